"""Preference pairs to token ids and padded batches.

`apply_chat_template` re-renders pairs by a tokenizer's chat template (data.apply_chat_template).
`tokenize_sft` / `tokenize_pairs` / `tokenize_prompts` make token-id lists (the prompt with
the tokenizer's special tokens, the answer + EOS), counting what they drop or cut; the
`collate_*` functions pad them into tensors (right padding for training, left padding for
generation prompts). The reward model scores `prompt + answer + EOS`: the convention
`tokenize_pairs` trains it on, and step 3 scores rollouts the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from jinja2 import TemplateError
from torch import Tensor

from engine.chat_format import hh_messages, hh_reply_spans, render, written_reply
from engine.models import prompt_ids
from engine.packing import packed_layout, restarting_positions
from steps.data import DataError, PreferencePair

IGNORE_INDEX = -100


class SFTExample(NamedTuple):
    input_ids: list[int]   # prompt + answer token ids
    labels: list[int]      # the same length, -100 over the prompt


class PairExample(NamedTuple):
    chosen_ids: list[int]     # prompt + chosen answer token ids
    rejected_ids: list[int]   # prompt + rejected answer token ids
    margin: float = 0.0       # the pair's margin (data.margin_key)


class DPOExample(NamedTuple):
    prompt_len: int           # the prompt's tokens at the head of both rows
    chosen_ids: list[int]     # prompt + chosen answer token ids
    rejected_ids: list[int]   # prompt + rejected answer token ids
    ref_chosen: float = 0.0   # the answers' log-probs under the reference (filled before training)
    ref_rejected: float = 0.0
    # KTO (dpo.loss=kto): the prompt + another pair's chosen answer, a mismatched row whose
    # log-ratio estimates the KL reference point; empty for the other losses
    kl_ids: tuple[int, ...] = ()
    ref_kl: float = 0.0       # its log-prob under the reference

    REFERENCE_FIELDS = ("ref_chosen", "ref_rejected")   # the reference's log-probs, by answer

    @property
    def first_row(self) -> list[int]:
        """The prompt and an answer (the chosen one)."""
        return self.chosen_ids

    @property
    def tokens(self) -> int:
        """The tokens of its rows."""
        return len(self.chosen_ids) + len(self.rejected_ids)

    @property
    def taught_tokens(self) -> int:
        """The chosen answer's predicted tokens, dpo.nll_coef's (a row's first token is
        predicted by none)."""
        return len(self.chosen_ids) - max(self.prompt_len, 1)


class FeedbackExample(NamedTuple):
    prompt_len: int           # the prompt's tokens at the head of the row
    ids: list[int]            # prompt + answer token ids
    desirable: bool           # the answer's label (a thumbs up or down)
    ref_logp: float = 0.0     # the answer's log-prob under the reference (filled before training)
    # the prompt + another record's answer, the mismatched row whose log-ratio estimates
    # KTO's reference point
    kl_ids: tuple[int, ...] = ()
    ref_kl: float = 0.0       # its log-prob under the reference

    REFERENCE_FIELDS = ("ref_logp",)

    @property
    def first_row(self) -> list[int]:
        return self.ids

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def taught_tokens(self) -> int:
        """The answer's predicted tokens where it is desirable (dpo.nll_coef's), else 0."""
        return len(self.ids) - max(self.prompt_len, 1) if self.desirable else 0


class TokenizeStats(NamedTuple):
    kept: int                  # examples returned
    dropped_long_prompt: int   # examples dropped: the prompt is longer than max_prompt_len
    truncated_answer: int      # answers of kept examples cut to max_answer_len (a pair: 0-2)
    dropped_empty_prompt: int = 0   # step-3 prompts dropped: 0 tokens, nothing to generate from
    dropped_tied: int = 0      # step-2 pairs dropped: chosen and rejected the same tokens
    earlier_replies: int = 0   # sft.multiturn: a dialogue's replies before its answer, trained on
    unplaced_replies: int = 0  # sft.multiturn: such replies not trained on (see reply_spans)


# ---------------------------------------------------------------------------------------------
# Chat templates


def apply_chat_template(pairs: Sequence[PreferencePair], tokenizer: Any, owner: str
                        ) -> tuple[list[PreferencePair], int]:
    """`pairs` as `tokenizer`'s chat template writes them (`owner`, e.g. "--actor-model X",
    names it in errors): the prompt is the dialogue's messages (the record's own, or its hh
    text read back) with the template's generation prompt; an answer is what the template
    writes after that prompt for the assistant's message, trailing whitespace dropped, so
    it ends with the turn's end token (e.g. <|im_end|>, then not doubled where it is the
    EOS). Returns (pairs, dialogues skipped because the template refuses them, e.g. roles
    that do not alternate, or cannot write them as a prompt and its reply)."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"data.apply_chat_template=true: the tokenizer of {owner} has no chat "
                        "template; use a model whose tokenizer has one, or "
                        "data.apply_chat_template=false (the hh-rlhf format)")
    rendered, refused = [], []
    for pair in pairs:
        messages = list(pair.messages) if pair.messages is not None else hh_messages(pair.prompt)
        try:
            prompt = render(tokenizer, messages, generation_prompt=True)
            answers = [_templated_answer(tokenizer, messages, prompt, answer)
                       for answer in (pair.chosen, pair.rejected)]
        except TemplateError as err:
            refused.append(str(err))
            continue
        rendered.append(PreferencePair(prompt, *answers, tuple(messages), label=pair.label,
                                       margin=pair.margin))
    if refused and not rendered:
        raise DataError(f"data.apply_chat_template: the chat template of {owner} refuses all "
                        f"{len(refused)} dialogues (first: {refused[0]}); fix the data or use "
                        "data.apply_chat_template=false")
    return rendered, len(refused)


def _templated_answer(tokenizer: Any, messages: list[dict], prompt: str, answer: str) -> str:
    """engine.chat_format.written_reply for the assistant's `answer` (hh text: one leading
    space dropped); a TemplateError refuses the dialogue. No `answer` (a step-3 prompt of
    ppo.prompt_data) is nothing to write: the prompt alone is what step 3 generates from."""
    if not answer:
        return ""
    return written_reply(tokenizer, messages, prompt, answer.removeprefix(" "))


# ---------------------------------------------------------------------------------------------
# Tokenizing


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        name = getattr(tokenizer, "name_or_path", type(tokenizer).__name__)
        raise DataError(f"tokenizer {name} has no eos_token_id; answers need an "
                        "end-of-sequence token (set tokenizer.eos_token)")
    return int(eos)


def _following(prompts: list[str], bare: list[list[int]], answers: list[str],
               tokenizer: Any) -> list[list[int]]:
    """Each answer's token ids as they follow its prompt: the tail of prompt + answer
    tokenized together, wherever the prompt's own ids (`bare`: without special tokens) are
    its head (else the answer alone).
    Tokenized alone, an answer gets what a tokenizer puts at the start of every text:
    SentencePiece's Llama-2 and Mistral prepend a space marker, so every answer would start
    with a spurious "▁" token that generating after the prompt never makes (and decode to
    a double space); the reward model would be scored on texts tokenized otherwise."""
    joint = tokenizer([p + a for p, a in zip(prompts, answers, strict=True)],
                      add_special_tokens=False)["input_ids"]
    ids = [whole[len(head):] if whole[:len(head)] == head else None
           for head, whole in zip(bare, joint, strict=True)]
    apart = [i for i, found in enumerate(ids) if found is None]
    if apart:
        alone = tokenizer([answers[i] for i in apart], add_special_tokens=False)["input_ids"]
        for i, answer in zip(apart, alone, strict=True):
            ids[i] = answer
    return ids


def _answer_ids(following: list[list[int]], eos_id: int, max_answer_len: int,
                keep_eos: bool = False) -> tuple[list[list[int]], list[bool]]:
    """answer ids (as they follow their prompts) + [eos] unless the answer's text ends in it
    already (a second would teach to stop twice), cut to max_answer_len tokens (`keep_eos`:
    the cut answer still ends in EOS); returns (ids, was_truncated)."""
    ids = [a if a[-1:] == [eos_id] else a + [eos_id] for a in following]
    end = [eos_id] if keep_eos else []
    cut = [a if len(a) <= max_answer_len else a[:max_answer_len - len(end)] + end for a in ids]
    return cut, [len(a) > max_answer_len for a in ids]


def _examples(pairs: Sequence[PreferencePair], tokenizer: Any, max_prompt_len: int,
              max_answer_len: int, sides: tuple[str, ...], make: Callable[..., Any],
              keep_eos: bool = False, drop_empty: bool = False, drop_tied: bool = False
              ) -> tuple[list, TokenizeStats]:
    """`make(pair, prompt ids, *answer ids)` for every pair whose prompt (with the tokenizer's special
    tokens, e.g. BOS) fits in max_prompt_len tokens, the answers being its `sides` ("chosen",
    "rejected") + EOS, each cut to max_answer_len tokens (truncated_answer counts the answers
    cut). `drop_empty`: prompts of 0 tokens (an empty prompt with a tokenizer that
    adds no BOS) are dropped and counted too; `drop_tied`: so are pairs whose answers are
    the same ids once cut. The tokenizer needs an EOS even with no sides: generation stops
    on it."""
    if max_prompt_len < 1 or max_answer_len < 1:
        raise ValueError(f"max_prompt_len and max_answer_len must be >= 1, got {max_prompt_len}, "
                         f"{max_answer_len}")
    eos = _eos_id(tokenizer)
    if not pairs:   # tokenizers refuse an empty batch
        return [], TokenizeStats(0, 0, 0)
    texts = [p.prompt for p in pairs]
    prompts, bare = prompt_ids(texts, tokenizer)
    answers = [_answer_ids(_following(texts, bare, [getattr(p, side) for p in pairs],
                                      tokenizer), eos, max_answer_len, keep_eos)
               for side in sides]
    empty = sum(not prompt for prompt in prompts) if drop_empty else 0
    long = sum(len(prompt) > max_prompt_len for prompt in prompts)
    kept = [i for i, prompt in enumerate(prompts)
            if len(prompt) <= max_prompt_len and (prompt or not drop_empty)]
    tied = {i for i in kept if drop_tied and len({tuple(ids[i]) for ids, _ in answers}) == 1}
    kept = [i for i in kept if i not in tied]
    examples = [make(pairs[i], prompts[i], *(ids[i] for ids, _ in answers)) for i in kept]
    truncated = sum(was_cut[i] for _, was_cut in answers for i in kept)
    return examples, TokenizeStats(len(kept), long, truncated, empty, len(tied))


def tokenize_sft(pairs: Sequence[PreferencePair], tokenizer: Any, max_prompt_len: int,
                 max_answer_len: int, train_on_prompt: bool = False, multiturn: bool = False,
                 templated: bool = False) -> tuple[list[SFTExample], TokenizeStats]:
    """SFT examples from the chosen answers: input_ids = prompt ids + answer ids (+ EOS),
    labels = -100 over the prompt (`train_on_prompt`: its ids, as input_ids) and the answer
    ids over the answer. `multiturn`: the labels are the ids over the dialogue's earlier
    assistant replies in the prompt too (as `templated` prompts, or hh text, write them:
    reply_spans), counted in the stats, with those not found in the prompt's tokens."""
    placed = unplaced = 0

    def example(pair: PreferencePair, prompt: list[int], answer: list[int]) -> SFTExample:
        nonlocal placed, unplaced
        if train_on_prompt:
            return SFTExample(prompt + answer, prompt + answer)
        shown = [IGNORE_INDEX] * len(prompt)
        if multiturn:
            spans = reply_spans(pair, prompt, tokenizer, templated)
            for start, end in filter(None, spans):
                shown[start:end] = prompt[start:end]
            placed += sum(span is not None for span in spans)
            unplaced += sum(span is None for span in spans)
        return SFTExample(prompt + answer, shown + answer)

    examples, stats = _examples(pairs, tokenizer, max_prompt_len, max_answer_len, ("chosen",),
                                example)
    return examples, stats._replace(earlier_replies=placed, unplaced_replies=unplaced)


def reply_spans(pair: PreferencePair, prompt: list[int], tokenizer: Any, templated: bool
                ) -> list[tuple[int, int] | None]:
    """[start, end) in `prompt` (pair.prompt's ids, with special tokens) of each assistant
    reply in the dialogue before its answer: in a chat template's prompt (`templated`), what
    the template writes for the reply, the end of its turn included (<|im_end|>); in hh text,
    the reply after its "Assistant:". None for a reply the prompt does not hold as so
    written (a template that drops earlier replies' reasoning, say) or whose tokens the
    rest of the prompt merges into others."""
    text = pair.prompt
    if templated:
        messages = list(pair.messages) if pair.messages is not None else hh_messages(text)
        chars = []
        for j, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                before = render(tokenizer, messages[:j], generation_prompt=True)
                reply = written_reply(tokenizer, messages[:j], before, message["content"])
            except TemplateError:
                chars.append(None)
                continue
            found = reply and text.startswith(before + reply)
            chars.append((len(before), len(before) + len(reply)) if found else None)
    else:
        chars = hh_reply_spans(text)
    if not any(chars):
        return chars
    bare = tokenizer(text, add_special_tokens=False)["input_ids"]
    offset = len(prompt) - len(bare)   # the special tokens before the text's own
    if offset < 0 or prompt[offset:] != bare:
        return [None] * len(chars)
    heads = tokenizer([text[:end] for span in filter(None, chars) for end in span],
                      add_special_tokens=False)["input_ids"]
    spans, ends = [], iter(zip(heads[::2], heads[1::2], strict=True))
    for span in chars:
        if span is None:
            spans.append(None)
            continue
        before, through = next(ends)
        held = (bare[:len(through)] == through and through[:len(before)] == before
                and len(through) > len(before))
        spans.append((offset + len(before), offset + len(through)) if held else None)
    return spans


def tokenize_pairs(pairs: Sequence[PreferencePair], tokenizer: Any, max_prompt_len: int,
                   max_answer_len: int, drop_tied: bool = False
                   ) -> tuple[list[PairExample], TokenizeStats]:
    """Reward-model examples: chosen_ids = prompt ids + chosen answer ids + EOS, rejected_ids
    likewise; a cut answer keeps its EOS, so the model always reads a score at EOS (where
    step 3 reads it: steps/scoring.py). `drop_tied`: drop (and count) pairs whose answers
    are the same ids, e.g. answers that differ only past max_answer_len: they teach no
    preference, and a tie counts as wrong in the accuracy."""
    return _examples(pairs, tokenizer, max_prompt_len, max_answer_len, ("chosen", "rejected"),
                     lambda pair, prompt, chosen, rejected: PairExample(
                         prompt + chosen, prompt + rejected, pair.margin or 0.0),
                     keep_eos=True, drop_tied=drop_tied)


def tokenize_preferences(pairs: Sequence[PreferencePair], tokenizer: Any, max_prompt_len: int,
                         max_answer_len: int) -> tuple[list[PairExample], TokenizeStats]:
    """Step 2's training and evaluation pairs: tokenize_pairs without the tied ones."""
    return tokenize_pairs(pairs, tokenizer, max_prompt_len, max_answer_len, drop_tied=True)


def tokenize_dpo(pairs: Sequence[PreferencePair], tokenizer: Any, max_prompt_len: int,
                 max_answer_len: int) -> tuple[list[DPOExample], TokenizeStats]:
    """DPO examples: the prompt ids and both answers' (+ EOS, as step 1 trains them: a cut
    answer keeps no EOS, so no ending is taught where the text went on); pairs whose answers
    are the same ids once cut are dropped and counted (their log-ratios cancel)."""
    return _examples(pairs, tokenizer, max_prompt_len, max_answer_len, ("chosen", "rejected"),
                     lambda pair, prompt, chosen, rejected: DPOExample(
                         len(prompt), prompt + chosen, prompt + rejected),
                     drop_tied=True)


def tokenize_feedback(records: Sequence[PreferencePair], tokenizer: Any, max_prompt_len: int,
                      max_answer_len: int) -> tuple[list[FeedbackExample], TokenizeStats]:
    """KTO's unpaired examples (data.feedback_path's records: the answer in `chosen`, its
    label a bool): the prompt ids and the answer's (+ EOS, cut as tokenize_dpo cuts)."""
    return _examples(records, tokenizer, max_prompt_len, max_answer_len, ("chosen",),
                     lambda record, prompt, answer: FeedbackExample(
                         len(prompt), prompt + answer, bool(record.label)))


def tokenize_prompts(pairs: Sequence[PreferencePair], tokenizer: Any, max_prompt_len: int
                     ) -> tuple[list[list[int]], TokenizeStats]:
    """PPO prompts: the prompt ids (with special tokens) of every pair whose prompt fits in
    max_prompt_len tokens; longer prompts, and prompts of 0 tokens (there is nothing to
    generate from), are dropped and counted. SFT and reward-model examples keep theirs:
    an answer alone is still text to learn and to score."""
    return _examples(pairs, tokenizer, max_prompt_len, 1, (), lambda _, prompt: prompt,
                     drop_empty=True)


# ---------------------------------------------------------------------------------------------
# Collating


def _pad(rows: Sequence[Sequence[int]], value: int, left: bool = False) -> Tensor:
    """Stack int lists into a LongTensor [len(rows), max_len], padding with `value`."""
    if not rows:
        raise ValueError("cannot collate an empty batch")
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, row in enumerate(rows):
        start = width - len(row) if left else 0
        out[i, start:start + len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def _mask(rows: Sequence[Sequence[int]], left: bool = False) -> Tensor:
    """attention_mask [len(rows), max_len]: 1 on real tokens, 0 on padding."""
    return _pad([[1] * len(r) for r in rows], 0, left=left)


def collate_sft(batch: list[SFTExample], pad_token_id: int) -> dict[str, Tensor]:
    """Right-padded input_ids [B,T], attention_mask [B,T], labels [B,T] (-100 on padding)."""
    ids = [ex.input_ids for ex in batch]
    return {"input_ids": _pad(ids, pad_token_id), "attention_mask": _mask(ids),
            "labels": _pad([ex.labels for ex in batch], IGNORE_INDEX)}


def collate_pairs(batch: list[PairExample], pad_token_id: int) -> dict[str, Tensor]:
    """input_ids [2B,T] = all chosen rows then all rejected rows, right padded to the longest of
    either; attention_mask [2B,T]; margins [B] where a pair has one (data.margin_key)."""
    ids = [ex.chosen_ids for ex in batch] + [ex.rejected_ids for ex in batch]
    return {"input_ids": _pad(ids, pad_token_id), "attention_mask": _mask(ids),
            **_margins(batch)}


def collate_dpo(batch: list[DPOExample], pad_token_id: int) -> dict[str, Tensor]:
    """input_ids [2B,T] = all chosen rows then all rejected rows, right padded; attention_mask
    [2B,T]; labels [2B,T], -100 over the prompts and the padding; ref_logps [2B] float32, the
    reference's log-probs of those answers, in that order. Examples with `kl_ids` (KTO) add
    kl_input_ids, kl_attention_mask, kl_labels [B,T'] and ref_kl_logps [B] of those rows."""
    ids = [ex.chosen_ids for ex in batch] + [ex.rejected_ids for ex in batch]
    ref = [ex.ref_chosen for ex in batch] + [ex.ref_rejected for ex in batch]
    rows = {**_answer_rows(ids, [ex.prompt_len for ex in batch + batch], pad_token_id),
            "ref_logps": torch.tensor(ref, dtype=torch.float32)}
    if batch[0].kl_ids:   # KTO's mismatched rows [B, T'], the same layout
        rows |= _mismatched_rows(batch, pad_token_id)
    return rows


def collate_feedback(batch: list[FeedbackExample], pad_token_id: int) -> dict[str, Tensor]:
    """input_ids [B,T] right padded; attention_mask [B,T]; labels [B,T], -100 over the
    prompts and the padding; desirable [B] bool; ref_logps [B] float32, the reference's
    log-probs of the answers; with `kl_ids`, kl_input_ids, kl_attention_mask, kl_labels
    [B,T'] and ref_kl_logps [B] of the mismatched rows (collate_dpo's keys)."""
    rows = {**_answer_rows([ex.ids for ex in batch], [ex.prompt_len for ex in batch],
                           pad_token_id),
            "desirable": torch.tensor([ex.desirable for ex in batch], dtype=torch.bool),
            "ref_logps": torch.tensor([ex.ref_logp for ex in batch], dtype=torch.float32)}
    if batch[0].kl_ids:
        rows |= _mismatched_rows(batch, pad_token_id)
    return rows


def _answer_rows(ids: list[Sequence[int]], prompt_lens: list[int], pad_token_id: int,
                 prefix: str = "") -> dict[str, Tensor]:
    """Right-padded `prefix`input_ids, attention_mask and labels [len(ids), T], the labels
    -100 over each row's prompt (its first `prompt_lens` tokens) and the padding."""
    labels = [[IGNORE_INDEX] * n + list(row[n:]) for row, n in zip(ids, prompt_lens, strict=True)]
    return {f"{prefix}input_ids": _pad(ids, pad_token_id), f"{prefix}attention_mask": _mask(ids),
            f"{prefix}labels": _pad(labels, IGNORE_INDEX)}


def _mismatched_rows(batch: list[DPOExample] | list[FeedbackExample], pad_token_id: int
                     ) -> dict[str, Tensor]:
    """KTO's mismatched rows of `batch` (kl_input_ids, kl_attention_mask, kl_labels [B,T'])
    and their reference log-probs (ref_kl_logps [B])."""
    return {**_answer_rows([ex.kl_ids for ex in batch], [ex.prompt_len for ex in batch],
                           pad_token_id, prefix="kl_"),
            "ref_kl_logps": torch.tensor([ex.ref_kl for ex in batch], dtype=torch.float32)}


def _margins(batch: list[PairExample]) -> dict[str, Tensor]:
    """margins [B] of pairs that have any (data.margin_key), else nothing."""
    if not any(ex.margin for ex in batch):
        return {}
    return {"margins": torch.tensor([ex.margin for ex in batch], dtype=torch.float32)}


def _packed(seqs: Sequence[Sequence[int]], fill: int) -> dict[str, Tensor]:
    """`seqs` packed by `packed_layout`: input_ids [R, W] (`fill` after a row's last
    sequence), position_ids [R, W] counting from 0 in every sequence and in the fill (so the
    model's mask keeps attention within each: transformers reads sequence starts from
    restarting positions when given no attention_mask), starts [N] and ends [N], each
    sequence's first and last token as a flat index (row * W + column), in `seqs`' order."""
    if not seqs:
        raise ValueError("cannot collate an empty batch")
    lengths = [len(s) for s in seqs]
    layout = packed_layout(lengths)
    width = max(lengths)
    positions, starts = restarting_positions(layout, lengths, width)
    ids = torch.full((len(layout), width), fill, dtype=torch.long)
    for r, row in enumerate(layout):
        column = 0
        for i in row:
            ids[r, column:column + lengths[i]] = torch.tensor(seqs[i], dtype=torch.long)
            column += lengths[i]
    ends = starts + torch.tensor([len(s) - 1 for s in seqs])
    return {"input_ids": ids, "position_ids": positions, "starts": starts, "ends": ends}


def collate_packed_sft(batch: list[SFTExample], pad_token_id: int) -> dict[str, Tensor]:
    """collate_sft's batch packed (`_packed`): input_ids, position_ids and labels [R, W], with
    -100 on the fill and on each example's first token, which the previous example's last
    token would otherwise be trained to predict."""
    out = _packed([ex.input_ids for ex in batch], pad_token_id)
    labels = _packed([ex.labels for ex in batch], IGNORE_INDEX)["input_ids"]
    labels.view(-1)[out.pop("starts")] = IGNORE_INDEX
    del out["ends"]
    return {**out, "labels": labels}


def collate_packed_pairs(batch: list[PairExample], pad_token_id: int) -> dict[str, Tensor]:
    """collate_pairs' sequences packed (`_packed`): input_ids and position_ids [R, W], and ends
    [2B], the flat index of each sequence's last token, all chosen then all rejected (and
    collate_pairs' margins)."""
    out = _packed([ex.chosen_ids for ex in batch] + [ex.rejected_ids for ex in batch],
                  pad_token_id)
    del out["starts"]
    return {**out, **_margins(batch)}


def collate_prompts(batch: list[list[int]], pad_token_id: int) -> dict[str, Tensor]:
    """LEFT-padded input_ids [B,P] and attention_mask [B,P] (prompts end at the last column,
    ready for generation)."""
    return {"input_ids": _pad(batch, pad_token_id, left=True),
            "attention_mask": _mask(batch, left=True)}
