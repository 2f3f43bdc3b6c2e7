"""The hybrid engine against Hugging Face `generate` on an unsharded copy of the same model,
one process or on several ranks (each rank generating its own rows of a batch).

    hybrid_check.py            # one process
    TEST_RANKS=2 hybrid_check.py   # 2 ranks forked (tests/harness/ranks.py), or torchrun

For every case (architecture, LoRA, ZeRO stage, hybrid settings) it checks, on every rank:
greedy and row-seeded sampled answers token-identical to HF generate; answers that end at
different lengths; and that a generate round trip changes nothing in training (the loss
before and after it, and one optimizer step, equal those of a twin engine that never
generated). Prints one JSON line (rank 0): {case: {check: value}}."""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from engine.config import HybridConfig, LoraConfig, OptimConfig  # noqa: E402
from engine.generation import SamplingSettings, generate  # noqa: E402
from engine.hybrid import HybridEngine  # noqa: E402
from engine.lora import apply_lora  # noqa: E402
from engine.models import byte_tokenizer, load_causal_lm, preset_config  # noqa: E402
from engine.parallel import ShardSettings  # noqa: E402
from engine.runtime import Runtime, setup_runtime  # noqa: E402
from steps.tokenize import collate_prompts  # noqa: E402
from tests.harness.ranks import run_ranks  # noqa: E402

PROMPTS = ["hello there", "a", "The quick brown fox jumps over", "12+34=", "Why is the sky",
           "ok", "Once upon a time, in a land", "x y z"]
GREEDY = SamplingSettings(max_new_tokens=24, do_sample=False)
SAMPLED = SamplingSettings(max_new_tokens=24, temperature=0.9, top_k=40, top_p=0.95)

# OPT with the norm after each block (as OPT-350m): no inference modules, the HF fallback
POST_NORM_OPT = "tiny-opt-post-norm"
# (name, preset, LoRA rank, ZeRO stage, hybrid settings)
CASES = [
    ("llama", "tiny-llama", 0, 3, HybridConfig()),
    ("llama-lora", "tiny-llama", 4, 3,
     HybridConfig(gather_group_size=2, pin_parameters=False)),
    ("opt", "tiny-opt", 0, 3, HybridConfig(release_inference_cache=True)),
    ("opt-lora-stage0", "tiny-opt", 4, 0, HybridConfig()),
    ("llama-stage2", "tiny-llama", 0, 2, HybridConfig(gather_group_size=2)),
    ("gpt2-lora", "tiny-gpt2", 4, 3, HybridConfig()),
    ("neox-lora", "tiny-gpt-neox", 4, 3, HybridConfig()),
    ("qwen3-lora", "tiny-qwen3", 4, 3, HybridConfig()),
    ("postnorm-opt-fallback", POST_NORM_OPT, 4, 3, HybridConfig()),
]


def model_with_answers_that_end(preset: str, lora: int, eos: int) -> torch.nn.Module:
    """A random model (LoRA B non-zero, so the adapters matter) whose EOS logit is scaled
    up enough that some answers end early and others run to max_new_tokens."""
    if preset == POST_NORM_OPT:
        config = preset_config("tiny-opt", byte_tokenizer())
        config.do_layer_norm_before = False
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = load_causal_lm(preset, byte_tokenizer(), seed=3)
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= 3
    model = apply_lora(model, LoraConfig(dim=lora))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
            elif "q_norm" in name or "k_norm" in name:   # Qwen3's start at 1: make each count
                param.uniform_(0.5, 1.5)
    return model


def llama_kin(model_type: str, **settings) -> torch.nn.Module:
    """A small random model of a Llama-plan family from its own config, whose answers end
    at different lengths, with its biases (where it has them) made non-zero and its norms
    (Gemma's, OLMo's) away from their initial values."""
    tok = byte_tokenizer()
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, **settings)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_token_id] *= 3   # some answers end early
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
            elif "gemma" in model_type and "norm" in name:   # 1 + w: each w counts
                param.normal_(0, 0.3)
            elif "olmo" in model_type and "norm" in name:    # they start at 1
                param.uniform_(0.5, 1.5)
    return model


def check_case(preset: str, lora: int, stage: int, settings: HybridConfig,
               rt: Runtime) -> dict:
    tok = byte_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    model = model_with_answers_that_end(preset, lora, eos)
    reference, twin = copy.deepcopy(model).eval(), copy.deepcopy(model)
    optim, sharding = OptimConfig(), ShardSettings(zero_stage=stage)
    engine = HybridEngine(model, optim, 10, rt, sharding, settings, lr=1e-3)
    twin = HybridEngine(twin, optim, 10, rt, sharding, replace(settings, enabled=False), lr=1e-3)

    rows = list(range(rt.rank, len(PROMPTS), rt.world_size))
    batch = collate_prompts([tok(PROMPTS[i])["input_ids"] for i in rows], pad)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    seeds = torch.tensor(rows) + 1000
    ids_train = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(rt.rank))

    def loss(e: HybridEngine) -> torch.Tensor:
        return e(input_ids=ids_train, labels=ids_train).loss

    with torch.no_grad():
        loss_before = loss(engine)
    result = {"injected": engine.injected}
    for name, sampling in (("greedy", GREEDY), ("sampled", SAMPLED)):
        kwargs = dict(eos_token_id=eos, pad_token_id=pad, row_seeds=seeds)
        want = generate(reference, ids, mask, sampling, **kwargs, synced=False)
        for _attempt in range(2):   # the second call reuses what the first kept (or not)
            got = engine.generate(ids, mask, sampling, **kwargs)
            same = got.shape == want.shape and bool((got == want).all())
            result[f"{name}_identical"] = result.get(f"{name}_identical", True) and same
        ended = (want[:, ids.shape[1]:] == eos).any(1)
        result[f"{name}_ended_early"], result[f"{name}_ran_to_max"] = rt.total(
            float(ended.sum()), float((~ended).sum()))
    with torch.no_grad():
        result["loss_unchanged"] = bool(loss(engine) == loss_before)
    # one optimizer step after the round trips equals the twin's (which never generated)
    for e in (engine, twin):
        e.backward(loss(e))
        e.step()
    with torch.no_grad():
        result["step_unchanged"] = bool(loss(engine) == loss(twin))
    return result


def run_cases(rt: Runtime, cases=CASES) -> dict:
    """{case: {check: value}}, the checks all-reduced (true only if true on every rank)."""
    results = {}
    for name, preset, lora, stage, settings in cases:
        result = check_case(preset, lora, stage, settings, rt)
        for key, value in result.items():
            if isinstance(value, bool):
                result[key] = rt.total(float(not value))[0] == 0
        results[name] = result
    return results


def main() -> None:
    rt = setup_runtime("cpu", "float32", seed=0, timeout_s=120)
    results = run_cases(rt)
    if rt.is_main:
        print(json.dumps({"world_size": rt.world_size, **results}), flush=True)
    if rt.distributed:
        torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    run_ranks(main)
