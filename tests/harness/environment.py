"""The environment of a child interpreter a test starts (torchrun ranks, harness scripts),
and a free port for the rendezvous of the ranks it starts."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**overrides: str) -> dict[str, str]:
    """os.environ with the repo first on PYTHONPATH, keeping what was already there (a machine
    whose packages come from PYTHONPATH, such as the GPU device's, still finds them)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **overrides}


def free_port() -> int:
    """A TCP port free on this machine now, for a rendezvous the test starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
