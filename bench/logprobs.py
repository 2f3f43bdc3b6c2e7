"""Memory and time of step 3's log-prob passes, three ways:
  before    the model's logits for every position, then a float32 log_softmax of the
            answer's;
  chunked   the head on the answer's positions only (`logits_to_keep`), then the fused,
            chunked steps.rlhf.logprobs_of_tokens, which makes no float32 [B, N, V] tensor
            but keeps the [B, N, V] logits and makes their gradient (until 2026-11-28);
  now       steps/ppo.py's answer_logprobs: the head itself run a few rows at a time
            (engine.models.head_reduced), each chunk's logits made again in backward, so
            neither the batch's logits nor their gradient exists whole.

One random-init Llama with a real vocabulary (50,272, OPT's) and a small body, so that the
logits weigh what they weigh at RL batch sizes; bf16 compute over fp32 master weights
(engine.TrainEngine). Per way, for a [rows, prompt + answer] batch:
  train     the policy loss's pass: log-probs with grad, a loss, backward (the update's);
  no_grad   the reference / old log-probs' pass (make_experience).
Printed per pass: the peak (CUDA: torch.cuda.max_memory_allocated; CPU: live tensor
storages, torch's MemTracker) above what was live before the pass, the median seconds of
--repeats runs, and the largest difference of the log-probs from the old way's.

Run:  python bench/logprobs.py [--device cpu|cuda] [--rows 16] [--prompt 64] [--answer 128]
      (about a minute on 2 CPU cores at the defaults)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import OptimConfig  # noqa: E402
from engine.runtime import setup_runtime  # noqa: E402
from engine.trainer import TrainEngine  # noqa: E402
from steps.ppo import answer_logprobs, position_ids  # noqa: E402
from steps.rlhf import logprobs_of_tokens  # noqa: E402


def old_answer_logprobs(model, sequences, attention_mask, prompt_len: int) -> torch.Tensor:
    """steps/ppo.py's answer_logprobs before: every position's logits, a float32
    log_softmax of the answer's."""
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask)).logits
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1], dim=-1, dtype=torch.float32)
    return logp.gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


def chunked_answer_logprobs(model, sequences, attention_mask, prompt_len: int) -> torch.Tensor:
    """steps/ppo.py's answer_logprobs until 2026-11-28: the answer's logits, then the fused,
    chunked log-probs."""
    answers = torch.nn.functional.pad(sequences[:, prompt_len:], (0, 1))
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask),
                   logits_to_keep=answers.shape[1]).logits
    return logprobs_of_tokens(logits, answers)[:, :-1]


WAYS = {"all logits, fp32 log_softmax (before)": old_answer_logprobs,
        "answer logits, fused chunked": chunked_answer_logprobs,
        "head a few rows at a time (now)": answer_logprobs}


def measure(fn, device: torch.device) -> tuple[int, float]:
    """Peak bytes above those live at the start, and seconds, of one call of `fn`."""
    from torch.distributed._tools.mem_tracker import MemTracker

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, time.perf_counter() - start
    tracker = MemTracker()
    with tracker:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return tracker.get_tracker_snapshot("peak")[device]["Total"], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--answer", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50272)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    rt = setup_runtime(args.device, "bfloat16", seed=0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=max(1, args.hidden // 64),
                         max_position_embeddings=args.prompt + args.answer)
    engine = TrainEngine(LlamaForCausalLM(config), OptimConfig(), total_steps=1, runtime=rt,
                         lr=0.0)
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, args.vocab, (args.rows, args.prompt + args.answer),
                              generator=gen).to(rt.device)
    mask = torch.ones_like(sequences)
    advantages = torch.randn(args.rows, args.answer, generator=gen).to(rt.device)

    results, reference = {}, None
    for label, way in WAYS.items():
        def train(way=way):
            loss = -(way(engine, sequences, mask, args.prompt) * advantages).mean()
            engine.backward(loss)
            engine.optimizer.zero_grad(set_to_none=True)

        def no_grad(way=way):
            with torch.no_grad():
                return way(engine, sequences, mask, args.prompt)

        with torch.no_grad():
            logprobs = way(engine, sequences, mask, args.prompt)
        reference = logprobs if reference is None else reference
        runs = {name: [measure(fn, rt.device) for _ in range(args.repeats)]
                for name, fn in (("train", train), ("no_grad", no_grad))}
        results[label] = ({name: (max(p for p, _ in r), statistics.median(s for _, s in r))
                           for name, r in runs.items()},
                          float((logprobs - reference).abs().max()))

    print(f"{args.device}, bf16 compute: {args.rows} rows x ({args.prompt} prompt + "
          f"{args.answer} answer) tokens, vocab {args.vocab}, Llama {args.layers} x "
          f"{args.hidden}")
    print(f"{'log-probs':<40} {'train MiB':>10} {'train s':>8} {'no_grad MiB':>12} "
          f"{'no_grad s':>10} {'max |diff|':>11}")
    base = next(iter(results.values()))[0]
    for label, (passes, diff) in results.items():
        print(f"{label:<40} {passes['train'][0] / 2**20:>10.0f} {passes['train'][1]:>8.3f} "
              f"{passes['no_grad'][0] / 2**20:>12.0f} {passes['no_grad'][1]:>10.3f} "
              f"{diff:>11.2e}")
    for label, (passes, _) in list(results.items())[1:]:
        print(f"peak ratio {label} / before: train {passes['train'][0] / base['train'][0]:.2f}"
              f", no_grad {passes['no_grad'][0] / base['no_grad'][0]:.2f}")


if __name__ == "__main__":
    main()
