"""Sequences packed into rows, attention kept within each: where lengths vary, fewer tokens
through the model than padding makes (sft.packing, rm.packing, ppo.packing).

`packed_layout` places sequences into rows; `unpadded` packs padded rows for a forward and
maps its outputs back to them; `require_packing` refuses the models whose forward would let
packed sequences attend to each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.errors import UserError
from engine.parallel import hf_model


def packed_layout(lengths: Sequence[int]) -> list[list[int]]:
    """Rows of sequence indices for packing sequences of `lengths`: first-fit decreasing into
    rows as wide as the longest sequence, so the packed batch has at most as many rows as
    sequences and is no wider than its padded form: never more tokens, nor more attention
    per row, than padding makes."""
    width, rows, room = max(lengths), [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if fits is None:
            rows.append([i])
            room.append(width - lengths[i])
        else:
            rows[fits].append(i)
            room[fits] -= lengths[i]
    return rows


def restarting_positions(layout: list[list[int]], lengths: Sequence[int],
                         width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids [R, W], starts [N]) of sequences of `lengths` placed by `layout` into
    rows of `width`: positions count from 0 in every sequence and in a row's fill after its
    last one (transformers reads sequence starts from restarting positions when given no
    attention_mask, and keeps each sequence's attention to itself); starts are each
    sequence's first token as a flat index (row * W + column)."""
    positions = torch.zeros((len(layout), width), dtype=torch.long)
    starts = torch.zeros(len(lengths), dtype=torch.long)
    for r, row in enumerate(layout):
        column = 0
        for i in row:
            positions[r, column:column + lengths[i]] = torch.arange(lengths[i])
            starts[i] = r * width + column
            column += lengths[i]
        positions[r, column:] = torch.arange(width - column)
    return positions, starts


class Unpadded(NamedTuple):
    """Padded rows [B, T], each one run of real tokens (left-padded prompts and right-padded
    answers), packed into [R, W] for a forward without padding."""

    input_ids: torch.Tensor     # [R, W], 0 in each row's fill
    position_ids: torch.Tensor  # [R, W], from 0 in every sequence and in the fill
    index: torch.Tensor         # [B, T] flat index into [R * W] of each padded position (a
                                # pad's is its row's nearest real token's: finite, masked)

    def padded(self, packed: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] the packed forward's output [R, W, ...] at each padded position."""
        return packed.flatten(0, 1)[self.index]


def unpadded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Unpadded:
    """input_ids [B, T] whose attention_mask [B, T] is one run of ones a row, packed by
    `packed_layout` (one host sync: the lengths)."""
    mask = attention_mask.bool()
    runs = mask[:, :1].sum(-1) + (mask[:, 1:] & ~mask[:, :-1]).sum(-1)   # [B] runs of ones
    counts = torch.stack([mask.sum(-1), mask.int().argmax(-1), runs])     # [3, B]
    lengths, _, runs = counts.tolist()
    if min(lengths) < 1 or max(runs) > 1:
        raise ValueError("unpadded: every row needs one run of real tokens (attention_mask)")
    layout = packed_layout(lengths)
    width, device = max(lengths), input_ids.device
    positions, starts = restarting_positions(layout, lengths, width)
    length, first = counts[0][:, None], counts[1][:, None]
    columns = (torch.arange(input_ids.shape[1], device=device) - first).clamp(min=0)
    index = starts.to(device)[:, None] + torch.minimum(columns, length - 1)
    ids = input_ids.new_zeros(len(layout) * width)
    ids[index[mask]] = input_ids[mask]
    return Unpadded(ids.view(len(layout), width), positions.to(device), index)


# Model types whose transformers forward keeps a packed sequence's attention to itself when
# given restarting position_ids and no attention_mask (transformers.masking_utils), with
# rotary or per-position embeddings read from position_ids: tests/test_packing.py checks each
# against the sequences run apart. OPT derives positions from the attention mask, Bloom's
# ALiBi and others build their own masks: those mix packed sequences, so they are refused.
PACKABLE_MODEL_TYPES = frozenset({
    "falcon", "gemma", "gpt2", "gpt_neox", "llama", "mistral", "phi3", "qwen2", "qwen3"})
PACKABLE_ATTENTION = frozenset({"sdpa", "eager"})


def require_packing(model: torch.nn.Module, flag: str, where: str) -> None:
    """Refuse `flag` (e.g. sft.packing=true) for a model (`where`: its flag and path) whose
    forward would let packed sequences attend to each other."""
    config = hf_model(model).config
    kind, attention = config.model_type, config._attn_implementation
    if kind not in PACKABLE_MODEL_TYPES:
        supported = ", ".join(sorted(PACKABLE_MODEL_TYPES))
        raise UserError(f"{flag}: {where} is of model type {kind}, whose attention would mix "
                        f"packed sequences (packing supports {supported}); "
                        f"set {flag.split('=')[0]}=false")
    if attention not in PACKABLE_ATTENTION:
        raise UserError(f"{flag}: {where} runs {attention} attention; packing is checked with "
                        f"sdpa and eager only; set {flag.split('=')[0]}=false")
