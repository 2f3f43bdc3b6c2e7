"""How a model is spread over the ranks: PyTorch FSDP2 (`fully_shard`) per transformer
block and at the root, applied in this one place and nowhere else.

ZeRO stages map onto FSDP2 as DeepSpeed users expect:
  3     parameters, gradients and optimizer state sharded; parameters re-gathered for
        backward (`reshard_after_forward=True`)
  1, 2  gradients and optimizer state sharded; parameters stay gathered from forward to
        backward (`reshard_after_forward=False`): more memory, one all-gather less
  0     replicated data parallel: FSDP2 over a (replicas, 1) mesh, i.e. every rank holds
        everything and gradients are all-reduced
With one process and no torchrun, models are left as they are (plain PyTorch).

ZeRO++ (engine/zeropp.py) goes onto every unit of a trained ZeRO-3 model here too: hpZ as
the units' int `reshard_after_forward`, qwZ and qgZ as their custom collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    OffloadPolicy,
    fully_shard,
)
from transformers import PreTrainedModel

from engine.config import ZeroPPConfig
from engine.errors import UserError
from engine.runtime import Runtime
from engine.zeropp import apply_zeropp, hpz_kwargs

# FSDP2 before torch 2.12 cannot shard an integer parameter (it re-wraps each shard as a
# Parameter that requires grad, which only floats can): there a quantized base's int8/uint8
# payloads stay out of FSDP, a full copy on every rank, and only its float parameters shard.
SHARDS_INTEGER_PARAMS = torch.torch_version.TorchVersion(torch.__version__) >= "2.12"


@dataclass(frozen=True)
class ShardSettings:
    zero_stage: int = 3
    offload: bool = False               # params + optimizer state on CPU (ZeRO-Offload)
    activation_checkpointing: bool = False
    zeropp: ZeroPPConfig = field(default_factory=ZeroPPConfig)   # ZeRO-3 only
    zeropp_quantize: bool = True        # False: ZeRO++'s hooks send exact values (tests)


def hf_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside wrappers (peft)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner, PreTrainedModel):
        raise TypeError(f"expected a transformers model, got {type(inner).__name__}")
    return inner


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers: the modules transformers itself never splits
    (`_no_split_modules`), which is the natural FSDP unit."""
    names = set(hf_model(model)._no_split_modules or ())
    # the MRO also finds them once sharded (FSDP2 subclasses each as FSDP<Block>)
    blocks = [m for m in model.modules()
              if any(cls.__name__ in names for cls in type(m).__mro__)]
    if not blocks:
        raise UserError(f"{type(hf_model(model)).__name__}: found no transformer blocks to "
                        "shard (the model class declares no _no_split_modules)")
    return blocks


def _mesh(rt: Runtime, zero_stage: int) -> DeviceMesh:
    if zero_stage == 0:
        return init_device_mesh(rt.device.type, (rt.world_size, 1),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("shard",))


def shard(model: nn.Module, rt: Runtime, settings: ShardSettings, *,
          trainable: bool = True) -> nn.Module:
    """Place a model: FSDP2 over all ranks when distributed, else just the device. Trained
    weights come loaded in the master dtype (engine/precision.py), frozen ones in the
    compute dtype."""
    if settings.activation_checkpointing:
        # non-reentrant checkpointing composes with FSDP2's hooks and keeps parameter names
        hf_model(model).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    if not rt.distributed:
        return model.to(rt.device)
    if settings.zero_stage not in (0, 1, 2, 3):
        raise UserError(f"zero stage {settings.zero_stage}: choose 0, 1, 2 or 3")
    zeropp = settings.zeropp if settings.zero_stage == 3 else ZeroPPConfig()
    # on a CPU run there is nowhere else to put the weights: offloading is a no-op
    offload = settings.offload and rt.device.type == "cuda"
    kwargs = dict(mesh=_mesh(rt, settings.zero_stage), mp_policy=rt.precision.fsdp_policy(),
                  offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
                  reshard_after_forward=settings.zero_stage == 3)
    # hpZ: an int reshard_after_forward
    kwargs.update(hpz_kwargs(zeropp, rt.world_size, rt.ranks_per_node))
    kept_whole = _integer_params_kept_whole(model, rt)
    if kept_whole:
        kwargs["ignored_params"] = kept_whole

    def place(unit: nn.Module, **overrides) -> None:
        hooks = zeropp
        if any(p in kept_whole for p in unit.parameters()):
            # no qwZ where a quantized base is kept whole: from torch 2.12 on such a unit's
            # group mixes dtypes and is gathered exactly anyway
            hooks = replace(zeropp, qwz=False)
        fully_shard(unit, **{**kwargs, **overrides})
        if hooks.qwz or hooks.qgz:
            apply_zeropp(unit, hooks, ranks_per_node=rt.ranks_per_node,
                         quantize=settings.zeropp_quantize)

    # fully_shard moves each block to the mesh's device as it shards it: the full model is
    # never on the device at once
    for block in transformer_blocks(model):
        place(block)
    # Untied input embeddings are a unit of their own: used first in forward and last in
    # backward, they need not stay gathered in between (a large share of a model with a big
    # vocabulary). Tied ones share the output head's weight and stay with the root.
    inner = hf_model(model)
    embeddings, head = inner.get_input_embeddings(), inner.get_output_embeddings()
    if embeddings is not None and (head is None or head.weight is not embeddings.weight):
        place(embeddings)
    # A trained root (output head, score head, final norm) stays gathered from forward to
    # backward: backward needs it at once, and the critic's values come from the score
    # head's output rather than the root's output, so FSDP's pre-backward hook on the root
    # output would never re-gather it.
    place(inner, reshard_after_forward=not trainable)
    return model


def _integer_params_kept_whole(model: nn.Module, rt: Runtime) -> set[nn.Parameter]:
    """The integer parameters to keep out of FSDP (fully_shard's `ignored_params`) where this
    torch cannot shard them (SHARDS_INTEGER_PARAMS), moved to the device here since FSDP will
    not move them; none elsewhere."""
    integer = {p for p in model.parameters() if not p.is_floating_point()}
    if not integer or SHARDS_INTEGER_PARAMS:
        return set()
    for p in integer:
        p.data = p.data.to(rt.device)
    if rt.is_main:
        mib = sum(p.numel() * p.element_size() for p in integer) / 2**20
        print(f"note: torch {torch.__version__}'s FSDP2 cannot shard integer weights: the "
              f"quantized base ({mib:.0f} MiB) is kept whole on every rank (torch>=2.12 "
              "shards it)")
    return integer


def frozen(model: nn.Module, rt: Runtime, *, sharded: bool = True,
           offload: bool = False) -> nn.Module:
    """Place a forward-only model (reference, reward in step 3): eval mode, no grads,
    ZeRO-3 sharded or a full replica on every rank; with `offload` its weights live on the
    CPU between uses (DeepSpeed-Chat's --offload_reference_model)."""
    model.eval().requires_grad_(False)
    if rt.distributed and sharded:
        return shard(model, rt, ShardSettings(zero_stage=3, offload=offload), trainable=False)
    if offload and rt.device.type == "cuda":
        def to_device(module: nn.Module, args) -> None:
            module.to(rt.device)

        def to_cpu(module: nn.Module, args, out) -> None:
            module.to("cpu")

        model.register_forward_pre_hook(to_device)
        model.register_forward_hook(to_cpu)
        return model.to("cpu")
    return model.to(rt.device)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Let the next backward reduce gradients across ranks (True), or only accumulate them
    locally (False: the micro-steps inside a gradient-accumulation window)."""
    root = hf_model(model)
    if isinstance(root, FSDPModule):
        root.set_requires_gradient_sync(enabled)


def resharded(model: nn.Module) -> nn.Module:
    """`model` with every FSDP2 unit's parameters sharded again. A forward without a
    backward (an evaluation) leaves the root unit's parameters unsharded, plain tensors in
    place of its DTensors; copies of the parameters must all be of one kind."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model
