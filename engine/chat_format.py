"""How a dialogue becomes the text a model reads: its tokenizer's chat template, or for a
tokenizer without one the Anthropic hh-rlhf format,

    [system]\\n\\nHuman: {text}\\n\\nAssistant: {reply}\\n\\nHuman: {text}\\n\\nAssistant:

which `HH_TEMPLATE` writes as a chat template. train.py trains in one of the two
(`data.apply_chat_template`) and saves the format with the model's tokenizer, the hh one as
`HH_TEMPLATE`, so that chat.py, and any tool that applies chat templates, talks to the
model in the format it was trained on."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from jinja2 import TemplateError

HUMAN = "\n\nHuman:"
ASSISTANT = "\n\nAssistant:"

# role -> what opens its turn in the hh format (a system message is the text before the
# first Human turn); a turn's text follows after one space
HH_PREFIX = {"system": "", "user": HUMAN + " ", "assistant": ASSISTANT + " "}

HH_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first -%}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}{{ '\\n\\nHuman: ' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '\\n\\nAssistant: ' + message['content'] }}"
    "{%- else -%}{{ raise_exception('the hh-rlhf format has system (first), user and "
    "assistant messages, not ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '\\n\\nAssistant:' }}{%- endif -%}"
)

# what with_variables puts before a template: its variables, opened and closed by these
# comments (found again, and replaced, when the template is given variables once more).
# The newline after them, which transformers' trim_blocks removes, starts the template on
# a line of its own, as lstrip_blocks reads its first tag
_VARIABLES_OPEN, _VARIABLES_CLOSE = "{# data.chat_template_kwargs #}", "{# end #}\n"
# names a Jinja template cannot set
_CONSTANTS = ("none", "true", "false", "None", "True", "False")
# what `render` passes the template itself: no user's to set
RENDER_NAMES = ("messages", "add_generation_prompt", "continue_final_message")

# a turn opens after "\n\n", or at the start, after any whitespace: DeepSpeed-Chat style
# prompts begin "Human:" or, as its get_prompt() writes them, " Human:"
_TURN = re.compile(r"(?:^\s*|\n\n)(Human|Assistant):")
# DeepSpeed-Chat's get_prompt() for some sets writes every turn after one space:
# " Human: q Assistant: a Human: r Assistant:"; read so when a text opens so and holds no
# "\n\n" turn at all
_SPACED_TURN = re.compile(r"(?:^\s*| )(Human|Assistant):")
_OPENS_SPACED = re.compile(r"\s*Human:")


def _turns(text: str) -> list[str]:
    """`text` split at its turns: [before the first, speaker, said, speaker, said, ...]."""
    if HUMAN not in text and ASSISTANT not in text and _OPENS_SPACED.match(text):
        return _SPACED_TURN.split(text)
    return _TURN.split(text)


def cue_appended(text: str) -> str:
    """hh text that ends in a Human turn with the cue to reply after it, in the text's own
    spacing (single spaces where its turns are so: DeepSpeed-Chat's); text ending in the
    cue as it is."""
    if text.rstrip().endswith("Assistant:"):
        return text
    spaced = HUMAN not in text and " Assistant:" in text and _OPENS_SPACED.match(text)
    return text.rstrip() + (" Assistant:" if spaced else ASSISTANT)


def uses_hh(tokenizer) -> bool:
    """Whether dialogues for `tokenizer` are hh-rlhf text: it has no chat template of its
    own, or the hh one train.py saved with it."""
    return tokenizer.chat_template in (None, HH_TEMPLATE)


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    """`messages` ({"role", "content"} dicts) as text by `tokenizer`'s chat template (the hh
    format when it has none); `generation_prompt`: ending where the assistant's reply
    starts. Raises jinja2's TemplateError for a dialogue the template refuses."""
    template = None if tokenizer.chat_template else HH_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def with_variables(template: str, variables: dict[str, Any]) -> str:
    """`template` with `variables` set before its first line, as if every call of
    apply_chat_template passed them as keyword arguments (Qwen3's enable_thinking=False):
    saved with the model's tokenizer, every tool that renders its template, chat.py among
    them, then writes the dialogues as training read them (a caller's own keyword of that
    name no longer changes it). Variables set before are replaced; none restores the
    template's own defaults."""
    if template.startswith(_VARIABLES_OPEN):
        template = template[template.index(_VARIABLES_CLOSE) + len(_VARIABLES_CLOSE):]
    if not variables:
        return template
    sets = "".join(f"{{% set {name} = {_jinja_literal(value)} %}}"
                   for name, value in variables.items())
    return _VARIABLES_OPEN + sets + _VARIABLES_CLOSE + template


def settable(variables: Any) -> bool:
    """Whether with_variables can set `variables` in a chat template: a mapping of names
    (not Jinja's constants, nor RENDER_NAMES) to JSON-like values, numbers finite."""
    if not hasattr(variables, "items"):
        return False
    try:
        for value in variables.values():
            _jinja_literal(value)
    except ValueError:
        return False
    return all(isinstance(name, str) and name.isidentifier()
               and name not in _CONSTANTS + RENDER_NAMES for name in variables)


def _jinja_literal(value: Any) -> str:
    """A JSON-like value (bool, None, number, string, list, mapping) as a Jinja literal;
    ValueError for a number that is not finite (Jinja has no literal for it)."""
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value} has no Jinja literal; give a finite number")
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, str):   # "#" escaped: no value can hold the closing comment
        return json.dumps(value, ensure_ascii=False).replace("#", "\\u0023")
    if hasattr(value, "items"):
        return "{" + ", ".join(f"{_jinja_literal(str(k))}: {_jinja_literal(v)}"
                               for k, v in value.items()) + "}"
    return "[" + ", ".join(map(_jinja_literal, value)) + "]"


def has_turns(text: str) -> bool:
    """Whether `text` holds hh-rlhf turns ("\\n\\nHuman:", "\\n\\nAssistant:", or "Human:"
    at its start, after any whitespace)."""
    return _TURN.search(text) is not None


def refusal(tokenizer, messages: list[dict]) -> str | None:
    """Why `tokenizer`'s chat template will not write `messages` (its raise_exception text,
    e.g. Gemma's "System role not supported"), or None when it writes them."""
    try:
        render(tokenizer, messages, generation_prompt=True)
    except TemplateError as err:
        return str(err)
    return None


def hh_messages(text: str) -> list[dict]:
    """hh-rlhf text -> chat messages, the inverse of the hh template: the text before the
    first turn is a system message, each "\\n\\nHuman:" / "\\n\\nAssistant:" opens a user /
    assistant message whose text (one space after the colon dropped) runs to the next; a
    final empty Assistant turn, the cue to reply, is not a message. A text that begins
    "Human:" (a prompt field "Human: ...\\n\\nAssistant:") opens with that turn, not with a
    system message of the human's words, and one that begins " Human:" with no "\n\n" turn
    has its turns after single spaces (DeepSpeed-Chat's). Text with no turns is one user
    message (a bare instruction)."""
    parts = _turns(text)
    if len(parts) == 1:
        return [{"role": "user", "content": text.strip()}]
    messages = [{"role": "system", "content": parts[0]}] if parts[0] else []
    for speaker, said in zip(parts[1::2], parts[2::2], strict=True):
        messages.append({"role": "user" if speaker == "Human" else "assistant",
                         "content": said.removeprefix(" ")})
    if messages[-1] == {"role": "assistant", "content": ""}:
        messages.pop()
    return messages


def hh_reply_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of each assistant reply in hh-rlhf `text`, as hh_messages reads them:
    from after its "Assistant:" (the space after it included, as an answer follows the
    cue) to the next turn; the final cue to reply (nothing said) is none."""
    spaced = HUMAN not in text and ASSISTANT not in text and _OPENS_SPACED.match(text)
    turns = list((_SPACED_TURN if spaced else _TURN).finditer(text))
    spans = []
    for turn, after in zip(turns, [*turns[1:], None], strict=True):
        end = after.start() if after is not None else len(text)
        if turn.group(1) == "Assistant" and text[turn.end():end].strip():
            spans.append((turn.end(), end))
    return spans


def written_reply(tokenizer, messages: list[dict], prompt: str, content: str) -> str:
    """What `tokenizer`'s chat template writes after `prompt` (`messages` rendered with the
    generation prompt) for an assistant reply of `content`, trailing whitespace dropped: the
    reply ending with the turn's end token (<|im_end|>). A TemplateError where the template
    writes the turns before the reply otherwise than in the prompt: it may do so for some
    dialogues only (Mistral's recent templates put a system message into the last user
    turn, which a reply moves)."""
    reply = {"role": "assistant", "content": content}
    whole = render(tokenizer, [*messages, reply], generation_prompt=False)
    if not whole.startswith(prompt):
        raise TemplateError("it does not write the dialogue as its prompt followed by the "
                            "reply (it renders the turns before the reply otherwise)")
    return whole[len(prompt):].rstrip()


def turn_ends_with_eos(tokenizer) -> bool:
    """Whether `tokenizer`'s chat template ends an assistant turn with its EOS token as text
    (ChatML's <|im_end|> where that is the EOS): the EOS is then part of what a reply says,
    not a token added after it. Never in the hh format."""
    if uses_hh(tokenizer) or not tokenizer.eos_token:
        return False
    asked = [{"role": "user", "content": "Hi"}]
    try:
        reply = written_reply(tokenizer, asked, render(tokenizer, asked, True), "Hello")
    except TemplateError:
        return False
    return reply.endswith(tokenizer.eos_token)


def template_writes_bos(tokenizer) -> bool:
    """Whether `tokenizer`'s chat template writes its BOS token as text at the start of a
    dialogue (Llama-3's <|begin_of_text|>, Mistral's and Gemma's bos_token): the BOS is
    then part of the text step 2 trained the reward model on, not a token the tokenizer
    adds. Never in the hh format."""
    if uses_hh(tokenizer) or not tokenizer.bos_token:
        return False
    return render(tokenizer, [{"role": "user", "content": "Hi"}],
                  generation_prompt=True).startswith(tokenizer.bos_token)
