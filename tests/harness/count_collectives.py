"""On 2 ranks (tests/harness/ranks.py, or torchrun): how many gradient reductions
(reduce-scatters, all-reduces) the backward of each micro-step of a TrainEngine with gradient
accumulation issues.

    TEST_RANKS=2 count_collectives.py GRAD_ACCUM:ZERO_STAGE [...]

Prints one JSON line (rank 0): {"GRAD_ACCUM:ZERO_STAGE": [one count a micro-step]}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from engine.config import OptimConfig  # noqa: E402
from engine.models import byte_tokenizer, load_causal_lm  # noqa: E402
from engine.parallel import ShardSettings  # noqa: E402
from engine.runtime import setup_runtime  # noqa: E402
from engine.trainer import TrainEngine  # noqa: E402
from tests.harness.ranks import run_ranks  # noqa: E402


class CountGradientReductions(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "reduce_scatter" in str(func) or "allreduce" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def micro_step_counts(rt, grad_accum: int, stage: int) -> list[int]:
    model = load_causal_lm("tiny-llama", byte_tokenizer(), seed=0)
    engine = TrainEngine(model, OptimConfig(), 10, rt, ShardSettings(zero_stage=stage),
                         lr=1e-3, grad_accum=grad_accum)
    counts = []
    for micro in range(2 * grad_accum):
        ids = torch.randint(4, 200, (2, 8), generator=torch.Generator().manual_seed(micro))
        with CountGradientReductions() as counter:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        counts.append(counter.count)
    return counts


def main() -> None:
    rt = setup_runtime("cpu", "float32", seed=0, timeout_s=60)
    counts = {case: micro_step_counts(rt, *map(int, case.split(":"))) for case in sys.argv[1:]}
    if rt.is_main:
        print(json.dumps(counts), flush=True)
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    run_ranks(main)
