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
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig

from engine.checkpoint import Tensors
from engine.engine import TrainEngine
from engine.errors import UserError
from engine.export import save_hf
from engine.generation import SamplingSettings
from engine.hybrid import HybridEngine, HybridSettings
from engine.lora import apply_lora
from engine.models import (
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    position_ids,
    sequence_scores,
    token_values,
)
from engine.parallel import frozen
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
    rank_rows,
    report_tokenized,
    require_examples,
    shard_settings,
    start_step,
    to_device,
)
from steps.data import (
    PreferencePair,
    collate_prompts,
    collate_sft,
    tokenize_prompts,
    tokenize_sft,
    train_eval_split,
)
from steps.rlhf import (
    answer_mask,
    ema_update,
    gae,
    kl_penalized_rewards,
    logprobs_of_tokens,
    masked_sum,
    policy_loss,
    sft_loss,
    value_loss,
    whiten,
)
from steps.sft import trained_tokens


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


def global_moments(x: torch.Tensor, mask: torch.Tensor, rt: Runtime
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased variance) of the masked entries of `x` over all ranks' rows."""
    total, count = rt.all_sum(torch.stack([masked_sum(x, mask), mask.sum()]))
    mean = total / count.clamp(min=1)
    squares = rt.all_sum(masked_sum((x - mean) ** 2, mask)[None])[0]
    var = squares / count.clamp(min=1)
    return mean, torch.where(count > 1, var * count / (count - 1).clamp(min=1), var)


def answer_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_len: int) -> torch.Tensor:
    """[B, N] log-probability of each answer token under `model`."""
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask)).logits
    return logprobs_of_tokens(logits[:, prompt_len - 1:-1], sequences[:, prompt_len:])


def answer_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  prompt_len: int) -> torch.Tensor:
    """[B, N] critic value of the state before each answer token."""
    return token_values(critic, sequences, attention_mask)[:, prompt_len - 1:-1]


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
def make_experience(actor: HybridEngine, ref, critic, score, prompts: dict[str, torch.Tensor],
                    sampling: SamplingSettings, eos_token_id: int, pad_token_id: int,
                    ppo: DictConfig, rt: Runtime, *, seeds: torch.Tensor | None = None,
                    weight: float = 1.0) -> tuple[Experience, dict[str, float]]:
    """Sample answers for this rank's left-padded prompts (row `seeds`, see row_seeds) and
    compute everything PPO needs. Whitening statistics come from all ranks' rows; a rank
    whose rows are stand-ins passes weight 0, which empties their action masks.
    Returns the experience and the seconds spent: gathering the actor for generation,
    generating, and computing the rest."""
    actor.take_times()
    sequences = actor.generate(prompts["input_ids"], prompts["attention_mask"], sampling,
                               eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                               row_seeds=seeds)
    t1 = time.perf_counter()
    generation = actor.take_times()
    prompt_len = prompts["input_ids"].shape[1]
    actions = answer_mask(sequences[:, prompt_len:], eos_token_id) * weight
    attention_mask = torch.cat([prompts["attention_mask"],
                                answer_mask(sequences[:, prompt_len:], eos_token_id).long()], 1)

    actor.eval()
    logprobs = answer_logprobs(actor, sequences, attention_mask, prompt_len)
    actor.train()
    ref_logprobs = answer_logprobs(ref, sequences, attention_mask, prompt_len)
    critic.eval()
    values = answer_values(critic.module, sequences, attention_mask, prompt_len) * actions
    critic.train()
    scores = score(sequences, attention_mask)

    rewards, kl = kl_penalized_rewards(scores, logprobs, ref_logprobs, actions,
                                       ppo.kl_coef, ppo.score_clip)
    advantages, returns = gae(rewards, values, actions, ppo.gamma, ppo.lam)
    if ppo.whiten_advantages:
        advantages = whiten(advantages, actions, moments=global_moments(advantages, actions, rt))
    t2 = time.perf_counter()
    experience = Experience(sequences, attention_mask, actions, logprobs, ref_logprobs, values,
                            rewards, advantages, returns, scores, kl)
    return experience, {"time/gather": generation.gather, "time/generate": generation.generate,
                        "time/experience": t2 - t1}


def train_on(experience: Experience, actor: TrainEngine, critic: TrainEngine, ppo: DictConfig,
             num_actions: float, ptx: tuple[dict[str, torch.Tensor], int, float] | None
             ) -> dict[str, float]:
    """One optimisation step of actor and critic on this rank's rows of a micro-batch.
    `num_actions`: the micro-batch's action count over all ranks; `ptx`: this rank's PTX
    rows, the global batch's token count, and this rank's weight. Returns this rank's
    shares of the statistics (they sum to the micro-batch's values over the ranks)."""
    exp, prompt_len = experience, experience.prompt_len
    logprobs = answer_logprobs(actor, exp.sequences, exp.attention_mask, prompt_len)
    actor_out = policy_loss(logprobs, exp.logprobs, exp.advantages, exp.action_mask,
                            ppo.clip_range, num_actions)
    loss = actor_out.loss
    stats = {}
    if ptx is not None:
        ptx_batch, ptx_tokens, ptx_weight = ptx
        logits = actor(input_ids=ptx_batch["input_ids"],
                       attention_mask=ptx_batch["attention_mask"],
                       position_ids=position_ids(ptx_batch["attention_mask"])).logits
        ptx_loss = sft_loss(logits, ptx_batch["labels"], num_tokens=ptx_tokens) * ptx_weight
        loss = loss + ppo.ptx.coef * ptx_loss
        stats["train/ptx_loss"] = ptx_loss.item()
    actor.backward(loss)
    actor.step()

    values = answer_values(critic.module, exp.sequences, exp.attention_mask, prompt_len)
    critic_out = value_loss(values, exp.values, exp.returns, exp.action_mask,
                            ppo.value_clip_range, num_actions)
    critic.backward(critic_out.loss)
    critic.step()
    return {**stats, "train/policy_loss": actor_out.loss.item(),
            "train/clip_fraction": float(actor_out.clip_fraction),
            "train/approx_kl": float(actor_out.approx_kl),
            "train/value_loss": critic_out.loss.item(),
            "train/value_clip_fraction": float(critic_out.clip_fraction)}


def summed(stats: dict[str, float], rt: Runtime) -> dict[str, float]:
    """Per-rank shares of statistics -> their totals over the ranks (one all-reduce)."""
    return dict(zip(stats, rt.total(*stats.values()), strict=True))


@torch.no_grad()
def evaluate_policy(actor: HybridEngine, scorer: RewardScorer, prompts: list[list[int]],
                    prompt_texts: list[str], tokenizer, sampling: SamplingSettings,
                    batch_size: int, seed: int, rt: Runtime) -> dict[str, float]:
    """Reward-model score (and the demo's ground truth when it applies) of answers sampled
    for held-out prompts, with fixed row seeds so before/after compare like with like."""
    reward_sum = truth_sum = truth_count = 0.0
    rows = list(range(len(prompts)))
    for batch_rows in batches(rows, batch_size, shuffle=False, seed=0):
        mine, weight = rank_rows(batch_rows, rt)
        batch = to_device(collate_prompts([prompts[i] for i in mine], tokenizer.pad_token_id),
                          rt.device)
        seqs = actor.generate(batch["input_ids"], batch["attention_mask"], sampling,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id,
                              row_seeds=row_seeds(seed, 0, mine))
        p = batch["input_ids"].shape[1]
        actions = answer_mask(seqs[:, p:], tokenizer.eos_token_id)
        reward_sum += float(scorer(seqs, torch.cat([batch["attention_mask"],
                                                     actions.long()], 1)).sum()) * weight
        # generate pads after EOS, so the special tokens are all that must go
        answers = tokenizer.batch_decode(seqs[:, p:], skip_special_tokens=True)
        truth = ground_truth([prompt_texts[i] for i in mine], answers)
        if truth is not None and weight:
            truth_sum, truth_count = truth_sum + truth[0], truth_count + truth[1]
    reward_sum, truth_sum, truth_count = rt.total(reward_sum, truth_sum, truth_count)
    metrics = {"reward": reward_sum / len(prompts)}
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


def run(cfg: DictConfig, pairs: list[PreferencePair], ptx_pairs: list[PreferencePair],
        rt: Runtime, resume: bool = False) -> dict:
    actor_path, reward_path = _paths(cfg)  # before start_step touches a previous run's files
    out = start_step(cfg, 3, rt, resume=resume)
    ppo, data, engine_cfg = cfg.ppo, cfg.data, cfg.engine
    trc = cfg.trust_remote_code
    tokenizer = load_tokenizer(actor_path, trust_remote_code=trc)
    reward_tokenizer = load_tokenizer(reward_path, flag="ppo.reward_path", trust_remote_code=trc)

    train_pairs, eval_pairs = train_eval_split(pairs, data.eval_fraction, cfg.seed)
    prompts, stats = tokenize_prompts(train_pairs, tokenizer, data.max_prompt_len)
    report_tokenized("step 3 prompts", stats, data.max_prompt_len)
    require_examples(3, "prompts", stats, data.max_prompt_len)
    eval_pairs = eval_pairs[:ppo.eval_prompts]
    eval_prompts, _ = tokenize_prompts(eval_pairs, tokenizer, data.max_prompt_len)
    eval_texts = tokenizer.batch_decode(eval_prompts, skip_special_tokens=True)
    ptx_examples = []
    if ppo.ptx.enabled:
        ptx_examples, ptx_stats = tokenize_sft(ptx_pairs, tokenizer, data.max_prompt_len,
                                               data.max_answer_len)
        report_tokenized("step 3 PTX", ptx_stats, data.max_prompt_len, data.max_answer_len)

    dtype, master, seed = rt.dtype, rt.master_dtype, cfg.seed
    actor_model = apply_lora(load_causal_lm(actor_path, tokenizer, dtype=master,
                                            trust_remote_code=trc), lora_settings(ppo.actor_lora))
    ref = frozen(load_causal_lm(actor_path, tokenizer, dtype=dtype, trust_remote_code=trc), rt,
                 sharded=engine_cfg.shard_frozen_models,
                 offload=engine_cfg.offload_reference_model)
    reward = frozen(load_reward_model(reward_path, reward_tokenizer, flag="ppo.reward_path",
                                      dtype=dtype, trust_remote_code=trc), rt,
                    sharded=engine_cfg.shard_frozen_models,
                    offload=engine_cfg.offload_reward_model)
    scorer = RewardScorer(reward, tokenizer, reward_tokenizer, rt.device)
    if scorer.same_tokenizer:
        critic_model = load_reward_model(reward_path, tokenizer, flag="ppo.reward_path",
                                         dtype=master, trust_remote_code=trc)
        critic_tokenizer = reward_tokenizer
    else:  # the critic must read the actor's tokens: start it from the actor instead
        log("step 3: reward model and actor tokenizers differ; the critic starts from the "
            "actor with a new value head, and rewards are scored on re-tokenized text")
        critic_model = load_reward_model(actor_path, tokenizer, flag="ppo.actor_path",
                                         dtype=master, trust_remote_code=trc, seed=seed)
        critic_tokenizer = tokenizer
    critic_model = apply_lora(critic_model, lora_settings(ppo.critic_lora))

    rounds = num_batches(len(prompts), ppo.rollout_batch_size)
    micro_per_round = num_batches(ppo.rollout_batch_size, ppo.micro_batch_size)
    total = ppo.epochs * rounds * ppo.ppo_epochs * micro_per_round
    actor = HybridEngine(actor_model, optim_settings(ppo, ppo.actor_lr, ppo.actor_lora), total,
                         rt, shard_settings(cfg, cfg.actor_zero_stage),
                         HybridSettings(**engine_cfg.hybrid))
    critic = TrainEngine(critic_model, optim_settings(ppo, ppo.critic_lr, ppo.critic_lora),
                         total, rt, shard_settings(cfg, cfg.reward_zero_stage))
    # the EMA copy is kept as (sharded) tensors beside the actor's own parameters
    ema = Tensors({name: p.detach().clone() for name, p in actor.module.named_parameters()}) \
        if ppo.ema.enabled else None
    sampling = SamplingSettings(max_new_tokens=ppo.max_new_tokens, temperature=ppo.temperature,
                                top_p=ppo.top_p, top_k=ppo.top_k, do_sample=True)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    ckpt = StepCheckpoints(cfg, 3, rt, {"actor": actor, "critic": critic},
                           extra={"ema": ema} if ema else None)
    position, metrics_rows = ckpt.restore(
        {"epoch": 0, "round": 0, "iteration": 0, "ptx_batches": 0, "seconds": 0.0,
         "before": None}, resume)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=3),
                      enabled=rt.is_main, keep_rows=metrics_rows)

    def evaluate() -> dict[str, float]:
        return evaluate_policy(actor, scorer, eval_prompts, eval_texts, tokenizer,
                               sampling, ppo.rollout_batch_size, seed, rt)

    before = position["before"]
    if before is None:
        before = evaluate() if eval_prompts else {}
    start = time.perf_counter() - position["seconds"]
    iteration, ptx_batches = position["iteration"], position["ptx_batches"]
    time_totals: dict[str, float] = {}
    for epoch in range(position["epoch"], ppo.epochs):
        for round_index, prompt_batch in epoch_batches(
                prompts, ppo.rollout_batch_size, seed=seed + epoch,
                skip=position["round"] if epoch == position["epoch"] else 0,
                desc=f"step 3 epoch {epoch + 1}", enabled=cfg.logging.progress and rt.is_main):
            t0 = time.perf_counter()
            mine, weight = rank_rows(range(len(prompt_batch)), rt)
            batch = to_device(collate_prompts([prompt_batch[i] for i in mine], pad), rt.device)
            exp, timing = make_experience(actor, ref, critic, scorer, batch, sampling, eos, pad,
                                          ppo, rt, seeds=row_seeds(seed, iteration + 1, mine),
                                          weight=weight)
            t1 = time.perf_counter()
            global_rows = torch.tensor(mine)
            stats: dict[str, float] = {}
            for ppo_epoch in range(ppo.ppo_epochs):
                order = torch.randperm(len(prompt_batch), generator=torch.Generator().manual_seed(
                    seed + iteration * 131 + ppo_epoch))
                for micro in order.split(ppo.micro_batch_size):
                    local = torch.isin(global_rows, micro).nonzero().flatten()
                    rows = exp.rows(local) if len(local) else \
                        exp.rows(torch.tensor([0])).without_actions()
                    num_actions = rt.total(float(rows.action_mask.sum()))[0]
                    ptx = None
                    if ptx_examples:
                        ptx_global = _ptx_batch(ptx_examples, ptx_batches, ppo.ptx.batch_size,
                                                seed)
                        ptx_batches += 1
                        ptx_rows, ptx_weight = rank_rows(ptx_global, rt)
                        ptx = (to_device(collate_sft(ptx_rows, pad), rt.device),
                               trained_tokens(ptx_global), ptx_weight)
                    stats = train_on(rows, actor, critic, ppo, num_actions, ptx)
                    if ema is not None:
                        ema_update(ema.tensors.values(), actor.module.parameters(),
                                   ppo.ema.beta)
            t2 = time.perf_counter()
            iteration += 1
            metrics = {**summed(stats, rt), **_rollout_metrics(exp, eos, rt),
                       "lr/actor": actor.lr, "lr/critic": critic.lr}
            tokens = metrics.pop("answer/tokens")
            times = _time_breakdown({**timing, "time/train": t2 - t1},
                                    time.perf_counter() - t0, len(prompt_batch), tokens,
                                    ppo.ppo_epochs)
            metrics.update(times)
            time_totals = {k: time_totals.get(k, 0.0) + v for k, v in times.items()}
            if iteration % ppo.log_every == 0:
                tracker.log(metrics, iteration)
                if not cfg.logging.progress:
                    log(f"step 3 iteration {iteration}: " + _breakdown_line(times))
            epoch_done = round_index == rounds
            ckpt.save_if_due(iteration, {
                "epoch": epoch + epoch_done, "round": 0 if epoch_done else round_index,
                "iteration": iteration, "ptx_batches": ptx_batches,
                "seconds": time.perf_counter() - start, "before": before}, tracker)

    actor.eval()
    after = evaluate() if eval_prompts else {}
    elapsed = time.perf_counter() - start
    summary = {**{f"eval/{k}_before": v for k, v in before.items()},
               **{f"eval/{k}_after": v for k, v in after.items()},
               "time/seconds": elapsed, "iterations": iteration}
    tracker.log(summary, iteration)
    tracker.close()
    step3 = Path(cfg.output_dir) / "step3"
    save_hf(actor.module, tokenizer, step3 / "actor", rt)
    save_hf(critic.module, critic_tokenizer, step3 / "critic", rt)
    if ema is not None:  # export the EMA weights through the actor's own structure
        with torch.no_grad():
            for param, average in zip(actor.module.parameters(), ema.tensors.values(),
                                      strict=True):
                param.copy_(average)
        save_hf(actor.module, tokenizer, step3 / "actor_ema", rt)
    ckpt.clear()
    if time_totals:
        runs = iteration - position["iteration"]
        log("step 3 mean iteration: " + _breakdown_line({
            k: v / runs for k, v in time_totals.items()}))
    line = ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in before if k in after)
    log(f"step 3 (PPO) done: {iteration} iterations, " + (f"{line}, " if line else "")
        + f"{elapsed:.1f}s -> {step3}")
    return summary


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


def _rollout_metrics(exp: Experience, eos_token_id: int, rt: Runtime) -> dict[str, float]:
    """Means over all ranks' real rows (rows with at least one action)."""
    real = (exp.action_mask.sum(1) > 0).float()
    lengths = exp.action_mask.sum(1)
    ended = ((exp.sequences[:, exp.prompt_len:] == eos_token_id) & (exp.action_mask > 0)).any(1)
    sums = rt.total(
        float(real.sum()), float((exp.scores * real).sum()),
        float((exp.kl * exp.action_mask).sum()), float(exp.rewards.sum()),
        float(lengths.sum()), float(ended.float().sum()),
        float(masked_sum(exp.values, exp.action_mask)))
    rows, score, kl, reward, tokens, ended, values = sums
    rows = max(rows, 1)
    return {"reward/score": score / rows, "reward/kl": kl / rows, "reward/total": reward / rows,
            "answer/length": tokens / rows, "answer/ended_with_eos": ended / rows,
            "value/mean": values / max(tokens, 1), "answer/tokens": tokens}


def _ptx_batch(examples: list, index: int, batch_size: int, seed: int) -> list:
    """The `index`-th PTX batch: passes over the step-1 data, each in a fresh seeded order,
    so the stream's position is one counter (which a checkpoint stores)."""
    per_pass = num_batches(len(examples), batch_size)
    epoch, offset = divmod(index, per_pass)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(
        seed + 7919 * (epoch + 1))).tolist()
    return [examples[i] for i in order[offset * batch_size:(offset + 1) * batch_size]]
