"""Where every model of a run lives, decided in one place from the `engine` config group
and the ZeRO-stage flags: which dtype it is loaded in, whether it is sharded or
replicated, offloaded, and how it trains or generates. steps/ asks for a model by its
role and gets it placed:

  role "actor"      the trained policy (step 1's SFT model, step 3's actor): --actor-zero-stage
  role "reward"     the trained scorer (step 2's reward model, step 3's critic): --reward-zero-stage
  frozen "reference", "reward"   step 3's forward-only models: ZeRO-3 sharded or replicated
                    (engine.shard_frozen_models), optionally kept on the CPU between uses

ZeRO++ (`engine.zeropp`) applies to the trained ZeRO-3 models; frozen models are gathered
exactly (their log-probs and scores are the KL anchor and the reward).

A trained model with LoRA over a frozen base keeps that base in the compute dtype; with
`engine.quantized_base` the base's Linear and Embedding weights are INT8/INT4 instead,
quantized while loading (engine/quantized_base.py). Step 3's reference is then the actor
with its adapters disabled (`engine.share_reference`), not a second copy of the base.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from tqdm.auto import tqdm

from engine.config import (
    HybridConfig,
    LoraConfig,
    OptimConfig,
    QuantizedBaseConfig,
    ZeroPPConfig,
)
from engine.hybrid import HybridEngine
from engine.lora import BaseWithoutAdapters, apply_lora, frozen_base
from engine.models import load_causal_lm, load_quantized, load_reward_model
from engine.parallel import ShardSettings, frozen
from engine.quantized_base import describe
from engine.runtime import Runtime
from engine.trainer import TrainEngine


@dataclass(frozen=True)
class Placement:
    runtime: Runtime
    zero_stages: Mapping[str, int]      # trained role -> ZeRO stage
    offload: bool = False
    gradient_checkpointing: bool = False
    shard_frozen_models: bool = True
    offload_frozen: Mapping[str, bool] = field(default_factory=dict)  # frozen role -> offload
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    zeropp: ZeroPPConfig = field(default_factory=ZeroPPConfig)
    quantized_base: QuantizedBaseConfig = field(default_factory=QuantizedBaseConfig)
    share_reference: bool = True
    max_skipped_steps: int = 5          # non-finite updates in a row before the run stops
    zeropp_quantize: bool = True        # False: ZeRO++'s hooks send exact values (tests)

    @classmethod
    def from_config(cls, engine_cfg: Mapping, runtime: Runtime, *, actor_zero_stage: int,
                    reward_zero_stage: int) -> Placement:
        """From the `engine` config group (and the two --*-zero-stage flags)."""
        return cls(runtime, {"actor": actor_zero_stage, "reward": reward_zero_stage},
                   offload=engine_cfg["offload"],
                   gradient_checkpointing=engine_cfg["gradient_checkpointing"],
                   shard_frozen_models=engine_cfg["shard_frozen_models"],
                   offload_frozen={"reference": engine_cfg["offload_reference_model"],
                                   "reward": engine_cfg["offload_reward_model"]},
                   hybrid=HybridConfig(**engine_cfg["hybrid"]),
                   zeropp=ZeroPPConfig(**engine_cfg["zeropp"]),
                   quantized_base=QuantizedBaseConfig(**engine_cfg["quantized_base"]),
                   share_reference=engine_cfg["share_reference"],
                   max_skipped_steps=engine_cfg["max_skipped_steps"])

    def causal_lm(self, spec: str, tokenizer, *, trained: bool,
                  lora: LoraConfig | None = None, **kwargs) -> nn.Module:
        """A causal LM; a trained one gets its LoRA adapters (`lora`) here."""
        return self._load("causal_lm", spec, tokenizer, trained, lora, **kwargs)

    def reward_model(self, spec: str, tokenizer, *, trained: bool,
                     lora: LoraConfig | None = None, **kwargs) -> nn.Module:
        """A one-label scorer (reward model, critic); LoRA as for causal_lm."""
        return self._load("reward_model", spec, tokenizer, trained, lora, **kwargs)

    def _load(self, kind: str, spec: str, tokenizer, trained: bool, lora: LoraConfig | None,
              **kwargs) -> nn.Module:
        lora, rt = lora or LoraConfig(), self.runtime
        if trained and self.quantized_base.enabled and lora.dim > 0:
            # filled module by module where it will run (sharding moves blocks to the device)
            model, report = load_quantized(
                kind, spec, tokenizer, self.quantized_base, dtype=rt.dtype,
                head_dtype=rt.precision.master, device=torch.device("cpu") if rt.distributed
                else rt.device, **kwargs)
            if rt.is_main:
                tqdm.write(describe(report, spec, self.quantized_base))
            lora = replace(lora, only_optimize_lora=True)   # integer weights cannot train
        else:
            if trained and self.quantized_base.enabled and rt.is_main:
                tqdm.write(f"quantized base: {spec} trains without LoRA here, so its weights "
                           "stay in full precision")
            load = load_causal_lm if kind == "causal_lm" else load_reward_model
            # trained weights load as the fp32 master copy, frozen ones in the compute dtype
            model = load(spec, tokenizer, dtype=rt.precision.load_dtype(trained), **kwargs)
        if not trained:
            return model
        model = apply_lora(model, lora)
        if frozen_base(model):   # no master copy for weights that never update
            for param in model.parameters():
                if not param.requires_grad and param.is_floating_point():
                    param.data = param.data.to(rt.dtype)
        return model

    def _sharding(self, role: str) -> ShardSettings:
        return ShardSettings(zero_stage=self.zero_stages[role], offload=self.offload,
                             activation_checkpointing=self.gradient_checkpointing,
                             zeropp=self.zeropp, zeropp_quantize=self.zeropp_quantize)

    def trainer(self, model: nn.Module, optim: OptimConfig, total_steps: int, *,
                role: str, name: str | None = None, **rates) -> TrainEngine:
        """A trained model of `role` ("actor" or "reward") with its optimizer; `name` (the
        role by default) is what its errors call it; `rates`: TrainEngine's lr, lora_lr and
        grad_accum."""
        return TrainEngine(model, optim, total_steps, self.runtime, self._sharding(role),
                           name=name or role, max_skipped_steps=self.max_skipped_steps, **rates)

    def rollout_actor(self, model: nn.Module, optim: OptimConfig, total_steps: int,
                      **rates) -> HybridEngine:
        """Step 3's actor: trained as the "actor" role, generating through the hybrid engine."""
        return HybridEngine(model, optim, total_steps, self.runtime, self._sharding("actor"),
                            self.hybrid, name="actor", max_skipped_steps=self.max_skipped_steps,
                            **rates)

    def reference(self, actor: TrainEngine, spec: str, tokenizer, **kwargs):
        """Step 3's KL anchor, the step-1 model `spec` that `actor` started from: the actor
        itself with its adapters disabled when it is LoRA over a frozen base (and
        engine.share_reference), else a separately loaded frozen model."""
        if self.share_reference and frozen_base(actor.module):
            return BaseWithoutAdapters(actor.module)
        return self.frozen(self.causal_lm(spec, tokenizer, trained=False, **kwargs),
                           role="reference")

    def frozen(self, model: nn.Module, *, role: str) -> nn.Module:
        """A forward-only model of `role` ("reference" or "reward")."""
        return frozen(model, self.runtime, sharded=self.shard_frozen_models,
                      offload=self.offload_frozen.get(role, False))

