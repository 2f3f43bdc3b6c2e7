"""Step 3, reinforcement learning against a reward (InstructGPT's PPO by default): the
actor samples answers, the reward model and/or a reward function score them, a KL penalty
to the frozen reference keeps the actor close to SFT, an advantage estimator turns rewards
into per-token advantages, and a clipped policy loss updates the actor (and a clipped value
loss the critic, for PPO). Optional: an EMA copy of the actor, a pretraining (PTX) loss on
step-1 data, an adaptive KL coefficient, a penalty for answers cut off without EOS.

`ppo.algorithm` picks the estimator (steps/rlhf.py): `ppo` (critic + GAE), or critic-free
`grpo` (rewards normalised within each prompt's group of `ppo.samples_per_prompt`
answers), `rloo` (leave-one-out baseline within the group) and `reinforce_pp` (discounted
returns with a per-token KL penalty, normalised over the batch). The loop is the same.

All tensors of a rollout are answer-aligned [B, N] (see steps/rlhf.py): column j is answer
token j of `sequences[:, P + j]`; the logits and values that belong to it sit at P+j-1.

With several ranks, each round's prompts are dealt out whole with their groups
(engine/data_parallel.py), every rank generates and scores its own, and every mean (losses,
advantage whitening, metrics) is taken over the whole round, so the run computes what one
process would. Sampling is row-seeded (engine/generation.py): an answer does not depend on
the rank that samples it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf

from engine.checkpoint import Tensors
from engine.data_parallel import DataParallel, Share
from engine.errors import NonFiniteError, UserError
from engine.generation import SamplingSettings
from engine.hybrid import HybridEngine
from engine.models import disable_dropout, load_tokenizer, position_ids
from engine.placement import Placement
from engine.runtime import Runtime, memory_peak, reset_memory_peak
from engine.tracking import Tracker
from engine.trainer import TrainEngine
from steps.common import (
    StepCheckpoints,
    batches,
    epoch_batches,
    ground_truth,
    log,
    num_batches,
    placement,
    report_tokenized,
    require_examples,
    start_step,
    to_device,
)
from steps.data import PreferencePair, permutation, train_eval_split
from steps.rlhf import (
    adaptive_kl_coef,
    answer_mask,
    ema_update,
    gae,
    group_normalized_advantages,
    kl_estimate,
    kl_penalized_rewards,
    leave_one_out_advantages,
    logprobs_of_tokens,
    loss_weights,
    masked_sum,
    policy_loss,
    returns_to_go,
    sequence_rewards,
    value_loss,
    whiten,
)
from steps.scoring import Rewards, RewardScorer, load_reward_fn
from steps.sft import batch_loss
from steps.tokenize import SFTExample, collate_prompts, collate_sft, tokenize_prompts, tokenize_sft


class Experience(NamedTuple):
    """One round of rollouts. B rows; P prompt columns (left-padded), N answer columns."""

    sequences: torch.Tensor       # [B, P+N] prompt + answer token ids
    attention_mask: torch.Tensor  # [B, P+N] 1 on real prompt tokens and on actions
    action_mask: torch.Tensor     # [B, N] 1 on answer tokens up to and including EOS
    logprobs: torch.Tensor        # [B, N] actor log-probs when sampled
    ref_logprobs: torch.Tensor    # [B, N] reference log-probs
    values: torch.Tensor          # [B, N] critic values (0 without a critic)
    rewards: torch.Tensor         # [B, N] KL penalty + clipped score on the last action
    advantages: torch.Tensor      # [B, N]
    returns: torch.Tensor         # [B, N] the critic's targets
    scores: torch.Tensor          # [B] score of each answer (reward model and/or function)
    kl: torch.Tensor              # [B, N] per-token KL estimate actor/reference

    @property
    def prompt_len(self) -> int:
        return self.sequences.shape[1] - self.action_mask.shape[1]

    def rows(self, index: torch.Tensor) -> Experience:
        return Experience(*(field[index] for field in self))

    def without_actions(self) -> Experience:
        """The same rows contributing nothing (a stand-in on a rank with no rows)."""
        return self._replace(action_mask=torch.zeros_like(self.action_mask))


def row_seeds(seed: int, stream: int, rows: list[int]) -> torch.Tensor:
    """[B] sampling seeds of global rows `rows` of a round (`stream` 0 = evaluation,
    i + 1 = rollouts of iteration i)."""
    return (torch.tensor(rows, dtype=torch.long) + (stream << 20)) + ((seed % (1 << 23)) << 40)


def answer_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_len: int, temperature: float = 1.0) -> torch.Tensor:
    """[B, N] fp32 log-probability of each answer token under `model` at the sampling
    `temperature`: the distribution the answers were drawn from, log_softmax(logits / T)."""
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask)).logits
    return logprobs_of_tokens(logits[:, prompt_len - 1:-1], sequences[:, prompt_len:],
                              temperature)


def answer_values(critic: TrainEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_len: int) -> torch.Tensor:
    """[B, N] critic value of the state before each answer token."""
    return critic.token_values(sequences, attention_mask)[:, prompt_len - 1:-1]


# Advantage estimators: (ppo settings, rewards [B, N], scores [B], kl [B, N], values [B, N],
# actions [B, N], the reward's KL weight, group size, dp) -> (advantages, returns) [B, N]
def _gae(ppo, rewards, scores, kl, values, actions, kl_coef, group_size, dp):
    advantages, returns = gae(rewards, values, actions, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten(advantages, actions, moments=dp.masked_moments(advantages, actions))
    return advantages, returns


def _returns_to_go(ppo, rewards, scores, kl, values, actions, kl_coef, group_size, dp):
    returns = returns_to_go(rewards, actions, ppo.gamma)
    return whiten(returns, actions, moments=dp.masked_moments(returns, actions)), returns


def _per_answer(baseline):
    """A critic-free estimator over each answer's reward (score minus its KL), compared
    within its group by `baseline(per_answer [B], group_size, ppo) -> [B]`."""
    def estimate(ppo, rewards, scores, kl, values, actions, kl_coef, group_size, dp):
        per_answer = sequence_rewards(scores, kl, actions, kl_coef, ppo.score_clip)
        advantage = baseline(per_answer, group_size, ppo)
        return advantage[:, None] * actions, per_answer[:, None] * actions
    return estimate


class Algorithm(NamedTuple):
    name: str                     # as the log writes it
    critic: bool                  # trains a critic (PPO's value model)
    groups: bool                  # compares the answers to one prompt: samples_per_prompt >= 2
    kl_in_loss: bool              # where ppo.kl_penalty=auto puts the KL: a loss term
    advantages: Callable          # the estimator (above)


ALGORITHMS = {
    "ppo": Algorithm("PPO", True, False, False, _gae),
    "grpo": Algorithm("GRPO", False, True, True, _per_answer(
        lambda r, g, ppo: group_normalized_advantages(r, g, ppo.grpo_scale_rewards))),
    "rloo": Algorithm("RLOO", False, True, False, _per_answer(
        lambda r, g, ppo: leave_one_out_advantages(r, g))),
    "reinforce_pp": Algorithm("REINFORCE++", False, False, False, _returns_to_go),
}
CRITIC_FREE = tuple(key for key, algorithm in ALGORITHMS.items() if not algorithm.critic)


class KLSettings(NamedTuple):
    in_loss: bool       # a loss term (GRPO), else a per-token penalty in the reward
    estimator: str      # k1 | k2 | k3 (steps/rlhf.kl_estimate)


def kl_settings(ppo: DictConfig) -> KLSettings:
    """`ppo.kl_penalty` and `ppo.kl_estimator` with "auto" resolved: GRPO's KL is a k3 loss
    term (DeepSeekMath), the others' a k1 penalty in the reward (InstructGPT)."""
    in_loss = ppo.kl_penalty == "loss" or (ppo.kl_penalty == "auto"
                                           and ALGORITHMS[ppo.algorithm].kl_in_loss)
    estimator = ppo.kl_estimator if ppo.kl_estimator != "auto" else "k3" if in_loss else "k1"
    return KLSettings(in_loss, estimator)


def check_settings(ppo: DictConfig) -> None:
    """Refuse step-3 settings that cannot work together, naming the keys (each key's own
    range is the schema's: steps/config.py)."""
    if ALGORITHMS[ppo.algorithm].groups and ppo.samples_per_prompt < 2:
        raise UserError(f"ppo.samples_per_prompt={ppo.samples_per_prompt}: {ppo.algorithm} "
                        "compares the answers to one prompt; give 2 or more (e.g. 4)")
    if ppo.reward_fn:
        load_reward_fn(ppo.reward_fn)
    elif ppo.reward_model_weight == 0:
        raise UserError("ppo.reward_model_weight=0 leaves nothing to reward: set ppo.reward_fn")
    if ppo.micro_batch_size > ppo.rollout_batch_size * ppo.samples_per_prompt:
        raise UserError("ppo.micro_batch_size must not exceed the answers of a round "
                        "(ppo.rollout_batch_size x ppo.samples_per_prompt)")


def ended_with_eos(answer_ids: torch.Tensor, actions: torch.Tensor, eos_token_id: int
                   ) -> torch.Tensor:
    """[B] bool: the answer's actions include its EOS (it was not cut off)."""
    return ((answer_ids == eos_token_id) & (actions > 0)).any(1)


class Rollout(NamedTuple):
    """Answers sampled for left-padded prompts (P columns), N answer columns."""

    sequences: torch.Tensor       # [B, P+N] prompt + answer token ids, pad after EOS
    attention_mask: torch.Tensor  # [B, P+N] 1 on real prompt tokens and on answer tokens
    answered: torch.Tensor        # [B, N] 1.0 on answer tokens up to and including EOS

    @property
    def prompt_len(self) -> int:
        return self.sequences.shape[1] - self.answered.shape[1]


@torch.no_grad()
def rollout(models: Models, prompts: dict[str, torch.Tensor], sampling: SamplingSettings,
            seeds: torch.Tensor | None, group_size: int = 1) -> Rollout:
    """The actor's answers to left-padded prompts (row `seeds`, see row_seeds; rows in
    groups of `group_size` copies of a prompt), for training and evaluation alike."""
    tokenizer = models.tokenizer
    sequences = models.actor.generate(prompts["input_ids"], prompts["attention_mask"],
                                      sampling, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id, row_seeds=seeds,
                                      group_size=group_size)
    answered = answer_mask(sequences[:, prompts["input_ids"].shape[1]:], tokenizer.eos_token_id)
    return Rollout(sequences, torch.cat([prompts["attention_mask"], answered.long()], 1),
                   answered)


@torch.no_grad()
def make_experience(models: Models, prompts: dict[str, torch.Tensor],
                    sampling: SamplingSettings, ppo: DictConfig, dp: DataParallel, *,
                    kl_coef: float, seeds: torch.Tensor | None = None, weight: float = 1.0,
                    group_size: int = 1) -> tuple[Experience, dict[str, float]]:
    """Sample answers for left-padded prompts (row `seeds`, see row_seeds), rows in groups
    of `group_size` copies of a prompt, and compute everything the update needs. The
    prompts are this process's share of the rollout batch, of `weight` (0 empties the action
    masks of a stand-in); batch statistics (whitening) use the whole batch. Returns the
    experience and the seconds spent: gathering the actor for generation, generating, and
    computing the rest."""
    actor, critic, eos = models.actor, models.critic, models.tokenizer.eos_token_id
    actor.take_times()
    sequences, attention_mask, answered = rollout(models, prompts, sampling, seeds, group_size)
    t1 = time.perf_counter()
    generation = actor.take_times()
    prompt_len = prompts["input_ids"].shape[1]
    actions = answered * weight

    actor.eval()
    logprobs = answer_logprobs(actor, sequences, attention_mask, prompt_len, sampling.temperature)
    actor.train()
    ref_logprobs = answer_logprobs(models.reference, sequences, attention_mask, prompt_len,
                                   sampling.temperature)
    values = torch.zeros_like(logprobs)
    if critic is not None:
        critic.eval()
        values = answer_values(critic, sequences, attention_mask, prompt_len) * actions
        critic.train()
    scores = models.rewards(sequences, attention_mask, prompt_len)
    if ppo.missing_eos_penalty is not None:
        cut_off = ~ended_with_eos(sequences[:, prompt_len:], answered, eos)
        scores = scores - ppo.missing_eos_penalty * cut_off.to(scores.dtype)

    penalty = kl_settings(ppo)
    reward_kl_coef = 0.0 if penalty.in_loss else kl_coef
    rewards, kl = kl_penalized_rewards(scores, logprobs, ref_logprobs, actions, reward_kl_coef,
                                       ppo.score_clip, penalty.estimator)
    advantages, returns = estimate_advantages(ppo, rewards, scores, kl, values, actions,
                                              reward_kl_coef, group_size, dp)
    t2 = time.perf_counter()
    experience = Experience(sequences, attention_mask, actions, logprobs, ref_logprobs, values,
                            rewards, advantages, returns, scores, kl)
    return experience, {"time/gather": generation.gather, "time/generate": generation.generate,
                        "time/experience": t2 - t1}


def estimate_advantages(ppo: DictConfig, rewards: torch.Tensor, scores: torch.Tensor,
                        kl: torch.Tensor, values: torch.Tensor, actions: torch.Tensor,
                        kl_coef: float, group_size: int, dp: DataParallel
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The algorithm's advantage estimator (steps/rlhf.py) over [B, N] rollouts whose rows
    come in groups of `group_size` answers to one prompt. `rewards` are per token (KL
    penalty + score on the last action), `scores` [B] per answer, `kl_coef` the reward's KL
    weight (0 when the KL is a loss term). Returns (advantages, returns) [B, N]."""
    return ALGORITHMS[ppo.algorithm].advantages(ppo, rewards, scores, kl, values, actions,
                                                kl_coef, group_size, dp)


def train_on(experience: Experience, models: Models, ppo: DictConfig, kl_coef: float,
             weights: torch.Tensor, count: float, ptx: PtxRows | None
             ) -> tuple[dict[str, float], dict[str, float]]:
    """One optimisation step of the actor (and critic) on this process's rows of a
    micro-batch. `weights` [B, N], `count`: each action's loss weight and the micro-batch's
    loss divisor over all processes (see loss_weights). Returns this process's shares of the statistics (their sums over
    processes are the micro-batch's), and the gradient norms (the whole micro-batch's
    already: NaN or inf where the update was skipped)."""
    exp, prompt_len, actor = experience, experience.prompt_len, models.actor
    logprobs = answer_logprobs(actor, exp.sequences, exp.attention_mask, prompt_len,
                               ppo.temperature)
    actor_out = policy_loss(logprobs, exp.logprobs, exp.advantages, weights, ppo.clip_range,
                            count)
    loss, stats = actor_out.loss, {}
    kl = kl_settings(ppo)
    if kl.in_loss:
        kl_loss = masked_sum(kl_estimate(logprobs, exp.ref_logprobs, exp.action_mask,
                                         kl.estimator), weights) / max(count, 1.0)
        loss = loss + kl_coef * kl_loss
        stats["train/kl_loss"] = kl_loss.item()
    if ptx is not None:
        ptx_loss = batch_loss(actor, ptx.batch, ptx.examples)[0] * ptx.weight
        loss = loss + ppo.ptx.coef * ptx_loss
        stats["train/ptx_loss"] = ptx_loss.item()
    actor.backward(loss)
    norms = {"train/grad_norm": actor.step()}
    stats.update({"train/policy_loss": actor_out.loss.item(),
                  "train/clip_fraction": float(actor_out.clip_fraction),
                  "train/approx_kl": float(actor_out.approx_kl),
                  "train/ratio": float(actor_out.ratio_mean)})
    if models.critic is not None:
        values = answer_values(models.critic, exp.sequences, exp.attention_mask, prompt_len)
        critic_out = value_loss(values, exp.values, exp.returns, weights,
                                ppo.value_clip_range, count)
        models.critic.backward(critic_out.loss)
        norms["train/critic_grad_norm"] = models.critic.step()
        stats.update({"train/value_loss": critic_out.loss.item(),
                      "train/value_clip_fraction": float(critic_out.clip_fraction)})
    return stats, norms


class PtxRows(NamedTuple):
    """This process's share of a pretraining (PTX) batch."""

    batch: dict[str, torch.Tensor]
    examples: list[SFTExample]   # the whole batch's (its trained tokens: the loss's divisor)
    weight: float


def ptx_rows(examples: list[SFTExample], index: int, batch_size: int, seed: int,
             pad_token_id: int, dp: DataParallel) -> PtxRows:
    """The `index`-th PTX batch: passes over the step-1 data, each in a fresh seeded order,
    so the stream's position is one counter (which a checkpoint stores)."""
    per_pass = num_batches(len(examples), batch_size)
    epoch, offset = divmod(index, per_pass)
    order = permutation(len(examples), seed + 7919 * (epoch + 1))
    batch = [examples[i] for i in order[offset * batch_size:(offset + 1) * batch_size]]
    share = dp.share(batch)
    return PtxRows(to_device(collate_sft(share.rows, pad_token_id), dp.device), batch,
                   share.weight)


def update(exp: Experience, share: Share, batch_size: int, models: Models, ppo: DictConfig,
           dp: DataParallel, ptx: list[SFTExample], ptx_batches: int, ema: Tensors | None,
           seed: int, iteration: int, kl_coef: float) -> tuple[dict[str, float], int]:
    """`ppo.ppo_epochs` passes over one round's experience (this process's `share` of its
    `batch_size` answers) in micro-batches, each one optimizer step of the actor and critic
    (and a PTX batch, an EMA update). Returns the statistics' means over the updates and
    the PTX stream's new position."""
    sums: dict[str, float] = {}
    norm_sums: dict[str, float] = {}
    updates = 0
    for ppo_epoch in range(ppo.ppo_epochs):
        order = torch.tensor(permutation(batch_size, seed + iteration * 131 + ppo_epoch))
        for micro in order.split(ppo.micro_batch_size):
            index, weight = dp.pick(share, micro)
            rows = exp.rows(index) if weight else exp.rows(index).without_actions()
            weights, local_count = loss_weights(rows.action_mask, ppo.loss_aggregation)
            count = dp.sum(float(local_count))[0]
            ptx_batch = None
            if ptx:
                ptx_batch = ptx_rows(ptx, ptx_batches, ppo.ptx.batch_size, seed,
                                     models.tokenizer.pad_token_id, dp)
                ptx_batches += 1
            stats, norms = train_on(rows, models, ppo, kl_coef, weights, count, ptx_batch)
            for totals, values in ((sums, stats), (norm_sums, norms)):
                for name, value in values.items():
                    totals[name] = totals.get(name, 0.0) + value
            updates += 1
            if ema is not None:
                ema_update(ema.tensors.values(), models.actor.parameters(), ppo.ema.beta)
    totals = dict(zip(sums, dp.sum(*sums.values()), strict=True))
    return {name: total / updates for name, total in {**totals, **norm_sums}.items()}, ptx_batches


@torch.no_grad()
def evaluate_policy(models: Models, prompts: Prompts, sampling: SamplingSettings,
                    batch_size: int, seed: int, dp: DataParallel) -> dict[str, float]:
    """Score (reward model and/or function; and the demo's ground truth when it applies)
    of answers sampled for held-out prompts, with fixed row seeds so before/after compare
    like with like."""
    if not prompts.eval:
        return {}
    tokenizer = models.tokenizer
    reward_sum = truth_sum = truth_count = 0.0
    for batch_rows in batches(range(len(prompts.eval)), batch_size, shuffle=False, seed=0):
        share = dp.share(batch_rows)
        batch = to_device(collate_prompts([prompts.eval[i] for i in share.rows],
                                          tokenizer.pad_token_id), dp.device)
        answers = rollout(models, batch, sampling, row_seeds(seed, 0, share.rows))
        p = answers.prompt_len
        scores = models.rewards(answers.sequences, answers.attention_mask, p)
        reward_sum += float(scores.sum()) * share.weight
        # generate pads after EOS, so the special tokens are all that must go
        texts = tokenizer.batch_decode(answers.sequences[:, p:], skip_special_tokens=True)
        truth = ground_truth([prompts.eval_texts[i] for i in share.rows], texts)
        if truth is not None and share.weight:
            truth_sum, truth_count = truth_sum + truth[0], truth_count + truth[1]
    reward_sum, truth_sum, truth_count = dp.sum(reward_sum, truth_sum, truth_count)
    metrics = {"reward": reward_sum / len(prompts.eval)}
    if truth_count:
        metrics["ground_truth"] = truth_sum / truth_count
    return metrics


def _paths(cfg: DictConfig) -> tuple[str, str | None]:
    """The actor's and the reward model's directories (None: no reward model)."""
    out = Path(cfg.output_dir)
    actor_path = cfg.ppo.actor_path or str(out / "actor")
    reward_path = (cfg.ppo.reward_path or str(out / "reward")
                   if cfg.ppo.reward_model_weight != 0 else None)
    for path, what, key in ((actor_path, "step-1 actor", "ppo.actor_path"),
                            (reward_path, "step-2 reward model", "ppo.reward_path")):
        if path is not None and not (Path(path) / "config.json").exists():
            alone = (" (or ppo.reward_model_weight=0 to reward with ppo.reward_fn alone)"
                     if key == "ppo.reward_path" else "")
            raise UserError(f"step 3 needs the {what} at {path}: run its step first "
                            f"(--step 1 2 3) or set {key}=DIR{alone}")
    return actor_path, reward_path


class Prompts(NamedTuple):
    train: list[list[int]]      # token ids of the rollout prompts
    eval: list[list[int]]       # held-out prompts (before/after evaluation)
    eval_texts: list[str]
    ptx: list[SFTExample]       # step-1 examples for the PTX loss ([] when off)


def load_prompts(cfg: DictConfig, tokenizer, pairs: list[PreferencePair],
                 ptx_pairs: list[PreferencePair]) -> Prompts:
    data = cfg.data
    train_pairs, eval_pairs = train_eval_split(pairs, data.eval_fraction, cfg.seed)
    prompts, stats = tokenize_prompts(train_pairs, tokenizer, data.max_prompt_len)
    report_tokenized("step 3 prompts", stats, data.max_prompt_len)
    require_examples(3, "prompts", stats, data.max_prompt_len)
    eval_prompts, _ = tokenize_prompts(eval_pairs[:cfg.ppo.eval_prompts], tokenizer,
                                       data.max_prompt_len)
    ptx = []
    if cfg.ppo.ptx.enabled:
        ptx, ptx_stats = tokenize_sft(ptx_pairs, tokenizer, data.max_prompt_len,
                                      data.max_answer_len)
        report_tokenized("step 3 PTX", ptx_stats, data.max_prompt_len, data.max_answer_len)
    return Prompts(prompts, eval_prompts,
                   tokenizer.batch_decode(eval_prompts, skip_special_tokens=True), ptx)


class Models(NamedTuple):
    """Step 3's models, placed (engine/placement.py)."""

    actor: HybridEngine          # trained; generates through the hybrid engine
    critic: TrainEngine | None   # trained; per-token values (PPO only)
    reference: object            # frozen step-1 actor (the KL anchor): a model, or the
                                 # actor's own base with its adapters disabled
    rewards: Rewards             # the frozen reward model and/or the reward function
    tokenizer: object            # the actor's (and the reference's)
    critic_tokenizer: object


def build_models(cfg: DictConfig, place: Placement, tokenizer, actor_path: str,
                 reward_path: str | None, updates: int) -> Models:
    ppo, trc = OmegaConf.to_object(cfg.ppo), cfg.trust_remote_code   # a PPOConfig
    scorer = None
    critic_start = dict(spec=actor_path, flag="ppo.actor_path", seed=cfg.seed)
    critic_tokenizer = tokenizer
    if reward_path is not None:
        reward_tokenizer = load_tokenizer(reward_path, flag="ppo.reward_path",
                                          trust_remote_code=trc)
        reward = place.frozen(place.reward_model(reward_path, reward_tokenizer, trained=False,
                                                 flag="ppo.reward_path", trust_remote_code=trc),
                              family="scorer")
        scorer = RewardScorer(reward, tokenizer, reward_tokenizer, place.runtime.device)
        if scorer.same_tokenizer:   # the critic starts from the reward model
            critic_start = dict(spec=reward_path, flag="ppo.reward_path")
            critic_tokenizer = reward_tokenizer
        elif ALGORITHMS[ppo.algorithm].critic:
            log("step 3: reward model and actor tokenizers differ; the critic starts from "
                "the actor with a new value head, and rewards are scored on re-tokenized text")
    rewards = Rewards(tokenizer, scorer, ppo.reward_model_weight,
                      load_reward_fn(ppo.reward_fn) if ppo.reward_fn else None,
                      ppo.reward_fn_weight, ppo.reward_fn)
    critic = None
    if ALGORITHMS[ppo.algorithm].critic:
        critic = place.reward_model(**critic_start, tokenizer=tokenizer, trained=True,
                                    lora=ppo.critic_lora, trust_remote_code=trc)
    actor = place.causal_lm(actor_path, tokenizer, trained=True, trust_remote_code=trc,
                            lora=ppo.actor_lora)
    if ppo.disable_dropout:   # else old and new log-probs differ before any update
        disable_dropout(actor)
        if critic is not None:
            disable_dropout(critic)
    actor = place.trainer(actor, ppo, updates, family="policy", generates=True, name="actor",
                          lr=ppo.actor_lr, lora_lr=ppo.actor_lora.learning_rate)
    if critic is not None:
        critic = place.trainer(critic, ppo, updates, family="scorer", name="critic",
                               lr=ppo.critic_lr, lora_lr=ppo.critic_lora.learning_rate)
    # the policy the actor started from; LoRA over a frozen base: the actor, adapters off
    reference = place.frozen_start(actor, actor_path, tokenizer, trust_remote_code=trc)
    return Models(actor, critic, reference, rewards, tokenizer,
                  critic_tokenizer if critic is not None else None)


def run(cfg: DictConfig, pairs: list[PreferencePair], ptx_pairs: list[PreferencePair],
        rt: Runtime, resume: bool = False) -> dict:
    actor_path, reward_path = _paths(cfg)  # before start_step touches a previous run's files
    dp, place = DataParallel(rt), placement(cfg, rt)
    out = start_step(cfg, 3, dp, resume=resume)
    ppo, seed = cfg.ppo, cfg.seed
    tokenizer = load_tokenizer(actor_path, trust_remote_code=cfg.trust_remote_code)
    prompts = load_prompts(cfg, tokenizer, pairs, ptx_pairs)
    rounds = num_batches(len(prompts.train), ppo.rollout_batch_size)
    updates = ppo.epochs * rounds * ppo.ppo_epochs * num_batches(
        ppo.rollout_batch_size * ppo.samples_per_prompt, ppo.micro_batch_size)
    reset_memory_peak(dp.device)
    models = build_models(cfg, place, tokenizer, actor_path, reward_path, updates)
    ema = models.actor.copy_weights() if ppo.ema.enabled else None
    sampling = SamplingSettings(ppo.max_new_tokens, ppo.temperature, ppo.top_p, ppo.top_k)
    engines = {"actor": models.actor, **({"critic": models.critic} if models.critic else {})}
    ckpt = StepCheckpoints(cfg, 3, rt, engines, extra={"ema": ema} if ema else None)
    position, metrics_rows = ckpt.restore({"epoch": 0, "round": 0, "iteration": 0,
                                           "ptx_batches": 0, "kl_coef": ppo.kl_coef,
                                           "seconds": 0.0, "before": None}, resume)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=3),
                      enabled=dp.reports, keep_rows=metrics_rows)
    evaluate = partial(evaluate_policy, models, prompts, sampling, ppo.rollout_batch_size,
                       seed, dp)
    before = evaluate() if position["before"] is None else position["before"]
    start = time.perf_counter() - position["seconds"]
    iteration, ptx_batches, kl_coef = (position[k] for k in ("iteration", "ptx_batches",
                                                              "kl_coef"))
    time_totals: dict[str, float] = {}
    for epoch in range(position["epoch"], ppo.epochs):
        for round_index, prompt_batch in epoch_batches(
                prompts.train, ppo.rollout_batch_size, seed=seed + epoch,
                skip=position["round"] if epoch == position["epoch"] else 0,
                desc=f"step 3 epoch {epoch + 1}", enabled=cfg.logging.progress and dp.reports):
            try:
                times, ptx_batches, kl_coef = iterate(cfg, models, prompts, prompt_batch,
                                                      sampling, ema, dp, tracker, iteration,
                                                      ptx_batches, kl_coef)
            except NonFiniteError as err:
                raise NonFiniteError(f"step 3 iteration {iteration + 1}: {err}") from None
            iteration += 1
            time_totals = {k: time_totals.get(k, 0.0) + v for k, v in times.items()}
            epoch_done = round_index == rounds
            ckpt.save_if_due(iteration, {
                "epoch": epoch + epoch_done, "round": 0 if epoch_done else round_index,
                "iteration": iteration, "ptx_batches": ptx_batches, "kl_coef": kl_coef,
                "seconds": time.perf_counter() - start, "before": before}, tracker)
    models.actor.eval()
    after = evaluate()
    mean_times = {k: v / max(iteration - position["iteration"], 1) for k, v in time_totals.items()}
    return finish(cfg, models, ema, tracker, before, after, time.perf_counter() - start,
                  iteration, mean_times, ckpt, dp)


def finish(cfg: DictConfig, models: Models, ema: Tensors | None, tracker: Tracker,
           before: dict, after: dict, elapsed: float, iterations: int,
           mean_times: dict[str, float], ckpt: StepCheckpoints, dp: DataParallel) -> dict:
    """Log the summary (scores before and after, wall time, memory peak), export the
    models, drop the checkpoints, and print the step's closing lines."""
    summary = {**{f"eval/{k}_before": v for k, v in before.items()},
               **{f"eval/{k}_after": v for k, v in after.items()},
               "time/seconds": elapsed, "iterations": iterations,
               "memory/peak_mib": memory_peak(dp.device) / 2**20,
               "memory/trained_mib": sum(e.state_bytes() for e in (models.actor, models.critic)
                                         if e is not None) / 2**20}
    tracker.log(summary, iterations)
    tracker.close()
    step3 = export(cfg, models, ema, dp)
    ckpt.clear()
    if mean_times:
        log("step 3 mean iteration: " + _breakdown_line(mean_times))
    line = ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in before if k in after)
    log(f"step 3 ({ALGORITHMS[cfg.ppo.algorithm].name}) done: {iterations} iterations, "
        + (f"{line}, " if line else "") + f"{elapsed:.1f}s, peak memory "
        f"{summary['memory/peak_mib']:.0f} MiB -> {step3}")
    return summary


def iterate(cfg: DictConfig, models: Models, prompts: Prompts, prompt_batch: list[list[int]],
            sampling: SamplingSettings, ema: Tensors | None, dp: DataParallel,
            tracker: Tracker, iteration: int, ptx_batches: int, kl_coef: float
            ) -> tuple[dict, int, float]:
    """One iteration: rollouts for a batch of prompts (`ppo.samples_per_prompt` answers
    each), then updates, then metrics. Returns its time breakdown, the PTX stream's new
    position and the next KL coefficient."""
    t0 = time.perf_counter()
    ppo, group = cfg.ppo, cfg.ppo.samples_per_prompt
    share = dp.share(prompt_batch, group=group)   # a prompt's answers stay on one rank
    batch = to_device(collate_prompts(share.rows, models.tokenizer.pad_token_id), dp.device)
    exp, timing = make_experience(models, batch, sampling, ppo, dp, kl_coef=kl_coef,
                                  seeds=row_seeds(cfg.seed, iteration + 1, share.index),
                                  weight=share.weight, group_size=group)
    t1 = time.perf_counter()
    stats, ptx_batches = update(exp, share, len(prompt_batch) * group, models, ppo, dp,
                                prompts.ptx, ptx_batches, ema, cfg.seed, iteration, kl_coef)
    t2 = time.perf_counter()
    metrics = {**stats, **_rollout_metrics(exp, models.tokenizer.eos_token_id, dp),
               "kl_coef": kl_coef, "train/skipped_steps": models.actor.skipped_steps}
    if models.critic is not None:
        metrics["train/critic_skipped_steps"] = models.critic.skipped_steps
    times = _time_breakdown({**timing, "time/train": t2 - t1}, time.perf_counter() - t0,
                            len(prompt_batch) * group, metrics.pop("answer/tokens"),
                            ppo.ppo_epochs)
    if ppo.kl_target is not None:
        kl_coef = adaptive_kl_coef(kl_coef, metrics["reward/kl"], ppo.kl_target,
                                   ppo.kl_horizon, len(prompt_batch) * group)
    if (iteration + 1) % ppo.log_every == 0:
        lrs = {f"lr/{name}": engine.lr for name, engine in (("actor", models.actor),
                                                            ("critic", models.critic)) if engine}
        tracker.log({**metrics, **lrs, **times}, iteration + 1)
        if not cfg.logging.progress:
            log(f"step 3 iteration {iteration + 1}: " + _breakdown_line(times))
    return times, ptx_batches, kl_coef


def export(cfg: DictConfig, models: Models, ema: Tensors | None, dp: DataParallel) -> Path:
    step3 = Path(cfg.output_dir) / "step3"
    models.actor.export(models.tokenizer, step3 / "actor")
    if models.critic is not None:
        models.critic.export(models.critic_tokenizer, step3 / "critic")
    else:   # an earlier run's critic (overwrite=true) must not pass for this run's
        dp.write_once(lambda: shutil.rmtree(step3 / "critic", ignore_errors=True))
    if ema is not None:
        models.actor.export(models.tokenizer, step3 / "actor_ema", weights=ema)
    return step3


def _time_breakdown(phases: dict[str, float], seconds: float, samples: int, tokens: float,
                    ppo_epochs: int) -> dict[str, float]:
    """One iteration's wall time split as DeepSpeed-Chat's hybrid engine reports it
    (gather, generate, experience, train, other) and its throughput: samples/s end to end,
    generated tokens/s (all ranks' tokens over the generation time), trained tokens/s."""
    other = seconds - sum(phases.values())
    return {**phases, "time/other": other, "time/iteration": seconds,
            "time/samples_per_s": samples / seconds,
            "time/generate_tokens_per_s": tokens / max(phases["time/generate"], 1e-9),
            "time/train_tokens_per_s": tokens * ppo_epochs / max(phases["time/train"], 1e-9)}


def _breakdown_line(times: dict[str, float]) -> str:
    parts = " + ".join(f"{name} {times[f'time/{name}']:.3f}"
                       for name in ("gather", "generate", "experience", "train", "other"))
    return (f"{times['time/iteration']:.3f}s = {parts} | "
            f"{times['time/samples_per_s']:.1f} samples/s, "
            f"{times['time/generate_tokens_per_s']:.0f} generated tokens/s")


def _rollout_metrics(exp: Experience, eos_token_id: int, dp: DataParallel
                     ) -> dict[str, float]:
    """Means over the whole batch's real rows (rows with at least one action)."""
    lengths = exp.action_mask.sum(1)
    real = (lengths > 0).float()
    ended = ended_with_eos(exp.sequences[:, exp.prompt_len:], exp.action_mask, eos_token_id)
    rows, score, kl, reward, tokens, ended, values = dp.sum(
        float(real.sum()), float((exp.scores * real).sum()),
        float((exp.kl * exp.action_mask).sum()), float(exp.rewards.sum()),
        float(lengths.sum()), float(ended.float().sum()),
        float(masked_sum(exp.values, exp.action_mask)))
    rows = max(rows, 1)
    return {"reward/score": score / rows, "reward/kl": kl / rows, "reward/total": reward / rows,
            "answer/length": tokens / rows, "answer/ended_with_eos": ended / rows,
            "value/mean": values / max(tokens, 1), "answer/tokens": tokens}
