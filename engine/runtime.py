"""Where the computation runs: device, dtype, seeding, and the process group when torchrun
started this process (one rank of N: gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import contextlib
import os
import random
import resource
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from engine.errors import UserError
from engine.launch import launched_by_torchrun
from engine.precision import Precision

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    dtype: torch.dtype          # compute dtype (trained weights stay fp32: engine/precision.py)
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    ranks_per_node: int = 1     # node of rank r: r // ranks_per_node (ZeRO++'s topology)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def precision(self) -> Precision:
        """Load, master, compute and reduce dtypes of every model (engine/precision.py)."""
        return Precision(compute=self.dtype)

    @property
    def distributed(self) -> bool:
        """True when torchrun started this process: models get sharded even at world 1."""
        return dist.is_available() and dist.is_initialized()

    def all_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise sum of `values` over all ranks (the tensor itself in one process)."""
        if not self.distributed or self.world_size == 1:
            return values
        values = values.detach().clone()
        dist.all_reduce(values)
        return values

    def total(self, *numbers: float) -> list[float]:
        """Sum plain numbers over the ranks: one all-reduce for several counters."""
        return self.all_sum(torch.tensor(numbers, dtype=torch.float64, device=self.device)).tolist()

    def most(self, number: int) -> int:
        """The largest of the ranks' `number`s (the number itself in one process)."""
        if not self.distributed or self.world_size == 1:
            return number
        value = torch.tensor([number], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)

    def exchange_rows(self, rows: torch.Tensor, to: torch.Tensor) -> torch.Tensor:
        """Row i of `rows` [n, ...] sent to rank `to[i]` ([n] long): returns the rows this
        rank was sent, by sender rank and in each sender's order (`rows` in one process).
        Each rank holds only what it sends and receives (all-to-all, not a gather)."""
        if not self.distributed or self.world_size == 1:
            return rows
        to = to.to(self.device)
        send = torch.bincount(to, minlength=self.world_size)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send)
        received = rows.new_empty((int(receive.sum()), *rows.shape[1:]))
        dist.all_to_all_single(received, rows[torch.sort(to, stable=True).indices].contiguous(),
                               receive.tolist(), send.tolist())
        return received

    def barrier(self) -> None:
        if self.distributed and self.world_size > 1:
            dist.barrier()


def setup_runtime(device: str = "auto", dtype: str = "auto", seed: int = 0,
                  timeout_s: float = 600, procs_per_node: int | None = None) -> Runtime:
    """Resolve `engine.device` / `engine.dtype` ("auto": CUDA + bf16 when present, else CPU
    + fp32), join the process group when launched by torchrun, and seed every generator.

    `timeout_s` bounds every collective: a rank that dies or hangs makes the others fail
    within it instead of waiting forever. Nodes are torchrun's (LOCAL_WORLD_SIZE ranks
    each) unless `procs_per_node` splits the ranks into simulated ones (CPU tests of
    ZeRO++'s node-aware collectives)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"engine.device={device}: no CUDA device here; use engine.device=cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in _DTYPES:
        raise UserError(f"engine.dtype={dtype}: unknown; use one of auto, {', '.join(_DTYPES)}")
    rank, world_size, local_rank = 0, 1, 0
    if launched_by_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                    timeout=timedelta(seconds=timeout_s))
        # groups made later without a timeout (ZeRO++'s node levels, FSDP2's hpZ mesh)
        # take c10d's default, 30 minutes on gloo: make timeout_s theirs too
        c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    elif device.startswith("cuda"):
        device = _use_cuda_device(torch.device(device))
    seed_everything(seed)
    per_node = procs_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % per_node:
        raise UserError(f"engine.procs_per_node={per_node} does not divide the {world_size} "
                        "ranks into whole nodes")
    return Runtime(device=torch.device(device), dtype=_DTYPES[dtype], rank=rank,
                   world_size=world_size, local_rank=local_rank, ranks_per_node=per_node)


def _use_cuda_device(device: torch.device) -> str:
    """Make `engine.device=cuda:N` the current device: Triton kernels, CUDA graphs and
    `torch.cuda` calls without a device run on the current one, not on their tensors'.
    Returns the device with its index ("cuda" is the current one): a tensor's device has
    one, and torch.device("cuda") != torch.device("cuda:0")."""
    if device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    if device.index >= torch.cuda.device_count():
        raise UserError(f"engine.device={device}: this machine has {torch.cuda.device_count()} "
                        f"CUDA devices (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    torch.cuda.set_device(device)
    return str(device)


def on_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` lives on `device`, a CUDA device without an index being the current
    one (a Runtime made by hand may name plain "cuda")."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return tensor.device == device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This process's generator states, for a checkpoint (tensors and lists only, so the
    file loads with weights_only=True)."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reset_memory_peak(device: torch.device) -> None:
    """Start a new peak for memory_peak: the CUDA allocator's, or the kernel's
    resident-set high-water mark of this process (Linux >= 4.0, where allowed)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def memory_peak(device: torch.device) -> int:
    """Bytes at the peak since reset_memory_peak: CUDA memory allocated by torch, or, on
    the CPU, the process's resident set (which includes Python and the libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
