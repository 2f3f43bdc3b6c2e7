"""ZeRO++ (Wang et al. 2023) on FSDP2: the three ways it cuts ZeRO-3's cross-node traffic,
as FSDP2 custom collectives and one `fully_shard` argument.

  qwZ  quantized weight all-gather: each rank quantizes its flat shard block-wise, each
       parameter's part in blocks of its own (engine/quantize.py: int8 or int4 + one fp32
       scale per `block` values; `block_layout`), the ranks
       all-gather the uint8 wire buffers, and every rank dequantizes all of them into the
       buffer FSDP expects. Bytes per gathered value: 1 + 4/block (8 bits) or
       0.5 + 4/block (4 bits), against 4 (fp32) or 2 (bf16).
  hpZ  hierarchical partitioning: after forward each block keeps a secondary shard over
       `hpz` ranks (0: one node's) instead of freeing down to the 1/world primary shard, so
       the backward all-gather stays inside the node. FSDP2 does this natively with an int
       `reshard_after_forward` (`hpz_kwargs`).
  qgZ  quantized gradient reduce-scatter: an all-to-all of quantized chunks, then a local
       fp32 sum, instead of a reduce-scatter (whose partial sums cannot be requantized hop
       by hop without compounding error). With ranks_per_node L dividing the group of
       n = N nodes x L: hierarchical, first an all-to-all inside the node (each rank sums
       its node's contributions to the N shards of its local index), then one across
       nodes among the N ranks of the same local index (each summing N partial sums).
       Cross-node bytes per rank: (N-1) quantized shards, against (N-1) * L fp32 shards
       for the plain reduce-scatter.

Where quantization applies: qwZ quantizes a gather only when its group spans more than one
node (hpZ's backward gather inside a node stays exact; with `ranks_per_node=None` the
layout is unknown and every gather is quantized). qgZ always quantizes.

`apply_zeropp(..., quantize=False)` (tests) keeps the hooks and their communication
pattern but sends the values themselves: the all-gather is then bit-identical to FSDP's
default one; the reduce-scatter equals the default one up to fp32 rounding (it sums the n
contributions in rank order, two levels when hierarchical, which may differ from the
backend's order: with gloo it matched bit for bit at world 2 and differed by ~1e-7 relative
at world 4, flat or hierarchical).

Falls back to the default collective, logged once per reason: all-gathers of a mixed-dtype
(uint8) group; reductions other than SUM and AVG (e.g. PREMUL_SUM). Sizes need not divide
the block: each parameter's part is zero-padded to a multiple of it before quantizing (qgZ
likewise, over the parts of the trained parameters' gradients). Hierarchical qgZ
falls back to the one-level all-to-all (also logged once) when the group is not the whole
world in rank order with `ranks_per_node` dividing it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from engine.config import ZeroPPConfig
from engine.errors import UserError
from engine.quantize import dequantize, quantize, unpack_wire, wire_bytes

log = logging.getLogger(__name__)
_logged: set[str] = set()

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.warning("ZeRO++: %s", reason)


def hpz_kwargs(zeropp: ZeroPPConfig, world_size: int, ranks_per_node: int) -> dict:
    """The `fully_shard` kwargs for hpZ: {"reshard_after_forward": size}, a secondary
    partition over `size` consecutive ranks. The size is `zeropp.hpz` read as DeepSpeed's
    zero_hpz_partition_size (1: off), 0 standing for the ranks of one node; {} when it is 1
    or the whole world (then it is plain ZeRO-3). It must divide the world size."""
    size = ranks_per_node if zeropp.hpz == 0 else zeropp.hpz
    if size in (1, world_size):
        return {}
    if world_size % size:
        raise UserError(f"engine.zeropp.hpz={zeropp.hpz}: a partition of {size} ranks must "
                        f"divide the {world_size} ranks (1 is off)")
    return {"reshard_after_forward": size}


# (group's global ranks, ranks per node) -> (this rank's intra-node, cross-node subgroup)
_levels: dict[tuple[tuple[int, ...], int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _node_levels(group: dist.ProcessGroup, per: int) -> None:
    """Create, once per group, the subgroups of hierarchical qgZ when `group` is the world
    in rank order and `per` divides it: one per node, and one per local index (that
    index's rank on every node). new_group is collective: every rank creates every
    subgroup, in one order."""
    ranks = dist.get_process_group_ranks(group)
    key = (tuple(ranks), per)
    n_nodes = _nodes(ranks, per)
    if key in _levels or len(ranks) != dist.get_world_size() or n_nodes < 2 or any(
            r != i for i, r in enumerate(ranks)) or len(ranks) % per:
        return      # only the whole world, in rank order, of whole nodes
    me = dist.get_rank()
    intra = cross = None
    for node in range(n_nodes):
        members = ranks[node * per:(node + 1) * per]
        subgroup = dist.new_group(members)
        intra = subgroup if me in members else intra
    for local in range(per):
        members = ranks[local::per]
        subgroup = dist.new_group(members)
        cross = subgroup if me in members else cross
    _levels[key] = (intra, cross)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _nodes(ranks: Sequence[int], ranks_per_node: int | None) -> int:
    """How many nodes the global `ranks` span."""
    return 1 if ranks_per_node is None else len({r // ranks_per_node for r in ranks})


class BlockLayout(NamedTuple):
    """Where each value of a flat row [m] sits once every parameter's part of it (a
    `segment`) is padded to whole blocks, so that no block mixes two parameters: a layer
    norm's ones and a LoRA B of 1e-4 in one block would put the B on the ones' grid of
    1/127. `index` is None when the segments' blocks fall on the row's own blocks already
    (every segment but the last a multiple of the block: the common case for big models)."""
    padded: int                    # the row's length padded per segment
    index: torch.Tensor | None     # long [m]: each value's place in the padded row


_layouts: dict[tuple, BlockLayout] = {}


def block_layout(m: int, segments: Sequence[int] | None, block: int,
                 device: torch.device) -> BlockLayout:
    """The layout of a row [m] made of `segments` (their sizes, in order; None or sizes
    not adding up to m: one segment). Cached."""
    segments = tuple(segments or ()) if sum(segments or ()) == m else ()
    key = (m, segments, block, str(device))
    if key not in _layouts:
        if all(size % block == 0 for size in segments[:-1]):
            _layouts[key] = BlockLayout(_round_up(m, block), None)
        else:
            index, at = [], 0
            for size in segments:
                index.append(torch.arange(at, at + size))
                at += _round_up(size, block)
            _layouts[key] = BlockLayout(at, torch.cat(index).to(device))
    return _layouts[key]


def _quantize_rows(rows: torch.Tensor, bits: int, layout: BlockLayout,
                   block: int) -> torch.Tensor:
    """rows [k, m] float -> wire buffers uint8 [k, wire_bytes(layout.padded)]."""
    k, m = rows.shape
    if layout.index is not None:
        spread = rows.new_zeros(k, layout.padded)
        spread[:, layout.index] = rows
        rows = spread
    elif layout.padded != m:
        rows = F.pad(rows, (0, layout.padded - m))
    wire = torch.empty(k, wire_bytes(layout.padded, bits, block), dtype=torch.uint8,
                       device=rows.device)
    for row, buf in zip(rows, wire, strict=True):
        quantize(row.contiguous(), bits, block, out=buf)
    return wire


def _dequantize_rows(wire: torch.Tensor, bits: int, layout: BlockLayout, block: int,
                     out: torch.Tensor) -> torch.Tensor:
    """wire [k, wire_bytes] -> out [k, m] (the padding is dropped)."""
    m = out.size(1)
    for buf, row in zip(wire, out, strict=True):
        q = unpack_wire(buf, bits, block, layout.padded)
        if layout.index is not None:
            row.copy_(dequantize(q, out.dtype)[layout.index])
        elif layout.padded == m and row.is_contiguous():
            dequantize(q, out=row)
        else:
            row.copy_(dequantize(q, out.dtype)[:m])
    return out


class QuantizedAllGather(AllGather):
    """qwZ. input [m] (this rank's flat shard: the concatenated padded shards of the
    module's parameters, in the param dtype), output [n * m], rank i's shard at [i*m:(i+1)*m]
    (FSDP lays the input there already). Quantized: each rank sends
    wire_bytes(m padded to block) bytes; all ranks, the sender included, see the same
    dequantized values. Runs synchronously (returns None). `segments`: the sizes of the
    parameters' parts of the shard, in order, each quantized in blocks of its own
    (`block_layout`)."""

    def __init__(self, bits: int = 8, block: int = 256, *, quantize: bool = True,
                 ranks_per_node: int | None = None, segments: Sequence[int] | None = None):
        self.bits, self.block, self.quantize = bits, block, quantize
        self.ranks_per_node, self.segments = ranks_per_node, segments

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        if not self._quantized(input_tensor, group):
            return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        n, m = group.size(), input_tensor.numel()
        parts = self.segments
        if parts and m % sum(parts) == 0:   # hpZ's backward gather (after forward) holds each
            # parameter's part world/hpz times its primary shard's, in the same order
            parts = [size * (m // sum(parts)) for size in parts]
        layout = block_layout(m, _parts(m, parts, "qwZ"), self.block, input_tensor.device)
        wire = _quantize_rows(input_tensor.view(1, m), self.bits, layout, self.block)
        gathered = torch.empty(n, wire.size(1), dtype=torch.uint8, device=wire.device)
        _all_gather(gathered.view(-1), wire.view(-1), group=group)
        _dequantize_rows(gathered, self.bits, layout, self.block, output_tensor.view(n, m))
        return None

    def _quantized(self, x: torch.Tensor, group: dist.ProcessGroup) -> bool:
        if not self.quantize:
            return False
        if not x.is_floating_point():
            _log_once(f"qwZ: all-gather of a {x.dtype} buffer (parameters of mixed dtypes) "
                      "sent unquantized")
            return False
        return self.ranks_per_node is None or _nodes(dist.get_process_group_ranks(group),
                                                     self.ranks_per_node) > 1


class QuantizedReduceScatter(ReduceScatter):
    """qgZ. input [n * m] (chunk i, [i*m:(i+1)*m], is the gradient part that rank i owns),
    output [m]: SUM (or AVG: divided by n) over the ranks of their chunk for this rank.
    All-to-all of the (quantized) chunks, then an fp32 sum in rank order; two levels when
    `ranks_per_node` divides the group into whole nodes (see the module docstring).
    Bytes each rank receives, w = wire_bytes(m padded to block), quantized:
      one level:     (n-1) * w, of them (N-1) * L * w cross-node
      hierarchical:  (L-1) * N * w inside the node + (N-1) * w cross-node
    Subgroups for the hierarchical form are created at construction, a collective call:
    every rank of the world must construct it (as FSDP's wrapping is done on all ranks).
    `segments`: the sizes of the gradients' parts of a chunk, in order (the trained
    parameters'), each quantized in blocks of its own (`block_layout`)."""

    def __init__(self, bits: int = 8, block: int = 256, *, quantize: bool = True,
                 ranks_per_node: int | None = None, group: dist.ProcessGroup | None = None,
                 segments: Sequence[int] | None = None):
        self.bits, self.block, self.quantize = bits, block, quantize
        self.ranks_per_node, self.segments = ranks_per_node, segments
        if group is not None and ranks_per_node is not None:
            _node_levels(group, ranks_per_node)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> dist.Work | None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            _log_once(f"qgZ: reduction {op} is neither SUM nor AVG: plain reduce-scatter "
                      "(set_force_sum_reduction_for_comms(True) avoids PREMUL_SUM)")
            return _reduce_scatter(output_tensor, input_tensor, group=group, op=op,
                                   async_op=async_op)
        n, m = group.size(), output_tensor.numel()
        chunks = input_tensor.view(n, m)
        levels = _levels.get((tuple(dist.get_process_group_ranks(group)), self.ranks_per_node))
        if levels is None and self.ranks_per_node is not None and _nodes(
                dist.get_process_group_ranks(group), self.ranks_per_node) > 1:
            _log_once("qgZ: the group is not the whole world of whole nodes (or was not "
                      "given at construction): one-level all-to-all")
        parts = _parts(m, self.segments, "qgZ") if self.quantize else [m]
        if levels is None:
            total = self._sum_exchanged(chunks, group, parts)
        else:
            intra, cross = levels
            per, n_nodes = intra.size(), cross.size()
            # [node, local, m] -> [local, node, m]: what goes to each local peer
            by_local = chunks.view(n_nodes, per, m).transpose(0, 1).reshape(per, n_nodes * m)
            # [n_nodes * m]: a row of n_nodes chunks, whose parts never share a block
            partial = self._sum_exchanged(by_local, intra, parts * n_nodes)
            total = self._sum_exchanged(partial.view(n_nodes, m), cross, parts)
        if op == dist.ReduceOp.AVG:
            total /= n
        output_tensor.copy_(total)
        return None

    def _sum_exchanged(self, rows: torch.Tensor, group: dist.ProcessGroup,
                       segments: list[int]) -> torch.Tensor:
        """rows [k, c] (row j for the group's rank j; each row made of `segments`) -> fp32
        [c]: the sum, in rank order, of the rows the k ranks sent this rank."""
        k, c = rows.shape
        if self.quantize:
            layout = block_layout(c, segments, self.block, rows.device)
            send = _quantize_rows(rows, self.bits, layout, self.block)
        else:
            send = rows.contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=group)
        if self.quantize:
            received = _dequantize_rows(received, self.bits, layout, self.block,
                                        torch.empty(k, c, device=rows.device))
        total = received[0].float().clone()
        for row in received[1:]:
            total += row
        return total


def apply_zeropp(module: FSDPModule, zeropp: ZeroPPConfig, *,
                 ranks_per_node: int | None = None, quantize: bool = True) -> None:
    """Install qwZ / qgZ on one `fully_shard`-ed module (one parameter group: no
    `shard_placement_fn` that splits it). hpZ is not installed here: pass `hpz_kwargs` to
    `fully_shard`. A collective call when qgZ is hierarchical (it creates subgroups): call
    it on every rank, in the same module order, like `fully_shard` itself. `quantize=False`
    (tests): the same hooks, sending the values as they are."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"apply_zeropp needs a fully_shard-ed module, got "
                        f"{type(module).__name__}")
    if zeropp.qwz:
        module.set_custom_all_gather(QuantizedAllGather(
            zeropp.weight_bits, zeropp.block, quantize=quantize, ranks_per_node=ranks_per_node,
            segments=shard_segments(module)))
    if zeropp.qgz:
        group = _shard_group(module) if ranks_per_node is not None else None
        module.set_custom_reduce_scatter(QuantizedReduceScatter(
            zeropp.grad_bits, zeropp.block, quantize=quantize, ranks_per_node=ranks_per_node,
            group=group, segments=shard_segments(module, trained_only=True)))


def shard_segments(module: FSDPModule, *, trained_only: bool = False) -> list[int] | None:
    """The sizes of the parameters' parts of a rank's flat shard, in FSDP's order: the
    layout of the all-gather input, and with `trained_only` of a reduce-scatter chunk
    (gradients of the parameters that require them). None when FSDP's private state is not
    where it was (then the whole shard is cut in blocks as one)."""
    group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
    params = getattr(group, "fsdp_params", None)
    if params is None or not all(hasattr(p, "padded_sharded_param_size") for p in params):
        return None
    return [p.padded_sharded_param_size.numel() for p in params
            if p.sharded_param.requires_grad or not trained_only]


def _parts(m: int, segments: Sequence[int] | None, hook: str) -> list[int]:
    """`segments` when they make up a buffer of m values, else [m] (one part), logged once
    when they do not (a step whose gradients skip a parameter; FSDP's layout changed)."""
    if segments is not None and sum(segments) != m:
        _log_once(f"{hook}: the flat buffer of {m} values is not the parameters' parts "
                  f"({sum(segments)} values): blocks may span two parameters")
    return list(segments) if segments is not None and sum(segments) == m else [m]


def _shard_group(module: FSDPModule) -> dist.ProcessGroup | None:
    """The process group FSDP reduce-scatters over (private FSDP2 state, checked)."""
    state = module._get_fsdp_state()
    param_group = getattr(state, "_fsdp_param_group", None)
    mesh_info = getattr(param_group, "mesh_info", None)
    return getattr(mesh_info, "shard_process_group", None)
