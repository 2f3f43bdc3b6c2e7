"""Block-wise quantization (engine/quantize.py): hand-computed cases, the round-trip error
bound, packing and the wire format on the PyTorch path; and the Triton kernels against it,
bit for bit, under Triton's interpreter in a fresh process (tests/harness/quantize_checks.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import quantize as Q
from tests.harness.environment import child_env

ROOT = Path(__file__).resolve().parent.parent


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


def test_hand_computed_8_bits():
    q = Q.quantize(torch.tensor([1.0, -2.0, 0.5, 4.0]), bits=8, block=4)
    # scale 4/127; x * 127/4 = 31.75, -63.5, 15.875, 127: -63.5 is a tie, rounded to even
    assert q.payload.dtype == torch.int8 and q.payload.tolist() == [32, -64, 16, 127]
    assert torch.equal(q.scales, (_f32(4) / _f32(127)).view(1))
    assert (q.bits, q.block, q.numel) == (8, 4, 4)
    want = torch.tensor([32.0, -64.0, 16.0, 127.0]) * (_f32(4) / _f32(127))
    assert torch.equal(Q.dequantize(q), want)


def test_hand_computed_4_bits():
    q = Q.quantize(torch.tensor([1.0, -2.0, 0.5, 4.0]), bits=4, block=4)
    # scale 4/7; x * 7/4 = 1.75, -3.5, 0.875, 7 -> 2, -4, 1, 7; nibbles q + 8 = 10, 4, 9, 15;
    # byte i = value 2i (low nibble) | value 2i+1 (high nibble)
    assert q.payload.dtype == torch.uint8 and q.payload.tolist() == [0x4A, 0xF9]
    assert torch.equal(q.scales, (_f32(4) / _f32(7)).view(1))
    want = torch.tensor([2.0, -4.0, 1.0, 7.0]) * (_f32(4) / _f32(7))
    assert torch.equal(Q.dequantize(q), want)


def _varied(n_blocks: int, block: int, seed: int = 0) -> torch.Tensor:
    """randn with block magnitudes spread from 1e-3 to 1e3."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, block, generator=gen)
    return (x * 10 ** (6 * torch.rand(n_blocks, 1, generator=gen) - 3)).view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [2, 32, 96, 256, 2048])
def test_round_trip_error_is_at_most_half_a_step(dtype, bits, block):
    x = _varied(max(8, 32768 // block), block).to(dtype)
    q = Q.quantize(x, bits, block)
    qmax = Q.QMAX[bits]
    blocks = x.float().view(-1, block)
    torch.testing.assert_close(q.scales, blocks.abs().amax(1) / qmax, rtol=2**-23, atol=0)
    ints = Q._integers(q).view(-1, block)
    assert ints.abs().amax(1).eq(qmax).all()       # each block's absmax maps to +-qmax
    error = (Q.dequantize(q).view(-1, block) - blocks).abs()
    step = q.scales[:, None]
    # scale / 2, plus fp32 rounding (at most qmax * 2^-22 of a step, below 2^-14)
    assert (error <= step * (0.5 + 2**-14)).all()
    assert (error / step).max() > 0.45          # and the bound is not loose
    # bf16 out: the same values, rounded to bf16
    assert torch.equal(Q.dequantize(q, torch.bfloat16), Q.dequantize(q).to(torch.bfloat16))


def test_bf16_input_quantizes_as_its_fp32_values():
    x = _varied(16, 64, seed=1).to(torch.bfloat16)
    for bits in (8, 4):
        got, want = Q.quantize(x, bits, 64), Q.quantize(x.float(), bits, 64)
        assert torch.equal(got.payload, want.payload) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("bits, zero_byte", [(8, 0), (4, 0x88)])
def test_zero_block_has_scale_zero_and_no_nan(bits, zero_byte):
    x = torch.cat([torch.zeros(8), torch.arange(1.0, 9.0), torch.zeros(8)])
    q = Q.quantize(x, bits, 8)
    assert q.scales[0] == 0 and q.scales[2] == 0 and q.scales[1] > 0
    first_block_bytes = 8 * bits // 8
    assert q.payload.view(torch.uint8)[:first_block_bytes].eq(zero_byte).all()
    values = Q.dequantize(q)
    assert not values.isnan().any() and values[:8].eq(0).all() and values[16:].eq(0).all()
    assert Q.dequantize(Q.quantize(torch.zeros(16), bits, 8)).eq(0).all()


def test_4_bit_packing_round_trip():
    # every value -7..7 at both nibble positions; each block holds a 7, so scale is 1
    ints = torch.arange(-7, 8).repeat_interleave(2)
    ints = torch.cat([ints, ints.roll(1)]).float()        # 60 values, blocks of 30
    ints[0::30] = 7.0
    q = Q.quantize(ints, 4, 30)
    assert q.scales.tolist() == [1.0, 1.0] and q.payload.numel() == 30
    lo, hi = q.payload & 15, q.payload >> 4
    assert torch.equal(lo.float() - 8, ints[0::2]) and torch.equal(hi.float() - 8, ints[1::2])
    assert torch.equal(Q.dequantize(q), ints)


def test_wire_layout_and_round_trip():
    assert Q.wire_bytes(1024, 8, 256) == 1024 + 16           # payload | 4 scales + pad
    assert Q.wire_bytes(1024, 4, 256) == 512 + 16
    assert Q.wire_bytes(20, 8, 4) == 32 + 32                 # 20 -> 32 | 20 bytes -> 32
    for bits in (8, 4):
        x = _varied(5, 4, seed=2)
        q = Q.quantize(x, bits, 4)
        buf = Q.pack_wire(q)
        assert buf.dtype == torch.uint8 and buf.numel() == Q.wire_bytes(20, bits, 4)
        back = Q.unpack_wire(buf, bits, 4, 20)
        assert back.payload.dtype == q.payload.dtype
        assert torch.equal(back.payload, q.payload) and torch.equal(back.scales, q.scales)
        assert torch.equal(Q.dequantize(back), Q.dequantize(q))
        # quantize(out=) writes the same bytes straight into a wire buffer
        out = torch.full_like(buf, 255)
        assert Q.quantize(x, bits, 4, out=out).payload.data_ptr() == out.data_ptr()
        assert torch.equal(out, buf)
        # buffers end to end (an all-gather's output) unpack in place, scales aligned
        gathered = torch.cat([buf, out])
        second = Q.unpack_wire(gathered[buf.numel():], bits, 4, 20)
        assert second.scales.data_ptr() > gathered.data_ptr()
        assert torch.equal(Q.dequantize(second), Q.dequantize(q))
        # and a misaligned buffer still unpacks (its scales copied)
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), buf])[1:]
        assert torch.equal(Q.dequantize(Q.unpack_wire(shifted, bits, 4, 20)), Q.dequantize(q))
        # but is refused for writing: its scales would have gone into that copy, not `out`
        with pytest.raises(ValueError, match="4-byte aligned"):
            Q.quantize(x, bits, 4, out=shifted)


def test_dequantize_into_out():
    q = Q.quantize(_varied(4, 16), 8, 16)
    out = torch.empty(64, dtype=torch.bfloat16)
    assert Q.dequantize(q, out=out) is out
    assert torch.equal(out, Q.dequantize(q, torch.bfloat16))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="not a multiple of the block size 256: pad"):
        Q.quantize(torch.randn(1000), 8, 256)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        Q.quantize(torch.randn(16), 2, 8)
    with pytest.raises(ValueError, match="even for 4 bits"):
        Q.quantize(torch.randn(15), 4, 5)
    with pytest.raises(ValueError, match="flat contiguous float"):
        Q.quantize(torch.randn(4, 8), 8, 8)
    with pytest.raises(ValueError, match="flat contiguous float"):
        Q.quantize(torch.arange(16), 8, 8)
    with pytest.raises(ValueError, match="uint8 buffer of 32 bytes"):
        Q.unpack_wire(torch.zeros(40, dtype=torch.uint8), 8, 8, 16)
    with pytest.raises(ValueError, match="flat contiguous tensor of 16"):
        Q.dequantize(Q.quantize(torch.randn(16), 8, 8), out=torch.empty(8))


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = child_env(TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "harness" / "quantize_checks.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout, result.stdout[-2000:]
    # the only check skipped on CPU is the one about dispatching on CUDA
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert all("for CUDA" in line for line in skips), result.stdout[-2000:]
