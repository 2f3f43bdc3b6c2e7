"""The Triton side of engine/kernels.py (imported on first use; see there)."""

import triton
import triton.language as tl


@triton.jit
def add_norm_kernel(delta_ptr, residual_ptr, weight_ptr, bias_ptr, sum_ptr, out_ptr,
                    n_cols, eps, HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                    RMS: tl.constexpr, FP32_SCALE: tl.constexpr, PLUS_ONE: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)   # rows x n_cols passes 2^31 in a big prefill
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
        normed = x32 * tl.math.rsqrt(variance + eps)
        if PLUS_ONE:      # Gemma: x̂ (1 + w) in fp32, rounded once
            out = (normed * (weight.to(tl.float32) + 1.0)).to(x.dtype)
        elif FP32_SCALE:  # OLMo 2: x̂ w in fp32, rounded once
            out = (normed * weight.to(tl.float32)).to(x.dtype)
        else:             # Llama: x̂ rounded to the dtype, then times w
            out = (weight.to(tl.float32) * normed.to(x.dtype).to(tl.float32)).to(x.dtype)
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
    row = tl.program_id(0).to(tl.int64)   # 70B's 2 x 28672 per row: past 2^31 at 37,450 rows
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
def row_seeded_sample_kernel(logits_ptr, seeds_ptr, step, step_ptr, temperature, tokens_ptr,
                             bad_ptr, n_cols, STEP_IN_MEMORY: tl.constexpr,
                             BLOCK: tl.constexpr):
    """One row: argmax over tokens of log_softmax(logits / T) + Gumbel noise from the row's
    seed, step (`step`, or read from step_ptr) and token id
    (engine.generation.row_uniforms), in two passes over the row; `bad` = the row holds a
    NaN or +inf."""
    row = tl.program_id(0)
    if STEP_IN_MEMORY:
        step = tl.load(step_ptr)
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
def _dequantized_tile(payload_ptr, scales_ptr, outs, k0, N, K, row_bytes, groups, block,
                      BITS: tl.constexpr, POW2_GROUP: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[outs, k0:k0 + BLOCK_K] in fp32: one contiguous load of the tile's bytes (INT4:
    value 2i in byte i's low nibble, 2i+1 in its high one, each + 8, interleaved back by
    a join), times its scales: one per CHUNK values (min(block, BLOCK_K), a power of two
    with POW2_GROUP), broadcast over a [N, G, CHUNK] view; else (a block that is not a
    power of two) gathered value by value."""
    PER_BYTE: tl.constexpr = 2 if BITS == 4 else 1
    nbytes = k0 // PER_BYTE + tl.arange(0, BLOCK_K // PER_BYTE)
    q = tl.load(payload_ptr + outs[:, None] * row_bytes + nbytes[None, :],
                mask=(outs[:, None] < N) & (nbytes[None, :] < row_bytes), other=0)
    if BITS == 4:
        low, high = (q & 15).to(tl.int32) - 8, (q >> 4).to(tl.int32) - 8
        w = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K)).to(tl.float32)
    else:
        w = q.to(tl.float32)
    if POW2_GROUP:
        G: tl.constexpr = BLOCK_K // CHUNK
        tile_groups = (k0 + tl.arange(0, G) * CHUNK) // block
        scale = tl.load(scales_ptr + outs[:, None] * groups + tile_groups[None, :],
                        mask=(outs[:, None] < N) & (tile_groups[None, :] < groups), other=0.0)
        w = tl.reshape(tl.reshape(w, (BLOCK_N, G, CHUNK)) * scale.to(tl.float32)[:, :, None],
                       (BLOCK_N, BLOCK_K))
    else:
        cols = k0 + tl.arange(0, BLOCK_K)
        w *= tl.load(scales_ptr + outs[:, None] * groups + cols[None, :] // block,
                     mask=(outs[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
    return w


@triton.jit
def quantized_matmul_kernel(x_ptr, payload_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K,
                            row_bytes, groups, block, k_per_split, BITS: tl.constexpr,
                            FP32_DOT: tl.constexpr, POW2_GROUP: tl.constexpr,
                            CHUNK: tl.constexpr, FINAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """x [M, K] @ (q * scale) [N, K]^T over K's range number program_id(2), of
    k_per_split values (split-K: a decode step's few output tiles still fill every SM),
    the weight dequantized in registers one [BLOCK_N, BLOCK_K] tile at a time. FINAL (one
    range): out [M, N] = that (+ bias) in out's dtype; else out [splits, M, N] fp32 holds
    the parts. FP32_DOT: the tiles meet in fp32 (IEEE, not TF32): for fp32 inputs, and
    under the interpreter, whose bf16 dot is wrong; the weight is rounded to x's dtype
    first either way, as the reference's dequantized copy is."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(split * k_per_split, tl.minimum(K, (split + 1) * k_per_split), BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :],
                    mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0)
        w = _dequantized_tile(payload_ptr, scales_ptr, outs, k0, N, K, row_bytes, groups,
                              block, BITS, POW2_GROUP, CHUNK, BLOCK_N, BLOCK_K)
        acc = _dot_dequantized(acc, x, w, FP32_DOT)
    mask = (rows[:, None] < M) & (outs[None, :] < N)
    if FINAL:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + outs[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + (split * M + rows[:, None]) * N + outs[None, :], acc, mask=mask)


@triton.jit
def dequantize_kernel(payload_ptr, scales_ptr, out_ptr, N, K, row_bytes, groups, block,
                      BITS: tl.constexpr, POW2_GROUP: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [N, K] = q * scale in out's dtype, one [BLOCK_N, BLOCK_K] tile a program."""
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    cols = k0 + tl.arange(0, BLOCK_K)
    w = _dequantized_tile(payload_ptr, scales_ptr, outs, k0, N, K, row_bytes, groups, block,
                          BITS, POW2_GROUP, CHUNK, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + outs[:, None] * K + cols[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(outs[:, None] < N) & (cols[None, :] < K))


@triton.jit
def _scaled_dot(acc, w, scale, xp_ptr, rows, M, x_stride, x0, j, FP32_DOT: tl.constexpr,
                BLOCK_N: tl.constexpr, WORDS: tl.constexpr, G: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + (w times its scale, rounded to x's dtype) @ xp[rows, x0:x0 +
    WORDS]^T; w [BLOCK_N, WORDS]: exact integers in x's dtype, or in fp32 under FP32_DOT
    (the interpreter, whose 16-bit arithmetic and dot are wrong; the dot then in fp32)."""
    xs = tl.load(xp_ptr + rows[:, None] * x_stride + (x0 + j)[None, :], mask=rows[:, None] < M,
                 other=0.0)
    w = tl.reshape(tl.reshape(w, (BLOCK_N, G, WORDS // G)) * scale.to(w.dtype)[:, :, None],
                   (BLOCK_N, WORDS))
    if FP32_DOT:
        return tl.dot(w.to(xs.dtype).to(tl.float32), tl.trans(xs.to(tl.float32)), acc,
                      input_precision="ieee")
    return tl.dot(w, tl.trans(xs), acc)


@triton.jit
def _nibbles(bits, OFFSET: tl.constexpr, dtype: tl.constexpr, FP32_DOT: tl.constexpr):
    """16-bit patterns MAGIC | n -> the integers n - 8, exactly (see decode_matmul_kernel)."""
    w = bits.to(tl.uint16).to(dtype, bitcast=True)
    return w.to(tl.float32) - OFFSET if FP32_DOT else w - OFFSET


@triton.jit
def _bias_and_low_rank_tile(out, rows, outs, M, N, bias_ptr, u_ptr, b_ptr, rank,
                            HAS_BIAS: tl.constexpr, RANK: tl.constexpr,
                            FP32_DOT: tl.constexpr):
    """out [BLOCK_M, BLOCK_N] fp32 + bias[outs] + u[rows] @ b[outs]^T: LoRA's up
    projection, u = x @ A^T [M, rank] and b [N, rank] (rows `rank` apart), padded to RANK
    columns (0: no LoRA)."""
    if HAS_BIAS:
        out += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
    if RANK > 0:
        r = tl.arange(0, RANK)
        u = tl.load(u_ptr + rows[:, None] * rank + r[None, :],
                    mask=(rows[:, None] < M) & (r[None, :] < rank), other=0.0)
        b = tl.load(b_ptr + outs[:, None] * rank + r[None, :],
                    mask=(outs[:, None] < N) & (r[None, :] < rank), other=0.0)
        if FP32_DOT:
            out = tl.dot(u.to(tl.float32), tl.trans(b.to(tl.float32)), out,
                         input_precision="ieee")
        else:
            out = tl.dot(u, tl.trans(b), out)
    return out


@triton.jit
def decode_matmul_kernel(xp_ptr, words_ptr, scales_ptr, out_ptr, bias_ptr, u_ptr, b_ptr, M, N,
                         K, x_stride, row_words, groups, block_shift, k_per_split, out_stride,
                         rank, BITS: tl.constexpr, MAGIC: tl.constexpr, OFFSET: tl.constexpr,
                         FP32_DOT: tl.constexpr, FINAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                         RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         WORDS: tl.constexpr, G: tl.constexpr):
    """A decode step's x [M <= BLOCK_M, K] @ W^T for an INT8/INT4 W read as 32-bit words
    (PER = 4 or 8 values a word: value PER * j + s in byte or nibble s of word j),
    computed transposed, W's tile the left operand [BLOCK_N, WORDS] per s: the big
    operand goes straight from registers into the tensor cores and the few rows of x are
    the narrow one (the other way round, every warp re-reads all of x's tile for its
    slice of W). x comes permuted per tile of PER * WORDS values (xp: value s of every
    word contiguous), so each s is one dot with no interleaving. INT4: a nibble becomes
    x's 16-bit float by bits, MAGIC | n = OFFSET - 8 + n, minus OFFSET, two at once
    (nibbles s and s + 4 are 16 bits apart), no int-to-float conversion; INT8: a byte
    sign-extended and converted. Times its scale (one per 2^block_shift values, G per
    tile), rounded once as the dequantized copy rounds it. FINAL (one K range): out
    [M, N] (rows out_stride apart) = that + bias + LoRA (_bias_and_low_rank_tile) in
    out's dtype; else, over K's range number program_id(2), fp32 parts [splits, M, N]
    for finish_split_kernel."""
    PER: tl.constexpr = 32 // BITS
    TILE: tl.constexpr = PER * WORDS
    dtype: tl.constexpr = xp_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    j = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(split * k_per_split, tl.minimum(K, (split + 1) * k_per_split), TILE):
        words = tl.load(words_ptr + outs[:, None] * row_words + (k0 // PER + j)[None, :],
                        mask=(outs[:, None] < N) & ((k0 // PER + j)[None, :] < row_words),
                        other=0)
        tile_groups = (k0 + tl.arange(0, G) * (TILE // G)) >> block_shift
        scale = tl.load(scales_ptr + outs[:, None] * groups + tile_groups[None, :],
                        mask=(outs[:, None] < N) & (tile_groups[None, :] < groups), other=0.0)
        for s in tl.static_range(4):
            if BITS == 4:
                pair = ((words >> (4 * s)) & 0x000F000F) | (MAGIC | (MAGIC << 16))
                acc = _scaled_dot(acc, _nibbles(pair, OFFSET, dtype, FP32_DOT), scale, xp_ptr,
                                  rows, M, x_stride, k0 + s * WORDS, j, FP32_DOT, BLOCK_N,
                                  WORDS, G)
                acc = _scaled_dot(acc, _nibbles(pair >> 16, OFFSET, dtype, FP32_DOT), scale,
                                  xp_ptr, rows, M, x_stride, k0 + (s + 4) * WORDS, j, FP32_DOT,
                                  BLOCK_N, WORDS, G)
            else:
                w = ((words << (24 - 8 * s)) >> 24).to(tl.float32)   # byte s, signed
                acc = _scaled_dot(acc, w if FP32_DOT else w.to(dtype), scale, xp_ptr, rows, M,
                                  x_stride, k0 + s * WORDS, j, FP32_DOT, BLOCK_N, WORDS, G)
    out = tl.trans(acc)
    mask = (rows[:, None] < M) & (outs[None, :] < N)
    if FINAL:
        out = _bias_and_low_rank_tile(out, rows, outs, M, N, bias_ptr, u_ptr, b_ptr, rank,
                                      HAS_BIAS, RANK, FP32_DOT)
        tl.store(out_ptr + rows[:, None] * out_stride + outs[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + (split * M + rows[:, None]) * N + outs[None, :], out, mask=mask)


@triton.jit
def finish_split_kernel(parts_ptr, out_ptr, bias_ptr, u_ptr, b_ptr, M, N, splits, out_stride,
                        rank, FP32_DOT: tl.constexpr, HAS_BIAS: tl.constexpr,
                        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out [M, N] (rows out_stride apart) = the sum of decode_matmul_kernel's fp32 parts
    [splits, M, N] + bias + LoRA, in out's dtype: one kernel for what would be a sum, an
    add or two and a cast."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (outs[None, :] < N)
    out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for split in range(splits):
        out += tl.load(parts_ptr + (split * M + rows[:, None]) * N + outs[None, :], mask=mask,
                       other=0.0)
    out = _bias_and_low_rank_tile(out, rows, outs, M, N, bias_ptr, u_ptr, b_ptr, rank,
                                  HAS_BIAS, RANK, FP32_DOT)
    tl.store(out_ptr + rows[:, None] * out_stride + outs[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, keys_ptr, values_ptr, write_at_ptr, T,
                      heads, kv_heads, head_dim, rotary_dim, qkv_stride, key_b, key_h, key_s,
                      q_scale, BLOCK: tl.constexpr):
    """One head of one token (program_id(0) = b * T + t, program_id(1) = head): the
    fused Q/K/V projection's row [(heads + 2 kv_heads) * head_dim], its first rotary_dim
    values of a Q or K head rotated (x * cos + rotate_half(x) * sin, each product and the
    sum rounded to the model's dtype, as the PyTorch formula rounds; compiled without FMA
    contraction; rotary_dim 0: none), Q times q_scale (rounded once) written to q [B,
    heads, T, head_dim], K and its V into the cache's slot write_at[t] (keys/values [B,
    kv_heads, S, head_dim] with the given strides)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    b, t = row // T, row % T
    i = tl.arange(0, BLOCK)
    src = qkv_ptr + row.to(tl.int64) * qkv_stride + head * head_dim
    x = tl.load(src + i, mask=i < head_dim, other=0.0)
    dtype = x.dtype
    half = rotary_dim // 2
    rotating = i < rotary_dim
    # in fp32, rounded to dtype where the formula rounds (the interpreter's 16-bit
    # arithmetic is wrong)
    partner = tl.load(src + tl.where(i < half, i + half, i - half), mask=rotating,
                      other=0.0).to(tl.float32)
    partner = tl.where(i < half, -partner, partner)
    cos = tl.load(cos_ptr + row * rotary_dim + i, mask=rotating, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + row * rotary_dim + i, mask=rotating, other=0.0).to(tl.float32)
    x32 = x.to(tl.float32)
    turned = ((x32 * cos).to(dtype).to(tl.float32)
              + (partner * sin).to(dtype).to(tl.float32)).to(dtype)
    y = tl.where(rotating, turned.to(tl.float32), x32).to(dtype)
    if head < heads:
        tl.store(q_ptr + ((b * heads + head) * T + t).to(tl.int64) * head_dim + i,
                 (y.to(tl.float32) * q_scale).to(dtype), mask=i < head_dim)
    else:
        slot = tl.load(write_at_ptr + t)
        at = b.to(tl.int64) * key_b + (head - heads) * key_h + slot * key_s + i
        tl.store(keys_ptr + at, y, mask=i < head_dim)
        tl.store(values_ptr + at, tl.load(src + kv_heads * head_dim + i, mask=i < head_dim),
                 mask=i < head_dim)


@triton.jit
def decode_attention_kernel(q_ptr, keys_ptr, values_ptr, valid_ptr, write_at_ptr, out_ptr,
                            scale, softcap, groups, q_b, q_h, valid_b, key_b, key_h, key_s,
                            HEAD_DIM: tl.constexpr, FP32_DOT: tl.constexpr,
                            WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
                            BLOCK_D: tl.constexpr):
    """One KV head of one row (program_id(0) = b, program_id(1) = KV head): its `groups`
    query heads' single query token attends the cache slots s <= write_at[0] (the query's
    own slot; later slots hold no token yet) where valid[b, s], by an online softmax over
    blocks of BLOCK_S slots: only filled slots are read, and masked ones (left padding)
    are not loaded; with a sliding WINDOW, only the last WINDOW slots are visited. Scores
    and the softmax in fp32 (SOFTCAP: softcap * tanh(s / softcap), Gemma 2's), P rounded
    to the cache's dtype for P @ V (as flash attention does); out [B, heads * head_dim]."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    in_head = d < HEAD_DIM
    q_rows = (g < groups)[:, None] & in_head[None, :]
    heads_of = (kv_head * groups + g)[:, None]
    q = tl.load(q_ptr + b * q_b + heads_of * q_h + d[None, :], mask=q_rows, other=0.0)
    cache = b * key_b + kv_head * key_h + d[None, :]
    end = tl.load(write_at_ptr) + 1
    first = 0
    if WINDOW > 0:   # slots further back are outside the window (valid masks them too)
        first = tl.maximum(end - WINDOW, 0)
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(first, end, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        valid = tl.load(valid_ptr + b * valid_b + s, mask=s < end, other=0) != 0
        at = cache + s[:, None].to(tl.int64) * key_s
        slot_mask = valid[:, None] & in_head[None, :]
        k = tl.load(keys_ptr + at, mask=slot_mask, other=0.0)
        v = tl.load(values_ptr + at, mask=slot_mask, other=0.0)
        if FP32_DOT:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                            input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if SOFTCAP:   # tanh(x) = 1 - 2 / (e^2x + 1): e^2x overflowing to inf gives 1
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)   # nothing valid yet
        p = tl.exp(scores - safe[:, None])
        rescale = tl.exp(running_max - safe)
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * rescale[:, None] + pv
        running_max = new_max
    out = acc / running_sum[:, None]
    heads = tl.num_programs(1) * groups
    tl.store(out_ptr + (b * heads + heads_of) * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_rows)
