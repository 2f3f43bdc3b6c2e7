"""Inference plans: which Hugging Face parameters fill which parameters of the inference
decoder (engine/inference_modules.py), per architecture, or why an architecture or variant
has no inference modules (`Unsupported`).

Supported families: Llama (also Mistral, Qwen2, Qwen3 with its per-head query/key norms,
Phi-3/Phi-4 with their fused projections, partial rotary embedding and longrope, and
Gemma 1-3 with their own norms, scales, softcaps and per-kind ropes, OLMo 2 and 3 with
their norms after attention and the MLP; sliding-window attention, on every layer or on
some), OPT (pre-norm), GPT-2 and GPT-NeoX (Pythia).
Weights are not taken from the model here: the plan lists, for every inference parameter,
the Hugging Face parameters it is built from (concatenated for fused ones), so the hybrid
engine can fill it while it gathers one FSDP unit at a time.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel


class Unsupported(Exception):
    """The model has a feature the inference modules do not implement (the reason)."""


@dataclass(frozen=True)
class DecoderSpec:
    """Shapes and variants of a decoder-only transformer, as the inference modules see it."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    # "rms" (Llama: x̂ rounded, times w) | "rms_fp32" (OLMo 2: x̂ w in fp32) | "gemma"
    # (x̂ (1 + w) in fp32) | "layer" (OPT): kernels.add_norm_reference
    norm: str
    norm_eps: float
    activation: str             # key of transformers' ACT2FN
    gated_mlp: bool             # act(gate(x)) * up(x) (Llama) or act(fc1(x)) (OPT)
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    rotary: bool                # rotary positions (Llama) or learned ones (OPT)
    rotary_dim: int = 0         # leading dims of a head that rotate (GPT-NeoX: a part)
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX)
    position_offset: int = 0    # OPT's learned positions start at index 2
    scale_query_first: bool = False  # OPT scales q before the dot product, as HF does
    tied_head: bool = False
    # RMSNorm of the queries and keys before rotation: "head", of each head (Qwen3, Gemma 3);
    # "whole", of all heads' together (OLMo 2); "": none
    qk_norm: str = ""
    # per layer, the sliding window its queries attend within (a key at most window - 1
    # slots back), 0 for full attention; () for full attention in every layer
    windows: tuple[int, ...] = ()
    # per layer, the rotary module's `layer_type` for its angles (Gemma 3's local and global
    # bases); () for one set of angles
    rope_types: tuple[str, ...] = ()
    # longrope (Phi-3.5, Phi-4-mini): a forward whose largest position passes this many
    # (original_max_position_embeddings) takes the long factors' angles, else the short's
    long_rope_from: int = 0
    # Gemma: the input embeddings times this (sqrt(hidden)); a norm after attention and
    # after the MLP besides the two before them; attention scaled by attention_scale
    # rather than head_dim ** -0.5; scores and logits softcapped: cap * tanh(x / cap)
    embed_scale: float = 0.0
    sandwich_norms: bool = False
    pre_norms: bool = True      # False: only the norms after attention and the MLP (OLMo 2)
    attention_scale: float = 0.0
    attention_softcap: float = 0.0
    logit_softcap: float = 0.0

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.attention_scale or self.head_dim ** -0.5


@dataclass
class Plan:
    """How to build the inference decoder from a Hugging Face causal LM.

    `sources[name]` lists the HF parameter names (relative to the transformers model) that
    inference parameter `name` is the concatenation of."""

    spec: DecoderSpec
    sources: dict[str, list[str]]
    rotary: nn.Module | None    # a copy of the model's rotary-embedding module
    # sources stored in another layout, and the function that turns them into ours
    transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)


def plan(model: PreTrainedModel, layer_prefixes: list[str]) -> Plan:
    """The inference plan for `model` (a transformers causal LM, unwrapped), whose decoder
    layers are at `layer_prefixes`. Raises Unsupported with the reason otherwise."""
    config = model.config
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise Unsupported(f"no inference modules for model type {config.model_type!r} "
                          f"(supported: {', '.join(sorted(_FAMILIES))})")
    return family(model, layer_prefixes)


def _has_bias(model: nn.Module, name: str) -> bool:
    return getattr(model.get_submodule(name), "bias", None) is not None


def _tied_head(model: PreTrainedModel) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def _check_rope(rope: dict, longrope: bool = False) -> None:
    """Refuse a rope whose angles change with the sequence length (of each layer kind's, as
    Gemma 3 keeps one a kind), but for longrope where the family's plan takes it."""
    refused = ("dynamic",) if longrope else ("dynamic", "longrope")
    for each in (rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope
                 else [rope]):
        if each.get("rope_type", "default") in refused:
            raise Unsupported(f"rope type {each['rope_type']!r} changes with the sequence "
                              "length")


def _llama(model: PreTrainedModel, layer_prefixes: list[str], fused: bool = False) -> Plan:
    """Llama and its kin; `fused`: Phi-3's Q/K/V and gate/up projections, each one Linear
    (in our order already), and its partial rotary embedding."""
    spec, root, layer, rotary = _llama_parts(model, layer_prefixes, fused)
    return _assemble(spec, root, layer, layer_prefixes, rotary)


def _llama_parts(model: PreTrainedModel, layer_prefixes: list[str], fused: bool = False,
                 base: str = "model"
                 ) -> tuple[DecoderSpec, dict[str, list[str]], dict[str, list[str]], nn.Module]:
    """The Llama plan's spec, root and per-layer sources and rotary module (`_assemble`'s
    arguments), for `_llama` and the families that vary it. `base`: the decoder (embeddings,
    layers, final norm, rotary module, and its config), `model.language_model` in a
    multimodal model."""
    decoder = model.get_submodule(base)
    config = decoder.config
    rope = getattr(config, "rope_parameters", None) or {}
    _check_rope(rope, longrope=fused)   # Phi-3.5's and Phi-4-mini's
    first = layer_prefixes[0]
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q_norm = getattr(model.get_submodule(f"{first}.self_attn"), "q_norm", None)
    qk_norm = ("" if q_norm is None else
               "head" if q_norm.weight.shape[0] == head_dim != heads * head_dim else "whole")
    qkv = (["self_attn.qkv_proj.weight"] if fused
           else [f"self_attn.{p}_proj.weight" for p in "qkv"])
    rotary = copy.deepcopy(decoder.rotary_emb)
    spec = DecoderSpec(
        vocab=config.vocab_size, hidden=config.hidden_size, layers=len(layer_prefixes),
        heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim, ffn=config.intermediate_size, norm="rms", norm_eps=config.rms_norm_eps,
        activation=getattr(config, "hidden_act", None), gated_mlp=True,   # (Gemma 2's: _gemma)
        qkv_bias=_has_bias(model, f"{first}.{qkv[0].removesuffix('.weight')}"),
        out_bias=_has_bias(model, f"{first}.self_attn.o_proj"),
        mlp_bias=_has_bias(model, f"{first}.mlp.down_proj"), rotary=True,
        # Phi-3 rotates the dims its rotary module has angles for: 12 of 16 at a factor of
        # 0.7 (0.7 x 16 = 11.2, the frequencies over every other of 11 dims)
        rotary_dim=2 * rotary.inv_freq.numel() if fused else head_dim,
        tied_head=_tied_head(model), qk_norm=qk_norm,
        windows=_windows(model, config, [f"{prefix}.self_attn" for prefix in layer_prefixes]),
        long_rope_from=(rope["original_max_position_embeddings"]
                        if rope.get("rope_type") == "longrope" else 0),
        # Gemma 3 and OLMo 3 keep angles a layer kind (their local layers' rope base)
        rope_types=(tuple(config.layer_types[:len(layer_prefixes)])
                    if isinstance(getattr(rotary, "layer_types", None), list) else ()))
    layer = {"attn_norm.weight": ["input_layernorm.weight"], "qkv.weight": qkv,
             "out.weight": ["self_attn.o_proj.weight"],
             "mlp_norm.weight": ["post_attention_layernorm.weight"],
             "up.weight": (["mlp.gate_up_proj.weight"] if fused
                           else ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
             "down.weight": ["mlp.down_proj.weight"]}
    if qk_norm:
        layer |= {"q_norm.weight": ["self_attn.q_norm.weight"],
                  "k_norm.weight": ["self_attn.k_norm.weight"]}
    root = {"embed.weight": [f"{base}.embed_tokens.weight"],
            "norm.weight": [f"{base}.norm.weight"]}
    return spec, root, layer, rotary


def _gemma(model: PreTrainedModel, layer_prefixes: list[str], base: str = "model") -> Plan:
    """Gemma 1, 2 and 3 (text): Llama's layout with RMSNorms that scale by 1 + w, embeddings
    times sqrt(hidden) and GeGLU; Gemma 2 and 3 add a norm after attention and after the
    MLP, a query scale of their own and sliding windows on alternate layers; Gemma 2
    softcaps the attention scores and the logits, Gemma 3 norms each query and key head
    and gives its local layers a rope of their own."""
    config = model.get_submodule(base).config
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("bidirectional attention (an embedding model)")
    spec, root, layer, rotary = _llama_parts(model, layer_prefixes, base=base)
    sandwich = hasattr(model.get_submodule(layer_prefixes[0]), "pre_feedforward_layernorm")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    # Gemma 3's config keeps attn_logit_softcapping, which its attention does not apply
    softcap = config.model_type == "gemma2" and config.attn_logit_softcapping
    spec = dataclasses.replace(
        spec, norm="gemma", embed_scale=config.hidden_size ** 0.5, sandwich_norms=sandwich,
        # Gemma 1's MLP reads hidden_act (its config holds both), Gemma 2's and 3's this
        activation=config.hidden_act if config.model_type == "gemma"
        else config.hidden_activation,
        attention_scale=scalar ** -0.5 if scalar else 0.0,
        attention_softcap=softcap or 0.0,
        logit_softcap=getattr(config, "final_logit_softcapping", None) or 0.0)
    if sandwich:   # Gemma 2's post_attention_layernorm norms attention's output
        layer |= {"mlp_norm.weight": ["pre_feedforward_layernorm.weight"],
                  "post_attn_norm.weight": ["post_attention_layernorm.weight"],
                  "post_mlp_norm.weight": ["post_feedforward_layernorm.weight"]}
    return _assemble(spec, root, layer, layer_prefixes, rotary)


def _gemma3_multimodal(model: PreTrainedModel, layer_prefixes: list[str]) -> Plan:
    """Gemma 3's image-text checkpoints (Gemma3ForConditionalGeneration, which
    AutoModelForCausalLM loads for gemma-3-4b and up): its language model, answering text
    prompts; the vision tower's layers are left out."""
    text = [prefix for prefix in layer_prefixes if prefix.startswith("model.language_model.")]
    return _gemma(model, text, base="model.language_model")


def _windows(model: PreTrainedModel, config, attention: list[str]) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as the model's attention applies
    it: Qwen2 and Qwen3 keep one a layer (their `layer_types`; None where the layer attends
    fully), Mistral and Phi-3 read the config's on every layer, and Llama has none (it
    ignores a `sliding_window` in its config)."""
    default = (getattr(config, "sliding_window", None)
               if config.model_type in ("mistral", "phi3") else None)
    windows = tuple(getattr(model.get_submodule(name), "sliding_window", default) or 0
                    for name in attention)
    if 1 in windows:   # HF's sliding cache keeps every key then (no checkpoint has one)
        raise Unsupported("a sliding window of 1 token")
    return windows if any(windows) else ()


def _opt(model: PreTrainedModel, layer_prefixes: list[str]) -> Plan:
    config = model.config
    if not config.do_layer_norm_before:
        raise Unsupported("post-norm OPT (do_layer_norm_before=False)")
    if config.word_embed_proj_dim != config.hidden_size:
        raise Unsupported("OPT with word_embed_proj_dim != hidden_size (project_in/out)")
    if not config.layer_norm_elementwise_affine or model.model.decoder.final_layer_norm is None:
        raise Unsupported("OPT without affine layer norms or without a final layer norm")
    bias = config.enable_bias
    heads = config.num_attention_heads
    spec = DecoderSpec(
        vocab=config.vocab_size, hidden=config.hidden_size, layers=len(layer_prefixes),
        heads=heads, kv_heads=heads, head_dim=config.hidden_size // heads, ffn=config.ffn_dim,
        norm="layer", norm_eps=1e-5, activation=config.activation_function, gated_mlp=False,
        qkv_bias=bias, out_bias=bias, mlp_bias=bias, rotary=False, position_offset=2,
        scale_query_first=True, tied_head=_tied_head(model))
    layer = {"attn_norm.weight": ["self_attn_layer_norm.weight"],
             "qkv.weight": [f"self_attn.{p}_proj.weight" for p in "qkv"],
             "out.weight": ["self_attn.out_proj.weight"],
             "mlp_norm.weight": ["final_layer_norm.weight"],
             "up.weight": ["fc1.weight"], "down.weight": ["fc2.weight"]}
    root = {"embed.weight": ["model.decoder.embed_tokens.weight"],
            "positions.weight": ["model.decoder.embed_positions.weight"],
            "norm.weight": ["model.decoder.final_layer_norm.weight"]}
    return _assemble(spec, root, layer, layer_prefixes, None)


def _gpt2(model: PreTrainedModel, layer_prefixes: list[str]) -> Plan:
    config = model.config
    if config.scale_attn_by_inverse_layer_idx or config.reorder_and_upcast_attn:
        raise Unsupported("GPT-2 attention scaled by layer index or upcast and reordered")
    if not config.scale_attn_weights:
        raise Unsupported("GPT-2 without scaled attention weights")
    heads = config.n_head
    spec = DecoderSpec(
        vocab=config.vocab_size, hidden=config.n_embd, layers=len(layer_prefixes), heads=heads,
        kv_heads=heads, head_dim=config.n_embd // heads, ffn=config.n_inner or 4 * config.n_embd,
        norm="layer", norm_eps=config.layer_norm_epsilon,
        activation=config.activation_function, gated_mlp=False, qkv_bias=True, out_bias=True,
        mlp_bias=True, rotary=False, tied_head=_tied_head(model))
    # Conv1D keeps its weight as [in, out]: these sources are transposed when copied
    conv = {"qkv": "attn.c_attn", "out": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}
    layer = {"attn_norm.weight": ["ln_1.weight"], "mlp_norm.weight": ["ln_2.weight"],
             **{f"{ours}.weight": [f"{theirs}.weight"] for ours, theirs in conv.items()}}
    root = {"embed.weight": ["transformer.wte.weight"], "norm.weight": ["transformer.ln_f.weight"],
            "positions.weight": ["transformer.wpe.weight"]}
    transforms = {f"{prefix}.{theirs}.weight": torch.Tensor.t for prefix in layer_prefixes
                  for theirs in conv.values()}
    return _assemble(spec, root, layer, layer_prefixes, None, transforms)


def _gpt_neox(model: PreTrainedModel, layer_prefixes: list[str]) -> Plan:
    config = model.config
    rope = config.rope_parameters
    _check_rope(rope)
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    spec = DecoderSpec(
        vocab=config.vocab_size, hidden=config.hidden_size, layers=len(layer_prefixes),
        heads=heads, kv_heads=heads, head_dim=head_dim, ffn=config.intermediate_size,
        norm="layer", norm_eps=config.layer_norm_eps, activation=config.hidden_act,
        gated_mlp=False, qkv_bias=config.attention_bias, out_bias=config.attention_bias,
        mlp_bias=True, rotary=True,
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        parallel_residual=config.use_parallel_residual, tied_head=_tied_head(model))
    layer = {"attn_norm.weight": ["input_layernorm.weight"],
             "mlp_norm.weight": ["post_attention_layernorm.weight"],
             "qkv.weight": ["attention.query_key_value.weight"],
             "out.weight": ["attention.dense.weight"],
             "up.weight": ["mlp.dense_h_to_4h.weight"], "down.weight": ["mlp.dense_4h_to_h.weight"]}
    root = {"embed.weight": ["gpt_neox.embed_in.weight"],
            "norm.weight": ["gpt_neox.final_layer_norm.weight"]}
    # the fused projection's rows run head by head ([q_h; k_h; v_h] for each head h): put
    # all q rows first, then k, then v
    order = torch.arange(3 * config.hidden_size).view(heads, 3, head_dim).transpose(0, 1).flatten()

    def by_kind(weight: torch.Tensor) -> torch.Tensor:
        return weight.index_select(0, order.to(weight.device))

    transforms = {f"{prefix}.attention.query_key_value.{p}": by_kind
                  for prefix in layer_prefixes for p in ("weight", "bias")}
    return _assemble(spec, root, layer, layer_prefixes,
                     copy.deepcopy(model.gpt_neox.rotary_emb), transforms)


def _olmo2(model: PreTrainedModel, layer_prefixes: list[str]) -> Plan:
    """OLMo 2 and 3: Llama's layout, but a layer norms the outputs of attention and the MLP
    (x̂ w in fp32) instead of their inputs, and the queries and keys of all heads together
    before rotation; OLMo 3 adds sliding windows on most layers with a rope of their own."""
    spec, root, layer, rotary = _llama_parts(model, layer_prefixes)
    spec = dataclasses.replace(spec, norm="rms_fp32", pre_norms=False, sandwich_norms=True)
    del layer["attn_norm.weight"], layer["mlp_norm.weight"]
    layer |= {"post_attn_norm.weight": ["post_attention_layernorm.weight"],
              "post_mlp_norm.weight": ["post_feedforward_layernorm.weight"]}
    return _assemble(spec, root, layer, layer_prefixes, rotary)


_FAMILIES = {"llama": _llama, "mistral": _llama, "qwen2": _llama, "qwen3": _llama,
             "phi3": partial(_llama, fused=True), "gemma": _gemma, "gemma2": _gemma,
             "gemma3_text": _gemma, "gemma3": _gemma3_multimodal, "olmo2": _olmo2,
             "olmo3": _olmo2, "opt": _opt, "gpt2": _gpt2, "gpt_neox": _gpt_neox}


def _assemble(spec: DecoderSpec, root: dict[str, list[str]], layer: dict[str, list[str]],
              layer_prefixes: list[str], rotary: nn.Module | None,
              transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
              ) -> Plan:
    if not spec.tied_head:   # every supported family names an untied head lm_head
        root = {**root, "head.weight": ["lm_head.weight"]}
    biased = ["attn_norm", "mlp_norm", "norm"] if spec.norm == "layer" else []
    biased += [name for name, on in (("qkv", spec.qkv_bias), ("out", spec.out_bias),
                                     ("up", spec.mlp_bias), ("down", spec.mlp_bias)) if on]
    root, layer = _with_biases(root, biased), _with_biases(layer, biased)
    sources = dict(root)
    for i, prefix in enumerate(layer_prefixes):
        for name, parts in layer.items():
            sources[f"layers.{i}.{name}"] = [f"{prefix}.{part}" for part in parts]
    return Plan(spec, sources, rotary, transforms or {})


def _with_biases(entries: dict[str, list[str]], names: list[str]) -> dict[str, list[str]]:
    """`entries` plus the bias of each of `names` that it has a weight of: families list
    weights only, and a bias sits in the modules of its weight."""
    return {**entries, **{f"{name}.bias": [part.removesuffix(".weight") + ".bias"
                                           for part in entries[f"{name}.weight"]]
                          for name in names if f"{name}.weight" in entries}}
