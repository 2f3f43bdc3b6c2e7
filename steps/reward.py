"""Step 2, reward model: a one-label sequence classifier trained on preference pairs with
-log sigmoid(r_chosen - r_rejected), the score read at the last real token."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from engine.data_parallel import DataParallel
from engine.models import load_tokenizer, require_positions
from engine.packing import require_packing
from engine.runtime import Runtime
from steps import supervised
from steps.common import (
    batches,
    in_chat_format,
    placement,
    require_trained_format,
    saving_chat_format,
    to_device,
    train_eval_examples,
)
from steps.data import PreferencePair
from steps.rlhf import pairwise_reward_loss
from steps.tokenize import (
    PairExample,
    collate_packed_pairs,
    collate_pairs,
    tokenize_preferences,
)


def pair_loss(model, batch: dict[str, torch.Tensor], examples: list[PairExample],
              center_coef: float = 0.0) -> tuple[torch.Tensor, dict]:
    """This process's share of the pairwise loss (with its pairs' margins and
    rm.center_rewards_coef's term) and accuracy over `examples` (the batch, or its
    accumulation window); `batch` holds its chosen rows, then its rejected rows (packed:
    its sequences, their ends in that order)."""
    if "attention_mask" in batch:
        scores = model.sequence_scores(batch["input_ids"], batch["attention_mask"])
    else:   # packed (rm.packing)
        scores = model.packed_scores(batch["input_ids"], batch["position_ids"], batch["ends"])
    chosen, rejected = scores.chunk(2)
    out = pairwise_reward_loss(chosen, rejected, len(examples), center_coef,
                               batch.get("margins"))
    return out.loss, {"train/accuracy": out.accuracy}


@torch.no_grad()
def evaluate(model, examples: list[PairExample], pad_token_id: int, batch_size: int,
             dp: DataParallel) -> dict[str, float]:
    """Accuracy and mean chosen/rejected scores over held-out pairs, and the mean and
    (population) std of all 2n scores: what ppo.normalize_reward standardises by."""
    correct = chosen_sum = rejected_sum = squares = 0.0
    for batch in batches(examples, batch_size, shuffle=False, seed=0):
        share = dp.share(batch)
        rows = to_device(collate_pairs(share.rows, pad_token_id), dp.device)
        scores = model.sequence_scores(rows["input_ids"], rows["attention_mask"]).double()
        c, r = scores.chunk(2)
        correct += float((c > r).sum()) * share.weight
        chosen_sum += float(c.sum()) * share.weight
        rejected_sum += float(r.sum()) * share.weight
        squares += float((scores ** 2).sum()) * share.weight
    correct, chosen_sum, rejected_sum, squares = dp.sum(correct, chosen_sum, rejected_sum,
                                                        squares)
    n = len(examples)
    mean = (chosen_sum + rejected_sum) / (2 * n)
    return {"eval/accuracy": correct / n, "eval/chosen_score": chosen_sum / n,
            "eval/rejected_score": rejected_sum / n, "eval/score_mean": mean,
            "eval/score_std": math.sqrt(max(squares / (2 * n) - mean ** 2, 0.0))}


def normalization_fields(summary: dict[str, float]) -> dict[str, float]:
    """The exported reward model's config.json fields that step 3's ppo.normalize_reward
    reads: its held-out scores' mean and std (none without held-out pairs)."""
    if "eval/score_mean" not in summary:
        return {}
    return {"score_mean": summary["eval/score_mean"], "score_std": summary["eval/score_std"]}


def template_tokenizer(cfg: DictConfig) -> tuple[object, str]:
    """(tokenizer, what to call its model) whose chat template step 2 renders with: step
    3's actor's, the format the reward model will score, where that model is already saved
    (step 1's, with the format it trained in: the hh one when step 1 ran without
    data.apply_chat_template), else --actor-model's (that step 1 will train); given
    data.chat_template_kwargs, as steps 1 and 3 give theirs."""
    actor = cfg.ppo.actor_path or str(Path(cfg.output_dir) / "actor")
    if (Path(actor).expanduser() / "config.json").exists():
        owner = f"the actor {actor}"
        tokenizer = load_tokenizer(actor, flag="ppo.actor_path",
                                   trust_remote_code=cfg.trust_remote_code)
    else:
        owner = f"--actor-model {cfg.actor_model}"
        tokenizer = load_tokenizer(cfg.actor_model, tokenizer=cfg.tokenizer,
                                   trust_remote_code=cfg.trust_remote_code)
    return saving_chat_format(cfg, tokenizer), owner


def run(cfg: DictConfig, pairs: list[PreferencePair], rt: Runtime, resume: bool = False,
        held_out: list[PreferencePair] | None = None) -> dict:
    """Train on `pairs`, evaluate on `held_out` (data.eval_path's pairs; None:
    data.eval_fraction of `pairs`), export."""
    rm = OmegaConf.to_object(cfg.rm)   # a RewardTrainConfig, what the engine takes
    dp, place = DataParallel(rt), placement(cfg, rt)
    tokenizer = load_tokenizer(cfg.reward_model, tokenizer=cfg.tokenizer, flag="--reward-model",
                               trust_remote_code=cfg.trust_remote_code)
    if cfg.data.apply_chat_template:   # the actor's: the format the reward model will score
        template = template_tokenizer(cfg)
        pairs = in_chat_format(cfg, "step 2", pairs, *template)
        if held_out is not None:
            held_out = in_chat_format(cfg, "step 2 held-out", held_out, *template)
    elif (Path(cfg.output_dir) / "actor" / "config.json").exists():
        actor = str(Path(cfg.output_dir) / "actor")
        require_trained_format(cfg, load_tokenizer(actor, flag="ppo.actor_path"), actor,
                               "step 2")
    train, evals = train_eval_examples(cfg, 2, "training pairs", pairs, tokenizer,
                                       tokenize_preferences, held_out)

    model = place.reward_model(cfg.reward_model, tokenizer, trained=True, seed=cfg.seed + 1,
                               lora=rm.lora, lora_key="rm.lora",
                               trust_remote_code=cfg.trust_remote_code)
    require_positions(model, cfg.data.max_prompt_len + cfg.data.max_answer_len,
                      f"data.max_prompt_len={cfg.data.max_prompt_len} + data.max_answer_len="
                      f"{cfg.data.max_answer_len}", f"--reward-model {cfg.reward_model}")
    if rm.packing:
        require_packing(model, "rm.packing=true", f"--reward-model {cfg.reward_model}")
    pad = tokenizer.pad_token_id
    task = supervised.Task(
        step=2, name="reward model", role="reward", family="scorer", section=rm, examples=train,
        collate=partial(collate_packed_pairs if rm.packing else collate_pairs, pad_token_id=pad),
        loss=partial(pair_loss, center_coef=rm.center_rewards_coef),
        tokens=lambda batch: sum(len(ex.chosen_ids) + len(ex.rejected_ids) for ex in batch),
        evaluate=lambda engine: evaluate(engine, evals, pad, rm.eval_batch_size, dp)
        if evals else {},
        results=lambda summary: (f"eval accuracy {summary['eval/accuracy']:.3f} (chosen "
                                 f"{summary['eval/chosen_score']:.3f} vs rejected "
                                 f"{summary['eval/rejected_score']:.3f})" if evals
                                 else supervised.NOT_EVALUATED),
        tokenizer=tokenizer, export_dir=Path(cfg.output_dir) / "reward",
        export_config=normalization_fields)
    return supervised.run(cfg, task, model, dp, place, resume)
