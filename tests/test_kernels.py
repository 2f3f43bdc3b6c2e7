"""The Triton kernels of the inference modules (engine/kernels.py) on CPU: the checks in
tests/harness/kernel_checks.py, run by pytest in a fresh process under Triton's
interpreter (which must be switched on before Triton is first imported)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.environment import child_env

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent


def test_triton_kernels_under_the_interpreter():
    """tests/harness/kernel_checks.py with the kernels interpreted on the CPU, in one
    process: the interpreter is one Python thread, and a second process beside it took the
    core the suite's other worker runs on (two halves at once: 354 s of the suite's wall
    time; one after the other: about 210 s)."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
         "not row_offsets", str(ROOT / "tests" / "harness" / "kernel_checks.py")],   # CUDA only
        cwd=ROOT, env=child_env(TRITON_INTERPRET="1"), capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("arch", [90, 86])
def test_every_launch_compiles_for_hopper_and_fits_an_l4(arch):
    """The launches of a decode step's launchers (tests/harness/compiled_launches.py),
    compiled for sm_90 (H100, H200) and sm_86 (A10, and as much shared memory as an L4) by
    Triton's own compiler and ptxas: what the interpreter cannot show (a loop-carried value
    changing type passes it and fails here), and each within the architecture's shared
    memory (Gemma's 256-wide heads in 64-slot blocks took 138 KiB, past an L4's 99)."""
    ptxas = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia"
    if not (ptxas / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in child_env().items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "harness" /
                                                 "compiled_launches.py"), str(arch)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = {line.split()[1] for line in result.stdout.splitlines()}
    assert compiled == {"add_norm_kernel", "silu_mul_kernel", "row_seeded_sample_kernel",
                        "rope_cache_kernel", "decode_attention_kernel", "decode_matmul_kernel",
                        "finish_split_kernel", "quantized_matmul_kernel", "dequantize_kernel"}


def test_the_gpu_checks_are_not_run_with_the_suite():
    """tests/harness/*_checks.py keep the GPU visible; named beside the suite's files they
    showed it to the whole suite, whose fp32 tolerances a bf16 GPU run does not meet."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--collect-only", "tests/test_tracking.py",
                             "tests/harness/kernel_checks.py"],
                            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 4 and "apart from the suite" in result.stderr, result.stderr


def test_a_device_without_an_index_is_the_current_one(monkeypatch):
    """A Runtime made by hand with plain "cuda" (the GPU checks, bench scripts): a tensor's
    device is "cuda:0", and torch.device("cuda") != torch.device("cuda:0"), so a quantized
    base's integers looked elsewhere and were copied instead of used in place."""
    import types

    import torch

    from engine.runtime import on_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))   # no GPU here: its device
    assert on_device(on_gpu, torch.device("cuda")) and on_device(on_gpu, torch.device("cuda:0"))
    assert not on_device(on_gpu, torch.device("cuda:1"))
    assert not on_device(on_gpu, torch.device("cpu"))
