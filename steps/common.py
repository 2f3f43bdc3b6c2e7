"""What the three steps share: step directories, config snapshots, progress bars,
batching, and the demo's ground-truth evaluation."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from engine.engine import OptimSettings
from engine.lora import LoraSettings
from steps import demo
from steps.data import DataError, TokenizeStats


def step_dir(cfg: DictConfig, step: int) -> Path:
    """Where step `step` writes its resolved config and metrics.jsonl."""
    return Path(cfg.output_dir) / f"step{step}"


def start_step(cfg: DictConfig, step: int) -> Path:
    directory = step_dir(cfg, step)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "metrics.jsonl").unlink(missing_ok=True)
    (directory / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return directory


def log(message: str) -> None:
    tqdm.write(message)


def report_tokenized(what: str, stats: TokenizeStats, max_prompt_len: int,
                     max_answer_len: int | None = None) -> None:
    """Say how many examples were kept, dropped and truncated: nothing vanishes silently."""
    parts = [f"{what}: {stats.kept} examples"]
    if stats.dropped_long_prompt:
        parts.append(f"{stats.dropped_long_prompt} dropped (prompt > data.max_prompt_len="
                     f"{max_prompt_len} tokens)")
    if stats.truncated_answer:
        parts.append(f"{stats.truncated_answer} answers cut to data.max_answer_len="
                     f"{max_answer_len} tokens")
    log(", ".join(parts))


def require_examples(step: int, what: str, stats: TokenizeStats, max_prompt_len: int) -> None:
    """Stop a step that filtering left with nothing to train on, saying why."""
    if stats.kept == 0:
        total = stats.kept + stats.dropped_long_prompt
        raise DataError(f"step {step} has no {what} after filtering: "
                        f"{stats.dropped_long_prompt} of {total} prompts are longer than "
                        f"data.max_prompt_len={max_prompt_len} tokens; add data or raise it")


def progress(iterable: Iterable, *, desc: str, total: int | None = None,
             enabled: bool = True) -> Iterator:
    return iter(tqdm(iterable, desc=desc, total=total, disable=not enabled, leave=False,
                     dynamic_ncols=True))


def batches(items: Sequence, batch_size: int, *, shuffle: bool, seed: int) -> Iterator[list]:
    """Consecutive batches of `items`, in a seeded order when shuffling."""
    order = list(range(len(items)))
    if shuffle:
        order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    for start in range(0, len(order), batch_size):
        yield [items[i] for i in order[start:start + batch_size]]


def num_batches(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def optim_settings(section: DictConfig, lr: float, lora: DictConfig) -> OptimSettings:
    return OptimSettings(
        lr=lr, weight_decay=section.weight_decay, lr_scheduler=section.lr_scheduler,
        warmup_steps=section.warmup_steps, grad_clip=section.grad_clip,
        grad_accum=section.get("grad_accum", 1), lora_lr=lora.learning_rate,
    )


def lora_settings(lora: DictConfig) -> LoraSettings:
    values = OmegaConf.to_container(lora, resolve=True)
    return LoraSettings(**values)


def ground_truth(prompts: Sequence[str], answers: Sequence[str]) -> float | None:
    """Mean demo ground-truth score over the demo prompts, None when there are none."""
    scored = [demo.score(p, a) for p, a in zip(prompts, answers, strict=True)
              if demo.rule_of(p) is not None]
    return sum(scored) / len(scored) if scored else None
