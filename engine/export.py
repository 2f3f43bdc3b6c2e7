"""Writing Hugging Face directories atomically: a killed run never leaves a model
directory that looks finished."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from torch import nn
from transformers import PreTrainedTokenizerBase

from engine.lora import merged


def atomic_directory(final: Path, write) -> Path:
    """Call `write(tmp_dir)`, then move tmp_dir to `final`, replacing what was there."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)   # a failed write leaves nothing behind
        raise
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        final.rename(old)
        try:
            tmp.rename(final)
        except BaseException:
            old.rename(final)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


def save_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    """Save `model` (LoRA merged in place) and `tokenizer` as a plain HF directory with
    model.safetensors, loadable by `from_pretrained` without this project."""
    plain = merged(model)

    def write(tmp: Path) -> None:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    return atomic_directory(out_dir, write)
