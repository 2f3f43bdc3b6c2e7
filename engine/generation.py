"""Sampling answers from a causal LM through Hugging Face generate, and the token choice
rule that the inference decoder's own decoding loop (engine/decode.py) shares with it.

Sampling is row-seeded: the noise that picks row b's t-th token is a hash of
(row_seeds[b], t, token id), drawn through the Gumbel-max trick. A row's answer then does
not depend on which other rows share its batch, how the batch is padded or split over
ranks, or what ran before: one process and N ranks sample the same answers, and a resumed
run samples what the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import kernels
from engine.errors import NonFiniteError
from engine.parallel import hf_model

# a per-step callback (streaming): called with the [B] tokens chosen at each step, pad after
# a row's end; a true return ends generation there
OnToken = Callable[[torch.Tensor], bool | None]


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0 = off
    do_sample: bool = True


# splitmix64's constants, as the signed int64 values torch computes with (each is >= 2**63)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijective int64 hash (multiplication wraps around)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def row_uniforms(row_seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1), a pure function of (row seed, step, token id)."""
    key = _mix(row_seeds.long() * _GOLDEN + step)                       # [B]
    tokens = torch.arange(vocab, device=row_seeds.device, dtype=torch.long)
    bits = _shift_right(_mix(key[:, None] + tokens * _GOLDEN), 40)      # 24 random bits
    return (bits.float() + 0.5) / float(1 << 24)


def _warpers(sampling: SamplingSettings) -> list[LogitsProcessor]:
    """Hugging Face's own warpers, in generate's order, so both decoding paths agree."""
    warpers = [TemperatureLogitsWarper(sampling.temperature)]
    if sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def _gumbel_scores(scores: torch.Tensor, row_seeds: torch.Tensor, step: int) -> torch.Tensor:
    uniforms = row_uniforms(row_seeds.to(scores.device), step, scores.shape[-1])
    return torch.log_softmax(scores, dim=-1) - torch.log(-torch.log(uniforms))


class RowSeededSampling(LogitsProcessor):
    """Temperature / top-k / top-p, then Gumbel noise from `row_uniforms`: the argmax that
    greedy decoding takes is then a sample from the warped distribution."""

    def __init__(self, sampling: SamplingSettings, row_seeds: torch.Tensor, prompt_len: int):
        self.row_seeds, self.prompt_len = row_seeds, prompt_len
        self.warpers = _warpers(sampling)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float()
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        return _gumbel_scores(scores, self.row_seeds, input_ids.shape[1] - self.prompt_len)


def _nonfinite(scores: torch.Tensor) -> torch.Tensor:
    """0-d bool: `scores` hold a NaN or +inf (-inf is a masked-out token, which is fine)."""
    return torch.isnan(scores).any() | torch.isposinf(scores).any()


def _refuse_nonfinite() -> NonFiniteError:
    return NonFiniteError("generation: the model's next-token scores hold NaN or inf, so no "
                          "token can be sampled; its weights or inputs went non-finite")


class RefuseNonFinite(LogitsProcessor):
    """Stops `generate` with a NonFiniteError on NaN or +inf scores (generate waits for the
    device every step anyway, so checking each step costs nothing extra)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if bool(_nonfinite(scores)):
            raise _refuse_nonfinite()
        return scores


@dataclass(frozen=True)
class TokenRule:
    """How each row's next token is chosen from fp32 logits [B, V], exactly as Hugging
    Face `generate` picks it under the same settings: argmax when greedy; with sampling,
    the warpers, then row-seeded Gumbel-max (`row_seeded`) or `torch.multinomial` on
    torch's global generator (same draws as generate's). `fused`: row-seeded sampling at a
    temperature alone (no top-k/top-p) runs as one Triton kernel
    (engine.kernels.row_seeded_sample), the same tokens but for fp32 rounding ties.

    Settings only, no state: a CUDA graph captures it once (engine/decode.py) and replays
    it with each call's seeds and step in its buffers."""

    sampling: SamplingSettings
    row_seeded: bool
    fused: bool

    @classmethod
    def of(cls, sampling: SamplingSettings, row_seeded: bool, fused: bool) -> TokenRule:
        sampling = replace(sampling, max_new_tokens=0)   # not a setting of the choice
        return cls(sampling, row_seeded, fused and sampling.do_sample and row_seeded
                   and sampling.top_k == 0 and sampling.top_p == 1.0)

    @property
    def capturable(self) -> bool:
        """Replayable in a CUDA graph: no draws from torch's global generator."""
        return not self.sampling.do_sample or self.row_seeded

    def __call__(self, logits: torch.Tensor, step: int | torch.Tensor,
                 row_seeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> ([B] tokens, 0-d bool: the logits hold a NaN or +inf). step: the answer
        token's index, an int or a 0-d long tensor on the logits' device."""
        if self.fused:
            return kernels.row_seeded_sample(logits, row_seeds, step,
                                             self.sampling.temperature)
        bad = _nonfinite(logits)
        if not self.sampling.do_sample:
            return logits.argmax(-1), bad
        for warp in _warpers(self.sampling):
            logits = warp(None, logits)
        if self.row_seeded:
            return _gumbel_scores(logits, row_seeds, step).argmax(-1), bad
        return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1).squeeze(1), bad


class TokenChooser:
    """A TokenRule applied step after step to one batch: it holds the rows' seeds (`keep`
    follows the batch as engine/decode.py drops ended rows) and notes non-finite logits
    on the device, refused by `check()`, which the decoder calls once the answers are
    complete (no host sync per token)."""

    def __init__(self, sampling: SamplingSettings, row_seeds: torch.Tensor | None = None, *,
                 fused: bool = False):
        self.rule = TokenRule.of(sampling, sampling.do_sample and row_seeds is not None, fused)
        # a copy: the caller's tensor may change after, and a decode step keeps the one it
        # loaded into its buffer (engine/decode.py)
        self.row_seeds = row_seeds.clone() if self.rule.row_seeded else None
        self.saw_nonfinite: torch.Tensor | None = None

    def keep(self, rows: torch.Tensor) -> None:
        """The batch now holds these of its rows."""
        if self.row_seeds is not None:
            self.row_seeds = self.row_seeds.to(rows.device)[rows]

    def note(self, bad: torch.Tensor) -> None:
        """Add a step's 0-d `bad` (a new tensor: a captured graph's output is overwritten
        by its next replay)."""
        self.saw_nonfinite = bad.clone() if self.saw_nonfinite is None else (
            self.saw_nonfinite | bad)

    def check(self) -> None:
        """Raise NonFiniteError if any logits chosen from so far were NaN or +inf."""
        if self.saw_nonfinite is not None and bool(self.saw_nonfinite):
            raise _refuse_nonfinite()

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        if self.row_seeds is not None:
            self.row_seeds = self.row_seeds.to(logits.device)   # once: no copy per token
        token, bad = self.rule(logits, step, self.row_seeds)
        self.note(bad)
        return token


class _OnToken(StoppingCriteria):
    """`OnToken` as a stopping criterion, which generate calls once per step, after
    appending the step's tokens; a true return stops every row."""

    def __init__(self, on_token: OnToken):
        self.on_token = on_token

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        stop = bool(self.on_token(input_ids[:, -1]))
        return torch.full(input_ids.shape[:1], stop, dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             sampling: SamplingSettings, *, eos_token_id: int | list[int], pad_token_id: int,
             row_seeds: torch.Tensor | None = None, synced: bool | None = None,
             on_token: OnToken | None = None) -> torch.Tensor:
    """Continue left-padded prompts. With several ranks, every rank keeps stepping until
    all have finished (transformers' `synced_gpus`), so the all-gathers of a sharded
    model's weights always pair up, whatever each rank's answer lengths; `synced=False`
    turns that off for a model every rank holds whole.

    Args:
        input_ids, attention_mask: [B, P], prompts left-padded.
        row_seeds: [B] int seeds for row-seeded sampling (see the module docstring); None
            samples from torch's global generator.
        on_token: see `OnToken`.
    Returns:
        [B, P + N] sequences, N <= max_new_tokens; after a row's EOS come pad tokens.
    """
    row_seeded = sampling.do_sample and row_seeds is not None
    native_sampling = sampling.do_sample and not row_seeded
    config = GenerationConfig(
        max_new_tokens=sampling.max_new_tokens, do_sample=native_sampling,
        temperature=sampling.temperature if native_sampling else None,
        top_p=sampling.top_p if native_sampling else None,
        top_k=sampling.top_k if native_sampling else None,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    processors = LogitsProcessorList(
        [RefuseNonFinite()]
        + ([RowSeededSampling(sampling, row_seeds, input_ids.shape[1])] if row_seeded else []))
    stopping = StoppingCriteriaList([_OnToken(on_token)] if on_token is not None else [])
    was_training, inner = model.training, hf_model(model)
    # transformers fills what `config` leaves unset from the model's own generation config
    # (a checkpoint's generation_config.json: Qwen2's repetition_penalty, say), which
    # neither the inference decoder nor the log-probs know of: generate under a blank one
    saved, inner.generation_config = inner.generation_config, GenerationConfig()
    model.eval()
    try:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              generation_config=config, logits_processor=processors,
                              stopping_criteria=stopping,
                              synced_gpus=synced if synced is not None
                              else dist.is_initialized() and dist.get_world_size() > 1)
    finally:
        inner.generation_config = saved
        model.train(was_training)
