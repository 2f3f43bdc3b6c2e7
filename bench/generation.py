"""Generation speed of the hybrid engine, side by side in one run (prints tables).

CPU (default; starts 2 gloo ranks through torchrun itself):
  1. Generation of one rollout batch (global batch 8, i.e. 4 rows per rank, 64 new tokens,
     row-seeded sampling as in step 3) from a Llama and an OPT of 6 layers, hidden 256,
     ZeRO-3 sharded over 2 ranks, three ways: Hugging Face `generate` on the sharded
     model (every layer all-gathered for every token, ranks stepping together), `generate`
     on an unsharded copy every rank holds (the copy's cost not counted), and the hybrid
     engine (gather once into fused inference modules, then decode alone; gather counted).
     All three must produce the same tokens; the bench checks that they do.
  2. Step-3 (PPO) iteration time on 2 ranks with the same Llama as actor and critic, with
     the hybrid engine and without it (train.py --step 3, same config otherwise).
  3. Shared prompt prefill (group sampling, as GRPO/RLOO sample several answers per
     prompt), one process: one rollout batch of --group-prompts prompts x --group-size
     samples (prompts of 224-256 tokens, left-padded; 32 new tokens, row-seeded sampling,
     no stop token) through the hybrid engine, each prompt's prefill computed once per
     group vs once per sample, for the same Llama and OPT; both must give the same tokens.

GPU (`--gpu`, one CUDA device): an OPT-1.3B-sized model with random weights in bf16,
256-token prompts and 256 new tokens at batch 1, 8 and 32: Hugging Face `generate` on the
plain model vs the hybrid engine (fused modules, CUDA-graph decode step); tokens/s,
ms per decode step, and the fraction of the memory-bandwidth bound (weight bytes per step
over --bandwidth, 4.8 TB/s for an H200); then where a decode step's time goes (one
generate at the first batch under torch.profiler, the device's ops by their own time);
then section 3 above with that model in bf16.

Times are medians of --repeats runs after a warm-up; with several ranks each run's time is
the slowest rank's.

Run:  python bench/generation.py            (about 4 minutes on 2 CPU cores)
      python bench/generation.py --shared-prefill-only    (section 3 alone)
      python bench/generation.py --gpu
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from engine.tracking import read_metrics  # noqa: E402

CHILD_TIMEOUT_S = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="the single-GPU OPT-1.3B benchmark")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch (CPU)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gather-group-size", type=int, default=1,
                   help="decoder layers the hybrid engine all-gathers at once")
    p.add_argument("--no-step3", action="store_true", help="skip the PPO iteration runs")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (GPU bound)")
    p.add_argument("--gpu-batches", default="1,8,32")
    p.add_argument("--gpu-model", choices=("opt", "llama", "qwen3"), default="opt",
                   help="--gpu: OPT-1.3B-sized, or a Llama of the same size (GQA, SiLU MLP), "
                   "or a Qwen3 of it (the Llama's shape with per-head query/key norms)")
    p.add_argument("--group-size", type=int, default=8,
                   help="shared prompt prefill: samples per prompt")
    p.add_argument("--group-prompts", type=int, default=8,
                   help="shared prompt prefill: prompts per rollout batch")
    p.add_argument("--shared-prefill-only", action="store_true",
                   help="run only the shared prompt prefill section")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _config(arch: str, layers: int, hidden: int, vocab: int, tok):
    from transformers import LlamaConfig, OPTConfig

    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
               eos_token_id=tok.eos_token_id)
    heads = max(hidden // 64, 1)
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=max(heads // 2, 1), tie_word_embeddings=False,
                           max_position_embeddings=2048, **ids)
    return OPTConfig(vocab_size=vocab, hidden_size=hidden, ffn_dim=4 * hidden,
                     num_hidden_layers=layers, num_attention_heads=heads,
                     word_embed_proj_dim=hidden, max_position_embeddings=2048, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, **ids)


def _median_time(fn, repeats: int, sync, ranks_max) -> tuple[float, object]:
    fn()   # warm-up
    times, out = [], None
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(ranks_max(time.perf_counter() - start))
    return statistics.median(times), out


# -- CPU: generation on 2 ranks -------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    """Under torchrun: time the three ways of generating; rank 0 prints a JSON line."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from engine.config import HybridConfig, OptimConfig
    from engine.generation import SamplingSettings, generate
    from engine.hybrid import HybridEngine
    from engine.models import byte_tokenizer
    from engine.parallel import ShardSettings
    from engine.runtime import setup_runtime
    from steps.tokenize import collate_prompts

    rt = setup_runtime("cpu", "float32", seed=0, timeout_s=300)
    tok = byte_tokenizer()
    rows = list(range(rt.rank, args.batch, rt.world_size))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 250, (int(n),), generator=gen).tolist()
               for n in torch.randint(16, 49, (args.batch,), generator=gen)]
    batch = collate_prompts([prompts[i] for i in rows], tok.pad_token_id)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    sampling = SamplingSettings(max_new_tokens=args.new_tokens)   # step 3's sampling
    seeds = torch.tensor(rows) + 7
    kwargs = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, row_seeds=seeds)

    def ranks_max(seconds: float) -> float:
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    results = {}
    for arch in ("llama", "opt"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            _config(arch, args.layers, args.hidden, len(tok), tok))
        plain = copy.deepcopy(model).eval()
        optim, sharding = OptimConfig(), ShardSettings(zero_stage=3)
        sharded = HybridEngine(copy.deepcopy(model), optim, 1, rt, sharding,
                               HybridConfig(enabled=False), lr=1e-4)
        hybrid = HybridEngine(model, optim, 1, rt, sharding,
                              HybridConfig(gather_group_size=args.gather_group_size), lr=1e-4)
        runs = {
            "sharded": partial(sharded.generate, ids, mask, sampling, **kwargs),
            "unsharded": partial(generate, plain, ids, mask, sampling, **kwargs, synced=False),
            "hybrid": partial(hybrid.generate, ids, mask, sampling, **kwargs),
        }
        row, outputs = {}, {}
        for name, fn in runs.items():
            hybrid.take_times()
            row[name], outputs[name] = _median_time(fn, args.repeats, lambda: None, ranks_max)
            if name == "hybrid":
                times = hybrid.take_times()
                row["hybrid_gather"] = ranks_max(times.gather / times.calls)
                row["inference_mib"] = {k: v / 2**20 for k, v in hybrid.inference_bytes().items()}
        same = all(torch.equal(outputs[n], outputs["sharded"]) for n in outputs)
        row["identical"] = ranks_max(float(not same)) == 0
        row["new_tokens"] = outputs["hybrid"].shape[1] - ids.shape[1]
        row["params"] = sum(p.numel() for p in plain.parameters())
        results[arch] = row
    if rt.is_main:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()
    os._exit(0)


def _torchrun(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.ranks}", str(Path(__file__).resolve()), "--worker",
           f"--layers={args.layers}", f"--hidden={args.hidden}", f"--batch={args.batch}",
           f"--new-tokens={args.new_tokens}", f"--repeats={args.repeats}",
           f"--gather-group-size={args.gather_group_size}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"generation worker failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# -- CPU: step-3 iterations with and without the hybrid engine ---------------------------------

def _step3(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    from engine.models import byte_tokenizer

    hf_logging.disable_progress_bar()
    tok = byte_tokenizer()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = _config("llama", args.layers, args.hidden, len(tok), tok)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(f"{tmp}/actor")
        config.num_labels = 1
        AutoModelForSequenceClassification.from_config(config).save_pretrained(f"{tmp}/reward")
        for name in ("actor", "reward"):
            tok.save_pretrained(f"{tmp}/{name}")
        for label, flag in (("hybrid engine", "--enable-hybrid-engine"),
                            ("sharded generate", "--no-enable-hybrid-engine")):
            run_dir = Path(tmp) / label.replace(" ", "_")
            cmd = [sys.executable, str(REPO / "train.py"), "--step", "3", "--output-dir",
                   str(run_dir), "--actor-zero-stage", "3", "--reward-zero-stage", "3", flag,
                   f"ppo.actor_path={tmp}/actor", f"ppo.reward_path={tmp}/reward",
                   "data.path=[demo]", "data.demo_pairs=100", "data.max_prompt_len=64",
                   f"data.max_answer_len={args.new_tokens}", f"ppo.rollout_batch_size={args.batch}",
                   f"ppo.micro_batch_size={args.batch}", "ppo.eval_prompts=0",
                   f"engine.procs={args.ranks}", "engine.device=cpu", "engine.checkpoint_every=0",
                   "logging.progress=false"]
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S)
            if done.returncode != 0:
                sys.exit(f"step 3 ({label}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            rows = read_metrics(run_dir / "step3" / "metrics.jsonl")
            rows = [r for r in rows if "time/iteration" in r][1:]   # the first warms up
            out[label] = {key: statistics.mean(r[f"time/{key}"] for r in rows) for key in
                          ("iteration", "gather", "generate", "experience", "train", "other")}
            out[label]["iterations"] = len(rows)
    return out


# -- Shared prompt prefill (group sampling), one process ----------------------------------------

SHARED_PROMPT_LEN, SHARED_NEW_TOKENS = 256, 32


def _shared_prefill(engine, vocab: int, pad_token_id: int, args: argparse.Namespace,
                    device, sync) -> dict:
    """Median time of one rollout batch (--group-prompts prompts, each repeated for its
    --group-size samples, distinct row seeds) through `engine.generate` with each prompt's
    prefill computed once per sample and once per group; whether the tokens are the same
    (and, if not, the share of answer tokens before each row's first difference)."""
    import torch

    from engine.generation import SamplingSettings
    from steps.tokenize import collate_prompts

    g = args.group_size
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(SHARED_PROMPT_LEN - 32, SHARED_PROMPT_LEN + 1,
                            (args.group_prompts,), generator=gen)
    prompts = [torch.randint(4, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    batch = collate_prompts([p for p in prompts for _ in range(g)], pad_token_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    sampling = SamplingSettings(max_new_tokens=SHARED_NEW_TOKENS)   # step 3's sampling
    # no stop token: every row runs to SHARED_NEW_TOKENS in both ways
    kwargs = dict(eos_token_id=[], pad_token_id=pad_token_id,
                  row_seeds=torch.arange(ids.shape[0], device=device) + 7)
    runs = {name: partial(engine.generate, ids, mask, sampling, group_size=size, **kwargs)
            for name, size in (("per_sample", 1), ("per_group", g))}
    # the two ways alternate, so that a machine busy with something else slows both alike
    times = {name: [] for name in runs}
    outputs = {name: run() for name, run in runs.items()}   # warm-ups
    for _ in range(args.repeats):
        for name, run in runs.items():
            sync()
            start = time.perf_counter()
            outputs[name] = run()
            sync()
            times[name].append(time.perf_counter() - start)
    row = {name: statistics.median(t) for name, t in times.items()}
    a, b = (outputs[n][:, ids.shape[1]:] for n in ("per_sample", "per_group"))
    row["identical"] = torch.equal(a, b)
    row["same_share"] = float((a == b).long().cumprod(-1).sum()) / a.numel()
    row["batch"] = ids.shape[0]
    return row


def _print_shared_prefill(rows: dict[str, dict], args: argparse.Namespace, where: str) -> None:
    print(f"\nShared prompt prefill (group sampling), {where}: {args.group_prompts} prompts x "
          f"{args.group_size} samples, prompts of {SHARED_PROMPT_LEN - 32}-{SHARED_PROMPT_LEN} "
          f"tokens (left-padded), {SHARED_NEW_TOKENS} new tokens, row-seeded sampling, "
          f"median of {args.repeats}")
    print(f"{'model':8} {'batch':>5} {'prefill per sample':>19} {'prefill per group':>18} "
          f"{'speed-up':>8} {'identical':>9}")
    for name, r in rows.items():
        same = "yes" if r["identical"] else f"NO ({r['same_share']:.0%})"
        print(f"{name:8} {r['batch']:5d} {r['per_sample'] * 1e3:16.0f} ms "
              f"{r['per_group'] * 1e3:15.0f} ms {r['per_sample'] / r['per_group']:7.2f}x "
              f"{same:>9}")
    print("time of one rollout batch through the hybrid engine's generate (its weight gather "
          "included, the same in both); identical: the same answer tokens (else the share "
          "before each row's first difference)")


def cpu_shared_prefill(args: argparse.Namespace) -> None:
    """Section 3: the Llama and OPT of section 1, one process, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import HybridConfig, OptimConfig
    from engine.hybrid import HybridEngine
    from engine.models import byte_tokenizer
    from engine.runtime import Runtime

    tok = byte_tokenizer()
    rt = Runtime(torch.device("cpu"), torch.float32)
    rows = {}
    for arch in ("llama", "opt"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            _config(arch, args.layers, args.hidden, len(tok), tok))
        engine = HybridEngine(model, OptimConfig(), 1, rt, hybrid=HybridConfig(), lr=1e-4)
        rows[arch] = _shared_prefill(engine, len(tok), tok.pad_token_id, args, rt.device,
                                     lambda: None)
    _print_shared_prefill(rows, args, f"one process (CPU, {torch.get_num_threads()} threads), "
                          f"fp32, {args.layers} layers, hidden {args.hidden}")


def cpu_main(args: argparse.Namespace) -> None:
    if args.shared_prefill_only:
        cpu_shared_prefill(args)
        return
    results = _torchrun(args)
    per_rank = args.batch // args.ranks
    print(f"\nGeneration, {args.ranks} ranks (gloo, CPU), ZeRO-3, {args.layers} layers, "
          f"hidden {args.hidden}, global batch {args.batch} ({per_rank} per rank), "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'model':8} {'params':>7} {'sharded generate':>17} {'unsharded copy':>15} "
          f"{'hybrid engine':>14} {'(gather)':>9} {'vs sharded':>11} {'vs copy':>8} "
          f"{'tokens/s':>9} {'identical':>9} {'held: weights + KV cache':>25}")
    for arch, r in results.items():
        tokens = args.batch * r["new_tokens"]
        print(f"{arch:8} {r['params'] / 1e6:6.1f}M {r['sharded'] * 1e3:14.0f} ms "
              f"{r['unsharded'] * 1e3:12.0f} ms {r['hybrid'] * 1e3:11.0f} ms "
              f"{r['hybrid_gather'] * 1e3:6.1f} ms {r['sharded'] / r['hybrid']:10.1f}x "
              f"{r['unsharded'] / r['hybrid']:7.2f}x {tokens / r['hybrid']:9.0f} "
              f"{'yes' if r['identical'] else 'NO':>9} "
              f"{r['inference_mib']['weights']:10.1f} + {r['inference_mib']['kv_cache']:4.1f} MiB")
    cpu_shared_prefill(args)
    if args.no_step3:
        return
    step3 = _step3(args)
    print(f"\nStep 3 (PPO) iteration, {args.ranks} ranks, ZeRO-3 actor and critic (the Llama "
          f"above), rollout batch {args.batch}, {args.new_tokens} new tokens, "
          f"mean over iterations after the first")
    print(f"{'generation':17} {'iteration':>9} {'gather':>7} {'generate':>9} "
          f"{'experience':>10} {'train':>7} {'other':>7} {'iters':>5}")
    for label, r in step3.items():
        print(f"{label:17} {r['iteration']:8.2f}s {r['gather']:6.2f}s {r['generate']:8.2f}s "
              f"{r['experience']:9.2f}s {r['train']:6.2f}s {r['other']:6.2f}s "
              f"{r['iterations']:5d}")
    with_he, without = step3["hybrid engine"], step3["sharded generate"]
    print(f"step-3 iteration speed-up with the hybrid engine: "
          f"{without['iteration'] / with_he['iteration']:.2f}x")


# -- GPU: OPT-1.3B-sized, one device --------------------------------------------------------

def gpu_main(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, Qwen3Config

    from engine.config import HybridConfig, OptimConfig
    from engine.generation import SamplingSettings
    from engine.hybrid import HybridEngine
    from engine.runtime import Runtime

    if not torch.cuda.is_available():
        sys.exit("--gpu: no CUDA device here")
    device = torch.device("cuda")
    ids = dict(pad_token_id=1, bos_token_id=2, eos_token_id=2)
    if args.gpu_model == "opt":
        config = OPTConfig(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192,
                           num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048,
                           word_embed_proj_dim=2048, do_layer_norm_before=True, **ids)
    else:
        llama_shaped = LlamaConfig if args.gpu_model == "llama" else Qwen3Config
        config = llama_shaped(hidden_size=2048, num_hidden_layers=24, intermediate_size=5632,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                              vocab_size=50272, max_position_embeddings=2048,
                              tie_word_embeddings=False, **ids)
    began = time.perf_counter()

    def note(what: str) -> None:   # where the time goes, for a run cut off by its limit
        print(f"[{time.perf_counter() - began:6.1f} s] {what}", file=sys.stderr, flush=True)

    torch.manual_seed(0)
    with torch.device(device):   # initialised on the GPU: 1.3B random weights take ~30 s on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    note("model built")
    rt = Runtime(device, torch.bfloat16, 0, 1, 0)
    engine = HybridEngine(copy.deepcopy(model), OptimConfig(), 1, rt, hybrid=HybridConfig(),
                          lr=1e-5)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bound_ms = weight_bytes / args.bandwidth * 1e3
    prompt_len = new = 256
    sampling = SamplingSettings(max_new_tokens=new, do_sample=False)
    sync = torch.cuda.synchronize
    print(f"\n{type(model).__name__}, 1.3B-sized ({weight_bytes / 1e9:.2f} GB of bf16 weights), "
          f"{torch.cuda.get_device_name()}, {prompt_len}-token prompts, {new} new tokens, "
          f"greedy; bandwidth bound {bound_ms:.3f} ms/step at {args.bandwidth / 1e12:.1f} TB/s")
    print(f"{'batch':>5} {'HF tok/s':>9} {'HF ms/step':>10} {'hybrid tok/s':>12} "
          f"{'ms/step':>8} {'decode ms':>9} {'speed-up':>8} {'of bound':>8} {'no graph':>8} "
          f"{'no kernels':>10} "
          f"{'gather ms':>9} {'peak GiB':>8} {'= HF tokens':>11}")
    if args.shared_prefill_only:
        _gpu_shared_prefill(engine, config, model, args, device)
        return
    for batch in (int(b) for b in args.gpu_batches.split(",")):
        ids = torch.randint(3, config.vocab_size, (batch, prompt_len), device=device)
        mask = torch.ones_like(ids)
        # every row runs to `new` tokens in both: HF told not to stop before, ours no EOS
        hf, hf_out = _median_time(partial(model.generate, input_ids=ids, attention_mask=mask,
                                          max_new_tokens=new, min_new_tokens=new,
                                          do_sample=False, pad_token_id=config.pad_token_id),
                                  args.repeats, sync, float)
        note(f"batch {batch}: HF generate")
        kwargs = dict(eos_token_id=[], pad_token_id=config.pad_token_id)   # no stop id
        run = partial(engine.generate, ids, mask, sampling, **kwargs)
        torch.cuda.reset_peak_memory_stats()
        engine.take_times()
        ours, out = _median_time(run, args.repeats, sync, float)
        times = engine.take_times()
        note(f"batch {batch}: hybrid engine")
        peak = torch.cuda.max_memory_allocated() / 2**30
        # the same decode without the CUDA graph, then without the Triton kernels
        settings = engine.hybrid
        engine.hybrid = dataclasses.replace(settings, cuda_graphs=False)
        no_graph, _ = _median_time(run, args.repeats, sync, float)
        note(f"batch {batch}: without the CUDA graph")
        engine._target.model.use_fused_kernels(False)
        no_kernels, _ = _median_time(run, args.repeats, sync, float)
        engine._target.model.use_fused_kernels(True)
        engine.hybrid = settings
        # bf16 greedy: kernels that sum in another order may flip a near-tie, after which
        # a row diverges; the share of answer tokens before each row's first difference
        same = (out[:, prompt_len:] == hf_out[:, prompt_len:]).long().cumprod(-1).sum()
        step_ms = ours / new * 1e3
        decode_ms = times.decode / max(times.decode_steps, 1) * 1e3   # the prefill apart
        print(f"{batch:5d} {batch * new / hf:9.0f} {hf / new * 1e3:10.2f} "
              f"{batch * new / ours:12.0f} {step_ms:8.2f} {decode_ms:9.3f} {hf / ours:7.2f}x "
              f"{bound_ms / decode_ms:7.0%} {no_graph / new * 1e3:8.2f} "
              f"{no_kernels / new * 1e3:10.2f} {times.gather / times.calls * 1e3:9.1f} "
              f"{peak:8.1f} {float(same) / (batch * new):10.0%}", flush=True)
    print("ms/step = the hybrid engine's generate time over new tokens (prefill included); "
          "decode ms: its decode steps alone (the prefill apart, device time), which 'of "
          "bound' compares with the bound; "
          "'no graph', 'no kernels': the same without the CUDA graph, then also without the "
          "Triton kernels; '= HF tokens': share of answer tokens equal to HF's before a "
          "row's first difference")
    _profile_decode(engine, config, sampling, int(args.gpu_batches.split(",")[0]), prompt_len)
    note("profile")
    _gpu_shared_prefill(engine, config, model, args, device)


def _profile_decode(engine, config, sampling, batch: int, prompt_len: int) -> None:
    """Where a decode step's time goes: one generate of the hybrid engine (CUDA graph and
    kernels) under torch.profiler, the device's ops by their own time; totals over the
    run's decode steps (divide by the new tokens for one step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = engine.runtime.device
    cuda = device.type == "cuda"
    ids = torch.randint(3, config.vocab_size, (batch, prompt_len), device=device)
    run = partial(engine.generate, ids, torch.ones_like(ids), sampling, eos_token_id=[],
                  pad_token_id=config.pad_token_id)
    run()   # the decode step for this batch exists before the recording
    try:
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            run()
            if cuda:
                torch.cuda.synchronize()
        where = "device" if cuda else "CPU"
        print(f"\nprofile of one generate at batch {batch}, {sampling.max_new_tokens} new "
              f"tokens, ops by their own {where} time:")
        print(prof.key_averages().table(sort_by=f"self_{'cuda' if cuda else 'cpu'}_time_total",
                                        row_limit=15))
    except RuntimeError as e:   # the table above stands without it
        print(f"no profile: {str(e).splitlines()[0]}")


def _gpu_shared_prefill(engine, config, model, args: argparse.Namespace, device) -> None:
    """Section 3 with the GPU model (bf16, CUDA-graph decode step)."""
    import torch

    row = _shared_prefill(engine, config.vocab_size, config.pad_token_id, args, device,
                          torch.cuda.synchronize)
    _print_shared_prefill({args.gpu_model: row}, args,
                          f"{torch.cuda.get_device_name()}, {type(model).__name__} 1.3B-sized, "
                          "bf16")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    elif args.gpu:
        gpu_main(args)
    else:
        cpu_main(args)


if __name__ == "__main__":
    main()
