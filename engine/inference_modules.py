"""The inference decoder: a decoder-only LM rebuilt from a Hugging Face model's weights
(as engine/inference_plans.py maps them) into fused modules, with a preallocated static KV
cache ("kernel injection").

Per layer: one fused QKV projection (one matmul instead of three), attention over the
static cache (a prefill's through PyTorch SDPA; with the Triton kernels, a decode step's
through one kernel that reads only the cache's filled slots), a fused
gate+up projection for gated MLPs, and the model's own norm formula, applied together with
the residual add before it (Triton kernels on CUDA, engine/kernels.py). How tokens are
decoded with it is engine/decode.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from engine import kernels
from engine.decode import DecodeTimes
from engine.inference_plans import DecoderSpec, Plan
from engine.quantized_inference import QuantizedProjection, QuantizedSlot, quantized_module

CACHE_LENGTH_STEP = 64   # cache lengths are rounded up to a multiple of this


class KVCache:
    """Preallocated keys and values, [layers, batch, kv_heads, length, head_dim] each, in
    one buffer. A call may use any batch and length up to the capacity (a view of the front).

    Between rollouts `free` gives the buffer back (training can use the memory) and
    `restore` makes it again. The decode steps captured over it (CUDA graphs hold its
    address) are kept when the new buffer lands where the old one was, as the caching
    allocator does when the freed block is whole again, and dropped otherwise."""

    def __init__(self, spec: DecoderSpec, batch: int, length: int, dtype: torch.dtype,
                 device: torch.device):
        self.shape = (2, spec.layers, batch, spec.kv_heads, length, spec.head_dim)
        self.dtype, self.device = dtype, device
        # cos, sin per position, by rope type (InferenceDecoder._rope_tables)
        self.rope: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        # decode steps captured over this cache (engine/decode.py), by their shapes
        self.static_steps: dict = {}
        self.restores = self.moves = 0   # restores, and those that dropped the steps
        self.lent = False   # its memory in other use (lend) until the next restore
        self._allocate()

    def _allocate(self) -> None:
        # zeros, not empty: a masked-out slot must hold finite values (0 * NaN is NaN);
        # a normal tensor even under inference mode, as its memory may be lent (lend)
        with torch.inference_mode(False):
            self.buffer: torch.Tensor | None = torch.zeros(self.shape, dtype=self.dtype,
                                                           device=self.device)
        self.keys, self.values = self.buffer.unbind(0)

    def lend(self) -> torch.Tensor:
        """The buffer, for other use until `restore`, which zeroes it again. It stays where
        it is, and so do the decode steps captured over it."""
        self.lent = True
        return self.buffer

    def free(self) -> None:
        if self.buffer is not None:
            self._freed_at = self.buffer.data_ptr()
            self.buffer = self.keys = self.values = None

    def restore(self) -> None:
        if self.lent:
            self.buffer.zero_()
            self.lent = False
        if self.buffer is None:
            self._allocate()
            self.restores += 1
            if self.buffer.data_ptr() != self._freed_at and self.static_steps:
                self.static_steps.clear()
                self.moves += 1

    def fits(self, batch: int, length: int) -> bool:
        return batch <= self.shape[2] and length <= self.shape[4]

    def view(self, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :batch, :, :length], self.values[:, :batch, :, :length]

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 while freed)."""
        return self.buffer.nbytes if self.buffer is not None else 0


class _Norm(nn.Module):
    """RMSNorm (Llama's formula) or LayerNorm, applied together with the residual add that
    precedes it: `(residual + delta, norm(residual + delta))`, fused into one Triton
    kernel when `fused` (CUDA), else the PyTorch formula."""

    def __init__(self, spec: DecoderSpec, size: int | None = None):
        super().__init__()
        size = size or spec.hidden   # a head's dims for Qwen3's query/key norms
        self.norm, self.eps = spec.norm, spec.norm_eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(size), requires_grad=False)
                     if spec.norm == "layer" else None)
        self.fused = False

    def forward(self, delta: torch.Tensor | None, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        add_norm = kernels.add_norm if self.fused else kernels.add_norm_reference
        return add_norm(delta, residual, self.weight, self.bias, self.eps, self.norm)


def _add(delta: torch.Tensor | None, residual: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A _Norm's (residual + delta, normed) for a layer without that norm (OLMo 2)."""
    x = residual if delta is None else residual + delta
    return x, x


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias, device="meta").requires_grad_(False)


class _Layer(nn.Module):
    def __init__(self, spec: DecoderSpec, window: int = 0):
        super().__init__()
        self.spec, self.window = spec, window   # its sliding window (0: full attention)
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        self.attn_norm, self.mlp_norm = ((_Norm(spec), _Norm(spec)) if spec.pre_norms
                                         else (_add, _add))
        if spec.sandwich_norms:   # Gemma 2 and 3, OLMo 2: on attention's and the MLP's outputs
            self.post_attn_norm, self.post_mlp_norm = _Norm(spec), _Norm(spec)
        if spec.qk_norm == "head":
            self.q_norm, self.k_norm = _Norm(spec, spec.head_dim), _Norm(spec, spec.head_dim)
        elif spec.qk_norm == "whole":
            self.q_norm = _Norm(spec, spec.heads * spec.head_dim)
            self.k_norm = _Norm(spec, spec.kv_heads * spec.head_dim)
        self.qkv = _linear(spec.hidden, q + 2 * kv, spec.qkv_bias)
        self.out = _linear(q, spec.hidden, spec.out_bias)
        self.up = _linear(spec.hidden, spec.ffn * (2 if spec.gated_mlp else 1), spec.mlp_bias)
        self.down = _linear(spec.ffn, spec.hidden, spec.mlp_bias)
        self.act = ACT2FN[spec.activation]
        self.splits = (q, kv, kv)
        self.fused_silu = self.fused_rope = self.fused_attention = False

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
        residual, h = self.attn_norm(delta, residual)
        qkv = self.qkv(h)
        if spec.qk_norm:
            qkv = self._norm_heads(qkv)
        if self.fused_rope and (rope is None or not spec.scale_query_first):
            q = kernels.rope_into_cache(
                qkv, *(rope or (None, None)), keys, values, write_at, spec.heads,
                spec.kv_heads, spec.head_dim, spec.rotary_dim if rope else 0,
                spec.scale if spec.scale_query_first else 1.0)
        else:
            q = self._queries_into_cache(qkv, rope, keys, values, write_at)
        scale = 1.0 if spec.scale_query_first else spec.scale
        if self.fused_attention and q.shape[2] == 1:   # a decode step
            attn = kernels.decode_attention(q, keys, values, mask[:, 0, 0], write_at, scale,
                                            self.window, spec.attention_softcap)
        else:
            if kv_len is not None:
                keys, values = keys[:, :, :kv_len], values[:, :, :kv_len]
            attn = _grouped_attention(q, keys, values, mask, scale, spec.attention_softcap)
        attn = self.out(attn)
        if spec.parallel_residual:   # the MLP reads the block's input, not attention's output
            _, h = self.mlp_norm(None, residual)
            return residual, attn + self._mlp(h)
        if spec.sandwich_norms:
            _, attn = self.post_attn_norm(None, attn)
        residual, h = self.mlp_norm(attn, residual)
        out = self._mlp(h)
        if spec.sandwich_norms:
            _, out = self.post_mlp_norm(None, out)
        return residual, out

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """qkv [B, T, ...] with its queries normed by q_norm and its keys by k_norm, before
        the rotation: each head over its head_dim (Qwen3, Gemma 3), or all heads together
        (OLMo 2)."""
        spec = self.spec
        if spec.qk_norm == "whole":
            q, k, v = qkv.split(self.splits, dim=-1)
            return torch.cat((self.q_norm(None, q)[1], self.k_norm(None, k)[1], v), dim=-1)
        q, k, v = qkv.unflatten(-1, (-1, spec.head_dim)).split(
            (spec.heads, spec.kv_heads, spec.kv_heads), dim=2)
        _, q = self.q_norm(None, q)
        _, k = self.k_norm(None, k)
        return torch.cat((q, k, v), dim=2).flatten(-2)

    def _queries_into_cache(self, qkv: torch.Tensor,
                            rope: tuple[torch.Tensor, torch.Tensor] | None, keys: torch.Tensor,
                            values: torch.Tensor, write_at: torch.Tensor) -> torch.Tensor:
        """Q [B, heads, T, d] from qkv [B, T, ...], Q and K rotated, K and V written into
        the cache (`kernels.rope_into_cache` fuses this)."""
        spec = self.spec
        q, k, v = qkv.split(self.splits, dim=-1)
        if spec.scale_query_first:
            q = q * spec.scale
        # [B, T, heads * d] -> [B, heads, T, d]
        q, k, v = (x.unflatten(-1, (-1, spec.head_dim)).transpose(1, 2) for x in (q, k, v))
        if rope is not None:
            q, k = _rotate(q, rope, spec.rotary_dim), _rotate(k, rope, spec.rotary_dim)
        keys.index_copy_(2, write_at, k)
        values.index_copy_(2, write_at, v)
        return q

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
        for module in self.children():
            if isinstance(module, _Norm):   # attn_norm, mlp_norm (and q_norm, k_norm)
                module.fused = enabled
        self.fused_silu = enabled and self.spec.gated_mlp and self.spec.activation == "silu"
        self.fused_rope = self.fused_attention = enabled


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """SDPA with grouped KV heads, without repeating the cache: the G query heads that share
    a KV head become G x T query rows of that head (every SDPA backend takes this, while
    few take `enable_gqa` together with a mask). With `softcap` (which SDPA cannot apply)
    the scores are cap * tanh(scores / cap) before the mask, as Hugging Face's eager
    attention computes them, softmax in fp32.

    q: [B, H, T, d]; keys, values: [B, Hkv, S, d]; mask: [B, 1, T, S] -> [B, T, H * d]."""
    b, heads, t, d = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    if groups > 1:   # query head h reads KV head h // groups, as HF's repeat_kv arranges
        q = q.reshape(b, kv_heads, groups * t, d)
        mask = mask.expand(b, 1, t, mask.shape[-1]).repeat(1, 1, groups, 1)
    if softcap:
        scores = torch.tanh(q @ keys.transpose(-1, -2) * scale / softcap) * softcap
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32)
        out = weights.to(q.dtype) @ values
    else:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(b, heads, t, d).transpose(1, 2).reshape(b, t, heads * d)


def _within(mask: torch.Tensor, write_at: torch.Tensor, window: int) -> torch.Tensor:
    """mask [B, 1, T, S] (True = attend) limited to keys fewer than `window` slots before
    each query, the T queries being at slots `write_at` [T] (0: unlimited). Slots count
    positions here: a row's tokens fill consecutive slots from its first real one."""
    if not window:
        return mask
    slots = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (slots[None, :] > write_at[:, None] - window)   # [T, S]


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], dims: int
            ) -> torch.Tensor:
    """Rotary embedding of the first `dims` of each head's dims (all, except GPT-NeoX)."""
    if dims < x.shape[-1]:
        return torch.cat((_rotate(x[..., :dims], rope, dims), x[..., dims:]), dim=-1)
    cos, sin = rope
    half = dims // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class InferenceDecoder(nn.Module):
    """A decoder-only LM in inference form. Its weights start unset (`allocate` gives them
    storage; the caller fills them); engine.decode.generate decodes with it over the static
    KV cache it holds (`cache_for`)."""

    def __init__(self, plan: Plan):
        super().__init__()
        spec = self.spec = plan.spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden, device="meta").requires_grad_(False)
        self.positions = (None if spec.rotary
                          else nn.Embedding(1, spec.hidden, device="meta").requires_grad_(False))
        self.windows = spec.windows or (0,) * spec.layers   # each layer's sliding window
        self.layers = nn.ModuleList(_Layer(spec, window) for window in self.windows)
        self.norm = _Norm(spec)
        self.head = None if spec.tied_head else _linear(spec.hidden, spec.vocab, False)
        self.rotary = plan.rotary
        self.rope_types = spec.rope_types or (None,) * spec.layers   # each layer's angles
        self.cache: KVCache | None = None
        self.steps_built = 0   # static decode steps made (captured, on CUDA) so far
        self.times = DecodeTimes()   # prefills' and decode steps' running totals
        self.fused_kernels = False   # Triton kernels (use_fused_kernels), sampling's too

    def allocate(self, shapes: dict[str, torch.Size], dtype: torch.dtype,
                 device: torch.device, quantized: dict[str, QuantizedSlot] | None = None
                 ) -> None:
        """Give every weight storage of its source's shape (learned positions size from
        the checkpoint); contents are filled by the caller. The modules named in `quantized`
        (paths such as `layers.0.qkv`) become quantized ones (engine/quantized_inference.py)
        holding integers, scales and LoRA factors instead of a full-precision weight."""
        quantized = quantized or {}
        for path, slot in quantized.items():
            module = quantized_module(shapes[f"{path}.weight"], slot, f"{path}.bias" in shapes,
                                      path in ("embed", "positions"), dtype, device)
            parent, _, attr = path.rpartition(".")
            setattr(self.get_submodule(parent), attr, module)
        for name, shape in shapes.items():
            path, attr = name.rsplit(".", 1)
            if path in quantized:
                continue
            weight = torch.empty(shape, dtype=dtype, device=device)
            setattr(self.get_submodule(path), attr, nn.Parameter(weight, requires_grad=False))
        if self.rotary is not None:
            self.rotary.to(device)
        self.dtype, self.device = dtype, device

    def cache_for(self, batch: int, length: int) -> KVCache:
        """A cache with room for `batch` rows of `length` tokens: the current one when it
        fits, else a new one with room to spare, so that rollouts with somewhat longer
        prompts reuse it (and the decode steps captured over it)."""
        if self.cache is not None and self.cache.fits(batch, length):
            self.cache.restore()
            return self.cache
        self.cache = None   # the old one (and its steps) first: its memory can be reused
        capacity = -(-length // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP
        self.cache = KVCache(self.spec, batch, capacity, self.dtype, self.device)
        self.cache.rope = self._rope_tables(capacity)
        return self.cache

    def angles_switch_within(self, length: int) -> bool:
        """Whether a generation of `length` tokens can pass longrope's switch to the long
        factors, which HF makes on the largest position of the whole batch (so the batch
        must not shrink to its live rows)."""
        return 0 < self.spec.long_rope_from < length

    def release_cache(self) -> None:
        """Free the KV cache's memory until the next `cache_for` (see KVCache)."""
        if self.cache is not None:
            self.cache.free()

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor):
        """tokens, positions: [B, T] -> hidden [B, T, H] and, by rope type (None: the one
        set of angles), rope (cos, sin) [B, 1, T, rotary_dim] (None without rotary)."""
        x = self.embed(tokens)
        if self.spec.embed_scale:   # Gemma, in the weights' dtype as HF scales
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        if self.positions is not None:
            x = x + self.positions(positions + self.spec.position_offset)
            return x, dict.fromkeys(self.rope_types)
        ropes = {}
        for kind, tables in self.cache.rope.items():
            if self.spec.long_rope_from:   # [2, S, d]: the short factors', the long's
                # as HF picks, on the largest position; a where, as a 0-d index would sync
                long = positions.max() + 1 > self.spec.long_rope_from
                cos, sin = (torch.where(long, table[1][positions], table[0][positions])
                            for table in tables)
            else:
                cos, sin = (table[positions] for table in tables)
            ropes[kind] = cos[:, None], sin[:, None]
        return x, ropes

    def _rope_tables(self, length: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """By rope type, cos, sin [length, head_dim] of positions 0..length-1 from the
        model's own rotary module (every rope variant it implements), looked up per token
        instead of recomputed: the same values, elementwise, as computing them per position."""
        if self.rotary is None:
            return {}
        probe = torch.empty(0, dtype=self.dtype, device=self.device)

        def angles(kind: str | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            positions = torch.arange(n, device=self.device)[None]
            cos, sin = (self.rotary(probe, positions) if kind is None
                        else self.rotary(probe, positions, kind))
            return cos[0], sin[0]

        tables, switch = {}, self.spec.long_rope_from
        for kind in set(self.rope_types):
            if not switch:
                tables[kind] = angles(kind, length)
                continue
            # the module takes the long factors for a call past `switch` positions: the
            # long table from one such call, the short one from one within (positions past
            # `switch` never read it: a forward holding them takes the long angles)
            long = [t[:length] for t in angles(kind, max(length, switch + 1))]
            short = angles(kind, min(length, switch))
            tables[kind] = tuple(torch.stack((torch.cat((s, t[len(s):])), t))
                                 for s, t in zip(short, long, strict=True))
        return tables

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_at: torch.Tensor,
                mask: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                kv_len: int | None = None) -> torch.Tensor:
        """Run tokens [B, T] at `positions` [B, T] through the layers, writing their keys
        and values into cache slots `write_at` [T]; returns the last token's logits [B, V]
        in fp32."""
        residual, ropes = self._embed(tokens, positions)
        masks = {window: _within(mask, write_at, window) for window in set(self.windows)}
        delta = None
        for i, layer in enumerate(self.layers):
            residual, delta = layer(residual, delta, ropes[self.rope_types[i]], keys[i],
                                    values[i], write_at, masks[self.windows[i]], kv_len)
        _, x = self.norm(delta[:, -1], residual[:, -1])
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        if self.spec.logit_softcap:   # Gemma 2, in the logits' dtype as HF caps them
            cap = self.spec.logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def use_fused_kernels(self, enabled: bool) -> None:
        """Triton kernels for add+norm, SiLU*up and quantized projections (CUDA; on CPU
        only under Triton's interpreter, for tests); engine/decode.py then samples with one
        too."""
        self.fused_kernels = enabled
        self.norm.fused = enabled
        for layer in self.layers:
            layer.use_fused_kernels(enabled)
        for module in self.modules():
            if isinstance(module, QuantizedProjection):
                module.fused = enabled


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
