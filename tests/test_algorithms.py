"""Step 3's critic-free estimators, KL estimators, adaptive KL controller and loss
aggregation (steps/rlhf.py) against hand-computed numbers, and the one-line errors for
bad step-3 settings and reward functions."""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import fields
from decimal import Decimal

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from engine.data_parallel import DataParallel
from engine.errors import NonFiniteError, UserError
from engine.runtime import Runtime
from steps import algorithms, demo, ppo
from steps.algorithms import load_reward_fn
from steps.config import PPOConfig, RunConfig, validate
from steps.rlhf import (
    LOSS_AGGREGATIONS,
    adaptive_kl_coef,
    coef_for_kl,
    group_normalized_advantages,
    informative_groups,
    kl_estimate,
    kl_penalized_rewards,
    leave_one_out_advantages,
    loss_weights,
    masked_sum,
    policy_loss,
    returns_to_go,
    sequence_rewards,
    tilted_kl,
    token_kl,
    whiten,
    with_group_baseline,
)
from steps.scoring import RewardFunction, Rewards

CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)


def close(got, want, tol=1e-6):
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), atol=tol, rtol=tol)


# -- group estimators: two prompts x 4 answers -----------------------------------------------

REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 2.0, 2.0])


def test_grpo_normalises_within_each_group():
    # group 1: mean 2.5, unbiased std sqrt(5/3) = 1.2909944; group 2: all equal -> 0
    s = math.sqrt(5 / 3)
    close(group_normalized_advantages(REWARDS, 4),
          [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s, 0, 0, 0, 0], tol=1e-5)


def test_dr_grpo_only_subtracts_the_group_mean():
    close(group_normalized_advantages(REWARDS, 4, scale=False),
          [-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0])


def test_rloo_subtracts_the_mean_of_the_other_answers():
    # 1 - (2+3+4)/3, 2 - (1+3+4)/3, 3 - (1+2+4)/3, 4 - (1+2+3)/3
    close(leave_one_out_advantages(REWARDS, 4), [-2, -2 / 3, 2 / 3, 2, 0, 0, 0, 0])


@pytest.mark.parametrize("group_size", [3, 5, 6, 7])
def test_a_group_of_equal_rewards_gets_exactly_zero_whatever_its_size(group_size):
    """Equal answers (common once a policy concentrates) carry no signal: in float32 the
    group's mean of 0.7234 is one ulp off, and over a std of 0 that made every answer's
    GRPO advantage -0.056 at size 7 (up to 0.24 for other values)."""
    rewards = torch.full((2 * group_size,), 0.7234)
    for advantages in (group_normalized_advantages(rewards, group_size),
                       group_normalized_advantages(rewards, group_size, scale=False),
                       leave_one_out_advantages(rewards, group_size)):
        assert advantages.dtype == torch.float32 and not advantages.any()


def test_dynamic_sampling_keeps_the_groups_whose_compared_rewards_differ():
    """DAPO's filter reads what the group estimators compare: scores clipped to
    ppo.score_clip, less their penalties. Groups of 3: scores that differ; all equal;
    7, 9 and 6, all 5 once clipped; equal scores that one answer's penalty sets apart."""
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 7.0, 9.0, 6.0, 2.0, 2.0, 2.0])
    penalty = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0.5, 0])
    assert informative_groups(scores, 3, 5.0).tolist() == [True, False, False, False]
    differ = informative_groups(scores, 3, 5.0, penalty)
    assert differ.tolist() == [True, False, False, True]
    # exactly the groups with a GRPO advantage
    rewards = sequence_rewards(scores, torch.zeros(12, 1), torch.ones(12, 1), 0.0, 5.0, penalty)
    advantages = group_normalized_advantages(rewards, 3).view(4, 3)
    assert advantages.any(1).tolist() == differ.tolist()


def test_dynamic_sampling_keeps_the_first_informative_prompts_in_the_order_sampled():
    flags = [torch.tensor([True, False, True]), torch.tensor([False, True, True, True])]
    assert [p.tolist() for p in ppo.kept_places(flags, 4)] == [[0, -1, 1], [-1, 2, 3, -1]]
    # short of the target: every informative prompt, in order
    assert [p.tolist() for p in ppo.kept_places(flags, 9)] == [[0, -1, 1], [-1, 2, 3, 4]]
    assert [p.tolist() for p in ppo.kept_places([torch.zeros(2, dtype=torch.bool)], 2)] \
        == [[-1, -1]]


def test_reinforce_pp_baseline_makes_each_score_relative_to_its_groups():
    """Groups of 2: scores 1 and 3 (mean 2); 2 and 2, the second less a penalty of 0.5
    (mean 1.75). The group's mean is subtracted at each answer's last action, the KL
    penalties stay where they are; then REINFORCE++'s returns, whitened over the batch."""
    scores, penalty = torch.tensor([1.0, 3.0, 2.0, 2.0]), torch.tensor([0.0, 0.0, 0.0, 0.5])
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    logprobs = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0], [0.0, 0.0, 0.4], [0.0, 0.0, 0.0]])
    zero = torch.zeros(4, 3)
    out = kl_penalized_rewards(scores, logprobs, zero, mask, 0.5, 5.0, penalty=penalty)
    got = with_group_baseline(out.rewards, scores, mask, 2, 5.0, penalty)
    want = [[-0.05, -0.1 - 1.0, 0], [-0.15 + 1.0, 0, 0], [0, 0, -0.2 + 0.25], [0, -0.25, 0]]
    close(got, want)
    # an all-equal group keeps its KL penalties alone, exactly
    equal = torch.full((2,), 0.7234)
    rewards = kl_penalized_rewards(equal, zero[:2], zero[:2], mask[:2], 0.5, 5.0).rewards
    assert not with_group_baseline(rewards, equal, mask[:2], 2, 5.0).any()
    settings = PPOConfig(score_clip=5.0, gamma=1.0)
    advantages, returns = ppo.ESTIMATORS["reinforce_pp_baseline"](
        settings, out.rewards, scores, penalty, out.kl, zero, mask, 0.5, 2, DataParallel(CPU))
    # gamma 1: each action's return is the sum of the rewards from it on
    close(returns, [[-1.15, -1.1, 0], [0.85, 0, 0], [0.05, 0.05, 0.05], [-0.25, -0.25, 0]])
    close(advantages, whiten(returns, mask))


def test_groups_must_divide_the_batch():
    with pytest.raises(ValueError, match="groups of 3"):
        leave_one_out_advantages(REWARDS, 3)


def test_returns_to_go_discount_the_rewards_after_each_action():
    rewards = torch.tensor([[0.1, -0.2, 1.0, 9.0], [2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    # row 0, gamma 0.5: G2 = 1.0, G1 = -0.2 + 0.5, G0 = 0.1 + 0.5 * 0.3; past the mask: 0
    close(returns_to_go(rewards, mask, 0.5), [[0.25, 0.3, 1.0, 0], [2.0, 0, 0, 0]])


def test_sequence_rewards_subtract_the_weighted_kl_sum_from_the_clipped_score():
    scores = torch.tensor([3.0, 10.0, 1.0])
    kl = torch.tensor([[0.1, 0.2, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [0, 0, 0]])
    # 3 - 0.5 * 0.3; clip(10) = 5, 5 - 0.5 * 0.5; a row without actions gets 0
    close(sequence_rewards(scores, kl, mask, 0.5, 5.0), [2.85, 4.75, 0.0])


def test_the_missing_eos_penalty_is_taken_after_the_score_clip():
    """A cut-off answer scoring at or above the clip keeps its whole penalty (taken before
    the clip, a score of 7 with a penalty of 1 was clipped back to 5, no penalty at all),
    in the per-token PPO reward and in the critic-free per-answer reward alike."""
    scores, penalty = torch.tensor([7.0, 7.0, -4.5]), torch.tensor([1.0, 0.0, 1.0])
    mask, zero = torch.ones(3, 2), torch.zeros(3, 2)
    want = [4.0, 5.0, -5.5]
    close(sequence_rewards(scores, zero, mask, 0.5, 5.0, penalty), want)
    out = kl_penalized_rewards(scores, zero, zero, mask, 0.1, 5.0, penalty=penalty)
    close(out.rewards, [[0.0, w] for w in want])
    # step 3's estimators pass it on (the critic-free ones recompute the per-answer reward)
    settings = PPOConfig(score_clip=5.0, gamma=1.0, lam=1.0)   # returns: the reward sums
    for name, estimate in ppo.ESTIMATORS.items():
        _, returns = estimate(settings, out.rewards, scores, penalty, zero, zero, mask, 0.1, 3,
                              DataParallel(CPU))
        expected = torch.tensor(want)   # REINFORCE++-baseline: relative to the group's mean
        expected -= expected.mean() if name == "reinforce_pp_baseline" else 0.0
        torch.testing.assert_close(returns[:, 0], expected, msg=name)


# -- KL estimators and the adaptive controller -----------------------------------------------


@pytest.mark.parametrize("estimator, want", [
    ("k1", [0.5, -0.5, 0.0]),
    ("k2", [0.125, 0.125, 0.0]),
    # exp(-d) - 1 + d: exp(-0.5) - 0.5 and exp(0.5) - 1.5
    ("k3", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5, 0.0]),
])
def test_kl_estimators(estimator, want):
    logprobs = torch.tensor([[-1.0, -2.0, float("nan")]])
    ref = torch.tensor([[-1.5, -1.5, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])       # garbage off the mask gives 0, not NaN
    close(kl_estimate(logprobs, ref, mask, estimator), [want])


def test_kl_penalty_in_the_reward_uses_the_named_estimator():
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]])
    mask = torch.ones(1, 2)
    out = kl_penalized_rewards(torch.tensor([2.0]), logprobs, ref, mask, 0.1, 5.0, "k2")
    close(out.rewards, [[-0.0125, 2.0 - 0.0125]])


def test_adaptive_kl_adds_a_proportional_answer_to_a_slow_integral():
    start = math.log(0.1)
    # KL twice the target: error log 2; the integral moves 0.2 * log 2 * 64/640, and the
    # coefficient answers at once by a factor of 2 (gain 1 on the log error)
    coef, integral = adaptive_kl_coef(start, 12.0, 6.0, 640, 64)
    assert integral == pytest.approx(start + 0.02 * math.log(2))
    assert coef == pytest.approx(0.1 * 2 ** 1.02)
    # 10% under the target
    coef, integral = adaptive_kl_coef(start, 5.4, 6.0, 640, 64)
    assert coef == pytest.approx(0.1 * 0.9 ** 1.02)
    assert adaptive_kl_coef(start, 6.0, 6.0, 640, 64) == pytest.approx((0.1, start))
    # the error clips at e times the target either way
    coef, integral = adaptive_kl_coef(start, 600.0, 6.0, 640, 64)
    assert (coef, integral) == pytest.approx((0.1 * math.exp(1.02), start + 0.02))
    # never below the floor, and the integral stops there: no wind-down while KL grows from 0
    assert adaptive_kl_coef(start, 0.0, 6.0, 640, 64, floor=0.099) == pytest.approx(
        (0.099, math.log(0.099)))
    assert adaptive_kl_coef(start, 0.0, 6.0, 10, 6400)[0] > 0


def toy_policy_kl(iterations: int, target: float | None, coef: float = 0.05,
                  samples: int = 64) -> list[float]:
    """KL to a uniform reference of a 50-way softmax policy trained by Adam (lr 0.2) on
    E[r] - coef * KL, the coefficient adapted each iteration with step 3's default horizon
    (ppo.KL_HORIZON_SHARE of the run's samples): its KL per iteration. Adam's momentum makes
    the KL answer the coefficient late, as it does in step 3."""
    rewards, reference = torch.linspace(0, 2, 50), torch.full((50,), 1 / 50).log()
    logits = torch.zeros(50, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.2)
    horizon = max(ppo.KL_HORIZON_SHARE * iterations * samples, samples)
    kls, floor, integral = [], coef, math.log(coef)
    for _ in range(iterations):
        logp = torch.log_softmax(logits, 0)
        kl = (logp.exp() * (logp - reference)).sum()
        optimizer.zero_grad()
        (coef * kl - (logp.exp() * rewards).sum()).backward()
        optimizer.step()
        kls.append(kl.item())
        if target is not None:
            coef, integral = adaptive_kl_coef(integral, kls[-1], target, horizon, samples,
                                              floor)
    return kls


def test_tilted_kl_by_hand_and_the_coefficient_that_hits_a_target():
    """pi_c ~ pi exp(r/c) over two sampled answers with rewards 0 and log 3, c = 1: weights
    1/4, 3/4, KL = 1/4 log(2/4) + 3/4 log(6/4). It falls from log n (c -> 0) to 0 (large c),
    and coef_for_kl finds the c whose KL, averaged over prompts, is the target."""
    rewards = torch.tensor([[0.0, math.log(3)]])
    want = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    kl = tilted_kl(rewards, torch.tensor([1e-4, 1.0, 1e4]))
    assert kl.shape == (1, 3)
    assert kl[0].tolist() == pytest.approx([math.log(2), want, 0.0], abs=1e-6)

    rewards = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    grid = ppo.KL_COEF_GRID
    curve = tilted_kl(rewards, grid).mean(0)
    for target in (0.2, 0.96, 1.8):
        coef = coef_for_kl(grid, curve, target)
        got = float(tilted_kl(rewards, torch.tensor([coef])).mean())
        assert got == pytest.approx(target, rel=1e-2)
    assert coef_for_kl(grid, curve, math.log(8)) is None        # no c reaches log n
    flat = tilted_kl(torch.ones(4, 8), grid).mean(0)
    assert coef_for_kl(grid, flat, 0.5) is None                  # nothing to tilt towards


def test_token_kl_by_hand_and_summed_over_an_answer_it_is_the_answers_kl():
    """Over two tokens, pi = (1/4, 3/4) against a uniform reference: KL = 1/4 log(1/2) +
    3/4 log(3/2), at temperature 2 from logits twice as far apart, in chunks of one row.
    Then the chain rule on a toy two-token language (3 tokens, the second's distribution
    depending on the first): the per-position KLs summed over an answer and averaged over
    every answer under pi (enumerated, weighted by its probability) equal the exact KL
    between the two distributions over whole answers, sum_y pi(y) log(pi(y) / pi_ref(y))."""
    want = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    logits, uniform = torch.tensor([[[0.0, math.log(3)]]]), torch.zeros(1, 1, 2)
    assert token_kl(logits, uniform).item() == pytest.approx(want, abs=1e-6)
    assert token_kl(2 * logits, uniform, temperature=2.0).item() == pytest.approx(want, abs=1e-6)
    batch = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    reference = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(token_kl(batch, reference, chunk=1),
                               token_kl(batch, reference), atol=1e-6, rtol=0)

    g = torch.Generator().manual_seed(2)
    first, first_ref = torch.randn(3, generator=g), torch.randn(3, generator=g)
    then, then_ref = torch.randn(3, 3, generator=g), torch.randn(3, 3, generator=g)  # [y1, y2]
    exact, expected = 0.0, 0.0
    for y1 in range(3):
        for y2 in range(3):
            log_p = first.log_softmax(0)[y1] + then[y1].log_softmax(0)[y2]
            log_q = first_ref.log_softmax(0)[y1] + then_ref[y1].log_softmax(0)[y2]
            exact += float(log_p.exp() * (log_p - log_q))
            per_position = token_kl(torch.stack([first, then[y1]])[None],
                                    torch.stack([first_ref, then_ref[y1]])[None])
            expected += float(log_p.exp() * per_position.sum())
    assert expected == pytest.approx(exact, abs=1e-6)


@pytest.mark.parametrize("iterations", [150, 1500])
def test_adaptive_kl_settles_at_the_target_in_a_short_and_a_long_run(iterations):
    """The default horizon scales with the run: in the demo's length (150 iterations) and
    one 10x longer the KL holds the target over the second half. (Ziegler's integral-only
    controller at this horizon cycles here: coefficient 0.05 <-> 8.8, the KL off the target
    by 85% on average over the short run's second half.)"""
    uncontrolled = toy_policy_kl(iterations, target=None)
    assert statistics.fmean(uncontrolled[iterations // 2:]) > 2.0   # the drift it stops
    held = toy_policy_kl(iterations, target=1.0)[iterations // 2:]
    assert statistics.fmean(abs(kl - 1.0) for kl in held) < 0.1
    assert max(held) < 1.3
    assert statistics.fmean(held[-iterations // 10:]) == pytest.approx(1.0, rel=0.1)


# -- loss aggregation ----------------------------------------------------------------------


def test_token_mean_and_seq_mean_aggregation():
    x = torch.tensor([[3.0, 6.0, 9.0, 100.0], [4.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    weights, count = loss_weights(mask, "token-mean")
    assert masked_sum(x, weights) / count == pytest.approx((3 + 6 + 9 + 4) / 4)
    weights, count = loss_weights(mask, "seq-mean")
    assert float(count) == 2
    assert masked_sum(x, weights) / count == pytest.approx((6 + 4) / 2)  # (mean 6, mean 4)
    # Dr. GRPO: each answer's sum over the budget of 5 tokens, averaged: (18/5 + 4/5) / 2
    weights, count = loss_weights(mask, "seq-mean-token-sum-norm", max_new_tokens=5)
    assert float(count) == 2
    assert masked_sum(x, weights) / count == pytest.approx((18 / 5 + 4 / 5) / 2)


def test_seq_mean_policy_loss_weighs_answers_equally():
    logprobs = old = torch.zeros(2, 3)     # ratio 1: the loss is -mean(advantage)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    weights, count = loss_weights(mask, "seq-mean")
    assert float(policy_loss(logprobs, old, advantages, weights, 0.2, count).loss) == -2.5
    weights, count = loss_weights(mask, "token-mean")
    assert float(policy_loss(logprobs, old, advantages, weights, 0.2, count).loss) == -7 / 4


# -- settings and reward functions: one-line errors naming the key ---------------------------


def settings(**changes):
    return OmegaConf.merge(OmegaConf.structured(PPOConfig), changes)


@pytest.mark.parametrize("changes, said", [
    (dict(algorithm="grpo"), "ppo.samples_per_prompt=1: grpo"),
    (dict(algorithm="rloo", samples_per_prompt=1), "ppo.samples_per_prompt=1: rloo"),
    (dict(algorithm="kto"), "ppo.algorithm=kto: choose one of ppo, grpo, rloo, reinforce_pp"),
    (dict(kl_estimator="k4"), "ppo.kl_estimator=k4"),
    (dict(loss_aggregation="sum"), "ppo.loss_aggregation=sum"),
    (dict(reward_model_weight=0.0), "ppo.reward_model_weight=0 leaves nothing"),
    (dict(reward_fn="no_such_module_xyz:score"), "ppo.reward_fn=no_such_module_xyz:score: "
     "cannot import"),
    (dict(reward_fn="steps.demo:no_such_fn"), "steps.demo has no function no_such_fn"),
    (dict(reward_fn="steps.demo"), "give package.module:function"),
    (dict(kl_target=-1.0), "ppo.kl_target=-1.0"),
    (dict(algorithm="grpo", samples_per_prompt=2, rollout_batch_size=2, micro_batch_size=8),
     "ppo.micro_batch_size must not exceed"),
    (dict(dual_clip=1.0), "ppo.dual_clip=1.0: give a number above 1"),
    (dict(dual_clip=float("inf")), "ppo.dual_clip=inf: not a finite number; give a number "
     "above 1"),
    (dict(clip_range_high=0.0), "ppo.clip_range_high=0.0"),
    (dict(max_new_tokens=16, overlong_buffer=32), "ppo.overlong_buffer=32: give at most "
     "ppo.max_new_tokens (16)"),
    (dict(dynamic_sampling=True), "ppo.dynamic_sampling drops the prompts whose answers all "
     "score the same, which only a group algorithm learns nothing from: set "
     "ppo.algorithm=grpo, rloo or reinforce_pp_baseline (not ppo)"),
    (dict(algorithm="reinforce_pp", samples_per_prompt=4, dynamic_sampling=True),
     "(not reinforce_pp)"),
    (dict(dynamic_sampling_max_draws=0), "ppo.dynamic_sampling_max_draws=0"),
    (dict(algorithm="grpo", samples_per_prompt=4, critic_warmup=2), "ppo.critic_warmup=2 "
     "trains the critic alone first, and grpo has none"),
    (dict(extra_reward_paths=["rm2"], reward_model_weight=0.0, reward_fn="steps.demo:score"),
     "ppo.extra_reward_paths are scored with the reward model, and ppo.reward_model_weight=0 "
     "uses none"),
    (dict(reward_ensemble="max"), "ppo.reward_ensemble=max: choose one of mean, min"),
    (dict(normalize_reward=True, reward_model_weight=0.0, reward_fn="steps.demo:score"),
     "ppo.normalize_reward=true standardises the reward model's scores, and "
     "ppo.reward_model_weight=0 uses no reward model"),
    (dict(algorithm="online_dpo"), "ppo.samples_per_prompt=1: online_dpo compares"),
    (dict(algorithm="online_dpo", samples_per_prompt=3, micro_batch_size=8),
     "ppo.micro_batch_size=8: online DPO pairs the answers to one prompt, so give a multiple "
     "of ppo.samples_per_prompt (3)"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, forward_batch_size=2),
     "ppo.forward_batch_size=2: online DPO pairs"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, kl_target=1.0),
     "ppo.kl_target=1.0 is not read by ppo.algorithm=online_dpo (the DPO loss's ppo.dpo_beta "
     "weighs the KL"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, dual_clip=3.0), "ppo.dual_clip=3.0 is "
     "not read"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, kl_penalty="loss"),
     "ppo.kl_penalty=loss is not read by ppo.algorithm=online_dpo"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, loss_aggregation="seq-mean"),
     "ppo.loss_aggregation=seq-mean is not read"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, entropy_coef=0.01),
     "ppo.entropy_coef=0.01: online DPO's loss is one per pair"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, mask_truncated=True),
     "ppo.mask_truncated=true would leave a pair with one answer"),
    (dict(algorithm="grpo", samples_per_prompt=4, dpo_beta=0.5), "ppo.dpo_beta sets online "
     "DPO's loss, and ppo.algorithm=grpo does not read it"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, dpo_loss="simpo"),
     "ppo.dpo_loss=simpo: choose one of sigmoid, ipo, hinge, kto"),
    (dict(algorithm="online_dpo", samples_per_prompt=4, dpo_loss="kto", kl_target=1.0),
     "ppo.kl_target=1.0 is not read by ppo.algorithm=online_dpo"),
])
def test_bad_settings_are_refused_naming_the_key(changes, said):
    """Each key's own range is the schema's (steps/config.py), the rules between keys
    check_settings': both run before step 1."""
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"ppo": changes})
    with pytest.raises((UserError, ValueError), match=re.escape(said)) as error:
        validate(cfg)
        algorithms.check_settings(cfg.ppo)
    assert "\n" not in str(error.value)


def test_online_kto_takes_what_its_answers_alone_allow():
    """KTO's answers train alone: no pair to keep whole, so ppo.mask_truncated and
    micro-batches that split a group are taken (DPO's pairs refuse both, above)."""
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"ppo": dict(
        algorithm="online_dpo", samples_per_prompt=4, dpo_loss="kto", mask_truncated=True,
        micro_batch_size=6, forward_batch_size=3)})
    validate(cfg)
    algorithms.check_settings(cfg.ppo)


def test_the_schema_accepts_every_algorithm_of_the_table():
    rule = next(f for f in fields(PPOConfig) if f.name == "algorithm").metadata["ok"]
    assert all(rule.test(name) for name in (*algorithms.ALGORITHMS, *algorithms.OFFLINE))
    assert not rule.test("kto")
    assert algorithms.CRITIC_FREE == ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                      "online_dpo")
    assert ppo.ESTIMATORS.keys() == algorithms.ALGORITHMS.keys()   # each has its estimator


def test_the_schema_accepts_every_loss_aggregation_of_loss_weights():
    """steps/config.py names the aggregations without importing torch's side: the same
    list as rlhf.LOSS_AGGREGATIONS, which loss_weights implements."""
    rule = next(f for f in fields(PPOConfig) if f.name == "loss_aggregation").metadata["ok"]
    assert all(rule.test(name) for name in LOSS_AGGREGATIONS) and not rule.test("seq-sum")
    mask = torch.ones(2, 3)
    for name in LOSS_AGGREGATIONS:
        loss_weights(mask, name, max_new_tokens=4)


def test_the_group_algorithms_accept_their_settings():
    for algorithm in algorithms.ALGORITHMS:
        algorithms.check_settings(settings(algorithm=algorithm, samples_per_prompt=4,
                                    reward_fn="steps.demo:score", reward_model_weight=0.0))


def test_kl_placement_defaults_per_algorithm():
    assert ppo.kl_settings(settings(algorithm="grpo")) == ppo.KLSettings(True, "k3")
    for algorithm in ("ppo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert ppo.kl_settings(settings(algorithm=algorithm)) == ppo.KLSettings(False, "k1")
    assert ppo.kl_settings(settings(algorithm="grpo", kl_penalty="reward")) == \
        ppo.KLSettings(False, "k1")
    assert ppo.kl_settings(settings(kl_penalty="loss", kl_estimator="k2")) == \
        ppo.KLSettings(True, "k2")


class ByteTokenizer:
    """decode = the byte values as text: enough for Rewards to hand texts to a function."""

    def decode(self, ids, **kwargs):
        return "".join(chr(t) for t in ids if t)

    def batch_decode(self, rows, **kwargs):
        return [self.decode(row) for row in rows]


def rewards_of(fn, prompt="Q?", answers=("ab", "c")):
    rows = [[ord(ch) for ch in prompt + a.ljust(2, "\0")] for a in answers]
    sequences = torch.tensor(rows)
    rewards = Rewards(ByteTokenizer(), None, 0.0, RewardFunction(fn, "tests:fn"), 2.0)
    return rewards(sequences, torch.ones_like(sequences), len(prompt))


def test_reward_function_sees_prompt_and_answer_texts_and_is_weighted():
    seen = []

    def fn(prompt, answer):
        seen.append((prompt, answer))
        return len(answer)

    close(rewards_of(fn), [4.0, 2.0])      # weight 2 x length
    assert seen == [("Q?", "ab"), ("Q?", "c")]


@pytest.mark.parametrize("fn, said", [
    (lambda p, a: 1 / 0, r"ppo.reward_fn=tests:fn raised ZeroDivisionError: division by zero "
     r"\(on prompt 'Q\?', answer 'ab'\)"),
    (lambda p, a: "high", r"ppo.reward_fn=tests:fn returned 'high' .*finite number"),
    (lambda p, a: float("nan"), r"returned nan .*finite number"),
    (lambda p, a: None, r"returned None"),
    # finite in Python, inf in the float32 rewards: trained on as inf (clipped to
    # ppo.reward_clip) and evaluated as inf or NaN
    (lambda p, a: 1e39, r"returned 1e\+39 .*within float32's range"),
    (lambda p, a: 10**400, r"returned 1000.* within float32's range"),
    (lambda p, a: [0.5], r"returned \[0.5\]"),
])
def test_reward_function_failures_are_one_line_errors(fn, said):
    with pytest.raises(UserError, match=said) as error:
        rewards_of(fn)
    assert "\n" not in str(error.value)


def test_reward_function_may_return_any_real_number():
    """A one-value tensor or a Decimal is a number (TRL's reward functions return tensors);
    a weighted sum past float32's range stops the run in one line."""
    close(rewards_of(lambda p, a: torch.tensor(0.25)), [0.5, 0.5])
    close(rewards_of(lambda p, a: Decimal("0.25")), [0.5, 0.5])
    close(rewards_of(lambda p, a: np.float32(0.25)), [0.5, 0.5])
    with pytest.raises(NonFiniteError, match=r"2 of 2 rewards went NaN or inf .* lower "
                                             r"ppo.reward_model_weight / ppo.reward_fn_weight"):
        rewards_of(lambda p, a: 3e38)   # weight 2


def test_the_demo_scorer_is_a_reward_function():
    score = load_reward_fn("steps.demo:score")
    assert score("\n\nHuman: Give me some even digits.\n\nAssistant:", " 2 4 7") == 2 / 3


# -- the distinct task: a second verifiable demo task without degenerate answers -----------


def test_distinct_task_scores_the_requested_digits_once_each():
    prompt = demo.prompt_text("Give me 4 different even digits.")
    assert demo.requested_count(prompt) == 4
    assert demo.score(prompt, " 2 4 6 8") == 1.0
    assert demo.score(prompt, " 2 2 2 2") == 1 / 4            # repetition counts once
    assert demo.score(prompt, " 2 4 6 8 0 2") == 4 / 6        # extra digits dilute
    assert demo.score(prompt, " 2 4") == 2 / 4                # too few cannot score full
    assert demo.score(prompt, " 2 4 7 8 0") == 3 / 5          # 7 wrong; 0 past the fourth
    assert demo.score(prompt, " 2468") == 0.0


def test_distinct_task_pairs_are_well_formed_and_ordered():
    pairs = demo.make_pairs(300, seed=3, task="distinct")
    for pair in pairs:
        count = demo.requested_count(pair.prompt)
        assert 3 <= count <= 5
        for answer in (pair.chosen, pair.rejected):   # no empty, run-together or repeats
            tokens = answer.split()
            assert count - 2 <= len(tokens) <= count + 2 and all(len(t) == 1 for t in tokens)
            assert len(set(tokens)) == len(tokens)
        assert demo.score(pair.prompt, pair.chosen) > demo.score(pair.prompt, pair.rejected)
    assert demo.make_pairs(50, seed=3) == demo.make_pairs(50, seed=3, task="digits")
