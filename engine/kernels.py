"""Fused Triton kernels of the inference modules (CUDA), with the PyTorch formulas they
replace. Decoding one token is a chain of small memory-bound ops; each fusion here reads
and writes the hidden state once instead of three or four times:

  add_norm   residual += delta, then RMSNorm (each family's) or LayerNorm of the new residual
  silu_mul   silu(gate) * up, from the fused gate/up projection's output
  row_seeded_sample  the next token of each row (temperature, then row-seeded Gumbel-max:
             engine.generation's sampling) in two reads of the logits, instead of a score
             tensor and a 64-bit hash tensor of [B, V] through some twenty ops
  rope_into_cache  the fused Q/K/V output split into heads, Q and K rotated, K and V
             written into the KV cache: one kernel for the PyTorch formula's twelve
  decode_attention  a decode step's attention (GQA) over the filled, unmasked slots of
             the KV cache, by an online softmax: one kernel for SDPA and the ops around it
  quantized_projection  x @ W^T + b + LoRA with W an INT8/INT4 payload and its block
             scales (engine/quantized_base.py's layout) in one or more parts, dequantized
             in registers: decoding streams the integers, not a full-precision copy (a
             prefill dequantizes the matrix and runs cuBLAS). A decode step (<= 16 rows of
             a 16-bit x) is one decode_matmul_kernel per part, W the wide operand (INT4
             nibbles made floats by bits), the bias and LoRA's B in its epilogue: p + 2
             kernels for p parts (a permutation of x, x @ A^T), 2p + 2 split along K

Both round where the Hugging Face modules round (the residual sum and the activation to
the model's dtype) and compute the rest in fp32. The kernels are compiled on first use;
with TRITON_INTERPRET=1 set before that, Triton's interpreter runs them on CPU tensors
(how the CPU tests check them).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# -- the PyTorch formulas (CPU path, and what the kernels must equal) --------------------------

def add_norm_reference(delta: torch.Tensor | None, residual: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor | None, eps: float, norm: str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, norm(residual + delta)) for `norm` (DecoderSpec.norm): "rms"
    (Llama: x̂ rounded to the dtype, then times w), "rms_fp32" (OLMo 2: x̂ w in fp32, rounded
    once), "gemma" (x̂ (1 + w) in fp32, rounded once) or "layer" (LayerNorm)."""
    x = residual if delta is None else residual + delta
    if norm == "layer":
        return x, F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if norm == "rms":
        return x, weight * x32.to(x.dtype)
    return x, (x32 * (weight.float() + (1.0 if norm == "gemma" else 0.0))).to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LowRank(NamedTuple):
    """LoRA beside a frozen projection: y += (x @ a^T) @ b^T (b times its scaling)."""

    a: torch.Tensor   # [r, K]
    b: torch.Tensor   # [N, r]


IntegerParts = list[tuple[torch.Tensor, torch.Tensor]]   # (payload, scales) per source


def quantized_projection_reference(x: torch.Tensor, parts: IntegerParts,
                                   bias: torch.Tensor | None = None,
                                   lora: LowRank | None = None) -> torch.Tensor:
    """x [..., K] @ W^T + bias + (x @ A^T) @ B^T -> [..., N], W the parts' dequantized
    rows one after the other (payload int8 [n, K] or uint8 [n, K / 2], scales [n, K /
    block]), each dequantized to x's dtype for the call."""
    from engine.quantized_base import dequantize_weight
    return _part_by_part(lambda x, payload, scales, bias: F.linear(
        x, dequantize_weight(payload, scales, x.dtype), bias), x, parts, bias, lora)


def quantized_linear_reference(x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized_projection_reference` of one part without LoRA."""
    return quantized_projection_reference(x, [(payload, scales)], bias)


def _part_by_part(matmul, x: torch.Tensor, parts: IntegerParts, bias: torch.Tensor | None,
                  lora: LowRank | None) -> torch.Tensor:
    """Each part through matmul(x, payload, scales, bias), side by side, then LoRA; one
    part takes the bias in its matmul (F.linear's rounding, as a dense Linear rounds)."""
    if len(parts) == 1:
        y = matmul(x, *parts[0], bias)
    else:
        y = torch.cat([matmul(x, *part, None) for part in parts], dim=-1)
        y = y if bias is None else y + bias
    return y if lora is None else y + F.linear(F.linear(x, lora.a), lora.b)


# -- Triton (engine/triton_kernels.py, imported only when a kernel is first used) -------------

def add_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float, norm: str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused `add_norm_reference`: one pass over [..., H] contiguous rows."""
    from engine import triton_kernels as tk
    residual = residual.contiguous()
    n_cols = residual.shape[-1]
    out = torch.empty_like(residual)
    total = residual if delta is None else torch.empty_like(residual)
    tk.add_norm_kernel[(residual.numel() // n_cols,)](
        residual if delta is None else delta.contiguous(), residual, weight,
        weight if bias is None else bias, total, out, n_cols, eps,
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, RMS=norm != "layer",
        FP32_SCALE=norm in ("rms_fp32", "gemma"), PLUS_ONE=norm == "gemma",
        BLOCK=tk.triton.next_power_of_2(n_cols))
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused `silu_mul_reference` over [..., 2F] -> [..., F]."""
    from engine import triton_kernels as tk
    gate_up = gate_up.contiguous()
    n_cols = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    block = min(tk.triton.next_power_of_2(n_cols), 1024)
    tk.silu_mul_kernel[(gate_up.numel() // (2 * n_cols), tk.triton.cdiv(n_cols, block))](
        gate_up, out, n_cols, BLOCK=block)
    return out


def row_seeded_sample(logits: torch.Tensor, row_seeds: torch.Tensor, step: int | torch.Tensor,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] fp32 logits -> ([B] tokens, 0-d bool: any NaN or +inf): the argmax of
    engine.generation._gumbel_scores(logits / temperature, row_seeds, step), fused. step:
    an int, or a 0-d long tensor on the device (read there: a CUDA graph replays it)."""
    from engine import triton_kernels as tk
    logits = logits.contiguous()
    rows, n_cols = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    bad = torch.empty(rows, dtype=torch.int32, device=logits.device)
    in_memory = isinstance(step, torch.Tensor)
    tk.row_seeded_sample_kernel[(rows,)](
        logits, row_seeds.to(device=logits.device, dtype=torch.long).contiguous(),
        0 if in_memory else step, step if in_memory else tokens, temperature, tokens, bad,
        n_cols, STEP_IN_MEMORY=in_memory, BLOCK=min(tk.triton.next_power_of_2(n_cols), 2048))
    return tokens, bad.any()


def rope_into_cache(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                    keys: torch.Tensor, values: torch.Tensor, write_at: torch.Tensor,
                    heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
                    q_scale: float = 1.0) -> torch.Tensor:
    """The fused Q/K/V output [B, T, (heads + 2 kv_heads) * head_dim] split into heads,
    Q and K rotated (cos, sin [B, 1, T, rotary_dim]; None and rotary_dim 0 for a model
    without rotary embeddings), Q times q_scale (OPT scales it before the dot product), K
    and V written into cache slots write_at [T] of keys/values [B, kv_heads, S,
    head_dim]: one kernel for the dozen ops of the PyTorch formula
    (engine/inference_modules.py; three or four without rotation). Returns Q [B, heads,
    T, head_dim]."""
    from engine import triton_kernels as tk
    b, t, width = qkv.shape
    q = torch.empty(b, heads, t, head_dim, dtype=qkv.dtype, device=qkv.device)
    assert keys.stride(-1) == values.stride(-1) == 1 and keys.stride() == values.stride()
    flat = qkv.reshape(b * t, width).contiguous()
    if rotary_dim == 0:   # nothing rotates: the angles are never read
        cos = sin = flat
    else:
        cos, sin = (x.reshape(b * t, rotary_dim).contiguous() for x in (cos, sin))
    tk.rope_cache_kernel[(b * t, heads + kv_heads)](
        flat, cos, sin, q, keys, values, write_at, t, heads, kv_heads, head_dim, rotary_dim,
        width, *keys.stride()[:3], q_scale, BLOCK=tk.triton.next_power_of_2(head_dim),
        enable_fp_fusion=False)
    return q


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     key_valid: torch.Tensor, write_at: torch.Tensor, scale: float,
                     window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Attention of one query token a row over the KV cache, fused (a decode step):
    q [B, heads, 1, d] (d contiguous), keys/values [B, kv_heads, S, d] (the cache's
    view), key_valid [B, >= write_at[0] + 1] bool (the slots each row may attend),
    write_at [1] the query's own slot: the valid slots up to it are attended (later ones
    hold no token yet, and are not read) -> [B, 1, heads * d], what
    engine.inference_modules._grouped_attention gives for that mask (and `softcap`). One
    kernel for the PyTorch path's four or five (the GQA mask's copy, SDPA's own, the
    output's layout), reading only the filled part of a static cache, and with a sliding
    `window` (which key_valid must hold too) only its last `window` slots."""
    from engine import triton_kernels as tk
    b, heads, t, d = q.shape
    kv_heads = keys.shape[1]
    assert t == 1 and q.stride(-1) == keys.stride(-1) == values.stride(-1) == 1
    assert keys.stride() == values.stride() and key_valid.stride(-1) == 1
    out = torch.empty(b, 1, heads * d, dtype=q.dtype, device=q.device)
    groups = heads // kv_heads
    block_d = max(16, tk.triton.next_power_of_2(d))
    # a block of keys and one of values of 16 KiB each at the most: 64 slots of a 128-wide
    # bf16 head, 32 of Gemma's 256; each pipelined stage holds both, and 64 slots of 256
    # took 138 KiB of shared memory, past the 99 KiB of an L4's or A10's SM
    block_s = max(16, min(64, 16384 // (block_d * keys.element_size())))
    tk.decode_attention_kernel[(b, kv_heads)](
        q, keys, values, key_valid.view(torch.uint8), write_at, out, scale, softcap or 1.0,
        groups, q.stride(0), q.stride(1), key_valid.stride(0), *keys.stride()[:3],
        HEAD_DIM=d, FP32_DOT=q.dtype == torch.float32 or _interpreted(), WINDOW=window,
        SOFTCAP=bool(softcap),
        BLOCK_G=max(16, tk.triton.next_power_of_2(groups)), BLOCK_S=block_s,
        BLOCK_D=block_d, num_warps=4)
    return out


FUSED_ROWS = 256   # up to here the fused kernels (decode steps, RL batches of up to 256
                  # rows); past it (a prefill) cuBLAS on a dequantized copy of the matrix
DECODE_ROWS = 16   # up to here (a decode step at batch <= 16) INT8/INT4 of a 16-bit x go
                   # through decode_matmul_kernel, the rest through quantized_matmul_kernel


def quantized_projection(x: torch.Tensor, parts: IntegerParts,
                         bias: torch.Tensor | None = None,
                         lora: LowRank | None = None) -> torch.Tensor:
    """`quantized_projection_reference` on the GPU. A decode step (<= DECODE_ROWS rows
    of a 16-bit x, bound by the weight's bytes): decode_matmul_kernel per part, each
    writing its columns of one output with the bias and LoRA's B added in its epilogue
    (or in the kernel that sums its split-K parts): x permuted and x @ A^T computed once
    for all parts. Up to FUSED_ROWS rows: the tiled kernel per part, bias and LoRA as
    PyTorch ops. A prefill (bound by its matmul): each part dequantized by a kernel,
    then cuBLAS."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    rows = flat.shape[0]
    if rows <= DECODE_ROWS and all(decode_fits(flat, *part) for part in parts):
        y = _decode_projection(flat, parts, bias, lora)
    elif rows <= FUSED_ROWS:
        y = _part_by_part(tiled_quantized_matmul, flat, parts, bias, lora)
    else:
        y = _part_by_part(lambda x, payload, scales, bias: F.linear(
            x, dequantize(payload, scales, x.dtype), bias), flat, parts, bias, lora)
    return y.view(*x.shape[:-1], y.shape[-1])


def quantized_linear(x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """`quantized_projection` of one part without LoRA."""
    return quantized_projection(x, [(payload, scales)], bias)


def tiled_quantized_matmul(flat: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows <= FUSED_ROWS, K] @ dequantize(payload, scales)^T + bias through
    quantized_matmul_kernel (INT8 or INT4, any block, any dtype): x the left operand,
    16-64 rows a tile, each tile of W dequantized in registers."""
    from engine import triton_kernels as tk
    (rows, k), n = flat.shape, payload.shape[0]
    tiles = _tiles(payload, scales, wide=False)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    grid = (tk.triton.cdiv(rows, block_m), tk.triton.cdiv(n, tiles.block_n))
    splits, k_per_split = split_k(grid[0] * grid[1], k, tiles.block_k, flat.device)
    out = _output(rows, n, splits, flat)
    tk.quantized_matmul_kernel[(*grid, splits)](
        flat, payload, scales, payload if bias is None else bias, out, rows, n, k,
        payload.shape[1], scales.shape[1], tiles.block, k_per_split, BITS=tiles.bits,
        FP32_DOT=flat.dtype == torch.float32 or _interpreted(),
        POW2_GROUP=tiles.pow2, CHUNK=tiles.chunk, FINAL=splits == 1,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=4, num_stages=3)
    return _summed(out, bias, flat.dtype)


_MAGIC = {torch.bfloat16: (0x4300, 136.0), torch.float16: (0x6400, 1032.0)}  # 128+n, 1024+n
_WORDS = 32   # 32-bit words of a row a tile of decode_matmul_kernel: 128 (INT8) or 256 values
_DECODE_OUTPUTS = 64   # rows of W a program: one warpgroup's tensor-core tile (sm_90)


def decode_fits(flat: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor) -> bool:
    """decode_matmul_kernel's conditions: a 16-bit float x, rows of whole 32-bit words
    (4-byte aligned), a power-of-two block of at least a word's values (4 or 8)."""
    block, per_word = _block(payload, scales), 4 if payload.dtype == torch.int8 else 8
    return (flat.dtype in _MAGIC and payload.is_contiguous() and payload.shape[1] % 4 == 0
            and payload.storage_offset() % 4 == 0 and block >= per_word
            and block & (block - 1) == 0)


def _decode_projection(flat: torch.Tensor, parts: IntegerParts, bias: torch.Tensor | None,
                       lora: LowRank | None) -> torch.Tensor:
    """The parts through decode_matmul_kernel into one [rows, N] output: x zero-padded to
    whole tiles and permuted within each (value s of every word together) and x @ A^T
    computed once; 64 outputs x 16 rows a program, split along K."""
    (rows, k), bits = flat.shape, 8 if parts[0][0].dtype == torch.int8 else 4
    tile = 32 // bits * _WORDS
    padded = -(-k // tile) * tile
    xp = flat if padded == k else F.pad(flat, (0, padded - k))
    xp = xp.view(rows, padded // tile, _WORDS, 32 // bits).transpose(2, 3).contiguous()
    low_rank = None if lora is None else (F.linear(flat, lora.a), lora.b)
    out = torch.empty(rows, sum(p.shape[0] for p, _ in parts), dtype=flat.dtype,
                      device=flat.device)
    column = 0
    for payload, scales in parts:
        n = payload.shape[0]
        columns = slice(column, column + n)
        _decode_part(xp.view(rows, padded), k, payload, scales,
                     None if bias is None else bias[columns],
                     None if low_rank is None else (low_rank[0], low_rank[1][columns]),
                     out[:, columns])
        column += n
    return out


def _decode_part(xp: torch.Tensor, k: int, payload: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None, low_rank: tuple[torch.Tensor, torch.Tensor] | None,
                 out: torch.Tensor) -> None:
    """One part's columns `out` [rows, n] (a view, rows `out.stride(0)` apart) = xp's x @
    dequantize(payload, scales)^T + bias + u @ b^T, low_rank = (u [rows, r], b [n, r]):
    in the kernel's epilogue, or, split along K, in finish_split_kernel."""
    from engine import triton_kernels as tk
    (rows, padded), n = xp.shape, payload.shape[0]
    bits = 8 if payload.dtype == torch.int8 else 4
    block, tile = _block(payload, scales), 32 // bits * _WORDS
    grid = (1, tk.triton.cdiv(n, _DECODE_OUTPUTS))
    splits, k_per_split = split_k(grid[1], k, tile, xp.device)
    parts = out if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32,
                                                device=xp.device)
    tail = _Epilogue.of(bias, low_rank, placeholder=payload)
    magic, offset = _MAGIC[xp.dtype]
    tk.decode_matmul_kernel[(*grid, splits)](
        xp, payload.view(torch.int32), scales, parts, tail.bias, tail.u, tail.b, rows, n, k,
        padded, payload.shape[1] // 4, scales.shape[1], block.bit_length() - 1, k_per_split,
        out.stride(0), tail.rank, BITS=bits, MAGIC=magic, OFFSET=offset,
        FP32_DOT=_interpreted(), FINAL=splits == 1, HAS_BIAS=bias is not None,
        RANK=tail.padded_rank, BLOCK_M=DECODE_ROWS, BLOCK_N=_DECODE_OUTPUTS, WORDS=_WORDS,
        G=max(1, tile // block), num_warps=4, num_stages=3)
    if splits > 1:
        tk.finish_split_kernel[(tk.triton.cdiv(rows, DECODE_ROWS),
                                tk.triton.cdiv(n, _DECODE_OUTPUTS))](
            parts, out, tail.bias, tail.u, tail.b, rows, n, splits, out.stride(0), tail.rank,
            FP32_DOT=_interpreted(), HAS_BIAS=bias is not None, RANK=tail.padded_rank,
            BLOCK_M=DECODE_ROWS, BLOCK_N=_DECODE_OUTPUTS)


class _Epilogue(NamedTuple):
    """The bias and LoRA arguments of the decode kernels' epilogue (unused pointers are
    a placeholder tensor; padded_rank: a power of two of at least 16, a dot's least K, or
    0 without LoRA)."""

    bias: torch.Tensor
    u: torch.Tensor
    b: torch.Tensor
    rank: int
    padded_rank: int

    @classmethod
    def of(cls, bias: torch.Tensor | None, low_rank: tuple[torch.Tensor, torch.Tensor] | None,
           placeholder: torch.Tensor) -> _Epilogue:
        u, b = low_rank if low_rank is not None else (placeholder, placeholder)
        rank = 0 if low_rank is None else u.shape[1]
        return cls(placeholder if bias is None else bias, u, b, rank,
                   0 if rank == 0 else max(16, 1 << (rank - 1).bit_length()))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _output(rows: int, n: int, splits: int, flat: torch.Tensor) -> torch.Tensor:
    """The kernels' output: [rows, n] in x's dtype, or one fp32 part per K range."""
    if splits == 1:
        return torch.empty(rows, n, dtype=flat.dtype, device=flat.device)
    return torch.empty(splits, rows, n, dtype=torch.float32, device=flat.device)


def _summed(out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The parts of a split-K output summed in fp32 (+ bias), in x's dtype."""
    if out.dim() == 2:
        return out
    out = out.sum(0) if bias is None else out.sum(0) + bias.float()
    return out.to(dtype)


def split_k(n_tiles: int, k: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(ranges, values a range) of K for n_tiles output tiles (row tiles x column
    tiles): about 4 programs an SM keep enough loads in flight, and a range is at least
    4 tiles long."""
    k_tiles = -(-k // block_k)
    splits = max(1, min(4 * _sm_count(device) // n_tiles, k_tiles // 4))
    k_per_split = -(-k_tiles // splits) * block_k
    return -(-k // k_per_split), k_per_split


def dequantize(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """engine.quantized_base.dequantize_weight as one kernel: [N, K] of `dtype`, each
    integer read once and each value written once."""
    from engine import triton_kernels as tk
    n, k = payload.shape[0], scales.shape[1] * _block(payload, scales)
    tiles = _tiles(payload, scales, wide=True)
    out = torch.empty(n, k, dtype=dtype, device=payload.device)
    grid = (tk.triton.cdiv(n, tiles.block_n), tk.triton.cdiv(k, tiles.block_k))
    tk.dequantize_kernel[grid](
        payload, scales, out, n, k, payload.shape[1], scales.shape[1], tiles.block,
        BITS=tiles.bits, POW2_GROUP=tiles.pow2, CHUNK=tiles.chunk, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k)
    return out


class _Tiles(NamedTuple):
    bits: int
    block: int       # values per scale
    pow2: bool       # block a power of two: scales broadcast per CHUNK, not gathered
    chunk: int       # min(block, block_k) where pow2
    block_n: int
    block_k: int     # values: 128 bytes of a row per tile, INT8 or INT4


def _block(payload: torch.Tensor, scales: torch.Tensor) -> int:
    per_byte = 1 if payload.dtype == torch.int8 else 2
    return payload.shape[1] * per_byte // scales.shape[1]


def _tiles(payload: torch.Tensor, scales: torch.Tensor, wide: bool) -> _Tiles:
    bits, block = (8 if payload.dtype == torch.int8 else 4), _block(payload, scales)
    block_k = 128 if bits == 8 else 256
    pow2 = block & (block - 1) == 0
    return _Tiles(bits, block, pow2, min(block, block_k) if pow2 else 1,
                  64 if wide else 32, block_k)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; an H100's 132 elsewhere (the
    interpreter), so that the CPU checks take the split-K path a GPU would."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
