"""Rule rewards the step-3 tests name as ppo.reward_fn (train.py imports them by name)."""

from __future__ import annotations


def even_words(prompt: str, answer: str) -> float:
    """1 for an answer of an even number of words, else 0: two values, so that a group of
    answers often all score the same (no GRPO advantage: what dynamic sampling drops)."""
    return float(len(answer.split()) % 2 == 0)
