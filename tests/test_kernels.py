"""The Triton kernels of the inference modules (engine/kernels.py) on CPU: the checks in
tests/harness/kernel_checks.py, run by pytest in a fresh process under Triton's
interpreter (which must be switched on before Triton is first imported)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.environment import child_env

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent


def test_triton_kernels_under_the_interpreter():
    """Two halves at once (the interpreter is one Python thread; the machine has 2 cores):
    the quantized decoder's checks, and the rest."""
    env = child_env(TRITON_INTERPRET="1")
    halves = [subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select,
         str(ROOT / "tests" / "harness" / "kernel_checks.py")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for select in ("quantized_base", "not quantized_base")]
    for half in halves:
        try:
            stdout, _ = half.communicate(timeout=300)
        finally:
            half.kill()
        assert half.returncode == 0, stdout[-4000:]
        assert " passed" in stdout and "skipped" not in stdout, stdout[-2000:]
