"""Step 3, reinforcement learning against a reward (InstructGPT's PPO by default): the
actor samples answers, the reward model and/or a reward function score them, a KL penalty
to the frozen reference keeps the actor close to SFT, an advantage estimator turns rewards
into per-token advantages, and a clipped policy loss updates the actor (and a clipped value
loss the critic, for PPO). Optional: an EMA copy of the actor, a pretraining (PTX) loss on
step-1 data, a penalty for answers cut off without EOS.

What keeps step 3 from ending worse than it started, each on by default:
- every answer is scored as step 2 trained the reward model to read it, at EOS (a cut-off
  answer gets one appended: steps/scoring.py);
- an adaptive KL coefficient holds the KL per answer at `ppo.kl_target`, under the budget;
- `ppo.target_kl` ends a round's updates once the policy moved that far from the sampling one;
- before training, the SFT policy is evaluated with its best-of-n (`ppo.best_of_n`): the
  line to beat; every `ppo.eval_every` iterations the policy is evaluated again (reward,
  gold score, KL to the reference), and `ppo.export=best` writes the best evaluated policy
  within `ppo.kl_budget` instead of the last.

The file reads top-down: the settings (resolved once), the models, `run` and its loop
(`train`, `iterate`), then what an iteration does (rollout, experience, update) and the
evaluations.

`ppo.algorithm` picks the estimator (steps/rlhf.py): `ppo` (critic + GAE), or critic-free
`grpo` (rewards normalised within each prompt's group of `ppo.samples_per_prompt`
answers), `rloo` (leave-one-out baseline within the group), `reinforce_pp` (discounted
returns with a per-token KL penalty, normalised over the batch) and `reinforce_pp_baseline`
(the same, each score less its group's mean first). The loop is the same. `online_dpo`
replaces the estimator and the clipped loss: each group's best and worst answer by the
reward form a pair, trained by DPO's loss against the reference, whose `ppo.dpo_beta` is
then the KL's weight (no penalty in the reward); with `ppo.dpo_loss=kto` each answer above
its group's mean is desirable and each below undesirable, trained by KTO's loss.

All tensors of a rollout are answer-aligned [B, N] (see steps/rlhf.py): column j is answer
token j of `sequences[:, P + j]`; the logits and values that belong to it sit at P+j-1.

With several ranks, each round's prompts are dealt out whole with their groups
(engine/data_parallel.py), every rank generates and scores its own, and every mean (losses,
advantage whitening, metrics) is taken over the whole round, so the run computes what one
process would. Sampling is row-seeded (engine/generation.py): an answer does not depend on
the rank that samples it.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from engine.checkpoint import Tensors
from engine.data_parallel import DataParallel, Share
from engine.errors import NonFiniteError, UserError
from engine.generation import SamplingSettings
from engine.hybrid import GenerationTimes, HybridEngine
from engine.model_source import named
from engine.models import (
    disable_dropout,
    head_reduced,
    is_preset,
    load_tokenizer,
    position_ids,
    prompt_ids,
    require_positions,
    stored_positions,
)
from engine.packing import require_packing
from engine.placement import Placement
from engine.profiling import IterationProfiler
from engine.runtime import Runtime, memory_peak, reset_memory_peak
from engine.tracking import Tracker
from engine.trainer import TrainEngine
from steps.algorithms import ALGORITHMS, Algorithm, model_paths, score_statistics
from steps.common import (
    Draws,
    StepCheckpoints,
    at_most,
    batches,
    check_export_fits,
    epoch_batches,
    in_chat_format,
    log,
    num_batches,
    placement,
    report_overlap,
    report_tokenized,
    require_examples,
    require_trained_format,
    saving_chat_format,
    start_step,
    to_device,
)
from steps.config import PPOConfig
from steps.data import PreferencePair, permutation, train_eval_split
from steps.rlhf import (
    adaptive_kl_coef,
    answer_mask,
    coef_for_kl,
    ema_update,
    feedback_labels,
    gae,
    group_normalized_advantages,
    informative_groups,
    kl_estimate,
    kl_penalized_rewards,
    kto_kl_point,
    labelled_kto_loss,
    leave_one_out_advantages,
    logprobs_of_tokens,
    loss_weights,
    masked_sum,
    overlong_penalty,
    paired_dpo_loss,
    policy_loss,
    preference_pairs,
    returns_to_go,
    rollout_kl_sum,
    sequence_rewards,
    statistic_weights,
    tilted_kl,
    token_entropy,
    token_kl,
    value_loss,
    whiten,
    with_group_baseline,
)
from steps.scoring import (
    RewardEnsemble,
    RewardFunction,
    Rewards,
    RewardScorer,
    decode_rollouts,
)
from steps.sft import batch_loss
from steps.tokenize import SFTExample, collate_prompts, collate_sft, tokenize_prompts, tokenize_sft


class KLSettings(NamedTuple):
    in_loss: bool       # a loss term (GRPO), else a per-token penalty in the reward
    estimator: str      # k1 | k2 | k3 (steps/rlhf.kl_estimate)


def kl_settings(ppo) -> KLSettings:
    """`ppo.kl_penalty` and `ppo.kl_estimator` with "auto" resolved: GRPO's KL is a k3 loss
    term (DeepSeekMath), the others' a k1 penalty in the reward (InstructGPT)."""
    in_loss = ppo.kl_penalty == "loss" or (ppo.kl_penalty == "auto"
                                           and ALGORITHMS[ppo.algorithm].kl_in_loss)
    estimator = ppo.kl_estimator if ppo.kl_estimator != "auto" else "k3" if in_loss else "k1"
    return KLSettings(in_loss, estimator)


def best_of_n_kl(n: int) -> float:
    """KL (nats) of best-of-n sampling to the sampled policy, the usual analytic bound
    log n - (n - 1) / n (Stiennon et al. 2020; exact for distinct answers)."""
    return math.log(n) - (n - 1) / n


KL_TARGET_SHARE = 0.9         # the controller aims this far under the budget: its swing fits
DEFAULT_BEST_OF_N = 8         # whose KL is the default budget when ppo.best_of_n is 0
KL_HORIZON_SHARE = 0.005      # of the run's samples: the controller settles early in any run
KL_START_HORIZONS = 20        # the start's floor holds at most this many horizons (10% of a run)
# coefficients searched for the one whose optimum sits at the KL target (see best_of_n)
KL_COEF_GRID = torch.logspace(-3, 3, 121, dtype=torch.float64)
DEMO_GOLD = "steps.demo:score"
DEFAULT_DPO_BETA = 0.1        # online DPO's, with ppo.dpo_beta null (TRL's and the dpo section's)


class Settings(NamedTuple):
    """Step 3's settings, resolved once from the config: `ppo` is cfg.ppo as a plain object
    (interpolations resolved); the rest is what its "auto" and null values resolve to."""

    ppo: PPOConfig
    seed: int
    algorithm: Algorithm
    kl: KLSettings
    group: int                        # answers per prompt
    sampling: SamplingSettings        # rollouts (and the KL measured in evaluations)
    greedy: SamplingSettings          # evaluation answers
    gold: RewardFunction | None       # the evaluations' gold score
    kl_budget: float                  # export=best's limit
    kl_target: float | None           # the adaptive controller's (None: kl_coef fixed)
    kl_horizon: float
    export_best: bool
    greedy_floor: bool                # export=best: greedy gold at least the SFT model's


def resolve(cfg: DictConfig, total_samples: int = 0, labels: dict[str, Any] | None = None
            ) -> Settings:
    """Settings from the run's config; `total_samples` (answers the run samples) sizes the
    adaptive KL controller's default horizon; `labels` are the prompts' (Prompts.labels)."""
    ppo: PPOConfig = OmegaConf.to_object(cfg.ppo)
    demo = list(cfg.data.path) == ["demo"] and not ppo.prompt_data
    spec = ppo.eval_reward_fn or (DEMO_GOLD if demo else None)
    gold = RewardFunction.named(spec, "ppo.eval_reward_fn", labels) if spec else None
    # best-of-n's KL whether or not the baseline is measured: turning the baseline off
    # must not turn off the KL controller and the budget with it
    budget = ppo.kl_budget or best_of_n_kl(ppo.best_of_n or DEFAULT_BEST_OF_N)
    target = ppo.kl_target if ppo.kl_target is not None else KL_TARGET_SHARE * budget
    # a coefficient of 0: no KL penalty at all; online DPO's KL is its loss's beta's
    target = target if ppo.kl_coef > 0 and not ALGORITHMS[ppo.algorithm].pairs else 0.0
    per_round = ppo.rollout_batch_size * ppo.samples_per_prompt
    horizon = ppo.kl_horizon or max(KL_HORIZON_SHARE * total_samples, per_round)
    sampling = SamplingSettings(ppo.max_new_tokens, ppo.temperature, ppo.top_p, ppo.top_k)
    return Settings(ppo, cfg.seed, ALGORITHMS[ppo.algorithm], kl_settings(ppo),
                    ppo.samples_per_prompt, sampling,
                    SamplingSettings(ppo.max_new_tokens, do_sample=False), gold, budget,
                    target or None, horizon,
                    ppo.export == "best" or (ppo.export == "auto" and gold is not None),
                    ppo.greedy_floor and gold is not None)


def with_evaluations(s: Settings, eval_prompts: int) -> Settings:
    """Export=best ranks evaluations: with no eval prompts there are none, and it would
    export the SFT weights it keeps at the start. Refused when asked for by name; auto
    falls back to the last policy."""
    if not s.export_best or eval_prompts:
        return s
    if s.ppo.export == "best":
        raise UserError("ppo.export=best ranks evaluations, and step 3 has no eval prompts: "
                        "raise ppo.eval_prompts or data.eval_fraction (or data.max_prompt_len"
                        ", if they were all too long), or set ppo.export=last")
    log("step 3 has no eval prompts: it exports the last policy (ppo.export=auto ranks "
        "evaluations where there are some)")
    return s._replace(export_best=False, greedy_floor=False)


# Advantage estimators: (ppo settings, rewards [B, N], scores [B], their penalty [B] or None,
# kl [B, N], values [B, N], actions [B, N], the reward's KL weight, group size, dp)
# -> (advantages, returns) [B, N]
def _gae(ppo, rewards, scores, penalty, kl, values, actions, kl_coef, group_size, dp):
    advantages, returns = gae(rewards, values, actions, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten(advantages, actions, moments=dp.masked_moments(advantages, actions))
    return advantages, returns


def _returns_to_go(ppo, rewards, scores, penalty, kl, values, actions, kl_coef, group_size, dp):
    returns = returns_to_go(rewards, actions, ppo.gamma)
    return whiten(returns, actions, moments=dp.masked_moments(returns, actions)), returns


def _returns_to_go_baseline(ppo, rewards, scores, penalty, kl, values, actions, kl_coef,
                            group_size, dp):
    relative = with_group_baseline(rewards, scores, actions, group_size, ppo.score_clip,
                                   penalty)
    return _returns_to_go(ppo, relative, scores, penalty, kl, values, actions, kl_coef,
                          group_size, dp)


def _per_answer(baseline):
    """A critic-free estimator over each answer's reward (score minus its KL), compared
    within its group by `baseline(per_answer [B], group_size, ppo) -> [B]`."""
    def estimate(ppo, rewards, scores, penalty, kl, values, actions, kl_coef, group_size, dp):
        per_answer = sequence_rewards(scores, kl, actions, kl_coef, ppo.score_clip, penalty)
        advantage = baseline(per_answer, group_size, ppo)
        return advantage[:, None] * actions, per_answer[:, None] * actions
    return estimate


def _preference_pairs(ppo, rewards, scores, penalty, kl, values, actions, kl_coef,
                      group_size, dp):
    """Online DPO's "advantages": each answer's pair label (rlhf.preference_pairs; KTO's:
    rlhf.feedback_labels) on its tokens, by its clipped score less its penalty (no KL: the
    loss holds it)."""
    per_answer = sequence_rewards(scores, kl, actions, 0.0, ppo.score_clip, penalty)
    labels = (feedback_labels if ppo.dpo_loss == "kto" else preference_pairs)(per_answer,
                                                                              group_size)
    return labels[:, None] * actions, per_answer[:, None] * actions


# by ppo.algorithm (what each one is: steps/algorithms.py)
ESTIMATORS = {
    "ppo": _gae,
    "grpo": _per_answer(lambda r, g, ppo: group_normalized_advantages(r, g,
                                                                      ppo.grpo_scale_rewards)),
    "rloo": _per_answer(lambda r, g, ppo: leave_one_out_advantages(r, g)),
    "reinforce_pp": _returns_to_go,
    "reinforce_pp_baseline": _returns_to_go_baseline,
    "online_dpo": _preference_pairs,
}


class Prompts(NamedTuple):
    train: list[list[int]]      # token ids of the rollout prompts
    eval: list[list[int]]       # held-out prompts (before/after evaluation)
    ptx: list[SFTExample]       # step-1 examples for the PTX loss ([] when off)
    labels: dict[str, Any]      # a prompt's label (ppo.prompt_data), by its decoded text


def load_prompts(cfg: DictConfig, tokenizer, pairs: list[PreferencePair],
                 ptx_pairs: list[PreferencePair], held_out: list[PreferencePair] | None = None
                 ) -> Prompts:
    """Step 3's tokenized prompts: `pairs`' (data.eval_fraction of them held out, but where
    `held_out` gives the held-out ones: ppo.eval_prompt_data), with the labels of both."""
    data = cfg.data
    train_pairs, eval_pairs = ((pairs, held_out) if held_out is not None
                               else train_eval_split(pairs, data.eval_fraction, cfg.seed))
    if held_out is not None:
        report_overlap("step 3", "prompts (ppo.eval_prompt_data)", train_pairs, held_out,
                       lambda pair: pair.prompt)
    prompts, stats = tokenize_prompts(train_pairs, tokenizer, data.max_prompt_len)
    report_tokenized("step 3 prompts", stats, data.max_prompt_len)
    require_examples(3, "prompts", stats, data.max_prompt_len)
    prompts = at_most(prompts, data.max_samples, "step 3 prompts", cfg.seed)
    eval_prompts, eval_stats = tokenize_prompts(eval_pairs[:cfg.ppo.eval_prompts], tokenizer,
                                                data.max_prompt_len)
    report_tokenized("step 3 eval prompts", eval_stats, data.max_prompt_len)
    if held_out is not None and cfg.ppo.eval_prompts:
        require_examples(3, "held-out prompts (ppo.eval_prompt_data)", eval_stats,
                         data.max_prompt_len, or_else="drop ppo.eval_prompt_data")
    if len(eval_pairs) > cfg.ppo.eval_prompts:
        log(f"step 3: {len(eval_pairs) - cfg.ppo.eval_prompts} held-out prompts past "
            f"ppo.eval_prompts={cfg.ppo.eval_prompts} are "
            + ("not evaluated (raise ppo.eval_prompts to evaluate on them)"
               if held_out is not None else "neither trained on nor evaluated (raise "
               "ppo.eval_prompts, or lower data.eval_fraction to train on them)"))
    ptx = []
    if cfg.ppo.ptx.enabled:   # step 1's examples, with step 1's targets
        ptx, ptx_stats = tokenize_sft(ptx_pairs, tokenizer, data.max_prompt_len,
                                      data.max_answer_len, cfg.sft.train_on_prompt,
                                      cfg.sft.multiturn, data.apply_chat_template)
        report_tokenized("step 3 PTX", ptx_stats, data.max_prompt_len, data.max_answer_len)
        # ppo.ptx asked for: not trained without it unsaid
        require_examples(3, "PTX examples (step 1's share)", ptx_stats, data.max_prompt_len,
                         or_else="set ppo.ptx.enabled=false")
    return Prompts(prompts, eval_prompts, ptx, prompt_labels(pairs + (held_out or []),
                                                             tokenizer))


def prompt_labels(pairs: list[PreferencePair], tokenizer) -> dict[str, Any]:
    """The labels of the prompts that have one, by the text a reward function gets for the
    prompt (its ids decoded as steps.scoring.decode_rollouts decodes them). Prompts that
    read the same with different labels keep the first, counted in the log."""
    labelled = [pair for pair in pairs if pair.label is not None]
    if not labelled:
        return {}
    ids, _ = prompt_ids([pair.prompt for pair in labelled], tokenizer)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True,
                                   clean_up_tokenization_spaces=False)
    labels: dict[str, Any] = {}
    for text, pair in zip(texts, labelled, strict=True):
        labels.setdefault(text, pair.label)
    clashes = sum(labels[text] != pair.label for text, pair in zip(texts, labelled, strict=True))
    if clashes:
        log(f"step 3 prompts: {clashes} repeat an earlier prompt with another label; the "
            "first prompt's label is used")
    return labels


class Models(NamedTuple):
    """Step 3's models, placed (engine/placement.py)."""

    actor: HybridEngine          # trained; generates through the hybrid engine
    critic: TrainEngine | None   # trained; per-token values (PPO only)
    reference: object            # frozen step-1 actor (the KL anchor): a model, or the
                                 # actor's own base with its adapters disabled
    rewards: Rewards             # the frozen reward model and/or the reward function
    tokenizer: object            # the actor's (and the reference's)
    critic_tokenizer: object


def report_labels(labels: dict[str, Any], functions: list[RewardFunction], label_key: str
                  ) -> None:
    """Say where the prompts' labels and the reward functions do not meet: labels that a
    function taking (prompt, answer) never sees, or that no function is there to see (no
    ppo.reward_fn nor ppo.eval_reward_fn), or a function taking a label that every prompt
    lacks (it gets None)."""
    if labels and not functions:
        log(f"step 3: {len(labels)} prompts have a label, and no ppo.reward_fn or "
            "ppo.eval_reward_fn is set to take it: the labels are not used")
    for fn in functions:
        if labels and not fn.takes_label:
            log(f"step 3: {fn.key}={fn.spec} has no `label` parameter: the prompts' labels are "
                "not passed to it")
        elif fn.takes_label and not labels:
            log(f"step 3: {fn.key}={fn.spec} takes a label, and no step-3 prompt has one "
                f"(ppo.prompt_data records' '{label_key}' field): it gets None")


def reward_scorer(cfg: DictConfig, place: Placement, tokenizer, reward_path: str,
                  ppo: PPOConfig, key: str = "ppo.reward_path") -> RewardScorer:
    """The frozen reward model at `reward_path` (named by `key` in errors), placed, scoring
    the actor's (`tokenizer`'s) rollouts; standardised by its score statistics with
    ppo.normalize_reward."""
    reward_tokenizer = model_tokenizer(cfg, reward_path, key)
    # trained_head: a causal LM here would score with a random head, silently
    reward = place.reward_model(reward_path, reward_tokenizer, trained=False, flag=key,
                                trust_remote_code=cfg.trust_remote_code, trained_head=True)
    _require_context(cfg, reward, f"{key} {reward_path}", scored=True)
    normalize = (score_statistics(reward.config.to_dict(), f"{key} {reward_path}")
                 if ppo.normalize_reward else None)
    if normalize:
        mean, std = normalize
        log(f"step 3: {key} scores standardised: (score {'-' if mean >= 0 else '+'} "
            f"{abs(mean):.4g}) / {std:.4g} (ppo.normalize_reward)")
    return RewardScorer(place.frozen(reward, family="scorer"), tokenizer, reward_tokenizer,
                        place.runtime.device, packed=ppo.packing, normalize=normalize)


def build_models(cfg: DictConfig, place: Placement, tokenizer, actor_path: str,
                 reward_path: str | None, updates: int, labels: dict[str, Any]) -> Models:
    ppo, trc = OmegaConf.to_object(cfg.ppo), cfg.trust_remote_code   # a PPOConfig
    scorer = None
    critic_start = dict(spec=actor_path, flag="ppo.actor_path", seed=cfg.seed)
    critic_tokenizer = tokenizer
    if reward_path is not None:
        scorer = reward_scorer(cfg, place, tokenizer, reward_path, ppo)
        if scorer.same_vocabulary:   # the critic starts from the reward model
            critic_start = dict(spec=reward_path, flag="ppo.reward_path")
            critic_tokenizer = scorer.reward_tokenizer
            if not scorer.reads_actor_ids:
                log("step 3: the reward model's tokenizer ends or starts texts otherwise than "
                    "the actor's (EOS, BOS); rewards are scored on re-tokenized text")
        elif ALGORITHMS[ppo.algorithm].critic:
            log("step 3: reward model and actor tokenizers differ; the critic starts from "
                "the actor with a new value head, and rewards are scored on re-tokenized text")
    if ppo.critic_path is not None:
        critic_start, critic_tokenizer = _critic_start(ppo.critic_path, tokenizer, trc)
    if scorer is not None and ppo.extra_reward_paths:
        scorer = RewardEnsemble([scorer] + [
            reward_scorer(cfg, place, tokenizer, path, ppo, f"ppo.extra_reward_paths[{i}]")
            for i, path in enumerate(ppo.extra_reward_paths)], ppo.reward_ensemble,
            ppo.reward_ensemble_coef)
        log(f"step 3: {len(scorer.scorers)} reward models score every answer, combined by "
            f"their {ppo.reward_ensemble} (ppo.reward_ensemble)")
    rewards = Rewards(tokenizer, scorer, ppo.reward_model_weight,
                      RewardFunction.named(ppo.reward_fn, labels=labels) if ppo.reward_fn
                      else None,
                      ppo.reward_fn_weight)
    critic = None
    if ALGORITHMS[ppo.algorithm].critic:
        critic = place.reward_model(**critic_start, tokenizer=tokenizer, trained=True,
                                    lora=ppo.critic_lora, lora_key="ppo.critic_lora",
                                    trust_remote_code=trc)
        _require_context(cfg, critic, f"{critic_start['flag']} {critic_start['spec']}")
    actor = place.causal_lm(actor_path, tokenizer, trained=True, trust_remote_code=trc,
                            lora=ppo.actor_lora, lora_key="ppo.actor_lora",
                            flag="ppo.actor_path", trained_head=True)
    _require_context(cfg, actor, f"ppo.actor_path {actor_path}", ptx=ppo.ptx.enabled)
    if ppo.disable_dropout:   # else old and new log-probs differ before any update
        disable_dropout(actor)
        if critic is not None:
            disable_dropout(critic)
    # the actor's schedule runs over the updates after ppo.critic_warmup's iterations
    warmup = ppo.critic_warmup * updates_per_round(ppo)
    actor = place.trainer(actor, ppo, max(updates - warmup, 1), family="policy",
                          generates=True, name="actor", lr=ppo.actor_lr,
                          lora_lr=ppo.actor_lora.learning_rate)
    if critic is not None:
        critic = place.trainer(critic, ppo, updates, family="scorer", name="critic",
                               lr=ppo.critic_lr, lora_lr=ppo.critic_lora.learning_rate)
    # the policy the actor started from; LoRA over a frozen base: the actor, adapters off
    reference = place.frozen_start(actor, actor_path, tokenizer, trust_remote_code=trc,
                                   flag="ppo.actor_path", trained_head=True)
    return Models(actor, critic, reference, rewards, tokenizer,
                  critic_tokenizer if critic is not None else None)


def model_tokenizer(cfg: DictConfig, path: str, flag: str):
    """The tokenizer of a step-3 model: its directory's own, or for a preset the run's
    `tokenizer=DIR`, as steps 1 and 2 give it theirs (without it, a preset actor got the
    byte tokenizer and no longer matched a reward model trained with DIR)."""
    return load_tokenizer(path, tokenizer=cfg.tokenizer if is_preset(path) else None,
                          flag=flag, trust_remote_code=cfg.trust_remote_code)


def _require_context(cfg: DictConfig, model, where: str, *, scored: bool = False,
                     ptx: bool = False) -> None:
    """Refuse a step-3 model (`where`: its flag and path) whose learned position embeddings
    cannot read a whole rollout: prompt + answer (+ the EOS a cut-off answer gets, for the
    reward model: `scored`), or a PTX example (`ptx`); with ppo.packing, one whose attention
    would mix packed sequences."""
    prompt, answer = cfg.data.max_prompt_len, cfg.data.max_answer_len
    require_positions(model, *_rollout_length(cfg, scored), where)
    if cfg.ppo.packing:
        require_packing(model, "ppo.packing=true", where)
    if ptx:
        require_positions(model, prompt + answer, f"data.max_prompt_len={prompt} + "
                          f"data.max_answer_len={answer} (PTX examples)", where)


def _rollout_length(cfg: DictConfig, scored: bool) -> tuple[int, str]:
    """The longest rollout a step-3 model reads (+ the EOS a cut-off answer gets, for the
    reward model: `scored`) and the settings that make it."""
    prompt, new = cfg.data.max_prompt_len, cfg.ppo.max_new_tokens
    return prompt + new + scored, (
        f"data.max_prompt_len={prompt} + ppo.max_new_tokens={new} (data.max_answer_len "
        "unless set)" + (" + the EOS the reward model reads" if scored else ""))


def check_rollout_fits(cfg: DictConfig, actor_path: str, reward_path: str | None,
                       made: tuple[int, ...]) -> None:
    """train.py, before step 1: refuse now, from the models' configs alone, a rollout longer
    than the learned position table of the actor or reward model that step 3 will load
    (the outputs of steps 1-2 in `made` have their starting models' shapes), not after
    those steps have trained."""
    out = Path(cfg.output_dir)

    def source(path: str, step: int, name: str, flag: str, key: str) -> tuple[str, str, bool]:
        made_here = step in made and Path(path).expanduser().resolve() == (out / name).resolve()
        scored = step == 2
        return (cfg.actor_model if step == 1 else cfg.reward_model, flag, scored) if made_here \
            else (path, key, scored)

    models = [source(actor_path, 1, "actor", "--actor-model", "ppo.actor_path=")]
    if reward_path is not None:
        models.append(source(reward_path, 2, "reward", "--reward-model", "ppo.reward_path="))
    for spec, flag, scored in models:
        found = stored_positions(spec, trust_remote_code=cfg.trust_remote_code)
        tokens, settings = _rollout_length(cfg, scored)
        if found is not None and tokens > found[0]:
            raise UserError(f"{settings}: step 3 reads up to {tokens} tokens, but {named(flag, spec)} "
                            f"({found[1]}, learned position embeddings) reads at most "
                            f"{found[0]}; lower them to fit")


def check_merged_exports(models: Models, ema: bool, output_dir: Path, adapter: bool) -> None:
    """Refuse, before training, merged exports that cannot be written (check_export_fits):
    the actor's and its EMA's (unless `adapter`: LoRA's weights alone) and the critic's,
    merged always; each is written from its own fp32 host copy, one at a time."""
    host, disk = (0, 0) if adapter else models.actor.merged_size()
    disk *= 2 if ema else 1
    if models.critic is not None:
        critic_host, critic_disk = models.critic.merged_size()
        host, disk = max(host, critic_host), disk + critic_disk
    what = f"ppo.export_weights={'adapter' if adapter else 'merged'}"
    fix = ("start the critic from a smaller model (ppo.critic_path)" if adapter
           else "pass ppo.export_weights=adapter (LoRA's weights alone)")
    check_export_fits(host, disk, output_dir, what, fix, fix)


def _critic_start(path: str, tokenizer, trust_remote_code: bool) -> tuple[dict, object]:
    """The critic's starting model and tokenizer when ppo.critic_path names one: a preset
    built for the actor's tokenizer, or a directory whose tokenizer must be the actor's
    (the critic reads the actor's tokens, one value per token)."""
    start = dict(spec=path, flag="ppo.critic_path")
    if is_preset(path):
        return start, tokenizer
    own = load_tokenizer(path, flag="ppo.critic_path", trust_remote_code=trust_remote_code)
    if own.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"ppo.critic_path={path}: its tokenizer differs from the actor's; "
                        "the critic values the actor's tokens, so give a model with the "
                        "actor's tokenizer (or leave ppo.critic_path unset)")
    return start, own


class Progress(NamedTuple):
    """Where a run stands: what a checkpoint stores to resume it exactly."""

    epoch: int = 0
    round: int = 0               # rounds of this epoch done
    iteration: int = 0
    ptx_batches: int = 0         # position in the PTX stream
    kl_coef: float = 0.0         # the coefficient in use
    kl_integral: float | None = None   # the adaptive controller's integral (None: log kl_coef)
    kl_floor: float | None = None      # its floor until the KL first reaches the target
    seconds: float = 0.0
    kl_stops: int = 0            # rounds cut short by ppo.target_kl
    floored: int = 0             # better evaluations not kept: greedy gold below the SFT's
    before: dict | None = None   # evaluation of the SFT policy, and its best-of-n baseline
    baseline: dict | None = None
    best: dict | None = None     # the best evaluation so far (export=best), with its iteration
    last_eval: dict | None = None   # the latest one, with its iteration


def run(cfg: DictConfig, pairs: list[PreferencePair], ptx_pairs: list[PreferencePair],
        rt: Runtime, resume: bool = False, held_out: list[PreferencePair] | None = None
        ) -> dict:
    """Train the actor on `pairs`' prompts (with ppo.ptx on `ptx_pairs`), evaluating on
    `held_out`'s (ppo.eval_prompt_data's; None: data.eval_fraction of `pairs`)."""
    actor_path, reward_path = model_paths(cfg)  # before start_step touches a previous run's files
    dp, place = DataParallel(rt), placement(cfg, rt)
    tokenizer = model_tokenizer(cfg, actor_path, "ppo.actor_path")
    require_trained_format(cfg, tokenizer, actor_path, "step 3")
    tokenizer = saving_chat_format(cfg, tokenizer)
    out = start_step(cfg, 3, dp, resume=resume)
    owner = f"the step-3 actor {actor_path}"
    prompts = load_prompts(cfg, tokenizer, in_chat_format(cfg, "step 3", pairs, tokenizer, owner),
                           in_chat_format(cfg, "step 3 PTX", ptx_pairs, tokenizer, owner)
                           if cfg.ppo.ptx.enabled else [],
                           None if held_out is None else
                           in_chat_format(cfg, "step 3 held-out", held_out, tokenizer, owner))
    rounds = num_batches(len(prompts.train), cfg.ppo.rollout_batch_size)
    s = with_evaluations(resolve(cfg, cfg.ppo.epochs * len(prompts.train)
                                 * cfg.ppo.samples_per_prompt, prompts.labels), len(prompts.eval))
    check_critic_warmup(s.ppo, s.ppo.epochs * rounds)
    updates = s.ppo.epochs * rounds * updates_per_round(s.ppo)
    reset_memory_peak(dp.device)
    models = build_models(cfg, place, tokenizer, actor_path, reward_path, updates, prompts.labels)
    report_labels(prompts.labels, [fn for fn in (models.rewards.fn, s.gold) if fn is not None],
                  cfg.ppo.label_key)
    check_merged_exports(models, s.ppo.ema.enabled, Path(cfg.output_dir),
                         adapter=s.ppo.export_weights == "adapter")
    # the trained parameters alone (all of them, unless LoRA over a frozen base, whose
    # weights never move: a second copy of a 70B INT4 base would be 37 GB)
    kept = Kept(models.actor.copy_weights(trainable_only=True) if s.ppo.ema.enabled else None,
                models.actor.copy_weights(trainable_only=True) if s.export_best else None)
    engines = {"actor": models.actor, **({"critic": models.critic} if models.critic else {})}
    ckpt = StepCheckpoints(cfg, 3, rt, engines, extra={k: v for k, v in kept._asdict().items()
                                                       if v is not None})
    start_coef = 0.0 if s.algorithm.pairs else s.ppo.kl_coef   # online DPO: beta's, not a penalty
    position, metrics_rows = ckpt.restore(Progress(kl_coef=start_coef)._asdict(), resume)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=3),
                      enabled=dp.reports, keep_rows=metrics_rows,
                      tensorboard=cfg.logging.tensorboard)
    state = Progress(**position)
    if state.before is None:
        state = baseline(models, prompts, s, dp, tracker, state)
    profiler = IterationProfiler(*s.ppo.profile, out / "profile", writes=dp.reports,
                                 device=dp.device) if s.ppo.profile else None
    state, mean_times = train(cfg, s, models, prompts, kept, ckpt, tracker, dp, state, rounds,
                              profiler)
    models.actor.eval()
    after = (state.last_eval or {}).copy()
    if after.pop("iteration", None) != state.iteration:   # else the loop's last evaluation
        after = evaluate_shown(models, prompts, s, dp,    # was of these very weights
                               tracker, state.iteration)
        state = keep_if_best(state, after, s, kept, models.actor)
    averaged = {}
    if kept.ema is not None:   # the EMA's own figures, beside the last policy's
        with models.actor.weights_in(kept.ema):
            averaged = evaluate(models, prompts, s, dp)
    return finish(cfg, s, models, kept, tracker, state, after, averaged, mean_times, ckpt, dp)


def updates_per_round(ppo: PPOConfig) -> int:
    """Optimizer steps planned for a round of ppo.rollout_batch_size prompts: the unit the
    learning-rate schedules are laid out in (see catch_up_schedules)."""
    return ppo.ppo_epochs * num_batches(ppo.rollout_batch_size * ppo.samples_per_prompt,
                                        ppo.micro_batch_size)


def catch_up_schedules(models: Models, steps_before: dict[str, int], rounds: int,
                       actor_trained: bool, ppo: PPOConfig) -> None:
    """Keep the learning-rate schedules on the data's clock: an iteration that drew
    `rounds` prompt batches moves each schedule updates_per_round(ppo) * rounds steps,
    whatever number of updates it made. Fewer are made when ppo.target_kl stops a round,
    a micro-batch has no trained token, the epoch's last batch is short, or dynamic
    sampling spends several batches on one iteration; counted by optimizer steps, the
    schedule would then end the run before it had decayed. `steps_before`: each engine's
    steps before the iteration's updates (fp16's loss-scale searches, which the schedule
    does not count, stay uncounted)."""
    for name, engine in (("actor", models.actor), ("critic", models.critic)):
        if engine is not None and (actor_trained or name == "critic"):
            engine.advance_schedule(updates_per_round(ppo) * rounds
                                    - (engine.steps - steps_before[name]))


def check_critic_warmup(ppo: PPOConfig, iterations: int) -> None:
    """Refuse a ppo.critic_warmup that would freeze the actor for the whole run."""
    if ppo.critic_warmup and ppo.critic_warmup >= iterations:
        raise UserError(f"ppo.critic_warmup={ppo.critic_warmup} freezes the actor for all "
                        f"{iterations} iterations of step 3 (ppo.epochs={ppo.epochs} over "
                        f"the prompts): it would never train; set it below {iterations}")


class Kept(NamedTuple):
    """Weights kept beside the live actor's (copy_weights), None when off."""

    ema: Tensors | None    # ppo.ema
    best: Tensors | None   # the best evaluated policy (export=best)


def train(cfg: DictConfig, s: Settings, models: Models, prompts: Prompts, kept: Kept,
          ckpt: StepCheckpoints, tracker: Tracker, dp: DataParallel, state: Progress,
          rounds: int, profiler: IterationProfiler | None = None
          ) -> tuple[Progress, dict[str, float]]:
    """The loop: for each round of prompts, rollouts -> advantages -> updates -> metrics,
    an evaluation every ppo.eval_every iterations, a checkpoint when due (and `profiler`
    around the iterations it records). Returns the final state and the mean time breakdown
    of the iterations run here."""
    start, first = time.perf_counter() - state.seconds, state.iteration
    time_totals: dict[str, float] = {}
    for epoch in range(state.epoch, s.ppo.epochs):
        draw = Draws(epoch_batches(
            prompts.train, s.ppo.rollout_batch_size, seed=s.seed + epoch,
            skip=state.round if epoch == state.epoch else 0,
            desc=f"step 3 epoch {epoch + 1}", enabled=cfg.logging.progress and dp.reports))
        while (prompt_batch := draw()) is not None:
            number = state.iteration + 1
            try:
                with profiler.iteration(number) if profiler else contextlib.nullcontext():
                    state, times = iterate(s, models, prompts, prompt_batch, kept, dp, tracker,
                                           state, bars=cfg.logging.progress,
                                           more=draw if s.ppo.dynamic_sampling else None)
            except NonFiniteError as err:
                raise NonFiniteError(f"step 3 iteration {number}: {err}") from None
            if profiler and number == profiler.last:
                _profiled(profiler, dp)
            time_totals = {k: time_totals.get(k, 0.0) + v for k, v in times.items()}
            if s.ppo.eval_every and state.iteration % s.ppo.eval_every == 0:
                state = evaluate_during(models, prompts, s, kept, dp, tracker, state)
            epoch_done = draw.number == rounds
            state = state._replace(epoch=epoch + epoch_done,
                                   round=0 if epoch_done else draw.number,
                                   seconds=time.perf_counter() - start)
            ckpt.save_if_due(state.iteration, state._asdict(), tracker)
    if profiler and profiler.close(state.iteration):   # the run ended inside the span
        _profiled(profiler, dp)
    ran = max(state.iteration - first, 1)
    return state, {k: v / ran for k, v in time_totals.items()}


def _profiled(profiler: IterationProfiler, dp: DataParallel) -> None:
    if dp.reports:
        log(f"step 3 profile of iterations {profiler.first}-{profiler.last}: "
            f"{profiler.out / 'ops.txt'}, {profiler.out / 'trace.json'}")


def iterate(s: Settings, models: Models, prompts: Prompts, prompt_batch: list[list[int]],
            kept: Kept, dp: DataParallel, tracker: Tracker, state: Progress, *,
            more: Callable[[], list[list[int]] | None] | None = None,
            bars: bool = False) -> tuple[Progress, dict]:
    """One iteration: rollouts for a batch of prompts (`s.group` answers each; with dynamic
    sampling, `more` draws further batches), then updates, then metrics. Returns the new
    state and the iteration's time breakdown."""
    models.actor.take_times()
    t0, stream = time.perf_counter(), state.iteration + 1
    taken = sample_round(models, prompt_batch, s, dp, stream) if more is None else \
        sample_informative(models, prompt_batch, more, s, dp, stream)
    exp = experience_of(models, taken.sampled, s, dp, kl_coef=state.kl_coef)
    t1 = time.perf_counter()
    timing = sampling_times(models.actor.take_times(), t1 - t0)
    steps_before = {"actor": models.actor.steps,
                    "critic": models.critic.steps if models.critic is not None else 0}
    stats, ptx_batches = update(exp, taken.share, taken.size, models, s, dp, prompts.ptx,
                                state.ptx_batches, kept.ema, state.iteration, state.kl_coef)
    catch_up_schedules(models, steps_before, taken.counts.get("sampling/draws", 1),
                       state.iteration >= s.ppo.critic_warmup, s.ppo)
    t2 = time.perf_counter()
    kl_stops = state.kl_stops + int(stats.pop("stopped"))
    trained_tokens = stats.pop("trained_tokens")
    metrics = {**stats, **_rollout_metrics(exp, models.tokenizer.eos_token_id,
                                           s.kl_target is not None, dp), **taken.counts,
               "kl_coef": state.kl_coef, "train/kl_stops": kl_stops,
               "train/skipped_steps": models.actor.skipped_steps,
               "generation/decode_steps_built": models.actor.decode_steps_built}
    if models.critic is not None:
        metrics["train/critic_skipped_steps"] = models.critic.skipped_steps
    for name, engine in (("", models.actor), ("critic_", models.critic)):
        if engine is not None and engine.loss_scale.enabled:   # fp16
            metrics[f"train/{name}loss_scale"] = engine.loss_scale.value
            metrics[f"train/{name}scale_overflows"] = engine.loss_scale.overflows
    generated = metrics.pop("answer/tokens")   # the answers trained on; with dynamic
    generated = taken.counts.get("sampling/answer_tokens", generated)   # sampling, more
    times = _time_breakdown({**timing, "time/train": t2 - t1}, time.perf_counter() - t0,
                            taken.drawn, generated, trained_tokens)
    iteration = state.iteration + 1
    if iteration % s.ppo.log_every == 0:
        lrs = {f"lr/{name}": engine.applied_lr for name, engine
               in (("actor", models.actor), ("critic", models.critic)) if engine}
        # the running peak, so that a run cut off early still tells its memory
        peak = {"memory/peak_mib": memory_peak(dp.device) / 2**20}
        tracker.log({**metrics, **lrs, **times, **peak}, iteration)
        if not bars:   # else the progress bar shows the pace
            log(f"step 3 iteration {iteration}: " + _breakdown_line(times))
    if not taken.size:   # dynamic sampling found nothing to learn from: no update
        log(f"step 3 iteration {iteration}: the answers to every prompt of "
            f"{taken.counts['sampling/draws']} batches scored the same; nothing trained")
    # nothing trained, or the actor frozen (ppo.critic_warmup): its KL tells the controller
    # nothing about the coefficient
    trained = taken.size > 0 and state.iteration >= s.ppo.critic_warmup
    observed_kl = metrics.get("reward/kl_vocab", 0.0) if trained else math.nan
    state = next_kl_coef(state, observed_kl, taken.size, s)
    return state._replace(iteration=iteration, ptx_batches=ptx_batches, kl_stops=kl_stops), times


def next_kl_coef(state: Progress, observed_kl: float, answers: int, s: Settings) -> Progress:
    """The adaptive KL coefficient after a round of `answers` whose mean KL per answer was
    `observed_kl`. Its floor is ppo.kl_coef, or the coefficient it started at (see
    start_kl_coef) until the KL first reaches the target or KL_START_HORIZONS horizons of
    samples have passed. A reading that is not finite (log-probs of a round whose updates
    the non-finite guard skipped) tells nothing: the coefficient stays."""
    if s.kl_target is None or not math.isfinite(observed_kl):
        return state
    integral = math.log(state.kl_coef) if state.kl_integral is None else state.kl_integral
    coef, integral = adaptive_kl_coef(integral, observed_kl, s.kl_target, s.kl_horizon,
                                      answers, floor=state.kl_floor or s.ppo.kl_coef)
    # a policy that stays under the target at the start's coefficient needs a lower one
    released = (observed_kl >= s.kl_target
                or (state.iteration + 1) * answers >= KL_START_HORIZONS * s.kl_horizon)
    return state._replace(kl_coef=coef, kl_integral=integral,
                          kl_floor=None if released else state.kl_floor)


class Experience(NamedTuple):
    """One round of rollouts. B rows; P prompt columns (left-padded), N answer columns."""

    sequences: torch.Tensor       # [B, P+N] prompt + answer token ids
    attention_mask: torch.Tensor  # [B, P+N] 1 on real prompt tokens and on actions
    action_mask: torch.Tensor     # [B, N] 1 on answer tokens up to and including EOS
    logprobs: torch.Tensor        # [B, N] actor log-probs when sampled
    ref_logprobs: torch.Tensor    # [B, N] reference log-probs
    values: torch.Tensor          # [B, N] critic values (0 without a critic)
    rewards: torch.Tensor         # [B, N] KL penalty + clipped score on the last action
    advantages: torch.Tensor      # [B, N] (online DPO: each answer's pair label, 1 chosen,
                                  # -1 rejected, 0 neither, on its actions)
    returns: torch.Tensor         # [B, N] the critic's targets
    scores: torch.Tensor          # [B] score of each answer (reward model and/or function)
    kl: torch.Tensor              # [B, N] per-token KL estimate actor/reference
    vocab_kl: torch.Tensor        # [B, N] KL over the vocabulary at each answer token (the
                                  # KL controller's reading; zeros when it is off)
    entropy: torch.Tensor         # [B, N] the sampling policy's entropy at each answer token
    loss_mask: torch.Tensor       # [B, N] the actions the losses weigh: action_mask, less
                                  # cut-off answers' under ppo.mask_truncated

    @property
    def prompt_len(self) -> int:
        return self.sequences.shape[1] - self.action_mask.shape[1]

    def rows(self, index: torch.Tensor) -> Experience:
        return Experience(*(field[index] for field in self))

    def without_actions(self) -> Experience:
        """The same rows contributing nothing (a stand-in on a rank with no rows)."""
        return self._replace(action_mask=torch.zeros_like(self.action_mask),
                             loss_mask=torch.zeros_like(self.loss_mask))


def row_seeds(seed: int, stream: int, rows: list[int]) -> torch.Tensor:
    """[B] sampling seeds of global rows `rows` of a round (`stream` 0 = evaluation,
    i + 1 = rollouts of iteration i)."""
    return (torch.tensor(rows, dtype=torch.long) + (stream << 20)) + ((seed % (1 << 23)) << 40)


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


class Sampled(NamedTuple):
    """A round's answers on this process and their scores: what `experience_of`'s forwards
    turn into experience."""

    answers: Rollout
    scores: torch.Tensor           # [B] each answer's score (reward model and/or function)
    penalty: torch.Tensor | None   # [B] what ppo.missing_eos_penalty and ppo.overlong_buffer
                                   # take from it after ppo.score_clip (None: both off)
    weight: float                  # 1.0, or 0.0 for a stand-in (DataParallel.share)

    def rows(self, index: torch.Tensor) -> Sampled:
        return Sampled(Rollout(*(field[index] for field in self.answers)), self.scores[index],
                       None if self.penalty is None else self.penalty[index], self.weight)


@torch.no_grad()
def sample(models: Models, prompts: dict[str, torch.Tensor], s: Settings, dp: DataParallel,
           *, seeds: torch.Tensor | None = None, weight: float = 1.0) -> Sampled:
    """Answers to left-padded prompts (row `seeds`, see row_seeds), rows in groups of
    `s.group` copies of a prompt, scored, with the penalties the settings ask for. The
    prompts are this process's share of the round, of `weight` (0: a stand-in's)."""
    answers = rollout(models, prompts, s.sampling, seeds, s.group)
    scores, penalty = _scores(models, answers, s, dp), None
    # penalties are taken after score_clip, which cannot hide them
    if s.ppo.missing_eos_penalty is not None:
        cut_off = ~ended_with_eos(answers.sequences[:, answers.prompt_len:], answers.answered,
                                  models.tokenizer.eos_token_id)
        penalty = s.ppo.missing_eos_penalty * cut_off.float()
    if s.ppo.overlong_buffer is not None:
        overlong = overlong_penalty(answers.answered.sum(-1), s.ppo.max_new_tokens,
                                    s.ppo.overlong_buffer, s.ppo.overlong_penalty)
        penalty = overlong if penalty is None else penalty + overlong
    return Sampled(answers, scores, penalty, weight)


@torch.no_grad()
def experience_of(models: Models, sampled: Sampled, s: Settings, dp: DataParallel, *,
                  kl_coef: float) -> Experience:
    """Everything the update needs from scored answers: the actor's and the reference's
    log-probs (and the critic's values), the KL-penalised rewards, and the advantages.
    Batch statistics (whitening) use the whole round's rows, all processes'."""
    actor, critic = models.actor, models.critic
    (sequences, attention_mask, answered), prompt_len = sampled.answers, sampled.answers.prompt_len
    actions = answered * sampled.weight

    def by_rows(fn) -> torch.Tensor:   # fn(sequences, attention_mask) over row chunks
        return dp.by_row_chunks(lambda rows: fn(sequences[rows], attention_mask[rows]),
                                len(sequences), s.ppo.forward_batch_size)

    actor.eval()
    logprobs, ref_logprobs, vocab_kl, entropy = by_rows(
        lambda seq, mask: _policy_and_reference(models, seq, mask, prompt_len, s)).unbind(1)
    actor.train()
    values = torch.zeros_like(logprobs)
    if critic is not None:
        critic.eval()
        values = by_rows(lambda seq, mask: answer_values(critic, seq, mask, prompt_len,
                                                         s.ppo.packing))
        values = values * actions
        critic.train()
    scores, penalty = sampled.scores, sampled.penalty
    reward_kl_coef = 0.0 if s.kl.in_loss or s.algorithm.pairs else kl_coef
    rewards, kl = kl_penalized_rewards(scores, logprobs, ref_logprobs, actions, reward_kl_coef,
                                       s.ppo.score_clip, s.kl.estimator, penalty)
    advantages, returns = ESTIMATORS[s.ppo.algorithm](
        s.ppo, rewards, scores, penalty, kl, values, actions, reward_kl_coef, s.group, dp)
    trained = actions
    if s.ppo.mask_truncated:   # in their group's statistics above, out of the losses
        trained = actions * ended_with_eos(sequences[:, prompt_len:], answered,
                                           models.tokenizer.eos_token_id)[:, None]
    return Experience(sequences, attention_mask, actions, logprobs, ref_logprobs, values,
                      rewards, advantages, returns, _logged_scores(sampled), kl, vocab_kl,
                      entropy, trained)


def make_experience(models: Models, prompts: dict[str, torch.Tensor], s: Settings,
                    dp: DataParallel, *, kl_coef: float, seeds: torch.Tensor | None = None,
                    weight: float = 1.0) -> tuple[Experience, dict[str, float]]:
    """`sample` then `experience_of`: one round's experience from its prompts. Returns it
    and the seconds spent (`sampling_times`)."""
    models.actor.take_times()
    start = time.perf_counter()
    sampled = sample(models, prompts, s, dp, seeds=seeds, weight=weight)
    experience = experience_of(models, sampled, s, dp, kl_coef=kl_coef)
    return experience, sampling_times(models.actor.take_times(), time.perf_counter() - start)


def sampling_times(generation: GenerationTimes, seconds: float) -> dict[str, float]:
    """The phases of `seconds` spent making a round's experience: gathering the actor for
    generation, generating (of which, with the inference decoder, its prefills and decode
    steps, and ms per decode step), and the rest (scoring, the forwards)."""
    times = {"time/gather": generation.gather, "time/generate": generation.generate,
             "time/experience": seconds - generation.gather - generation.generate}
    if generation.decode_steps:   # the inference decoder's split of the generate phase
        times.update({"time/prefill": generation.prefill, "time/decode": generation.decode,
                      "time/decode_step_ms":
                          generation.decode / generation.decode_steps * 1e3})
    return times


class Round(NamedTuple):
    """What an iteration sampled and trains on, on this process."""

    sampled: Sampled
    share: Share            # where its rows sit in the batch trained on
    size: int               # that batch's answers, all processes'
    drawn: int              # answers sampled for it, all processes' (dynamic sampling's too)
    counts: dict[str, float]   # dynamic sampling's (sampling/*); empty without it


def sample_round(models: Models, prompt_batch: list[list[int]], s: Settings, dp: DataParallel,
                 stream: int, first_row: int = 0) -> Round:
    """This process's share of a batch of prompts, sampled and scored; row seeds from global
    row `first_row` on (row_seeds: a later draw of the same iteration gets fresh ones)."""
    share = dp.share(prompt_batch, group=s.group)   # a prompt's answers stay on one rank
    batch = to_device(collate_prompts(share.rows, models.tokenizer.pad_token_id), dp.device)
    seeds = row_seeds(s.seed, stream, [first_row + i for i in share.index])
    size = len(prompt_batch) * s.group
    return Round(sample(models, batch, s, dp, seeds=seeds, weight=share.weight), share, size,
                 size, {})


def sample_informative(models: Models, prompt_batch: list[list[int]],
                       more: Callable[[], list[list[int]] | None], s: Settings,
                       dp: DataParallel, stream: int) -> Round:
    """DAPO's dynamic sampling (Yu et al., 2025): batches of prompts (`prompt_batch`, then
    `more()`'s, None at the epoch's end) are sampled until ppo.rollout_batch_size prompts
    have answers that do not all score the same (rlhf.informative_groups), for at most
    ppo.dynamic_sampling_max_draws batches. The first that many such prompts in the order
    sampled are the batch trained on, the same on any number of processes; the others are
    dropped and counted (sampling/*). The kept prompts are dealt to the processes as a
    batch of that many is (DataParallel.redeal); a process left without one holds a
    stand-in."""
    group, parts, flags = s.group, [], []
    with models.actor.held_weights():   # one gather for all the draws
        while prompt_batch is not None:
            part = sample_round(models, prompt_batch, s, dp, stream,
                                first_row=sum(p.size for p in parts))
            differ = informative_groups(part.sampled.scores, group, s.ppo.score_clip,
                                        part.sampled.penalty)
            flags.append(dp.batch_flags(part.share, differ, len(prompt_batch), group).cpu())
            parts.append(part)
            if int(torch.cat(flags).sum()) >= s.ppo.rollout_batch_size \
                    or len(parts) == s.ppo.dynamic_sampling_max_draws:
                break
            prompt_batch = more()
    places = kept_places(flags, s.ppo.rollout_batch_size)
    kept, kept_groups = [], []
    for part, place in zip(parts, places, strict=True):
        mine = place[torch.tensor(part.share.index[::group]) // group] if part.share.weight \
            else torch.tensor([-1])   # a stand-in's row belongs to another process
        keep = mine >= 0
        kept.append(part.sampled.rows(keep.repeat_interleave(group).nonzero().flatten()))
        kept_groups.append(mine[keep])
    size, drawn = sum(int((p >= 0).sum()) for p in places) * group, sum(p.size for p in parts)
    counts = _sampling_counts(parts, flags, size // group, dp)
    # the kept groups sit where they were sampled, unevenly: deal them again as a batch
    local = concat_sampled(kept, models.tokenizer.pad_token_id,
                           dp.most(max(p.sampled.answers.prompt_len for p in parts)),
                           dp.most(max(p.sampled.answers.answered.shape[1] for p in parts)))
    penalty = [] if local.penalty is None else [local.penalty]
    fields, places = dp.redeal([*local.answers, local.scores, *penalty],
                               torch.cat(kept_groups), group)
    if not len(places):   # a stand-in group of weight 0: every process runs the same passes
        return Round(parts[0].sampled.rows(torch.arange(group))._replace(weight=0.0),
                     Share([], [0], 0.0), size, drawn, counts)
    positions = places[:, None] * group + torch.arange(group, device=places.device)
    dealt = Sampled(Rollout(*fields[:3]), fields[3], fields[4] if penalty else None, 1.0)
    return Round(dealt, Share([], positions.flatten().tolist(), 1.0), size, drawn, counts)


def kept_places(flags: list[torch.Tensor], target: int) -> list[torch.Tensor]:
    """Dynamic sampling's choice: for each batch's prompts ([prompts] bool, informative),
    its place among the first `target` informative prompts in the order sampled, -1 where
    it is not kept. Returns [prompts] long tensors, one per batch."""
    informative = torch.cat(flags)
    place = informative.long().cumsum(0) - 1
    place = torch.where(informative & (place < target), place, -1)
    return list(place.split([len(f) for f in flags]))


def _sampling_counts(parts: list[Round], flags: list[torch.Tensor], kept: int,
                     dp: DataParallel) -> dict[str, float]:
    """Dynamic sampling's metrics: the batches drawn, the prompts kept, those dropped
    because their answers all scored the same ("uniform") or as past the target
    ("surplus"), the mean score over every answer sampled (reward/score's, without
    dynamic sampling: reward/score is then over the answers kept), and the answer tokens
    generated (the throughput's)."""
    informative = sum(int(f.sum()) for f in flags)
    score, answers, tokens = dp.sum(*(
        sum(float(_logged_scores(p.sampled).sum()) * p.share.weight for p in parts),
        sum(len(p.sampled.scores) * p.share.weight for p in parts),
        sum(float(p.sampled.answers.answered.sum()) * p.share.weight for p in parts)))
    return {"sampling/draws": len(parts), "sampling/prompts_kept": kept,
            "sampling/prompts_uniform": sum(len(f) for f in flags) - informative,
            "sampling/prompts_surplus": informative - kept,
            "sampling/score": score / max(answers, 1.0), "sampling/answer_tokens": tokens}


def _logged_scores(sampled: Sampled) -> torch.Tensor:
    """[B] the scores the metrics report: with their penalties."""
    if sampled.penalty is None:
        return sampled.scores
    return sampled.scores - sampled.penalty.to(sampled.scores.dtype)


def concat_sampled(parts: list[Sampled], pad_token_id: int, prompt_len: int = 0,
                   answer_len: int = 0) -> Sampled:
    """Several rounds' real rows as one (of weight 1): prompts left-padded and answers
    right-padded to the longest, or to `prompt_len` and `answer_len` where longer (the
    masks' zeros cover the padding, and positions come from the masks)."""
    prompt_len = max(prompt_len, *(part.answers.prompt_len for part in parts))
    answer_len = max(answer_len, *(part.answers.answered.shape[1] for part in parts))

    def padded(answers: Rollout) -> Rollout:
        left, right = prompt_len - answers.prompt_len, answer_len - answers.answered.shape[1]
        return Rollout(F.pad(answers.sequences, (left, right), value=pad_token_id),
                       F.pad(answers.attention_mask, (left, right)),
                       F.pad(answers.answered, (0, right)))

    rollouts = [padded(part.answers) for part in parts]
    penalty = None if parts[0].penalty is None else torch.cat([p.penalty for p in parts])
    return Sampled(Rollout(*(torch.cat(fields) for fields in zip(*rollouts, strict=True))),
                   torch.cat([part.scores for part in parts]), penalty, 1.0)


def _policy_and_reference(models: Models, sequences: torch.Tensor, mask: torch.Tensor,
                          prompt_len: int, s: Settings) -> torch.Tensor:
    """[B, 4, N]: each answer token's log-prob under the actor and under the reference;
    with the KL controller on, the KL between their next-token distributions over the
    vocabulary (steps.rlhf.token_kl; else zeros); and the actor's entropy there
    (rlhf.token_entropy, logged as policy/entropy). The controller reads the KL: the
    sampled log-ratio of 32-64 answers has three times its spread, noise the controller
    would answer as if the policy had moved. Without it, neither model's logits for the
    whole batch are made (answer_logprobs)."""
    temperature, packed = s.sampling.temperature, s.ppo.packing
    if s.kl_target is None:
        logprobs, entropy = answer_logprobs_and_entropy(models.actor, sequences, mask,
                                                        prompt_len, temperature, packed=packed)
        ref_logprobs = answer_logprobs(models.reference, sequences, mask, prompt_len,
                                       temperature, packed=packed)
        return torch.stack([logprobs, ref_logprobs, torch.zeros_like(logprobs), entropy], 1)
    answers = F.pad(sequences[:, prompt_len:], (0, 1))
    logits = answer_head(models.actor, sequences, mask, prompt_len, packed)
    logprobs = logprobs_of_tokens(logits, answers, temperature)[:, :-1]
    ref_logits = answer_head(models.reference, sequences, mask, prompt_len, packed)
    ref_logprobs = logprobs_of_tokens(ref_logits, answers, temperature)[:, :-1]
    vocab_kl = token_kl(logits[:, :-1], ref_logits[:, :-1], temperature)
    entropy = token_entropy(logits[:, :-1], temperature)
    return torch.stack([logprobs, ref_logprobs, vocab_kl, entropy], 1)


def update(exp: Experience, share: Share, batch_size: int, models: Models, s: Settings,
           dp: DataParallel, ptx: list[SFTExample], ptx_batches: int, ema: Tensors | None,
           iteration: int, kl_coef: float) -> tuple[dict[str, float], int]:
    """`ppo.ppo_epochs` passes over one round's experience (this process's `share` of its
    `batch_size` answers) in micro-batches, each one optimizer step of the actor and critic
    (and a PTX batch, an EMA update), until the policy has moved `ppo.target_kl` from the
    one that sampled the round. Returns the statistics' means over the updates ("stopped":
    1.0 when target_kl cut the round short; "trained_tokens": the answer tokens of the
    updates made, all ranks') and the PTX stream's new position."""
    sums: dict[str, float] = {}
    norm_sums: dict[str, float] = {}
    updates, stopped, tokens = 0, False, 0.0
    actor_trains = iteration >= s.ppo.critic_warmup   # else the critic alone learns
    kl_point = _kl_point(exp, share, dp) if s.ppo.dpo_loss == "kto" else 0.0
    for ppo_epoch in range(s.ppo.ppo_epochs):
        order = micro_batch_order(batch_size, s.group if s.algorithm.pairs else 1,
                                  s.seed + iteration * 131 + ppo_epoch)
        for micro in order.split(s.ppo.micro_batch_size) if batch_size else ():
            index, weight = dp.pick(share, micro)
            rows = exp.rows(index) if weight else exp.rows(index).without_actions()
            weights, local_count = loss_weights(rows.loss_mask, s.ppo.loss_aggregation,
                                                s.ppo.max_new_tokens)
            weights = (weights, statistic_weights(rows.loss_mask, s.ppo.loss_aggregation))
            count = dp.sum(float(local_count))[0]
            pairs = dp.sum(float(_pairs_in(rows, s)))[0] if s.algorithm.pairs else None
            # every answer masked (ppo.mask_truncated), or no pair (online DPO: every group
            # tied; KTO: no answer labelled): nothing to learn, and Adam would still move
            if not count or pairs == 0:
                continue
            ptx_batch = None
            if ptx and actor_trains:
                ptx_batch = ptx_rows(ptx, ptx_batches, s.ppo.ptx.batch_size, s.seed,
                                     models.tokenizer.pad_token_id, dp)
            trained = train_on(rows, models, s, kl_coef, weights, count, ptx_batch, dp,
                               train_actor=actor_trains, pairs=pairs, kl_point=kl_point)
            if trained is None:   # target_kl: nothing trained, the PTX batch waits
                stopped = True
                break
            ptx_batches += 1 if ptx_batch is not None else 0
            for totals, values in zip((sums, norm_sums), trained, strict=True):
                for name, value in values.items():
                    totals[name] = totals.get(name, 0.0) + value
            updates += 1
            tokens = tokens + rows.loss_mask.sum()   # a tensor: read once, at the end
            if ema is not None and actor_trains:
                ema_update(ema.tensors.values(), models.actor.trained_parameters(),
                           s.ppo.ema.beta)
        if stopped:
            break
    *summed, tokens = dp.sum(*sums.values(), float(tokens))
    totals = dict(zip(sums, summed, strict=True))
    means = {name: total / max(updates, 1) for name, total in {**totals, **norm_sums}.items()}
    if s.ppo.dpo_loss == "kto":
        means["train/kl_point"] = kl_point
    return {**means, "train/updates": updates, "stopped": float(stopped),
            "trained_tokens": tokens}, ptx_batches


def micro_batch_order(batch_size: int, group: int, seed: int) -> torch.Tensor:
    """[batch_size] a seeded order of a round's rows for its micro-batches: of whole groups
    of `group` consecutive rows (each kept in its order), so that a micro-batch of a
    multiple of `group` rows holds a prompt's answers together (online DPO's pairs)."""
    groups = torch.tensor(permutation(batch_size // group, seed))
    return (groups[:, None] * group + torch.arange(group)).flatten()


def _pairs_in(rows: Experience, s: Settings) -> int:
    """Online DPO: the pairs these rows hold (their chosen answers; KTO: their labelled
    answers; a stand-in's: none)."""
    label = rows.advantages.sum(1)
    units = label != 0 if s.ppo.dpo_loss == "kto" else label > 0
    return int((units & (rows.loss_mask != 0).any(1)).sum())


def _kl_point(exp: Experience, share: Share, dp: DataParallel) -> float:
    """Online KTO's z0 for a round: the sampling policy's KL to the reference over the
    round's answers on all processes (rlhf.rollout_kl_sum), the same for its updates."""
    kl_sum, count = rollout_kl_sum(exp.logprobs, exp.ref_logprobs, exp.action_mask)
    return kto_kl_point(*dp.sum(kl_sum * share.weight, count * share.weight))


def train_on(experience: Experience, models: Models, s: Settings, kl_coef: float,
             weights: tuple[torch.Tensor, torch.Tensor], count: float, ptx: PtxRows | None,
             dp: DataParallel, *, train_actor: bool = True, pairs: float | None = None,
             kl_point: float = 0.0) -> tuple[dict[str, float], dict[str, float]] | None:
    """One optimisation step of the actor (unless not `train_actor`: ppo.critic_warmup) and
    critic on this process's rows of a micro-batch, in forwards of `ppo.forward_batch_size`
    rows whose gradients add up.
    `weights` ([B, N] loss and statistics weights), `count`: the micro-batch's divisor over
    all processes (loss_weights), so the parts' losses and statistics sum to its own.
    Online DPO: its loss on the micro-batch's `pairs` (all processes'; the forward chunks
    hold whole groups) instead of the clipped one; KTO's on as many labelled answers, about
    the round's `kl_point`.
    Returns this process's shares of the statistics (their sums over processes are the
    micro-batch's), and the gradient norms (the whole micro-batch's already: NaN or inf
    where the update was skipped); None, with nothing updated, when the policy is already
    `ppo.target_kl` from the sampling one."""
    exp, actor = experience, models.actor
    chunks = dp.row_chunks(len(exp.sequences), s.ppo.forward_batch_size)

    def add(name: str, value) -> None:
        stats[name] = stats.get(name, 0.0) + (value.item() if torch.is_tensor(value) else value)

    (action_weights, stat_weights), stats = weights, {}
    for i, (rows, real) in enumerate(chunks if train_actor else []):
        last, part_weights = i == len(chunks) - 1, action_weights[rows] * real
        logprobs, entropy = _policy_logprobs(actor, exp, rows, s)
        actor_out = _actor_loss(logprobs, exp, rows, real, weights, count, pairs, s, kl_point)
        for name, value in actor_out._asdict().items():
            add(f"train/{name}", value)
        # the whole micro-batch's KL from the sampling policy is known at its last part:
        # past the bound, the parts already backpropagated are dropped and nothing moves
        if last and s.ppo.target_kl is not None and \
                dp.sum(stats["train/approx_kl"])[0] > s.ppo.target_kl:
            actor.discard()
            return None
        loss = actor_out.policy_loss
        if s.kl.in_loss:
            kl_loss = masked_sum(kl_estimate(logprobs, exp.ref_logprobs[rows],
                                             exp.action_mask[rows], s.kl.estimator),
                                 part_weights) / max(count, 1.0)
            loss = loss + kl_coef * kl_loss
            add("train/kl_loss", kl_loss)
        if entropy is not None:   # the bonus, over the loss's tokens as the policy loss is
            loss = loss - s.ppo.entropy_coef * masked_sum(entropy, part_weights) / max(count, 1.0)
            add("train/entropy", masked_sum(entropy.detach(), stat_weights[rows] * real)
                / max(count, 1.0))
        if ptx is not None and last:
            ptx_loss = batch_loss(actor, ptx.batch, ptx.examples)[0] * ptx.weight
            loss = loss + s.ppo.ptx.coef * ptx_loss
            add("train/ptx_loss", ptx_loss)
        actor.backward(loss)   # the parts' gradients add up: one step below
    norms = {"train/grad_norm": actor.step()} if train_actor else {}
    if models.critic is not None:
        norms["train/critic_grad_norm"] = _critic_step(models.critic, exp, chunks, weights,
                                                       count, s, add)
    return stats, norms


class PairLossOut(NamedTuple):   # the field names are the logged statistics' (train/...)
    policy_loss: torch.Tensor    # scalar, differentiable: these rows' share of the DPO loss
    approx_kl: torch.Tensor      # their share of the k3 KL per token from the sampling policy
    pair_accuracy: torch.Tensor  # their share of the pairs ranked right
    pair_margin: torch.Tensor    # their share of the mean implicit-reward margin


class ClippedLossOut(NamedTuple):   # rlhf.PolicyLossOut under the logged names
    policy_loss: torch.Tensor
    clip_fraction: torch.Tensor
    approx_kl: torch.Tensor
    ratio: torch.Tensor


def _actor_loss(logprobs: torch.Tensor, exp: Experience, rows: slice, real: bool,
                weights: tuple[torch.Tensor, torch.Tensor], count: float,
                pairs: float | None, s: Settings, kl_point: float = 0.0
                ) -> PairLossOut | ClippedLossOut:
    """train_on's actor loss on rows `rows` of a micro-batch (`real`: not a stand-in's):
    the clipped policy loss, or online DPO's on the micro-batch's `pairs` (KTO: labelled
    answers, about `kl_point`); its first field is the loss, the rest statistics."""
    action_weights, stat_weights = weights
    if s.algorithm.pairs:
        return _pair_loss(logprobs, exp, rows, real, stat_weights, count, pairs, s, kl_point)
    return ClippedLossOut(*policy_loss(
        logprobs, exp.logprobs[rows], exp.advantages[rows], action_weights[rows] * real,
        s.ppo.clip_range, count, s.ppo.clip_range_high, s.ppo.dual_clip,
        stat_weights[rows] * real, sequence_ratio=s.ppo.importance_ratio == "sequence"))


def _pair_loss(logprobs: torch.Tensor, exp: Experience, rows: slice, real: bool,
               stat_weights: torch.Tensor, count: float, pairs: float, s: Settings,
               kl_point: float) -> PairLossOut:
    """train_on's online-DPO loss on rows `rows` (whole groups) of a micro-batch of `pairs`
    pairs and `count` loss tokens (all processes'): rlhf.paired_dpo_loss with the
    experience's reference log-probs (at the sampling temperature, as the policy's); KTO:
    rlhf.labelled_kto_loss on `pairs` labelled answers about z0 = `kl_point`."""
    mask = exp.loss_mask[rows] * real
    labels = torch.sign(exp.advantages[rows].sum(1))
    beta = s.ppo.dpo_beta or DEFAULT_DPO_BETA
    if s.ppo.dpo_loss == "kto":
        out = labelled_kto_loss(logprobs, exp.ref_logprobs[rows], labels, mask, kl_point, beta,
                                num_answers=pairs)
    else:
        out = paired_dpo_loss(logprobs, exp.ref_logprobs[rows], labels, mask, s.group, beta,
                              s.ppo.dpo_loss or "sigmoid", num_pairs=pairs)
    with torch.no_grad():   # what target_kl reads, as policy_loss's approx_kl: KL(old || new)
        approx_kl = masked_sum(kl_estimate(exp.logprobs[rows], logprobs, mask, "k3"),
                               stat_weights[rows] * real) / max(count, 1.0)
    return PairLossOut(out.loss, approx_kl, out.accuracy, out.margin)


def _policy_logprobs(actor: TrainEngine, exp: Experience, rows: slice, s: Settings
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, N] the actor's log-probs of rows `rows`' answers, with gradients, and with
    ppo.entropy_coef their entropies (differentiable; else None)."""
    args = (actor, exp.sequences[rows], exp.attention_mask[rows], exp.prompt_len,
            s.sampling.temperature)
    if s.ppo.entropy_coef:
        return answer_logprobs_and_entropy(*args, entropy_grad=True, packed=s.ppo.packing)
    return answer_logprobs(*args, packed=s.ppo.packing), None


def _critic_step(critic: TrainEngine, exp: Experience, chunks: list[tuple[slice, bool]],
                 weights: tuple[torch.Tensor, torch.Tensor], count: float, s: Settings,
                 add: Callable[[str, Any], None]) -> float:
    """train_on's optimisation step of the critic, over the same row chunks; returns its
    gradient norm."""
    action_weights, stat_weights = weights
    for rows, real in chunks:
        values = answer_values(critic, exp.sequences[rows], exp.attention_mask[rows],
                               exp.prompt_len, s.ppo.packing)
        critic_out = value_loss(values, exp.values[rows], exp.returns[rows],
                                action_weights[rows] * real, s.ppo.value_clip_range, count,
                                stat_weights[rows] * real)
        critic.backward(critic_out.loss)
        add("train/value_loss", critic_out.loss)
        add("train/value_clip_fraction", critic_out.clip_fraction)
    return critic.step()


def answer_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_len: int, temperature: float = 1.0, *, packed: bool = False
                    ) -> torch.Tensor:
    """[B, N] fp32 log-probability of each answer token under `model` (a causal LM, its
    TrainEngine, or a LoRA model's BaseWithoutAdapters) at the sampling `temperature`: the
    distribution the answers were drawn from, log_softmax(logits / T). The head runs on a
    few rows at a time and on the answer's positions only: neither the whole batch's logits
    nor their gradient is ever made. `packed` (ppo.packing): the rows run without their
    padding, packed into fewer (engine.packing.unpadded)."""
    answers = F.pad(sequences[:, prompt_len:], (0, 1))

    def taken(logits: torch.Tensor, rows: slice) -> torch.Tensor:
        return logprobs_of_tokens(logits, answers[rows], temperature)

    return _answer_reduced(model, sequences, attention_mask, answers.shape[1], taken,
                           packed)[:, :-1]


def answer_logprobs_and_entropy(model, sequences: torch.Tensor, attention_mask: torch.Tensor,
                                prompt_len: int, temperature: float = 1.0, *,
                                entropy_grad: bool = False, packed: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """answer_logprobs, and [B, N] fp32 the entropy of the distribution each answer token
    was drawn from (rlhf.token_entropy), from the same chunks of the head's logits.
    `entropy_grad`: the entropy is differentiable (ppo.entropy_coef's bonus), else it is
    taken without a gradient (logged only)."""
    answers = F.pad(sequences[:, prompt_len:], (0, 1))

    def both(logits: torch.Tensor, rows: slice) -> torch.Tensor:
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = token_entropy(logits, temperature)
        return torch.stack([logprobs_of_tokens(logits, answers[rows], temperature), entropy], -1)

    reduced = _answer_reduced(model, sequences, attention_mask, answers.shape[1], both,
                              packed)[:, :-1]
    return reduced[..., 0], reduced[..., 1] if entropy_grad else reduced[..., 1].detach()


def _answer_reduced(model, sequences: torch.Tensor, attention_mask: torch.Tensor, keep: int,
                    reduce, packed: bool) -> torch.Tensor:
    """[B, keep, ...] `reduce` of the head's logits at the answer's positions and one past
    it. Callers drop that last one after the head: position t's logits are answer token
    t's distribution, and the last one's log-prob (of a stand-in token 0) is dropped after
    the head, since slicing the logits instead would make the backward fill a zero
    gradient to copy into."""
    args = (sequences, attention_mask, keep, reduce)
    if isinstance(model, torch.nn.Module):
        return head_reduced(model, *args, packed=packed)
    return model.head_reduced(*args, packed=packed)   # a TrainEngine, or a LoRA model's base


def answer_head(model, sequences: torch.Tensor, attention_mask: torch.Tensor,
                 prompt_len: int, packed: bool = False) -> torch.Tensor:
    """[B, N + 1, V] logits at the answer's positions: position t is the distribution
    answer token t was drawn from, the last one what would follow the answer. The model's
    head runs on these positions only (`logits_to_keep`, or packed through head_reduced):
    the prompt's logits are never made."""
    keep = sequences.shape[1] - prompt_len + 1
    if packed:
        return _answer_reduced(model, sequences, attention_mask, keep,
                               lambda logits, rows: logits, packed)
    return model(input_ids=sequences, attention_mask=attention_mask,
                 position_ids=position_ids(attention_mask), logits_to_keep=keep).logits


def answer_values(critic: TrainEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_len: int, packed: bool = False) -> torch.Tensor:
    """[B, N] critic value of the state before each answer token (`packed`: run packed)."""
    return critic.token_values(sequences, attention_mask, packed)[:, prompt_len - 1:-1]


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


EVAL_STREAM, BEST_OF_N_STREAM = 0, (1 << 20) - 1   # row_seeds streams; rollouts use 1, 2, ...


@torch.no_grad()
def evaluate(models: Models, prompts: Prompts, s: Settings, dp: DataParallel,
             shown: list[dict] | None = None) -> dict[str, float]:
    """The policy on the held-out prompts, per answer: `reward` (the step-3 score) and
    `ground_truth` (the gold score, when there is one) of answers sampled as in training
    with fixed row seeds (so two evaluations compare like with like), the same for greedy
    answers (`greedy_*`, what chat.py answers), and the `kl` to the reference, measured on
    the sampled answers, as is a reward ensemble's `reward_disagreement` (the std of its
    models' scores). `shown` gets the first ppo.log_answers greedy answers (this
    process's) with their scores."""
    if not prompts.eval:
        return {}
    ensemble = models.rewards.ensemble
    totals = torch.zeros(6, dtype=torch.float64)
    with models.actor.held_weights():   # one gather for the whole evaluation
        for batch_rows in batches(range(len(prompts.eval)), s.ppo.rollout_batch_size,
                                  shuffle=False, seed=0):
            share = dp.share(batch_rows)
            batch = to_device(collate_prompts([prompts.eval[i] for i in share.rows],
                                              models.tokenizer.pad_token_id), dp.device)
            sampled = rollout(models, batch, s.sampling, row_seeds(s.seed, EVAL_STREAM, share.rows))
            greedy = rollout(models, batch, s.greedy, None)
            kl = masked_sum(_kl_to_reference(models, sampled, s, dp), sampled.answered, dim=1)
            sums = [float(kl.sum()), float(_disagreement(models, sampled, s, dp).sum())
                    if ensemble else 0.0]
            for answers in (sampled, greedy):
                reward, gold = _scores(models, answers, s, dp), _gold(s, models.tokenizer, answers)
                sums += [float(reward.sum()), float(gold.sum())]
            totals += share.weight * torch.tensor(sums, dtype=torch.float64)
            if shown is not None and not shown and s.ppo.log_answers:
                # the loop's last scores are the greedy answers'
                shown += _shown_answers(models.tokenizer, greedy, reward, gold, s)
    kl, disagreement, reward, gold, greedy_reward, greedy_gold = (
        total / len(prompts.eval) for total in dp.sum(*totals.tolist()))
    return {"reward": reward, **({"ground_truth": gold} if s.gold else {}),
            "greedy_reward": greedy_reward,
            **({"greedy_ground_truth": greedy_gold} if s.gold else {}), "kl": kl,
            **({"reward_disagreement": disagreement} if ensemble else {})}


def evaluate_shown(models: Models, prompts: Prompts, s: Settings, dp: DataParallel,
                   tracker: Tracker, step: int) -> dict[str, float]:
    """`evaluate`, its first greedy answers logged (answers.jsonl) at `step`."""
    shown: list[dict] = []
    metrics = evaluate(models, prompts, s, dp, shown)
    tracker.log_answers(shown, step)
    return metrics


def _shown_answers(tokenizer, answers: Rollout, reward: torch.Tensor, gold: torch.Tensor,
                   s: Settings) -> list[dict]:
    """The first ppo.log_answers of `answers` as texts, with their rewards [B] and gold
    scores [B] (those only with a gold function)."""
    n = s.ppo.log_answers
    prompts, texts = decode_rollouts(tokenizer, answers.sequences[:n], answers.prompt_len)
    return [{"prompt": prompt, "answer": text, "reward": r,
             **({"ground_truth": g} if s.gold else {})}
            for prompt, text, r, g in zip(prompts, texts, reward[:n].tolist(),
                                          gold[:n].tolist(), strict=True)]


def _gold(s: Settings, tokenizer, answers: Rollout) -> torch.Tensor:
    """[B] the gold score of each answer (zeros without a gold function)."""
    if s.gold is None:
        return torch.zeros(len(answers.sequences))
    return torch.tensor(s.gold(*decode_rollouts(tokenizer, answers.sequences,
                                                answers.prompt_len)))


def _kl_to_reference(models: Models, answers: Rollout, s: Settings, dp: DataParallel
                     ) -> torch.Tensor:
    """[B, N] KL(pi || pi_ref) over the vocabulary at each answer token's position
    (steps.rlhf.token_kl: summed over an answer, the KL per answer with a third of the
    sampled log-ratio's spread, so that a budget is judged on the policy, not on which 64
    answers it happened to sample), `ppo.forward_batch_size` rows at a time."""
    def both(rows: slice) -> torch.Tensor:
        args = (answers.sequences[rows], answers.attention_mask[rows], answers.prompt_len,
                s.ppo.packing)
        return token_kl(answer_head(models.actor, *args)[:, :-1],
                        answer_head(models.reference, *args)[:, :-1], s.sampling.temperature)

    models.actor.eval()
    kl = dp.by_row_chunks(both, len(answers.sequences), s.ppo.forward_batch_size)
    models.actor.train()
    return kl


def _scores(models: Models, answers: Rollout, s: Settings, dp: DataParallel) -> torch.Tensor:
    """[B] the step-3 score of each answer, `ppo.forward_batch_size` rows at a time."""
    return dp.by_row_chunks(lambda rows: models.rewards(answers.sequences[rows],
                                                        answers.attention_mask[rows],
                                                        answers.prompt_len),
                            len(answers.sequences), s.ppo.forward_batch_size)


def _disagreement(models: Models, answers: Rollout, s: Settings, dp: DataParallel
                  ) -> torch.Tensor:
    """[B] the reward ensemble's disagreement on each answer (Rewards.disagreement),
    `ppo.forward_batch_size` rows at a time."""
    return dp.by_row_chunks(lambda rows: models.rewards.disagreement(
        answers.sequences[rows], answers.attention_mask[rows], answers.prompt_len),
        len(answers.sequences), s.ppo.forward_batch_size)


@torch.no_grad()
def best_of_n(models: Models, prompts: Prompts, s: Settings, dp: DataParallel
              ) -> dict[str, float]:
    """The baseline step 3 has to beat: for each held-out prompt, the SFT policy's best of
    `ppo.best_of_n` sampled answers by the step-3 score. Returns its mean `reward`, mean
    `ground_truth` (with a gold function) and analytic `kl` to the SFT policy. Call it
    before any update."""
    n = s.ppo.best_of_n
    if not prompts.eval or n < 2:
        return {}
    totals = torch.zeros(2, dtype=torch.float64)   # reward, gold sums of the picks
    tilted = torch.zeros(len(KL_COEF_GRID), dtype=torch.float64)   # sums over prompts
    with models.actor.held_weights():   # one gather for all the batches
        for batch_rows in batches(range(len(prompts.eval)), max(1, s.ppo.rollout_batch_size // n),
                                  shuffle=False, seed=0):
            share = dp.share(batch_rows, group=n)
            batch = to_device(collate_prompts([prompts.eval[i] for i in share.rows],
                                              models.tokenizer.pad_token_id), dp.device)
            seeds = row_seeds(s.seed, BEST_OF_N_STREAM,
                              [batch_rows[0] * n + i for i in share.index])
            answers = rollout(models, batch, s.sampling, seeds, n)
            reward = _scores(models, answers, s, dp)
            picks = reward.view(-1, n).argmax(1) + torch.arange(0, len(reward), n,
                                                              device=reward.device)
            gold = _gold(s, models.tokenizer, answers)
            totals += share.weight * torch.tensor([float(reward[picks].sum()),
                                                   float(gold[picks.cpu()].sum())],
                                                  dtype=torch.float64)
            clipped = reward.float().cpu().clamp(-s.ppo.score_clip, s.ppo.score_clip)
            tilted += share.weight * tilted_kl(clipped.view(-1, n), KL_COEF_GRID).sum(0)
    reward, gold, *tilted = (total / len(prompts.eval)
                             for total in dp.sum(*totals.tolist(), *tilted.tolist()))
    coef = coef_for_kl(KL_COEF_GRID, torch.tensor(tilted), s.kl_target) if s.kl_target else None
    return {"reward": reward, **({"ground_truth": gold} if s.gold else {}),
            "kl": best_of_n_kl(n), **({"kl_coef_at_target": coef} if coef else {})}


def baseline(models: Models, prompts: Prompts, s: Settings, dp: DataParallel,
             tracker: Tracker, state: Progress) -> Progress:
    """Evaluate the SFT policy (greedy) and its best-of-n, print and log both: the line
    every run shows it has to beat. The SFT policy is the first candidate for export=best."""
    before = evaluate_shown(models, prompts, s, dp, tracker, 0)
    bon = best_of_n(models, prompts, s, dp)
    tracker.log({**{f"eval/{k}": v for k, v in before.items()},
                 **{f"baseline/best_of_{s.ppo.best_of_n}_{k}": v for k, v in bon.items()}}, 0)
    if before:
        greedy = {k.removeprefix("greedy_"): v for k, v in before.items() if "greedy" in k}
        log("step 3 baseline: SFT greedy " + _scores_line(greedy) + " | SFT sampled "
            + _scores_line(before) + (f" | best-of-{s.ppo.best_of_n} " + _scores_line(bon)
                                      if bon else ""))
    state = state._replace(before=before, baseline=bon, best={**before, "iteration": 0})
    return start_kl_coef(state, bon.get("kl_coef_at_target"), s)


def start_kl_coef(state: Progress, at_target: float | None, s: Settings) -> Progress:
    """Start the adaptive controller at the coefficient whose optimum holds the KL target,
    as read from the baseline's samples (never below ppo.kl_coef), and keep it as the floor
    until the KL first reaches the target: from ppo.kl_coef, or lowered while the KL grows
    from 0, the policy runs far past the target in the first updates before the controller
    catches up. The floor holds KL_START_HORIZONS horizons at most: a trained policy can
    stay under the target at that coefficient (the digits task, seed 99: 0.8 nats against
    0.96 for a whole run). Only where the KL is a penalty in the reward: a loss-term KL
    weighs against normalised advantages, another scale."""
    if s.kl_target is None or at_target is None or s.kl.in_loss:
        return state
    coef = max(at_target, s.ppo.kl_coef)
    log(f"step 3 KL coefficient starts at {coef:.3g}: the optimum of the reward model's "
        f"score at that coefficient holds KL {s.kl_target:.3g} (from the best-of-"
        f"{s.ppo.best_of_n} samples)")
    return state._replace(kl_coef=coef, kl_integral=math.log(coef), kl_floor=coef)


def evaluate_during(models: Models, prompts: Prompts, s: Settings, kept: Kept,
                    dp: DataParallel, tracker: Tracker, state: Progress) -> Progress:
    """An evaluation between iterations: logged, and kept if it is the best so far."""
    metrics = evaluate_shown(models, prompts, s, dp, tracker, state.iteration)
    tracker.log({f"eval/{k}": v for k, v in metrics.items()}, state.iteration)
    state = state._replace(last_eval={**metrics, "iteration": state.iteration})
    return keep_if_best(state, metrics, s, kept, models.actor)


def keep_if_best(state: Progress, metrics: dict[str, float], s: Settings, kept: Kept,
                 actor: TrainEngine) -> Progress:
    """With export=best, copy the actor's weights if `metrics` beat the best evaluation so
    far: a higher gold score (else reward; reward breaks ties), within the KL budget, and
    with s.greedy_floor, greedy answers whose gold score is at least the SFT policy's (a
    policy that only moved its most likely answer away from the gold is not better)."""
    if kept.best is None or not metrics:
        return state
    def standing(m: dict) -> tuple:   # gold first when there is one, the reward breaks ties
        return m.get("ground_truth", 0.0), m["reward"]

    better = metrics["kl"] <= s.kl_budget and (
        state.best is None or standing(metrics) > standing(state.best))
    floor = (state.before or {}).get("greedy_ground_truth") if s.greedy_floor else None
    if better and floor is not None and metrics["greedy_ground_truth"] < floor:
        return state._replace(floored=state.floored + 1)
    if better:
        kept.best.load_state_dict(actor.copy_weights(trainable_only=True).tensors)
        return state._replace(best={**metrics, "iteration": state.iteration})
    return state


def _scores_line(metrics: dict[str, float]) -> str:
    return ", ".join(f"{name} {metrics[name]:.3f}" for name in ("reward", "ground_truth", "kl")
                     if name in metrics)


def finish(cfg: DictConfig, s: Settings, models: Models, kept: Kept, tracker: Tracker,
           state: Progress, after: dict, averaged: dict, mean_times: dict[str, float],
           ckpt: StepCheckpoints, dp: DataParallel) -> dict:
    """Log the summary (the SFT policy, its best-of-n, the last, the exported policy and
    the EMA's, `averaged`; wall time, memory peak), export the models, drop the
    checkpoints, and print the step's closing lines."""
    exported = state.best if s.export_best else {**after, "iteration": state.iteration}
    summary = {**{f"eval/{k}_before": v for k, v in state.before.items()},
               **{f"eval/{k}_after": v for k, v in after.items()},
               **{f"eval/{k}_exported": v for k, v in (exported or {}).items()},
               **{f"eval/{k}_ema": v for k, v in averaged.items()},
               **{f"baseline/best_of_{s.ppo.best_of_n}_{k}": v
                  for k, v in state.baseline.items()},
               "time/seconds": state.seconds, "iterations": state.iteration,
               "train/kl_stops": state.kl_stops, "eval/floored": state.floored,
               "memory/peak_mib": memory_peak(dp.device) / 2**20,
               "memory/trained_mib": sum(e.state_bytes() for e in (models.actor, models.critic)
                                         if e is not None) / 2**20}
    # the models first: a run killed before the summary row has not finished, on the page
    counted = tracker.read_sources()   # (engine.log_comm: the evaluation's, not the export's)
    step3 = export(cfg, models, kept, s.export_best, dp)
    tracker.log(summary, state.iteration, sources=counted)
    tracker.close()
    ckpt.clear()
    if mean_times:
        log("step 3 mean iteration: " + _breakdown_line(mean_times))
    line = ", ".join(f"{k} {state.before[k]:.3f} -> {after[k]:.3f}" for k in state.before
                     if k in after)
    if s.export_best and exported:
        line += f"; exported the best evaluated policy (iteration {exported['iteration']}: " \
                f"{_scores_line(exported)})"
        if state.floored:
            line += (f"; {state.floored} evaluations scoring higher were not exported: their "
                     "greedy answers' gold score fell below the SFT model's (ppo.greedy_floor)")
    if averaged:
        line += f"; the EMA (actor_ema): {_scores_line(averaged)}"
    log(f"step 3 ({s.algorithm.name}) done: {state.iteration} iterations, "
        + (f"{line}, " if line else "") + f"{state.seconds:.1f}s, peak memory "
        f"{summary['memory/peak_mib']:.0f} MiB -> {step3}")
    return summary


def export(cfg: DictConfig, models: Models, kept: Kept, best: bool, dp: DataParallel) -> Path:
    step3, adapter = Path(cfg.output_dir) / "step3", cfg.ppo.export_weights == "adapter"
    models.actor.export(models.tokenizer, step3 / "actor", weights=kept.best if best else None,
                        adapter=adapter)
    if models.critic is not None:
        models.critic.export(models.critic_tokenizer, step3 / "critic")
    else:   # an earlier run's critic (overwrite=true) must not pass for this run's
        dp.write_once(lambda: shutil.rmtree(step3 / "critic", ignore_errors=True))
    if kept.ema is not None:
        models.actor.export(models.tokenizer, step3 / "actor_ema", weights=kept.ema,
                            adapter=adapter)
    return step3


PHASES = ("gather", "generate", "experience", "train")   # an iteration's, with "other"


def _time_breakdown(phases: dict[str, float], seconds: float, samples: int, tokens: float,
                    trained_tokens: float) -> dict[str, float]:
    """One iteration's wall time split as DeepSpeed-Chat's hybrid engine reports it
    (gather, generate, experience, train, other; `phases` may hold parts of those too) and
    its throughput: samples/s end to end, generated tokens/s (all ranks' tokens over the
    generation time), trained tokens/s (of the updates made: ppo.target_kl may stop a
    round's before its ppo_epochs passes)."""
    other = seconds - sum(phases[f"time/{name}"] for name in PHASES)
    return {**phases, "time/other": other, "time/iteration": seconds,
            "time/samples_per_s": samples / seconds,
            "time/generate_tokens_per_s": tokens / max(phases["time/generate"], 1e-9),
            "time/train_tokens_per_s": trained_tokens / max(phases["time/train"], 1e-9)}


def _breakdown_line(times: dict[str, float]) -> str:
    parts = " + ".join(f"{name} {times[f'time/{name}']:.3f}" for name in (*PHASES, "other"))
    if "time/prefill" in times:
        parts += (f" | generate: prefill {times['time/prefill']:.3f}s, "
                  f"{times['time/decode_step_ms']:.2f} ms a decode step")
    return (f"{times['time/iteration']:.3f}s = {parts} | "
            f"{times['time/samples_per_s']:.1f} samples/s, "
            f"{times['time/generate_tokens_per_s']:.0f} generated tokens/s")


def _rollout_metrics(exp: Experience, eos_token_id: int, vocab_kl: bool, dp: DataParallel
                     ) -> dict[str, float]:
    """Means over the whole batch's real rows (rows with at least one action; value/mean and
    policy/entropy: over its answer tokens); `vocab_kl`: also the KL over the vocabulary
    per answer (reward/kl_vocab, the controller's reading). A batch without a real row
    (dynamic sampling kept nothing) has no means: zeros would read as scores."""
    lengths = exp.action_mask.sum(1)
    real = (lengths > 0).float()
    ended = ended_with_eos(exp.sequences[:, exp.prompt_len:], exp.action_mask, eos_token_id)
    rows, score, kl, kl_vocab, reward, tokens, ended, values, entropy = dp.sum(
        float(real.sum()), float((exp.scores * real).sum()),
        float(masked_sum(exp.kl, exp.action_mask)),
        float(masked_sum(exp.vocab_kl, exp.action_mask)), float(exp.rewards.sum()),
        float(lengths.sum()), float(ended.float().sum()),
        float(masked_sum(exp.values, exp.action_mask)),
        float(masked_sum(exp.entropy, exp.action_mask)))
    if not rows:
        return {"answer/tokens": 0.0}
    return {"reward/score": score / rows, "reward/kl": kl / rows,
            **({"reward/kl_vocab": kl_vocab / rows} if vocab_kl else {}),
            "reward/total": reward / rows, "answer/length": tokens / rows,
            "answer/ended_with_eos": ended / rows, "value/mean": values / max(tokens, 1),
            "policy/entropy": entropy / max(tokens, 1), "answer/tokens": tokens}
