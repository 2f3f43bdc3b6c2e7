"""A LoRA actor over an INT8/INT4 frozen base, end to end through the engine: loaded from a
safetensors directory one module at a time, sharded (ZeRO-3, FSDP2), three optimizer steps
on a fixed global batch, the reference log-probs with the adapters off, a greedy rollout
through the hybrid engine and the merged export. Run plainly it is the single-process
reference; on 2 or 4 ranks (gloo, CPU; TEST_RANKS=N forks them, tests/harness/ranks.py)
the same numbers must come out.

    quantized_base_checks.py MODEL_DIR BITS [--zeropp | --zeropp-exact]

--zeropp adds qwZ, qgZ and hpZ over nodes of 2 ranks; --zeropp-exact the same hooks
sending exact values. Prints one JSON line (rank 0) that
tests/test_quantized_base_dist.py compares."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from engine.comm_meter import CommMeter  # noqa: E402
from engine.config import (  # noqa: E402
    EngineConfig,
    LoraConfig,
    OptimConfig,
    QuantizedBaseConfig,
    ZeroPPConfig,
)
from engine.export import full_copy, save_adapter  # noqa: E402
from engine.generation import SamplingSettings  # noqa: E402
from engine.models import byte_tokenizer  # noqa: E402
from engine.placement import Placement  # noqa: E402
from engine.runtime import setup_runtime  # noqa: E402
from steps.tokenize import collate_prompts  # noqa: E402
from tests.harness.ranks import run_ranks  # noqa: E402

ROWS, LENGTH, STEPS = 4, 24, 3


def main() -> None:
    model_dir, bits = sys.argv[1], int(sys.argv[2])
    zeropp = "--zeropp" in sys.argv or "--zeropp-exact" in sys.argv
    torch.set_num_threads(1)
    rt = setup_runtime("cpu", "float32", seed=0, timeout_s=120,
                       procs_per_node=2 if zeropp else None)
    tok = byte_tokenizer()
    engine = EngineConfig(quantized_base=QuantizedBaseConfig(True, bits, 64),
                          zeropp=ZeroPPConfig(qwz=zeropp, qgz=zeropp, hpz=2 if zeropp else 1))
    place = Placement(rt, engine, {"policy": 3, "scorer": 3},
                      zeropp_quantize="--zeropp-exact" not in sys.argv)
    model = place.causal_lm(model_dir, tok, trained=True, seed=3,
                            lora=LoraConfig(dim=4, alpha=8, only_optimize_lora=True))
    # STEPS + 1: the schedule leaves a step with a learning rate after the loop (below)
    actor = place.trainer(model, OptimConfig(grad_clip=0), STEPS + 1, family="policy",
                          generates=True, lr=2e-2)
    reference = place.frozen_start(actor, model_dir, tok)

    ids = torch.randint(4, 250, (ROWS, LENGTH), generator=torch.Generator().manual_seed(7))
    mine = ids[rt.rank::rt.world_size]
    out = {"world": rt.world_size, "losses": [], "optimized": sum(
        len(g["params"]) for g in actor.optimizer.param_groups)}
    for step in range(STEPS):
        meter = CommMeter(ranks_per_node=rt.ranks_per_node) if step == 1 else None
        with meter or torch.enable_grad():
            # this rank's share of the global mean over ROWS rows (equal lengths)
            loss = actor(input_ids=mine, labels=mine).loss * (len(mine) / ROWS)
            actor.backward(loss)
            actor.step()
        out["losses"].append(float(rt.all_sum(loss.detach())))
        if meter is not None:
            out["all_gather_bytes"] = sum(r.bytes for r in meter.records
                                          if r.kind == "all_gather")

    logprobs = torch.log_softmax(reference(input_ids=mine).logits.float(), -1)
    out["reference_logprob_sum"] = float(rt.all_sum(logprobs.gather(
        -1, mine[:, 1:, None]).sum()))
    out["frozen_bytes"] = sum(_local(p).numel() * _local(p).element_size()
                              for p in actor.parameters() if not p.requires_grad)

    prompts = collate_prompts([tok(t)["input_ids"] for t in ("Hello", "2+2=", "Hi there", "Q:")
                               ][rt.rank::rt.world_size], tok.pad_token_id)
    answers = actor.generate(prompts["input_ids"], prompts["attention_mask"],
                             SamplingSettings(max_new_tokens=12, do_sample=False),
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    everyone = [None] * rt.world_size
    if rt.distributed:
        dist.all_gather_object(everyone, answers.tolist())
    else:
        everyone = [answers.tolist()]
    pad = tok.pad_token_id   # ranks pad their own prompts to their own widths
    out["answers"] = sorted([t for t in row if t != pad] for rows in everyone for row in rows)

    # a step after the reference's forwards and the rollout: LoRA still trains (under hpZ,
    # peft's adapter toggle once left the sharded LoRA parameters without gradients)
    stepped = [p for group in actor.optimizer.param_groups for p in group["params"]]
    before = [_local(p).detach().clone() for p in stepped]
    actor.backward(actor(input_ids=mine, labels=mine).loss * (len(mine) / ROWS))
    actor.step()
    moved = sum(not torch.equal(_local(p), old) for p, old in zip(stepped, before, strict=True))
    out["moved_after_reference"] = int(rt.all_sum(torch.tensor(float(moved))))
    with torch.no_grad():
        logits = actor(input_ids=ids).logits
    out["logits"] = [float(logits.sum()), float(logits.abs().sum())]
    merged = full_copy(actor.module, rt)   # the export's merge; collective
    adapter = save_adapter(actor.module, tok, Path(tempfile.mkdtemp()) / "adapter", rt)
    if rt.is_main:
        weights = [v for v in merged.state_dict().values() if not v.is_meta]
        out["merged_weights"] = [float(sum(v.double().sum() for v in weights)),
                                 float(sum(v.double().abs().sum() for v in weights))]
        lora = load_file(adapter / "adapter_model.safetensors")   # gathered whole
        out["adapter_weights"] = [len(lora),   # no signed sum: it cancels to ~1e-4 of these
                                  float(sum(v.double().abs().sum() for v in lora.values())),
                                  float(sum(v.double().square().sum() for v in lora.values()))]
        print(json.dumps(out), flush=True)
    if rt.distributed:
        dist.barrier()
        os._exit(0)   # skip gloo's teardown race (see bench/memory.py)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


if __name__ == "__main__":
    run_ranks(main)
