"""On 2 or 4 ranks (gloo, CPU; TEST_RANKS=N, tests/harness/ranks.py), seen as nodes of 2
ranks: ZeRO++'s pieces against plain collectives and plain ZeRO-3 on a tiny Llama (2 layers,
hidden 64); at world 4 also the hybrid engine (engine/hybrid.py) over ZeRO++ units, whose
rollout gather goes through the qwZ hook.

    TEST_RANKS=4 zeropp_checks.py

Prints one JSON line (rank 0) of measured numbers; tests/test_zeropp.py asserts on them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from engine.comm_meter import CommMeter  # noqa: E402
from engine.config import OptimConfig, ZeroPPConfig  # noqa: E402
from engine.generation import SamplingSettings  # noqa: E402
from engine.hybrid import HybridEngine  # noqa: E402
from engine.models import byte_tokenizer  # noqa: E402
from engine.parallel import ShardSettings  # noqa: E402
from engine.quantize import QMAX  # noqa: E402
from engine.runtime import Runtime  # noqa: E402
from engine.zeropp import (  # noqa: E402
    QuantizedAllGather,
    QuantizedReduceScatter,
    apply_zeropp,
    hpz_kwargs,
    shard_segments,
)
from engine.zeropp import _logged as zeropp_logged  # noqa: E402
from steps.tokenize import collate_prompts  # noqa: E402
from tests.harness.ranks import run_ranks  # noqa: E402

PER_NODE = 2    # ranks per node at world 4; at world 2 each rank is a node of its own
BLOCK = 64


def meter_plain_collectives() -> dict:
    """Bytes rank 0 counts for plain collectives (fp32): world and a cross-node pair."""
    pair = dist.new_group([0, 2]) if dist.get_world_size() == 4 else None
    n = dist.get_world_size()
    got = {}
    for name, group, size in (("world", None, n), ("pair", pair, 2)):
        if group is pair and dist.get_rank() not in (0, 2):
            continue
        with CommMeter(ranks_per_node=PER_NODE) as meter:
            _all_gather(torch.empty(6 * size), torch.ones(6), group)
        got[f"all_gather_{name}"] = [meter.bytes, meter.cross_node_bytes]
        with CommMeter(ranks_per_node=PER_NODE) as meter:
            _reduce_scatter(torch.empty(6), torch.ones(6 * size), group)
        got[f"reduce_scatter_{name}"] = [meter.bytes, meter.cross_node_bytes]
        with CommMeter(ranks_per_node=PER_NODE) as meter:
            dist.all_reduce(torch.ones(8), group=group)
        got[f"all_reduce_{name}"] = [meter.bytes, meter.cross_node_bytes]
    return got


def _all_gather(out, x, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter(out, x, group, op=dist.ReduceOp.SUM):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group, op=op)


def collective_errors() -> dict:
    """The hooks called directly on random data of sizes that do not divide the block."""
    n, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    m = 3 * BLOCK + 10
    x = torch.randn(m, generator=torch.Generator().manual_seed(rank)) * (1 + rank)
    exact = torch.empty(n * m)
    _all_gather(exact, x, group)
    out = {}
    for bits in (8, 4):
        got = torch.empty(n * m)
        got.view(n, m)[rank].copy_(x)
        QuantizedAllGather(bits, BLOCK, ranks_per_node=None)(got, got.view(n, m)[rank], group)
        padded = torch.nn.functional.pad(exact.view(n, m), (0, -m % BLOCK))
        bound = padded.view(n, -1, BLOCK).abs().amax(-1, keepdim=True) / (2 * QMAX[bits])
        bound = bound.expand(-1, -1, BLOCK).reshape(n, -1)[:, :m].reshape(-1)
        excess = (got - exact).abs() - bound * (1 + 1e-4)
        out[f"all_gather_{bits}_excess"] = float(excess.max())
        out[f"all_gather_{bits}_error"] = float((got - exact).abs().max())
    out.update(segmented_errors(n, rank, m, group))
    exact_ag = torch.empty(n * m)
    exact_ag.view(n, m)[rank].copy_(x)
    QuantizedAllGather(8, BLOCK, quantize=False)(exact_ag, exact_ag.view(n, m)[rank], group)
    out["all_gather_off_equal"] = bool(torch.equal(exact_ag, exact))

    grads = torch.randn(n * m, generator=torch.Generator().manual_seed(10 + rank))
    want = torch.empty(m)
    _reduce_scatter(want, grads.clone(), group, dist.ReduceOp.AVG)
    for label, per_node in (("flat", None), ("hier", PER_NODE)):
        for bits, quant in ((8, True), (4, True), (8, False)):
            comm = QuantizedReduceScatter(bits, BLOCK, quantize=quant, ranks_per_node=per_node,
                                          group=group)
            got = torch.empty(m)
            comm(got, grads.clone(), group, dist.ReduceOp.AVG)
            key = f"reduce_scatter_{label}_{bits if quant else 'off'}"
            out[key] = float((got - want).abs().max() / want.abs().max())
    return out


def segmented_errors(n: int, rank: int, m: int, group: dist.ProcessGroup) -> dict:
    """A shard of two parameters' parts that share a block: a norm's ~1 values, then a
    LoRA B's ~1e-3. Cut per parameter, each value stays within half a step of its own
    parameter's blocks; cut as one row, the B's first block is on the norm's grid."""
    segments = [BLOCK // 2 + 5, m - BLOCK // 2 - 5]
    gen = torch.Generator().manual_seed(20 + rank)
    x = torch.cat([1 + 0.1 * torch.randn(segments[0], generator=gen),
                   1e-3 * torch.randn(segments[1], generator=gen)])
    exact = torch.empty(n, m)
    _all_gather(exact.view(-1), x, group)
    own = [F.pad(part, (0, -part.size(1) % BLOCK)) for part in exact.split(segments, 1)]
    bound = torch.cat([
        part.view(n, -1, BLOCK).abs().amax(-1, keepdim=True).expand(-1, -1, BLOCK)
        .reshape(n, -1)[:, :size] for part, size in zip(own, segments, strict=True)], 1)
    out = {}
    for bits in (8, 4):
        for label, cut in (("segmented", segments), ("unsegmented", None)):
            got = torch.empty(n, m)
            got[rank].copy_(x)
            QuantizedAllGather(bits, BLOCK, segments=cut)(got.view(-1), got[rank], group)
            excess = (got - exact).abs() - bound / (2 * QMAX[bits]) * (1 + 1e-4)
            out[f"all_gather_{bits}_{label}_excess"] = float(excess.max())
    grads = torch.cat([torch.randn(n, segments[0], generator=gen),
                       1e-3 * torch.randn(n, segments[1], generator=gen)], 1)
    want = torch.empty(m)
    _reduce_scatter(want, grads.clone().view(-1), group)
    small = slice(segments[0], None)
    for label, per_node in (("flat", None), ("hier", PER_NODE)):
        for cut_label, cut in (("segmented", segments), ("unsegmented", None)):
            got = torch.empty(m)
            QuantizedReduceScatter(8, BLOCK, ranks_per_node=per_node, group=group,
                                   segments=cut)(got, grads.clone().view(-1), group,
                                                 dist.ReduceOp.SUM)
            err = (got[small] - want[small]).abs().max() / want[small].abs().max()
            out[f"reduce_scatter_{label}_8_{cut_label}_small"] = float(err)
    # a chunk whose parts fall on blocks but for its last (a weight, then its bias): the
    # hierarchical hop inside a node sends a row of several chunks back to back
    segments = [2 * BLOCK, 20]
    grads = torch.cat([torch.randn(n, segments[0], generator=gen),
                       1e-3 * torch.randn(n, segments[1], generator=gen)], 1)
    want = torch.empty(sum(segments))
    _reduce_scatter(want, grads.clone().view(-1), group)
    got = torch.empty(sum(segments))
    QuantizedReduceScatter(8, BLOCK, ranks_per_node=PER_NODE, group=group, segments=segments)(
        got, grads.clone().view(-1), group, dist.ReduceOp.SUM)
    small = slice(segments[0], None)
    out["reduce_scatter_hier_8_aligned_small"] = float(
        (got[small] - want[small]).abs().max() / want[small].abs().max())
    return out


class WeightAndGate(torch.nn.Module):
    """A unit of two parameters: a weight of ~1 and a gate of ~1e-3 (a LoRA B's size)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(8, 50, generator=gen))
        self.gate = torch.nn.Parameter(1e-3 * torch.randn(8, generator=gen))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight).sum() + (y * self.gate).sum()


def hpz_across_nodes() -> dict:
    """World 4, each rank a node, hpZ over 2 ranks: the backward gather of the secondary
    shard crosses nodes, so qwZ quantizes it; its buffer holds each parameter's part twice
    the primary shard's. The gate as backward used it (y's gradient), against the exact."""
    unit, settings = WeightAndGate(), ZeroPPConfig(qwz=True, hpz=2, block=BLOCK)
    exact = unit.gate.detach().clone()
    root = torch.nn.Sequential(unit)
    fully_shard(unit, **hpz_kwargs(settings, dist.get_world_size(), 1))
    apply_zeropp(unit, settings, ranks_per_node=1)
    fully_shard(root)
    y = torch.ones(3, 8, requires_grad=True)
    unit(torch.ones(3, 8), y).backward()
    return {"gate_error": float((y.grad[0] - exact).abs().max() / exact.abs().max())}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def sharded(settings: ZeroPPConfig | None, bf16: bool = False,
            quantize: bool = True) -> LlamaForCausalLM:
    model = tiny_llama()
    world = dist.get_world_size()
    kwargs = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32) if bf16
                  else MixedPrecisionPolicy())
    if settings is not None:
        kwargs.update(hpz_kwargs(settings, world, PER_NODE))
    units = [*model.model.layers, model.model.embed_tokens, model]
    for unit in units:
        fully_shard(unit, **kwargs)
        if settings is not None:
            apply_zeropp(unit, settings, ranks_per_node=PER_NODE, quantize=quantize)
    return model


def train_step(settings: ZeroPPConfig | None, bf16: bool = False,
               quantize: bool = True) -> dict:
    """One AdamW step: losses before/after, full gradients and weights, metered bytes of
    the step's forward + backward."""
    model = sharded(settings, bf16, quantize)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    with CommMeter(ranks_per_node=PER_NODE) as meter:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    opt.step()
    with torch.no_grad():
        weights = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    with torch.no_grad():
        after = model(input_ids=ids, labels=ids).loss
    return dict(loss=loss.item(), after=after.item(), grads=grads, weights=weights,
                meter=meter.summary())


def compare(got: dict, want: dict) -> dict:
    return dict(loss=abs(got["loss"] - want["loss"]), after=abs(got["after"] - want["after"]),
                grads=float((got["grads"] - want["grads"]).abs().max()),
                weights=float((got["weights"] - want["weights"]).abs().max()),
                grads_rel=float((got["grads"] - want["grads"]).norm() / want["grads"].norm()))


def model_checks() -> dict:
    world = dist.get_world_size()
    base = train_step(None)
    runs = {
        "exact_hooks": ZeroPPConfig(qwz=True, qgz=True, block=BLOCK),   # sending exact values
        "qwz8": ZeroPPConfig(qwz=True, block=BLOCK),
        "qwz4": ZeroPPConfig(qwz=True, weight_bits=4, block=BLOCK),
        "qgz8": ZeroPPConfig(qgz=True, block=BLOCK),
    }
    if world == 4:
        runs["hpz"] = ZeroPPConfig(hpz=PER_NODE)
        runs["all8"] = ZeroPPConfig(qwz=True, hpz=PER_NODE, qgz=True, block=BLOCK)
    out = {"base_meter": base["meter"]}
    for name, settings in runs.items():
        result = train_step(settings, quantize=name != "exact_hooks")
        out[name] = compare(result, base)
        out[name]["meter"] = result["meter"]
    if world == 4:
        out["bf16_base_meter"] = train_step(None, bf16=True)["meter"]
        out["bf16_qwz8_meter"] = train_step(ZeroPPConfig(qwz=True, block=BLOCK),
                                            bf16=True)["meter"]
    return out


def lora_step() -> dict:
    """One forward/backward of a LoRA model under qwZ + qgZ, whose units hold a frozen base
    and trained adapters: a layer's segments as the hooks see them, and the ZeRO++
    warnings logged so far (a layout that does not match its buffer is one)."""
    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for unit in [*model.base_model.model.model.layers, model]:
        fully_shard(unit)
        apply_zeropp(unit, ZeroPPConfig(qwz=True, qgz=True, block=BLOCK),
                     ranks_per_node=PER_NODE)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    layer = model.base_model.model.model.layers[0]
    return dict(segments=shard_segments(layer), trained=shard_segments(layer, trained_only=True),
                warnings=sorted(zeropp_logged))


def hybrid_checks() -> dict:
    """HybridEngine (tiny Llama with LoRA 4, as step 3's actor) over ZeRO-3 with all three
    of ZeRO++ at 2 nodes x 2 ranks, against the same over plain ZeRO-3:

      exact_*      the hooks with quantize=False: greedy and row-seeded sampled answers
                   token-identical to plain ZeRO-3's
      quantized    quantize=True: every local shard bit-identical after generate, the
                   training loss after generate equal to the one before, and one optimizer
                   step afterwards equal to that of a twin that never generated
      *_gather     the rollout gather's bytes (CommMeter around a first generate, so the
                   gather starts from the primary 1/world shards)

    Booleans are true only when true on every rank."""
    from hybrid_check import PROMPTS, model_with_answers_that_end  # beside this file

    world, rank = dist.get_world_size(), dist.get_rank()
    rt = Runtime(torch.device("cpu"), torch.float32, rank=rank, world_size=world,
                 local_rank=rank % PER_NODE, ranks_per_node=PER_NODE)
    tok = byte_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    rows = list(range(rank, len(PROMPTS), world))
    batch = collate_prompts([tok(PROMPTS[i])["input_ids"] for i in rows], pad)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    kwargs = dict(eos_token_id=eos, pad_token_id=pad, row_seeds=torch.tensor(rows) + 1000)
    greedy = SamplingSettings(max_new_tokens=16, do_sample=False)
    sampled = SamplingSettings(max_new_tokens=16, temperature=0.9, top_k=40, top_p=0.95)
    ids_train = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(rank))
    every = dict(qwz=True, hpz=PER_NODE, qgz=True)

    def engine(zeropp: ZeroPPConfig, quantize: bool = True) -> HybridEngine:
        torch.manual_seed(0)    # LoRA A's initialisation draws from the global generator
        model = model_with_answers_that_end("tiny-llama", 4, eos)
        return HybridEngine(model, OptimConfig(), 10, rt,
                            ShardSettings(zero_stage=3, zeropp=zeropp, zeropp_quantize=quantize),
                            lr=1e-3)

    def rollouts(e: HybridEngine) -> tuple[list[torch.Tensor], CommMeter]:
        with CommMeter(ranks_per_node=PER_NODE) as meter:
            first = e.generate(ids, mask, greedy, **kwargs)
        return [first, e.generate(ids, mask, sampled, **kwargs)], meter

    def loss(e: HybridEngine) -> torch.Tensor:
        return e(input_ids=ids_train, labels=ids_train).loss

    def shards(e: HybridEngine) -> list[torch.Tensor]:
        """Every parameter's local shard. Through state_dict, whose FSDP hook puts every
        unit into its sharded state first (a trained root stays gathered after a no-grad
        forward, and after forward hpZ holds a secondary shard instead)."""
        state = e.module.state_dict()
        assert all(isinstance(v, DTensor) for v in state.values()), "unsharded parameter"
        return [v.to_local().detach().clone() for v in state.values()]

    def everywhere(flag: bool) -> bool:
        return rt.total(float(not flag))[0] == 0

    plain, plain_meter = rollouts(engine(ZeroPPConfig()))
    exact, exact_meter = rollouts(engine(ZeroPPConfig(**every), quantize=False))
    quantized = engine(ZeroPPConfig(**every))
    before = shards(quantized)
    _, meter = rollouts(quantized)
    after_first = shards(quantized)
    with torch.no_grad():
        loss_before = loss(quantized)
    quantized.generate(ids, mask, greedy, **kwargs)     # after a forward (hpZ's secondary shard)
    with torch.no_grad():
        loss_after = loss(quantized)
    after = shards(quantized)
    twin = engine(ZeroPPConfig(**every))                # never generates
    with torch.no_grad():
        twin_loss = loss(twin)
    for e in (quantized, twin):
        e.backward(loss(e))
        e.step()
    with torch.no_grad():
        step_equal = bool(loss(quantized) == loss(twin))
    step_shards_equal = all(torch.equal(a, b) for a, b in zip(shards(quantized), shards(twin),
                                                              strict=True))

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(x.shape == y.shape and bool((x == y).all()) for x, y in zip(a, b, strict=True))

    return {
        "exact_greedy_identical": everywhere(same(exact[:1], plain[:1])),
        "exact_sampled_identical": everywhere(same(exact[1:], plain[1:])),
        "answer_tokens": rt.total(float(plain[0].shape[1] - ids.shape[1]))[0],
        "shards": len(before),
        "shards_unchanged": everywhere(all(
            torch.equal(a, b) and torch.equal(a, c)
            for a, b, c in zip(before, after_first, after, strict=True))),
        "loss_before": loss_before.item(), "loss_after": loss_after.item(),
        "loss_twin": twin_loss.item(),
        "loss_unchanged": everywhere(bool(loss_after == loss_before)),
        "step_unchanged": everywhere(step_equal and step_shards_equal),
        "plain_gather": meter_bytes(plain_meter), "exact_gather": meter_bytes(exact_meter),
        "qwz_gather": meter_bytes(meter),
    }


def meter_bytes(meter: CommMeter) -> dict:
    """Rank 0's all-gather calls, bytes and cross-node bytes, and the bytes of all other
    collectives."""
    gathers = meter.summary().get("all_gather", {"calls": 0, "bytes": 0, "cross_node_bytes": 0})
    return {**gathers, "other_bytes": meter.bytes - gathers["bytes"]}


def main() -> None:
    global PER_NODE
    dist.init_process_group("gloo")
    PER_NODE = 2 if dist.get_world_size() == 4 else 1
    torch.set_num_threads(1)
    results = {"world": dist.get_world_size()}
    if dist.get_world_size() == 4:
        results["meter"] = meter_plain_collectives()
    results["collectives"] = collective_errors()
    results["model"] = model_checks()
    if dist.get_world_size() == 4:
        results["hybrid"] = hybrid_checks()
        results["hpz_across_nodes"] = hpz_across_nodes()
    results["lora"] = lora_step()
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    run_ranks(main)
