"""Packed batches for steps 1 and 2 (sft.packing, rm.packing): the layout, the models whose
attention keeps packed sequences apart, and the losses and gradients equal to padding's."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from engine.errors import UserError
from engine.models import byte_tokenizer, load_causal_lm, load_reward_model
from engine.packing import PACKABLE_MODEL_TYPES, packed_layout, require_packing, unpadded
from steps import reward, sft
from steps.config import RunConfig
from steps.data import PreferencePair
from steps.tokenize import (
    IGNORE_INDEX,
    PairExample,
    SFTExample,
    collate_packed_pairs,
    collate_packed_sft,
    collate_pairs,
    collate_sft,
    tokenize_pairs,
    tokenize_sft,
)

TOK = byte_tokenizer()
# lengths 20 to 60 tokens, and one example with no prompt: its first token is an answer token
PAIRS = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (1 + 3 * i), " no" * (i + 1))
         for i in (3, 0, 1, 4, 2, 0)] + [PreferencePair("", " yes yes", " no")]


def test_packed_sft_layout_by_hand():
    """Lengths 3, 1, 2 pack into rows 3 wide: [first], [third, second]; positions restart per
    example and in the fill; each example's first label is ignored (the one before it would
    be trained to predict it), the fill's too."""
    batch = [SFTExample([5, 6, 7], [-100, 6, 7]), SFTExample([8], [8]),
             SFTExample([3, 4], [3, 4])]
    out = collate_packed_sft(batch, pad_token_id=1)
    assert torch.equal(out["input_ids"], torch.tensor([[5, 6, 7], [3, 4, 8]]))
    assert torch.equal(out["position_ids"], torch.tensor([[0, 1, 2], [0, 1, 0]]))
    assert torch.equal(out["labels"], torch.tensor([[-100, 6, 7], [-100, 4, -100]]))
    assert set(out) == {"input_ids", "position_ids", "labels"}

    out = collate_packed_sft([SFTExample([5, 6, 7], [5, 6, 7]), SFTExample([8], [8]),
                              SFTExample([9], [9])], pad_token_id=1)
    assert torch.equal(out["input_ids"], torch.tensor([[5, 6, 7], [8, 9, 1]]))
    assert torch.equal(out["position_ids"], torch.tensor([[0, 1, 2], [0, 0, 0]]))
    assert torch.equal(out["labels"], torch.tensor([[-100, 6, 7], [-100, -100, -100]]))


def test_packed_pairs_ends_point_at_each_sequences_last_token():
    batch = [PairExample([5, 6], [5, 7, 8]), PairExample([9], [9, 4])]
    out = collate_packed_pairs(batch, pad_token_id=0)
    # lengths 2, 1, 3, 2 in rows 3 wide: [5 7 8], [5 6 9], [9 4 _]
    assert torch.equal(out["input_ids"], torch.tensor([[5, 7, 8], [5, 6, 9], [9, 4, 0]]))
    assert torch.equal(out["position_ids"], torch.tensor([[0, 1, 2], [0, 1, 0], [0, 1, 0]]))
    flat = out["input_ids"].view(-1)
    assert flat[out["ends"]].tolist() == [6, 9, 8, 4]     # chosen, chosen, rejected, rejected
    with pytest.raises(ValueError):
        collate_packed_pairs([], pad_token_id=0)


def test_packed_layout_holds_every_sequence_once_and_never_adds_rows_or_width():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 20))]
        rows = packed_layout(lengths)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= max(lengths) for row in rows)
        assert len(rows) <= len(lengths)
    assert len(packed_layout([10, 3, 3, 3, 1])) == 2   # 10 | 3 3 3 1


def _tiny(model_type: str) -> transformers.PreTrainedModel:
    """A 2-layer random model of `model_type` with a 100-token vocabulary."""
    sizes = ({"n_embd": 64, "n_layer": 2, "n_head": 4} if model_type in ("gpt2", "bloom") else
             {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4})
    extra = {"opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
             "gemma": {"head_dim": 16}, "qwen3": {"head_dim": 16}}.get(model_type, {})
    if model_type not in ("gpt2", "bloom", "opt", "falcon"):
        extra = {**extra, "intermediate_size": 128, "num_key_value_heads": 2}
    config = transformers.AutoConfig.for_model(model_type, vocab_size=100, bos_token_id=1,
                                               eos_token_id=2, pad_token_id=0, **sizes, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager" if model_type == "bloom" else "sdpa")


def _packed_error(model: transformers.PreTrainedModel, attention: str) -> float:
    """Largest logit difference between sequences of 7, 1 and 5 tokens packed in one row and
    the same run apart, in training mode (where a cache would hide the packing)."""
    model.set_attn_implementation(attention)
    model.train()
    for module in model.modules():   # dropout off, the mode left on
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    seqs = [torch.randint(3, 100, (1, n), generator=torch.Generator().manual_seed(n))
            for n in (7, 1, 5)]
    with torch.no_grad():
        apart = torch.cat([model(input_ids=s, use_cache=False).logits for s in seqs], 1)
        positions = torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]
        packed = model(input_ids=torch.cat(seqs, 1), position_ids=positions,
                       use_cache=False).logits
    return float((packed - apart).abs().max())


@pytest.mark.parametrize("model_type", sorted(PACKABLE_MODEL_TYPES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packable_models_keep_packed_sequences_apart(model_type, attention):
    """The installed transformers keeps attention within each packed sequence for every type
    packing accepts: the list in engine/models.py is checked, not assumed."""
    assert _packed_error(_tiny(model_type), attention) < 1e-5


@pytest.mark.parametrize("model_type", ["opt", "bloom"])
def test_models_that_mix_packed_sequences_are_refused(model_type):
    model = _tiny(model_type)
    assert _packed_error(model, "eager") > 1e-2   # what packing them would train on
    with pytest.raises(UserError, match=rf"^sft.packing=true: --actor-model X is of model type "
                                        rf"{model_type}, whose attention would mix .* "
                                        r"set sft.packing=false$"):
        require_packing(model, "sft.packing=true", "--actor-model X")


def test_step1_refuses_packing_for_an_opt_actor_before_training(tmp_path):
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(40)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-opt", "reward_model": "tiny-opt", "output_dir": str(tmp_path),
        "sft": {"packing": True}, "logging": {"progress": False}})
    from engine.runtime import Runtime
    with pytest.raises(UserError,
                       match=r"^sft.packing=true: --actor-model tiny-opt is of model type opt, "):
        sft.run(cfg, pairs, Runtime(device=torch.device("cpu"), dtype=torch.float32))
    assert not (tmp_path / "actor").exists()


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _assert_same(loss_a, grads_a, loss_b, grads_b):
    assert float(loss_b) == pytest.approx(float(loss_a), rel=1e-5)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6,
                                   msg=name)


def test_packed_sft_loss_and_gradients_equal_paddings():
    """Step 1's loss over a batch of 8 examples of 3 to 60 tokens (one with no prompt),
    packed into fewer rows, equals the padded batch's, and so do the gradients; the last
    example trains on every token, its first one too (as whole dialogues do)."""
    whole = TOK(" yes no yes", add_special_tokens=False)["input_ids"]
    examples = tokenize_sft(PAIRS, TOK, 64, 64)[0] + [SFTExample(whole, whole)]
    padded, packed = collate_sft(examples, TOK.pad_token_id), collate_packed_sft(
        examples, TOK.pad_token_id)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()
    assert (packed["labels"] != IGNORE_INDEX).sum() == sft.trained_tokens(examples)
    model = load_causal_lm("tiny-llama", TOK, seed=0)
    model.train()
    results = []
    for batch in (padded, packed):
        loss, _ = sft.batch_loss(model, batch, examples)
        loss.backward()
        results += [loss.detach(), _gradients(model)]
    _assert_same(*results)


def test_packed_reward_loss_and_gradients_equal_paddings():
    """Step 2's pairwise loss and accuracy, packed, equal the padded batch's, and so do the
    gradients of the model and its score head."""
    examples = tokenize_pairs(PAIRS, TOK, 64, 64)[0]
    padded, packed = collate_pairs(examples, TOK.pad_token_id), collate_packed_pairs(
        examples, TOK.pad_token_id)
    assert packed["input_ids"].numel() < padded["input_ids"].numel()

    class Scorer(torch.nn.Module):   # what TrainEngine gives steps/reward.py
        def __init__(self, model):
            super().__init__()
            self.model = model

        def sequence_scores(self, input_ids, attention_mask):
            from engine.models import sequence_scores
            return sequence_scores(self.model, input_ids, attention_mask)

        def packed_scores(self, input_ids, position_ids, ends):
            from engine.models import packed_scores
            return packed_scores(self.model, input_ids, position_ids, ends)

    model = load_reward_model("tiny-llama", TOK, seed=0)
    model.train()
    results, accuracies = [], []
    for batch in (padded, packed):
        loss, stats = reward.pair_loss(Scorer(model), batch, examples)
        loss.backward()
        results += [loss.detach(), _gradients(model)]
        accuracies.append(float(stats["train/accuracy"]))
    _assert_same(*results)
    assert accuracies[0] == accuracies[1]
    assert "score.weight" in results[1]


def test_steps_1_and_2_train_the_same_models_packed(tmp_path, monkeypatch):
    """Steps 1 and 2 run end to end (config, collate, loss, optimizer, evaluation, export)
    with sft.packing and rm.packing: the same training losses and held-out results as
    padded, on batches of examples of 3 to 60 tokens."""
    from engine.runtime import Runtime
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (1 + i % 15),
                            " no" * (1 + i % 4)) for i in range(48)]
    packed_batches = []
    for step, collate in ((sft, collate_packed_sft), (reward, collate_packed_pairs)):
        monkeypatch.setattr(step, collate.__name__, lambda batch, pad_token_id, collate=collate:
                            packed_batches.append(len(batch)) or collate(batch, pad_token_id))
    results = []
    for packing in (False, True):
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "actor_model": "tiny-llama", "reward_model": "tiny-llama",
            "output_dir": str(tmp_path / str(packing)), "logging": {"progress": False},
            "data": {"eval_fraction": 0.2},
            "sft": {"packing": packing, "lr": 1e-3}, "rm": {"packing": packing, "lr": 1e-3}})
        cpu = Runtime(device=torch.device("cpu"), dtype=torch.float32)
        results.append({**sft.run(cfg, pairs, cpu), **reward.run(cfg, pairs, cpu)})
        assert bool(packed_batches) == packing   # the packed run's batches, and only its
    padded, packed = results
    for name in ("train/loss", "eval/perplexity", "eval/chosen_score", "eval/rejected_score"):
        assert packed[name] == pytest.approx(padded[name], rel=1e-4), name
    assert padded["eval/perplexity"] < 100   # it trained (untrained: ~260)


# ---------------------------------------------------------------------------------------------
# Step 3 (ppo.packing): rollouts, left-padded prompts and right-padded answers, run packed


def test_unpadded_layout_by_hand():
    """Rows of 4, 4, 1 and 2 real tokens (left-padded prompts of 3 columns, right-padded
    answers, one answer empty) pack into 3 rows 4 wide: [row 0], [row 1], [row 3, row 2];
    each padded position maps back to its token, a pad to its row's nearest real one."""
    P = 0
    ids = torch.tensor([[P, 5, 6, 7, 8, P], [9, 1, 2, 3, P, P], [P, P, 4, P, P, P],
                        [P, 2, 3, P, P, P]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0],
                         [0, 1, 1, 0, 0, 0]])
    layout = unpadded(ids, mask)
    assert torch.equal(layout.input_ids, torch.tensor([[5, 6, 7, 8], [9, 1, 2, 3], [2, 3, 4, 0]]))
    assert torch.equal(layout.position_ids, torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3],
                                                          [0, 1, 0, 0]]))
    assert torch.equal(layout.index, torch.tensor([[0, 0, 1, 2, 3, 3], [4, 5, 6, 7, 7, 7],
                                                   [10] * 6, [8, 8, 9, 9, 9, 9]]))
    back = layout.padded(layout.input_ids)
    assert torch.equal(back[mask.bool()], ids[mask.bool()])
    with pytest.raises(ValueError, match="one run of real tokens"):
        unpadded(ids, torch.tensor([[1, 0, 1, 0, 0, 0]] * 4))


def _rollouts(batch: int = 7, prompt_len: int = 9, answer_len: int = 11):
    """Rollouts as step 3 makes them: prompts of 2 to 9 tokens left-padded, answers of 0 to
    11 right-padded (mask [B, P + N])."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (batch, prompt_len + answer_len), generator=g)
    mask = torch.zeros_like(ids)
    for row in range(batch):
        prompt, answer = 2 + 7 * row // (batch - 1), (answer_len * row) // (batch - 1)
        mask[row, prompt_len - prompt:prompt_len + answer] = 1
    return ids.masked_fill(mask == 0, TOK.pad_token_id), mask, prompt_len


@pytest.mark.parametrize("plain_head", [True, False])
def test_packed_step3_logprobs_entropy_and_logits_equal_padded(plain_head, monkeypatch):
    """The actor's log-probs and entropy of each answer token (with their gradients, as the
    update takes them) and the answers' logits (the KL controller's), run packed, equal
    the padded forward's to rounding; so does a head reduced whole (`plain_head` off)."""
    from steps.ppo import answer_head, answer_logprobs, answer_logprobs_and_entropy
    if not plain_head:
        monkeypatch.setattr("engine.models.PLAIN_HEAD_MODEL_TYPES", frozenset())
    ids, mask, prompt_len = _rollouts()
    real = mask[:, prompt_len:].bool()
    model = load_causal_lm("tiny-llama", TOK, seed=0)
    model.train()
    weights = torch.randn(real.shape, generator=torch.Generator().manual_seed(1)) * real
    results = []
    for packed in (False, True):
        logprobs, entropy = answer_logprobs_and_entropy(model, ids, mask, prompt_len, 0.7,
                                                        entropy_grad=True, packed=packed)
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        results += [(logprobs[real], entropy[real]), _gradients(model)]
        with torch.no_grad():
            alone = answer_logprobs(model, ids, mask, prompt_len, 0.7, packed=packed)
            torch.testing.assert_close(alone[real], logprobs[real].detach())
            logits = answer_head(model, ids, mask, prompt_len, packed)
        results[-2] += (logits[mask[:, prompt_len - 1:].bool()],)
    (padded, packed), (padded_grads, packed_grads) = results[::2], results[1::2]
    for want, got in zip(padded, packed, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert padded_grads.keys() == packed_grads.keys() and "lm_head.weight" in padded_grads
    for name in padded_grads:
        torch.testing.assert_close(packed_grads[name], padded_grads[name], rtol=1e-4,
                                   atol=1e-6, msg=name)


def test_packed_step3_values_and_scores_equal_padded():
    """The critic's values before each answer token (with gradients) and the reward
    model's score at each rollout's last token, packed, equal the padded forward's."""
    from engine.models import sequence_scores, token_values
    ids, mask, prompt_len = _rollouts()
    model = load_reward_model("tiny-llama", TOK, seed=0)
    model.train()
    results = []
    for packed in (False, True):
        values = token_values(model, ids, mask, packed=packed)
        (values * mask).sum().backward()
        with torch.no_grad():
            scores = sequence_scores(model, ids, mask, packed=packed)
        results += [values[mask.bool()].detach(), scores, _gradients(model)]
    torch.testing.assert_close(results[3], results[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[4], results[1], rtol=1e-5, atol=1e-5)
    for name in results[2]:
        torch.testing.assert_close(results[5][name], results[2][name], rtol=1e-4, atol=1e-6,
                                   msg=name)
    assert "score.weight" in results[2]
