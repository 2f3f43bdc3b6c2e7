"""A model's inference form, for one process that holds it whole: the fused inference
decoder (engine/inference_modules.py) built from a Hugging Face causal LM by its plan
(engine/inference_plans.py) and decoded by engine/decode.py, or, for an architecture
without inference modules, the Hugging Face model itself with `generate`.

`inference_form(model, device, dtype)` makes one from a plain model (chat.py); the hybrid
engine (engine/hybrid.py) builds the same decoder from its sharded model with the helpers
here, filling it while it gathers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from engine import decode, generation, kernels
from engine.errors import UserError
from engine.generation import OnToken, SamplingSettings
from engine.inference_modules import InferenceDecoder
from engine.inference_plans import Plan, Unsupported, plan
from engine.parallel import transformer_blocks
from engine.quantized_inference import QuantizedSlot

log = logging.getLogger(__name__)


@dataclass
class InferenceForm:
    """What generates in this process: the inference decoder, or a Hugging Face model."""

    model: nn.Module
    device: torch.device
    generation_config: GenerationConfig | None = None   # the source model's (its stop ids)
    cuda_graph: bool = False                              # capture the decode step (CUDA)

    @property
    def injected(self) -> bool:
        """True when generation runs through the inference modules."""
        return isinstance(self.model, InferenceDecoder)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 sampling: SamplingSettings, *, eos_token_id: int | list[int],
                 pad_token_id: int, row_seeds: torch.Tensor | None = None,
                 on_token: OnToken | None = None, group_size: int = 1) -> torch.Tensor:
        """Continue left-padded prompts [B, P] -> [B, P + N] exactly as
        engine.generation.generate does; `on_token`: see engine.generation.OnToken.
        `group_size`: rows come in groups of that many sharing a prompt, whose prefill the
        inference decoder then computes once per group (engine.decode); the Hugging Face
        path ignores it (a prefill per row, the same answers)."""
        kwargs = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                      row_seeds=row_seeds, on_token=on_token)
        if self.injected:
            return decode.generate(self.model, input_ids, attention_mask, sampling,
                                   cuda_graph=self.cuda_graph, group_size=group_size,
                                   **kwargs)
        return generation.generate(self.model, input_ids, attention_mask, sampling,
                                   synced=False, **kwargs)


def _moved(model: PreTrainedModel, device: torch.device, dtype: torch.dtype
           ) -> PreTrainedModel:
    """`model` on `device`, its parameters in `dtype` and its buffers in their own (as
    from_pretrained keeps a bf16 model's rotary inv_freq in fp32)."""
    buffers = {name: buffer.to(device) for name, buffer in model.named_buffers()}
    model.to(device=device, dtype=dtype)
    for name, buffer in buffers.items():
        put_buffer(model, name, buffer)
    return model


def put_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set `model`'s buffer `name` (dotted) to `value`, dtype and all (copy_ would cast)."""
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, value)


def inference_form(model: PreTrainedModel, device: torch.device, dtype: torch.dtype
                   ) -> InferenceForm:
    """The inference form of `model`, a plain transformers causal LM, on `device` in
    `dtype`: the inference decoder with a copy of the model's weights (CUDA graph and Triton
    kernels on CUDA), or, for an architecture without one, the model itself moved there."""
    try:
        the_plan = plan(model, layer_prefixes(model, transformer_blocks(model)))
    except (Unsupported, UserError) as why:
        log.warning("%s: %s; generating with the Hugging Face modules", type(model).__name__, why)
        return InferenceForm(_moved(model, device, dtype).eval(), device,
                             model.generation_config)
    decoder = allocate_decoder(the_plan, lambda source: model.get_parameter(source).shape,
                               dtype, device, fused_kernels=True)
    params = dict(decoder.named_parameters())
    with torch.no_grad():
        for name, sources in the_plan.sources.items():
            copy_sources(params[name], sources, model.get_parameter, the_plan.transforms)
    return InferenceForm(decoder, device, model.generation_config,
                         cuda_graph=device.type == "cuda")


def layer_prefixes(model: nn.Module, blocks: list[nn.Module]) -> list[str]:
    """The names in `model` of its decoder layers `blocks`, as plans take them."""
    names = {id(m): n for n, m in model.named_modules()}
    return [names[id(b)] for b in blocks]


def allocate_decoder(plan: Plan, source_shape: Callable[[str], torch.Size],
                     dtype: torch.dtype, device: torch.device, fused_kernels: bool,
                     quantized: dict[str, QuantizedSlot] | None = None) -> InferenceDecoder:
    """The inference decoder of `plan` on `device`, its weights allocated but unset, each
    shaped as its sources (`source_shape` of an HF parameter name, through the plan's
    transforms), the modules in `quantized` held quantized (InferenceDecoder.allocate);
    Triton kernels when `fused_kernels` and on CUDA."""
    def meta(source: str) -> torch.Tensor:   # the source's shape, without its storage
        full = torch.empty(source_shape(source), device="meta")
        return plan.transforms.get(source, lambda w: w)(full)

    decoder = InferenceDecoder(plan)
    decoder.allocate({name: torch.cat([meta(s) for s in parts]).shape   # as copy_sources
                      for name, parts in plan.sources.items()}, dtype, device, quantized)
    decoder.use_fused_kernels(fused_kernels and device.type == "cuda"
                              and kernels.triton_available())
    return decoder.eval()


def copy_sources(param: torch.Tensor, sources: list[str],
                 weight: Callable[[str], torch.Tensor],
                 transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> None:
    """Fill `param` with the concatenation (along dim 0) of its sources' weights, each
    through its transform if it has one, in place (no concatenated copy)."""
    offset = 0
    for source in sources:
        part = transforms.get(source, lambda w: w)(weight(source))
        param[offset:offset + part.shape[0]].copy_(part)
        offset += part.shape[0]
