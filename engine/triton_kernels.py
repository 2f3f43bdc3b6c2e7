"""The Triton side of engine/kernels.py (imported on first use; see there)."""

import triton
import triton.language as tl


@triton.jit
def add_norm_kernel(delta_ptr, residual_ptr, weight_ptr, bias_ptr, sum_ptr, out_ptr,
                    n_cols, eps, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                    RMS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offsets = row * n_cols + cols
    x = tl.load(residual_ptr + offsets, mask=mask, other=0.0)
    if HAS_DELTA:
        # rounded to the model's dtype, as the residual stream is between modules
        x = (x.to(tl.float32) + tl.load(delta_ptr + offsets, mask=mask, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offsets, x, mask=mask)
    x32 = x.to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if RMS:
        variance = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
    else:
        mean = tl.sum(x32, axis=0) / n_cols
        centred = tl.where(mask, x32 - mean, 0.0)
        variance = tl.sum(centred * centred, axis=0) / n_cols
        out = centred * tl.math.rsqrt(variance + eps) * weight.to(tl.float32)
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = out.to(x.dtype)
    tl.store(out_ptr + offsets, out, mask=mask)

@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    activated = (g32 * tl.sigmoid(g32)).to(gate.dtype)
    out = (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)
