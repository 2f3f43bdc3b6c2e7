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
    env = child_env(TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "harness" / "kernel_checks.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
