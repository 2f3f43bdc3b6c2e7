"""The built-in demo task: digits that follow a rule, with a ground-truth score.

A user asks for digits of a kind ("Give me some even digits."); the assistant answers
with space-separated digits (" 2 8 4 6"). The ground-truth score of an answer is the
fraction of its tokens that are digits of the requested kind, so a run can show that
RLHF made the model better, not only that the losses moved.

Preference pairs are made the way human labels are: two answers drawn from a noisy base
distribution, the better one is `chosen`. SFT on `chosen` therefore imitates a mixture
of good and mediocre answers; the reward model learns the rule from comparisons; PPO
pushes the policy past what it saw in the data.
"""

from __future__ import annotations

import random
import re

from steps.data import PreferencePair

RULES = {
    "even": lambda d: d % 2 == 0,
    "odd": lambda d: d % 2 == 1,
    "small": lambda d: d < 5,
    "big": lambda d: d >= 5,
}
TEMPLATES = ("Give me some {} digits.", "List a few {} digits.", "Which digits are {}?")


def prompt_text(request: str) -> str:
    return f"\n\nHuman: {request}\n\nAssistant:"


MIN_DIGITS = 3
_RULE_WORD = re.compile(r"\b(" + "|".join(RULES) + r")\b")


def rule_of(prompt: str) -> str | None:
    """The rule a demo prompt asks for (taken from the last human turn), or None."""
    found = _RULE_WORD.search(prompt.rsplit("Human:", 1)[-1])
    return found.group(1) if found else None


def score(prompt: str, answer: str) -> float:
    """Ground truth in [0, 1]: the share of whitespace-separated tokens of `answer` that are
    single digits obeying the prompt's rule, over at least MIN_DIGITS tokens (so a short or
    empty answer cannot score full marks)."""
    rule = RULES.get(rule_of(prompt) or "")
    tokens = answer.split()
    if rule is None:
        return 0.0
    good = sum(1 for t in tokens if len(t) == 1 and t.isdigit() and rule(int(t)))
    return good / max(len(tokens), MIN_DIGITS)


def _degenerate_answer(rng: random.Random) -> str:
    """What a drifting policy produces: nothing, too little, or digits run together."""
    digits = [str(rng.randrange(10)) for _ in range(rng.randint(1, 6))]
    return rng.choice(["", " ", f" {digits[0]}", " " + "".join(digits), "  ".join(digits)])


def _sample_answer(rng: random.Random, rule: str) -> str:
    """A noisy answer: 3 to 8 digits, each obeying the rule with a per-answer probability."""
    follows = RULES[rule]
    good = [d for d in range(10) if follows(d)]
    bad = [d for d in range(10) if not follows(d)]
    p_good = rng.uniform(0.2, 1.0)
    digits = [rng.choice(good if rng.random() < p_good else bad) for _ in range(rng.randint(3, 8))]
    return "".join(f" {d}" for d in digits)


def make_pairs(num_pairs: int, seed: int) -> list[PreferencePair]:
    """`num_pairs` preference pairs; chosen has the strictly higher ground-truth score."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < num_pairs:
        rule = rng.choice(sorted(RULES))
        prompt = prompt_text(rng.choice(TEMPLATES).format(rule))
        a = _sample_answer(rng, rule)
        b = _degenerate_answer(rng) if rng.random() < 0.15 else _sample_answer(rng, rule)
        score_a, score_b = score(prompt, a), score(prompt, b)
        if score_a == score_b:
            continue
        chosen, rejected = (a, b) if score_a > score_b else (b, a)
        pairs.append(PreferencePair(prompt, chosen, rejected))
    return pairs
