"""Step 2, reward model: a one-label sequence classifier trained on preference pairs with
-log sigmoid(r_chosen - r_rejected), the score read at the last real token."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from engine.engine import TrainEngine
from engine.export import save_hf
from engine.lora import apply_lora
from engine.models import load_reward_model, load_tokenizer, sequence_scores
from engine.runtime import Runtime
from engine.tracking import Tracker
from steps.common import (
    StepCheckpoints,
    batches,
    epoch_batches,
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
from steps.data import PreferencePair, collate_pairs, tokenize_pairs, train_eval_split
from steps.rlhf import RewardLossOut, pairwise_reward_loss


def _pair_loss(model, batch: dict[str, torch.Tensor], num_pairs: int | None = None
               ) -> RewardLossOut:
    scores = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    chosen, rejected = scores.chunk(2)
    return pairwise_reward_loss(chosen, rejected, num_pairs)


@torch.no_grad()
def evaluate(model, examples, pad_token_id: int, batch_size: int, rt: Runtime
             ) -> dict[str, float]:
    """Accuracy and mean chosen/rejected scores over held-out pairs (split over the ranks)."""
    correct = chosen_sum = rejected_sum = 0.0
    for batch in batches(examples, batch_size, shuffle=False, seed=0):
        mine, weight = rank_rows(batch, rt)
        batch = to_device(collate_pairs(mine, pad_token_id), rt.device)
        c, r = sequence_scores(model, batch["input_ids"], batch["attention_mask"]).chunk(2)
        correct += float((c > r).sum()) * weight
        chosen_sum += float(c.sum()) * weight
        rejected_sum += float(r.sum()) * weight
    correct, chosen_sum, rejected_sum = rt.total(correct, chosen_sum, rejected_sum)
    n = len(examples)
    return {"eval/accuracy": correct / n, "eval/chosen_score": chosen_sum / n,
            "eval/rejected_score": rejected_sum / n}


def run(cfg: DictConfig, pairs: list[PreferencePair], rt: Runtime, resume: bool = False
        ) -> dict:
    out = start_step(cfg, 2, rt, resume=resume)
    rm, data = cfg.rm, cfg.data
    tokenizer = load_tokenizer(cfg.reward_model, tokenizer=cfg.tokenizer, flag="--reward-model",
                               trust_remote_code=cfg.trust_remote_code)
    train_pairs, eval_pairs = train_eval_split(pairs, data.eval_fraction, cfg.seed)
    train, stats = tokenize_pairs(train_pairs, tokenizer, data.max_prompt_len,
                                  data.max_answer_len)
    report_tokenized("step 2 train", stats, data.max_prompt_len, data.max_answer_len)
    evals, _ = tokenize_pairs(eval_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    require_examples(2, "training pairs", stats, data.max_prompt_len)

    model = load_reward_model(cfg.reward_model, tokenizer, dtype=rt.master_dtype,
                              seed=cfg.seed + 1, trust_remote_code=cfg.trust_remote_code)
    model = apply_lora(model, lora_settings(rm.lora))
    steps_per_epoch = num_batches(len(train), rm.batch_size)
    engine = TrainEngine(model, optim_settings(rm, rm.lr, rm.lora),
                         rm.epochs * steps_per_epoch // rm.grad_accum, rt,
                         shard_settings(cfg, cfg.reward_zero_stage))
    ckpt = StepCheckpoints(cfg, 2, rt, {"reward": engine})
    position, metrics_rows = ckpt.restore(
        {"epoch": 0, "batch": 0, "seconds": 0.0, "loss": float("nan")}, resume)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=2),
                      enabled=rt.is_main, keep_rows=metrics_rows)

    start, loss = time.perf_counter() - position["seconds"], position["loss"]
    for epoch in range(position["epoch"], rm.epochs):
        for index, examples in epoch_batches(
                train, rm.batch_size, seed=cfg.seed + epoch,
                skip=position["batch"] if epoch == position["epoch"] else 0,
                desc=f"step 2 epoch {epoch + 1}/{rm.epochs}",
                enabled=cfg.logging.progress and rt.is_main):
            mine, weight = rank_rows(examples, rt)
            batch = to_device(collate_pairs(mine, tokenizer.pad_token_id), rt.device)
            result = _pair_loss(engine.module, batch, num_pairs=len(examples))
            engine.backward(result.loss * weight)
            grad_norm = engine.step()
            if grad_norm is None:
                continue
            loss, accuracy = rt.total(result.loss.item() * weight, result.accuracy.item() * weight)
            if engine.steps % rm.log_every == 0:
                tracker.log({"train/loss": loss, "train/accuracy": accuracy,
                             "train/lr": engine.lr, "train/grad_norm": grad_norm,
                             "epoch": epoch}, engine.steps)
            epoch_done = index == steps_per_epoch
            ckpt.save_if_due(engine.steps, {
                "epoch": epoch + epoch_done, "batch": 0 if epoch_done else index,
                "loss": loss, "seconds": time.perf_counter() - start}, tracker)

    engine.eval()
    metrics = evaluate(engine.module, evals, tokenizer.pad_token_id, rm.eval_batch_size,
                       rt) if evals else {}
    elapsed = time.perf_counter() - start
    summary = {**metrics, "train/loss": loss, "time/seconds": elapsed}
    tracker.log(summary, engine.steps)
    tracker.close()
    save_hf(engine.module, tokenizer, Path(cfg.output_dir) / "reward", rt)
    ckpt.clear()
    log(f"step 2 (reward model) done: {engine.steps} steps, eval accuracy "
        f"{metrics.get('eval/accuracy', float('nan')):.3f} (chosen "
        f"{metrics.get('eval/chosen_score', float('nan')):.3f} vs rejected "
        f"{metrics.get('eval/rejected_score', float('nan')):.3f}), {elapsed:.1f}s "
        f"-> {Path(cfg.output_dir) / 'reward'}")
    return summary
