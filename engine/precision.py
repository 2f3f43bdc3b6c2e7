"""The run's precision policy, decided here for every path (one process or FSDP2 at any
world size, full fine-tuning, LoRA, a frozen quantized base):

  load     trained weights in `master`, frozen models (reference, reward model, a LoRA
           model's frozen base) in `compute`
  master   fp32: trained weights and the optimizer's state, whatever the compute dtype
  compute  the matmuls of every forward and backward: `engine.dtype` (bf16 on a GPU).
           Under FSDP2 its MixedPrecisionPolicy casts the gathered weights; in a single
           process the trained model's forward runs under autocast.
  reduce   fp32: gradients summed over ranks
  scale    fp16 only: the loss scaled dynamically before backward (LossScale), so that
           small gradients survive fp16's narrow range; bf16 has fp32's range
  export   the master weights (fp32), as Hugging Face's Trainer writes them under autocast;
           a quantized base is written in the compute dtype it ran in

Log-probs, KL, values, advantages and losses are fp32 by construction: steps/rlhf.py
computes them from the logits and values in fp32.

Attention in differentiated forwards avoids cuDNN's SDPA kernels on CUDA: their
backward returns NaN query gradients (PyTorch issue 196678, Hopper, torch 2.11 to 2.13,
bf16/fp16) when a mask is given, the sequence length is 64 mod 128 and a query row's
log-sum-exp is below -88.7, which every left-padded row's padding positions have (they
attend to nothing). That is what turned bf16 step 3 NaN on an H100 at the first rollout
batch 64 tokens long. Flash and memory-efficient attention take over at the same speed
for these shapes; forward-only passes (no backward) keep cuDNN. The backward runs under
the same choice: gradient checkpointing's recompute must pick the forward's kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.nn.attention import SDPBackend, sdpa_kernel

# every SDPA backend but cuDNN's, in torch's own order of preference
_TRAINING_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                       SDPBackend.MATH]


@dataclass(frozen=True)
class Precision:
    compute: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    reduce: torch.dtype = torch.float32

    @property
    def mixed(self) -> bool:
        """True when compute runs in a lower precision than the master weights."""
        return self.compute != self.master

    def load_dtype(self, trained: bool) -> torch.dtype:
        """The dtype to load a model's weights in: the master copy of a trained model,
        the compute dtype of a frozen one."""
        return self.master if trained else self.compute

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's casts: gathered weights in the compute dtype, gradients reduced in fp32."""
        if not self.mixed:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute, reduce_dtype=self.reduce)

    @contextlib.contextmanager
    def trained_forward(self, device: torch.device, *, autocast: bool) -> Iterator[None]:
        """The context of a trained model's forward: autocast to the compute dtype where
        nothing else casts (`autocast`: a single process, weights in `master`), and on
        CUDA attention kernels whose backward is sound (see the module docstring)."""
        with contextlib.ExitStack() as stack:
            if autocast and self.mixed:
                stack.enter_context(torch.autocast(device.type, dtype=self.compute))
            stack.enter_context(self.trained_backward(device))
            yield

    @contextlib.contextmanager
    def trained_backward(self, device: torch.device) -> Iterator[None]:
        """The context of a trained model's backward: the forward's attention kernels, so
        that gradient checkpointing recomputes with the backend the forward saved for
        (otherwise cuDNN's, and the recomputed tensors' shapes differ)."""
        with sdpa_kernel(_TRAINING_ATTENTION) if device.type == "cuda" else \
                contextlib.nullcontext():
            yield


class LossScale:
    """Dynamic loss scaling, on where the compute dtype is fp16 (as DeepSpeed's fp16 and
    torch.amp's GradScaler): the loss is multiplied by `value` before backward, so that
    gradients too small for fp16 (below 6e-8) survive its backward, and the gradients are
    divided by it before clipping. A non-finite gradient norm from a finite loss is an
    overflow of the scale, not of the model: the update is skipped and the scale halved
    (never below 1), and GROWTH_INTERVAL clean updates in a row double it. bf16 has fp32's
    range and needs none: `value` stays 1."""

    INITIAL, GROWTH_INTERVAL = 2.0**16, 1000

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.value = self.INITIAL if enabled else 1.0
        self.clean = 0        # updates since the last overflow or growth
        self.overflows = 0    # updates skipped for one, in all

    def can_lower(self) -> bool:
        """Whether an overflow can be answered by halving the scale."""
        return self.enabled and self.value > 1.0

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.value, self.clean = max(self.value / 2, 1.0), 0
            self.overflows += 1
            return
        self.clean += 1
        if self.clean == self.GROWTH_INTERVAL:
            self.value, self.clean = self.value * 2, 0

    def state_dict(self) -> dict:
        return {"value": self.value, "clean": self.clean, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.clean, self.overflows = state["value"], state["clean"], state["overflows"]
