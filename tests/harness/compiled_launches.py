"""Every Triton kernel of engine/kernels.py compiled for a GPU on a machine without one.
The interpreter (tests/harness/kernel_checks.py) checks what the kernels compute but not
that they compile: a loop-carried value that changes type, or a tensor-core product of a
shape the hardware lacks, only fails in the compiler. Here the launchers run a decode
step's calls on CPU tensors with each launch recorded instead of run, and Triton compiles
exactly those launches (arguments' types, constexprs, warps, stages) for sm_90 with its
bundled ptxas: what CI can check of the GPU path without a GPU.

Run by tests/test_kernels.py in a fresh process (Triton must not be in interpreter mode):
    python tests/harness/compiled_launches.py [ARCH]      prints one line per launch
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from engine import kernels  # noqa: E402
from engine.quantized_base import quantize_weight  # noqa: E402

_POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
            torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64",
            torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def record_launches(calls) -> list[tuple[JITFunction, dict, dict]]:
    """(kernel, its arguments by name, options) of each launch `calls()` makes."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args, strict=False))   # constexprs by keyword
        named.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
        launches.append((self, named, {k: v for k, v in kwargs.items() if k in _OPTIONS}))

    original, JITFunction.run = JITFunction.run, record
    try:
        calls()
    finally:
        JITFunction.run = original
    return launches


def _signature(kernel: JITFunction, named: dict) -> tuple[dict, dict, dict]:
    """Triton's signature, constexprs and divisibility hints for these arguments, as its
    JIT would specialise them (16-byte aligned pointers, integers divisible by 16)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = named[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _POINTEE[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
            if value % 16 == 0 and param.name not in kernel.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[param.name] = "fp32"
    return signature, constexprs, attrs


def decode_step_calls(dtype: torch.dtype = torch.bfloat16) -> None:
    """One call of each launcher with a decode step's shapes (GQA, INT8 and INT4 with
    LoRA, split and unsplit along K), a tiled and a prefill projection."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    b, heads, kv_heads, d, hidden = 4, 8, 2, 128, 1024
    kernels.add_norm(randn(b, 1, hidden), randn(b, 1, hidden), randn(hidden), None, 1e-5, "rms")
    kernels.add_norm(None, randn(b, 1, hidden), randn(hidden), randn(hidden), 1e-5, "layer")
    for norm in ("gemma", "rms_fp32"):   # Gemma's (1 + w), OLMo 2's x̂ w in fp32
        kernels.add_norm(randn(b, 1, hidden), randn(b, 1, hidden), randn(hidden), None, 1e-6,
                         norm)
    kernels.silu_mul(randn(b, 1, 2 * 2816))
    logits, seeds = torch.randn(b, 32000, generator=gen), torch.arange(b)
    kernels.row_seeded_sample(logits, seeds, 3, 0.7)
    kernels.row_seeded_sample(logits, seeds, torch.tensor(3), 0.7)
    cache = randn(2, b, kv_heads, 256, d)
    cos, sin = randn(b, 1, 1, d), randn(b, 1, 1, d)
    q = kernels.rope_into_cache(randn(b, 1, (heads + 2 * kv_heads) * d), cos, sin, cache[0],
                                cache[1], torch.tensor([40]), heads, kv_heads, d, d)
    kernels.rope_into_cache(randn(b, 1, (heads + 2 * kv_heads) * d), None, None, cache[0],
                            cache[1], torch.tensor([40]), heads, kv_heads, d, 0, d ** -0.5)
    valid = torch.ones(b, 256, dtype=torch.bool)
    kernels.decode_attention(q, cache[0], cache[1], valid, torch.tensor([40]), d ** -0.5)
    for wide in (randn, lambda *shape: randn(*shape).float()):   # Gemma's 256-wide heads
        cache = wide(2, b, kv_heads, 256, 256)
        kernels.decode_attention(wide(b, heads, 1, 256), cache[0], cache[1], valid,
                                 torch.tensor([40]), 256 ** -0.5)
        kernels.decode_attention(wide(b, heads, 1, 256), cache[0], cache[1], valid,   # Gemma 2
                                 torch.tensor([40]), 256 ** -0.5, window=16, softcap=50.0)
    for bits in (8, 4):
        parts = [quantize_weight(randn(3 * hidden, hidden).float(), bits, 64, dtype)]
        lora = kernels.LowRank(randn(8, hidden), randn(3 * hidden, 8))
        for rows in (1, 16, 64, 300):   # decode (split along K at 1), tiled, prefill
            kernels.quantized_projection(randn(rows, hidden), parts, randn(3 * hidden), lora)


# shared memory a block may have, by compute capability (A100: 163 KiB; A10, L4, L40S, RTX
# 30/40: 99 KiB; H100, H200: 227 KiB)
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def main() -> None:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    seen = set()
    for kernel, named, options in record_launches(decode_step_calls):
        signature, constexprs, attrs = _signature(kernel, named)
        key = repr((kernel.__name__, signature, constexprs, attrs, options))
        if key in seen:
            continue
        seen.add(key)
        compiled = compile(ASTSource(kernel, signature, constexprs, attrs),
                           target=GPUTarget("cuda", arch, 32), options=options)
        shared = compiled.metadata.shared
        print(f"sm_{arch} {kernel.__name__} {len(compiled.asm['cubin'])} bytes, {shared} "
              f"shared {constexprs}", flush=True)
        if shared > SHARED_LIMIT.get(arch, shared):
            raise SystemExit(f"{kernel.__name__} {constexprs}: {shared} bytes of shared "
                             f"memory, over sm_{arch}'s {SHARED_LIMIT[arch]}")


if __name__ == "__main__":
    main()
