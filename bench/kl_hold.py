"""How well step 3's adaptive KL controller holds its target, from finished runs' logs.

For each run directory (one `python train.py --step 3 ...` output, e.g. those
bench/step3_quality.py leaves under its --root), over the iterations after the first
fifth (the controller's approach): the mean and standard deviation of the KL per answer
to the reference of each iteration's rollouts (what the controller reads: the KL over the
vocabulary, `reward/kl_vocab`, where the run logged it, else the sampled log-ratio,
`reward/kl`; --sampled: always the latter), the share of iterations within
±25% of the target, and the range of the coefficient (`kl_coef`); and the highest KL of
the whole run. Runs are grouped by the name between the task and the seed
(<task>-<setting>-<seed>, as bench/step3_quality.py names them).

Run:  python bench/kl_hold.py ROOT [ROOT ...] [--settings guarded grpo] [--target 0.964]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.tracking import read_metrics  # noqa: E402
from steps.ppo import DEFAULT_BEST_OF_N, KL_TARGET_SHARE, best_of_n_kl  # noqa: E402


def hold(run: Path, target: float, sampled: bool
         ) -> tuple[float, float, float, float, float, float]:
    """(mean KL, its sd, share within ±25% of target, min and max coefficient) after the
    first fifth of the run's iterations, and the run's highest KL."""
    rows = read_metrics(run / "step3" / "metrics.jsonl")
    iterations = [r for r in rows if "reward/kl" in r]
    kls = [r["reward/kl"] if sampled else r.get("reward/kl_vocab", r["reward/kl"])
           for r in iterations]
    first = len(iterations) // 5
    kl, coef = kls[first:], [r["kl_coef"] for r in iterations[first:]]
    return (statistics.fmean(kl), statistics.stdev(kl),
            sum(abs(k / target - 1) < 0.25 for k in kl) / len(kl), min(coef), max(coef),
            max(kls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", nargs="+", type=Path)
    parser.add_argument("--settings", nargs="*", default=None, help="default: all")
    parser.add_argument("--target", type=float,
                        default=KL_TARGET_SHARE * best_of_n_kl(DEFAULT_BEST_OF_N),
                        help="the KL target the runs aimed at (default: step 3's default)")
    parser.add_argument("--sampled", action="store_true",
                        help="the sampled log-ratio (reward/kl) even where reward/kl_vocab was "
                             "logged")
    args = parser.parse_args()
    print(f"{'root':<16} {'setting':<14} runs  KL mean ± sd   within ±25%   kl_coef range"
          "   highest KL (mean, max)")
    for root in args.roots:
        groups: dict[str, list] = defaultdict(list)
        for run in sorted(root.iterdir()):
            _task, *setting, _seed = run.name.split("-")
            name = "-".join(setting)
            done = (run / "step3" / "actor" / "config.json").exists()
            if done and (args.settings is None or name in args.settings):
                groups[name].append(hold(run, args.target, args.sampled))
        for name, runs in groups.items():
            mean = [statistics.fmean(r[i] for r in runs) for i in range(6)]
            print(f"{root.name:<16} {name:<14} {len(runs):>4}  {mean[0]:.2f} ± {mean[1]:.2f}"
                  f"   {mean[2]:>10.0%}   {min(r[3] for r in runs):.2f}-"
                  f"{max(r[4] for r in runs):<8.2f}   {mean[5]:.1f}, "
                  f"{max(r[5] for r in runs):.1f}")


if __name__ == "__main__":
    main()
