"""Checks of the Triton kernels (engine/kernels.py) on CPU, under Triton's interpreter;
tests/test_kernels.py runs this file with pytest in a fresh process with TRITON_INTERPRET=1
(the interpreter must be on before Triton is first imported).

Each kernel equals the PyTorch formula it replaces: exactly in fp32; in bf16 to within
2 units in the last place, because the interpreter truncates to bf16 where CUDA rounds to
nearest; the fused sampler picks the same tokens. A decoder using the kernels still
generates what Hugging Face generate does, greedy and row-seeded sampled."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from engine import kernels

pytest.importorskip("triton")


# CPU tensors under the interpreter; compiled kernels on CUDA (`pytest tests/harness/
# kernel_checks.py` on a GPU machine)
if os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = torch.device("cpu")
elif torch.cuda.is_available():
    DEVICE = torch.device("cuda")
else:
    pytest.skip("run through tests/test_kernels.py (needs TRITON_INTERPRET=1 from the start)",
                allow_module_level=True)


def _prompt_batch(tok) -> dict[str, torch.Tensor]:
    """Four prompts of different lengths, left-padded, on DEVICE. Interpreted, every kernel
    program is Python and the prefill of PROMPTS[:4] (30 tokens the longest) was most of the
    decoder checks' time: there the longest of the four is 11 tokens (all fit one block of
    the decode attention's cache either way)."""
    from steps.tokenize import collate_prompts
    from tests.harness.hybrid_check import PROMPTS

    chosen = (0, 1, 3, 5) if DEVICE.type == "cpu" else (0, 1, 2, 3)
    batch = collate_prompts([tok(PROMPTS[i])["input_ids"] for i in chosen], tok.pad_token_id)
    return {k: v.to(DEVICE) for k, v in batch.items()}


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: equal to 1e-5 relative. bf16: within 2^-6 of the largest value (two bf16 steps
    of it), against the formula computed in fp32 from the same bf16 inputs: a kernel
    rounds to bf16 at most twice, where the formula does, and the interpreter truncates
    where CUDA rounds to nearest. A wrong formula is off by far more."""
    assert got.dtype == want.dtype or want.dtype == torch.float32
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        error = (got.float() - want.float()).abs().max()
        assert error <= 2 ** -6 * want.float().abs().max(), float(error)


def _fp32(*tensors):
    return [None if t is None else t.float() for t in tensors]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", ["rms", "rms_fp32", "gemma", "layer"])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_norm_equals_the_pytorch_formula(dtype, norm, with_delta):
    gen = torch.Generator().manual_seed(0)
    plus_one = norm == "gemma"
    residual = torch.randn(3, 5, 96, generator=gen).to(DEVICE, dtype)   # 96: not a power of 2
    delta = torch.randn(3, 5, 96, generator=gen).to(DEVICE, dtype) if with_delta else None
    # Gemma keeps the scale as 1 + weight, its weights near 0
    weight = ((0 if plus_one else 1) + 0.1 * torch.randn(96, generator=gen)).to(DEVICE, dtype)
    bias = (0.1 * torch.randn(96, generator=gen)).to(DEVICE, dtype) if norm == "layer" else None
    got_sum, got = kernels.add_norm(delta, residual, weight, bias, 1e-5, norm)
    total = residual if delta is None else (residual.float() + delta.float()).to(dtype)
    _assert_close(got_sum, total)            # the residual stream, rounded to its dtype
    _, want = kernels.add_norm_reference(None, *_fp32(total, weight, bias), 1e-5, norm)
    assert got.dtype == dtype
    _assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_the_pytorch_formula(dtype):
    gate_up = torch.randn(4, 1, 2 * 1300, generator=torch.Generator().manual_seed(1))
    gate_up = gate_up.to(DEVICE, dtype)
    got = kernels.silu_mul(gate_up)
    assert got.shape == (4, 1, 1300) and got.dtype == dtype
    _assert_close(got, kernels.silu_mul_reference(gate_up.float()))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="4-9 GB tensors: hours in the interpreter")
def test_row_offsets_past_2_to_the_31_are_right():
    """A 70B prefill's rows: silu_mul's 2 x 28672 values per row pass 2^31 elements at row
    37,450, add_norm's 8192 at row 262,144. int32 offsets wrapped there, reading and writing
    other tensors' memory."""
    gate_up = torch.randn(37_460, 2 * 28672, device=DEVICE, dtype=torch.bfloat16)
    _assert_close(kernels.silu_mul(gate_up)[-16:],
                  kernels.silu_mul_reference(gate_up[-16:].float()))
    del gate_up
    residual = torch.randn(262_160, 8192, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.ones(8192, device=DEVICE, dtype=torch.bfloat16)
    _, got = kernels.add_norm(None, residual, weight, None, 1e-5, "rms")
    _assert_close(got[-16:], kernels.add_norm_reference(None, residual[-16:].float(),
                                                         weight.float(), None, 1e-5, "rms")[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 256: Gemma's heads, in blocks of fewer slots (32 in bf16, 16 in fp32)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 16), (8, 2, 24), (8, 1, 64), (4, 2, 256)])
def test_decode_attention_equals_sdpa_over_the_masked_cache(dtype, heads, kv_heads, d):
    """The fused decode attention gives the decoder's SDPA path (_grouped_attention over
    the cache up to the query's slot): MHA and GQA, a head_dim that is not a power of two,
    a strided cache view and a strided Q. Rows left-padded by 0 to 90 slots (one row's
    first block wholly masked); what lies past the query's slot is never read: NaN
    there changes nothing."""
    from engine.inference_modules import _grouped_attention

    gen = torch.Generator().manual_seed(heads + d)
    b, slots, write_at = 4, 150, 130                # three blocks of 64, the last partial
    cache = torch.randn(2, 6, kv_heads, slots, d, generator=gen).to(dtype)
    cache[:, :, :, write_at + 1:] = float("nan")    # not written yet: must not be read
    keys, values = cache[0, 1:b + 1].to(DEVICE), cache[1, 1:b + 1].to(DEVICE)
    q = torch.randn(b, 1, heads, d, generator=gen).to(dtype).to(DEVICE).transpose(1, 2)
    valid = torch.zeros(b, slots + 10, dtype=torch.bool)
    for row, padding in enumerate((0, 3, 90, 17)):
        valid[row, padding:write_at + 1] = True
    valid[1, 40] = valid[3, 100] = False               # a gap (a masked slot mid-row)
    valid = valid.to(DEVICE)
    scale = d ** -0.5
    got = kernels.decode_attention(q, keys, values, valid[:, :write_at + 1],
                                   torch.tensor([write_at], device=DEVICE), scale)
    n = write_at + 1
    want = _grouped_attention(*_fp32(q, keys[:, :, :n], values[:, :, :n]),
                              valid[:, None, None, :n], scale)
    assert got.shape == (b, 1, heads * d) and got.dtype == dtype
    _assert_close(got.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(40, 0.0), (0, 0.5), (70, 0.5)])
def test_decode_attention_within_a_window_and_softcapped(dtype, window, softcap):
    """A sliding window (the mask holds it; the kernel starts its loop at the window's
    first slot, mid-block) and Gemma 2's softcapped scores: the PyTorch path's result.
    Slots before the window hold NaN, which the result never sees."""
    from engine.inference_modules import _grouped_attention, _within

    gen = torch.Generator().manual_seed(window)
    b, heads, kv_heads, d, slots, write_at = 3, 8, 2, 24, 150, 130
    cache = torch.randn(2, b, kv_heads, slots, d, generator=gen).to(dtype)
    if window:
        cache[:, :, :, :write_at + 1 - window] = float("nan")
    keys, values = cache[0].to(DEVICE), cache[1].to(DEVICE)
    q = torch.randn(b, heads, 1, d, generator=gen).to(dtype).to(DEVICE)
    valid = torch.zeros(b, 1, 1, write_at + 1, dtype=torch.bool)
    for row, padding in enumerate((0, 3, 100)):
        valid[row, ..., padding:] = True
    at = torch.tensor([write_at])
    valid = _within(valid, at, window).to(DEVICE)
    scale = d ** -0.5
    got = kernels.decode_attention(q, keys, values, valid[:, 0, 0], at.to(DEVICE), scale,
                                   window, softcap)
    n = write_at + 1
    if window:   # the reference reads only the window (NaN elsewhere would reach it)
        keys, values = keys.nan_to_num(), values.nan_to_num()
    want = _grouped_attention(*_fp32(q, keys[:, :, :n], values[:, :, :n]), valid, scale,
                              softcap)
    _assert_close(got.cpu(), want.cpu())


# one block; three of 2048, the last partial; and on a GPU a real vocabulary's (OPT's)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# all of a head, its first half, or none (OPT: no rotary embedding, Q scaled first)
@pytest.mark.parametrize("rotary_dim", [16, 8, 0])
def test_rope_into_cache_equals_the_pytorch_formula(dtype, rotary_dim):
    """The fused rotary kernel gives the decoder layer's PyTorch path's Q and writes the
    same K and V into the cache slots (a strided view of a larger cache), and nothing
    else: exactly in fp32 (each product and the sum rounded, no FMA), to the bf16
    rounding of _assert_close in bf16. GQA: 4 query heads over 2 KV heads. Without
    rotation, Q is scaled as OPT's path scales it."""
    from types import SimpleNamespace

    from engine.inference_modules import _Layer

    gen = torch.Generator().manual_seed(rotary_dim)
    b, t, heads, kv_heads, d = 3, 2, 4, 2, 16
    spec = SimpleNamespace(scale_query_first=rotary_dim == 0, head_dim=d,
                           rotary_dim=rotary_dim, scale=d ** -0.5)
    layer = SimpleNamespace(spec=spec, splits=(heads * d, kv_heads * d, kv_heads * d))
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    angles = torch.randn(b, 1, t, rotary_dim, generator=gen)
    rope = (angles.cos().to(dtype), angles.sin().to(dtype)) if rotary_dim else None
    write_at = torch.tensor([5, 6])
    caches = []
    for fused in (True, False):
        cache = torch.randn(2, 4, kv_heads, 10, d, generator=torch.Generator().manual_seed(0))
        cache = cache.to(dtype).to(DEVICE)
        keys, values = cache[0, :b], cache[1, :b]   # [b, kv_heads, 10, d], strided
        args = [x.to(DEVICE) for x in (qkv, *(rope or ()))]
        if fused:
            q = kernels.rope_into_cache(*args, *[None, None] * (rope is None), keys, values,
                                        write_at.to(DEVICE), heads, kv_heads, d, rotary_dim,
                                        d ** -0.5 if spec.scale_query_first else 1.0)
        else:
            want = _Layer._queries_into_cache(layer, args[0], tuple(args[1:]) or None, keys,
                                              values, write_at.to(DEVICE))
        caches.append(cache.cpu())
    if dtype == torch.float32:
        assert torch.equal(q.cpu(), want.cpu()) and torch.equal(caches[0], caches[1])
    else:
        _assert_close(q.cpu(), want.cpu())
        _assert_close(caches[0], caches[1])


@pytest.mark.parametrize("vocab", [1000, 5000] + ([50272] if DEVICE.type == "cuda" else []))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_seeded_sample_equals_the_pytorch_sampler(vocab, temperature):
    """The fused sampler picks the argmax of engine.generation's row-seeded Gumbel scores at
    every step (random logits: no fp32 near-ties), masked tokens never, and flags a row
    with NaN or +inf."""
    from engine.generation import _gumbel_scores
    gen = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(6, vocab, generator=gen)).to(DEVICE)
    logits[:, 1::2] = float("-inf")                   # masked tokens (top-k style)
    seeds = torch.randint(-2**62, 2**62, (6,), generator=gen).to(DEVICE)
    for step in (0, 1, 37):
        got, bad = kernels.row_seeded_sample(logits, seeds, step, temperature)
        want = _gumbel_scores(logits / temperature, seeds, step).argmax(-1)
        assert torch.equal(got, want) and not bool(bad)
        # the step read from the device (as a captured decode step passes it)
        from_memory, _ = kernels.row_seeded_sample(logits, seeds, torch.tensor(step).to(DEVICE),
                                                   temperature)
        assert torch.equal(from_memory, want)
        assert (got % 2 == 0).all()
    for poison in (float("nan"), float("inf")):
        poisoned = logits.clone()
        poisoned[4, 10] = poison
        assert bool(kernels.row_seeded_sample(poisoned, seeds, 0, temperature)[1])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt", "tiny-qwen3"])
def test_decoder_with_fused_kernels_matches_hf_generate(preset):
    from engine import decode
    from engine.config import OptimConfig
    from engine.generation import SamplingSettings, generate
    from engine.hybrid import HybridEngine
    from engine.models import byte_tokenizer
    from engine.runtime import Runtime
    from tests.harness.hybrid_check import model_with_answers_that_end

    tok = byte_tokenizer()
    model = model_with_answers_that_end(preset, 0, tok.eos_token_id).to(DEVICE)
    reference = copy.deepcopy(model)
    runtime = Runtime(DEVICE, torch.float32, 0, 1, 0)
    decoder = HybridEngine(model, OptimConfig(), 1, runtime, lr=1e-3)._gather().model
    decoder.use_fused_kernels(True)
    batch = _prompt_batch(tok)
    sampling = SamplingSettings(max_new_tokens=12, do_sample=False)
    kwargs = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    want = generate(reference, batch["input_ids"], batch["attention_mask"], sampling, **kwargs)
    got = decode.generate(decoder, batch["input_ids"], batch["attention_mask"], sampling,
                          **kwargs)
    assert torch.equal(got, want)
    if DEVICE.type == "cuda":   # the decode step captured as a CUDA graph, replayed per token
        got = decode.generate(decoder, batch["input_ids"], batch["attention_mask"], sampling,
                              **kwargs, cuda_graph=True)
        assert torch.equal(got, want)
    elif preset != "tiny-llama":   # their own parts are the norms, positions and query/key
        return                     # norms: the sampler is tested on Llama's (the interpreter
                                   # takes ~30 s more a preset for it)
    # row-seeded sampling through the fused sampler: generate's answers with its processor
    sampled = SamplingSettings(max_new_tokens=12, temperature=0.8)
    seeds = torch.tensor([11, -3, 2**40, 7], device=DEVICE)
    want = generate(reference, batch["input_ids"], batch["attention_mask"], sampled,
                    row_seeds=seeds, **kwargs)
    # static (the CUDA graph's shapes, run eagerly here): sampled inside the step, the step
    # index in memory, and the fused attention reading the filled part of the whole cache
    modes = [{}, {"static": True}] + ([{"cuda_graph": True}] if DEVICE.type == "cuda" else [])
    for mode in modes:
        got = decode.generate(decoder, batch["input_ids"], batch["attention_mask"], sampled,
                              row_seeds=seeds, **kwargs, **mode)
        assert torch.equal(got, want), mode


FAMILIES = {  # Gemma 2's softcapped attention (its decode step unfused), Gemma 3's windowed,
             # through the fused decode attention, with a local rope of its own; OLMo 3's
             # norms after attention and the MLP only, of all query and key heads together
    "gemma2": dict(head_dim=24, query_pre_attn_scalar=20, attn_logit_softcapping=0.5,
                   final_logit_softcapping=0.5, sliding_window=5),
    "gemma3_text": dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=5,
                        layer_types=["sliding_attention", "full_attention"], rope_parameters={
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
    "olmo3": dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"])}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_gemma_and_olmo_decoders_with_fused_kernels_match_hf_generate(model_type):
    """Gemma's (1 + w) norms and OLMo's in the fused add+norm kernel, sliding windows in
    the fused decode attention over the whole static cache: HF generate's greedy answers."""
    from engine import decode
    from engine.generation import SamplingSettings, generate
    from engine.inference_form import inference_form
    from engine.models import byte_tokenizer
    from tests.harness.hybrid_check import llama_kin

    tok = byte_tokenizer()
    model = llama_kin(model_type, **FAMILIES[model_type]).to(DEVICE)
    decoder = inference_form(copy.deepcopy(model), DEVICE, torch.float32).model
    decoder.use_fused_kernels(True)
    assert decoder.layers[0].fused_attention   # Gemma 2's softcap is the kernel's too
    batch = _prompt_batch(tok)
    sampling = SamplingSettings(max_new_tokens=12, do_sample=False)
    kwargs = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    want = generate(model, batch["input_ids"], batch["attention_mask"], sampling, **kwargs)
    for mode in [{"static": True}] + ([{"cuda_graph": True}] if DEVICE.type == "cuda" else []):
        got = decode.generate(decoder, batch["input_ids"], batch["attention_mask"], sampling,
                              **kwargs, **mode)
        assert torch.equal(got, want), mode


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# rows: the fused kernel at 16 rows a tile, at 64 (two tiles); cuBLAS past 256. Blocks:
# several scale groups a tile (16, 64), one a tile or (INT8) one over two tiles (256)
@pytest.mark.parametrize("rows,block", [(7, 16), (7, 256), (70, 64), (300, 64)])
def test_quantized_linear_is_the_dequantized_matmul_within_the_quantization_bound(
        bits, dtype, rows, block):
    """The kernel equals x @ dequantize(W)^T + b (to the dtype's rounding), and so differs
    from the unquantized x @ W^T + b by at most sum_k |x_k| * scale_k / 2 per output
    (each weight is within half a step of its original). Shapes: several K tiles, outputs
    not a multiple of the tile."""
    import torch.nn.functional as F

    from engine.quantized_base import dequantize_weight, quantize_weight

    gen = torch.Generator().manual_seed(bits + rows)
    n, k = 150, 512
    w = torch.randn(n, k, generator=gen)
    payload, scales = quantize_weight(w, bits, block, dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    got = kernels.quantized_linear(x.to(DEVICE), payload.to(DEVICE), scales.to(DEVICE),
                                   bias.to(DEVICE)).cpu()
    assert got.shape == (rows, n) and got.dtype == dtype
    # the weight dequantized to x's dtype (as the kernel rounds it), the product in fp32
    dequantized = dequantize_weight(payload, scales, dtype).float()
    want = F.linear(x.float(), dequantized, bias.float())
    # fp32: summation order only, at most k roundings of the sum of |terms| (a split-K or
    # cuBLAS order crossed 1e-6 of the largest output on the H200); bf16: as _assert_close
    terms = x.float().abs() @ dequantized.abs().T + bias.float().abs()
    tolerance = (2 ** -6 * want.abs().max() if dtype == torch.bfloat16 else k * 2 ** -24 * terms)
    assert ((got.float() - want).abs() <= tolerance).all()
    bound = x.float().abs() @ (scales.float().repeat_interleave(block, dim=1) / 2).T
    exact = x.float() @ w.T + bias.float()
    rounding = 2 ** -6 * exact.abs().max() if dtype == torch.bfloat16 else 1e-4
    assert ((got.float() - exact).abs() <= bound + rounding).all()
    # and without bias, through a leading batch dimension
    flat = kernels.quantized_linear(x.to(DEVICE)[None], payload.to(DEVICE), scales.to(DEVICE))
    assert flat.shape == (1, rows, n)
    assert ((flat[0].cpu().float() - (want - bias.float())).abs() <= tolerance).all()


@pytest.mark.parametrize("bits,block,rows", [(4, 64, 1), (8, 64, 3), (4, 96, 3), (8, 96, 1)])
def test_a_decode_step_split_along_k_is_the_dequantized_matmul(bits, block, rows):
    """Decode shapes with few output tiles and a long K: the kernel splits K into ranges
    (parts summed in fp32, then the bias) and still equals x @ dequantize(W)^T + b; scales
    broadcast per group (64) or gathered per value (96, not a power of two)."""
    import torch.nn.functional as F

    from engine.quantized_base import dequantize_weight, quantize_weight

    gen = torch.Generator().manual_seed(bits + block + rows)
    n, k = 100, 3072
    tiles = kernels._tiles(*quantize_weight(torch.zeros(1, k), bits, block, torch.bfloat16),
                           wide=False)
    splits, _ = kernels.split_k(-(-n // tiles.block_n), k, tiles.block_k, DEVICE)
    assert splits > 1 or DEVICE.type == "cuda"   # on a GPU, as its SM count decides
    payload, scales = quantize_weight(torch.randn(n, k, generator=gen), bits, block,
                                      torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = kernels.quantized_linear(x.to(DEVICE), payload.to(DEVICE), scales.to(DEVICE),
                                   bias.to(DEVICE)).cpu()
    want = F.linear(x.float(), dequantize_weight(payload, scales, torch.bfloat16).float(),
                    bias.float())
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@pytest.mark.parametrize("bits", [8, 4])
# K: 12-24 tiles split along K (3072), a tile or two and a part (384: the last tile
# masked), 4-8 tiles; blocks: a group or several a tile, one over two or more tiles; 150
# outputs: a part of a tile
@pytest.mark.parametrize("dtype,rows,k,block", [(torch.bfloat16, 1, 3072, 64),
                                                (torch.float16, 16, 384, 16),
                                                (torch.bfloat16, 5, 1024, 512)])
def test_the_decode_kernel_is_the_dequantized_matmul(bits, dtype, rows, k, block):
    """At up to 16 rows of a 16-bit x, INT8 and INT4 go through decode_matmul_kernel (W
    the wide operand; INT4 nibbles made floats by bits) and equal x @ dequantize(W)^T + b
    to the dtype's rounding, as the tiled kernel does; with and without bias, and as two
    parts writing their columns of one output with LoRA added in the epilogue (or, split
    along K, in the kernel that sums the parts)."""
    import torch.nn.functional as F

    from engine.quantized_base import dequantize_weight, quantize_weight

    gen = torch.Generator().manual_seed(bits + rows + k + block)
    n = 150
    payload, scales = quantize_weight(torch.randn(n, k, generator=gen), bits, block, dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    assert kernels.decode_fits(x, payload, scales)
    want = F.linear(x.float(), dequantize_weight(payload, scales, dtype).float(), bias.float())
    args = [t.to(DEVICE) for t in (x, payload, scales)]
    got = kernels.quantized_linear(*args, bias.to(DEVICE)).cpu()
    tiled = kernels.tiled_quantized_matmul(*args, bias.to(DEVICE)).cpu()
    assert got.shape == (rows, n) and got.dtype == dtype
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10   # and the interpreter truncates
    assert (got.float() - want).abs().max() <= 2 * ulp * want.abs().max()
    assert (tiled.float() - want).abs().max() <= 2 * ulp * want.abs().max()
    no_bias = kernels.quantized_linear(*args).cpu()
    assert (no_bias.float() - (want - bias.float())).abs().max() <= 2 * ulp * want.abs().max()
    # two parts into one output (a fused projection's sources), LoRA of rank 6 beside them
    a, b = (torch.randn(shape, generator=gen).to(dtype) * 0.3 for shape in ((6, k), (n, 6)))
    parts = [(payload[:100].to(DEVICE), scales[:100].to(DEVICE)),
             (payload[100:].to(DEVICE), scales[100:].to(DEVICE))]
    got = kernels.quantized_projection(args[0], parts, bias.to(DEVICE),
                                       kernels.LowRank(a.to(DEVICE), b.to(DEVICE))).cpu()
    want = want + (x.float() @ a.float().T).to(dtype).float() @ b.float().T
    assert (got.float() - want).abs().max() <= 2 * ulp * want.abs().max()


@pytest.mark.parametrize("bits,block", [(4, 64), (8, 16), (4, 96)])
def test_the_dequantize_kernel_is_dequantize_weight_exactly(bits, block):
    """The prefill's matrix: the same bf16 values as engine.quantized_base's formula (the
    fp32 product rounded once; the interpreter rounds to bf16 toward zero, a GPU to
    nearest even as PyTorch does)."""
    from engine.quantized_base import dequantize_weight, quantize_weight

    w = torch.randn(70, 384, generator=torch.Generator().manual_seed(bits))
    payload, scales = quantize_weight(w, bits, block, torch.bfloat16)
    got = kernels.dequantize(payload.to(DEVICE), scales.to(DEVICE), torch.bfloat16).cpu()
    product = dequantize_weight(payload, scales, torch.float32)
    if DEVICE.type == "cuda":
        assert torch.equal(got, dequantize_weight(payload, scales, torch.bfloat16))
    else:
        toward_zero = (product.view(torch.int32) & ~0xFFFF).view(torch.float32)
        assert torch.equal(got, toward_zero.to(torch.bfloat16))


def _quantized_lora_model(preset: str, bits: int, dtype: torch.dtype):
    """(model, runtime): `preset` with LoRA rank 4 over an INT8/INT4 base (block 64) in
    `dtype`, its B factors random (so that the adapters change the outputs)."""
    from engine.config import EngineConfig, LoraConfig, QuantizedBaseConfig
    from engine.models import byte_tokenizer
    from engine.placement import Placement
    from engine.runtime import Runtime

    runtime = Runtime(DEVICE, dtype, 0, 1, 0)
    placement = Placement(runtime, EngineConfig(quantized_base=QuantizedBaseConfig(True, bits, 64)),
                          {"policy": 3, "scorer": 3})
    model = placement.causal_lm(preset, byte_tokenizer(), trained=True,
                                lora=LoraConfig(dim=4, alpha=8), seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0))
                            .to(param.device) * 0.05)
    return model, runtime


def _inference_form(model, runtime, quantized: bool):
    from engine.config import HybridConfig, OptimConfig
    from engine.hybrid import HybridEngine

    return HybridEngine(model, OptimConfig(), 1, runtime, lr=1e-3, hybrid=HybridConfig(
        quantized_inference=quantized))._gather().model


@pytest.mark.parametrize("preset,bits,in_place", [("tiny-llama", 4, True), ("tiny-llama", 4, False),
                                                  ("tiny-opt", 8, True)])
def test_decoder_from_a_quantized_base_with_fused_kernels_matches_the_dequantized_path(
        preset, bits, in_place, monkeypatch):
    """LoRA over an INT4/INT8 base: the inference form generating from the integers through
    the Triton kernel (the base's own, one matmul per source; or a gathered copy, fused)
    gives the greedy answers of the dequantized-copy form."""
    from engine import decode, hybrid
    if not in_place:
        monkeypatch.setattr(hybrid, "shareable", lambda *args: False)
    from engine.generation import SamplingSettings
    from engine.models import byte_tokenizer

    tok = byte_tokenizer()
    model, runtime = _quantized_lora_model(preset, bits, torch.float32)
    batch = _prompt_batch(tok)
    sampling = SamplingSettings(max_new_tokens=4, do_sample=False)
    kwargs = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    answers = []
    for quantized in (True, False):
        decoder = _inference_form(model, runtime, quantized)
        # the reference runs the plain PyTorch formulas: the fused ones give the same tokens
        # (test_decoder_with_fused_kernels_matches_hf_generate), and are slow interpreted
        decoder.use_fused_kernels(quantized or DEVICE.type == "cuda")
        answers.append(decode.generate(decoder, batch["input_ids"], batch["attention_mask"],
                                       sampling, **kwargs))
    assert torch.equal(answers[0], answers[1])


@pytest.mark.parametrize("preset,bits,in_place", [("tiny-llama", 4, True), ("tiny-llama", 4, False),
                                                  ("tiny-opt", 8, True)])
def test_a_bf16_decode_step_from_a_quantized_base_goes_through_the_decode_kernel(
        preset, bits, in_place, monkeypatch):
    """In bf16, a decode step's projections of the INT4/INT8 inference form (fused Q/K/V
    and gate/up with LoRA; the base's integers in place, one matmul per source, or a
    gathered copy) run decode_matmul_kernel and give the dequantized formula's outputs to
    bf16 rounding."""
    from engine import hybrid
    from engine.quantized_inference import QuantizedProjection
    if not in_place:
        monkeypatch.setattr(hybrid, "shareable", lambda *args: False)
    calls = []
    decode_part = kernels._decode_part
    monkeypatch.setattr(kernels, "_decode_part", lambda *a: calls.append(1) or decode_part(*a))
    decoder = _inference_form(*_quantized_lora_model(preset, bits, torch.bfloat16), True)
    projections = [m for m in decoder.modules() if isinstance(m, QuantizedProjection)]
    # in place, a fused projection runs one matmul per source
    assert any(len(m.integer_parts()) > 1 for m in projections) == in_place
    gen = torch.Generator().manual_seed(0)
    for module in projections:
        payload = module.integer_parts()[0][0]
        in_features = payload.shape[1] * (2 if bits == 4 else 1)   # two INT4 values a byte
        x = torch.randn(5, in_features, generator=gen).to(DEVICE, torch.bfloat16)
        module.fused = False
        want = module(x)
        module.fused = True
        _assert_close(module(x), want)
    assert len(calls) >= len(projections)
