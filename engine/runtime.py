"""Where the computation runs: device, dtype, seeding. (Process groups join here later.)"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.errors import UserError

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype          # parameter dtype of the models
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_runtime(device: str = "auto", dtype: str = "auto", seed: int = 0) -> Runtime:
    """Resolve `engine.device` / `engine.dtype` ("auto": CUDA + bf16 when present, else CPU
    + fp32) and seed every generator the run uses."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"engine.device={device}: no CUDA device here; use engine.device=cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise UserError(f"engine.dtype={dtype}: unknown; use one of auto, {', '.join(_DTYPES)}")
    seed_everything(seed)
    return Runtime(device=torch.device(device), dtype=_DTYPES[dtype])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def seeded(seed: int, device: torch.device):
    """Run a block with fixed torch RNG state (CPU and, when used, the CUDA device), then
    restore the state the run had, so an evaluation does not shift training's samples."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
