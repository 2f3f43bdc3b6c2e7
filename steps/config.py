"""A run's config: every key, its type, its default and its one-line comment, in one place.
Defaults follow DeepSpeed-Chat's settings for OPT-1.3B-class actors; configs/recipe/ holds
override files (`demo`, which train.py picks when given no model, scales them down).
Hydra composes configs/config.yaml (this schema, then a recipe) and the command line onto
it, so an unknown key or a value of the wrong type (`ppo.kl_coef=abc`) is refused before
anything runs; `listing()` is what `train.py --help` prints."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, NamedTuple, Optional  # noqa: UP035 - OmegaConf's schema needs Optional

from hydra.core.config_store import ConfigStore


class Rule(NamedTuple):
    """What values a key allows: `test(value)` is true for those, `allowed` says which."""

    test: Callable[[Any], bool]
    allowed: str


def at_least(n: float) -> Rule:
    return Rule(lambda v: v >= n, f"give {n} or more")


def above(n: float) -> Rule:
    return Rule(lambda v: v > n, f"give a number above {n}")


def within(low: float, high: float, *, high_open: bool = False) -> Rule:
    return Rule(lambda v: low <= v < high if high_open else low <= v <= high,
                f"give a number in [{low}, {high}{')' if high_open else ']'}")


def one_of(*choices: Any) -> Rule:
    names = list(map(str, choices))
    said = " or ".join(names) if len(names) == 2 else f"one of {', '.join(names)}"
    return Rule(lambda v: v in choices, f"choose {said}")


def each(rule: Rule) -> Rule:
    return Rule(lambda v: all(rule.test(x) for x in v), f"{rule.allowed}, for every entry")


POSITIVE, COUNT, NON_NEGATIVE = above(0), at_least(1), at_least(0)
EVEN = Rule(lambda v: v >= 2 and v % 2 == 0, "give an even number of values, e.g. 64")
SCHEDULERS = one_of("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                    "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau",
                    "cosine_with_min_lr", "warmup_stable_decay")


def val(default: Any, help: str = "", ok: Rule | None = None) -> Any:
    """A field's default with its comment and the values it allows (`ok`, checked by
    `validate`). A list, or a callable making the value (a section's class), is a default
    factory, so every config gets its own."""
    meta = {"help": help, "ok": ok}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class LoraConfig:
    dim: int = val(0, "rank; 0 = off", NON_NEGATIVE)
    alpha: float = val(16.0, ok=POSITIVE)
    dropout: float = val(0.0, ok=within(0, 1, high_open=True))
    target_modules: Any = val("all-linear", '"all-linear" or a list of module names')
    only_optimize_lora: bool = False
    learning_rate: Optional[float] = val(5e-4, "null: the model's", POSITIVE)  # noqa: UP045


@dataclass
class DataConfig:
    path: list[str] = val(["Dahoas/rm-static"], "files (.json .jsonl .jsonl.gz .parquet), "
                          'dirs, hub names, or "demo"')
    split: list[float] = val([2.0, 4.0, 4.0], "share of every source for steps 1, 2, 3",
                             each(NON_NEGATIVE))
    eval_fraction: float = val(0.05, "held out of each step's share for evaluation",
                               within(0, 1, high_open=True))
    max_prompt_len: int = val(256, "longer prompts are dropped (and counted)", COUNT)
    max_answer_len: int = val(256, "longer answers are truncated", COUNT)
    demo_pairs: int = val(4000, "size of the built-in demo data set", COUNT)
    demo_task: str = val("digits", 'what "demo" generates: digits | distinct | pick '
                         '(steps/demo.py)')


@dataclass
class HybridConfig:
    enabled: bool = val(True, "false: generate on the sharded training model (slow)")
    kernel_injection: bool = val(True, "fused inference modules (Llama, OPT families); "
                                 "false: a gathered HF copy")
    pin_parameters: bool = val(True, "keep the gathered inference weights between rollouts "
                               "(false: free them)")
    release_inference_cache: bool = val(False, "free the KV cache after every rollout")
    gather_group_size: int = val(1, "decoder layers all-gathered at once (bounds the "
                                 "gather's extra memory)", COUNT)
    cuda_graphs: bool = val(True, "capture the decode step as a CUDA graph (CUDA only)")
    fused_kernels: bool = val(True, "Triton kernels for add+norm and SiLU*up (CUDA only)")


@dataclass
class ZeroPPConfig:
    qwz: bool = val(False, "qwZ: weight all-gathers quantized block-wise across nodes")
    hpz: int = val(1, "hpZ: a secondary weight partition of N ranks that serves the backward "
                   "all-gather; 1 = off, 0 = the ranks of one node",
                   Rule(lambda v: v >= 0, "give 1 (off), 0 (one node's ranks) or the "
                        "partition's rank count"))
    qgz: bool = val(False, "qgZ: gradient reduce-scatter as a quantized all-to-all, inside "
                    "the node, then across")
    weight_bits: int = val(8, "qwZ: 8 or 4", one_of(8, 4))
    grad_bits: int = val(8, "qgZ: 8 or 4", one_of(8, 4))
    block: int = val(256, "values per quantization block (one fp32 scale each)", EVEN)


@dataclass
class QuantizedBaseConfig:
    enabled: bool = val(False, "LoRA models keep their frozen Linear/Embedding weights as "
                        "integers: sharded, gathered and stored quantized")
    bits: int = val(8, "8 or 4", one_of(8, 4))
    block: int = val(64, "values per scale along a row", EVEN)


@dataclass
class EngineConfig:
    device: str = val("auto", "auto | cpu | cuda | cuda:N",
                      Rule(lambda v: v in ("auto", "cpu", "cuda") or (
                          v.startswith("cuda:") and v[5:].isdigit()),
                           "choose auto, cpu, cuda or cuda:N"))
    dtype: str = val("auto", "compute dtype: auto (bf16 on CUDA, fp32 on CPU) | float32 | "
                     "bfloat16; trained weights and optimizer state stay fp32",
                     one_of("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"))
    procs: int = val(1, "processes on this node; >1 starts them through torchrun (gloo on "
                     "CPU, NCCL on CUDA)", COUNT)
    procs_per_node: Optional[int] = val(None, "ranks per node for ZeRO++ (default: "  # noqa: UP045
                                        "torchrun's); fewer than engine.procs simulates "
                                        "nodes on one machine")
    timeout_s: float = val(600.0, "collective timeout: a dead or hung rank stops the job "
                           "within it", POSITIVE)
    gradient_checkpointing: bool = val(False, "activation checkpointing of the trained models")
    offload: bool = val(False, "ZeRO-Offload: trained models' params and optimizer state on "
                        "the CPU (CUDA runs)")
    shard_frozen_models: bool = val(True, "step 3 reference and reward models: ZeRO-3 "
                                    "sharded (true) or replicated")
    offload_reference_model: bool = val(False, "keep the reference model on the CPU between uses")
    offload_reward_model: bool = False
    max_skipped_steps: int = val(5, "updates with a non-finite loss or gradient norm are "
                                 "skipped; this many in a row stop the run", COUNT)
    checkpoint_every: int = val(200, "optimizer steps (steps 1, 2) / PPO iterations (step 3) "
                                "between checkpoints; 0 = none", NON_NEGATIVE)
    keep_checkpoints: int = val(1, ok=COUNT)
    hybrid: HybridConfig = val(HybridConfig, "step 3's actor generates in inference form "
                               "(engine/hybrid.py)")
    zeropp: ZeroPPConfig = val(ZeroPPConfig, "ZeRO++ on the trained ZeRO-3 models "
                               "(engine/zeropp.py)")
    quantized_base: QuantizedBaseConfig = val(QuantizedBaseConfig, "frozen base of LoRA "
                                              "models in INT8/INT4 (engine/quantized_base.py)")
    share_reference: bool = val(True, "step 3: a LoRA actor over a frozen base is its own "
                                "reference (adapters disabled); false: a separate copy")
    log_comm: bool = val(False, "debug: log rank 0's collective bytes (comm/*, intra- and "
                         "cross-node) with each metrics row")


@dataclass
class LaunchConfig:
    nnodes: int = 1
    node_rank: Optional[int] = val(None, "this node's rank (default 0, or its place in the "  # noqa: UP045
                                   "hostfile)")
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    hostfile: Optional[str] = val(None, 'DeepSpeed-style "host slots=N" lines: sets nnodes, '  # noqa: UP045
                                  "master_addr, procs")


@dataclass
class TrainConfig:
    """Step 1 (SFT) and step 2 (reward model) share this shape."""

    epochs: int = val(1, ok=COUNT)
    batch_size: int = val(8, "examples (step 2: pairs) per micro-batch", COUNT)
    grad_accum: int = val(1, ok=COUNT)
    lr: float = val(9.65e-6, ok=POSITIVE)
    weight_decay: float = val(0.0, ok=NON_NEGATIVE)
    lr_scheduler: str = val("cosine", ok=SCHEDULERS)
    warmup_steps: int = val(0, ok=NON_NEGATIVE)
    grad_clip: float = val(1.0, "max gradient norm; 0 = off", NON_NEGATIVE)
    eval_batch_size: int = val(16, ok=COUNT)
    log_every: int = val(10, ok=COUNT)
    lora: LoraConfig = val(LoraConfig)


@dataclass
class EmaConfig:
    enabled: bool = False
    beta: float = val(0.992, ok=within(0, 1, high_open=True))


@dataclass
class PtxConfig:
    enabled: bool = False
    coef: float = val(27.8, ok=NON_NEGATIVE)
    batch_size: int = val(8, ok=COUNT)


@dataclass
class PPOConfig:
    actor_path: Optional[str] = val(None, "default: <output_dir>/actor (step 1)")  # noqa: UP045
    reward_path: Optional[str] = val(None, "default: <output_dir>/reward (step 2); the "  # noqa: UP045
                                     "critic starts from it")
    epochs: int = val(1, "passes over the step-3 prompts", COUNT)
    rollout_batch_size: int = val(8, "prompts per generation round", COUNT)
    ppo_epochs: int = val(1, "optimisation passes over each round's experience", COUNT)
    micro_batch_size: int = val(8, "answers per optimizer step", COUNT)
    actor_lr: float = val(9.65e-6, ok=POSITIVE)
    critic_lr: float = val(5e-6, ok=POSITIVE)
    weight_decay: float = val(0.0, ok=NON_NEGATIVE)
    lr_scheduler: str = val("linear", ok=SCHEDULERS)
    warmup_steps: int = val(0, ok=NON_NEGATIVE)
    grad_clip: float = val(1.0, "max gradient norm; 0 = off", NON_NEGATIVE)
    algorithm: str = val("ppo", "ppo | grpo | rloo | reinforce_pp (the last three train no "
                         "critic)", one_of("ppo", "grpo", "rloo", "reinforce_pp"))
    samples_per_prompt: int = val(1, "answers sampled per prompt, a group (GRPO and RLOO need "
                                  ">= 2); rollout_batch_size counts prompts", COUNT)
    grpo_scale_rewards: bool = val(True, "GRPO: divide by the group's std (false: Dr. GRPO)")
    reward_fn: Optional[str] = val(None, "package.module:function, (prompt, answer) -> float: "  # noqa: UP045
                                   "a rule-based reward (the demo's: steps.demo:score)")
    reward_fn_weight: float = 1.0
    reward_model_weight: float = val(1.0, "0: no reward model, reward_fn alone (step 2 not needed)")
    kl_coef: float = val(0.1, ok=NON_NEGATIVE)
    kl_penalty: str = val("auto", "reward | loss | auto (loss for grpo, reward otherwise)",
                          one_of("auto", "reward", "loss"))
    kl_estimator: str = val("auto", "k1 | k2 | k3 | auto (k3 as a loss, k1 in the reward)",
                            one_of("auto", "k1", "k2", "k3"))
    kl_target: Optional[float] = val(None, "adaptive KL controller (Ziegler et al.): the KL "  # noqa: UP045
                                     "per answer to hold; null: kl_coef stays fixed", POSITIVE)
    kl_horizon: float = val(10000.0, "adaptive KL: samples over which it closes the gap",
                            POSITIVE)
    missing_eos_penalty: Optional[float] = val(None, "subtracted from the score of answers "  # noqa: UP045
                                               "cut off without EOS")
    loss_aggregation: str = val("token-mean", "token-mean | seq-mean (each answer's mean, "
                                "then over answers)", one_of("token-mean", "seq-mean"))
    score_clip: float = val(5.0, ok=POSITIVE)
    clip_range: float = val(0.2, ok=POSITIVE)
    value_clip_range: float = val(0.2, ok=POSITIVE)
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
    eval_prompts: int = val(64, "held-out prompts scored before and after PPO", NON_NEGATIVE)
    log_every: int = val(1, ok=COUNT)
    ema: EmaConfig = val(EmaConfig)
    ptx: PtxConfig = val(PtxConfig, "pretraining loss on step-1 data")
    actor_lora: LoraConfig = val(LoraConfig)
    critic_lora: LoraConfig = val(LoraConfig)


@dataclass
class WandbConfig:
    enabled: bool = False
    mode: str = val("auto", "auto (offline without an API key) | online | offline | disabled",
                    one_of("auto", "online", "offline", "disabled"))
    project: str = "rlhf"
    group: Optional[str] = None  # noqa: UP045
    run_name: Optional[str] = None  # noqa: UP045


@dataclass
class LoggingConfig:
    wandb: WandbConfig = val(WandbConfig)
    progress: bool = val(True, "tqdm bars")


@dataclass
class RunConfig:
    actor_model: Optional[str] = val(None, "preset (tiny-llama, tiny-opt, tiny-gpt2, "  # noqa: UP045
                                     "tiny-gpt-neox), HF dir or hub name")
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
    sft: TrainConfig = val(TrainConfig)
    rm: TrainConfig = val(lambda: TrainConfig(lr=5e-6, weight_decay=0.1))
    ppo: PPOConfig = val(PPOConfig)
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
            shown = value if isinstance(value, str | int | float) else list(value)
            raise BadValue(f"{prefix}{f.name}", shown, rule.allowed)


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


def register() -> None:
    """Make the schema available to configs/config.yaml as `schema`."""
    ConfigStore.instance().store(name="schema", node=RunConfig)
