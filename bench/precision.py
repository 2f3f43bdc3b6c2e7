"""The demo in fp32 and in bf16, side by side: does bf16 training (fp32 master weights, bf16
compute, engine/precision.py) reach what fp32 reaches?

For each seed and dtype it runs `python train.py seed=S engine.dtype=D` (the demo: SFT,
reward model, PPO), and with --grpo also GRPO's step 3 from the same step-1 and step-2
models, then prints per run: SFT perplexity, reward-model accuracy, the ground truth before
and after step 3, and each step's wall time; then bf16 minus fp32 per seed.

Run:  python bench/precision.py                  (the device's default: CUDA when present)
      python bench/precision.py --device cpu --seeds 1234 99 7 --grpo
Runs whose output directory already holds a finished run are read, not run again.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from engine.tracking import read_metrics  # noqa: E402

GRPO = ["ppo.algorithm=grpo", "ppo.samples_per_prompt=4", "ppo.rollout_batch_size=16",
        "ppo.epochs=1"]


def last_row(path: Path) -> dict:
    return read_metrics(path)[-1]


def run(out: Path, args: list[str]) -> None:
    if (out / "step3" / "actor" / "config.json").exists():
        return
    command = [sys.executable, str(REPO / "train.py"), "--output-dir", str(out),
               "logging.progress=false", *args]
    print("$ " + shlex.join(command[1:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def results(out: Path) -> dict:
    sft, rm, ppo = (last_row(out / f"step{s}" / "metrics.jsonl") for s in (1, 2, 3))
    return {"perplexity": sft["eval/perplexity"], "accuracy": rm["eval/accuracy"],
            "before": ppo["eval/ground_truth_before"], "after": ppo["eval/ground_truth_after"],
            "seconds": [sft["time/seconds"], rm["time/seconds"], ppo["time/seconds"]],
            "iteration": ppo["time/seconds"] / ppo["iterations"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 99, 7])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--grpo", action="store_true", help="also GRPO's step 3 (about 1 min each)")
    p.add_argument("--out", type=Path, default=Path("output/precision"))
    args = p.parse_args()

    table = {}
    for seed in args.seeds:
        for dtype in args.dtypes:
            out = args.out / f"demo-{dtype}-{seed}"
            run(out, [f"seed={seed}", f"engine.dtype={dtype}", f"engine.device={args.device}"])
            table[seed, dtype, "ppo"] = results(out)
            if args.grpo:
                grpo = args.out / f"demo-{dtype}-{seed}-grpo"
                run(grpo, ["--step", "3", f"seed={seed}", f"engine.dtype={dtype}",
                           f"engine.device={args.device}", f"ppo.actor_path={out / 'actor'}",
                           f"ppo.reward_path={out / 'reward'}", *GRPO])
                row = last_row(grpo / "step3" / "metrics.jsonl")
                table[seed, dtype, "grpo"] = {
                    **table[seed, dtype, "ppo"], "before": row["eval/ground_truth_before"],
                    "after": row["eval/ground_truth_after"],
                    "iteration": row["time/seconds"] / row["iterations"]}

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"{'seed':>5}  {'dtype':<9}  {'step 3':<6}  {'SFT ppl':>7}  {'RM acc':>6}  "
          f"{'ground truth':>14}  {'step 1 / 2 / 3 s':>18}  {'s/iter':>6}")
    for (seed, dtype, algo), r in table.items():
        times = " / ".join(f"{t:.1f}" for t in r["seconds"]) if algo == "ppo" else "-"
        print(f"{seed:>5}  {dtype:<9}  {algo:<6}  {r['perplexity']:>7.3f}  {r['accuracy']:>6.3f}"
              f"  {r['before']:.3f} -> {r['after']:.3f}  {times:>18}  {r['iteration']:>6.3f}")
    if {"float32", "bfloat16"} <= set(args.dtypes):
        print("\nbf16 - fp32, ground truth after step 3:")
        for (seed, dtype, algo), r in table.items():
            if dtype == "bfloat16":
                fp32 = table[seed, "float32", algo]
                print(f"  seed {seed} {algo}: {r['after'] - fp32['after']:+.3f} (RM accuracy "
                      f"{r['accuracy']:.3f} vs {fp32['accuracy']:.3f})")


if __name__ == "__main__":
    main()
