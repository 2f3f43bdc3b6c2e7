"""The built-in demo tasks of steps/demo.py: the `pick` task's ground truth by hand, its
generated pairs, and every task's prompts recognised and scored by the one scorer."""

import pytest

from steps import demo
from steps.common import ground_truth

PICK = demo.prompt_text("Which of 3 8 5 2 9 are even?")   # the right answer: 8 and 2


@pytest.mark.parametrize(("answer", "truth"), [
    (" 8 2", 1.0),
    (" 2 8", 1.0),                          # any order
    (" 8", 1 / 2),                          # one missing
    (" 8 2 5", 2 / 3),                      # 5 is odd
    (" 8 2 4", 2 / 3),                      # 4 is even but not listed
    (" 8 8 2", 2 / 3),                      # a repeat counts once and dilutes
    (" 8 2 8 2 8 2 8 2 8 2 8 2", 2 / 12),   # running on to the length limit
    (" 4 6 0", 0.0),
    (" 82", 0.0),
    ("", 0.0),
])
def test_pick_scores_the_listed_digits_of_the_rule_once_each(answer, truth):
    assert demo.score(PICK, answer) == pytest.approx(truth)


def test_every_tasks_prompts_are_recognised_by_the_one_scorer():
    other = demo.prompt_text("From 0 1 9 5, pick the small ones.")
    assert demo.rule_of(other) == "small" and demo.listed_digits(other) == [0, 1, 9, 5]
    assert demo.score(other, " 0 1") == 1.0 and demo.score(other, " 0 1 2") == 2 / 3
    # the last human turn decides
    assert demo.listed_digits("\n\nHuman: Which of 1 2 3 are odd?\n\nAssistant: 1 3" + other) \
        == [0, 1, 9, 5]
    digits = demo.prompt_text("Give me some even digits.")
    distinct = demo.prompt_text("Give me 4 different even digits.")
    assert demo.listed_digits(digits) is None and demo.listed_digits(distinct) is None
    assert demo.score(digits, " 2 4 7") == 2 / 3 and demo.score(distinct, " 2 4 6 8") == 1.0
    assert ground_truth([PICK, "\n\nHuman: hi\n\nAssistant:"], [" 8", " hello"]) == (0.5, 1)


def test_pick_pairs_are_well_formed_and_ordered():
    pairs = demo.make_pairs(400, seed=5, task="pick")
    assert len(pairs) == 400
    for pair in pairs:
        listed, follows = demo.listed_digits(pair.prompt), demo.RULES[demo.rule_of(pair.prompt)]
        assert 4 <= len(listed) <= 7 and len(set(listed)) == len(listed)
        assert 0 < sum(map(follows, listed)) < len(listed)   # something right, something wrong
        for answer in (pair.chosen, pair.rejected):
            tokens = answer.split()
            assert all(len(t) == 1 and t.isdigit() for t in tokens)
            # never a repeat, at most one digit the prompt lacks (and then one of the rule):
            # never past the natural end
            assert len(set(tokens)) == len(tokens) <= len(listed)
            invented = [int(t) for t in tokens if int(t) not in listed]
            assert len(invented) <= 1 and all(map(follows, invented))
        assert demo.score(pair.prompt, pair.chosen) > demo.score(pair.prompt, pair.rejected)
    assert demo.make_pairs(50, seed=5, task="pick") == pairs[:50]
    with pytest.raises(ValueError, match="pick"):
        demo.make_pairs(1, seed=5, task="nonsense")
