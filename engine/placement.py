"""Where every model of a run lives, decided in one place from the `engine` config group
and the ZeRO-stage flags: which dtype it is loaded in, whether it is sharded or
replicated, offloaded, and how it trains or generates. The engine knows a model by what it
is, not by its part in a step: steps/ names each model's family, which decides the rest:

  "policy"  a causal LM (step 1's model; step 3's actor and its reference): trained at
            zero_stages["policy"] (--actor-zero-stage), through the hybrid engine when it
            `generates`; frozen, on the CPU between uses with engine.offload_reference_model
  "scorer"  a one-label sequence scorer (step 2's reward model; step 3's critic and reward
            model): trained at zero_stages["scorer"] (--reward-zero-stage); frozen, on the
            CPU between uses with engine.offload_reward_model

Frozen models are ZeRO-3 sharded or replicated (engine.shard_frozen_models). ZeRO++
(`engine.zeropp`) applies to the trained ZeRO-3 models; frozen models are gathered exactly
(their log-probs and scores are the KL anchor and the reward).

A trained model with LoRA over a frozen base keeps that base in the compute dtype; with
`engine.quantized_base` the base's Linear and Embedding weights are INT8/INT4 instead,
quantized while loading (engine/quantized_base.py). The frozen policy a trained one started
from (`frozen_start`) is then that model with its adapters disabled
(`engine.share_reference`), not a second copy of the base.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
from torch import nn
from tqdm.auto import tqdm

from engine.config import EngineConfig, LoraConfig, OptimConfig
from engine.hybrid import HybridEngine
from engine.lora import BaseWithoutAdapters, apply_lora, frozen_base
from engine.models import load_causal_lm, load_quantized, load_reward_model
from engine.parallel import ShardSettings, frozen
from engine.quantized_base import QUANTIZED, describe
from engine.runtime import Runtime
from engine.trainer import TrainEngine

Family = Literal["policy", "scorer"]


@dataclass(frozen=True)
class Placement:
    runtime: Runtime
    engine: EngineConfig                 # the `engine` config group
    zero_stages: Mapping[Family, int]    # family -> ZeRO stage of its trained models
    zeropp_quantize: bool = True         # False: ZeRO++'s hooks send exact values (tests)

    def causal_lm(self, spec: str, tokenizer, *, trained: bool,
                  lora: LoraConfig | None = None, lora_key: str = "lora",
                  **kwargs) -> nn.Module:
        """A causal LM (a policy); a trained one gets its LoRA adapters (`lora`, the config
        section `lora_key`, which errors name) here."""
        return self._load("causal_lm", spec, tokenizer, trained, lora, lora_key, **kwargs)

    def reward_model(self, spec: str, tokenizer, *, trained: bool,
                     lora: LoraConfig | None = None, lora_key: str = "lora",
                     **kwargs) -> nn.Module:
        """A one-label sequence scorer; LoRA as for causal_lm."""
        return self._load("reward_model", spec, tokenizer, trained, lora, lora_key, **kwargs)

    def _load(self, kind: str, spec: str, tokenizer, trained: bool, lora: LoraConfig | None,
              lora_key: str, **kwargs) -> nn.Module:
        lora, rt, quantized = lora or LoraConfig(), self.runtime, self.engine.quantized_base
        if trained and quantized.enabled and lora.dim > 0:
            model = self._quantized(kind, spec, tokenizer, head_dtype=rt.precision.master,
                                    **kwargs)
            lora = replace(lora, only_optimize_lora=True)   # integer weights cannot train
        else:
            if trained and quantized.enabled and rt.is_main:
                tqdm.write(f"quantized base: {spec} trains without LoRA here, so its weights "
                           "stay in full precision")
            load = load_causal_lm if kind == "causal_lm" else load_reward_model
            # trained weights load as the fp32 master copy, frozen ones in the compute dtype
            model = load(spec, tokenizer, dtype=rt.precision.load_dtype(trained), **kwargs)
        if not trained:
            return model
        # an adapter export names its base (peft's base_model_name_or_path) by this
        model.name_or_path = str(Path(spec).resolve()) if Path(spec).is_dir() else str(spec)
        model = apply_lora(model, lora, lora_key)
        if frozen_base(model):   # no master copy for weights that never update
            for param in model.parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(rt.dtype)
        return model

    def _quantized(self, kind: str, spec: str, tokenizer, *, head_dtype: torch.dtype,
                   **kwargs) -> nn.Module:
        """`spec` with its frozen weights INT8/INT4 (engine.quantized_base), filled module by
        module where it will run (sharding moves blocks to the device)."""
        rt, settings = self.runtime, self.engine.quantized_base
        model, report = load_quantized(
            kind, spec, tokenizer, settings, dtype=rt.dtype, head_dtype=head_dtype,
            device=torch.device("cpu") if rt.distributed else rt.device, **kwargs)
        if rt.is_main:
            tqdm.write(describe(report, spec, settings))
        return model

    def _sharding(self, family: Family) -> ShardSettings:
        return ShardSettings(zero_stage=self.zero_stages[family], offload=self.engine.offload,
                             activation_checkpointing=self.engine.gradient_checkpointing,
                             zeropp=self.engine.zeropp, zeropp_quantize=self.zeropp_quantize)

    def trainer(self, model: nn.Module, optim: OptimConfig, total_steps: int, *,
                family: Family, lr: float, lora_lr: float | None = None, grad_accum: int = 1,
                generates: bool = False, name: str | None = None) -> TrainEngine:
        """A trained model of `family` with its optimizer: AdamW at `lr` (LoRA parameters at
        `lora_lr`), stepping every `grad_accum` micro-batches. A policy that `generates` is a
        HybridEngine. `name` (the family by default) is what its errors call it."""
        place = (model, optim, total_steps, self.runtime, self._sharding(family))
        kwargs = dict(lr=lr, lora_lr=lora_lr, grad_accum=grad_accum, name=name or family,
                      max_skipped_steps=self.engine.max_skipped_steps)
        if generates:
            return HybridEngine(*place, self.engine.hybrid, **kwargs)
        return TrainEngine(*place, **kwargs)

    def frozen(self, model: nn.Module, *, family: Family) -> nn.Module:
        """A forward-only model of `family`."""
        offload = (self.engine.offload_reward_model if family == "scorer"
                   else self.engine.offload_reference_model)
        return frozen(model, self.runtime, sharded=self.engine.shard_frozen_models,
                      offload=offload)

    def frozen_start(self, trained: TrainEngine, spec: str, tokenizer, **kwargs):
        """The policy `trained` started from, `spec` (step 3's KL anchor), forward only:
        `trained` itself with its adapters disabled when it is LoRA over a frozen base (and
        engine.share_reference), else `spec` loaded again as a frozen policy, quantized as
        `trained`'s base is (the policy started from the integers, not from `spec` in full
        precision: its first KL would be the quantization error)."""
        if frozen_base(trained.module) and self.engine.share_reference:
            return BaseWithoutAdapters(trained.module)
        if frozen_base(trained.module) and any(
                isinstance(m, QUANTIZED) for m in trained.module.modules()):
            model = self._quantized("causal_lm", spec, tokenizer, head_dtype=self.runtime.dtype,
                                    **kwargs)
        else:
            model = self.causal_lm(spec, tokenizer, trained=False, **kwargs)
        return self.frozen(model, family="policy")
