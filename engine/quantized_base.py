"""LoRA over a frozen, quantized base: DeepSpeed's MixZ++ (`zero_quantized_nontrainable_weights`)
on FSDP2.

The frozen linears and embeddings of a LoRA model are stored as integers, INT8 or INT4
(two to a byte, engine/quantize.py's nibble layout), with one scale per group of `block`
consecutive values of a row. The scales are kept in the compute dtype, so FSDP2's mixed
precision leaves them as they are. Both are ordinary frozen `nn.Parameter`s: FSDP2 shards
them and all-gathers them in this form (a unit that mixes int8 and float parameters is
gathered as bytes), and they are dequantized only inside forward and backward. peft wraps
a `QuantizedLinear` like any `nn.Linear`, so only the adapters train.

  scale = absmax(group) / qmax, rounded to the scale dtype        qmax = 127 (8 bits), 7 (4)
          (up where it is subnormal: fp16's below 6.1e-5)
  q     = clamp(round(w / scale), -qmax, qmax)
  |w - q * scale| <= scale / 2      (rounding the scale down moves absmax by at most
                                     2^-9 of it in bf16, less than half a step)

`build_quantized` builds the model on the meta device, then fills it one module at a time
(from safetensors, or a preset's random init) and quantizes each module as it is filled:
at most one module's full-precision weights exist at once, on the host or on the device.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

from engine import kernels
from engine.config import QuantizedBaseConfig
from engine.errors import UserError
from engine.quantize import QMAX, pack_int4, unpack_int4
from engine.runtime import memory_peak, reset_memory_peak

_CHUNK = 1 << 24   # values quantized at once: bounds the fp32 temporaries of a big embedding


def quantize_weight(w: torch.Tensor, bits: int, block: int, scale_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] float, C a multiple of `block` -> (payload int8 [..., C] or uint8
    [..., C / 2] for 4 bits, scales [..., C / block] of `scale_dtype`)."""
    qmax = QMAX[bits]
    payloads, scales = [], []
    rows = w.reshape(-1, w.shape[-1])
    for part in rows.split(max(1, _CHUNK // w.shape[-1])):
        groups = part.float().unflatten(-1, (-1, block))
        scale = _rounded_up_if_subnormal(groups.abs().amax(-1) / qmax, scale_dtype)
        s = scale.float().unsqueeze(-1)
        q = torch.where(s > 0, groups / torch.where(s > 0, s, 1.0), 0.0)
        q = q.round_().clamp_(-qmax, qmax).flatten(-2)
        payloads.append(q.to(torch.int8) if bits == 8 else pack_int4(q))
        scales.append(scale)
    payload, scale = torch.cat(payloads), torch.cat(scales)
    return payload.view(*w.shape[:-1], -1), scale.view(*w.shape[:-1], -1)


def _rounded_up_if_subnormal(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scales in `dtype`; a subnormal one (fp16's below 6.1e-5) rounded up, not to
    nearest: to nearest it could lose up to half its value (1e-6 groups came out 24 steps
    off, and all zero a decade lower), and |w / scale| past qmax broke the bound above."""
    rounded = scale.to(dtype)
    low = (rounded.float() < scale) & (scale < torch.finfo(dtype).tiny)
    return torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)),
                       rounded)


def dequantize_weight(payload: torch.Tensor, scales: torch.Tensor,
                      dtype: torch.dtype | None = None) -> torch.Tensor:
    """The inverse: payload [..., C] int8 or [..., C / 2] uint8 (4 bits), scales
    [..., C / block] -> [..., C] of `dtype` (default: the scales'), q * scale in it."""
    dtype = dtype or scales.dtype
    q = payload if payload.dtype == torch.int8 else unpack_int4(payload)
    q = q.unflatten(-1, (scales.shape[-1], -1)).to(dtype)
    return (q * scales.to(dtype).unsqueeze(-1)).flatten(-2)


def _dequantized(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
                 ) -> torch.Tensor:
    """dequantize_weight's values; on a GPU one kernel that reads each integer once and
    writes each value once (engine.kernels.dequantize), not a chain of unpack, cast and
    multiply passes: a 70B base is dequantized some 20 times a step-3 iteration."""
    if payload.is_cuda and kernels.triton_available():
        return kernels.dequantize(payload.contiguous(), scales.contiguous(), dtype)
    return dequantize_weight(payload, scales, dtype)


class _DequantizedLinear(torch.autograd.Function):
    """y = x @ dequantize(W).T + b, saving the quantized W (not a dequantized copy) for
    backward: under FSDP2 that is the gathered parameter, freed after forward and gathered
    again for backward like any weight."""

    @staticmethod
    def forward(ctx, x, payload, scales, bias):
        ctx.save_for_backward(payload, scales)
        return F.linear(x, _dequantized(payload, scales, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        payload, scales = ctx.saved_tensors
        return grad_out @ _dequantized(payload, scales, grad_out.dtype), None, None, None


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantizedLinear(nn.Linear):
    """A frozen nn.Linear whose weight is a quantized payload plus scales."""

    def __init__(self, linear: nn.Linear, bits: int, block: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bits, self.block = bits, block
        payload, scales = quantize_weight(linear.weight.detach(), bits, block, dtype)
        self.weight, self.weight_scale = _frozen(payload), _frozen(scales)
        bias = linear.bias
        self.bias = None if bias is None else _frozen(bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantizedLinear.apply(x, self.weight, self.weight_scale, self.bias)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full weight [out, in] the forward pass uses."""
        return _dequantized(self.weight, self.weight_scale, dtype or self.weight_scale.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int{self.bits}, block={self.block}"


class QuantizedEmbedding(nn.Embedding):
    """A frozen nn.Embedding whose table is quantized; a lookup dequantizes only its rows."""

    def __init__(self, embedding: nn.Embedding, bits: int, block: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = embedding.padding_idx, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.bits, self.block = bits, block
        payload, scales = quantize_weight(embedding.weight.detach(), bits, block, dtype)
        self.weight, self.weight_scale = _frozen(payload), _frozen(scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_weight(F.embedding(ids, self.weight), F.embedding(ids, self.weight_scale))

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_weight(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int{self.bits}, block={self.block}"


QUANTIZED = (QuantizedLinear, QuantizedEmbedding)
_KINDS = {nn.Linear: QuantizedLinear, nn.Embedding: QuantizedEmbedding}


def effective_weight(module: nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A module's weight as forward uses it: dequantized for a quantized module."""
    return module.dequantized(dtype) if isinstance(module, QUANTIZED) else module.weight


def effective_shape(module: nn.Module) -> torch.Size:
    """The full shape of that weight, sharded or not (a DTensor reports its full shape)."""
    if isinstance(module, QUANTIZED):   # rows x values per row, from the scales' rows
        return torch.Size((module.weight_scale.shape[0], module.weight_scale.shape[1]
                           * module.block))
    return module.weight.shape


def dequantize_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype
                          ) -> dict[str, torch.Tensor]:
    """A state dict with every quantized `X.weight` (+ `X.weight_scale`) replaced by the
    dequantized `X.weight` of `dtype`: what a plain model of the same class loads."""
    out = dict(state)
    for key in [k for k in state if k.endswith(".weight_scale")]:
        weight = key.removesuffix("_scale")
        out[weight] = dequantize_weight(out[weight], out.pop(key), dtype)
    return out


def _tied(model: PreTrainedModel) -> set[nn.Module]:
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is not None and outputs is not None and outputs.weight is inputs.weight:
        return {inputs, outputs}
    return set()


def _why_not(module: nn.Module, name: str, block: int, bits: int, tied: set[nn.Module]
             ) -> str | None:
    """Why the frozen Linear/Embedding `module` stays in full precision, or None if it can
    be quantized."""
    if name.rsplit(".", 1)[-1] == "score":
        return "trained head"
    if module in tied:
        return "tied input/output embeddings"
    width = module.weight.shape[-1]
    if width % block or (bits == 4 and block % 2):
        return f"rows of {width} values are not a multiple of the block {block}"
    return None


class QuantizeReport(NamedTuple):
    quantized: int                    # modules now stored as integers
    kept: Counter                     # reason -> modules with weights left in full precision
    bytes_before: int                 # their weights in the compute dtype
    bytes_after: int                  # payloads + scales


def quantize_modules(model: PreTrainedModel, settings: QuantizedBaseConfig,
                     dtype: torch.dtype, modules: list[str] | None = None,
                     tied: set[nn.Module] | None = None) -> QuantizeReport:
    """Replace the Linear and Embedding modules of `model` (all, or those named) by their
    quantized forms in place, scales in `dtype`. Skipped, and counted by reason: the
    `score` head, tied embeddings (`tied`, default: as the model has them now), rows not a
    multiple of the block, other kinds."""
    tied = _tied(model) if tied is None else tied
    quantized, before, after, kept = 0, 0, 0, Counter()
    for name in modules if modules is not None else [n for n, _ in model.named_modules()]:
        module = model.get_submodule(name)
        if type(module) not in _KINDS:
            weight = getattr(module, "weight", None)
            if module in tied:   # Gemma's scaled embedding, tied to its head
                kept["tied input/output embeddings"] += 1
            elif isinstance(module, tuple(_KINDS)):   # its own forward or users would break
                kind = next(k.__name__ for k in _KINDS if isinstance(module, k))
                kept[f"{type(module).__name__} layers (a subclass of {kind}: only plain "
                     "Linear and Embedding are quantized)"] += 1
            elif isinstance(weight, nn.Parameter) and weight.dim() == 2:   # GPT-2's Conv1D
                kept[f"{type(module).__name__} layers (only Linear and Embedding are "
                     "quantized)"] += 1
            continue
        why = _why_not(module, name, settings.block, settings.bits, tied)
        if why:
            kept[why] += 1
            continue
        replacement = _KINDS[type(module)](module, settings.bits, settings.block, dtype)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, replacement)
        quantized += 1
        before += module.weight.numel() * torch.finfo(dtype).bits // 8
        after += sum(p.numel() * p.element_size()
                     for p in (replacement.weight, replacement.weight_scale))
    return QuantizeReport(quantized, kept, before, after)


# -- loading one module at a time -----------------------------------------------------------

class _Safetensors:
    """The tensors of a directory's *.safetensors files, by the model's parameter names:
    checkpoint keys renamed as from_pretrained renames them (transformers' conversion
    mapping for the model, e.g. GPT-NeoX's `embed_out` -> `lm_head`; the base prefix added
    or dropped). Keys transformers would convert (merge, split: MoE experts) are refused:
    this loader reads one tensor per parameter."""

    def __init__(self, directory: Path, model: PreTrainedModel):
        files = sorted(Path(directory).glob("*.safetensors"))
        if not files:
            raise UserError(f"{directory}: no *.safetensors weights; the quantized base "
                            "(engine.quantized_base) loads safetensors checkpoints only: "
                            "re-save the model with save_pretrained(safe_serialization=True)")
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        expected = model.state_dict()
        self.where: dict[str, tuple[Path, str]] = {}
        for file in files:
            with safe_open(file, "pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - a safe_open handle, not a dict
                    name, converted = rename_source_key(key, renamings, converters,
                                                        model.base_model_prefix, expected)
                    if converted is not None:
                        raise UserError(
                            f"{directory}: {key} is stored in a layout transformers converts "
                            f"while loading ({converted}); the quantized base "
                            "(engine.quantized_base) reads one tensor per weight: load this "
                            "model without it")
                    if name in expected:
                        self.where[name] = (file, key)

    def get(self, name: str) -> torch.Tensor | None:
        if name not in self.where:
            return None
        file, key = self.where[name]
        with safe_open(file, "pt") as handle:
            return handle.get_tensor(key)


class LoadReport(NamedTuple):
    quantize: QuantizeReport
    new_weights: list[str]           # not in the checkpoint: freshly initialised
    host_peak: int                   # bytes: the process's resident peak while loading
    device_peak: int                 # bytes: CUDA allocator peak while loading (0 on CPU)
    seconds: float


def build_quantized(auto_cls, config: PretrainedConfig, settings: QuantizedBaseConfig, *,
                   dtype: torch.dtype, head_dtype: torch.dtype, device: torch.device,
                   checkpoint: Path | None = None, seed: int = 0
                   ) -> tuple[PreTrainedModel, LoadReport]:
    """`auto_cls` model of `config` with frozen weights in `dtype`, Linear/Embedding weights
    quantized (see quantize_modules), a `score` head in `head_dtype`, on `device`. Weights
    come from `checkpoint` (a directory of safetensors); those it lacks (all, without one)
    are initialised as the model class does, from `seed`."""
    start, cuda = time.perf_counter(), device.type == "cuda"
    reset_memory_peak(torch.device("cpu"))
    if cuda:
        reset_memory_peak(device)
    with torch.device("meta"):
        model = auto_cls.from_config(config, dtype=dtype)
    expected = set(model.state_dict())
    reader = _Safetensors(checkpoint, model) if checkpoint else None
    tied, new, total = _tied(model), [], QuantizeReport(0, Counter(), 0, 0)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name in [name for name, _ in model.named_modules()]:
            # by name, not a list of modules: that would keep every replaced module's
            # full-precision weight alive until the end (140 GB at 70B)
            module = model.get_submodule(name)
            if module in tied and module is model.get_output_embeddings():
                continue   # the input embedding's weight, tied again below
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            if not own:
                continue
            module.to_empty(device=device, recurse=False)
            prefix = f"{name}." if name else ""
            loaded = {attr: reader.get(prefix + attr) if reader else None for attr, _ in own}
            if any(v is None for v in loaded.values()):
                model._init_weights(module)
                new += [prefix + a for a, v in loaded.items()
                        if v is None and prefix + a in expected and reader]
            is_head = name.rsplit(".", 1)[-1] == "score"
            for attr, value in [*module.named_parameters(recurse=False),
                                *module.named_buffers(recurse=False)]:
                if loaded[attr] is not None:
                    value.copy_(loaded[attr])
                if value.is_floating_point() and attr in module._parameters:
                    module._parameters[attr] = nn.Parameter(
                        value.to(head_dtype if is_head else dtype), value.requires_grad)
            report = quantize_modules(model, settings, dtype, [name], tied)
            total = QuantizeReport(total.quantized + report.quantized, total.kept + report.kept,
                                   total.bytes_before + report.bytes_before,
                                   total.bytes_after + report.bytes_after)
    model.tie_weights()
    device_peak = memory_peak(device) if cuda else 0
    return model.eval(), LoadReport(total, new, memory_peak(torch.device("cpu")), device_peak,
                                    time.perf_counter() - start)


def describe(report: LoadReport, what: str, settings: QuantizedBaseConfig) -> str:
    """One line on what loading did, for the run's log."""
    q, MiB = report.quantize, 2**20
    kept = ", ".join(f"{n} {why}" for why, n in q.kept.items())
    ratio = q.bytes_after / q.bytes_before if q.bytes_before else 0.0
    line = (f"quantized base: {what}: {q.quantized} modules as int{settings.bits} (block "
            f"{settings.block}), {q.bytes_before / MiB:.1f} -> {q.bytes_after / MiB:.1f} MiB "
            f"({ratio:.2f}x){'; kept in full precision: ' + kept if kept else ''}; loading "
            f"peak: host {report.host_peak / MiB:.0f} MiB resident")
    if report.device_peak:
        line += f", device {report.device_peak / MiB:.0f} MiB"
    if report.new_weights:
        line += f"; newly initialised: {', '.join(report.new_weights[:4])}" + (
            f" (+{len(report.new_weights) - 4})" * (len(report.new_weights) > 4))
    return line + f" ({report.seconds:.1f} s)"

