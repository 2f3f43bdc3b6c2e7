"""Data parallelism as the steps see it: this process's share of a global batch, and sums
over all processes. steps/ writes single-process math against this object; whether there
is one process or many, and how rows are dealt to them, is decided here.

Rows are dealt round robin (process r of W takes rows r, r+W, ...). A process that a small
batch leaves without rows still takes part, with the batch's first row as a stand-in of
weight 0, because every process must run the same forward and backward passes (the
sharded weights' collectives pair up across processes). Rows kept from several batches
(dynamic sampling) are dealt again the same way (`redeal`). Means over a global batch are
sums of every share divided by the global count: see `TrainEngine`'s loss contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from engine.runtime import Runtime


class Share(NamedTuple):
    """This process's rows of a global batch."""

    rows: list          # its rows (the batch's first row as a stand-in when it has none)
    index: list[int]    # their positions in the global batch
    weight: float       # 1.0, or 0.0 for a stand-in: multiply its contributions by it


class DataParallel:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def reports(self) -> bool:
        """Whether this process prints, logs metrics and writes files (one process does)."""
        return self.runtime.is_main

    def share(self, batch: Sequence, group: int = 1) -> Share:
        """This process's rows of `batch`, each repeated `group` times (several answers to
        one prompt): a group is never split across processes, so statistics within a
        group need no collective. `index` then counts the repeated rows: row i's copies
        are i*group ... i*group + group-1."""
        rt = self.runtime
        index = list(range(rt.rank, len(batch), rt.world_size))
        weight = 1.0 if index else 0.0
        index = index or [0]
        return Share([batch[i] for i in index for _ in range(group)],
                     [i * group + k for i in index for k in range(group)], weight)

    def pick(self, share: Share, rows: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Where the global batch positions `rows` sit in this process's `share`, and the
        weight of what it then holds: ([positions], 1.0), or ([0], 0.0) as a stand-in when
        it holds none of them."""
        held = torch.isin(torch.tensor(share.index), rows).nonzero().flatten()
        if share.weight == 0 or not len(held):
            return torch.tensor([0]), 0.0
        return held, 1.0

    def batch_flags(self, share: Share, flags: torch.Tensor, size: int, group: int = 1
                    ) -> torch.Tensor:
        """[size] bool over a batch of `size` items dealt by `share(batch, group)`: each
        process's `flags` [its items] in place, one collective (a stand-in flags nothing)."""
        local = torch.zeros(size, dtype=torch.float64, device=self.device)
        if share.weight:
            local[torch.tensor(share.index[::group], device=self.device) // group] = \
                flags.to(self.device, torch.float64)
        return self.runtime.all_sum(local) > 0

    def batch_values(self, share: Share, values: torch.Tensor, size: int) -> torch.Tensor:
        """[size, ...] float64 over a batch of `size` rows dealt by `share(batch)`: each
        process's `values` [its rows, ...] in its rows' places, one collective (a stand-in
        adds nothing): what every process computed of a batch, whole on each."""
        local = torch.zeros((size, *values.shape[1:]), dtype=torch.float64, device=self.device)
        if share.weight:
            local[torch.tensor(share.index, device=self.device)] = \
                values.to(self.device, torch.float64)
        return self.runtime.all_sum(local)

    def redeal(self, fields: Sequence[torch.Tensor], places: torch.Tensor, group: int = 1
               ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Groups of rows kept wherever they were made, dealt again as `share` deals a
        batch, so that no process holds more than its part: the group at global place p
        goes to process p % W. `places` [groups] long are this process's groups' places
        and each of `fields` [groups * group, ...] their rows (the same trailing shapes on
        every process). Returns this process's fields and places, in the places' order.
        An all-to-all: each process holds only the rows it sends and receives."""
        rows = len(places) * group
        widths = [math.prod(field.shape[1:]) for field in fields]
        row_places = places.to(self.device).repeat_interleave(group)
        # one exchange: every field as float64 columns (exact for integers below 2**53)
        packed = torch.cat([field.reshape(rows, width).to(self.device, torch.float64)
                            for field, width in zip(fields, widths, strict=True)]
                           + [row_places[:, None].to(torch.float64)], 1)
        packed = self.runtime.exchange_rows(packed, row_places % self.runtime.world_size)
        row_places = packed[:, -1].long()
        order = torch.sort(row_places, stable=True).indices   # a group's rows keep their order
        columns = packed[order, :-1].split(widths, 1)
        dealt = [column.to(field.dtype).reshape(len(order), *field.shape[1:])
                 for column, field in zip(columns, fields, strict=True)]
        return dealt, row_places[order][::group]

    def most(self, number: int) -> int:
        """The largest of the processes' `number`s."""
        return self.runtime.most(number)

    def row_chunks(self, rows: int, size: int | None) -> list[tuple[slice, bool]]:
        """This process's `rows` as slices of at most `size` (None: one slice), each with
        whether it is real: every process runs as many passes as the one with the most
        slices, so the others add stand-ins (row 0, False) to keep the passes paired."""
        if size is None:
            return [(slice(0, rows), True)]
        count = self.runtime.most(-(-rows // size))
        return [(slice(start, min(start + size, rows)), True) if start < rows
                else (slice(0, 1), False) for start in range(0, count * size, size)]

    def by_row_chunks(self, fn: Callable[[slice], torch.Tensor], rows: int,
                      size: int | None) -> torch.Tensor:
        """fn(row slice) -> [rows of the slice, ...] over `row_chunks`, concatenated (the
        stand-ins' results dropped)."""
        results = [(fn(chunk), real) for chunk, real in self.row_chunks(rows, size)]
        return torch.cat([result for result, real in results if real])

    def sum(self, *numbers: float) -> list[float]:
        """Each number summed over all processes (one collective for all of them)."""
        return self.runtime.total(*numbers)

    def masked_moments(self, x: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, unbiased variance) of the entries of `x` where `mask` is set, over all
        processes' rows."""
        total, count = self.runtime.all_sum(torch.stack([(x * mask).sum(), mask.sum()]))
        mean = total / count.clamp(min=1)
        squares = self.runtime.all_sum((((x - mean) ** 2) * mask).sum()[None])[0]
        var = squares / count.clamp(min=1)
        return mean, torch.where(count > 1, var * count / (count - 1).clamp(min=1), var)

    def write_once(self, write: Callable[[], None]) -> None:
        """Run `write` (files every process reads) on the reporting process; the others
        wait until it is done."""
        if self.reports:
            write()
        self.runtime.barrier()
