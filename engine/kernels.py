"""Fused Triton kernels of the inference modules (CUDA), with the PyTorch formulas they
replace. Decoding one token is a chain of small memory-bound ops; each fusion here reads
and writes the hidden state once instead of three or four times:

  add_norm   residual += delta, then RMSNorm or LayerNorm of the new residual
  silu_mul   silu(gate) * up, from the fused gate/up projection's output
  row_seeded_sample  the next token of each row (temperature, then row-seeded Gumbel-max:
             engine.generation's sampling) in two reads of the logits, instead of a score
             tensor and a 64-bit hash tensor of [B, V] through some twenty ops
  quantized_linear  x @ W^T + b with W an INT8/INT4 payload and its block scales
             (engine/quantized_base.py's layout), dequantized in registers: decoding
             streams the integers, not a full-precision copy

Both round where the Hugging Face modules round (the residual sum and the activation to
the model's dtype) and compute the rest in fp32. The kernels are compiled on first use;
with TRITON_INTERPRET=1 set before that, Triton's interpreter runs them on CPU tensors
(how the CPU tests check them).
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# -- the PyTorch formulas (CPU path, and what the kernels must equal) --------------------------

def add_norm_reference(delta: torch.Tensor | None, residual: torch.Tensor,
                       weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, norm(residual + delta)) with Llama's RMSNorm (rms) or LayerNorm."""
    x = residual if delta is None else residual + delta
    if not rms:
        return x, F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * x32.to(x.dtype)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantized_linear_reference(x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(payload, scales)^T + bias -> [..., N], the weight
    dequantized to x's dtype for the call (payload int8 [N, K] or uint8 [N, K / 2], scales
    [N, K / block])."""
    from engine.quantized_base import dequantize_weight
    return F.linear(x, dequantize_weight(payload, scales, x.dtype), bias)


# -- Triton (engine/triton_kernels.py, imported only when a kernel is first used) -------------

def add_norm(delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float, rms: bool
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
        HAS_DELTA=delta is not None, HAS_BIAS=bias is not None, RMS=rms,
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


def row_seeded_sample(logits: torch.Tensor, row_seeds: torch.Tensor, step: int,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] fp32 logits -> ([B] tokens, 0-d bool: any NaN or +inf): the argmax of
    engine.generation._gumbel_scores(logits / temperature, row_seeds, step), fused."""
    from engine import triton_kernels as tk
    logits = logits.contiguous()
    rows, n_cols = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    bad = torch.empty(rows, dtype=torch.int32, device=logits.device)
    tk.row_seeded_sample_kernel[(rows,)](
        logits, row_seeds.to(device=logits.device, dtype=torch.long).contiguous(), step,
        temperature, tokens, bad, n_cols, BLOCK=min(tk.triton.next_power_of_2(n_cols), 2048))
    return tokens, bad.any()


def quantized_linear(x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Fused `quantized_linear_reference`: one kernel, the weight read once as integers.
    Tiles: narrow ones for decoding (a few rows: many programs stream the weight), wider
    for a prefill's many rows."""
    from engine import triton_kernels as tk
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    (rows, k), n = flat.shape, payload.shape[0]
    bits, block = 8 if payload.dtype == torch.int8 else 4, k // scales.shape[-1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_m, block_n = (16, 32) if rows <= 16 else (64, 64)
    # a tile of one scale group where that is a power of two that makes a dot of 16 to 128
    # bytes a row; else tiles of 64 values gather their scales value by value
    one_group = block & (block - 1) == 0 and (16 if bits == 8 else 32) <= block <= 128
    block_k = block if one_group else 64
    grid = (tk.triton.cdiv(rows, block_m), tk.triton.cdiv(n, block_n))
    tk.quantized_matmul_kernel[grid](
        flat, payload, scales, payload if bias is None else bias, out, rows, n, k, block,
        HAS_BIAS=bias is not None, BITS=bits,
        FP32_DOT=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        ONE_GROUP=one_group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out.view(*x.shape[:-1], n)
