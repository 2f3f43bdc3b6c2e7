"""The actor's generation form ("kernel injection"): a decoder rebuilt from a Hugging Face
model's weights into inference modules, with a preallocated static KV cache.

Per layer: one fused QKV projection (one matmul instead of three), attention through
PyTorch SDPA (flash / memory-efficient kernels on CUDA) over the static cache, a fused
gate+up projection for gated MLPs, and the model's own norm formula. On CUDA the decode
step can be captured once as a CUDA graph and replayed for every token, which removes the
per-kernel launch cost that dominates small-batch decoding.

Supported families: Llama (also Mistral without sliding window, Qwen2), OPT (pre-norm),
GPT-2 and GPT-NeoX (Pythia).
`plan(model)` says whether a model is supported and, if not, why; the hybrid engine then
falls back to the Hugging Face modules. Weights are not taken from the model here: the
plan lists, for every inference parameter, the Hugging Face parameters it is built from
(concatenated for fused ones), so the hybrid engine can fill it while it gathers one
FSDP unit at a time.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from engine import kernels
from engine.generation import SamplingSettings, TokenChooser


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
    norm: str                   # "rms" (Llama) | "layer" (OPT)
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


@dataclass
class Plan:
    """How to build the inference decoder from a Hugging Face causal LM.

    `sources[name]` lists the HF parameter names (relative to the transformers model) that
    inference parameter `name` is the concatenation of; `layer_of[name]` is its layer
    index, or None for the embeddings, final norm and head."""

    spec: DecoderSpec
    sources: dict[str, list[str]]
    layer_of: dict[str, int | None]
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


def _check_rope(rope: dict) -> None:
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        raise Unsupported(f"rope type {rope['rope_type']!r} changes with the sequence length")


def _llama(model: PreTrainedModel, layer_prefixes: list[str]) -> Plan:
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    _check_rope(rope)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        raise Unsupported("sliding-window attention")
    first = layer_prefixes[0]
    heads = config.num_attention_heads
    spec = DecoderSpec(
        vocab=config.vocab_size, hidden=config.hidden_size, layers=len(layer_prefixes),
        heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        ffn=config.intermediate_size, norm="rms", norm_eps=config.rms_norm_eps,
        activation=config.hidden_act, gated_mlp=True,
        qkv_bias=_has_bias(model, f"{first}.self_attn.q_proj"),
        out_bias=_has_bias(model, f"{first}.self_attn.o_proj"),
        mlp_bias=_has_bias(model, f"{first}.mlp.down_proj"), rotary=True,
        rotary_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        tied_head=_tied_head(model))
    layer = {"attn_norm.weight": ["input_layernorm.weight"],
             "qkv.weight": [f"self_attn.{p}_proj.weight" for p in "qkv"],
             "out.weight": ["self_attn.o_proj.weight"],
             "mlp_norm.weight": ["post_attention_layernorm.weight"],
             "up.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
             "down.weight": ["mlp.down_proj.weight"]}
    if spec.qkv_bias:
        layer["qkv.bias"] = [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if spec.out_bias:
        layer["out.bias"] = ["self_attn.o_proj.bias"]
    if spec.mlp_bias:
        layer["up.bias"] = ["mlp.gate_proj.bias", "mlp.up_proj.bias"]
        layer["down.bias"] = ["mlp.down_proj.bias"]
    root = {"embed.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    return _assemble(spec, root, layer, layer_prefixes, copy.deepcopy(model.model.rotary_emb))


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
        scale_query_first=True,
        tied_head=_tied_head(model))
    layer = {"attn_norm.weight": ["self_attn_layer_norm.weight"],
             "attn_norm.bias": ["self_attn_layer_norm.bias"],
             "qkv.weight": [f"self_attn.{p}_proj.weight" for p in "qkv"],
             "out.weight": ["self_attn.out_proj.weight"],
             "mlp_norm.weight": ["final_layer_norm.weight"],
             "mlp_norm.bias": ["final_layer_norm.bias"],
             "up.weight": ["fc1.weight"], "down.weight": ["fc2.weight"]}
    if bias:
        layer |= {"qkv.bias": [f"self_attn.{p}_proj.bias" for p in "qkv"],
                  "out.bias": ["self_attn.out_proj.bias"], "up.bias": ["fc1.bias"],
                  "down.bias": ["fc2.bias"]}
    root = {"embed.weight": ["model.decoder.embed_tokens.weight"],
            "positions.weight": ["model.decoder.embed_positions.weight"],
            "norm.weight": ["model.decoder.final_layer_norm.weight"],
            "norm.bias": ["model.decoder.final_layer_norm.bias"]}
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
        mlp_bias=True, rotary=False,
        tied_head=_tied_head(model))
    # Conv1D keeps its weight as [in, out]: these sources are transposed when copied
    conv = {"qkv": "attn.c_attn", "out": "attn.c_proj", "up": "mlp.c_fc",
            "down": "mlp.c_proj"}
    layer = {"attn_norm.weight": ["ln_1.weight"], "attn_norm.bias": ["ln_1.bias"],
             "mlp_norm.weight": ["ln_2.weight"], "mlp_norm.bias": ["ln_2.bias"],
             **{f"{ours}.{p}": [f"{theirs}.{p}"] for ours, theirs in conv.items()
                for p in ("weight", "bias")}}
    root = {"embed.weight": ["transformer.wte.weight"],
            "positions.weight": ["transformer.wpe.weight"],
            "norm.weight": ["transformer.ln_f.weight"], "norm.bias": ["transformer.ln_f.bias"]}
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
        parallel_residual=config.use_parallel_residual,
        tied_head=_tied_head(model))
    layer = {"attn_norm.weight": ["input_layernorm.weight"],
             "attn_norm.bias": ["input_layernorm.bias"],
             "mlp_norm.weight": ["post_attention_layernorm.weight"],
             "mlp_norm.bias": ["post_attention_layernorm.bias"],
             "qkv.weight": ["attention.query_key_value.weight"],
             "out.weight": ["attention.dense.weight"],
             "up.weight": ["mlp.dense_h_to_4h.weight"], "up.bias": ["mlp.dense_h_to_4h.bias"],
             "down.weight": ["mlp.dense_4h_to_h.weight"],
             "down.bias": ["mlp.dense_4h_to_h.bias"]}
    if spec.qkv_bias:
        layer |= {"qkv.bias": ["attention.query_key_value.bias"],
                  "out.bias": ["attention.dense.bias"]}
    root = {"embed.weight": ["gpt_neox.embed_in.weight"],
            "norm.weight": ["gpt_neox.final_layer_norm.weight"],
            "norm.bias": ["gpt_neox.final_layer_norm.bias"]}
    # the fused projection's rows run head by head ([q_h; k_h; v_h] for each head h): put
    # all q rows first, then k, then v
    order = torch.arange(3 * config.hidden_size).view(heads, 3, head_dim).transpose(0, 1)
    order = order.reshape(-1)

    def by_kind(weight: torch.Tensor) -> torch.Tensor:
        return weight.index_select(0, order.to(weight.device))

    transforms = {f"{prefix}.attention.query_key_value.{p}": by_kind
                  for prefix in layer_prefixes for p in ("weight", "bias")}
    return _assemble(spec, root, layer, layer_prefixes,
                     copy.deepcopy(model.gpt_neox.rotary_emb), transforms)


_FAMILIES = {"llama": _llama, "mistral": _llama, "qwen2": _llama, "opt": _opt, "gpt2": _gpt2,
             "gpt_neox": _gpt_neox}


def _assemble(spec: DecoderSpec, root: dict[str, list[str]], layer: dict[str, list[str]],
              layer_prefixes: list[str], rotary: nn.Module | None,
              transforms: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
              ) -> Plan:
    if not spec.tied_head:   # every supported family names an untied head lm_head
        root = {**root, "head.weight": ["lm_head.weight"]}
    sources, layer_of = dict(root), dict.fromkeys(root)
    for i, prefix in enumerate(layer_prefixes):
        for name, parts in layer.items():
            sources[f"layers.{i}.{name}"] = [f"{prefix}.{part}" for part in parts]
            layer_of[f"layers.{i}.{name}"] = i
    return Plan(spec, sources, layer_of, rotary, transforms or {})


CACHE_LENGTH_STEP = 64   # cache lengths are rounded up to a multiple of this


class KVCache:
    """Preallocated keys and values, [layers, batch, kv_heads, length, head_dim] each.
    A call may use any batch and length up to the capacity (a view of the front)."""

    def __init__(self, spec: DecoderSpec, batch: int, length: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (spec.layers, batch, spec.kv_heads, length, spec.head_dim)
        # zeros, not empty: a masked-out slot must hold finite values (0 * NaN is NaN)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin per position

    def fits(self, batch: int, length: int) -> bool:
        return batch <= self.keys.shape[1] and length <= self.keys.shape[3]

    def view(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :batch, :, :length], self.values[:, :batch, :, :length]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()


class _Norm(nn.Module):
    """RMSNorm (Llama's formula) or LayerNorm, applied together with the residual add that
    precedes it: `(residual + delta, norm(residual + delta))`, fused into one Triton
    kernel when `fused` (CUDA), else the PyTorch formula."""

    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.rms, self.eps = spec.norm == "rms", spec.norm_eps
        self.weight = nn.Parameter(torch.empty(spec.hidden), requires_grad=False)
        self.bias = None if self.rms else nn.Parameter(torch.empty(spec.hidden),
                                                       requires_grad=False)
        self.fused = False

    def forward(self, delta: torch.Tensor | None, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        add_norm = kernels.add_norm if self.fused else kernels.add_norm_reference
        return add_norm(delta, residual, self.weight, self.bias, self.eps, self.rms)


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias, device="meta")
    return layer.requires_grad_(False)


class _Layer(nn.Module):
    def __init__(self, spec: DecoderSpec):
        super().__init__()
        self.spec = spec
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        self.attn_norm, self.mlp_norm = _Norm(spec), _Norm(spec)
        self.qkv = _linear(spec.hidden, q + 2 * kv, spec.qkv_bias)
        self.out = _linear(q, spec.hidden, spec.out_bias)
        self.up = _linear(spec.hidden, spec.ffn * (2 if spec.gated_mlp else 1), spec.mlp_bias)
        self.down = _linear(spec.ffn, spec.hidden, spec.mlp_bias)
        self.act = ACT2FN[spec.activation]
        self.splits = (q, kv, kv)
        self.fused_silu = False

    def forward(self, residual: torch.Tensor, delta: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor] | None, keys: torch.Tensor,
                values: torch.Tensor, write_at: torch.Tensor, mask: torch.Tensor,
                kv_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One pre-norm block on the residual stream, which arrives as `residual` plus the
        previous block's output `delta` (added here, fused with the norm) and leaves the
        same way: returns (residual, this block's output), the output being the MLP's (plus
        attention's, with a parallel residual).

        residual, delta: [B, T, hidden]; keys/values: this layer's cache [B, Hkv, S, d],
        written at slots `write_at` ([T] long); mask: [B, 1, T, kv_len or S] bool (True =
        attend); rope: (cos, sin) [B, 1, T, rotary_dim]. Attends over the first kv_len cache
        slots (all S when None: static shapes for CUDA graphs)."""
        spec = self.spec
        b, t, _ = residual.shape
        residual, h = self.attn_norm(delta, residual)
        q, k, v = self.qkv(h).split(self.splits, dim=-1)
        if spec.scale_query_first:
            q = q * spec.head_dim ** -0.5
        q = q.view(b, t, spec.heads, spec.head_dim).transpose(1, 2)
        k = k.view(b, t, spec.kv_heads, spec.head_dim).transpose(1, 2)
        v = v.view(b, t, spec.kv_heads, spec.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = _rotate(q, rope, spec.rotary_dim), _rotate(k, rope, spec.rotary_dim)
        keys.index_copy_(2, write_at, k)
        values.index_copy_(2, write_at, v)
        if kv_len is not None:
            keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
        attn = _grouped_attention(q, keys, values, mask,
                                  1.0 if spec.scale_query_first else spec.head_dim ** -0.5)
        attn = self.out(attn)
        if spec.parallel_residual:   # the MLP reads the block's input, not attention's output
            _, h = self.mlp_norm(None, residual)
            return residual, attn + self._mlp(h)
        residual, h = self.mlp_norm(attn, residual)
        return residual, self._mlp(h)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        h = self.up(h)
        if not self.spec.gated_mlp:
            h = self.act(h)
        elif self.fused_silu:
            h = kernels.silu_mul(h)
        else:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        return self.down(h)

    def use_fused_kernels(self, enabled: bool) -> None:
        self.attn_norm.fused = self.mlp_norm.fused = enabled
        self.fused_silu = enabled and self.spec.gated_mlp and self.spec.activation == "silu"


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA with grouped KV heads, without repeating the cache: the G query heads that share
    a KV head become G x T query rows of that head (every SDPA backend takes this, while
    few take `enable_gqa` together with a mask).

    q: [B, H, T, d]; keys, values: [B, Hkv, S, d]; mask: [B, 1, T, S] -> [B, T, H * d]."""
    b, heads, t, d = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if groups > 1:   # query head h reads KV head h // groups, as HF's repeat_kv arranges
        q = q.reshape(b, kv_heads, groups * t, d)
        mask = mask.expand(b, 1, t, mask.shape[-1]).repeat(1, 1, groups, 1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, t, d).transpose(1, 2).reshape(b, t, heads * d)


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], dims: int
            ) -> torch.Tensor:
    """Rotary embedding of the first `dims` of each head's dims (all, except GPT-NeoX)."""
    cos, sin = rope
    if dims == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :dims], x[..., dims:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class InferenceDecoder(nn.Module):
    """A decoder-only LM in inference form. Its weights start unset (`allocate` gives them
    storage; the hybrid engine fills them); `generate` decodes with a static KV cache."""

    def __init__(self, plan: Plan):
        super().__init__()
        spec = self.spec = plan.spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden, device="meta").requires_grad_(False)
        self.positions = None
        if not spec.rotary:
            self.positions = nn.Embedding(1, spec.hidden, device="meta").requires_grad_(False)
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.layers))
        self.norm = _Norm(spec)
        self.head = None if spec.tied_head else _linear(spec.hidden, spec.vocab, False)
        self.rotary = plan.rotary
        self.cache: KVCache | None = None
        self._steps: dict[tuple[int, int, bool], _StaticDecodeStep] = {}

    def allocate(self, shapes: dict[str, torch.Size], dtype: torch.dtype,
                 device: torch.device) -> None:
        """Give every weight storage of its source's shape (learned positions size from
        the checkpoint); contents are filled by the caller."""
        for name, shape in shapes.items():
            owner, attr = self.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
            setattr(owner, attr, nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                              requires_grad=False))
        if self.rotary is not None:
            self.rotary.to(device)
        self.dtype, self.device = dtype, device

    def release_cache(self) -> None:
        self.cache, self._steps = None, {}

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        """tokens, positions: [B, T] -> hidden [B, T, H], rope (cos, sin) or None."""
        x = self.embed(tokens)
        if self.positions is not None:
            return x + self.positions(positions + self.spec.position_offset), None
        cos, sin = self.cache.rope
        return x, (cos[positions][:, None], sin[positions][:, None])

    def _rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos, sin [length, head_dim] of positions 0..length-1 from the model's own rotary
        module (every rope variant it implements), looked up per token instead of
        recomputed: the same values, elementwise, as computing them per position."""
        if self.rotary is None:
            return None
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, torch.arange(length, device=self.device)[None])
        return cos[0], sin[0]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor,
                mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                kv_len: int | None = None) -> torch.Tensor:
        """Run tokens [B, T] at `positions` [B, T] through the layers, writing their keys
        and values into cache slots `write_at` [T]; returns the last token's logits [B, V]
        in fp32."""
        residual, rope = self._embed(tokens, positions)
        delta = None
        for i, layer in enumerate(self.layers):
            residual, delta = layer(residual, delta, rope, keys[i], values[i], write_at, mask,
                                    kv_len)
        _, x = self.norm(delta[:, -1], residual[:, -1])
        head = self.embed.weight if self.head is None else self.head.weight
        return F.linear(x, head).float()

    def use_fused_kernels(self, enabled: bool) -> None:
        """Triton kernels for add+norm and SiLU*up (CUDA; on CPU only under Triton's
        interpreter, for tests)."""
        self.norm.fused = enabled
        for layer in self.layers:
            layer.use_fused_kernels(enabled)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 sampling: SamplingSettings, **kwargs) -> torch.Tensor:
        """See `_generate`. Decoding runs in inference mode (less bookkeeping per op); the
        answer is returned as an ordinary tensor, fit for training."""
        with torch.inference_mode():
            out = self._generate(input_ids, attention_mask, sampling, **kwargs)
        return out.clone()

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 sampling: SamplingSettings, *, eos_token_id: int | list[int],
                 pad_token_id: int, row_seeds: torch.Tensor | None = None,
                 static: bool = False, cuda_graph: bool = False) -> torch.Tensor:
        """Continue left-padded prompts as Hugging Face `generate` does (same positions,
        sampling, EOS and padding rules): [B, P] -> [B, P + N], N <= max_new_tokens, pad
        after a row's EOS (one of the ids in a list; an empty list never stops early),
        stopping when every row has ended. Decode steps attend over the
        filled part of the cache; `static` (implied by `cuda_graph`) over all of it, with
        fixed shapes, as a CUDA graph needs."""
        b, p = input_ids.shape
        n = sampling.max_new_tokens
        length = p + n
        if self.cache is None or not self.cache.fits(b, length):
            self.release_cache()
            # room to spare, so that rollouts with somewhat longer prompts reuse the cache
            # (and the decode step captured for it)
            capacity = -(-length // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP
            self.cache = KVCache(self.spec, b, capacity, self.dtype, self.device)
            self.cache.rope = self._rope_tables(capacity)
        static = static or cuda_graph
        # a static step attends over the whole capacity: its shapes do not change with P
        width = self.cache.keys.shape[3] if static else length
        keys, values = self.cache.view(b, width)
        device = input_ids.device
        prompt_mask = attention_mask.bool()
        # key slots a query may attend: real prompt tokens, then every answer slot once
        # written; causality and "a pad token attends to itself" (so that no row of the
        # softmax is empty) are added per call
        key_valid = torch.zeros(b, width, dtype=torch.bool, device=device)
        key_valid[:, :p] = prompt_mask
        positions = attention_mask.long().cumsum(-1) - 1
        positions = positions.masked_fill(~prompt_mask, 1)    # as HF generate does
        slots = torch.arange(p, device=device)
        causal = slots[None, :] <= slots[:, None]                          # [P, P]
        mask = (key_valid[:, None, :p] & causal) | torch.eye(p, dtype=torch.bool, device=device)
        # (a new static step runs warm-ups that write one cache slot: before the prefill)
        step = _StaticDecodeStep.get(self, b, width, cuda_graph) if static else None
        logits = self(input_ids, positions, slots, mask[:, None], keys, values, kv_len=p)

        chooser = TokenChooser(sampling, row_seeds)
        stops = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        eos = torch.tensor(stops, dtype=torch.long, device=device)
        out = torch.full((b, length), pad_token_id, dtype=input_ids.dtype, device=device)
        out[:, :p] = input_ids
        unfinished = torch.ones(b, dtype=torch.bool, device=device)
        next_position = attention_mask.long().sum(-1)                   # [B]
        for t in range(n):
            token = chooser(logits, t)
            token = torch.where(unfinished, token, torch.full_like(token, pad_token_id))
            out[:, p + t] = token
            unfinished &= ~torch.isin(token, eos)
            if t == n - 1 or not bool(unfinished.any()):
                return out[:, :p + t + 1]
            key_valid[:, p + t] = True
            slot = torch.tensor([p + t], device=device)
            if step is not None:
                logits = step(token, next_position + t, slot, key_valid)
            else:
                logits = self(token[:, None], (next_position + t)[:, None], slot,
                              key_valid[:, None, None, :p + t + 1], keys, values,
                              kv_len=p + t + 1)
        return out[:, :p]  # max_new_tokens == 0


class _StaticDecodeStep:
    """One decode step with fixed shapes: attention over the whole static cache, inputs
    copied into fixed buffers. On CUDA it is captured once as a graph and replayed per
    token; elsewhere it runs eagerly (which is how the CPU tests check what is captured)."""

    def __init__(self, model: InferenceDecoder, batch: int, length: int, capture: bool):
        device = model.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        # warm-ups write the last slot, which no call reads before writing it itself (it is
        # masked until then)
        self.slot = torch.full((1,), length - 1, dtype=torch.long, device=device)
        # the warm-up query sees only itself: a row with nothing to attend would turn its
        # keys and values into NaN, which even a masked slot passes on (0 * NaN)
        self.key_valid = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=device)
        self.key_valid[..., length - 1] = True
        keys, values = model.cache.view(batch, length)

        def run() -> torch.Tensor:
            return model(self.tokens, self.positions, self.slot, self.key_valid, keys, values)

        self.run, self.graph = run, None
        if not capture:
            run()   # the warm-up a capture does, so that CPU tests see its cache writes too
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):   # warm-up outside the graph, as capture needs
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = run()

    @staticmethod
    def get(model: InferenceDecoder, batch: int, length: int, capture: bool
            ) -> _StaticDecodeStep:
        """The step for these shapes, kept with the cache (captured graphs read its
        memory and the weights', so they stay valid while both are kept)."""
        key = (batch, length, capture)
        if key not in model._steps:
            model._steps[key] = _StaticDecodeStep(model, batch, length, capture)
        return model._steps[key]

    def __call__(self, token: torch.Tensor, positions: torch.Tensor, slot: torch.Tensor,
                 key_valid: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(token[:, None])
        self.positions.copy_(positions[:, None])
        self.slot.copy_(slot)
        self.key_valid.copy_(key_valid[:, None, None])
        if self.graph is None:
            return self.run()
        self.graph.replay()
        return self.logits.clone()


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def fused_shape(shapes: list[torch.Size]) -> torch.Size:
    """Shape of the concatenation (along dim 0) of parameters of `shapes`."""
    return torch.Size([sum(s[0] for s in shapes), *shapes[0][1:]])
