"""The schema of a run's config: key names and types. The values (defaults) live in
configs/config.yaml and configs/recipe/; Hydra merges them onto this schema, so an
override of an unknown key or of the wrong type (`ppo.kl_coef=abc`) is refused before
anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional  # noqa: UP035 - OmegaConf's schema needs typing.Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class LoraConfig:
    dim: int = MISSING                  # rank; 0 = off
    alpha: float = MISSING
    dropout: float = MISSING
    target_modules: Any = MISSING       # "all-linear" or a list of module names
    only_optimize_lora: bool = MISSING
    learning_rate: Optional[float] = MISSING  # noqa: UP045


@dataclass
class DataConfig:
    path: list[str] = MISSING
    split: list[float] = MISSING
    eval_fraction: float = MISSING
    max_prompt_len: int = MISSING
    max_answer_len: int = MISSING
    demo_pairs: int = MISSING


@dataclass
class HybridConfig:
    enabled: bool = MISSING
    kernel_injection: bool = MISSING
    pin_parameters: bool = MISSING
    release_inference_cache: bool = MISSING
    gather_group_size: int = MISSING
    cuda_graphs: bool = MISSING
    fused_kernels: bool = MISSING


@dataclass
class EngineConfig:
    device: str = MISSING
    dtype: str = MISSING
    procs: int = MISSING
    timeout_s: float = MISSING
    gradient_checkpointing: bool = MISSING
    offload: bool = MISSING
    shard_frozen_models: bool = MISSING
    offload_reference_model: bool = MISSING
    offload_reward_model: bool = MISSING
    checkpoint_every: int = MISSING
    keep_checkpoints: int = MISSING
    hybrid: HybridConfig = field(default_factory=HybridConfig)


@dataclass
class LaunchConfig:
    nnodes: int = MISSING
    node_rank: Optional[int] = MISSING  # noqa: UP045
    master_addr: str = MISSING
    master_port: int = MISSING
    hostfile: Optional[str] = MISSING  # noqa: UP045


@dataclass
class TrainConfig:
    """Step 1 (SFT) and step 2 (reward model) share this shape."""

    epochs: int = MISSING
    batch_size: int = MISSING
    grad_accum: int = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING
    lr_scheduler: str = MISSING
    warmup_steps: int = MISSING
    grad_clip: float = MISSING
    eval_batch_size: int = MISSING
    log_every: int = MISSING
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class EmaConfig:
    enabled: bool = MISSING
    beta: float = MISSING


@dataclass
class PtxConfig:
    enabled: bool = MISSING
    coef: float = MISSING
    batch_size: int = MISSING


@dataclass
class PPOConfig:
    actor_path: Optional[str] = MISSING  # noqa: UP045
    reward_path: Optional[str] = MISSING  # noqa: UP045
    epochs: int = MISSING
    rollout_batch_size: int = MISSING
    ppo_epochs: int = MISSING
    micro_batch_size: int = MISSING
    actor_lr: float = MISSING
    critic_lr: float = MISSING
    weight_decay: float = MISSING
    lr_scheduler: str = MISSING
    warmup_steps: int = MISSING
    grad_clip: float = MISSING
    kl_coef: float = MISSING
    score_clip: float = MISSING
    clip_range: float = MISSING
    value_clip_range: float = MISSING
    gamma: float = MISSING
    lam: float = MISSING
    whiten_advantages: bool = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    top_k: int = MISSING
    max_new_tokens: int = MISSING
    eval_prompts: int = MISSING
    log_every: int = MISSING
    ema: EmaConfig = field(default_factory=EmaConfig)
    ptx: PtxConfig = field(default_factory=PtxConfig)
    actor_lora: LoraConfig = field(default_factory=LoraConfig)
    critic_lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class WandbConfig:
    enabled: bool = MISSING
    mode: str = MISSING
    project: str = MISSING
    group: Optional[str] = MISSING  # noqa: UP045
    run_name: Optional[str] = MISSING  # noqa: UP045


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = MISSING


@dataclass
class RunConfig:
    actor_model: Optional[str] = MISSING  # noqa: UP045
    reward_model: Optional[str] = MISSING  # noqa: UP045
    tokenizer: Optional[str] = MISSING  # noqa: UP045
    steps: list[int] = MISSING
    output_dir: str = MISSING
    overwrite: bool = MISSING
    resume: str = MISSING
    seed: int = MISSING
    trust_remote_code: bool = MISSING
    deployment_type: str = MISSING
    actor_zero_stage: int = MISSING
    reward_zero_stage: int = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    sft: TrainConfig = field(default_factory=TrainConfig)
    rm: TrainConfig = field(default_factory=TrainConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


LIST_KEYS = ("steps", "data.path", "data.split")


def register() -> None:
    """Make the schema available to configs/config.yaml as `schema`."""
    ConfigStore.instance().store(name="schema", node=RunConfig)
