"""Throughput of the block-wise quantization of engine/quantize.py (prints a table).

For each input dtype (bf16, fp32) and bit width (8, 4) at one block size, `quantize` and
`dequantize` (back to the input dtype) of a flat tensor of --numel randn values:

  ms        median time of one call
  GB/s      bytes read + written per call over that time: input + payload + scales for
            quantize, payload + scales + output for dequantize (1 GB = 1e9 bytes)
  of copy   (CUDA) that rate as a fraction of the device-to-device copy bandwidth measured
            in the same run (`dst.copy_(src)` of the largest input, read + write counted):
            how close a memory-bound pass gets to what the memory delivers
  torch ms  (CUDA) the PyTorch reference's time (`quantize_reference`, the CPU path run on
            the GPU), and the speed-up of the fused Triton kernels over it

CUDA: 64 Mi values by default; each call is timed with a pair of torch.cuda.Events, the
median over --repeats calls after warm-up calls, rotating over at least 3 input buffers
that together exceed twice the L2 cache, so data streams from HBM (not a cache benchmark).
CPU: the torch path only (it is the CPU implementation), 4 Mi values, time.perf_counter.
Before timing, the fast path is checked against the reference: bit for bit on CUDA; the
round-trip error bound (scale / 2) on CPU.

Run:  python bench/quantize.py                 (CPU, about 10 s on 2 cores)
      python bench/quantize.py --device cuda   (GPU, under a minute on an H100)
Options: --numel, --block, --bits, --dtypes, --repeats (see --help).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import quantize as Q  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--numel", type=int, default=None,
                   help="values per tensor (default 64 Mi on CUDA, 4 Mi on CPU)")
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--bits", default="8,4")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls (default 100 on CUDA, 10 on CPU)")
    return p.parse_args(argv)


def median_seconds(fn, inputs: list, repeats: int, warmup: int, cuda: bool) -> float:
    """Median time of fn(inputs[i % len(inputs)]) over `repeats` calls."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    if cuda:
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(inputs[i % len(inputs)])
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for i in range(repeats):
            start = time.perf_counter()
            fn(inputs[i % len(inputs)])
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def check(x: torch.Tensor, bits: int, block: int, cuda: bool) -> None:
    """The path being timed gives the reference's bytes (CUDA), or the round trip stays
    within scale / 2 of the input (CPU, where the path is the reference)."""
    q = Q.quantize(x, bits, block)
    if cuda:
        want = Q.quantize_reference(x, bits, block)
        assert torch.equal(q.payload, want.payload) and torch.equal(q.scales, want.scales)
        assert torch.equal(Q.dequantize(q, x.dtype), Q.dequantize_reference(want, x.dtype))
    else:
        error = (Q.dequantize(q).view(-1, block) - x.float().view(-1, block)).abs()
        assert (error <= q.scales[:, None] * (0.5 + 2**-14)).all()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    device = torch.device(args.device)
    numel = args.numel or (64 if cuda else 4) * 2**20
    numel -= numel % args.block
    repeats = args.repeats or (100 if cuda else 10)
    warmup = 10 if cuda else 2
    dtypes = {name: DTYPES[name] for name in args.dtypes.split(",")}
    bits_list = [int(b) for b in args.bits.split(",")]
    torch.manual_seed(0)

    # enough buffers that one pass over them all does not fit in L2 (on CPU: 3)
    largest = numel * max(dtype.itemsize for dtype in dtypes.values())
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) \
        if cuda else 0
    n_buffers = max(3, math.ceil(2 * l2 / largest))

    copy_rate = None
    if cuda:
        sources = [torch.randn(largest // 4, device=device) for _ in range(n_buffers)]
        destination = torch.empty_like(sources[0])
        seconds = median_seconds(destination.copy_, sources, repeats, warmup, cuda)
        copy_rate = 2 * largest / seconds
        del sources, destination
        print(f"device: {torch.cuda.get_device_name(device)}; copy_ of {largest / 2**20:.0f} "
              f"MiB: {copy_rate / 1e9:.0f} GB/s (read + write)")
    else:
        print(f"device: CPU, {torch.get_num_threads()} threads; torch path")
    print(f"{numel / 2**20:.0f} Mi values, block {args.block}, median of {repeats} calls, "
          f"{n_buffers} input buffers rotated")

    header = f"{'dtype':<6}{'bits':>5}{'op':>12}{'ms':>10}{'GB/s':>9}"
    if cuda:
        header += f"{'of copy':>9}{'torch ms':>10}{'speed-up':>10}"
    print(header)
    for name, dtype in dtypes.items():
        inputs = [torch.randn(numel, device=device).to(dtype) for _ in range(n_buffers)]
        for bits in bits_list:
            check(inputs[0], bits, args.block, cuda)
            quantized = [Q.quantize(x, bits, args.block) for x in inputs]
            packed = numel * bits // 8 + 4 * (numel // args.block)
            moved = numel * dtype.itemsize + packed        # same both ways
            ops = {
                "quantize": (lambda x, b=bits: Q.quantize(x, b, args.block), inputs,
                             lambda x, b=bits: Q.quantize_reference(x, b, args.block)),
                "dequantize": (lambda q, d=dtype: Q.dequantize(q, d), quantized,
                               lambda q, d=dtype: Q.dequantize_reference(q, d)),
            }
            for op, (fast, data, reference) in ops.items():
                seconds = median_seconds(fast, data, repeats, warmup, cuda)
                line = (f"{name:<6}{bits:>5}{op:>12}{seconds * 1e3:>10.3f}"
                        f"{moved / seconds / 1e9:>9.{1 if cuda else 2}f}")
                if cuda:
                    ref = median_seconds(reference, data, max(10, repeats // 5), 3, cuda)
                    line += (f"{moved / seconds / copy_rate:>9.0%}{ref * 1e3:>10.3f}"
                             f"{ref / seconds:>9.1f}x")
                print(line, flush=True)
            del quantized
        del inputs


if __name__ == "__main__":
    main()
