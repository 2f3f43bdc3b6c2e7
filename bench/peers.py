"""Step 3 beside TRL on one GPU: the same GRPO run through our train.py and through TRL's
GRPOTrainer (without vLLM), gradient checkpointing off and on.

The run: a random-init Llama of 0.386B parameters (hidden 1024, 24 layers, GQA 16/8,
intermediate 2816, untied head) over the OPT tokenizer, written once as bf16 safetensors
that both systems load; hh-rlhf prompts of at most 64 tokens (../shared/data); 16 prompts
x 8 samples = 128 answers of 128 new tokens a round (random weights almost never say EOS,
so every answer runs to the limit); one optimizer step a round; KL 0.04 to the reference
as a loss; the rule reward `reward` below for both. Each system runs in its own process
for --iterations rounds, the first --warmup untimed.

Both take the round's 128 answers in forwards of --forward-batch (16): ours
ppo.forward_batch_size, TRL's per_device_train_batch_size with gradient accumulation.

Printed per system (and per iteration for ours, the decode steps captured as CUDA graphs: 0
once they are reused): s/iteration (median after warm-up) and its phase split, peak
allocator memory (torch.cuda.max_memory_allocated over the whole run; on a CPU the peak of
live tensor bytes, bench/tensor_peak.py, with what held them at the peak printed after the
table), generated tokens/s, and the trained weights' dtype. Ours: the phases of
metrics.jsonl (generate, experience = reward, reference and old log-probs, train), and of
the generate phase the prefills (s) and the decode step (ms a step, the prefill apart:
against the bound's step). TRL: generate = its `_generate`, experience = the rest of
`_generate_and_score_completions`, train = the rest of the optimizer step.

The bound for the config, from the card's measured copy bandwidth and bf16 matmul rate:
decode = per new token max(weight bytes / bandwidth, 2 x params x rows / rate); prefill
2 x params x prompt tokens / rate; experience = two forwards (policy and reference), 2 x
params x tokens / rate each; train = 6 x params x tokens / rate (8 x with checkpointing).
Attention's own FLOPs and the KV cache's bytes are left out: a strict bound (the issue's
goals are set against it), though at 128 rows the cache read by a decode step, up to 1.2 GB
over 192 slots at the end of an answer, is of the weights' size (0.77 GB).

Run:  pip install -e ".[bench]"        (TRL, pinned; CI does not need it)
      python bench/peers.py            (one GPU; ~10 min for the four rows)
      python bench/peers.py --small --device cpu --systems ours trl
          (the harness itself on a CPU: 2 layers of 64, 4 prompts x 4, 16 tokens)
      python bench/peers.py --device cpu --layers 2 --iterations 2 --warmup 1
          (the memory at the full width, vocabulary and batch on a CPU, in fp32, at the
          second iteration, when AdamW's moments exist; about 70 min on 2 cores)
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from engine.tracking import read_metrics  # noqa: E402

HH_RLHF = REPO.parent / "shared" / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
OPT_TOKENIZER = REPO.parent / "shared" / "tokenizers" / "opt"
ASSISTANT = "\n\nAssistant:"


class Shape(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


class Run(NamedTuple):
    prompts: int        # per round
    group: int          # samples per prompt
    new_tokens: int
    max_prompt: int
    iterations: int
    warmup: int
    forward: int        # rows per forward/backward pass (gradients accumulate over them)
    kl: float = 0.04
    lr: float = 1e-6


FULL = Shape(hidden=1024, layers=24, heads=16, kv_heads=8, intermediate=2816)
SMALL = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128)


def reward(prompt: str, answer: str) -> float:
    """The rule reward both systems optimise: the share of the answer's characters that are
    letters (cheap, deterministic, and not constant on random text)."""
    return sum(ch.isalpha() for ch in answer) / max(len(answer), 1)


# --- the shared inputs -----------------------------------------------------------------


def write_model(path: Path, shape: Shape, dtype: torch.dtype) -> int:
    """A random-init Llama of `shape` with the OPT tokenizer, saved to `path`; its size."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(OPT_TOKENIZER)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def write_prompts(path: Path, tokenizer_dir: Path, run: Run) -> int:
    """hh-rlhf prompts of at most `run.max_prompt` tokens, as many as the rounds use, in the
    prompt/chosen/rejected shape train.py reads (the answers are never used by step 3)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    need = run.prompts * run.iterations
    rows = []
    with gzip.open(HH_RLHF, "rt") as f:
        for line in f:
            chosen = json.loads(line)["chosen"]
            prompt = chosen[:chosen.rindex(ASSISTANT) + len(ASSISTANT)]
            if len(tok(prompt).input_ids) <= run.max_prompt:
                rows.append({"prompt": prompt, "chosen": " Yes.", "rejected": " No."})
            if len(rows) == need:
                break
    if len(rows) < need:
        raise SystemExit(f"{HH_RLHF}: only {len(rows)} prompts of <= {run.max_prompt} tokens, "
                         f"{need} needed; lower --iterations")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


# --- ours: train.py ----------------------------------------------------------------------


def train_env() -> dict[str, str]:
    """A train.py child's environment: bench/ on its path, for ppo.reward_fn=peers:reward."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO / "bench"), str(REPO), os.environ.get("PYTHONPATH")]))}


def run_child(command: list[str], out: Path, env, device: str) -> dict | None:
    """Run one system's child with its stderr in out/stderr.txt, written as it runs: None
    when it succeeded, else a row naming the failure (the other systems still run). On a
    CPU the child runs under bench/tensor_peak.py, which writes out/tensor_peak.json."""
    script = Path(command[1]).name
    if device == "cpu":
        command = [command[0], str(REPO / "bench" / "tensor_peak.py"),
                   str(out / "tensor_peak.json"), *command[1:]]
    print("$ " + shlex.join(command[1:]), file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "stderr.txt"
    with log.open("w") as stderr:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                stderr=stderr)
    if not result.returncode:
        return None
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    print(f"{script} failed ({result.returncode}), stderr in {log}:\n"
          + "\n".join(lines[:3] + ["..."] + lines[-12:]), file=sys.stderr, flush=True)
    return {"failed": lines[-1] if lines else f"exit {result.returncode}"}


def run_ours(model: Path, prompts: Path, out: Path, run: Run, gc: bool, device: str,
             profile: bool = False, lean: bool = False) -> dict:
    """Step 3 alone through train.py (GRPO, the rule reward, no reward model), then its
    metrics.jsonl read back (by default the policy's gradients then live in the KV cache's
    and the inference weights' memory between rollouts: engine.hybrid.cache_holds_gradients).
    `lean`: instead the KV cache freed after each rollout and made again for the next
    (engine.hybrid.release_inference_cache=true); `graphs` counts the decode steps captured
    per timed iteration (0 when the new cache lands at the old address and the graphs are
    reused) from the running total in metrics.jsonl."""
    command = [
        sys.executable, str(REPO / "train.py"), "--step", "3", "--output-dir", str(out),
        f"--actor-model={model}", f"ppo.actor_path={model}", f"data.path=[{prompts}]",
        "data.split=[0,0,1]", "data.eval_fraction=0", f"data.max_prompt_len={run.max_prompt}",
        f"data.max_answer_len={run.new_tokens}", "ppo.algorithm=grpo",
        f"ppo.samples_per_prompt={run.group}", f"ppo.rollout_batch_size={run.prompts}",
        f"ppo.micro_batch_size={run.prompts * run.group}",
        f"ppo.forward_batch_size={run.forward}", "ppo.epochs=1",
        "ppo.reward_fn=peers:reward", "ppo.reward_model_weight=0", f"ppo.kl_coef={run.kl}",
        "ppo.kl_target=0", "ppo.target_kl=null", f"ppo.actor_lr={run.lr}",
        "ppo.eval_prompts=0", "ppo.best_of_n=0", f"engine.device={device}",
        f"engine.gradient_checkpointing={str(gc).lower()}", "logging.progress=false",
        "overwrite=true", "resume=false",   # a rerun into the same --out measures afresh
        *(["engine.hybrid.release_inference_cache=true"] * lean),
        *([f"ppo.profile=[{run.warmup + 1},{run.warmup + 1}]"] * profile)]
    if failed := run_child(command, out, train_env(), device):
        return failed
    rows = read_metrics(out / "step3" / "metrics.jsonl")
    iterations = [r for r in rows if "time/iteration" in r]
    timed = iterations[run.warmup:]
    built = [r.get("generation/decode_steps_built", 0) for r in iterations]
    median = {k: statistics.median(r[k] for r in timed)
              for k in ("time/iteration", "time/generate", "time/experience", "time/train",
                        "time/generate_tokens_per_s", "time/prefill", "time/decode_step_ms")
              if all(k in r for r in timed)}
    return {"s_per_iteration": median["time/iteration"], "generate": median["time/generate"],
            "prefill": median.get("time/prefill"),
            "decode_step_ms": median.get("time/decode_step_ms"),
            "experience": median["time/experience"], "train": median["time/train"],
            "peak_gib": rows[-1]["memory/peak_mib"] / 1024,
            "generated_tokens_per_s": median["time/generate_tokens_per_s"],
            "weights": "fp32 master, bf16 compute" if device != "cpu" else "fp32",
            "iterations": len(timed), **tensor_peak(out, device),
            "graphs": (built[-1] - (built[run.warmup - 1] if run.warmup else 0)) / len(timed)}


def tensor_peak(out: Path, device: str) -> dict:
    """On a CPU, the child's peak of live tensor bytes and what held it (see run_child)."""
    if device != "cpu":
        return {}
    peak = json.loads((out / "tensor_peak.json").read_text())
    return {"peak_gib": peak["peak_bytes"] / 2**30, "at_peak": peak["at_peak"]}


# --- TRL: GRPOTrainer in a child process ------------------------------------------------


def trl_worker(model: Path, prompts: Path, run: Run, gc: bool, device: str, out: Path) -> None:
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = device != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # With a fingerprint given, datasets does not hash the table: that hash dill-pickles a
    # helper whose globals hold pyarrow, by value (all of pyarrow, MonthDayNano fails) when
    # pyarrow sits outside sys.prefix and outside any site-packages, as on PYTHONPATH.
    text = prompts.read_text()
    dataset = Dataset(InMemoryTable.from_pylist([{"prompt": json.loads(line)["prompt"]}
                                                 for line in text.splitlines()]),
                      fingerprint=hashlib.sha256(text.encode()).hexdigest()[:16])
    batch = run.prompts * run.group
    micro = min(batch, run.forward)
    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro, num_generations=run.group,
        max_completion_length=run.new_tokens, beta=run.kl, learning_rate=run.lr,
        max_steps=run.iterations, gradient_checkpointing=gc, bf16=cuda, use_cpu=not cuda,
        logging_steps=1, report_to=[], save_strategy="no", temperature=1.0, top_p=1.0,
        seed=0, shuffle_dataset=True, disable_dropout=True)
    trainer = GRPOTrainer(model=str(model), reward_funcs=trl_reward, args=args,
                          train_dataset=dataset)

    phases = {"generate": [], "generate_and_score": [], "step": []}

    def timed(name, fn):
        def wrapper(*a, **k):
            sync()
            start = time.perf_counter()
            result = fn(*a, **k)
            sync()
            phases[name].append(time.perf_counter() - start)
            return result
        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._generate_and_score_completions = timed(
        "generate_and_score", trainer._generate_and_score_completions)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync()
            phases["step"].append(time.perf_counter() - self.start)

    trainer.add_callback(StepTimer())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    w = run.warmup
    step, gen = phases["step"][w:], phases["generate"][w:]
    experience = [s - g for s, g in zip(phases["generate_and_score"][w:], gen, strict=True)]
    weights = next(p for p in trainer.model.parameters() if p.requires_grad).dtype
    row = {"s_per_iteration": statistics.median(step), "generate": statistics.median(gen),
           "experience": statistics.median(experience),
           "train": statistics.median(s - g - e for s, g, e in zip(step, gen, experience, strict=True)),
           # (on a CPU, replaced by the peak of live tensor bytes: see run_child)
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "generated_tokens_per_s": batch * run.new_tokens / statistics.median(gen),
           "weights": str(weights).removeprefix("torch.") + (", bf16 autocast" if cuda else ""),
           "iterations": len(step)}
    (out / "row.json").write_text(json.dumps(row))


def trl_reward(prompts, completions, **_) -> list[float]:
    return [reward(p, c) for p, c in zip(prompts, completions, strict=True)]


def run_trl(model: Path, prompts: Path, out: Path, run: Run, gc: bool, device: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--worker", "--model", str(model),
               "--prompts", str(prompts), "--out", str(out), "--device", device,
               "--gc", "on" if gc else "off", *run_args(run)]
    if failed := run_child(command, out, os.environ, device):
        return failed
    return {**json.loads((out / "row.json").read_text()), **tensor_peak(out, device)}


def run_args(run: Run) -> list[str]:
    return [f"--prompts-per-round={run.prompts}", f"--group={run.group}",
            f"--new-tokens={run.new_tokens}", f"--max-prompt={run.max_prompt}",
            f"--iterations={run.iterations}", f"--warmup={run.warmup}",
            f"--forward-batch={run.forward}"]


# --- the bound ----------------------------------------------------------------------------


def measured_rates(device: str) -> tuple[float, float]:
    """(bytes/s of a device-to-device copy counting read + write, bf16 matmul FLOP/s)."""
    if device == "cpu":
        return float("nan"), float("nan")
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def seconds(fn, repeats: int) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    bandwidth = 2 * x.numel() / seconds(lambda: y.copy_(x), 20)
    flops = 2 * 8192**3 / seconds(lambda: a @ a, 10)
    return bandwidth, flops


def bound(params: int, weight_bytes: int, run: Run, prompt_tokens: float, gc: bool,
          bandwidth: float, flops: float) -> dict:
    rows = run.prompts * run.group
    tokens = rows * (prompt_tokens + run.new_tokens)
    step = max(weight_bytes / bandwidth, 2 * params * rows / flops)
    decode = run.new_tokens * step
    prefill = 2 * params * rows * prompt_tokens / flops
    experience = 2 * 2 * params * tokens / flops
    train = (8 if gc else 6) * params * tokens / flops
    return {"generate": decode + prefill, "prefill": prefill, "decode_step_ms": step * 1e3,
            "experience": experience, "train": train,
            "s_per_iteration": decode + prefill + experience + train}


# --- the table ----------------------------------------------------------------------------


def _or_dash(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"



def print_held(held: dict[str, dict[str, int] | None], top: int = 8) -> None:
    """On a CPU: per run, the allocation sites of the most bytes live at the peak."""
    for run, sites in held.items():
        if sites:
            print(f"\nheld at the peak, {run} (MiB, where allocated <- from which of its "
                  "own lines):")
            for site, nbytes in list(sites.items())[:top]:
                print(f"  {nbytes / 2**20:>8.1f}  {site}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["trl", "ours"],
                   choices=["trl", "ours", "ours-lean"], help="ours-lean: ours with the "
                   "KV cache freed after each rollout (see run_ours)")
    p.add_argument("--gc", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="2 layers of 64, 4 prompts x 4, "
                   "16 tokens: the harness, not a measurement")
    p.add_argument("--layers", type=int, default=None, help="the model's layers (default "
                   "24; fewer keep the width, vocabulary and batch, for a CPU's memory probe)")
    p.add_argument("--prompts-per-round", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--forward-batch", type=int, default=16, help="answers per forward/"
                   "backward pass: ours ppo.forward_batch_size, TRL's "
                   "per_device_train_batch_size (its gradient accumulation fills the step)")
    p.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--profile", action="store_true", help="also profile our first timed "
                   "iteration (ppo.profile) and print the top of its op table")
    # the child process of one TRL row
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()

    run = Run(args.prompts_per_round, args.group, args.new_tokens, args.max_prompt,
              args.iterations, args.warmup, args.forward_batch)
    if args.small:
        run = run._replace(prompts=4, group=4, new_tokens=16, iterations=4, warmup=1,
                           forward=8)
    if args.worker:
        trl_worker(args.model, args.prompts, run, args.gc == ["on"], args.device, args.out)
        return

    with contextlib.ExitStack() as stack:
        out = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model, prompts = out / "model", out / "prompts.jsonl"
        shape = SMALL if args.small else FULL
        shape = shape._replace(layers=args.layers or shape.layers)
        dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
        params = write_model(model, shape, dtype)
        write_prompts(prompts, model, run)
        bandwidth, flops = measured_rates(args.device)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model)
        prompt_tokens = statistics.mean(
            len(tok(json.loads(line)["prompt"]).input_ids)
            for line in prompts.read_text().splitlines())

        name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
        print(f"command: python {shlex.join(sys.argv)}")
        print(f"device: {name}; torch {torch.__version__}; "
              f"copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
        print(f"model: random-init Llama {shape.layers} x {shape.hidden} (GQA {shape.heads}/"
              f"{shape.kv_heads}), {params / 1e9:.3f}B parameters, {dtype} on disk")
        print(f"run: {run.prompts} prompts x {run.group} samples, {run.new_tokens} new tokens, "
              f"prompts {prompt_tokens:.1f} tokens on average (<= {run.max_prompt}), one "
              f"optimizer step a round over forwards of {run.forward}, KL {run.kl}; median of "
              f"{run.iterations - run.warmup} rounds after {run.warmup}")
        header = (f"{'system':<9} {'GC':<3} {'s/iter':>7} {'generate':>9} {'prefill':>8} "
                  f"{'ms/step':>8} {'experience':>10} {'train':>7} {'peak GiB':>9} "
                  f"{'gen tok/s':>10} {'x bound':>8} {'graphs':>6} {'wall s':>7}  weights")
        print(header)
        print("-" * len(header), flush=True)
        bounds = {gc: bound(params, params * 2, run, prompt_tokens, gc == "on", bandwidth,
                            flops) for gc in args.gc}
        for gc, b in bounds.items():   # first: a bench cut off by its limit still has them
            print(f"{'bound':<9} {gc:<3} {b['s_per_iteration']:>7.3f} {b['generate']:>9.3f} "
                  f"{b['prefill']:>8.3f} {b['decode_step_ms']:>8.2f} "
                  f"{b['experience']:>10.3f} {b['train']:>7.3f}", flush=True)
        # a row as each run ends (ours first): a bench cut off by its limit keeps those done
        held = {}
        for gc in args.gc:
            for system in sorted(args.systems, key=lambda s: s == "trl"):
                where, began = out / f"{system}-gc-{gc}", time.perf_counter()
                if system.startswith("ours"):
                    r = run_ours(model, prompts, where, run, gc == "on", args.device,
                                 args.profile and system == "ours", system == "ours-lean")
                else:
                    r = run_trl(model, prompts, where, run, gc == "on", args.device)
                wall = time.perf_counter() - began
                if "failed" in r:
                    print(f"{system:<9} {gc:<3} failed after {wall:.0f} s: {r['failed'][:160]}",
                          flush=True)
                    continue
                print(f"{system:<9} {gc:<3} {r['s_per_iteration']:>7.3f} {r['generate']:>9.3f} "
                      f"{_or_dash(r.get('prefill'), 8, 3)} "
                      f"{_or_dash(r.get('decode_step_ms'), 8, 2)} "
                      f"{r['experience']:>10.3f} {r['train']:>7.3f} {r['peak_gib']:>9.1f} "
                      f"{r['generated_tokens_per_s']:>10.0f} "
                      f"{r['s_per_iteration'] / bounds[gc]['s_per_iteration']:>8.1f} "
                      f"{r['graphs'] if 'graphs' in r else '-':>6} "
                      f"{wall:>7.0f}  {r['weights']}", flush=True)
                held[f"{system}, GC {gc}"] = r.get("at_peak")
                ops = where / "step3" / "profile" / "ops.txt"
                if args.profile and ops.exists():   # at once, for the same reason
                    print(f"\nours, GC {gc}: {ops}\n" +
                          "\n".join(ops.read_text().splitlines()[:20]) + "\n", flush=True)
        print_held(held)


if __name__ == "__main__":
    main()
