"""ZeRO++ on CPU gloo, world 4 seen as 2 nodes x 2 ranks: communication per training step,
then loss parity of real training runs (prints one table per part).

Part 1, communication (`--part comm`; it starts its own 4 ranks through torchrun):
  Model: OPT-125m's architecture (the values of facebook/opt-125m's config.json in a
  transformers OPTConfig: 12 layers, hidden 768, 12 heads, FFN 3072, vocab 50272, tied
  embeddings; 125.2M parameters), random weights, dropout 0, fp32 master weights and
  all-gathers (--bf16: bf16 all-gathers). Chosen over a Llama of similar shape because it
  is a released model's exact shape and one step of it takes seconds on 2 cores.
  Sharded THROUGH THE ENGINE: a TrainEngine (engine/trainer.py; it calls engine/parallel.py
  `shard` with ShardSettings(zero_stage=3, zeropp=ZeroPPConfig(...)): FSDP2 per decoder
  layer + root, hpZ/qwZ/qgZ per unit) on the Runtime of `setup_runtime(procs_per_node=2)`
  (ranks_per_node=2). One training step = forward + backward + optimizer step (grad-norm
  clip, AdamW) on 1 x --seq tokens per rank.
  Rows: ZeRO-3, qwZ 8-bit, qwZ 4-bit, hpZ (partition 2 = one node), qgZ (8-bit) alone, all
  three at 8 bits, all three with 4-bit weights (block 256 everywhere). Per row: a fresh
  model, a warm-up step, one step under engine/comm_meter.py's CommMeter (bytes rank 0
  RECEIVES, split by sender into intra- and cross-node; the meter slows the step, so that
  step is not timed), then --steps timed steps (median of the slowest rank's time).
  The meter does not see collectives that DTensor issues inside its own op dispatch, here
  only the grad-norm clip's all-reduce of one scalar per step (a few bytes).
  Goals (ZeRO++ paper / DeepSpeed): all three <= 0.25x ZeRO-3's cross-node bytes; with
  4-bit weights <= 0.17x.
  On one machine the "nodes" share memory (and here 2 busy cores): step times show
  quantization's compute cost and the machine's load, NOT network savings; the byte
  columns are the point.

Part 2, loss parity (`--part parity`): train.py (subprocess) runs steps 1 (SFT) and 2
  (reward model) at engine.procs=4 engine.procs_per_node=2 --actor-zero-stage 3
  --reward-zero-stage 3, twice: plain ZeRO-3, and ZeRO++ all three at 8 bits
  (--zero-quantized-weights --zero-hpz-partition-size 2 --zero-quantized-gradients).
  Real data: Anthropic hh-rlhf, harmless-base test split (/work/shared/data, 2,312 pairs),
  the OPT tokenizer (/work/shared/tokenizers/opt), models `tiny-opt` (2 layers, hidden 128,
  vocab 50265, random init) for both steps. Pairs split 1:1 between steps 1 and 2, 10% of
  each held out for eval; prompts over 64 tokens dropped (about 64% are), answers cut at 32
  tokens: about 370 training examples per step. Global batch 8, --sft-epochs / --rm-epochs
  5 epochs (about 235 optimizer steps per step), lr 1e-3 (SFT) / 3e-4 (RM) after 10 warm-up
  steps (above DeepSpeed-Chat's defaults: tiny untrained models), loss logged every step.
  Printed per step: the final loss (mean of the last 10% of the logged losses) of both
  runs and their ratio against the goal (<= 1.1x ZeRO-3's, DeepSpeed's ZeRO++ parity
  criterion), step 2's eval accuracy, and the metrics.jsonl files holding the curves.

Run:  python bench/zeropp.py                  (both parts; about 20 min on 2 busy cores)
      python bench/zeropp.py --part comm      (part 1 only, ~7 min; --steps, --seq, --bf16)
      python bench/zeropp.py --part parity    (part 2 only, ~13 min; --out, --sft-epochs, ...)
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from engine.tracking import read_metrics  # noqa: E402

WORLD, PER_NODE = 4, 2
DATA = Path("/work/shared/data/hh-rlhf-harmless-base-test.jsonl.gz")
TOKENIZER = Path("/work/shared/tokenizers/opt")
GOALS = {"all three 8-bit": 0.25, "all three, 4-bit weights": 0.17}
PARITY_GOAL = 1.1


# ---------------------------------------------------------------------------------------------
# Part 1: communication per training step


def _configs() -> dict:
    from engine.config import ZeroPPConfig
    return {
        "ZeRO-3": ZeroPPConfig(),
        "qwZ 8-bit": ZeroPPConfig(qwz=True),
        "qwZ 4-bit": ZeroPPConfig(qwz=True, weight_bits=4),
        "hpZ": ZeroPPConfig(hpz=PER_NODE),
        "qgZ 8-bit": ZeroPPConfig(qgz=True),
        "all three 8-bit": ZeroPPConfig(qwz=True, hpz=PER_NODE, qgz=True),
        "all three, 4-bit weights": ZeroPPConfig(qwz=True, hpz=PER_NODE, qgz=True,
                                                 weight_bits=4),
    }


def _opt_125m():
    """facebook/opt-125m's architecture (its config.json's values), random weights."""
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=50272, hidden_size=768, num_hidden_layers=12, ffn_dim=3072,
                       num_attention_heads=12, max_position_embeddings=2048,
                       word_embed_proj_dim=768, do_layer_norm_before=True,
                       enable_bias=True, dropout=0.0, attention_dropout=0.0,
                       activation_dropout=0.0, layerdrop=0.0)
    return OPTForCausalLM(config)


def _train_step(engine, ids) -> float:
    """One optimizer step of the language-model loss on `ids`; returns this rank's loss."""
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss / WORLD)       # this rank's share of the mean over the ranks
    engine.step()
    return float(loss.detach())


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_gb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def _comm_rank(steps: int, seq: int, bf16: bool) -> None:
    import torch
    import torch.distributed as dist

    from engine.comm_meter import CommMeter
    from engine.config import OptimConfig
    from engine.parallel import ShardSettings
    from engine.runtime import setup_runtime
    from engine.trainer import TrainEngine

    torch.set_num_threads(1)
    rt = setup_runtime(device="cpu", dtype="bfloat16" if bf16 else "float32", seed=0,
                       procs_per_node=PER_NODE)
    assert rt.world_size == WORLD and rt.ranks_per_node == PER_NODE, rt
    ids = torch.randint(0, 50272, (1, seq), generator=torch.Generator().manual_seed(rt.rank))
    rows, params = [], 0
    for name, settings in _configs().items():
        model = _opt_125m()
        params = sum(p.numel() for p in model.parameters())
        engine = TrainEngine(model, OptimConfig(), total_steps=steps + 2, runtime=rt, lr=1e-5,
                             sharding=ShardSettings(zero_stage=3, zeropp=settings))

        _train_step(engine, ids)                                    # warm-up (FSDP's lazy init)
        with CommMeter(ranks_per_node=rt.ranks_per_node) as meter:
            loss = _train_step(engine, ids)
        times = []
        for _ in range(steps):
            rt.barrier()
            start = time.perf_counter()
            _train_step(engine, ids)
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed))
        kinds = {kind: (row["calls"], row["bytes"], row["cross_node_bytes"])
                 for kind, row in meter.summary().items()}
        rows.append((name, meter.bytes, meter.cross_node_bytes, statistics.median(times),
                     kinds, loss))
        del engine, model
        gc.collect()
        _trim_heap()        # freed model memory back to the OS: 4 ranks share the machine
        if rt.is_main:
            print(f"  {name}: done ({statistics.median(times):.1f} s/step; rank 0 peak RSS "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB, now "
                  f"{_rss_gb():.1f} GB)", flush=True)
    if rt.is_main:
        _print_comm(rows, params, steps, seq, bf16)
    rt.barrier()
    dist.destroy_process_group()


def _print_comm(rows, params: int, steps: int, seq: int, bf16: bool) -> None:
    mb = 1e6
    print(f"\nPart 1: communication per training step (forward + backward + clip + AdamW)\n"
          f"OPT-125m architecture ({params / 1e6:.1f}M parameters, random weights), "
          f"{'bf16' if bf16 else 'fp32'} all-gathers over fp32 master weights, 1 x {seq} "
          f"tokens per rank;\nworld {WORLD} = 2 nodes x {PER_NODE} ranks (CPU gloo, one "
          f"machine); MB (1e6 bytes) that rank 0 receives in one step; step time: median "
          f"of {steps} steps, slowest rank.\n")
    base_cross, base_time = rows[0][2], rows[0][3]
    head = (f"{'config':<26}{'total MB':>10}{'intra MB':>10}{'cross MB':>10}"
            f"{'cross vs Z3':>13}{'step s':>9}{'vs Z3':>7}   goal")
    print(head)
    print("-" * (len(head) + 20))
    met = {}
    for name, total, cross, seconds, _, _ in rows:
        ratio = cross / base_cross
        goal = ""
        if name in GOALS:
            met[name] = ratio <= GOALS[name]
            goal = f"<= {GOALS[name]:.2f}x: {'met' if met[name] else 'NOT met'}"
        print(f"{name:<26}{total / mb:>10.1f}{(total - cross) / mb:>10.1f}{cross / mb:>10.1f}"
              f"{ratio:>12.3f}x{seconds:>9.2f}{seconds / base_time:>6.2f}x   {goal}")
    print("\ncross-node MB by collective (calls in parentheses):")
    kinds = sorted({k for row in rows for k in row[4]})
    print(f"{'config':<26}" + "".join(f"{k:>24}" for k in kinds))
    for name, _, _, _, by_kind, _ in rows:
        cells = []
        for k in kinds:
            calls, _, cross = by_kind.get(k, (0, 0, 0))
            cells.append(f"{cross / mb:>17.1f} ({calls:>3})")
        print(f"{name:<26}" + "".join(f"{c:>24}" for c in cells))
    print("\nmetered step's loss on rank 0 (same data and init in every row): "
          + ", ".join(f"{name} {loss:.4f}" for name, *_, loss in rows))
    print("\ngoals: " + "; ".join(f"{name} cross-node <= {GOALS[name]}x ZeRO-3: "
                                   f"{'met' if ok else 'NOT met'}" for name, ok in met.items()),
          flush=True)


def run_comm(args) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={WORLD}", __file__, "--part", "comm", "--steps",
               str(args.steps), "--seq", str(args.seq)] + ["--bf16"] * args.bf16
    # PYTHONWARNINGS: FSDP2's "returned a view tensor" UserWarning about OPT's decoder
    # layers, 4 ranks x 7 models of it, would bury the table
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning"}
    print(f"$ {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, timeout=3600)
    print(f"part 1 wall time: {time.perf_counter() - start:.0f} s", flush=True)


# ---------------------------------------------------------------------------------------------
# Part 2: loss parity through train.py

ZEROPP_FLAGS = ["--zero-quantized-weights", "--zero-hpz-partition-size", str(PER_NODE),
                "--zero-quantized-gradients"]


def _train_command(out: Path, zeropp: bool, args) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "--output-dir", str(out), "--step", "1", "2",
            "--actor-model", "tiny-opt", "--reward-model", "tiny-opt",
            "--actor-zero-stage", "3", "--reward-zero-stage", "3",
            *(ZEROPP_FLAGS if zeropp else []),
            f"engine.procs={WORLD}", f"engine.procs_per_node={PER_NODE}", "engine.device=cpu",
            f"tokenizer={TOKENIZER}", f"data.path={args.data}", "data.split=[1,1,0]",
            f"data.eval_fraction={args.eval_fraction}",
            f"data.max_prompt_len={args.max_prompt_len}",
            f"data.max_answer_len={args.max_answer_len}",
            f"sft.epochs={args.sft_epochs}", f"rm.epochs={args.rm_epochs}",
            f"sft.batch_size={args.batch_size}", f"rm.batch_size={args.batch_size}",
            "sft.log_every=1", "rm.log_every=1", "sft.lr=1e-3", "rm.lr=3e-4",
            "sft.warmup_steps=10", "rm.warmup_steps=10", "engine.checkpoint_every=0",
            "logging.progress=false", "overwrite=true", "resume=false"]


def _read_rows(path: Path) -> list[dict]:
    return read_metrics(path)


def _final_loss(rows: list[dict], tail: float = 0.1) -> tuple[float, int, int]:
    """Mean train/loss of the last `tail` share of the logged training rows (those with a
    learning rate: the summary row at the end is not one); (mean, rows used, rows)."""
    losses = [r["train/loss"] for r in rows if "train/lr" in r and "train/loss" in r]
    k = max(1, round(tail * len(losses)))
    return statistics.fmean(losses[-k:]), k, len(losses)


def run_parity(args) -> None:
    out_root = Path(args.out)
    runs = {"ZeRO-3": out_root / "zero3", "ZeRO++ (all three, 8-bit)": out_root / "zeropp"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    seconds = {}
    for (name, out), zeropp in zip(runs.items(), (False, True), strict=True):
        out.mkdir(parents=True, exist_ok=True)
        command = _train_command(out, zeropp, args)
        print(f"$ {shlex.join(command)}   (log: {out / 'train.log'})", flush=True)
        start = time.perf_counter()
        with open(out / "train.log", "w") as log:
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=ROOT, timeout=3600)
        seconds[name] = time.perf_counter() - start
        summary = [line for line in (out / "train.log").read_text().splitlines()
                   if " done: " in line]
        for line in summary:
            print(f"  {line.strip()}")
        print(f"  {name}: {seconds[name]:.0f} s, exit {done.returncode}", flush=True)
        if done.returncode:
            print((out / "train.log").read_text()[-4000:])
            raise SystemExit(f"train.py failed for {name}: see {out / 'train.log'}")

    print(f"\nPart 2: loss parity, train.py steps 1 and 2 at engine.procs={WORLD} "
          f"engine.procs_per_node={PER_NODE}, both zero stages 3; tiny-opt, hh-rlhf "
          f"harmless-base test split, OPT tokenizer\nfinal loss = mean train/loss over the "
          f"last 10% of optimizer steps (logged every step)\n")
    head = (f"{'step':<14}{'opt steps':>10}{'ZeRO-3':>10}{'ZeRO++':>10}{'ratio':>9}"
            f"   goal <= {PARITY_GOAL}x")
    print(head)
    print("-" * (len(head) + 8))
    ok_all = True
    for step, label in ((1, "1 SFT"), (2, "2 reward")):
        finals = []
        for out in runs.values():
            finals.append(_final_loss(_read_rows(out / f"step{step}" / "metrics.jsonl")))
        (base, k, n), (zpp, _, n2) = finals
        ratio = zpp / base
        ok = ratio <= PARITY_GOAL
        ok_all &= ok
        steps_note = f"{n}" if n == n2 else f"{n}/{n2}"
        print(f"{label:<14}{steps_note:>10}{base:>10.4f}{zpp:>10.4f}{ratio:>8.3f}x   "
              f"{'met' if ok else 'NOT met'} (last {k})")
    print()
    for name, out in runs.items():
        nan = float("nan")
        rm = _read_rows(out / "step2" / "metrics.jsonl")[-1]
        sft_rows = _read_rows(out / "step1" / "metrics.jsonl")
        print(f"{name:<27} step 2 eval accuracy {rm.get('eval/accuracy', nan):.3f} (chosen "
              f"{rm.get('eval/chosen_score', nan):+.3f} vs rejected "
              f"{rm.get('eval/rejected_score', nan):+.3f}); step 1 eval perplexity "
              f"{sft_rows[-1].get('eval/perplexity', nan):.1f}, first SFT loss "
              f"{sft_rows[0].get('train/loss', nan):.3f}; train.py wall {seconds[name]:.0f} s")
    print("\ncurves (one JSON row per optimizer step):")
    for name, out in runs.items():
        for step in (1, 2):
            print(f"  {name:<28} {out / f'step{step}' / 'metrics.jsonl'}")
    print(f"\nparity goal (<= {PARITY_GOAL}x ZeRO-3's final loss): "
          f"{'met' if ok_all else 'NOT met'}", flush=True)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["all", "comm", "parity"], default="all")
    parser.add_argument("--steps", type=int, default=3, help="part 1: timed steps per config")
    parser.add_argument("--seq", type=int, default=64, help="part 1: tokens per rank per step")
    parser.add_argument("--bf16", action="store_true", help="part 1: bf16 all-gathers")
    parser.add_argument("--out", default="/tmp/zeropp-parity", help="part 2: run directories")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--sft-epochs", type=int, default=5)
    parser.add_argument("--rm-epochs", type=int, default=5)
    parser.add_argument("--eval-fraction", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-prompt-len", type=int, default=64)
    parser.add_argument("--max-answer-len", type=int, default=32)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:      # a rank of part 1, started by run_comm
        _comm_rank(args.steps, args.seq, args.bf16)
        return
    print(f"$ {shlex.join(['python', *sys.argv])}\n", flush=True)
    start = time.perf_counter()
    if args.part in ("all", "comm"):
        run_comm(args)
    if args.part in ("all", "parity"):
        print()
        run_parity(args)
    print(f"\ntotal wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
