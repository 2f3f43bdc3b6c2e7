"""The largest Llama shape that runs step 3 on this GPU: GRPO with a rule reward over an
INT4 frozen base with LoRA rank 8, from the shape presets (engine/models.py: llama-7b,
llama-13b, llama-34b, llama-70b; random weights, built straight into the quantized base).

Per preset, smallest first, one `train.py --step 3` in its own process: 4 prompts x 4
samples of 64 new tokens a round (hh-rlhf prompts), one optimizer step a round in forwards
of 4 answers, gradient checkpointing on, --iterations rounds (the first untimed; prompts of
at most 128 bytes, the presets' byte tokenizer). It stops at the first preset that fails
(out of memory, usually) and prints its last error line. Printed per preset: parameters,
the INT4 base's size, peak allocator memory, s/iteration with its phase split, ms per new
token (the generate phase over its 64 tokens, prefill included), ms per decode step (the
prefill apart, time/decode_step_ms) and two decode bounds from the card's measured copy
bandwidth: streaming the INT4 base (what generation straight from the quantized weights
reads, engine.hybrid.quantized_inference, the default) and streaming a bf16 copy (the
`--dequantized` path, which builds one per rollout), with the share of the bound the
decode step reaches. Whether every logged loss was finite and no update was
skipped is checked per preset.

With --ppo each preset also runs PPO with a small critic (ppo.critic_path=tiny-llama, the
actor's tokenizer): the actor's side of PPO, with a critic's values and GAE, at that size.

Run:  python bench/largest.py                          (one GPU; minutes per preset)
      python bench/largest.py --dequantized            (the bf16-copy rollout, to compare)
      python bench/largest.py --ppo                    (PPO with a small critic as well)
      python bench/largest.py --presets llama-70b --ppo-only   (PPO alone)
      python bench/largest.py --presets llama-34b --memory-gib 76
          (on an H200: the allocator capped below an 80 GB H100's memory)
      python bench/largest.py --presets tiny-llama --device cpu   (the harness on a CPU)
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from peers import REPO, Run, measured_rates, train_env, write_prompts  # puts REPO on the path

from engine.models import SHAPES, byte_tokenizer, preset_config
from engine.tracking import read_metrics

NEW_TOKENS, PROMPTS, GROUP, FORWARD = 64, 4, 4, 4
MAX_PROMPT = 128   # tokens of the presets' byte tokenizer: hh-rlhf's short questions


def sizes(preset: str) -> tuple[int, int, int]:
    """(parameters, bytes of a bf16 copy, bytes of the INT4 base: 4 bits a weight of the
    Linear/Embedding modules plus a bf16 scale per 64, other weights in bf16)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(preset, byte_tokenizer()))
    params = sum(p.numel() for p in model.parameters())
    matrices = sum(m.weight.numel() for m in model.modules()
                   if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)))
    return params, 2 * params, matrices // 2 + matrices // 64 * 2 + 2 * (params - matrices)


def run_step3(preset: str, prompts: Path, out: Path, iterations: int, device: str,
              dequantized: bool, algorithm: str, memory_gib: float | None
              ) -> tuple[dict | None, str]:
    algorithm_settings = (["ppo.algorithm=grpo", f"ppo.samples_per_prompt={GROUP}"]
                          if algorithm == "grpo" else
                          ["ppo.critic_path=tiny-llama", f"ppo.samples_per_prompt={GROUP}"])
    capped = [str(REPO / "bench" / "capped.py"), str(memory_gib)] if memory_gib else []
    command = [
        sys.executable, *capped, str(REPO / "train.py"), "--step", "3", "--output-dir", str(out),
        "--zero-quantized-nontrainable-weights", "engine.quantized_base.bits=4",
        f"ppo.actor_path={preset}", "ppo.actor_lora.dim=8", *algorithm_settings,
        f"ppo.rollout_batch_size={PROMPTS}",
        f"ppo.micro_batch_size={PROMPTS * GROUP}", f"ppo.forward_batch_size={FORWARD}",
        f"data.path=[{prompts}]", "data.split=[0,0,1]", "data.eval_fraction=0",
        f"data.max_prompt_len={MAX_PROMPT}", f"data.max_answer_len={NEW_TOKENS}",
        "ppo.epochs=1",
        "ppo.reward_fn=peers:reward", "ppo.reward_model_weight=0", "ppo.eval_prompts=0",
        "ppo.best_of_n=0", "engine.gradient_checkpointing=true", f"engine.device={device}",
        f"engine.hybrid.quantized_inference={str(not dequantized).lower()}",
        "ppo.export_weights=adapter", "logging.progress=false",
        "overwrite=true", "resume=false"]   # a rerun into the same --out measures afresh
    print("$ " + shlex.join(command[1:]), file=sys.stderr, flush=True)
    log = out.with_suffix(".log")   # the child's stderr as it runs: kept if this one is killed
    with log.open("w") as stderr:
        result = subprocess.run(command, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL,
                                stderr=stderr, text=True)
    if result.returncode:
        lines = [line for line in log.read_text().splitlines() if line.strip()]
        return None, lines[-1] if lines else f"exit {result.returncode}"
    rows = read_metrics(out / "step3" / "metrics.jsonl")
    timed = [r for r in rows if "time/iteration" in r][1:]
    losses = [r[k] for r in rows for k in ("train/policy_loss", "train/kl_loss") if k in r]
    row = {k: statistics.median(r[f"time/{k}"] for r in timed)
           for k in ("iteration", "generate", "experience", "train")}
    steps = [r["time/decode_step_ms"] for r in timed if "time/decode_step_ms" in r]
    row.update(peak_gib=max(r.get("memory/peak_mib", 0) for r in rows) / 1024, rounds=len(timed),
               decode_step_ms=statistics.median(steps) if steps else None,
               finite=all(math.isfinite(x) for x in losses)
               and max(r.get("train/skipped_steps", 0) for r in rows) == 0)
    return row, "ok"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(SHAPES))
    p.add_argument("--iterations", type=int, default=6, help="rounds, the first untimed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--dequantized", action="store_true",
                   help="generate from a bf16 copy (engine.hybrid.quantized_inference=false)")
    p.add_argument("--ppo", action="store_true", help="also PPO with a small critic")
    p.add_argument("--ppo-only", action="store_true", help="PPO with a small critic alone")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="cap the children's CUDA allocator (bench/capped.py): e.g. 76 to "
                        "show on an H200 what fits an 80 GB H100")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        prompts, tokenizer = out / "prompts.jsonl", out / "tokenizer"
        byte_tokenizer().save_pretrained(tokenizer)   # the presets' own
        write_prompts(prompts, tokenizer, Run(PROMPTS, GROUP, NEW_TOKENS, MAX_PROMPT,
                                              args.iterations, 1, FORWARD))
        bandwidth, _ = measured_rates(args.device)
        if args.device != "cpu":
            torch.cuda.empty_cache()   # the children get the whole card
        print_header(args, bandwidth)
        for preset in args.presets:   # a row as each run ends: a cut-off bench keeps them
            for algorithm in (("ppo",) if args.ppo_only else ("grpo", "ppo") if args.ppo
                              else ("grpo",)):
                row, status = run_step3(preset, prompts, out / f"{preset}-{algorithm}",
                                        args.iterations, args.device, args.dequantized,
                                        algorithm, args.memory_gib)
                print_row(args, bandwidth, f"{preset} {algorithm}", *sizes(preset), row,
                          status)
            if row is None:
                break


def print_header(args: argparse.Namespace, bandwidth: float) -> None:
    name = torch.cuda.get_device_name() if args.device != "cpu" else "CPU"
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"device: {name}; torch {torch.__version__}; copy {bandwidth / 1e12:.2f} TB/s"
          + (f"; allocator capped at {args.memory_gib:g} GiB" if args.memory_gib else ""))
    rollout = ("a bf16 copy (--dequantized)" if args.dequantized
               else "the INT4 base (engine.hybrid.quantized_inference)")
    print(f"run: GRPO (and PPO with --ppo), {PROMPTS} prompts x {GROUP} samples of {NEW_TOKENS} new tokens, INT4 "
          f"base (block 64) + LoRA rank 8, gradient checkpointing, forwards of {FORWARD}, "
          f"static KV cache for {PROMPTS * GROUP} rows, generating from {rollout}; median "
          f"of {args.iterations - 1} rounds after 1; bounds: ms per decode step to stream "
          "those bytes once")
    header = (f"{'preset':<15} {'params':>7} {'INT4 GiB':>9} {'peak GiB':>9} {'s/iter':>7} "
              f"{'generate':>9} {'exper.':>7} {'train':>7} {'ms/token':>9} {'ms/step':>8} "
              f"{'int4 bound':>10} {'bf16 bound':>10} {'of bound':>8}  status")
    print(header)
    print("-" * len(header), flush=True)


def print_row(args: argparse.Namespace, bandwidth: float, preset: str, params: int,
              bf16_bytes: int, int4_bytes: int, row: dict | None, status: str) -> None:
    streamed = bf16_bytes if args.dequantized else int4_bytes
    bounds = (f"{int4_bytes / bandwidth * 1e3:>10.2f} {bf16_bytes / bandwidth * 1e3:>10.2f}"
              if args.device != "cpu" else f"{'-':>10} {'-':>10}")
    if row is None:
        print(f"{preset:<15} {params / 1e9:>6.1f}B {int4_bytes / 2**30:>9.1f} "
              f"{'-':>9} {'-':>7} {'-':>9} {'-':>7} {'-':>7} {'-':>9} {'-':>8} {bounds} "
              f"{'-':>8}  {status}", flush=True)
        return
    per_token = row["generate"] / NEW_TOKENS
    per_step = row["decode_step_ms"] / 1e3 if row["decode_step_ms"] else per_token
    share = (f"{streamed / bandwidth / per_step:>8.0%}" if args.device != "cpu"
             else f"{'-':>8}")
    print(f"{preset:<15} {params / 1e9:>6.1f}B {int4_bytes / 2**30:>9.1f} "
          f"{row['peak_gib']:>9.1f} {row['iteration']:>7.2f} {row['generate']:>9.2f} "
          f"{row['experience']:>7.2f} {row['train']:>7.2f} {per_token * 1e3:>9.2f} "
          f"{per_step * 1e3:>8.2f} {bounds} {share}  "
          f"{'finite, none skipped' if row['finite'] else 'NON-FINITE or skipped'}",
          flush=True)


if __name__ == "__main__":
    main()
