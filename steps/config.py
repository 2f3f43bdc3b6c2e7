"""A run's config: every key, its type, its default and its one-line comment, in one tree
(the engine's groups are engine/config.py's, composed here). Defaults follow
DeepSpeed-Chat's settings for OPT-1.3B-class actors; configs/recipe/ holds override files
(`demo`, which train.py picks when given no model, scales them down).
Hydra composes configs/config.yaml (this schema, then a recipe) and the command line onto
it, so an unknown key or a value of the wrong type (`ppo.kl_coef=abc`) is refused before
anything runs; `listing()` is what `train.py --help` prints."""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional  # noqa: UP035 - OmegaConf's schema needs Optional

from hydra.core.config_store import ConfigStore

from engine.chat_format import RENDER_NAMES, settable
from engine.config import (
    COUNT,
    FINITE,
    LEARNING_RATE,
    NON_NEGATIVE,
    POSITIVE,
    SCHEDULERS,
    EngineConfig,
    LoraConfig,
    OptimConfig,
    Rule,
    above,
    each,
    one_of,
    val,
    within,
)


@dataclass
class DataConfig:
    path: list[str] = val(["Dahoas/rm-static"], "files (.json .jsonl .jsonl.gz .parquet), "
                          'dirs, hub names, or "demo"')
    prompt_key: str = val("prompt", "the records' prompt field (absent: hh-rlhf transcripts "
                          "or whole dialogues in chosen/rejected)")
    chosen_key: str = val("chosen", "the records' preferred answer (or dialogue) field")
    rejected_key: str = val("rejected", "the records' other answer (or dialogue) field")
    margin_key: Optional[str] = val(None, "the records' field of how far chosen is preferred "  # noqa: UP045
                                    "(a number; Llama 2's margin, TRL's margin column): step "
                                    "2's loss is -log sigmoid(r_chosen - r_rejected - margin); "
                                    "null: no margins")
    sft_path: list[str] = val([], "step 1's examples from these sources (every record: a "
                              "prompt and its answer), not its share of data.path")
    sft_prompt_key: str = val("${data.prompt_key}", "sft_path's prompt field (text or "  # type: ignore[assignment]
                              "messages)")
    sft_answer_key: str = val("response", "sft_path's answer field (absent: whole dialogues "
                              "in sft_prompt_key)")
    sft_input_key: Optional[str] = val("input", "sft_path's input field (Alpaca's), joined "  # noqa: UP045
                                       "to a text prompt after a blank line; null: not read")
    feedback_path: list[str] = val([], "dpo.loss=kto's step-3 data from these sources, not "
                                   "its share of data.path's pairs: unpaired feedback, each "
                                   "record a prompt, one answer and whether it is desirable "
                                   "(TRL's unpaired preference format)")
    feedback_prompt_key: str = val("${data.prompt_key}", "feedback_path's prompt field (text "  # type: ignore[assignment]
                                   "or messages)")
    feedback_completion_key: str = val("completion", "feedback_path's answer field (text, or "
                                       "one assistant message)")
    feedback_label_key: str = val("label", "feedback_path's label field: true/false (or 1/0), "
                                  "whether the answer is desirable")
    split: list[float] = val([2.0, 4.0, 4.0], "share of every source for steps 1, 2, 3",
                             each(NON_NEGATIVE))
    eval_path: list[str] = val([], "steps 1 and 2's (and DPO's step 3's) held-out pairs "
                               "from these sources (every record, read as data.path's; e.g. "
                               "a test split), not data.eval_fraction of their training pairs (OpenRLHF's "
                               "--eval_dataset)")
    eval_split: str = val("test", "the split data.eval_path and ppo.eval_prompt_data read of "
                          "sources that hold splits: hub datasets, save_to_disk "
                          "DatasetDicts, directories of split-named files (the training "
                          "keys read train)")
    eval_fraction: float = val(0.05, "held out of each step's share for evaluation (but "
                               "where data.eval_path / ppo.eval_prompt_data give them)",
                               within(0, 1, high_open=True))
    max_samples: int = val(0, "each step trains on at most this many of its examples (step "
                           "3: prompts), a seeded random choice of those that pass the length "
                           "filters; 0: all (OpenRLHF's --max_samples)", NON_NEGATIVE)
    max_prompt_len: int = val(256, "longer prompts are dropped (and counted)", COUNT)
    max_answer_len: int = val(256, "longer answers are truncated", COUNT)
    apply_chat_template: bool = val(False, "render dialogues by the actor tokenizer's chat "
                                    "template (else hh-rlhf text); saved with the model")
    # Any, not a dict: Hydra merges an override into a dict field, and refuses new keys
    chat_template_kwargs: Any = val(None, "variables the chat template reads, e.g. "
                                    "{enable_thinking: false} (Qwen3); saved in the model's "
                                    "template",
                                    Rule(settable, "give a mapping of variable names to "
                                         "values (finite numbers), e.g. {enable_thinking: "
                                         "false} (not " + " or ".join(RENDER_NAMES) +
                                         ": the steps set those)"))
    demo_pairs: int = val(4000, "size of the built-in demo data set", COUNT)
    demo_task: str = val("digits", 'what "demo" generates: digits | distinct | pick '
                         '(steps/demo.py)')


@dataclass
class LaunchConfig:
    nnodes: int = val(1, ok=COUNT)
    node_rank: Optional[int] = val(None, "this node's rank (default 0, or its place in the "  # noqa: UP045
                                   "hostfile)", NON_NEGATIVE)
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    hostfile: Optional[str] = val(None, 'DeepSpeed-style "host slots=N" lines: sets nnodes, '  # noqa: UP045
                                  "master_addr, procs")


@dataclass
class TrainConfig(OptimConfig):
    """Step 1 (SFT) and step 2 (reward model) share this shape."""

    epochs: int = val(1, ok=COUNT)
    batch_size: int = val(8, "examples (step 2: pairs) per micro-batch", COUNT)
    grad_accum: int = val(1, ok=COUNT)
    lr: float = val(9.65e-6, ok=LEARNING_RATE)
    eval_batch_size: int = val(16, ok=COUNT)
    eval_every: int = val(0, "optimizer steps between evaluations on the held-out examples "
                          "(logged as eval/*, and said); 0: after training only",
                          NON_NEGATIVE)
    log_every: int = val(10, ok=COUNT)
    packing: bool = val(False, "pack each micro-batch's examples into rows as wide as its "
                        "longest, attention kept within each (no padding between): fewer "
                        "tokens through the model where lengths vary; llama, mistral, qwen2/3, "
                        "gemma, phi3, gpt_neox, falcon and gpt2 models, sdpa or eager attention")
    lora: LoraConfig = val(LoraConfig)


@dataclass
class SFTTrainConfig(TrainConfig):
    """Step 1's: the shared shape, and what only SFT takes."""

    neftune_noise_alpha: float = val(0.0, "NEFTune (Jain et al., 2023; TRL's "
                                     "neftune_noise_alpha, e.g. 5): uniform noise of "
                                     "alpha / sqrt(tokens x hidden) on the input embeddings "
                                     "while training (not evaluating); 0: off", NON_NEGATIVE)
    train_on_prompt: bool = val(False, "the loss (and the evaluation's perplexity) over the "
                                "prompt's tokens too, not the answer's alone (OpenRLHF's "
                                "--pretrain_mode, TRL's completion_only_loss=false)")
    multiturn: bool = val(False, "in dialogues of several turns, the loss over every "
                          "assistant reply, not the last alone (OpenRLHF's --multiturn, TRL's "
                          "assistant_only_loss): the user's turns are still not trained on")


@dataclass
class RewardTrainConfig(TrainConfig):
    """Step 2's: step 1's shape, and what only a reward model's loss takes."""

    center_rewards_coef: float = val(0.0, "adds this x mean((r_chosen + r_rejected)^2) to "
                                     "the loss, holding the scores near 0 (Eisenstein et al., "
                                     "2023; TRL's center_rewards_coefficient, e.g. 0.01): the "
                                     "pairwise loss sees only differences; 0: off",
                                     NON_NEGATIVE)


@dataclass
class EmaConfig:
    enabled: bool = False
    beta: float = val(0.992, ok=within(0, 1, high_open=True))


@dataclass
class DPOTrainConfig(TrainConfig):
    """Step 3's with ppo.algorithm=dpo: step 1's shape, and what only DPO's loss takes."""

    beta: float = val(0.1, "how far the policy may move from the reference (step 1's "
                      "actor): an answer's implicit reward is beta x log(pi / pi_ref)",
                      POSITIVE)
    loss: str = val("sigmoid", "sigmoid: DPO (Rafailov et al., 2023) | ipo: IPO (Azar et al., "
                    "2023) | hinge: SLiC (Zhao et al., 2023) | simpo: SimPO (Meng et al., "
                    "2024; e.g. beta 2, simpo_gamma 1) | orpo: ORPO (Hong et al., 2024; with "
                    "nll_coef 1, as its paper) | kto: KTO (Ethayarajh et al., 2024; each "
                    "pair's chosen answer desirable, its rejected one undesirable); ipo, "
                    "simpo and orpo on per-token mean log-probs, simpo and orpo without a "
                    "reference",
                    one_of("sigmoid", "ipo", "hinge", "simpo", "orpo", "kto"))
    label_smoothing: float = val(0.0, "sigmoid: the chance that a pair's label is wrong "
                                 "(cDPO; TRL's label_smoothing, OpenRLHF's "
                                 "--label_smoothing); 0: labels trusted",
                                 within(0, 0.5, high_open=True))
    simpo_gamma: float = val(0.5, "simpo: the margin the chosen answer's reward must pass "
                             "(TRL's simpo_gamma)", NON_NEGATIVE)
    desirable_weight: float = val(1.0, "kto: the weight of a desirable (chosen) answer's "
                                  "loss (TRL's desirable_weight; the paper keeps desirable "
                                  "x its count / (undesirable x its count) within 1 to 4/3)",
                                  POSITIVE)
    undesirable_weight: float = val(1.0, "kto: the weight of an undesirable (rejected) "
                                    "answer's loss (TRL's undesirable_weight)", POSITIVE)
    nll_coef: float = val(0.0, "adds this x the chosen answers' token cross entropy (RPO, "
                          "Pang et al., 2024; OpenRLHF's --nll_loss_coef); 0: off",
                          NON_NEGATIVE)
    export: str = val("last", "last: the policy it ends with | best: the evaluated policy "
                      "(every eval_every updates, the start included) with the highest "
                      "ground truth (else accuracy) whose sampled answers' KL is within "
                      "ppo.kl_budget (null: best-of-n's, as PPO's export=best)",
                      one_of("last", "best"))
    eval_prompts: int = val(64, "held-out pairs whose prompts get sampled answers (their KL to "
                            "the reference measured, which is kept for it) and greedy ones, "
                            "both scored by the ground truth (ppo.eval_reward_fn, or the "
                            "demo's) at every evaluation; 0: none, and the reference is "
                            "dropped once its log-probs are computed", NON_NEGATIVE)
    ema: EmaConfig = val(EmaConfig, "an exponential moving average of the policy's weights "
                         "over the updates (beta: the old average's share at each), exported "
                         "beside it as step3/actor_ema, as ppo.ema's")


@dataclass
class PtxConfig:
    enabled: bool = False
    coef: float = val(27.8, ok=NON_NEGATIVE)
    batch_size: int = val(8, ok=COUNT)


@dataclass
class PPOConfig(OptimConfig):
    actor_path: Optional[str] = val(None, "default: <output_dir>/actor (step 1)")  # noqa: UP045
    reward_path: Optional[str] = val(None, "default: <output_dir>/reward (step 2); the "  # noqa: UP045
                                     "critic starts from it")
    critic_path: Optional[str] = val(None, "PPO's critic starts from this model directory "  # noqa: UP045
                                     "or preset instead (a small critic for a big actor; "
                                     "the actor's tokenizer); default: the reward model if "
                                     "it shares the actor's tokenizer, else the actor")
    prompt_data: list[str] = val([], "step 3's prompts from these sources (files, dirs, hub "
                                 "names; every record), not its share of data.path")
    eval_prompt_data: list[str] = val([], "step 3's held-out prompts from these sources "
                                      "(every record, read as prompt_data's, labels and "
                                      "all), not data.eval_fraction of its prompts")
    prompt_key: str = val("${data.prompt_key}", "prompt_data's field holding a prompt (text "  # type: ignore[assignment]
                          "or messages)")
    label_key: str = val("label", "prompt_data's field passed as label= to reward_fn and "
                         "eval_reward_fn (e.g. a reference answer)")
    epochs: int = val(1, "passes over the step-3 prompts", COUNT)
    rollout_batch_size: int = val(8, "prompts per generation round", COUNT)
    ppo_epochs: int = val(1, "optimisation passes over each round's experience", COUNT)
    micro_batch_size: int = val(8, "answers per optimizer step", COUNT)
    packing: bool = val(False, "the experience's and the update's forwards (actor, "
                        "reference, critic, reward model) run each chunk's rollouts "
                        "without their padding, packed into rows as wide as the longest, "
                        "attention kept within each: fewer tokens through the models where "
                        "prompt and answer lengths vary; the model types sft.packing takes")
    forward_batch_size: Optional[int] = val(None, "answers per forward pass, bounding "  # noqa: UP045
                                            "activation memory: the update accumulates "
                                            "gradients over them into one optimizer step, "
                                            "and the experience's log-probs, values and "
                                            "scores run in such chunks; null: a whole "
                                            "micro-batch (the experience: a whole round)",
                                            COUNT)
    actor_lr: float = val(9.65e-6, ok=LEARNING_RATE)
    critic_lr: float = val(5e-6, ok=LEARNING_RATE)
    lr_scheduler: str = val("linear", ok=SCHEDULERS)   # OptimConfig's key, its own default
    algorithm: str = val("ppo", "ppo | grpo | rloo | reinforce_pp | reinforce_pp_baseline | "
                         "online_dpo: each group's best and worst answer by the reward, "
                         "trained as a DPO pair (all but ppo train no critic) | dpo: "
                         "offline, on step 3's share of data.path's pairs against step 1's "
                         "actor, no reward model (the dpo section)",
                         one_of("ppo", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                                "online_dpo", "dpo"))
    samples_per_prompt: int = val(1, "answers sampled per prompt, a group (grpo, rloo and "
                                  "reinforce_pp_baseline need >= 2); rollout_batch_size "
                                  "counts prompts", COUNT)
    dpo_beta: Optional[float] = val(None, "online_dpo: the DPO loss's beta, the weight of "  # noqa: UP045
                                    "the KL to the reference; null: 0.1", POSITIVE)
    dpo_loss: Optional[str] = val(None, "online_dpo: sigmoid (DPO) | ipo | hinge (SLiC), "  # noqa: UP045
                                  "as the dpo section's loss, on each group's best and "
                                  "worst answer | kto: every answer alone, desirable above "
                                  "its group's mean reward, undesirable below; null: sigmoid",
                                  one_of("sigmoid", "ipo", "hinge", "kto"))
    grpo_scale_rewards: bool = val(True, "GRPO: divide by the group's std (false: Dr. GRPO)")
    dynamic_sampling: bool = val(False, "DAPO's dynamic sampling (grpo, rloo, "
                                 "reinforce_pp_baseline): drop the prompts whose answers "
                                 "all score the same (no advantage) and sample further "
                                 "prompt batches until rollout_batch_size prompts have "
                                 "answers that differ; it makes fewer updates, so pair it "
                                 "with lr_scheduler=constant, as DAPO does")
    dynamic_sampling_max_draws: int = val(4, "dynamic_sampling: prompt batches an iteration "
                                          "samples at most; it then trains on the prompts "
                                          "found (the epoch's end stops it too)", COUNT)
    reward_fn: Optional[str] = val(None, "package.module:function, (prompt, answer[, label]) -> "  # noqa: UP045
                                   "float: a rule-based reward (the demo's: steps.demo:score)")
    reward_fn_weight: float = val(1.0, ok=FINITE)
    reward_model_weight: float = val(1.0, "0: no reward model, reward_fn alone (step 2 not needed)",
                                     FINITE)
    # an ensemble over-optimises less than one reward model (Coste et al., 2023)
    extra_reward_paths: list[str] = val([], "more reward model directories (each with its "
                                        "tokenizer), scored beside reward_path's, combined by "
                                        "reward_ensemble; the critic starts from reward_path's")
    reward_ensemble: str = val("mean", "how an ensemble's scores combine, per answer: mean | "
                               "min (the worst case) | mean_minus_std (uncertainty-weighted: "
                               "mean - reward_ensemble_coef x the std over the models)",
                               one_of("mean", "min", "mean_minus_std"))
    reward_ensemble_coef: float = val(1.0, "mean_minus_std's weight on the std",
                                      NON_NEGATIVE)
    normalize_reward: bool = val(False, "standardise the reward model's scores by their mean "
                                 "and std over step 2's held-out answers (its config.json's "
                                 "score_mean, score_std; OpenRLHF's --normalize_reward): "
                                 "score_clip, kl_coef and reward_model_weight then read in "
                                 "standard deviations, whatever the reward model's scale")
    kl_coef: float = val(0.1, "the KL penalty's coefficient: with kl_target, the "
                         "controller's floor; it starts where best-of-n's samples put the "
                         "target (a KL in the reward), else here; 0: no KL penalty",
                         NON_NEGATIVE)
    kl_penalty: str = val("auto", "reward | loss | auto (loss for grpo, reward otherwise)",
                          one_of("auto", "reward", "loss"))
    kl_estimator: str = val("auto", "k1 | k2 | k3 | auto (k3 as a loss, k1 in the reward)",
                            one_of("auto", "k1", "k2", "k3"))
    kl_target: Optional[float] = val(None, "adaptive KL controller (proportional-integral): the KL "  # noqa: UP045
                                     "per answer to hold, from kl_coef up; null: 0.9 x "
                                     "kl_budget; 0: off, kl_coef stays fixed", NON_NEGATIVE)
    kl_horizon: Optional[float] = val(None, "adaptive KL: samples over which it closes the "  # noqa: UP045
                                      "gap; null: 0.5% of the run's (one round's at least)",
                                      POSITIVE)
    target_kl: Optional[float] = val(0.1, "stop a round's remaining updates once the policy "  # noqa: UP045
                                     "moved this far from the one that sampled it (approx. "
                                     "KL per token, Stable-Baselines3); null: off", POSITIVE)
    missing_eos_penalty: Optional[float] = val(None, "subtracted from the score of answers "  # noqa: UP045
                                               "cut off without EOS", FINITE)
    overlong_buffer: Optional[int] = val(None, "DAPO's soft overlong punishment: an answer "  # noqa: UP045
                                         "reaching into the last this many tokens of "
                                         "max_new_tokens loses up to overlong_penalty from its "
                                         "score, linearly; null: off", COUNT)
    overlong_penalty: float = val(1.0, "the most overlong_buffer takes (at max_new_tokens)",
                                  POSITIVE)
    mask_truncated: bool = val(False, "answers cut off at max_new_tokens without EOS are left "
                               "out of the losses (TRL's mask_truncated_completions, DAPO's "
                               "overlong filtering); they still count in their group's "
                               "statistics and the metrics")
    loss_aggregation: str = val("token-mean", "token-mean | seq-mean (each answer's mean, "
                                "then over answers) | seq-mean-token-sum-norm (each answer's "
                                "token sum over max_new_tokens, then over answers: Dr. GRPO)",
                                one_of("token-mean", "seq-mean", "seq-mean-token-sum-norm"))
    score_clip: float = val(5.0, ok=POSITIVE)
    clip_range: float = val(0.2, ok=POSITIVE)
    clip_range_high: Optional[float] = val(None, "the ratio's upper clip is 1 + this (DAPO's "  # noqa: UP045
                                           "clip-higher, e.g. 0.28); null: clip_range",
                                           POSITIVE)
    dual_clip: Optional[float] = val(None, "dual-clip PPO (OpenRLHF's --dual_clip, verl's "  # noqa: UP045
                                     "clip_ratio_c): a token with a negative advantage A adds "
                                     "at most -A x this to the loss; null: off",
                                     above(1))
    importance_ratio: str = val("token", "token: PPO's ratio per token | sequence: GSPO's "
                                "(Zheng et al., 2025; TRL's importance_sampling_level, "
                                "verl's loss_mode=gspo), each answer's geometric mean ratio, "
                                "clipped as one: use it with clip_range=3e-4 "
                                "clip_range_high=4e-4 loss_aggregation=seq-mean",
                                one_of("token", "sequence"))
    entropy_coef: float = val(0.0, "entropy bonus: the loss less this x the policy's mean "
                              "token entropy (verl's entropy_coeff, OpenRLHF's "
                              "--entropy_loss_coef; logged as train/entropy); 0: off "
                              "(policy/entropy, the sampling policy's, is logged anyway)",
                              NON_NEGATIVE)
    value_clip_range: float = val(0.2, ok=POSITIVE)
    critic_warmup: int = val(0, "PPO: iterations at the start that train the critic alone, "
                             "the actor frozen (verl's critic_warmup, OpenRLHF's "
                             "--freezing_actor_steps): a critic started from the reward "
                             "model learns values before its advantages steer the actor",
                             NON_NEGATIVE)
    gamma: float = val(1.0, ok=within(0, 1))
    lam: float = val(0.95, ok=within(0, 1))
    whiten_advantages: bool = val(True, "PPO: normalise advantages over the rollout batch "
                                  "(TRL and OpenRLHF do; DeepSpeed-Chat does not: set false "
                                  "for its behaviour)")
    disable_dropout: bool = val(True, "dropout off in the step-3 actor, critic, reference and "
                                "reward models (TRL's default, DeepSpeed-Chat's "
                                "--disable_actor_dropout/--disable_critic_dropout): with "
                                "dropout on, the first PPO update's ratio is not 1")
    temperature: float = val(1.0, ok=POSITIVE)
    top_p: float = val(1.0, ok=Rule(lambda v: 0 < v <= 1, "give a number in (0, 1]"))
    top_k: int = val(0, "0 = off", NON_NEGATIVE)
    max_new_tokens: int = val("${data.max_answer_len}", ok=COUNT)  # type: ignore[assignment]
    eval_prompts: int = val(64, "held-out prompts: greedy answers scored, and the KL to the "
                            "reference measured, before, during and after step 3", NON_NEGATIVE)
    log_answers: int = val(4, "each evaluation writes this many held-out prompts' greedy "
                           "answers, with their scores, to <output_dir>/step3/answers.jsonl "
                           "(DeepSpeed-Chat's --print_answers); 0: none", NON_NEGATIVE)
    eval_every: int = val(10, "iterations between evaluations; 0: before and after only",
                          NON_NEGATIVE)
    eval_reward_fn: Optional[str] = val(None, "package.module:function, (prompt, answer[, label]) -> "  # noqa: UP045
                                        "float: the gold score evaluations report (default: "
                                        "steps.demo:score on the demo data)")
    best_of_n: int = val(8, "the baseline step 3 must beat: the SFT model's best of n answers "
                         "by the reward, scored on the eval prompts; 0: off",
                         Rule(lambda v: v == 0 or v >= 2, "give 0 (off) or 2 or more"))
    kl_budget: Optional[float] = val(None, "the most KL per answer an exported policy may "  # noqa: UP045
                                     "have (export=best); null: best-of-n's, log n - (n-1)/n "
                                     "(n = best_of_n, 8 when that is 0)",
                                     POSITIVE)
    export: str = val("auto", "best: the evaluated policy with the highest gold score (else "
                      "reward) within kl_budget | last | auto (best with a gold score)",
                      one_of("auto", "best", "last"))
    export_weights: str = val("merged", "merged: the actor with LoRA folded in, a plain HF "
                              "directory | adapter: LoRA's weights alone, a peft adapter "
                              "over the actor's base (for a base too big to write merged, "
                              "e.g. 70B INT4); adapter needs a LoRA actor whose base is frozen",
                              one_of("merged", "adapter"))
    greedy_floor: bool = val(True, "export=best with a gold score: never export a policy "
                             "whose greedy answers score below the SFT model's greedy "
                             "answers on it (false: rank by the sampled answers alone)")
    log_every: int = val(1, ok=COUNT)
    profile: list[int] = val([], "[first, last]: iterations recorded with torch.profiler "
                             "into <output>/step3/profile (trace.json, ops.txt); []: off",
                             Rule(lambda v: len(v) == 0 or (len(v) == 2 and 1 <= v[0] <= v[1]),
                                  "give [] or [first, last] with 1 <= first <= last"))
    ema: EmaConfig = val(EmaConfig)
    ptx: PtxConfig = val(PtxConfig, "pretraining loss on step-1 data")
    actor_lora: LoraConfig = val(LoraConfig)
    critic_lora: LoraConfig = val(LoraConfig)


@dataclass
class WandbConfig:
    enabled: bool = False
    mode: str = val("auto", "auto (offline without an API key or when wandb's server does "
                    "not answer) | online | offline | disabled",
                    one_of("auto", "online", "offline", "disabled"))
    project: str = "rlhf"
    group: Optional[str] = None  # noqa: UP045
    run_name: Optional[str] = None  # noqa: UP045


@dataclass
class LoggingConfig:
    wandb: WandbConfig = val(WandbConfig)
    tensorboard: bool = val(False, "also write each step's metrics as TensorBoard events in "
                            "<output_dir>/stepN/tensorboard (pip install tensorboard; "
                            "DeepSpeed-Chat's --enable_tensorboard)")
    progress: bool = val(True, "tqdm bars")


@dataclass
class RunConfig:
    actor_model: Optional[str] = val(None, "preset (tiny-llama, tiny-llama-4l, tiny-opt, "  # noqa: UP045
                                     "tiny-gpt2, tiny-gpt-neox, tiny-qwen3; shapes llama-7b, -13b, "
                                     "-34b, -70b over "
                                     "a quantized base), HF dir or hub name")
    reward_model: Optional[str] = val(None, "same kinds; step 2 trains it, step 3 scores "  # noqa: UP045
                                      "with it")
    tokenizer: Optional[str] = val(None, "tokenizer dir for presets (default: the built-in "  # noqa: UP045
                                   "byte tokenizer)")
    steps: list[int] = val([1, 2, 3], ok=Rule(lambda v: bool(v) and set(v) <= {1, 2, 3},
                                              "choose from 1 2 3 (--step 1 2 3)"))
    output_dir: str = "./output"
    overwrite: bool = val(False, "replace a finished step's model in output_dir")
    resume: str = val("auto", "auto: continue an interrupted run found in output_dir | true: "
                      "must | false: start over", one_of("auto", "true", "false"))
    seed: int = val(1234, ok=NON_NEGATIVE)
    trust_remote_code: bool = False
    deployment_type: str = val("single_gpu", "single_gpu | single_node (torchrun, one process "
                               "per GPU) | multi_node",
                               one_of("single_gpu", "single_node", "multi_node"))
    actor_zero_stage: int = val(0, ok=one_of(0, 1, 2, 3))
    reward_zero_stage: int = val(0, ok=one_of(0, 1, 2, 3))
    data: DataConfig = val(DataConfig)
    engine: EngineConfig = val(EngineConfig)
    launch: LaunchConfig = val(LaunchConfig, "torchrun rendezvous for --deployment-type "
                               "multi_node (flags override)")
    sft: SFTTrainConfig = val(SFTTrainConfig)
    rm: RewardTrainConfig = val(lambda: RewardTrainConfig(lr=5e-6, weight_decay=0.1))
    ppo: PPOConfig = val(PPOConfig)
    dpo: DPOTrainConfig = val(lambda: DPOTrainConfig(lr=5e-7, warmup_ratio=0.1),
                              "step 3 with ppo.algorithm=dpo")
    logging: LoggingConfig = val(LoggingConfig)


class BadValue(ValueError):
    """A key's value outside what its schema field allows."""

    def __init__(self, key: str, value: Any, allowed: str):
        super().__init__(f"{key}={value}: {allowed}")
        self.key, self.value, self.allowed = key, value, allowed


def validate(cfg: Any, schema: Any = None, prefix: str = "") -> None:
    """Check every key of a composed config against its schema field's `ok` rule, in
    schema order; the first key that breaks its rule raises BadValue ("key=value: what is
    allowed"). `cfg` is the config (any mapping of the schema's shape); None skips a key."""
    schema = RunConfig() if schema is None else schema
    for f in fields(schema):
        value, default = cfg[f.name], getattr(schema, f.name)
        if is_dataclass(default):
            validate(value, default, f"{prefix}{f.name}.")
            continue
        rule = f.metadata.get("ok")
        if rule is not None and value is not None and not rule.test(value):
            shown = (value if isinstance(value, str | int | float)
                     else dict(value) if hasattr(value, "items") else list(value))
            raise BadValue(f"{prefix}{f.name}", shown, _refusal(rule, shown))


def _refusal(rule: Rule, value: Any) -> str:
    """What a refused value is told: the rules' texts speak of ranges, so inf and nan (which
    OmegaConf takes as floats) are named as what is wrong with them."""
    values = value if isinstance(value, list) else [value]
    finite = all(math.isfinite(v) for v in values if isinstance(v, float))
    return rule.allowed if finite or rule is FINITE else f"not a finite number; {rule.allowed}"


def unknown_keys(cfg: Any, schema: Any = None, prefix: str = "") -> list[str]:
    """The dotted keys of a composed config that its schema does not declare: Hydra's
    `+key=value` and `++key=value` add any key, which nothing would then read. A field
    that is not a section (an `Any` such as lora.target_modules) may hold any mapping."""
    schema = RunConfig() if schema is None else schema
    sections = {f.name: getattr(schema, f.name) for f in fields(schema)}
    unknown = []
    for key in cfg:
        if key not in sections:
            unknown.append(f"{prefix}{key}")
        elif is_dataclass(sections[key]) and cfg[key] is not None:
            unknown += unknown_keys(cfg[key], sections[key], f"{prefix}{key}.")
    return unknown


def unknown_key(key: str) -> str:
    """The one-line refusal of an unknown key, with the nearest known one: by its last part,
    in its own section first (sft.epoch -> sft.epochs), then, closer, in any (sft.kl_coef ->
    ppo.kl_coef); whole keys would pair unrelated siblings (sft.nope -> sft.lora)."""
    section, _, name = key.rpartition(".")
    by_name: dict[str, str] = {}
    for known in DEFAULTS:
        by_name.setdefault(known.rpartition(".")[2], known)
    siblings = {k.rpartition(".")[2]: k for k in DEFAULTS if k.rpartition(".")[0] == section}
    near = [choices[match] for choices, cutoff in ((siblings, 0.6), (by_name, 0.85))
            for match in difflib.get_close_matches(name, choices, n=1, cutoff=cutoff)]
    return f"unknown key {key} (" + (f"did you mean {near[0]}?)" if near else
                                     "train.py --help lists every key)")


def walk(section: Any, prefix: str = ""):
    """(dotted key, default, comment) of every key and section under `section`, in order."""
    for f in fields(section):
        value = getattr(section, f.name)
        yield prefix + f.name, value, f.metadata.get("help")
        if is_dataclass(value):
            yield from walk(value, f"{prefix}{f.name}.")


DEFAULTS = {key: value for key, value, _ in walk(RunConfig())}  # "ppo.kl_coef": 0.1, ...
LIST_KEYS = tuple(key for key, value in DEFAULTS.items() if isinstance(value, list))


def as_yaml(value: Any) -> str:
    if isinstance(value, list):
        return f"[{', '.join(map(as_yaml, value))}]"
    return value if isinstance(value, str) else json.dumps(value)


def listing() -> str:
    """Every key with its default and comment, as YAML: what `train.py --help` shows."""
    lines = []
    for key, value, note in walk(RunConfig()):
        line = "  " * key.count(".") + key.rpartition(".")[2] + ":"
        line += "" if is_dataclass(value) else f" {as_yaml(value)}"
        lines.append(f"{line:<30}  # {note}" if note else line)
    return "\n".join(lines)


def step_dir(cfg, step: int) -> Path:
    """Where step `step` writes its resolved config, metrics.jsonl and checkpoints."""
    return Path(cfg.output_dir) / f"step{step}"


FINISHED = "finished"   # in a step's directory once its models are written (train.py)


def register() -> None:
    """Make the schema available to configs/config.yaml as `schema`."""
    ConfigStore.instance().store(name="schema", node=RunConfig)
