"""Does step 3 beat best-of-n? Step 3's ground truth against the baselines it should beat,
on a built-in demo task (data.demo_task), on CPU, through train.py (subprocesses).

Step 3 picks the policy it exports by its own evaluations (ppo.export=best, on its 64
held-out prompts). Everything here is measured on other prompts: --test-prompts fresh ones
of the same task (drawn with another seed), which neither step 3 nor its selection saw.
Per seed: steps 1-2 once (`python train.py --step 1 2 seed=S data.demo_task=T`), then:
  - the reward model's held-out pair accuracy (step 2's eval/accuracy);
  - the SFT model's greedy answer's ground truth (steps.demo.score);
  - n answers sampled at temperature 1 (row-seeded): their mean ground truth, the ground
    truth of the reward model's favourite (best-of-n) and least favourite (worst-of-n),
    the favourite's mean reward-model score, and the best ground truth among them (oracle
    best-of-n, a ceiling);
  - the reward model's KL-optimal policy at best-of-n's KL: pi(y) ~ pi_SFT(y) exp(r(y)/b),
    b set so that its KL to the SFT model is log n - (n-1)/n, estimated by self-normalised
    importance weights over --frontier-n samples per prompt. It is the most any policy
    can get by optimising this reward model within that KL (what step 3's objective
    converges to), so it says how far the reward model's errors, not the optimiser, bound
    the result; and the ground truth of its most likely answer among those samples (by
    log pi_SFT + r/b), beside the SFT model's most likely sample: whether the optimum
    moves the mode towards right answers or away. (Only the samples are searched, so
    this reads greedy answers roughly: compare the two estimates with each other, not
    with the SFT model's greedy score);
  - step 3 under each named setting (hydra overrides on top of the demo recipe), from the
    same step-1/2 models: the exported policy's (ppo.export: the best evaluated policy, or
    the last) mean ground truth over n fresh samples per prompt and its greedy ground
    truth, on the test prompts; from step 3's own log, its exported iteration, KL to the
    reference, and its evaluation's sampled ground truth (on the prompts that picked it);
    over the last 10 iterations the KL per answer to the reference (reward/kl_vocab, the
    KL over the vocabulary the controller reads, where logged, else reward/kl), the share
    of answers ended with EOS, and their length.
The reward model scores exactly as step 3 does (steps.scoring.RewardScorer: at the EOS
that ends the answer, appended when it was cut off).

Run:  python bench/step3_quality.py --task pick --seeds 1234 99 7 \\
          [--setting defaults] [--setting nokl ppo.kl_coef=0] [--root DIR] [--out FILE]
      (--setting NAME [OVERRIDE ...], repeatable; default: `defaults` with no overrides.
      On 2 idle CPU cores about 2 min per seed for steps 1-2 and the baselines, plus
      1-2 min per setting. To run seeds side by side, one process each, set
      OMP_NUM_THREADS=1: two processes of 2 threads each on 2 cores ran step 1 in 325 s
      against 27 s alone, and one thread each in 44 s.)
Runs already finished under --root are read, not run again. Seeds run side by side, one
process each (`--out` per seed), give one table with
      python bench/step3_quality.py --merge seed-1234.txt seed-99.txt seed-7.txt --out FILE
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quantized_base import rows, train  # noqa: E402

from engine.generation import SamplingSettings, generate  # noqa: E402
from engine.models import load_causal_lm, load_reward_model, load_tokenizer  # noqa: E402
from steps import demo  # noqa: E402
from steps.ppo import answer_logprobs, row_seeds  # noqa: E402
from steps.rlhf import answer_mask, masked_sum, tilted_kl  # noqa: E402
from steps.scoring import RewardScorer  # noqa: E402
from steps.tokenize import collate_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"defaults": []}
FRESH_SEED_OFFSET = 10_000   # sample seeds for the exported policy, apart from step 3's
TEST_SEED_OFFSET = 20_000    # the test prompts' draw, apart from the run's own data


def test_prompts(seed: int, overrides: list[str], actor_dir: Path, count: int,
                 offset: int = TEST_SEED_OFFSET) -> tuple[list[list[int]], list[str], int]:
    """`count` fresh prompts of the run's task (token ids, texts as step 3 decodes its
    own), drawn with a seed of their own (`seed + offset`), and the answer length limit."""
    import train as cli
    from steps.tokenize import tokenize_prompts

    cfg = cli.build_config(cli.parse_args([f"seed={seed}", *overrides]))
    pairs = demo.make_pairs(count, seed + offset, cfg.data.demo_task)
    tokenizer = load_tokenizer(str(actor_dir))
    ids, _ = tokenize_prompts(pairs, tokenizer, cfg.data.max_prompt_len)
    return ids, tokenizer.batch_decode(ids, skip_special_tokens=True), cfg.data.max_answer_len


@torch.no_grad()
def answers(model, tokenizer, prompt_ids: list[list[int]], sampling: SamplingSettings,
            seeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Sequences [B, P+N], their attention masks (prompt + answer up to EOS), answer texts."""
    batch = collate_prompts(prompt_ids, tokenizer.pad_token_id)
    sequences = generate(model, batch["input_ids"], batch["attention_mask"], sampling,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         row_seeds=seeds, synced=False)
    p = batch["input_ids"].shape[1]
    answered = answer_mask(sequences[:, p:], tokenizer.eos_token_id)
    mask = torch.cat([batch["attention_mask"], answered.long()], 1)
    return sequences, mask, tokenizer.batch_decode(sequences[:, p:], skip_special_tokens=True)


def load_actor(actor_dir: Path):
    tokenizer = load_tokenizer(str(actor_dir))
    return load_causal_lm(str(actor_dir), tokenizer).eval(), tokenizer


def samples(model, tokenizer, prompt_ids: list[list[int]], texts: list[str], max_len: int,
            seed: int, n: int):
    """n row-seeded answers per prompt at temperature 1, one batch at a time: (sequences,
    masks, each answer's ground truth). Batch 0 uses step 3's evaluation seeds at `seed`."""
    rows_ = range(len(prompt_ids))
    for j in range(n):
        seeds = row_seeds(seed, 0, [j * len(rows_) + i for i in rows_])
        sequences, mask, said = answers(model, tokenizer, prompt_ids,
                                        SamplingSettings(max_len), seeds)
        yield sequences, mask, [demo.score(p, a) for p, a in zip(texts, said, strict=True)]


@torch.no_grad()
def sequence_logprobs(model, sequences: torch.Tensor, mask: torch.Tensor, prompt_len: int
                      ) -> list[float]:
    """[B] log pi(answer | prompt) of each answer, up to and including its EOS."""
    tokens = answer_logprobs(model, sequences, mask, prompt_len)
    return masked_sum(tokens, mask[:, prompt_len:], dim=1).tolist()


def greedy_truth(actor_dir: Path, prompt_ids: list[list[int]], texts: list[str],
                 max_len: int) -> float:
    model, tokenizer = load_actor(actor_dir)
    _, _, said = answers(model, tokenizer, prompt_ids,
                         SamplingSettings(max_len, do_sample=False), None)
    return statistics.fmean(demo.score(p, a) for p, a in zip(texts, said, strict=True))


def sampled_truth(actor_dir: Path, prompt_ids: list[list[int]], texts: list[str],
                  max_len: int, seed: int, n: int) -> float:
    """Mean ground truth of n fresh samples per prompt (seeds step 3 never evaluated with,
    so a policy picked by its evaluations is not measured on the samples that picked it)."""
    model, tokenizer = load_actor(actor_dir)
    return statistics.fmean(t for *_, truths in samples(model, tokenizer, prompt_ids, texts,
                                                         max_len, seed + FRESH_SEED_OFFSET, n)
                            for t in truths)


def kl_optimum(scores: torch.Tensor, truths: torch.Tensor, logprobs: torch.Tensor, kl: float
               ) -> tuple[float, float]:
    """pi(y) ~ pi_SFT(y) exp(r(y) / b) with b such that KL(pi || pi_SFT) is `kl` per prompt
    on average, from [prompts, n] reward scores, ground truths and log pi_SFT of n samples
    of pi_SFT per prompt (steps.rlhf.tilted_kl's self-normalised weights; bisection on
    log b): its mean ground truth, and the ground truth of its most likely answer among the
    samples (what a policy at that optimum answers greedily)."""
    scores, truths = scores.double(), truths.double()
    low, high = -12.0, 12.0   # a small b: far from pi_SFT; a large one: pi_SFT itself
    for _ in range(60):
        middle = (low + high) / 2
        above = float(tilted_kl(scores, torch.tensor([math.exp(middle)])).mean()) > kl
        low, high = (middle, high) if above else (low, middle)
    weights = torch.softmax(scores / math.exp(high), dim=1)
    return ((weights * truths).sum(1).mean().item(),
            most_likely_truth(logprobs.double() + scores / math.exp(high), truths))


def most_likely_truth(log_weights: torch.Tensor, truths: torch.Tensor) -> float:
    """Mean over prompts of the ground truth of each prompt's sample with the largest
    (unnormalised) log-probability [prompts, n]."""
    return truths.gather(1, log_weights.argmax(1, keepdim=True)).mean().item()


def best_of_n(base: Path, prompt_ids: list[list[int]], texts: list[str], max_len: int,
              seed: int, n: int, frontier_n: int) -> dict[str, float]:
    """The baselines from row-seeded samples of the SFT model: best-of-n from the first n
    per prompt, the KL-optimal policy at best-of-n's KL from all max(n, frontier_n)."""
    actor, tokenizer = load_actor(base / "actor")
    scorer = RewardScorer(load_reward_model(str(base / "reward"), tokenizer).eval(),
                          tokenizer, tokenizer, torch.device("cpu"))
    truths, scores, logprobs = [], [], []
    prompt_len = collate_prompts(prompt_ids, tokenizer.pad_token_id)["input_ids"].shape[1]
    for sequences, mask, said_truths in samples(actor, tokenizer, prompt_ids, texts, max_len,
                                                seed, max(n, frontier_n)):
        scores.append(scorer(sequences, mask, prompt_len).tolist())
        logprobs.append(sequence_logprobs(actor, sequences, mask, prompt_len))
        truths.append(said_truths)
    rows_ = range(len(prompt_ids))
    best = [max(range(n), key=lambda j, i=i: scores[j][i]) for i in rows_]
    worst = [min(range(n), key=lambda j, i=i: scores[j][i]) for i in rows_]
    scores_, truths_, logprobs_ = (torch.tensor(x).T for x in (scores, truths, logprobs))
    optimum, optimum_mode = kl_optimum(scores_, truths_, logprobs_, math.log(n) - (n - 1) / n)
    return {"SFT sample GT (mean)": statistics.fmean(t for row in truths[:n] for t in row),
            "best-of-n GT": statistics.fmean(truths[best[i]][i] for i in rows_),
            "best-of-n RM score": statistics.fmean(scores[best[i]][i] for i in rows_),
            "worst-of-n GT": statistics.fmean(truths[worst[i]][i] for i in rows_),
            "oracle best-of-n GT": statistics.fmean(max(t[i] for t in truths[:n]) for i in rows_),
            "RM's KL-optimal policy GT at best-of-n's KL": optimum,
            "RM's KL-optimal policy, its most likely answer's GT": optimum_mode,
            "SFT's most likely sample's GT": most_likely_truth(logprobs_, truths_)}


def step3(out: Path, base: Path, seed: int, flags: list[str], prompts, n: int
          ) -> dict[str, float]:
    """Step 3 from the seed's step-1/2 models; its figures."""
    if not (out / "step3" / "actor" / "config.json").exists():
        train(out, "--step", "3", f"seed={seed}", f"ppo.actor_path={base / 'actor'}",
              f"ppo.reward_path={base / 'reward'}", *flags)
    metrics = rows(out / "step3" / "metrics.jsonl")
    last = [r for r in metrics if "reward/kl" in r][-10:]
    summary = metrics[-1]
    return {"step 3 exported GT (sampled)": sampled_truth(out / "step3" / "actor",
                                                          *prompts, seed, n),
            "step 3 exported greedy GT": greedy_truth(out / "step3" / "actor", *prompts),
            "step 3 exported iteration": summary["eval/iteration_exported"],
            "step 3 exported KL": summary["eval/kl_exported"],
            "step 3 exported GT (its evaluation)": summary["eval/ground_truth_exported"],
            "step 3 last GT (its evaluation)": summary["eval/ground_truth_after"],
            "step 3 KL (last 10)": statistics.fmean(r.get("reward/kl_vocab", r["reward/kl"])
                                                    for r in last),
            "step 3 ended with EOS": statistics.fmean(r["answer/ended_with_eos"] for r in last),
            "step 3 answer length": statistics.fmean(r["answer/length"] for r in last),
            "step 3 last RM score": summary["eval/reward_after"]}


def one_seed(root: Path, seed: int, task: str, settings: dict[str, list[str]],
             extra: list[str], n: int, frontier_n: int, count: int
             ) -> tuple[dict[str, float], int]:
    """The seed's figures (steps 1-2 and each step-3 setting run when not already under
    `root`) and the number of held-out prompts they were measured on."""
    common = [f"data.demo_task={task}", *extra]
    base = root / f"{task}-steps12-{seed}"
    if not (base / "reward" / "config.json").exists():
        train(base, "--step", "1", "2", f"seed={seed}", *common)
    prompts = test_prompts(seed, common, base / "actor", count)
    result = {"rm accuracy": rows(base / "step2" / "metrics.jsonl")[-1]["eval/accuracy"],
              "SFT greedy GT": greedy_truth(base / "actor", *prompts),
              **best_of_n(base, *prompts, seed, n, frontier_n)}
    print(f"seed {seed} baselines: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()),
          flush=True)
    for name, flags in settings.items():
        figures = step3(root / f"{task}-{name}-{seed}", base, seed, [*common, *flags], prompts,
                        n)
        result.update({f"[{name}] {k}": v for k, v in figures.items()})
    print(f"seed {seed}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
    return result, len(prompts[0])


def table(results: dict[int, dict[str, float]], n: int | None = None) -> str:
    """One row per measure, one column per seed, then mean ± sd over the seeds (best-of-n
    named for its n where given)."""
    seeds = list(results)
    labels = {key: key.replace("-of-n", f"-of-{n}") if n else key for key in results[seeds[0]]}
    width = max(map(len, labels.values())) + 2
    head = f"{'measure':<{width}}" + "".join(f"{f'seed {s}':>11}" for s in seeds) + "   mean ± sd"
    lines = [head, "-" * len(head)]
    for key, label in labels.items():
        values = [results[s][key] for s in seeds]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        lines.append(f"{label:<{width}}" + "".join(f"{v:>11.3f}" for v in values)
                     + f"   {statistics.fmean(values):.3f} ± {sd:.3f}")
    return "\n".join(lines)


def read_table(path: Path) -> tuple[list[str], dict[int, dict[str, float]]]:
    """A table written by --out: its command lines, and each seed's figures by measure."""
    lines = path.read_text().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("measure ")), None)
    if head is None:
        raise SystemExit(f"--merge {path}: no table in it (a file written by --out?)")
    seeds = [int(s) for s in lines[head].split()[2:-3:2]]
    results: dict[int, dict[str, float]] = {s: {} for s in seeds}
    for line in lines[head + 2:]:
        if not line.strip():
            break
        words = line.split()
        values = words[-3 - len(seeds):-3]
        label = " ".join(words[:-3 - len(seeds)])
        for seed, value in zip(seeds, values, strict=True):
            results[seed][label] = float(value)
    return [line for line in lines[:head] if line.strip()], results


def merge(paths: list[Path]) -> str:
    """One table over the seeds of several --out files (one process per seed): each file's
    command, the first file's description, the table."""
    commands, described, results = [], [], {}
    for path in paths:
        preamble, figures = read_table(path)
        commands += [line for line in preamble if line.startswith("command: ")]
        described = described or [line for line in preamble if not line.startswith("command: ")]
        for seed, measures in figures.items():
            results.setdefault(seed, {}).update(measures)
    measures = {key for figures in results.values() for key in figures}
    for seed, figures in results.items():
        if missing := sorted(measures - figures.keys()):
            raise SystemExit(f"--merge: seed {seed} lacks {missing[0]!r} (and {len(missing) - 1}"
                             " more): give every seed's file the same settings")
    return "\n".join([*commands, *described]) + "\n\n" + table(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="pick", choices=demo.TASKS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--setting", nargs="+", action="append", metavar=("NAME", "OVERRIDE"),
                        help="a step-3 setting: its name, then hydra overrides (repeatable)")
    parser.add_argument("--overrides", nargs="*", default=[],
                        help="hydra overrides for every run (steps 1-3), e.g. data.demo_pairs=")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt for best-of-n")
    parser.add_argument("--frontier-n", type=int, default=64,
                        help="SFT samples per prompt for the KL-optimal policy's estimate")
    parser.add_argument("--test-prompts", type=int, default=128,
                        help="fresh prompts of the task every figure is measured on")
    parser.add_argument("--root", type=Path, help="run directory (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    parser.add_argument("--merge", type=Path, nargs="+", metavar="FILE",
                        help="print (and --out) one table from per-seed --out files; runs nothing")
    args = parser.parse_args()
    if args.merge:
        report = merge(args.merge)
        print(report)
        if args.out:
            args.out.write_text(report + "\n")
        return
    transformers.logging.disable_progress_bar()
    settings = {s[0]: s[1:] for s in args.setting} if args.setting else SETTINGS
    root = args.root or Path(tempfile.mkdtemp(prefix="step3-quality-"))
    command = f"python bench/step3_quality.py {shlex.join(sys.argv[1:])}"
    print(f"command: {command}\nruns under {root}", flush=True)
    results, count = {}, 0
    for seed in args.seeds:
        results[seed], count = one_seed(root, seed, args.task, settings, args.overrides, args.n,
                                        args.frontier_n, args.test_prompts)
    described = "; ".join(f"{k}: {' '.join(v) or 'the demo recipe'}" for k, v in settings.items())
    report = (f"command: {command}\ntask {args.task}; step-3 settings: {described}\n"
              f"GT = steps.demo.score on {count} fresh test prompts of the task (not step "
              f"3's own evaluation prompts); {args.n} samples per prompt at temperature 1; "
              f"the KL-optimal policy from {args.frontier_n}\n\n" + table(results, args.n))
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
