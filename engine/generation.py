"""Sampling answers from a causal LM (Hugging Face generate for now; the hybrid engine
replaces this path for the sharded actor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    do_sample: bool = True


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             sampling: SamplingSettings, *, eos_token_id: int, pad_token_id: int
             ) -> torch.Tensor:
    """Continue left-padded prompts.

    Args:
        input_ids, attention_mask: [B, P], prompts left-padded.
    Returns:
        [B, P + N] sequences, N <= max_new_tokens; after a row's EOS come pad tokens.
    """
    config = GenerationConfig(
        max_new_tokens=sampling.max_new_tokens, do_sample=sampling.do_sample,
        temperature=sampling.temperature if sampling.do_sample else None,
        top_p=sampling.top_p if sampling.do_sample else None,
        top_k=sampling.top_k if sampling.do_sample else None,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )
    was_training = model.training
    model.eval()
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                         generation_config=config)
    model.train(was_training)
    return out
