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


@triton.jit
def _splitmix64(x):
    """splitmix64's finaliser on uint64 (multiplication wraps), as engine.generation._mix."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit(do_not_specialize=["step"])   # compiled once: 1 is not a constant step
def row_seeded_sample_kernel(logits_ptr, seeds_ptr, step, temperature, tokens_ptr, bad_ptr,
                             n_cols, BLOCK: tl.constexpr):
    """One row: argmax over tokens of log_softmax(logits / T) + Gumbel noise from the row's
    seed, step and token id (engine.generation.row_uniforms), in two passes over the row;
    `bad` = the row holds a NaN or +inf."""
    row = tl.program_id(0)
    golden = 0x9E3779B97F4A7C15
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    key = _splitmix64(seed * golden + step.to(tl.uint64))
    base = logits_ptr + row.to(tl.int64) * n_cols
    # pass 1: the row's max and sum of exp (online), and whether anything is NaN or +inf
    running_max = tl.full([BLOCK], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")) / temperature
        bad |= ((x != x) | (x == float("inf"))).to(tl.int32)
        new_max = tl.maximum(running_max, x)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe) + tl.exp(x - safe)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    log_sum = tl.log(tl.sum(running_sum * tl.exp(running_max - row_max), axis=0))
    # pass 2: the noisy scores' argmax, the first index on ties (as torch.argmax)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], 0, tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")) / temperature
        bits = _splitmix64(key + cols.to(tl.uint64) * golden) >> 40
        uniform = (bits.to(tl.float32) + 0.5) / 16777216.0
        score = ((x - row_max) - log_sum) - tl.log(-tl.log(uniform))
        # past the row's end, and NaN (a row then refused through `bad`), never win
        score = tl.where((cols < n_cols) & (score == score), score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0).to(tl.int64) + start
        take = block_best > best
        best_index = tl.where(take, block_index, best_index)
        best = tl.where(take, block_best, best)
    tl.store(tokens_ptr + row, best_index)
    tl.store(bad_ptr + row, tl.max(bad, axis=0))


@triton.jit
def _dot_dequantized(acc, x, w, FP32_DOT: tl.constexpr):
    """acc + x @ w^T, w [N, K] fp32 rounded to x's dtype first (as a dequantized copy of
    x's dtype would hold it)."""
    w = w.to(x.dtype)
    if FP32_DOT:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w))


@triton.jit
def quantized_matmul_kernel(x_ptr, payload_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K,
                            block, HAS_BIAS: tl.constexpr, BITS: tl.constexpr,
                            FP32_DOT: tl.constexpr, ONE_GROUP: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """out [M, N] = x [M, K] @ (q * scale) [N, K]^T (+ bias), the weight dequantized in
    registers one [BLOCK_N, BLOCK_K] tile at a time. INT4 bytes hold values 2i (low nibble)
    and 2i+1 (high), each + 8: the tile is two half-width tiles, against x's even and odd
    columns, so nothing is interleaved. FP32_DOT: the tiles meet in fp32 (IEEE, not TF32):
    for fp32 inputs, and under the interpreter, whose bf16 dot is wrong; the weight is
    rounded to x's dtype first either way, as the reference's dequantized copy is.
    ONE_GROUP: BLOCK_K is the scale block, so a tile's scales are one per output row (no
    per-value gather of them)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    PER_BYTE: tl.constexpr = 2 if BITS == 4 else 1
    BYTES: tl.constexpr = BLOCK_K // PER_BYTE
    row_bytes, groups = K // PER_BYTE, K // block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BYTES) * PER_BYTE   # the (first) value of each byte
        w_mask = (outs[:, None] < N) & (cols[None, :] < K)
        x_mask = (rows[:, None] < M) & (cols[None, :] < K)
        q = tl.load(payload_ptr + outs[:, None] * row_bytes + cols[None, :] // PER_BYTE,
                    mask=w_mask, other=0)
        if ONE_GROUP:   # the tile is one scale group: one scale per output row
            scale = tl.load(scales_ptr + outs * groups + k0 // block, mask=outs < N,
                            other=0.0).to(tl.float32)[:, None]
        else:
            scale = tl.load(scales_ptr + outs[:, None] * groups + cols[None, :] // block,
                            mask=w_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=x_mask, other=0.0)
        if BITS == 8:
            acc = _dot_dequantized(acc, x, q.to(tl.float32) * scale, FP32_DOT)
        else:
            x_odd = tl.load(x_ptr + rows[:, None] * K + cols[None, :] + 1, mask=x_mask,
                            other=0.0)
            low = ((q & 15).to(tl.int32) - 8).to(tl.float32) * scale
            high = ((q >> 4).to(tl.int32) - 8).to(tl.float32) * scale
            acc = _dot_dequantized(acc, x, low, FP32_DOT)
            acc = _dot_dequantized(acc, x_odd, high, FP32_DOT)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (rows[:, None] < M) & (outs[None, :] < N)
    tl.store(out_ptr + rows[:, None] * N + outs[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=out_mask)
