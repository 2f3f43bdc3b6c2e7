"""Block-wise symmetric quantization of flat tensors, for ZeRO++'s quantized collectives
(qwZ: the weight all-gather; qgZ: the gradient reduce-scatter).

A flat tensor of `numel` values (fp32, bf16 or fp16; numel a multiple of `block`) is cut
into blocks of `block` consecutive values. Each block gets one fp32 scale and integers:

  scale = absmax(block) / qmax              qmax = 127 (8 bits) or 7 (4 bits)
  q     = clamp(round(x * (qmax / absmax)), -qmax, qmax)     round: nearest, ties to even
  x'    = q * scale                          (computed in fp32, then cast to the dtype)

An all-zero block has scale 0 and q 0 (no NaN). The round trip's error is at most half a
step of the block's grid, elementwise:

  |x - dequantize(quantize(x))| <= scale / 2 = absmax / (2 * qmax)

up to fp32 rounding (at most qmax * 2^-22 of the scale, i.e. 3e-5 of it at 8 bits: the
reciprocal, the products and the scale are each rounded once), plus the output dtype's own
rounding when dequantizing to bf16/fp16.

Payloads: 8 bits: int8 [numel]. 4 bits: uint8 [numel // 2], values 2i and 2i+1 in the low
and high nibble of byte i, each stored as q + 8 (1..15). Inputs are expected finite.

The PyTorch functions (`*_reference`) run on CPU; on CUDA tensors `quantize` and
`dequantize` run fused Triton kernels (one pass each, engine/triton_quantize.py) that equal
the reference bit for bit. `pack_wire`/`unpack_wire` put payload and scales in one uint8
buffer, the thing a collective sends:

  [payload | pad to 16 | scales as fp32 bytes | pad to 16]     (wire_bytes long)

Every part and the total are multiples of 16 bytes, so buffers laid end to end (an
all-gather's output) keep their scales aligned and can be unpacked in place.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.kernels import triton_available

QMAX = {8: 127, 4: 7}
_WIRE_ALIGN = 16
_TILE = 4096            # values per Triton program (several blocks when block is small)


class QuantizedBlocks(NamedTuple):
    payload: torch.Tensor   # int8 [numel] (8 bits) or uint8 [numel // 2] (4 bits, packed)
    scales: torch.Tensor    # fp32 [numel // block], one per block
    bits: int
    block: int
    numel: int


def _check(numel: int, bits: int, block: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if block <= 0 or (bits == 4 and block % 2):
        raise ValueError(f"block must be positive{' and even for 4 bits' * (bits == 4)}, "
                         f"got {block}")
    if numel % block:
        raise ValueError(f"numel {numel} is not a multiple of the block size {block}: "
                         f"pad the tensor to {-(-numel // block) * block} values")


def _check_input(x: torch.Tensor, bits: int, block: int) -> None:
    if x.dim() != 1 or not x.is_contiguous() or not x.is_floating_point():
        raise ValueError(f"expected a flat contiguous float tensor, got {x.dtype} "
                         f"{tuple(x.shape)} (contiguous={x.is_contiguous()})")
    _check(x.numel(), bits, block)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _wire_layout(numel: int, bits: int, block: int) -> tuple[int, int, int]:
    """(payload bytes, offset of the scales, total bytes) of a wire buffer."""
    _check(numel, bits, block)
    payload = numel * bits // 8
    scales_at = _round_up(payload, _WIRE_ALIGN)
    return payload, scales_at, _round_up(scales_at + 4 * (numel // block), _WIRE_ALIGN)


def wire_bytes(numel: int, bits: int, block: int) -> int:
    """Size in bytes of the one-buffer form of `numel` values (see the module docstring)."""
    return _wire_layout(numel, bits, block)[2]


def unpack_wire(buf: torch.Tensor, bits: int, block: int, numel: int) -> QuantizedBlocks:
    """The QuantizedBlocks inside a wire buffer (uint8 [wire_bytes]); payload and scales are
    views of `buf`, not copies (the scales are copied only if `buf` starts misaligned)."""
    payload_bytes, scales_at, total = _wire_layout(numel, bits, block)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != total:
        raise ValueError(f"expected a uint8 buffer of {total} bytes, got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    payload = buf[:payload_bytes]
    scales = buf[scales_at:scales_at + 4 * (numel // block)]
    if (buf.storage_offset() + scales_at) % 4:
        scales = scales.clone()
    return QuantizedBlocks(payload.view(torch.int8) if bits == 8 else payload,
                           scales.view(torch.float32), bits, block, numel)


def _claim_wire(buf: torch.Tensor, bits: int, block: int, numel: int) -> QuantizedBlocks:
    """unpack_wire for writing: also zeroes the padding so equal data gives equal bytes."""
    payload_bytes, scales_at, _ = _wire_layout(numel, bits, block)
    if (buf.storage_offset() + scales_at) % 4:   # unpack_wire would copy the scales
        raise ValueError("quantize(out=): the buffer must start 4-byte aligned (offset "
                         f"{buf.storage_offset()}), or the scales land in a copy")
    q = unpack_wire(buf, bits, block, numel)
    buf[payload_bytes:scales_at].zero_()
    buf[scales_at + 4 * (numel // block):].zero_()
    return q


def pack_wire(q: QuantizedBlocks) -> torch.Tensor:
    """payload and scales copied into one uint8 buffer [wire_bytes] (`quantize(..., out=)`
    writes there directly, without this copy)."""
    buf = torch.empty(wire_bytes(q.numel, q.bits, q.block), dtype=torch.uint8,
                      device=q.payload.device)
    views = _claim_wire(buf, q.bits, q.block, q.numel)
    views.payload.copy_(q.payload)
    views.scales.copy_(q.scales)
    return buf


# -- the PyTorch formulas (CPU path, and what the kernels must equal) --------------------------

def quantize_reference(x: torch.Tensor, bits: int, block: int) -> QuantizedBlocks:
    """x: [numel] float -> QuantizedBlocks (payload [numel] int8 or [numel // 2] uint8,
    scales [numel // block] fp32)."""
    _check_input(x, bits, block)
    qmax = QMAX[bits]
    blocks = x.float().view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    # divisions of tensor by tensor: torch turns `number / tensor` and, on CUDA,
    # `tensor / number` into a multiplication by a rounded reciprocal, not what the kernel does
    qmaxes = torch.full_like(absmax, qmax)
    scales = absmax / qmaxes
    # multiply by the reciprocal rather than divide by the scale: what the kernel does too
    inverse = torch.where(absmax > 0, qmaxes / torch.where(absmax > 0, absmax, 1.0), 0.0)
    q = (blocks * inverse[:, None]).round_().clamp_(-qmax, qmax)
    payload = q.to(torch.int8).view(-1) if bits == 8 else pack_int4(q.view(-1))
    return QuantizedBlocks(payload, scales, bits, block, x.numel())


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-7, 7], [..., 2k] (any dtype) -> uint8 [..., k]: values 2i and 2i+1 in
    the low and high nibble of byte i, each stored as q + 8."""
    nibbles = (q + 8).to(torch.uint8).unflatten(-1, (-1, 2))
    return nibbles[..., 0] | (nibbles[..., 1] << 4)


def unpack_int4(payload: torch.Tensor) -> torch.Tensor:
    """uint8 [..., k] -> int8 [..., 2k], the inverse of pack_int4."""
    return (torch.stack((payload & 15, payload >> 4), dim=-1).flatten(-2).to(torch.int8) - 8)


def _integers(q: QuantizedBlocks) -> torch.Tensor:
    """The quantized integers [numel] as fp32 (the 4-bit payload unpacked)."""
    return (q.payload if q.bits == 8 else unpack_int4(q.payload)).float()


def dequantize_reference(q: QuantizedBlocks, dtype: torch.dtype = torch.float32
                         ) -> torch.Tensor:
    """QuantizedBlocks -> [numel] of `dtype` (q * scale in fp32, then cast)."""
    values = _integers(q).view(-1, q.block) * q.scales[:, None]
    return values.view(-1).to(dtype)


# -- Triton ---------------------------------------------------------------------------------

def _launch(module, n_blocks: int, block: int) -> tuple[tuple[int], dict]:
    width = module.triton.next_power_of_2(block)
    rows = max(1, _TILE // width)
    meta = dict(ROWS=rows, BLOCK=width, num_warps=4 if rows * width <= _TILE else 8)
    return (module.triton.cdiv(n_blocks, rows),), meta


def quantize_triton(x: torch.Tensor, bits: int, block: int,
                    out: torch.Tensor | None = None) -> QuantizedBlocks:
    """Fused `quantize_reference` (absmax, scale, round, pack in one pass); `out` as in
    `quantize`."""
    _check_input(x, bits, block)
    from engine import triton_quantize as module  # Triton, imported on first use
    numel, n_blocks = x.numel(), x.numel() // block
    if out is None:
        payload = torch.empty(numel * bits // 8, device=x.device,
                              dtype=torch.int8 if bits == 8 else torch.uint8)
        scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
        q = QuantizedBlocks(payload, scales, bits, block, numel)
    else:
        q = _claim_wire(out, bits, block, numel)
    grid, meta = _launch(module, n_blocks, block)
    module.quantize_kernel[grid](x, q.payload, q.scales, n_blocks, block, BITS=bits, **meta)
    return q


def dequantize_triton(q: QuantizedBlocks, dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `dequantize_reference` (one pass); `out` as in `dequantize`."""
    from engine import triton_quantize as module  # Triton, imported on first use
    if out is None:
        out = torch.empty(q.numel, dtype=dtype, device=q.payload.device)
    n_blocks = q.numel // q.block
    grid, meta = _launch(module, n_blocks, q.block)
    module.dequantize_kernel[grid](q.payload, q.scales, out, n_blocks, q.block, BITS=q.bits,
                                   OUT_BF16=out.dtype == torch.bfloat16, **meta)
    return out


# -- the entry points -------------------------------------------------------------------------

def _fused(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def quantize(x: torch.Tensor, bits: int = 8, block: int = 256,
             out: torch.Tensor | None = None) -> QuantizedBlocks:
    """x: flat contiguous [numel] fp32/bf16/fp16, numel a multiple of `block` (else
    ValueError; pad first). Returns payload (int8 [numel], or uint8 [numel // 2] for 4 bits)
    and fp32 scales [numel // block]. With `out` (uint8 [wire_bytes(numel, bits, block)],
    4-byte aligned)
    they are written into it, in the wire layout, and the result's tensors view it."""
    if _fused(x):
        return quantize_triton(x, bits, block, out)
    q = quantize_reference(x, bits, block)
    if out is None:
        return q
    views = _claim_wire(out, bits, block, q.numel)
    views.payload.copy_(q.payload)
    views.scales.copy_(q.scales)
    return views


def dequantize(q: QuantizedBlocks, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """QuantizedBlocks -> flat [numel] tensor of `dtype` (or written into `out`, [numel])."""
    if out is not None and (out.dim() != 1 or out.numel() != q.numel
                            or not out.is_contiguous()):
        raise ValueError(f"out must be a flat contiguous tensor of {q.numel} values, "
                         f"got {tuple(out.shape)}")
    if _fused(q.payload):
        return dequantize_triton(q, dtype if out is None else out.dtype, out)
    values = dequantize_reference(q, dtype if out is None else out.dtype)
    return values if out is None else out.copy_(values)
