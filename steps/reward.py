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
    batches,
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
from steps.data import PreferencePair, collate_pairs, tokenize_pairs, train_eval_split
from steps.rlhf import RewardLossOut, pairwise_reward_loss


def _pair_loss(model, batch: dict[str, torch.Tensor]) -> RewardLossOut:
    scores = sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    chosen, rejected = scores.chunk(2)
    return pairwise_reward_loss(chosen, rejected)


@torch.no_grad()
def evaluate(model, examples, pad_token_id: int, batch_size: int, device) -> dict[str, float]:
    """Accuracy and mean chosen/rejected scores over held-out pairs."""
    chosen, rejected = [], []
    for batch in batches(examples, batch_size, shuffle=False, seed=0):
        batch = to_device(collate_pairs(batch, pad_token_id), device)
        c, r = sequence_scores(model, batch["input_ids"], batch["attention_mask"]).chunk(2)
        chosen.append(c)
        rejected.append(r)
    c, r = torch.cat(chosen), torch.cat(rejected)
    return {"eval/accuracy": float((c > r).float().mean()),
            "eval/chosen_score": float(c.mean()), "eval/rejected_score": float(r.mean())}


def run(cfg: DictConfig, pairs: list[PreferencePair], rt: Runtime) -> dict:
    out = start_step(cfg, 2)
    rm, data = cfg.rm, cfg.data
    tokenizer = load_tokenizer(cfg.reward_model, tokenizer=cfg.tokenizer, flag="--reward-model",
                               trust_remote_code=cfg.trust_remote_code)
    train_pairs, eval_pairs = train_eval_split(pairs, data.eval_fraction, cfg.seed)
    train, stats = tokenize_pairs(train_pairs, tokenizer, data.max_prompt_len,
                                  data.max_answer_len)
    report_tokenized("step 2 train", stats, data.max_prompt_len, data.max_answer_len)
    evals, _ = tokenize_pairs(eval_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    require_examples(2, "training pairs", stats, data.max_prompt_len)

    model = load_reward_model(cfg.reward_model, tokenizer, dtype=rt.dtype, seed=cfg.seed + 1,
                              trust_remote_code=cfg.trust_remote_code)
    if cfg.engine.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = apply_lora(model, lora_settings(rm.lora))
    steps_per_epoch = num_batches(len(train), rm.batch_size)
    engine = TrainEngine(model, optim_settings(rm, rm.lr, rm.lora),
                         rm.epochs * steps_per_epoch // rm.grad_accum, rt)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=2))

    start = time.perf_counter()
    for epoch in range(rm.epochs):
        epoch_batches = batches(train, rm.batch_size, shuffle=True, seed=cfg.seed + epoch)
        bar = progress(epoch_batches, desc=f"step 2 epoch {epoch + 1}/{rm.epochs}",
                       total=steps_per_epoch, enabled=cfg.logging.progress)
        for examples in bar:
            batch = to_device(collate_pairs(examples, tokenizer.pad_token_id), rt.device)
            result = _pair_loss(engine.module, batch)
            engine.backward(result.loss)
            grad_norm = engine.step()
            if grad_norm is not None and engine.steps % rm.log_every == 0:
                tracker.log({"train/loss": result.loss.item(),
                             "train/accuracy": result.accuracy.item(), "train/lr": engine.lr,
                             "train/grad_norm": grad_norm, "epoch": epoch}, engine.steps)

    engine.eval()
    metrics = evaluate(engine.module, evals, tokenizer.pad_token_id, rm.eval_batch_size,
                       rt.device) if evals else {}
    elapsed = time.perf_counter() - start
    summary = {**metrics, "train/loss": result.loss.item(), "time/seconds": elapsed}
    tracker.log(summary, engine.steps)
    tracker.close()
    save_hf(engine.module, tokenizer, Path(cfg.output_dir) / "reward")
    log(f"step 2 (reward model) done: {engine.steps} steps, eval accuracy "
        f"{metrics.get('eval/accuracy', float('nan')):.3f} (chosen "
        f"{metrics.get('eval/chosen_score', float('nan')):.3f} vs rejected "
        f"{metrics.get('eval/rejected_score', float('nan')):.3f}), {elapsed:.1f}s "
        f"-> {Path(cfg.output_dir) / 'reward'}")
    return summary
