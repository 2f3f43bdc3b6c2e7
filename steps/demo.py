"""The built-in demo tasks: digits that follow a rule, with a ground-truth score.

A user asks for digits of a kind ("Give me some even digits."); the assistant answers
with space-separated digits (" 2 8 4 6"). The ground-truth score of an answer is the
fraction of its tokens that are digits of the requested kind, so a run can show that
RLHF made the model better, not only that the losses moved.

Preference pairs are made the way human labels are: two answers drawn from a noisy base
distribution, the better one is `chosen`. SFT on `chosen` therefore imitates a mixture
of good and mediocre answers; the reward model learns the rule from comparisons; PPO
pushes the policy past what it saw in the data.

Three tasks (`data.demo_task`):
- `digits` ("Give me some even digits."): some of its pairs hold hand-made degenerate
  answers (empty, too short, digits run together), so its reward model learns to score
  them low.
- `distinct` ("Give me 4 different even digits."): only the first n digits count, each
  once; extra ones dilute the score. Its pairs are all well formed (n-2 to n+2 digits, none
  repeated, ended), so its reward model never saw degenerate repetition: the task on which
  an unguarded step 3 can hack it.
- `pick` ("Which of 3 8 5 2 9 are even?"): list the prompt's digits that obey the rule,
  each once, and stop. Its answers have a natural end (after the last such digit), and its
  pairs never go past it: answers drop some of the right digits and slip in some wrong
  ones of the prompt, rarely name a digit of the rule that the prompt lacks, and never
  repeat one or list more digits than the prompt. Checking an answer against the prompt
  is hard for the tiny models: the SFT model copies badly (greedy ground truth about 0.4)
  and the reward model ranks held-out pairs imperfectly; and it never saw answers that run
  on, repeat or invent digits, which are just what a drifting policy writes. The task on
  which step 3 with the demo's fixed KL penalty ends below the SFT model it started from
  (`python bench/step3_quality.py --task pick`).
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


DISTINCT_TEMPLATES = ("Give me {} different {} digits.", "List {} different {} digits.")
MIN_DIGITS = 3
_RULE_WORD = re.compile(r"\b(" + "|".join(RULES) + r")\b")
_COUNT = re.compile(r"\b(\d+) different\b")
PICK_TEMPLATES = ("Which of {items} are {rule}?", "From {items}, pick the {rule} ones.")
_ITEMS = re.compile(r"(?<!\S)\d(?: \d)+(?![\w])")


def rule_of(prompt: str) -> str | None:
    """The rule a demo prompt asks for (taken from the last human turn), or None."""
    found = _RULE_WORD.search(prompt.rsplit("Human:", 1)[-1])
    return found.group(1) if found else None


def requested_count(prompt: str) -> int | None:
    """How many different digits a `distinct` prompt asks for, or None."""
    found = _COUNT.search(prompt.rsplit("Human:", 1)[-1])
    return int(found.group(1)) if found else None


def listed_digits(prompt: str) -> list[int] | None:
    """The digits a `pick` prompt lists ("Which of 3 8 5 2 9 are even?"), or None."""
    found = _ITEMS.search(prompt.rsplit("Human:", 1)[-1])
    return [int(d) for d in found.group(0).split()] if found else None


def score(prompt: str, answer: str) -> float:
    """Ground truth in [0, 1]: the share of whitespace-separated tokens of `answer` that are
    single digits obeying the prompt's rule, over at least MIN_DIGITS tokens (so a short or
    empty answer cannot score full marks). A `distinct` prompt's n: only the first n tokens
    can count, each digit once, over at least n tokens (more dilute the score). A `pick`
    prompt's digits: the listed ones obeying the rule, each counting once, over at least as
    many tokens as there are such digits (missing ones, repeats and extras all cost)."""
    rule = RULES.get(rule_of(prompt) or "")
    tokens = answer.split()
    if rule is None:
        return 0.0
    listed = listed_digits(prompt)
    if listed is not None:
        wanted = {str(d) for d in listed if rule(d)}
        return len(wanted & set(tokens)) / max(len(tokens), len(wanted), 1)
    count = requested_count(prompt)
    good = [t for t in tokens[:count] if len(t) == 1 and t.isdigit() and rule(int(t))]
    return len(set(good) if count else good) / max(len(tokens), count or MIN_DIGITS)


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


def _distinct_answer(rng: random.Random, rule: str, count: int) -> str:
    """A noisy answer to a `distinct` prompt: count +- 2 digits, none repeated, each from
    the rule's digits with a per-answer probability (while there are any left)."""
    follows = RULES[rule]
    pools = {True: [d for d in range(10) if follows(d)],
             False: [d for d in range(10) if not follows(d)]}
    p_good = rng.uniform(0.2, 1.0)
    digits = []
    for _ in range(count + rng.randint(-2, 2)):
        pool = pools[rng.random() < p_good] or pools[True] or pools[False]
        digits.append(pool.pop(rng.randrange(len(pool))))
    return "".join(f" {d}" for d in digits)


def _pick_prompt(rng: random.Random, rule: str) -> tuple[str, list[int]]:
    """A `pick` prompt listing 4 to 7 different digits, at least one obeying `rule` and one
    not; returns it and the digits."""
    while True:
        items = rng.sample(range(10), rng.randint(4, 7))
        if 0 < sum(RULES[rule](d) for d in items) < len(items):
            break
    request = rng.choice(PICK_TEMPLATES).format(items=" ".join(map(str, items)), rule=rule)
    return prompt_text(request), items


def _pick_answer(rng: random.Random, rule: str, items: list[int]) -> str:
    """A noisy answer to a `pick` prompt, in the prompt's order: each right digit kept with a
    per-answer probability, each wrong one of the prompt slipped in with another; now and
    then one right digit replaced by a digit of the rule that the prompt lacks. Never a
    repeat, nor more digits than the prompt lists."""
    follows = RULES[rule]
    p_keep, p_wrong = rng.uniform(0.3, 1.0), rng.uniform(0.0, 0.4)
    digits = [d for d in items if rng.random() < (p_keep if follows(d) else p_wrong)]
    outside = [d for d in range(10) if follows(d) and d not in items]
    right = [i for i, d in enumerate(digits) if follows(d)]
    if outside and right and rng.random() < 0.1:
        digits[rng.choice(right)] = rng.choice(outside)
    return "".join(f" {d}" for d in digits)


TASKS = ("digits", "distinct", "pick")


def make_pairs(num_pairs: int, seed: int, task: str = "digits") -> list[PreferencePair]:
    """`num_pairs` preference pairs of `task`; chosen has the strictly higher ground-truth
    score."""
    if task not in TASKS:
        raise ValueError(f"demo task {task!r}: choose one of {', '.join(TASKS)}")
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < num_pairs:
        rule = rng.choice(sorted(RULES))
        if task == "pick":
            prompt, items = _pick_prompt(rng, rule)
            a, b = _pick_answer(rng, rule, items), _pick_answer(rng, rule, items)
        elif task == "distinct":
            count = rng.randint(3, 5)
            prompt = prompt_text(rng.choice(DISTINCT_TEMPLATES).format(count, rule))
            a, b = _distinct_answer(rng, rule, count), _distinct_answer(rng, rule, count)
        else:
            prompt = prompt_text(rng.choice(TEMPLATES).format(rule))
            a = _sample_answer(rng, rule)
            b = _degenerate_answer(rng) if rng.random() < 0.15 else _sample_answer(rng, rule)
        score_a, score_b = score(prompt, a), score(prompt, b)
        if score_a == score_b:
            continue
        chosen, rejected = (a, b) if score_a > score_b else (b, a)
        pairs.append(PreferencePair(prompt, chosen, rejected))
    return pairs


def feedback_records(pairs: list[PreferencePair], seed: int) -> list[dict]:
    """`pairs` as unpaired feedback, the way a log of thumbs up and down holds it
    (data.feedback_path's records: prompt, completion, label): of each pair one answer, by
    a seeded coin, desirable where it was the pair's chosen one. No record has the other
    answer of its pair beside it (the KTO paper's one answer per pair)."""
    rng = random.Random(seed)
    records = []
    for pair in pairs:
        desirable = rng.random() < 0.5
        records.append({"prompt": pair.prompt, "label": desirable,
                        "completion": pair.chosen if desirable else pair.rejected})
    return records
