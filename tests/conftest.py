import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.harness.environment import child_env

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
HH_RLHF = SHARED / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
OPT_TOKENIZER = SHARED / "tokenizers" / "opt"

# Tests never reach a hub: a model or dataset name must resolve locally or fail.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# The demo's default run (`python train.py`, about 3 minutes) is the suite's longest: it
# starts in its own process, on one thread, once its tests are collected, and runs beside
# the other tests, which leave a core idle much of the time (single-threaded interpreter
# start-ups, small in-process models). Its tests go last and wait for it.
DEMO_TESTS = "test_demo_learns.py"
DEMO_TIMEOUT = 1800   # seconds: a hung run fails its tests instead of hanging the suite
_demo_run = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def pytest_collection_modifyitems(config, items):
    demo = [item for item in items if item.path.name == DEMO_TESTS]
    if not demo:
        return
    items[:] = [item for item in items if item.path.name != DEMO_TESTS] + demo
    out = Path(tempfile.mkdtemp(prefix="demo-run-"))
    with open(out / "log.txt", "w") as log:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), "--output-dir", str(out / "run"),
             "logging.progress=false"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=child_env(OMP_NUM_THREADS="1"))
    config.stash[_demo_run] = process, out


def pytest_unconfigure(config):
    process, out = config.stash.get(_demo_run, (None, None))
    if process is not None:
        process.kill()
        process.wait()
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_run(pytestconfig) -> Path:
    """The output directory of the demo's default run, once it has finished."""
    process, out = pytestconfig.stash[_demo_run]
    try:
        code = process.wait(timeout=DEMO_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the demo run took over {DEMO_TIMEOUT} s")
    assert code == 0, f"the demo run failed (exit {code}):\n{(out / 'log.txt').read_text()}"
    return out / "run"


def pytest_configure(config):
    """The suite runs on the CPU wherever it runs, as CI does (its tolerances are fp32's):
    a GPU machine runs exactly CI's suite. The GPU checks are tests/harness/*_checks.py,
    run by path (`pytest tests/harness/bf16_checks.py`), which keeps the GPU visible."""
    if not any("harness" in str(arg) for arg in config.args):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


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
