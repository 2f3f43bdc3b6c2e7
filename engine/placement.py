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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.engine import OptimSettings, TrainEngine
from engine.hybrid import HybridEngine, HybridSettings
from engine.models import load_causal_lm, load_reward_model
from engine.parallel import ShardSettings, frozen
from engine.runtime import Runtime
from engine.zeropp import ZeroPPSettings


@dataclass(frozen=True)
class Placement:
    runtime: Runtime
    zero_stages: Mapping[str, int]      # trained role -> ZeRO stage
    offload: bool = False
    gradient_checkpointing: bool = False
    shard_frozen_models: bool = True
    offload_frozen: Mapping[str, bool] = field(default_factory=dict)  # frozen role -> offload
    hybrid: HybridSettings = HybridSettings()
    zeropp: ZeroPPSettings = ZeroPPSettings()

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
                   hybrid=HybridSettings(**engine_cfg["hybrid"]),
                   zeropp=zeropp_settings(engine_cfg["zeropp"], runtime))

    def load_dtype(self, trained: bool) -> torch.dtype:
        """Trained weights load as the master copy (fp32 when sharded under mixed
        precision), frozen ones in the compute dtype."""
        return self.runtime.master_dtype if trained else self.runtime.dtype

    def causal_lm(self, spec: str, tokenizer, *, trained: bool, **kwargs) -> nn.Module:
        return load_causal_lm(spec, tokenizer, dtype=self.load_dtype(trained), **kwargs)

    def reward_model(self, spec: str, tokenizer, *, trained: bool, **kwargs) -> nn.Module:
        return load_reward_model(spec, tokenizer, dtype=self.load_dtype(trained), **kwargs)

    def _sharding(self, role: str) -> ShardSettings:
        return ShardSettings(zero_stage=self.zero_stages[role], offload=self.offload,
                             activation_checkpointing=self.gradient_checkpointing,
                             zeropp=self.zeropp)

    def trainer(self, model: nn.Module, optim: OptimSettings, total_steps: int, *,
                role: str) -> TrainEngine:
        """A trained model of `role` ("actor" or "reward") with its optimizer."""
        return TrainEngine(model, optim, total_steps, self.runtime, self._sharding(role))

    def rollout_actor(self, model: nn.Module, optim: OptimSettings,
                      total_steps: int) -> HybridEngine:
        """Step 3's actor: trained as the "actor" role, generating through the hybrid
        engine."""
        return HybridEngine(model, optim, total_steps, self.runtime, self._sharding("actor"),
                            self.hybrid)

    def frozen(self, model: nn.Module, *, role: str) -> nn.Module:
        """A forward-only model of `role` ("reference" or "reward")."""
        return frozen(model, self.runtime, sharded=self.shard_frozen_models,
                      offload=self.offload_frozen.get(role, False))


def zeropp_settings(cfg: Mapping, runtime: Runtime) -> ZeroPPSettings:
    """`engine.zeropp` -> ZeroPPSettings. Its `hpz` reads as DeepSpeed's
    zero_hpz_partition_size (1: off), with 0 for "the ranks of one node"."""
    size = runtime.ranks_per_node if cfg["hpz"] == 0 else cfg["hpz"]
    return ZeroPPSettings(qwz=cfg["qwz"], hpz=size if size > 1 else 0, qgz=cfg["qgz"],
                          weight_bits=cfg["weight_bits"], grad_bits=cfg["grad_bits"],
                          block=cfg["block"])
