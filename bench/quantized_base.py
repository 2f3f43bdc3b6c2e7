"""Quality of LoRA over a quantized frozen base (engine/quantized_base.py) against LoRA over
the same base in full precision, through train.py (subprocesses), on CPU:

  demo   the demo's step 3 (PPO) with a LoRA actor (rank 16, only LoRA trains) from one
         demo step-1/2 run, per seed: ground truth before -> after, for a full-precision,
         an INT8 and an INT4 base. Goal: INT8's gain within the seeds' spread of full's.
  sft    step 1 (SFT) with LoRA on half the hh-rlhf file (harmless-base test split) over
         one saved tiny-llama base (random weights, the byte tokenizer: a CPU-sized vocabulary):
         the final training loss (mean of the last 10% of steps) per base. Goal: INT8 <= 1.05x
         full precision.

Run:  python bench/quantized_base.py [--part demo|sft|all] [--seeds 1,2]   (~15 min, 2 cores)
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine.tracking import read_metrics  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
BASES = {"full": [], "int8": ["--zero-quantized-nontrainable-weights"],
         "int4": ["--zero-quantized-nontrainable-weights", "engine.quantized_base.bits=4"]}
QUIET = ["logging.progress=false", "engine.checkpoint_every=0", "overwrite=true",
         "resume=false"]


def train(out: Path, *args: str) -> float:
    """Run train.py; its log goes to out/train.log. Returns the wall time."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "train.py"), "--output-dir", str(out), *args, *QUIET]
    print(f"$ {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    with open(out / "train.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "WANDB_MODE": "disabled"}, timeout=3600)
    if done.returncode:
        raise SystemExit(f"train.py failed: see {out / 'train.log'}")
    return time.perf_counter() - start


def rows(path: Path) -> list[dict]:
    return read_metrics(path)


def demo(root: Path, seeds: list[int]) -> None:
    train(root / "steps12", "--step", "1", "2")
    gains: dict[str, list[float]] = {name: [] for name in BASES}
    print(f"\ndemo step 3, LoRA actor (rank 16, lr 5e-3, only LoRA trains), from "
          f"{root / 'steps12'}\n")
    print(f"{'base':<6}{'seed':>5}{'ground truth':>20}{'gain':>8}{'reward':>18}{'wall s':>8}")
    for name, flags in BASES.items():
        for seed in seeds:
            out = root / f"{name}-{seed}"
            wall = train(out, "--step", "3", f"seed={seed}",
                         f"ppo.actor_path={root / 'steps12' / 'actor'}",
                         f"ppo.reward_path={root / 'steps12' / 'reward'}",
                         "ppo.actor_lora.dim=16", "ppo.actor_lora.only_optimize_lora=true",
                         "ppo.actor_lora.learning_rate=5e-3", *flags)
            final = rows(out / "step3" / "metrics.jsonl")[-1]
            gt = final["eval/ground_truth_before"], final["eval/ground_truth_after"]
            reward = final["eval/reward_before"], final["eval/reward_after"]
            gain = gt[1] - gt[0]
            gains[name].append(gain)
            print(f"{name:<6}{seed:>5}{gt[0]:>10.3f} -> {gt[1]:.3f}{gain:>+8.3f}"
                  f"{reward[0]:>8.3f} -> {reward[1]:.3f}{wall:>8.0f}", flush=True)
    print()
    for name, values in gains.items():
        spread = statistics.stdev(values) if len(values) > 1 else float("nan")
        print(f"{name:<6} mean gain {statistics.fmean(values):+.3f} (sd {spread:.3f}, "
              f"{len(values)} seeds)")


def sft(root: Path) -> None:
    from engine.models import byte_tokenizer, load_causal_lm

    base = root / "tiny-llama-base"
    load_causal_lm("tiny-llama", byte_tokenizer(), seed=0).save_pretrained(base)
    byte_tokenizer().save_pretrained(base)
    finals = {}
    for name, flags in BASES.items():
        out = root / f"sft-{name}"
        wall = train(out, "--step", "1", "--actor-model", str(base), f"data.path={DATA}",
                     "data.split=[0.5,0,0]", "data.max_prompt_len=384", "data.max_answer_len=96",
                     "sft.epochs=1", "sft.batch_size=16", "sft.log_every=1",
                     "sft.lora.dim=16", "sft.lora.only_optimize_lora=true",
                     "sft.lora.learning_rate=5e-3", "sft.warmup_steps=10", *flags)
        losses = [r["train/loss"] for r in rows(out / "step1" / "metrics.jsonl")
                  if "train/lr" in r]
        tail = losses[-max(1, len(losses) // 10):]
        finals[name] = (losses[0], statistics.fmean(tail), len(losses), wall)
    print(f"\nstep 1 SFT, LoRA rank 16 over a saved tiny-llama base, {DATA.name}\n")
    print(f"{'base':<6}{'first loss':>11}{'final loss':>11}{'vs full':>9}{'steps':>7}{'wall s':>8}")
    for name, (first, final, steps, wall) in finals.items():
        print(f"{name:<6}{first:>11.4f}{final:>11.4f}{final / finals['full'][1]:>8.3f}x"
              f"{steps:>7}{wall:>8.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "demo", "sft"], default="all")
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--out", default="/tmp/bench-quantized-base")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    root = Path(args.out)
    print(f"command: python bench/quantized_base.py {shlex.join(sys.argv[1:])}")
    if args.part in ("all", "sft"):
        sft(root)
    if args.part in ("all", "demo"):
        demo(root, [int(s) for s in args.seeds.split(",")])


if __name__ == "__main__":
    main()
