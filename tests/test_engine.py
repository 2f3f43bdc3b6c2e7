"""engine/: presets, the byte tokenizer, padding-proof positions and values, atomic export,
gradient accumulation, and the masks of steps/ppo.make_experience on scripted rollouts."""

import copy
import json
import shutil
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from omegaconf import OmegaConf
from peft.tuners.lora import LoraLayer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

import steps.ppo as ppo
from engine.config import SCHEDULER_NAMES, LoraConfig, OptimConfig, QuantizedBaseConfig
from engine.data_parallel import DataParallel, Share
from engine.errors import UserError
from engine.export import atomic_directory
from engine.hybrid import HybridEngine
from engine.lora import apply_lora, linear_names
from engine.models import (
    PRESETS,
    SHAPES,
    byte_tokenizer,
    learned_positions,
    load_causal_lm,
    load_quantized,
    load_reward_model,
    load_tokenizer,
    position_ids,
    preset_config,
    require_positions,
    sequence_scores,
    token_values,
)
from engine.parallel import frozen
from engine.runtime import Runtime
from engine.trainer import TrainEngine
from steps.common import placement
from steps.config import RunConfig
from steps.rlhf import loss_weights, sft_loss
from steps.scoring import Rewards, RewardScorer
from steps.tokenize import collate_prompts

pytestmark = [  # library noise: peft on transformers 5, peft's GPT-2 Conv1D notice
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False:UserWarning"),
]
CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)
PAD, BOS, EOS = 0, 1, 2


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return byte_tokenizer()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate_prompts(rows, PAD)
    return batch["input_ids"], batch["attention_mask"]


def right_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


# ---------------------------------------------------------------------------------------------
# presets and the byte tokenizer


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_builds_as_lm_and_classifier_seeded(tok, preset):
    lm = load_causal_lm(preset, tok, seed=0)
    assert isinstance(lm, PreTrainedModel)
    ids = torch.tensor([tok("hi there")["input_ids"]])
    assert lm(input_ids=ids).logits.shape == (1, ids.shape[1], len(tok))
    assert same_weights(weights(lm), weights(load_causal_lm(preset, tok, seed=0)))
    assert not same_weights(weights(lm), weights(load_causal_lm(preset, tok, seed=1)))

    rm = load_reward_model(preset, tok, seed=0)
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == PAD
    assert rm(input_ids=ids).logits.shape == (1, 1)
    assert same_weights(weights(rm), weights(load_reward_model(preset, tok, seed=0)))
    assert not same_weights(weights(rm), weights(load_reward_model(preset, tok, seed=1)))


def test_tiny_llama_4l_is_tiny_llama_at_four_layers(tok):
    two, four = (load_causal_lm(name, tok, seed=0).config.to_dict()
                 for name in ("tiny-llama", "tiny-llama-4l"))
    assert (two["num_hidden_layers"], four["num_hidden_layers"]) == (2, 4)
    assert {**four, "num_hidden_layers": 2} == two


# parameter counts of the released checkpoints these shapes copy (untied embeddings)
RELEASED = {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320,
            "llama-34b": 33_743_970_304, "llama-70b": 68_976_648_192}


@pytest.mark.parametrize("preset", sorted(SHAPES))
def test_shape_presets_have_the_released_shapes(tok, preset):
    """Built on the meta device: exactly the released model's parameter count; GQA where
    the release has it; refused in full precision, with the flag named."""
    config = preset_config(preset, tok)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == RELEASED[preset]
    assert (config.num_key_value_heads < config.num_attention_heads) == \
        (preset in ("llama-34b", "llama-70b"))
    with pytest.raises(UserError, match=f"--actor-model {preset}: a shape preset is built "
                                        "straight into a quantized base"):
        load_causal_lm(preset, tok)


def test_byte_tokenizer_round_trips_and_saves(tok, tmp_path):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD, BOS, EOS)
    assert tok.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<unk>"]) == [0, 1, 2, 3]
    text = "Héllo, wörld! 你好 🤖\n\ttabs  and  spaces ~`\\ \u200b end"
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS and BOS not in ids[1:]
    assert len(ids) == 1 + len(text.encode("utf-8"))  # one token per byte
    assert tok.decode(ids, skip_special_tokens=True) == text

    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text)["input_ids"] == ids
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (PAD, BOS, EOS)
    assert again.decode(ids, skip_special_tokens=True) == text


def _saved_without_pad(tmp_path, unk: bool, eos: str | None = "</s>") -> str:
    base = byte_tokenizer()
    no_pad = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>",
                                     eos_token=eos, unk_token="<unk>" if unk else None)
    assert no_pad.pad_token_id is None
    no_pad.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a model directory
    return str(tmp_path)


def test_load_tokenizer_sets_a_pad_token_preferring_unk(tmp_path):
    with_unk = load_tokenizer(_saved_without_pad(tmp_path / "a", unk=True))
    assert with_unk.pad_token == "<unk>" and with_unk.pad_token_id not in (None, EOS)
    without_unk = load_tokenizer(_saved_without_pad(tmp_path / "b", unk=False))
    assert without_unk.pad_token_id == without_unk.eos_token_id == EOS
    assert with_unk.padding_side == without_unk.padding_side == "right"


def test_a_tokenizer_without_an_eos_token_is_refused_in_one_line(tmp_path):
    """Answers end at EOS (and rewards are read there): without one, nothing would end."""
    directory = _saved_without_pad(tmp_path, unk=True, eos=None)
    with pytest.raises(UserError) as err:
        load_tokenizer(directory, flag="--reward-model")
    assert str(err.value) == (f"--reward-model {directory}: the tokenizer has no EOS token; "
                              "answers need one")


def test_hub_name_offline_fails_fast_in_one_line():
    start = time.perf_counter()
    with pytest.raises(UserError) as err:
        load_tokenizer("no-such-org/no-such-model")
    assert time.perf_counter() - start < 10
    message = str(err.value)
    assert "\n" not in message
    assert "no-such-org/no-such-model" in message and "offline" in message


def _partial_hub_cache(cache, tok) -> str:
    """A hub cache holding acme/tiny's config and tokenizer but not its weights: a download
    broken off part way."""
    repo = cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    preset_config("tiny-llama", tok).save_pretrained(snapshot)
    tok.save_pretrained(snapshot)
    return "acme/tiny"


def test_partly_cached_hub_model_offline_fails_in_one_line_without_the_network(
        tmp_path, tok, monkeypatch):
    """Unreachable hub, cache without weights: train.py's up-front check names what is
    missing, and a load (chat.py's path) fails in one line without one request to the hub
    (transformers' adapter lookup ignores local_files_only and would retry for ~25 s)."""
    import huggingface_hub.constants
    import huggingface_hub.file_download

    from engine.model_source import check_model_arg
    requests = []

    def no_network(url, *args, **kwargs):
        requests.append(url)
        raise AssertionError(f"requested {url}")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("engine.model_source.hub_offline", lambda: True)
    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_network)
    spec = _partial_hub_cache(tmp_path, tok)
    check_model_arg(spec, "--actor-model", tokenizer=True)   # the tokenizer is there
    with pytest.raises(UserError) as up_front:
        check_model_arg(spec, "--actor-model", own_tokenizer=True)
    assert str(up_front.value).startswith("--actor-model acme/tiny: ")
    assert "only part of it: none of model.safetensors" in str(up_front.value)
    with pytest.raises(UserError) as loading:
        load_causal_lm(spec, tok)
    assert "\n" not in str(loading.value) and "only part of it" in str(loading.value)
    assert requests == []


# ---------------------------------------------------------------------------------------------
# positions and per-token values under padding


def test_position_ids_count_real_tokens_only():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 1, 2, 2, 2]]


# Rotary models (llama, gpt-neox) are blind to a constant position shift and OPT derives
# positions from the mask; GPT-2's absolute positions are what catch a missing position_ids.
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt", "tiny-gpt2"])
def test_left_padding_does_not_change_logits(tok, preset):
    model = load_causal_lm(preset, tok, seed=0).eval()
    rows = [tok("short")["input_ids"], tok("a much longer prompt")["input_ids"]]
    ids, mask = left_pad(rows)
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask,
                       position_ids=position_ids(mask)).logits
        for i, row in enumerate(rows):
            alone = model(input_ids=torch.tensor([row])).logits[0]
            torch.testing.assert_close(padded[i, -len(row):], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-opt", "tiny-gpt2"])
@pytest.mark.parametrize("lora", [False, True])
def test_token_values_match_hf_pooled_logits(tok, preset, lora):
    model = load_reward_model(preset, tok, seed=0)
    if lora:
        model = apply_lora(model, LoraConfig(dim=4))
        with torch.no_grad():  # make the adapters matter (lora_B starts at zero)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.5)
    model.eval()
    rows = [tok("one")["input_ids"], tok("two words here")["input_ids"],
            tok("x")["input_ids"]]
    with torch.no_grad():
        alone = torch.stack([model(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])
        for ids, mask in (right_pad(rows), left_pad(rows)):
            hf = model(input_ids=ids, attention_mask=mask,
                       position_ids=position_ids(mask)).logits[:, 0]
            scores = sequence_scores(model, ids, mask)
            torch.testing.assert_close(scores, hf, atol=1e-5, rtol=0)
            torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)
            values = token_values(model, ids, mask)
            assert values.shape == ids.shape
            for i, row in enumerate(rows):
                real = values[i][mask[i].bool()]
                single = token_values(model, torch.tensor([row]), torch.ones(1, len(row)))[0]
                torch.testing.assert_close(real, single, atol=1e-5, rtol=0)
        if lora:  # the adapters are in the computation, not bypassed by the hook
            plain = model.get_base_model()
            with model.disable_adapter():
                base = sequence_scores(plain, *right_pad(rows))
            assert not torch.allclose(base, alone, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# atomic export


def test_atomic_directory_appears_only_when_written(tmp_path):
    final = tmp_path / "model"

    def write(tmp):
        assert not final.exists() and tmp != final and tmp.parent == final.parent
        (tmp / "weights.bin").write_text("new")
        assert not final.exists()

    assert atomic_directory(final, write) == final
    assert (final / "weights.bin").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_atomic_directory_failed_write_leaves_nothing(tmp_path):
    final = tmp_path / "model"

    def write(tmp):
        (tmp / "half.bin").write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_directory(final, write)
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []  # the temp dir is cleaned up too

    final.mkdir()
    (final / "weights.bin").write_text("old")
    with pytest.raises(RuntimeError):
        atomic_directory(final, write)
    assert (final / "weights.bin").read_text() == "old"  # the finished model survives
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_atomic_directory_replaces_an_existing_dir(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "stale.bin").write_text("old")
    atomic_directory(final, lambda tmp: (tmp / "weights.bin").write_text("new"))
    assert sorted(p.name for p in final.iterdir()) == ["weights.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_atomic_directory_after_a_write_killed_between_or_after_its_renames(tmp_path):
    """A write killed while deleting the model it replaced left a half-deleted
    .model.old-<pid>: the next write under the same pid (containers reuse them) failed at
    the end of training, its model stranded in a hidden directory. Killed between its two
    renames, the replaced model is the only one: put back before the next write."""
    import os
    final, old = tmp_path / "model", tmp_path / f".model.old-{os.getpid()}"
    final.mkdir()
    old.mkdir()
    (old / "half-deleted.bin").write_text("x")
    atomic_directory(final, lambda tmp: (tmp / "weights.bin").write_text("new"))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (final / "weights.bin").read_text() == "new"

    shutil.rmtree(final)
    old.mkdir()   # killed between the renames: the previous model, whole
    (old / "weights.bin").write_text("previous")
    with pytest.raises(RuntimeError):
        atomic_directory(final, lambda tmp: (_ for _ in ()).throw(RuntimeError("disk full")))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (final / "weights.bin").read_text() == "previous"


def test_atomic_directory_removes_an_unfinished_copy_a_killed_write_left(tmp_path):
    """A write killed mid-copy (any process's) left .model.tmp-<pid>, a model's worth of disk:
    the next write removes it, and the finished model it did not reach stays as it was
    until replaced."""
    final, unfinished = tmp_path / "model", tmp_path / ".model.tmp-4194304"
    final.mkdir()
    (final / "weights.bin").write_text("old")
    unfinished.mkdir()
    (unfinished / "half.bin").write_text("partial")
    with pytest.raises(RuntimeError):
        atomic_directory(final, lambda tmp: (_ for _ in ()).throw(RuntimeError("disk full")))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (final / "weights.bin").read_text() == "old"


def test_atomic_directory_puts_the_replaced_model_back_when_the_new_one_cannot_move_in(
        tmp_path, monkeypatch):
    final = tmp_path / "model"
    final.mkdir()
    (final / "weights.bin").write_text("old")
    rename = Path.rename

    def failing_rename(self, target):
        if self.name.startswith(".model.tmp-"):   # the finished copy moving into place
            raise OSError("device busy")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", failing_rename)
    with pytest.raises(OSError, match="device busy"):
        atomic_directory(final, lambda tmp: (tmp / "weights.bin").write_text("new"))
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert (final / "weights.bin").read_text() == "old"


# ---------------------------------------------------------------------------------------------
# TrainEngine


def _engine(model, grad_accum: int) -> TrainEngine:
    return TrainEngine(model, OptimConfig(lr_scheduler="constant"), total_steps=4, runtime=CPU,
                       lr=1e-3, grad_accum=grad_accum)


def _loss(engine: TrainEngine, ids: torch.Tensor) -> torch.Tensor:
    return sft_loss(engine(input_ids=ids).logits, ids)


def test_grad_accumulation_matches_one_full_batch(tok):
    model = load_causal_lm("tiny-llama", tok, seed=0)
    start = weights(model)
    ids = torch.randint(4, len(tok), (4, 12), generator=torch.Generator().manual_seed(0))

    full = _engine(copy.deepcopy(model), grad_accum=1)
    full.backward(_loss(full, ids))
    full_norm = full.step()
    assert full_norm is not None and full.steps == 1

    accum = _engine(copy.deepcopy(model), grad_accum=2)
    accum.backward(_loss(accum, ids[:2]))
    assert accum.step() is None and accum.steps == 0
    assert same_weights(weights(accum.module), start)  # no update after the first half
    accum.backward(_loss(accum, ids[2:]))
    accum_norm = accum.step()
    assert accum_norm is not None and accum.steps == 1
    # the same gradient, not twice it (Adam's step alone would hide a missing 1/grad_accum)
    assert accum_norm == pytest.approx(full_norm, rel=1e-5)

    after_full, after_accum = weights(full.module), weights(accum.module)
    assert not same_weights(after_full, start)
    # Adam's first step moves each weight by lr * g / (|g| + eps) = 1e-3 in size, except
    # where |g| is near eps (1e-8): there a gradient's rounding (two half-batch sums against
    # one) shows up amplified, measured up to 2.7e-6. 5e-6 is 0.5% of the step.
    for name, value in after_full.items():
        torch.testing.assert_close(after_accum[name], value, atol=5e-6, rtol=0, msg=name)


# Learning rate (of 1) after 4 of 6 steps with 2 of warmup: half-way through the decay.
HALF_WAY_LR = {"linear": 0.5, "cosine": 0.5, "cosine_with_restarts": 0.5, "polynomial": 0.5,
               "constant": 1.0, "constant_with_warmup": 1.0, "inverse_sqrt": 0.5 ** 0.5,
               "cosine_with_min_lr": 0.1 + 0.9 * 0.5}


@pytest.mark.parametrize("name", SCHEDULER_NAMES)
def test_every_schedule_the_config_allows_trains(tok, name):
    """Each allowed name builds and steps (three once allowed raised, one only at its
    first step), at the hand-computed rate."""
    engine = TrainEngine(load_causal_lm("tiny-llama", tok, seed=0),
                         OptimConfig(lr_scheduler=name, warmup_steps=2), total_steps=6,
                         runtime=CPU, lr=1.0)
    ids = torch.tensor([[5, 6, 7, 8]])
    for step in range(4):
        engine.backward(_loss(engine, ids))
        assert engine.step() is not None
        if step == 0 and name != "constant":   # logged as train/lr: the rate the update
            # used, 0 at warmup's start
            assert engine.applied_lr == 0.0 and engine.lr == 0.5
    assert engine.lr == pytest.approx(HALF_WAY_LR[name], abs=1e-6)


def test_warmup_ratio_warms_up_over_its_share_of_the_steps_rounded_up(tok):
    """warmup_ratio=0.34 of 6 steps: ceil(2.04) = 3 steps of warmup, so the linear
    schedule's rate is 1/3, 2/3, then 1 at its peak, and decays over the 3 steps left."""
    engine = TrainEngine(load_causal_lm("tiny-llama", tok, seed=0),
                         OptimConfig(lr_scheduler="linear", warmup_ratio=0.34), total_steps=6,
                         runtime=CPU, lr=1.0)
    ids, rates = torch.tensor([[5, 6, 7, 8]]), []
    for _ in range(4):
        engine.backward(_loss(engine, ids))
        engine.step()
        rates.append(engine.lr)
    assert rates == pytest.approx([1 / 3, 2 / 3, 1.0, 2 / 3], abs=1e-6)


def test_lora_params_get_their_own_learning_rate(tok):
    model = apply_lora(load_causal_lm("tiny-llama", tok, seed=0), LoraConfig(dim=4))
    engine = TrainEngine(model, OptimConfig(weight_decay=0.1), total_steps=4, runtime=CPU,
                         lr=1e-3, lora_lr=5e-4)
    lora = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert lora
    seen = set()
    for group in engine.optimizer.param_groups:
        kinds = {id(p) in lora for p in group["params"]}
        assert len(kinds) == 1, "a group mixes LoRA and base parameters"
        assert group["lr"] == (5e-4 if kinds == {True} else 1e-3)
        assert all((p.ndim >= 2) == (group["weight_decay"] == 0.1) for p in group["params"])
        seen |= {id(p) for p in group["params"]}
    assert seen == {id(p) for p in model.parameters() if p.requires_grad}


# ---------------------------------------------------------------------------------------------
# make_experience: masks and alignment on scripted, left-padded rollouts


N = 5


class Scripted(NamedTuple):
    models: ppo.Models
    reward: PreTrainedModel          # the reward model inside models.rewards
    prompt_rows: list[list[int]]
    prompt_ids: torch.Tensor         # [3, P] left-padded
    prompt_mask: torch.Tensor
    answers: torch.Tensor            # [3, N]


def scripted_step3(tok, preset: str) -> Scripted:
    """Step 3's models (actor, critic, reference, reward model: tiny, seeded), three
    left-padded prompts and the answers a scripted rollout gives them."""
    actor = HybridEngine(load_causal_lm(preset, tok, seed=1), OptimConfig(), 1, CPU, lr=1e-3)
    ref = frozen(load_causal_lm(preset, tok, seed=2), CPU)
    critic = TrainEngine(load_reward_model(preset, tok, seed=3), OptimConfig(), 1, CPU, lr=1e-3)
    reward = frozen(load_reward_model(preset, tok, seed=4), CPU)
    rewards = Rewards(tok, RewardScorer(reward, tok, tok, CPU.device), 1.0, None, 0.0)
    models = ppo.Models(actor, critic, ref, rewards, tok, tok)
    prompt_rows = [tok(t)["input_ids"] for t in ("Hi", "Hello there, how are you?", "Q: 2+2")]
    prompt_ids, prompt_mask = left_pad(prompt_rows)
    a, b, c, d, e = tok("abcde", add_special_tokens=False)["input_ids"]
    answers = torch.tensor([[a, b, EOS, PAD, PAD],   # ends early, then padding
                            [a, b, c, d, e],         # runs to the limit, no EOS
                            [EOS, PAD, PAD, PAD, PAD]])  # empty answer
    return Scripted(models, reward, prompt_rows, prompt_ids, prompt_mask, answers)


def scripted_round(tok, monkeypatch, **ppo_settings):
    """One round of step 3 on scripted_step3's models and rollout, under `ppo_settings`:
    (models, settings, data parallel, experience)."""
    models, _, _, prompt_ids, prompt_mask, answers = scripted_step3(tok, "tiny-llama")
    monkeypatch.setattr(models.actor, "generate", lambda input_ids, *_, **__:
                        torch.cat([input_ids, answers], dim=1))
    settings = ppo.resolve(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                           {"ppo": ppo_settings}))
    dp = DataParallel(CPU)
    exp, _ = ppo.make_experience(models, {"input_ids": prompt_ids,
                                          "attention_mask": prompt_mask}, settings, dp,
                                 kl_coef=0.1)
    return models, settings, dp, exp


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])  # rotary / absolute positions
def test_make_experience_masks_and_alignment(tok, monkeypatch, preset):
    models, reward, prompt_rows, prompt_ids, prompt_mask, answers = scripted_step3(tok, preset)
    actor, critic, ref = models.actor, models.critic, models.reference
    calls = []

    def scripted_generate(input_ids, attention_mask, sampling, *, eos_token_id,
                          pad_token_id, row_seeds, group_size):
        calls.append((row_seeds, group_size))
        assert torch.equal(input_ids, prompt_ids) and torch.equal(attention_mask, prompt_mask)
        assert (eos_token_id, pad_token_id, sampling.max_new_tokens) == (EOS, PAD, N)
        return torch.cat([input_ids, answers], dim=1)

    monkeypatch.setattr(actor, "generate", scripted_generate)
    settings = ppo.resolve(OmegaConf.merge(OmegaConf.structured(RunConfig), {"ppo": dict(
        kl_coef=0.1, score_clip=5.0, gamma=1.0, lam=0.95, whiten_advantages=True,
        max_new_tokens=N)}))
    exp, timing = ppo.make_experience(
        models, {"input_ids": prompt_ids, "attention_mask": prompt_mask}, settings,
        DataParallel(CPU), kl_coef=0.1)

    assert calls == [(None, 1)]
    assert actor.module.training and critic.module.training  # modes restored
    P = prompt_ids.shape[1]
    assert exp.prompt_len == P
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).float()
    assert torch.equal(exp.action_mask, expected)
    assert torch.equal(exp.attention_mask, torch.cat([prompt_mask, expected.long()], dim=1))
    for name, value in exp._asdict().items():
        assert not value.float().isnan().any(), name
        assert value.float().isfinite().all(), name
    assert all(v >= 0 for v in timing.values())

    outside = expected == 0
    for name in ("rewards", "advantages", "returns", "values", "kl"):
        assert (getattr(exp, name)[outside] == 0).all(), name

    # the clipped score sits on the last action only; the rest of the reward is the KL part
    kl_part = -settings.ppo.kl_coef * exp.kl
    score_part = exp.rewards - kl_part
    last = torch.tensor([2, N - 1, 0])
    onehot = torch.zeros(3, N)
    onehot[torch.arange(3), last] = 1
    torch.testing.assert_close(score_part, onehot * exp.scores.clamp(-5, 5)[:, None],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(exp.kl, (exp.logprobs - exp.ref_logprobs) * expected)

    # every row against a direct forward of its real tokens alone: padding shifts nothing
    with torch.no_grad():
        for i, prompt in enumerate(prompt_rows):
            n = int(expected[i].sum())
            real = torch.tensor([prompt + answers[i, :n].tolist()])
            start = len(prompt) - 1
            for model, got in ((actor.module, exp.logprobs), (ref, exp.ref_logprobs)):
                logits = model(input_ids=real).logits[0, start:start + n]
                want = torch.log_softmax(logits, -1).gather(-1, real[0, len(prompt):, None])
                torch.testing.assert_close(got[i, :n], want[:, 0], atol=1e-5, rtol=0)
            values = token_values(critic.module, real, torch.ones_like(real))[0]
            torch.testing.assert_close(exp.values[i, :n], values[start:start + n], atol=1e-5,
                                       rtol=0)
            # scored as the reward model was trained to read: at EOS, appended if cut off
            read = real if real[0, -1] == EOS else torch.cat([real, torch.tensor([[EOS]])], 1)
            score = sequence_scores(reward, read, torch.ones_like(read))[0]
            torch.testing.assert_close(exp.scores[i], score, atol=1e-5, rtol=0)


def test_critic_warmup_trains_the_critic_alone_first(tok, monkeypatch):
    """ppo.critic_warmup=1: the first iteration's update moves the critic and leaves the
    actor as it was (no policy statistics, no actor gradient norm); the second moves the
    actor too."""
    models, settings, dp, exp = scripted_round(
        tok, monkeypatch, max_new_tokens=N, rollout_batch_size=3, micro_batch_size=3,
        target_kl=None, critic_warmup=1)

    def weights(engine) -> list[torch.Tensor]:
        return [p.detach().clone() for p in engine.parameters()]

    for iteration, actor_trains in ((0, False), (1, True)):
        actor, critic = weights(models.actor), weights(models.critic)
        stats, _ = ppo.update(exp, Share([], [0, 1, 2], 1.0), 3, models, settings, dp, [], 0,
                              None, iteration, 0.1)
        assert stats["train/updates"] == 1 and "train/value_loss" in stats
        assert ("train/policy_loss" in stats) == ("train/grad_norm" in stats) == actor_trains
        moved = [[not torch.equal(p, q) for p, q in zip(weights(engine), before, strict=True)]
                 for engine, before in ((models.critic, critic), (models.actor, actor))]
        assert any(moved[1]) == actor_trains
        assert any(moved[0]) or iteration   # (its 1-step schedule is spent at the second)


def test_a_critic_warmup_as_long_as_the_run_is_refused():
    """ppo.critic_warmup covering every iteration would end step 3 with the SFT actor."""
    def config(warmup: int):
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "ppo": dict(critic_warmup=warmup)})).ppo

    ppo.check_critic_warmup(config(0), 1)
    ppo.check_critic_warmup(config(3), 4)
    with pytest.raises(UserError, match=r"^ppo.critic_warmup=4 freezes the actor for all 4 "
                                        r"iterations .* set it below 4$"):
        ppo.check_critic_warmup(config(4), 4)


def test_mask_truncated_leaves_cut_off_answers_out_of_the_losses(tok, monkeypatch):
    """ppo.mask_truncated: the answer cut off without EOS (row 1) keeps its actions, score
    and advantages (its group's statistics and the metrics see it) and loses its loss
    weights: the update trains as it does on the two answers that ended alone."""
    runs = []
    for masked in (True, False):
        models, settings, dp, exp = scripted_round(
            tok, monkeypatch, max_new_tokens=N, rollout_batch_size=3, micro_batch_size=3,
            target_kl=None, mask_truncated=masked)
        ended = torch.tensor([1.0, 0.0, 1.0])[:, None]
        if masked:
            assert torch.equal(exp.loss_mask, exp.action_mask * ended)
            assert exp.action_mask[1].sum() == N and exp.advantages[1].abs().sum() > 0
            share, size = Share([], [0, 1, 2], 1.0), 3
        else:   # the rows that ended, alone
            assert torch.equal(exp.loss_mask, exp.action_mask)
            exp, share, size = exp.rows(torch.tensor([0, 2])), Share([], [0, 1], 1.0), 2
        stats, _ = ppo.update(exp, share, size, models, settings, dp, [], 0, None, 0, 0.1)
        runs.append((stats, [p.detach() for p in models.actor.parameters()]))
    (masked, masked_weights), (alone, alone_weights) = runs
    assert masked["trained_tokens"] == alone["trained_tokens"] == 3 + 1
    for name, value in alone.items():
        assert masked[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    for p, q in zip(masked_weights, alone_weights, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6)


def test_a_micro_batch_of_cut_off_answers_alone_makes_no_update(tok, monkeypatch):
    """ppo.mask_truncated on a micro-batch whose every answer was cut off: no loss weight is
    left, and no optimizer step is taken (Adam's momentum would still move the weights)."""
    models, settings, dp, exp = scripted_round(
        tok, monkeypatch, max_new_tokens=N, rollout_batch_size=3, micro_batch_size=1,
        target_kl=None, mask_truncated=True)
    # one update on an answer that ended moves the actor: the model can train here
    before = [p.detach().clone() for p in models.actor.parameters()]
    stats, _ = ppo.update(exp.rows(torch.tensor([0])), Share([], [0], 1.0), 1, models,
                          settings, dp, [], 0, None, 0, 0.1)
    assert stats["train/updates"] == 1 and stats["trained_tokens"] == 3
    moved = [p.detach().clone() for p in models.actor.parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(before, moved, strict=True))
    # row 1 was cut off (no EOS): its rows alone give nothing to train on
    assert exp.action_mask[1].sum() == N and exp.loss_mask[1].sum() == 0
    stats, _ = ppo.update(exp.rows(torch.tensor([1])), Share([], [0], 1.0), 1, models,
                          settings, dp, [], 0, None, 0, 0.1)
    assert stats["train/updates"] == 0 and stats["trained_tokens"] == 0
    assert all(torch.equal(p, q) for p, q in zip(models.actor.parameters(), moved,
                                                 strict=True))


def test_forward_batches_equal_one_pass(tok, monkeypatch):
    """ppo.forward_batch_size=1: the experience (log-probs, reference log-probs, values,
    scores) and one update of actor and critic (KL in the loss) equal one pass over the
    micro-batch; and a second update past ppo.target_kl moves nothing either way, though
    the chunked one has backpropagated its first parts before the bound is known."""
    runs = {}
    for size in (None, 1):
        models, settings, dp, exp = scripted_round(
            tok, monkeypatch, algorithm="ppo", kl_penalty="loss", kl_coef=0.1,
            max_new_tokens=N, forward_batch_size=size, target_kl=1e-3)
        weights, count = loss_weights(exp.action_mask, "token-mean")
        update = (exp, models, settings, 0.1, (weights, weights), float(count), None, dp)
        first = ppo.train_on(*update)
        after_first = [p.detach().clone() for p in models.actor.parameters()]
        assert ppo.train_on(*update) is None   # moved 1e-3 nats from the sampling policy
        assert all(torch.equal(p, q) for p, q in zip(models.actor.parameters(), after_first,
                                                     strict=True))
        assert all(p.grad is None for p in models.actor.parameters())
        runs[size] = (exp, first, after_first,
                      [p.detach().clone() for p in models.critic.parameters()])
    (exp, (stats, norms), actor, critic), (exp1, (stats1, norms1), actor1, critic1) = \
        runs[None], runs[1]
    for name in ("logprobs", "ref_logprobs", "values", "scores", "advantages"):
        torch.testing.assert_close(getattr(exp1, name), getattr(exp, name), atol=1e-6, rtol=0)
    assert stats1.keys() == stats.keys() and norms1.keys() == norms.keys()
    for name in stats:
        assert stats1[name] == pytest.approx(stats[name], abs=1e-6), name
    for name in norms:
        assert norms1[name] == pytest.approx(norms[name], rel=1e-5), name
    for p, q in zip(actor1 + critic1, actor + critic, strict=True):
        # Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps a
        # rounding of g moves it by up to lr (1e-3). 1 of 65,536 weights did by 8.7e-6 on
        # this machine's MKL; all others within 2e-6
        off = (p - q).abs()
        assert (off > 2e-6).sum() <= max(1, p.numel() // 10_000) and off.max() <= 1e-3
    assert any(not torch.equal(p, q) for p, q in zip(
        actor, [p.detach() for p in scripted_step3(tok, "tiny-llama").models.actor.parameters()],
        strict=True))   # the first update did move the actor


# ---------------------------------------------------------------------------------------------
# loading checkpoints: of the right kind, fitting the data and the tokenizer


def saved(model: PreTrainedModel, tok, directory) -> str:
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def step3_models(actor: str, reward: str, engine: dict | None = None,
                 **ppo_settings) -> ppo.Models:
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig),
                          {"ppo": ppo_settings, "engine": engine or {}})
    return ppo.build_models(cfg, placement(cfg, CPU), byte_tokenizer(), actor, reward, 1, {})


def test_step3_refuses_a_checkpoint_of_the_wrong_kind(tok, tmp_path):
    """A causal LM as ppo.reward_path, a reward model as ppo.actor_path: one line each,
    rather than a freshly initialised (random) score or LM head training on silently."""
    lm = saved(load_causal_lm("tiny-llama", tok), tok, tmp_path / "actor")
    rm = saved(load_reward_model("tiny-llama", tok), tok, tmp_path / "reward")
    with pytest.raises(UserError, match=rf"^ppo.reward_path {lm}: a causal LM "
                                        r"\(LlamaForCausalLM\), not a reward model: .*random"):
        step3_models(lm, lm)
    with pytest.raises(UserError, match=rf"^ppo.actor_path {rm}: a reward model "
                                        r"\(LlamaForSequenceClassification\), not a causal LM"):
        step3_models(rm, rm)
    with pytest.raises(UserError, match=rf"^ppo.actor_path {rm}: a reward model"):
        step3_models(rm, rm, {"quantized_base": {"enabled": True}}, actor_lora={"dim": 4})
    models = step3_models(lm, rm)   # the critic starts from the reward model
    assert models.critic is not None and models.rewards.scorer is not None


def test_normalize_reward_standardises_the_reward_models_scores_by_its_config(tok, tmp_path):
    """ppo.normalize_reward: every score step 3 takes from the reward model is (score -
    score_mean) / score_std, as its config.json says (OpenRLHF's mean and std too); a
    reward model without them, or with a std of 0, is refused in one line."""
    lm = saved(load_causal_lm("tiny-llama", tok), tok, tmp_path / "actor")
    reward = load_reward_model("tiny-llama", tok, seed=4)
    reward.config.update({"score_mean": 0.75, "score_std": 0.5})
    rm = saved(reward, tok, tmp_path / "reward")
    sequences = torch.tensor([tok("Q: 1+1 A: 2")["input_ids"] + [tok.eos_token_id],
                              tok("Q: 3+1 A: 9")["input_ids"] + [tok.eos_token_id]])
    mask, prompt_len = torch.ones_like(sequences), len(tok("Q: 1+1")["input_ids"])
    raw = step3_models(lm, rm).rewards(sequences, mask, prompt_len)
    standardised = step3_models(lm, rm, normalize_reward=True).rewards(sequences, mask,
                                                                       prompt_len)
    assert float((raw[0] - raw[1]).abs()) > 1e-3   # two different scores, each standardised
    torch.testing.assert_close(standardised, (raw - 0.75) / 0.5, atol=1e-6, rtol=0)

    config = tmp_path / "reward" / "config.json"
    fields = json.loads(config.read_text())
    openrlhf = {k: v for k, v in fields.items() if not k.startswith("score_")}
    config.write_text(json.dumps({**openrlhf, "mean": -1.0, "std": 2.0}))
    torch.testing.assert_close(step3_models(lm, rm, normalize_reward=True).rewards(
        sequences, mask, prompt_len), (raw + 1.0) / 2.0, atol=1e-6, rtol=0)
    config.write_text(json.dumps(openrlhf))
    with pytest.raises(UserError, match=rf"^ppo.normalize_reward=true: the reward model "
                                        rf"ppo.reward_path {rm} has no score statistics"):
        step3_models(lm, rm, normalize_reward=True)
    config.write_text(json.dumps({**openrlhf, "score_mean": 0.5, "score_std": 0.0}))
    with pytest.raises(UserError, match=r"has score_mean=0.5, score_std=0.0 in its config.json; "
                                        r"a finite mean and a std above 0 are needed"):
        step3_models(lm, rm, normalize_reward=True)


@pytest.mark.parametrize("how", ["mean", "min", "mean_minus_std"])
def test_extra_reward_paths_score_as_an_ensemble_of_the_reward_models(tok, tmp_path, how):
    """ppo.extra_reward_paths: step 3's reward is the ensemble of every reward model's own
    score (each standardised by its own statistics), combined per answer by
    ppo.reward_ensemble; the critic still starts from ppo.reward_path's."""
    lm = saved(load_causal_lm("tiny-llama", tok), tok, tmp_path / "actor")
    paths = []
    for seed, (mean, std) in enumerate([(-1.0, 0.5), (0.5, 2.0), (0.0, 1.0)], start=4):
        reward = load_reward_model("tiny-llama", tok, seed=seed)
        reward.config.update({"score_mean": mean, "score_std": std})
        paths.append(saved(reward, tok, tmp_path / f"reward{seed}"))
    sequences = torch.tensor([tok("Q: 1+1 A: 2")["input_ids"] + [tok.eos_token_id],
                              tok("Q: 3+1 A: 9")["input_ids"] + [tok.eos_token_id]])
    mask, prompt_len = torch.ones_like(sequences), len(tok("Q: 1+1")["input_ids"])
    alone = torch.stack([step3_models(lm, path, normalize_reward=True).rewards(
        sequences, mask, prompt_len) for path in paths])   # [3 models, 2 answers]
    models = step3_models(lm, paths[0], normalize_reward=True, extra_reward_paths=paths[1:],
                          reward_ensemble=how, reward_ensemble_coef=0.5)
    by_hand = {"mean": alone.mean(0), "min": alone.min(0).values,
               "mean_minus_std": alone.mean(0) - 0.5 * (
                   ((alone - alone.mean(0)) ** 2).mean(0) ** 0.5)}[how]
    torch.testing.assert_close(models.rewards(sequences, mask, prompt_len), by_hand,
                               atol=1e-6, rtol=0)
    # models that disagree, and an ensemble that is not ppo.reward_path's model alone
    assert float((alone[0] - alone[1]).abs().max()) > 1e-3
    assert float((by_hand - alone[0]).abs().min()) > 1e-3
    assert models.critic is not None


def test_a_fresh_head_is_still_made_where_it_is_wanted(tok, tmp_path):
    """Step 2's reward model and the critic start from a causal LM with a new score head;
    a config.json without `architectures` cannot tell its kind, so it loads."""
    lm = saved(load_causal_lm("tiny-llama", tok), tok, tmp_path / "actor")
    assert load_reward_model(lm, tok).config.num_labels == 1
    place = placement(OmegaConf.structured(RunConfig), CPU)
    critic = place.reward_model(lm, tok, trained=True, flag="ppo.actor_path")
    assert critic.config.architectures == ["LlamaForCausalLM"]
    config = tmp_path / "actor" / "config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items()
                                  if k != "architectures"}))
    assert load_reward_model(lm, tok, trained_head=True).config.num_labels == 1


@pytest.mark.parametrize("preset, limit", [("tiny-gpt2", 1024), ("tiny-opt", 1024),
                                           ("tiny-llama", None), ("tiny-gpt-neox", None)])
def test_learned_position_embeddings_bound_the_sequence_length(tok, preset, limit):
    """GPT-2 and OPT index a table of positions (one past it: IndexError deep in the
    forward); rotary Llama and GPT-NeoX have no such bound."""
    model = load_causal_lm(preset, tok)
    assert learned_positions(model) == limit
    if limit is not None:
        with pytest.raises(IndexError):
            model(input_ids=torch.full((1, limit + 1), 5))
        require_positions(model, limit, "data.max_prompt_len=1000 + x=24", "--actor-model m")
        with pytest.raises(UserError, match=rf"^data.max_prompt_len=1000 \+ x=25: sequences of "
                                            rf"up to {limit + 1} tokens, but --actor-model m "
                                            rf"\({model.config.model_type}, .*most {limit}"):
            require_positions(model, limit + 1, "data.max_prompt_len=1000 + x=25",
                              "--actor-model m")
    else:
        require_positions(model, 10**6, "data.max_prompt_len", "--actor-model m")


def test_step3_refuses_rollouts_longer_than_learned_positions(tok, tmp_path):
    """tiny-gpt2 reads 1024 positions: a rollout of 1000 + 24 tokens fits the actor, not the
    reward model, which reads one more (the EOS a cut-off answer gets)."""
    lm = saved(load_causal_lm("tiny-gpt2", tok), tok, tmp_path / "actor")
    rm = saved(load_reward_model("tiny-gpt2", tok), tok, tmp_path / "reward")

    def build(prompt: int, answer: int):
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"data": dict(
            max_prompt_len=prompt, max_answer_len=answer)})
        return ppo.build_models(cfg, placement(cfg, CPU), tok, lm, rm, 1, {})

    with pytest.raises(UserError, match=rf"^data.max_prompt_len=2000 \+ ppo.max_new_tokens=2000 "
                                        rf".*but ppo.reward_path {rm} \(gpt2, .* 1024"):
        build(2000, 2000)
    with pytest.raises(UserError, match=rf"EOS the reward model reads: .*ppo.reward_path {rm}"):
        build(1000, 24)
    assert build(1000, 23).critic is not None


def test_a_tokenizer_larger_than_the_embedding_is_refused(tok, tmp_path, opt_tokenizer_path):
    """tokenizer=DIR of another model (OPT's 50k tokens over a 260-token model): one line
    naming both, on every load path, rather than an IndexError in the first forward."""
    model = saved(load_causal_lm("tiny-llama", tok), tok, tmp_path / "m")
    opt = load_tokenizer(model, tokenizer=str(opt_tokenizer_path))
    said = rf"^--actor-model {model}: the model embeds 260 tokens, the tokenizer .*opt has 50265"
    with pytest.raises(UserError, match=said):
        load_causal_lm(model, opt)
    with pytest.raises(UserError, match=said.replace("--actor-model", "--reward-model")):
        load_reward_model(model, opt)
    with pytest.raises(UserError, match=said):
        load_quantized("causal_lm", model, opt, QuantizedBaseConfig(True), dtype=torch.float32,
                       head_dtype=torch.float32, device=torch.device("cpu"))
    assert load_causal_lm(model, tok).config.vocab_size == len(tok)


@pytest.mark.parametrize("preset, linear", [("tiny-llama", "q_proj, k_proj"),
                                            ("tiny-gpt2", "c_attn, c_proj, c_fc")])  # Conv1D
def test_lora_targets_that_match_nothing_are_named(tok, preset, linear):
    """peft's NoMatchingPeftModuleError (or its 'not supported' ValueError) as one line naming
    the key and some Linear layers the model has."""
    with pytest.raises(UserError, match=rf"^sft.lora.target_modules=\[nonexistent\]: matches "
                                        rf"no module of the model; .*\({linear}.*all-linear$"):
        apply_lora(load_causal_lm(preset, tok), LoraConfig(dim=4, target_modules=["nonexistent"]),
                   "sft.lora")
    with pytest.raises(UserError, match=r"^lora.target_modules=\[ln_f,norm\]: .*Linear"):
        apply_lora(load_causal_lm(preset, tok), LoraConfig(dim=4, target_modules=["ln_f", "norm"]))


@pytest.mark.parametrize("preset, embedding", [("tiny-llama", "embed_tokens"),
                                               ("tiny-gpt2", "wte")])
def test_lora_targets_are_linear_layers(tok, preset, embedding):
    """peft adapts an embedding too, but the hybrid engine folds LoRA into Linear layers
    only: step 3 sampled from the base embedding while training its adapter. Refused; one
    name given as a string is that name (peft read it as a regex over full names, matching
    nothing, and the error suggested that very name)."""
    first = linear_names(load_causal_lm(preset, tok))[0]
    with pytest.raises(UserError, match=rf"^lora.target_modules=\[{embedding},{first}\]: "
                                        rf"{embedding} is not a Linear layer"):
        apply_lora(load_causal_lm(preset, tok),
                   LoraConfig(dim=4, target_modules=[embedding, first]))
    model = apply_lora(load_causal_lm(preset, tok), LoraConfig(dim=4, target_modules=first))
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert adapted == {first}


def test_a_merged_export_leaves_the_adapters_base_as_it_was(tok, tmp_path):
    """peft renamed the live adapter's base to the meta copy's (none) as the merged export
    wrapped it, with a warning on every LoRA export; a later adapter export of the same
    model would have named no base, which chat.py refuses."""
    model = load_causal_lm("tiny-llama", tok)
    model.name_or_path = "tiny-llama"   # as engine/placement.py names a trained model
    peft_model = apply_lora(model, LoraConfig(dim=4, only_optimize_lora=True))
    engine = TrainEngine(peft_model, OptimConfig(), 1, CPU, lr=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.export(tok, tmp_path / "merged")
    assert not [w for w in caught if "renamed" in str(w.message)]
    assert peft_model.peft_config["default"].base_model_name_or_path == "tiny-llama"


def test_step3_names_its_lora_section(tok, tmp_path):
    lm = saved(load_causal_lm("tiny-llama", tok), tok, tmp_path / "actor")
    rm = saved(load_reward_model("tiny-llama", tok), tok, tmp_path / "reward")
    for key in ("actor_lora", "critic_lora"):
        with pytest.raises(UserError, match=rf"^ppo.{key}.target_modules=\[nope\]: matches no"):
            step3_models(lm, rm, **{key: {"dim": 4, "target_modules": ["nope"]}})
