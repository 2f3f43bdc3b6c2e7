"""The precision policy (engine/precision.py) and the numerical guards: fp32 master weights
and optimizer state under bf16 compute in one process, attention kernels of differentiated
forwards, updates skipped on a non-finite loss or gradient (weights untouched, counted, a
clean stop after too many in a row), no checkpoint or export of non-finite weights, no
sampling from non-finite scores, and log-probs at the sampling temperature."""

from __future__ import annotations

import copy
import functools
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from engine.checkpoint import Checkpointer, Tensors
from engine.config import EngineConfig, LoraConfig, OptimConfig, QuantizedBaseConfig
from engine.errors import NonFiniteError
from engine.generation import SamplingSettings, TokenChooser, generate
from engine.inference_form import inference_form
from engine.lora import BaseWithoutAdapters
from engine.models import LinearReduced, byte_tokenizer, head_reduced, load_causal_lm
from engine.placement import Placement
from engine.precision import LossScale, Precision
from engine.quantized_base import effective_weight
from engine.runtime import Runtime
from engine.trainer import TrainEngine
from steps.ppo import answer_logprobs, answer_logprobs_and_entropy
from steps.rlhf import logprobs_of_tokens, sft_loss, token_entropy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from tensor_peak import TensorPeak  # noqa: E402

pytestmark = pytest.mark.filterwarnings(   # library noise: peft on transformers 5
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)
CPU_BF16 = Runtime(device=torch.device("cpu"), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 200, (4, 12), generator=torch.Generator().manual_seed(seed))


def engine_for(model, rt: Runtime = CPU, **guards) -> TrainEngine:
    return TrainEngine(model, OptimConfig(lr_scheduler="constant"), total_steps=10, runtime=rt,
                       lr=1e-2, **guards)


def train_step(engine: TrainEngine, ids: torch.Tensor, poison: float = 1.0) -> float | None:
    engine.backward(sft_loss(engine(input_ids=ids).logits, ids) * poison)
    return engine.step()


def snapshot(engine: TrainEngine) -> dict[str, torch.Tensor]:
    state = {f"param/{n}": p.detach().clone() for n, p in engine.module.named_parameters()}
    for i, s in enumerate(engine.optimizer.state.values()):
        state.update({f"adam{i}/{k}": v.clone() for k, v in s.items() if torch.is_tensor(v)})
    return state


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---------------------------------------------------------------------------------------------
# The policy


def test_policy_dtypes():
    bf16 = Precision(compute=torch.bfloat16)
    assert bf16.mixed and bf16.master == bf16.reduce == torch.float32
    assert (bf16.load_dtype(trained=True), bf16.load_dtype(trained=False)) == (
        torch.float32, torch.bfloat16)
    policy = bf16.fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert not Precision().mixed and Precision().fsdp_policy().param_dtype is None


def test_one_process_bf16_trains_fp32_master_weights_under_autocast(tok):
    """Trained weights and AdamW state stay fp32 in a single bf16 process (they were bf16
    before), the forward computes in bf16, and the update is the fp32 one to bf16 rounding;
    frozen models load in bf16."""
    place = Placement(CPU_BF16, EngineConfig(), {"policy": 0, "scorer": 0})
    model = place.causal_lm("tiny-llama", tok, trained=True, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    frozen = place.causal_lm("tiny-llama", tok, trained=False, seed=0)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}

    start = copy.deepcopy(model.state_dict())
    bf16, fp32 = engine_for(model, CPU_BF16), engine_for(load_causal_lm("tiny-llama", tok, seed=0))
    assert bf16(input_ids=batch()).logits.dtype == torch.bfloat16
    for engine in (bf16, fp32):
        assert train_step(engine, batch()) > 0
    assert {v.dtype for s in bf16.optimizer.state.values() for v in s.values()
            if torch.is_tensor(v) and v.ndim} == {torch.float32}
    updates = [torch.cat([(e.module.state_dict()[k] - start[k]).flatten() for k in start])
               for e in (bf16, fp32)]
    assert torch.cosine_similarity(*updates, dim=0) > 0.99


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_one_process_bf16_lora_over_a_frozen_base(tok, bits):
    """LoRA over a frozen bf16, INT8 or INT4 base in a bf16 process: the adapters (and only
    they) train, in fp32; the base stays as it was loaded; the step is taken."""
    quantized = QuantizedBaseConfig(enabled=bits is not None, bits=bits or 8)
    place = Placement(CPU_BF16, EngineConfig(quantized_base=quantized), {"policy": 0, "scorer": 0})
    model = place.causal_lm("tiny-llama", tok, trained=True, seed=0,
                            lora=LoraConfig(dim=4, only_optimize_lora=True))
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert {p.dtype for p in trained.values()} == {torch.float32}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert {p.dtype for p in frozen.values()} <= {torch.bfloat16, torch.int8, torch.uint8}
    engine = engine_for(model, CPU_BF16)
    lora_before = {n: p.detach().clone() for n, p in trained.items()}
    for seed in range(2):   # LoRA's B starts at zero: A moves only from the second step
        assert 0 < train_step(engine, batch(seed)) < float("inf")
    assert engine.skipped_steps == 0
    assert all(not torch.equal(p, lora_before[n]) for n, p in trained.items())
    assert_same({n: p for n, p in model.named_parameters() if not p.requires_grad}, frozen)


def test_differentiated_attention_never_runs_on_cudnn():
    """On CUDA the trained forward excludes cuDNN's SDPA kernels (their backward returns
    NaN for left-padded batches of 64 mod 128 tokens; tests/harness/bf16_checks.py shows it
    on a GPU); everything is restored afterwards."""
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    with Precision(compute=torch.bfloat16).trained_forward(torch.device("cuda"), autocast=False):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before


def test_a_checkpointed_forward_is_recomputed_under_the_forwards_attention_choice(monkeypatch):
    """Gradient checkpointing recomputes a block during backward: TrainEngine.backward runs
    it under the trained forward's attention kernels, or the recompute picks cuDNN's and
    its saved tensors differ (CheckpointError on an H200, bench/results/h200-2026-11-27.txt).
    The CUDA device is only named: the SDPA flags are what each pass would dispatch on."""
    runtime = Runtime(device=torch.device("cuda"), dtype=torch.float32)
    cudnn_seen = []

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            cudnn_seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return self.linear(x)

    block = Block()
    engine = SimpleNamespace(runtime=runtime, micro_steps=0, grad_accum=1, module=block,
                             _in_window=0, loss_scale=LossScale(False),
                             _loss_nonfinite=torch.zeros((), dtype=torch.bool),
                             _place_gradients=lambda: None)
    monkeypatch.setattr("engine.trainer.set_gradient_sync", lambda *_: None)
    with runtime.precision.trained_forward(runtime.device, autocast=False):
        loss = checkpoint(block, torch.randn(2, 4), use_reentrant=False).sum()
    TrainEngine.backward(engine, loss)
    assert cudnn_seen == [False, False]   # the forward, then its recompute in backward
    assert block.linear.weight.grad is not None


# ---------------------------------------------------------------------------------------------
# Guards in the optimizer step


@pytest.mark.parametrize("poison", ["loss", "loss only", "gradient"])
def test_non_finite_update_is_skipped_and_counted(tok, poison):
    """A NaN loss (also one whose gradients are finite: a NaN constant term), or a finite
    loss with an inf gradient: no update (weights and AdamW state bit for bit as before),
    the step counted as skipped and its gradient norm NaN or inf (as the metrics read a
    skip), the next good step trains."""
    engine = engine_for(load_causal_lm("tiny-llama", tok, seed=0), max_skipped_steps=3)
    assert train_step(engine, batch(0)) > 0
    before = snapshot(engine)
    if poison == "loss":
        grad_norm = train_step(engine, batch(1), poison=float("nan"))
    elif poison == "loss only":
        ids = batch(1)
        engine.backward(sft_loss(engine(input_ids=ids).logits, ids) + torch.tensor(math.nan))
        grad_norm = engine.step()
    else:
        weight = engine.module.model.layers[0].mlp.up_proj.weight
        handle = weight.register_hook(lambda grad: grad * float("inf"))
        grad_norm = train_step(engine, batch(1))
        handle.remove()
    assert not torch.isfinite(torch.tensor(grad_norm))
    assert_same(snapshot(engine), before)
    assert (engine.skipped_steps, engine.skipped_in_a_row, engine.steps) == (1, 1, 2)
    assert all(p.grad is None for p in engine.module.parameters())

    assert train_step(engine, batch(2)) > 0
    assert (engine.skipped_steps, engine.skipped_in_a_row) == (1, 0)
    after = snapshot(engine)
    assert not torch.equal(after["param/lm_head.weight"], before["param/lm_head.weight"])
    assert engine.progress_state()["skipped_steps"] == 1


def test_too_many_skips_in_a_row_stop_with_one_line(tok):
    engine = engine_for(load_causal_lm("tiny-llama", tok, seed=0), name="actor",
                        max_skipped_steps=2)
    train_step(engine, batch(0), poison=float("nan"))
    train_step(engine, batch(1))                     # a good step resets the run of skips
    train_step(engine, batch(2), poison=float("inf"))
    with pytest.raises(NonFiniteError) as err:
        train_step(engine, batch(3), poison=float("nan"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("actor: 2 updates in a row skipped (engine.max_skipped_steps=2)")
    assert "optimizer step 4" in message and "non-finite loss" in message


# ---------------------------------------------------------------------------------------------
# Nothing non-finite is written or sampled from


def poisoned(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        model.get_output_embeddings().weight[5, 3] = float("nan")
    return model


def test_export_and_checkpoint_refuse_non_finite_weights(tok, tmp_path):
    engine = engine_for(load_causal_lm("tiny-llama", tok, seed=0), name="actor")
    ema = engine.copy_weights()
    poisoned(engine.module)
    with pytest.raises(NonFiniteError, match=r"actor export to .*: 1 values are NaN or inf"):
        engine.export(tok, tmp_path / "actor")
    assert not (tmp_path / "actor").exists() and not list(tmp_path.iterdir())

    engine.export(tok, tmp_path / "actor_ema", weights=ema)    # the EMA copy is finite
    assert (tmp_path / "actor_ema" / "model.safetensors").exists()
    ema.tensors["lm_head.weight"][0, 0] = float("inf")
    with pytest.raises(NonFiniteError):
        engine.export(tok, tmp_path / "ema_again", weights=ema)

    ckpt = Checkpointer(tmp_path / "step3", CPU, every=1)
    with pytest.raises(NonFiniteError, match="checkpoint"):
        ckpt.save(1, {"actor": engine, "ema": Tensors(ema.tensors)}, {})
    assert ckpt.latest() is None and not (tmp_path / "step3").exists()


def test_sampler_refuses_non_finite_scores(tok):
    chooser = TokenChooser(SamplingSettings(do_sample=False))
    chooser(torch.tensor([[0.0, 1.0, float("-inf")]]), 0)     # -inf: a masked-out token
    chooser.check()
    chooser(torch.tensor([[0.0, float("nan"), 1.0]]), 1)
    chooser(torch.tensor([[0.0, 1.0, 2.0]]), 2)
    with pytest.raises(NonFiniteError, match="next-token scores hold NaN"):
        chooser.check()

    model = poisoned(load_causal_lm("tiny-llama", tok, seed=0)).eval()
    ids = torch.tensor([[1, 40, 41, 42]])
    mask = torch.ones_like(ids)
    sampling = SamplingSettings(max_new_tokens=4)
    seeds = torch.tensor([7])
    with pytest.raises(NonFiniteError):
        generate(model, ids, mask, sampling, eos_token_id=2, pad_token_id=0, row_seeds=seeds)
    with pytest.raises(NonFiniteError):
        inference_form(model, CPU.device, torch.float32).generate(
            ids, mask, sampling, eos_token_id=2, pad_token_id=0, row_seeds=seeds)


# ---------------------------------------------------------------------------------------------
# Log-probs at the sampling temperature


def test_logprobs_at_the_sampling_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]]])     # [B=1, T=2, V=3]
    tokens = torch.tensor([[0, 2]])
    t = 0.7
    # by hand: log(exp(x_k / t) / sum_j exp(x_j / t))
    want = [2 / t - torch.logsumexp(torch.tensor([2 / t, 0.0, -1 / t]), 0),
            3 / t - torch.logsumexp(torch.tensor([0.5 / t, 0.5 / t, 3 / t]), 0)]
    got = logprobs_of_tokens(logits, tokens, temperature=t)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.stack(want)[None], rtol=0, atol=1e-6)
    torch.testing.assert_close(logprobs_of_tokens(logits.bfloat16(), tokens, temperature=t),
                               got, rtol=0, atol=5e-2)


def test_answer_logprobs_are_the_sampling_distributions(tok):
    """answer_logprobs at T equals log_softmax(logits / T) of the actor's own forward, gathered
    at the answer tokens; at T = 1 it differs (what the ratio and KL used before)."""
    model = load_causal_lm("tiny-llama", tok, seed=0).eval()
    ids = torch.tensor([[0, 1, 40, 41, 42, 43, 44], [1, 50, 51, 52, 53, 54, 55]])
    mask = (ids != 0).long()
    with torch.no_grad():
        got = answer_logprobs(model, ids, mask, prompt_len=4, temperature=0.7)
        logits = model(input_ids=ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        want = torch.log_softmax(logits[:, 3:-1].float() / 0.7, -1).gather(
            -1, ids[:, 4:, None]).squeeze(-1)
        plain = answer_logprobs(model, ids, mask, prompt_len=4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got - plain).abs().max() > 1e-2


def head_model(model_type: str = "llama", lora_on_head: bool = False, **extra):
    """A small causal LM whose logits outweigh everything else: vocabulary 4096, width 32."""
    config = AutoConfig.for_model(model_type, vocab_size=4096, hidden_size=32, num_hidden_layers=2,
                                  intermediate_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
                                  **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if lora_on_head:
        model = get_peft_model(model, PeftLoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                     init_lora_weights=False))
    return model


def head_batch(rows: int = 8, prompt: int = 4, answer: int = 24) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(4, 4096, (rows, prompt + answer),
                        generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[::2, :2] = 0   # left padding
    return ids.masked_fill(mask == 0, 0), mask


def full_logprobs(model, ids, mask, prompt_len, temperature) -> torch.Tensor:
    """The reference computation: the whole [B, N, V] logits, log_softmax, gather."""
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    return torch.log_softmax(logits[:, prompt_len - 1:-1].float() / temperature, -1).gather(
        -1, ids[:, prompt_len:, None]).squeeze(-1)


def reduced_logprobs(model, ids, mask, prompt_len, temperature, chunk) -> torch.Tensor:
    answers = F.pad(ids[:, prompt_len:], (0, 1))
    return head_reduced(model, ids, mask, answers.shape[1],
                        lambda logits, rows: logprobs_of_tokens(logits, answers[rows],
                                                                temperature), chunk=chunk)[:, :-1]


@pytest.mark.parametrize("lora_on_head", [False, True])
def test_head_reduced_logprobs_and_gradients_equal_the_full_logits(lora_on_head):
    """Log-probs made from the head a few rows at a time (2 of 8 a chunk here), the head run
    again in backward, equal the whole logits' log_softmax, and so do every parameter's
    gradients: the head's (and LoRA's on it), the layers' below through the hidden states."""
    ids, mask = head_batch()
    weights = torch.linspace(-1, 1, 24)
    grads = []
    for reduced in (False, True):
        model = head_model(lora_on_head=lora_on_head)
        if reduced:
            got = reduced_logprobs(model, ids, mask, 4, 0.7, chunk=2 * 25 * 4096)
        else:
            want = got = full_logprobs(model, ids, mask, 4, 0.7)
        (got * weights).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert grads[0].keys() == grads[1].keys() and any("lm_head" in n for n in grads[1])
    for name, want_grad in grads[0].items():   # fp32 sums in another order: ~1e-7 of scale
        torch.testing.assert_close(grads[1][name], want_grad, rtol=1e-4,
                                   atol=2e-6 * float(want_grad.abs().max()), msg=name)


def test_token_entropy_by_hand():
    """Uniform over 4: log 4; p = (1/4, 3/4) from logits (0, log 3): -(1/4 log 1/4 + 3/4
    log 3/4); the same logits at T = 2 are p ~ (1, sqrt 3); bf16 logits read in fp32; rows
    a chunk at a time as one."""
    t, l3 = 2.0, math.log(3)
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, l3, -1e4, -1e4]]])
    q = 1 / (1 + math.sqrt(3))
    want = [[math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]]
    got = token_entropy(logits)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(want), rtol=0, atol=1e-6)
    hot = token_entropy(logits[:, 1:, :2], temperature=t)
    want_hot = -(q * math.log(q) + (1 - q) * math.log(1 - q))
    torch.testing.assert_close(hot, torch.tensor([[want_hot]]), rtol=0, atol=1e-6)
    rows = torch.randn(5, 3, 7)
    torch.testing.assert_close(token_entropy(rows, 0.7, chunk=21), token_entropy(rows, 0.7))
    torch.testing.assert_close(token_entropy(rows.bfloat16()), token_entropy(rows), rtol=0,
                               atol=3e-2)


def plain_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The reference computation, through autograd: the whole fp32 log_softmax."""
    log_p = torch.log_softmax(logits.float() / temperature, -1)
    return -(log_p.exp() * log_p).sum(-1)


def test_token_entropys_gradient_is_autograds_without_keeping_fp32_logits():
    """The fused backward, -p (log p + H) / T per chunk, equals autograd's through the
    whole log_softmax, in fp32 and for bf16 logits (returned in bf16)."""
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 3
    weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        grads = []
        for fused in (True, False):   # 2 rows of 3 a chunk
            x = logits.to(dtype).clone().requires_grad_()
            entropy = token_entropy(x, 0.7, chunk=2 * 5 * 11) if fused else plain_entropy(x, 0.7)
            (entropy * weights).sum().backward()
            grads.append(x.grad)
        assert grads[0].dtype == dtype
        torch.testing.assert_close(grads[0].float(), grads[1].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("lora_on_head", [False, True])
def test_head_reduced_entropy_and_its_gradients_equal_the_full_logits(lora_on_head,
                                                                      monkeypatch):
    """The entropy made beside the log-probs from the same chunks of the head (2 rows of 8 a
    chunk) equals the whole logits' entropy, and with entropy_grad the gradients of a loss
    over both equal the whole logits' (the entropy bonus); without it the entropy carries
    no gradient."""
    ids, mask = head_batch()
    monkeypatch.setattr("steps.ppo.head_reduced", functools.partial(head_reduced,
                                                                    chunk=2 * 25 * 4096))
    weights = torch.linspace(-1, 1, 24)
    grads = []
    for reduced in (False, True):
        model = head_model(lora_on_head=lora_on_head)
        if reduced:
            logprobs, entropy = answer_logprobs_and_entropy(model, ids, mask, 4, 0.7,
                                                            entropy_grad=True)
        else:
            logits = model(input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 3:-1]
            want_entropy = entropy = plain_entropy(logits, 0.7)
            want_logprobs = logprobs = full_logprobs(model, ids, mask, 4, 0.7)
        ((logprobs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    torch.testing.assert_close(logprobs, want_logprobs, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=2e-5)
    for name, want_grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], want_grad, rtol=1e-4,
                                   atol=2e-6 * float(want_grad.abs().max()), msg=name)
    _, logged = answer_logprobs_and_entropy(head_model(lora_on_head=lora_on_head), ids, mask, 4)
    assert not logged.requires_grad


@pytest.mark.parametrize("packed", [False, True])
def test_a_lora_models_base_gives_its_logprobs_a_few_rows_at_a_time(packed):
    """Step 3's reference under LoRA is the base with the adapters off (BaseWithoutAdapters):
    its log-probs through the reduced head (padded or packed: ppo.packing) equal the whole
    logits' of the base with the adapters off, and differ from the adapted model's (the
    adapters, LoRA on the head too, really were off); the model is left in training mode
    with its adapters on."""
    ids, mask = head_batch()
    model = head_model(lora_on_head=True).train()
    with torch.no_grad(), model.disable_adapter():
        want = full_logprobs(model.eval(), ids, mask, 4, 0.7)
    model.train()
    got = answer_logprobs(BaseWithoutAdapters(model), ids, mask, prompt_len=4, temperature=0.7,
                          packed=packed)
    answered = mask[:, 4:].bool()
    torch.testing.assert_close(got[answered], want[answered], rtol=0, atol=2e-6)
    assert model.training and not got.requires_grad
    with torch.no_grad():
        adapted = full_logprobs(model.eval(), ids, mask, 4, 0.7)
    assert (adapted - got).abs().max() > 1e-3


def test_head_reduced_logprobs_never_hold_the_whole_logits():
    """The peak of live tensor bytes over a forward and backward: with the head reduced a
    chunk at a time it is below the whole logits' by at least the logits and their gradient
    (less one chunk of each); it would not be if any pass kept every chunk's logits."""
    ids, mask = head_batch()
    logits_bytes = 8 * 24 * 4096 * 4
    peaks = []
    for reduced in (False, True):
        model = head_model()
        with TensorPeak() as tracker:
            if reduced:
                out = reduced_logprobs(model, ids, mask, 4, 1.0, chunk=2 * 25 * 4096)
            else:
                out = full_logprobs(model, ids, mask, 4, 1.0)
            out.sum().backward()
        peaks.append(tracker.peak)
    assert peaks[0] - peaks[1] > 2 * logits_bytes * (1 - 2 / 8), peaks


def test_a_linear_heads_chunks_add_into_one_weight_gradient():
    """A plain nn.Linear head's backward (LinearReduced) adds each chunk's share into one
    [V, H] gradient: with the parameter's gradient already there (accumulation over
    micro-batches), the pass peaks at the weight, its gradient and one more block (3.1 of
    the weight's bytes); a checkpointed head's chunks, summed by autograd, hold two more
    (4.1). Its log-probs and gradients equal the whole logits'."""
    V, H = 4096, 256
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=True)
    hidden0, tokens = torch.randn(8, 24, H), torch.randint(0, V, (8, 24))
    weights = torch.linspace(-1, 1, 24)

    def reduce(logits, rows):
        return logprobs_of_tokens(logits, tokens[rows], 0.7)

    hidden = hidden0.clone().requires_grad_()
    want = reduce(head(hidden), slice(None))
    (want * weights).sum().backward()
    wants = [hidden.grad, head.weight.grad.clone(), head.bias.grad.clone()]
    head.weight.grad.zero_()
    head.bias.grad.zero_()
    hidden = hidden0.clone().requires_grad_()
    with TensorPeak() as tracker:
        got = LinearReduced.apply(hidden, head.weight, head.bias, reduce, 1)
        (got * weights).sum().backward()
    assert tracker.peak < 3.5 * V * H * 4, tracker.peak / (V * H * 4)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    for grad, want_grad in zip([hidden.grad, head.weight.grad, head.bias.grad], wants,
                               strict=True):
        torch.testing.assert_close(grad, want_grad, rtol=1e-4,
                                   atol=2e-6 * float(want_grad.abs().max()))


def test_head_reduced_under_autocast_equals_the_whole_logits():
    """Under bf16 autocast (a single process's trained forward) the reduced head, forward
    and backward, runs in bf16 as the whole head does: log-probs and gradients agree to
    bf16 rounding, and the fp32 master weights get fp32 gradients."""
    ids, mask = head_batch()
    weights = torch.linspace(-1, 1, 24)
    grads = []
    for reduced in (False, True):
        model = head_model()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if reduced:
                got = reduced_logprobs(model, ids, mask, 4, 1.0, chunk=2 * 25 * 4096)
            else:
                want = full_logprobs(model, ids, mask, 4, 1.0)
        (got if reduced else want).mul(weights).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)
    assert grads[1]["lm_head.weight"].dtype == torch.float32
    for name, want_grad in grads[0].items():
        scale = float(want_grad.abs().max())
        torch.testing.assert_close(grads[1][name], want_grad, rtol=0.05, atol=0.02 * scale,
                                   msg=name)


def test_a_head_with_work_after_it_gets_its_whole_logits_reduced():
    """Gemma 2 soft-caps its logits after the head: running the head alone would miss it, so
    such a model's logits are made whole and reduced at once, equal to log_softmax of them."""
    ids, mask = head_batch(rows=4)
    model = head_model("gemma2", final_logit_softcapping=0.5, sliding_window=8,
                       layer_types=["full_attention"] * 2).eval()
    with torch.no_grad():
        got = reduced_logprobs(model, ids, mask, 4, 1.0, chunk=25 * 4096)
        want = full_logprobs(model, ids, mask, 4, 1.0)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def _fp16_step(tok, factor: float, dtype=torch.float16, scaled: bool = True):
    """One update of tiny-llama on a loss times `factor`: (grad norm, engine, start)."""
    engine = TrainEngine(load_causal_lm("tiny-llama", tok, seed=0),
                         OptimConfig(lr_scheduler="constant"), 10,
                         Runtime(device=torch.device("cpu"), dtype=dtype), lr=1e-3)
    if not scaled:
        engine.loss_scale = LossScale(False)
    start = copy.deepcopy(engine.module.state_dict())
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss * factor)
    return engine.step(), engine, start


def test_fp16_scales_the_loss_so_small_gradients_survive_and_an_overflow_lowers_it(tok):
    """fp16's smallest gradient is 6e-8: a loss times 2^-20 lost half its gradient norm
    unscaled (2^-30: all of it); with the loss scale it is the fp32 run's. An overflow of
    the scale halves it and skips that update without counting it as a failure (only a
    non-finite loss, or an overflow at a scale of 1, is one); the next update trains."""
    want, _, _ = _fp16_step(tok, 2**-20, torch.float32)
    scaled, engine, _ = _fp16_step(tok, 2**-20)
    unscaled, _, _ = _fp16_step(tok, 2**-20, scaled=False)
    assert scaled == pytest.approx(want, rel=1e-3) and unscaled < 0.7 * want
    assert engine.loss_scale.state_dict() == {"value": 2.0**16, "clean": 1, "overflows": 0}
    assert not _fp16_step(tok, 1.0, torch.bfloat16)[1].loss_scale.enabled

    norm, engine, start = _fp16_step(tok, 1e8)   # overflows fp16 at 2^16, not in fp32
    assert not math.isfinite(norm) and engine.skipped_steps == 0
    # the scale's search spends no step of the learning-rate schedule (its warmup)
    assert engine.scheduler.last_epoch == 0 and engine.steps == 1
    assert engine.loss_scale.state_dict() == {"value": 2.0**15, "clean": 0, "overflows": 1}
    assert all(torch.equal(value, start[name]) for name, value in
               engine.module.state_dict().items())
    resumed = _fp16_step(tok, 1.0)[1]
    resumed.load_progress_state(engine.progress_state())
    assert resumed.loss_scale.value == 2.0**15


def test_the_loss_scale_grows_after_its_interval_of_clean_updates_and_stays_above_one():
    scale = LossScale(True)
    for _ in range(LossScale.GROWTH_INTERVAL - 1):
        scale.update(overflow=False)
    assert scale.value == 2.0**16
    scale.update(overflow=False)
    assert scale.value == 2.0**17 and scale.clean == 0
    for _ in range(40):
        scale.update(overflow=True)
    assert scale.value == 1.0 and not scale.can_lower() and scale.overflows == 40


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-base", "int8-base"])
def test_a_lora_models_merged_export_keeps_its_delta_over_a_bf16_base(tok, tmp_path,
                                                                       quantized):
    """LoRA over a frozen base held in the compute dtype (bf16), or INT8 with bf16 compute:
    merged in bf16, or merged in fp32 and cast to bf16 (the INT8 base, before), the small
    delta the adapters trained was partly rounded away (8% of its norm at B ~ 1e-3; at
    1e-4, 60% of its entries). It is merged and written in fp32, as every trained export
    is."""
    settings = QuantizedBaseConfig(True, 8, 64) if quantized else QuantizedBaseConfig()
    place = Placement(CPU_BF16, EngineConfig(quantized_base=settings), {"policy": 0, "scorer": 0})
    model = place.causal_lm("tiny-llama", tok, trained=True, seed=0,
                            lora=LoraConfig(dim=4, only_optimize_lora=True))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 1e-4)
    TrainEngine(model, OptimConfig(), 1, CPU_BF16, lr=1e-3).export(tok, tmp_path / "actor")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "actor")
    assert loaded.dtype == torch.float32
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        base = effective_weight(q_proj.base_layer, torch.float32)
        delta = q_proj.scaling["default"] * (q_proj.lora_B["default"].weight
                                             @ q_proj.lora_A["default"].weight)
    torch.testing.assert_close(loaded.model.layers[0].self_attn.q_proj.weight, base + delta,
                               rtol=0, atol=1e-7)
