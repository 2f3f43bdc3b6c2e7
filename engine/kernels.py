"""Fused Triton kernels of the inference modules (CUDA), with the PyTorch formulas they
replace. Decoding one token is a chain of small memory-bound ops; each fusion here reads
and writes the hidden state once instead of three or four times:

  add_norm   residual += delta, then RMSNorm or LayerNorm of the new residual
  silu_mul   silu(gate) * up, from the fused gate/up projection's output
  row_seeded_sample  the next token of each row (temperature, then row-seeded Gumbel-max:
             engine.generation's sampling) in two reads of the logits, instead of a score
             tensor and a 64-bit hash tensor of [B, V] through some twenty ops

Both round where the Hugging Face modules round (the residual sum and the activation to
the model's dtype) and compute the rest in fp32. The kernels are compiled on first use;
with TRITON_INTERPRET=1 set before that, Triton's interpreter runs them on CPU tensors
(how the CPU tests check them).
"""

from __future__ import annotations

import importlib.util

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
