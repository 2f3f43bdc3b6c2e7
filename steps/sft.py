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
from steps.data import PreferencePair, collate_sft, tokenize_sft, train_eval_split
from steps.rlhf import sft_loss


def _batch_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=position_ids(batch["attention_mask"])).logits
    return sft_loss(logits, batch["labels"])


@torch.no_grad()
def perplexity(model, examples, pad_token_id: int, batch_size: int, device) -> float:
    """exp of the mean answer-token cross entropy over `examples`."""
    total_loss, total_tokens = 0.0, 0
    for batch in batches(examples, batch_size, shuffle=False, seed=0):
        batch = to_device(collate_sft(batch, pad_token_id), device)
        tokens = int((batch["labels"][:, 1:] != -100).sum())
        total_loss += float(_batch_loss(model, batch)) * tokens
        total_tokens += tokens
    return math.exp(total_loss / max(total_tokens, 1))


def run(cfg: DictConfig, pairs: list[PreferencePair], rt: Runtime) -> dict:
    out = start_step(cfg, 1)
    sft, data = cfg.sft, cfg.data
    tokenizer = load_tokenizer(cfg.actor_model, tokenizer=cfg.tokenizer,
                               trust_remote_code=cfg.trust_remote_code)
    train_pairs, eval_pairs = train_eval_split(pairs, data.eval_fraction, cfg.seed)
    train, stats = tokenize_sft(train_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    report_tokenized("step 1 train", stats, data.max_prompt_len, data.max_answer_len)
    evals, _ = tokenize_sft(eval_pairs, tokenizer, data.max_prompt_len, data.max_answer_len)
    require_examples(1, "training examples", stats, data.max_prompt_len)

    model = load_causal_lm(cfg.actor_model, tokenizer, dtype=rt.dtype, seed=cfg.seed,
                           trust_remote_code=cfg.trust_remote_code)
    if cfg.engine.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model = apply_lora(model, lora_settings(sft.lora))
    steps_per_epoch = num_batches(len(train), sft.batch_size)
    engine = TrainEngine(model, optim_settings(sft, sft.lr, sft.lora),
                         sft.epochs * steps_per_epoch // sft.grad_accum, rt)
    tracker = Tracker(out, wandb_settings=cfg.logging.wandb, config=dict(step=1))

    start, tokens = time.perf_counter(), 0
    for epoch in range(sft.epochs):
        epoch_batches = batches(train, sft.batch_size, shuffle=True, seed=cfg.seed + epoch)
        bar = progress(epoch_batches, desc=f"step 1 epoch {epoch + 1}/{sft.epochs}",
                       total=steps_per_epoch, enabled=cfg.logging.progress)
        for examples in bar:
            batch = to_device(collate_sft(examples, tokenizer.pad_token_id), rt.device)
            loss = _batch_loss(engine, batch)
            engine.backward(loss)
            tokens += int(batch["attention_mask"].sum())
            grad_norm = engine.step()
            if grad_norm is not None and engine.steps % sft.log_every == 0:
                tracker.log({"train/loss": loss.item(), "train/lr": engine.lr,
                             "train/grad_norm": grad_norm, "epoch": epoch}, engine.steps)

    engine.eval()
    ppl = perplexity(engine.module, evals, tokenizer.pad_token_id, sft.eval_batch_size,
                     rt.device) if evals else float("nan")
    elapsed = time.perf_counter() - start
    summary = {"eval/perplexity": ppl, "train/loss": loss.item(), "time/seconds": elapsed,
               "time/tokens_per_s": tokens / elapsed}
    tracker.log(summary, engine.steps)
    tracker.close()
    save_hf(engine.module, tokenizer, Path(cfg.output_dir) / "actor")
    log(f"step 1 (SFT) done: {engine.steps} steps, final loss {loss.item():.4f}, "
        f"eval perplexity {ppl:.3f}, {elapsed:.1f}s -> {Path(cfg.output_dir) / 'actor'}")
    return summary
