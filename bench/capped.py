"""Run a script with the CUDA caching allocator capped at a number of GiB, as on a card
with less memory: `python bench/capped.py GIB SCRIPT ARGS...` (bench/largest.py
--memory-gib runs train.py so, to show on an H200 what fits an 80 GB H100). Past the cap
an allocation raises torch's out-of-memory error, as the smaller card would. The CUDA
context and libraries' own memory lie outside the allocator: leave room for them (about
2-3 GiB of an H100's 79.2 GiB)."""

from __future__ import annotations

import runpy
import sys

import torch


def main() -> None:
    gib, script, *args = sys.argv[1:]
    total = torch.cuda.get_device_properties(0).total_memory
    cap = float(gib) * 2**30
    if cap > total:
        raise SystemExit(f"bench/capped.py: the cap {gib} GiB exceeds this card's "
                         f"{total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
