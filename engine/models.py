"""Where models and tokenizers come from: built-in presets, local directories, the hub.

A model argument (`--actor-model`, `--reward-model`) is one of
  * a built-in tiny preset (`tiny-llama`, `tiny-llama-4l`, `tiny-opt`, `tiny-gpt2`,
    `tiny-gpt-neox`, `tiny-qwen3`), built from a config with random weights, for demos and
    tests;
  * a local Hugging Face directory (config.json + weights);
  * a hub name, which works when online or cached and otherwise fails in one line.
engine/model_source.py tells which (without importing transformers); this file loads.
"""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub import snapshot_download
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as tokenizer_models
from torch.utils.checkpoint import checkpoint
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen3Config,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.errors import UserError
from engine.model_source import (
    PRESET_NAMES,
    SHAPES,
    hub_error,
    hub_local_only,
    is_preset,
    model_source,
    named,
    require_tokenizer_files,
)
from engine.packing import Unpadded, unpadded
from engine.parallel import hf_model
from engine.quantized_base import build_quantized

# Small enough to train on two CPU cores in seconds, big enough to learn the demo task.
_TINY = dict(hidden=128, layers=2, heads=4, ffn=512, positions=1024)


def _llama(vocab_size: int, layers: int = _TINY["layers"], **ids: int) -> PretrainedConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=_TINY["hidden"], intermediate_size=_TINY["ffn"],
        num_hidden_layers=layers, num_attention_heads=_TINY["heads"],
        num_key_value_heads=_TINY["heads"] // 2, max_position_embeddings=_TINY["positions"],
        tie_word_embeddings=False, **ids)


def _opt(vocab_size: int, **ids: int) -> PretrainedConfig:
    return OPTConfig(
        vocab_size=vocab_size, hidden_size=_TINY["hidden"], ffn_dim=_TINY["ffn"],
        num_hidden_layers=_TINY["layers"], num_attention_heads=_TINY["heads"],
        word_embed_proj_dim=_TINY["hidden"], max_position_embeddings=_TINY["positions"],
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, **ids)


def _gpt2(vocab_size: int, **ids: int) -> PretrainedConfig:
    return GPT2Config(
        vocab_size=vocab_size, n_embd=_TINY["hidden"], n_layer=_TINY["layers"],
        n_head=_TINY["heads"], n_inner=_TINY["ffn"], n_positions=_TINY["positions"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)


def _gpt_neox(vocab_size: int, **ids: int) -> PretrainedConfig:
    return GPTNeoXConfig(
        vocab_size=vocab_size, hidden_size=_TINY["hidden"], intermediate_size=_TINY["ffn"],
        num_hidden_layers=_TINY["layers"], num_attention_heads=_TINY["heads"],
        max_position_embeddings=_TINY["positions"], hidden_dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=False, **ids)


def _qwen3(vocab_size: int, **ids: int) -> PretrainedConfig:
    # Qwen3's own traits: RMSNorm of each query and key head, a head_dim wider than
    # hidden / heads (as Qwen3-0.6B's 128 against 1024 / 16) and a tied head
    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=_TINY["hidden"], intermediate_size=_TINY["ffn"],
        num_hidden_layers=_TINY["layers"], num_attention_heads=_TINY["heads"],
        num_key_value_heads=_TINY["heads"] // 2, head_dim=2 * _TINY["hidden"] // _TINY["heads"],
        max_position_embeddings=_TINY["positions"], tie_word_embeddings=True, **ids)


# tiny-llama-4l: tiny-llama at 4 layers, a deeper reward model for the demo tasks (README,
# "Step 3 against best-of-n")
PRESETS = dict(zip(PRESET_NAMES, (_llama, partial(_llama, layers=4), _opt, _gpt2, _gpt_neox,
                                  _qwen3), strict=True))

def _shape_preset(spec: str, vocab_size: int, **overrides) -> PretrainedConfig:
    hidden, layers, heads, kv_heads, ffn, theta = SHAPES[spec]
    return LlamaConfig(**{
        "vocab_size": max(32000, vocab_size), "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 4096, "rope_theta": theta,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **overrides})


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in tokenizer of the presets: one token per byte, so it needs no training
    data and round-trips any text. Ids: <pad>=0, <s>=1 (prepended), </s>=2, <unk>=3."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(specials + alphabet)}
    tok = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                       special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   model_max_length=_TINY["positions"])


def prompt_ids(texts: list[str], tokenizer: PreTrainedTokenizerBase
               ) -> tuple[list[list[int]], list[list[int]]]:
    """(ids with the tokenizer's special tokens, ids without) of prompt texts. Of the special
    tokens, those that would break a prompt are left out: the ones a post-processor appends
    (Llama's add_eos_token: every prompt would end the text before its answer), and the
    ones it prepends to a text that begins with them already (a prompt a chat template
    rendered, BOS included: it would have two)."""
    # quietly: prompts longer than a limit are dropped and counted by the callers
    full = tokenizer(texts, verbose=False)["input_ids"]
    bare = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    head, tail = _special_affixes(tokenizer)
    for i, (ids, own) in enumerate(zip(full, bare, strict=True)):
        if ids != head + own + tail:   # a tokenizer that adds tokens otherwise: as it is
            continue
        full[i] = own if head and own[:len(head)] == head else head + own
    return full, bare


def _special_affixes(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The ids a tokenizer puts before and after a text's own (e.g. [BOS], [])."""
    full = tokenizer("Hi", verbose=False)["input_ids"]
    own = tokenizer("Hi", add_special_tokens=False, verbose=False)["input_ids"]
    for start in range(len(full) - len(own) + 1):
        if full[start:start + len(own)] == own:
            return full[:start], full[start + len(own):]
    return [], []


def decode_answer(tokenizer: PreTrainedTokenizerBase, prompt: list[int],
                  answer: list[int]) -> str:
    """An answer's text as it reads after its prompt, special tokens (EOS, padding) left out.
    Decoded with a few prompt tokens in front: SentencePiece tokenizers (Llama-2, Mistral)
    drop the leading space of a text's first token, and that space is part of the answer
    (decoded alone, prompt + answer would read "Assistant:Paris")."""
    context, kw = list(prompt[-4:]), dict(skip_special_tokens=True,
                                          clean_up_tokenization_spaces=False)
    head = tokenizer.decode(context, **kw)
    whole = tokenizer.decode(context + list(answer), **kw)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(answer, **kw)


def _from_hub_or_dir(load, spec: str, kind: str, flag: str, what: str, **kwargs):
    """`load(spec, local_files_only=..., **kwargs)`, with hub/IO failures and unreadable
    files (truncated or corrupt weights, a broken config.json, an unknown architecture) as
    one-line errors."""
    local_only = kind == "hub" and hub_local_only(spec, flag)
    if local_only and what == "model":
        # from_pretrained does not pass local_files_only on to its look for a LoRA adapter,
        # which would retry the unreachable hub for half a minute (transformers 5)
        kwargs["adapter_kwargs"] = {"local_files_only": True}
    try:
        return load(spec, local_files_only=local_only, **kwargs)
    except (OSError, ValueError, SafetensorError) as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if isinstance(err, SafetensorError):
            why = f"a weights file is truncated or not safetensors: {why}"
        if local_only:
            why = f"offline, and the local cache holds only part of it: {why}"
        if kind == "hub":
            raise hub_error(spec, flag, why) from None
        raise UserError(f"{named(flag, spec)}: cannot load the {what} ({why})") from None


def load_tokenizer(spec: str, *, tokenizer: str | None = None, flag: str = "--actor-model",
                   trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer for a model argument: `tokenizer` when given, the built-in byte
    tokenizer for a preset, otherwise the model directory's own. Ensures a pad token."""
    source = tokenizer or spec
    if is_preset(source):
        tok = byte_tokenizer()
    else:
        flag = "tokenizer=" if tokenizer else flag
        kind = model_source(source, flag, tokenizer=bool(tokenizer))
        if kind == "local":
            require_tokenizer_files(source, flag)
        tok = _from_hub_or_dir(AutoTokenizer.from_pretrained, source, kind, flag, "tokenizer",
                               trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise UserError(f"{named(flag, source)}: the tokenizer has no EOS token; answers need one")
    if tok.pad_token_id is None:
        # Prefer a token that never ends a real sequence, so HF's sequence-classification
        # pooling (rightmost non-pad token) still sees the final EOS.
        tok.pad_token = tok.unk_token if tok.unk_token_id not in (None, tok.eos_token_id) \
            else tok.eos_token
    tok.padding_side = "right"
    return tok


def preset_config(spec: str, tok: PreTrainedTokenizerBase, **overrides) -> PretrainedConfig:
    build = PRESETS[spec] if spec in PRESETS else partial(_shape_preset, spec)
    return build(len(tok), pad_token_id=tok.pad_token_id,
                 bos_token_id=tok.bos_token_id or tok.eos_token_id,
                 eos_token_id=tok.eos_token_id, **overrides)


# What each loader's checkpoint must be to bring its head, as README's users call it.
_KINDS = {AutoModelForCausalLM: ("a causal LM", "a causal-LM directory (e.g. output/actor "
                                 "or output/step3/actor)"),
          AutoModelForSequenceClassification: ("a reward model", "a reward-model directory "
                                               "(step 2's output/reward)")}


def _kind_of(architecture: str) -> type | None:
    """The auto class whose head an `architectures` entry of config.json has; None for one
    this cannot tell (a headless base, custom code): such a directory is let through."""
    if architecture.endswith("ForSequenceClassification"):
        return AutoModelForSequenceClassification
    if architecture.endswith(("ForCausalLM", "LMHeadModel")) \
            or architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return AutoModelForCausalLM
    return None


def require_head(auto_cls, architectures: list[str] | None, spec: str, flag: str) -> None:
    """Refuse a checkpoint whose config.json names a model of another kind than `auto_cls`:
    loaded anyway, its head would be freshly initialised (random rewards, a random LM head)
    and nothing would say so. Wanted where the head must come trained: a step-3 reward model
    or actor, a model to chat with; not where a fresh head is the point (step 2, the critic)."""
    kinds = {_kind_of(name) for name in architectures or ()} - {None}
    if not kinds or auto_cls in kinds:
        return
    found, wanted = _KINDS[kinds.pop()][0], _KINDS[auto_cls]
    raise UserError(f"{named(flag, spec)}: {found} ({', '.join(architectures)}), not {wanted[0]}: "
                    f"its head would start random; pass {wanted[1]}")


def _local_architectures(directory: str) -> list[str] | None:
    try:   # unreadable: from_pretrained says why next
        return json.loads((Path(directory) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None


def _load(auto_cls, spec: str, tok: PreTrainedTokenizerBase, *, flag: str, dtype: torch.dtype,
          trust_remote_code: bool, seed: int, trained_head: bool = False,
          **kwargs) -> PreTrainedModel:
    kind = model_source(spec, flag)
    if spec in SHAPES:
        raise UserError(f"{named(flag, spec)}: a shape preset is built straight into a quantized "
                        "base (--zero-quantized-nontrainable-weights, with LoRA); in full "
                        "precision pass a checkpoint directory instead")
    if kind == "preset":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return auto_cls.from_config(preset_config(spec, tok, **kwargs), dtype=dtype)
    if trained_head and kind == "local":   # before the weights: a big model loads slowly
        require_head(auto_cls, _local_architectures(spec), spec, flag)
    model = _from_hub_or_dir(auto_cls.from_pretrained, spec, kind, flag, "model", dtype=dtype,
                             trust_remote_code=trust_remote_code, **kwargs)
    if trained_head:   # a hub model's too: its loaded config keeps config.json's architectures
        require_head(auto_cls, model.config.architectures, spec, flag)
    _require_vocabulary(model, tok, spec, flag)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model


def _snapshot(spec: str, local_files_only: bool = False) -> Path:
    """A hub model's local snapshot (configs and safetensors only)."""
    return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors"],
                                  local_files_only=local_files_only))


def load_quantized(kind: str, spec: str, tok: PreTrainedTokenizerBase, settings, *,
                   flag: str | None = None, dtype: torch.dtype, head_dtype: torch.dtype,
                   device: torch.device, trust_remote_code: bool = False, seed: int = 0,
                   trained_head: bool = False):
    """A causal LM (`kind` "causal_lm") or one-label reward model ("reward_model") with its
    frozen Linear/Embedding weights quantized while loading (engine/quantized_base.py),
    never materialized in full precision; returns (model, LoadReport). `trained_head`: the
    checkpoint must be of that kind (see require_head)."""
    auto_cls, extra = ((AutoModelForCausalLM, {}) if kind == "causal_lm"
                       else (AutoModelForSequenceClassification, {"num_labels": 1}))
    flag = flag or ("--actor-model" if kind == "causal_lm" else "--reward-model")
    source, checkpoint = model_source(spec, flag), None
    if source == "preset":
        config = preset_config(spec, tok, **extra)
    else:
        checkpoint = Path(spec) if source == "local" else \
            _from_hub_or_dir(_snapshot, spec, source, flag, "model")
        config = _from_hub_or_dir(AutoConfig.from_pretrained, str(checkpoint), "local", flag,
                                  "model config", trust_remote_code=trust_remote_code, **extra)
        if trained_head:
            require_head(auto_cls, config.architectures, spec, flag)
    model, report = build_quantized(auto_cls, config, settings, dtype=dtype,
                                         head_dtype=head_dtype, device=device,
                                         checkpoint=checkpoint, seed=seed)
    _require_vocabulary(model, tok, spec, flag)
    if kind == "reward_model" or model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model, report


def load_causal_lm(spec: str, tok: PreTrainedTokenizerBase, *, flag: str = "--actor-model",
                   dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                   seed: int = 0, trained_head: bool = False) -> PreTrainedModel:
    """A causal LM from a preset, directory or hub name (random init for presets).
    `trained_head`: refuse a checkpoint of another kind (see require_head)."""
    return _load(AutoModelForCausalLM, spec, tok, flag=flag, dtype=dtype,
                 trust_remote_code=trust_remote_code, seed=seed, trained_head=trained_head)


def load_adapter(directory: str, base: str, tok: PreTrainedTokenizerBase, *, flag: str,
                 dtype: torch.dtype = torch.float32,
                 trust_remote_code: bool = False) -> PreTrainedModel:
    """A LoRA adapter directory (ppo.export_weights=adapter) merged into its base `base`,
    a checkpoint directory or hub name (a preset's weights are random: refused)."""
    if model_source(base, flag) == "preset":
        raise UserError(f"{named(flag, directory)}: an adapter over the preset {base}, whose "
                        "weights are random (a shape probe): there is no model to load")
    from peft import PeftModel  # chat.py's path alone needs it

    from engine.lora import peft_quietly

    model = load_causal_lm(base, tok, flag=f"{named(flag, directory)}'s base", dtype=dtype,
                           trust_remote_code=trust_remote_code, trained_head=True)
    with peft_quietly():
        return PeftModel.from_pretrained(model, directory).merge_and_unload()


def load_reward_model(spec: str, tok: PreTrainedTokenizerBase, *, flag: str = "--reward-model",
                      dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                      seed: int = 0, trained_head: bool = False) -> PreTrainedModel:
    """A one-label `AutoModelForSequenceClassification`. From a causal-LM checkpoint the
    transformer is reused and the score head is freshly initialised (as in InstructGPT),
    unless `trained_head` (a frozen reward model) refuses it (see require_head)."""
    model = _load(AutoModelForSequenceClassification, spec, tok, flag=flag, dtype=dtype,
                  trust_remote_code=trust_remote_code, seed=seed, trained_head=trained_head,
                  num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    return model


# Learned absolute position tables (GPT-2's `wpe`, OPT's `embed_positions`, ...): a position
# past the end indexes out of range deep in the forward. Rotary (Llama, GPT-NeoX) and ALiBi
# models have none, and may run past max_position_embeddings.
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def learned_positions(model: torch.nn.Module) -> int | None:
    """How many positions a model with learned absolute position embeddings reads; None for
    one without them (no hard limit)."""
    inner = hf_model(model)
    if not any(name.rsplit(".", 1)[-1] in _POSITION_TABLES for name, _ in inner.named_modules()):
        return None
    return getattr(inner.config.get_text_config(), "max_position_embeddings", None)


def require_positions(model: torch.nn.Module, tokens: int, settings: str, where: str) -> None:
    """Refuse, before training, sequences of `tokens` (made by `settings`, e.g.
    "data.max_prompt_len=2000 + data.max_answer_len=2000") longer than the learned position
    embeddings of `model` (`where`: its flag and path) reach."""
    limit = learned_positions(model)
    if limit is not None and tokens > limit:
        kind = hf_model(model).config.model_type
        raise UserError(f"{settings}: sequences of up to {tokens} tokens, but {where} ({kind}, "
                        f"learned position embeddings) reads at most {limit}; lower them to fit")


def stored_positions(spec: str, trust_remote_code: bool = False) -> tuple[int, str] | None:
    """(positions, model type) of a preset or local model directory with learned absolute
    position embeddings, read from its config alone (the model built on the meta device,
    no weights); None for one without them, or one this cannot tell (a hub name, custom
    code): the check when the model loads still catches those."""
    try:
        if is_preset(spec):
            build = PRESETS[spec] if spec in PRESETS else partial(_shape_preset, spec)
            config = build(256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        elif (Path(spec).expanduser() / "config.json").exists():
            config = AutoConfig.from_pretrained(Path(spec).expanduser(),
                                                trust_remote_code=trust_remote_code)
        else:
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    limit = learned_positions(model)
    return None if limit is None else (limit, config.model_type)


def _require_vocabulary(model: PreTrainedModel, tok: PreTrainedTokenizerBase, spec: str,
                        flag: str) -> None:
    """Refuse a tokenizer with more tokens than the model has embeddings (tokenizer=DIR of
    another model): its ids past the table would fail deep in the first forward."""
    table = model.get_input_embeddings()
    rows = getattr(table, "num_embeddings", None) or model.config.get_text_config().vocab_size
    if len(tok) > rows:
        name = f" {tok.name_or_path}" if tok.name_or_path else ""
        raise UserError(f"{named(flag, spec)}: the model embeds {rows} tokens, the tokenizer{name} "
                        f"has {len(tok)}: ids past the model's table; use the tokenizer the "
                        "model was trained with")


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] positions counting real tokens only, so a left-padded prompt gets the same
    positions as unpadded (and as `generate` gives it)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# Model types whose logits are their output head's output as it is, with no scaling or
# soft-capping after it (Gemma 2's, Cohere's and Granite's have some): `head_reduced` may
# reduce the head's output in place of the logits.
PLAIN_HEAD_MODEL_TYPES = frozenset({
    "bloom", "falcon", "gemma", "gpt2", "gpt_neox", "llama", "mistral", "mixtral", "opt",
    "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})

# logits elements one chunk of `head_reduced` makes (32 MiB in bf16): 2 rows of 128 answer
# tokens at a 50k vocabulary, a head GEMM of 256 x H x V, still large enough to run at the
# GPU's matmul rate; 4x this left a forward batch of 16 in two chunks, half its logits
HEAD_CHUNK = 2**24


def head_reduced(model: torch.nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, keep: int, reduce, *, call=None,
                 chunk: int = HEAD_CHUNK, packed: bool = False) -> torch.Tensor:
    """[B, keep, ...]: ``reduce(logits, rows)`` of a causal LM's logits [r, keep, V] at the
    last `keep` positions, r rows at a time (as many as fit in `chunk` logits elements),
    where ``reduce`` maps rows `rows` (a slice) of the logits to [r, keep] (e.g. the taken
    tokens' log-probs) or [r, keep, k] (several values a position: log-prob and entropy). The [B, keep, V] logits never exist at once, forward or backward: the head
    computes the reduction in its own forward (inside FSDP's gathered root, peft's adapters,
    an offload's hooks), and with gradients each chunk's head runs again in backward, so
    between the passes only its input [B, keep, H] is kept: a plain nn.Linear head through
    LinearReduced (one weight gradient for all chunks), any other (peft's LoRA on the head)
    through torch.utils.checkpoint. The model is called as a whole (through `call`, e.g.
    its TrainEngine, when given). A model type not in PLAIN_HEAD_MODEL_TYPES gets its whole
    logits reduced at once. `packed`: the rows run packed (engine.packing.unpadded; each
    row's real tokens one run), the head on the last `keep` positions of each."""
    inner, layout = hf_model(model), unpadded(input_ids, attention_mask) if packed else None
    kwargs = _forward_inputs(input_ids, attention_mask, layout)
    if inner.config.model_type not in PLAIN_HEAD_MODEL_TYPES:
        logits = (call or model)(**kwargs, logits_to_keep=0 if packed else keep).logits
        return reduce(layout.padded(logits)[:, -keep:] if packed else logits, slice(None))
    head, hidden = inner.get_output_embeddings(), []

    def skip_head(module, args):   # the hidden states are kept, the head makes nothing
        hidden.append(layout.padded(args[0])[:, -keep:] if packed else args[0])
        return (args[0][:, :0], *args[1:])

    def reduce_instead(module, args, output):
        rows = max(1, chunk // (keep * output.shape[-1]))
        if type(module) is torch.nn.Linear:   # one weight gradient for all the chunks
            return LinearReduced.apply(hidden.pop(), module.weight, module.bias, reduce, rows)
        return _reduced_by_rows(module.forward, hidden.pop(), reduce, rows)

    handles = [head.register_forward_pre_hook(skip_head),
               head.register_forward_hook(reduce_instead)]
    try:
        return (call or model)(**kwargs, logits_to_keep=0 if packed else keep).logits
    finally:
        for handle in handles:
            handle.remove()


def _forward_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    layout: Unpadded | None) -> dict[str, torch.Tensor | bool]:
    """A forward's inputs for padded rows, or for them packed by `layout`: no attention_mask
    (position_ids restarting at each sequence keep its attention to itself) and no cache,
    without which transformers would not read the sequences from the positions."""
    if layout is None:
        return dict(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids(attention_mask))
    return dict(input_ids=layout.input_ids, position_ids=layout.position_ids, use_cache=False)


def _reduced_by_rows(forward, hidden: torch.Tensor, reduce, rows: int) -> torch.Tensor:
    """torch.cat over row chunks of ``reduce(forward(hidden[part]), part)``: checkpointed
    when gradients are on, so backward makes each chunk's output again instead of keeping
    it (no RNG state is saved: an output head has no dropout)."""
    parts = []
    for part in _row_chunks(hidden.shape[0], rows):

        def chunk(h: torch.Tensor, part: slice = part) -> torch.Tensor:
            return reduce(forward(h), part)

        if torch.is_grad_enabled():
            parts.append(checkpoint(chunk, hidden[part], use_reentrant=False,
                                    preserve_rng_state=False))
        else:
            parts.append(chunk(hidden[part]))
    return torch.cat(parts)


class LinearReduced(torch.autograd.Function):
    """[B, N]: ``reduce(F.linear(hidden[rows], weight, bias), rows)`` over row chunks of
    hidden [B, N, H], weight [V, H], where ``reduce`` depends on its input only. Backward
    makes each chunk's output again, takes its gradient through ``reduce``, and adds the
    chunk's share into one weight gradient of the weight's dtype: autograd's own sum of a
    checkpointed head's per-chunk [V, H] gradients holds two of them at once beside the
    parameter's. Autocast, where on in forward, is on in backward too; its bf16 products
    are then summed into fp32 weights' gradient in fp32 (one bf16 product at a time beside
    it), where autograd would sum the chunks in bf16."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias, reduce,
                rows: int) -> torch.Tensor:
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device),
                        torch.get_autocast_dtype(device))
        ctx.reduce, ctx.rows = reduce, rows
        ctx.save_for_backward(hidden, weight, bias)
        return torch.cat([reduce(F.linear(hidden[part], weight, bias), part)
                          for part in _row_chunks(hidden.shape[0], rows)])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, bias = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            for part in _row_chunks(hidden.shape[0], ctx.rows):
                h = hidden[part]
                g = _gradient_of_logits(ctx.reduce, F.linear(h, weight, bias), part,
                                        grad_out[part])
                if need_hidden:
                    grad_hidden[part] = g @ weight
                if need_weight:
                    _add_product(grad_weight, g.flatten(0, -2).mT, h.flatten(0, -2))
                if need_bias:
                    grad_bias.add_(g.flatten(0, -2).sum(0))
                del g   # before the next chunk's logits are made
        return grad_hidden, grad_weight, grad_bias, None, None


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, in place where the dtypes match, else through autocast's product."""
    if a.dtype == b.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)


def _gradient_of_logits(reduce, logits: torch.Tensor, rows: slice,
                        grad_out: torch.Tensor) -> torch.Tensor:
    logits.requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(reduce(logits, rows), logits, grad_out)[0]


def _row_chunks(total: int, rows: int) -> list[slice]:
    return [slice(b, b + rows) for b in range(0, total, rows)]


def _score_head(model: torch.nn.Module) -> torch.nn.Module:
    heads = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "score"]
    if len(heads) != 1:
        raise UserError(f"{type(model).__name__}: expected one `score` head for per-token "
                        "values; use an AutoModelForSequenceClassification checkpoint")
    return heads[0]


def token_values(model: torch.nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, call=None, packed: bool = False) -> torch.Tensor:
    """Per-token outputs [B, T] (fp32) of a one-label sequence-classification model (the
    reward at every position, or the critic's values). The model is called as a whole
    (through `call`, e.g. its TrainEngine, when given), so wrappers (peft, FSDP) run their
    hooks; the head's output is captured on the way out. `packed`: the rows run packed
    (engine.packing.unpadded), their outputs put back in place."""
    if not packed:
        return _score_outputs(model, call, **_forward_inputs(input_ids, attention_mask, None))
    layout = unpadded(input_ids, attention_mask)
    return layout.padded(_score_outputs(model, call, **_forward_inputs(None, None, layout)))


def _score_outputs(model: torch.nn.Module, call, **inputs) -> torch.Tensor:
    captured = []
    handle = _score_head(model).register_forward_hook(lambda m, i, out: captured.append(out))
    try:
        (call or model)(**inputs)
    finally:
        handle.remove()
    return captured[0].squeeze(-1).float()


def packed_scores(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  ends: torch.Tensor, call=None) -> torch.Tensor:
    """[N] a one-label scorer's outputs at the last tokens `ends` (flat indices into [R, W])
    of sequences packed into input_ids [R, W] (steps.tokenize.collate_packed_pairs); the
    packing's position_ids keep each sequence's attention to itself (require_packing)."""
    values = _score_outputs(model, call, input_ids=input_ids, position_ids=position_ids,
                            use_cache=False)
    return values.reshape(-1)[ends]


def sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, call=None, packed: bool = False
                    ) -> torch.Tensor:
    """[B] reward-model score at the last real token of each sequence (left or right
    padding; `packed`: run packed, as token_values)."""
    values = token_values(model, input_ids, attention_mask, call, packed)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.long()).argmax(-1)   # [B] the rightmost real token
    return values.gather(1, last[:, None]).squeeze(1)


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn every dropout of `model` off in place, its config left as it is (so an export
    keeps the checkpoint's values): `nn.Dropout` modules, and the float rates that
    transformers' modules pass to functional dropout themselves (OPT's `dropout`, Llama's
    `attention_dropout`, ...). Returns how many were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            changed += module.p > 0
            module.p = 0.0
            continue
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                changed += value > 0
                setattr(module, name, 0.0)
    return changed


def add_embedding_noise(model: torch.nn.Module, alpha: float
                        ) -> torch.utils.hooks.RemovableHandle:
    """NEFTune (Jain et al., 2023; TRL's neftune_noise_alpha): while `model` trains, its
    input embeddings [B, L, d] get uniform noise in [-alpha / sqrt(L * d), alpha / sqrt(L *
    d)]; in eval mode (evaluation, generation) they are left as they are. Returns the
    hook's handle (`.remove()` takes it off)."""
    def noisy(module: torch.nn.Module, inputs, embeddings: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return embeddings
        bound = alpha / math.sqrt(embeddings.shape[-2] * embeddings.shape[-1])
        return embeddings + torch.empty_like(embeddings).uniform_(-bound, bound)

    return model.get_input_embeddings().register_forward_hook(noisy)
