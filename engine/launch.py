"""Starting several processes: torchrun (torch.distributed.run), called in-process, with
its own rendezvous flags. No launcher of our own: a user with a cluster can equally run
`torchrun ... train.py ...` on every node, or any launcher that sets torchrun's variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.errors import UserError

# Exit code of a rank that stopped because another one failed (a collective broke or timed
# out), so the launcher can name the rank that failed first in fact, not the first to exit.
PEER_LOST_EXIT = 3
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting",
              "timed out", "Broken pipe")


class Stopped(BaseException):
    """A signal stopped the run: a kill or a scheduler's preemption (SIGTERM), a closed
    terminal (SIGHUP), or, from torchrun, Ctrl-C too. A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def signals_stop_the_run() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Stopped in the block, as SIGINT raises KeyboardInterrupt, so
    that a killed or preempted run can say what it keeps instead of vanishing mid-line; the
    handlers before are restored after. Only where a signal has its default action: one
    ignored (SIGHUP under nohup) or handled by the caller stays so. Outside the main thread
    (where signal.signal cannot be called) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(signum) is signal.SIG_DFL}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def lost_peer(err: BaseException) -> bool:
    """Whether `err` is a collective failing because another rank died or hung."""
    import torch.distributed as dist

    return isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and any(s in str(err) for s in _PEER_LOST))


def stop_with_launcher() -> None:
    """Have the kernel stop this rank (SIGTERM) when the process that started it dies.
    torchrun starts ranks in sessions of their own, so a launcher killed outright (SIGKILL,
    the OOM killer) left them training on, racing a rerun for the same output directory.
    Linux only (prctl's PR_SET_PDEATHSIG); elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:   # the launcher died before the call
        os._exit(1)


def record_error(message: str, error: str) -> None:
    """Leave this rank's one-line error (`message`, naming the rank; `error`, as every rank
    meeting it words it) in the file torchrun names for it, which its launcher reads back
    (run_torchrun): a rank other than 0 prints nothing itself, so that an error every rank
    meets is printed once, by rank 0."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": message, "error": error,
                                          "timestamp": int(time.time())}))


@dataclass(frozen=True)
class Launch:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    standalone: bool = True         # one node: a free local port, no fixed rendezvous


def read_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed's hostfile format: one `hostname slots=N` per line; # starts a comment."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise UserError(f"--hostfile {path}: cannot read it ({err.strerror})") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = [p.removeprefix("slots=") for p in parts[1:] if p.startswith("slots=")]
        if len(parts) != 2 or len(slots) != 1 or not slots[0].isdigit() or int(slots[0]) < 1:
            raise UserError(f"--hostfile {path}, line {number}: expected `hostname slots=N`, "
                            f"got {line!r}")
        hosts.append((parts[0], int(slots[0])))
    if not hosts:
        raise UserError(f"--hostfile {path}: lists no hosts")
    return hosts


def from_hostfile(path: str, node_rank: int | None, master_port: int) -> Launch:
    """Nodes, master and processes per node from a hostfile; this node's rank is its
    position in the file unless given."""
    hosts = read_hostfile(path)
    slots = {n for _, n in hosts}
    if len(slots) != 1:
        raise UserError(f"--hostfile {path}: every host needs the same slots=N (torchrun "
                        "starts the same number of processes on each node)")
    if node_rank is None:
        names = {socket.gethostname(), socket.getfqdn(), "localhost"}
        matches = [i for i, (host, _) in enumerate(hosts) if host in names]
        if len(matches) != 1:
            raise UserError(f"--hostfile {path}: this machine ({socket.gethostname()}) is not "
                            "listed once; pass --node-rank")
        node_rank = matches[0]
    if node_rank >= len(hosts):
        raise UserError(f"--node-rank {node_rank}: --hostfile {path} lists {len(hosts)} "
                        f"nodes, ranked 0 to {len(hosts) - 1}")
    return Launch(nproc_per_node=slots.pop(), nnodes=len(hosts), node_rank=node_rank,
                  master_addr=hosts[0][0], master_port=master_port, standalone=False)


def torchrun_args(launch: Launch, script: str, script_args: list[str]) -> list[str]:
    args = [f"--nproc-per-node={launch.nproc_per_node}", "--max-restarts=0"]
    if launch.standalone:
        args.append("--standalone")
    else:
        args += [f"--nnodes={launch.nnodes}", f"--node-rank={launch.node_rank}",
                 f"--master-addr={launch.master_addr}", f"--master-port={launch.master_port}"]
    return [*args, script, *script_args]


def run_torchrun(launch: Launch, script: str, script_args: list[str]) -> int:
    """Run `script` on every process of this node; returns 0, or the exit code of the rank
    that failed first (2: a user error, else 1) after saying which one it was and, if that
    rank did not print it (only rank 0 prints a user error), its error."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun would otherwise pin every worker to one thread, with a banner saying so
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // launch.nproc_per_node)))
    args = get_args_parser().parse_args(torchrun_args(launch, script, script_args))
    # its "failed (exitcode: 2) local_rank: 0 ..." and "Received 2 death signal" log lines
    # say less than our one line; several of its loggers set a level of their own
    elastic = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name.split(".")[:3] == ["torch", "distributed", "elastic"]]
    levels = [logger.level for logger in elastic]
    for logger in elastic:
        logger.setLevel(logging.CRITICAL)
    try:
        run(args)
    except ChildFailedError as err:
        # a rank that lost its peers exits after the one that failed, but may be seen first
        culprits = {r: f for r, f in err.failures.items() if f.exitcode != PEER_LOST_EXIT}
        rank, failure = min((culprits or err.failures).items(), key=lambda rf: rf[1].timestamp)
        how = f"exit code {failure.exitcode}" if failure.exitcode > 0 else \
            f"killed by signal {-failure.exitcode}"
        # record_error's, unless rank 0 printed the same error (every rank met it, and
        # another was only the first to exit)
        said_by_0 = err.failures[0].error_file_data.get("error") if 0 in err.failures else None
        if "timestamp" in failure.error_file_data and rank != 0 and \
                failure.error_file_data.get("error") != said_by_0:
            print(failure.message, file=sys.stderr)
        ranks = launch.nproc_per_node * launch.nnodes
        print(f"{Path(script).name}: rank {rank} failed ({how})"
              f"{'; its error is printed above' if failure.exitcode > 0 else ''}"
              + (f"; all {ranks} ranks stopped" if ranks > 1 else ""), file=sys.stderr)
        return 2 if failure.exitcode == 2 else 1
    except SignalException as err:   # Ctrl-C or a kill of the launcher; torchrun stopped the ranks
        raise Stopped(err.sigval) from None
    finally:
        for logger, level in zip(elastic, levels, strict=True):
            logger.setLevel(level)
    return 0
