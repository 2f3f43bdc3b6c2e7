"""The hybrid engine (engine/hybrid.py, engine/inference_*.py, engine/decode.py) against
Hugging Face `generate` on the unsharded model, fp32 on CPU: greedy and sampled answers token
for token (Llama, OPT, GPT-2 and GPT-NeoX, with and without LoRA, ZeRO-3 at one and two ranks,
the fallback for a model without inference modules), and training unchanged by the switch to
generation and back; the same for a plain model's inference form (engine/inference_form.py),
with its per-token callback.
The checks themselves are in tests/harness/hybrid_check.py, shared by both world sizes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    BloomForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    GenerationConfig,
    SiglipVisionConfig,
)

from engine import decode, kernels
from engine.config import HybridConfig, LoraConfig, OptimConfig
from engine.generation import SamplingSettings, generate
from engine.hybrid import HybridEngine
from engine.inference_form import inference_form
from engine.inference_plans import Unsupported, plan
from engine.lora import apply_lora
from engine.models import byte_tokenizer, load_causal_lm
from engine.runtime import Runtime
from steps.tokenize import collate_prompts
from tests.harness.environment import child_env
from tests.harness.hybrid_check import (
    POST_NORM_OPT,
    PROMPTS,
    llama_kin,
    model_with_answers_that_end,
    run_cases,
)

ROOT = Path(__file__).resolve().parent.parent
ONE_PROCESS = Runtime(torch.device("cpu"), torch.float32, 0, 1, 0)
TOK = byte_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id


def _assert_cases_pass(results: dict) -> None:
    for case, checks in results.items():
        failed = [k for k, v in checks.items() if v is False and k != "injected"]
        assert not failed, f"{case}: {failed} ({checks})"
        # answers of different lengths: the batch really stops row by row
        assert checks["greedy_ended_early"] > 0 and checks["greedy_ran_to_max"] > 0, checks
        assert checks["injected"] == (case != "postnorm-opt-fallback"), checks


def test_one_process_matches_hf_generate():
    _assert_cases_pass(run_cases(ONE_PROCESS))


@pytest.mark.slow
def test_two_ranks_zero3_match_hf_generate():
    env = child_env(OMP_NUM_THREADS="1", TEST_RANKS="2")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "harness" / "hybrid_check.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results.pop("world_size") == 2
    _assert_cases_pass(results)


def _batch(prompts=PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate_prompts([TOK(p)["input_ids"] for p in prompts], PAD)
    return batch["input_ids"], batch["attention_mask"]


def _engine(model, **settings) -> HybridEngine:
    return HybridEngine(model, OptimConfig(), 10, ONE_PROCESS, hybrid=HybridConfig(**settings),
                        lr=1e-3)


def _with_lora_and_engine(model) -> tuple[torch.nn.Module, HybridEngine]:
    """`model` with LoRA rank 4 on every Linear (B non-zero, so the adapters count), and a
    hybrid engine over a copy of it, generating through the inference modules."""
    adapted = apply_lora(model, LoraConfig(dim=4))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    engine = _engine(copy.deepcopy(adapted))
    assert engine.injected
    return adapted, engine


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
def test_static_decode_step_matches(preset):
    """The fixed-shape decode step (what CUDA graphs capture) gives the same tokens, and
    one step serves batches whose prompts pad to different lengths."""
    model = model_with_answers_that_end(preset, 0, EOS)
    reference = copy.deepcopy(model)
    engine = _engine(model)
    decoder = engine._gather().model
    sampling = SamplingSettings(max_new_tokens=20, do_sample=False)
    lengths = set()
    for prompts in (PROMPTS[:2], PROMPTS[2:4]):   # padded to 12 and 31 tokens
        ids, mask = _batch(prompts)
        lengths.add(ids.shape[1])
        want = generate(reference, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)
        got = decode.generate(decoder, ids, mask, sampling, eos_token_id=EOS,
                              pad_token_id=PAD, static=True)
        assert torch.equal(got, want)
    assert len(lengths) == 2 and len(decoder.cache.static_steps) == 1


def test_a_released_cache_frees_its_memory_and_keeps_its_decode_steps():
    """engine.hybrid.release_inference_cache between rollouts: nothing keeps the freed
    cache's memory (not the static decode step made over it), the next rollout's answers
    are still generate's, and the step (a CUDA graph holds the cache's address) is reused
    when the new buffer lands at the old address, and made again when it does not."""
    model = model_with_answers_that_end("tiny-llama", 0, EOS)
    reference = copy.deepcopy(model)
    decoder = _engine(model)._gather().model
    sampling = SamplingSettings(max_new_tokens=20, do_sample=False)
    ids, mask = _batch(PROMPTS[:4])
    want = generate(reference, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)

    def rollout():
        got = decode.generate(decoder, ids, mask, sampling, eos_token_id=EOS,
                              pad_token_id=PAD, static=True)
        assert torch.equal(got, want)
        (step,) = decoder.cache.static_steps.values()
        return step

    step, cache = rollout(), decoder.cache
    for forced_move in (False, True):
        freed_at = cache.buffer.data_ptr()
        storage = weakref.ref(cache.buffer.untyped_storage())
        decoder.release_cache()
        assert storage() is None and cache.nbytes == 0
        if forced_move:   # as if the allocator had put the new buffer elsewhere
            cache._freed_at = freed_at + 1
        moves = cache.moves
        again = rollout()
        assert decoder.cache is cache and cache.nbytes > 0
        reused = not forced_move and cache.buffer.data_ptr() == freed_at
        assert (again is step) == reused and cache.moves == moves + (not reused)
        step = again
    assert cache.restores == 2


def _lending_and_not():
    """Two engines over the same tiny-llama, two micro-steps a window, weight decay 0.1:
    the first lends its gradients the rollout's memory (cache_holds_gradients), the second
    not; a rollout of both, and losses reaching the first layer only or the whole model."""
    model = model_with_answers_that_end("tiny-llama", 0, EOS)
    engines = [HybridEngine(m, OptimConfig(weight_decay=0.1), 10, ONE_PROCESS, lr=1e-3,
                            hybrid=HybridConfig(cache_holds_gradients=lends), grad_accum=2)
               for m, lends in ((model, True), (copy.deepcopy(model), False))]
    ids, mask = _batch(PROMPTS * 2)
    sampling = SamplingSettings(max_new_tokens=24, do_sample=False)
    train_ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(0))

    def rollout() -> list[torch.Tensor]:
        return [e.generate(ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)
                for e in engines]

    def first_layer(e):
        return e(input_ids=train_ids, output_hidden_states=True).hidden_states[1].pow(2).mean()

    def whole(e):
        return e(input_ids=train_ids, labels=train_ids).loss

    return engines, rollout, first_layer, whole


def test_between_rollouts_the_cache_holds_the_gradients_and_nothing_else_changes():
    """engine.hybrid.cache_holds_gradients (one process, the default): an update's gradients
    lie in the KV cache's and the inference weights' bytes, which stay where they are, and
    answers and weights equal those of an engine whose gradients have memory of their own:
    over three rollouts, two micro-steps a window, with weight decay. A first window reaches
    only the first layer (AdamW would decay the others on a zero gradient: they must keep no
    gradient at all), and a window left open across a rollout keeps what it had accumulated."""
    engines, rollout, first_layer, whole = _lending_and_not()
    got, want = rollout()
    assert torch.equal(got, want)
    cache = engines[0]._target.model.cache
    where = (cache.buffer.data_ptr(), cache.buffer.data_ptr() + cache.buffer.nbytes)
    for e in engines:
        e.backward(first_layer(e))
    lent = [(t.data_ptr(), t.data_ptr() + t.nbytes)
            for t in [cache.buffer, *engines[0]._refilled_weights()]]
    assert all(any(a <= p.grad.data_ptr() < b for a, b in lent)
               for p in engines[0].parameters())
    assert any(where[0] <= p.grad.data_ptr() < where[1] for p in engines[0].parameters())
    for e in engines:
        e.backward(first_layer(e))
        e.step()
    last_layer = dict(engines[0].module.named_parameters())["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(last_layer, dict(engines[1].module.named_parameters())[
        "model.layers.1.mlp.up_proj.weight"])   # no gradient reached it: not decayed
    for e in engines:   # a window open across the rollout
        e.backward(whole(e))
    got, want = rollout()
    assert torch.equal(got, want) and engines[0]._target.model.cache is cache
    for e in engines:
        e.backward(whole(e))
        e.step()
    for memory in [cache.buffer, *engines[0]._refilled_weights()]:
        memory.data.fill_(float("nan"))   # what lent bytes may hold: no answer may depend on it
    got, want = rollout()
    assert torch.equal(got, want) and cache.buffer.data_ptr() == where[0]
    for (name, mine), theirs in zip(engines[0].module.named_parameters(),
                                    engines[1].parameters(), strict=True):
        assert torch.equal(mine, theirs), name


def test_a_window_open_across_a_rollout_keeps_no_gradient_its_backward_did_not_reach():
    """A window's first backward reaches only the first layer, then a rollout takes the
    lent memory back, then its second backward again reaches only the first layer: the
    other layers' placed (zero) gradients are dropped, not kept, so AdamW's weight decay
    leaves them as they are, as it does without lending; every weight equals the
    non-lending engine's."""
    engines, rollout, first_layer, _ = _lending_and_not()
    rollout()
    for e in engines:
        e.backward(first_layer(e))
    rollout()
    for e in engines:
        e.backward(first_layer(e))
        e.step()
    for (name, mine), theirs in zip(engines[0].module.named_parameters(),
                                    engines[1].parameters(), strict=True):
        assert torch.equal(mine, theirs), name


@pytest.mark.parametrize("row_seeded,top_k,top_p", [(True, 0, 1.0), (True, 20, 0.8),
                                                    (False, 20, 0.8)])
def test_the_static_step_samples_inside_it_as_hf_generate_does(row_seeded, top_k, top_p):
    """The static step (what a CUDA graph captures) chooses the next token itself, from
    seeds and a step index in its buffers: row-seeded sampling with temperature, top-k
    and top-p gives generate's answers, in two batches of different seeds through the one
    step; sampling from torch's global generator (not capturable) is left to the loop,
    with generate's draws."""
    model = model_with_answers_that_end("tiny-llama", 0, EOS)
    reference = copy.deepcopy(model)
    decoder = _engine(model)._gather().model
    sampling = SamplingSettings(max_new_tokens=24, temperature=0.8, top_k=top_k, top_p=top_p)
    ids, mask = _batch(PROMPTS[:4])
    for seeds in ((torch.tensor([3, -8, 2**50, 77]), torch.tensor([5, 6, 7, 8]))
                  if row_seeded else (None,)):
        torch.manual_seed(4)
        want = generate(reference, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD,
                        row_seeds=seeds)
        torch.manual_seed(4)
        got = decode.generate(decoder, ids, mask, sampling, eos_token_id=EOS,
                              pad_token_id=PAD, row_seeds=seeds, static=True)
        assert torch.equal(got, want)
    (step,) = decoder.cache.static_steps.values()
    assert (step.rule is not None) == row_seeded


@pytest.mark.parametrize("static", [False, True])
def test_answers_end_where_hf_generate_stops_without_a_read_per_token(static):
    """Every row ends within a few tokens: the decoder reads "all ended?" only every
    ENDED_CHECK_EVERY steps, decodes padding until then, and still returns HF generate's
    answers at HF's length."""
    model = model_with_answers_that_end("tiny-llama", 0, EOS)
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS] *= 20   # EOS first within a few tokens
    reference = copy.deepcopy(model)
    decoder = _engine(model)._gather().model
    sampling = SamplingSettings(max_new_tokens=40, do_sample=False)
    ids, mask = _batch(PROMPTS[:4])
    want = generate(reference, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)
    got = decode.generate(decoder, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD,
                          static=static)
    assert torch.equal(got, want)
    assert 1 < want.shape[1] - ids.shape[1] < decode.ENDED_CHECK_EVERY


def test_the_generate_phase_splits_into_prefill_and_counted_decode_steps():
    """The engine's generation times split the generate phase into the prefills and the
    decode steps after them, with the steps counted as run: N - 1 for N tokens that run
    to the end (the first token comes from the prefill), and up to the all-ended read
    (ENDED_CHECK_EVERY - 1) for answers that end early; per call, not since the start."""
    model = model_with_answers_that_end("tiny-llama", 0, EOS)
    engine = _engine(model)
    ids, mask = _batch(PROMPTS[:4])
    for new_tokens in (24, 9):
        sampling = SamplingSettings(max_new_tokens=new_tokens, do_sample=False)
        engine.generate(ids, mask, sampling, eos_token_id=[], pad_token_id=PAD)
        times = engine.take_times()
        assert (times.calls, times.decode_steps) == (1, new_tokens - 1)
        assert 0 < times.prefill and 0 < times.decode
        assert times.prefill + times.decode <= times.generate
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS] *= 20   # EOS first within a few tokens
    out = engine.generate(ids, mask, SamplingSettings(max_new_tokens=40, do_sample=False),
                          eos_token_id=EOS, pad_token_id=PAD)
    assert out.shape[1] - ids.shape[1] < decode.ENDED_CHECK_EVERY
    assert engine.take_times().decode_steps == decode.ENDED_CHECK_EVERY - 1
    engine.hybrid = HybridConfig(enabled=False)   # Hugging Face generate: no split
    engine.generate(ids, mask, sampling, eos_token_id=[], pad_token_id=PAD)
    times = engine.take_times()
    assert (times.calls, times.decode_steps, times.prefill, times.decode) == (1, 0, 0.0, 0.0)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_dropping_ended_rows_changes_no_answer(static, sampled, monkeypatch):
    """32 rows whose answers end at many different steps: the decoder shrinks its batch
    to the live rows at its all-ended reads (greedy: 32 -> 16 -> 8 rows; sampled: 32 ->
    16; static: a captured step per size) and still returns generate's answers, greedy
    and row-seeded sampled."""
    model = model_with_answers_that_end("tiny-llama", 0, EOS)
    with torch.no_grad():   # answers ending between 1 and 60 tokens, a dozen never
        model.get_output_embeddings().weight[EOS] *= 5.0 if sampled else 1.6
    reference = copy.deepcopy(model)
    decoder = _engine(model)._gather().model
    sampling = SamplingSettings(max_new_tokens=64, do_sample=sampled, temperature=0.9)
    seeds = torch.arange(32) * 7919 - 5 if sampled else None
    ids, mask = _batch(PROMPTS * 4)
    sizes = []
    keep = decode._rows_to_keep
    monkeypatch.setattr(decode, "_rows_to_keep",
                        lambda unfinished, live: sizes.append(len(unfinished)) or
                        keep(unfinished, live))
    want = generate(reference, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD,
                    row_seeds=seeds)
    got = decode.generate(decoder, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD,
                          row_seeds=seeds, static=static)
    assert torch.equal(got, want)
    assert sizes == ([32] if sampled else [32, 16]), sizes


def test_seeded_sampling_and_stop_tokens_match_hf_generate():
    """Sampling from torch's generator draws what generate draws (same seed, same
    tokens, and again on a second run); a list of stop tokens ends rows like generate."""
    model = model_with_answers_that_end("tiny-llama", 4, EOS)
    reference = copy.deepcopy(model)
    engine = _engine(model)
    ids, mask = _batch()
    sampling = SamplingSettings(max_new_tokens=20, temperature=0.7, top_k=50, top_p=0.9)
    torch.manual_seed(11)
    free = generate(reference, ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)
    answers = free[:, ids.shape[1]:]
    common = answers[(answers != EOS) & (answers != PAD)].mode().values
    stop = [EOS, int(common)]   # a token the model does sample: rows stop on it
    runs = []
    for generator in (lambda **kw: generate(reference, ids, mask, sampling, **kw),
                      lambda **kw: engine.generate(ids, mask, sampling, **kw),
                      lambda **kw: engine.generate(ids, mask, sampling, **kw)):
        torch.manual_seed(11)
        runs.append(generator(eos_token_id=stop, pad_token_id=PAD))
    assert torch.equal(runs[1], runs[0]) and torch.equal(runs[2], runs[0])
    answers = runs[0][:, ids.shape[1]:]
    assert (answers == stop[1]).any(), "the test should exercise the second stop token"


def test_pinned_weights_and_cache_are_kept_or_freed_as_configured():
    ids, mask = _batch()
    sampling = SamplingSettings(max_new_tokens=8, do_sample=False)
    kept = _engine(load_causal_lm("tiny-llama", TOK))
    kept.generate(ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)
    held = kept.inference_bytes()
    decoder, cache = kept._target.model, kept._target.model.cache
    assert held["weights"] > 0 and held["kv_cache"] > 0
    kept.generate(ids[:4], mask[:4], sampling, eos_token_id=EOS, pad_token_id=PAD)
    assert kept._target.model is decoder and kept._target.model.cache is cache  # reused

    no_cache = _engine(load_causal_lm("tiny-llama", TOK), release_inference_cache=True)
    no_cache.generate(ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)
    assert no_cache.inference_bytes() == {"weights": held["weights"], "kv_cache": 0}

    unpinned = _engine(load_causal_lm("tiny-llama", TOK), pin_parameters=False)
    unpinned.generate(ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD)
    assert unpinned.inference_bytes() == {"weights": 0, "kv_cache": 0}


@pytest.mark.parametrize("settings", [{}, {"pin_parameters": False}])
def test_rollouts_in_held_weights_share_one_gather_until_a_step(settings):
    """held_weights (dynamic sampling's draws, an evaluation's batches): the rollouts in the
    block fill the generation form once, and answer as an engine that gathers for each
    does; an optimizer step in the block makes the next rollout gather the new weights;
    the block's end releases the form as a rollout would (the KV cache lent for the
    gradients again). With pin_parameters=False every rollout gathers and frees, as
    outside the block."""
    ids, mask = _batch()
    sampling = SamplingSettings(max_new_tokens=8, do_sample=True, temperature=1.0)
    seeds = torch.arange(len(ids))
    held, each = (_engine(load_causal_lm("tiny-llama", TOK, seed=3), **settings)
                  for _ in range(2))

    def rollout(e):
        return e.generate(ids, mask, sampling, eos_token_id=EOS, pad_token_id=PAD,
                          row_seeds=seeds)

    def update(e):
        e.backward(e(input_ids=ids, attention_mask=mask).logits.float().square().mean())
        e.step()

    with held.held_weights():
        firsts = rollout(held), rollout(held)
        assert held._lent == [] and held.take_times().gathers == (2 if settings else 1)
        update(held)
        after_step = rollout(held)
        assert held.take_times().gathers == 1
    assert held._lent != [] if not settings else held.inference_bytes()["weights"] == 0
    want = rollout(each), rollout(each)
    update(each)
    assert all(torch.equal(g, w) for g, w in zip(firsts, want, strict=True))
    assert torch.equal(after_step, rollout(each)) and not torch.equal(after_step, firsts[0])
    assert each.take_times().gathers == 3


def test_inference_form_holds_fused_weights_with_lora_merged():
    """The gathered Llama layer: q, k, v stacked into one projection and gate, up into
    another, with LoRA's B @ A * scaling folded in; the HF model keeps its adapters."""
    model = model_with_answers_that_end("tiny-llama", 4, EOS)
    engine = _engine(model)
    layer = engine._gather().model.layers[1]
    attn = model.get_base_model().model.layers[1].self_attn
    expected = [proj.base_layer.weight + proj.lora_B.default.weight @ proj.lora_A.default.weight
                * proj.scaling["default"] for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
    torch.testing.assert_close(layer.qkv.weight, torch.cat(expected), rtol=0, atol=1e-6)
    assert layer.qkv.weight.shape == (128 + 2 * 64, 128)   # 4 heads, 2 KV heads of 32
    assert layer.up.weight.shape == (2 * 512, 128)
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_unsupported_variants_name_the_reason():
    opt = load_causal_lm("tiny-opt", TOK)
    opt.config.do_layer_norm_before = False
    with pytest.raises(Unsupported, match="post-norm"):
        plan(opt, ["model.decoder.layers.0", "model.decoder.layers.1"])
    llama = load_causal_lm("tiny-llama", TOK)
    llama.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(Unsupported, match="'dynamic' changes with the sequence length"):
        plan(llama, ["model.layers.0", "model.layers.1"])
    with pytest.raises(Unsupported, match="a sliding window of 1 token"):
        plan(mistral := llama_kin("mistral", sliding_window=1),
             [f"model.layers.{i}" for i in range(len(mistral.model.layers))])
    bloom = BloomForCausalLM(BloomConfig(vocab_size=300, hidden_size=32, n_layer=1, n_head=2))
    with pytest.raises(Unsupported, match="model type 'bloom'"):
        plan(bloom, ["transformer.h.0"])


def test_fallback_is_logged_once(capsys):
    engine = _engine(model_with_answers_that_end(POST_NORM_OPT, 0, EOS))
    ids, mask = _batch(PROMPTS[:2])
    for _ in range(2):
        engine.generate(ids, mask, SamplingSettings(max_new_tokens=4, do_sample=False),
                        eos_token_id=EOS, pad_token_id=PAD)
    out = capsys.readouterr().out
    assert out.count("hybrid engine: OPTForCausalLM: post-norm OPT") == 1, out


@pytest.mark.parametrize("model_type,norm", [("llama", "rms"), ("olmo2", "rms_fp32"),
                                             ("gemma2", "gemma")])
def test_each_rms_formula_rounds_where_its_familys_norm_does(model_type, norm):
    """In bf16 the inference modules' RMSNorm equals the family's own module bit for bit
    (Llama: x̂ rounded, then times w; OLMo 2: x̂ w in fp32; Gemma: x̂ (1 + w) in fp32),
    and the other formulas do not."""
    hf_norm = llama_kin(model_type).model.norm.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():   # away from its initial ones (or zeros), where formulas agree
        hf_norm.weight += 0.3 * torch.randn(64, generator=gen).to(torch.bfloat16)
    x = torch.randn(64, 64, generator=gen).to(torch.bfloat16)
    want = hf_norm(x)
    for formula in ("rms", "rms_fp32", "gemma"):
        _, got = kernels.add_norm_reference(None, x, hf_norm.weight, None, hf_norm.eps
                                            if hasattr(hf_norm, "eps") else
                                            hf_norm.variance_epsilon, formula)
        assert torch.equal(got, want) == (formula == norm), formula


def test_a_sliding_window_holds_in_the_static_step_group_prefill_and_compaction():
    """Mistral's 5-slot window through the decode paths that move slots and rows: the
    fixed-shape step, one prefill a group of 2, and the batch shrinking to its live rows
    (12 rows, row-seeded): HF generate's answers."""
    model = llama_kin("mistral", sliding_window=5)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4   # most rows end by step 32: the batch shrinks
    decoder = inference_form(copy.deepcopy(model), torch.device("cpu"), torch.float32).model
    ids, mask = _batch(PROMPTS[:6])
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    sampling = SamplingSettings(max_new_tokens=40, temperature=0.9)
    kwargs = dict(eos_token_id=EOS, pad_token_id=PAD, row_seeds=torch.arange(len(ids)))
    want = generate(model, ids, mask, sampling, **kwargs)
    got = decode.generate(decoder, ids, mask, sampling, static=True, group_size=2, **kwargs)
    assert torch.equal(got, want)
    assert len(decoder.cache.static_steps) == 2   # 12 rows, then 8 after a compaction


def test_gemma3s_image_text_checkpoint_generates_through_its_language_model():
    """Gemma3ForConditionalGeneration (what AutoModelForCausalLM loads for gemma-3-4b and
    up): the inference modules take its language model and leave the vision tower out;
    text prompts get HF generate's answers, greedy and sampled, from the inference form and
    from the hybrid engine with LoRA on every Linear (the vision tower's too)."""
    text = Gemma3TextConfig(
        vocab_size=len(TOK), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20,
        max_position_embeddings=256, sliding_window=5, eos_token_id=EOS, pad_token_id=PAD,
        layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=259, boi_token_index=258,
                          eoi_token_index=257, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS] *= 3
        for name, param in model.named_parameters():
            if "language_model" in name and "norm" in name:   # 1 + w: each w counts
                param.normal_(0, 0.3)
    form = inference_form(copy.deepcopy(model), torch.device("cpu"), torch.float32)
    assert form.injected and form.model.spec.layers == 2 and form.model.spec.windows == (5, 0)
    adapted, engine = _with_lora_and_engine(copy.deepcopy(model))
    ids, mask = _batch()
    for generating, reference in ((form.generate, model), (engine.generate, adapted.eval())):
        for sampling, seeds in ((SamplingSettings(20, do_sample=False), None),
                                (SamplingSettings(20, temperature=0.9), torch.arange(len(ids)))):
            kwargs = dict(eos_token_id=EOS, pad_token_id=PAD, row_seeds=seeds)
            assert torch.equal(generating(ids, mask, sampling, **kwargs),
                               generate(reference, ids, mask, sampling, **kwargs))


def test_longrope_switches_its_angles_where_hf_does():
    """Phi-3.5's longrope (switching to the long factors past 16 positions here): from the
    prefill when a prompt is longer, at the decode step that passes it otherwise, on the
    whole batch's largest position, and in the fixed-shape step; the batch does not shrink
    to its live rows where the switch can come (a live row's angles follow ended ones')."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.3, 1.7, 2.0, 3.0, 4.0],
            "long_factor": [2.0, 5.0, 9.0, 15.0, 30.0, 60.0],
            "original_max_position_embeddings": 16}
    model = llama_kin("phi3", sliding_window=None, rope_parameters=rope,
                      original_max_position_embeddings=16)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 2   # most rows end early: a batch that would shrink
        for layer in model.model.layers:   # sharper attention: the angles change answers
            layer.self_attn.qkv_proj.weight[:96] *= 3   # q's 64 rows and k's 32
    decoder = inference_form(copy.deepcopy(model), torch.device("cpu"), torch.float32).model
    assert decoder.spec.long_rope_from == 16
    long_prompts, short_prompts = _batch(PROMPTS), _batch(PROMPTS[:2])   # 31 and 12 tokens
    for (ids, mask), static in ((long_prompts, False), (short_prompts, False),
                                (short_prompts, True)):
        for sampling, seeds in ((SamplingSettings(20, do_sample=False), None),
                                (SamplingSettings(20, temperature=0.9), torch.arange(len(ids)))):
            kwargs = dict(eos_token_id=EOS, pad_token_id=PAD, row_seeds=seeds)
            want = generate(model, ids, mask, sampling, **kwargs)
            got = decode.generate(decoder, ids, mask, sampling, static=static, **kwargs)
            assert torch.equal(got, want), (ids.shape, static, sampling)
    # twelve rows, seven of them ended by step 16's check: the batch would shrink to 8
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 2.5
    decoder = inference_form(copy.deepcopy(model), torch.device("cpu"), torch.float32).model
    ids, mask = (x.repeat_interleave(6, 0) for x in short_prompts)
    kwargs = dict(eos_token_id=EOS, pad_token_id=PAD, row_seeds=torch.arange(12))
    sampling = SamplingSettings(20, temperature=0.9)
    want = generate(model, ids, mask, sampling, **kwargs)
    assert 6 <= int((want[:, 12:28] == EOS).any(-1).sum()) < 12
    assert torch.equal(decode.generate(decoder, ids, mask, sampling, static=True, **kwargs),
                       want)
    assert {size for size, *_ in decoder.cache.static_steps} == {12}


@pytest.mark.parametrize("model_type,settings", [
    ("qwen2", {"tie_word_embeddings": False}), ("mistral", {"sliding_window": None}),
    # sliding windows shorter than prompt and answer: on every layer, or on the second
    ("mistral", {"sliding_window": 5}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("llama", {"head_dim": 64, "rope_parameters": {     # Llama 3.1's rope
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    # a rotary share whose width rounds: 0.7 x 16 dims, of which HF rotates 12
    # (and Phi-3-mini-4k's window on every layer)
    ("phi3", {"sliding_window": 7, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.7}}),
    # Gemma: (1 + w) norms, embeddings times sqrt(hidden), GeGLU, a head of its own width;
    # its MLP reads hidden_act, not the hidden_activation its configs also hold
    ("gemma", {"head_dim": 24, "hidden_act": "silu", "hidden_activation": "gelu_pytorch_tanh"}),
    # Gemma 2: four norms a layer, its own query scale, softcapped scores and logits
    # (eager attention in HF), a window on alternate layers
    ("gemma2", {"head_dim": 24, "query_pre_attn_scalar": 20, "attn_logit_softcapping": 0.5,
                "final_logit_softcapping": 0.5, "sliding_window": 5}),
    # Gemma 3: per-head query/key norms, and local layers with a rope base of their own
    ("gemma3_text", {"head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 5,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "rope_parameters": {
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                            "factor": 8.0}}}),
    # OLMo 2: norms on attention's and the MLP's outputs only (x̂ w in fp32), and of the
    # queries and keys of all heads together; OLMo 3: windowed layers with a rope of theirs
    ("olmo2", {}),
    ("olmo3", {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": {
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                   "full_attention": {"rope_type": "default", "rope_theta": 5e5}}})])
def test_the_other_llama_family_models_match_hf_generate(model_type, settings):
    """The Llama plan's other members, built from their own configs: Qwen2's Q/K/V biases
    (made non-zero), Mistral, sliding windows (Mistral's and Phi-3's on every layer,
    Qwen2's above max_window_layers), a Llama with Llama 3.1's rope scaling and a head wider than
    hidden / heads, Phi-3's fused projections with a partial rotary embedding, Gemma 1, 2
    and 3, and OLMo 2 and 3 (their norm weights away from their initial values):
    injected, and HF generate's answers, greedy and row-seeded sampled; then the same
    through the hybrid engine with LoRA (folded into the fused weights) on every Linear."""
    model = llama_kin(model_type, **settings)
    config = model.config
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    assert bool(biases) == (model_type == "qwen2")
    form = inference_form(copy.deepcopy(model), torch.device("cpu"), torch.float32)
    assert form.injected
    ids, mask = _batch()

    def answers(generating, reference) -> list[torch.Tensor]:
        """`generating`'s answers, greedy and row-seeded sampled, checked against HF's."""
        wanted = []
        for sampling, seeds in ((SamplingSettings(20, do_sample=False), None),
                                (SamplingSettings(20, temperature=0.9), torch.arange(len(ids)))):
            kwargs = dict(eos_token_id=EOS, pad_token_id=PAD, row_seeds=seeds)
            wanted.append(generate(reference, ids, mask, sampling, **kwargs))
            assert torch.equal(generating(ids, mask, sampling, **kwargs), wanted[-1])
        return wanted

    plain = answers(form.generate, model)
    assert any((want[:, ids.shape[1]:] == EOS).any() for want in plain)   # some end early
    window = settings.get("sliding_window")
    if window:   # where windowed, the window binds: without it HF answers otherwise
        assert form.model.spec.windows == {"qwen2": (0, window), "gemma2": (window, 0),
                                           "gemma3_text": (window, 0),
                                           "olmo3": (window, 0)}.get(
                                               model_type, (window, window))
        unlimited = AutoModelForCausalLM.from_config(type(config)(**{
            **config.to_dict(), "sliding_window": 4096})).eval()
        unlimited.load_state_dict(model.state_dict())
        assert not torch.equal(generate(unlimited, ids, mask, SamplingSettings(
            20, do_sample=False), eos_token_id=EOS, pad_token_id=PAD), plain[0])
    adapted, engine = _with_lora_and_engine(model)
    adapted_answers = answers(engine.generate, adapted.eval())
    assert all(not torch.equal(a, b) for a, b in zip(adapted_answers, plain, strict=True))


@pytest.mark.parametrize("preset", ["tiny-opt", "tiny-gpt2", POST_NORM_OPT])
def test_inference_form_matches_hf_generate_and_streams(preset, caplog):
    """A plain model's inference form (no engine, no optimizer) generates what HF generate
    does; the callback sees each step's tokens, and its true return stops there. The model
    is left as it was (a fallback only moves it)."""
    model = model_with_answers_that_end(preset, 0, EOS)
    reference = copy.deepcopy(model)
    form = inference_form(model, torch.device("cpu"), torch.float32)
    assert form.injected == (preset != POST_NORM_OPT)
    assert ("post-norm OPT" in caplog.text) == (preset == POST_NORM_OPT)
    ids, mask = _batch()
    sampling = SamplingSettings(max_new_tokens=20, do_sample=False)
    kwargs = dict(eos_token_id=EOS, pad_token_id=PAD)
    want = generate(reference, ids, mask, sampling, **kwargs)
    seen = []
    got = form.generate(ids, mask, sampling, **kwargs, on_token=seen.append)
    assert torch.equal(got, want)
    assert torch.equal(torch.stack(seen, 1), want[:, ids.shape[1]:])
    seen.clear()
    got = form.generate(ids, mask, sampling, **kwargs,
                        on_token=lambda tokens: seen.append(tokens) or len(seen) == 3)
    assert torch.equal(got, want[:, :ids.shape[1] + 3]) and len(seen) == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(),
                                                 strict=True))


def test_the_fallback_copies_keep_their_buffers_dtype():
    """A model without an inference plan (a rope that changes with the length) generates
    from a plain copy (the hybrid engine) or from itself moved (inference_form), in the
    compute dtype: its buffers keep theirs, as from_pretrained keeps a bf16 model's rotary
    inv_freq in fp32 (rounded to bf16, position 4000's angles turn by up to 0.6 rad)."""
    bf16 = Runtime(torch.device("cpu"), torch.bfloat16, 0, 1, 0)
    model = load_causal_lm("tiny-llama", TOK, seed=3)
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    want = model.model.rotary_emb.inv_freq.clone()
    engine = HybridEngine(copy.deepcopy(model), OptimConfig(), 10, bf16, hybrid=HybridConfig(),
                          lr=1e-3)
    form = inference_form(model, torch.device("cpu"), torch.bfloat16)
    assert not engine.injected and not form.injected
    for generating in (engine._gather().model, form.model):
        assert torch.equal(generating.model.rotary_emb.inv_freq, want)   # fp32, exactly
        assert generating.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_checkpoints_own_generation_settings_do_not_reach_generate():
    """A checkpoint's generation_config.json (Qwen2-Instruct's repetition penalty, say) is
    for its users' chats: transformers would apply it to every rollout through HF
    generate, which the inference decoder and the log-probs know nothing of. Both paths
    give the same answers, and the model keeps its config."""
    model = load_causal_lm("tiny-llama", TOK, seed=3)
    shipped = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8,
                               repetition_penalty=1.3, no_repeat_ngram_size=2)
    model.generation_config = shipped
    form = inference_form(copy.deepcopy(model), torch.device("cpu"), torch.float32)
    ids, mask = _batch()
    for sampling, seeds in ((SamplingSettings(24, do_sample=False), None),
                            (SamplingSettings(24, temperature=0.1), torch.arange(len(ids)))):
        kwargs = dict(eos_token_id=EOS, pad_token_id=PAD, row_seeds=seeds)
        assert torch.equal(generate(model, ids, mask, sampling, **kwargs),
                           form.generate(ids, mask, sampling, **kwargs))
    assert model.generation_config is shipped


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt"])
def test_shared_prompt_prefill_gives_the_same_answers(preset):
    """Group sampling: rows in groups of g sharing a prompt, their prefill computed once
    per group, give token for token the answers of a prefill per row (eager and static
    decode steps, and through the engine); the rows of a group do sample different
    answers."""
    g = 4
    engine = _engine(model_with_answers_that_end(preset, 0, EOS))
    decoder = engine._gather().model
    ids, mask = _batch([PROMPTS[0], PROMPTS[2], PROMPTS[4]])   # 3 lengths, left-padded
    ids, mask = ids.repeat_interleave(g, 0), mask.repeat_interleave(g, 0)
    # temperature 0.1: a random tiny model's logits are nearly flat; at 1.0 wrong prefill
    # logits would still often sample the same tokens
    sampling = SamplingSettings(max_new_tokens=12, temperature=0.1)
    kwargs = dict(eos_token_id=EOS, pad_token_id=PAD, row_seeds=torch.arange(3 * g) + 100)
    for static in (False, True):
        decoder.release_cache()   # a fresh cache: no rows left filled by another run
        got = decode.generate(decoder, ids, mask, sampling, static=static, group_size=g,
                              **kwargs)
        want = decode.generate(decoder, ids, mask, sampling, static=static, **kwargs)
        assert torch.equal(got, want), static
    answers = want[:, ids.shape[1]:].reshape(3, g, -1)
    assert all(len({tuple(row.tolist()) for row in group}) > 1 for group in answers)
    decoder.release_cache()
    assert torch.equal(engine.generate(ids, mask, sampling, group_size=g, **kwargs), want)


def test_shared_prompt_prefill_refuses_groups_that_differ():
    engine = _engine(load_causal_lm("tiny-llama", TOK))
    ids, mask = _batch(PROMPTS[:4])
    sampling = SamplingSettings(max_new_tokens=2, do_sample=False)
    kwargs = dict(eos_token_id=EOS, pad_token_id=PAD)
    with pytest.raises(ValueError, match="rows of a group hold different prompts"):
        engine.generate(ids, mask, sampling, group_size=2, **kwargs)
    with pytest.raises(ValueError, match="does not divide the batch of 4 rows"):
        engine.generate(ids, mask, sampling, group_size=3, **kwargs)
