"""Writing Hugging Face directories atomically: a killed run never leaves a model
directory that looks finished. A sharded model is gathered to rank 0 one parameter at a
time (each all-gathered, moved to the CPU, then freed on the device), so the device never
holds more than one full layer beyond its shards."""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from pathlib import Path

import torch
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from engine.lora import merged, peft_quietly
from engine.parallel import hf_model, resharded
from engine.quantized_base import QUANTIZED, dequantize_state_dict, effective_shape
from engine.runtime import Runtime


def atomic_directory(final: Path, write) -> Path:
    """Call `write(tmp_dir)`, then move tmp_dir to `final`, replacing what was there."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # what a killed write left (a model's worth of disk each), whichever process it was: an
    # unfinished copy, or a replaced model it was deleting; killed between its two renames,
    # the replaced model is whole and the only one: put back
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in sorted(final.parent.glob(f".{final.name}.old-*")):
        if final.exists():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.rename(final)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
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


def plain_class(model: PreTrainedModel) -> type[PreTrainedModel]:
    """The transformers class under FSDP2's generated `FSDP<Model>` subclass."""
    return next(c for c in type(model).__mro__
                if issubclass(c, PreTrainedModel) and not issubclass(c, FSDPModule))


def full_copy(model: nn.Module, rt: Runtime) -> PreTrainedModel | None:
    """A plain CPU copy of `model` with full weights and LoRA merged in, on rank 0 (None on
    the others). Collective when the model is sharded; the live model is left untouched."""
    full = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    if not rt.is_main:
        return None
    inner = hf_model(model)
    with torch.device("meta"):
        copy = plain_class(inner)(inner.config)
    if isinstance(model, PeftModel):
        # a copy of the config: peft renames its base to the meta copy's (none), which a
        # later adapter export of the live model would write
        config = dataclasses.replace(model.peft_config[model.active_adapter])
        copy.name_or_path = inner.name_or_path
        with peft_quietly():
            copy = get_peft_model(copy, config)
    # what shares storage with the live model (a CPU model's state, replicated at ZeRO-0 on
    # any number of ranks) is copied before merging, or the merge would add LoRA into the
    # live base; a gathered or offloaded tensor is new already, not copied a second time
    live = _storages(model)
    full = {k: v.detach().clone() if v.untyped_storage().data_ptr() in live
            else v.detach().cpu() for k, v in full.items()}
    quantized = any(k.endswith(".weight_scale") for k in full)
    if quantized:   # LoRA merges into the dequantized base, in fp32
        full = dequantize_state_dict(full, torch.float32)
    elif isinstance(model, PeftModel):   # and into a frozen bf16 base in fp32 too: merged in
        # bf16, the adapters' small delta was rounded away (8% of q_proj's at B ~ 1e-3)
        full = {k: v.float() if v.is_floating_point() else v for k, v in full.items()}
    copy.load_state_dict(full, strict=False, assign=True)
    # each key assigned its own copy: tie the head to the embeddings again before merging,
    # or peft's merge finds them apart and unties the config (a second vocab x hidden table)
    (copy.get_base_model() if isinstance(copy, PeftModel) else copy).tie_weights()
    # written in fp32 as merged: cast to bf16, a LoRA delta below half a bf16 step of its
    # base weight (B ~ 1e-4 over an INT8 base: 60% of its entries) was rounded away
    copy = merged(copy)
    copy.tie_weights()
    meta = [name for name, t in copy.state_dict().items() if t.is_meta]
    if meta:
        raise RuntimeError(f"export left weights unset: {meta[:3]}")
    return copy.eval()


def _storages(model: nn.Module) -> set[int]:
    """Data pointers of the storages behind `model`'s state (each rank's local shards)."""
    tensors = [t.to_local() if isinstance(t, DTensor) else t
               for t in model.state_dict().values() if torch.is_tensor(t)]
    return {t.untyped_storage().data_ptr() for t in tensors if not t.is_meta}


def save_hf(model: nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: Path,
            rt: Runtime, config: dict | None = None) -> Path:
    """Save `model` (LoRA merged) and `tokenizer` as a plain HF directory with
    model.safetensors, loadable by `from_pretrained` without this project, its config.json
    with the `config` fields added. Collective: every rank calls it; rank 0 writes."""
    plain = full_copy(model, rt)
    if plain is not None:
        plain.config = copy.deepcopy(plain.config)   # not the live model's, which stays
        plain.config.update(config or {})

        def write(tmp: Path) -> None:
            plain.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)

        atomic_directory(out_dir, write)
    rt.barrier()
    return Path(out_dir)


def save_adapter(model: PeftModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path,
                 rt: Runtime) -> Path:
    """Save `model`'s LoRA adapter alone (peft's adapter_model.safetensors and
    adapter_config.json, for `PeftModel.from_pretrained` over the base it names) and
    `tokenizer`: for a frozen base too big to write out merged (a 70B merged is 140 GB of
    bf16, and its fp32 merge would not fit the host). Collective: every rank gathers the
    adapter's parameters (a few MB); rank 0 writes."""
    trained = {name: p for name, p in resharded(model).named_parameters() if p.requires_grad}
    # save_embedding_layers off: "auto" asks the hub whether the base's vocabulary changed
    adapter = get_peft_model_state_dict(model, state_dict=trained,
                                        adapter_name=model.active_adapter,
                                        save_embedding_layers=False)
    if len(adapter) != len(trained):   # check_settings refuses such runs before step 1
        raise RuntimeError("an adapter export would drop trained base weights")
    full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().to("cpu", copy=True)
            for k, v in adapter.items()}
    if rt.is_main:
        def write(tmp: Path) -> None:
            save_file({k: v.contiguous() for k, v in full.items()},
                      str(tmp / "adapter_model.safetensors"))
            # with its task, so peft's AutoPeftModelFor* find the base's class
            config = copy.copy(model.peft_config[model.active_adapter])
            config.task_type = "SEQ_CLS" if hasattr(hf_model(model), "score") else "CAUSAL_LM"
            config.inference_mode = True
            config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

        atomic_directory(out_dir, write)
    rt.barrier()
    return Path(out_dir)


def merged_export_size(model: nn.Module) -> tuple[int, int]:
    """(host bytes, disk bytes) that writing `model` merged (save_hf) takes at the least:
    every weight on the CPU in fp32 (where LoRA merges; a quantized base is dequantized to
    take it), then written in fp32. Counted from full shapes: sharded or quantized alike."""
    values, seen = 0, set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:   # tied weights are written once
                continue
            seen.add(id(param))
            if isinstance(module, QUANTIZED) and name in ("weight", "weight_scale"):
                values += effective_shape(module).numel() if name == "weight" else 0
            else:
                values += param.numel()
    return values * 4, values * 4


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
