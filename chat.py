"""Chat with a trained model: python chat.py --path output/step3/actor

Works on any Hugging Face causal-LM directory (config.json, weights, tokenizer files), or a hub
name, loaded as train.py loads models (engine/models.py), and generates through the model's
inference form (engine/inference_form.py: fused inference modules, CUDA graphs on a GPU; Hugging
Face generate for architectures without them). The conversation is written in the format the
model was trained in, which train.py saves as its tokenizer's chat template
(engine/chat_format.py): the model's own template (data.apply_chat_template) or the Anthropic
hh-rlhf format, also used for a tokenizer without a template,

    \\n\\nHuman: {text}\\n\\nAssistant: {reply}\\n\\nHuman: {text}\\n\\nAssistant:

in which a reply ends where the model starts the next human turn.

Type `clear` to start a new conversation, `quit`/`exit` or EOF (Ctrl-D) to leave. With stdin
piped, one user turn is read per line and each reply is printed as "Assistant: <reply>".
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TYPE_CHECKING

# torch, transformers and the engine are imported once the arguments and the model path are
# checked: a mistyped flag or path fails at once, not after seconds of imports
from engine.chat_format import HUMAN
from engine.errors import OneLineParser, UserError
from engine.model_source import adapter_base, model_source, require_tokenizer_files

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")


# -----------------------------------------------------------------------------
# conversation helpers (pure string / token-list functions)


def cut_reply(text: str, stop: str | None) -> str:
    """The reply ends where the model starts writing `stop` (the hh format's next human
    turn; None: a chat template's turn ends with a token generation stops on)."""
    return text.split(stop, 1)[0] if stop else text


def display_reply(reply: str) -> str:
    # replies are trained as " text" after "Assistant:"; the space is format, not content
    return reply.strip()


def without_oldest_exchange(messages: list[dict]) -> list[dict]:
    """`messages` less their first exchange (a user message and the replies to it); a
    system message that opens them stays."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(head):]
    starts = [i for i, m in enumerate(rest) if m["role"] == "user" and i > 0]
    return head + rest[starts[0]:] if starts else messages


def fit_history(messages: list[dict], encode, budget: int, prefix: list[int]
                ) -> tuple[list[dict], list[int]]:
    """Make the conversation's prompt fit in `budget` tokens: drop the oldest exchanges
    first, and if the newest one alone is still too long, keep its last tokens after
    `prefix` (e.g. [BOS]: the model expects it at position 0). `encode` maps messages to
    prompt ids. Returns the (possibly shortened) messages and their prompt ids."""
    ids = encode(messages)
    while len(ids) > budget and (shorter := without_oldest_exchange(messages)) != messages:
        messages, ids = shorter, encode(shorter)
    if len(ids) > budget:
        if ids[: len(prefix)] != prefix or len(prefix) >= budget:
            prefix = []
        ids = prefix + ids[len(prefix) :][-(budget - len(prefix)) :]
    return messages, ids


def stream_safe(text: str, stop: str | None) -> str:
    """The part of a partial reply that is safe to print now: hold back an incomplete UTF-8
    character (decoded as U+FFFD), anything that may still become the `stop` string, and
    trailing whitespace (display_reply strips it at the end)."""
    text = cut_reply(text, stop).rstrip("\ufffd")
    for k in range(len(stop or "") - 1, 0, -1):
        if text.endswith(stop[:k]):
            text = text[:-k]
            break
    return display_reply(text)


# -----------------------------------------------------------------------------
# generation


def decode_new(tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The reply's text as it reads after the prompt (engine.models.decode_answer)."""
    from engine.models import decode_answer

    return decode_answer(tokenizer, prompt_ids, new_ids)


class ReplyStreamer:
    """Per-token callback of generation: prints the reply as it grows, exactly as it will finally
    read, and ends generation (returns True) once the model writes `stop` (the hh format's
    next human turn)."""

    def __init__(self, tokenizer, prompt_ids: list[int], out=None, stop: str | None = HUMAN):
        self.tokenizer, self.prompt_ids, self.stop = tokenizer, prompt_ids, stop
        self.out = out or sys.stdout  # looked up now, so redirected stdout is honoured
        self.new_ids: list[int] = []
        self.shown = ""

    def __call__(self, tokens: torch.Tensor) -> bool:
        self.new_ids.extend(tokens.tolist())  # [1]: the one row's token
        text = decode_new(self.tokenizer, self.prompt_ids, self.new_ids)
        self._show(stream_safe(text, self.stop))
        return bool(self.stop) and self.stop in text

    def end(self):
        self._show(display_reply(cut_reply(decode_new(self.tokenizer, self.prompt_ids,
                                                      self.new_ids), self.stop)))

    def _show(self, text: str):
        # only ever append; if decoding rewrote earlier text, wait for the final version
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def reply(model, tokenizer, prompt_ids: list[int], args, out=None, stop: str | None = HUMAN
          ) -> str:
    """Generate (and stream to `out`) the assistant's reply with `model`, an inference form
    (engine.inference_form), until EOS or `stop`; returns its raw text."""
    import torch

    from engine.generation import SamplingSettings

    input_ids = torch.tensor([prompt_ids], device=model.device)
    if args.greedy:  # no sampling knobs: unused, they would still be validated (--temperature 0)
        sampling = SamplingSettings(max_new_tokens=args.max_new_tokens, do_sample=False)
    else:
        sampling = SamplingSettings(args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, top_k=args.top_k)
    streamer = ReplyStreamer(tokenizer, prompt_ids, out, stop)
    # the tokenizer's EOS, which training taught it to end with, and the checkpoint's own
    eos = sorted({tokenizer.eos_token_id, *_ids(model.generation_config.eos_token_id)})
    out_ids = model.generate(input_ids, torch.ones_like(input_ids), sampling, eos_token_id=eos,
                             pad_token_id=tokenizer.pad_token_id, on_token=streamer)
    streamer.end()
    return cut_reply(decode_new(tokenizer, prompt_ids, out_ids[0, len(prompt_ids) :].tolist()),
                     stop)


# -----------------------------------------------------------------------------
# loading


def pick_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device available; use --device cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32  # half precision on CPU is slow and, for some ops, unsupported


# -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = OneLineParser(
        prog="chat.py",
        description="Chat with a trained causal LM, in the format it was trained in.")
    p.add_argument("--path", required=True, help="model directory, e.g. output/step3/actor")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="the longest reply, in tokens (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="sampling temperature, > 0 (default %(default)s)")
    p.add_argument("--top-p", type=float, default=0.9,
                   help="nucleus sampling: the smallest set of tokens with this much "
                        "probability, in (0, 1] (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k likeliest tokens; 0 = off (default)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    p.add_argument("--seed", type=int, default=None,
                   help="seed the sampling, so that the same turns get the same replies")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when available (default)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="auto: bfloat16 on a GPU that has it, else float16; float32 on CPU "
                        "(default)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message that opens the conversation (kept when older "
                        "turns are dropped to fit the context)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow custom model code from the model directory")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if not args.greedy and args.temperature <= 0:
        raise UserError("--temperature must be > 0; use --greedy for deterministic replies")
    if not 0 < args.top_p <= 1:
        raise UserError("--top-p must be in (0, 1]")
    if args.top_k < 0:
        raise UserError("--top-k must be >= 0 (0 = off)")
    if args.seed is not None and not 0 <= args.seed < 2**32:   # numpy's seeds, in set_seed
        raise UserError(f"--seed {args.seed}: give a whole number from 0 to 2**32 - 1")
    return args


def check_path(path: str, base: str | None) -> None:
    """Refuse, before the heavy imports, a --path that cannot be chatted with: a bad path, a
    preset (random weights: nothing trained to talk to), a directory without a tokenizer
    (chat.py has no option to bring one). `base`: the model under an adapter `path`."""
    flag = (f"--path {path}: its adapter_config.json's base_model_name_or_path" if base
            else "--path")   # the base a copied output dir names may be elsewhere now
    kind = model_source(base or path, flag, missing=(
        "edit it to where the base model is now" if base
        else "pass a trained model directory (e.g. output/step3/actor) or a hub name"))
    if kind == "preset" and base is None:
        raise UserError(f"--path {path}: a built-in preset, random weights with nothing "
                        "trained; pass a trained model directory (e.g. output/step3/actor)")
    if kind == "local" or base is not None:   # the tokenizer is the directory's own
        require_tokenizer_files(path, "--path", "copy the tokenizer files of the model it was "
                                "trained from into it (train.py saves them with each model)")


def load(args: argparse.Namespace, progress: bool = True):
    """(tokenizer, model in its inference form, device, dtype, prompt budget in tokens)
    for the parsed arguments; a UserError for anything that cannot load. `progress`: show
    transformers' loading bars."""
    base = adapter_base(args.path)     # a LoRA adapter (ppo.export_weights=adapter)
    check_path(args.path, base)        # a bad path fails before the imports below
    from transformers.utils import logging as hf_logging

    from engine.inference_form import inference_form
    from engine.models import load_adapter, load_causal_lm, load_tokenizer

    if not progress:
        hf_logging.disable_progress_bar()

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    # loaded as train.py loads them, so bad paths and an unreachable hub fail in one line
    remote = args.trust_remote_code  # runs Python shipped with the model: only when asked
    tokenizer = load_tokenizer(args.path, flag="--path", trust_remote_code=remote,
                               tokenizer=args.path if base else None)   # the adapter's own
    if args.system:   # before the weights load: a template without a system role says so
        check_system(tokenizer, args.system)
    if base is not None:
        model = load_adapter(args.path, base, tokenizer, flag="--path", dtype=dtype,
                             trust_remote_code=remote)
    else:
        model = load_causal_lm(args.path, tokenizer, flag="--path", dtype=dtype,
                               trust_remote_code=remote, trained_head=True)
    # leave room for the reply inside the model's context window
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    budget = max_pos - args.max_new_tokens if max_pos else None
    if budget is not None and budget < 2:
        raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room for the "
                        f"conversation in the model's context of {max_pos} tokens")
    # the fused form copies the weights onto the device: the loaded model is then dropped
    return tokenizer, inference_form(model, device, dtype), device, dtype, budget


def check_system(tokenizer, text: str) -> None:
    """Refuse a --system message the model's chat template cannot write (Gemma's has no
    system role) in one line, not a traceback at the first turn."""
    from engine.chat_format import refusal

    why = refusal(tokenizer, [{"role": "system", "content": text},
                              {"role": "user", "content": "Hi"}])
    if why is not None:
        raise UserError(f"--system: the model's chat template refuses a system message "
                        f"({why}); leave --system out")


def main(argv=None) -> int:
    interactive = sys.stdin.isatty()
    try:
        args = parse_args(argv)
        # no loading bars when piped: stderr is kept for real problems
        tokenizer, model, device, dtype, budget = load(args, progress=interactive)
    except UserError as e:
        print(f"chat.py: {e}", file=sys.stderr)
        return 2
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)
    if interactive:
        with contextlib.suppress(ImportError):  # line editing for input(), where available
            import readline  # noqa: F401
        print(f"chat.py: {args.path} on {device} ({dtype}); type 'clear' to reset, 'quit' to exit",
              file=sys.stderr)
    converse(model, tokenizer, args, budget, interactive)
    return 0


def converse(model, tokenizer, args: argparse.Namespace, budget: int | None,
             interactive: bool) -> None:
    """Read user turns until EOF or quit, and stream each reply."""
    from engine.chat_format import render, uses_hh
    from engine.models import prompt_ids as tokenized_prompts

    def encode(messages: list[dict]) -> list[int]:   # special tokens as in training (BOS)
        return tokenized_prompts([render(tokenizer, messages, True)], tokenizer)[0][0]

    stop = HUMAN if uses_hh(tokenizer) else None
    head = tokenized_prompts([""], tokenizer)[0][0]   # e.g. [BOS]
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    while True:
        try:
            line = input("Human: " if interactive else "")
        except EOFError:
            if interactive:   # the shell's prompt on a line of its own
                print()
            break
        except KeyboardInterrupt:
            print()
            break
        text = line.strip()
        if not text:
            continue
        if text in ("quit", "exit"):
            break
        if text == "clear":
            messages = list(opening)
            print("(history cleared)", file=sys.stderr)
            continue
        messages = [*messages, {"role": "user", "content": text}]
        if budget is None:
            prompt_ids = encode(messages)
        else:
            messages, prompt_ids = fit_history(messages, encode, budget, head)
        print("Assistant: ", end="", flush=True)
        try:
            answer = reply(model, tokenizer, prompt_ids, args, stop=stop)
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the chat
            print()
            messages = messages[:-1]
            continue
        messages.append({"role": "assistant", "content": display_reply(answer)})
        print("\n" if interactive else "", flush=True)


if __name__ == "__main__":
    sys.exit(main())
