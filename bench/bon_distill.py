"""Best-of-n distillation, offline: does a policy trained only on the reward model's
favourites among the SFT model's own samples keep the SFT model's greedy answers?

Rejection-sampling fine-tuning (as in Llama 2's rejection sampling, RAFT) with every sample
from the SFT model: its target is best-of-n itself, inside the SFT model's support, so
unlike step 3 it cannot wander into answers the SFT model never samples. For a built-in
demo task and a steps 1-2 output (bench/step3_quality.py's RUN/T-steps12-S): n samples per
prompt on `--prompts` fresh training prompts, the reward model's favourite of each kept
(scored as step 3 scores: steps.scoring.RewardScorer), the SFT model fine-tuned on them
(answer tokens' NLL, AdamW); after each epoch the greedy and sampled (16 per prompt) ground
truth on step3_quality's 128 test prompts, and the KL to the SFT model per answer (mean log
ratio over those samples). The SFT row is comparable with step3_quality's SFT rows.

Run:  OMP_NUM_THREADS=1 python bench/bon_distill.py --task distinct --seed 1234 \\
          --steps12 RUN/distinct-steps12-1234 [--n 16 --prompts 512 --epochs 4 --lr 2e-4]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step3_quality import (  # noqa: E402
    FRESH_SEED_OFFSET,
    answers,
    load_actor,
    samples,
    sequence_logprobs,
    test_prompts,
)

from engine.generation import SamplingSettings  # noqa: E402
from engine.models import load_reward_model  # noqa: E402
from steps import demo  # noqa: E402
from steps.ppo import answer_logprobs  # noqa: E402
from steps.rlhf import masked_mean  # noqa: E402
from steps.scoring import RewardScorer  # noqa: E402
from steps.tokenize import collate_prompts  # noqa: E402

TRAIN_SEED_OFFSET, SAMPLE_SEED_OFFSET = 30_000, 40_000   # apart from step3_quality's draws


def favourites(sft, tokenizer, scorer, prompt_ids, texts, max_len: int, seed: int, n: int):
    """Per prompt, the reward model's favourite of n SFT samples: (sequences [B, L], masks
    [B, L], their mean ground truth)."""
    best = [(-float("inf"), None, None, 0.0)] * len(prompt_ids)
    prompt_len = max(map(len, prompt_ids))   # the left-padded prompts' columns
    for sequences, mask, truths in samples(sft, tokenizer, prompt_ids, texts, max_len, seed, n):
        for i, score in enumerate(scorer(sequences, mask, prompt_len).tolist()):
            if score > best[i][0]:
                best[i] = (score, sequences[i], mask[i], truths[i])
    length = max(row[1].shape[0] for row in best)
    sequences = torch.stack([F.pad(s, (0, length - s.shape[0]), value=tokenizer.pad_token_id)
                             for _, s, _, _ in best])
    masks = torch.stack([F.pad(m, (0, length - m.shape[0])) for _, _, m, _ in best])
    return sequences, masks, statistics.fmean(row[3] for row in best)


def evaluate(model, sft, tokenizer, prompt_ids, texts, max_len: int, seed: int) -> str:
    model.eval()
    _, _, said = answers(model, tokenizer, prompt_ids,
                         SamplingSettings(max_len, do_sample=False), None)
    greedy = statistics.fmean(demo.score(p, a) for p, a in zip(texts, said, strict=True))
    prompt_len = collate_prompts(prompt_ids, tokenizer.pad_token_id)["input_ids"].shape[1]
    truths, kls = [], []
    for sequences, mask, said_truths in samples(model, tokenizer, prompt_ids, texts, max_len,
                                                seed + FRESH_SEED_OFFSET, 16):
        truths += said_truths
        kls += [a - b for a, b in zip(sequence_logprobs(model, sequences, mask, prompt_len),
                                      sequence_logprobs(sft, sequences, mask, prompt_len),
                                      strict=True)]
    return (f"greedy GT {greedy:.3f}  sampled GT {statistics.fmean(truths):.3f}  "
            f"KL to SFT {statistics.fmean(kls):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="distinct", choices=demo.TASKS)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--steps12", type=Path, required=True, help="holds actor/ and reward/")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    sft, tokenizer = load_actor(args.steps12 / "actor")
    scorer = RewardScorer(load_reward_model(str(args.steps12 / "reward"), tokenizer).eval(),
                          tokenizer, tokenizer, torch.device("cpu"))
    task = [f"data.demo_task={args.task}"]
    train_ids, train_texts, _ = test_prompts(args.seed, task, args.steps12 / "actor",
                                             args.prompts, offset=TRAIN_SEED_OFFSET)
    test_ids, test_texts, max_len = test_prompts(args.seed, task, args.steps12 / "actor", 128)
    sequences, masks, picked = favourites(sft, tokenizer, scorer, train_ids, train_texts,
                                          max_len, args.seed + SAMPLE_SEED_OFFSET, args.n)
    prompt_len = collate_prompts(train_ids, tokenizer.pad_token_id)["input_ids"].shape[1]
    print(f"{args.task}, seed {args.seed}: best-of-{args.n} of the SFT model on "
          f"{args.prompts} training prompts, the picks' ground truth {picked:.3f}", flush=True)

    measure = (sft, tokenizer, test_ids, test_texts, max_len, args.seed)
    print(f"  {'SFT':<9} {evaluate(sft, *measure)}", flush=True)
    policy = copy.deepcopy(sft)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    for epoch in range(1, args.epochs + 1):
        policy.train()
        for rows in torch.randperm(len(train_ids)).split(32):
            logprobs = answer_logprobs(policy, sequences[rows], masks[rows], prompt_len)
            loss = -masked_mean(logprobs, masks[rows, prompt_len:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"  {f'epoch {epoch}':<9} {evaluate(policy, *measure)}", flush=True)


if __name__ == "__main__":
    main()
