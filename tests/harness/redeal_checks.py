"""DataParallel.redeal on 4 CPU ranks (gloo; TEST_RANKS=4 forks them, tests/harness/ranks.py):
groups of rows held unevenly (as dynamic sampling leaves them: rank 0 three groups, rank 2
none) come back dealt as `share` deals a batch, place p to rank p % 4, each field exact in
its dtype and a group's rows in order. Every rank checks its own part; a failed check
exits non-zero (tests/test_distributed.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.data_parallel import DataParallel  # noqa: E402
from engine.runtime import setup_runtime  # noqa: E402
from tests.harness.ranks import run_ranks  # noqa: E402

GROUP = 2
HELD = {0: [4, 0, 1], 1: [2], 2: [], 3: [3]}   # each rank's groups' global places
BIG = 2**40   # token ids travel as float64: exact far past any vocabulary


def rows_of(places: list[int]) -> list[torch.Tensor]:
    """[sequences (long, 3 columns), answered (bool, 2x2), scores (float32)] for the groups
    at `places`, each value telling the place and the row within its group."""
    row = torch.tensor([p * GROUP + k for p in places for k in range(GROUP)], dtype=torch.long)
    sequences = BIG + row[:, None] * 10 + torch.arange(3)
    answered = torch.stack([row % 2 == 0, row % 3 == 0, row % 5 == 0, row >= 0], 1)
    return [sequences, answered.reshape(-1, 2, 2), row.float() / 3]


def main() -> None:
    torch.set_num_threads(1)
    dp = DataParallel(setup_runtime("cpu", "float32", seed=0, timeout_s=60))
    rank, world = dp.runtime.rank, dp.runtime.world_size
    dealt, places = dp.redeal(rows_of(HELD[rank]), torch.tensor(HELD[rank], dtype=torch.long),
                              GROUP)
    want = sorted(p for held in HELD.values() for p in held if p % world == rank)
    assert places.tolist() == want, (rank, places.tolist(), want)
    for got, expected in zip(dealt, rows_of(want), strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected), (rank, got, expected)
    # nothing held anywhere: empty fields of the right trailing shapes
    dealt, places = dp.redeal(rows_of([]), torch.tensor([], dtype=torch.long), GROUP)
    assert not len(places) and [f.shape[1:] for f in dealt] == [(3,), (2, 2), ()]


if __name__ == "__main__":
    run_ranks(main)
