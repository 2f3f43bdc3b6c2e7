"""TrainEngine: one trainable model with its optimizer, schedule and gradient
accumulation. steps/ calls `engine(...)`, `backward(loss)`, `step()`; how parameters are
placed and reduced stays in here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import get_scheduler

from engine.lora import is_lora_param
from engine.runtime import Runtime


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    grad_clip: float = 1.0          # max global grad norm; 0 = off
    grad_accum: int = 1             # micro-batches per optimizer step
    lora_lr: float | None = None    # learning rate of LoRA parameters (None = lr)


def _param_groups(model: nn.Module, optim: OptimSettings) -> list[dict]:
    """AdamW groups: no weight decay on biases and norms; LoRA at its own rate."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            key = (is_lora_param(name), param.ndim >= 2)
            groups.setdefault(key, []).append(param)
    return [
        {"params": params,
         "lr": optim.lora_lr if lora and optim.lora_lr is not None else optim.lr,
         "weight_decay": optim.weight_decay if decay else 0.0}
        for (lora, decay), params in groups.items()
    ]


class TrainEngine:
    def __init__(self, model: nn.Module, optim: OptimSettings, total_steps: int,
                 runtime: Runtime):
        self.runtime = runtime
        self.optim = optim
        self.module = model.to(runtime.device)
        self.module.train()
        fused = runtime.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(_param_groups(model, optim), lr=optim.lr,
                                           betas=optim.betas, fused=fused)
        self.scheduler = get_scheduler(optim.lr_scheduler, self.optimizer,
                                       num_warmup_steps=optim.warmup_steps,
                                       num_training_steps=max(total_steps, 1))
        self.micro_steps = 0
        self.steps = 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.optim.grad_accum).backward()
        self.micro_steps += 1

    def step(self) -> float | None:
        """Apply the optimizer at the end of an accumulation window; returns the gradient
        norm before clipping then, else None."""
        if self.micro_steps % self.optim.grad_accum != 0:
            return None
        params = [p for p in self.module.parameters() if p.grad is not None]
        max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return float(grad_norm)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()


def frozen(model: nn.Module, runtime: Runtime) -> nn.Module:
    """A model used for forward passes only (reference, reward): eval mode, no grads."""
    return model.to(runtime.device).eval().requires_grad_(False)
