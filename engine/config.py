"""The engine's config groups: every key engine/ reads, its type, default, one-line comment
(`train.py --help`) and allowed values (`ok`, checked once by steps/config.py's `validate`),
declared once. steps/config.py composes them into the run's schema (the `engine` group,
each section's `lora`, the optimizer keys of `sft`, `rm` and `ppo`); engine code takes these
objects as they are. Plain (not frozen) dataclasses: Hydra applies overrides to them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional  # noqa: UP035 - OmegaConf's schema needs Optional


class Rule(NamedTuple):
    """What values a key allows: `test(value)` is true for those, `allowed` says which."""

    test: Callable[[Any], bool]
    allowed: str


# The numeric rules refuse inf and nan (`sft.lr=inf`, YAML's .inf): OmegaConf takes them as
# floats, and they would only fail once training produced non-finite weights or counts.
# steps/config.py's `validate` says "not a finite number" for those, so the texts below
# keep to the range.
FINITE = Rule(math.isfinite, "give a finite number")


def at_least(n: float) -> Rule:
    return Rule(lambda v: math.isfinite(v) and v >= n, f"give {n} or more")


def above(n: float) -> Rule:
    return Rule(lambda v: math.isfinite(v) and v > n, f"give a number above {n}")


def within(low: float, high: float, *, high_open: bool = False) -> Rule:
    def test(v: float) -> bool:
        return math.isfinite(v) and (low <= v < high if high_open else low <= v <= high)

    return Rule(test, f"give a number in [{low}, {high}{')' if high_open else ']'}")


def one_of(*choices: Any) -> Rule:
    names = list(map(str, choices))
    said = " or ".join(names) if len(names) == 2 else f"one of {', '.join(names)}"
    return Rule(lambda v: v in choices, f"choose {said}")


def each(rule: Rule) -> Rule:
    return Rule(lambda v: all(rule.test(x) for x in v), f"{rule.allowed}, for every entry")


POSITIVE, COUNT, NON_NEGATIVE = above(0), at_least(1), at_least(0)
# AdamW moves every weight by about the learning rate each update: above 1 it is a typo
# (at 1e38 step 1's model evaluated to NaN, and step 3's Adam step size overflowed)
LEARNING_RATE = Rule(lambda v: math.isfinite(v) and 0 < v <= 1,
                     "give a learning rate above 0 and at most 1")
EVEN = Rule(lambda v: v >= 2 and v % 2 == 0, "give an even number of values, e.g. 64")
# transformers' schedules that need nothing beyond the warmup and the length (and
# cosine_with_min_lr its floor); reduce_lr_on_plateau would need a metric to watch
SCHEDULER_NAMES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                   "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr")
SCHEDULERS = one_of(*SCHEDULER_NAMES)


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
class OptimConfig:
    """AdamW (betas 0.9, 0.95) and its schedule: the keys every trained section shares
    (`sft`, `rm`, `ppo` inherit them); learning rates are the sections' own."""

    weight_decay: float = val(0.0, ok=NON_NEGATIVE)
    lr_scheduler: str = val("cosine", ok=SCHEDULERS)
    warmup_steps: int = val(0, ok=NON_NEGATIVE)
    warmup_ratio: float = val(0.0, "warmup as a fraction of the section's optimizer steps, "
                              "rounded up (OpenRLHF's --lr_warmup_ratio, TRL's warmup_ratio); "
                              "for warmup_steps=0", within(0, 1, high_open=True))
    min_lr_ratio: float = val(0.1, "cosine_with_min_lr's floor, a fraction of the learning "
                              "rate", within(0, 1))
    grad_clip: float = val(1.0, "max gradient norm; 0 = off", NON_NEGATIVE)


@dataclass
class LoraConfig:
    dim: int = val(0, "rank; 0 = off", NON_NEGATIVE)
    alpha: float = val(16.0, ok=POSITIVE)
    dropout: float = val(0.0, ok=within(0, 1, high_open=True))
    target_modules: Any = val("all-linear", '"all-linear", a list of module names (or one '
                              'name), or a regex over full module names')
    only_optimize_lora: bool = False
    learning_rate: Optional[float] = val(5e-4, "null: the model's", LEARNING_RATE)  # noqa: UP045


@dataclass
class HybridConfig:
    enabled: bool = val(True, "false: generate on the sharded training model (slow)")
    kernel_injection: bool = val(True, "fused inference modules (Llama, OPT families); "
                                 "false: a gathered HF copy")
    pin_parameters: bool = val(True, "keep the gathered inference weights between rollouts "
                               "(false: free them)")
    release_inference_cache: bool = val(False, "free the KV cache after every rollout (made "
                                        "again for the next; its CUDA graphs kept when it "
                                        "lands at the same address)")
    cache_holds_gradients: bool = val(True, "one process: between rollouts the KV cache's "
                                      "and the inference weights' memory holds the policy's "
                                      "gradients (as many as fit); both are written again "
                                      "before the next rollout, its CUDA graphs kept")
    gather_group_size: int = val(1, "decoder layers all-gathered at once (bounds the "
                                 "gather's extra memory)", COUNT)
    cuda_graphs: bool = val(True, "capture the decode step as a CUDA graph (CUDA only)")
    fused_kernels: bool = val(True, "Triton kernels for add+norm, SiLU*up and quantized "
                              "matmuls (CUDA only)")
    quantized_inference: bool = val(True, "with a quantized base (engine.quantized_base), "
                                    "generate from its INT8/INT4 weights with LoRA beside "
                                    "them; false: a dequantized full-precision copy")


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
                     "bfloat16 | float16 (with dynamic loss scaling); trained weights and "
                     "optimizer state stay fp32",
                     one_of("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"))
    procs: int = val(1, "processes on this node; >1 starts them through torchrun (gloo on "
                     "CPU, NCCL on CUDA)", COUNT)
    procs_per_node: Optional[int] = val(None, "ranks per node for ZeRO++ (default: "  # noqa: UP045
                                        "torchrun's); fewer than engine.procs simulates "
                                        "nodes on one machine", COUNT)
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
