"""Step 1, supervised fine-tuning: causal-LM loss on the answer tokens of the chosen
responses (sft.train_on_prompt: on the prompt's too); evaluated by perplexity on held-out
pairs."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from engine.data_parallel import DataParallel
from engine.models import (
    add_embedding_noise,
    load_tokenizer,
    position_ids,
    require_positions,
)
from engine.packing import require_packing
from engine.runtime import Runtime
from steps import supervised
from steps.common import (
    batches,
    in_chat_format,
    placement,
    saving_chat_format,
    to_device,
    train_eval_examples,
)
from steps.data import PreferencePair
from steps.rlhf import sft_loss
from steps.tokenize import (
    IGNORE_INDEX,
    SFTExample,
    collate_packed_sft,
    collate_sft,
    tokenize_sft,
)


def trained_tokens(examples: list[SFTExample]) -> int:
    """Tokens the loss is taken over, the answers' (and with sft.train_on_prompt the
    prompts'): the targets after the one-token shift."""
    return sum(sum(label != IGNORE_INDEX for label in ex.labels[1:]) for ex in examples)


def batch_loss(model, batch: dict[str, torch.Tensor], examples: list[SFTExample]
               ) -> tuple[torch.Tensor, dict]:
    """This process's share of the mean answer-token cross entropy over `examples` (the
    whole batch, or the accumulation window it is part of), from its collated rows
    `batch`."""
    if "attention_mask" in batch:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=position_ids(batch["attention_mask"])).logits
    else:   # packed (sft.packing): no cache, or transformers would not read the packing
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       use_cache=False).logits
    return sft_loss(logits, batch["labels"], num_tokens=trained_tokens(examples)), {}


@torch.no_grad()
def perplexity(model, examples: list[SFTExample], pad_token_id: int, batch_size: int,
               dp: DataParallel) -> float:
    """exp of the mean answer-token cross entropy over `examples`."""
    total_loss = 0.0
    for batch in batches(examples, batch_size, shuffle=False, seed=0):
        share = dp.share(batch)
        rows = to_device(collate_sft(share.rows, pad_token_id), dp.device)
        loss, _ = batch_loss(model, rows, share.rows)
        total_loss += float(loss) * trained_tokens(share.rows) * share.weight
    return math.exp(dp.sum(total_loss)[0] / max(trained_tokens(examples), 1))


def run(cfg: DictConfig, pairs: list[PreferencePair], rt: Runtime, resume: bool = False,
        held_out: list[PreferencePair] | None = None) -> dict:
    """Train on `pairs`, evaluate on `held_out` (data.eval_path's pairs; None:
    data.eval_fraction of `pairs`), export."""
    sft = OmegaConf.to_object(cfg.sft)   # an SFTTrainConfig, what the engine takes
    dp, place = DataParallel(rt), placement(cfg, rt)
    tokenizer = saving_chat_format(cfg, load_tokenizer(
        cfg.actor_model, tokenizer=cfg.tokenizer, trust_remote_code=cfg.trust_remote_code))
    owner = f"--actor-model {cfg.actor_model}"
    pairs = in_chat_format(cfg, "step 1", pairs, tokenizer, owner)
    if held_out is not None:
        held_out = in_chat_format(cfg, "step 1 held-out", held_out, tokenizer, owner)
    train, evals = train_eval_examples(cfg, 1, "training examples", pairs, tokenizer,
                                       partial(tokenize_sft, train_on_prompt=sft.train_on_prompt,
                                               multiturn=sft.multiturn,
                                               templated=cfg.data.apply_chat_template),
                                       held_out)

    # trained_head: a reward model's directory here would train a random LM head
    model = place.causal_lm(cfg.actor_model, tokenizer, trained=True, seed=cfg.seed,
                            lora=sft.lora, lora_key="sft.lora", trained_head=True,
                            trust_remote_code=cfg.trust_remote_code)
    require_positions(model, cfg.data.max_prompt_len + cfg.data.max_answer_len,
                      f"data.max_prompt_len={cfg.data.max_prompt_len} + data.max_answer_len="
                      f"{cfg.data.max_answer_len}", f"--actor-model {cfg.actor_model}")
    if sft.packing:
        require_packing(model, "sft.packing=true", f"--actor-model {cfg.actor_model}")
    if sft.neftune_noise_alpha:   # a forward hook: the exported model carries none
        add_embedding_noise(model, sft.neftune_noise_alpha)
    pad = tokenizer.pad_token_id
    task = supervised.Task(
        step=1, name="SFT", role="actor", family="policy", section=sft, examples=train,
        collate=partial(collate_packed_sft if sft.packing else collate_sft, pad_token_id=pad),
        loss=batch_loss,
        tokens=lambda batch: sum(len(ex.input_ids) for ex in batch),
        evaluate=lambda engine: {"eval/perplexity": perplexity(
            engine, evals, pad, sft.eval_batch_size, dp)} if evals else {},
        results=lambda summary: (f"eval perplexity {summary['eval/perplexity']:.3f}" if evals
                                 else supervised.NOT_EVALUATED),
        tokenizer=tokenizer, export_dir=Path(cfg.output_dir) / "actor")
    return supervised.run(cfg, task, model, dp, place, resume)
