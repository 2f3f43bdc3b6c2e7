"""Steps 1, 2 and 3 on real preference data, padded against packed (sft.packing, rm.packing,
ppo.packing).

The hh-rlhf pairs in ../shared/data, tokenized as steps 1 and 2 tokenize them (OPT's
tokenizer, prompts and answers up to 256 tokens), in seeded batches of --batch-size. For
each batch, one forward and backward of the step's loss (steps/sft.py's batch_loss,
steps/reward.py's pair_loss) on the batch padded (collate_sft, collate_pairs) and packed
(collate_packed_sft, collate_packed_pairs), the two in alternating order on the same model
and weights. Step 3's rows are rollouts of the same prompts, left-padded, and the chosen
answers standing in for sampled ones, right-padded: the update's forward and backward of
the answer tokens' log-probs (steps/ppo.py's answer_logprobs), packed by ppo.packing. Printed per step: the real tokens, the tokens each form puts through the model
(rows x width), the seconds of each, and the largest difference between their losses.

Run:  python bench/packing.py [--batches 12] [--batch-size 8] [--model tiny-llama-4l]
      (about 3 minutes on 2 CPU cores at the defaults)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.models import (  # noqa: E402
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    packed_scores,
    sequence_scores,
)
from engine.packing import require_packing, unpadded  # noqa: E402
from steps import reward, sft  # noqa: E402
from steps.data import load_pairs  # noqa: E402
from steps.ppo import answer_logprobs  # noqa: E402
from steps.tokenize import (  # noqa: E402
    IGNORE_INDEX,
    collate_packed_pairs,
    collate_packed_sft,
    collate_pairs,
    collate_sft,
    tokenize_pairs,
    tokenize_sft,
)

DATA = REPO.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
TOKENIZER = REPO.parent / "shared" / "tokenizers" / "opt"


class Scorer:
    """What steps/reward.py's pair_loss calls (a TrainEngine's two scoring methods)."""

    def __init__(self, model):
        self.model = model

    def sequence_scores(self, input_ids, attention_mask):
        return sequence_scores(self.model, input_ids, attention_mask)

    def packed_scores(self, input_ids, position_ids, ends):
        return packed_scores(self.model, input_ids, position_ids, ends)


def timed_step(model, loss_fn, batch: dict, examples: list, device: torch.device
               ) -> tuple[float, float]:
    """(seconds, loss) of one forward and backward of `loss_fn` on `batch`."""
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        loss, _ = loss_fn(model, batch, examples)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, float(loss.detach())


def measure(name: str, model, loss_fn, collates, examples: list, args, device) -> dict:
    rng = random.Random(args.seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    row = {"step": name, "real": 0, "padded": 0, "packed": 0, "padded_s": 0.0,
           "packed_s": 0.0, "loss_diff": 0.0}
    model.to(device).train()
    for b in range(args.batches + 1):   # batch 0 warms up, unmeasured
        chunk = [examples[i] for i in order[b * args.batch_size:(b + 1) * args.batch_size]]
        if not chunk:
            break
        forms = {form: collate(chunk) for form, collate in collates.items()}
        losses = {}
        for form in sorted(forms, reverse=b % 2 == 1):   # alternate which runs first
            seconds, losses[form] = timed_step(model, loss_fn, forms[form], chunk, device)
            if b:
                row[f"{form}_s"] += seconds
        if b:
            row["real"] += _real_tokens(chunk)
            for form in ("padded", "packed"):   # step 3's packing is in its forward
                row[form] += forms[form].get("tokens", forms[form]["input_ids"].numel())
            row["loss_diff"] = max(row["loss_diff"], abs(losses["padded"] - losses["packed"]))
    return row


def rollouts(chunk: list) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Step 3's rollout batch of SFT examples' prompts (left-padded) and answers (right-
    padded; the dataset's chosen answers standing in for sampled ones): sequences [B, P + N],
    attention_mask, P."""
    split = [(ex.input_ids[:ex.labels.count(IGNORE_INDEX)],
              ex.input_ids[ex.labels.count(IGNORE_INDEX):]) for ex in chunk]
    prompt_len = max(len(p) for p, _ in split)
    answer_len = max(len(a) for _, a in split)
    ids = torch.zeros((len(chunk), prompt_len + answer_len), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (prompt, answer) in enumerate(split):
        start = prompt_len - len(prompt)
        ids[row, start:start + len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        mask[row, start:start + len(prompt) + len(answer)] = 1
    return ids, mask, prompt_len


def step3_update(model, batch: dict, chunk: list) -> tuple[torch.Tensor, None]:
    """The update's forward (steps/ppo.py's answer_logprobs, as train_on takes it): a loss
    of each answer token's log-prob, padded or packed (batch["packed"])."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logprobs = answer_logprobs(model, ids, mask, batch["prompt_len"], packed=batch["packed"])
    answered = mask[:, batch["prompt_len"]:]
    return -(logprobs * answered).sum() / answered.sum(), None


def step3_batch(chunk: list, packed: bool) -> dict:
    ids, mask, prompt_len = rollouts(chunk)
    tokens = unpadded(ids, mask).input_ids.numel() if packed else ids.numel()
    return {"input_ids": ids, "attention_mask": mask, "prompt_len": prompt_len,
            "packed": packed, "tokens": tokens}


def _real_tokens(chunk: list) -> int:
    if hasattr(chunk[0], "input_ids"):
        return sum(len(ex.input_ids) for ex in chunk)
    return sum(len(ex.chosen_ids) + len(ex.rejected_ids) for ex in chunk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=12, help="measured batches per step")
    parser.add_argument("--batch-size", type=int, default=8, help="examples (pairs) per batch")
    parser.add_argument("--model", default="tiny-llama-4l", help="preset or model directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    tok = load_tokenizer(args.model, tokenizer=str(TOKENIZER))
    pairs, _ = load_pairs(str(DATA))
    sft_examples = tokenize_sft(pairs, tok, 256, 256)[0]
    pair_examples = tokenize_pairs(pairs, tok, 256, 256)[0]
    pad = tok.pad_token_id

    lm = load_causal_lm(args.model, tok, seed=args.seed)
    require_packing(lm, "sft.packing=true", f"--model {args.model}")
    rows = [measure("1 SFT", lm, sft.batch_loss,
                    {"padded": lambda c: collate_sft(c, pad),
                     "packed": lambda c: collate_packed_sft(c, pad)},
                    sft_examples, args, device)]
    rows.append(measure("3 update (answer log-probs)", lm, step3_update,
                        {form: lambda c, form=form: step3_batch(c, form == "packed")
                         for form in ("padded", "packed")}, sft_examples, args, device))
    del lm
    scorer = load_reward_model(args.model, tok, seed=args.seed)
    rows.append(measure("2 reward model", scorer,
                        lambda model, batch, ex: reward.pair_loss(Scorer(model), batch, ex),
                        {"padded": lambda c: collate_pairs(c, pad),
                         "packed": lambda c: collate_packed_pairs(c, pad)},
                        pair_examples, args, device))

    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# {args.model}, OPT tokenizer, {DATA.name}, {args.batches} batches of "
          f"{args.batch_size} after one warm-up, forward + backward, on {name}")
    print("| step | real tokens | padded: tokens through the model | packed | padded s | "
          "packed s | speed-up | largest loss difference |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['real']:,} | {r['padded']:,} ({r['padded'] / r['real']:.2f}x)"
              f" | {r['packed']:,} ({r['packed'] / r['real']:.2f}x) | {r['padded_s']:.2f} | "
              f"{r['packed_s']:.2f} | {r['padded_s'] / r['packed_s']:.2f}x | "
              f"{r['loss_diff']:.1e} |")


if __name__ == "__main__":
    main()
