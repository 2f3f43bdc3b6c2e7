"""Online DPO (ppo.algorithm=online_dpo): each group's best and worst answer by the reward
form a pair, trained by DPO's loss against the reference inside step 3's loop. The pairs
and the loss by hand; an update's first loss is log 2 (the reference is the start) and
raises the chosen answers over the rejected; forward chunks of whole groups add up to the
whole micro-batch's step; tied groups train nothing. Online KTO (ppo.dpo_loss=kto): each
answer labelled by its group's mean, its loss and z0 by hand, a first loss of 1/2, the
desirable answers raised over the undesirable ones, and z0 the round's KL."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from engine.data_parallel import DataParallel, Share
from engine.models import byte_tokenizer
from engine.runtime import Runtime
from steps import ppo
from steps.config import RunConfig
from steps.rlhf import (
    feedback_labels,
    kto_feedback_loss,
    labelled_kto_loss,
    paired_dpo_loss,
    preference_pairs,
    rollout_kl_sum,
    sequence_rewards,
)
from steps.tokenize import collate_prompts
from tests.test_step3_controls import tiny_models

CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)


def settings(**changes) -> ppo.Settings:
    base = dict(algorithm="online_dpo", samples_per_prompt=2, rollout_batch_size=4,
                micro_batch_size=8, max_new_tokens=6, target_kl=None)
    return ppo.resolve(OmegaConf.merge(OmegaConf.structured(RunConfig),
                                       {"ppo": {**base, **changes}}))


def test_each_group_pairs_its_best_and_worst_answer_and_a_tie_pairs_nothing():
    rewards = torch.tensor([1.0, 3.0, 2.0, -1.0,    # group of 4: best 3.0, worst -1.0
                            5.0, 0.0, 5.0, 0.0,     # ties go to the first
                            2.0, 2.0, 2.0, 2.0])    # all equal: no preference
    assert preference_pairs(rewards, 4).tolist() == [0, 1, 0, -1, 1, -1, 0, 0, 0, 0, 0, 0]
    assert preference_pairs(torch.tensor([0.5, 0.2, 0.1, 0.7]), 2).tolist() == [1, -1, -1, 1]
    with pytest.raises(ValueError, match="groups of 3"):
        preference_pairs(rewards[:4], 3)


def test_the_paired_loss_by_hand():
    """Rows 0-1 and 2-3 are two groups; row 2's third token is off the mask. The chosen
    answer's log-prob is its tokens' sum (IPO: their mean), less the reference's."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.5, -0.5, -0.5],
                             [-3.0, -1.0, -9.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0],
                        [-2.0, -2.0, -9.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1.0]])
    labels = torch.tensor([-1.0, 1.0, 1.0, -1.0])
    # pair 1: chosen row 1 (-1.5 vs ref -3), rejected row 0 (-3.5 vs -3): h = 1.5 + 0.5 = 2
    # pair 2: chosen row 2 (-4 vs -4), rejected row 3 (-3 vs -1.5): h = 0 + 1.5 = 1.5
    out = paired_dpo_loss(logprobs, ref, labels, mask, 2, beta=0.5)
    want = -(math.log(1 / (1 + math.exp(-1.0))) + math.log(1 / (1 + math.exp(-0.75)))) / 2
    assert out.loss.item() == pytest.approx(want)
    assert float(out.accuracy) == 1.0 and float(out.pairs) == 2
    assert float(out.margin) == pytest.approx(0.5 * (2 + 1.5) / 2)
    out.loss.backward()
    # d loss / d logp of a chosen token: -beta sigmoid(-beta h) / pairs, + for a rejected one
    g = 0.5 * torch.sigmoid(torch.tensor(-1.0)) / 2
    torch.testing.assert_close(logprobs.grad[1], -g.expand(3))
    torch.testing.assert_close(logprobs.grad[0], g.expand(3))
    assert logprobs.grad[2, 2] == 0   # off the mask
    # IPO on the tokens' means: pair 1 h = (-0.5 + 1) - (-7/6 + 1) = 2/3, pair 2 h = 0.5
    ipo = paired_dpo_loss(logprobs, ref, labels, mask, 2, beta=1.0, loss_type="ipo",
                          num_pairs=4)
    assert float(ipo.loss) == pytest.approx(((2 / 3 - 0.5) ** 2 + (0.5 - 0.5) ** 2) / 4)
    # a stand-in (no tokens) is in no pair, and half a group is refused
    none = paired_dpo_loss(logprobs, ref, labels, torch.zeros_like(mask), 2, beta=0.5)
    assert float(none.loss) == 0 and float(none.pairs) == 0 and none.loss.requires_grad
    # half a group, or pairs across two groups (rows 0 and 1 chosen, 2 and 3 rejected)
    with pytest.raises(ValueError, match="give whole groups"):
        paired_dpo_loss(logprobs[:3], ref[:3], labels[:3], mask[:3], 2, beta=0.5)
    with pytest.raises(ValueError, match="not within groups of 2"):
        paired_dpo_loss(logprobs, ref, torch.tensor([1.0, 1, -1, -1]), mask, 2, beta=0.5)


def test_micro_batches_are_drawn_in_whole_groups():
    order = ppo.micro_batch_order(12, 3, seed=5)
    assert sorted(order.tolist()) == list(range(12))
    for group in order.view(-1, 3):
        assert group.tolist() == list(range(group[0], group[0] + 3)) and group[0] % 3 == 0
    assert ppo.micro_batch_order(12, 1, seed=5).tolist() != list(range(12))


def _round(s: ppo.Settings, seed: int = 0) -> tuple[ppo.Models, ppo.Experience]:
    torch.manual_seed(seed)
    models = tiny_models(byte_tokenizer(), lr=1e-2)
    prompts = [models.tokenizer(f"Q{i}:")["input_ids"] for i in range(s.ppo.rollout_batch_size)]
    batch = collate_prompts([p for p in prompts for _ in range(s.group)], 0)
    exp, _ = ppo.make_experience(models, batch, s, DataParallel(CPU), kl_coef=0.0,
                                 seeds=ppo.row_seeds(0, 1, list(range(len(batch["input_ids"])))))
    return models, exp


def _update(models: ppo.Models, exp: ppo.Experience, s: ppo.Settings) -> dict:
    rows = len(exp.sequences)
    share = Share(list(range(rows)), list(range(rows)), 1.0)
    return ppo.update(exp, share, rows, models, s, DataParallel(CPU), [], 0, None, 0, 0.0)[0]


def _margin(models: ppo.Models, exp: ppo.Experience, mean: bool = False) -> float:
    """The chosen (desirable) answers' log-probs less the rejected (undesirable) ones',
    summed (`mean`: each side's mean, where they number differently)."""
    with torch.no_grad():
        logps = ppo.answer_logprobs(models.actor, exp.sequences, exp.attention_mask,
                                    exp.prompt_len)
    answers = (logps * exp.action_mask).sum(1)
    labels = torch.sign(exp.advantages.sum(1))
    side = torch.mean if mean else torch.sum
    return float(side(answers[labels > 0]) - side(answers[labels < 0]))


def test_a_round_trains_each_groups_best_over_its_worst_from_a_loss_of_log_2():
    s = settings()
    models, exp = _round(s)
    # the pairs are the scores' (no KL in them: the loss's beta holds it)
    per_answer = sequence_rewards(exp.scores, exp.kl, exp.action_mask, 0.0, s.ppo.score_clip)
    labels = torch.sign(exp.advantages.sum(1))
    assert torch.equal(labels, preference_pairs(per_answer, 2)) and labels.abs().sum() == 8
    torch.testing.assert_close(exp.rewards.sum(1), per_answer)   # no KL penalty either
    before = _margin(models, exp)
    stats = _update(models, exp, s)
    # the reference is the start: every pair's margin is 0, its loss log 2
    assert stats["train/updates"] == 1
    assert stats["train/policy_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert stats["train/pair_accuracy"] == 0.0   # ties count wrong
    assert _margin(models, exp) > before + 1.0
    again = _update(models, exp, s)
    assert again["train/policy_loss"] < math.log(2) and again["train/pair_accuracy"] > 0.5


def test_forward_chunks_of_whole_groups_add_up_to_the_micro_batchs_step():
    """ppo.forward_batch_size=2: four forwards of one group each, their gradients summed
    into the one optimizer step a whole-batch forward makes (the gradient's norm: Adam's
    step would hide a scale)."""
    weights, norms = {}, {}
    for chunk in (None, 2):
        s = settings(forward_batch_size=chunk)
        models, exp = _round(s)
        stats = _update(models, exp, s)
        weights[chunk] = [p.detach().clone() for p in models.actor.module.parameters()]
        norms[chunk] = stats["train/grad_norm"]
        assert stats["train/policy_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert norms[2] == pytest.approx(norms[None], rel=1e-5) and norms[None] > 0
    for whole, chunked in zip(weights[None], weights[2], strict=True):
        torch.testing.assert_close(whole, chunked, rtol=0, atol=1e-4)   # Adam: 1e-2 a step


def test_micro_batches_smaller_than_the_round_train_whole_groups():
    """Two micro-batches of two groups each: two updates, each on its two pairs."""
    s = settings(micro_batch_size=4)
    models, exp = _round(s)
    stats = _update(models, exp, s)
    assert stats["train/updates"] == 2 and models.actor.steps == 2
    assert stats["train/policy_loss"] < math.log(2)   # the later updates see a moved policy


def test_a_round_whose_groups_all_tie_trains_nothing():
    s = settings()
    models, exp = _round(s)
    tied = exp._replace(advantages=torch.zeros_like(exp.advantages))
    before = [p.detach().clone() for p in models.actor.module.parameters()]
    assert _update(models, tied, s)["train/updates"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, models.actor.module.parameters(),
                                                 strict=True))


def test_online_kto_labels_each_answer_by_its_groups_mean():
    rewards = torch.tensor([1.0, 3.0, 2.0, -2.0,    # mean 1: 3 and 2 above, -2 below, 1 at it
                            0.1, 0.1, 0.1, 0.1,     # all equal: nothing (even in float32)
                            1.0, 0.0, 0.0, 0.0])    # one success: 1 up, 3 down
    assert feedback_labels(rewards, 4).tolist() == [0, 1, 1, -1, 0, 0, 0, 0, 1, -1, -1, -1]
    with pytest.raises(ValueError, match="groups of 5"):
        feedback_labels(rewards, 5)


def test_the_online_kto_loss_and_its_kl_point_by_hand():
    """Row 0 desirable (r = -1.5 + 3 = 1.5), row 1 unlabelled, row 2 undesirable (its third
    token off the mask: r = -4 + 4 = 0), row 3 a stand-in (no tokens)."""
    logprobs = torch.tensor([[-1.0, -0.5], [-1.0, -1.0], [-3.0, -1.0], [-2.0, -2.0]],
                            requires_grad=True)
    ref = torch.tensor([[-1.5, -1.5], [-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [0, 0.0]])
    labels = torch.tensor([1.0, 0.0, -1.0, 1.0])
    out = labelled_kto_loss(logprobs, ref, labels, mask, kl_point=0.5, beta=0.5)
    # desirable: 1 - sigmoid(0.5 (1.5 - 0.5)); undesirable: 1 - sigmoid(0.5 (0.5 - 0))
    want = ((1 - 1 / (1 + math.exp(-0.5))) + (1 - 1 / (1 + math.exp(-0.25)))) / 2
    assert out.loss.item() == pytest.approx(want)
    assert float(out.pairs) == 2 and float(out.accuracy) == 1.0   # 1.5 > z0 > 0
    assert float(out.margin) == pytest.approx((0.5 * 1.5 - 0.5 * 0.0) / 2)
    # the same as kto_feedback_loss on the two answers' sums
    same = kto_feedback_loss(torch.tensor([-1.5, -4.0]), torch.tensor([-3.0, -4.0]),
                             torch.tensor([True, False]), 0.5, 0.5)
    assert out.loss.item() == pytest.approx(float(same.loss))
    out.loss.backward()
    # d/d logp of a desirable token: -beta s(1 - s) / n with s = sigmoid(beta (r - z0))
    s = 1 / (1 + math.exp(-0.5))
    torch.testing.assert_close(logprobs.grad[0], torch.full((2,), -0.5 * s * (1 - s) / 2))
    assert logprobs.grad[2, 0] > 0 and logprobs.grad[1].abs().sum() == 0
    assert logprobs.grad[3].abs().sum() == 0   # the stand-in
    # over 4 answers (the batch's), the same sum divided by 4
    assert float(labelled_kto_loss(logprobs, ref, labels, mask, 0.5, 0.5, num_answers=4).loss) \
        == pytest.approx(want / 2)
    none = labelled_kto_loss(logprobs, ref, torch.zeros(4), mask, 0.5, 0.5)
    assert float(none.loss) == 0 and float(none.pairs) == 0 and none.loss.requires_grad
    # z0's sum: rows 0-2's log-ratios, labelled or not (1.5, 0, 0); the stand-in uncounted
    assert rollout_kl_sum(logprobs, ref, mask) == (pytest.approx(1.5 + 0.0 + 0.0), 3.0)


def test_an_online_kto_round_raises_the_desirable_answers_from_a_loss_of_a_half():
    s = settings(dpo_loss="kto", samples_per_prompt=4, rollout_batch_size=2)
    models, exp = _round(s)
    per_answer = sequence_rewards(exp.scores, exp.kl, exp.action_mask, 0.0, s.ppo.score_clip)
    labels = torch.sign(exp.advantages.sum(1))
    assert torch.equal(labels, feedback_labels(per_answer, 4)) and labels.abs().sum() == 8
    before = _margin(models, exp, mean=True)
    stats = _update(models, exp, s)
    # the reference is the start: every log-ratio and z0 are 0, each answer's loss 1/2
    assert stats["train/updates"] == 1
    assert stats["train/policy_loss"] == pytest.approx(0.5, abs=1e-5)
    assert _margin(models, exp, mean=True) > before + 1.0
    again = _update(models, exp, s)
    assert again["train/policy_loss"] < 0.5 and again["train/pair_accuracy"] > 0.5


def test_online_kto_s_kl_point_is_the_rounds_kl_to_the_reference():
    """z0 is the mean over the round's answers of their log-ratio to the reference, taken
    from the experience (the sampling policy's), held at 0 or above; a stand-in adds
    nothing."""
    s = settings(dpo_loss="kto", target_kl=None)
    models, exp = _round(s)
    rows = len(exp.sequences)
    share = Share(list(range(rows)), list(range(rows)), 1.0)
    shifted = exp._replace(logprobs=exp.ref_logprobs + 0.25 * exp.action_mask)
    z0 = 0.25 * float(exp.action_mask.sum(1).mean())
    dp = DataParallel(CPU)
    assert ppo._kl_point(shifted, share, dp) == pytest.approx(z0)
    below = exp._replace(logprobs=exp.ref_logprobs - 0.25 * exp.action_mask)
    assert ppo._kl_point(below, share, dp) == 0.0
    assert ppo._kl_point(shifted, Share([0], [0], 0.0), dp) == 0.0
    # the update's loss reads it: the policy is still the reference (r = 0), so a desirable
    # answer's loss is 1 - sigmoid(-beta z0), an undesirable one's 1 - sigmoid(beta z0)
    labels = torch.sign(exp.advantages.sum(1))
    up, down = float((labels > 0).sum()), float((labels < 0).sum())
    sig = 1 / (1 + math.exp(-0.1 * z0))
    stats = _update(models, shifted, s)
    assert stats["train/kl_point"] == pytest.approx(z0)
    assert stats["train/policy_loss"] == pytest.approx((up * sig + down * (1 - sig))
                                                       / (up + down), abs=1e-5)


def test_online_kto_trains_micro_batches_that_split_a_group():
    """Its answers train alone: micro-batches of 3 rows (groups of 2), which DPO's pairs
    refuse (tests/test_algorithms.py), are three updates."""
    s = settings(dpo_loss="kto", micro_batch_size=3)
    models, exp = _round(s)
    stats = _update(models, exp, s)
    assert stats["train/updates"] == 3 and models.actor.steps == 3
