"""Step 3, PPO (InstructGPT): the actor samples answers, the frozen reward model scores
them, a per-token KL penalty to the frozen reference keeps the actor close to SFT, GAE
turns rewards into advantages, and clipped policy and value losses update actor and
critic. Optional: an EMA copy of the actor, and a pretraining (PTX) loss on step-1 data.

All PPO tensors are answer-aligned [B, N] (see steps/rlhf.py): column j is answer token j
of `sequences[:, P + j]`; the logits and values that belong to it sit at position P+j-1.

With several ranks, each round's prompts are dealt out (rank r takes rows r, r+W, ...),
every rank generates and scores its own, and every mean (losses, advantage whitening,
metrics) is taken over the whole round, so the run computes what one process would.
Sampling is row-seeded (engine/generation.py): a prompt's answer does not depend on the
rank that samples it.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig

from engine.checkpoint import Tensors
from engine.data_parallel import DataParallel, Share
from engine.engine import TrainEngine
from engine.errors import UserError
from engine.generation import SamplingSettings
from engine.hybrid import HybridEngine
from engine.models import disable_dropout, load_tokenizer, position_ids, sequence_scores
from engine.placement import Placement
from engine.runtime import Runtime
from engine.tracking import Tracker
from steps.common import (
    StepCheckpoints,
    batches,
    epoch_batches,
    ground_truth,
    log,
    lora_settings,
    num_batches,
    optim_settings,
    placement,
    report_tokenized,
    require_examples,
    start_step,
    to_device,
)
from steps.data import PreferencePair, permutation, train_eval_split
from steps.rlhf import (
    answer_mask,
    ema_update,
    gae,
    kl_penalized_rewards,
    logprobs_of_tokens,
    masked_sum,
    policy_loss,
    value_loss,
    whiten,
)
from steps.sft import batch_loss
from steps.tokenize import SFTExample, collate_prompts, collate_sft, tokenize_prompts, tokenize_sft


class Experience(NamedTuple):
    """One round of rollouts. B rows; P prompt columns (left-padded), N answer columns."""

    sequences: torch.Tensor       # [B, P+N] prompt + answer token ids
    attention_mask: torch.Tensor  # [B, P+N] 1 on real prompt tokens and on actions
    action_mask: torch.Tensor     # [B, N] 1 on answer tokens up to and including EOS
    logprobs: torch.Tensor        # [B, N] actor log-probs when sampled
    ref_logprobs: torch.Tensor    # [B, N] reference log-probs
    values: torch.Tensor          # [B, N] critic values
    rewards: torch.Tensor         # [B, N] KL penalty + clipped score on the last action
    advantages: torch.Tensor      # [B, N]
    returns: torch.Tensor         # [B, N]
    scores: torch.Tensor          # [B] reward-model score of each answer
    kl: torch.Tensor              # [B, N] per-token log-ratio actor/reference

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
                    prompt_len: int) -> torch.Tensor:
    """[B, N] log-probability of each answer token under `model`."""
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask)).logits
    return logprobs_of_tokens(logits[:, prompt_len - 1:-1], sequences[:, prompt_len:])


def answer_values(critic: TrainEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_len: int) -> torch.Tensor:
    """[B, N] critic value of the state before each answer token."""
    return critic.token_values(sequences, attention_mask)[:, prompt_len - 1:-1]


class RewardScorer:
    """Scores prompt + answer with the reward model, re-tokenizing the text when the reward
    model's tokenizer differs from the actor's."""

    def __init__(self, model, actor_tokenizer, reward_tokenizer, device):
        self.model, self.device = model, device
        self.actor_tokenizer, self.reward_tokenizer = actor_tokenizer, reward_tokenizer
        self.same_tokenizer = actor_tokenizer.get_vocab() == reward_tokenizer.get_vocab()

    @torch.no_grad()
    def __call__(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.same_tokenizer:
            # the rightmost attended token of a rollout is its last action
            return sequence_scores(self.model, sequences, attention_mask)
        texts = [self.actor_tokenizer.decode(row[mask.bool()], skip_special_tokens=True)
                 for row, mask in zip(sequences, attention_mask, strict=True)]
        eos = self.reward_tokenizer.eos_token_id
        ids = [row + [eos] for row in self.reward_tokenizer(texts)["input_ids"]]
        batch = to_device(collate_prompts(ids, self.reward_tokenizer.pad_token_id), self.device)
        return sequence_scores(self.model, batch["input_ids"], batch["attention_mask"])


@torch.no_grad()
def make_experience(actor: HybridEngine, ref, critic: TrainEngine, score,
                    prompts: dict[str, torch.Tensor], sampling: SamplingSettings,
                    eos_token_id: int, pad_token_id: int, ppo: DictConfig, dp: DataParallel,
                    *, seeds: torch.Tensor | None = None, weight: float = 1.0
                    ) -> tuple[Experience, dict[str, float]]:
    """Sample answers for left-padded prompts (row `seeds`, see row_seeds) and compute
    everything PPO needs. The prompts are this process's share of the rollout batch, of
    `weight` (0 empties the action masks of a stand-in); whitening uses the whole batch.
    Returns the experience and the seconds spent: gathering the actor for generation,
    generating, and computing the rest."""
    actor.take_times()
    sequences = actor.generate(prompts["input_ids"], prompts["attention_mask"], sampling,
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                               row_seeds=seeds)
    t1 = time.perf_counter()
    generation = actor.take_times()
    prompt_len = prompts["input_ids"].shape[1]
    answered = answer_mask(sequences[:, prompt_len:], eos_token_id)
    actions = answered * weight
    attention_mask = torch.cat([prompts["attention_mask"], answered.long()], 1)

    actor.eval()
    logprobs = answer_logprobs(actor, sequences, attention_mask, prompt_len)
    actor.train()
    ref_logprobs = answer_logprobs(ref, sequences, attention_mask, prompt_len)
    critic.eval()
    values = answer_values(critic, sequences, attention_mask, prompt_len) * actions
    critic.train()
    scores = score(sequences, attention_mask)

    rewards, kl = kl_penalized_rewards(scores, logprobs, ref_logprobs, actions,
                                       ppo.kl_coef, ppo.score_clip)
    advantages, returns = gae(rewards, values, actions, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten(advantages, actions, moments=dp.masked_moments(advantages, actions))
    t2 = time.perf_counter()
    experience = Experience(sequences, attention_mask, actions, logprobs, ref_logprobs, values,
                            rewards, advantages, returns, scores, kl)
    return experience, {"time/gather": generation.gather, "time/generate": generation.generate,
                        "time/experience": t2 - t1}


def train_on(experience: Experience, actor: TrainEngine, critic: TrainEngine, ppo: DictConfig,
             num_actions: float, ptx: PtxRows | None) -> dict[str, float]:
    """One optimisation step of actor and critic on this process's rows of a micro-batch.
    `num_actions`: the micro-batch's action count over all processes. Returns this
    process's shares of the statistics (their sums over processes are the micro-batch's)."""
    exp, prompt_len = experience, experience.prompt_len
    logprobs = answer_logprobs(actor, exp.sequences, exp.attention_mask, prompt_len)
    actor_out = policy_loss(logprobs, exp.logprobs, exp.advantages, exp.action_mask,
                            ppo.clip_range, num_actions)
    loss = actor_out.loss
    stats = {}
    if ptx is not None:
        ptx_loss = batch_loss(actor, ptx.batch, ptx.examples)[0] * ptx.weight
        loss = loss + ppo.ptx.coef * ptx_loss
        stats["train/ptx_loss"] = ptx_loss.item()
    actor.backward(loss)
    actor.step()

    values = answer_values(critic, exp.sequences, exp.attention_mask, prompt_len)
    critic_out = value_loss(values, exp.values, exp.returns, exp.action_mask,
                            ppo.value_clip_range, num_actions)
    critic.backward(critic_out.loss)
    critic.step()
    return {**stats, "train/policy_loss": actor_out.loss.item(),
            "train/clip_fraction": float(actor_out.clip_fraction),
            "train/approx_kl": float(actor_out.approx_kl),
            "train/ratio": float(actor_out.ratio_mean),
            "train/value_loss": critic_out.loss.item(),
            "train/value_clip_fraction": float(critic_out.clip_fraction)}


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
           seed: int, iteration: int) -> tuple[dict[str, float], int]:
    """`ppo.ppo_epochs` passes over one round's experience (this process's `share` of its
    `batch_size` rows) in micro-batches, each one optimizer step of actor and critic (and
    a PTX batch, an EMA update). Returns the statistics' means over the updates and the
    PTX stream's new position."""
    sums: dict[str, float] = {}
    updates = 0
    for ppo_epoch in range(ppo.ppo_epochs):
        order = torch.tensor(permutation(batch_size, seed + iteration * 131 + ppo_epoch))
        for micro in order.split(ppo.micro_batch_size):
            index, weight = dp.pick(share, micro)
            rows = exp.rows(index) if weight else exp.rows(index).without_actions()
            num_actions = dp.sum(float(rows.action_mask.sum()))[0]
            ptx_batch = None
            if ptx:
                ptx_batch = ptx_rows(ptx, ptx_batches, ppo.ptx.batch_size, seed,
                                     models.tokenizer.pad_token_id, dp)
                ptx_batches += 1
            for name, value in train_on(rows, models.actor, models.critic, ppo, num_actions,
                                        ptx_batch).items():
                sums[name] = sums.get(name, 0.0) + value
            updates += 1
            if ema is not None:
                ema_update(ema.tensors.values(), models.actor.parameters(), ppo.ema.beta)
    totals = dp.sum(*sums.values())
    return {name: total / updates for name, total in zip(sums, totals, strict=True)}, ptx_batches


@torch.no_grad()
def evaluate_policy(models: Models, prompts: Prompts, sampling: SamplingSettings,
                    batch_size: int, seed: int, dp: DataParallel) -> dict[str, float]:
    """Reward-model score (and the demo's ground truth when it applies) of answers sampled
    for held-out prompts, with fixed row seeds so before/after compare like with like."""
    if not prompts.eval:
        return {}
    tokenizer = models.tokenizer
    reward_sum = truth_sum = truth_count = 0.0
    for batch_rows in batches(range(len(prompts.eval)), batch_size, shuffle=False, seed=0):
        share = dp.share(batch_rows)
        batch = to_device(collate_prompts([prompts.eval[i] for i in share.rows],
                                          tokenizer.pad_token_id), dp.device)
        seqs = models.actor.generate(batch["input_ids"], batch["attention_mask"], sampling,
                                     eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id,
                                     row_seeds=row_seeds(seed, 0, share.rows))
        p = batch["input_ids"].shape[1]
        actions = answer_mask(seqs[:, p:], tokenizer.eos_token_id)
        scores = models.scorer(seqs, torch.cat([batch["attention_mask"], actions.long()], 1))
        reward_sum += float(scores.sum()) * share.weight
        # generate pads after EOS, so the special tokens are all that must go
        answers = tokenizer.batch_decode(seqs[:, p:], skip_special_tokens=True)
        truth = ground_truth([prompts.eval_texts[i] for i in share.rows], answers)
        if truth is not None and share.weight:
            truth_sum, truth_count = truth_sum + truth[0], truth_count + truth[1]
    reward_sum, truth_sum, truth_count = dp.sum(reward_sum, truth_sum, truth_count)
    metrics = {"reward": reward_sum / len(prompts.eval)}
    if truth_count:
        metrics["ground_truth"] = truth_sum / truth_count
    return metrics


def _paths(cfg: DictConfig) -> tuple[str, str]:
    out = Path(cfg.output_dir)
    actor_path = cfg.ppo.actor_path or str(out / "actor")
    reward_path = cfg.ppo.reward_path or str(out / "reward")
    for path, what, key in ((actor_path, "step-1 actor", "ppo.actor_path"),
                            (reward_path, "step-2 reward model", "ppo.reward_path")):
        if not (Path(path) / "config.json").exists():
            raise UserError(f"step 3 needs the {what} at {path}: run its step first "
                            f"(--step 1 2 3) or set {key}=DIR")
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
    critic: TrainEngine          # trained; per-token values
    reference: object            # frozen step-1 actor (the KL anchor): a model, or the
                                 # actor's own base with its adapters disabled
    scorer: RewardScorer         # the frozen reward model
    tokenizer: object            # the actor's (and the reference's)
    critic_tokenizer: object


def build_models(cfg: DictConfig, place: Placement, tokenizer, actor_path: str,
                 reward_path: str, updates: int) -> Models:
    ppo, trc = cfg.ppo, cfg.trust_remote_code
    reward_tokenizer = load_tokenizer(reward_path, flag="ppo.reward_path", trust_remote_code=trc)
    reward = place.frozen(place.reward_model(reward_path, reward_tokenizer, trained=False,
                                             flag="ppo.reward_path", trust_remote_code=trc),
                          role="reward")
    scorer = RewardScorer(reward, tokenizer, reward_tokenizer, place.runtime.device)
    critic_lora = lora_settings(ppo.critic_lora)
    if scorer.same_tokenizer:
        critic = place.reward_model(reward_path, tokenizer, trained=True, lora=critic_lora,
                                    flag="ppo.reward_path", trust_remote_code=trc)
        critic_tokenizer = reward_tokenizer
    else:  # the critic must read the actor's tokens: start it from the actor instead
        log("step 3: reward model and actor tokenizers differ; the critic starts from the "
            "actor with a new value head, and rewards are scored on re-tokenized text")
        critic = place.reward_model(actor_path, tokenizer, trained=True, lora=critic_lora,
                                    flag="ppo.actor_path", trust_remote_code=trc, seed=cfg.seed)
        critic_tokenizer = tokenizer
    actor = place.causal_lm(actor_path, tokenizer, trained=True, trust_remote_code=trc,
                            lora=lora_settings(ppo.actor_lora))
    if ppo.disable_dropout:   # else old and new log-probs differ before any update
        disable_dropout(actor)
        disable_dropout(critic)
    actor = place.rollout_actor(actor, optim_settings(ppo, ppo.actor_lr, ppo.actor_lora), updates)
    critic = place.trainer(critic, optim_settings(ppo, ppo.critic_lr, ppo.critic_lora), updates,
                           role="reward")
    # LoRA over a frozen base: the actor with its adapters off is the reference
    reference = place.reference(actor, actor_path, tokenizer, trust_remote_code=trc)
    return Models(actor, critic, reference, scorer, tokenizer, critic_tokenizer)


def run(cfg: DictConfig, pairs: list[PreferencePair], ptx_pairs: list[PreferencePair],
        rt: Runtime, resume: bool = False) -> dict:
    actor_path, reward_path = _paths(cfg)  # before start_step touches a previous run's files
    dp, place = DataParallel(rt), placement(cfg, rt)
    out = start_step(cfg, 3, dp, resume=resume)
    ppo, seed = cfg.ppo, cfg.seed
    tokenizer = load_tokenizer(actor_path, trust_remote_code=cfg.trust_remote_code)
    prompts = load_prompts(cfg, tokenizer, pairs, ptx_pairs)
    rounds = num_batches(len(prompts.train), ppo.rollout_batch_size)
    updates = ppo.epochs * rounds * ppo.ppo_epochs * num_batches(ppo.rollout_batch_size,
                                                                 ppo.micro_batch_size)
    models = build_models(cfg, place, tokenizer, actor_path, reward_path, updates)
    ema = models.actor.copy_weights() if ppo.ema.enabled else None
    sampling = SamplingSettings(ppo.max_new_tokens, ppo.temperature, ppo.top_p, ppo.top_k)
    ckpt = StepCheckpoints(cfg, 3, rt, {"actor": models.actor, "critic": models.critic},
                           extra={"ema": ema} if ema else None)
    position, metrics_rows = ckpt.restore({"epoch": 0, "round": 0, "iteration": 0,
                                           "ptx_batches": 0, "seconds": 0.0, "before": None},
                                          resume)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=3),
                      enabled=dp.reports, keep_rows=metrics_rows)
    evaluate = partial(evaluate_policy, models, prompts, sampling, ppo.rollout_batch_size,
                       seed, dp)
    before = evaluate() if position["before"] is None else position["before"]
    start = time.perf_counter() - position["seconds"]
    iteration, ptx_batches = position["iteration"], position["ptx_batches"]
    time_totals: dict[str, float] = {}
    for epoch in range(position["epoch"], ppo.epochs):
        for round_index, prompt_batch in epoch_batches(
                prompts.train, ppo.rollout_batch_size, seed=seed + epoch,
                skip=position["round"] if epoch == position["epoch"] else 0,
                desc=f"step 3 epoch {epoch + 1}", enabled=cfg.logging.progress and dp.reports):
            times, ptx_batches = iterate(cfg, models, prompts, prompt_batch, sampling, ema,
                                         dp, tracker, iteration, ptx_batches)
            iteration += 1
            time_totals = {k: time_totals.get(k, 0.0) + v for k, v in times.items()}
            epoch_done = round_index == rounds
            ckpt.save_if_due(iteration, {
                "epoch": epoch + epoch_done, "round": 0 if epoch_done else round_index,
                "iteration": iteration, "ptx_batches": ptx_batches,
                "seconds": time.perf_counter() - start, "before": before}, tracker)

    models.actor.eval()
    after = evaluate()
    elapsed = time.perf_counter() - start
    summary = {**{f"eval/{k}_before": v for k, v in before.items()},
               **{f"eval/{k}_after": v for k, v in after.items()},
               "time/seconds": elapsed, "iterations": iteration}
    tracker.log(summary, iteration)
    tracker.close()
    step3 = export(cfg, models, ema)
    ckpt.clear()
    if time_totals:
        runs = iteration - position["iteration"]
        log("step 3 mean iteration: "
            + _breakdown_line({k: v / runs for k, v in time_totals.items()}))
    line = ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in before if k in after)
    log(f"step 3 (PPO) done: {iteration} iterations, " + (f"{line}, " if line else "")
        + f"{elapsed:.1f}s -> {step3}")
    return summary


def iterate(cfg: DictConfig, models: Models, prompts: Prompts, prompt_batch: list[list[int]],
            sampling: SamplingSettings, ema: Tensors | None, dp: DataParallel,
            tracker: Tracker, iteration: int, ptx_batches: int) -> tuple[dict, int]:
    """One PPO iteration: rollouts for a batch of prompts, then updates, then metrics.
    Returns its time breakdown and the PTX stream's new position."""
    t0 = time.perf_counter()
    eos, pad = models.tokenizer.eos_token_id, models.tokenizer.pad_token_id
    share = dp.share(prompt_batch)
    batch = to_device(collate_prompts(share.rows, pad), dp.device)
    exp, timing = make_experience(
        models.actor, models.reference, models.critic, models.scorer, batch, sampling, eos,
        pad, cfg.ppo, dp, seeds=row_seeds(cfg.seed, iteration + 1, share.index),
        weight=share.weight)
    t1 = time.perf_counter()
    stats, ptx_batches = update(exp, share, len(prompt_batch), models, cfg.ppo, dp, prompts.ptx,
                                ptx_batches, ema, cfg.seed, iteration)
    t2 = time.perf_counter()
    metrics = {**stats, **_rollout_metrics(exp, eos, dp)}
    times = _time_breakdown({**timing, "time/train": t2 - t1}, time.perf_counter() - t0,
                            len(prompt_batch), metrics.pop("answer/tokens"), cfg.ppo.ppo_epochs)
    if (iteration + 1) % cfg.ppo.log_every == 0:
        tracker.log({**metrics, "lr/actor": models.actor.lr, "lr/critic": models.critic.lr,
                     **times}, iteration + 1)
        if not cfg.logging.progress:
            log(f"step 3 iteration {iteration + 1}: " + _breakdown_line(times))
    return times, ptx_batches


def export(cfg: DictConfig, models: Models, ema: Tensors | None) -> Path:
    step3 = Path(cfg.output_dir) / "step3"
    models.actor.export(models.tokenizer, step3 / "actor")
    models.critic.export(models.critic_tokenizer, step3 / "critic")
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
    ended = ((exp.sequences[:, exp.prompt_len:] == eos_token_id) & (exp.action_mask > 0)).any(1)
    rows, score, kl, reward, tokens, ended, values = dp.sum(
        float(real.sum()), float((exp.scores * real).sum()),
        float((exp.kl * exp.action_mask).sum()), float(exp.rewards.sum()),
        float(lengths.sum()), float(ended.float().sum()),
        float(masked_sum(exp.values, exp.action_mask)))
    rows = max(rows, 1)
    return {"reward/score": score / rows, "reward/kl": kl / rows, "reward/total": reward / rows,
            "answer/length": tokens / rows, "answer/ended_with_eos": ended / rows,
            "value/mean": values / max(tokens, 1), "answer/tokens": tokens}
