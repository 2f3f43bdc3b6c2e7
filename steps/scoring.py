"""What step 3 rewards: a learned reward model's score, a rule-based reward function's
(`ppo.reward_fn`, a Python callable (prompt, answer) -> float: a math checker, a unit
test, a format rule), or a weighted sum of both."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from numbers import Real

import torch

from engine.errors import NonFiniteError, UserError
from engine.models import sequence_scores
from steps.common import to_device
from steps.tokenize import collate_prompts

RewardFn = Callable[[str, str], float]


def load_reward_fn(spec: str, key: str = "ppo.reward_fn") -> RewardFn:
    """The callable that `spec` ("package.module:function") names."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UserError(f"{key}={spec}: give package.module:function, e.g. steps.demo:score")
    try:
        source = importlib.import_module(module_name)
    except Exception as why:   # a broken module raises anything at import
        raise UserError(f"{key}={spec}: cannot import {module_name} ({type(why).__name__}: "
                        f"{why}); is it on PYTHONPATH?") from None
    fn = getattr(source, attribute, None)
    if not callable(fn):
        raise UserError(f"{key}={spec}: {module_name} has no function {attribute}")
    return fn


class RewardScorer:
    """Scores prompt + answer with the reward model, re-tokenizing the text when the reward
    model's tokenizer differs from the actor's."""

    def __init__(self, model, actor_tokenizer, reward_tokenizer, device):
        self.model, self.device = model, device
        self.actor_tokenizer, self.reward_tokenizer = actor_tokenizer, reward_tokenizer
        self.same_tokenizer = actor_tokenizer.get_vocab() == reward_tokenizer.get_vocab()

    @torch.no_grad()
    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.same_tokenizer:
            # the rightmost attended token of a rollout is its last action
            return sequence_scores(self.model, sequences, attention_mask)
        texts = [self.actor_tokenizer.decode(row[mask.bool()], skip_special_tokens=True)
                 for row, mask in zip(sequences, attention_mask, strict=True)]
        eos = self.reward_tokenizer.eos_token_id
        ids = [row + [eos] for row in self.reward_tokenizer(texts)["input_ids"]]
        batch = to_device(collate_prompts(ids, self.reward_tokenizer.pad_token_id), self.device)
        return sequence_scores(self.model, batch["input_ids"], batch["attention_mask"])


class Rewards:
    """The score of each rollout: `model_weight` x the reward model's score plus `fn_weight`
    x the reward function's, either of them absent (None)."""

    def __init__(self, tokenizer, scorer: RewardScorer | None, model_weight: float,
                 fn: RewardFn | None, fn_weight: float, fn_spec: str | None = None):
        self.tokenizer, self.scorer, self.model_weight = tokenizer, scorer, model_weight
        self.fn, self.fn_weight, self.fn_spec = fn, fn_weight, fn_spec

    @torch.no_grad()
    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_len: int) -> torch.Tensor:
        """[B] scores of left-padded prompts (P = `prompt_len` columns) + answers [B, P+N]."""
        total = torch.zeros(len(sequences), device=sequences.device)
        if self.scorer is not None:
            scores = self.scorer(sequences, attention_mask).float()
            if not bool(torch.isfinite(scores).all()):
                raise NonFiniteError(f"the reward model scored {int((~scores.isfinite()).sum())}"
                                     f" of {len(scores)} answers NaN or inf; its weights or "
                                     "inputs went non-finite")
            total += self.model_weight * scores
        if self.fn is not None:
            decode = self.tokenizer.batch_decode
            # generate pads after EOS, so the special tokens are all that must go
            prompts = decode(sequences[:, :prompt_len], skip_special_tokens=True)
            answers = decode(sequences[:, prompt_len:], skip_special_tokens=True)
            scores = [self._call(p, a) for p, a in zip(prompts, answers, strict=True)]
            total += self.fn_weight * torch.tensor(scores, device=sequences.device)
        return total

    def _call(self, prompt: str, answer: str) -> float:
        where = f"ppo.reward_fn={self.fn_spec}"
        try:
            value = self.fn(prompt, answer)
        except Exception as why:   # the user's code: say which input broke it
            raise UserError(f"{where} raised {type(why).__name__}: {why} (on prompt "
                            f"{prompt[-60:]!r}, answer {answer[:60]!r})") from None
        if not isinstance(value, Real) or not math.isfinite(value):
            raise UserError(f"{where} returned {value!r} (on prompt {prompt[-60:]!r}): it must "
                            "return a finite number")
        return float(value)
