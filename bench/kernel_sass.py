"""The quantized matmul kernels' main loops, compiled for a GPU on any machine (no GPU
needed): Triton builds each kernel for the target as its JIT would for a decode step
(bf16 x, INT8 or INT4 W, block 64, the launcher's tiles; pointers and sizes divisible by 16),
cuobjdump disassembles it, and this counts the instructions of the main loop (the
largest backward branch). Printed per kernel: a thread's instructions per iteration,
the bytes of W an iteration reads, instructions per byte of W over the whole program,
the kinds that matter (global and shared loads, tensor-core ops, int-to-float
conversions), and the ceiling that issuing puts on the rate W streams at: one warp
instruction per scheduler per clock, 4 schedulers an SM, and at most 16 conversions
(I2F, F2I, F2F) a clock an SM, against the card's bandwidth. A ceiling, not a timing:
latency and memory stalls come on top.

Run:  python bench/kernel_sass.py              (sm_90: H100/H200)
      python bench/kernel_sass.py --arch 80    (A100)
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import kernels  # noqa: E402
from engine import triton_kernels as tk  # noqa: E402

CARDS = {90: ("H200", 132, 1.98e9, 4.8e12), 80: ("A100-80G", 108, 1.41e9, 2.0e12)}
DIVISIBLE = {"x_ptr", "xp_ptr", "payload_ptr", "words_ptr", "scales_ptr", "bias_ptr", "out_ptr",
             "u_ptr", "b_ptr", "N", "K", "x_stride", "row_bytes", "row_words", "groups", "block",
             "k_per_split", "out_stride"}


K, BLOCK = 8192, 64   # a Llama-70B row; the quantized base's default block


def tiled(bits: int) -> tuple:
    payload = torch.empty(1, K * bits // 8, dtype=torch.int8 if bits == 8 else torch.uint8)
    tiles = kernels._tiles(payload, torch.empty(1, K // BLOCK, dtype=torch.bfloat16),
                           wide=False)
    constexprs = dict(BITS=bits, FP32_DOT=False, POW2_GROUP=True, CHUNK=tiles.chunk,
                      FINAL=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=tiles.block_n,
                      BLOCK_K=tiles.block_k)
    pointers = dict(x_ptr="*bf16", payload_ptr="*i8" if bits == 8 else "*u8",
                    scales_ptr="*bf16", bias_ptr="*bf16", out_ptr="*fp32")
    return (tk.quantized_matmul_kernel, pointers, constexprs,
            tiles.block_n * tiles.block_k * bits // 8)


def decode(bits: int) -> tuple:
    magic, offset = kernels._MAGIC[torch.bfloat16]
    words, block_n = kernels._WORDS, kernels._DECODE_OUTPUTS
    constexprs = dict(BITS=bits, MAGIC=magic, OFFSET=offset, FP32_DOT=False, FINAL=False,
                      HAS_BIAS=False, RANK=0, BLOCK_M=kernels.DECODE_ROWS, BLOCK_N=block_n,
                      WORDS=words, G=max(1, 32 // bits * words // BLOCK))
    pointers = dict(xp_ptr="*bf16", words_ptr="*i32", scales_ptr="*bf16", bias_ptr="*bf16",
                    u_ptr="*bf16", b_ptr="*bf16", out_ptr="*fp32")
    return tk.decode_matmul_kernel, pointers, constexprs, block_n * words * 4


def sass(fn, pointers: dict, constexprs: dict, arch: int, warps: int) -> str:
    signature = {name: pointers.get(name, "constexpr" if name in constexprs else "i32")
                 for name in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in DIVISIBLE if a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": 3})
    cubin = Path("/tmp") / f"{fn.__name__}-sm{arch}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


def main_loop(listing: str) -> list[str]:
    """The opcodes of the largest loop: from a backward branch's target to the branch."""
    code = [(int(m[1], 16), m[2], m[3]) for m in re.finditer(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", listing)]
    loops = [(int(t[1], 16), at) for at, op, rest in code if op.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t[1], 16) < at]
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    return [op for at, op, _ in code if start <= at <= end]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, choices=sorted(CARDS))
    args = p.parse_args()
    card, sms, clock, bandwidth = CARDS[args.arch]
    print(f"command: python {' '.join(sys.argv)}")
    print(f"triton {triton.__version__}, sm_{args.arch}; ceiling: {card}, {sms} SMs x 4 "
          f"schedulers x {clock / 1e9:.2f} GHz against {bandwidth / 1e12:.1f} TB/s")
    header = (f"{'kernel':<40} {'warps':>5} {'W B/iter':>8} {'instr/iter':>10} {'instr/B':>7} "
              f"{'LDG':>4} {'LDGSTS':>6} {'LDS':>4} {'MMA':>4} {'I2F':>4} {'ceiling':>8}")
    print(header)
    print("-" * len(header))
    for name, build, bits in (("quantized_matmul_kernel (tiled)", tiled, 8),
                              ("decode_matmul_kernel", decode, 8),
                              ("quantized_matmul_kernel (tiled)", tiled, 4),
                              ("decode_matmul_kernel", decode, 4)):
        fn, pointers, constexprs, w_bytes = build(bits)
        name = f"{name}, INT{bits}"
        warps = 4
        ops = main_loop(sass(fn, pointers, constexprs, args.arch, warps))
        kinds = collections.Counter(op.split(".")[0] for op in ops)
        per_byte = len(ops) * 32 * warps / w_bytes
        conversions = sum(kinds[k] for k in ("I2F", "F2I", "F2F")) * 32 * warps / w_bytes
        ceiling = min(sms * 4 * clock * 32 / per_byte,   # issue: a warp a scheduler a clock
                      sms * 16 * clock / max(conversions, 1e-9)) / bandwidth   # 16 cvt/clk/SM
        print(f"{name:<40} {warps:>5} {w_bytes:>8} {len(ops):>10} {per_byte:>7.1f} "
              f"{kinds['LDG']:>4} {kinds['LDGSTS']:>6} {kinds['LDS'] + kinds['LDSM']:>4} "
              f"{kinds['HMMA'] + kinds['HGMMA']:>4} {kinds['I2F']:>4} {ceiling:>8.0%}")


if __name__ == "__main__":
    main()
