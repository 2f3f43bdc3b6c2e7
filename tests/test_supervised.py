"""Steps 1 and 2's shared loop (steps/supervised.py): what an accumulation window trains."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from engine.config import OptimConfig
from engine.data_parallel import DataParallel
from engine.errors import NonFiniteError, UserError
from engine.models import (
    add_embedding_noise,
    byte_tokenizer,
    load_causal_lm,
    load_reward_model,
    position_ids,
    sequence_scores,
)
from engine.runtime import Runtime, seed_everything
from engine.tracking import read_metrics
from engine.trainer import TrainEngine
from steps import reward, sft, supervised
from steps.common import num_batches
from steps.config import RunConfig
from steps.data import PreferencePair, train_eval_split
from steps.rlhf import sft_loss
from steps.tokenize import collate_sft, tokenize_preferences, tokenize_sft

CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)
TOK = byte_tokenizer()
# answers of 3 to 43 tokens: a mean per micro-batch would weigh the short ones' tokens more
EXAMPLES = tokenize_sft([PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (1 + 4 * i),
                                        " no") for i in (2, 0, 1, 4, 3)], TOK, 64, 64)[0]


def train(batch_size: int, grad_accum: int) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Step 1's loop over EXAMPLES for one epoch: its logged rows and final weights."""
    section = SimpleNamespace(epochs=1, batch_size=batch_size, grad_accum=grad_accum,
                              log_every=1, eval_every=0)
    steps = num_batches(num_batches(len(EXAMPLES), batch_size), grad_accum)
    engine = TrainEngine(load_causal_lm("tiny-llama", TOK, seed=0),
                         OptimConfig(lr_scheduler="constant", grad_clip=0), steps, CPU,
                         lr=1e-3, grad_accum=grad_accum)
    task = SimpleNamespace(step=1, section=section, examples=EXAMPLES, loss=sft.batch_loss,
                           collate=partial(collate_sft, pad_token_id=TOK.pad_token_id),
                           tokens=sft.trained_tokens)
    rows = []
    supervised._train(OmegaConf.create({"seed": 0, "logging": {"progress": False}}), task,
                      engine, DataParallel(CPU), SimpleNamespace(save_if_due=lambda *a: None),
                      SimpleNamespace(log=lambda row, step: rows.append(row)),
                      {"epoch": 0, "batch": 0, "tokens": 0, "seconds": 0.0, "loss": 0.0})
    assert engine.steps == steps == len(rows)
    return rows, {name: p.detach().clone() for name, p in engine.module.named_parameters()}


def test_k_batches_of_b_train_what_one_batch_of_k_times_b_does():
    """Batches of 1 accumulated in windows of 2 against batches of 2: the same windows of
    examples (5 of them: 2, 2, then a short last 1), so the same gradients, losses and
    weights. A micro-batch's own mean weighed a 3-token answer's tokens like a 43-token
    one's (the gradient differed by 83%), and the short last window was never applied."""
    (whole, whole_weights), (accumulated, accumulated_weights) = train(2, 1), train(1, 2)
    for one, other in zip(whole, accumulated, strict=True):
        for name in ("train/loss", "train/grad_norm"):
            assert other[name] == pytest.approx(one[name], rel=1e-5), name
    # the weights' change as a whole: Adam moves each weight by about its lr, and where a
    # gradient is near Adam's eps, summing it in two halves shows up amplified in that one
    # weight (2 of 65536 off by 1.6e-5 after 3 steps), as in test_engine's window test
    start = load_causal_lm("tiny-llama", TOK, seed=0).state_dict()
    moved = torch.cat([(whole_weights[n] - start[n]).flatten() for n in start])
    differ = torch.cat([(accumulated_weights[n] - whole_weights[n]).flatten() for n in start])
    assert float(differ.norm() / moved.norm()) < 1e-3


@pytest.mark.parametrize("step", [sft, reward])
def test_steps_1_and_2_refuse_lengths_past_learned_positions_before_training(step, tmp_path):
    """tiny-gpt2 reads 1024 positions: 1000 + 100 tokens would stop in an IndexError deep
    in the first forward; refused in one line naming both keys and the model."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(8)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-gpt2", "reward_model": "tiny-gpt2", "output_dir": str(tmp_path),
        "data": {"max_prompt_len": 1000, "max_answer_len": 100}})
    flag = "--actor-model" if step is sft else "--reward-model"
    with pytest.raises(UserError, match=rf"^data.max_prompt_len=1000 \+ data.max_answer_len=100:"
                                        rf" .* but {flag} tiny-gpt2 \(gpt2, .* 1024"):
        step.run(cfg, pairs, CPU)
    assert not any(tmp_path.iterdir())   # nothing written


def test_step_1_refuses_a_reward_model_as_its_actor(tmp_path):
    """Its LM head would start random: refused, naming the flag (as step 3 does)."""
    load_reward_model("tiny-llama", TOK).save_pretrained(tmp_path / "reward")
    TOK.save_pretrained(tmp_path / "reward")
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(8)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": str(tmp_path / "reward"), "output_dir": str(tmp_path / "out")})
    with pytest.raises(UserError, match=r"^--actor-model .*reward: a reward model .*, not a "
                                        r"causal LM"):
        sft.run(cfg, pairs, CPU)


@pytest.mark.parametrize("step", [sft, reward])
def test_steps_1_and_2_refuse_an_export_the_host_cannot_hold_before_training(step, tmp_path,
                                                                            monkeypatch):
    """The export is written from an fp32 copy on the host (LoRA merged in): a model whose
    copy the host cannot hold trained to the end, then was killed writing it. Refused in one
    line before the first update, with no metrics written."""
    import steps.common

    monkeypatch.setattr(steps.common, "host_memory_bytes", lambda: 2 ** 20)
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(8)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-llama", "reward_model": "tiny-llama", "output_dir": str(tmp_path)})
    with pytest.raises(UserError, match=rf"^step {1 if step is sft else 2}'s export: writing "
                                        r"the model takes .* GiB of fp32 on the host, which has "
                                        r"0 GiB; train on a machine with more memory"):
        step.run(cfg, pairs, CPU)
    assert not list(tmp_path.rglob("metrics.jsonl"))


@pytest.mark.parametrize("step", [sft, reward])
def test_a_model_that_evaluates_to_nan_is_not_exported(step, tmp_path, monkeypatch):
    """Each update checks the weights are finite, but finite weights can still overflow on
    held-out data (step 1 at sft.lr=1e38 exported a model whose eval perplexity was NaN):
    the step stops before its export, the evaluation logged."""
    nan = float("nan")
    if step is sft:
        monkeypatch.setattr(sft, "perplexity", lambda *args: nan)
    else:
        monkeypatch.setattr(reward, "evaluate", lambda *args: {"eval/accuracy": 0.5,
                                                              "eval/chosen_score": nan})
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(8)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-llama", "reward_model": "tiny-llama", "output_dir": str(tmp_path),
        "data": {"eval_fraction": 0.25}, "logging": {"progress": False}})
    said = "eval/perplexity nan" if step is sft else "eval/chosen_score nan"
    with pytest.raises(NonFiniteError, match=rf"^step {1 if step is sft else 2} .*evaluates to "
                                             rf"{said} on held-out data, so it is not exported"):
        step.run(cfg, pairs, CPU)
    assert not (tmp_path / ("actor" if step is sft else "reward")).exists()
    rows = read_metrics(tmp_path / f"step{1 if step is sft else 2}" / "metrics.jsonl")
    assert any(name in rows[-1] for name in ("eval/perplexity", "eval/chosen_score"))


@pytest.mark.parametrize("step", [sft, reward])
def test_eval_every_evaluates_between_updates_and_trains_as_without(step, tmp_path, capsys):
    """sft/rm.eval_every (OpenRLHF's --eval_steps): the held-out metrics every N updates,
    logged at their update and said; the one after the last update is the final
    evaluation's, of the same weights. The evaluations draw no random numbers and leave
    dropout as it was, so the updates are those of a run without them."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (i % 3 + 1), " no")
             for i in range(20)]
    section = "sft" if step is sft else "rm"

    def run(eval_every: int) -> list[dict]:
        out = tmp_path / str(eval_every)
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "actor_model": "tiny-llama", "reward_model": "tiny-llama", "output_dir": str(out),
            "data": {"eval_fraction": 0.2},
            section: {"batch_size": 2, "log_every": 1, "eval_every": eval_every,
                      "lora": {"dropout": 0.1, "dim": 4}},
            "logging": {"progress": False}})
        seed_everything(cfg.seed)   # as train.py does before each step: the same dropout
        step.run(cfg, pairs, CPU)
        return read_metrics(out / f"step{1 if step is sft else 2}" / "metrics.jsonl")

    plain, evaluated = run(0), run(3)
    said = capsys.readouterr().out
    name = "eval/perplexity" if step is sft else "eval/accuracy"
    trained = [row for row in evaluated if "train/loss" in row and "time/seconds" not in row]
    assert [row["train/loss"] for row in trained] == [
        row["train/loss"] for row in plain if "train/loss" in row and "time/seconds" not in row]
    during = [row for row in evaluated if name in row and "time/seconds" not in row]
    assert [row["step"] for row in during] == [3, 6]   # 16 examples in batches of 2: 8 updates
    assert all(name not in row for row in plain if "time/seconds" not in row)
    assert evaluated[-1][name] == plain[-1][name]   # the end: the same weights, evaluated
    assert f"step {1 if step is sft else 2} ({'SFT' if step is sft else 'reward model'}) " \
           f"after 3 updates: eval " in said


def test_step_2_evaluates_the_mean_and_std_of_every_held_out_score():
    """ppo.normalize_reward's statistics: over the chosen and the rejected answers' scores
    together (2n of them), the population std, summed over batches that do not divide the
    pairs (5 in batches of 2)."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (i + 1), " no" * i)
             for i in range(5)]
    examples = tokenize_preferences(pairs, TOK, 64, 64)[0]
    model = load_reward_model("tiny-llama", TOK, seed=3).eval().requires_grad_(False)
    scorer = SimpleNamespace(sequence_scores=partial(sequence_scores, model))
    got = reward.evaluate(scorer, examples, TOK.pad_token_id, 2, DataParallel(CPU))
    one_by_one = torch.tensor([float(sequence_scores(model, torch.tensor([ids]),
                                                     torch.ones(1, len(ids)))[0])
                               for ex in examples for ids in (ex.chosen_ids, ex.rejected_ids)])
    assert float(one_by_one.std()) > 1e-3   # scores that differ
    assert got["eval/score_mean"] == pytest.approx(float(one_by_one.mean()), abs=1e-6)
    assert got["eval/score_std"] == pytest.approx(float(one_by_one.std(correction=0)),
                                                  rel=1e-5)
    assert reward.normalization_fields(got) == {"score_mean": got["eval/score_mean"],
                                                "score_std": got["eval/score_std"]}


@pytest.mark.parametrize("packing", [False, True])
def test_margins_and_center_rewards_coef_reach_step_2s_first_loss(tmp_path, packing):
    """The pairs' margins (data.margin_key) and rm.center_rewards_coef reach the loss step 2
    trains on, padded or packed: its first update's loss, over all 6 pairs in one batch, is
    the initial model's Bradley-Terry loss of r_chosen - r_rejected - margin plus the
    coefficient x mean((r_chosen + r_rejected)^2), computed here by hand."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (i + 1), " no" * i,
                            margin=0.25 * i) for i in range(6)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "reward_model": "tiny-llama", "output_dir": str(tmp_path), "seed": 7,
        "data": {"eval_fraction": 0.0}, "logging": {"progress": False},
        "rm": {"batch_size": 6, "log_every": 1, "center_rewards_coef": 0.5,
               "packing": packing}})
    reward.run(cfg, pairs, CPU)
    first = read_metrics(tmp_path / "step2" / "metrics.jsonl")[0]
    start = load_reward_model("tiny-llama", TOK, seed=8).requires_grad_(False)   # seed + 1
    scores = torch.stack([sequence_scores(start, torch.tensor([ids]), torch.ones(1, len(ids)))[0]
                          for ex in tokenize_preferences(pairs, TOK, 256, 256)[0]
                          for ids in (ex.chosen_ids, ex.rejected_ids)])
    chosen, rejected = scores[0::2], scores[1::2]
    margins = torch.tensor([0.25 * i for i in range(6)])
    bradley_terry = float(-torch.nn.functional.logsigmoid(chosen - rejected - margins).mean())
    centering = float(((chosen + rejected) ** 2).mean())
    assert centering > 1e-3   # a term that shows
    assert first["train/loss"] == pytest.approx(bradley_terry + 0.5 * centering, rel=1e-5)


def test_neftune_noise_is_bounded_uniform_while_training_and_absent_in_eval():
    """add_embedding_noise (sft.neftune_noise_alpha): in train mode every embedding moves by
    at most alpha / sqrt(L * d), spread up to that bound; in eval mode not at all."""
    model = load_causal_lm("tiny-llama", TOK, seed=0)
    ids = torch.randint(3, 200, (4, 32))
    clean = model.get_input_embeddings()(ids).detach()
    handle = add_embedding_noise(model, 5.0)
    noise = model.get_input_embeddings()(ids).detach() - clean
    bound = 5.0 / (32 * clean.shape[-1]) ** 0.5
    assert float(noise.abs().max()) <= bound * (1 + 1e-6)
    assert float(noise.abs().max()) > 0.95 * bound and abs(float(noise.mean())) < 0.02 * bound
    model.eval()
    assert torch.equal(model.get_input_embeddings()(ids), clean)
    handle.remove()


def test_neftune_reaches_step_1s_training_not_its_evaluation(tmp_path):
    """sft.neftune_noise_alpha: step 1's training losses differ from a run without it, and
    the exported model evaluates as it would without the hook (it carries none)."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (i + 1), " no")
             for i in range(8)]

    def step_1(alpha: float, out) -> list[dict]:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "actor_model": "tiny-llama", "output_dir": str(out), "seed": 3,
            "data": {"eval_fraction": 0.25}, "logging": {"progress": False},
            "sft": {"batch_size": 2, "log_every": 1, "lr": 1e-3,
                    "neftune_noise_alpha": alpha}})
        summary = sft.run(cfg, pairs, CPU)
        return read_metrics(out / "step1" / "metrics.jsonl"), summary

    (plain, _), (noisy, summary) = step_1(0.0, tmp_path / "a"), step_1(5.0, tmp_path / "b")
    assert plain[0]["train/loss"] != noisy[0]["train/loss"]
    exported = load_causal_lm(str(tmp_path / "b" / "actor"), TOK).eval()
    held_out = tokenize_sft(train_eval_split(pairs, 0.25, 3)[1], TOK, 256, 256)[0]
    clean = sft.perplexity(exported, held_out, TOK.pad_token_id, 16, DataParallel(CPU))
    assert summary["eval/perplexity"] == pytest.approx(clean, rel=1e-5)


def step_1s_first_loss(tmp_path, pairs: list[PreferencePair], **sft_keys) -> float:
    """The first logged loss of a step-1 run (seed 5) over `pairs` in one batch."""
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-llama", "output_dir": str(tmp_path), "seed": 5,
        "data": {"eval_fraction": 0.0}, "logging": {"progress": False},
        "sft": {"batch_size": len(pairs), "log_every": 1, **sft_keys}})
    sft.run(cfg, pairs, CPU)
    return read_metrics(tmp_path / "step1" / "metrics.jsonl")[0]["train/loss"]


def initial_loss(examples: list) -> float:
    """The seed-5 initial model's cross entropy over `examples`' labels, in one batch."""
    start = load_causal_lm("tiny-llama", TOK, seed=5).requires_grad_(False)
    batch = collate_sft(examples, TOK.pad_token_id)
    logits = start(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=position_ids(batch["attention_mask"])).logits
    return float(sft_loss(logits, batch["labels"]))


def test_train_on_prompt_takes_step_1s_loss_over_the_prompt_too(tmp_path):
    """sft.train_on_prompt: every token is a target, and step 1's first loss, over all 4
    examples in one batch, is the initial model's cross entropy over them all, computed
    here; without it the prompt's tokens are not."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes" * (i + 1), " no")
             for i in range(4)]
    first = step_1s_first_loss(tmp_path, pairs, train_on_prompt=True)
    examples = tokenize_sft(pairs, TOK, 256, 256, train_on_prompt=True)[0]
    assert all(ex.labels == ex.input_ids for ex in examples)
    assert first == pytest.approx(initial_loss(examples), rel=1e-5)
    assert abs(first - initial_loss(tokenize_sft(pairs, TOK, 256, 256)[0])) > 1e-3


def test_multiturn_takes_step_1s_loss_over_every_assistant_reply(tmp_path, capsys):
    """sft.multiturn: step 1's first loss, over 4 two-turn dialogues in one batch, is the
    initial model's cross entropy over both replies of each, computed here."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant: {'ok ' * i}sure\n\nHuman: "
                            "and?\n\nAssistant:", " yes" * (i + 1), "") for i in range(4)]
    first = step_1s_first_loss(tmp_path, pairs, multiturn=True)
    assert ("step 1 train: 4 examples, 4 earlier assistant replies trained on too "
            "(sft.multiturn)") in capsys.readouterr().out
    examples, stats = tokenize_sft(pairs, TOK, 256, 256, multiturn=True)
    assert stats.earlier_replies == 4
    assert first == pytest.approx(initial_loss(examples), rel=1e-5)
    assert abs(first - initial_loss(tokenize_sft(pairs, TOK, 256, 256)[0])) > 1e-3


@pytest.mark.parametrize("step", [sft, reward])
def test_without_held_out_pairs_there_is_nothing_to_refuse(step, tmp_path, capsys):
    """Nor a "nan" in the closing line, which a finite run otherwise never shows."""
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(8)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-llama", "reward_model": "tiny-llama", "output_dir": str(tmp_path),
        "data": {"eval_fraction": 0.0}, "logging": {"progress": False}})
    assert not any(name.startswith("eval/") for name in step.run(cfg, pairs, CPU))
    assert (tmp_path / ("actor" if step is sft else "reward") / "model.safetensors").exists()
    config = (tmp_path / ("actor" if step is sft else "reward") / "config.json").read_text()
    assert "score_mean" not in config   # no statistics of nothing (normalize_reward refuses)
    done = next(line for line in capsys.readouterr().out.splitlines() if " done: " in line)
    assert "nan" not in done and "not evaluated (no held-out examples" in done


def test_a_refused_model_with_a_checkpoint_is_to_be_trained_afresh(tmp_path, monkeypatch):
    """Run again as it was, the step resumes from its checkpoint, with the learning rate
    the checkpoint saved: one of the last update would be refused again at once. The fix
    says resume=false."""
    monkeypatch.setattr(sft, "perplexity", lambda *args: float("nan"))
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(8)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-llama", "output_dir": str(tmp_path), "data": {"eval_fraction": 0.25},
        "engine": {"checkpoint_every": 1}, "logging": {"progress": False}})
    with pytest.raises(NonFiniteError, match=r"then run the step again with resume=false \(a "
                                             r"resume would go on from step-00000001, at the "
                                             r"rate it saved\)$"):
        sft.run(cfg, pairs, CPU)
