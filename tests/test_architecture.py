"""The seam between steps/ (what RLHF computes) and engine/ (how it runs): steps/ reads as
single-process math. These checks read the source, so a leak fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEPS = sorted((ROOT / "steps").glob("*.py"))
ENGINE = sorted((ROOT / "engine").glob("*.py"))

# What only engine/ may touch: process groups and collectives, ranks, placement (sharding,
# offload, master dtype), and the wrapped module inside an engine.
FORBIDDEN_IMPORTS = ("torch.distributed", "engine.parallel", "engine.launch")
FORBIDDEN_NAMES = {
    "rank", "world_size", "local_rank", "is_main", "distributed",            # who am I
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",    # collectives
    "all_sum", "all_to_all",
    "ShardSettings", "fully_shard", "shard", "frozen_models", "master_dtype",  # placement
    "offload", "offload_reference_model", "offload_reward_model", "shard_frozen_models",
    "zero_stage", "module",
}
MAX_FUNCTION_LINES = 60


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", STEPS, ids=lambda p: p.name)
def test_steps_import_no_distributed_or_placement_code(path):
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        bad = [n for n in names if n.startswith(FORBIDDEN_IMPORTS)]
        assert not bad, f"{path.name}:{node.lineno} imports {bad}: that belongs in engine/"


# steps/config.py is exempt: the schema declares the engine group's keys (engine reads them)
@pytest.mark.parametrize("path", [p for p in STEPS if p.name != "config.py"],
                         ids=lambda p: p.name)
def test_steps_name_no_rank_collective_or_placement(path):
    for node in ast.walk(_tree(path)):
        name = node.attr if isinstance(node, ast.Attribute) else \
            node.id if isinstance(node, ast.Name) else None
        assert name not in FORBIDDEN_NAMES, (
            f"{path.name}:{node.lineno} uses `{name}`: ranks, collectives and placement "
            "belong in engine/ (ask engine.data_parallel / engine.placement)")


@pytest.mark.parametrize("path", STEPS + ENGINE + [ROOT / "chat.py"], ids=lambda p: p.name)
def test_functions_fit_on_a_screen(path):
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_FUNCTION_LINES, (
                f"{path.name}:{node.lineno} {node.name} has {lines} lines "
                f"(at most {MAX_FUNCTION_LINES}): split it")


def test_the_rule_catches_a_leak(tmp_path):
    """The checks above fail on the code they exist to keep out."""
    leak = tmp_path / "leak.py"
    leak.write_text("import torch.distributed as dist\n"
                    "def f(rt, x):\n    dist.all_reduce(x)\n    return x[rt.rank::rt.world_size]\n")
    with pytest.raises(AssertionError, match="imports"):
        test_steps_import_no_distributed_or_placement_code(leak)
    with pytest.raises(AssertionError, match="uses"):
        test_steps_name_no_rank_collective_or_placement(leak)
