"""Hand-computed checks of the PPO / reward-model / DPO / SFT math in steps/rlhf.py."""

from __future__ import annotations

import math

import pytest
import torch

from steps.rlhf import (
    LOSS_AGGREGATIONS,
    answer_mask,
    dpo_loss,
    ema_update,
    gae,
    kl_penalized_rewards,
    logprobs_of_tokens,
    loss_weights,
    masked_mean,
    masked_sum,
    masked_var,
    overlong_penalty,
    pairwise_reward_loss,
    policy_loss,
    sequence_logprobs,
    sft_loss,
    statistic_weights,
    value_loss,
    whiten,
)


def close(actual, expected, atol=1e-5):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------
# answer_mask
# --------------------------------------------------------------------------------------------


def test_answer_mask_early_eos_no_eos_empty_answer():
    eos = 2
    ids = torch.tensor(
        [
            [5, 2, 7, 2],  # ends at column 1; the second EOS is already padding
            [5, 6, 7, 8],  # no EOS: cut at N, all 4 are actions
            [2, 9, 9, 9],  # empty answer: EOS first -> exactly one action
        ]
    )
    mask = answer_mask(ids, eos)
    assert mask.dtype == torch.float32
    close(mask, [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])


def test_answer_mask_multiple_eos_ids():
    ids = torch.tensor([[5, 3, 2, 1], [2, 3, 4, 4], [4, 4, 4, 4]])
    close(answer_mask(ids, (2, 3)), [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    close(answer_mask(ids, [3]), [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])


# --------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------


def test_masked_mean_var_and_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    m = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])
    close(masked_sum(x, m), 10.0)
    close(masked_mean(x, m), 2.5)  # (1+2+3+4)/4
    # squared deviations from 2.5: 2.25, 0.25, 0.25, 2.25 -> sum 5
    close(masked_var(x, m), 5.0 / 3.0)  # unbiased: 5 / (4-1)
    close(masked_var(x, m, unbiased=False), 1.25)  # 5 / 4

    w = whiten(x, m)
    # (1 - 2.5) / sqrt(5/3) = -1.5 / 1.2909944 = -1.1618950
    close(w[0], -1.1618950)
    close(w[4], 0.0)  # outside the mask stays 0
    close(masked_mean(w, m), 0.0)
    close(masked_var(w, m), 1.0, atol=1e-4)
    # shift_mean=False adds the mean back: -1.1618950 + 2.5
    close(whiten(x, m, shift_mean=False)[0], 1.3381050)


def test_masked_mean_dim_and_empty_masks_give_no_nan():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    m = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    close(masked_mean(x, m, dim=1), [1.0, 0.0])  # second row empty -> 0, not NaN

    empty = torch.zeros(2, 2)
    garbage = torch.tensor([[float("inf"), float("nan")], [1.0, 2.0]])
    for value in (
        masked_mean(x, empty),
        masked_mean(garbage, empty),
        masked_var(x, empty),
        masked_var(x, torch.tensor([[1.0, 0.0], [0.0, 0.0]])),  # n=1: 0, not inf
        whiten(x, empty),
    ):
        assert torch.isfinite(value).all()
        close(value, torch.zeros_like(value))


# --------------------------------------------------------------------------------------------
# logprobs_of_tokens
# --------------------------------------------------------------------------------------------


def test_logprobs_of_tokens_hand_computed():
    # logsumexp([0, 1, 2]) = log(1 + e + e^2) = log(11.1073379) = 2.4076060
    # logsumexp([5, 5, 5]) = 5 + log 3, so every token has log-prob -log 3 = -1.0986123
    logits = torch.tensor([[[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [5.0, 5.0, 5.0]]])
    tokens = torch.tensor([[2, 0, 1]])
    expected = [[2.0 - 2.4076060, 0.0 - 2.4076060, -1.0986123]]
    out = logprobs_of_tokens(logits, tokens)
    assert out.shape == (1, 3) and out.dtype == torch.float32
    close(out, expected)

    out_bf16 = logprobs_of_tokens(logits.to(torch.bfloat16), tokens)  # 0,1,2,5 exact in bf16
    assert out_bf16.dtype == torch.float32
    close(out_bf16, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 55, 110, 121, 2**24])
def test_chunked_logprobs_equal_the_full_log_softmax(dtype, temperature, chunk):
    """Values and gradients of the fused, chunked log-probs equal autograd through a full
    float32 log_softmax to rounding, for chunks of 1 row (chunk <= T * V = 55), 2 rows (110,
    121: the last chunk shorter) and all 3; the gradient comes back in the logits' dtype and
    float32 logits are left as they were."""
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 11)).to(dtype).requires_grad_()
    tokens = torch.randint(0, 11, (3, 5))
    upstream = torch.randn(3, 5)
    before = logits.detach().clone()
    got = logprobs_of_tokens(logits, tokens, temperature, chunk=chunk)
    (got_grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    want = torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])
    (want_grad,) = torch.autograd.grad((want.squeeze(-1) * upstream).sum(), logits)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    torch.testing.assert_close(got, want.squeeze(-1), rtol=0, atol=2e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=1e-6)
    assert torch.equal(logits.detach(), before)


def test_chunked_logprobs_keep_no_float32_vocab_sized_tensor_for_backward():
    """What autograd keeps for the backward of bf16 logits [B, T, V]: the logits themselves
    (already alive as the model's output) and the tokens, no float32 [B, T, V] copy (a
    log_softmax(dtype=float32) keeps one: the memory issue 22 measured)."""
    saved = []

    def keep(tensor):
        saved.append((tensor.dtype, tensor.numel()))
        return tensor

    logits = torch.randn(4, 6, 50, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 50, (4, 6))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logprobs_of_tokens(logits, tokens, 0.7, chunk=2 * 6 * 50)
    assert not any(dtype == torch.float32 for dtype, _ in saved)   # only its bf16 inputs
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):   # the old way
        torch.log_softmax(logits, -1, dtype=torch.float32)
    assert (torch.float32, logits.numel()) in saved


def test_chunked_logprob_gradient_hand_computed():
    # d log softmax(x / T)_k / d x_j = (1[j = k] - softmax(x / T)_j) / T
    # x = [0, ln 3] at T = 1: softmax = [1/4, 3/4]; token 0 -> [3/4, -3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)
    out = logprobs_of_tokens(logits, torch.tensor([[0]]))
    close(out, [[math.log(0.25)]])
    out.sum().backward()
    close(logits.grad, [[[0.75, -0.75]]])


# --------------------------------------------------------------------------------------------
# kl_penalized_rewards
# --------------------------------------------------------------------------------------------


def test_kl_penalized_rewards_hand_computed():
    logprobs = torch.tensor(
        [
            [-1.0, -2.0, -0.5, -9.0],
            [-1.0, -1.0, -1.0, -1.0],
            [-1.0, -1.0, -1.0, -1.0],
        ]
    )
    ref = torch.tensor(
        [
            [-1.5, -1.0, -0.5, -3.0],
            [-2.0, -1.0, -1.0, -0.5],
            [-5.0, -5.0, -5.0, -5.0],
        ]
    )
    mask = torch.tensor(
        [
            [1.0, 1.0, 1.0, 0.0],  # row 0: EOS at column 2
            [1.0, 1.0, 1.0, 1.0],  # row 1: cut at N
            [0.0, 0.0, 0.0, 0.0],  # row 2: no actions
        ]
    )
    scores = torch.tensor([3.0, -10.0, 7.0])
    out = kl_penalized_rewards(scores, logprobs, ref, mask, kl_coef=0.1, score_clip=5.0)
    # row 0: kl = [-1+1.5, -2+1, 0, (masked)] = [0.5, -1.0, 0, 0]
    #        reward = -0.1*kl = [-0.05, 0.1, 0, 0]; score 3 (inside the clip) at column 2
    # row 1: kl = [-1+2, 0, 0, -1+0.5] = [1, 0, 0, -0.5]
    #        reward = [-0.1, 0, 0, 0.05]; score -10 clipped to -5 at column 3: 0.05 - 5 = -4.95
    # row 2: nothing
    close(out.kl, [[0.5, -1.0, 0.0, 0.0], [1.0, 0.0, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]])
    close(
        out.rewards,
        [[-0.05, 0.1, 3.0, 0.0], [-0.1, 0.0, 0.0, -4.95], [0.0, 0.0, 0.0, 0.0]],
    )


def test_kl_penalized_rewards_empty_answer_gets_score_on_eos():
    # "empty" answer: only the EOS is an action, the score lands on column 0
    out = kl_penalized_rewards(
        torch.tensor([2.0]),
        torch.tensor([[-1.0, 0.0, 0.0]]),
        torch.tensor([[-1.0, 0.0, 0.0]]),
        torch.tensor([[1.0, 0.0, 0.0]]),
        kl_coef=0.1,
        score_clip=5.0,
    )
    close(out.rewards, [[2.0, 0.0, 0.0]])


# --------------------------------------------------------------------------------------------
# gae
# --------------------------------------------------------------------------------------------


def test_gae_gamma1_lam095_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # delta2 = 1 + 0 - 0.7 = 0.3 (value after the end is 0)
    # delta1 = 0 + 0.7 - 0.6 = 0.1
    # delta0 = 0 + 0.6 - 0.5 = 0.1
    # A2 = 0.3; A1 = 0.1 + 0.95*0.3 = 0.385; A0 = 0.1 + 0.95*0.385 = 0.46575
    close(adv, [[0.46575, 0.385, 0.3]])
    close(ret, [[0.96575, 0.985, 1.0]])  # A + V


def test_gae_gamma09_lam1_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    mask = torch.ones(1, 3)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=1.0)
    # delta2 = 2 - 1.5 = 0.5
    # delta1 = 0 + 0.9*1.5 - 1.0 = 0.35
    # delta0 = 1 + 0.9*1.0 - 0.5 = 1.4
    # A2 = 0.5; A1 = 0.35 + 0.9*0.5 = 0.8; A0 = 1.4 + 0.9*0.8 = 2.12
    close(adv, [[2.12, 0.8, 0.5]])
    # lam = 1: returns are the discounted Monte-Carlo returns 2, 0+0.9*2, 1+0.9*1.8
    close(ret, [[2.62, 1.8, 2.0]])


def test_gae_lam0_and_gamma1_lam1():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3)
    # lam = 0: A = delta = [0.1, 0.1, 0.3] (see the gamma=1, lam=0.95 test)
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    close(adv, [[0.1, 0.1, 0.3]])
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t = [1-0.5, 1-0.6, 1-0.7]
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_early_end_does_not_bootstrap_and_masked_stay_zero():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 100.0], [3.0, 4.0, 5.0]])  # 100: garbage after the end
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 0 ends at column 1, so V after it is 0, not 100:
    # delta1 = 1 + 0 - 0.6 = 0.4; delta0 = 0 + 0.6 - 0.5 = 0.1
    # A1 = 0.4; A0 = 0.1 + 0.95*0.4 = 0.48; returns = [0.98, 1.0]
    close(adv, [[0.48, 0.4, 0.0], [0.0, 0.0, 0.0]])
    close(ret, [[0.98, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert not adv.requires_grad


def _reference_gae(rewards, values, mask, gamma, lam):
    """Plain per-row reverse loop over the actions [0, length)."""
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        length = int(mask[b].sum())
        running = 0.0
        for t in reversed(range(length)):
            next_value = float(values[b, t + 1]) if t + 1 < length else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 1.0), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_reverse_loop_on_random_data(gamma, lam):
    g = torch.Generator().manual_seed(0)
    batch, n = 6, 17
    rewards = torch.randn(batch, n, generator=g)
    values = torch.randn(batch, n, generator=g)
    lengths = torch.randint(0, n + 1, (batch,), generator=g)
    lengths[0], lengths[1] = 0, n  # an all-zero row and a row cut at N
    mask = (torch.arange(n).unsqueeze(0) < lengths.unsqueeze(1)).float()
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected = _reference_gae(rewards, values, mask, gamma, lam).float()
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, (expected + values) * mask, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# policy_loss
# --------------------------------------------------------------------------------------------


def test_policy_loss_hand_computed():
    # clip_range 0.2 -> ratios clipped to [0.8, 1.2]; old log-probs 0, new log-probs log r
    ratios = torch.tensor([[1.1, 1.5, 0.5, 1.5, 0.5]])
    adv = torch.tensor([[1.0, 1.0, -2.0, -2.0, 1.0]])
    # per token max(-A*r, -A*clip(r)):
    #   A=+1, r=1.1 (inside):   max(-1.1, -1.1) = -1.1
    #   A=+1, r=1.5 (above):    max(-1.5, -1.2) = -1.2   clipped
    #   A=-2, r=0.5 (below):    max( 1.0,  1.6) =  1.6   clipped
    #   A=-2, r=1.5 (above):    max( 3.0,  2.4) =  3.0   (pessimistic, unclipped)
    #   A=+1, r=0.5 (below):    max(-0.5, -0.8) = -0.5   (unclipped)
    # loss = (-1.1 - 1.2 + 1.6 + 3.0 - 0.5) / 5 = 1.8 / 5 = 0.36; clip_fraction = 2/5
    new = ratios.log().requires_grad_(True)
    old = torch.zeros_like(new)
    mask = torch.ones_like(new)
    out = policy_loss(new, old, adv, mask, clip_range=0.2)
    close(out.loss, 0.36)
    close(out.clip_fraction, 0.4)
    close(out.ratio_mean, 1.02)  # (1.1 + 1.5 + 0.5 + 1.5 + 0.5) / 5
    # k3: (r-1) - log r:  1.1 -> 0.1 - 0.0953102 = 0.0046898
    #                     1.5 -> 0.5 - 0.4054651 = 0.0945349 (twice)
    #                     0.5 -> -0.5 + 0.6931472 = 0.1931472 (twice)
    # mean = (0.0046898 + 2*0.0945349 + 2*0.1931472) / 5 = 0.5800540 / 5 = 0.1160108
    close(out.approx_kl, 0.1160108)
    for stat in (out.clip_fraction, out.approx_kl, out.ratio_mean):
        assert not stat.requires_grad
    # gradient: unclipped tokens d(-A*r)/dlogp = -A*r, divided by 5; clipped tokens 0
    out.loss.backward()
    close(new.grad, [[-1.1 / 5, 0.0, 0.0, 2.0 * 1.5 / 5, -0.5 / 5]])


def test_clip_higher_and_dual_clip_hand_computed():
    """The same tokens as test_policy_loss_hand_computed, clip_range 0.2 low and 0.3 high
    (DAPO's clip-higher), then a dual clip of c = 1.25 on negative advantages."""
    ratios = torch.tensor([[1.1, 1.5, 0.5, 1.5, 0.5]])
    adv = torch.tensor([[1.0, 1.0, -2.0, -2.0, 1.0]])
    # clip to [0.8, 1.3]:
    #   A=+1, r=1.5: max(-1.5, -1.3) = -1.3 clipped (was -1.2 at 0.2)
    #   the others as before: -1.1, 1.6 (clipped), 3.0, -0.5
    # loss = (-1.1 - 1.3 + 1.6 + 3.0 - 0.5) / 5 = 1.7 / 5 = 0.34; clip_fraction 2/5
    new = ratios.log().requires_grad_(True)
    out = policy_loss(new, torch.zeros_like(new), adv, torch.ones_like(new), 0.2,
                      clip_range_high=0.3)
    close(out.loss, 0.34)
    close(out.clip_fraction, 0.4)
    out.loss.backward()
    close(new.grad, [[-1.1 / 5, 0.0, 0.0, 2.0 * 1.5 / 5, -0.5 / 5]])
    # dual clip c = 1.25: A < 0 tokens at most -A c = 2.5:
    #   A=-2, r=0.5: 1.6 (under 2.5, kept); A=-2, r=1.5: 3.0 -> 2.5 (capped, no gradient)
    # loss = (-1.1 - 1.2 + 1.6 + 2.5 - 0.5) / 5 = 1.3 / 5 = 0.26; clip_fraction 3/5
    new = ratios.log().requires_grad_(True)
    out = policy_loss(new, torch.zeros_like(new), adv, torch.ones_like(new), 0.2,
                      dual_clip=1.25)
    close(out.loss, 0.26)
    close(out.clip_fraction, 0.6)
    out.loss.backward()
    close(new.grad, [[-1.1 / 5, 0.0, 0.0, 0.0, -0.5 / 5]])


def test_gspo_sequence_ratio_hand_computed():
    """GSPO (sequence_ratio): each answer's tokens share its geometric-mean ratio, clipped
    as one, and token t's gradient is -A_t * s / count (GSPO-token: a token's own
    advantage, not its answer's mean). clip_range 0.1: [0.9, 1.1]."""
    # row 0: 2 tokens of ratios 1.2, 1.0 (a garbage log-ratio of 50 in its padding);
    #        s0 = sqrt(1.2) = 1.0954451, inside the clip; token advantages -1, -3
    # row 1: 3 tokens of ratios 2, 0.5, 1.5: s1 = 1.5^(1/3) = 1.1447142, above 1.1; A = +1
    new = torch.tensor([[1.2, 1.0, math.exp(50)], [2.0, 0.5, 1.5]]).log().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([[-1.0, -3.0, 0.0], [1.0, 1.0, 1.0]])
    out = policy_loss(new, torch.zeros(2, 3), adv, mask, 0.1, sequence_ratio=True)
    # per token max(-A s, -A clip(s)): row 0: 1.0954451, 3.2863353 (unclipped); row 1:
    # max(-1.1447142, -1.1) = -1.1 on each of its 3 tokens (clipped)
    # loss = (1.0954451 + 3.2863353 - 3 * 1.1) / 5 = 0.2163561; clip_fraction 3/5
    close(out.loss, 0.2163561)
    close(out.clip_fraction, 0.6)
    close(out.ratio_mean, (2 * 1.0954451 + 3 * 1.1447142) / 5)
    # the KL statistic stays the tokens' k3 (what target_kl reads): 1.2 -> 0.0176784,
    # 1.0 -> 0, 2 -> 0.3068528, 0.5 -> 0.1931472, 1.5 -> 0.0945349; mean 0.1224427
    close(out.approx_kl, 0.1224427)
    out.loss.backward()
    close(new.grad, [[1.0954451 / 5, 3 * 1.0954451 / 5, 0.0], [0.0, 0.0, 0.0]])
    # PPO's token ratios on the same tokens: row 0: max(1.2, 1.1) = 1.2 (A < 0, the
    # pessimistic side: not clipped), 3.0; row 1: -1.1 (2, clipped), -0.5 (0.5, not),
    # -1.1 (1.5, clipped); loss (1.2 + 3 - 1.1 - 0.5 - 1.1) / 5 = 0.3, clip_fraction 2/5
    token = policy_loss(new.detach(), torch.zeros(2, 3), adv, mask, 0.1)
    close(token.loss, 0.3)
    close(token.clip_fraction, 0.4)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_an_unmoved_policy_reads_ratio_one_under_every_aggregation(aggregation):
    """The update's statistics are means under every loss aggregation: a policy that has
    not moved reads a ratio of 1 and no KL, and one whose every token moved by log 1.5
    reads 1.5 and every token clipped, also under Dr. GRPO's token-sum weights (which
    summed to length / max_new_tokens per answer and read 1.5 x 3/8 for answers of 3)."""
    mask = torch.tensor([[1.0, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0]])
    advantages = torch.ones(2, 8)
    weights, count = loss_weights(mask, aggregation, max_new_tokens=8)
    stats = statistic_weights(mask, aggregation)
    for log_ratio, ratio, kl, clipped in ((0.0, 1.0, 0.0, 0.0),
                                          (math.log(1.5), 1.5, 0.5 - math.log(1.5), 1.0)):
        out = policy_loss(torch.full((2, 8), log_ratio), torch.zeros(2, 8), advantages,
                          weights, 0.2, count, stat_weights=stats)
        close(out.ratio_mean, ratio)
        close(out.approx_kl, kl)
        close(out.clip_fraction, clipped)


def test_overlong_penalty_rises_linearly_over_the_buffer():
    # budget 20, buffer 8: free up to 12 tokens, then (length - 12) / 8 of the penalty 0.5
    lengths = torch.tensor([0, 12, 13, 16, 20])
    close(overlong_penalty(lengths, 20, 8, 0.5), [0.0, 0.0, 0.0625, 0.25, 0.5])
    close(overlong_penalty(lengths, 20, 20, 1.0), [0.0, 0.6, 0.65, 0.8, 1.0])


def test_policy_loss_masked_positions_have_no_effect():
    new = torch.tensor([[0.1, -0.2, 0.3, 0.0], [0.05, 0.0, 0.0, 0.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])

    def run(new, old, adv):
        new = new.clone().requires_grad_(True)
        out = policy_loss(new, old, adv, mask, clip_range=0.2)
        out.loss.backward()
        return out, new.grad

    base, base_grad = run(new, old, adv)
    # garbage off the mask: exp(1e4) would be inf, huge advantages
    off = mask == 0
    new2 = torch.where(off, torch.full_like(new, 1e4), new)
    old2 = torch.where(off, torch.full_like(old, -1e4), old)
    adv2 = torch.where(off, torch.full_like(adv, 1e6), adv)
    other, other_grad = run(new2, old2, adv2)
    for a, b in zip(base, other, strict=True):
        assert torch.isfinite(b)
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(base_grad, other_grad)
    assert (other_grad[off] == 0).all()


def test_policy_loss_all_masked_is_zero_not_nan():
    new = torch.zeros(2, 3, requires_grad=True)
    out = policy_loss(new, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), 0.2)
    assert all(torch.isfinite(x) for x in out)
    close(out.loss, 0.0)
    out.loss.backward()
    close(new.grad, torch.zeros(2, 3))


# --------------------------------------------------------------------------------------------
# value_loss
# --------------------------------------------------------------------------------------------


def test_value_loss_hand_computed():
    # clip_range 0.2 -> v_clip = clip(v, old - 0.2, old + 0.2)
    values = torch.tensor([[1.0, 1.5, 1.5, 0.5, 9.0]], requires_grad=True)
    old = torch.tensor([[0.9, 1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # last token masked: ignored
    # 1: v=1.0 (within clip)  -> (1-2)^2 = 1.0 both                      -> 1.0
    # 2: v=1.5 -> v_clip 1.2: (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64          -> 0.64 clipped
    # 3: v=1.5 -> v_clip 1.2: (1.5-1)^2 = 0.25, (1.2-1)^2 = 0.04          -> 0.25
    # 4: v=0.5 -> v_clip 0.8: (0.5-0)^2 = 0.25, (0.8-0)^2 = 0.64          -> 0.64 clipped
    # loss = 0.5 * (1.0 + 0.64 + 0.25 + 0.64) / 4 = 0.5 * 0.6325 = 0.31625
    out = value_loss(values, old, returns, mask, clip_range=0.2)
    close(out.loss, 0.31625)
    close(out.clip_fraction, 0.5)
    out.loss.backward()
    # d/dv of 0.5*(v-R)^2/4 = (v-R)/4 on unclipped tokens; clipped tokens have no gradient
    close(values.grad, [[-1.0 / 4, 0.0, 0.5 / 4, 0.0, 0.0]])


@pytest.mark.parametrize("junk", ["values", "old_values", "returns"])
def test_value_loss_ignores_inf_and_nan_off_the_mask(junk):
    """Junk at masked positions (inf, NaN, 1e30) changes neither the loss nor its gradient:
    squared or clamped there, it made the gradient NaN (0 x inf) and the update skipped."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    inputs = {"values": [[0.0, 0.0, 0.0, 0.0]], "old_values": [[0.0, 0.0, 0.0, 0.0]],
              "returns": [[1.0, 0.0, 0.0, 0.0]]}
    inputs[junk] = [[inputs[junk][0][0], 1e30, float("inf"), float("nan")]]
    values = torch.tensor(inputs["values"], requires_grad=True)
    out = value_loss(values, torch.tensor(inputs["old_values"]), torch.tensor(inputs["returns"]),
                     mask, clip_range=0.2)
    out.loss.backward()
    close(out.loss, 0.5)            # 0.5 * (0 - 1)^2 on the one real token
    close(out.clip_fraction, 0.0)
    close(values.grad, [[-1.0, 0.0, 0.0, 0.0]])


# --------------------------------------------------------------------------------------------
# reward model and SFT losses
# --------------------------------------------------------------------------------------------


def test_pairwise_reward_loss_hand_computed():
    chosen = torch.tensor([2.0, 0.0, 1.0], requires_grad=True)
    rejected = torch.tensor([1.0, 0.5, 1.0])
    out = pairwise_reward_loss(chosen, rejected)
    # -log sigmoid(1)    = log(1 + e^-1)  = 0.3132617
    # -log sigmoid(-0.5) = log(1 + e^0.5) = 0.9740770
    # -log sigmoid(0)    = log 2          = 0.6931472
    # mean = 1.9804859 / 3 = 0.6601620
    close(out.loss, 0.6601620)
    close(out.accuracy, 1.0 / 3.0)  # only the first pair; a tie counts as wrong
    close(out.chosen_mean, 1.0)
    close(out.rejected_mean, 2.5 / 3.0)
    assert out.loss.requires_grad and not out.accuracy.requires_grad
    single = pairwise_reward_loss(torch.tensor([1.0]), torch.tensor([0.0]))
    close(single.loss, 0.3133, atol=1e-4)
    # centering: + 0.1 * mean((3)^2, (0.5)^2, (2)^2) = 0.1 * 13.25 / 3 = 0.4416667; its
    # gradient on chosen: 0.1 * 2 * (chosen + rejected) / 3 besides the Bradley-Terry term's
    centered = pairwise_reward_loss(chosen, rejected, center_coef=0.1)
    close(centered.loss, 0.6601620 + 0.4416667)
    close(centered.accuracy, 1.0 / 3.0)
    (bt,) = torch.autograd.grad(out.loss, chosen, retain_graph=True)
    (both,) = torch.autograd.grad(centered.loss, chosen)
    close(both - bt, 0.2 * torch.tensor([3.0, 0.5, 2.0]) / 3)
    # margins 0.5, 0, 1 (Llama 2's): differences 0.5, -0.5, -1
    # log(1 + e^-0.5) + log(1 + e^0.5) + log(1 + e) = 2.7614157, / 3 = 0.9204719
    margined = pairwise_reward_loss(chosen, rejected, margins=torch.tensor([0.5, 0.0, 1.0]))
    close(margined.loss, 0.9204719)
    close(margined.accuracy, 1.0 / 3.0)   # the scores' order, the margin aside


def test_dpo_losses_hand_computed():
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    rejected = torch.tensor([-1.5, -1.0])
    ref_chosen, ref_rejected = torch.tensor([-1.2, -2.0]), torch.tensor([-1.2, -1.5])
    # log-ratios: chosen 0.2, 0.0; rejected -0.3, 0.5; margins h = 0.5, -0.5; beta h = +-0.25
    out = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
    # -log sigmoid(0.25) = log(1 + e^-0.25) = 0.5759394; -log sigmoid(-0.25) = 0.8259394
    close(out.loss, (0.5759394 + 0.8259394) / 2)
    close(out.chosen_rewards, [0.1, 0.0])
    close(out.rejected_rewards, [-0.15, 0.25])
    close(out.accuracy, 0.5)
    assert out.loss.requires_grad and not out.chosen_rewards.requires_grad
    # d/d chosen of -log sigmoid(beta h) / 2 = -beta sigmoid(-beta h) / 2
    (grad,) = torch.autograd.grad(out.loss, chosen)
    close(grad, [-0.25 * 0.4378235, -0.25 * 0.5621765])
    # a rank's share: the sum over the whole batch's count
    close(dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.5, num_pairs=4).loss,
          (0.5759394 + 0.8259394) / 4)
    # cDPO: 0.9 x -log sigmoid(0.25) + 0.1 x -log sigmoid(-0.25), the first pair alone
    smoothed = dpo_loss(chosen[:1], rejected[:1], ref_chosen[:1], ref_rejected[:1], 0.5,
                        label_smoothing=0.1)
    close(smoothed.loss, 0.9 * 0.5759394 + 0.1 * 0.8259394)
    # IPO: (h - 1 / (2 beta))^2 = (0.5 - 1)^2, (-0.5 - 1)^2
    close(dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.5, "ipo").loss,
          (0.25 + 2.25) / 2)
    # hinge: relu(1 - beta h) = 0.75, 1.25
    close(dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.5, "hinge").loss, 1.0)
    # the policy still at the reference: log 2 a pair, every implicit reward 0
    start = dpo_loss(ref_chosen, ref_rejected, ref_chosen, ref_rejected, 0.1)
    close(start.loss, math.log(2))
    close(start.accuracy, 0.0)   # ties count wrong
    # SimPO, reference-free (the reference unread): -log sigmoid(beta h - gamma), h = 0.5, -1
    simpo = dpo_loss(chosen, rejected, None, None, beta=2.0, loss_type="simpo", gamma=0.5)
    # -log sigmoid(0.5) = 0.4740770, -log sigmoid(-2.5) = log(1 + e^2.5) = 2.5788897
    close(simpo.loss, (0.4740770 + 2.5788897) / 2)
    close(simpo.chosen_rewards, [-2.0, -4.0])   # beta x the (mean) log-probs
    close(simpo.accuracy, 0.5)
    # ORPO: -beta log sigmoid(log odds(chosen) - log odds(rejected)),
    # log odds(x) = x - log(1 - e^x): -1 -> -0.5413249, -1.5 -> -1.2475532, -2 -> -1.8545865
    orpo = dpo_loss(chosen, rejected, None, None, beta=0.1, loss_type="orpo")
    odds = [-0.5413249 + 1.2475532, -1.8545865 + 0.5413249]
    close(orpo.loss, 0.1 * sum(math.log1p(math.exp(-x)) for x in odds) / 2)
    # a sure answer (log-prob 0) has infinite odds: held finite
    assert torch.isfinite(dpo_loss(torch.zeros(1), torch.tensor([-1.0]), None, None, 0.1,
                                   "orpo").loss)
    with pytest.raises(ValueError, match="loss_type 'kto'"):
        dpo_loss(chosen, rejected, ref_chosen, ref_rejected, 0.5, "kto")


def test_sequence_logprobs_sum_each_rows_answer_tokens():
    # column t is the log-prob of labels[:, t + 1]; the last column is never read
    token_logprobs = torch.tensor([[-0.1, -0.2, -0.3, float("nan")],
                                   [-0.5, float("inf"), -0.7, -9.0]])
    labels = torch.tensor([[7, -100, 5, 6],       # targets 5, 6: columns 1, 2
                           [3, 4, -100, -100]])   # target 4: column 0
    sums, counts = sequence_logprobs(token_logprobs, labels)
    close(sums, [-0.5, -0.5])
    close(counts, [2.0, 1.0])


def test_sft_loss_ignores_minus100_and_shifts():
    garbage = [100.0, -100.0, 50.0]  # logits of the last position predict nothing
    logits = torch.tensor(
        [
            [[0.0, 1.0, 2.0], [5.0, 5.0, 5.0], garbage],
            [[2.0, 1.0, 0.0], [9.0, 0.0, 0.0], garbage],
        ]
    )
    labels = torch.tensor(
        [
            [-100, 2, 0],  # logits[0,0] -> token 2; logits[0,1] -> token 0
            [-100, 1, -100],  # logits[1,0] -> token 1; position 2 ignored
        ]
    )
    # CE(logits [0,1,2], 2) = 2.4076060 - 2 = 0.4076060
    # CE(logits [5,5,5], 0) = log 3        = 1.0986123
    # CE(logits [2,1,0], 1) = 2.4076060 - 1 = 1.4076060
    # mean over the 3 counted tokens = 2.9138243 / 3 = 0.9712748
    close(sft_loss(logits, labels), 0.9712748)
    close(sft_loss(logits.to(torch.bfloat16), labels), 0.9712748, atol=1e-3)
    all_ignored = sft_loss(logits, torch.full_like(labels, -100))
    assert torch.isfinite(all_ignored)
    close(all_ignored, 0.0)


def test_ema_update_in_place():
    ema = [torch.tensor([0.0, 2.0]), torch.tensor([[4.0]])]
    params = [torch.tensor([1.0, 0.0], requires_grad=True), torch.tensor([[0.0]])]
    ema_update(ema, params, beta=0.9)
    # 0.9*0 + 0.1*1 = 0.1; 0.9*2 + 0.1*0 = 1.8; 0.9*4 = 3.6
    close(ema[0], [0.1, 1.8])
    close(ema[1], [[3.6]])
    assert not ema[0].requires_grad


def test_constants_used_in_comments():
    # guards the hand arithmetic above against typos
    assert math.isclose(math.log(1 + math.e + math.e**2), 2.4076060, abs_tol=1e-6)
    assert math.isclose(-math.log(1 / (1 + math.exp(-1))), 0.3132617, abs_tol=1e-6)


# --------------------------------------------------------------------------------------------
# ensemble_scores (steps/scoring.py)
# --------------------------------------------------------------------------------------------


def test_ensemble_scores_combine_each_answers_scores_over_the_models():
    from steps.scoring import ensemble_scores

    scores = torch.tensor([[1.0, -2.0, 0.5],   # model 0's scores of 3 answers
                           [3.0, -2.0, -0.5],
                           [2.0, 1.0, 1.5]])
    close(ensemble_scores(scores, "mean"), [2.0, -1.0, 0.5])
    close(ensemble_scores(scores, "min"), [1.0, -2.0, -0.5])
    # population std per answer: sqrt(2/3), sqrt(2), sqrt(2/3)
    close(ensemble_scores(scores, "mean_minus_std", coef=0.5),
          [2.0 - 0.5 * math.sqrt(2 / 3), -1.0 - 0.5 * math.sqrt(2), 0.5 - 0.5 * math.sqrt(2 / 3)])
    close(ensemble_scores(scores[:1], "mean_minus_std"), scores[0])   # one model: its score
    with pytest.raises(ValueError, match="unknown reward ensemble 'max'"):
        ensemble_scores(scores, "max")
