"""KTO (dpo.loss=kto, steps.rlhf.kto_loss): its loss and gradient against hand-computed
values, the reference point z0 from mismatched rows (each pair's prompt with the next
pair's chosen answer), its collated rows, a batch's loss at the start (the policy is the
reference) and with z0 moved, the keys only some losses read, and a run that raises the
chosen answers over the rejected. That KTO shards exactly (z0 summed over ranks, a
stand-in adding nothing) is test_distributed's; that it raises the demo's ground truth,
test_demo_learns'."""

from __future__ import annotations

import json
import math

import pytest
import torch

import train
from engine.data_parallel import DataParallel
from engine.models import byte_tokenizer, load_causal_lm
from engine.runtime import setup_runtime
from steps import demo
from steps.config import DPOTrainConfig
from steps.dpo import answer_logprobs, batch_loss, with_mismatched, with_reference
from steps.rlhf import kto_kl_point, kto_loss
from steps.tokenize import IGNORE_INDEX, collate_dpo, tokenize_dpo
from tests.harness.in_process import train_here


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
    assert point.grad is None
    # at the start (every ratio 0, z0 0) the loss is (wd + wu) / 4, whatever num_pairs splits
    zero = torch.zeros(3)
    start = kto_loss(zero, zero, zero, zero, 0.0, beta, wd, wu, num_pairs=6)
    assert float(start.loss) == pytest.approx((wd + wu) / 4 / 2)   # half the pairs here


def test_the_reference_point_is_the_mismatched_rows_mean_held_at_zero():
    assert kto_kl_point(3.0, 2) == 1.5
    assert kto_kl_point(-3.0, 2) == 0.0   # the policy less likely than the reference: 0
    assert kto_kl_point(0.0, 0) == 0.0    # no rows


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return load_causal_lm("tiny-llama", tok, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def examples(tok):
    return tokenize_dpo(demo.make_pairs(6, seed=3), tok, max_prompt_len=64,
                        max_answer_len=12)[0]


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
    kl_rows = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"],
               "labels": batch["kl_labels"]}
    with torch.no_grad():
        torch.testing.assert_close(batch["ref_kl_logps"], answer_logprobs(model, kl_rows)[0],
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


def _refusal(capsys, tmp_path, *overrides: str) -> str:
    code = train.main(["--step", "3", "--output-dir", str(tmp_path / "out"),
                       "ppo.algorithm=dpo", *overrides])
    assert code == 2
    return capsys.readouterr().err.strip()


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


def test_a_kto_run_raises_the_chosen_answers_over_the_rejected(tmp_path, tok):
    actor = tmp_path / "sft"
    torch.manual_seed(0)
    load_causal_lm("tiny-llama", tok, dtype=torch.float32).save_pretrained(actor)
    tok.save_pretrained(actor)
    out = tmp_path / "out"
    train_here(["--step", "3", "--output-dir", out, f"ppo.actor_path={actor}",
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
