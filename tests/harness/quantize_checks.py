"""Checks of the Triton quantization kernels (engine/quantize.py) against the PyTorch
reference: on CPU under Triton's interpreter (tests/test_quantize.py runs this file with
pytest in a fresh process with TRITON_INTERPRET=1, which must be on before Triton is first
imported), or compiled on CUDA (`pytest tests/harness/quantize_checks.py` on a GPU machine).

The kernels must equal the reference bit for bit: payload, scales, and the dequantized
values in fp32 and bf16. On CUDA the reference is computed on CPU from the same input, so
the check also covers CPU and GPU ranks quantizing alike."""

from __future__ import annotations

import os

import pytest
import torch

from engine import quantize as Q

pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    pytest.skip("run through tests/test_quantize.py (needs TRITON_INTERPRET=1 from the start)",
                allow_module_level=True)


def _assert_same(got: Q.QuantizedBlocks, want: Q.QuantizedBlocks) -> None:
    assert got.payload.dtype == want.payload.dtype
    assert torch.equal(got.payload.cpu(), want.payload.cpu())
    assert torch.equal(got.scales.cpu(), want.scales.cpu())
    assert (got.bits, got.block, got.numel) == (want.bits, want.block, want.numel)


def _data(n_blocks: int, block: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """randn with block magnitudes from 1e-3 to 1e3, and one all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, block, generator=gen)
    x *= 10 ** (6 * torch.rand(n_blocks, 1, generator=gen) - 3)
    x[n_blocks // 2] = 0
    return x.view(-1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [4, 96, 256, 6000])   # 96, 6000: not powers of 2
def test_kernels_equal_the_reference_bit_for_bit(dtype, bits, block):
    # 37 blocks: more than one program, and a last program only partly filled
    x = _data(37 if block < 6000 else 3, block, dtype)
    want = Q.quantize_reference(x, bits, block)
    got = Q.quantize_triton(x.to(DEVICE), bits, block)
    _assert_same(got, want)
    assert got.scales[len(got.scales) // 2] == 0
    for out_dtype in (torch.float32, torch.bfloat16):
        values = Q.dequantize_triton(got, out_dtype)
        assert values.dtype == out_dtype
        assert torch.equal(values.cpu(), Q.dequantize_reference(want, out_dtype))


def test_ties_round_to_even():
    # absmax 127: scale 1, so x * (qmax / absmax) is x itself and .5 values are ties
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0], device=DEVICE)
    q = Q.quantize_triton(x, 8, 8)
    assert q.payload.tolist() == [0, 2, 2, 0, -2, -2, 126, 127]
    _assert_same(q, Q.quantize_reference(x.cpu(), 8, 8))


def test_dequantize_to_bf16_rounds_ties_to_even():
    # q * scale exactly halfway between two bf16 values (8 significant bits): with scale
    # 1 + 2^-8 the even neighbour is below (1), with 1 + 3 * 2^-8 above (1 + 2^-6)
    scales = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8], device=DEVICE)
    payload = torch.tensor([1, -1, 1, -1], dtype=torch.int8, device=DEVICE)
    q = Q.QuantizedBlocks(payload, scales, 8, 2, 4)
    got = Q.dequantize_triton(q, torch.bfloat16).cpu()
    assert got.float().tolist() == [1.0, -1.0, 1 + 2**-6, -(1 + 2**-6)]
    assert torch.equal(got, Q.dequantize_reference(q, torch.bfloat16).cpu())


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_into_a_wire_buffer(bits):
    x = _data(10, 96, torch.bfloat16, seed=1)
    want = Q.pack_wire(Q.quantize_reference(x, bits, 96))
    buf = torch.full((Q.wire_bytes(x.numel(), bits, 96),), 255, dtype=torch.uint8,
                     device=DEVICE)
    got = Q.quantize_triton(x.to(DEVICE), bits, 96, out=buf)
    assert torch.equal(buf.cpu(), want)         # padding zeroed too
    assert got.payload.data_ptr() == buf.data_ptr()
    out = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEVICE)
    Q.dequantize_triton(Q.unpack_wire(buf, bits, 96, x.numel()), out=out)
    assert torch.equal(out.cpu(), Q.dequantize_reference(Q.unpack_wire(want, bits, 96,
                                                                       x.numel()),
                                                          torch.bfloat16))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="dispatch to the kernels is for CUDA")
def test_quantize_and_dequantize_use_the_kernels_on_cuda(monkeypatch):
    x = _data(64, 256, torch.float32, seed=2)
    calls = []
    for name in ("quantize_triton", "dequantize_triton"):
        fn = getattr(Q, name)
        monkeypatch.setattr(Q, name, lambda *a, _fn=fn, **k: calls.append(_fn) or _fn(*a, **k))
    q = Q.quantize(x.cuda(), 4, 256)
    values = Q.dequantize(q, torch.float32)
    assert len(calls) == 2
    want = Q.quantize_reference(x, 4, 256)
    _assert_same(q, want)
    assert torch.equal(values.cpu(), Q.dequantize_reference(want))
    # the torch path on CUDA agrees with it too
    _assert_same(Q.quantize_reference(x.cuda(), 4, 256), want)
