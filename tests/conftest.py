import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
HH_RLHF = SHARED / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
OPT_TOKENIZER = SHARED / "tokenizers" / "opt"

# Tests never reach a hub: a model or dataset name must resolve locally or fail.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (the README's test command runs two files at once, `-n 2`): one thread
# for each worker and every process it starts. Two spinning OpenMP pools on 2 cores run 10x
# slower.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


def pytest_configure(config):
    """The suite runs on the CPU wherever it runs, as CI does (its tolerances are fp32's):
    a GPU machine runs exactly CI's suite. The GPU checks are tests/harness/*_checks.py,
    run by path (`pytest tests/harness/bf16_checks.py`), which keeps the GPU visible; run
    with the suite, they would have shown it the GPU too, so they are run apart."""
    harness = [_in_harness(Path(str(arg).split("::")[0])) for arg in config.args]
    if any(harness) and not all(harness):
        raise pytest.UsageError("run tests/harness/*_checks.py (the GPU checks) apart from "
                                "the suite: with them, the suite would see the GPU")
    if not any(harness):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # files handed out in LONGEST_FIRST's order: xdist 3.6+ reorders them by their number
    # of tests (--loadscope-reorder, on by default), which started the demo's 4 tests, the
    # longest file, 15 minutes into a 23-minute suite
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _in_harness(path: Path) -> bool:
    """Whether a pytest argument names tests/harness or a file in it (of this checkout)."""
    try:
        return path.resolve().relative_to(ROOT).parts[:2] == ("tests", "harness")
    except ValueError:
        return False


@pytest.fixture
def hh_rlhf_path() -> Path:
    if not HH_RLHF.exists():
        pytest.skip(f"shared data not found at {HH_RLHF} (../shared is absent)")
    return HH_RLHF


@pytest.fixture
def opt_tokenizer_path() -> Path:
    if not OPT_TOKENIZER.exists():
        pytest.skip(f"shared OPT tokenizer not found at {OPT_TOKENIZER} (../shared is absent)")
    return OPT_TOKENIZER


# The longest files first. Two files run at a time (`--dist loadfile`), handed out in
# collection order, so the last long one to start sets the end: the demo's (~5 min) began
# mid-suite and ran on alone for minutes.
LONGEST_FIRST = ("test_demo_learns.py", "test_distributed.py", "test_kernels.py")


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONGEST_FIRST)))   # stable
