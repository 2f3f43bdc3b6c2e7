"""Run a harness's `main()` on TEST_RANKS CPU ranks forked from the harness's process.

The harness has already imported the training stack when it forks, so a rank starts at
once instead of importing it again: about 6 s of CPU per rank on a 2-core CI machine, where
start-up was most of these tests' cost. The ranks meet over gloo through the variables
torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), so the
code under test takes the same path as under torchrun; train.py's own launches, and their
failure handling, still go through torchrun (tests/test_distributed.py).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Callable

from tests.harness.environment import free_port

# transformers imports a model family on first use: import them once, before the fork
LAZY_MODULES = ("transformers.models.llama.modeling_llama", "transformers.models.opt.modeling_opt")
PR_SET_PDEATHSIG = 1


def run_ranks(main: Callable[[], None]) -> None:
    """`main()` here when TEST_RANKS is unset or 1; else on that many forked ranks. Exits
    with 1 as soon as any rank fails (the others are killed), else returns."""
    world = int(os.environ.get("TEST_RANKS", "1"))
    if world == 1:
        main()
        return
    for name in LAZY_MODULES:
        importlib.import_module(name)
    port = free_port()
    ranks = {_fork(rank, world, port, main): rank for rank in range(world)}
    while ranks:
        pid, status = os.wait()
        rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0:
            for other in ranks:
                os.kill(other, signal.SIGKILL)
            print(f"rank {rank} of {world} failed (exit {code})", file=sys.stderr, flush=True)
            sys.exit(1)


def _fork(rank: int, world: int, port: int, main: Callable[[], None]) -> int:
    pid = os.fork()
    if pid:
        return pid
    # die with the harness (a test's timeout kills only the process it started)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    code = 1
    try:
        main()
        code = 0
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the rank exits non-zero
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

