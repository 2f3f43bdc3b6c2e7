"""Generation straight from a quantized base: the inference decoder's projections keep the
frozen weights as the INT8/INT4 payloads and scales of engine/quantized_base.py, and LoRA
as its own low-rank path beside them. No full-precision copy of the model exists at any
point, so the rollout costs the quantized base's bytes a second time, not the model's
full size (140 GB at 70B in bf16, 37 GB in INT4).

  y = x @ dequantize(q, s)^T + b + (x @ A^T) @ B^T

A fused projection (Q, K and V; gate and up) concatenates its sources' rows: payloads and
scales row by row, LoRA side by side. Its A stacks the sources' A matrices and its B is
block-diagonal, each source's B (times its scaling) in its own rows and rank columns, so
that every output row sees only its own source's adapter. On CUDA the first term is one
Triton kernel that dequantizes in registers (engine/kernels.quantized_linear); elsewhere
the weight is dequantized for the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import nn

from engine import kernels
from engine.quantized_base import QuantizedEmbedding, QuantizedLinear, dequantize_weight


class QuantizedSlot(NamedTuple):
    """How an inference weight is held quantized: its sources' bits and block, and the
    total rank of their active LoRA adapters (0: none)."""

    bits: int
    block: int
    rank: int


def _frozen(shape, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantizedProjection(nn.Module):
    """A frozen linear [out, in] held as integers and scales, plus a low-rank LoRA path."""

    def __init__(self, out_features: int, in_features: int, slot: QuantizedSlot, bias: bool,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        per_byte = 2 if slot.bits == 4 else 1
        self.weight = _frozen((out_features, in_features // per_byte),
                              torch.int8 if slot.bits == 8 else torch.uint8, device)
        self.weight_scale = _frozen((out_features, in_features // slot.block), dtype, device)
        self.bias = _frozen(out_features, dtype, device) if bias else None
        self.lora_A = _frozen((slot.rank, in_features), dtype, device) if slot.rank else None
        self.lora_B = _frozen((out_features, slot.rank), dtype, device) if slot.rank else None
        self.fused = False   # the Triton kernel (CUDA; Triton's interpreter in tests)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = kernels.quantized_linear if self.fused else kernels.quantized_linear_reference
        y = linear(x, self.weight, self.weight_scale, self.bias)
        if self.lora_A is None:
            return y
        return y + F.linear(F.linear(x, self.lora_A), self.lora_B)


class QuantizedTable(nn.Module):
    """A frozen embedding table held quantized; a lookup dequantizes only its rows."""

    def __init__(self, rows: int, width: int, slot: QuantizedSlot, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        per_byte = 2 if slot.bits == 4 else 1
        self.weight = _frozen((rows, width // per_byte),
                              torch.int8 if slot.bits == 8 else torch.uint8, device)
        self.weight_scale = _frozen((rows, width // slot.block), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return dequantize_weight(F.embedding(ids, self.weight), F.embedding(ids, self.weight_scale))


def quantized_module(shape: torch.Size, slot: QuantizedSlot, bias: bool, table: bool,
                     dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The quantized inference module for a weight of full `shape` ([out, in] or [rows,
    width]), its storage allocated and unset."""
    if table:
        return QuantizedTable(shape[0], shape[1], slot, dtype, device)
    return QuantizedProjection(shape[0], shape[1], slot, bias, dtype, device)


def _adapters(owner: nn.Module) -> list[str]:
    """The active LoRA adapters of a peft layer (none for a plain module)."""
    if not isinstance(owner, LoraLayer) or owner.merged or owner.disable_adapters:
        return []
    return [a for a in owner.active_adapters if a in owner.lora_A]


def slot_for(layers: list[tuple[nn.Module, nn.Module]]) -> QuantizedSlot | None:
    """The slot of an inference weight whose sources are `layers` ((owner, base) pairs: the
    peft layer or plain module, and its base module), or None when it cannot be held
    quantized: a source in full precision, mixed bits or blocks, an adapter on an embedding
    or one that is not a plain low-rank product (DoRA). These keep the dense copy."""
    bases = [base for _, base in layers]
    if not all(isinstance(b, QuantizedLinear) for b in bases) and not (
            len(bases) == 1 and isinstance(bases[0], QuantizedEmbedding)):
        return None
    if len({(b.bits, b.block) for b in bases}) > 1:
        return None
    rank = 0
    for owner, base in layers:
        if isinstance(base, QuantizedEmbedding) and isinstance(owner, LoraLayer):
            return None
        for adapter in _adapters(owner):
            if owner.use_dora.get(adapter, False):
                return None
            rank += owner.lora_A[adapter].weight.shape[0]
    return QuantizedSlot(bases[0].bits, bases[0].block, rank)


def fill_quantized(module: nn.Module, layers: list[tuple[nn.Module, nn.Module]],
                   transforms: list[Callable[[torch.Tensor], torch.Tensor] | None]) -> None:
    """Copy the sources' payloads and scales into `module` row block by row block (each
    through its row transform, if any), their adapters' A side by side and B (times the
    adapter's scaling) block-diagonally. Sources must be whole (gathered)."""
    rows = cols = 0
    if getattr(module, "lora_A", None) is not None:   # adapters since disabled add nothing
        module.lora_A.zero_()
        module.lora_B.zero_()
    for (owner, base), transform in zip(layers, transforms, strict=True):
        same = transform or (lambda t: t)
        payload = same(base.weight)
        module.weight[rows:rows + payload.shape[0]].copy_(payload)
        module.weight_scale[rows:rows + payload.shape[0]].copy_(same(base.weight_scale))
        for adapter in _adapters(owner):
            a = owner.lora_A[adapter].weight
            b = same(owner.lora_B[adapter].weight) * owner.scaling[adapter]
            module.lora_A[cols:cols + a.shape[0]].copy_(a)
            module.lora_B[rows:rows + b.shape[0], cols:cols + a.shape[0]].copy_(b)
            cols += a.shape[0]
        rows += payload.shape[0]
