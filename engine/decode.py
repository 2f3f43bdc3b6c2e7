"""Decoding with the inference decoder (engine/inference_modules.py): the token-by-token
loop over its static KV cache, which continues prompts exactly as Hugging Face `generate`
does, and the fixed-shape decode step that, on CUDA, is captured once as a CUDA graph and
replayed for every token (removing the per-kernel launch cost that dominates small-batch
decoding). With group sampling (several answers per prompt, in consecutive rows), each
prompt's prefill is computed once for its group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.generation import OnToken, SamplingSettings, TokenChooser, TokenRule

if TYPE_CHECKING:
    from engine.inference_modules import InferenceDecoder


# Whether every row has ended is read on the host every this many steps, not every step:
# each read waits for the device, while between reads the decode steps queue back to back.
# Steps after the last row ended write only padding, and the answers are cut where Hugging
# Face's would stop.
ENDED_CHECK_EVERY = 16
# At those reads, once half the rows or more have ended, the batch shrinks to the live rows
# (padded to a power of two, at least this many): ended rows stop costing decode work.
COMPACT_MIN_ROWS = 8


@dataclass
class DecodeTimes:
    """A decoder's running totals over its generations: seconds in the prompts' prefills,
    seconds in the decode steps after them, and the decode steps run (a forward of every
    live row each). Device time on CUDA (events, read when a generation has ended)."""

    prefill: float = 0.0
    decode: float = 0.0
    steps: int = 0


def generate(model: InferenceDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             sampling: SamplingSettings, **kwargs) -> torch.Tensor:
    """See `_generate`. Decoding runs in inference mode (less bookkeeping per op); the
    answer is returned as an ordinary tensor, fit for training."""
    return _generate(model, input_ids, attention_mask, sampling, **kwargs).clone()


@torch.inference_mode()
def _generate(model: InferenceDecoder, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              sampling: SamplingSettings, *, eos_token_id: int | list[int], pad_token_id: int,
              row_seeds: torch.Tensor | None = None, on_token: OnToken | None = None,
              static: bool = False, cuda_graph: bool = False, group_size: int = 1
              ) -> torch.Tensor:
    """Continue left-padded prompts as Hugging Face `generate` does (same positions,
    sampling, EOS and padding rules): [B, P] -> [B, P + N], N <= max_new_tokens, pad
    after a row's EOS (one of the ids in a list; an empty list never stops early),
    stopping when every row has ended, or when `on_token` returns true. Decode steps attend
    over the filled part of the cache; `static` (implied by `cuda_graph`) over all of it,
    with fixed shapes, as a CUDA graph needs.

    group_size g: rows come in groups of g consecutive rows holding the same prompt (group
    sampling; the row seeds differ). The prompt's prefill runs once per group, on its first
    row ([B/g, P]), whose KV cache slots are then copied to the rest of the group; the
    decode steps run on all B rows as with g = 1.

    Without `on_token` the loop reads nothing from the device per token (see
    ENDED_CHECK_EVERY): one CUDA graph replay after another; and when rows are sampled
    per row (greedy, or `row_seeds`) it drops ended rows as it goes (COMPACT_MIN_ROWS),
    which changes no row's tokens (but for a longrope model that can switch its angles
    within the generation: they follow the whole batch's largest position)."""
    b, p = input_ids.shape
    _check_groups(input_ids, attention_mask, group_size)
    length = p + sampling.max_new_tokens
    cache = model.cache_for(b, length)
    static = static or cuda_graph
    # a static step attends over the whole capacity: its shapes do not change with P
    width = cache.keys.shape[3] if static else length
    keys, values = cache.view(b, width)
    key_valid, positions, slots, mask = _prompt_layout(attention_mask, width)
    chooser = TokenChooser(sampling, row_seeds, fused=model.fused_kernels)
    # (a new static step runs warm-ups that write one cache slot: before the prefill)
    step = (_StaticDecodeStep.get(model, b, width, cuda_graph, chooser.rule) if static
            else None)
    started = _Mark(input_ids.device)
    if group_size == 1:
        logits = model(input_ids, positions, slots, mask[:, None], keys, values, kv_len=p)
    else:
        logits = _group_prefill(model, input_ids, positions, slots, mask, keys, values,
                                group_size)
    prefilled = _Mark(input_ids.device)
    out = torch.full((b, length), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
    out[:, :p] = input_ids
    batch = _Batch(None, torch.ones(b, dtype=torch.bool, device=input_ids.device), key_valid,
                   attention_mask.long().sum(-1), keys, values, step)
    out, steps = _decode(model, batch, logits, out, p, sampling, width, cuda_graph, chooser,
                         eos_token_id, pad_token_id, on_token,
                         compacts=on_token is None and (row_seeds is not None
                                                        or not sampling.do_sample)
                         and not model.angles_switch_within(length))
    ended = _Mark(input_ids.device)
    model.times.prefill += started.seconds_to(prefilled)
    model.times.decode += prefilled.seconds_to(ended)
    model.times.steps += steps
    return out


@dataclass
class _Batch:
    """The rows a decode step runs on, and their state."""

    rows: torch.Tensor | None     # [b] their rows of the output (None: all, in order)
    unfinished: torch.Tensor      # [b] no EOS yet
    key_valid: torch.Tensor       # [b, width] the cache slots each row attends
    next_position: torch.Tensor   # [b] position of the first answer token
    keys: torch.Tensor            # the cache's views for these rows
    values: torch.Tensor
    step: _StaticDecodeStep | None

    def keep(self, keep: torch.Tensor, model: InferenceDecoder, width: int,
             cuda_graph: bool, chooser: TokenChooser) -> None:
        """Only rows `keep` from now on: their cache rows moved to the front (and the
        chooser's seeds with them)."""
        self.rows = keep if self.rows is None else self.rows[keep]
        self.unfinished, self.key_valid = self.unfinished[keep], self.key_valid[keep]
        self.next_position = self.next_position[keep]
        whole_keys, whole_values = self.keys, self.values
        self.keys, self.values = model.cache.view(len(keep), width)
        self.keys.copy_(whole_keys[:, keep])
        self.values.copy_(whole_values[:, keep])
        chooser.keep(keep)
        if self.step is not None:
            self.step = _StaticDecodeStep.get(model, len(keep), width, cuda_graph,
                                              chooser.rule)


def _decode(model: InferenceDecoder, batch: _Batch, logits: torch.Tensor, out: torch.Tensor,
            p: int, sampling: SamplingSettings, width: int, cuda_graph: bool,
            chooser: TokenChooser, eos_token_id: int | list[int], pad_token_id: int,
            on_token: OnToken | None, compacts: bool) -> tuple[torch.Tensor, int]:
    """The token loop after the prefill (see _generate): the answers in `out` [B, P + N],
    and the decode steps run. Step t writes its token, then runs it through the model,
    which chooses step t + 1's (inside the captured step, where the token rule allows)."""
    n, device = sampling.max_new_tokens, out.device
    eos = torch.tensor(eos_token_id, dtype=torch.long, device=device)   # 0-d or [E]
    cache_slots = torch.arange(p, p + n, device=device)             # step t writes slot p + t
    ended_at = torch.tensor(n - 1, device=device)   # the step every row had ended by
    if n == 0:
        return out[:, :p], 0
    chosen = chooser(logits, 0)                    # the first token, from the prefill
    for t in range(n):
        token = chosen.masked_fill(~batch.unfinished, pad_token_id)
        if batch.rows is None:
            out[:, p + t] = token
        else:
            out[batch.rows, p + t] = token
        batch.unfinished &= ~torch.isin(token, eos)
        if on_token is not None:   # a caller that sees every token: stop exactly, per token
            if on_token(token) or t == n - 1 or not bool(batch.unfinished.any()):
                chooser.check()
                return out[:, :p + t + 1], t
        else:
            ended_at = torch.where((ended_at == n - 1) & ~batch.unfinished.any(), t, ended_at)
            live = int(batch.unfinished.sum()) if (t + 1) % ENDED_CHECK_EVERY == 0 else -1
            if t == n - 1 or live == 0:
                chooser.check()
                return out[:, :p + int(ended_at) + 1], t
            if compacts and 0 < live <= len(token) // 2 and len(token) > COMPACT_MIN_ROWS:
                keep = _rows_to_keep(batch.unfinished, live)
                token = token[keep]
                batch.keep(keep, model, width, cuda_graph, chooser)
        batch.key_valid[:, p + t] = True
        slot, positions = cache_slots[t:t + 1], batch.next_position + t
        if p + t == model.spec.long_rope_from:   # longrope's switch: see _long_rope_prefill
            chosen = chooser(_long_rope_prefill(model, out[:, :p + t + 1], batch), t + 1)
        elif batch.step is not None:
            chosen = batch.step.next_tokens(token, positions, slot, batch.key_valid, chooser,
                                            t + 1)
        else:
            chosen = chooser(model(token[:, None], positions[:, None], slot,
                                   batch.key_valid[:, None, None, :p + t + 1], batch.keys,
                                   batch.values, kv_len=p + t + 1), t + 1)
    raise AssertionError("unreachable: step n - 1 returns")


def _long_rope_prefill(model: InferenceDecoder, tokens: torch.Tensor, batch: _Batch
                       ) -> torch.Tensor:
    """The forward of every token so far ([B, L], the last one new) as one prefill, its
    keys and values written over the cache's: Hugging Face's Phi-3 recomputes its cache so
    when the sequence first passes original_max_position_embeddings, so that every key
    takes the long factors' angles (the prefill's largest position passes the switch).
    Returns the last token's logits [B, V]. The batch keeps its rows (no compaction)."""
    length = tokens.shape[1]
    _, positions, slots, mask = _prompt_layout(batch.key_valid[:, :length].long(), length)
    return model(tokens, positions, slots, mask[:, None], batch.keys, batch.values,
                 kv_len=length)


class _Mark:
    """A point in a generation: an event on the device's stream on CUDA (no host sync until
    a span is read, once the generation has ended), the host's clock elsewhere."""

    def __init__(self, device: torch.device):
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        self.at = time.perf_counter()

    def seconds_to(self, later: _Mark) -> float:
        if self.event is None:
            return later.at - self.at
        later.event.synchronize()
        return self.event.elapsed_time(later.event) / 1e3


def _rows_to_keep(unfinished: torch.Tensor, live: int) -> torch.Tensor:
    """The `live` unfinished rows' indices, in order, then ended rows up to a power of two
    (at least COMPACT_MIN_ROWS) rows: batch sizes (and captured graphs) stay few."""
    size = max(COMPACT_MIN_ROWS, 1 << (live - 1).bit_length())
    order = torch.argsort((~unfinished).to(torch.int8), stable=True)   # live rows first
    return order[:size]


def _prompt_layout(attention_mask: torch.Tensor, width: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For left-padded prompts ([B, P] mask) and a cache `width` slots wide: the key slots
    a query may attend ([B, width]: real prompt tokens, then each answer slot once written),
    the prompt's positions ([B, P], as HF generate gives them), its slots ([P]) and the
    prefill's attention mask ([B, P, P]: causal over real tokens, and a pad token attends
    to itself, so that no row of the softmax is empty)."""
    b, p = attention_mask.shape
    prompt_mask, device = attention_mask.bool(), attention_mask.device
    key_valid = torch.zeros(b, width, dtype=torch.bool, device=device)
    key_valid[:, :p] = prompt_mask
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(~prompt_mask, 1)
    slots = torch.arange(p, device=device)
    causal = slots[None, :] <= slots[:, None]                          # [P, P]
    mask = (key_valid[:, None, :p] & causal) | torch.eye(p, dtype=torch.bool, device=device)
    return key_valid, positions, slots, mask


def _check_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, g: int) -> None:
    """Raise ValueError unless the [B, P] rows form groups of g identical prompts."""
    b = input_ids.shape[0]
    if g < 1 or b % g:
        raise ValueError(f"group_size {g} does not divide the batch of {b} rows")
    for rows in (input_ids, attention_mask):
        grouped = rows.unflatten(0, (-1, g))                      # [B/g, g, P]
        if g > 1 and not torch.equal(grouped[:, 1:], grouped[:, :-1]):
            raise ValueError(f"group_size {g}: the rows of a group hold different prompts")


def _group_prefill(model: InferenceDecoder, input_ids: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, g: int) -> torch.Tensor:
    """The prefill of each group's first row, written to that row's own cache row (a
    strided view: rows 0, g, 2g, ...), then copied into the prompt slots of the group's
    other rows. input_ids, positions: [B, P]; mask: [B, P, P]; keys, values:
    [layers, B, Hkv, S, d] -> logits [B, V]."""
    p = input_ids.shape[1]
    first = slice(None, None, g)
    logits = model(input_ids[first], positions[first], slots, mask[first, None],
                   keys[:, first], values[:, first], kv_len=p)              # [B/g, V]
    for cache in (keys, values):
        grouped = cache[:, :, :, :p].unflatten(1, (-1, g))   # [L, B/g, g, Hkv, P, d]
        # from a clone: source and destination share the cache's storage, and an in-place
        # copy between overlapping ranges is not guaranteed to read before it writes
        source = grouped[:, :, :1].clone()
        grouped[:, :, 1:].copy_(source.expand_as(grouped[:, :, 1:]))
    return logits.repeat_interleave(g, dim=0)


class _StaticDecodeStep:
    """One decode step with fixed shapes: attention over the whole static cache, inputs
    copied into fixed buffers, and the next token chosen from its logits by the token rule
    (when `rule.capturable`; else the logits are returned). On CUDA it is captured once as
    a graph and replayed per token; elsewhere it runs eagerly (which is how the CPU tests
    check what is captured)."""

    def __init__(self, model: InferenceDecoder, batch: int, length: int, capture: bool,
                 rule: TokenRule):
        device = model.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        # warm-ups write the last slot, which no call reads before writing it itself (it is
        # masked until then)
        self.slot = torch.full((1,), length - 1, dtype=torch.long, device=device)
        # the warm-up query sees only itself: a row with nothing to attend would turn its
        # keys and values into NaN, which even a masked slot passes on (0 * NaN)
        self.key_valid = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=device)
        self.key_valid[..., length - 1] = True
        self.rule = rule if rule.capturable else None
        self.seeds = torch.zeros(batch, dtype=torch.long, device=device)
        self.step_index = torch.zeros((), dtype=torch.long, device=device)
        self.seeds_of: torch.Tensor | None = None   # the seeds in `seeds`

        def run() -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
            # the cache's views taken when run (a graph keeps those of its capture): the
            # step holds no reference that would keep a freed cache's memory (KVCache.free)
            keys, values = model.cache.view(batch, length)
            logits = model(self.tokens, self.positions, self.slot, self.key_valid, keys,
                           values)
            if self.rule is None:
                return logits
            return self.rule(logits, self.step_index,
                             self.seeds if self.rule.row_seeded else None)

        self.run, self.graph = run, None
        if not capture:
            run()   # the warm-up a capture does, so that CPU tests see its cache writes too
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # warm-up outside the graph, as capture needs
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = run()

    @staticmethod
    def get(model: InferenceDecoder, batch: int, length: int, capture: bool, rule: TokenRule
            ) -> _StaticDecodeStep:
        """The step for these shapes and this token rule, kept with the cache (captured
        graphs read its memory and the weights', so they stay valid while both are kept)."""
        key, steps = (batch, length, capture, rule), model.cache.static_steps
        if key not in steps:
            steps[key] = _StaticDecodeStep(model, batch, length, capture, rule)
            model.steps_built += 1
        return steps[key]

    def __call__(self, token: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                 key_valid: torch.Tensor):
        """The outputs of `run` for these inputs, valid until the next call."""
        self.tokens.copy_(token[:, None])
        self.positions.copy_(positions[:, None])
        self.slot.copy_(slot)
        self.key_valid.copy_(key_valid[:, None, None])
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.outputs

    def next_tokens(self, token: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                    key_valid: torch.Tensor, chooser: TokenChooser, step: int
                    ) -> torch.Tensor:
        """[B] tokens chosen for answer step `step` after running `token` [B] through the
        model (valid until the next call): inside the step when its rule is captured (the
        step index, and the chooser's seeds when new, copied into its buffers first), else
        by the chooser from the returned logits."""
        if self.rule is None:
            return chooser(self(token, positions, slot, key_valid), step)
        if chooser.row_seeds is not None and chooser.row_seeds is not self.seeds_of:
            self.seeds.copy_(chooser.row_seeds)   # once a batch (a chooser's seeds are its
            self.seeds_of = chooser.row_seeds     # own copy, replaced when rows are dropped)
        self.step_index.fill_(step)
        tokens, bad = self(token, positions, slot, key_valid)
        chooser.note(bad)
        return tokens
