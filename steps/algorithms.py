"""Step 3's algorithms, what each one is (its estimator is steps/ppo.py's), and the rules
between step-3 keys. Light to import, without torch or transformers: train.py checks a run
here before it starts its processes."""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from omegaconf import DictConfig, ListConfig, OmegaConf

from engine.errors import UserError

RewardFn = Callable[[str, str], float]


class Algorithm(NamedTuple):
    name: str                     # as the log writes it
    critic: bool                  # trains a critic (PPO's value model)
    groups: bool                  # compares the answers to one prompt: samples_per_prompt >= 2
    kl_in_loss: bool              # where ppo.kl_penalty=auto puts the KL: a loss term
    pairs: bool = False           # trains on each group's best and worst answers as a
                                  # preference pair, by DPO's loss: its beta is the KL's weight


ALGORITHMS = {
    "ppo": Algorithm("PPO", critic=True, groups=False, kl_in_loss=False),
    "grpo": Algorithm("GRPO", critic=False, groups=True, kl_in_loss=True),
    "rloo": Algorithm("RLOO", critic=False, groups=True, kl_in_loss=False),
    "reinforce_pp": Algorithm("REINFORCE++", critic=False, groups=False, kl_in_loss=False),
    "reinforce_pp_baseline": Algorithm("REINFORCE++-baseline", critic=False, groups=True,
                                       kl_in_loss=False),
    # Guo et al., 2024 (TRL's OnlineDPOTrainer); OpenRLHF's iterative DPO ranks best of n
    "online_dpo": Algorithm("online DPO", critic=False, groups=True, kl_in_loss=False,
                            pairs=True),
}
# trained offline on preference pairs (steps/dpo.py): no sampling, reward model or critic
OFFLINE = ("dpo",)
CRITIC_FREE = tuple(key for key, algorithm in ALGORITHMS.items() if not algorithm.critic)


def load_reward_fn(spec: str, key: str = "ppo.reward_fn") -> RewardFn:
    """The callable that `spec` ("package.module:function") names."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UserError(f"{key}={spec}: give package.module:function, e.g. steps.demo:score")
    try:
        source = importlib.import_module(module_name)
    except Exception as why:   # a broken module raises anything at import
        raise UserError(f"{key}={spec}: cannot import {module_name} ({type(why).__name__}: "
                        f"{why}); is it on PYTHONPATH?") from None
    fn = getattr(source, attribute, None)
    if not callable(fn):
        raise UserError(f"{key}={spec}: {module_name} has no function {attribute}")
    return fn


def model_paths(cfg: DictConfig, made: tuple[int, ...] = ()) -> tuple[str, str | None]:
    """Step 3's actor and reward-model directories (None: no reward model), each refused in
    one line when it holds no model: the actor may be a preset instead (random weights: a
    shape probe, e.g. llama-70b). `made`: the steps this run trains first (train.py checks
    before step 1), whose outputs (<output_dir>/actor, /reward) count as there, however a
    key spells them (the critic may start from the step-1 actor)."""
    from engine.model_source import is_preset, models_inside, require_weight_files

    out, ppo = Path(cfg.output_dir), cfg.ppo
    actor_path = ppo.actor_path or str(out / "actor")
    offline = ppo.algorithm in OFFLINE
    reward_path = (ppo.reward_path or str(out / "reward")) \
        if ppo.reward_model_weight != 0 and not offline else None
    critic_path = ppo.critic_path if not offline and ALGORITHMS[ppo.algorithm].critic else None
    to_come = {_resolved(out / name) for step, name in ((1, "actor"), (2, "reward"))
               if step in made}
    extras = [(path, "reward model", f"ppo.extra_reward_paths[{i}]")
              for i, path in enumerate(ppo.extra_reward_paths if reward_path else [])]
    for path, what, key in ((actor_path, "step-1 actor", "ppo.actor_path"),
                            (reward_path, "step-2 reward model", "ppo.reward_path"),
                            (critic_path, "critic's starting model", "ppo.critic_path"),
                            *extras):
        # a preset actor or critic is a shape probe (random weights); a reward model is not
        if path is None or ("reward" not in key and is_preset(path)) \
                or _resolved(path) in to_come:
            continue
        if (_expanded(path) / "config.json").exists():
            require_weight_files(path, f"{key}=")
            continue
        if key.startswith("ppo.extra") or OmegaConf.select(cfg, key):   # the user's own path
            raise UserError(f"{key}={path}: no config.json there, so not a Hugging Face "
                            f"model directory; check the path{models_inside(path)}")
        alone = (" (or ppo.reward_model_weight=0 to reward with ppo.reward_fn alone)"
                 if key == "ppo.reward_path" else "")
        raise UserError(f"step 3 needs the {what} at {path}: run its step first "
                        f"(--step 1 2 3) or set {key}=DIR{alone}")
    if ppo.normalize_reward and reward_path is not None:
        _require_score_statistics(cfg, reward_path, _resolved(reward_path) in to_come)
        for path, _, key in extras:
            _require_score_statistics(cfg, path, _resolved(path) in to_come, key)
    return actor_path, reward_path


def _require_score_statistics(cfg: DictConfig, reward_path: str, to_come: bool,
                              key: str = "ppo.reward_path") -> None:
    """ppo.normalize_reward's statistics, checked before step 1: step 2 of this run writes
    them where it holds pairs out; a reward model on disk has them in its config.json (a
    hub name's are checked as step 3 loads it)."""
    if to_come:
        if cfg.data.eval_fraction == 0:
            raise UserError("ppo.normalize_reward=true standardises by the reward model's "
                            "scores on step 2's held-out pairs, and data.eval_fraction=0 "
                            "holds none out: give data.eval_fraction > 0 (e.g. 0.05)")
        return
    try:
        config = json.loads((_expanded(reward_path) / "config.json").read_text())
    except (OSError, ValueError):   # none, or unreadable: the loader says what is wrong
        return
    if isinstance(config, dict):
        score_statistics(config, f"{key} {reward_path}")


def score_statistics(config: dict, where: str) -> tuple[float, float]:
    """(mean, std) of a reward model's scores, from its config.json (`config`, as a dict):
    step 2's score_mean and score_std, or OpenRLHF's mean and std; refused in one line
    naming `where` (the model) when it has none, or a std that cannot divide."""
    for mean_key, std_key in (("score_mean", "score_std"), ("mean", "std")):
        mean, std = config.get(mean_key), config.get(std_key)
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (mean, std)):
            break
    else:
        raise UserError(f"ppo.normalize_reward=true: the reward model {where} has no score "
                        "statistics in its config.json (score_mean and score_std, which step "
                        "2 writes from its held-out pairs): train it with step 2 and "
                        "data.eval_fraction > 0, or set ppo.normalize_reward=false")
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise UserError(f"ppo.normalize_reward=true: the reward model {where} has "
                        f"{mean_key}={mean}, {std_key}={std} in its config.json; a finite "
                        "mean and a std above 0 are needed (a reward model that scores "
                        "every answer alike cannot be standardised): set "
                        "ppo.normalize_reward=false")
    return float(mean), float(std)


def _expanded(path: str | Path) -> Path:
    """`path` with ~ expanded as the loader expands it (as it is where ~user is unknown)."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        return Path(path)


def _resolved(path: str | Path) -> Path:
    return _expanded(path).resolve()


# What ppo.algorithm=dpo does not read, and what to do instead: set, it would be ignored
NOT_READ_BY_DPO = {
    "ppo.prompt_data": "it trains on step 3's share of data.path's pairs (KTO: or on "
                       "data.feedback_path's feedback)",
    "ppo.eval_prompt_data": "its held-out pairs are data.eval_path's, or data.eval_fraction "
                            "of its share",
    "ppo.reward_path": "it reads no reward model",
    "ppo.extra_reward_paths": "it reads no reward model",
    "ppo.critic_path": "it trains no critic",
    "ppo.reward_fn": "it samples nothing to reward (ppo.eval_reward_fn scores its "
                     "evaluations)",
    "ppo.ptx.enabled": "it takes no pretraining loss; dpo.nll_coef adds the chosen answers' "
                       "cross entropy",
    "ppo.actor_lora.dim": "its LoRA is dpo.lora's",
    "ppo.ema.enabled": "its EMA is dpo.ema's",
    "ppo.export": "its export is dpo.export's",
    "ppo.export_weights": "it exports the actor merged, a plain Hugging Face directory",
}


# the dpo keys that only some of its losses read
DPO_LOSS_KEYS = {"label_smoothing": ("sigmoid",), "simpo_gamma": ("simpo",),
                 "desirable_weight": ("kto",), "undesirable_weight": ("kto",)}


def check_dpo(cfg: DictConfig) -> None:
    """Refuse the step-3 keys that DPO would ignore (NOT_READ_BY_DPO), set to other than
    their defaults, each named with what DPO reads instead."""
    from steps.config import DEFAULTS, as_yaml

    for key, instead in NOT_READ_BY_DPO.items():
        value = OmegaConf.select(cfg, key)
        if value != DEFAULTS[key] and not (key == "ppo.export" and value == "last"):
            shown = as_yaml(list(value) if isinstance(value, ListConfig) else value)
            raise UserError(f"{key}={shown}: ppo.algorithm=dpo does not read it ({instead}); "
                            "drop it, or choose another ppo.algorithm")
    for key, losses in DPO_LOSS_KEYS.items():
        value = cfg.dpo[key]
        if value != DEFAULTS[f"dpo.{key}"] and cfg.dpo.loss not in losses:
            raise UserError(f"dpo.{key}={value} is read by dpo.loss={' or '.join(losses)} "
                            f"only, not by dpo.loss={cfg.dpo.loss}: drop it, or choose that loss")
    if cfg.data.feedback_path and cfg.dpo.loss != "kto":
        raise UserError(f"data.feedback_path holds unpaired feedback, which only dpo.loss=kto "
                        f"trains on, not dpo.loss={cfg.dpo.loss}: set dpo.loss=kto, or give "
                        "pairs in data.path")
    if cfg.dpo.export == "best" and not (cfg.dpo.eval_every and cfg.dpo.eval_prompts):
        raise UserError(f"dpo.export=best chooses among the evaluations by their KL: give "
                        f"dpo.eval_every > 0 (it is {cfg.dpo.eval_every}) and dpo.eval_prompts "
                        f"> 0 (it is {cfg.dpo.eval_prompts})")


# online DPO's loss has no advantage, ratio clip or token aggregation, and its KL is beta's
NOT_READ_BY_ONLINE_DPO = {
    "clip_range_high": "its loss has no ratio to clip",
    "dual_clip": "its loss has no ratio to clip",
    "kl_target": "the DPO loss's ppo.dpo_beta weighs the KL: there is no penalty to control",
}


def check_online_dpo(ppo) -> None:
    """Refuse what online DPO would ignore or cannot do, naming the key."""
    for key, why in NOT_READ_BY_ONLINE_DPO.items():
        if getattr(ppo, key) not in (None, 0):
            raise UserError(f"ppo.{key}={getattr(ppo, key)} is not read by "
                            f"ppo.algorithm=online_dpo ({why}): drop it")
    for key, value, default in (("kl_penalty", ppo.kl_penalty, "auto"),
                                ("importance_ratio", ppo.importance_ratio, "token"),
                                ("loss_aggregation", ppo.loss_aggregation, "token-mean")):
        if value != default:
            raise UserError(f"ppo.{key}={value} is not read by ppo.algorithm=online_dpo "
                            f"(its loss is one per pair, its KL ppo.dpo_beta's): drop it")
    if ppo.entropy_coef:
        raise UserError(f"ppo.entropy_coef={ppo.entropy_coef}: online DPO's loss is one per "
                        "pair and takes no entropy bonus; set ppo.entropy_coef=0")
    if ppo.dpo_loss == "kto":   # each answer alone: neither a pair nor a group to keep whole
        return
    if ppo.mask_truncated:
        raise UserError("ppo.mask_truncated=true would leave a pair with one answer: with "
                        "ppo.algorithm=online_dpo give ppo.missing_eos_penalty (e.g. 1.0), so "
                        "that a cut-off answer loses its pair instead (or ppo.dpo_loss=kto, "
                        "whose answers train alone)")
    group = ppo.samples_per_prompt
    for key in ("micro_batch_size", "forward_batch_size"):
        size = getattr(ppo, key)
        if size is not None and size % group:
            raise UserError(f"ppo.{key}={size}: online DPO pairs the answers to one prompt, "
                            f"so give a multiple of ppo.samples_per_prompt ({group})")


def check_settings(ppo, quantized_base: bool = False) -> None:
    """Refuse step-3 settings that cannot work together, naming the keys (each key's own
    range is the schema's: steps/config.py). `quantized_base`: the actor's base is frozen
    integers (engine.quantized_base.enabled)."""
    if ppo.export_weights == "adapter" and not (
            ppo.actor_lora.dim > 0 and (quantized_base or ppo.actor_lora.only_optimize_lora)):
        raise UserError("ppo.export_weights=adapter writes LoRA's weights alone: give the actor "
                        "a LoRA over a frozen base (ppo.actor_lora.dim=8 and "
                        "ppo.actor_lora.only_optimize_lora=true, or a quantized base)")
    if ALGORITHMS[ppo.algorithm].groups and ppo.samples_per_prompt < 2:
        raise UserError(f"ppo.samples_per_prompt={ppo.samples_per_prompt}: {ppo.algorithm} "
                        "compares the answers to one prompt; give 2 or more (e.g. 4)")
    if ALGORITHMS[ppo.algorithm].pairs:
        check_online_dpo(ppo)
    else:
        for key in ("dpo_beta", "dpo_loss"):
            if getattr(ppo, key) is not None:
                raise UserError(f"ppo.{key} sets online DPO's loss, and ppo.algorithm="
                                f"{ppo.algorithm} does not read it: drop it, or set "
                                "ppo.algorithm=online_dpo (offline DPO: the dpo section)")
    if ppo.dynamic_sampling and not ALGORITHMS[ppo.algorithm].groups:
        raise UserError(f"ppo.dynamic_sampling drops the prompts whose answers all score the "
                        f"same, which only a group algorithm learns nothing from: set "
                        f"ppo.algorithm=grpo, rloo or reinforce_pp_baseline (not {ppo.algorithm})")
    if ppo.critic_warmup and not ALGORITHMS[ppo.algorithm].critic:
        raise UserError(f"ppo.critic_warmup={ppo.critic_warmup} trains the critic alone "
                        f"first, and {ppo.algorithm} has none: set ppo.critic_warmup=0 or "
                        "ppo.algorithm=ppo")
    if ppo.reward_fn:
        load_reward_fn(ppo.reward_fn)
    elif ppo.reward_model_weight == 0:
        raise UserError("ppo.reward_model_weight=0 leaves nothing to reward: set ppo.reward_fn")
    if ppo.extra_reward_paths and ppo.reward_model_weight == 0:
        raise UserError("ppo.extra_reward_paths are scored with the reward model, and "
                        "ppo.reward_model_weight=0 uses none: set one of them back")
    if ppo.normalize_reward and ppo.reward_model_weight == 0:
        raise UserError("ppo.normalize_reward=true standardises the reward model's scores, and "
                        "ppo.reward_model_weight=0 uses no reward model: set one of them back")
    if ppo.eval_reward_fn:
        load_reward_fn(ppo.eval_reward_fn, "ppo.eval_reward_fn")
    if ppo.overlong_buffer is not None and ppo.overlong_buffer > ppo.max_new_tokens:
        raise UserError(f"ppo.overlong_buffer={ppo.overlong_buffer}: give at most "
                        f"ppo.max_new_tokens ({ppo.max_new_tokens}) tokens")
    if ppo.micro_batch_size > ppo.rollout_batch_size * ppo.samples_per_prompt:
        raise UserError("ppo.micro_batch_size must not exceed the answers of a round "
                        "(ppo.rollout_batch_size x ppo.samples_per_prompt)")
