"""How precisely does an evaluation measure a policy's KL to the reference? The KL per
answer estimated two ways from the same sampled answers, and the spread of each:
  - k1, the sampled log-ratio summed over the answer: sum_t log pi(y_t) - log pi_ref(y_t);
  - the KL over the vocabulary at each answer token, summed (steps.rlhf.token_kl, what
    step 3's evaluations measure): sum_t KL(pi(. | y_<t) || pi_ref(. | y_<t)).
Both have the answer's KL as their mean; what matters for a KL budget judged on 64
answers is the standard error of a 64-answer mean, printed beside the means of
consecutive 64-answer batches.

Run:  python bench/kl_spread.py --reference STEPS12/actor --policy STEP3/actor \\
          --task digits --seed 1234 [--prompts 64] [--samples 8]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from step3_quality import load_actor, samples, test_prompts  # noqa: E402

from steps import demo  # noqa: E402
from steps.rlhf import masked_sum, token_kl  # noqa: E402


@torch.no_grad()
def kl_per_answer(actor, reference, sequences: torch.Tensor, mask: torch.Tensor,
                  prompt_len: int) -> tuple[list[float], list[float]]:
    """([B] k1 sums, [B] vocabulary-KL sums) over each answer up to and including EOS."""
    log_p = actor(input_ids=sequences, attention_mask=mask).logits[:, prompt_len - 1:-1]
    log_q = reference(input_ids=sequences, attention_mask=mask).logits[:, prompt_len - 1:-1]
    taken = sequences[:, prompt_len:, None]
    k1 = (log_p.float().log_softmax(-1).gather(-1, taken)
          - log_q.float().log_softmax(-1).gather(-1, taken))[..., 0]
    answered = mask[:, prompt_len:].float()
    return (masked_sum(k1, answered, dim=1).tolist(),
            masked_sum(token_kl(log_p, log_q), answered, dim=1).tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="the SFT model's directory")
    parser.add_argument("--policy", type=Path, required=True, help="a step-3 actor's directory")
    parser.add_argument("--task", default="digits", choices=demo.TASKS)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8, help="answers per prompt")
    args = parser.parse_args()
    ids, texts, max_len = test_prompts(args.seed, [f"data.demo_task={args.task}"],
                                       args.reference, args.prompts)
    actor, tokenizer = load_actor(args.policy)
    reference, _ = load_actor(args.reference)
    prompt_len = max(map(len, ids))
    estimates: dict[str, list[float]] = {"k1 (sampled log-ratio)": [],
                                         "KL over the vocabulary": []}
    for sequences, mask, _ in samples(actor, tokenizer, ids, texts, max_len, args.seed,
                                      args.samples):
        for values, got in zip(estimates.values(),
                               kl_per_answer(actor, reference, sequences, mask, prompt_len),
                               strict=True):
            values += got
    print(f"command: python bench/kl_spread.py {' '.join(sys.argv[1:])}")
    print(f"{args.samples} batches of {len(ids)} answers (one per fresh prompt of the task)\n")
    print(f"{'estimator':<24}{'mean':>8}{'sd/answer':>11}{f'se of {len(ids)}':>10}"
          "   means of the batches")
    for name, values in estimates.items():
        sd = statistics.stdev(values)
        batches = [statistics.fmean(values[i:i + len(ids)])
                   for i in range(0, len(values), len(ids))]
        print(f"{name:<24}{statistics.fmean(values):>8.3f}{sd:>11.3f}"
              f"{sd / math.sqrt(len(ids)):>10.3f}   " + " ".join(f"{b:.3f}" for b in batches))


if __name__ == "__main__":
    main()
