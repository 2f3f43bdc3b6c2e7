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
