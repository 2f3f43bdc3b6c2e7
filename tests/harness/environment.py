"""The environment of a child interpreter a test starts (torchrun ranks, harness scripts)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**overrides: str) -> dict[str, str]:
    """os.environ with the repo first on PYTHONPATH, keeping what was already there (a machine
    whose packages come from PYTHONPATH, such as the GPU device's, still finds them)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **overrides}
