"""LoRA through peft: attach adapters for training, merge them for export."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import peft
import torch
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils.error import NoMatchingPeftModuleError
from torch import nn
from transformers.pytorch_utils import Conv1D

from engine.config import LoraConfig
from engine.errors import UserError
from engine.models import head_reduced
from engine.parallel import resharded


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """peft reads transformers 5's deprecated `is_gradient_checkpointing` as it wraps a
    model: a FutureWarning for every adapter, of peft's making, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        yield


def apply_lora(model: nn.Module, lora: LoraConfig, key: str = "lora") -> nn.Module:
    """Wrap `model` with LoRA adapters (no-op when lora.dim == 0). Without
    `only_optimize_lora` the base weights keep training too (DeepSpeed-Chat's default); a
    sequence-classification `score` head always trains, since it starts random. `key`: the
    config section `lora` came from (e.g. sft.lora), which errors name."""
    if lora.dim <= 0:
        return model
    targets = lora.target_modules   # all-linear, a regex over full names, or a list of names
    targets = list(targets) if not isinstance(targets, str) else (
        [targets] if targets.isidentifier() else targets)   # q_proj: a name, as in a list
    shown = targets if isinstance(targets, str) else f"[{','.join(targets)}]"
    config = peft.LoraConfig(r=lora.dim, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=targets, exclude_modules=["score", "lm_head"])
    try:
        with peft_quietly():
            peft_model = get_peft_model(model, config)
    except ValueError as err:
        why = _unusable_targets(err)
        if why is None:
            raise
        raise UserError(f"{key}.target_modules={shown}: {why}; name some of its Linear "
                        f"modules ({', '.join(linear_names(model)[:8])}) or use all-linear"
                        ) from None
    other = next((name for name, module in peft_model.named_modules() if isinstance(
        module, LoraLayer) and not isinstance(module.get_base_layer(), nn.Linear | Conv1D)), None)
    if other is not None:   # peft adapts embeddings too; the hybrid engine folds Linear only
        raise UserError(f"{key}.target_modules={shown}: {other.rsplit('.', 1)[-1]} is not a "
                        "Linear layer, and LoRA here adapts Linear layers; name some of "
                        f"{', '.join(linear_names(model)[:8])} or use all-linear")
    for name, param in peft_model.named_parameters():
        is_head = name.split(".")[-2:-1] == ["score"]
        param.requires_grad_(is_lora_param(name) or is_head or not lora.only_optimize_lora)
    return peft_model


def _unusable_targets(err: ValueError) -> str | None:
    """What is wrong with target_modules, from peft's error; None for any other error."""
    if isinstance(err, NoMatchingPeftModuleError):
        return "matches no module of the model"
    first = str(err).split(". ")[0]   # "Target module LlamaRMSNorm(...) is not supported"
    return f"{first}: LoRA adapts Linear layers" if first.endswith("is not supported") else None


def linear_names(model: nn.Module) -> list[str]:
    """The distinct names (last part) of the Linear layers LoRA can target, heads left out."""
    names = {name.rsplit(".", 1)[-1]: None for name, module in model.named_modules()
             if isinstance(module, nn.Linear | Conv1D)}
    return [name for name in names if name not in ("score", "lm_head")]


def merged(model: nn.Module) -> nn.Module:
    """The plain transformers model with LoRA folded into its weights (in place)."""
    return model.merge_and_unload() if isinstance(model, PeftModel) else model


def active_adapters(layer: nn.Module) -> list[str]:
    """The active low-rank (lora_A/lora_B) adapters of a peft LoRA layer that are not merged
    into its base: none for a plain module."""
    if not isinstance(layer, LoraLayer) or layer.merged or layer.disable_adapters:
        return []
    return [a for a in layer.active_adapters if a in layer.lora_A]


def is_lora_param(name: str) -> bool:
    return "lora_" in name


def frozen_base(model: nn.Module) -> bool:
    """True for a LoRA model whose base does not train: only adapters (and a head) do."""
    return isinstance(model, PeftModel) and not any(
        p.requires_grad for name, p in model.named_parameters()
        if not is_lora_param(name) and name.split(".")[-2:-1] != ["score"])


class BaseWithoutAdapters:
    """The frozen base under a LoRA model, called as a forward-only model (eval mode, no
    gradients, adapters disabled): step 3's reference policy without a second copy."""

    def __init__(self, model: PeftModel):
        self.model = model

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                try:
                    return self.model(*args, **kwargs)
                finally:
                    # peft turns requires_grad back on for the parameters registered when the
                    # context exits; under hpZ a forward leaves FSDP units holding other
                    # objects than the sharded ones the optimizer steps (LoRA stopped
                    # training), so the sharded ones are registered first
                    resharded(self.model)
        finally:
            self.model.train(training)

    def head_reduced(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
                     reduce, packed: bool = False) -> torch.Tensor:
        """[B, keep] reduction of the base's last `keep` logits, made a few rows at a time
        (see engine.models.head_reduced)."""
        return head_reduced(self.model, input_ids, attention_mask, keep, reduce, call=self,
                            packed=packed)
