"""PPO / reward-model / DPO / SFT math as small pure functions (tensors in, tensors out).

Masking convention (shared by every function below):

A rollout is ``sequences [B, P+N]``: a left-padded prompt (P columns) followed by the
generated answer (N columns). Everything here works on ANSWER-ALIGNED tensors of shape
``[B, N]``: column ``j`` is the j-th generated token. ``action_mask [B, N]`` (float, 1.0/0.0)
is 1 for answer tokens up to and including the first EOS and 0 after it (right padding), so the
ones of a row form a contiguous prefix. An answer may end early at EOS, may be cut at N without
EOS (all N columns are actions), or be "empty" (EOS first: exactly one action, the EOS). A row
whose mask is all zero contributes nothing and never produces NaN. Values at masked positions
may be garbage (even inf/NaN in the inputs of the losses): they are selected away with
``torch.where`` rather than multiplied by 0. Prompt left padding never reaches this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class RewardsOut(NamedTuple):
    rewards: Tensor  # [B, N] per-token reward (KL penalty + clipped score at the last action)
    kl: Tensor  # [B, N] per-token KL estimate (logprobs - ref_logprobs), 0 outside the mask


class AdvantagesOut(NamedTuple):
    advantages: Tensor  # [B, N], 0 outside the mask
    returns: Tensor  # [B, N] advantages + values, 0 outside the mask


class PolicyLossOut(NamedTuple):
    loss: Tensor  # scalar, differentiable
    clip_fraction: Tensor  # scalar, detached: share of actions where the clipped term is used
    approx_kl: Tensor  # scalar, detached: masked mean of (r - 1) - log r
    ratio_mean: Tensor  # scalar, detached: masked mean of r = exp(new - old)


class ValueLossOut(NamedTuple):
    loss: Tensor  # scalar, differentiable
    clip_fraction: Tensor  # scalar, detached: share of actions where the clipped term is used


class DPOLossOut(NamedTuple):
    loss: Tensor  # scalar, differentiable
    chosen_rewards: Tensor  # [B] detached: beta * (log pi - log pi_ref) of each chosen answer
    rejected_rewards: Tensor  # [B] detached: the same of each rejected answer
    accuracy: Tensor  # scalar, detached: share of pairs whose chosen reward is the higher


class KTOLossOut(NamedTuple):
    loss: Tensor  # scalar, differentiable
    rewards: Tensor  # [N] detached: beta * (log pi - log pi_ref) of each answer
    accuracy: Tensor  # scalar, detached: share of answers on their label's side of z0


class RewardLossOut(NamedTuple):
    loss: Tensor  # scalar, differentiable
    accuracy: Tensor  # scalar, detached: share of pairs with chosen > rejected (ties count wrong)
    chosen_mean: Tensor  # scalar, detached
    rejected_mean: Tensor  # scalar, detached


# ---------------------------------------------------------------------------------------------
# Masks and log-probabilities


def answer_mask(answer_ids: Tensor, eos_token_id: int | Sequence[int] | None) -> Tensor:
    """Action mask [B, N] (float32) of generated answers ``answer_ids`` [B, N] (prompt
    removed): 1.0 up to and including the first EOS of each row, 0.0 after. ``eos_token_id``:
    an id, or several (any of them ends the answer); ``None``: every token is an action."""
    if eos_token_id is None:
        return torch.ones(answer_ids.shape, dtype=torch.float32, device=answer_ids.device)
    eos = torch.tensor(eos_token_id, dtype=answer_ids.dtype, device=answer_ids.device)
    is_eos = torch.isin(answer_ids, eos).to(torch.int32)
    eos_strictly_before = torch.cumsum(is_eos, dim=-1) - is_eos  # [B, N]
    return (eos_strictly_before == 0).to(torch.float32)


LOGPROB_CHUNK = 2**24   # elements of a float32 [rows, T, V] chunk (64 MiB) made at one time


def logprobs_of_tokens(logits: Tensor, tokens: Tensor, temperature: float = 1.0,
                       chunk: int = LOGPROB_CHUNK) -> Tensor:
    """float32 [B, T] log-probability ``log_softmax(logits / temperature)[b, t, tokens[b, t]]``
    of ``tokens`` [B, T] under ``logits`` [B, T, V] of any float dtype: ``logits[:, t]`` is
    the distribution of ``tokens[:, t]`` (no shifting is done here). ``temperature``: the
    one the tokens were sampled at, so that the log-probs are those of the sampling
    distribution.

    Fused and chunked: no float32 [B, T, V] tensor is made, forward or backward, and the
    logits (a view, e.g. ``logits[:, :-1]``) are not copied. Both passes take as many rows
    at a time as fit in ``chunk`` float32 elements (at least one); the forward keeps nothing
    but its inputs, and the backward recomputes each chunk's softmax:
    d logp / d logits = (onehot(token) - softmax(logits / T)) / T, returned in the logits'
    dtype (the one [B, T, V] tensor the backward has to make). torch's own (log_)softmax
    kernels do the arithmetic, so values and gradients round as a full log_softmax does."""
    rows = max(1, chunk // (tokens.shape[1] * logits.shape[-1]))
    return _TokenLogprobs.apply(logits, tokens, temperature, rows)


def token_entropy(logits: Tensor, temperature: float = 1.0, chunk: int = LOGPROB_CHUNK
                  ) -> Tensor:
    """float32 [B, T] entropy ``-sum_v p_v log p_v`` of ``p = softmax(logits / temperature)``
    at each position of ``logits`` [B, T, V] (any float dtype, finite): the policy's
    uncertainty over its next token, whose collapse long RL runs watch for (DAPO's
    clip-higher is its remedy).

    Fused and chunked as `logprobs_of_tokens` is: no float32 [B, T, V] tensor is made, and
    the forward keeps nothing but the logits; the backward recomputes each chunk's softmax:
    dH / d logits = -p (log p + H) / T, returned in the logits' dtype."""
    rows = max(1, chunk // (logits.shape[1] * logits.shape[-1]))
    return _TokenEntropy.apply(logits, temperature, rows)


@torch.no_grad()
def token_kl(logits: Tensor, ref_logits: Tensor, temperature: float = 1.0,
             chunk: int = LOGPROB_CHUNK) -> Tensor:
    """float32 [B, T] KL(pi(. | prefix) || pi_ref(. | prefix)) over the whole vocabulary at
    each position, from the policy's and the reference's ``logits`` [B, T, V] (any float
    dtype, at the sampling ``temperature``). Summed over a sampled answer it estimates the
    KL per answer without bias (the chain rule, with each step's expectation taken exactly
    instead of read from the one token sampled), at a third of the sampled log-ratio's
    (k1's) spread on the demo task: what an evaluation measures a KL budget with.
    ``chunk`` float32 elements a piece, as in `logprobs_of_tokens`."""
    rows = max(1, chunk // (logits.shape[1] * logits.shape[-1]))
    out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
    for (part, policy), (_, reference) in zip(_scaled_chunks(logits, temperature, rows),
                                              _scaled_chunks(ref_logits, temperature, rows),
                                              strict=True):
        log_p, log_q = torch.log_softmax(policy, -1), torch.log_softmax(reference, -1)
        out[part] = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    return out


def _scaled_chunks(logits: Tensor, temperature: float, rows: int):
    """(slice of rows, float32 logits / temperature of those rows): a fresh chunk each."""
    for b in range(0, logits.shape[0], rows):
        part = slice(b, b + rows)
        yield part, logits[part].to(torch.float32, copy=True).div_(temperature)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tokens: Tensor, temperature: float, rows: int):
        out = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
        for part, scaled in _scaled_chunks(logits, temperature, rows):
            out[part] = torch.log_softmax(scaled, -1).gather(-1, tokens[part, :, None])[..., 0]
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, tokens = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for part, scaled in _scaled_chunks(logits, ctx.temperature, ctx.rows):
            chunk = torch.softmax(scaled, -1).neg_()
            del scaled
            chunk.scatter_add_(-1, tokens[part, :, None], torch.ones_like(chunk[..., :1]))
            grad[part] = chunk.mul_(grad_out[part, :, None].float() / ctx.temperature)
        return grad, None, None, None


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, rows: int):
        out = torch.empty(logits.shape[:2], dtype=torch.float32, device=logits.device)
        for part, scaled in _scaled_chunks(logits, temperature, rows):
            log_p = torch.log_softmax(scaled, -1)
            del scaled
            out[part] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(logits)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (logits,) = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for part, scaled in _scaled_chunks(logits, ctx.temperature, ctx.rows):
            log_p = torch.log_softmax(scaled, -1)
            del scaled
            p = log_p.exp()
            entropy = -(p * log_p).sum(-1, keepdim=True)
            scale = grad_out[part, :, None].float() / -ctx.temperature
            grad[part] = log_p.add_(entropy).mul_(p).mul_(scale)
        return grad, None, None


# ---------------------------------------------------------------------------------------------
# Masked statistics


def _select(x: Tensor, mask: Tensor) -> Tensor:
    """``x * mask`` where mask != 0, exactly 0 elsewhere (also when x is inf/NaN there)."""
    return torch.where(mask != 0, x * mask, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` [...] where ``mask`` (same shape or broadcastable; 1.0 keep, 0.0 drop) is
    set: a scalar, or with ``dim`` the entries reduced over that dim."""
    y = _select(x, mask)
    return y.sum() if dim is None else y.sum(dim=dim)


def _over(total: Tensor, count: Tensor | float | None, mask: Tensor) -> Tensor:
    """``total / count``; ``count`` defaults to the number of masked entries (0 -> 1)."""
    if count is None:
        count = mask.sum()
    count = torch.as_tensor(count, dtype=total.dtype, device=total.device)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the masked entries; 0 (not NaN) where the mask is empty. Arguments
    and result shape as for ``masked_sum``."""
    total = masked_sum(x, mask, dim)
    mask = mask.to(total.dtype).expand_as(x)
    return _over(total, mask.sum() if dim is None else mask.sum(dim=dim), mask)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Scalar variance of ``x`` [...] over the entries where ``mask`` (same shape) is set;
    ``unbiased`` applies Bessel's n / (n - 1). 0 when the mask holds fewer than two."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.to(var.dtype).expand_as(x).sum()
        var = var * torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
    return var


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
           moments: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Normalise ``x`` by its masked mean and (unbiased) masked variance.

    Args:
        x: [...] values (e.g. advantages [B, N]). mask: same shape as ``x``.
        shift_mean: if False the masked mean is added back (only the scale is normalised).
        eps: added to the variance before the square root.
        moments: (mean, unbiased var) to use instead of those of ``x`` itself, e.g. of the
            whole batch when ``x`` is one rank's share of it.

    Returns:
        same shape as ``x``: ``(x - mean) / sqrt(var + eps)`` on masked entries, 0 elsewhere.
    """
    mean, var = moments if moments is not None else (masked_mean(x, mask),
                                                     masked_var(x, mask, unbiased=True))
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return _select(out, mask)


# ---------------------------------------------------------------------------------------------
# Rewards and advantages (constants for the optimiser: computed under no_grad)


# d = logprobs - ref_logprobs -> the per-token estimate (see kl_estimate)
KL_ESTIMATORS = {"k1": lambda d: d, "k2": lambda d: 0.5 * d ** 2,
                 "k3": lambda d: torch.expm1(-d) + d}



def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(policy || reference) from actions sampled by the policy
    (Schulman, "Approximating KL divergence"), with ``d = logprobs - ref_logprobs``:
    ``k1 = d`` (unbiased, can be negative), ``k2 = d^2 / 2`` (biased, low variance),
    ``k3 = exp(-d) - 1 + d`` (unbiased and >= 0: GRPO's KL loss).

    Args:
        logprobs: [B, N] log-probs under the policy (may carry grad: the KL loss).
        ref_logprobs: [B, N] under the reference. mask: [B, N] action mask.
        estimator: "k1", "k2" or "k3".

    Returns:
        float32 [B, N], 0 outside the mask.
    """
    d = torch.where(mask != 0, logprobs.float() - ref_logprobs.float(),
                    torch.zeros((), device=logprobs.device))
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")
    kl = KL_ESTIMATORS[estimator](d)
    return _select(kl, mask)


@torch.no_grad()
def kl_penalized_rewards(scores: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor,
                         kl_coef: float, score_clip: float, estimator: str = "k1",
                         penalty: Tensor | None = None) -> RewardsOut:
    """Per-token PPO reward (InstructGPT / DeepSpeed-Chat): KL penalty + clipped final score.

    Args:
        scores: [B] reward-model score of each full sequence.
        logprobs: [B, N] log-probs of the actions under the policy that sampled them.
        ref_logprobs: [B, N] log-probs of the same actions under the frozen reference model.
        mask: [B, N] action mask.
        kl_coef: weight of the KL penalty (0: none).
        score_clip: scores are clamped to [-score_clip, score_clip].
        estimator: the per-token KL estimate (``kl_estimate``); InstructGPT's is k1.
        penalty: [B] subtracted from the clipped score (the missing-EOS penalty: after the
            clip, which would otherwise absorb it from a score near the bound).

    Returns:
        RewardsOut(rewards [B, N], kl [B, N]) with ``kl = kl_estimate(...)`` on actions
        and ``rewards = -kl_coef * kl``, plus the clipped score (less the penalty) at the
        last action of each row.
        Both are 0 outside the mask; a row without actions gets no score. Detached.
    """
    kl = kl_estimate(logprobs, ref_logprobs, mask, estimator)
    rewards = -kl_coef * kl
    has_action = (mask != 0).any(dim=-1)  # [B]
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask != 0, positions, torch.zeros_like(positions)).amax(dim=-1)  # [B]
    score = _clipped(scores, score_clip, penalty)
    score = torch.where(has_action, score, torch.zeros_like(score))
    rewards = rewards.scatter_add(-1, last.unsqueeze(-1), score.unsqueeze(-1))
    return RewardsOut(rewards=rewards, kl=kl)


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> AdvantagesOut:
    """Generalized advantage estimation over the action positions of each row.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V`` after the last action equal to 0 (the
    episode ends; values beyond the end are never read), and ``A_t = sum_{k>=t} (gamma*lam)^(k-t)
    delta_k``. The discounted sum is computed without a loop as one matmul of the deltas with
    the [N, N] upper-triangular matrix ``(gamma*lam)^(k-t)``, in float64 (exact to float32
    rounding, and unaffected by TF32 matmul settings). Works for gamma=1, lam=1 and lam=0.
    The ones of each mask row must be contiguous (as ``answer_mask`` produces).

    Args:
        rewards: [B, N] per-token rewards (e.g. ``kl_penalized_rewards(...).rewards``).
        values: [B, N] value estimates V_t of the state before action t.
        mask: [B, N] action mask.
        gamma: discount factor. lam: GAE lambda.

    Returns:
        AdvantagesOut(advantages [B, N], returns [B, N]) in the dtype of ``values``,
        ``returns = advantages + values``; both 0 outside the mask. Detached.
    """
    out_dtype = values.dtype if values.is_floating_point() else torch.float32
    keep = mask != 0
    zero = torch.zeros((), dtype=torch.float64, device=values.device)
    r = torch.where(keep, rewards.double(), zero)
    v = torch.where(keep, values.double(), zero)
    next_v = F.pad(v[:, 1:], (0, 1))  # V_{t+1}; 0 past the last action since v is masked
    delta = torch.where(keep, r + gamma * next_v - v, zero)  # [B, N]

    idx = torch.arange(delta.shape[-1], device=delta.device)
    power = idx.unsqueeze(1) - idx.unsqueeze(0)  # [k, t] -> k - t
    # [N, N]: (gamma*lam)^(k-t) for k >= t (0**0 == 1 covers lam = 0)
    discount = torch.where(power >= 0, torch.pow(float(gamma * lam), power.clamp(min=0).double()),
                           zero)
    adv = delta @ discount  # A[b, t] = sum_k delta[b, k] * discount[k, t]
    adv = torch.where(keep, adv, zero)
    ret = torch.where(keep, adv + v, zero)
    return AdvantagesOut(advantages=adv.to(out_dtype), returns=ret.to(out_dtype))


@torch.no_grad()
def returns_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """[B, N] discounted return of each action of ``rewards`` [B, N] under ``mask`` [B, N],
    ``G_t = sum_{k>=t} gamma^(k-t) r_k`` (REINFORCE, no critic): GAE with zero values and
    lambda 1. float32, 0 outside the mask, detached."""
    return gae(rewards, torch.zeros_like(rewards, dtype=torch.float32), mask, gamma,
               1.0).returns


@torch.no_grad()
def with_group_baseline(rewards: Tensor, scores: Tensor, mask: Tensor, group_size: int,
                        score_clip: float, penalty: Tensor | None = None) -> Tensor:
    """REINFORCE++-baseline (Hu et al., 2025; OpenRLHF's ``reinforce_baseline``): the
    per-token ``rewards`` [B, N] of ``kl_penalized_rewards`` with each answer's score made
    relative to its group's, the mean clipped score (less penalties) of the answers to the
    same prompt subtracted at each answer's last action. A group whose answers all score
    the same keeps only its KL penalties.

    Args:
        rewards: [B, N], the clipped scores at the last actions. scores: [B] raw scores, B =
            prompts * group_size, each prompt's answers consecutive. mask: [B, N] actions.
        penalty: [B] subtracted after the clip, or None.

    Returns:
        [B, N] float32, 0 outside the mask.
    """
    has_action = (mask != 0).any(dim=-1)
    score = torch.where(has_action, _clipped(scores, score_clip, penalty), 0.0)
    # float64: the mean of equal scores is exactly that score (see _groups)
    baseline = _groups(score, group_size).mean(dim=1).repeat_interleave(group_size)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask != 0, positions, torch.zeros_like(positions)).amax(dim=-1)
    offsets = torch.where(has_action, -baseline, 0.0).to(rewards.dtype)
    return rewards.scatter_add(-1, last.unsqueeze(-1), offsets.unsqueeze(-1))


@torch.no_grad()
def sequence_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float,
                     score_clip: float, penalty: Tensor | None = None) -> Tensor:
    """[B] float32: one reward per answer for the critic-free group estimators, its score
    [B] clamped to +-score_clip, less ``penalty`` [B] (after the clip, as in
    ``kl_penalized_rewards``), minus ``kl_coef`` (0 when the KL is a loss term instead) times
    its summed per-token KL ``kl`` [B, N] under ``mask`` [B, N]. A row without actions gets 0."""
    has_action = (mask != 0).any(dim=-1)
    reward = _clipped(scores, score_clip, penalty) - kl_coef * masked_sum(kl, mask, -1)
    return torch.where(has_action, reward, torch.zeros_like(reward))


def overlong_penalty(lengths: Tensor, max_new_tokens: int, buffer: int, penalty: float
                     ) -> Tensor:
    """DAPO's soft overlong punishment: 0 for an answer of up to ``max_new_tokens - buffer``
    tokens, rising linearly to ``penalty`` at ``max_new_tokens`` (what is subtracted from
    its score: answers that run into the budget are discouraged before they are cut off).

    Args:
        lengths: [B] answer lengths in tokens. buffer: 1 <= buffer <= max_new_tokens.

    Returns:
        [B] float penalties in [0, penalty].
    """
    start = max_new_tokens - buffer
    return penalty * ((lengths.float() - start) / buffer).clamp(0.0, 1.0)


def _clipped(scores: Tensor, score_clip: float, penalty: Tensor | None) -> Tensor:
    score = scores.float().clamp(-score_clip, score_clip)
    return score if penalty is None else score - penalty.float()


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1 or group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} do not form groups of {group_size}")
    # float64: the mean of k equal float32 values is then exactly that value, so an
    # all-equal group's deviations are 0 (in float32 a 1-ulp mean error over a 0 std made
    # advantages of up to 0.24 at group sizes 3, 5, 6, 7)
    return rewards.double().view(-1, group_size)


@torch.no_grad()
def group_normalized_advantages(rewards: Tensor, group_size: int, scale: bool = True,
                                eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al., 2024): each answer's reward against the other answers to the same
    prompt, ``(r - mean_group) / (std_group + eps)`` with the unbiased std; ``scale=False``
    keeps only the mean shift, as Dr. GRPO (Liu et al., 2025) does.

    Args:
        rewards: [B] one reward per answer, B = prompts * group_size, each prompt's answers
            consecutive. group_size: answers per prompt (>= 2).

    Returns:
        [B] float32 advantages (one per answer; broadcast over its tokens). A group whose
        answers all score the same gets 0.
    """
    groups = _groups(rewards, group_size)
    advantages = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    return advantages.float().flatten()


@torch.no_grad()
def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al., 2024): each answer's reward minus the mean reward of the
    other answers to the same prompt, ``r_i - (sum_j r_j - r_i) / (k - 1)``. ``rewards``: [B],
    one per answer, each prompt's ``group_size`` (>= 2) consecutive. Returns [B] float32
    advantages (broadcast over each answer's tokens)."""
    groups = _groups(rewards, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).float().flatten()


def informative_groups(scores: Tensor, group_size: int, score_clip: float,
                       penalty: Tensor | None = None) -> Tensor:
    """DAPO's dynamic-sampling filter (Yu et al., 2025): which prompts' answers do not all
    score the same. A group whose clipped scores less penalties (what the group estimators
    compare, see ``sequence_rewards``) are all equal has a GRPO advantage of exactly 0 and
    no score signal for RLOO: training on it only dilutes the others' gradient.

    Args:
        scores: [B] one score per answer, B = prompts * group_size, each prompt's answers
            consecutive. penalty: [B] subtracted after the clip, or None.

    Returns:
        [B / group_size] bool, True where the group's scores differ.
    """
    groups = _groups(_clipped(scores, score_clip, penalty), group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)


@torch.no_grad()
def preference_pairs(rewards: Tensor, group_size: int) -> Tensor:
    """Online DPO's pairs (Guo et al., 2024; best against worst of n, as OpenRLHF's iterative
    DPO and Xiong et al., 2024 rank them): in each group the answer with the highest reward
    is chosen and the one with the lowest rejected. A group whose rewards are all equal
    states no preference and gives no pair. Ties for the top or the bottom go to the first
    such answer.

    Args:
        rewards: [B] one reward per answer, B = prompts * group_size, each prompt's answers
            consecutive. group_size: answers per prompt (>= 2).

    Returns:
        [B] float32 labels: 1 chosen, -1 rejected, 0 in no pair; a group holds one 1 and
        one -1, or only zeros.
    """
    groups = _groups(rewards, group_size)
    differ = (groups.amax(1) > groups.amin(1)).float()[:, None]
    labels = torch.zeros(groups.shape, dtype=torch.float32, device=rewards.device)
    labels.scatter_(1, groups.argmax(1, keepdim=True), differ)
    labels.scatter_(1, groups.argmin(1, keepdim=True), -differ)
    return labels.flatten()



@torch.no_grad()
def feedback_labels(rewards: Tensor, group_size: int) -> Tensor:
    """Online KTO's labels: an answer is desirable where its reward is above its group's
    mean and undesirable below it, each judged alone as KTO's thumbs up or down, so that
    every answer of a group whose rewards differ trains (a pair trains two). An answer at
    the mean, or in a group whose rewards are all equal, states nothing.

    Args:
        rewards: [B] one reward per answer, B = prompts * group_size, each prompt's answers
            consecutive. group_size: answers per prompt (>= 2).

    Returns:
        [B] float32 labels: 1 desirable, -1 undesirable, 0 unlabelled.
    """
    groups = _groups(rewards, group_size)   # float64: an all-equal group is exactly at its mean
    return torch.sign(groups - groups.mean(1, keepdim=True)).float().flatten()

KL_PROPORTIONAL_GAIN = 1.0   # the coefficient's immediate answer to a KL e times the target: x e
KL_INTEGRAL_GAIN = 0.2       # its drift per horizon at that error (Ziegler's most per horizon)


def adaptive_kl_coef(integral: float, observed_kl: float, target: float, horizon: float,
                     samples: int, floor: float = 0.0) -> tuple[float, float]:
    """The adaptive KL coefficient as a proportional-integral controller in log space:
    with the error ``e = clip(log(observed / target), -1, 1)``, the log coefficient is an
    integral that moves ``KL_INTEGRAL_GAIN * e * samples / horizon`` per batch, plus
    ``KL_PROPORTIONAL_GAIN * e``. It raises the penalty while the policy's KL to the
    reference is above ``target`` and lowers it, down to ``floor``, while below.

    Ziegler et al. (2019)'s controller is the integral alone. With a horizon short enough to
    settle early in a short run, that cycles: the policy's KL answers the coefficient
    several iterations late (Adam's momentum, a critic relearning its values), so the
    integral overshoots one way, then the other (measured on the pick task: the
    coefficient swinging 0.05 <-> 7, the KL 0.4 <-> 2.1 nats around a target of 0.96). The
    proportional term answers the KL of this batch at once, and lets the integral be slow.
    The integral stops at log(floor), so that it does not wind down while the KL is still
    growing from 0 at the start of a run.

    Args:
        integral: the log coefficient's integral part (``log(kl_coef)`` at the start).
        observed_kl: this batch's mean KL per answer (summed over its tokens). target: the
            KL to hold. horizon: samples over which the integral moves by
            ``KL_INTEGRAL_GAIN`` at an error of 1. samples: this batch's answers.
        floor: the lowest coefficient it returns.

    Returns:
        (the next coefficient, the next integral)
    """
    ratio = observed_kl / target
    error = min(max(math.log(ratio), -1.0), 1.0) if ratio > 0 else -1.0
    integral = max(integral + KL_INTEGRAL_GAIN * error * samples / horizon,
                   math.log(floor) if floor > 0 else -math.inf)
    return max(math.exp(integral + KL_PROPORTIONAL_GAIN * error), floor), integral


def tilted_kl(rewards: Tensor, coefs: Tensor) -> Tensor:
    """KL(pi_c || pi) of the reward-tilted policy pi_c(y) ~ pi(y) exp(r(y) / c), the optimum
    of E[r] - c KL(. || pi), estimated per prompt from answers sampled from pi: with the
    self-normalised weights w = softmax(r / c), KL = sum_i w_i log(n w_i). It is at most
    log n (all weight on one answer), so n samples under-read a large KL.

    Args:
        rewards: [P, n] float, n sampled answers' rewards per prompt. coefs: [G] > 0.

    Returns:
        [P, G] float64, each prompt's KL at each coefficient: in fp32 a small KL, a sum of
        terms that nearly cancel, moved 3e-6 (relative) with rewards one rounding apart,
        and the coefficient read from it as much.
    """
    logits = rewards.double()[:, :, None] / coefs.double()[None, None, :]     # [P, n, G]
    log_w = torch.log_softmax(logits, dim=1)
    return (log_w.exp() * (log_w + math.log(rewards.shape[1]))).sum(1)


def coef_for_kl(coefs: Tensor, kl: Tensor, target: float) -> float | None:
    """The coefficient at which the tilted policy's KL (`tilted_kl` averaged over prompts)
    is `target`, interpolated in log space on an increasing grid `coefs` [G] with their KL
    `kl` [G] (which falls as the coefficient grows); None when the grid does not bracket
    the target (e.g. a target above log n, or rewards that do not vary)."""
    above = (kl >= target).nonzero().flatten()
    if not len(above) or above[-1] + 1 >= len(coefs) or kl[-1] > target:
        return None
    i = int(above[-1])           # kl[i] >= target > kl[i + 1]
    share = (kl[i] - target) / (kl[i] - kl[i + 1]).clamp(min=1e-12)
    lo, hi = math.log(float(coefs[i])), math.log(float(coefs[i + 1]))
    return math.exp(lo + float(share) * (hi - lo))


LOSS_AGGREGATIONS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")


def loss_weights(mask: Tensor, aggregation: str, max_new_tokens: int | None = None
                 ) -> tuple[Tensor, Tensor]:
    """How a per-token loss is averaged: the mask scaled per token, and the count the sum
    divides by (to be summed over ranks when these rows are one rank's share).

    ``token-mean``: every action of the batch counts the same (long answers weigh more).
    ``seq-mean``: each answer's token mean, averaged over answers (GRPO's paper).
    ``seq-mean-token-sum-norm``: each answer's token sum over the constant
    ``max_new_tokens``, averaged over answers (Dr. GRPO: no length normalisation, so a
    long wrong answer is not penalised less per token than a short one).

    Args:
        mask: [B, N] action mask. aggregation: one of LOSS_AGGREGATIONS.
        max_new_tokens: the generation budget (``seq-mean-token-sum-norm``).

    Returns:
        (weights [B, N], count scalar): loss = masked_sum(x, weights) / count.
    """
    if aggregation == "token-mean":
        return mask, mask.sum()
    lengths = mask.sum(dim=-1, keepdim=True)
    answers = (lengths > 0).sum().to(mask.dtype)
    if aggregation == "seq-mean":
        return mask / lengths.clamp(min=1), answers
    if aggregation == "seq-mean-token-sum-norm":
        if not max_new_tokens:
            raise ValueError("seq-mean-token-sum-norm needs max_new_tokens")
        return mask / max_new_tokens, answers
    raise ValueError(f"loss aggregation {aggregation!r}: choose one of "
                     f"{', '.join(LOSS_AGGREGATIONS)}")


def statistic_weights(mask: Tensor, aggregation: str) -> Tensor:
    """[B, N] per-token weights that make the update's statistics (ratio, KL from the
    sampling policy, clip fractions) means over ``loss_weights``' count: the loss's own
    weights, but under ``seq-mean-token-sum-norm``, whose weights sum to an answer's length
    over max_new_tokens rather than to 1, each answer's token mean (``seq-mean``'s, whose
    count is the same)."""
    if aggregation == "seq-mean-token-sum-norm":
        aggregation = "seq-mean"
    return loss_weights(mask, aggregation)[0]


# ---------------------------------------------------------------------------------------------
# Losses


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_range: float, num_actions: Tensor | float | None = None,
                clip_range_high: float | None = None, dual_clip: float | None = None,
                stat_weights: Tensor | None = None, sequence_ratio: bool = False
                ) -> PolicyLossOut:
    """PPO clipped surrogate objective.

    ``r = exp(logprobs - old_logprobs)``;
    ``loss = masked_mean(max(-A * r, -A * clip(r, 1 - clip_range, 1 + clip_range_high)))``;
    with ``dual_clip`` c, a token with A < 0 contributes at most ``-A * c`` (Ye et al.,
    2020: a ratio far above 1 on a bad action no longer drives an unbounded update).
    ``sequence_ratio``: GSPO's ratio (Zheng et al., 2025), each answer's geometric mean
    ``s = exp(mean_t(logprobs - old_logprobs))`` for all its tokens, clipped as one; as
    GSPO-token, token t's ratio is ``sg(s) * exp(logprobs_t - sg(logprobs_t))``: the value
    s, the gradient ``s * grad logprobs_t``, so token advantages keep their own credit (with
    one advantage an answer and ``seq-mean`` weights, GSPO's gradient of s itself).

    Args:
        logprobs: [B, N] log-probs of the actions under the current policy (with grad).
        old_logprobs: [B, N] log-probs at rollout time. advantages: [B, N].
        mask: [B, N] action mask, or per-token weights on the actions (``loss_weights``).
        clip_range: PPO epsilon (the lower one, when ``clip_range_high`` is given).
        num_actions: the count the means divide by; default ``mask.sum()``. Give the count
            of the whole batch when these rows are one rank's share of it: the shares then
            sum to the batch mean.
        clip_range_high: the upper epsilon (DAPO's clip-higher, e.g. 0.28); default
            ``clip_range``.
        dual_clip: c > 1, or None for no dual clip.
        stat_weights: [B, N] the statistics' weights (``statistic_weights``); default
            ``mask``.
        sequence_ratio: GSPO's ratio per answer (above) instead of PPO's per token.

    Returns:
        PolicyLossOut (see its fields), all scalars, the statistics detached; ``approx_kl`` is
        the "k3" estimator ``(r - 1) - log r`` of the tokens' own ratios (>= 0, unbiased for
        KL(old || new), whichever ratio is clipped); ``clip_fraction`` counts the tokens
        either clip holds; ``ratio`` is the mean of the ratio the clip acts on.
    """
    advantages = advantages.detach()
    log_ratio, ratio = _ratios(logprobs, old_logprobs.detach(), mask != 0, sequence_ratio)
    high = clip_range if clip_range_high is None else clip_range_high
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    held = clipped > unclipped
    if dual_clip is not None:
        bound = -advantages * dual_clip
        capped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(capped, bound, per_token)
        held = held | capped
    loss = _over(masked_sum(per_token, mask), num_actions, mask)
    with torch.no_grad():
        w = mask if stat_weights is None else stat_weights
        clip_fraction = _over(masked_sum(held.to(ratio.dtype), w), num_actions, w)
        token_ratio = torch.exp(log_ratio) if sequence_ratio else ratio
        approx_kl = _over(masked_sum((token_ratio - 1.0) - log_ratio, w), num_actions, w)
        ratio_mean = _over(masked_sum(ratio, w), num_actions, w)
    return PolicyLossOut(loss, clip_fraction, approx_kl, ratio_mean)


def _ratios(logprobs: Tensor, old_logprobs: Tensor, keep: Tensor, sequence_ratio: bool
            ) -> tuple[Tensor, Tensor]:
    """([B, N] the tokens' log-ratios, [B, N] the ratio the clip acts on: theirs, or with
    ``sequence_ratio`` GSPO-token's), both 0 and 1 off ``keep``."""
    # zeroed off the mask before exp, so that garbage there cannot overflow to inf/NaN
    zeros = torch.zeros_like(logprobs)
    log_ratio = torch.where(keep, logprobs - old_logprobs, zeros)
    if not sequence_ratio:
        return log_ratio, torch.exp(log_ratio)
    answer = masked_mean(log_ratio.detach(), keep, dim=1)[:, None]   # [B, 1]
    # the bracket is exactly 0 in value: s rounds once, the same for all its answer's tokens
    return log_ratio, torch.exp(torch.where(keep, answer + (logprobs - logprobs.detach()), zeros))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float, num_actions: Tensor | float | None = None,
               stat_weights: Tensor | None = None) -> ValueLossOut:
    """Clipped value loss (OpenAI baselines / DeepSpeed-Chat).

    ``v_clip = clip(values, old_values - clip_range, old_values + clip_range)``;
    ``loss = 0.5 * masked_mean(max((values - R)^2, (v_clip - R)^2))``.

    Args:
        values: [B, N] current value predictions (with grad). old_values: [B, N] at rollout time.
        returns: [B, N] GAE returns. mask: [B, N], as for ``policy_loss``.
        clip_range: value clip epsilon.
        num_actions: the count the means divide by (see ``policy_loss``).
        stat_weights: ``clip_fraction``'s weights (see ``policy_loss``).

    Returns:
        ValueLossOut (see its fields), scalars, ``clip_fraction`` detached.
    """
    # garbage at masked positions selected away first: squared or clamped, an inf there would
    # give a NaN gradient (0 x inf) however the sum masks it
    real = mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    values = torch.where(real, values, zero)
    old_values = torch.where(real, old_values.detach(), zero)
    returns = torch.where(real, returns.detach(), zero)
    # clamp to bounds (not old + clamp(diff)): inside them v_clip is `values` bit for bit, so
    # the clip statistics never count rounding noise as clipping
    v_clip = torch.clamp(values, old_values - clip_range, old_values + clip_range)
    unclipped = (values - returns) ** 2
    clipped = (v_clip - returns) ** 2
    loss = 0.5 * _over(masked_sum(torch.maximum(unclipped, clipped), mask), num_actions, mask)
    with torch.no_grad():
        w = mask if stat_weights is None else stat_weights
        clip_fraction = _over(masked_sum((clipped > unclipped).to(unclipped.dtype), w),
                              num_actions, w)
    return ValueLossOut(loss, clip_fraction)


def pairwise_reward_loss(chosen_scores: Tensor, rejected_scores: Tensor,
                         num_pairs: int | None = None, center_coef: float = 0.0,
                         margins: Tensor | None = None) -> RewardLossOut:
    """Bradley-Terry loss of a reward model on (chosen, rejected) pairs, optionally with
    Llama 2's margins (the score difference a pair must pass) and a centering term
    (Eisenstein et al., 2023; TRL's center_rewards_coefficient): the loss alone is blind to
    a shift of every score, which the term pins near 0.

    Args:
        chosen_scores: [B] scores of the preferred answers. rejected_scores: [B].
        num_pairs: the count the means divide by; default B (the whole batch's count when
            these pairs are one rank's share of it).
        center_coef: weight of ``mean((chosen + rejected) ** 2)``; 0: none.
        margins: [B] each pair's margin; None: 0.

    Returns:
        RewardLossOut(loss, accuracy, chosen_mean, rejected_mean), scalars:
        ``loss = mean(-logsigmoid(chosen - rejected - margin)) + center_coef * mean((chosen
        + rejected) ** 2)``; ``accuracy = mean(chosen > rejected)`` (the margin aside); the
        statistics are detached.
    """
    chosen, rejected = chosen_scores.float(), rejected_scores.float()
    n = num_pairs or len(chosen)
    difference = chosen - rejected if margins is None else chosen - rejected - margins.float()
    loss = -F.logsigmoid(difference).sum() / n
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).sum() / n
    with torch.no_grad():
        accuracy = (chosen > rejected).float().sum() / n
        chosen_mean = chosen.sum() / n
        rejected_mean = rejected.sum() / n
    return RewardLossOut(loss, accuracy, chosen_mean, rejected_mean)


DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")   # dpo_loss's
KTO = "kto"   # dpo.loss's other choice: kto_loss
REFERENCE_FREE = ("simpo", "orpo")   # their losses read no reference log-probs
PER_TOKEN = ("ipo", "simpo", "orpo")  # on each answer's mean token log-prob, not its sum


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor | None,
             ref_rejected_logps: Tensor | None, beta: float, loss_type: str = "sigmoid",
             label_smoothing: float = 0.0, num_pairs: int | None = None,
             gamma: float = 0.0) -> DPOLossOut:
    """Direct preference optimisation's loss on (chosen, rejected) pairs, from the answers'
    log-probabilities under the policy and the frozen reference. With the log-ratio margin
    ``h = (chosen - ref_chosen) - (rejected - ref_rejected)``:

    - ``sigmoid`` (DPO, Rafailov et al., 2023), with ``label_smoothing`` e the chance that a
      pair's label is wrong (cDPO, Mitchell 2023): ``-(1 - e) logsigmoid(beta h) - e
      logsigmoid(-beta h)``;
    - ``ipo`` (Azar et al., 2023): ``(h - 1 / (2 beta))^2``;
    - ``hinge`` (SLiC, Zhao et al., 2023): ``relu(1 - beta h)``.

    Reference-free (the reference's log-probs unread, may be None; h = chosen - rejected):

    - ``simpo`` (Meng et al., 2024): ``-logsigmoid(beta h - gamma)``;
    - ``orpo`` (Hong et al., 2024): ``-beta logsigmoid(log odds(chosen) - log odds(rejected))``
      with ``log odds(x) = x - log(1 - e^x)``; its paper adds the chosen answers' NLL
      (the caller's).

    ``ipo``, ``simpo`` and ``orpo`` take log-probabilities that the caller averages over
    each answer's tokens (PER_TOKEN), as their papers do.

    Args:
        chosen_logps, rejected_logps: [B] float, the answers' log-probabilities under the
            policy (differentiable). ref_chosen_logps, ref_rejected_logps: [B], the
            reference's.
        beta: the strength of the implied KL constraint (SimPO: the reward's scale;
            ORPO: the odds-ratio term's weight), > 0.
        num_pairs: the count the means divide by; default B (the whole batch's count when
            these pairs are one rank's share of it).
        gamma: SimPO's target margin.

    Returns:
        DPOLossOut: the loss (the per-pair losses' sum over ``num_pairs``), each answer's
        implicit reward ``beta * (logp - ref_logp)`` (reference-free: ``beta * logp``) and
        the share of pairs whose chosen answer's is higher (ties count wrong), over
        ``num_pairs``.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type {loss_type!r}: choose one of {', '.join(DPO_LOSSES)}")
    chosen_ratio, rejected_ratio = chosen_logps.float(), rejected_logps.float()
    if loss_type not in REFERENCE_FREE:
        chosen_ratio = chosen_ratio - ref_chosen_logps.float()
        rejected_ratio = rejected_ratio - ref_rejected_logps.float()
    losses = _pair_losses(chosen_ratio, rejected_ratio, beta, loss_type, label_smoothing, gamma)
    n = num_pairs or len(losses)
    with torch.no_grad():
        chosen_rewards, rejected_rewards = beta * chosen_ratio, beta * rejected_ratio
        accuracy = (chosen_rewards > rejected_rewards).float().sum() / n
    return DPOLossOut(losses.sum() / n, chosen_rewards, rejected_rewards, accuracy)


class PairedLossOut(NamedTuple):
    loss: Tensor  # scalar, differentiable
    accuracy: Tensor  # scalar, detached: share of the pairs (of num_pairs) dpo_loss ranks right
    margin: Tensor  # scalar, detached: the chosen less the rejected implicit reward, summed
                    # over these pairs / num_pairs
    pairs: Tensor  # scalar: the pairs in these rows


def paired_dpo_loss(logprobs: Tensor, ref_logprobs: Tensor, labels: Tensor, mask: Tensor,
                    group_size: int, beta: float, loss_type: str = "sigmoid",
                    num_pairs: float | None = None) -> PairedLossOut:
    """Online DPO's loss over rollouts: dpo_loss on the pairs that ``labels`` mark
    (preference_pairs), each answer's log-probability the sum of its tokens' (ipo: their
    mean) under ``mask``.

    Args:
        logprobs: [B, N] the policy's log-prob of each answer token (differentiable).
        ref_logprobs: [B, N] the reference's. labels: [B] 1 chosen, -1 rejected, 0 neither.
        mask: [B, N] the answers' tokens; a row without any is in no pair (a stand-in).
        group_size: the rows are whole groups of this many answers to one prompt, each
            group's consecutive; a pair's two rows are in one group.
        num_pairs: the count the means divide by; default these rows' pairs (give the
            whole batch's when these rows are one part of it).

    Returns:
        PairedLossOut; 0 loss, not NaN, without a pair.
    """
    keep = mask != 0
    real = keep.any(1)
    chosen, rejected = (labels > 0) & real, (labels < 0) & real
    groups = torch.arange(len(labels), device=labels.device) // group_size
    if not torch.equal(groups[chosen], groups[rejected]):
        raise ValueError(f"the pairs of {len(labels)} rows are not within groups of "
                         f"{group_size} consecutive rows: give whole groups")
    zeros = torch.zeros((), device=logprobs.device)
    policy = torch.where(keep, logprobs.float(), zeros).sum(1)
    reference = torch.where(keep, ref_logprobs.float(), zeros).sum(1)
    if loss_type in PER_TOKEN:
        tokens = keep.sum(1).clamp(min=1)
        policy, reference = policy / tokens, reference / tokens
    n = num_pairs or max(int(chosen.sum()), 1)
    out = dpo_loss(policy[chosen], policy[rejected], reference[chosen], reference[rejected],
                   beta, loss_type, num_pairs=n)
    margin = (out.chosen_rewards - out.rejected_rewards).sum() / n
    return PairedLossOut(out.loss, out.accuracy, margin, chosen.sum().float())



def labelled_kto_loss(logprobs: Tensor, ref_logprobs: Tensor, labels: Tensor, mask: Tensor,
                      kl_point: float, beta: float, num_answers: float | None = None
                      ) -> PairedLossOut:
    """Online KTO's loss over rollouts: kto_feedback_loss on the answers that ``labels``
    mark (feedback_labels), each answer's log-probability the sum of its tokens' under
    ``mask``.

    Args:
        logprobs: [B, N] the policy's log-prob of each answer token (differentiable).
        ref_logprobs: [B, N] the reference's. labels: [B] 1 desirable, -1 undesirable, 0
            neither. mask: [B, N] the answers' tokens; a row without any is unlabelled (a
            stand-in).
        kl_point: z0, the sampling policy's KL to the reference (kto_kl_point).
        num_answers: the count the means divide by; default these rows' labelled answers
            (give the whole batch's when these rows are one part of it).

    Returns:
        PairedLossOut: the loss; as accuracy the share of the answers on their label's side
        of z0; as margin the answers' implicit rewards, each signed by its label (desirable
        +, undesirable -), summed / num_answers; as pairs the labelled answers. 0 loss, not
        NaN, without one.
    """
    keep = mask != 0
    labelled = (labels != 0) & keep.any(1)
    zeros = torch.zeros((), device=logprobs.device)
    policy = torch.where(keep, logprobs.float(), zeros).sum(1)[labelled]
    reference = torch.where(keep, ref_logprobs.float(), zeros).sum(1)[labelled]
    n = num_answers or max(int(labelled.sum()), 1)
    sign = labels[labelled].float()
    out = kto_feedback_loss(policy, reference, sign > 0, kl_point, beta, num_answers=n)
    margin = (sign * out.rewards).sum() / n
    return PairedLossOut(out.loss, out.accuracy, margin, labelled.sum().float())

def _pair_losses(chosen: Tensor, rejected: Tensor, beta: float, loss_type: str,
                 label_smoothing: float, gamma: float) -> Tensor:
    """[B] dpo_loss's per-pair losses, from each answer's log-ratio to the reference (the
    log-prob itself without one)."""
    h = chosen - rejected
    if loss_type == "sigmoid":
        return (-(1 - label_smoothing) * F.logsigmoid(beta * h)
                - label_smoothing * F.logsigmoid(-beta * h))
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "hinge":
        return F.relu(1 - beta * h)
    if loss_type == "simpo":
        return -F.logsigmoid(beta * h - gamma)
    return -beta * F.logsigmoid(_log_odds(chosen) - _log_odds(rejected))   # orpo


def kto_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor,
             ref_rejected_logps: Tensor, kl_point: Tensor | float, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             num_pairs: int | None = None) -> DPOLossOut:
    """kto_feedback_loss on pairs read as one desirable (chosen) and one undesirable
    (rejected) answer each, averaged over the answers (two per pair), as TRL's KTOTrainer
    averages; at the start (r = z0 = 0) the loss is (desirable_weight + undesirable_weight)
    / 4.

    Args:
        chosen_logps, rejected_logps: [B] float, the answers' log-probability sums under the
            policy (differentiable). ref_chosen_logps, ref_rejected_logps: [B], the
            reference's.
        kl_point, beta, desirable_weight, undesirable_weight: as kto_feedback_loss's.
        num_pairs: the pairs the means divide by; default B.

    Returns:
        DPOLossOut as dpo_loss's: the loss (the answers' losses summed over 2 x num_pairs),
        the implicit rewards ``beta * r`` and the share of pairs whose chosen answer's is the
        higher.
    """
    n = num_pairs or len(chosen_logps)
    desirable = torch.arange(2 * len(chosen_logps), device=chosen_logps.device) < len(chosen_logps)
    out = kto_feedback_loss(torch.cat([chosen_logps, rejected_logps]),
                            torch.cat([ref_chosen_logps, ref_rejected_logps]), desirable,
                            kl_point, beta, desirable_weight, undesirable_weight, 2 * n)
    chosen_rewards, rejected_rewards = out.rewards.chunk(2)
    accuracy = (chosen_rewards > rejected_rewards).float().sum() / n
    return DPOLossOut(out.loss, chosen_rewards, rejected_rewards, accuracy)


def kto_feedback_loss(logps: Tensor, ref_logps: Tensor, desirable: Tensor,
                      kl_point: Tensor | float, beta: float, desirable_weight: float = 1.0,
                      undesirable_weight: float = 1.0, num_answers: int | None = None
                      ) -> KTOLossOut:
    """Kahneman-Tversky optimisation's loss (Ethayarajh et al., 2024) on answers each
    labelled desirable or undesirable alone (thumbs up or down; no pairs). With an answer's
    log-ratio ``r = logp - ref_logp`` and the reference point ``z0`` (``kl_point``: the
    policy's KL to the reference, estimated on mismatched prompts and answers and not
    trained through):

        desirable:   desirable_weight * (1 - sigmoid(beta * (r - z0)))
        undesirable: undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

    averaged over the answers; at the start (r = z0 = 0) each answer's loss is half its
    weight.

    Args:
        logps: [N] float, the answers' log-probability sums under the policy
            (differentiable). ref_logps: [N], the reference's.
        desirable: [N] bool, each answer's label.
        kl_point: scalar z0 >= 0 (kto_kl_point), detached.
        beta: the value function's scale, > 0.
        num_answers: the answers the mean divides by; default N.

    Returns:
        KTOLossOut: the loss (summed over the answers, divided by num_answers), the implicit
        rewards ``beta * r`` and the share of answers on their label's side of z0
        (desirable: r > z0; undesirable: r < z0; over num_answers).
    """
    ratio = logps.float() - ref_logps.float()
    z0 = torch.as_tensor(kl_point, dtype=torch.float32, device=ratio.device).detach()
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio))))
    n = num_answers or len(losses)
    ratio = ratio.detach()
    sided = torch.where(desirable, ratio > z0, ratio < z0)
    return KTOLossOut(losses.sum() / n, beta * ratio, sided.float().sum() / n)


def kto_kl_point(kl_sum: float, count: float) -> float:
    """KTO's reference point z0 from the sum of ``log pi(y'|x) - log pi_ref(y'|x)`` over
    `count` mismatched (prompt, answer) pairs (an answer to another prompt): their mean,
    held at 0 or above, as the paper's estimate of KL(pi || pi_ref). [scalar floats: the
    caller sums over processes first.]"""
    # a NaN mean stays NaN (max keeps its first argument), so the loss and the engine's
    # non-finite guard see it rather than a clamped 0
    return max(kl_sum / count, 0.0) if count else 0.0



@torch.no_grad()
def rollout_kl_sum(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> tuple[float, float]:
    """The sum over answers of ``log pi(y|x) - log pi_ref(y|x)`` (each the sum of its tokens'
    under ``mask``, [B, N] each) and the answers counted (rows with a token): with answers
    sampled from pi, their mean is a Monte Carlo estimate of KL(pi || pi_ref), online KTO's
    z0 through kto_kl_point (offline KTO needs mismatched pairs for it, having no samples
    of pi). [the caller sums over processes]"""
    keep = mask != 0
    ratio = torch.where(keep, logprobs.double() - ref_logprobs.double(),
                        torch.zeros((), dtype=torch.float64, device=logprobs.device))
    return float(ratio.sum()), float(keep.any(1).sum())

def _log_odds(logp: Tensor) -> Tensor:
    """log(p / (1 - p)) of probabilities given as log-probs, log(1 - p) as log(-expm1(logp));
    held below log 1, where a sure answer's odds would be infinite."""
    logp = logp.clamp(max=-1e-6)
    return logp - torch.log(-torch.expm1(logp))


def sequence_logprobs(token_logprobs: Tensor, labels: Tensor, ignore_index: int = -100
                      ) -> tuple[Tensor, Tensor]:
    """Each row's answer log-probability: the sum of its target tokens' log-probs, and their
    count.

    Args:
        token_logprobs: [B, T] float; column t is the log-prob of ``labels[:, t + 1]`` (the
            next token's), the last column is never read. Values at ignored positions may be
            anything (they are selected away).
        labels: [B, T] LongTensor aligned with the input ids; ``ignore_index`` off the answer.

    Returns:
        ([B] float32 sums, [B] float32 token counts).
    """
    trained = labels[:, 1:] != ignore_index
    kept = torch.where(trained, token_logprobs[:, :-1].float(),
                       torch.zeros((), device=token_logprobs.device))
    return kept.sum(1), trained.sum(1).float()


def sft_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100,
             num_tokens: int | None = None) -> Tensor:
    """Causal-LM cross entropy; ``logits[:, t]`` predicts ``labels[:, t + 1]``.

    Args:
        logits: [B, T, V] model outputs for ``input_ids`` [B, T] (any float dtype; float32
            math, without a float32 copy of the logits: see logprobs_of_tokens).
        labels: LongTensor [B, T] aligned with ``input_ids``; ``ignore_index`` marks positions
            that are not trained on (prompt, padding).
        num_tokens: the count the mean divides by; default the batch's target tokens (give
            the whole batch's count when these rows are one rank's share of it).

    Returns:
        scalar: mean cross entropy over the non-ignored target tokens of the whole batch
        (0, not NaN, when every label is ignored).
    """
    targets = labels[:, 1:]
    trained = targets != ignore_index
    logprobs = logprobs_of_tokens(logits[:, :-1], targets.masked_fill(~trained, 0))
    total = -torch.where(trained, logprobs, torch.zeros((), device=logits.device)).sum()
    count = num_tokens if num_tokens is not None else trained.sum()
    return total / max(int(count), 1)


# ---------------------------------------------------------------------------------------------
# Parameter EMA (the one in-place helper)


@torch.no_grad()
def ema_update(ema_params: Iterable[Tensor], params: Iterable[Tensor], beta: float) -> None:
    """In place ``ema = beta * ema + (1 - beta) * param`` for each pair of tensors.

    Args:
        ema_params: tensors updated in place (any shape; each matches its partner in ``params``).
        params: source tensors, same order and shapes (floating point: trained ones).
        beta: EMA decay in [0, 1].
    """
    for ema, param in zip(ema_params, params, strict=True):
        ema.lerp_(param.detach().to(device=ema.device, dtype=ema.dtype), 1.0 - beta)
