"""The seam between steps/ (what RLHF computes) and engine/ (how it runs): steps/ reads as
single-process math. These checks read the source, so a leak fails here, not in review."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from engine.config import EngineConfig

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

# engine/ knows nothing of PPO: step 3's roles are steps/' words (engine/placement.py places a
# "policy" or a "scorer"). Checked as whole words (split at "_", ".", and case changes) of
# identifiers, attribute and argument names, and identifier-like strings ("actor"), so prose
# (docstrings, messages naming --actor-model) may still say what a model is used for.
ROLE_WORDS = {"actor", "critic", "reference"}
ROLE_NAMES_ALLOWED = {
    *(f.name for f in fields(EngineConfig)),  # the user's keys (offload_reference_model, ...)
    "add_norm_reference", "silu_mul_reference",          # kernels' reference implementations
    "quantized_linear_reference", "quantized_projection_reference",
    "quantize_reference", "dequantize_reference",
}


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


@pytest.mark.parametrize("path", STEPS, ids=lambda p: p.name)
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


def _names(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, name) of every name the code itself uses: identifiers, definitions, attributes,
    arguments, keywords, imports, and string constants that read as an identifier."""
    for node in ast.walk(tree):
        name = (node.id if isinstance(node, ast.Name) else
                node.attr if isinstance(node, ast.Attribute) else
                node.arg if isinstance(node, ast.arg | ast.keyword) else
                node.asname or node.name if isinstance(node, ast.alias) else
                node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef
                                        | ast.ClassDef) else
                node.value if isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value.isidentifier() else None)
        if name:
            yield getattr(node, "lineno", 0), name


@pytest.mark.parametrize("path", ENGINE, ids=lambda p: p.name)
def test_engine_names_no_step3_role(path):
    for line, name in _names(_tree(path)):
        words = {w.lower() for w in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", name)}
        assert name in ROLE_NAMES_ALLOWED or not words & ROLE_WORDS, (
            f"{path.name}:{line} names `{name}`: step 3's roles belong in steps/; the engine "
            "places a policy or a scorer, trained or frozen (engine/placement.py)")


def test_the_rule_catches_a_leak(tmp_path):
    """The checks above fail on the code they exist to keep out."""
    leak = tmp_path / "leak.py"
    leak.write_text("import torch.distributed as dist\n"
                    "def f(rt, x):\n    dist.all_reduce(x)\n    return x[rt.rank::rt.world_size]\n")
    with pytest.raises(AssertionError, match="imports"):
        test_steps_import_no_distributed_or_placement_code(leak)
    with pytest.raises(AssertionError, match="uses"):
        test_steps_name_no_rank_collective_or_placement(leak)
    for role in ("def rollout_actor(model):\n    return model\n",
                 "def f(place):\n    return place.offload_frozen['reference']\n",
                 "class CriticEngine:\n    pass\n",
                 "def f(model, *, role='actor'):\n    return model\n"):
        leak.write_text(role)
        with pytest.raises(AssertionError, match="step 3's roles"):
            test_engine_names_no_step3_role(leak)
