"""Periodic checkpoints of a running step, sharded with torch.distributed.checkpoint (DCP):
every rank writes its own shards of models and optimizers; plain state (counters, data
position, schedules) goes to state.json and each rank's RNG state to rng-rank<r>.pt.

A checkpoint is written under a temporary name and renamed once every rank has finished,
so `latest()` only ever sees complete ones; a killed save leaves a `.tmp` directory that
the next save removes. DCP reshards on load, so a run may resume on another world size
(only the per-rank RNG states are then left behind, with a warning).
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.errors import NonFiniteError, UserError

# DCP and engine.runtime (DTensor, FSDP: about 1 s to import) are imported where a
# checkpoint is written or read: the launcher's process only looks for complete ones.
if TYPE_CHECKING:
    from engine.runtime import Runtime

_PREFIX = "step-"


class Checkpointer:
    def __init__(self, directory: Path, rt: Runtime, *, every: int, keep: int = 1):
        self.directory = Path(directory) / "checkpoints"
        self.rt, self.every, self.keep = rt, every, max(keep, 1)

    def due(self, count: int) -> bool:
        return self.every > 0 and count > 0 and count % self.every == 0

    def complete(self) -> list[Path]:
        return complete_checkpoints(self.directory.parent)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, tag: int, stateful: dict[str, Any], state: dict) -> Path:
        """Write models/optimizers (`stateful`: objects with state_dict/load_state_dict)
        and the plain `state`; collective: every rank calls it. Refuses (NonFiniteError)
        state holding NaN or inf, before anything is written."""
        import torch.distributed.checkpoint as dcp

        from engine.runtime import rng_state

        final = self.directory / f"{_PREFIX}{tag:08d}"
        require_finite(_tensors([obj.state_dict() for obj in stateful.values()]), self.rt,
                       f"checkpoint {final}")
        tmp = self.directory / f".{final.name}.tmp"
        if self.rt.is_main:
            for stale in self.directory.glob(".*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.rt.barrier()
        with warnings.catch_warnings():  # DCP warns that one process saves alone
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
            dcp.save(stateful, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng-rank{self.rt.rank}.pt")
        self.rt.barrier()
        if self.rt.is_main:
            payload = {**state, "world_size": self.rt.world_size}
            (tmp / "state.json").write_text(json.dumps(payload, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in self.complete()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.rt.barrier()
        return final

    def load(self, stateful: dict[str, Any]) -> dict | None:
        """Load the latest checkpoint into `stateful` in place; returns its plain state, or
        None when there is none. Collective."""
        import torch.distributed.checkpoint as dcp

        from engine.runtime import set_rng_state

        path = self.latest()
        if path is None:
            return None
        rng = path / f"rng-rank{self.rt.rank}.pt"
        try:
            state = json.loads((path / "state.json").read_text())
            if not (path / ".metadata").is_file():   # else DCP prints tracebacks, then fails
                raise FileNotFoundError(f"no {path / '.metadata'}")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled")
                dcp.load(stateful, storage_reader=_checked_reader(path),
                         planner=_weights_only_planner())
            same_world = state["world_size"] == self.rt.world_size
            if same_world and rng.exists():
                set_rng_state(torch.load(rng, weights_only=True))
        except (Exception, dcp.CheckpointException) as err:   # damaged, or other settings
            raise UserError(f"checkpoint {path} cannot be loaded ({_first_line(err)}): "
                            "it is damaged or was written with other model settings; delete "
                            "it to resume from an earlier one, or pass resume=false to start "
                            "the step afresh") from None
        if not same_world and self.rt.is_main:
            print(f"note: checkpoint {path} was written by {state['world_size']} ranks; "
                  f"resuming on {self.rt.world_size} with fresh RNG states", flush=True)
        return state

    def clear(self) -> None:
        """Drop the checkpoints (once the step's final model is written). Collective."""
        self.rt.barrier()
        if self.rt.is_main:
            shutil.rmtree(self.directory, ignore_errors=True)


# What a checkpoint's pickles may name: DCP's own metadata classes, torch's dtypes and
# sizes, paths. DCP unpickles .metadata with pickle.load and its non-tensor entries (the
# optimizers' param_groups) with torch.load(weights_only=False), so a crafted checkpoint
# would run code on resume; these readers refuse anything else.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",
                     "torch.distributed.checkpoint.filesystem")
_METADATA_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                   ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                   ("collections", "OrderedDict")}


def _metadata_unpickler(file):
    import pickle

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            found = super().find_class(module, name)
            if ((module in _METADATA_MODULES and isinstance(found, type))
                    or (module, name) in _METADATA_NAMES
                    or (module == "torch" and isinstance(found, torch.dtype))):
                return found
            raise pickle.UnpicklingError(f".metadata names {module}.{name}, which a "
                                         "checkpoint's metadata never holds")

    return MetadataUnpickler(file)


def _checked_reader(path: Path):
    """DCP's file reader, its .metadata unpickled by `_metadata_unpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            with open(path / ".metadata", "rb") as file:
                metadata = _metadata_unpickler(file).load()
            if not isinstance(metadata, Metadata):
                raise TypeError(f".metadata holds a {type(metadata).__name__}, not DCP's Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return CheckedReader(str(path))


def _weights_only_planner():
    """DCP's load planner, its non-tensor entries read with torch.load(weights_only=True)
    (then handed to DCP's own placement as a buffer holding only what that allowed)."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            checked = io.BytesIO()
            torch.save(torch.load(value, weights_only=True), checked)
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return WeightsOnlyPlanner()


def _first_line(err: BaseException) -> str:
    """What went wrong, in a line: DCP wraps each rank's error in a CheckpointException
    (a BaseException) whose own text is a traceback."""
    failures = getattr(err, "failures", None)
    if failures:   # rank -> (its exception, its traceback)
        err = next(iter(failures.values()))[0]
    text = str(err).strip()
    return type(err).__name__ + (f": {text.splitlines()[0][:200]}" if text else "")


class Tensors:
    """A dict of tensors (e.g. EMA weights) as a DCP `Stateful`."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in state.items():
                if value is not self.tensors[name]:
                    self.tensors[name].copy_(value)


def complete_checkpoints(step_dir: Path) -> list[Path]:
    """The complete checkpoints under a step's directory, oldest first."""
    done = [p for p in (Path(step_dir) / "checkpoints").glob(f"{_PREFIX}*")
            if (p / "state.json").exists()]
    return sorted(done, key=lambda p: int(p.name.removeprefix(_PREFIX)))


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors in a nested state dict (lists, dicts, tensors and plain values)."""
    if torch.is_tensor(state):
        yield state
    elif isinstance(state, dict | list | tuple):
        for value in state.values() if isinstance(state, dict) else state:
            yield from _tensors(value)


def require_finite(tensors: Iterable[torch.Tensor], rt: Runtime, what: str) -> None:
    """Raise NonFiniteError unless every floating-point value of `tensors` (this rank's
    shards of them) is finite on every rank. Collective."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    counts = [(~torch.isfinite(t.detach())).sum().to(rt.device, torch.float64) for t in local
              if t.is_floating_point() and t.numel()]   # summed on the device: one sync
    bad = int(rt.all_sum(torch.stack(counts).sum() if counts
                         else torch.zeros((), dtype=torch.float64, device=rt.device)))
    if bad:
        raise NonFiniteError(f"{what}: {bad} values are NaN or inf; nothing was written "
                             "(the last good checkpoint and model stay as they were)")
