"""The peak of live tensor bytes in a run, and what held them at the peak, on any device
(a CPU has no allocator statistics; its resident set is mostly Python and the libraries):

    python bench/tensor_peak.py OUT.json SCRIPT ARGS...

runs SCRIPT under `TensorPeak` and writes OUT.json: the peak in bytes, the bytes live at
the end, and the live storages at the peak grouped by where they were allocated (the
innermost frame outside torch, and the innermost frame of the caller's own code: this
repository's steps/ and engine/, or TRL). bench/peers.py --device cpu reports it for both
systems, the same measure for each.

Torch's MemTracker gives the peak by category (parameters, gradients, optimizer state,
activations); this gives the source line of each block held at the peak, which is what
shows a copy of the logits kept too long. It counts a storage once however many views it
has, from the op that made it (or, for tensors that came from outside the dispatcher,
such as memory-mapped safetensors, the first op that read it) until it is freed. Like
torch.cuda.max_memory_allocated it leaves out the caching allocator's slack.
"""

from __future__ import annotations

import json
import runpy
import sys
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Storages below this size are counted but not itemised (a frame walk each would cost more
# than the op); grouped as one line at the peak.
ITEMISED_BYTES = 1 << 20
# A new peak is itemised when it passes the last itemised one by this share: the itemised
# peak is within it of the true one, for a few dozen snapshots a run.
SNAPSHOT_STEP = 0.002
TORCH_DIR = str(Path(torch.__file__).parent)
OWN_CODE = (str(Path(__file__).resolve().parent.parent / "steps"),
            str(Path(__file__).resolve().parent.parent / "engine"), "/trl/")


def allocation_site() -> str:
    """'innermost frame outside torch <- innermost frame of the caller's own code'."""
    frame, inner, own = sys._getframe(2), None, None
    while frame is not None and own is None:
        name = frame.f_code.co_filename
        if not name.startswith(TORCH_DIR) and name != __file__:
            where = f"{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
            inner = inner or where
            if any(part in name for part in OWN_CODE):
                own = where
        frame = frame.f_back
    return f"{inner} <- {own}" if own and own != inner else str(inner)


class TensorPeak(TorchDispatchMode):
    """Live tensor bytes over the ops run under it: `peak`, `live`, and `at_peak`
    ({allocation site: bytes} of the storages of ITEMISED_BYTES or more at the peak, and
    'smaller storages' for the rest)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.small = 0
        self.at_peak: dict[str, int] = {}
        self._itemised_peak = 0
        self._storages: dict[int, tuple[weakref.ref, int, str | None]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for t in tree_leaves((out, args, kwargs)):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t.untyped_storage())
        if self.live > self.peak:
            self.peak = self.live
            if self.live > self._itemised_peak * (1 + SNAPSHOT_STEP):
                self._itemise()
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = storage._cdata, storage.nbytes()
        seen = self._storages.get(key)
        if seen is not None and seen[1] == nbytes:
            return
        if seen is not None:                 # resized in place (an out= op): recount it
            self._forget(key)
        site = allocation_site() if nbytes >= ITEMISED_BYTES else None
        ref = weakref.ref(storage, lambda _, key=key: self._forget(key))
        self._storages[key] = (ref, nbytes, site)
        self.live += nbytes
        self.small += nbytes if site is None else 0

    def _forget(self, key: int) -> None:
        _, nbytes, site = self._storages.pop(key, (None, 0, "gone"))
        self.live -= nbytes
        self.small -= nbytes if site is None else 0

    def _itemise(self) -> None:
        sites = Counter()
        for _, nbytes, site in self._storages.values():
            if site is not None:
                sites[site] += nbytes
        sites["smaller storages"] = self.small
        self.at_peak, self._itemised_peak = dict(sites.most_common()), self.live

    def summary(self) -> dict:
        return {"peak_bytes": self.peak, "live_bytes_at_end": self.live,
                "itemised_peak_bytes": self._itemised_peak, "at_peak": self.at_peak}


def main() -> None:
    out, script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    tracker = TensorPeak()
    try:
        with tracker:
            runpy.run_path(script, run_name="__main__")
    finally:
        Path(out).write_text(json.dumps(tracker.summary(), indent=1))


if __name__ == "__main__":
    main()
