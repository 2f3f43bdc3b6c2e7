"""Step 1, supervised fine-tuning: causal-LM loss on the answer tokens of the chosen
responses; evaluated by perplexity on held-out pairs."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from engine.engine import TrainEngine
from engine.export import save_hf
from engine.lora import apply_lora
from engine.models import load_causal_lm, load_tokenizer, position_ids
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
from steps.data import (
    IGNORE_INDEX,
    PreferencePair,
    SFTExample,
    collate_sft,
    tokenize_sft,
    train_eval_split,
)
from steps.rlhf import sft_loss


def trained_tokens(examples: list[SFTExample]) -> int:
    """Answer tokens the loss is taken over (the targets after the one-token shift)."""
    return sum(sum(label != IGNORE_INDEX for label in ex.labels[1:]) for ex in examples)


def _batch_loss(model, batch: dict[str, torch.Tensor], num_tokens: int | None = None
                ) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=position_ids(batch["attention_mask"])).logits
    return sft_loss(logits, batch["labels"], num_tokens=num_tokens)


@torch.no_grad()
def perplexity(model, examples, pad_token_id: int, batch_size: int, rt: Runtime) -> float:
    """exp of the mean answer-token cross entropy over `examples` (split over the ranks)."""
    total_loss = 0.0
    for batch in batches(examples, batch_size, shuffle=False, seed=0):
        mine, weight = rank_rows(batch, rt)
        tokens = trained_tokens(mine)
        loss = _batch_loss(model, to_device(collate_sft(mine, pad_token_id), rt.device))
        total_loss += float(loss) * tokens * weight
    total_loss = rt.total(total_loss)[0]
    return math.exp(total_loss / max(trained_tokens(examples), 1))


def run(cfg: DictConfig, pairs: list[PreferencePair], rt: Runtime, resume: bool = False
        ) -> dict:
    out = start_step(cfg, 1, rt, resume=resume)
    sft, data = cfg.sft, cfg.data
    tokenizer = load_tokenizer(cfg.actor_model, tokenizer=cfg.tokenizer,
                               trust_remote_code=cfg.trust_remote_code)
    train_pairs, eval_pairs = train_eval_split(pairs, data.eval_fraction, cfg.seed)
    train, stats = tokenize_sft(train_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    report_tokenized("step 1 train", stats, data.max_prompt_len, data.max_answer_len)
    evals, _ = tokenize_sft(eval_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    require_examples(1, "training examples", stats, data.max_prompt_len)

    model = load_causal_lm(cfg.actor_model, tokenizer, dtype=rt.master_dtype, seed=cfg.seed,
                           trust_remote_code=cfg.trust_remote_code)
    model = apply_lora(model, lora_settings(sft.lora))
    steps_per_epoch = num_batches(len(train), sft.batch_size)
    engine = TrainEngine(model, optim_settings(sft, sft.lr, sft.lora),
                         sft.epochs * steps_per_epoch // sft.grad_accum, rt,
                         shard_settings(cfg, cfg.actor_zero_stage))
    ckpt = StepCheckpoints(cfg, 1, rt, {"actor": engine})
    position, metrics_rows = ckpt.restore(
        {"epoch": 0, "batch": 0, "tokens": 0, "seconds": 0.0, "loss": float("nan")}, resume)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=1),
                      enabled=rt.is_main, keep_rows=metrics_rows)

    start, tokens, loss = time.perf_counter() - position["seconds"], position["tokens"], \
        position["loss"]
    for epoch in range(position["epoch"], sft.epochs):
        for index, examples in epoch_batches(
                train, sft.batch_size, seed=cfg.seed + epoch,
                skip=position["batch"] if epoch == position["epoch"] else 0,
                desc=f"step 1 epoch {epoch + 1}/{sft.epochs}",
                enabled=cfg.logging.progress and rt.is_main):
            mine, weight = rank_rows(examples, rt)
            batch = to_device(collate_sft(mine, tokenizer.pad_token_id), rt.device)
            share = _batch_loss(engine, batch, num_tokens=trained_tokens(examples)) * weight
            engine.backward(share)
            tokens += sum(len(ex.input_ids) for ex in examples)
            grad_norm = engine.step()
            if grad_norm is None:
                continue
            loss = rt.total(share.item())[0]
            if engine.steps % sft.log_every == 0:
                tracker.log({"train/loss": loss, "train/lr": engine.lr,
                             "train/grad_norm": grad_norm, "epoch": epoch}, engine.steps)
            epoch_done = index == steps_per_epoch
            ckpt.save_if_due(engine.steps, {
                "epoch": epoch + epoch_done, "batch": 0 if epoch_done else index,
                "tokens": tokens, "loss": loss, "seconds": time.perf_counter() - start}, tracker)

    engine.eval()
    ppl = perplexity(engine.module, evals, tokenizer.pad_token_id, sft.eval_batch_size,
                     rt) if evals else float("nan")
    elapsed = time.perf_counter() - start
    summary = {"eval/perplexity": ppl, "train/loss": loss, "time/seconds": elapsed,
               "time/tokens_per_s": tokens / elapsed}
    tracker.log(summary, engine.steps)
    tracker.close()
    save_hf(engine.module, tokenizer, Path(cfg.output_dir) / "actor", rt)
    ckpt.clear()
    log(f"step 1 (SFT) done: {engine.steps} steps, final loss {loss:.4f}, "
        f"eval perplexity {ppl:.3f}, {elapsed:.1f}s -> {Path(cfg.output_dir) / 'actor'}")
    return summary
