"""What step 3 rewards: a learned reward model's score, a rule-based reward function's
(`ppo.reward_fn`, a Python callable (prompt, answer) -> float: a math checker, a unit
test, a format rule), or a weighted sum of both."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from engine.chat_format import template_writes_bos, turn_ends_with_eos
from engine.errors import NonFiniteError, UserError
from engine.models import decode_answer, sequence_scores
from steps.algorithms import RewardFn, load_reward_fn
from steps.common import to_device
from steps.data import PreferencePair
from steps.tokenize import collate_prompts, tokenize_pairs


class RewardScorer:
    """Scores prompt + answer with the reward model, re-tokenizing the text as step 2
    tokenized its pairs (steps.tokenize.tokenize_pairs) unless the reward model's tokenizer
    gives the actor's ids: the same vocabulary is not enough (a Qwen2.5-Instruct actor ends
    with <|im_end|>, a base reward model was trained on answers ending with <|endoftext|>;
    one tokenizer may add a BOS or an EOS the other does not)."""

    PROBE = "Human: Is 2 + 2 = 4?\n\nAssistant: Yes."

    def __init__(self, model, actor_tokenizer, reward_tokenizer, device, packed: bool = False,
                 normalize: tuple[float, float] | None = None):
        self.model, self.device, self.packed = model, device, packed   # packed: ppo.packing
        self.normalize = normalize   # (mean, std) the scores are standardised by, or None
        self.actor_tokenizer, self.reward_tokenizer = actor_tokenizer, reward_tokenizer
        # a chat template's turn end that is the EOS is text the reward model was trained on
        self.eos_in_text = turn_ends_with_eos(actor_tokenizer)
        self.bos_in_text = template_writes_bos(actor_tokenizer)   # <|begin_of_text|>, likewise
        self.same_vocabulary = actor_tokenizer.get_vocab() == reward_tokenizer.get_vocab()
        self.reads_actor_ids = self.same_vocabulary and (
            actor_tokenizer.eos_token_id == reward_tokenizer.eos_token_id
            and actor_tokenizer(self.PROBE)["input_ids"]
            == reward_tokenizer(self.PROBE)["input_ids"])

    @torch.no_grad()
    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_len: int) -> torch.Tensor:
        """[B] scores of rollouts [B, L] (left-padded prompts in the first `prompt_len`
        columns), each read at the EOS that ends its answer: a cut-off answer gets one
        appended, as step 2 trained the reward model to read (read at its last token
        instead, running on past the end can score higher than ending); standardised by
        `normalize` where given."""
        scores = self._scores(sequences, attention_mask, prompt_len)
        if self.normalize is None:
            return scores
        mean, std = self.normalize
        return (scores.float() - mean) / std

    def _scores(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                prompt_len: int) -> torch.Tensor:
        if self.reads_actor_ids:
            sequences, attention_mask = ended_with(sequences, attention_mask,
                                                   self.reward_tokenizer.eos_token_id)
            return sequence_scores(self.model, sequences, attention_mask, packed=self.packed)
        rows = [(row[:prompt_len][mask[:prompt_len].bool()].tolist(),
                 row[prompt_len:][mask[prompt_len:].bool()].tolist())
                for row, mask in zip(sequences, attention_mask, strict=True)]
        texts = [self._texts(prompt, answer) for prompt, answer in rows]
        pairs = [PreferencePair(prompt, answer, answer) for prompt, answer in texts]
        unlimited = sequences.shape[1] * 64   # tokens: none dropped or cut
        examples, _ = tokenize_pairs(pairs, self.reward_tokenizer, unlimited, unlimited)
        batch = to_device(collate_prompts([example.chosen_ids for example in examples],
                                          self.reward_tokenizer.pad_token_id), self.device)
        return sequence_scores(self.model, batch["input_ids"], batch["attention_mask"],
                               packed=self.packed)

    def _texts(self, prompt: list[int], answer: list[int]) -> tuple[str, str]:
        """(prompt text, answer text as it follows the prompt) of a rollout's ids, as step 2
        read the pair: special tokens kept (a chat template's turn markers), but the actor's
        BOS and the EOS that ends the answer, for which the reward tokenizer puts its own
        (unless the template writes them as text). A BOS the template writes is put back as
        its text, not decoded with the rest: a SentencePiece decoder would read the space
        marker after it as a space ("<s> [INST]")."""
        tok, head = self.actor_tokenizer, ""
        if prompt[:1] == [tok.bos_token_id]:
            head, prompt = tok.bos_token if self.bos_in_text else "", prompt[1:]
        if answer[-1:] == [tok.eos_token_id] and not self.eos_in_text:
            answer = answer[:-1]
        said = tok.decode(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        whole = tok.decode(prompt + answer, skip_special_tokens=False,
                           clean_up_tokenization_spaces=False)
        reply = whole[len(said):] if whole.startswith(said) else tok.decode(
            answer, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return head + said, reply


class RewardEnsemble:
    """Several reward models' scores of the same rollouts, combined per answer (each
    RewardScorer re-tokenizes for its own model and standardises by its own statistics):
    their mean, their minimum (the worst case), or their mean less `coef` x their std over
    the models (uncertainty-weighted; Coste et al., 2023)."""

    def __init__(self, scorers: list[RewardScorer], how: str = "mean", coef: float = 1.0):
        self.scorers, self.how, self.coef = scorers, how, coef

    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_len: int) -> torch.Tensor:
        """[B] combined scores of rollouts [B, L], as RewardScorer reads them."""
        return ensemble_scores(self.each(sequences, attention_mask, prompt_len), self.how,
                               self.coef)

    def each(self, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int
             ) -> torch.Tensor:
        """[models, B] every model's scores of rollouts [B, L]."""
        return torch.stack([scorer(sequences, attention_mask, prompt_len).float()
                            for scorer in self.scorers])


def ensemble_scores(scores: torch.Tensor, how: str, coef: float = 1.0) -> torch.Tensor:
    """[models, B] scores -> [B]: `how` = mean | min | mean_minus_std (mean - coef x the
    population std over the models)."""
    if how == "mean":
        return scores.mean(0)
    if how == "min":
        return scores.min(0).values
    if how == "mean_minus_std":
        return scores.mean(0) - coef * scores.std(0, correction=0)
    raise ValueError(f"unknown reward ensemble {how!r}")


def ended_with(sequences: torch.Tensor, attention_mask: torch.Tensor, eos_token_id: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, L] (any padding) -> [B, L+1] whose rightmost real token is `eos_token_id`:
    rows that end otherwise get it appended after their last real token."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.long()).argmax(-1)                 # [B]
    open_rows = (sequences.gather(1, last[:, None]).squeeze(1) != eos_token_id).nonzero()[:, 0]
    sequences = torch.nn.functional.pad(sequences, (0, 1), value=eos_token_id)
    attention_mask = torch.nn.functional.pad(attention_mask, (0, 1), value=0)
    sequences[open_rows, last[open_rows] + 1] = eos_token_id
    attention_mask[open_rows, last[open_rows] + 1] = 1
    return sequences, attention_mask


class RewardFunction:
    """A user's (prompt, answer) -> float, or (prompt, answer, label) -> float, loaded from
    "package.module:function" (`key` is the config key that named it): called on decoded
    texts, with the label of the prompt's record (`labels`: by the prompt's decoded text;
    None for a prompt without one) as `label=` when the function has that parameter; its
    failures and non-finite returns refused in one line naming the key and the input."""

    def __init__(self, fn: RewardFn, spec: str, key: str = "ppo.reward_fn",
                 labels: dict[str, Any] | None = None):
        self.fn, self.spec, self.key, self.labels = fn, spec, key, labels or {}
        self.takes_label = takes_label(fn)

    @classmethod
    def named(cls, spec: str, key: str = "ppo.reward_fn",
              labels: dict[str, Any] | None = None) -> RewardFunction:
        return cls(load_reward_fn(spec, key), spec, key, labels)

    def __call__(self, prompts: list[str], answers: list[str]) -> list[float]:
        return [self._call(p, a) for p, a in zip(prompts, answers, strict=True)]

    def _call(self, prompt: str, answer: str) -> float:
        where = f"{self.key}={self.spec}"
        try:
            value = (self.fn(prompt, answer, label=self.labels.get(prompt)) if self.takes_label
                     else self.fn(prompt, answer))
        except Exception as why:   # the user's code: say which input broke it
            raise UserError(f"{where} raised {type(why).__name__}: {why} (on prompt "
                            f"{prompt[-60:]!r}, answer {answer[:60]!r})") from None
        score = _as_score(value)
        if score is None:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise UserError(f"{where} returned {shown} (on prompt {prompt[-60:]!r}): it must "
                            "return a finite number within float32's range (±3.4e38)")
        return score


def takes_label(fn: RewardFn) -> bool:
    """Whether `fn` takes the label: it has a parameter named `label` (or takes any keyword),
    so that a third parameter of its own (`weight=0.5`) is never handed the label."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):   # a callable without a signature
        return False
    return any(p.name == "label" and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD
               for p in parameters)


_FLOAT32_MAX = torch.finfo(torch.float32).max


def _as_score(value) -> float | None:
    """A reward function's value as the float32 the rewards are kept in, or None where it
    is none: not a number (text, a sequence), NaN or inf, or past float32's range (a
    finite 1e39 or 10**400 became inf there)."""
    if isinstance(value, str | bytes):
        return None
    try:
        score = float(value)   # a Python or NumPy number, a Decimal, a one-value tensor
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None
    return score if abs(score) <= _FLOAT32_MAX else None


def decode_rollouts(tokenizer, sequences: torch.Tensor, prompt_len: int
                    ) -> tuple[list[str], list[str]]:
    """(prompt texts, answer texts) of left-padded prompts + answers [B, P+N]: each answer as
    it reads after its prompt (its leading space kept under SentencePiece tokenizers too),
    so that prompt + answer is the text."""
    # generate pads after EOS, so the special tokens are all that must go
    rows = sequences.tolist()
    prompts = tokenizer.batch_decode([row[:prompt_len] for row in rows], skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)
    return prompts, [decode_answer(tokenizer, row[:prompt_len], row[prompt_len:]) for row in rows]


class Rewards:
    """The score of each rollout: `model_weight` x the reward model's (or ensemble's) score
    plus `fn_weight` x the reward function's, either of them absent (None)."""

    def __init__(self, tokenizer, scorer: RewardScorer | RewardEnsemble | None,
                 model_weight: float, fn: RewardFunction | None, fn_weight: float):
        self.tokenizer, self.scorer, self.model_weight = tokenizer, scorer, model_weight
        self.fn, self.fn_weight = fn, fn_weight

    @torch.no_grad()
    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_len: int) -> torch.Tensor:
        """[B] scores of left-padded prompts (P = `prompt_len` columns) + answers [B, P+N]."""
        total = torch.zeros(len(sequences), device=sequences.device)
        if self.scorer is not None:
            scores = self.scorer(sequences, attention_mask, prompt_len).float()
            if not bool(torch.isfinite(scores).all()):
                raise NonFiniteError(f"the reward model scored {int((~scores.isfinite()).sum())}"
                                     f" of {len(scores)} answers NaN or inf; its weights or "
                                     "inputs went non-finite")
            total += self.model_weight * scores
        if self.fn is not None:
            scores = self.fn(*decode_rollouts(self.tokenizer, sequences, prompt_len))
            total += self.fn_weight * torch.tensor(scores, device=sequences.device)
        if not bool(torch.isfinite(total).all()):   # a weight x score past float32's range
            raise NonFiniteError(f"{int((~total.isfinite()).sum())} of {len(total)} rewards "
                                 "went NaN or inf weighting and adding the scores; lower "
                                 "ppo.reward_model_weight / ppo.reward_fn_weight")
        return total

    @property
    def ensemble(self) -> bool:
        return isinstance(self.scorer, RewardEnsemble)

    @torch.no_grad()
    def disagreement(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                     prompt_len: int) -> torch.Tensor:
        """[B] the (population) std of a reward ensemble's scores of each rollout, over its
        models: their disagreement, which grows where the policy leaves what they were
        trained on (over-optimisation)."""
        return self.scorer.each(sequences, attention_mask, prompt_len).std(0, correction=0)
