"""Peak memory per rank of one training step under ZeRO stages 0, 2 and 3 (FSDP2 via
engine.TrainEngine), at several world sizes, on one fixed randomly initialised Llama.

For each (world size, stage) a child job is started with torchrun. Every rank builds the
same model (same seed), wraps it in TrainEngine, and runs two AdamW steps on a fixed random
batch split over the ranks; the second step is measured:

  peak      CUDA: torch.cuda.max_memory_allocated. CPU: peak bytes of live torch tensor
            storages on the rank, from torch's FSDPMemTracker (a TorchDispatchMode that also
            follows FSDP2's storage resizes), which splits the peak into parameters,
            gradients, optimizer state and activations/temporaries.
  fwd peak  the same peak, up to the end of forward: where ZeRO-2 (layers kept gathered
            until backward) and ZeRO-3 differ even when the whole step's peak is the same.
  shards    bytes of this rank's local parameters, gradients (after backward) and AdamW
            state: deterministic, and where ZeRO's 1/N shows directly.
  RSS       the process's peak resident set, for reference only: it includes the full
            model every rank builds before sharding, and Python/transformers themselves.

Per-rank numbers are the maximum over the ranks. Stage 3 with CPU offload applies to CUDA
only (on CPU there is nowhere to offload to).

With --lora: a LoRA actor (rank 16, only LoRA trains, ZeRO-3, bf16 compute) over a frozen
base kept in bf16, INT8 or INT4 (engine.quantized_base), loaded through the engine from a
safetensors copy of the model: per rank, the frozen base's bytes, the bytes all-gathered in
one training step (forward + backward, engine.comm_meter), the step's peak; then step 3's
reference policy as a separate frozen bf16 copy (ZeRO-3 sharded) vs the actor's own base with
its adapters off: the reference's bytes per rank and the peak of a reference forward plus a
training step.

Run:  python bench/memory.py        (options: --help; about 3 minutes on 2 CPU cores)
      python bench/memory.py --lora (about 5 minutes)
      python bench/memory.py --precision (one process: the fp32 master copy's cost)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
CHILD_TIMEOUT_S = 300
# FSDPMemTracker categories, merged into the columns printed
PEAK_GROUPS = {
    "param": ("Sharded Param", "Unsharded Param", "All Gather"),
    "grad": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optim": ("OptState",),
    "act": ("Activation", "Temp", "Inputs", "Buffer"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,4", help="world sizes (comma-separated)")
    p.add_argument("--stages", default="0,2,3", help="ZeRO stages (comma-separated)")
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=True,
                   help="add stage 3 + CPU offload rows (run on CUDA, n/a on CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    # proportions of a real LLM: embeddings ~14% of the parameters (a 32k vocabulary at
    # this width would make them half the model, and the gathered root would dominate)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--batch", type=int, default=4, help="global sequences, split over ranks")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora", action="store_true", help="LoRA over bf16/INT8/INT4 frozen bases")
    p.add_argument("--precision", action="store_true",
                   help="one process, bf16 compute: what the fp32 master copy costs")
    p.add_argument("--bases", default="bf16,int8,int4", help="with --lora")
    # child-only
    p.add_argument("--base", default="bf16", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    # Llama's proportions: 64-wide heads, MLP 8/3 x hidden rounded up to a multiple of 32
    intermediate = math.ceil(args.hidden * 8 / 3 / 32) * 32
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                       num_key_value_heads=args.hidden // 64, vocab_size=args.vocab,
                       max_position_embeddings=max(args.seq, 128))


# ---------------------------------------------------------------- child (one rank) ---

def local_nbytes(tensors) -> int:
    """Bytes this rank holds: a DTensor counts only its local shard."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import LlamaForCausalLM

    from engine.config import OptimConfig
    from engine.parallel import ShardSettings
    from engine.runtime import setup_runtime
    from engine.trainer import TrainEngine

    # a short collective timeout: a stuck rank fails the job rather than eating its budget
    rt = setup_runtime(args.device, "float32", seed=args.seed, timeout_s=120)
    model = LlamaForCausalLM(model_config(args))  # same seed: identical on every rank
    engine = TrainEngine(model, OptimConfig(), total_steps=10, runtime=rt, lr=1e-4,
                         sharding=ShardSettings(zero_stage=args.stage, offload=args.offload))

    # one fixed global batch; each rank takes its contiguous slice
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(args.seed))
    per_rank = args.batch // rt.world_size
    ids = ids[rt.rank * per_rank:(rt.rank + 1) * per_rank].to(rt.device)
    cuda = rt.device.type == "cuda"
    tracker = None
    grad_bytes = fwd_peak = 0

    def peak_so_far() -> int:
        if cuda:
            return torch.cuda.max_memory_allocated(rt.device)
        return tracker.get_tracker_snapshot("peak").get(rt.device, {}).get("Total", 0)

    def train_step() -> None:
        nonlocal grad_bytes, fwd_peak
        out = engine(input_ids=ids, labels=ids)
        # ZeRO-2 differs from 3 here: it keeps the layers gathered from forward to backward
        fwd_peak = peak_so_far() if tracker else 0
        # engine contract: the rank shares sum to the objective, here the global token mean
        engine.backward(out.loss * (per_rank / args.batch))
        # grads are freed by step(), so count them in between
        grad_bytes = local_nbytes(p.grad for p in engine.module.parameters()
                                  if p.grad is not None)
        engine.step()

    train_step()  # step 1: lazy FSDP init and AdamW state allocation, not measured
    gc.collect()  # leftovers of step 1 must not be counted in (or freed during) step 2
    tracker = FSDPMemTracker(engine.module, engine.optimizer)
    if cuda:
        torch.cuda.synchronize(rt.device)
        torch.cuda.reset_peak_memory_stats(rt.device)
    with tracker:
        train_step()
    if cuda:
        torch.cuda.synchronize(rt.device)

    snap = tracker.get_tracker_snapshot("peak").get(rt.device, {})
    row = {group: sum(snap.get(key, 0) for key in keys) for group, keys in PEAK_GROUPS.items()}
    row["tracked_peak"] = snap.get("Total", 0)
    row["peak"] = peak_so_far()
    row["fwd_peak"] = fwd_peak
    row["param_shard"] = local_nbytes(engine.module.parameters())
    row["grad_shard"] = grad_bytes
    row["optim_shard"] = local_nbytes(v for state in engine.optimizer.state.values()
                                      for v in state.values() if torch.is_tensor(v))
    row["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    finish(rt, row, args.out)


def finish(rt, row: dict, out: str) -> None:
    """Write the max over ranks of every figure (and the ranks' rows) to `out`; exit."""
    import torch.distributed as dist

    rows = [None] * rt.world_size
    dist.all_gather_object(rows, row)
    if rt.is_main:
        Path(out).write_text(json.dumps(
            {key: max(r[key] for r in rows) for key in row} | {"ranks": rows}))
    dist.destroy_process_group()
    # Skip interpreter teardown: with gloo, a ProcessGroupGloo worker thread can still touch
    # Python while the interpreter finalizes, which aborts the rank ("terminate called without
    # an active exception", SIGABRT) in about half the runs, after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def lora_worker(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from engine.comm_meter import CommMeter
    from engine.config import EngineConfig, LoraConfig, OptimConfig, QuantizedBaseConfig
    from engine.models import byte_tokenizer
    from engine.parallel import hf_model
    from engine.placement import Placement
    from engine.runtime import setup_runtime

    rt = setup_runtime(args.device, "bfloat16", seed=args.seed, timeout_s=300)
    bits = {"bf16": 0, "int8": 8, "int4": 4}[args.base]
    place = Placement(rt, EngineConfig(quantized_base=QuantizedBaseConfig(bits > 0, bits or 8, 64)),
                      {"policy": 3, "scorer": 3})
    tok = byte_tokenizer()   # only its pad id is read: the ids below are random
    model = place.causal_lm(args.model_dir, tok, trained=True,
                            lora=LoraConfig(dim=16, only_optimize_lora=True))
    actor = place.trainer(model, OptimConfig(), 10, family="policy", lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(args.seed))
    per_rank = args.batch // rt.world_size
    ids = ids[rt.rank * per_rank:(rt.rank + 1) * per_rank].to(rt.device)
    cuda = rt.device.type == "cuda"

    def train_step() -> None:
        out = actor(input_ids=ids, labels=ids)
        actor.backward(out.loss * (per_rank / args.batch))
        actor.step()

    def measured(reference=None) -> tuple[int, int]:
        """(peak bytes, all-gathered bytes) of a reference forward (if any) + a step."""
        gc.collect()
        tracker = FSDPMemTracker(hf_model(actor.module), actor.optimizer)  # the FSDP root
        if cuda:
            torch.cuda.synchronize(rt.device)
            torch.cuda.reset_peak_memory_stats(rt.device)
        with tracker, CommMeter() as meter:
            if reference is not None:
                with torch.no_grad():
                    reference(input_ids=ids)
            train_step()
        peak = torch.cuda.max_memory_allocated(rt.device) if cuda else \
            tracker.get_tracker_snapshot("peak").get(rt.device, {}).get("Total", 0)
        return peak, sum(r.bytes for r in meter.records if r.kind == "all_gather")

    train_step()   # lazy init and optimizer state, not measured
    row = {"frozen": local_nbytes(p for p in actor.parameters() if not p.requires_grad),
           "lora": local_nbytes(p for p in actor.parameters() if p.requires_grad),
           "optim": local_nbytes(v for state in actor.optimizer.state.values()
                                 for v in state.values() if torch.is_tensor(v))}
    row["peak"], row["gathered"] = measured()
    shared = place.frozen_start(actor, args.model_dir, tok)
    row["peak_shared_ref"], _ = measured(shared)
    separate = place.frozen(place.causal_lm(args.model_dir, tok, trained=False),
                            family="policy")
    row["separate_ref"] = local_nbytes(separate.parameters())
    row["peak_separate_ref"], _ = measured(separate)
    if not cuda:   # the tracker counts what the actor's step allocates and holds, not the
        row["peak_separate_ref"] += row["separate_ref"]   # reference's resident shards
    finish(rt, row, args.out)


# ---------------------------------------------------------------------- parent ---

def child_command(args: argparse.Namespace, world: int, stage: int, offload: bool,
                  out: str, base: str | None = None) -> list[str]:
    lora = ["--lora", f"--base={base}", f"--model-dir={args.model_dir}"] if base else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world}", str(Path(__file__).resolve()), "--worker", *lora,
            f"--stage={stage}", "--offload" if offload else "--no-offload",
            f"--device={args.device}", f"--hidden={args.hidden}", f"--layers={args.layers}",
            f"--vocab={args.vocab}", f"--batch={args.batch}", f"--seq={args.seq}",
            f"--seed={args.seed}", f"--out={out}"]


def run_child(args: argparse.Namespace, world: int, stage: int, offload: bool,
              base: str | None = None) -> dict | str:
    """One torchrun job; its rank-0 row, or why there is none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        env = dict(os.environ,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])),
                   # share the cores between the ranks; setting it also silences torchrun
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)))
        # own session, so a timeout can kill torchrun and all its ranks together
        proc = subprocess.Popen(child_command(args, world, stage, offload, out, base), cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
            why = f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            why = f"timed out after {CHILD_TIMEOUT_S} s"
        if proc.returncode == 0 and os.path.exists(out):
            return json.loads(Path(out).read_text())
    # keep the whole log: torchrun's summary at its end rarely shows the cause
    name = f"bench-memory-w{world}-s{stage}{'-offload' * offload}{'-' + base if base else ''}.log"
    saved = Path(tempfile.gettempdir()) / name
    saved.write_text(log)
    return f"FAILED: {why}, log in {saved}"


def mib(n: int) -> str:
    return f"{n / MiB:.1f}"


def main() -> None:
    args = parse_args()
    if args.worker:
        return lora_worker(args) if args.lora else worker(args)

    import torch
    import transformers

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    worlds = [int(w) for w in args.worlds.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    bad = [w for w in worlds if args.batch % w]
    if bad:
        sys.exit(f"--batch {args.batch} does not split evenly over world sizes {bad}")
    cfg = model_config(args)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in transformers.LlamaForCausalLM(cfg).parameters())

    print(f"model: LlamaForCausalLM hidden {cfg.hidden_size}, layers {cfg.num_hidden_layers}, "
          f"heads {cfg.num_attention_heads}, intermediate {cfg.intermediate_size}, vocab "
          f"{cfg.vocab_size}: {n_params / 1e6:.1f}M params, {mib(4 * n_params)} MiB fp32")
    print(f"batch: {args.batch} x {args.seq} tokens (global, split over ranks); AdamW; "
          f"2 steps, the 2nd measured")
    print(f"device: {args.device}; torch {torch.__version__}; transformers "
          f"{transformers.__version__}")
    print(f"command: {shlex.join(['python', *sys.argv])}")
    if args.lora:
        return lora_table(args, worlds)
    if args.precision:
        return precision_table(args)
    child = child_command(args, worlds[0], stages[0], False, "ROW.json")
    print(f"child, e.g.: PYTHONPATH=. OMP_NUM_THREADS=<cores / world> python "
          f"{shlex.join(child[1:]).replace(str(REPO) + '/', '')}")
    print(flush=True)

    jobs = [(w, s, False) for w in worlds for s in stages]
    if args.offload:
        jobs += [(w, 3, True) for w in worlds]
    jobs.sort()
    results = {}
    started = time.monotonic()
    for world, stage, offload in jobs:
        if offload and args.device != "cuda":
            results[world, stage, offload] = "n/a (CPU run)"
            continue
        if args.device == "cuda" and world > torch.cuda.device_count():
            results[world, stage, offload] = f"n/a ({torch.cuda.device_count()} GPUs)"
            continue
        t0 = time.monotonic()
        results[world, stage, offload] = run_child(args, world, stage, offload)
        print(f"  world {world} stage {stage}{' +offload' if offload else ''}: "
              f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    cols = ("world", "stage", "params", "grads", "optim", "peak/rank", "vs w1 s0", "fwd peak",
            "@peak: param", "grad", "optim", "act+tmp", "RSS (ref)")
    widths = (5, 9, 7, 7, 7, 9, 8, 8, 12, 7, 7, 7, 9)
    line = "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))
    print(line)
    print("-" * len(line))
    base = results.get((1, 0, False))
    for (world, stage, offload), r in results.items():
        label = f"{stage}+offload" if offload else str(stage)
        if isinstance(r, str):
            print(f"{world:>5}  {label:>9}  {r}")
            continue
        ratio = f"{r['peak'] / base['peak']:.2f}x" if isinstance(base, dict) else "-"
        cells = (world, label, mib(r["param_shard"]), mib(r["grad_shard"]),
                 mib(r["optim_shard"]), mib(r["peak"]), ratio, mib(r["fwd_peak"]), mib(r["param"]),
                 mib(r["grad"]), mib(r["optim"]), mib(r["act"]), mib(r["rss"]))
        print("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    peak_how = ("torch.cuda.max_memory_allocated" if args.device == "cuda" else
                "peak bytes of live\n                      tensor storages (FSDPMemTracker)")
    print(f"""
All sizes MiB per rank, max over ranks. World 1 runs under torchrun too: FSDP2 over one rank,
not plain PyTorch (so gathered parameters are a second copy of the weights).
  params/grads/optim  this rank's local shards: parameters, gradients after backward,
                      AdamW state after the step
  peak/rank           peak of the 2nd training step (forward, backward, AdamW): {peak_how}
  fwd peak            the same, up to the end of forward (loss included)
  @peak: ...          FSDPMemTracker's split of its peak: param = sharded + gathered params
                      (+ all-gather buffers), grad = sharded + unsharded grads (+ reduce-
                      scatter buffers), act+tmp = activations, backward temporaries, buffers
  RSS (ref)           peak resident memory of the whole rank process: includes the full
                      model each rank builds before sharding, Python and libraries
total time {time.monotonic() - started:.0f} s""")


def precision_table(args: argparse.Namespace) -> None:
    """One process, bf16 compute, the same model and batch: weights trained in bf16 (the
    single-process policy before engine/precision.py) against fp32 master weights and AdamW
    state under bf16 autocast (the policy now, as under FSDP2 at any world size)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import LlamaForCausalLM

    from engine.config import OptimConfig
    from engine.runtime import setup_runtime
    from engine.trainer import TrainEngine

    rt = setup_runtime(args.device, "bfloat16", seed=args.seed)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(args.seed)).to(rt.device)
    rows = {}
    for label, weights in (("bf16 weights and AdamW (before)", torch.bfloat16),
                           ("fp32 master, bf16 compute (now)", torch.float32)):
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(model_config(args)).to(weights)
        engine = TrainEngine(model, OptimConfig(), total_steps=10, runtime=rt, lr=1e-4)
        grads = []

        def train_step(engine=engine, grads=grads) -> float:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            grads.append(local_nbytes(p.grad for p in engine.module.parameters()))
            engine.step()
            return float(loss.detach())

        train_step()
        gc.collect()
        tracker = MemTracker()
        tracker.track_external(engine.module, engine.optimizer)
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(rt.device)
        with tracker:
            loss = train_step()
        peak = (torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else
                tracker.get_tracker_snapshot("peak")[rt.device]["Total"])
        rows[label] = (local_nbytes(engine.module.parameters()), grads[-1],
                       local_nbytes(v for st in engine.optimizer.state.values()
                                    for v in st.values() if torch.is_tensor(v)), peak, loss)
        del engine, model
        gc.collect()
    print(f"{'one process, bf16 compute':<33}  {'weights':>8}  {'grads':>8}  {'AdamW':>8}  "
          f"{'peak':>8}  {'vs before':>9}  {'loss (2nd step)':>15}")
    base = next(iter(rows.values()))[3]
    for label, (w, g, o, peak, loss) in rows.items():
        print(f"{label:<33}  {mib(w):>8}  {mib(g):>8}  {mib(o):>8}  {mib(peak):>8}  "
              f"{peak / base:>8.2f}x  {loss:>15.4f}")
    print("MiB; peak of the 2nd step: " + ("torch.cuda.max_memory_allocated" if
          rt.device.type == "cuda" else "live tensor storages (torch's MemTracker)"))


def lora_table(args: argparse.Namespace, worlds: list[int]) -> None:
    import torch
    import transformers

    bases = args.bases.split(",")
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as model_dir:
        torch.manual_seed(args.seed)   # one model, saved once: every job loads these weights
        transformers.LlamaForCausalLM(model_config(args)).save_pretrained(model_dir)
        args.model_dir = model_dir
        print(f"LoRA rank 16 over a frozen base (only LoRA trains), ZeRO-3, bf16 compute; "
              f"loaded from {args.hidden}x{args.layers} safetensors\n", flush=True)
        results = {}
        for world in worlds:
            for base in bases:
                t0 = time.monotonic()
                results[world, base] = run_child(args, world, 3, False, base)
                print(f"  world {world} {base}: {time.monotonic() - t0:.0f} s", file=sys.stderr,
                      flush=True)
    cols = ("world", "base", "frozen", "vs bf16", "gathered", "vs bf16", "lora+optim",
            "peak/rank", "ref: separate", "shared", "peak: separate", "shared")
    widths = (5, 5, 8, 7, 9, 7, 10, 9, 13, 6, 14, 8)
    line = "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))
    print(line)
    print("-" * len(line))
    for (world, base), r in results.items():
        if isinstance(r, str):
            print(f"{world:>5}  {base:>5}  {r}")
            continue
        full = results.get((world, "bf16"))
        ratios = [f"{r[key] / full[key]:.2f}x" if isinstance(full, dict) and full[key] else "-"
                  for key in ("frozen", "gathered")]
        cells = (world, base, mib(r["frozen"]), ratios[0], mib(r["gathered"]), ratios[1], mib(r["lora"] + r["optim"]), mib(r["peak"]),
                 mib(r["separate_ref"]), "0.0", mib(r["peak_separate_ref"]),
                 mib(r["peak_shared_ref"]))
        print("  ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    print(f"""
MiB per rank, max over ranks (goals: INT8 <= 0.55x the gathered bytes and <= 0.6x the frozen
memory of bf16; INT4 <= 0.3x).
  frozen        this rank's shard of the frozen base: integer weights + their bf16 scales
                (a group of 64 values each), norms in bf16
  gathered      bytes this rank received in all-gathers during one training step (forward
                and backward), counted by engine.comm_meter (0 at world 1)
  lora+optim    LoRA adapters (fp32 master) and their AdamW state
  peak/rank     peak of the training step (FSDPMemTracker on CPU, CUDA allocator on GPU)
  ref           step 3's reference policy: a separate frozen bf16 copy (ZeRO-3 sharded)
                vs the actor's base with its adapters disabled (no bytes of its own)
  peak: ...     peak of one reference forward followed by one training step
total time {time.monotonic() - started:.0f} s""")


if __name__ == "__main__":
    main()
