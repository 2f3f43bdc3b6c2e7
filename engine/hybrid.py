"""HybridEngine: a trained policy that generates (step 3's actor), switching between ZeRO-3
training and fast generation.

Training form: the FSDP2-sharded model of TrainEngine. Generating from it directly is slow,
since every layer of every token waits for an all-gather and all ranks must step together.
So `generate` switches form:

  1. gather: the FSDP units are all-gathered group by group (`gather_group_size` decoder
     layers at a time, so at most that many full layers exist beyond the shards), and each
     group's weights, with LoRA folded in, are copied into the inference model: fused QKV
     and gate/up projections (engine/inference_modules.py), or for an architecture without
     inference modules, a plain Hugging Face copy (logged once);
  2. generate: every rank decodes its own prompts alone, with a static KV cache and no
     collectives;
  3. release: the units are resharded; with `pin_parameters=False` the inference weights
     are freed too (and the decode steps captured over them), with
     `release_inference_cache=True` the KV cache (DeepSpeed-Chat's options of the same
     names). A freed cache is made again for the next rollout, and its captured steps are
     reused when it lands at its old address (KVCache.restore). By default instead, in one
     process, the cache's memory and the inference weights' (which the next gather
     writes whole) hold the policy's gradients until the next rollout
     (`cache_holds_gradients`; TrainEngine.lend): the memory a rollout needs and the
     memory an update needs are then largely the same bytes, at one address.

The training form is never modified: after a rollout, training continues exactly as if
generation had run on the sharded model.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.fsdp import FSDPModule
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from engine.config import HybridConfig, OptimConfig
from engine.decode import DecodeTimes
from engine.export import plain_class
from engine.generation import SamplingSettings, generate
from engine.inference_form import (
    InferenceForm,
    allocate_decoder,
    copy_sources,
    layer_prefixes,
    put_buffer,
)
from engine.inference_modules import weight_bytes
from engine.inference_plans import Unsupported, plan
from engine.lora import active_adapters, is_lora_param
from engine.parallel import ShardSettings, hf_model, transformer_blocks
from engine.quantized_base import effective_shape, effective_weight
from engine.quantized_inference import QuantizedSlot, fill_quantized, shareable, slot_for
from engine.runtime import Runtime
from engine.trainer import TrainEngine


@dataclass
class GenerationTimes:
    """Seconds spent since the last `take_times`: gathering weights, and generating; of the
    generating, the inference decoder's prefills and decode steps, and the decode steps run
    (0 when the Hugging Face modules generate). `calls` to generate, `gathers` of them
    that filled the generation form (fewer in held_weights)."""

    gather: float = 0.0
    generate: float = 0.0
    calls: int = 0
    gathers: int = 0
    prefill: float = 0.0
    decode: float = 0.0
    decode_steps: int = 0

    def add_decode(self, before: DecodeTimes, after: DecodeTimes) -> None:
        self.prefill += after.prefill - before.prefill
        self.decode += after.decode - before.decode
        self.decode_steps += after.steps - before.steps


def _decode_totals(model: nn.Module) -> DecodeTimes:
    """A copy of an inference decoder's running totals (zeros for Hugging Face modules)."""
    return dataclasses.replace(getattr(model, "times", DecodeTimes()))


def _base_module(model: nn.Module, name: str) -> tuple[nn.Module, nn.Module, str]:
    """(owning module, its base layer under peft, attribute) of HF parameter `name`."""
    path, attr = name.rsplit(".", 1)
    owner = model.get_submodule(path)
    return owner, owner.get_base_layer() if isinstance(owner, LoraLayer) else owner, attr


def _shape(model: nn.Module, name: str) -> torch.Size:
    """Full shape of HF parameter `name`, sharded or not, quantized or not."""
    _, base, attr = _base_module(model, name)
    return effective_shape(base) if attr == "weight" else getattr(base, attr).shape


def merged_weight(model: nn.Module, name: str) -> torch.Tensor:
    """Parameter `name` of `model` as the forward pass sees it: a quantized base weight
    dequantized (engine/quantized_base.py), and for a weight under a peft LoRA layer,
    base + B @ A * scaling of the active adapters."""
    owner, base, attr = _base_module(model, name)
    if attr != "weight":
        return getattr(base, attr)
    value = effective_weight(base)
    for adapter in active_adapters(owner):
        value = value + owner.get_delta_weight(adapter)
    return value


@contextmanager
def gathered(units: list[nn.Module]) -> Iterator[None]:
    """All-gather the FSDP units (together, asynchronously) for the duration; plain
    modules need nothing."""
    sharded = [u for u in units if isinstance(u, FSDPModule)]
    for handle in [u.unshard(async_op=True) for u in sharded]:
        if handle is not None:
            handle.wait()
    try:
        yield
    finally:
        for unit in sharded:
            unit.reshard()


@dataclass
class _Target:
    """What a gather fills: the inference model or a plain HF copy, the source parameters
    of each of its parameters, and its parameters by the gather group they come with."""

    model: nn.Module
    sources: dict[str, list[str]]
    groups: dict[int, list[str]]
    quantized: dict[str, QuantizedSlot]   # module paths held quantized (quantized_inference)


class HybridEngine(TrainEngine):
    def __init__(self, model: nn.Module, optim: OptimConfig, total_steps: int,
                 runtime: Runtime, sharding: ShardSettings | None = None,
                 hybrid: HybridConfig | None = None, **guards):
        super().__init__(model, optim, total_steps, runtime, sharding, **guards)
        self.hybrid = hybrid or HybridConfig()
        self.times = GenerationTimes()
        # static decode steps made (CUDA graphs captured) so far: flat once they are reused
        self.decode_steps_built = 0
        inner = hf_model(self.module)
        self._blocks = transformer_blocks(self.module)
        self._layer_prefixes = layer_prefixes(inner, self._blocks)
        self._plan = None
        if self.hybrid.enabled:
            reason = "kernel injection is off (engine.hybrid.kernel_injection)"
            if self.hybrid.kernel_injection:
                try:
                    self._plan = plan(inner, self._layer_prefixes)
                except Unsupported as why:
                    reason = str(why)
            if self._plan is None and runtime.is_main:
                tqdm.write(f"hybrid engine: {type(inner).__name__}: {reason}; "
                           "generating with the gathered Hugging Face modules")
        self._target: _Target | None = None
        self._holding = False             # inside held_weights()
        self._filled_at: int | None = None   # self.steps when the held form was filled

    @property
    def injected(self) -> bool:
        """True when generation runs through the inference modules."""
        return self._plan is not None

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 sampling: SamplingSettings, *, eos_token_id: int | list[int],
                 pad_token_id: int, row_seeds: torch.Tensor | None = None,
                 group_size: int = 1) -> torch.Tensor:
        """Continue left-padded prompts [B, P] -> [B, P + N] (see engine.generation.generate,
        whose results this matches). Collective when sharded: every rank calls it.
        `group_size`: rows in groups of that many sharing a prompt (group sampling; see
        InferenceForm.generate)."""
        if group_size < 1 or input_ids.shape[0] % group_size:
            raise ValueError(f"group_size {group_size} does not divide the batch of "
                             f"{input_ids.shape[0]} rows")
        kwargs = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, row_seeds=row_seeds)
        start = gathered_at = self._now()
        if self.hybrid.enabled:
            if self._filled_at == self.steps and self._target is not None:
                target = self._target   # held_weights: filled with these weights already
            else:
                self.reclaim()   # the cache's and weights' memory, if it held gradients
                target = self._gather()
                self.times.gathers += 1
                self._filled_at = self.steps if self._holding else None
            gathered_at = self._now()
            device = self.runtime.device
            form = InferenceForm(target.model, device,
                                 cuda_graph=self.hybrid.cuda_graphs and device.type == "cuda")
            built = getattr(target.model, "steps_built", 0)
            before = _decode_totals(target.model)
            try:
                out = form.generate(input_ids, attention_mask, sampling, group_size=group_size,
                                    **kwargs)
            finally:
                self.decode_steps_built += getattr(target.model, "steps_built", 0) - built
                self.times.add_decode(before, _decode_totals(target.model))
                if not self._holding:
                    self._release()
        else:
            out = generate(self.module, input_ids, attention_mask, sampling, **kwargs)
        end = self._now()
        self.times.gather += gathered_at - start
        self.times.generate += end - gathered_at
        self.times.calls += 1
        return out

    @contextmanager
    def held_weights(self) -> Iterator[None]:
        """Generate calls in the block share one gather: the generation form stays filled
        (and its KV cache kept) from the first to the last, and is released at the end.
        For several rollouts with no update in between (dynamic sampling's draws, an
        evaluation's batches): at ZeRO-3 each gather all-gathers the whole model. An
        optimizer step inside the block makes the next generate gather again. Collective
        like generate: every rank enters it. Re-entrant. With pin_parameters=False each
        call gathers and frees as it would outside the block (the memory is the point)."""
        if self._holding or not (self.hybrid.enabled and self.hybrid.pin_parameters):
            yield
            return
        self._holding = True
        try:
            yield
        finally:
            self._holding, self._filled_at = False, None
            if self._target is not None:
                self._release()

    def take_times(self) -> GenerationTimes:
        times, self.times = self.times, GenerationTimes()
        return times

    def inference_bytes(self) -> dict[str, int]:
        """Memory the generation form holds now: weights and KV cache."""
        if self._target is None:
            return {"weights": 0, "kv_cache": 0}
        cache = getattr(self._target.model, "cache", None)
        return {"weights": weight_bytes(self._target.model),
                "kv_cache": cache.nbytes if cache is not None else 0}

    # -- switching form ---------------------------------------------------------------

    def _gather(self) -> _Target:
        """Fill the generation form with the current training weights, one gather group
        at a time."""
        inner = hf_model(self.module)
        if self._target is None:
            self._target = self._build(inner)
        target = self._target
        params = dict(target.model.named_parameters())
        transforms = self._plan.transforms if self._plan is not None else {}
        size = max(self.hybrid.gather_group_size, 1)
        root_units = [m for m in inner.modules()
                      if isinstance(m, FSDPModule) and m not in self._blocks]
        with torch.no_grad():
            for group, names in sorted(target.groups.items()):
                units = root_units if group < 0 else self._blocks[group * size:(group + 1) * size]
                with gathered(units):
                    for name in names:
                        path, attr = name.rsplit(".", 1)
                        sources = target.sources[name]
                        if attr == "weight" and path in target.quantized:
                            fill_quantized(target.model.get_submodule(path),
                                           [_base_module(inner, s)[:2] for s in sources],
                                           [transforms.get(s) for s in sources])
                        else:
                            copy_sources(params[name], sources,
                                         lambda source: merged_weight(inner, source), transforms)
        return target

    def _build(self, inner: PreTrainedModel) -> _Target:
        """Allocate the generation form (weights unset) on this rank's device."""
        dtype, device = self.runtime.dtype, self.runtime.device
        quantized = {}
        if self._plan is not None:
            quantized = self._quantized_slots(inner)
            model = allocate_decoder(self._plan, lambda source: _shape(inner, source),
                                     dtype, device, self.hybrid.fused_kernels, quantized)
            sources = self._plan.sources
        else:
            model = self._plain_copy(inner, dtype, device)
            sources = {name: [name] for name, _ in model.named_parameters()}
        groups: dict[int, list[str]] = {}
        for name, parts in sources.items():
            groups.setdefault(self._group(parts[0]), []).append(name)
        return _Target(model.eval(), sources, groups, quantized)

    def _quantized_slots(self, inner: PreTrainedModel) -> dict[str, QuantizedSlot]:
        """The inference modules that generate straight from the quantized base (all whose
        sources are quantized, when engine.hybrid.quantized_inference), said once."""
        if not self.hybrid.quantized_inference:
            return {}
        slots, sharded = {}, any(isinstance(m, FSDPModule) for m in inner.modules())
        for name, parts in self._plan.sources.items():
            path, attr = name.rsplit(".", 1)
            layers = [_base_module(inner, s)[:2] for s in parts]
            slot = slot_for(layers) if attr == "weight" else None
            if slot is not None:
                transforms = [self._plan.transforms.get(s) for s in parts]
                slots[path] = slot._replace(
                    shared=shareable(layers, transforms, self.runtime.device, sharded))
        if slots and self.runtime.is_main:
            bits = sorted({slot.bits for slot in slots.values()})
            shared = sum(slot.shared for slot in slots.values())
            tqdm.write(f"hybrid engine: generating from the quantized base: {len(slots)} "
                       f"matrices as int{'/int'.join(map(str, bits))}, LoRA beside them, no "
                       f"full-precision copy ({shared} used in place, {len(slots) - shared} "
                       "gathered into a copy)")
        return slots

    def _plain_copy(self, inner: PreTrainedModel, dtype: torch.dtype,
                    device: torch.device) -> PreTrainedModel:
        """An empty plain transformers model like `inner` (without LoRA), its buffers
        (rotary tables and the like, which FSDP does not shard) copied in their own dtype:
        a bf16 rotary inv_freq would turn position 4000's angles by up to 0.6 radians."""
        with torch.device("meta"):
            model = plain_class(inner)(inner.config)
        model = model.to_empty(device=device).to(dtype)
        model.tie_weights()
        for name, buffer in inner.named_buffers():
            if not is_lora_param(name):
                put_buffer(model, name.replace(".base_layer", ""),
                           buffer.detach().to(device, copy=True))
        return model.requires_grad_(False)

    def _group(self, source: str) -> int:
        """Gather group of HF parameter `source`: -1 for the root units (embeddings, final
        norm, head), else its decoder layer's index // gather_group_size."""
        for i, prefix in enumerate(self._layer_prefixes):
            if source.startswith(prefix + "."):
                return i // max(self.hybrid.gather_group_size, 1)
        return -1

    def _release(self) -> None:
        if not self.hybrid.pin_parameters:
            self._target = None
        elif self.hybrid.release_inference_cache and self.injected:
            self._target.model.release_cache()
        elif (self.hybrid.cache_holds_gradients and self.injected
              and not self.runtime.distributed):
            cache = self._target.model.cache
            if cache is not None and cache.buffer is not None:
                self.lend([cache.lend(), *self._refilled_weights()])

    def _refilled_weights(self) -> list[torch.Tensor]:
        """The inference weights the next gather writes whole (not those that are, or hold,
        the quantized base's integers): free to hold gradients until then."""
        params = dict(self._target.model.named_parameters())
        return [params[name] for name in self._target.sources
                if name.rsplit(".", 1)[0] not in self._target.quantized]

    def _now(self) -> float:
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
