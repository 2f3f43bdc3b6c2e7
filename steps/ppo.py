"""Step 3, PPO (InstructGPT): the actor samples answers, the frozen reward model scores
them, a per-token KL penalty to the frozen reference keeps the actor close to SFT, GAE
turns rewards into advantages, and clipped policy and value losses update actor and
critic. Optional: an EMA copy of the actor, and a pretraining (PTX) loss on step-1 data.

All PPO tensors are answer-aligned [B, N] (see steps/rlhf.py): column j is answer token j
of `sequences[:, P + j]`; the logits and values that belong to it sit at position P+j-1.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import DictConfig

from engine.engine import TrainEngine, frozen
from engine.errors import UserError
from engine.export import save_hf
from engine.generation import SamplingSettings, generate
from engine.lora import apply_lora
from engine.models import (
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    position_ids,
    sequence_scores,
    token_values,
)
from engine.runtime import Runtime, seeded
from engine.tracking import Tracker
from steps.common import (
    batches,
    ground_truth,
    log,
    lora_settings,
    num_batches,
    optim_settings,
    progress,
    report_tokenized,
    require_examples,
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
    masked_mean,
    policy_loss,
    sft_loss,
    value_loss,
    whiten,
)


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
def make_experience(actor, ref, critic, score, prompts: dict[str, torch.Tensor],
                    sampling: SamplingSettings, eos_token_id: int, pad_token_id: int,
                    ppo: DictConfig) -> tuple[Experience, dict[str, float]]:
    """Sample answers for a batch of left-padded prompts and compute everything PPO needs."""
    t0 = time.perf_counter()
    sequences = generate(actor.module, prompts["input_ids"], prompts["attention_mask"],
                         sampling, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    t1 = time.perf_counter()
    prompt_len = prompts["input_ids"].shape[1]
    actions = answer_mask(sequences[:, prompt_len:], eos_token_id)
    attention_mask = torch.cat([prompts["attention_mask"], actions.long()], dim=1)

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
        advantages = whiten(advantages, actions)
    t2 = time.perf_counter()
    experience = Experience(sequences, attention_mask, actions, logprobs, ref_logprobs, values,
                            rewards, advantages, returns, scores, kl)
    generated = float(actions.sum())
    return experience, {"time/generate": t1 - t0, "time/experience": t2 - t1,
                        "time/generate_tokens_per_s": generated / max(t1 - t0, 1e-9)}


def train_on(experience: Experience, actor: TrainEngine, critic: TrainEngine, ppo: DictConfig,
             ptx_batch: dict[str, torch.Tensor] | None) -> dict[str, float]:
    """One optimisation step of actor and critic on a micro-batch of experience."""
    exp, prompt_len = experience, experience.prompt_len
    logprobs = answer_logprobs(actor, exp.sequences, exp.attention_mask, prompt_len)
    actor_out = policy_loss(logprobs, exp.logprobs, exp.advantages, exp.action_mask,
                            ppo.clip_range)
    loss = actor_out.loss
    stats = {}
    if ptx_batch is not None:
        logits = actor(input_ids=ptx_batch["input_ids"],
                       attention_mask=ptx_batch["attention_mask"],
                       position_ids=position_ids(ptx_batch["attention_mask"])).logits
        ptx = sft_loss(logits, ptx_batch["labels"])
        loss = loss + ppo.ptx.coef * ptx
        stats["train/ptx_loss"] = ptx.item()
    actor.backward(loss)
    actor.step()

    values = answer_values(critic.module, exp.sequences, exp.attention_mask, prompt_len)
    critic_out = value_loss(values, exp.values, exp.returns, exp.action_mask,
                            ppo.value_clip_range)
    critic.backward(critic_out.loss)
    critic.step()
    return {**stats, "train/policy_loss": actor_out.loss.item(),
            "train/clip_fraction": float(actor_out.clip_fraction),
            "train/approx_kl": float(actor_out.approx_kl),
            "train/value_loss": critic_out.loss.item(),
            "train/value_clip_fraction": float(critic_out.clip_fraction)}


@torch.no_grad()
def evaluate_policy(actor_module, scorer: RewardScorer, prompts: list[list[int]],
                    prompt_texts: list[str], tokenizer, sampling: SamplingSettings,
                    batch_size: int, seed: int, device) -> dict[str, float]:
    """Reward-model score (and the demo's ground truth when it applies) of answers sampled
    for held-out prompts, with a fixed seed so before/after compare like with like."""
    scores, answers = [], []
    with seeded(seed, device):
        for batch in batches(prompts, batch_size, shuffle=False, seed=0):
            batch = to_device(collate_prompts(batch, tokenizer.pad_token_id), device)
            seqs = generate(actor_module, batch["input_ids"], batch["attention_mask"],
                            sampling, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
            p = batch["input_ids"].shape[1]
            actions = answer_mask(seqs[:, p:], tokenizer.eos_token_id)
            scores.append(scorer(seqs, torch.cat([batch["attention_mask"], actions.long()], 1)))
            # generate pads after EOS, so the special tokens are all that must go
            answers += tokenizer.batch_decode(seqs[:, p:], skip_special_tokens=True)
    metrics = {"reward": float(torch.cat(scores).mean())}
    truth = ground_truth(prompt_texts, answers)
    if truth is not None:
        metrics["ground_truth"] = truth
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
        rt: Runtime) -> dict:
    actor_path, reward_path = _paths(cfg)  # before start_step touches a previous run's files
    out = start_step(cfg, 3)
    ppo, data = cfg.ppo, cfg.data
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

    dtype, seed = rt.dtype, cfg.seed
    actor_model = apply_lora(load_causal_lm(actor_path, tokenizer, dtype=dtype,
                                            trust_remote_code=trc), lora_settings(ppo.actor_lora))
    ref = frozen(load_causal_lm(actor_path, tokenizer, dtype=dtype, trust_remote_code=trc), rt)
    reward = frozen(load_reward_model(reward_path, reward_tokenizer, flag="ppo.reward_path",
                                      dtype=dtype, trust_remote_code=trc), rt)
    scorer = RewardScorer(reward, tokenizer, reward_tokenizer, rt.device)
    if scorer.same_tokenizer:
        critic_model = load_reward_model(reward_path, tokenizer, flag="ppo.reward_path",
                                         dtype=dtype, trust_remote_code=trc)
        critic_tokenizer = reward_tokenizer
    else:  # the critic must read the actor's tokens: start it from the actor instead
        log("step 3: reward model and actor tokenizers differ; the critic starts from the "
            "actor with a new value head, and rewards are scored on re-tokenized text")
        critic_model = load_reward_model(actor_path, tokenizer, flag="ppo.actor_path",
                                         dtype=dtype, trust_remote_code=trc, seed=seed)
        critic_tokenizer = tokenizer
    if cfg.engine.gradient_checkpointing:
        actor_model.gradient_checkpointing_enable()
        critic_model.gradient_checkpointing_enable()
    critic_model = apply_lora(critic_model, lora_settings(ppo.critic_lora))

    rounds = num_batches(len(prompts), ppo.rollout_batch_size)
    micro_per_round = num_batches(ppo.rollout_batch_size, ppo.micro_batch_size)
    total = ppo.epochs * rounds * ppo.ppo_epochs * micro_per_round
    actor = TrainEngine(actor_model, optim_settings(ppo, ppo.actor_lr, ppo.actor_lora), total, rt)
    critic = TrainEngine(critic_model, optim_settings(ppo, ppo.critic_lr, ppo.critic_lora),
                         total, rt)
    ema = copy.deepcopy(actor.module).eval().requires_grad_(False) if ppo.ema.enabled else None
    sampling = SamplingSettings(max_new_tokens=ppo.max_new_tokens, temperature=ppo.temperature,
                                top_p=ppo.top_p, top_k=ppo.top_k, do_sample=True)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=3))

    def evaluate() -> dict[str, float]:
        return evaluate_policy(actor.module, scorer, eval_prompts, eval_texts, tokenizer,
                               sampling, ppo.rollout_batch_size, seed, rt.device)

    before = evaluate() if eval_prompts else {}
    start, iteration = time.perf_counter(), 0
    ptx_stream = iter(())
    for epoch in range(ppo.epochs):
        prompt_batches = batches(prompts, ppo.rollout_batch_size, shuffle=True, seed=seed + epoch)
        for prompt_batch in progress(prompt_batches, desc=f"step 3 epoch {epoch + 1}",
                                     total=rounds, enabled=cfg.logging.progress):
            t0 = time.perf_counter()
            batch = to_device(collate_prompts(prompt_batch, pad), rt.device)
            exp, timing = make_experience(actor, ref, critic, scorer, batch, sampling, eos, pad,
                                          ppo)
            t1 = time.perf_counter()
            stats: dict[str, float] = {}
            for ppo_epoch in range(ppo.ppo_epochs):
                order = torch.randperm(len(exp.scores), generator=torch.Generator().manual_seed(
                    seed + iteration * 131 + ppo_epoch))
                for index in order.split(ppo.micro_batch_size):
                    ptx_batch = None
                    if ptx_examples:
                        ptx_batch, ptx_stream = _next_ptx(ptx_stream, ptx_examples, ppo, pad,
                                                          seed + iteration, rt.device)
                    stats = train_on(exp.rows(index.to(rt.device)), actor, critic, ppo,
                                     ptx_batch)
                    if ema is not None:
                        ema_update(ema.parameters(), actor.module.parameters(), ppo.ema.beta)
            t2 = time.perf_counter()
            iteration += 1
            lengths = exp.action_mask.sum(1)
            metrics = {
                **stats, **timing,
                "reward/score": float(exp.scores.mean()),
                "reward/kl": float((exp.kl * exp.action_mask).sum(1).mean()),
                "reward/total": float(exp.rewards.sum(1).mean()),
                "answer/length": float(lengths.float().mean()),
                "answer/ended_with_eos": float((exp.action_mask.sum(1) < exp.action_mask.shape[1])
                                               .float().mean()),
                "value/mean": float(masked_mean(exp.values, exp.action_mask)),
                "time/train": t2 - t1, "time/iteration": t2 - t0,
                "time/train_tokens_per_s": float(lengths.sum()) * ppo.ppo_epochs / (t2 - t1),
                "lr/actor": actor.lr, "lr/critic": critic.lr,
            }
            if iteration % ppo.log_every == 0:
                tracker.log(metrics, iteration)

    actor.eval()
    after = evaluate() if eval_prompts else {}
    elapsed = time.perf_counter() - start
    summary = {**{f"eval/{k}_before": v for k, v in before.items()},
               **{f"eval/{k}_after": v for k, v in after.items()},
               "time/seconds": elapsed, "iterations": iteration}
    tracker.log(summary, iteration)
    tracker.close()
    step3 = Path(cfg.output_dir) / "step3"
    save_hf(actor.module, tokenizer, step3 / "actor")
    save_hf(critic.module, critic_tokenizer, step3 / "critic")
    if ema is not None:
        save_hf(ema, tokenizer, step3 / "actor_ema")
    line = ", ".join(f"{k} {before[k]:.3f} -> {after[k]:.3f}" for k in before if k in after)
    log(f"step 3 (PPO) done: {iteration} iterations, " + (f"{line}, " if line else "")
        + f"{elapsed:.1f}s -> {step3}")
    return summary


def _next_ptx(stream, examples, ppo: DictConfig, pad: int, seed: int, device):
    """The next PTX batch, cycling through the step-1 data in a fresh order each pass."""
    batch = next(stream, None)
    if batch is None:
        stream = batches(examples, ppo.ptx.batch_size, shuffle=True, seed=seed)
        batch = next(stream)
    return to_device(collate_sft(batch, pad), device), stream
