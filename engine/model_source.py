"""Where a model argument comes from, checked before anything heavy is imported (the
launcher's process plans and checks a run without transformers): a built-in preset, a
local Hugging Face directory, or a hub name, which works when online or cached and
otherwise fails in one line. engine/models.py loads from what this decides."""

from __future__ import annotations

import difflib
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import constants, try_to_load_from_cache

from engine.errors import UserError

# built in engine/models.py; tiny-llama-4l is tiny-llama at 4 layers
PRESET_NAMES = ("tiny-llama", "tiny-llama-4l", "tiny-opt", "tiny-gpt2", "tiny-gpt-neox",
                "tiny-qwen3")

# what a directory must hold for AutoTokenizer to load from it (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")

# Real model shapes with random weights, for memory and speed probes without a checkpoint:
# Llama 2 7B and 13B, Code Llama 34B and Llama 2 70B (the last two with GQA, 8 KV heads).
# (hidden, layers, heads, kv heads, intermediate, rope theta); vocabulary 32,000 (or the
# tokenizer's, if larger). They are built straight into the quantized base, one module at
# a time (engine.quantized_base); in full precision they are refused.
SHAPES = {"llama-7b": (4096, 32, 32, 32, 11008, 1e4), "llama-13b": (5120, 40, 40, 40, 13824, 1e4),
          "llama-34b": (8192, 48, 64, 8, 22016, 1e6), "llama-70b": (8192, 80, 64, 8, 28672, 1e4)}


def named(flag: str, value: str) -> str:
    """How an error names an argument: `--actor-model DIR`, or `tokenizer=DIR` for a key."""
    return f"{flag}{value}" if flag.endswith("=") else f"{flag} {value}"


def is_preset(spec: str) -> bool:
    return spec in PRESET_NAMES or spec in SHAPES


def model_source(spec: str, flag: str, tokenizer: bool = False, missing: str | None = None
                 ) -> str:
    """Classify a model (or tokenizer) argument as 'preset', 'local' or 'hub'; fail early on
    a bad path. A tokenizer directory holds no config.json, only tokenizer files. `missing`:
    what to do about a path that does not exist (default: the model arguments' choices)."""
    if is_preset(spec):
        return "preset"
    path = Path(spec).expanduser()
    if path.is_dir():
        files = ("tokenizer_config.json", "tokenizer.json") if tokenizer else ("config.json",)
        base = None if tokenizer else adapter_base(spec)
        if base is not None:
            raise UserError(f"{named(flag, spec)}: a LoRA adapter over {base} (ppo.export_weights="
                            "adapter), not a whole model; chat.py --path takes it, or load it "
                            "with peft's PeftModel.from_pretrained over its base")
        if not any((path / name).exists() for name in files):
            what = "tokenizer directory" if tokenizer else "model directory (e.g. output/actor)"
            raise UserError(f"{named(flag, spec)}: directory has no {' or '.join(files)}; pass a "
                            f"Hugging Face {what}"
                            + models_inside(spec, files, "tokenizers" if tokenizer else "models"))
        return "local"
    if path.exists():
        raise UserError(f"{named(flag, spec)}: a file, not a directory; pass the directory that "
                        "holds the " + ("tokenizer" if tokenizer else "model (its config.json)"))
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise UserError(f"{named(flag, spec)}: no such directory; " + (
            missing or "pass a Hugging Face model directory (e.g. output/step3/actor), a hub "
            f"name or a preset ({', '.join([*PRESET_NAMES, *SHAPES])})"))
    return "hub"


def models_inside(spec: str, files: tuple[str, ...] = ("config.json",), what: str = "models"
                  ) -> str:
    """A hint naming the directories right under `spec` that hold one of `files`, for a
    path one level too high (output/step3 for output/step3/actor); '' when there are none."""
    try:   # an unknown ~user, an unreadable directory: no hint
        found = sorted(str(Path(spec) / sub.name) for sub in Path(spec).expanduser().iterdir()
                       if sub.is_dir() and any((sub / name).exists() for name in files))
    except (OSError, RuntimeError):
        return ""
    return f"; the {what} in it: {', '.join(found)}" if found else ""


def adapter_base(spec: str) -> str | None:
    """The base model a LoRA adapter directory names (written by ppo.export_weights=adapter:
    adapter_config.json, no config.json); None for anything else."""
    path = Path(spec).expanduser()
    config = path / "adapter_config.json"
    if not config.exists() or (path / "config.json").exists():
        return None
    try:
        settings = json.loads(config.read_text())
    except (OSError, ValueError) as why:
        raise UserError(f"{config}: cannot read it ({why}); write the adapter again "
                        "(ppo.export_weights=adapter)") from None
    if not isinstance(settings, dict):
        raise UserError(f"{config}: holds a JSON {type(settings).__name__}, not peft's "
                        "settings object; write the adapter again (ppo.export_weights=adapter)")
    base = settings.get("base_model_name_or_path")
    if not base:
        raise UserError(f"{config}: names no base model (base_model_name_or_path); set it to "
                        "the directory or hub name the adapter was trained over")
    return str(base)


def hub_offline() -> bool:
    """True when the hub cannot be reached: offline mode, or no connection within 3 s.
    Checked up front because the hub client retries for most of a minute otherwise."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "", "false", "no"):
        return True
    return not server_reachable(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))


def server_reachable(url: str) -> bool:
    """Whether a connection to `url`'s host opens within 3 s. Behind a proxy a direct probe
    says nothing, so it is taken as reachable: the client's own request decides."""
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return True
    parsed = urlparse(url)
    try:
        socket.create_connection((parsed.hostname, parsed.port or 443), timeout=3).close()
        return True
    except OSError:
        return False


@contextmanager
def hub_libraries_offline() -> Iterator[None]:
    """huggingface_hub and `datasets` in offline mode for the block, as HF_HUB_OFFLINE=1 would
    have set them: both read it once, at import, and retry an unreachable hub for half a
    minute before they fall back to a cache."""
    import datasets

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def _cached(spec: str, name: str) -> bool:
    """`name` of hub repo `spec` is in the local cache (not merely known to be absent)."""
    return isinstance(try_to_load_from_cache(spec, name), str)


def hub_error(spec: str, flag: str, why: str) -> UserError:
    near = difflib.get_close_matches(spec, [*PRESET_NAMES, *SHAPES], n=1, cutoff=0.8)
    fix = f"did you mean the preset {near[0]}? Or download it" if near else "download it"
    return UserError(f"{named(flag, spec)}: not a local directory or preset, and the Hugging "
                     f"Face hub could not provide it ({why}); {fix} and pass the local directory")


def hub_local_only(spec: str, flag: str) -> bool:
    """For a hub name: True when it must be read from the local cache (hub unreachable);
    raises when it is neither reachable nor cached."""
    if not hub_offline():
        return False
    if not any(_cached(spec, name) for name in ("config.json", "tokenizer_config.json")):
        raise hub_error(spec, flag, "unreachable or offline, and not in the local cache")
    return True


# what a model needs, any one of each: offline, in the hub cache; weights, in a directory too
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
HUB_TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def require_cached(spec: str, flag: str, *needs: tuple[str, ...]) -> None:
    """Offline: refuse a hub name whose cached snapshot lacks all of one of `needs`' file
    sets (a download broken off after config.json), before the run reads its data."""
    for names in needs:
        if names and not any(_cached(spec, name) for name in names):
            raise hub_error(spec, flag, "offline, and the local cache holds only part of it: "
                            f"none of {', '.join(names)}")


def check_model_arg(spec: str, flag: str, *, tokenizer: bool = False,
                    own_tokenizer: bool = False) -> None:
    """Fail fast, in one line and before train.py reads or writes anything, on a model (or
    tokenizer) argument that cannot load: a bad path, an unreachable hub name not cached, a
    model directory without weights or without the tokenizer it must bring (`own_tokenizer`)."""
    kind = model_source(spec, flag, tokenizer=tokenizer)
    if kind == "hub":
        if hub_local_only(spec, flag):
            require_cached(spec, flag, () if tokenizer else WEIGHT_FILES,
                           HUB_TOKENIZER if tokenizer or own_tokenizer else ())
    elif kind == "local":
        if not tokenizer:
            require_weight_files(spec, flag)
        if own_tokenizer:
            require_tokenizer_files(spec, flag)


def require_weight_files(directory: str, flag: str) -> None:
    """Refuse a model directory that holds no weights (a config.json alone: a copy or a save
    broken off), before hours of data and earlier steps; other shard names than
    from_pretrained's are let through, for it to judge."""
    path = Path(directory).expanduser()
    if not any((path / name).exists() for name in WEIGHT_FILES) \
            and next(path.glob("*.safetensors"), None) is None:
        raise UserError(f"{named(flag, directory)}: the directory has config.json but no weights "
                        f"(one of {', '.join(WEIGHT_FILES)}); copy the whole model, or save it "
                        "again with save_pretrained")


def require_tokenizer_files(directory: str, flag: str,
                            remedy: str = "save the tokenizer into it or pass tokenizer=DIR"
                            ) -> None:
    """Refuse a local directory that holds none of the files a tokenizer loads from;
    `remedy` is what to do, in the words of the entry point (train.py's by default)."""
    if not any((Path(directory) / name).exists() for name in TOKENIZER_FILES):
        raise UserError(f"{named(flag, directory)}: the directory has no tokenizer files (one of "
                        f"{', '.join(TOKENIZER_FILES)}); {remedy}")
