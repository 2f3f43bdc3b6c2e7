"""The Triton side of engine/quantize.py (imported on first use; see there).

Each program handles a [ROWS, BLOCK] tile: ROWS quantization blocks of `block` values
(BLOCK = block rounded up to a power of 2, the extra columns masked off). Both kernels must
equal the PyTorch reference bit for bit, on CUDA and under the interpreter, so every
floating-point step is one IEEE-rounded op that torch performs the same way.
"""

import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    """torch.round (nearest, ties to even) as int32. Built from floor and comparisons only:
    an add or subtract on y could be fused with the multiply that made y into one FMA,
    which skips y's rounding and so could round differently from torch."""
    r = tl.floor(y)
    half = r + 0.5
    ri = r.to(tl.int32)
    up = (y > half) | ((y == half) & ((ri & 1) == 1))
    return ri + up.to(tl.int32)


@triton.jit
def _to_bf16(y):
    """fp32 -> bf16, round to nearest even, by hand: the interpreter's cast truncates (CUDA's
    rounds), and this way both round as torch does. Inputs are finite."""
    bits = y.to(tl.uint32, bitcast=True)
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def quantize_kernel(x_ptr, payload_ptr, scales_ptr, n_blocks, block,
                    BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_blocks
    rows64 = rows.to(tl.int64)      # offsets past 2^31 elements
    mask = row_ok[:, None] & (cols[None, :] < block)
    x = tl.load(x_ptr + rows64[:, None] * block + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)

    absmax = tl.max(tl.abs(x), axis=1)
    qmax = tl.full((ROWS,), QMAX, tl.float32)
    # div_rn: IEEE division as torch's (a plain `/` may be approximate on CUDA)
    tl.store(scales_ptr + rows, tl.math.div_rn(absmax, qmax), mask=row_ok)
    inverse = tl.math.div_rn(qmax, tl.where(absmax > 0, absmax, 1.0))
    inverse = tl.where(absmax > 0, inverse, 0.0)           # an all-zero block: q = 0
    q = _round_half_even(x * inverse[:, None])
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)

    if BITS == 8:
        tl.store(payload_ptr + rows64[:, None] * block + cols[None, :], q.to(tl.int8),
                 mask=mask)
    else:
        # values 2i and 2i+1 share byte i: low and high nibble, offset by 8 (nibbles 1..15)
        lo, hi = tl.split(tl.reshape(q + 8, (ROWS, BLOCK // 2, 2)))
        pcols = tl.arange(0, BLOCK // 2)
        pmask = row_ok[:, None] & (pcols[None, :] < block // 2)
        tl.store(payload_ptr + rows64[:, None] * (block // 2) + pcols[None, :],
                 (lo | (hi << 4)).to(tl.uint8), mask=pmask)


@triton.jit
def dequantize_kernel(payload_ptr, scales_ptr, out_ptr, n_blocks, block,
                      BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      OUT_BF16: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_ok = rows < n_blocks
    rows64 = rows.to(tl.int64)
    mask = row_ok[:, None] & (cols[None, :] < block)
    scale = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)

    if BITS == 8:
        q = tl.load(payload_ptr + rows64[:, None] * block + cols[None, :], mask=mask, other=0)
    else:
        pcols = tl.arange(0, BLOCK // 2)
        pmask = row_ok[:, None] & (pcols[None, :] < block // 2)
        packed = tl.load(payload_ptr + rows64[:, None] * (block // 2) + pcols[None, :],
                         mask=pmask, other=0).to(tl.int32)
        q = tl.reshape(tl.join((packed & 15) - 8, (packed >> 4) - 8), (ROWS, BLOCK))

    y = q.to(tl.float32) * scale[:, None]
    if OUT_BF16:
        y = _to_bf16(y)
    tl.store(out_ptr + rows64[:, None] * block + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)
