"""Generation straight from a quantized base: the inference decoder's projections keep the
frozen weights as the INT8/INT4 payloads and scales of engine/quantized_base.py, and LoRA
as its own low-rank path beside them. No full-precision copy of the model exists at any
point (140 GB at 70B in bf16; the INT4 base is 37 GB).

  y = x @ dequantize(q, s)^T + b + (x @ A^T) @ B^T

Where the base is whole on this device (one process without sharding: the usual one-GPU
run), the inference form uses the training form's own integers in place and adds only
LoRA's factors; under sharding it holds a gathered copy of them, the quantized base's size
once more. A copied fused projection (Q, K and V; gate and up) stacks its sources' payload
and scale rows; a shared one runs one matmul per source, each into its columns of the
output. LoRA is fused either way: A stacks the sources' A matrices and B is
block-diagonal, each source's B (times its scaling) in its own rows and rank columns, so
that every output row sees only its own source's adapter. On CUDA each matmul is one
Triton kernel that dequantizes in registers, a decode step's with the bias and LoRA's B
in its epilogue (engine/kernels.quantized_projection); elsewhere the weight is
dequantized for the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor

from engine import kernels
from engine.lora import active_adapters
from engine.quantized_base import QuantizedEmbedding, QuantizedLinear, dequantize_weight
from engine.runtime import on_device


class QuantizedSlot(NamedTuple):
    """How an inference weight is held quantized: its sources' bits and block, the total
    rank of their active LoRA adapters (0: none), and whether it uses the sources' own
    integers in place (`shared`: they are whole on this device) or a copy of them."""

    bits: int
    block: int
    rank: int
    shared: bool = False


def _frozen(shape, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Integers(nn.Module):
    """A frozen matrix [rows, width] as integers and scales: its own copy (`weight`,
    `weight_scale`), or, for a shared slot, the sources' own tensors (`parts`, one
    (payload, scales) per source, set by fill_quantized; no storage of its own)."""

    def __init__(self, rows: int, width: int, slot: QuantizedSlot, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        per_byte = 2 if slot.bits == 4 else 1
        self.weight = self.weight_scale = None
        if not slot.shared:
            self.weight = _frozen((rows, width // per_byte),
                                  torch.int8 if slot.bits == 8 else torch.uint8, device)
            self.weight_scale = _frozen((rows, width // slot.block), dtype, device)
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []

    def integer_parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.parts if self.weight is None else [(self.weight, self.weight_scale)]


class QuantizedProjection(_Integers):
    """A frozen linear [out, in] held as integers and scales, plus a low-rank LoRA path.
    A shared fused projection runs one matmul per source into its columns of the output
    (engine.kernels.quantized_projection)."""

    def __init__(self, out_features: int, in_features: int, slot: QuantizedSlot, bias: bool,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(out_features, in_features, slot, dtype, device)
        self.bias = _frozen(out_features, dtype, device) if bias else None
        self.lora_A = _frozen((slot.rank, in_features), dtype, device) if slot.rank else None
        self.lora_B = _frozen((out_features, slot.rank), dtype, device) if slot.rank else None
        self.fused = False   # the Triton kernel (CUDA; Triton's interpreter in tests)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        project = (kernels.quantized_projection if self.fused else
                   kernels.quantized_projection_reference)
        lora = None if self.lora_A is None else kernels.LowRank(self.lora_A, self.lora_B)
        return project(x, self.integer_parts(), self.bias, lora)


class QuantizedTable(_Integers):
    """A frozen embedding table held quantized; a lookup dequantizes only its rows."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        (payload, scales), = self.integer_parts()
        return dequantize_weight(F.embedding(ids, payload), F.embedding(ids, scales))


def quantized_module(shape: torch.Size, slot: QuantizedSlot, bias: bool, table: bool,
                     dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The quantized inference module for a weight of full `shape` ([out, in] or [rows,
    width]), its storage allocated (none for the integers of a shared slot) and unset."""
    if table:
        return QuantizedTable(shape[0], shape[1], slot, dtype, device)
    return QuantizedProjection(shape[0], shape[1], slot, bias, dtype, device)


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
        for adapter in active_adapters(owner):
            if owner.use_dora.get(adapter, False):
                return None
            rank += owner.lora_A[adapter].weight.shape[0]
    return QuantizedSlot(bases[0].bits, bases[0].block, rank)


def shareable(layers: list[tuple[nn.Module, nn.Module]],
              transforms: list[Callable[[torch.Tensor], torch.Tensor] | None],
              device: torch.device, sharded: bool) -> bool:
    """True when the inference form can use the sources' integers in place: the model is
    not sharded (FSDP frees and swaps the tensors a module shows, even a unit it leaves
    gathered between forwards), each is a whole tensor on `device`, and none needs a row
    transform."""
    return not sharded and all(transform is None for transform in transforms) and all(
        not isinstance(t, DTensor) and on_device(t, device)
        for _, base in layers for t in (base.weight, base.weight_scale))


def fill_quantized(module: _Integers, layers: list[tuple[nn.Module, nn.Module]],
                   transforms: list[Callable[[torch.Tensor], torch.Tensor] | None]) -> None:
    """Point a shared `module` at the sources' payloads and scales, or copy them into it
    row block by row block (each through its row transform, if any); their adapters' A
    side by side and B (times the adapter's scaling) block-diagonally. Sources must be
    whole (gathered)."""
    shared = module.weight is None
    if shared:
        module.parts = [(base.weight, base.weight_scale) for _, base in layers]
    rows = cols = 0
    if getattr(module, "lora_A", None) is not None:   # adapters since disabled add nothing
        module.lora_A.zero_()
        module.lora_B.zero_()
    for (owner, base), transform in zip(layers, transforms, strict=True):
        same = transform or (lambda t: t)
        n = base.weight_scale.shape[0]
        if not shared:
            module.weight[rows:rows + n].copy_(same(base.weight))
            module.weight_scale[rows:rows + n].copy_(same(base.weight_scale))
        for adapter in active_adapters(owner):
            a = owner.lora_A[adapter].weight
            b = same(owner.lora_B[adapter].weight) * owner.scaling[adapter]
            module.lora_A[cols:cols + a.shape[0]].copy_(a)
            module.lora_B[rows:rows + n, cols:cols + a.shape[0]].copy_(b)
            cols += a.shape[0]
        rows += n
