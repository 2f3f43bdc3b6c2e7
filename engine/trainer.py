"""TrainEngine: one trainable model with its optimizer, schedule and gradient
accumulation. steps/ calls `engine(...)`, `backward(loss)`, `step()`; how parameters are
placed, sharded and reduced stays in here (engine/parallel.py).

The loss contract with several ranks: each rank passes its share of the objective, and the
objective is the sum of the shares over the ranks (a mean over a global batch is each
rank's sum divided by the global count). Gradients then equal a single process's on the
whole batch, however the batch was split.

Guards: an update whose loss or gradient norm is not finite (on any rank) is skipped: the
weights and the optimizer's state are left as they were, the gradients dropped, and the
skip counted (`skipped_steps`); `max_skipped_steps` skips in a row stop the run with a
NonFiniteError. Nothing is exported or checkpointed with a non-finite weight.

Borrowed memory: in one process, memory another part of the run leaves idle while this
model trains (the hybrid engine's KV cache and inference weights between rollouts) can be
lent to the engine
(`lend`); each accumulation window's gradients are then placed in it, as many as fit, and
need no memory of their own. `reclaim` hands it back."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import get_scheduler

from engine.checkpoint import Tensors, require_finite
from engine.config import OptimConfig
from engine.errors import NonFiniteError
from engine.export import merged_export_size, save_adapter, save_hf
from engine.lora import is_lora_param
from engine.models import head_reduced, packed_scores, sequence_scores, token_values
from engine.parallel import ShardSettings, resharded, set_gradient_sync, shard
from engine.precision import LossScale
from engine.runtime import Runtime

BETAS = (0.9, 0.95)   # AdamW's


def _param_groups(model: nn.Module, weight_decay: float, lr: float,
                  lora_lr: float | None) -> list[dict]:
    """AdamW groups: no weight decay on biases and norms; LoRA at its own rate."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault((is_lora_param(name), param.ndim >= 2), []).append(param)
    return [{"params": params, "lr": lora_lr if lora and lora_lr is not None else lr,
             "weight_decay": weight_decay if decay else 0.0}
            for (lora, decay), params in groups.items()]


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """The schedule's warmup: warmup_steps, else warmup_ratio of `total_steps`, rounded up
    (train.py refuses both at once)."""
    return optim.warmup_steps or math.ceil(optim.warmup_ratio * total_steps)


def _schedule_kwargs(optim: OptimConfig) -> dict:
    """What a schedule takes beyond its warmup and length."""
    if optim.lr_scheduler == "cosine_with_min_lr":
        return {"min_lr_rate": optim.min_lr_ratio}
    return {}


class TrainEngine:
    def __init__(self, model: nn.Module, optim: OptimConfig, total_steps: int,
                 runtime: Runtime, sharding: ShardSettings | None = None, *, lr: float,
                 lora_lr: float | None = None, grad_accum: int = 1, name: str = "model",
                 max_skipped_steps: int = 5):
        """`optim`: the section's optimizer keys; `lr` the model's learning rate, `lora_lr`
        its LoRA parameters' (None: `lr`); `grad_accum` micro-batches per optimizer step."""
        self.runtime, self.optim, self.name = runtime, optim, name
        self.grad_accum, self.max_skipped_steps = grad_accum, max_skipped_steps
        self.module = shard(model, runtime, sharding or ShardSettings())
        self.module.train()
        fused = runtime.device.type == "cuda" and not (sharding and sharding.offload)
        self.optimizer = torch.optim.AdamW(_param_groups(model, optim.weight_decay, lr, lora_lr),
                                           lr=lr, betas=BETAS, fused=fused)
        self.scheduler = get_scheduler(optim.lr_scheduler, self.optimizer,
                                       num_warmup_steps=warmup_steps(optim, total_steps),
                                       num_training_steps=max(total_steps, 1),
                                       scheduler_specific_kwargs=_schedule_kwargs(optim))
        self.applied_lr = self.lr   # the rate of the last update (logged as train/lr)
        self.micro_steps = self.steps = 0
        self._in_window, self._window_ends = 0, False   # micro-steps in the open window
        self.skipped_steps = self.skipped_in_a_row = 0
        self.loss_scale = LossScale(runtime.dtype == torch.float16)
        self._loss_nonfinite = torch.zeros((), dtype=torch.bool, device=runtime.device)
        self._lent: list[torch.Tensor] = []          # bytes lent for gradients (lend)
        self._in_lent: list[nn.Parameter] = []       # parameters whose gradient is in them
        self._touched: set[int] = set()              # ids of those a backward reached
        self._hooked = False

    def __call__(self, *args, **kwargs):
        with self.runtime.precision.trained_forward(self.runtime.device,
                                                    autocast=not self.runtime.distributed):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, ends_window: bool | None = None) -> None:
        """Accumulate the gradient of this rank's share of the loss; ranks exchange
        gradients only on the last micro-step of an accumulation window: every grad_accum-th,
        or where `ends_window` says (a short last window, whose losses the caller
        normalises over the micro-batches it really has)."""
        if self._in_window == 0:
            self._place_gradients()
        self.micro_steps += 1
        self._in_window += 1
        # >=: with grad_accum 1, a step may follow several backwards (step 3's row chunks)
        self._window_ends = (self._in_window >= self.grad_accum if ends_window is None
                             else ends_window)
        set_gradient_sync(self.module, self._window_ends)
        self._loss_nonfinite |= ~torch.isfinite(loss.detach())   # checked in step(), no sync
        # FSDP2 averages gradients over ranks; the objective is their sum (see above)
        with self.runtime.precision.trained_backward(self.runtime.device):
            (loss * (self.runtime.world_size * self.loss_scale.value / self.grad_accum)
             ).backward()

    def step(self) -> float | None:
        """Apply the optimizer at the end of an accumulation window; returns the gradient
        norm before clipping then (NaN or inf when the update was skipped: a non-finite loss
        or gradient, or in fp16 an overflow of the loss scale), else None."""
        if not self._window_ends:
            return None
        self._in_window, self._window_ends = 0, False
        for param in self._in_lent:   # placed but never reached: no gradient, as autograd's
            if id(param) not in self._touched:
                param.grad = None
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.loss_scale.value != 1.0:
            for param in params:
                param.grad.div_(self.loss_scale.value)
        max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(grad_norm, "full_tensor"):  # DTensor when sharded
            grad_norm = grad_norm.full_tensor()
        # one number for all ranks: the norm is global, a rank's loss is its own
        loss_bad = float(self.runtime.all_sum(self._loss_nonfinite.float()))
        grad_norm = float(grad_norm)
        self._loss_nonfinite.zero_()
        overflow = not loss_bad and not math.isfinite(grad_norm)
        scale_overflow = overflow and self.loss_scale.can_lower()   # fp16's scale, not the model
        if scale_overflow:
            self.loss_scale.update(overflow=True)
        elif loss_bad or overflow:
            self._skip("loss" if loss_bad else f"gradient norm ({grad_norm})")
            grad_norm = grad_norm if overflow else math.nan   # a skip reads as one
        else:
            self.skipped_in_a_row = 0
            self.optimizer.step()
            self.loss_scale.update(overflow=False)
        self.applied_lr = self.lr
        if not scale_overflow:   # the scale's search spends no warmup (as DeepSpeed's fp16)
            with warnings.catch_warnings():   # a skipped first update: the schedule moves on
                warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step")
                self.scheduler.step()
        self._drop_gradients()
        self.steps += 1
        return grad_norm

    def advance_schedule(self, steps: int) -> None:
        """Move the learning-rate schedule `steps` updates on without updating the weights
        (steps/ppo.py's rounds that made fewer updates than planned); none if `steps` <= 0."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step")
            for _ in range(steps):
                self.scheduler.step()

    def discard(self) -> None:
        """Drop the gradients accumulated since the last step (steps/ppo.py: parts of a
        micro-batch already backpropagated when target_kl stops it), leaving weights,
        optimizer and schedule as they are. Only where each step is one backward
        (grad_accum 1), so no accumulation window is left half counted."""
        assert self.grad_accum == 1, "discard() with gradient accumulation"
        self._in_window, self._window_ends = 0, False
        self._drop_gradients()
        self._loss_nonfinite.zero_()

    def _drop_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._in_lent, self._touched = [], set()

    def lend(self, buffers: list[torch.Tensor]) -> None:
        """Memory (contiguous tensors) that nothing else touches until `reclaim`: the
        gradients of the accumulation windows that begin meanwhile go into it, as many as
        fit. One process only (under FSDP2 the gradients are its own sharded tensors)."""
        if self.runtime.distributed:
            raise ValueError("lend: gradients are FSDP2's own when distributed")
        if not self._hooked:   # which placed gradients a backward reaches (see step)
            for param in self.module.parameters():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(
                        lambda p: self._touched.add(id(p)))
            self._hooked = True
        self._lent = [b.view(-1).view(torch.uint8) for b in buffers]

    def reclaim(self) -> None:
        """End a `lend`: a window still open moves the gradients a backward reached into
        memory of their own and drops the others (as `step` would); the lender may then
        overwrite the buffers."""
        for param in self._in_lent:
            if param.grad is not None:
                param.grad = param.grad.clone() if id(param) in self._touched else None
        self._lent, self._in_lent = [], []

    def _place_gradients(self) -> None:
        """At a window's first backward: zeroed gradients in the lent bytes, each in the
        first buffer with room, at a 256-byte boundary (AccumulateGrad then adds into them
        in place)."""
        if not self._lent:
            return
        used = [0] * len(self._lent)
        for param in self.module.parameters():
            if not param.requires_grad or param.grad is not None or not param.is_contiguous():
                continue
            size = param.numel() * param.element_size()
            for i, buffer in enumerate(self._lent):
                start = -(-used[i] // 256) * 256
                if start + size <= buffer.numel():
                    grad = buffer[start:start + size].view(param.dtype).view(param.shape)
                    param.grad = grad.zero_()
                    self._in_lent.append(param)
                    used[i] = start + size
                    break

    def _skip(self, what: str) -> None:
        """Leave the weights as they are; stop after max_skipped_steps skips in a row."""
        self.skipped_steps += 1
        self.skipped_in_a_row += 1
        if self.skipped_in_a_row >= self.max_skipped_steps:
            raise NonFiniteError(
                f"{self.name}: {self.skipped_in_a_row} updates in a row skipped "
                f"(engine.max_skipped_steps={self.max_skipped_steps}), the last at optimizer "
                f"step {self.steps + 1} for a non-finite {what}; nothing was exported: lower "
                "the learning rate, check the data, or use engine.dtype=float32")

    def state_dict(self) -> dict:
        """Model and optimizer state, sharded as the model is (for a DCP checkpoint)."""
        fresh = not self.optimizer.state
        model, optimizer = get_state_dict(self.module, self.optimizer)
        if fresh:   # it made the moments by a zero-lr step: undo that step, keep its shapes
            for state in optimizer["state"].values():
                state["step"] = torch.zeros_like(state["step"])
            self.optimizer.state.clear()
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def progress_state(self) -> dict:
        """Counters and schedule: plain values, stored beside the tensors."""
        return {"steps": self.steps, "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps, "skipped_in_a_row": self.skipped_in_a_row,
                "scheduler": self.scheduler.state_dict(),
                "loss_scale": self.loss_scale.state_dict()}

    def load_progress_state(self, state: dict) -> None:
        self.steps, self.micro_steps = state["steps"], state["micro_steps"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.skipped_in_a_row = state.get("skipped_in_a_row", 0)
        self.scheduler.load_state_dict(state["scheduler"])
        if "loss_scale" in state:
            self.loss_scale.load_state_dict(state["loss_scale"])

    @property
    def lr(self) -> float:
        """The rate the next update will use (`applied_lr`: the last update's)."""
        return self.scheduler.get_last_lr()[0]

    def train(self) -> None:
        self.module.train()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This process's parameters (its shards, when sharded)."""
        return self.module.parameters()

    def trained_parameters(self) -> list[nn.Parameter]:
        """This process's parameters that train, in `copy_weights(trainable_only=True)`'s
        order."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def state_bytes(self) -> int:
        """Bytes this process holds of the model's parameters and the optimizer's state
        (its shards, when sharded)."""
        tensors = [*self.module.parameters(),
                   *(v for state in self.optimizer.state.values() for v in state.values()
                     if torch.is_tensor(v))]
        # a DTensor (sharded) counts its local shard
        return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes for t in tensors)

    def token_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     packed: bool = False) -> torch.Tensor:
        """[B, T] per-token outputs of a one-label scorer (see engine.models.token_values)."""
        return token_values(self.module, input_ids, attention_mask, call=self, packed=packed)

    def head_reduced(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, keep: int,
                     reduce, packed: bool = False) -> torch.Tensor:
        """[B, keep] reduction of a causal LM's last `keep` logits, made a few rows at a time
        (see engine.models.head_reduced)."""
        return head_reduced(self.module, input_ids, attention_mask, keep, reduce, call=self,
                            packed=packed)

    def sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        packed: bool = False) -> torch.Tensor:
        """[B] a scorer's output at each sequence's last real token."""
        return sequence_scores(self.module, input_ids, attention_mask, call=self,
                               packed=packed)

    def packed_scores(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      ends: torch.Tensor) -> torch.Tensor:
        """[N] a scorer's output at the last tokens of packed sequences (see
        engine.models.packed_scores)."""
        return packed_scores(self.module, input_ids, position_ids, ends, call=self)

    def copy_weights(self, trainable_only: bool = False) -> Tensors:
        """A detached copy of the parameters (`trainable_only`: those that train, e.g. LoRA
        adapters alone), sharded as they are (e.g. an EMA, a best-so-far policy)."""
        return Tensors({name: p.detach().clone()
                        for name, p in resharded(self.module).named_parameters()
                        if p.requires_grad or not trainable_only})

    def export(self, tokenizer, out_dir: Path, weights: Tensors | None = None,
               adapter: bool = False, config: dict | None = None) -> Path:
        """Write the model (LoRA merged) as a plain Hugging Face directory, its config.json
        with the `config` fields added, or with `adapter` LoRA's weights alone (a peft
        adapter directory); with `weights` (a `copy_weights` of it, e.g. its EMA) those
        weights instead of the live ones, which are left as they were. Collective: every
        process calls it. Refuses (NonFiniteError) weights that are not all finite, before
        anything is written."""
        what = f"{self.name} export to {out_dir}"
        if adapter and config:
            raise ValueError("an adapter export writes no config.json to add fields to")
        save = save_adapter if adapter else partial(save_hf, config=config)
        if weights is None:
            require_finite(self.module.parameters(), self.runtime, what)
            return save(self.module, tokenizer, out_dir, self.runtime)
        require_finite(weights.tensors.values(), self.runtime, what)
        with self.weights_in(weights):
            return save(self.module, tokenizer, out_dir, self.runtime)

    @contextmanager
    def weights_in(self, weights: Tensors) -> Iterator[None]:
        """The module holds `weights` (a `copy_weights` of it, e.g. its EMA) in place of its
        own within the block, to export or evaluate them; its own are put back after. Each
        process copies its own shards: no collective."""
        params = Tensors(dict(resharded(self.module).named_parameters()))
        # only what `weights` replaces (LoRA's factors alone for export=best over a LoRA)
        live = Tensors({name: params.tensors[name].detach().clone() for name in weights.tensors})
        params.load_state_dict(weights.tensors)   # copied in place, by name
        try:
            yield
        finally:
            # an evaluation's forward leaves the root unit's gathered copy of `weights`
            # standing: shard it away first, or the next forward would run on it
            resharded(self.module)
            params.load_state_dict(live.tensors)

    def merged_size(self) -> tuple[int, int]:
        """(host bytes, disk bytes) that `export` without `adapter` takes at the least."""
        return merged_export_size(self.module)

    def eval(self) -> None:
        self.module.eval()

