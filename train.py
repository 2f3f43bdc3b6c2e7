"""Train a chat model with the InstructGPT recipe: SFT, reward model, PPO (or DPO).

    python train.py                                     # the built-in demo, CPU, minutes
    python train.py --actor-model facebook/opt-1.3b --reward-model facebook/opt-350m \\
        data.path=[Dahoas/rm-static] ppo.kl_coef=0.05
    python train.py --deployment-type single_node --actor-zero-stage 3 ...  # all GPUs here
    python train.py engine.device=cpu engine.procs=4    # 4 CPU processes (gloo)
    python train.py --actor-model ... --step 1 3 ppo.algorithm=dpo   # DPO: no reward model
    python train.py ... ppo.algorithm=online_dpo ppo.samples_per_prompt=4   # pairs sampled

Flags follow DeepSpeed-Chat; every further `key=value` argument is a Hydra override of a
key of steps/config.py (see --help for all keys).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NoReturn

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from engine.errors import OneLineParser, UserError
from steps.algorithms import OFFLINE
from steps.config import (
    DEFAULTS,
    FINISHED,
    LIST_KEYS,
    BadValue,
    as_yaml,
    listing,
    register,
    step_dir,
    unknown_key,
    unknown_keys,
    validate,
)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DEPLOYMENTS = ("single_gpu", "single_node", "multi_node")
MODEL_DIRS = {1: ("actor",), 2: ("reward",), 3: ("step3/actor", "step3/critic")}


register()


def _const(value: object) -> dict:
    return {"action": "store_const", "const": value}


INT, ZERO = {"type": int}, {"type": int, "choices": (0, 1, 2, 3)}
BOOL = {"action": argparse.BooleanOptionalAction}
# DeepSpeed-Chat's flags by --help group: (flag, the config key it sets, argparse options,
# help). A flag given beats an override of its key; --help adds the key and its default.
FLAGS: dict[str, list[tuple[str, str, dict, str]]] = {"": [
    ("--actor-model", "actor_model", {}, "actor/SFT model: local HF dir, hub name, or a preset "
     "(tiny-llama, tiny-llama-4l, tiny-opt, tiny-gpt2, tiny-gpt-neox, tiny-qwen3)"),
    ("--reward-model", "reward_model", {}, "reward-model base: same kinds as --actor-model"),
    ("--step", "steps", {"type": int, "nargs": "+", "action": "extend", "choices": (1, 2, 3)},
     "steps to run"),
    ("--output-dir", "output_dir", {}, "where models, configs and metrics go"),
    ("--deployment-type", "deployment_type", {"choices": DEPLOYMENTS}, "single_gpu: one "
     "process; single_node: one process per GPU here, through torchrun; multi_node: the same "
     "on every node, with --nnodes/--node-rank/--master-addr or --hostfile"),
    ("--actor-zero-stage", "actor_zero_stage", ZERO, "actor sharding (steps 1, 3): 3 = ZeRO-3, "
     "1/2 = gradients and optimizer state sharded, 0 = replicated"),
    ("--reward-zero-stage", "reward_zero_stage", ZERO,
     "reward model (step 2) and critic (step 3) sharding"),
    ("--resume", "resume", _const("true"), "continue the interrupted run in --output-dir (it "
     "must hold one); by default a run found there is continued anyway"),
    ("--apply-chat-template", "data.apply_chat_template", _const(True), "render the data's "
     "dialogues by the actor tokenizer's chat template, not as hh-rlhf text"),
    ("--disable-dropout", "ppo.disable_dropout", BOOL,
     "dropout off in the step-3 actor, critic, reference and reward models"),
], "hybrid engine (step 3 generation)": [
    ("--enable-hybrid-engine", "engine.hybrid.enabled", BOOL,
     "generate from a gathered inference form of the actor"),
    ("--unpin-actor-parameters", "engine.hybrid.pin_parameters", _const(False),
     "free the inference weights after every rollout"),
    ("--release-inference-cache", "engine.hybrid.release_inference_cache", _const(True),
     "free the KV cache after every rollout"),
    ("--tp-gather-partition-size", "engine.hybrid.gather_group_size", INT,
     "decoder layers all-gathered at once when switching to generation"),
], "ZeRO++ (DeepSpeed's names; on the ZeRO-3 trained models)": [
    ("--zero-quantized-weights", "engine.zeropp.qwz", _const(True),
     "qwZ: weight all-gathers in int8 blocks (engine.zeropp.weight_bits=4: int4)"),
    ("--zero-hpz-partition-size", "engine.zeropp.hpz", {**INT, "metavar": "N"},
     "hpZ: a secondary weight partition of N ranks (normally one node's) for backward"),
    ("--zero-quantized-gradients", "engine.zeropp.qgz", _const(True),
     "qgZ: gradient reduce-scatter as a quantized all-to-all, intra- then inter-node"),
    ("--zero-quantized-nontrainable-weights", "engine.quantized_base.enabled", _const(True),
     "frozen base weights of LoRA models stored, sharded and gathered as INT8 "
     "(engine.quantized_base.bits=4: INT4)"),
], "multi-node rendezvous (torchrun's)": [
    ("--nnodes", "launch.nnodes", INT, ""),
    ("--node-rank", "launch.node_rank", INT, ""),
    ("--master-addr", "launch.master_addr", {}, ""),
    ("--master-port", "launch.master_port", INT, ""),
    ("--hostfile", "launch.hostfile", {}, "DeepSpeed-style `host slots=N` lines: sets the node "
     "count, the master (first host) and processes per node"),
]}


def _flag_help(key: str, options: dict, text: str) -> str:
    """`text [key=const; default ...]`, the default from the schema."""
    const = f"={as_yaml(options['const'])}" if "const" in options else ""
    default = "" if DEFAULTS[key] is None else f"; default {as_yaml(DEFAULTS[key])}"
    return f"{text} [{key}{const}{default}]".lstrip()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = OneLineParser(
        prog="train.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="RLHF in three steps: 1 SFT, 2 reward model, 3 PPO (or GRPO, RLOO, "
                    "REINFORCE++, online DPO on the reward model's ranking of sampled "
                    "answers; or DPO on the pairs alone: ppo.algorithm=dpo, no step 2). "
                    "With no model flags it runs the built-in demo (tiny models, generated "
                    "data, CPU-friendly).",
        epilog="Hydra overrides: any `key=value` after the flags sets a config key, e.g.\n"
               "  ppo.kl_coef=0.05 sft.epochs=2 'data.path=[a.jsonl,b.parquet]' recipe=demo\n"
               "Unknown keys are refused. With no model flags, recipe=demo "
               "(configs/recipe/demo.yaml) is applied.\n"
               "The keys and their defaults (steps/config.py):\n\n" + listing(),
    )
    for title, rows in FLAGS.items():
        group = parser.add_argument_group(title) if title else parser
        for flag, key, options, text in rows:
            group.add_argument(flag, **options, default=None, help=_flag_help(key, options, text))
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="Hydra overrides of the config keys listed below")
    # intermixed: `key=value` overrides may come before, between and after the flags
    return parser.parse_intermixed_args(_inline_steps(sys.argv[1:] if argv is None else argv))


def _inline_steps(argv: list[str]) -> list[str]:
    """`--step 1 3 sft.epochs=2` -> `--step=1 --step=3 sft.epochs=2`: nargs="+" would also
    swallow the overrides that follow the step numbers."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--step" and i + 1 < len(argv) and argv[i + 1].isdigit():
            while i + 1 < len(argv) and argv[i + 1].isdigit():
                out.append(f"--step={argv[i + 1]}")
                i += 1
        else:
            out.append(argv[i])
        i += 1
    return out


def _as_list(override: str) -> str:
    """`data.path=a.jsonl` -> `data.path=[a.jsonl]`: one value for a list key is a list."""
    key, sep, value = override.partition("=")
    if sep and key in LIST_KEYS and value and not value.startswith("["):
        return f"{key}=[{value}]"
    return override


def build_config(args: argparse.Namespace) -> DictConfig:
    """Flags and overrides -> the resolved run config. With no model flags and no explicit
    recipe the demo recipe is selected."""
    overrides = [_as_list(o) for o in args.overrides]
    no_models = args.actor_model is None and args.reward_model is None
    if no_models and not any(o.lstrip("+~").startswith("recipe=") for o in overrides):
        overrides.insert(0, "recipe=demo")
    cfg = _compose(overrides, args.overrides)
    for rows in FLAGS.values():
        for flag, key, _, _ in rows:
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is not None:
                OmegaConf.update(cfg, key, sorted(set(value)) if key == "steps" else value)
    cfg.resume = str(cfg.resume).lower()
    cfg.steps = sorted(set(cfg.steps))   # steps=[3,1] as --step 3 1: each once, in order
    return cfg


def _compose(overrides: list[str], given: list[str]) -> DictConfig:
    """configs/config.yaml with `overrides` (from the command line `given`), holding only
    the schema's keys."""
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        try:
            cfg = compose("config", overrides=overrides)
        except ValueError as err:  # hydra lets some malformed overrides (`=3`) through raw
            raise UserError(f"bad override in {' '.join(given)}: "
                            f"{str(err).splitlines()[0]}") from None
        except OverrideParseException:
            bare = next((o for o in given if "=" not in o and not o.startswith("~")), None)
            if bare is not None:   # Hydra: "missing EQUAL at '<EOF>'"
                raise UserError(f"bad override '{bare}': write key=value, e.g. "
                                "ppo.kl_coef=0.05 (train.py --help lists every key)") from None
            raise
        except ConfigCompositionException as err:
            # Hydra's advice for an unknown key is `+key=value`, which adds a key nothing reads
            cause = err.__cause__
            if isinstance(cause, ConfigAttributeError | ConfigKeyError) \
                    and cause.full_key and cause.full_key not in DEFAULTS:
                raise UserError(unknown_key(cause.full_key)) from None
            if isinstance(cause, ValidationError) and cause.full_key:
                raise UserError(_wrong_type(cause, given)) from None
            raise
    unknown = unknown_keys(cfg)   # `+key=` and `++key=` add keys Hydra does not check
    if unknown:
        raise UserError(unknown_key(unknown[0]))
    return cfg


KINDS = {"Float": "a number", "Integer": "a whole number", "Boolean": "true or false"}


def _wrong_type(err: ValidationError, given: list[str]) -> str:
    """`ppo.kl_coef=abc: not a number`, `ppo=3: ppo is a section ...`, for OmegaConf's
    "Value 'abc' of type 'str' could not be converted to Float"."""
    key = err.full_key.split("[")[0]   # data.split[0] -> data.split
    override = next((o.lstrip("+") for o in given if o.lstrip("+").partition("=")[0] == key),
                    f"{key}={err.value}")
    kind = re.search(r"could not be converted to (\w+)", str(err))
    if kind and kind[1] in KINDS:
        return f"{override}: {key} takes {KINDS[kind[1]]}" + (
            "" if err.full_key == key else " for each item")
    if "is not a subclass of" in str(err):
        return (f"{override}: {key} is a section, not a value; set its keys, e.g. "
                f"{key}.<name>=value (train.py --help lists them)")
    return f"{override}: {str(err).splitlines()[0]}"


def check_config(cfg: DictConfig) -> None:
    """Refuse a run that cannot work, before anything is loaded or written: every key in
    its schema's range (steps/config.py), then the rules between keys, paths and models."""
    try:
        validate(cfg)
    except BadValue as err:   # named with the key's flag, where it has one
        flag = next((f" ({row[0]})" for rows in FLAGS.values() for row in rows
                     if row[1] == err.key), "")
        raise UserError(f"{err.key}={err.value}{flag}: {err.allowed}") from None
    steps = list(cfg.steps)
    if not str(cfg.output_dir).strip():   # Path("") is the working directory
        raise UserError(f"--output-dir '{cfg.output_dir}': empty; give a directory for the "
                        "run's models (e.g. --output-dir output)")
    check_output_dir(Path(cfg.output_dir))
    # the weights of steps with data of their own are ignored: all 0 if no step reads data.path
    if sum(cfg.data.split) <= 0 and not set(steps) <= set(own_data(cfg)):
        raise UserError(f"data.split={list(cfg.data.split)}: give at least one weight above 0")
    check_launch(cfg)
    check_zeropp(cfg)
    dpo = cfg.ppo.algorithm in OFFLINE   # step 3 trains by DPO, on the dpo section's keys
    for step, section in ((1, "sft"), (2, "rm"), (3, "dpo" if dpo else "ppo")):
        if step in steps and cfg[section].warmup_steps and cfg[section].warmup_ratio:
            raise UserError(f"{section}.warmup_steps={cfg[section].warmup_steps} and "
                            f"{section}.warmup_ratio={cfg[section].warmup_ratio}: give one "
                            "of them (the other 0)")
    sft_loss_used = 1 in steps or (3 in steps and cfg.ppo.ptx.enabled)
    if sft_loss_used and cfg.sft.multiturn and cfg.sft.train_on_prompt:
        raise UserError("sft.multiturn=true and sft.train_on_prompt=true: the prompt's tokens, "
                        "earlier replies included, are trained on already; give one of them")
    if 1 in steps and not cfg.actor_model:
        raise UserError("step 1 needs --actor-model (a local HF dir, hub name or preset)")
    if 2 in steps and not cfg.reward_model:
        raise UserError("step 2 needs --reward-model (a local HF dir, hub name or preset)")
    from engine.model_source import check_model_arg
    from steps.demo import TASKS

    if 1 in steps:
        check_model_arg(cfg.actor_model, "--actor-model", own_tokenizer=not cfg.tokenizer)
    if 2 in steps:
        check_model_arg(cfg.reward_model, "--reward-model", own_tokenizer=not cfg.tokenizer)
    if cfg.tokenizer:
        check_model_arg(cfg.tokenizer, "tokenizer=", tokenizer=True)
    if cfg.logging.tensorboard:
        from engine.tracking import require_tensorboard

        require_tensorboard()
    if len(cfg.data.split) != 3:
        raise UserError(f"data.split={list(cfg.data.split)}: give three weights, for steps "
                        "1, 2, 3 (e.g. data.split=[2,4,4])")
    check_split_shares(cfg)
    if cfg.data.chat_template_kwargs and not cfg.data.apply_chat_template:
        raise UserError("data.chat_template_kwargs: the chat template reads them only with "
                        "data.apply_chat_template=true (--apply-chat-template); add it, or "
                        "drop the kwargs")
    if cfg.data.demo_task not in TASKS:
        raise UserError(f"data.demo_task={cfg.data.demo_task}: choose one of {', '.join(TASKS)}")
    if 3 in steps:
        from steps.algorithms import check_dpo, check_settings, model_paths

        if dpo:
            check_dpo(cfg)
        elif cfg.data.feedback_path:
            raise UserError(f"data.feedback_path holds unpaired feedback, which step 3 trains "
                            f"on by KTO only, not by ppo.algorithm={cfg.ppo.algorithm}: set "
                            "ppo.algorithm=dpo dpo.loss=kto, or drop data.feedback_path")
        else:
            check_settings(cfg.ppo, quantized_base=cfg.engine.quantized_base.enabled)
        made = tuple(s for s in steps if s < 3)   # checked now, not after hours of steps 1-2
        paths = model_paths(cfg, made=made)
        if not dpo and not needs_launcher(cfg):   # needs transformers: torchrun's ranks check it at start
            from steps.ppo import check_rollout_fits

            check_rollout_fits(cfg, *paths, made)
    plan_steps(cfg)


def check_output_dir(out: Path) -> None:
    """Step 1 makes --output-dir only once the data is loaded: refuse now a path that cannot
    be made (under a file, or where this user cannot write)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {out}: a file, not a directory; choose another path")
    # os.path.exists, not Path's: a directory we may not search is "not there", not an error
    there = next(p for p in (out.absolute(), *out.absolute().parents) if os.path.exists(p))
    if not there.is_dir():
        raise UserError(f"--output-dir {out}: {there} is a file, not a directory; choose "
                        "another path")
    if not (os.access(there, os.W_OK | os.X_OK) and _can_make_dir_in(there)):
        raise UserError(f"--output-dir {out}: cannot create it in {there} (not writable); "
                        "choose another path")


def _can_make_dir_in(directory: Path) -> bool:
    """Whether a directory can be made in `directory` (made and removed): os.access says
    yes to root everywhere, also in /proc or on a full disk."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".train-write-check-", dir=directory))
    except OSError:
        return False
    return True


# The rendezvous keys a run on one node ignores, by flag: on a cluster such a run would
# start every node as a whole job of its own, all writing into the shared output dir.
RENDEZVOUS_FLAGS = {"launch.nnodes": "--nnodes", "launch.node_rank": "--node-rank",
                    "launch.master_addr": "--master-addr", "launch.master_port": "--master-port",
                    "launch.hostfile": "--hostfile"}


def check_launch(cfg: DictConfig) -> None:
    """Rendezvous flags (or their keys) only with --deployment-type multi_node, and a node
    rank among the nodes (one past them would wait in the rendezvous for ever)."""
    lc = cfg.launch
    if cfg.deployment_type == "multi_node":
        if not lc.hostfile and lc.node_rank is not None and lc.node_rank >= lc.nnodes:
            raise UserError(f"--node-rank {lc.node_rank}: --nnodes {lc.nnodes} ranks the nodes "
                            f"0 to {lc.nnodes - 1}")
        return
    for key, flag in RENDEZVOUS_FLAGS.items():
        value = OmegaConf.select(cfg, key)
        if value != DEFAULTS[key]:
            raise UserError(f"{flag} {value} ({key}) is for several nodes: add --deployment-type "
                            f"multi_node, or drop {flag}")


def own_data(cfg: DictConfig) -> dict[int, str]:
    """The steps that read data of their own, not a share of data.path: step 1 with
    data.sft_path, step 3 with ppo.prompt_data or (KTO) data.feedback_path (the key that
    names it)."""
    return {step: key for step, key in ((1, "data.sft_path"), (3, "ppo.prompt_data"),
                                        (3, "data.feedback_path"))
            if OmegaConf.select(cfg, key)}


def check_split_shares(cfg: DictConfig) -> None:
    """Each selected step trains on its own share of data.split (step 3 on its prompts, and
    with ppo.ptx on step 1's share too) unless it reads data of its own: a share of 0 would
    otherwise stop that step only after the earlier ones ran, or silently leave ppo.ptx
    out."""
    split, own = list(cfg.data.split), own_data(cfg)
    for step in cfg.steps:
        if split[step - 1] == 0 and step not in own:
            raise UserError(f"data.split={split}: step {step} gets no data (its weight, entry "
                            f"{step}, is 0); give it a weight above 0 or drop --step {step}")
    if 3 in cfg.steps and cfg.ppo.ptx.enabled and split[0] == 0 and 1 not in own:
        raise UserError(f"data.split={split}: ppo.ptx trains on step 1's share, and its "
                        "weight (entry 1) is 0; give it a weight above 0 or set "
                        "ppo.ptx.enabled=false")


def check_zeropp(cfg: DictConfig) -> None:
    """The engine's rules between keys (each key's own range is the schema's): ranks per
    node divide the processes, ZeRO++ needs a ZeRO-3 model, a quantized base a LoRA model.
    hpZ's partition against the world size is checked once that is known (engine/zeropp.py)."""
    z, per_node = cfg.engine.zeropp, cfg.engine.procs_per_node
    if per_node is not None and cfg.engine.procs % per_node:
        raise UserError(f"engine.procs_per_node={per_node}: give a divisor of engine.procs="
                        f"{cfg.engine.procs}")
    if (z.qwz or z.qgz or z.hpz != 1) and 3 not in (cfg.actor_zero_stage, cfg.reward_zero_stage):
        raise UserError("ZeRO++ (engine.zeropp, --zero-quantized-weights/-gradients, "
                        "--zero-hpz-partition-size) works on ZeRO-3 models: add "
                        "--actor-zero-stage 3 and/or --reward-zero-stage 3")
    q = cfg.engine.quantized_base
    lora_dims = {1: [cfg.sft.lora.dim], 2: [cfg.rm.lora.dim],
                 3: [cfg.dpo.lora.dim] if cfg.ppo.algorithm in OFFLINE
                 else [cfg.ppo.actor_lora.dim, cfg.ppo.critic_lora.dim]}
    if q.enabled and not any(dim > 0 for step in cfg.steps for dim in lora_dims[step]):
        raise UserError("engine.quantized_base (--zero-quantized-nontrainable-weights) quantizes "
                        "the frozen base under LoRA, and no model of this run has LoRA: set "
                        "sft.lora.dim, rm.lora.dim, ppo.actor_lora.dim or ppo.critic_lora.dim "
                        "(dpo.lora.dim with ppo.algorithm=dpo)")


def plan_steps(cfg: DictConfig) -> list[tuple[int, str]]:
    """What each selected step does: "run" from scratch, "resume" from its latest
    checkpoint, "restart" (interrupted before its first checkpoint: run again, replacing
    what it left), or "skip" (finished before the interrupted step). A step is finished
    when its models are written (checkpoints are dropped once they are); it was
    interrupted when its directory holds a complete checkpoint, or when it was started
    (its directory exists) and not finished."""
    from engine.checkpoint import complete_checkpoints

    out = Path(cfg.output_dir)
    resumable, started = [], []
    if cfg.resume != "false":
        resumable = [s for s in cfg.steps if complete_checkpoints(step_dir(cfg, s))]
        started = [s for s in cfg.steps if step_dir(cfg, s).exists() and not _finished(cfg, s)]
    if cfg.resume == "true" and not resumable + started:
        raise UserError(f"--resume: {out} holds no interrupted run (no step*/checkpoints/step-* "
                        "of the selected steps, no step started and not finished); drop "
                        "--resume to start one")
    first = min(resumable + started, default=None)
    plan = []
    for step in cfg.steps:
        if first is not None and step < first and _finished(cfg, step):
            plan.append((step, "skip"))
        elif step == first:
            if step in resumable:
                check_resume_settings(cfg, step)
            plan.append((step, "resume" if step in resumable else "restart"))
        else:
            for name in MODEL_DIRS[step]:
                if (out / name).exists() and not cfg.overwrite:
                    raise UserError(f"{out / name} already holds a finished step-{step} model; "
                                    "pass overwrite=true to replace it or choose another "
                                    "--output-dir")
            plan.append((step, "run"))
    return plan


# The keys that shape a step's run, beyond seed and data.*: a checkpoint's data position,
# schedule and weights mean nothing under others. Keys that only report or bound memory may
# change on resume: by name in any section, or by their whole key (ppo.eval_every stays: it
# decides which policies export=best can pick).
RUN_SHAPING = {1: ("actor_model", "tokenizer", "sft"), 2: ("reward_model", "tokenizer", "rm"),
               3: ("tokenizer", "ppo", "dpo")}
FREE_ON_RESUME = {"log_every", "log_answers", "eval_batch_size", "profile", "forward_batch_size",
                  "sft.eval_every", "rm.eval_every"}


def check_resume_settings(cfg: DictConfig, step: int) -> None:
    """Refuse to resume `step` under settings that shape it differently from those it started
    with (its snapshot step<N>/config.yaml): a changed batch size, data or model would go on
    from the checkpoint's position silently wrong, e.g. skipping examples it never saw."""
    snapshot = step_dir(cfg, step) / "config.yaml"
    if not snapshot.exists():   # (a checkpoint from before the snapshot was written)
        return
    old = _leaves(OmegaConf.to_container(OmegaConf.load(snapshot)))
    new = _leaves(OmegaConf.to_container(cfg, resolve=True))
    shaping = ("seed", "data", *RUN_SHAPING[step])
    changed = [key for key, value in new.items()
               if key.split(".")[0] in shaping and key.rpartition(".")[2] not in FREE_ON_RESUME
               and key not in FREE_ON_RESUME and key in old and old[key] != value]
    if changed:
        raise UserError(f"resuming step {step} with settings that differ from those it started "
                        "with (" + ", ".join(f"{k}: {old[k]} -> {new[k]}" for k in changed)
                        + f"); set them back, or pass resume=false to start step {step} afresh")


def _leaves(tree: object, prefix: str = "") -> dict[str, object]:
    """{"sft.lora.dim": 0, ...}: a nested config's values by dotted key."""
    if not isinstance(tree, dict) or not tree:
        return {prefix: tree}
    leaves: dict[str, object] = {}
    for name, sub in tree.items():
        leaves.update(_leaves(sub, f"{prefix}.{name}" if prefix else str(name)))
    return leaves


def _finished(cfg: DictConfig, step: int) -> bool:
    """Whether `step` wrote its models: its directory says so, or (a run from before that
    mark) every model directory it writes exists."""
    from steps.algorithms import CRITIC_FREE

    if (step_dir(cfg, step) / FINISHED).exists():
        return True
    names = MODEL_DIRS[step][:1] if step == 3 and cfg.ppo.algorithm in (*CRITIC_FREE, *OFFLINE) \
        else MODEL_DIRS[step]   # (critic-free algorithms and DPO write no critic)
    return all((Path(cfg.output_dir) / name).exists() for name in names)


def needs_launcher(cfg: DictConfig) -> bool:
    from engine.launch import launched_by_torchrun

    multi = cfg.deployment_type != "single_gpu" or cfg.engine.procs > 1
    return multi and not launched_by_torchrun()


def launch(cfg: DictConfig, argv: list[str], script: str) -> int:
    """Start this same command (`script` with `argv`) on every process of this node through
    torchrun."""
    import torch

    from engine.launch import Launch, from_hostfile, run_torchrun

    lc = cfg.launch
    gpus = torch.cuda.device_count() if cfg.engine.device in ("auto", "cuda") else 0
    procs = cfg.engine.procs if cfg.engine.procs > 1 else max(gpus, 1)
    if gpus and procs > gpus:
        raise UserError(f"engine.procs={procs}, but this node has {gpus} GPU(s): one process "
                        "per GPU; lower engine.procs or set engine.device=cpu")
    if cfg.deployment_type != "multi_node":
        where = Launch(nproc_per_node=procs)
    elif lc.hostfile:
        where = from_hostfile(lc.hostfile, lc.node_rank, lc.master_port)
    else:
        where = Launch(nproc_per_node=procs, nnodes=lc.nnodes, node_rank=lc.node_rank or 0,
                       master_addr=lc.master_addr, master_port=lc.master_port, standalone=False)
    procs = where.nproc_per_node
    print(f"launching {procs} process{'es' if procs > 1 else ''} on this node"
          + (f" (node {where.node_rank} of {where.nnodes}, master {where.master_addr}:"
             f"{where.master_port})" if not where.standalone else "") + " through torchrun",
          flush=True)
    return run_torchrun(where, script, argv)


def require_shares(cfg: DictConfig, steps: list[int], shares: tuple[list, list, list]) -> None:
    """Before any step runs, each step to run (and ppo.ptx, which trains on step 1's share)
    has pairs: too little data split by data.split can leave a share empty (2 pairs at
    2/4/4 give step 1 none), which was blamed on data.max_prompt_len. Data of a step's own
    is checked as it is read."""
    from steps.data import DataError

    split, own = list(cfg.data.split), own_data(cfg)
    # data.path's pairs alone: a step's own data is no share of it (nor read yet)
    total = sum(len(share) for step, share in enumerate(shares, 1) if step not in own)
    needs = [(step, f"step {step}", "") for step in steps if step not in own]
    if 3 in steps and cfg.ppo.ptx.enabled and 1 not in own:
        needs.append((1, "ppo.ptx (step 1's share)", ", or set ppo.ptx.enabled=false"))
    for share, who, or_else in needs:
        if not shares[share - 1]:
            raise DataError(f"data.split={split} gives {who} none of the {total} pairs in "
                            f"data.path; add data or raise entry {share} of data.split{or_else}")


def load_data(cfg: DictConfig, steps: list[int]) -> tuple[list, list, list]:
    """The pairs of steps 1, 2 and 3: shares of data.path split by data.split, but for a
    step that reads data of its own (own_data), whose weight is then ignored. Each source
    is read only when a step to run needs it (ppo.ptx trains on step 1's): a config kept for
    a later --step 3 must not stop steps 1-2 on a source they never use."""
    from steps import demo
    from steps.common import log
    from steps.data import (
        Fields,
        load_blend,
        load_feedback_data,
        load_prompt_data,
        load_sft_data,
    )

    data, ppo, own = cfg.data, cfg.ppo, own_data(cfg)
    reads = {*steps, *([1] if 3 in steps and ppo.ptx.enabled else [])}
    split = [0.0 if step in own else weight for step, weight in enumerate(data.split, 1)]
    shares: list[list] = [[], [], []]
    if reads - set(own):
        shares = list(load_blend(
            list(data.path), split, cfg.seed,
            demo_pairs=lambda: demo.make_pairs(data.demo_pairs, cfg.seed, data.demo_task),
            fields=Fields(data.prompt_key, data.chosen_key, data.rejected_key,
                          data.margin_key)))
        log(f"data {list(data.path)}: {' / '.join(str(len(pairs)) for pairs in shares)} "
            f"pairs for steps 1 / 2 / 3 (split {split}"
            + "".join(f"; step {step}'s are {key}'s" for step, key in own.items()) + ")")
    require_shares(cfg, steps, tuple(shares))   # data.path's shares alone, and counted alone
    if 1 in own and 1 in reads:
        shares[0] = load_sft_data(list(data.sft_path), data.sft_prompt_key,
                                  data.sft_answer_key, data.sft_input_key)
        log(f"step 1 examples {list(data.sft_path)}: {len(shares[0])}")
    if own.get(3) == "data.feedback_path" and 3 in reads:
        shares[2] = load_feedback_data(list(data.feedback_path), data.feedback_prompt_key,
                                       data.feedback_completion_key, data.feedback_label_key)
        desirable = sum(record.label for record in shares[2])
        log(f"step 3 feedback {list(data.feedback_path)}: {len(shares[2])} records, "
            f"{desirable} desirable and {len(shares[2]) - desirable} undesirable")
    elif 3 in own and 3 in reads:
        shares[2] = load_prompt_data(list(ppo.prompt_data), ppo.prompt_key, ppo.label_key)
        labelled = sum(prompt.label is not None for prompt in shares[2])
        log(f"step 3 prompts {list(ppo.prompt_data)}: {len(shares[2])}, {labelled} with a "
            f"'{ppo.label_key}' label")
    return tuple(shares)


def load_held_out(cfg: DictConfig, steps: list[int]) -> dict[int, list]:
    """The held-out data of the steps to run that are given it: data.eval_path's pairs for
    steps 1 and 2 (read once for both), ppo.eval_prompt_data's prompts for step 3. A step
    missing here holds out data.eval_fraction of its own data instead."""
    from steps.common import log
    from steps.data import Fields, load_eval_pairs, load_prompt_data

    data, ppo, held_out = cfg.data, cfg.ppo, {}
    on_pairs = (1, 2, 3) if ppo.algorithm in OFFLINE else (1, 2)   # DPO's step 3 too
    if data.eval_path and set(on_pairs) & set(steps):
        pairs = load_eval_pairs(list(data.eval_path), Fields(data.prompt_key, data.chosen_key,
                                                             data.rejected_key, data.margin_key),
                                data.eval_split)
        evaluated = [step for step in on_pairs if step in steps]
        log(f"held-out pairs {list(data.eval_path)}: {len(pairs)}, for step"
            + (f"s {', '.join(map(str, evaluated[:-1]))} and {evaluated[-1]}"
               if len(evaluated) > 1 else f" {evaluated[0]}"))
        held_out.update({step: pairs for step in evaluated})
    if ppo.eval_prompt_data and 3 in steps:
        held_out[3] = load_prompt_data(list(ppo.eval_prompt_data), ppo.prompt_key,
                                       ppo.label_key, "ppo.eval_prompt_data", data.eval_split)
        labelled = sum(prompt.label is not None for prompt in held_out[3])
        log(f"step 3 held-out prompts {list(ppo.eval_prompt_data)}: {len(held_out[3])}, "
            f"{labelled} with a '{ppo.label_key}' label")
    return held_out


def run(cfg: DictConfig) -> dict[int, float]:
    """Run the selected steps in order; returns each step's wall time in seconds."""
    from engine.comm_meter import logged_comm
    from engine.errors import NonFiniteError
    from engine.runtime import seed_everything, setup_runtime
    from steps import dpo, ppo, reward, sft
    from steps.common import log
    from steps.data import DataError

    rt = setup_runtime(cfg.engine.device, cfg.engine.dtype, cfg.seed, cfg.engine.timeout_s,
                       cfg.engine.procs_per_node)
    plan = plan_steps(cfg)
    to_run = [step for step, mode in plan if mode != "skip"]
    sft_pairs, rm_pairs, ppo_pairs = load_data(cfg, to_run)
    held_out = load_held_out(cfg, to_run)
    log(f"device {rt.device}, {str(rt.dtype).removeprefix('torch.')}"
        + (f", {rt.world_size} ranks" if rt.distributed else ""))
    if rt.device.type == "cpu" and str(rt.dtype) == "torch.float16":
        log("engine.dtype=float16 on the CPU: most CPUs have no float16 arithmetic, so it "
            "runs many times slower than float32 (see the README); use float32, or bfloat16")
    seconds = {}
    out = Path(cfg.output_dir)
    out_existed = out.exists()
    with logged_comm(rt, cfg.engine.log_comm):
        for step, mode in plan:
            if mode == "skip":
                log(f"step {step}: finished before the interruption; kept")
                continue
            if mode == "restart":
                log(f"step {step}: interrupted before its first checkpoint; run again")
            seed_everything(cfg.seed + step)
            start = time.perf_counter()
            fresh = not step_dir(cfg, step).exists()
            resume = mode == "resume"
            try:
                if step == 1:
                    sft.run(cfg, sft_pairs, rt, resume, held_out.get(1))
                elif step == 2:
                    reward.run(cfg, rm_pairs, rt, resume, held_out.get(2))
                elif cfg.ppo.algorithm in OFFLINE:
                    dpo.run(cfg, ppo_pairs, rt, resume, held_out.get(3))
                else:
                    ppo.run(cfg, ppo_pairs, sft_pairs, rt, resume, held_out.get(3))
            except (UserError, DataError) as err:
                # a refused step (bad model, no data left after filtering) leaves nothing
                # behind; one stopped by non-finite numbers keeps its metrics and checkpoints
                if fresh and rt.is_main and not isinstance(err, NonFiniteError):
                    shutil.rmtree(step_dir(cfg, step), ignore_errors=True)
                if rt.is_main and not out_existed and out.is_dir() and not any(out.iterdir()):
                    out.rmdir()
                raise
            if rt.is_main:
                (step_dir(cfg, step) / FINISHED).touch()
            seconds[step] = time.perf_counter() - start
    log("done: " + ", ".join(f"step {s} {t:.1f}s" for s, t in seconds.items())
        + f"; outputs in {cfg.output_dir}")
    return seconds


def main(argv: list[str] | None = None, script: str = __file__) -> int:
    """`script`: what torchrun starts on every rank when this run needs several processes
    (this file; a test harness passes its own wrapper)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from engine.launch import Stopped, launched_by_torchrun, signals_stop_the_run
    from steps.data import DataError

    rank = int(os.environ.get("RANK", 0)) if launched_by_torchrun() else None
    cfg = None
    try:   # a rank is stopped by its launcher, which says what happened
        with signals_stop_the_run() if rank is None else contextlib.nullcontext():
            cfg = build_config(args)
            check_config(cfg)
            if needs_launcher(cfg):
                return launch(cfg, argv, str(Path(script).resolve()))
            import transformers

            transformers.logging.set_verbosity_error()
            transformers.logging.disable_progress_bar()
            if rank is not None:
                return _run_rank(cfg, rank)
            run(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        reason = " ".join(str(err).split("\n")[:2]).strip()
        cause = str(err.__cause__).split("\n")[0] if err.__cause__ else ""
        where = f"bad override '{err.override}': " if isinstance(err, OverrideParseException) \
            and err.override and err.override not in reason else ""
        print(f"train.py: {where}{reason}" + (f" ({cause})" if cause else ""), file=sys.stderr)
        return 2
    except (UserError, DataError) as err:
        _user_error(err, rank)
        return 2
    except (KeyboardInterrupt, Stopped) as err:   # what is kept, what the same command does
        signum = err.signum if isinstance(err, Stopped) else signal.SIGINT
        print(f"train.py: {_interrupted(cfg, signum)}", file=sys.stderr, flush=True)
        return 128 + signum
    return 0


PLANNED = {"skip": "is kept", "resume": "resumes from its last checkpoint",
           "restart": "runs again (stopped before its first checkpoint)", "run": "runs"}


def _interrupted(cfg: DictConfig | None, signum: int = signal.SIGINT) -> str:
    """'interrupted; ...: step 1 is kept, step 2 resumes from its last checkpoint, ...' (for
    Ctrl-C; 'stopped by SIGTERM; ...' for a kill)."""
    what = "interrupted" if signum == signal.SIGINT else \
        f"stopped by {signal.Signals(signum).name}"
    if cfg is None:
        return what
    again = cfg.copy()
    again.resume = "auto"
    try:
        plan = plan_steps(again)
    except UserError:
        return what
    how = "run the same command" + (" with resume=auto" if cfg.resume == "false" else "")
    return f"{what}; {how} to go on: " + ", ".join(f"step {step} {PLANNED[mode]}"
                                                   for step, mode in plan)


def _user_error(err: Exception, rank: int | None) -> None:
    """A user error, in one line: printed by one process, or by rank 0 of a torchrun job,
    whose other ranks leave theirs for the launcher (which prints the one that failed first
    if it is not rank 0's)."""
    from engine.launch import record_error

    if not rank:   # first: a rank stopped between the two still said its error
        print(f"train.py: {err}", file=sys.stderr, flush=True)
    record_error(f"train.py: rank {rank}: {err}" if rank else f"train.py: {err}", str(err))


def _run_rank(cfg: DictConfig, rank: int) -> NoReturn:
    """One rank of a torchrun job: only rank 0 prints progress; an error is printed with
    the rank's number, and the process exits at once, without waiting on the other ranks
    (which torchrun, or the collective timeout, then stops). Exit codes: 0 done, 2 a user
    error, 1 a failure, PEER_LOST_EXIT stopped because another rank failed."""
    import torch.distributed as dist

    from engine.launch import PEER_LOST_EXIT, lost_peer, stop_with_launcher
    from steps.data import DataError

    stop_with_launcher()
    if rank != 0:   # what every rank would say alike (progress, the data's warnings): once
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        logging.getLogger("steps").setLevel(logging.ERROR)
    try:
        run(cfg)
    except (UserError, DataError) as err:
        _user_error(err, rank)
        os._exit(2)
    except KeyboardInterrupt:   # torchrun passes on a Ctrl-C; the launcher says what it kept
        os._exit(128 + signal.SIGINT)
    except BaseException as err:  # noqa: BLE001 - any failure must stop the whole job
        if lost_peer(err):
            print(f"train.py: rank {rank} stopped: another rank failed or hung "
                  f"({str(err).splitlines()[0][:200]})", file=sys.stderr, flush=True)
            os._exit(PEER_LOST_EXIT)
        print(f"train.py: rank {rank} failed: {type(err).__name__}: {err}\n"
              + "".join(traceback.format_exception(err)), file=sys.stderr, flush=True)
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    # leave without interpreter teardown: gloo's worker threads may still call into Python
    # during it and abort a rank that has finished its work (pytorch#90549)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
