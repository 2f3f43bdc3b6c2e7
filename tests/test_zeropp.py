"""ZeRO++ on FSDP2 (engine/zeropp.py) and the collective byte meter (engine/comm_meter.py),
on CPU gloo ranks: world 2 (each rank its own node) and world 4 (2 nodes x 2 ranks). One
launch per world size runs every check (tests/harness/zeropp_checks.py) and reports
numbers; each test asserts on a part of them.

Expectations: with quantization off the hooks reproduce plain ZeRO-3 (bit for bit at world
2; at world 4 the reduce-scatter's different fp32 summation order shows as ~1e-8 relative
in the gradients); hpZ alone is ZeRO-3 exactly; quantized all-gathers stay within half a
quantization step of each block (absmax / (2 qmax)); qwZ at 8 bits sends ~0.53x the
cross-node bytes of a bf16 all-gather (1 + 4/64 bytes per value over 2, block 64) and
~0.27x of an fp32 one; hierarchical qgZ cuts the gradients' cross-node bytes ~7.5x.

The hybrid engine (world 4) gathers the actor for rollouts through the same units, so
through the qwZ hook: exact hooks give the plain ZeRO-3 answers token for token; quantized,
the rollout gather's cross-node bytes fall to (1 + 4/256) / 4 = 0.254x of fp32 (block 256,
plus padding: measured 0.255x), and the training form (the fp32 shards) is untouched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import ZeroPPConfig
from engine.errors import UserError
from engine.zeropp import hpz_kwargs
from tests.harness.environment import child_env

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "tests" / "harness" / "zeropp_checks.py"
TIMEOUT = 150   # seconds: a deadlock fails the test instead of hanging the suite


def _run(world: int) -> dict:
    result = subprocess.run(
        [sys.executable, str(HARNESS)],
        cwd=ROOT, env=child_env(OMP_NUM_THREADS="1", TEST_RANKS=str(world)),
        capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def world2() -> dict:
    return _run(2)


@pytest.fixture(scope="module")
def world4() -> dict:
    return _run(4)


def test_comm_meter_counts_received_bytes_by_node(world4):
    """Rank 0 of 4 = nodes {0, 1}, {2, 3}; fp32. all-gather of 6 values (24 B) from each
    of 3 peers, 2 on the other node; reduce-scatter to 6 values: 24 B from each peer;
    all-reduce of 8 values (32 B): ring-equivalent 2 * 32 / n from each peer. The pair
    {0, 2} spans both nodes: everything is cross-node."""
    assert world4["meter"] == {
        "all_gather_world": [72, 48], "reduce_scatter_world": [72, 48],
        "all_reduce_world": [48, 32],
        "all_gather_pair": [24, 24], "reduce_scatter_pair": [24, 24],
        "all_reduce_pair": [32, 32],
    }


def test_hooks_without_quantization_match_plain_zero3(world2, world4):
    assert world2["collectives"]["all_gather_off_equal"]
    assert world4["collectives"]["all_gather_off_equal"]
    exact = world2["model"]["exact_hooks"]
    assert [exact[k] for k in ("loss", "after", "grads", "weights")] == [0, 0, 0, 0]
    assert world2["collectives"]["reduce_scatter_flat_off"] == 0
    exact = world4["model"]["exact_hooks"]
    assert exact["loss"] == 0 and exact["after"] == 0
    assert exact["grads_rel"] < 1e-6 and exact["weights"] < 1e-5
    for layout in ("flat", "hier"):
        assert world4["collectives"][f"reduce_scatter_{layout}_off"] < 1e-6


def test_quantized_collectives_stay_within_the_block_bound(world2, world4):
    for world in (world2, world4):
        checks = world["collectives"]
        for bits in (8, 4):
            assert checks[f"all_gather_{bits}_error"] > 0      # quantized for real
            assert checks[f"all_gather_{bits}_excess"] <= 0    # |error| <= absmax / (2 qmax)
        for layout in ("flat", "hier"):      # relative to the largest reduced value
            assert checks[f"reduce_scatter_{layout}_8"] < 0.02
            assert checks[f"reduce_scatter_{layout}_4"] < 0.3
        for name in ("qwz8", "qgz8"):        # one training step of the tiny Llama
            run = world["model"][name]
            # the loss after an AdamW step (lr 1e-2): Adam turns small gradient errors into
            # steps of up to lr, so this one is loose
            assert run["loss"] < 1e-3 and run["after"] < 5e-2 and run["grads_rel"] < 0.05


def test_each_parameter_is_quantized_on_its_own_blocks(world2, world4):
    """A norm's ~1 values and a LoRA B's ~1e-3 in one block of the flat shard: cut per
    parameter, every value stays within half a step of its own parameter's blocks; cut as
    one row (what the hooks did before), the B's first block sits on the norm's grid of
    ~1/127 and its gradient sum is wrong by most of its size."""
    for world in (world2, world4):
        checks = world["collectives"]
        for bits in (8, 4):
            assert checks[f"all_gather_{bits}_segmented_excess"] <= 0
            assert checks[f"all_gather_{bits}_unsegmented_excess"] > 1e-3
        for layout in ("flat", "hier"):
            assert checks[f"reduce_scatter_{layout}_8_segmented_small"] < 0.02
            assert checks[f"reduce_scatter_{layout}_8_unsegmented_small"] > 0.2
        # parts on blocks but the last: the hop inside a node sends chunks back to back,
        # each cut on its own (it was 1.0, the bias's part rounded away)
        assert checks["reduce_scatter_hier_8_aligned_small"] < 0.02
    # hpZ across nodes: the backward gather's parts are twice the primary shard's (the gate
    # of ~1e-3 beside a weight of ~1 came out 0)
    assert world4["hpz_across_nodes"]["gate_error"] < 0.02


def test_hooks_read_the_parameters_parts_of_a_lora_unit(world2, world4):
    """Tiny Llama, hidden 64, LoRA r=4 on q/v, world 2: a layer's shard is its 13
    parameters' halves (q 32x64 = 2048, its A 2x64, its B 32x4, ..., the two norms 32 each)
    and its gradient chunk the 4 adapters' halves; forward and backward ran without a
    layout that does not match its buffer."""
    lora = world2["lora"]
    assert lora["segments"] == [2048, 128, 128, 1024, 1024, 128, 64, 2048, 4096, 4096, 4096,
                                32, 32]
    assert lora["trained"] == [128, 128, 128, 64]
    for world in (world2, world4):    # world 4 also ran hpZ, its gather crossing nodes
        assert not [w for w in world["lora"]["warnings"] if "parameters' parts" in w]


def test_hpz_alone_is_zero3_with_node_local_backward_gathers(world4):
    hpz, base = world4["model"]["hpz"], world4["model"]["base_meter"]
    assert [hpz[k] for k in ("loss", "after", "grads", "weights")] == [0, 0, 0, 0]
    # the backward re-gathers stay inside the node: fewer cross-node bytes
    assert hpz["meter"]["all_gather"]["cross_node_bytes"] < \
        0.6 * base["all_gather"]["cross_node_bytes"]


def test_hpz_reads_as_the_config_says():
    """engine.zeropp.hpz: 1 = off, 0 = the ranks of one node, N = a partition of N ranks
    (plain ZeRO-3 when that is the whole world), which must divide the world."""
    def size(hpz: int, world: int = 8, per_node: int = 2) -> int | None:
        return hpz_kwargs(ZeroPPConfig(hpz=hpz), world, per_node).get("reshard_after_forward")

    assert size(1) is None and size(0) == 2 and size(4) == 4 and size(8) is None
    assert size(0, per_node=1) is None and size(0, world=2, per_node=2) is None
    with pytest.raises(UserError, match="engine.zeropp.hpz=3"):
        size(3)


def test_quantization_cuts_cross_node_bytes(world4):
    model = world4["model"]
    bf16_ratio = (model["bf16_qwz8_meter"]["all_gather"]["cross_node_bytes"]
                  / model["bf16_base_meter"]["all_gather"]["cross_node_bytes"])
    assert 0.5 < bf16_ratio < 0.56
    fp32_ratio = (model["qwz8"]["meter"]["all_gather"]["cross_node_bytes"]
                  / model["base_meter"]["all_gather"]["cross_node_bytes"])
    assert 0.25 < fp32_ratio < 0.28
    grad_ratio = (model["qgz8"]["meter"]["all_to_all"]["cross_node_bytes"]
                  / model["base_meter"]["reduce_scatter"]["cross_node_bytes"])
    assert grad_ratio < 0.15
    everything = model["all8"]["meter"]
    assert everything["all_gather"]["cross_node_bytes"] < \
        0.2 * model["base_meter"]["all_gather"]["cross_node_bytes"]


def test_hybrid_rollouts_over_exact_hooks_match_plain_zero3(world4):
    """qwZ + hpZ + qgZ with quantize=False under the hybrid engine: greedy and row-seeded
    sampled answers token-identical to plain ZeRO-3's, on every rank."""
    hybrid = world4["hybrid"]
    assert hybrid["exact_greedy_identical"] and hybrid["exact_sampled_identical"]
    assert hybrid["answer_tokens"] == 4 * 16     # every rank has an answer running to the max
    # the same gathers: the hooks pass the values through unchanged
    assert hybrid["exact_gather"] == hybrid["plain_gather"]


def test_quantized_rollout_gather_leaves_the_training_form_alone(world4):
    """qwZ quantizes only what the rollout gather sends: every local shard is bit-identical
    after generate (a first one from the primary shards, a second after a forward); the
    training loss after generate equals the one before, and one optimizer step then equals
    that of a twin engine that never generated."""
    hybrid = world4["hybrid"]
    assert hybrid["shards"] == 49    # 2 layers x (9 weights + 14 LoRA) + embeddings, norm, head
    assert hybrid["shards_unchanged"]
    assert hybrid["loss_unchanged"] and hybrid["loss_after"] == hybrid["loss_before"]
    assert hybrid["loss_twin"] == hybrid["loss_before"]
    assert hybrid["step_unchanged"]


def test_qwz_cuts_the_rollout_gathers_cross_node_bytes(world4):
    """CommMeter around the first generate (gathered from the 1/world primary shards): the
    same 4 all-gathers (gather groups: 2 layers, embeddings, root), int8 blocks of 256 values
    with one fp32 scale each instead of fp32 values."""
    plain, qwz = world4["hybrid"]["plain_gather"], world4["hybrid"]["qwz_gather"]
    assert plain["calls"] == qwz["calls"] == 4
    assert plain["other_bytes"] == qwz["other_bytes"] == 0   # decoding needs no collective
    assert plain["cross_node_bytes"] > 0
    ratio = qwz["cross_node_bytes"] / plain["cross_node_bytes"]
    assert 0.25 < ratio < 0.27, ratio
