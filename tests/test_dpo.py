"""Step 3 by DPO (ppo.algorithm=dpo, steps/dpo.py): its examples and their masks, the
answers' log-probs against a full log-softmax by hand, the reference's log-probs being
the starting policy's (so its loss starts at log 2), the keys it refuses before anything
runs, a LoRA run whose reference is the base under the adapters, and KTO's loss,
reference point and mismatched rows by hand, and dpo.ema's export. That DPO raises the demo's ground truth is
test_demo_learns'; that it shards exactly, test_distributed's."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import train
from engine.data_parallel import DataParallel
from engine.models import byte_tokenizer, load_causal_lm
from engine.runtime import setup_runtime
from steps import demo
from steps.config import DPOTrainConfig
from steps.data import PreferencePair
from steps.dpo import (
    answer_logprobs,
    batch_loss,
    mismatched_rows,
    with_mismatched,
    with_reference,
)
from steps.rlhf import kto_kl_point, kto_loss
from steps.tokenize import IGNORE_INDEX, collate_dpo, tokenize_dpo
from tests.harness.in_process import train_here


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_dpo_examples_mask_the_prompt_and_drop_tied_pairs(tok):
    pairs = [PreferencePair("ab", "cd", "e"), PreferencePair("x", "same", "same"),
             PreferencePair("long prompt", "y", "z")]
    examples, stats = tokenize_dpo(pairs, tok, max_prompt_len=4, max_answer_len=8)
    assert (stats.kept, stats.dropped_tied, stats.dropped_long_prompt) == (1, 1, 1)
    (ex,) = examples
    prompt = tok("ab")["input_ids"]   # <s> a b
    assert ex.prompt_len == len(prompt) == 3
    eos = tok.eos_token_id
    assert ex.chosen_ids == prompt + tok("cd", add_special_tokens=False)["input_ids"] + [eos]
    assert ex.rejected_ids == prompt + tok("e", add_special_tokens=False)["input_ids"] + [eos]
    batch = collate_dpo([ex._replace(ref_chosen=-1.5, ref_rejected=-2.5)], tok.pad_token_id)
    # chosen row, then rejected row padded to its width; labels only over the answers
    assert batch["input_ids"].tolist() == [ex.chosen_ids, ex.rejected_ids + [tok.pad_token_id]]
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX] * 3 + ex.chosen_ids[3:],
        [IGNORE_INDEX] * 3 + ex.rejected_ids[3:] + [IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1] * 5 + [0]]
    assert batch["ref_logps"].tolist() == [-1.5, -2.5]
    # a cut answer keeps no EOS, as step 1 trains it
    cut, stats = tokenize_dpo(pairs[:1], tok, max_prompt_len=4, max_answer_len=1)
    assert cut[0].chosen_ids == prompt + [tok("c", add_special_tokens=False)["input_ids"][0]]
    assert stats.truncated_answer == 2


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return load_causal_lm("tiny-llama", tok, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def examples(tok):
    pairs = demo.make_pairs(6, seed=3)
    return tokenize_dpo(pairs, tok, max_prompt_len=64, max_answer_len=12)[0]


def test_answer_logprobs_sum_each_answers_tokens_as_a_full_log_softmax_does(model, tok,
                                                                           examples):
    """Padded or packed (dpo.packing), each row's answer log-prob is its tokens' under a
    full log-softmax of the row run alone."""
    batch = collate_dpo(examples, tok.pad_token_id)
    with torch.no_grad():
        sums, counts = answer_logprobs(model, batch)
        packed = answer_logprobs(model, batch, packed=True)   # dpo.packing's forwards
    torch.testing.assert_close(packed, (sums, counts), atol=1e-5, rtol=0)
    rows = [ex.chosen_ids for ex in examples] + [ex.rejected_ids for ex in examples]
    starts = [ex.prompt_len for ex in examples] * 2
    for i, (row, start) in enumerate(zip(rows, starts, strict=True)):
        ids = torch.tensor([row])
        with torch.no_grad():   # the row alone, unpadded
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        by_hand = sum(float(logp[t - 1, row[t]]) for t in range(start, len(row)))
        assert float(sums[i]) == pytest.approx(by_hand, abs=1e-4), i
        assert counts[i] == len(row) - start


def test_the_reference_is_the_starting_policy_so_the_loss_starts_at_log_2(model, tok,
                                                                          examples):
    dp = DataParallel(setup_runtime("cpu", "float32", 0))
    filled = with_reference(model, examples, tok.pad_token_id, batch_size=4, dp=dp)
    batch = collate_dpo(filled, tok.pad_token_id)
    sums, _ = answer_logprobs(model, batch)
    torch.testing.assert_close(batch["ref_logps"], sums.detach(), atol=1e-5, rtol=0)
    for loss_type, start in (("sigmoid", math.log(2)), ("hinge", 1.0),
                             ("ipo", (1 / (2 * 0.1)) ** 2)):
        dpo = DPOTrainConfig(beta=0.1, loss=loss_type)
        loss, stats = batch_loss(model, batch, filled, dpo, dp)
        assert float(loss.detach()) == pytest.approx(start, abs=1e-4), loss_type
        assert float(stats["train/margin"]) == pytest.approx(0.0, abs=1e-5)
    # reference-free: SimPO and ORPO on the answers' mean token log-probs alone
    means = (sums / batch["labels"][:, 1:].ne(IGNORE_INDEX).sum(1)).detach().chunk(2)
    h = means[0] - means[1]
    loss, _ = batch_loss(model, batch, filled, DPOTrainConfig(beta=2.0, loss="simpo",
                                                              simpo_gamma=0.5), dp)
    assert float(loss.detach()) == pytest.approx(
        float(-torch.nn.functional.logsigmoid(2.0 * h - 0.5).mean()), rel=1e-5)

    def log_odds(x):
        return x - torch.log1p(-torch.exp(x))

    loss, _ = batch_loss(model, batch, filled, DPOTrainConfig(beta=0.1, loss="orpo"), dp)
    assert float(loss.detach()) == pytest.approx(float(-0.1 * torch.nn.functional.logsigmoid(
        log_odds(means[0]) - log_odds(means[1])).mean()), rel=1e-5)
    # with dpo.nll_coef, the chosen answers' token cross entropy is added
    chosen_sum = float(sums.detach().chunk(2)[0].sum())
    tokens = sum(len(ex.chosen_ids) - ex.prompt_len for ex in filled)
    loss, stats = batch_loss(model, batch, filled, DPOTrainConfig(beta=0.1, nll_coef=0.5), dp)
    assert float(stats["train/nll"]) == pytest.approx(-chosen_sum / tokens, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(math.log(2) - 0.5 * chosen_sum / tokens, rel=1e-5)


def _refusal(capsys, tmp_path, *overrides: str) -> str:
    code = train.main(["--step", "3", "--output-dir", str(tmp_path / "out"),
                       "ppo.algorithm=dpo", *overrides])
    assert code == 2
    return capsys.readouterr().err.strip()


def test_dpo_refuses_the_step_3_keys_it_would_ignore_and_needs_no_reward_model(
        capsys, tmp_path):
    assert _refusal(capsys, tmp_path, "ppo.prompt_data=[p.jsonl]") == (
        "train.py: ppo.prompt_data=[p.jsonl]: ppo.algorithm=dpo does not read it (it trains "
        "on step 3's share of data.path's pairs (KTO: or on data.feedback_path's feedback)); "
        "drop it, or choose another ppo.algorithm")
    assert "ppo.actor_lora.dim=8: ppo.algorithm=dpo does not read it (its LoRA is " \
        "dpo.lora's)" in _refusal(capsys, tmp_path, "ppo.actor_lora.dim=8")
    assert "ppo.ptx.enabled=true: ppo.algorithm=dpo does not read it" in \
        _refusal(capsys, tmp_path, "ppo.ptx.enabled=true")
    assert "ppo.export=best: ppo.algorithm=dpo does not read it (its export is " \
        "dpo.export's)" in _refusal(capsys, tmp_path, "ppo.export=best")
    assert "dpo.export=best chooses among the evaluations by their KL: give dpo.eval_every " \
        "> 0 (it is 0)" in _refusal(capsys, tmp_path, "dpo.export=best")
    assert "dpo.warmup_steps=5 and dpo.warmup_ratio=0.1: give one" in \
        _refusal(capsys, tmp_path, "dpo.warmup_steps=5")
    assert "dpo.label_smoothing=0.5:" in _refusal(capsys, tmp_path, "dpo.label_smoothing=0.5")
    # the actor is all it needs: named, with no word of a reward model
    assert "step 3 needs the step-1 actor at" in _refusal(capsys, tmp_path)
    cfg = train.build_config(train.parse_args(
        ["--step", "1", "3", "--output-dir", str(tmp_path / "out"), "ppo.algorithm=dpo"]))
    train.check_config(cfg)   # step 1 makes the actor; no step 2, no reward model


@pytest.mark.parametrize("base", ["fp32", "int8"])
def test_a_lora_dpo_run_starts_at_its_base_and_exports_a_merged_actor(tmp_path, tok, base):
    """LoRA over a frozen base (fp32, or INT8 under engine.quantized_base): the reference is
    the base with the adapters off (no second copy; the integers the policy starts from,
    not the full-precision model), so the first evaluation reads log 2 and a KL of 0; the
    actor exported merged loads as a plain causal LM, and no critic is left (an earlier
    PPO run's, overwrite=true, is removed)."""
    actor = tmp_path / "sft"
    load_causal_lm("tiny-llama", tok, dtype=torch.float32).save_pretrained(actor)
    tok.save_pretrained(actor)
    out = tmp_path / "out"
    for earlier in ("actor", "critic", "actor_ema"):   # as a finished PPO run leaves them
        (out / "step3" / earlier).mkdir(parents=True)
        (out / "step3" / earlier / "config.json").write_text("{}")
    quantized = ["engine.quantized_base.enabled=true"] if base == "int8" else []
    run = train_here(["--step", "3", "--output-dir", out, f"ppo.actor_path={actor}",
                      "ppo.algorithm=dpo", "data.demo_pairs=200", "dpo.lora.dim=4",
                      "dpo.lora.only_optimize_lora=true", "dpo.lr=1e-3", "dpo.eval_prompts=4",
                      "data.max_answer_len=8", "logging.progress=false", "overwrite=true",
                      *quantized]).check()
    assert "step 3 (DPO) done" in run.stdout
    assert ("as int8" in run.stdout) == (base == "int8"), run.stdout
    rows = [json.loads(line) for line in (out / "step3" / "metrics.jsonl").open()]
    assert rows[0]["step"] == 0
    assert rows[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[0]["eval/kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[-1]["eval/loss"] < math.log(2)   # it learned to prefer the chosen answers
    assert rows[-1]["eval/kl"] > 0
    exported = load_causal_lm(str(out / "step3" / "actor"), tok, dtype=torch.float32)
    assert not any("lora" in name for name, _ in exported.named_parameters())
    assert not (out / "step3" / "critic").exists()
    assert not (out / "step3" / "actor_ema").exists()
    assert (out / "step3" / "finished").exists()


@pytest.fixture(scope="module")
def sft_actor(tmp_path_factory, tok):
    actor = tmp_path_factory.mktemp("sft") / "actor"
    torch.manual_seed(0)
    load_causal_lm("tiny-llama", tok, dtype=torch.float32).save_pretrained(actor)
    tok.save_pretrained(actor)
    return actor


def _best_run(out, actor, budget: float) -> list[dict]:
    train_here(["--step", "3", "--output-dir", out, f"ppo.actor_path={actor}",
                "ppo.algorithm=dpo", "data.demo_pairs=200", "dpo.lr=1e-3", "dpo.batch_size=4",
                "dpo.eval_every=5", "dpo.eval_prompts=6", "dpo.export=best",
                f"ppo.kl_budget={budget}", "data.max_answer_len=8",
                "logging.progress=false"]).check()
    return [json.loads(line) for line in (out / "step3" / "metrics.jsonl").open()]


def test_export_best_writes_the_top_evaluated_policy_within_the_kl_budget(tmp_path,
                                                                         sft_actor):
    """dpo.export=best: the evaluation (the start's included) with the highest ground truth
    within ppo.kl_budget is what is written, and the summary names it; a budget that only
    the start meets exports the SFT model's own weights."""
    rows = _best_run(tmp_path / "wide", sft_actor, 1e9)
    evaluations = [row for row in rows if "eval/ground_truth" in row][:-1]   # not the summary
    summary = rows[-1]
    top = max(evaluations, key=lambda row: (row["eval/ground_truth"], row["eval/accuracy"]))
    assert len(evaluations) > 3 and summary["eval/step_exported"] == top["step"]
    assert summary["eval/ground_truth_exported"] == top["eval/ground_truth"]
    assert summary["eval/kl_exported"] == top["eval/kl"]

    rows = _best_run(tmp_path / "tight", sft_actor, 1e-9)
    assert rows[-1]["eval/step_exported"] == 0 and rows[-1]["eval/kl"] > 1e-9
    exported = load_file(tmp_path / "tight" / "step3" / "actor" / "model.safetensors")
    start = load_file(sft_actor / "model.safetensors")
    assert exported.keys() == start.keys()
    for name, value in start.items():
        assert torch.equal(exported[name], value), name


def test_the_ema_is_exported_beside_the_actor_as_the_average_of_its_updates(tmp_path,
                                                                          sft_actor):
    """dpo.ema: one update (a batch of every training pair) leaves the average at
    beta x the start + (1 - beta) x the update's weights, exported as step3/actor_ema; a
    run without it leaves none (an earlier run's is removed)."""
    out = tmp_path / "out"
    args = ["--step", "3", "--output-dir", out, f"ppo.actor_path={sft_actor}",
            "ppo.algorithm=dpo", "data.demo_pairs=40", "data.eval_fraction=0.1",
            "dpo.batch_size=64", "dpo.lr=2e-3", "dpo.warmup_ratio=0", "dpo.eval_prompts=0",
            "data.max_answer_len=8", "logging.progress=false"]
    train_here([*args, "dpo.ema.enabled=true", "dpo.ema.beta=0.75"]).check()
    rows = [json.loads(line) for line in (out / "step3" / "metrics.jsonl").open()]
    summary = rows[-1]
    assert summary["step"] == 1   # one update
    # the EMA evaluated too, a quarter of the way from the start to the update
    assert summary["eval/loss_before"] > summary["eval/loss_ema"] > summary["eval/loss"]
    start = load_file(sft_actor / "model.safetensors")
    actor = load_file(out / "step3" / "actor" / "model.safetensors")
    ema = load_file(out / "step3" / "actor_ema" / "model.safetensors")
    assert ema.keys() == start.keys() == actor.keys()
    moved = 0.0
    for name, value in start.items():
        torch.testing.assert_close(ema[name], 0.75 * value + 0.25 * actor[name],
                                   rtol=0, atol=1e-6)
        moved = max(moved, float((actor[name] - value).abs().max()))
    assert moved > 1e-3   # the update moved the weights, so the average is not the start
    # at beta 0 the EMA is the last policy: its evaluation, with its weights swapped in,
    # is the live weights' to the last digit, and its export the actor's
    train_here([*args, "dpo.ema.enabled=true", "dpo.ema.beta=0", "overwrite=true"]).check()
    summary = [json.loads(line) for line in (out / "step3" / "metrics.jsonl").open()][-1]
    assert summary["eval/loss_ema"] == summary["eval/loss"]
    assert summary["eval/accuracy_ema"] == summary["eval/accuracy"]
    actor = load_file(out / "step3" / "actor" / "model.safetensors")
    ema = load_file(out / "step3" / "actor_ema" / "model.safetensors")
    assert all(torch.equal(ema[name], actor[name]) for name in actor)
    train_here([*args, "overwrite=true"]).check()
    assert not (out / "step3" / "actor_ema").exists()


# KTO (dpo.loss=kto, steps.rlhf.kto_loss): each pair's answers judged alone against the
# reference point z0, from mismatched rows (each pair's prompt with the next pair's chosen
# answer); that it shards exactly (z0 summed over ranks) is test_distributed's, that it
# raises the demo's ground truth test_demo_learns'


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_and_gradient_by_hand():
    chosen = torch.tensor([-3.0, -5.0], requires_grad=True)
    rejected = torch.tensor([-4.0, -2.0], requires_grad=True)
    ref_chosen, ref_rejected = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -2.5])
    beta, z0, wd, wu = 0.5, 0.3, 1.5, 0.7
    out = kto_loss(chosen, rejected, ref_chosen, ref_rejected, torch.tensor(z0), beta, wd, wu)
    r_chosen, r_rejected = [0.5, -1.0], [-1.0, 0.5]
    by_hand = sum(wd * (1 - _sigmoid(beta * (r - z0))) for r in r_chosen) \
        + sum(wu * (1 - _sigmoid(beta * (z0 - r))) for r in r_rejected)
    assert float(out.loss.detach()) == pytest.approx(by_hand / 4, rel=1e-6)   # 4 answers
    out.loss.backward()
    # d/dr of 1 - sigmoid(beta (r - z0)) is -beta s (1 - s): chosen up, rejected down
    for g, r in zip(chosen.grad.tolist(), r_chosen, strict=True):
        s = _sigmoid(beta * (r - z0))
        assert g == pytest.approx(-wd * beta * s * (1 - s) / 4, rel=1e-5)
    for g, r in zip(rejected.grad.tolist(), r_rejected, strict=True):
        s = _sigmoid(beta * (z0 - r))
        assert g == pytest.approx(wu * beta * s * (1 - s) / 4, rel=1e-5)
    assert out.chosen_rewards.tolist() == pytest.approx([0.25, -0.5])
    assert out.rejected_rewards.tolist() == pytest.approx([-0.5, 0.25])
    assert float(out.accuracy) == 0.5   # pair 0 ranks right, pair 1 wrong
    # z0 is a constant of the loss: no gradient flows into it
    point = torch.tensor(0.2, requires_grad=True)
    assert not kto_loss(chosen.detach(), rejected.detach(), ref_chosen, ref_rejected, point,
                        beta).loss.requires_grad
    # at the start (every ratio 0, z0 0) the loss is (wd + wu) / 4; 3 pairs of a batch of 6
    # (one rank's share) give half of it
    zero = torch.zeros(3)
    start = kto_loss(zero, zero, zero, zero, 0.0, beta, wd, wu, num_pairs=6)
    assert float(start.loss) == pytest.approx((wd + wu) / 4 / 2)


def test_the_reference_point_is_the_mismatched_rows_mean_held_at_zero():
    assert kto_kl_point(3.0, 2) == 1.5
    assert kto_kl_point(-3.0, 2) == 0.0   # the policy less likely than the reference: 0
    assert kto_kl_point(0.0, 0) == 0.0    # no rows


def test_mismatched_rows_give_each_prompt_the_next_pairs_chosen_answer(tok, examples):
    mismatched = with_mismatched(examples)
    for k, ex in enumerate(mismatched):
        after = examples[(k + 1) % len(examples)]
        assert list(ex.kl_ids) == ex.chosen_ids[:ex.prompt_len] + \
            after.chosen_ids[after.prompt_len:]
    batch = collate_dpo([ex._replace(ref_kl=-float(k)) for k, ex in enumerate(mismatched)],
                        tok.pad_token_id)
    width = max(len(ex.kl_ids) for ex in mismatched)
    assert batch["kl_input_ids"].shape == batch["kl_labels"].shape == (len(examples), width)
    for row, ex in enumerate(mismatched):
        n = len(ex.kl_ids)
        assert batch["kl_input_ids"][row, :n].tolist() == list(ex.kl_ids)
        assert batch["kl_labels"][row].tolist() == [IGNORE_INDEX] * ex.prompt_len + \
            list(ex.kl_ids[ex.prompt_len:]) + [IGNORE_INDEX] * (width - n)
        assert batch["kl_attention_mask"][row].sum() == n
    assert batch["ref_kl_logps"].tolist() == [-float(k) for k in range(len(examples))]
    assert "kl_input_ids" not in collate_dpo(examples, tok.pad_token_id)   # other losses


def test_a_kto_batch_starts_at_half_and_reads_z0_from_its_mismatched_rows(model, tok,
                                                                          examples):
    dp = DataParallel(setup_runtime("cpu", "float32", 0))
    filled = with_reference(model, with_mismatched(examples), tok.pad_token_id,
                            batch_size=4, dp=dp)
    batch = collate_dpo(filled, tok.pad_token_id) | {"weight": torch.tensor(1.0)}
    with torch.no_grad():
        torch.testing.assert_close(batch["ref_kl_logps"],
                                   answer_logprobs(model, mismatched_rows(batch))[0],
                                   atol=1e-5, rtol=0)
    kto = DPOTrainConfig(beta=0.1, loss="kto", desirable_weight=2.0)
    loss, stats = batch_loss(model, batch, filled, kto, dp)
    assert float(loss.detach()) == pytest.approx((2.0 + 1.0) / 4, abs=1e-5)
    assert float(stats["train/kl_point"]) == pytest.approx(0.0, abs=1e-5)
    # the reference made 1 nat less likely on the mismatched rows: z0 = 1, and every
    # desirable answer's loss is 1 - sigmoid(-beta), every undesirable's 1 - sigmoid(beta)
    moved = batch | {"ref_kl_logps": batch["ref_kl_logps"] - 1.0}
    loss, stats = batch_loss(model, moved, filled, kto, dp)
    assert float(stats["train/kl_point"]) == pytest.approx(1.0, abs=1e-5)
    by_hand = (2.0 * (1 - _sigmoid(-0.1)) + (1 - _sigmoid(0.1))) / 2
    assert float(loss.detach()) == pytest.approx(by_hand, abs=1e-5)
    # a stand-in (weight 0) adds nothing to z0: with no real rows anywhere, it is 0
    loss, stats = batch_loss(model, moved | {"weight": torch.tensor(0.0)}, filled, kto, dp)
    assert float(stats["train/kl_point"]) == 0.0


def test_a_dpo_key_another_loss_reads_is_refused_by_name(capsys, tmp_path):
    assert _refusal(capsys, tmp_path, "dpo.desirable_weight=1.3") == (
        "train.py: dpo.desirable_weight=1.3 is read by dpo.loss=kto only, not by "
        "dpo.loss=sigmoid: drop it, or choose that loss")
    assert "dpo.label_smoothing=0.1 is read by dpo.loss=sigmoid only, not by dpo.loss=kto" \
        in _refusal(capsys, tmp_path, "dpo.loss=kto", "dpo.label_smoothing=0.1")
    assert "dpo.simpo_gamma=1.0 is read by dpo.loss=simpo only, not by dpo.loss=ipo" in \
        _refusal(capsys, tmp_path, "dpo.loss=ipo", "dpo.simpo_gamma=1.0")
    assert "dpo.undesirable_weight=0.0:" in _refusal(capsys, tmp_path, "dpo.loss=kto",
                                                     "dpo.undesirable_weight=0")


def test_a_kto_run_raises_the_chosen_answers_over_the_rejected(tmp_path, sft_actor):
    out = tmp_path / "out"
    train_here(["--step", "3", "--output-dir", out, f"ppo.actor_path={sft_actor}",
                "ppo.algorithm=dpo", "dpo.loss=kto", "dpo.beta=0.5", "data.demo_pairs=200",
                "dpo.lr=1e-3", "dpo.batch_size=4", "dpo.eval_every=20", "dpo.eval_prompts=0",
                "dpo.log_every=1", "data.max_answer_len=8", "logging.progress=false"]).check()
    rows = [json.loads(line) for line in (out / "step3" / "metrics.jsonl").open()]
    start, summary = rows[0], rows[-1]
    trained = [row for row in rows if "train/kl_point" in row]
    assert start["step"] == 0 and start["eval/loss"] == pytest.approx(0.5, abs=1e-5)
    assert trained[0]["train/loss"] == pytest.approx(0.5, abs=1e-5)   # the first batch's
    assert all(row["train/kl_point"] >= 0 for row in trained)
    # from an untrained model the answers' common tokens come first: every answer, the
    # mismatched ones too, grows likelier (z0 > 0), and the chosen a little more
    assert summary["eval/kl_point"] > 0
    assert summary["eval/loss"] < 0.47 and summary["eval/margin"] > 0.3
    assert summary["eval/accuracy"] >= 0.7


# KTO on unpaired feedback (data.feedback_path: prompt, completion, label records)


def test_feedback_records_are_read_with_their_labels_and_bad_ones_named(tmp_path):
    from steps.data import DataError, load_feedback_records

    path = tmp_path / "feedback.jsonl"
    records = [{"prompt": "Hi?", "completion": "Hello.", "label": True},
               {"prompt": [{"role": "user", "content": "Sum 2+2?"}],
                "completion": [{"role": "assistant", "content": "5"}], "label": 0},
               {"prompt": "Empty?", "completion": "", "label": True},
               {"prompt": "Unlabelled?", "completion": "Yes.", "label": None}]
    path.write_text("\n".join(json.dumps(r) for r in records[:1] + records[2:]))
    read, skipped = load_feedback_records(str(path))
    assert skipped == 2   # the empty answer, the null label
    assert read == [PreferencePair("\n\nHuman: Hi?\n\nAssistant:", " Hello.", "",
                                   ({"role": "user", "content": "Hi?"},), label=True)]
    path.write_text(json.dumps(records[1]))
    (chat,), _ = load_feedback_records(str(path))
    assert (chat.prompt, chat.chosen, chat.label) == (
        "\n\nHuman: Sum 2+2?\n\nAssistant:", " 5", False)
    path.write_text(json.dumps({"prompt": "Hi?", "completion": "Hello.", "label": "good"}))
    with pytest.raises(DataError, match=r"record 1: field 'label' is \"good\", where a "
                                        r"feedback label is true/false"):
        load_feedback_records(str(path))
    path.write_text(json.dumps({"prompt": "Hi?", "answer": "Hello.", "label": True}))
    with pytest.raises(DataError, match="no 'completion' field .* set "
                                        "data.feedback_completion_key"):
        load_feedback_records(str(path))


def test_kto_on_feedback_is_kto_on_the_pairs_it_was_made_of(model, tok):
    """A batch of pairs and the same answers as desirable / undesirable records give one
    loss and one gradient: the unpaired path is the paired one without the pairing."""
    from steps.dpo import as_feedback
    from steps.tokenize import collate_feedback, tokenize_feedback

    pairs = demo.make_pairs(6, seed=3)
    dp = DataParallel(setup_runtime("cpu", "float32", 0))
    reference = load_causal_lm("tiny-llama", tok, dtype=torch.float32).eval()
    policy = load_causal_lm("tiny-llama", tok, dtype=torch.float32)
    policy.load_state_dict(model.state_dict())
    with torch.no_grad():   # away from the reference, so the loss and gradient are not trivial
        torch.manual_seed(1)
        for p in policy.parameters():
            p.add_(0.02 * torch.randn_like(p))
    paired = with_reference(reference, with_mismatched(tokenize_dpo(pairs, tok, 64, 12)[0]),
                            tok.pad_token_id, 4, dp)
    feedback = tokenize_feedback(as_feedback(pairs), tok, 64, 12)[0]
    assert [ex.desirable for ex in feedback] == [True, False] * len(pairs)
    feedback = with_reference(reference, with_mismatched(feedback), tok.pad_token_id, 4, dp)
    kto = DPOTrainConfig(beta=0.1, loss="kto", desirable_weight=1.5)
    results = []
    for rows, examples in ((collate_dpo(paired, tok.pad_token_id), paired),
                           (collate_feedback(feedback, tok.pad_token_id), feedback)):
        policy.zero_grad()
        loss, stats = batch_loss(policy, rows | {"weight": torch.tensor(1.0)}, examples,
                                 kto, dp)
        loss.backward()
        results.append((float(loss.detach()), stats, [p.grad.clone() for p in policy.parameters()]))
    (pair_loss, pair_stats, pair_grads), (loss, stats, grads) = results
    assert loss == pytest.approx(pair_loss, abs=1e-6) and abs(loss - 0.5 * 1.25) > 1e-4
    for g, h in zip(grads, pair_grads, strict=True):
        torch.testing.assert_close(g, h, atol=1e-6, rtol=1e-5)
    assert float(stats["train/desirable_reward"]) == pytest.approx(
        float(pair_stats["train/chosen_reward"]), abs=1e-6)
    assert float(stats["train/undesirable_reward"]) == pytest.approx(
        float(pair_stats["train/rejected_reward"]), abs=1e-6)


def test_a_mismatched_row_takes_the_next_answer_to_another_prompt(tok):
    from steps.tokenize import tokenize_feedback

    records = [PreferencePair("a", " x", "", label=True), PreferencePair("a", " y", "", label=False),
               PreferencePair("b", " z", "", label=True)]
    examples = with_mismatched(tokenize_feedback(records, tok, 8, 8)[0])
    answer = {text: tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
              for text in (" x", " z")}
    prompt = {text: tok(text)["input_ids"] for text in ("a", "b")}
    assert [list(ex.kl_ids) for ex in examples] == [
        prompt["a"] + answer[" z"], prompt["a"] + answer[" z"], prompt["b"] + answer[" x"]]


def test_feedback_is_refused_but_by_kto(capsys, tmp_path):
    assert "data.feedback_path holds unpaired feedback, which only dpo.loss=kto trains on, " \
        "not dpo.loss=sigmoid" in _refusal(capsys, tmp_path, "data.feedback_path=[f.jsonl]")
    code = train.main(["--step", "3", "--output-dir", str(tmp_path / "out"),
                       "ppo.algorithm=ppo", "data.feedback_path=[f.jsonl]"])
    assert code == 2 and capsys.readouterr().err.strip().startswith(
        "train.py: data.feedback_path holds unpaired feedback, which step 3 trains on by KTO "
        "only, not by ppo.algorithm=ppo")


def test_a_kto_run_on_unpaired_feedback_raises_the_desirable_answers(tmp_path, sft_actor):
    """data.feedback_path's records through train.py: one answer of each demo pair, alone
    (steps.demo.feedback_records), read, held out and trained on."""
    feedback = tmp_path / "feedback.jsonl"
    records = demo.feedback_records(demo.make_pairs(400, seed=5), seed=5)
    feedback.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "out"
    train_here(["--step", "3", "--output-dir", out, f"ppo.actor_path={sft_actor}",
                "ppo.algorithm=dpo", "dpo.loss=kto", f"data.feedback_path=[{feedback}]",
                "dpo.beta=0.5", "dpo.lr=1e-3", "dpo.batch_size=16", "dpo.epochs=2",
                "data.eval_fraction=0.1", "dpo.eval_prompts=0", "data.max_answer_len=8",
                "logging.progress=false"]).check()
    rows = [json.loads(line) for line in (out / "step3" / "metrics.jsonl").open()]
    start, summary = rows[0], rows[-1]
    assert start["eval/loss"] == pytest.approx(0.5, abs=1e-5) and start["eval/accuracy"] == 0
    assert "eval/chosen_reward" not in summary   # no pairs: rewards by label
    assert summary["eval/loss"] < 0.47
    assert summary["eval/desirable_reward"] > summary["eval/undesirable_reward"]
    assert summary["eval/accuracy"] >= 0.6
