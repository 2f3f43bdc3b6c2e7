"""Step 3's algorithms side by side on the demo task, through train.py (subprocesses), on
CPU: PPO, GRPO, RLOO, REINFORCE++, REINFORCE++-baseline and GSPO (GRPO with
ppo.importance_ratio=sequence and GSPO's clips), each rewarded by the step-2
reward model (`rm`) and by the demo's ground-truth scorer as a reward function alone
(`fn`: ppo.reward_fn=steps.demo:score, ppo.reward_model_weight=0), from one demo step-1/2
run per seed.

Per run: the ground truth of held-out answers before -> after step 3, step 3's wall time,
its memory peak (CUDA allocator, or on CPU the process's resident set, which includes
Python and the libraries) and the bytes of trained state (parameters + AdamW state of the
actor and, for PPO, the critic).

Budgets: PPO and REINFORCE++ sample one answer per prompt, 32 prompts a round, 2 epochs
over the step-3 prompts (the demo recipe until 2026-11-27, which now gives PPO GRPO's
layout); GRPO, RLOO, REINFORCE++-baseline and GSPO 4 answers per prompt, 16 prompts a round,
1 epoch: twice the answers, in about the same number of iterations.

--part hacking: reward over-optimisation on the `distinct` demo task (data.demo_task=
distinct: "Give me 4 different even digits.", whose preference pairs hold no repeated
digits, so its reward model never saw degenerate repetition). PPO from one step-1/2 run
per seed, 4 epochs over the step-3 prompts, three ways: no KL penalty at all
(ppo.kl_coef=0), the demo's fixed penalty (0.05), and with the guards: the adaptive KL
controller (ppo.kl_target=1, ppo.kl_horizon=1000) and ppo.missing_eos_penalty=1. Per run:
reward-model score and ground truth of held-out answers before -> after, and over the
last 10 iterations the KL per answer, the share of answers that ended with EOS, and the
final kl_coef.

--part dynamic: DAPO's dynamic sampling (GRPO, the ground truth as the reward alone, so
that many groups score alike) beside plain GRPO, with the learning rate's linear schedule
(on the data's clock), a constant rate (DAPO's recipe), and the linear one over 3 epochs.
Per run: the ground truth before -> after and exported (its iteration and KL), the
iterations, the final learning rate and step 3's time.

--part dpo: DPO (ppo.algorithm=dpo: offline, on step 3's share of the pairs, no reward
model) at several betas and losses (KTO's among them), beside PPO (the demo recipe's step
3), each from one demo step-1/2 run per seed (DPO reads its actor alone). Per run: the
ground truth of the held-out prompts' sampled answers before -> after (PPO: after, and
the policy it exports), the greedy answers' after, the sampled answers' KL to the SFT
model, and step 3's time.

--part online: online DPO (ppo.algorithm=online_dpo: each group's best and worst answer by
the step-2 reward model, a DPO pair) and online KTO (ppo.dpo_loss=kto: every answer above its
group's mean desirable, below it undesirable) at several betas, beside PPO and the SFT model's
best-of-16, each from one demo step-1/2 run per seed, with the demo recipe's step 3
otherwise (16 prompts x 4 answers a round, export=best within best-of-16's KL). Per run:
the ground truth of the held-out sampled answers before -> after and of the policy it
exports, with the KL of each, and step 3's time.

Run:  python bench/algorithms.py [--part algorithms|hacking|dynamic|dpo|online|all]
      [--seeds 1,2,3]
      [--algorithms ppo,grpo,rloo,reinforce_pp,reinforce_pp_baseline,gspo] [--rewards rm,fn]
      [--dpo-runs "dpo,kto,kto beta 0.5"] (--part dpo: these of its runs; default all)
      (algorithms ~25 min, hacking ~15 min, dynamic ~7 min, dpo ~20 min, online ~35 min
      for 3 seeds on 2 cores, alone)
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

from quantized_base import rows, train

ONE_ANSWER = ["ppo.samples_per_prompt=1", "ppo.rollout_batch_size=32"]
SETTINGS = {
    "ppo": [*ONE_ANSWER, "ppo.epochs=2"],
    "grpo": ["ppo.algorithm=grpo", "ppo.samples_per_prompt=4", "ppo.rollout_batch_size=16",
             "ppo.epochs=1"],
    "rloo": ["ppo.algorithm=rloo", "ppo.samples_per_prompt=4", "ppo.rollout_batch_size=16",
             "ppo.epochs=1"],
    "reinforce_pp": ["ppo.algorithm=reinforce_pp", *ONE_ANSWER, "ppo.epochs=2"],
    "reinforce_pp_baseline": ["ppo.algorithm=reinforce_pp_baseline", "ppo.samples_per_prompt=4",
                              "ppo.rollout_batch_size=16", "ppo.epochs=1"],
    # GRPO with GSPO's sequence ratio and its paper's clips and aggregation
    "gspo": ["ppo.algorithm=grpo", "ppo.samples_per_prompt=4", "ppo.rollout_batch_size=16",
             "ppo.epochs=1", "ppo.importance_ratio=sequence", "ppo.clip_range=3e-4",
             "ppo.clip_range_high=4e-4", "ppo.loss_aggregation=seq-mean"],
}
REWARDS = {"rm": [], "fn": ["ppo.reward_fn=steps.demo:score", "ppo.reward_model_weight=0"]}
DYNAMIC = {"grpo": [], "dynamic": ["ppo.dynamic_sampling=true"],
           "constant lr": ["ppo.dynamic_sampling=true", "ppo.lr_scheduler=constant"],
           "dynamic, 3 ep": ["ppo.dynamic_sampling=true", "ppo.epochs=3"]}
DPO = {"dpo": [], "dpo beta 0.5": ["dpo.beta=0.5"], "dpo beta 1": ["dpo.beta=1"],
       "cdpo 0.1": ["dpo.label_smoothing=0.1"], "ipo beta 1": ["dpo.loss=ipo", "dpo.beta=1"],
       # reference-free: SimPO at its paper's beta and a margin of 1 (at 1e-3 it drifts to a
       # KL of 36), ORPO with the NLL term its paper adds, its odds-ratio weight 1 (0.1 barely
       # moves the SFT model)
       "simpo": ["dpo.loss=simpo", "dpo.beta=2", "dpo.simpo_gamma=1", "dpo.lr=1e-4"],
       "orpo beta 1": ["dpo.loss=orpo", "dpo.beta=1", "dpo.nll_coef=1"],
       # KTO: each pair's answers as one desirable and one undesirable
       "kto": ["dpo.loss=kto"], "kto beta 0.5": ["dpo.loss=kto", "dpo.beta=0.5"],
       "kto beta 1": ["dpo.loss=kto", "dpo.beta=1"],
       # held to best-of-16's KL as PPO is: the best of its evaluations every 20 updates
       "kto best": ["dpo.loss=kto", "dpo.export=best", "dpo.eval_every=20"],
       # the EMA of the weights (step3/actor_ema), evaluated beside the last policy
       "dpo ema": ["dpo.ema.enabled=true"], "dpo ema 0.98": ["dpo.ema.enabled=true",
                                                          "dpo.ema.beta=0.98"]}
ONLINE = {"online dpo": [], "beta 1": ["ppo.dpo_beta=1"], "beta 2": ["ppo.dpo_beta=2"],
          "kto": ["ppo.dpo_loss=kto"], "kto beta 1": ["ppo.dpo_loss=kto", "ppo.dpo_beta=1"],
          "kto beta 2": ["ppo.dpo_loss=kto", "ppo.dpo_beta=2"],
          "kto beta 4": ["ppo.dpo_loss=kto", "ppo.dpo_beta=4"]}
GUARDS = {"no KL": ["ppo.kl_coef=0"], "fixed KL": [],
          "guards": ["ppo.kl_target=1", "ppo.kl_horizon=1000", "ppo.missing_eos_penalty=1"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="all",
                        choices=["all", "algorithms", "hacking", "dynamic", "dpo", "online"])
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--algorithms", default=",".join(SETTINGS))
    parser.add_argument("--rewards", default=",".join(REWARDS))
    parser.add_argument("--dpo-runs", default=",".join(DPO))
    parser.add_argument("--out", default="/tmp/bench-algorithms")
    args = parser.parse_args()
    root = Path(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"command: python bench/algorithms.py {shlex.join(sys.argv[1:])}", flush=True)
    if args.part in ("all", "hacking"):
        hacking(root, seeds)
    if args.part in ("all", "algorithms"):
        algorithms(root, seeds, args.algorithms.split(","), args.rewards.split(","))
    if args.part in ("all", "dynamic"):
        dynamic_sampling(root, seeds)
    if args.part in ("all", "dpo"):
        dpo(root, seeds, args.dpo_runs.split(","))
    if args.part in ("all", "online"):
        online_dpo(root, seeds)


def hacking(root: Path, seeds: list[int]) -> None:
    lines = []
    for seed in seeds:
        base = root / f"distinct-steps12-{seed}"
        if not (base / "reward" / "config.json").exists():
            train(base, "--step", "1", "2", f"seed={seed}", "data.demo_task=distinct")
        for name, flags in GUARDS.items():
            out = root / f"distinct-{name.replace(' ', '-')}-{seed}"
            train(out, "--step", "3", f"seed={seed}", "data.demo_task=distinct",
                  *ONE_ANSWER, "ppo.epochs=4", f"ppo.actor_path={base / 'actor'}",
                  f"ppo.reward_path={base / 'reward'}", *flags)
            metrics = rows(out / "step3" / "metrics.jsonl")
            final, last = metrics[-1], [r for r in metrics if "reward/kl" in r][-10:]
            lines.append(
                f"{name:<10}{seed:>5}{final['eval/reward_before']:>9.3f} -> "
                f"{final['eval/reward_after']:.3f}{final['eval/ground_truth_before']:>9.3f} -> "
                f"{final['eval/ground_truth_after']:.3f}"
                f"{statistics.fmean(r['reward/kl'] for r in last):>9.2f}"
                f"{statistics.fmean(r['answer/ended_with_eos'] for r in last):>9.2f}"
                f"{statistics.fmean(r['answer/length'] for r in last):>9.1f}"
                f"{last[-1]['kl_coef']:>10.4f}")
            print(lines[-1], flush=True)
    print(f"\n{'run':<10}{'seed':>5}{'reward model':>19}{'ground truth':>19}{'KL':>9}"
          f"{'EOS':>9}{'length':>9}{'kl_coef':>10}")
    print("\n".join(lines))


def algorithms(root: Path, seeds: list[int], names: list[str], rewards: list[str]) -> None:
    results: dict[tuple[str, str], list[tuple]] = {}
    for seed in seeds:
        base = demo_steps12(root, seed)
        for algorithm in names:
            for reward in rewards:
                out = root / f"{algorithm}-{reward}-{seed}"
                train(out, "--step", "3", f"seed={seed}", f"ppo.actor_path={base / 'actor'}",
                      f"ppo.reward_path={base / 'reward'}", *SETTINGS[algorithm],
                      *REWARDS[reward])
                final = rows(out / "step3" / "metrics.jsonl")[-1]
                result = (seed, final["eval/ground_truth_before"],
                          final["eval/ground_truth_after"], final["time/seconds"],
                          final["memory/peak_mib"], final["memory/trained_mib"],
                          final["iterations"])
                results.setdefault((algorithm, reward), []).append(result)
                print(f"{algorithm:<22}{reward:<4}" + _row(result), flush=True)
    print(f"\n{'algorithm':<22}{'reward':<7}{'seed':>5}{'ground truth':>18}{'gain':>8}"
          f"{'step 3 s':>10}{'peak MiB':>10}{'trained MiB':>13}{'iters':>7}")
    for (algorithm, reward), runs in results.items():
        for result in runs:
            print(f"{algorithm:<22}{reward:<7}" + _row(result))
    print(f"\n{'algorithm':<22}{'reward':<7}{'mean gain':>10}{'min gain':>10}{'mean s':>8}"
          f"{'mean peak MiB':>15}{'trained MiB':>13}")
    for (algorithm, reward), runs in results.items():
        gains = [after - before for _, before, after, *_ in runs]
        print(f"{algorithm:<22}{reward:<7}{statistics.fmean(gains):>+10.3f}{min(gains):>+10.3f}"
              f"{statistics.fmean(r[3] for r in runs):>8.1f}"
              f"{statistics.fmean(r[4] for r in runs):>15.0f}{runs[0][5]:>13.1f}")


def dynamic_sampling(root: Path, seeds: list[int]) -> None:
    lines, finals = [], {name: [] for name in DYNAMIC}
    for seed in seeds:
        base = demo_steps12(root, seed)
        for name, flags in DYNAMIC.items():
            out = root / f"dynamic-{name.replace(', ', '-').replace(' ', '-')}-{seed}"
            train(out, "--step", "3", f"seed={seed}", f"ppo.actor_path={base / 'actor'}",
                  f"ppo.reward_path={base / 'reward'}", *SETTINGS["grpo"], *REWARDS["fn"],
                  *flags)
            metrics = rows(out / "step3" / "metrics.jsonl")
            final = metrics[-1]
            lr = [r["lr/actor"] for r in metrics if "lr/actor" in r][-1]
            finals[name].append((final["eval/ground_truth_after"],
                                 final["eval/ground_truth_exported"]))
            lines.append(
                f"{seed:>5}  {name:<14}{final['iterations']:>6}"
                f"{final['eval/ground_truth_before']:>9.3f} -> "
                f"{final['eval/ground_truth_after']:.3f}"
                f"{final['eval/ground_truth_exported']:>9.3f} (it. "
                f"{final['eval/iteration_exported']}, KL {final['eval/kl_exported']:.3f})"
                f"{lr:>10.1e}{final['time/seconds']:>8.1f}")
            print(lines[-1], flush=True)
    print(f"\n{'seed':>5}  {'run':<14}{'iters':>6}{'ground truth':>18}{'exported':>12}"
          f"{'':>19}{'final lr':>10}{'s':>8}")
    print("\n".join(lines))
    print(f"\n{'run':<14}{'mean final':>11}{'mean exported':>15}")
    for name, runs in finals.items():
        print(f"{name:<14}{statistics.fmean(a for a, _ in runs):>11.3f}"
              f"{statistics.fmean(e for _, e in runs):>15.3f}")


def dpo(root: Path, seeds: list[int], names: list[str]) -> None:
    unknown = sorted(set(names) - set(DPO))
    if unknown:
        raise SystemExit(f"--dpo-runs: no run {', '.join(unknown)}; choose from {', '.join(DPO)}")
    lines, finals = [], {name: [] for name in ("ppo", *names)}
    for seed in seeds:
        base = demo_steps12(root, seed)
        out = root / f"dpo-ppo-{seed}"
        if not (out / "step3" / "finished").exists():
            train(out, "--step", "3", f"seed={seed}", f"ppo.actor_path={base / 'actor'}",
                  f"ppo.reward_path={base / 'reward'}")
        final = rows(out / "step3" / "metrics.jsonl")[-1]
        finals["ppo"].append(final["eval/ground_truth_exported"])
        lines.append(
            f"{seed:>5}  {'ppo':<14}{final['eval/ground_truth_before']:>9.3f} -> "
            f"{final['eval/ground_truth_after']:.3f} (exported "
            f"{final['eval/ground_truth_exported']:.3f})"
            f"{final['eval/greedy_ground_truth_after']:>9.3f}"
            f"{final['eval/kl_after']:>8.3f} (exported {final['eval/kl_exported']:.3f})"
            f"{final['time/seconds']:>8.1f}")
        print(lines[-1], flush=True)
        for name in names:
            flags = DPO[name]
            out = root / f"dpo-{name.replace(' ', '-')}-{seed}"
            train(out, "--step", "3", f"seed={seed}", f"ppo.actor_path={base / 'actor'}",
                  "ppo.algorithm=dpo", *flags)
            final = rows(out / "step3" / "metrics.jsonl")[-1]
            kept = "eval/step_exported" in final   # dpo.export=best: the policy it writes
            # dpo.ema: the EMA's figures beside the last policy's
            shown = "exported" if kept else "ema" if "eval/ground_truth_ema" in final else ""
            finals[name].append(final[f"eval/ground_truth_{shown}" if shown else
                                      "eval/ground_truth"])
            exported, kl_exported = ((f" ({shown} {final[f'eval/ground_truth_{shown}']:.3f})",
                                      f" ({shown} {final[f'eval/kl_{shown}']:.3f})")
                                     if shown else ("", ""))
            lines.append(
                f"{seed:>5}  {name:<14}{final['eval/ground_truth_before']:>9.3f} -> "
                f"{final['eval/ground_truth']:.3f}{exported:<19}"
                f"{final['eval/greedy_ground_truth']:>9.3f}{final['eval/kl']:>8.3f}"
                f"{kl_exported:<19}{final['time/seconds']:>8.1f}")
            print(lines[-1], flush=True)
    print(f"\n{'seed':>5}  {'run':<14}{'ground truth (sampled)':>37}{'greedy':>9}"
          f"{'KL':>8}{'':>19}{'s':>8}")
    print("\n".join(lines))
    print(f"\n{'run':<14}{'mean final':>11}  (PPO, export=best: exported; dpo.ema: the EMA)")
    for name, runs in finals.items():
        print(f"{name:<14}{statistics.fmean(runs):>11.3f}")


def online_dpo(root: Path, seeds: list[int]) -> None:
    runs = {"ppo": [], **{name: ["ppo.algorithm=online_dpo", *flags]
                          for name, flags in ONLINE.items()}}
    lines, finals = [], {name: [] for name in (*runs, "best-of-16")}
    for seed in seeds:
        base = demo_steps12(root, seed)
        for name, flags in runs.items():
            out = root / f"{'dpo' if name == 'ppo' else 'online'}-{name.replace(' ', '-')}-{seed}"
            if not (out / "step3" / "finished").exists():   # PPO's: --part dpo's run
                train(out, "--step", "3", f"seed={seed}", f"ppo.actor_path={base / 'actor'}",
                      f"ppo.reward_path={base / 'reward'}", *flags)
            metrics = rows(out / "step3" / "metrics.jsonl")
            baseline, final = metrics[0], metrics[-1]
            if name == "ppo":
                bon = (baseline["baseline/best_of_16_ground_truth"],
                       baseline["baseline/best_of_16_kl"])
                finals["best-of-16"].append(bon)
                lines.append(f"{seed:>5}  {'best-of-16':<17}{'':>16}{bon[0]:>9.3f}"
                             f"{bon[1]:>7.3f}{'':>8}")
            exported = (final["eval/ground_truth_exported"], final["eval/kl_exported"])
            finals[name].append(exported)
            lines.append(
                f"{seed:>5}  {name:<17}{final['eval/ground_truth_before']:>7.3f} -> "
                f"{final['eval/ground_truth_after']:.3f}{exported[0]:>9.3f}"
                f"{exported[1]:>7.3f}{final['eval/kl_after']:>8.3f}"
                f"{final['time/seconds']:>8.1f}")
            print(lines[-1], flush=True)
    print(f"\n{'seed':>5}  {'run':<17}{'ground truth':>16}{'exported':>9}{'KL':>7}"
          f"{'KL end':>8}{'s':>8}")
    print("\n".join(lines))
    print(f"\n{'run':<17}{'exported':>9}{'KL':>7}  (means over the seeds)")
    for name, got in finals.items():
        print(f"{name:<17}{statistics.fmean(g for g, _ in got):>9.3f}"
              f"{statistics.fmean(k for _, k in got):>7.3f}")


def demo_steps12(root: Path, seed: int) -> Path:
    """The default demo's step-1/2 models of `seed`, trained once under `root` and shared by
    the parts that start from them (algorithms, dynamic)."""
    base = root / f"steps12-{seed}"
    if not (base / "reward" / "config.json").exists():
        train(base, "--step", "1", "2", f"seed={seed}")
    return base


def _row(result: tuple) -> str:
    seed, before, after, seconds, peak, trained, iterations = result
    return (f"{seed:>5}{before:>10.3f} -> {after:.3f}{after - before:>+8.3f}{seconds:>10.1f}"
            f"{peak:>10.0f}{trained:>13.1f}{iterations:>7}")


if __name__ == "__main__":
    main()
