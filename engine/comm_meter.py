"""Count the bytes of every collective a rank issues, split into intra-node and cross-node
traffic: a `TorchDispatchMode` that sees each `c10d.*` and `_c10d_functional.*` op (also
those FSDP2 issues in backward, or a custom collective inside its hooks), reads the op's
process group for the peers' global ranks, and attributes bytes to peers. Nothing in the
engine changes; collectives run as they would without the meter.

Nodes: global rank r sits on node r // ranks_per_node (`ranks_per_node=None`: all ranks on
one node, so nothing is cross-node).

The rule: a record counts the bytes THIS rank RECEIVES, split by the sending peer (its own
data is never counted). For a group of n ranks, with `nbytes` = numel * element size:

  all-gather       from each peer: the peer's input (= this rank's input nbytes)
                   total (n-1) * input nbytes
  reduce-scatter   from each peer: the peer's contribution to this rank's shard
                   (= output nbytes); total (n-1) * output nbytes (the direct algorithm;
                   a ring moves the same total)
  all-reduce       ring equivalent (a reduce-scatter then an all-gather): from each peer
                   2 * nbytes / n; total 2 (n-1)/n * nbytes
  all-to-all       from each peer: this rank's output split for that peer
  broadcast        non-root: nbytes from the root; root: 0
  reduce           root: nbytes from each peer; others: 0
  gather/scatter   root of a gather: each peer's input; non-root of a scatter: its output
  recv             nbytes from the source (any-source receives count as intra-node);
                   send: 0
  barrier          0 bytes (still counted as a call)

Cross-node bytes are those whose sending peer is on another node than this rank. Summed
over ranks, they are the bytes that cross node boundaries in the algorithm named above
(what a real backend does inside a node, e.g. NCCL's rings or trees, may differ; the
numbers compare communication volumes, not wire protocol details).

Not seen: collectives that DTensor issues inside its own op dispatch (the mode is off while
its handler runs), e.g. the all-reduce of `clip_grad_norm_` over sharded gradients: one
scalar per step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from engine.runtime import Runtime
from engine.tracking import Tracker

_NAMESPACES = ("c10d", "_c10d_functional")


@dataclass(frozen=True)
class CollectiveRecord:
    op: str                 # op name without namespace and trailing "_", e.g. "allgather_base"
    kind: str               # all_gather, reduce_scatter, all_reduce, all_to_all, broadcast, ...
    group_size: int
    bytes: int              # bytes this rank received from its peers
    cross_node_bytes: int   # the part sent by ranks on other nodes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat(tensors) -> list[torch.Tensor]:
    """A tensor, a list of tensors or a list of lists, flattened to a list."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return [t for item in tensors for t in _flat(item)]


def _total(tensors) -> int:
    return sum(_nbytes(t) for t in _flat(tensors))


def _group(obj) -> dist.ProcessGroup:
    """The ProcessGroup of an op argument (a group object, or a functional op's name)."""
    if isinstance(obj, str):
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(obj)
    if isinstance(obj, torch.ScriptObject):     # what the dispatcher hands a Python mode
        return dist.ProcessGroup.unbox(obj)
    return obj


# kind of each op; arguments are read by position, following the op schemas
_KINDS = {
    "allgather": "all_gather", "_allgather_base": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_any_source": "recv",
    "barrier": "barrier", "monitored_barrier": "barrier",
}


def _per_peer(functional: bool, name: str, kind: str, args, n: int, me: int
              ) -> dict[int, int]:
    """{group-local peer index: bytes received from it} for one op call (`me`: this
    rank's index in the group of n; `functional`: a `_c10d_functional` op)."""
    peers = [p for p in range(n) if p != me]
    if functional:
        data = args[0]
        if kind == "all_to_all":    # (input, output_splits, input_splits, group_name)
            row = _nbytes(data) // max(data.size(0), 1) if data.dim() else _nbytes(data)
            splits = args[1]
            return {p: int(splits[p]) * row if splits else _nbytes(data) // n for p in peers}
        if kind == "all_gather":    # (input(s), group_size, group_name)
            return {p: _total(data) for p in peers}
        if kind == "reduce_scatter":    # (input(s), op, group_size, group_name)
            return {p: _total(data) // n for p in peers}
        if kind == "all_reduce":    # (input(s), op, group_name)
            return {p: 2 * _total(data) // n for p in peers}
        if kind == "broadcast":     # (input, src, group_name)
            return {args[1]: _total(data)} if me != args[1] else {}
    if kind == "all_gather":        # (outputs, inputs, group, ...)
        if name == "allgather":     # outputs[0][i]: rank i's tensor
            return {p: _nbytes(args[0][0][p]) for p in peers}
        return {p: _total(args[1]) for p in peers}
    if kind == "reduce_scatter":    # (outputs, inputs, group, op, ...)
        return {p: _total(args[0]) for p in peers}
    if kind == "all_reduce":        # (tensors, group, op, ...)
        return {p: 2 * _total(args[0]) // n for p in peers}
    if kind == "all_to_all":
        if name == "alltoall":      # (outputs, inputs, group): outputs[i] from rank i
            return {p: _nbytes(args[0][p]) for p in peers}
        out, out_splits = args[0], args[3]   # (output, input, group, out_splits, in_splits)
        if not out_splits:
            return {p: _nbytes(out) // n for p in peers}
        row = _nbytes(out) // max(out.size(0), 1)
        return {p: int(out_splits[p]) * row for p in peers}
    if kind == "broadcast":         # (tensors, group, root_rank, ...)
        return {args[2]: _total(args[0])} if me != args[2] else {}
    if kind == "reduce":            # (tensors, group, op, root_rank, ...)
        return {p: _total(args[0]) for p in peers} if me == args[3] else {}
    if kind == "gather":            # (outputs, inputs, group, root_rank, ...)
        return {p: _total(args[1]) for p in peers} if me == args[3] else {}
    if kind == "scatter":           # (outputs, inputs, group, root_rank, ...)
        return {args[3]: _total(args[0])} if me != args[3] else {}
    if kind == "recv":              # (tensors, group, src, tag) or (tensors, group, tag)
        return {args[2] if name == "recv" else me: _total(args[0])}
    return {}                       # send, barrier


def _group_arg(kind: str, args):
    """The process group argument of a c10d op (functional ops have its name last)."""
    if kind in ("all_reduce", "broadcast", "reduce", "recv", "send", "barrier"):
        return args[1]
    return args[2]


class CommMeter(TorchDispatchMode):
    """Context manager recording every collective issued inside it on this rank:

        with CommMeter(ranks_per_node=2) as meter:
            loss = model(...).loss; loss.backward()
        meter.bytes, meter.cross_node_bytes, meter.summary()

    Bytes follow the module docstring's rule (received by this rank, split by sender)."""

    def __init__(self, ranks_per_node: int | None = None):
        super().__init__()
        if ranks_per_node is not None and ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be positive, got {ranks_per_node}")
        self.ranks_per_node = ranks_per_node
        self.records: list[CollectiveRecord] = []

    def _node(self, global_rank: int) -> int:
        return 0 if self.ranks_per_node is None else global_rank // self.ranks_per_node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in _NAMESPACES:
            name = func._opname.rstrip("_")
            kind = _KINDS.get(name)
            if kind is not None:
                self._record(func.namespace != "c10d", name, kind, args)
        return out

    def _record(self, functional: bool, name: str, kind: str, args) -> None:
        group = _group(args[-1] if functional else _group_arg(kind, args))
        ranks = dist.get_process_group_ranks(group)
        me = ranks.index(dist.get_rank())
        received = _per_peer(functional, name, kind, args, len(ranks), me)
        mine = self._node(ranks[me])
        cross = sum(b for p, b in received.items() if self._node(ranks[p]) != mine)
        self.records.append(CollectiveRecord(name, kind, len(ranks), sum(received.values()),
                                             cross))

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    @property
    def cross_node_bytes(self) -> int:
        return sum(r.cross_node_bytes for r in self.records)

    @property
    def intra_node_bytes(self) -> int:
        return self.bytes - self.cross_node_bytes

    def summary(self) -> dict[str, dict[str, int]]:
        """{kind: {"calls", "bytes", "cross_node_bytes"}} over the records."""
        out: dict[str, dict[str, int]] = defaultdict(
            lambda: {"calls": 0, "bytes": 0, "cross_node_bytes": 0})
        for r in self.records:
            row = out[r.kind]
            row["calls"] += 1
            row["bytes"] += r.bytes
            row["cross_node_bytes"] += r.cross_node_bytes
        return dict(out)

    def reset(self) -> None:
        self.records.clear()

    def take_metrics(self) -> dict[str, int]:
        """The traffic since the last call as comm/* metrics (engine.log_comm); the records
        are dropped, so a long run's meter stays small."""
        metrics = {"comm/calls": len(self.records), "comm/bytes": self.bytes,
                   "comm/intra_node_bytes": self.intra_node_bytes,
                   "comm/cross_node_bytes": self.cross_node_bytes}
        self.reset()
        return metrics


@contextmanager
def logged_comm(runtime: Runtime, enabled: bool) -> Iterator[None]:
    """engine.log_comm: meter rank 0's collectives and add their comm/* metrics to every
    metrics row (the bytes since the row before). A debugging aid: the meter sees every
    op through Python, which slows the run."""
    if not (enabled and runtime.is_main):
        yield
        return
    with CommMeter(runtime.ranks_per_node) as meter:
        Tracker.row_sources.append(meter.take_metrics)
        try:
            yield
        finally:
            Tracker.row_sources.remove(meter.take_metrics)
