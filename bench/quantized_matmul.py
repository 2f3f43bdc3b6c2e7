"""The weight-only quantized matmul (engine.kernels.quantized_linear) against the
bandwidth bound, beside bf16 cuBLAS on the same shapes, in one run.

For each matrix of a Llama decoder layer (QKV, output, gate+up, down; Llama 2 7B and 70B
shapes) and each row count (1, 8 and 16 rows: decode steps at batch 1, 8 and 16, the
largest presets' rollouts; 128: step 3's batch; 512: a prefill), it times, on one GPU:
  - bf16: F.linear on the bf16 weight (cuBLAS), the path of a full-precision copy;
  - int8 / int4: engine.kernels.quantized_linear on the INT8 / INT4 payload and its bf16
    scales (block 64): up to 256 rows a Triton kernel that dequantizes in registers
    (split along K where the output tiles are few; at up to 16 rows the decode kernel,
    W the wide operand), past that this one matrix dequantized by a kernel, then cuBLAS;
  - int8 / int4 tiled: the tiled kernel alone (what up to 16 rows used before the decode
    kernel), up to 256 rows;
and prints microseconds per call and the share of the bound: the bytes the call must read
(weight, scales and x) and write over the card's measured copy bandwidth. Every kernel
result is checked against x @ dequantize(W)^T first (bf16 rounding).

Each cell is timed twice. The main figure is the GPU's own time: the calls captured as one
CUDA graph and replayed, as a decode step runs them, each call on another copy of the
matrix (copies that together exceed the L2 cache twice, as each of a decode step's
matmuls reads another weight). In brackets, one call between two CUDA events, its launch
included: what an eager forward (a prefill, the training passes) pays a call. Before
2026-11-29 the table gave only the latter, and at a few rows that was mostly the launch
(tens of microseconds of Python and Triton's launcher against a few of kernel).

Run:  python bench/quantized_matmul.py                 (one GPU, about a minute)
      TRITON_INTERPRET=1 python bench/quantized_matmul.py --small --device cpu   (harness)
"""

from __future__ import annotations

import argparse
import shlex
import sys
from functools import lru_cache, partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import kernels  # noqa: E402
from engine.quantized_base import dequantize_weight, quantize_weight  # noqa: E402

# (name, in, out) per decoder layer: fused QKV (GQA 8 KV heads at 70B), output, gate+up, down
SHAPES = {
    "llama-7b": [("qkv", 4096, 3 * 4096), ("out", 4096, 4096), ("gate_up", 4096, 2 * 11008),
                 ("down", 11008, 4096)],
    "llama-70b": [("qkv", 8192, 8192 + 2 * 1024), ("out", 8192, 8192),
                  ("gate_up", 8192, 2 * 28672), ("down", 28672, 8192)],
    "small": [("qkv", 256, 384), ("down", 512, 256)],
}
BLOCK = 64
GRAPH_CALLS = 64   # calls a replayed graph holds (at least)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds per call of `fn`, each call alone between two CUDA events, its launch
    included (one warm-up call compiles)."""
    fn()
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def replayed(call, weights: tuple[torch.Tensor, ...], device: torch.device,
             repeats: int) -> float:
    """Median seconds per `call(*weights)` on the GPU alone: one CUDA graph of at least
    GRAPH_CALLS calls, round-robin over copies of `weights` that together exceed twice the
    L2 cache (so that each call reads its matrix from memory, as a decode step's do),
    replayed between two CUDA events; no launch in the time."""
    if device.type != "cuda":
        return float("nan")
    size = sum(t.numel() * t.element_size() for t in weights)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    copies = [weights] + [tuple(t.clone() for t in weights)
                          for _ in range(max(1, -(-2 * l2 // size)))]
    calls = -(-GRAPH_CALLS // len(copies)) * len(copies)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):   # warm-up outside the graph, as capture needs
        for held in copies:
            call(*held)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(*copies[i % len(copies)])
    return timed(graph.replay, device, max(3, repeats // 4)) / calls


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, 10)


@lru_cache(maxsize=1)   # the rows of one shape in a row: made once, where it runs
def shape_weights(n_in: int, n_out: int, device: torch.device) -> tuple:
    """(bf16 weight [n_out, n_in], {bits: (payload, scales)}) on `device`."""
    gen = torch.Generator(device).manual_seed(n_in + n_out)
    weight = (torch.randn(n_out, n_in, generator=gen, device=device)
              * n_in ** -0.5).to(torch.bfloat16)
    return weight, {bits: quantize_weight(weight, bits, BLOCK, torch.bfloat16)
                    for bits in (8, 4)}


def one_shape(n_in: int, n_out: int, rows: int, device: torch.device, repeats: int,
              bandwidth: float) -> list[str]:
    """One row of the table: each column's us per call (replayed; eager in brackets) and
    share of the bound, each result checked first against x @ (its weight)^T (a wrong one
    shows as WRONG with its error, and the table goes on)."""
    dense, quantized = shape_weights(n_in, n_out, device)
    gen = torch.Generator(device).manual_seed(rows)
    x = torch.randn(rows, n_in, generator=gen, device=device).to(torch.bfloat16)
    # (call on the weights, the weights, their bytes, the weight the result must match)
    columns = [(lambda w: F.linear(x, w), (dense,), dense.numel() * 2, dense)]
    for bits in (8, 4):
        payload, scales = quantized[bits]
        column = (lambda p, s: kernels.quantized_linear(x, p, s), (payload, scales),
                  payload.numel() + scales.numel() * 2, dequantize_weight(payload, scales))
        # the tiled kernel alone (the decode kernel's predecessor at <= 16 rows)
        tiled = (lambda p, s: kernels.tiled_quantized_matmul(x, p, s, None), *column[1:])
        columns += [column, tiled if rows <= kernels.FUSED_ROWS else None]
    cells = []
    for column in columns:
        if column is None:
            cells.append("-")
            continue
        call, weights, weight_bytes, used = column
        want = F.linear(x.float(), used.float())
        error = (call(*weights).float() - want).abs().max() / want.abs().max()
        if error > 2 ** -6:
            cells.append(f"WRONG ({error:.1e})")
            continue
        eager = timed(partial(call, *weights), device, repeats)
        try:
            seconds = replayed(call, weights, device, repeats)
        except RuntimeError as e:   # a capture that fails still leaves the eager figure
            print(f"{n_in}x{n_out}, {rows} rows, column {len(cells) + 1}: no graph: "
                  f"{str(e).splitlines()[0]}", file=sys.stderr)
            seconds = float("nan")
        streamed = weight_bytes + 2 * rows * (n_in + n_out)   # weights, x, y
        cells.append(f"{seconds * 1e6:>7.1f} {streamed / bandwidth / seconds:>4.0%} "
                     f"({eager * 1e6:>5.0f})")
    return cells


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", nargs="+", default=["llama-7b", "llama-70b"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 128, 512])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU harness check)")
    args = p.parse_args()
    device = torch.device(args.device)
    models = ["small"] if args.small else args.models
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"command: python {shlex.join(sys.argv)}")
    print(f"device: {name}; torch {torch.__version__}; copy {bandwidth / 1e12:.2f} TB/s; "
          f"bf16 x, scales per {BLOCK}; us per call replayed in a CUDA graph and its share "
          "of the bandwidth bound (us per call launched eagerly)")
    header = (f"{'model':<10} {'matrix':<8} {'in x out':>12} {'rows':>5} "
              + " ".join(f"{name:>20}" for name in ("bf16 cuBLAS", "int8", "int8 tiled",
                                                    "int4", "int4 tiled")))
    print(header)
    print("-" * len(header))
    for model in models:
        for matrix, n_in, n_out in SHAPES[model]:
            for rows in args.rows:
                cells = one_shape(n_in, n_out, rows, device, args.repeats, bandwidth)
                print(f"{model:<10} {matrix:<8} {f'{n_in}x{n_out}':>12} {rows:>5} "
                      + " ".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
