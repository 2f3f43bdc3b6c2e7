"""Where a loop's time goes: torch.profiler over a chosen span of its iterations.

`IterationProfiler(first, last, out)` records iterations first..last (counted from 1) with
CPU and, on CUDA, device activity and input shapes, then writes into `out`: trace.json (a
Chrome / Perfetto trace) and ops.txt (the ops by total device time on CUDA, by CPU time
elsewhere). Every rank records its own span; rank 0 writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

OPS_SHOWN = 40


class IterationProfiler:
    def __init__(self, first: int, last: int, out: Path, *, writes: bool,
                 device: torch.device):
        self.first, self.last, self.out = first, last, out
        self.writes, self.cuda = writes, device.type == "cuda"
        self._profile: profile | None = None
        self.table: str | None = None   # the op table, once written

    @contextlib.contextmanager
    def iteration(self, number: int) -> Iterator[None]:
        """Wrap iteration `number` (1-based) of the loop."""
        if number == self.first:
            activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * self.cuda
            self._profile = profile(activities=activities, record_shapes=True)
            self._profile.__enter__()
        try:
            yield
        finally:
            if number == self.last:
                self.close(number)

    def close(self, last_run: int) -> bool:
        """Stop recording after iteration `last_run` (the loop's end, when it came before
        `last`) and write; True when this wrote a profile."""
        if self._profile is None:
            return False
        if self.cuda:
            torch.cuda.synchronize()
        self._profile.__exit__(None, None, None)
        self.last = last_run
        self._write(self._profile)
        self._profile = None
        return True

    def _write(self, prof: profile) -> None:
        sort_by = "cuda_time_total" if self.cuda else "cpu_time_total"
        self.table = prof.key_averages().table(sort_by=sort_by, row_limit=OPS_SHOWN)
        if self.writes:   # the table first: a GPU trace takes a while (~1 GB at 24 layers)
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "ops.txt").write_text(
                f"iterations {self.first}-{self.last}, ops by {sort_by}\n{self.table}\n")
            prof.export_chrome_trace(str(self.out / "trace.json"))
