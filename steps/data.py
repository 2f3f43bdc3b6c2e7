"""Preference data in: reading, blending and splitting.

Reading: `load_pairs` turns one source (a local .json/.jsonl/.jsonl.gz/.json.gz/.parquet file,
a directory of such files, a directory written by `datasets`' save_to_disk, or a Hugging Face
hub dataset name) into `PreferencePair`s.
Three record shapes are accepted, detected by the columns of the record set and their types:

* DeepSpeed-Chat style: `prompt`, `chosen`, `rejected` (extra columns such as `response`
  are ignored); `chosen`/`rejected` are the answers that continue `prompt`. A bare-text
  prompt (no hh-rlhf turns) is one user turn, "\\n\\nHuman: {prompt}\\n\\nAssistant:".
* Anthropic hh-rlhf: only `chosen` and `rejected`, each a whole "\\n\\nHuman: ...\\n\\nAssistant: ..."
  transcript; the prompt is the text of `chosen` through its last "\\n\\nAssistant:".
* Chat messages (OpenRLHF, TRL): `chosen` and `rejected` are lists of {"role", "content"}
  messages (roles system, user, assistant), either whole dialogues (a text `prompt` beside
  them is not read) or, with a `prompt` list of messages, its continuations (TRL's explicit
  prompt). They are rendered as hh-rlhf text
  (a system message is the text before the first "\\n\\nHuman: ", a user's turn is
  "\\n\\nHuman: " + content, an assistant's "\\n\\nAssistant: " + content), and the prompt is
  the dialogue before its final assistant message, through "\\n\\nAssistant:", so that the
  answer is " " + content as in hh-rlhf and chat.py's prompts.

Records whose answer is empty, whose rejected dialogue does not share the chosen one's prompt,
or that do not end in an Assistant turn are skipped and counted; any other malformed record
(a field of the wrong type, a message without a known role or text content) stops with a
DataError naming it.

Splitting: `load_blend` splits every source between the three steps (SFT, reward model, PPO)
and `train_eval_split` holds out an eval set. Both are deterministic in `seed` only.

Tokenizing and batching are in steps/tokenize.py.
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import logging
import math
import re
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from engine.chat_format import ASSISTANT, HH_PREFIX, cue_appended, has_turns, hh_messages

log = logging.getLogger(__name__)

DEMO_SOURCE = "demo"

# suffix -> `datasets` builder name
_DATA_SUFFIXES = {".json": "json", ".jsonl": "json", ".json.gz": "json", ".jsonl.gz": "json",
                  ".parquet": "parquet"}
_FORMAT_HINT = ("preference data needs prompt/chosen/rejected, hh-rlhf chosen/rejected transcripts "
                "or chosen/rejected chat messages")


# why a record is skipped -> what the log says ({chosen}, {rejected}, {prompt}: the Fields)
_SKIPPED = {"empty": "with an empty answer",
            "no_marker": "with no \"\\n\\nAssistant:\" in '{chosen}' (no '{prompt}' field, so read "
                         "as hh-rlhf transcripts)",
            "no_answer": "whose dialogue does not end in an assistant message",
            "differs": "whose '{rejected}' does not share the prompt of '{chosen}'"}
_NO_MARKER_FIX = ("give the records a '{prompt}' field that '{chosen}' and '{rejected}' answer "
                  "(or set data.prompt_key to the field that holds their prompts), or write them "
                  "as \"\\n\\nHuman: ...\\n\\nAssistant: ...\" transcripts")


class PreferencePair(NamedTuple):
    """One comparison: `prompt + chosen` is the preferred dialogue, `prompt + rejected` the other."""

    prompt: str  # dialogue through the final "\n\nAssistant:" (or the record's prompt field)
    chosen: str  # preferred answer text (continuation of prompt)
    rejected: str  # dispreferred answer text
    # the prompt's chat messages, for records that were chat messages (None: read them back
    # from `prompt`); data.apply_chat_template renders them, exactly as written
    messages: tuple[dict, ...] | None = None
    # a step-3 prompt's label (ppo.label_key: e.g. the reference answer a reward function
    # checks against); step-3 prompt records have no answers
    label: Any = None
    # how far chosen is preferred (data.margin_key: Llama 2's margin), which the reward
    # model's score difference must pass; None: 0
    margin: float | None = None


class Fields(NamedTuple):
    """The names of a preference record's fields (data.prompt_key, chosen_key, rejected_key):
    stack-exchange-paired's question/response_j/response_k, say."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    margin: str | None = None   # data.margin_key: None reads no margin


FIELDS = Fields()


class DataError(ValueError):
    """A user-facing, one-line problem with the training data (names the source and the fix)."""


# ---------------------------------------------------------------------------------------------
# Reading


def load_pairs(source: str, fields: Fields = FIELDS, key: str = "data.path",
               split: str = "train") -> tuple[list[PreferencePair], int]:
    """Read one source of config key `key` (of a source holding splits, `split`); returns
    (pairs, n_skipped). A hub name is tried
    only when no such local path exists and the name has neither a data-file extension nor
    a path's start (./ ../ / ~). Records with an empty answer, no Assistant turn, or a
    `rejected` that does not share the prompt of `chosen` are skipped and counted; anything
    else wrong raises DataError. `fields` names the records' fields."""
    label, tables = _read_source(source, key, split)
    results = [_pairs_from_columns(columns, where, fields) for where, columns in tables]
    pairs = [pair for table_pairs, _ in results for pair in table_pairs]
    skipped = sum((table_skipped for _, table_skipped in results), Counter())
    if not pairs and not skipped:
        raise DataError(f"{label}: no records; check {key}")
    if not pairs:
        why = ", ".join(f"{n} {_SKIPPED[reason].format(**fields._asdict())}"
                        for reason, n in skipped.most_common())
        fix = (_NO_MARKER_FIX.format(**fields._asdict())
               if skipped["no_marker"] == skipped.total() else "check the data")
        raise DataError(f"{label}: no usable preference pairs (all {skipped.total()} records "
                        f"skipped: {why}); {fix}")
    return pairs, skipped.total()


def _read_source(source: str, key: str, split: str = "train"
                 ) -> tuple[str, list[tuple[str, dict[str, list]]]]:
    """(what to call `source` in errors, its tables: (what to call each, its columns)) of
    one source of config key `key`: a saved dataset, a directory of files (a table each), a
    file or a hub dataset; of those that hold splits, `split`."""
    path = Path(source).expanduser()
    if source == DEMO_SOURCE and not path.exists():
        raise DataError(f"{key}: 'demo' is the built-in demo task, not a file; it is a "
                        "data.path source only")
    if path.is_dir() and _saved_dataset(path):
        label = f"saved dataset {source}"
        return label, [(label, _read_saved(path, source, key, split))]
    if path.is_dir():
        return (f"data directory {source}",
                [(f"data file {f}", _read_file(f))
                 for f in _directory_files(path, source, key, split)])
    if path.exists():
        if not _data_suffix(path):
            raise DataError(f"unsupported data file type: {source}; use .json, .jsonl, .jsonl.gz, "
                            ".json.gz or .parquet")
        return f"data file {source}", [(f"data file {source}", _read_file(path))]
    if _data_suffix(path):
        raise DataError(f"data file not found: {source}; check {key}")
    if source.startswith(("./", "../", "/", "~")):   # a path, never a hub name
        raise DataError(f"no such file or directory: {source}; check {key}")
    return f"dataset '{source}'", [(f"dataset '{source}'", _read_hub(source, key, split))]


def _records(source: str, key: str, parse: Callable[[dict, str], tuple[list, int]],
             what: str, why: str, split: str = "train") -> tuple[list, int]:
    """(the records `parse(columns, what to call the table)` makes of each table of one
    source of config key `key`, how many it skipped); a source with no usable record is
    refused, naming `what` its records are and `why` they were skipped."""
    label, tables = _read_source(source, key, split)
    results = [parse(columns, where) for where, columns in tables]
    records = [record for found, _ in results for record in found]
    skipped = sum(count for _, count in results)
    if not records and not skipped:
        raise DataError(f"{label}: no records; check {key}")
    if not records:
        raise DataError(f"{label}: no usable {what} ({skipped} records, all {why}); "
                        f"check {key}")
    return records, skipped


def load_prompt_records(source: str, prompt_key: str = "prompt", label_key: str = "label",
                        key: str = "ppo.prompt_data", split: str = "train"
                        ) -> tuple[list[PreferencePair], int]:
    """Step 3's prompts read from one source of `key` (as load_pairs reads
    sources, of those holding splits `split`): each record's `prompt_key` field, hh-rlhf text used as it is, a bare text
    (one user turn) or chat messages (rendered as hh-rlhf text ending in the assistant's
    cue, the messages kept), and its `label_key` field, when the records have one, as the
    label a reward function checks answers against (a reference answer). Returns (prompts
    as pairs without answers, the records skipped: empty prompts, and dialogues that end in
    an assistant message)."""
    return _records(source, key, lambda columns, where: _prompts_from_columns(
        columns, where, prompt_key, label_key), "prompts", "empty or ending in an assistant "
        "message", split)


def _prompts_from_columns(columns: dict[str, list[Any]], where: str, prompt_key: str,
                          label_key: str | None, keep_empty: bool = False,
                          setting: str = "ppo.prompt_key"
                          ) -> tuple[list[PreferencePair | None], int]:
    """The prompt records of one table (see load_prompt_records) and how many were skipped;
    `keep_empty`: None in place of each skipped record, the records' order kept; `setting`:
    the config key that names `prompt_key`."""
    if not columns or not next(iter(columns.values())):
        return [], 0
    if prompt_key not in columns:
        raise DataError(f"{where}: records have no '{prompt_key}' field (columns: "
                        f"{', '.join(columns)}); set {setting} to the field holding the "
                        "prompts")
    labels = columns.get(label_key, [None] * len(columns[prompt_key])) if label_key \
        else [None] * len(columns[prompt_key])
    if _messages_in(columns, prompt_key):
        dialogues = _message_column(columns, prompt_key, where, opens=True)
        prompts = [(_render(d) + ASSISTANT, tuple(d))
                   if d and d[-1]["role"] != "assistant" else None for d in dialogues]
    else:
        prompts = [_text_prompt(text) if text.strip() else None
                   for text in _text_column(columns, prompt_key, where)]
    kept = [None if found is None else PreferencePair(found[0], "", "", found[1], label)
            for found, label in zip(prompts, labels, strict=True)]
    skipped = sum(prompt is None for prompt in kept)
    return (kept if keep_empty else [prompt for prompt in kept if prompt is not None]), skipped


def load_sft_records(source: str, prompt_key: str = "prompt", answer_key: str = "response",
                     input_key: str | None = None) -> tuple[list[PreferencePair], int]:
    """Step 1's examples read from one source of data.sft_path (as load_pairs reads sources):
    each record's `prompt_key` field (as a step-3 prompt: hh-rlhf text as written, a bare
    text as one user turn, or chat messages) answered by its `answer_key` field (Alpaca's
    output, Dahoas/rm-static's response); or, without that field, whole dialogues in
    `prompt_key` (UltraChat's messages) answered by their final assistant message; a text
    prompt has its `input_key` field (Alpaca's input), where there is one, after a blank
    line. Returns (examples as pairs with the answer as `chosen` and no `rejected`, the
    records skipped: empty prompts or answers, dialogues that do not end in an assistant
    message)."""
    return _records(source, "data.sft_path", lambda columns, where: _sft_from_columns(
        columns, where, prompt_key, answer_key, input_key), "examples", "with an empty "
        "prompt or answer, or a prompt ending in an assistant message")


def _sft_from_columns(columns: dict[str, list[Any]], where: str, prompt_key: str,
                      answer_key: str, input_key: str | None = None
                      ) -> tuple[list[PreferencePair], int]:
    """The SFT records of one table (see load_sft_records) and how many were skipped."""
    if not columns or not next(iter(columns.values())):
        return [], 0
    if input_key in columns and input_key not in (prompt_key, answer_key) \
            and prompt_key in columns:
        columns = {**columns, prompt_key: _with_inputs(columns, where, prompt_key, input_key)}
    if answer_key in columns and _messages_in(columns, answer_key):   # TRL's completion
        raise DataError(f"{where}: field '{answer_key}' holds chat messages, not text answers; "
                        "set data.sft_answer_key to a field of text answers, or give whole "
                        "dialogues (prompt and answer messages) in data.sft_prompt_key")
    if answer_key in columns:
        prompts, _ = _prompts_from_columns(columns, where, prompt_key, None, keep_empty=True,
                                           setting="data.sft_prompt_key")
        answers = _text_column(columns, answer_key, where)
        examples = [PreferencePair(p.prompt, _following_cue(answer), "", p.messages)
                    for p, answer in zip(prompts, answers, strict=True)
                    if p is not None and answer.strip()]
        return examples, len(answers) - len(examples)
    if prompt_key in columns and _messages_in(columns, prompt_key):
        dialogues = _message_column(columns, prompt_key, where, opens=True)
        records = [_split_dialogues(d, d) for d in dialogues]
        examples = [PreferencePair(record[0], record[1], "", record[3]) for record in records
                    if not isinstance(record, str) and record[1].strip()]
        return examples, len(records) - len(examples)
    raise DataError(f"{where}: records have no '{answer_key}' field (columns: "
                    f"{', '.join(columns)}); set data.sft_answer_key to the field holding the "
                    "answers, or give whole chat dialogues in data.sft_prompt_key")


def load_feedback_records(source: str, prompt_key: str = "prompt",
                          completion_key: str = "completion", label_key: str = "label"
                          ) -> tuple[list[PreferencePair], int]:
    """KTO's unpaired feedback read from one source of data.feedback_path (as load_pairs
    reads sources; TRL's unpaired preference format): each record's `prompt_key` field (as
    a step-3 prompt: hh-rlhf text, a bare text as one user turn, or chat messages), its
    `completion_key` field (a text answer, or one assistant message) and its `label_key`
    field, whether that answer is desirable (true/false, or 1/0: a thumbs up or down).
    Returns (records as pairs with the answer as `chosen`, no `rejected` and the label a
    bool, the records skipped: empty prompts or answers, null labels, prompts ending in an
    assistant message)."""
    return _records(source, "data.feedback_path", lambda columns, where: _feedback_from_columns(
        columns, where, prompt_key, completion_key, label_key), "feedback records",
        "with an empty prompt or answer, a null label, or a prompt ending in an assistant "
        "message")


def _feedback_from_columns(columns: dict[str, list[Any]], where: str, prompt_key: str,
                           completion_key: str, label_key: str
                           ) -> tuple[list[PreferencePair], int]:
    """The feedback records of one table (see load_feedback_records) and how many were
    skipped."""
    if not columns or not next(iter(columns.values())):
        return [], 0
    for field, key in ((completion_key, "completion_key"), (label_key, "label_key")):
        if field not in columns:
            raise DataError(f"{where}: records have no '{field}' field (columns: "
                            f"{', '.join(columns)}); feedback records need prompt, completion "
                            f"and label fields, or set data.feedback_{key} to the field that "
                            "holds them")
    prompts, _ = _prompts_from_columns(columns, where, prompt_key, None, keep_empty=True,
                                       setting="data.feedback_prompt_key")
    if _messages_in(columns, completion_key):   # TRL's conversational form
        answers = [_one_reply(messages, where, i, completion_key) for i, messages in
                   enumerate(_message_column(columns, completion_key, where, opens=False))]
    else:
        answers = _text_column(columns, completion_key, where)
    labels = [_feedback_label(value, where, i, label_key)
              for i, value in enumerate(columns[label_key])]
    records = [PreferencePair(p.prompt, _following_cue(answer), "", p.messages, label=label)
               for p, answer, label in zip(prompts, answers, labels, strict=True)
               if p is not None and answer.strip() and label is not None]
    return records, len(answers) - len(records)


def _one_reply(messages: list[dict], where: str, i: int, field: str) -> str:
    """The text of a completion given as chat messages: exactly one assistant message."""
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise DataError(f"{where} record {i + 1}: field '{field}' holds "
                        f"{len(messages)} message(s) with roles "
                        f"{[m['role'] for m in messages]}, where a completion is one assistant "
                        "message; fix or remove that record")
    return messages[0]["content"]


def _feedback_label(value: Any, where: str, i: int, field: str) -> bool | None:
    """A feedback record's label as a bool (true/1: desirable); None (the record skipped)
    for a null one; anything else is refused, naming the record: "bad" or 0.7 is not for
    us to read as a side."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    raise DataError(f"{where} record {i + 1}: field '{field}' is {_shown(value)}, where a "
                    "feedback label is true/false (or 1/0): whether the answer is desirable; "
                    "fix or remove that record")


def _with_inputs(columns: dict[str, list[Any]], where: str, prompt_key: str, input_key: str
                 ) -> list[Any]:
    """columns[prompt_key] with each record's `input_key` text (Alpaca's input: what the
    instruction is to work on) after its text prompt and a blank line; an empty or null
    input adds nothing. An input beside chat messages or hh turns is refused, naming the
    record: which turn it belongs to is not for us to guess."""
    prompts = list(columns[prompt_key])
    for i, (prompt, given) in enumerate(zip(prompts, columns[input_key], strict=True)):
        if given is None or (isinstance(given, str) and not given.strip()):
            continue
        fix = f"or set data.sft_input_key=null not to read '{input_key}'"
        if not isinstance(given, str):
            raise DataError(f"{where} record {i + 1}: field '{input_key}' is not text (got "
                            f"{type(given).__name__}); fix that record, {fix}")
        if isinstance(prompt, list) or (isinstance(prompt, str) and has_turns(prompt)):
            raise DataError(f"{where} record {i + 1}: field '{input_key}' beside a prompt of "
                            "chat messages or hh turns; join it into the prompt's turn, " + fix)
        if isinstance(prompt, str):
            prompts[i] = "\n\n".join(part for part in (prompt.rstrip(), given.strip()) if part)
    return prompts


def _following_cue(answer: str) -> str:
    """An answer as it follows "Assistant:": after one space, as hh-rlhf's and rendered chat
    messages' answers do (and a chat template's rendering drops); only a space is that
    space: an answer that opens with a newline (code) is one as a message too."""
    return answer if answer.startswith(" ") else " " + answer


def _text_prompt(text: str) -> tuple[str, tuple[dict, ...] | None] | None:
    """(prompt, its messages) of a prompt record's text: hh-rlhf turns as written, the cue
    to reply added where they end in a Human turn; None (skipped, as such a dialogue in
    messages is) where they end in an assistant's reply: an hh-rlhf `chosen` given as a
    prompt would hold its answer. A bare question (GSM8K's) is one user turn, as a chat
    template reads it too, so that a model trained on hh text is asked in hh text."""
    if has_turns(text):
        dialogue = hh_messages(text)
        if dialogue and dialogue[-1]["role"] == "assistant":
            return None
        return cue_appended(text), None
    asked = hh_messages(text)   # without turns: the one user turn
    return _render(asked) + ASSISTANT, tuple(asked)


def _saved_dataset(path: Path) -> bool:
    """Whether directory `path` was written by `datasets`' save_to_disk (a Dataset's
    state.json + dataset_info.json, or a DatasetDict's dataset_dict.json)."""
    return ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()
            or (path / "dataset_dict.json").is_file())


def _read_saved(path: Path, source: str, key: str, split: str = "train"
                ) -> dict[str, list[Any]]:
    """Columns of a save_to_disk directory; of a DatasetDict, its `split` (`key`: the
    config key that named it, for the fixes errors suggest)."""
    import datasets

    try:
        with _quiet_datasets():
            saved = datasets.load_from_disk(str(path), keep_in_memory=True)
    except Exception as exc:
        raise DataError(f"cannot read saved dataset {source}: {_short(exc)}; save it again "
                        f"with save_to_disk or pass its data files in {key}") from exc
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise DataError(f"saved dataset {source} has no {split} split (splits: "
                            f"{', '.join(saved)}); pass the split's directory in {key}")
        if len(saved) > 1:
            log.warning("saved dataset %s: read its %s split, left out %s", source, split,
                        ", ".join(f"{name} ({len(part)} records)"
                                  for name, part in saved.items() if name != split))
        saved = saved[split]
    return saved.to_dict()


def _directory_files(path: Path, source: str, key: str, split: str = "train") -> list[Path]:
    """The data files directly in directory `path`, saying what else is there: other files
    and subdirectories (not searched: a hub snapshot's train and test splits would both
    land in the blend) are left out, counted, never read unsaid. Files named for hub
    splits (train-00000-of-00001.parquet, test.jsonl) are read as `datasets` reads them:
    the `split` only. `key` is the config key that named it, for the fixes suggested."""
    entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
    files = [p for p in entries if p.is_file() and _data_suffix(p)]
    left_out = [p.name + ("/" if p.is_dir() else "") for p in entries if p not in files]
    if not files:
        raise DataError(f"data directory {source} has no .json, .jsonl, .jsonl.gz, .json.gz or "
                        f".parquet files{_found(entries)}; put the data there as one of those or "
                        f"name the files in {key}")
    split_named = [p for p in files if _split_of(p) is not None]
    if split_named:
        chosen = [p for p in split_named if _split_of(p) == split]
        others = [p.name for p in files if p not in chosen]
        use = "train on" if split == "train" else "evaluate on"
        if not chosen:
            raise DataError(f"data directory {source} holds hub split files but no {split} "
                            f"split ({_listed(others)}); name the file to {use} in {key}")
        if others:
            log.warning("data directory %s: read its %s split (%d files), left out %d other "
                        "data files (%s); name them in %s to %s them",
                        source, split, len(chosen), len(others), _listed(others), key, use)
        files = chosen
    if left_out:
        log.warning("data directory %s: read %d data files, left out %d other entries (%s): "
                    "subdirectories and other file types are not read; name them in %s",
                    source, len(files), len(left_out), _listed(left_out), key)
    return files


def _found(entries: list[Path]) -> str:
    """What a directory without data files holds, for its error: ' (found only .csv files;
    subdirectories are not searched: data/)', or '' when it is empty."""
    kinds = sorted({p.suffix.lower() or p.name for p in entries if p.is_file()})
    subdirs = [p.name + "/" for p in entries if p.is_dir()]
    parts = ([f"found only {', '.join(kinds)} files"] if kinds else []) + (
        [f"subdirectories are not searched: {_listed(subdirs)}"] if subdirs else [])
    return f" ({'; '.join(parts)})" if parts else ""


# words in a file name that `datasets` reads as split names (its split-pattern inference:
# at the start or after a separator, and before one: train-0000.parquet, hh_test.jsonl)
_SPLIT_NAMES = {"train": "train", "training": "train", "test": "test", "testing": "test",
                "eval": "test", "evaluation": "test", "validation": "validation",
                "valid": "validation", "val": "validation", "dev": "validation"}
_SPLIT_WORD = re.compile(r"(?:^|[-._ 0-9])(" + "|".join(_SPLIT_NAMES) + r")(?=[-._ 0-9]|$)",
                         re.IGNORECASE)


def _split_of(path: Path) -> str | None:
    """The hub split a data file's name gives it ('train', 'test', 'validation') or None."""
    found = _SPLIT_WORD.search(path.name)
    return _SPLIT_NAMES[found.group(1).lower()] if found else None


def _listed(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")


def _data_suffix(path: Path) -> str | None:
    """The known data suffix of `path` ('.jsonl.gz', '.parquet', ...) or None."""
    return next((s for s in _DATA_SUFFIXES if path.name.lower().endswith(s)), None)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Silence `datasets` progress bars and log lines while reading a small local file."""
    import datasets
    from datasets.utils import logging as ds_logging

    bars_were_on = not datasets.are_progress_bars_disabled()
    verbosity = ds_logging.get_verbosity()
    datasets.disable_progress_bars()
    ds_logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def _short(exc: BaseException) -> str:
    """First line of an exception message (with its cause when the message is generic)."""
    text = str(exc).strip() or type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip() and "error occurred" in text:
        text = str(cause).strip()
    line = text.splitlines()[0]
    return line if len(line) <= 200 else line[:197] + "..."


def _read_file(path: Path) -> dict[str, list[Any]]:
    """Read a local data file into columns {name: [value per record]}. JSON records by the
    standard library, exactly as written: Arrow types a column from the file's first block
    (about 10 MB) and silently re-encodes later values of another shape (a message's
    "content" came back as '"z"', a list prompt as the text '["x"]'). Parquet, and JSON
    that does not parse (for its error), with `datasets`, its Arrow cache in a temporary
    directory (nothing is written under the user's home)."""
    builder = _DATA_SUFFIXES[_data_suffix(path) or ""]
    if builder == "json" and (records := _json_records(path)) is not None:
        names = list(dict.fromkeys(name for record in records for name in record))
        return {name: [record.get(name) for record in records] for name in names}
    import datasets

    try:
        with tempfile.TemporaryDirectory(prefix="rlhf-data-") as cache_dir, _quiet_datasets():
            ds = datasets.load_dataset(builder, data_files=str(path), split="train",
                                       cache_dir=cache_dir, keep_in_memory=True)
            return ds.to_dict()
    except Exception as exc:
        # an empty file: StopIteration for JSON lines, "corresponds to no data" otherwise
        if isinstance(exc, StopIteration) or (
                isinstance(exc, ValueError) and "corresponds to no data" in str(exc)):
            return {}
        kind = "Parquet" if builder == "parquet" else "JSON (an array of records or JSON lines)"
        where = _bad_json_line(path) if builder == "json" else None
        raise DataError(f"cannot read data file {path}: {where or _short(exc)}; check that it "
                        f"is valid {kind}") from exc


def _bad_json_line(path: Path) -> str | None:
    """Where a JSON file stops parsing, by line and column from 1 as editors number them
    (`datasets` names rows from 0, and a JSON array's error by character offset): the first
    bad line of JSON lines, the place in an array; None when it all parses."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError, EOFError, zlib.error):
        return None
    # an array is one document; JSON lines are one a line (split on newlines alone, here and
    # in _json_records: a JSON string may hold U+2028, which splitlines would break at)
    documents = [text] if text.lstrip().startswith("[") else text.split("\n")
    for number, document in enumerate(documents, 1):
        try:
            if document.strip():
                json.loads(document)
        except json.JSONDecodeError as err:
            return f"line {number + err.lineno - 1}: {err.msg} (column {err.colno})"
    return None


def _json_records(path: Path) -> list[dict] | None:
    """The records of a JSON file (maybe .gz): an array of objects, one object, or JSON
    lines; None where it does not parse (`datasets` then says where). JSON that parses into
    something other than objects, and a truncated or damaged .gz, raise DataError."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            text = f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise DataError(f"cannot read data file {path}: a truncated or damaged gzip file "
                        f"({_short(err)}); copy or download it again") from None
    except (OSError, ValueError):
        return None
    try:
        try:
            whole = json.loads(text)
            records = whole if isinstance(whole, list) else [whole]
        except ValueError:   # JSON lines (or no JSON: None below)
            records = [json.loads(line) for line in text.split("\n") if line.strip()]
    except ValueError:
        return None
    other = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if other is not None:
        raise DataError(f"cannot read data file {path}: record {other + 1} is "
                        f"{json.dumps(records[other])[:40]}, not an object; give one JSON "
                        "object per record (an array of them, or one per line)")
    return records


def _read_hub(name: str, key: str, split: str = "train") -> dict[str, list[Any]]:
    """Load `split` of hub dataset `name` into columns (default `datasets` cache);
    `key` is the config key that named it, for the fixes errors suggest."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    from engine.model_source import hub_libraries_offline, hub_offline

    unreachable = (f"cannot load dataset '{name}': not a local file and the Hugging Face hub is "
                   f"unreachable (offline?); download it and pass the local file path in {key}")
    offline = hub_offline()
    # checked first: with no network and no cache, `datasets` retries for half a minute
    if offline and not _hub_dataset_cached(name):
        raise DataError(unreachable)
    try:
        # offline mode for the load too, or `datasets` retries that half minute before it
        # reads its prepared copy (or finds the copy unreadable)
        with hub_libraries_offline() if offline else contextlib.nullcontext():
            ds = datasets.load_dataset(name, split=split)
    except ConnectionError as exc:
        raise DataError(unreachable) from exc
    except DatasetNotFoundError as exc:
        raise DataError(f"cannot load dataset '{name}': not a local file and not found on the "
                        f"Hugging Face hub ({_short(exc)}); check the name or pass a local file "
                        f"path in {key}") from exc
    except FileNotFoundError as exc:
        if offline:
            raise DataError(f"cannot load dataset '{name}': the Hugging Face hub is unreachable "
                            f"(offline?) and its copy in {datasets.config.HF_DATASETS_CACHE} "
                            f"cannot be read ({_short(exc)}); download it again, or pass a local "
                            f"file path in {key}") from exc
        raise DataError(f"cannot load dataset '{name}': no such local file and not a Hugging Face "
                        f"hub dataset name; check {key}") from exc
    except Exception as exc:
        raise DataError(f"cannot load dataset '{name}': {_short(exc)}; pass a local file path in "
                        f"{key}") from exc
    return ds.to_dict()


def _hub_dataset_cached(name: str) -> bool:
    """Whether hub dataset `name` has a prepared copy in `datasets`' cache
    (namespace___snake_case_name/config/version/hash), the only form it loads offline: the
    hub client's download (datasets--namespace--Name) alone is not read without the hub."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    namespace, _, short = name.rpartition("/")
    prepared = (f"{namespace}___" if namespace else "") + camelcase_to_snakecase(short)
    root = Path(datasets.config.HF_DATASETS_CACHE) / prepared
    return any(path.is_dir() for path in root.glob("*/*/*"))


def _text_column(columns: dict[str, list[Any]], field: str, label: str) -> list[str]:
    """columns[field], checked to be all strings (record numbers in errors are 1-based)."""
    values = columns[field]
    for i, value in enumerate(values):
        if not isinstance(value, str):   # (a record without the field reads as null)
            what = "is missing or null" if value is None \
                else f"is not text (got {type(value).__name__})"
            raise DataError(f"{label} record {i + 1}: field '{field}' {what}; fix or remove "
                            "that record")
    return values


def _pairs_from_columns(columns: dict[str, list[Any]], label: str, fields: Fields
                        ) -> tuple[list[PreferencePair], Counter]:
    """Detect the record format from the column names and build pairs; returns (pairs, the
    records skipped, counted by reason: a key of _SKIPPED)."""
    if not columns or not next(iter(columns.values())):
        return [], Counter()
    for field, key in ((fields.chosen, "chosen_key"), (fields.rejected, "rejected_key")):
        if field not in columns:
            raise DataError(f"{label}: records have no '{field}' field (columns: "
                            f"{', '.join(columns)}); {_FORMAT_HINT}, or set data.{key} to "
                            "the field that holds them")
    if _messages_in(columns, fields.chosen):
        records = _dialogue_records(columns, label, fields)
    elif fields.prompt in columns:
        records = [_text_record(*record) for record in zip(
            *(_text_column(columns, field, label)
              for field in (fields.prompt, fields.chosen, fields.rejected)), strict=True)]
    else:
        records = [_split_transcripts(c, r) for c, r in zip(
            _text_column(columns, fields.chosen, label),
            _text_column(columns, fields.rejected, label), strict=True)]
    skipped = Counter(record if isinstance(record, str) else "empty" for record in records
                      if isinstance(record, str) or not (record[1].strip() and record[2].strip()))
    margins = (_margin_column(columns, fields.margin, label) if fields.margin
               else [None] * len(records))
    pairs = [PreferencePair(*record, margin=margin)
             for record, margin in zip(records, margins, strict=True)
             if not isinstance(record, str) and record[1].strip() and record[2].strip()]
    return pairs, skipped


def _margin_column(columns: dict[str, list[Any]], field: str, label: str) -> list[float]:
    """columns[field] (data.margin_key), checked to be all finite numbers."""
    if field not in columns:
        raise DataError(f"{label}: records have no '{field}' field (columns: "
                        f"{', '.join(columns)}); give each record its margin, or set "
                        "data.margin_key to the field that holds it (null: no margins)")
    margins = []
    for i, value in enumerate(columns[field]):
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            raise DataError(f"{label} record {i + 1}: field '{field}' (data.margin_key) is "
                            f"{_shown(value)}, not a finite number; fix or remove that record")
        margins.append(float(value))
    return margins


def _text_record(prompt: str, chosen: str, rejected: str
                 ) -> tuple[str, str, str, tuple[dict, ...] | None]:
    """(prompt, chosen, rejected, the prompt's messages) of a record of text fields: hh-rlhf
    text as written; a bare prompt (stack-exchange's question) is one user turn, as step 3
    asks ppo.prompt_data's (_text_prompt) and chat.py asks, its answers following
    "\\n\\nAssistant: ". An empty prompt stays empty: the answers alone are the text."""
    if has_turns(prompt) or not prompt.strip():
        return prompt, chosen, rejected, None
    framed, messages = _text_prompt(prompt)
    return framed, _following_cue(chosen), _following_cue(rejected), messages


def _split_transcripts(chosen: str, rejected: str) -> tuple[str, str, str] | str:
    """hh-rlhf transcripts -> (prompt, chosen answer, rejected answer), or why not (a reason
    of _SKIPPED).
    The prompt is `chosen` through its last "\\n\\nAssistant:", kept verbatim so that
    prompt + chosen answer == chosen transcript; `rejected` must start with the same prompt."""
    cut = chosen.rfind(ASSISTANT)
    if cut < 0:
        return "no_marker"
    prompt = chosen[: cut + len(ASSISTANT)]
    if not rejected.startswith(prompt):
        return "differs"
    return prompt, chosen[len(prompt) :], rejected[len(prompt) :]


def _messages_in(columns: dict[str, list[Any]], field: str) -> bool:
    """Whether column `field` holds chat messages (OpenRLHF / TRL): its first value is a
    list (the records that differ from it are named as errors)."""
    first = next((value for value in columns[field] if value is not None), None)
    return isinstance(first, list)


def _message_column(columns: dict[str, list[Any]], field: str, label: str,
                    opens: bool, shaped: str | None = None) -> list[list]:
    """columns[field], checked to be lists of {"role", "content"} messages; `opens`: each
    list starts a dialogue (only there may a system message stand, first). A value of
    another shape is named against `shaped`, the column whose first value made the records
    chat messages: the chosen answers' for the rejected ones, else the field itself."""
    values, shaped = columns[field], shaped or field
    for i, messages in enumerate(values):
        where = f"{label} record {i + 1}: field '{field}'"
        if not isinstance(messages, list):
            got = "null" if messages is None else type(messages).__name__
            raise DataError(f"{where} is not a list of chat messages (got {got}) as '{shaped}' is "
                            "elsewhere in this data; give every record's fields that shape")
        for n, message in enumerate(messages, 1):
            role = message.get("role") if isinstance(message, dict) else None
            if role not in HH_PREFIX or not isinstance(message.get("content"), str):
                raise DataError(f"{where} message {n} is not a {{\"role\": system/user/assistant, "
                                f"\"content\": text}} message (got {_shown(message)}); fix or "
                                "remove that record")
            if role == "system" and (n > 1 or not opens):
                raise DataError(f"{where} message {n}: a system message can only open a "
                                "dialogue; fix or remove that record")
    return values


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _render(messages: list[dict]) -> str:
    """Chat messages as hh-rlhf text: "[system]\n\nHuman: ...\n\nAssistant: ..."."""
    return "".join(HH_PREFIX[m["role"]] + m["content"] for m in messages)


def _dialogue_records(columns: dict[str, list[Any]], label: str, fields: Fields
                      ) -> list[tuple[str, str, str] | str]:
    """(prompt, chosen, rejected) texts of chat-message records, or why not: whole
    dialogues in `chosen`/`rejected`, or TRL's explicit `prompt` messages continued by them.
    The prompt is the dialogue before its final assistant message, through "\n\nAssistant:".
    A text `prompt` beside whole dialogues (UltraFeedback's: their first user turn) is not
    read, as OpenRLHF reads such data."""
    explicit = fields.prompt in columns and _messages_in(columns, fields.prompt)
    chosen = _message_column(columns, fields.chosen, label, opens=not explicit)
    rejected = _message_column(columns, fields.rejected, label, opens=not explicit,
                               shaped=fields.chosen)
    prompts = (_message_column(columns, fields.prompt, label, opens=True) if explicit
               else [[] for _ in chosen])
    return [_split_dialogues(prompt + c, prompt + r)
            for prompt, c, r in zip(prompts, chosen, rejected, strict=True)]


def _split_dialogues(chosen: list[dict], rejected: list[dict]
                     ) -> tuple[str, str, str, tuple[dict, ...]] | str:
    """Two dialogues -> (prompt, chosen answer, rejected answer) as hh-rlhf text and the
    prompt's messages, or why not: either does not end in an assistant message, or they
    differ before it."""
    if not chosen or not rejected or chosen[-1]["role"] != "assistant" \
            or rejected[-1]["role"] != "assistant":
        return "no_answer"
    prompt = _render(chosen[:-1]) + ASSISTANT
    if _render(rejected[:-1]) + ASSISTANT != prompt:
        return "differs"
    return (prompt, " " + chosen[-1]["content"], " " + rejected[-1]["content"],
            tuple({"role": m["role"], "content": m["content"]} for m in chosen[:-1]))


# ---------------------------------------------------------------------------------------------
# Splitting and blending


def permutation(n: int, seed: int) -> list[int]:
    """A permutation of range(n) that depends only on `seed` (same on every run and process)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def split_indices(n: int, split: Sequence[float], seed: int) -> list[list[int]]:
    """Split range(n) into len(split) disjoint parts proportional to `split` (e.g. (2, 4, 4) ->
    20%/40%/40%), in a seeded random order. Part sizes are rounded cumulatively so they sum to n;
    a weight of 0 gives an empty part."""
    if not split or any(w < 0 for w in split) or sum(split) <= 0:
        raise ValueError(f"data split must be non-negative weights with a positive sum: {split}")
    total = float(sum(split))
    order = permutation(n, seed)
    ends = [min(n, round(cumulative / total * n)) for cumulative in itertools.accumulate(split)]
    ends[-1] = n
    return [order[start:end] for start, end in itertools.pairwise([0, *ends])]


def load_blend(sources: Sequence[str], split: Sequence[float], seed: int, *,
               demo_pairs: Callable[[], list[PreferencePair]] | None = None,
               fields: Fields = FIELDS
               ) -> tuple[list[PreferencePair], list[PreferencePair], list[PreferencePair]]:
    """Load every source, split EACH source by `split` (e.g. (2,4,4) -> 20%/40%/40% for steps
    1,2,3) with a seeded permutation, concatenate per step, shuffle each step's list with the
    seed; returns (sft_pairs, reward_pairs, ppo_pairs). The source "demo" calls demo_pairs()."""
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise DataError("no data sources given; set data.path to a data file or 'demo'")
    if len(split) != 3:
        raise ValueError(f"data split needs 3 weights (SFT, reward model, PPO), got {split}")

    steps: tuple[list[PreferencePair], ...] = ([], [], [])
    for source in sources:
        if source == DEMO_SOURCE:
            if demo_pairs is None:
                raise DataError("data source 'demo' needs the built-in demo task generator")
            if Path(source).exists():
                log.warning("data.path 'demo' is the built-in demo task: ./demo here is not "
                            "read (pass ./demo to read it)")
            pairs = list(demo_pairs())
        else:
            pairs, skipped = load_pairs(source, fields)
            if skipped:
                log.warning("%s: skipped %d malformed or empty records", source, skipped)
        for step, indices in zip(steps, split_indices(len(pairs), split, seed), strict=True):
            step.extend(pairs[i] for i in indices)

    sft, reward, ppo = ([step[i] for i in permutation(len(step), seed)] for step in steps)
    return sft, reward, ppo


def load_eval_pairs(sources: Sequence[str], fields: Fields = FIELDS, split: str = "test"
                    ) -> list[PreferencePair]:
    """Every pair of every source of data.eval_path (load_pairs, as data.path reads them,
    but `split` of those holding splits: data.eval_split), in order; what was skipped is
    counted in a warning."""
    if DEMO_SOURCE in sources:
        raise DataError("data.eval_path: 'demo' is not a source of held-out pairs (the demo "
                        "holds out data.eval_fraction of its own); give files or datasets")
    return _every_record(sources, lambda source: load_pairs(source, fields, "data.eval_path",
                                                            split),
                         "malformed or empty records")


def load_sft_data(sources: Sequence[str], prompt_key: str, answer_key: str,
                  input_key: str | None = None) -> list[PreferencePair]:
    """Every example of every source of data.sft_path (load_sft_records), in order; what
    was skipped is counted in a warning."""
    return _every_record(sources, lambda source: load_sft_records(source, prompt_key,
                                                                  answer_key, input_key),
                         "records with an empty prompt or answer, or a dialogue that does "
                         "not end in an assistant message")


def load_prompt_data(sources: Sequence[str], prompt_key: str, label_key: str,
                     key: str = "ppo.prompt_data", split: str = "train"
                     ) -> list[PreferencePair]:
    """Every prompt record of every source of `key` (ppo.prompt_data, or
    ppo.eval_prompt_data: load_prompt_records; of sources holding splits, `split`), in
    order; what was skipped is counted in a warning."""
    return _every_record(sources, lambda source: load_prompt_records(source, prompt_key,
                                                                     label_key, key, split),
                         "empty prompts or dialogues ending in an assistant message")


def load_feedback_data(sources: Sequence[str], prompt_key: str, completion_key: str,
                       label_key: str) -> list[PreferencePair]:
    """Every feedback record of every source of data.feedback_path (load_feedback_records),
    in order; what was skipped is counted in a warning."""
    return _every_record(sources, lambda source: load_feedback_records(
        source, prompt_key, completion_key, label_key), "records with an empty prompt or "
        "answer, a null label, or a prompt ending in an assistant message")


def _every_record(sources: Sequence[str], load: Callable[[str], tuple[list, int]],
                  skipped_what: str) -> list:
    """The records `load(source)` reads from every source, in order, warning of each
    source's skipped ones (`skipped_what`: what they were)."""
    records = []
    for source in sources:
        found, skipped = load(source)
        if skipped:
            log.warning("%s: skipped %d %s", source, skipped, skipped_what)
        records.extend(found)
    return records


def train_eval_split(items: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Hold out round(len * eval_fraction) items (at least 1 when eval_fraction > 0 and there
    are >= 2 items; never all of them) chosen by a seeded permutation. Returns (train, eval),
    each in the original order."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(items)
    n_eval = min(max(round(n * eval_fraction), 1), n - 1) if eval_fraction > 0 and n >= 2 else 0
    held_out = set(permutation(n, seed)[:n_eval])
    return ([x for i, x in enumerate(items) if i not in held_out],
            [x for i, x in enumerate(items) if i in held_out])
