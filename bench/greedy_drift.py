"""What step 3 changed in the greedy answers: the SFT model's against a step-3 actor's, on
fresh prompts of a built-in demo task, with the reward model's score beside the ground truth.

When a step-3 policy's sampled answers gain ground truth but its greedy answers lose it
(ppo.greedy_floor then keeps the SFT model), this shows what the policy learned instead:
per answer, its ground truth (steps.demo.score), its reward-model score (as step 3 reads
it: steps.scoring.RewardScorer), its length in digits, repeated digits, digits that break
the prompt's rule and, for `pick`, digits the prompt did not list; then examples whose
ground truth fell. A feature the reward model does not penalise shows as a higher score
for a lower ground truth.

Run (steps 1-2 and a step 3 run with ppo.export=last, e.g. from bench/step3_quality.py):
  python bench/greedy_drift.py --task distinct --steps12 RUN/distinct-steps12-1234 \\
      --step3 OUT --seed 1234
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from step3_quality import answers, load_actor, test_prompts  # noqa: E402

from engine.generation import SamplingSettings  # noqa: E402
from engine.models import load_reward_model  # noqa: E402
from steps import demo  # noqa: E402
from steps.scoring import RewardScorer  # noqa: E402


def answer_features(prompt: str, answer: str) -> dict[str, float]:
    """An answer's ground truth and what it is made of, in whitespace-separated tokens."""
    rule = demo.RULES[demo.rule_of(prompt)]
    tokens = answer.split()
    digits = [int(t) for t in tokens if len(t) == 1 and t.isdigit()]
    listed = demo.listed_digits(prompt)
    features = {"ground truth": demo.score(prompt, answer), "length": len(tokens),
                "repeated digits": len(digits) - len(set(digits)),
                "digits breaking the rule": sum(not rule(d) for d in digits),
                "tokens that are not digits": len(tokens) - len(digits)}
    if listed is not None:
        features["digits not in the prompt"] = sum(d not in listed for d in digits)
    return features


@torch.no_grad()
def greedy_answers(actor_dir: Path, scorer: RewardScorer, prompt_ids: list[list[int]],
                   max_len: int) -> tuple[list[str], list[float]]:
    model, tokenizer = load_actor(actor_dir)
    sequences, mask, said = answers(model, tokenizer, prompt_ids,
                                    SamplingSettings(max_len, do_sample=False), None)
    prompt_len = max(map(len, prompt_ids))   # the left-padded prompts' columns
    return said, scorer(sequences, mask, prompt_len).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="distinct", choices=demo.TASKS)
    parser.add_argument("--steps12", type=Path, required=True,
                        help="the output dir of steps 1-2 (actor/, reward/)")
    parser.add_argument("--step3", type=Path, required=True, help="a step-3 output dir")
    parser.add_argument("--seed", type=int, default=1234, help="the runs' seed")
    parser.add_argument("--test-prompts", type=int, default=128)
    parser.add_argument("--examples", type=int, default=8)
    args = parser.parse_args()

    prompt_ids, texts, max_len = test_prompts(args.seed, [f"data.demo_task={args.task}"],
                                              args.steps12 / "actor", args.test_prompts)
    _, tokenizer = load_actor(args.steps12 / "actor")
    scorer = RewardScorer(load_reward_model(str(args.steps12 / "reward"), tokenizer).eval(),
                          tokenizer, tokenizer, torch.device("cpu"))
    policies = {"SFT": args.steps12 / "actor", "step 3": args.step3 / "step3" / "actor"}
    said = {name: greedy_answers(path, scorer, prompt_ids, max_len)
            for name, path in policies.items()}
    features = {name: [{**answer_features(p, a), "reward-model score": s}
                       for p, a, s in zip(texts, *said[name], strict=True)] for name in said}

    print(f"task {args.task}, seed {args.seed}: greedy answers to {len(texts)} fresh prompts, "
          "means per answer")
    print(f"{'':<28}{'SFT':>10}{'step 3':>10}")
    for key in features["SFT"][0]:
        means = [statistics.fmean(f[key] for f in features[name]) for name in policies]
        print(f"{key:<28}" + "".join(f"{m:>10.3f}" for m in means))
    worse = [i for i, (a, b) in enumerate(zip(features["SFT"], features["step 3"], strict=True))
             if b["ground truth"] < a["ground truth"]]
    print(f"\n{len(worse)} of {len(texts)} answers lost ground truth; the first "
          f"{min(args.examples, len(worse))} (ground truth, reward-model score):")
    for i in worse[:args.examples]:
        request = texts[i].rsplit("Human:", 1)[-1].split("\n")[0].strip()
        sft, new = (f"{said[n][0][i]!r} ({features[n][i]['ground truth']:.2f}, "
                    f"{features[n][i]['reward-model score']:.2f})" for n in policies)
        print(f"  {request:<40} SFT {sft:<32} step 3 {new}")


if __name__ == "__main__":
    main()
