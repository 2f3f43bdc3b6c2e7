"""Tests for steps/data.py: reading preference data, splitting, tokenizing, collating."""

import gzip
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from engine.models import byte_tokenizer
from steps.common import report_tokenized, require_examples, train_eval_examples
from steps.config import RunConfig
from steps.data import (
    DataError,
    Fields,
    PreferencePair,
    load_blend,
    load_eval_pairs,
    load_pairs,
    load_prompt_records,
    load_sft_records,
    split_indices,
    train_eval_split,
)
from steps.scoring import decode_rollouts
from steps.tokenize import (
    PairExample,
    SFTExample,
    TokenizeStats,
    collate_pairs,
    collate_prompts,
    collate_sft,
    tokenize_pairs,
    tokenize_preferences,
    tokenize_prompts,
    tokenize_sft,
)
from tests.harness.sft_targets import target_texts

PROMPT_RECORDS = [
    {"prompt": "Human: hi\n\nAssistant:", "chosen": " Hello!", "rejected": " Go away."},
    {"prompt": "Human: 2+2?\n\nAssistant:", "chosen": " 4", "rejected": " 5", "response": " 4"},
]
PROMPT_PAIRS = [
    PreferencePair("Human: hi\n\nAssistant:", " Hello!", " Go away."),
    PreferencePair("Human: 2+2?\n\nAssistant:", " 4", " 5"),
]
HH_RECORDS = [
    {
        "chosen": "\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: how are you?\n\nAssistant: Fine.",
        "rejected": "\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: how are you?\n\nAssistant: Bad.",
    },
    {  # rejected does not share the chosen prompt: skipped
        "chosen": "\n\nHuman: a\n\nAssistant: b",
        "rejected": "\n\nHuman: x\n\nAssistant: y",
    },
    {  # empty chosen answer: skipped
        "chosen": "\n\nHuman: a\n\nAssistant: ",
        "rejected": "\n\nHuman: a\n\nAssistant: no",
    },
]
HH_PAIRS = [
    PreferencePair(
        "\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: how are you?\n\nAssistant:", " Fine.", " Bad."
    )
]


def write_json(path: Path, records: list[dict]) -> Path:
    path.write_text(json.dumps(records))
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


WRITERS = {
    "a.json": write_json,
    "a.jsonl": write_jsonl,
    "a.jsonl.gz": write_jsonl,
    "a.json.gz": write_jsonl,
    "a.parquet": write_parquet,
}


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def refused(source: str) -> str:
    """load_pairs' one-line refusal of `source`."""
    with pytest.raises(DataError) as exc:
        load_pairs(source)
    return one_line(exc)


# ---------------------------------------------------------------------------------------------
# Reading


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_load_prompt_chosen_rejected(tmp_path, name):
    path = WRITERS[name](tmp_path / name, PROMPT_RECORDS)
    assert load_pairs(str(path)) == (PROMPT_PAIRS, 0)


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_load_hh_rlhf_shape(tmp_path, name):
    path = WRITERS[name](tmp_path / name, HH_RECORDS)
    pairs, skipped = load_pairs(str(path))
    assert pairs == HH_PAIRS
    assert skipped == 2
    assert pairs[0].prompt + pairs[0].chosen == HH_RECORDS[0]["chosen"]


def test_json_lines_in_dot_json(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", PROMPT_RECORDS)
    assert load_pairs(str(path)) == (PROMPT_PAIRS, 0)


def test_empty_answers_skipped(tmp_path):
    records = PROMPT_RECORDS + [
        {"prompt": "p", "chosen": "", "rejected": " r"},
        {"prompt": "p", "chosen": " c", "rejected": "  "},
    ]
    assert load_pairs(str(write_jsonl(tmp_path / "a.jsonl", records))) == (PROMPT_PAIRS, 2)


def test_load_directory(tmp_path, caplog):
    """The data files directly in it are read; what else is there is named and counted,
    subdirectories included (a hub snapshot's data/ holds its train and test splits)."""
    write_json(tmp_path / "a.json", PROMPT_RECORDS[:1])
    write_parquet(tmp_path / "b.parquet", PROMPT_RECORDS[1:])
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "sub").mkdir()
    write_json(tmp_path / "sub" / "c.json", PROMPT_RECORDS)
    assert load_pairs(str(tmp_path)) == (PROMPT_PAIRS, 0)
    assert "read 2 data files, left out 2 other entries (notes.txt, sub/)" in caplog.text
    snapshot = tmp_path / "snapshot"
    (snapshot / "data").mkdir(parents=True)
    write_json(snapshot / "data" / "train.json", PROMPT_RECORDS)
    with pytest.raises(DataError, match=r"parquet files \(subdirectories are not searched: "
                                        r"data/\); .* name the files in data\.path"):
        load_pairs(str(snapshot))


def test_a_directory_of_other_file_types_names_them(tmp_path):
    """Not "subdirectories are not searched: ds.csv": the types found and those read."""
    (tmp_path / "ds.csv").write_text("prompt,chosen,rejected\n")
    (tmp_path / "README.md").write_text("")
    assert refused(str(tmp_path)) == (
        f"data directory {tmp_path} has no .json, .jsonl, .jsonl.gz, .json.gz or .parquet "
        "files (found only .csv, .md files); put the data there as one of those or name the "
        "files in data.path")


def test_a_directory_of_hub_split_files_reads_its_train_split(tmp_path, caplog):
    """What `huggingface-cli download` puts in data/: the test rows used to land in training."""
    write_parquet(tmp_path / "train-00000-of-00002.parquet", PROMPT_RECORDS[:1])
    write_parquet(tmp_path / "train-00001-of-00002.parquet", PROMPT_RECORDS[1:])
    write_parquet(tmp_path / "test-00000-of-00001.parquet", PROMPT_RECORDS)
    write_jsonl(tmp_path / "validation.jsonl", PROMPT_RECORDS)
    assert load_pairs(str(tmp_path)) == (PROMPT_PAIRS, 0)
    assert ("read its train split (2 files), left out 2 other data files "
            "(test-00000-of-00001.parquet, validation.jsonl)") in caplog.text
    for name in ("train-00000-of-00002.parquet", "train-00001-of-00002.parquet"):
        (tmp_path / name).unlink()
    with pytest.raises(DataError) as exc:
        load_pairs(str(tmp_path))
    assert one_line(exc) == (f"data directory {tmp_path} holds hub split files but no train "
                             "split (test-00000-of-00001.parquet, validation.jsonl); name the "
                             "file to train on in data.path")
    # the split's word after a separator too, as `datasets` reads it
    suffixed = tmp_path / "suffixed"
    suffixed.mkdir()
    write_jsonl(suffixed / "hh_train.jsonl", PROMPT_RECORDS)
    write_jsonl(suffixed / "hh_test.jsonl", PROMPT_RECORDS[:1])
    write_jsonl(suffixed / "pretrained.jsonl", PROMPT_RECORDS[:1])   # no split's word
    caplog.clear()
    assert load_pairs(str(suffixed)) == (PROMPT_PAIRS, 0)
    assert "left out 2 other data files (hh_test.jsonl, pretrained.jsonl)" in caplog.text


def test_a_directory_saved_by_datasets(tmp_path, caplog):
    """save_to_disk's directories were read as JSON files: "records have no 'chosen' field
    (columns: citation, description, ...)" from its dataset_info.json."""
    import datasets

    def dataset(records):
        return datasets.Dataset.from_list(records)

    dataset(PROMPT_RECORDS).save_to_disk(str(tmp_path / "one"))
    assert load_pairs(str(tmp_path / "one")) == (PROMPT_PAIRS, 0)
    datasets.DatasetDict({"train": dataset(HH_RECORDS), "test": dataset(PROMPT_RECORDS)}
                         ).save_to_disk(str(tmp_path / "dict"))
    assert load_pairs(str(tmp_path / "dict")) == (HH_PAIRS, 2)
    assert f"saved dataset {tmp_path / 'dict'}: read its train split, left out test (2 " \
           "records)" in caplog.text
    datasets.DatasetDict({"test": dataset(PROMPT_RECORDS)}).save_to_disk(str(tmp_path / "test"))
    with pytest.raises(DataError) as exc:
        load_pairs(str(tmp_path / "test"))
    assert one_line(exc) == (f"saved dataset {tmp_path / 'test'} has no train split (splits: "
                             "test); pass the split's directory in data.path")
    dataset([{"prompt": "p", "chosen": "c"}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"^saved dataset .*bad: records have no 'rejected'"):
        load_pairs(str(tmp_path / "bad"))
    dataset(PROMPT_RECORDS).save_to_disk(str(tmp_path / "damaged"))
    next((tmp_path / "damaged").glob("*.arrow")).write_bytes(b"not arrow")
    line = refused(str(tmp_path / "damaged"))
    assert line.startswith(f"cannot read saved dataset {tmp_path / 'damaged'}: ")
    assert line.endswith("; save it again with save_to_disk or pass its data files in data.path")


def test_held_out_sources_read_their_test_split(tmp_path, caplog, monkeypatch):
    """data.eval_path (and ppo.eval_prompt_data) read data.eval_split of a source that holds
    splits, where data.path reads train: a directory of split-named files, a saved
    DatasetDict, a hub dataset (asked for that split). A held-out set read from the train
    split would have evaluated on the training data."""
    import datasets

    split_files = tmp_path / "files"
    split_files.mkdir()
    write_jsonl(split_files / "train.jsonl", HH_RECORDS)
    write_jsonl(split_files / "test.jsonl", PROMPT_RECORDS)
    assert load_eval_pairs([str(split_files)]) == PROMPT_PAIRS
    assert load_pairs(str(split_files))[0] == HH_PAIRS
    assert "read its test split (1 files), left out 1 other data files (train.jsonl); name " \
           "them in data.eval_path to evaluate on them" in caplog.text
    (split_files / "test.jsonl").rename(split_files / "validation.jsonl")
    with pytest.raises(DataError, match=r"holds hub split files but no test split \(train.jsonl, "
                                        r"validation.jsonl\); name the file to evaluate on in "
                                        r"data.eval_path$"):
        load_eval_pairs([str(split_files)])
    assert load_eval_pairs([str(split_files)], split="validation") == PROMPT_PAIRS
    datasets.DatasetDict({"train": datasets.Dataset.from_list(HH_RECORDS),
                          "test": datasets.Dataset.from_list(PROMPT_RECORDS)}
                         ).save_to_disk(str(tmp_path / "dict"))
    assert load_eval_pairs([str(tmp_path / "dict")]) == PROMPT_PAIRS
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: asked.append(split)
                        or datasets.Dataset.from_list(PROMPT_RECORDS))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr("engine.model_source.hub_offline", lambda: False)
    assert load_eval_pairs(["someone/prefs"]) == PROMPT_PAIRS and asked == ["test"]


def test_real_hh_rlhf(hh_rlhf_path):
    pairs, skipped = load_pairs(str(hh_rlhf_path))
    assert len(pairs) + skipped == 2312
    assert (len(pairs), skipped) == (2304, 8)
    assert all(p.prompt.endswith("\n\nAssistant:") for p in pairs)
    assert all(p.chosen.strip() and p.rejected.strip() for p in pairs)
    with gzip.open(hh_rlhf_path, "rt") as f:
        first = json.loads(f.readline())
    assert pairs[0].prompt + pairs[0].chosen == first["chosen"]
    assert pairs[0].prompt + pairs[0].rejected == first["rejected"]


def _chat(*turns: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


CHAT_RECORDS = [   # whole dialogues (OpenRLHF, TRL's implicit prompt)
    {"chosen": _chat(("system", "Be brief."), ("user", "hi"), ("assistant", "Hello!"),
                     ("user", "how are you?"), ("assistant", "Fine.")),
     "rejected": _chat(("system", "Be brief."), ("user", "hi"), ("assistant", "Hello!"),
                       ("user", "how are you?"), ("assistant", "Bad."))},
    {"chosen": _chat(("user", "a"), ("assistant", "b")),   # prompts differ: skipped
     "rejected": _chat(("user", "x"), ("assistant", "y"))},
    {"chosen": _chat(("user", "a"), ("assistant", "b"), ("user", "c")),   # no answer: skipped
     "rejected": _chat(("user", "a"), ("assistant", "b"), ("user", "d"))},
]
CHAT_PAIRS = [PreferencePair("Be brief.\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: how are "
                             "you?\n\nAssistant:", " Fine.", " Bad.",
                             tuple(_chat(("system", "Be brief."), ("user", "hi"),
                                         ("assistant", "Hello!"), ("user", "how are you?"))))]


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_load_chat_messages(tmp_path, name):
    """Chat messages are rendered as hh-rlhf text: the prompt ends in "\\n\\nAssistant:" as
    chat.py's and the demo's do, and prompt + answer is the rendered dialogue; the prompt's
    messages are kept, exactly, for data.apply_chat_template."""
    path = WRITERS[name](tmp_path / name, CHAT_RECORDS)
    assert load_pairs(str(path)) == (CHAT_PAIRS, 2)
    hh = HH_RECORDS[0]["chosen"]
    (pair,), _ = load_pairs(str(WRITERS[name](tmp_path / f"hh{name}", [{
        "chosen": _chat(("user", "hi"), ("assistant", "Hello!"), ("user", "how are you?"),
                        ("assistant", "Fine.")),
        "rejected": _chat(("user", "hi"), ("assistant", "Hello!"), ("user", "how are you?"),
                          ("assistant", "Bad."))}])))
    assert pair[:3] == HH_PAIRS[0][:3] and pair.prompt + pair.chosen == hh


def test_load_chat_messages_with_an_explicit_prompt(tmp_path):
    """TRL's explicit-prompt form: `prompt` messages, answers as assistant messages."""
    records = [{"prompt": _chat(("system", "Be brief."), ("user", "hi"), ("assistant", "Hello!"),
                                ("user", "how are you?")),
                "chosen": _chat(("assistant", "Fine.")), "rejected": _chat(("assistant", "Bad."))},
               {"prompt": _chat(("user", "q")), "chosen": _chat(("assistant", "")),
                "rejected": _chat(("assistant", "no"))}]   # empty answer: skipped
    assert load_pairs(str(write_jsonl(tmp_path / "a.jsonl", records))) == (CHAT_PAIRS, 1)


def test_chat_messages_of_differing_keys_past_arrows_first_block(tmp_path):
    """Arrow types a JSON file's columns from its first block (about 10 MB): a later message
    with a key the others lack ("name") failed to cast, and the valid file was reported as
    "not valid JSON". Such a file is read by the standard library."""
    long = "q" * 2000
    records = [{"chosen": _chat(("user", f"{long}{i}"), ("assistant", "a")),
                "rejected": _chat(("user", f"{long}{i}"), ("assistant", "b"))}
               for i in range(6000)]
    records.append({"chosen": [{"role": "user", "content": "z"},
                               {"role": "assistant", "content": "a", "name": "bot"}],
                    "rejected": _chat(("user", "z"), ("assistant", "b"))})
    pairs, skipped = load_pairs(str(write_jsonl(tmp_path / "a.jsonl", records)))
    assert len(pairs) == 6001 and skipped == 0
    assert pairs[-1] == PreferencePair("\n\nHuman: z\n\nAssistant:", " a", " b",
                                       tuple(_chat(("user", "z"))))
    # a value of another type there was not even refused: Arrow re-encoded the later block
    # (every content as '"z"', the int as '3') and skipped the 981 records it broke
    records[-1] = {"chosen": _chat(("user", "z"), ("assistant", 3)),
                   "rejected": _chat(("user", "z"), ("assistant", "b"))}
    path = write_jsonl(tmp_path / "b.jsonl", records)
    with pytest.raises(DataError) as exc:
        load_pairs(str(path))
    assert one_line(exc).startswith(f"data file {path} record 6001: field 'chosen' message 2 "
                                    "is not a {")


def test_a_text_prompt_beside_whole_dialogues_is_not_read(tmp_path):
    """UltraFeedback-binarized's layout: `prompt` the first user turn as text, `chosen` and
    `rejected` the whole dialogues. It stopped with "field 'prompt' is not a list of chat
    messages"; the dialogues say it all (OpenRLHF reads it so too)."""
    records = [{"prompt": "hi", **record} for record in CHAT_RECORDS]
    assert load_pairs(str(write_jsonl(tmp_path / "a.jsonl", records))) == (CHAT_PAIRS, 2)


@pytest.mark.parametrize("record, said", [
    ({"chosen": _chat(("user", "a"), ("assistant", 3)), "rejected": _chat(("assistant", "b"))},
     "field 'chosen' message 2 is not a {\"role\": system/user/assistant, \"content\": text} "
     "message (got {\"role\": \"assistant\", \"content\": 3}); fix or remove that record"),
    ({"chosen": _chat(("user", "a"), ("tool", "b")), "rejected": _chat(("assistant", "b"))},
     "field 'chosen' message 2 is not a {\"role\": system/user/assistant, \"content\": text} "
     "message (got {\"role\": \"tool\", \"content\": \"b\"}); fix or remove that record"),
    ({"chosen": _chat(("user", "a"), ("system", "b")), "rejected": _chat(("assistant", "b"))},
     "field 'chosen' message 2: a system message can only open a dialogue; fix or remove "
     "that record"),
    ({"chosen": "a", "rejected": _chat(("assistant", "b"))},
     "field 'chosen' is not a list of chat messages (got str) as 'chosen' is elsewhere in this "
     "data; give every record's fields that shape"),
])
def test_malformed_chat_messages(tmp_path, record, said):
    good = CHAT_RECORDS[0]
    path = write_json(tmp_path / "a.json", [good, record])
    with pytest.raises(DataError) as exc:
        load_pairs(str(path))
    assert one_line(exc) == f"data file {path} record 2: {said}"


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(DataError) as exc:
        load_pairs(str(path))
    assert f"data file not found: {path}" in one_line(exc)


def test_malformed_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"prompt": "a", "chosen": ')
    with pytest.raises(DataError) as exc:
        load_pairs(str(path))
    assert f"cannot read data file {path}: " in one_line(exc)


def test_a_truncated_gzip_file_is_refused_in_one_line(tmp_path):
    """Half a .jsonl.gz (a copy cut short) stopped in gzip's EOFError traceback."""
    import gzip
    whole = gzip.compress("".join(json.dumps(r) + "\n" for r in PROMPT_RECORDS * 50).encode())
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(DataError, match=rf"^cannot read data file {path}: a truncated or "
                                        r"damaged gzip file \(.*\); copy or download it again$"):
        load_pairs(str(path))


@pytest.mark.parametrize("text, record, said", [
    ("null", 1, "null"), ("[1, 2]", 1, "1"), ('[{"prompt": "a"}, "b"]', 2, '"b"'),
    ('{"prompt": "a"}\n[3]\n', 2, "[3]")])
def test_json_that_is_not_records_is_refused_by_the_record_it_names(tmp_path, text, record,
                                                                       said):
    """JSON that parses but holds no objects went on to pyarrow, which crashed the process
    on a file of `null` and said "Column() changed from object to number" otherwise."""
    path = tmp_path / "odd.jsonl"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^cannot read data file {path}: record {record} is "
                                        rf"{re.escape(said)}, not an object; give one JSON "):
        load_pairs(str(path))


def test_a_bad_json_line_is_named_by_its_line_number(tmp_path):
    """As an editor numbers it (from 1; `datasets` said "row 2" for the third line)."""
    good = json.dumps(PROMPT_RECORDS[0])
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{good}\n{good[:-1]},}}\n{good}\n")
    with pytest.raises(DataError, match=rf"^cannot read data file {path}: line 4: .*column"):
        load_pairs(str(path))


def test_a_bad_json_array_is_named_by_line_and_column(tmp_path):
    """`datasets` gave an array's error as a character offset ("at position 66")."""
    good = json.dumps(PROMPT_RECORDS[0])
    path = tmp_path / "bad.json"
    path.write_text(f"[{good},\n {good},\n {good[:9]}{good[10:]}]\n")   # no colon
    assert refused(str(path)) == (f"cannot read data file {path}: line 3: Expecting ':' "
                                  "delimiter (column 12); check that it is valid JSON (an "
                                  "array of records or JSON lines)")


def test_a_line_separator_inside_a_json_string_is_text_not_a_new_line(tmp_path, monkeypatch):
    """JSON strings may hold U+2028 unescaped: a reader that split lines there found no
    JSON and handed the file to `datasets` (Arrow's typing, see _read_file), and a line
    count that split there was one off."""
    import datasets

    good = json.dumps(PROMPT_RECORDS[0])
    spaced = {**PROMPT_RECORDS[0], "chosen": " 4\u2028 5"}
    path = tmp_path / "spaced.jsonl"
    path.write_text(f"{json.dumps(spaced, ensure_ascii=False)}\n{good}\n", encoding="utf-8")
    with monkeypatch.context() as patched:
        patched.setattr(datasets, "load_dataset",
                        lambda *args, **kwargs: pytest.fail("datasets was asked"))
        pairs, _ = load_pairs(str(path))
    assert [p.chosen for p in pairs] == [" 4\u2028 5", PROMPT_RECORDS[0]["chosen"]]
    path.write_text(f"{json.dumps(spaced, ensure_ascii=False)}\n{good[:-1]},}}\n",
                    encoding="utf-8")
    with pytest.raises(DataError, match=rf"^cannot read data file {path}: line 2: "):
        load_pairs(str(path))


def test_a_file_with_a_utf8_bom_is_named_right(tmp_path):
    """A BOM (Windows editors write one) used to make the re-readers fail on line 1: a bad
    line was named as line 1, and a mistyped field as the record `datasets` decoded lossily."""
    good = json.dumps(PROMPT_RECORDS[0])
    path = tmp_path / "bom.jsonl"
    path.write_text(f"\ufeff{good}\n{good}\n{good[:-1]},}}\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^cannot read data file {path}: line 3: "):
        load_pairs(str(path))
    records = [PROMPT_RECORDS[0], {**PROMPT_RECORDS[0], "chosen": " 4"},
               {**PROMPT_RECORDS[0], "chosen": 7}]
    path.write_text("\ufeff" + "".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    with pytest.raises(DataError, match=r"record 3: field 'chosen' is not text \(got int\)"):
        load_pairs(str(path))


def test_missing_rejected(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "chosen": "c"}])
    with pytest.raises(DataError) as exc:
        load_pairs(str(path))
    message = one_line(exc)
    assert str(path) in message
    assert "no 'rejected' field (columns: prompt, chosen)" in message


@pytest.mark.parametrize("name", ["a.json", "a.jsonl.gz"])
@pytest.mark.parametrize(
    "bad, said", [(None, "is missing or null"), (3, "is not text (got int)"),
                  (["x"], "is not text (got list)"), ({"k": 1}, "is not text (got dict)"),
                  ("absent", "is missing or null")]
)
def test_non_string_field(tmp_path, name, bad, said):
    record = {"prompt": "p", "rejected": "r"} | ({} if bad == "absent" else {"chosen": bad})
    path = WRITERS[name](tmp_path / name, PROMPT_RECORDS + [record])
    with pytest.raises(DataError) as exc:
        load_pairs(str(path))
    message = one_line(exc)
    assert f"data file {path} record 3: field 'chosen' {said}; fix or remove" in message


@pytest.mark.parametrize("bad, got", [(None, "null"), (3, "int")])
def test_non_string_field_parquet(tmp_path, bad, got):
    records = [
        {"prompt": "p", "chosen": "c", "rejected": "r"},
        {"prompt": "p", "chosen": "c", "rejected": bad},
    ]
    if got == "int":  # a parquet column has one type: every record is an int
        records = [{**r, "rejected": 7} for r in records]
    path = write_parquet(tmp_path / "a.parquet", records)
    with pytest.raises(DataError) as exc:
        load_pairs(str(path))
    record, said = (2, "is missing or null") if got == "null" else (1, "is not text (got int)")
    expected = f"data file {path} record {record}: field 'rejected' {said}"
    assert expected in one_line(exc)


def test_a_hub_dataset_in_a_local_cache_is_found(tmp_path, monkeypatch):
    """`datasets` reads offline only its prepared copy, namespace___snake_case_name/config/
    version/hash (stanfordnlp___shp/...): the hub client's download alone, or a prepared
    directory with nothing in it, is not a cache an offline run can use."""
    import datasets
    from huggingface_hub import constants

    from steps.data import _hub_dataset_cached

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "prepared")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert not _hub_dataset_cached("stanfordnlp/SHP")
    (tmp_path / "hub" / "datasets--stanfordnlp--SHP").mkdir(parents=True)
    (tmp_path / "prepared" / "stanfordnlp___shp" / "default").mkdir(parents=True)
    assert not _hub_dataset_cached("stanfordnlp/SHP")
    (tmp_path / "prepared" / "stanfordnlp___shp" / "default" / "0.0.0" / "8a3f").mkdir(parents=True)
    assert _hub_dataset_cached("stanfordnlp/SHP")


def _prepared_copy(cache: Path, name: str, records: list[dict], source: Path) -> None:
    """Lay out `records` in `cache` as `datasets` prepares hub dataset `name` (one config,
    'default'), by preparing them as a local JSON file and renaming what it wrote."""
    import datasets

    namespace, short = name.split("/")
    datasets.load_dataset("json", data_files=str(write_jsonl(source, records)), split="train",
                          cache_dir=str(cache))
    (built,) = (cache / "json").glob("*/*/*/")
    (built / "json-train.arrow").rename(built / f"{short}-train.arrow")
    target = cache / f"{namespace}___{short}" / "default" / "0.0.0" / built.name
    target.parent.mkdir(parents=True)
    built.rename(target)


def test_an_unreachable_hub_reads_the_prepared_copy_without_a_request(tmp_path, monkeypatch):
    """No network and no offline mode set: `datasets` retried the hub for ~25 s before it
    read its cache (and as long before it failed on a copy it could not read); the load runs
    in offline mode now, and asks the hub nothing."""
    import datasets
    import huggingface_hub.constants
    import huggingface_hub.file_download

    requests = []

    def no_network(url, *args, **kwargs):
        requests.append(url)
        raise AssertionError(f"requested {url}")

    records = [{"prompt": f"Human: q{i}\n\nAssistant:", "chosen": f" yes {i}",
                "rejected": f" no {i}"} for i in range(3)]
    _prepared_copy(tmp_path / "prepared", "acme/pairs", records, tmp_path / "pairs.jsonl")
    (tmp_path / "prepared" / "acme___broken" / "default" / "0.0.0" / "0a1b").mkdir(parents=True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "prepared")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("engine.model_source.hub_offline", lambda: True)
    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_network)

    pairs, skipped = load_pairs("acme/pairs")
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        (r["prompt"], r["chosen"], r["rejected"]) for r in records]
    assert skipped == 0
    with pytest.raises(DataError) as exc:
        load_pairs("acme/broken")
    assert one_line(exc).startswith("cannot load dataset 'acme/broken': the Hugging Face hub is "
                                    f"unreachable (offline?) and its copy in {tmp_path / 'prepared'} ")
    assert requests == []
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False   # as it was, after the load
    assert datasets.config.HF_HUB_OFFLINE is False


def test_offline_hub_name(monkeypatch):
    """Refused before `datasets` is asked: with no network and no offline mode set, it
    retried for half a minute (26 s here) before failing."""
    import datasets

    def no_network(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("engine.model_source.socket.create_connection", no_network)
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *args, **kwargs: pytest.fail("datasets was asked"))
    with pytest.raises(DataError) as exc:
        load_pairs("Dahoas/rm-static")
    message = one_line(exc)
    assert "cannot load dataset 'Dahoas/rm-static'" in message
    assert "unreachable (offline?)" in message
    assert "data.path" in message


@pytest.mark.parametrize("source", ["./no_such_dir", "../no/such", "/no/such/dir", "~/no_such"])
def test_a_mistyped_path_is_not_blamed_on_the_hub(source):
    """It was "Repo id must use alphanumeric chars" or "the hub is unreachable"."""
    with pytest.raises(DataError) as exc:
        load_pairs(source)
    assert one_line(exc) == f"no such file or directory: {source}; check data.path"


def test_records_all_skipped_say_why(tmp_path):
    """Transcripts with no "\\n\\nAssistant:" were blamed on empty answers or a rejected
    transcript not sharing the chosen prompt; each reason is counted apart now."""
    implicit = [{"chosen": f"The sky is blue {i}.", "rejected": f"It is green {i}."}
                for i in range(3)]
    def refusal(name: str, records: list[dict]) -> tuple[Path, str]:
        path = write_jsonl(tmp_path / name, records)
        with pytest.raises(DataError) as exc:
            load_pairs(str(path))
        return path, one_line(exc)

    path, said = refusal("implicit.jsonl", implicit)
    assert said == (
        f"data file {path}: no usable preference pairs (all 3 records skipped: 3 with no "
        "\"\\n\\nAssistant:\" in 'chosen' (no 'prompt' field, so read as hh-rlhf transcripts)); "
        "give the records a 'prompt' field that 'chosen' and 'rejected' answer (or set "
        "data.prompt_key to the field that holds their prompts), or write them as "
        "\"\\n\\nHuman: ...\\n\\nAssistant: ...\" transcripts")
    path, said = refusal("mixed.jsonl", implicit[:2] + HH_RECORDS[1:])
    assert said == (
        f"data file {path}: no usable preference pairs (all 4 records skipped: 2 with no "
        "\"\\n\\nAssistant:\" in 'chosen' (no 'prompt' field, so read as hh-rlhf transcripts), 1 "
        "whose 'rejected' does not share the prompt of 'chosen', 1 with an empty answer); check "
        "the data")


def test_unsupported_and_empty_files(tmp_path):
    csv = tmp_path / "a.csv"
    csv.write_text("prompt,chosen,rejected\n")
    with pytest.raises(DataError, match="unsupported data file type"):
        load_pairs(str(csv))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="no records"):
        load_pairs(str(empty))
    all_skipped = write_jsonl(
        tmp_path / "skip.jsonl", [{"prompt": "p", "chosen": "", "rejected": "r"}]
    )
    with pytest.raises(DataError, match="no usable preference pairs"):
        load_pairs(str(all_skipped))
    with pytest.raises(DataError, match="built-in demo task"):
        load_pairs("demo")


# ---------------------------------------------------------------------------------------------
# Splitting and blending


def test_split_indices():
    parts = split_indices(100, (2, 4, 4), seed=1)
    assert [len(p) for p in parts] == [20, 40, 40]
    assert sorted(i for p in parts for i in p) == list(range(100))
    assert split_indices(100, (2, 4, 4), seed=1) == parts
    assert split_indices(100, (2, 4, 4), seed=2) != parts
    assert [len(p) for p in split_indices(10, (1, 0, 0), seed=0)] == [10, 0, 0]
    assert [len(p) for p in split_indices(7, (1, 1, 1), seed=0)] == [2, 3, 2]
    with pytest.raises(ValueError):
        split_indices(10, (0, 0, 0), seed=0)


def test_train_eval_split():
    items = list(range(50))
    train, evals = train_eval_split(items, 0.1, seed=3)
    assert len(evals) == 5 and len(train) == 45
    assert sorted(train + evals) == items
    assert train_eval_split(items, 0.1, seed=3) == (train, evals)
    assert train_eval_split(items, 0.1, seed=4) != (train, evals)
    assert [len(x) for x in train_eval_split([1, 2], 0.01, seed=0)] == [1, 1]
    assert train_eval_split([1, 2, 3], 0.0, seed=0) == ([1, 2, 3], [])
    assert train_eval_split([1], 0.5, seed=0) == ([1], [])


def _pairs(tag: str, n: int) -> list[PreferencePair]:
    """hh-rlhf pairs, which a data file gives back as written."""
    return [PreferencePair(f"\n\nHuman: {tag}{i}\n\nAssistant:", " c", " r") for i in range(n)]


def test_load_blend(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [p._asdict() for p in _pairs("a", 30)])
    demo = _pairs("demo", 20)
    steps = load_blend([str(a), "demo"], (2, 4, 4), seed=7, demo_pairs=lambda: demo)
    assert [len(s) for s in steps] == [6 + 4, 12 + 8, 12 + 8]
    for step in steps:
        assert any(p.prompt.startswith("\n\nHuman: a") for p in step)
        assert any(p.prompt.startswith("\n\nHuman: demo") for p in step)
    everything = [p for step in steps for p in step]
    assert sorted(everything) == sorted(_pairs("a", 30) + demo)
    assert load_blend([str(a), "demo"], (2, 4, 4), seed=7, demo_pairs=lambda: demo) == steps
    assert load_blend([str(a), "demo"], (2, 4, 4), seed=8, demo_pairs=lambda: demo) != steps
    with pytest.raises(DataError, match="demo"):
        load_blend(["demo"], (2, 4, 4), seed=7)


def test_a_demo_directory_here_is_named_not_read(tmp_path, monkeypatch, caplog):
    """'demo' is the built-in task even where ./demo exists (a user's own data): said, not
    silently passed over."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    write_jsonl(tmp_path / "demo" / "pairs.jsonl", [p._asdict() for p in _pairs("mine", 5)])
    demo = _pairs("demo", 10)
    steps = load_blend(["demo"], (2, 4, 4), seed=7, demo_pairs=lambda: demo)
    assert sorted(p for step in steps for p in step) == sorted(demo)
    assert "./demo here is not read (pass ./demo to read it)" in caplog.text


# ---------------------------------------------------------------------------------------------
# Tokenizing


@pytest.fixture
def opt_tokenizer(opt_tokenizer_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(opt_tokenizer_path))


HELLO = [PreferencePair("Hello", " world", " there")]


def test_tokenize_sft_exact(opt_tokenizer):
    # "Hello" -> [2 (BOS), 31414]; " world" -> [232]; " there" -> [89]; EOS 2
    examples, stats = tokenize_sft(HELLO, opt_tokenizer, max_prompt_len=8, max_answer_len=8)
    assert examples == [SFTExample([2, 31414, 232, 2], [-100, -100, 232, 2])]
    assert stats == TokenizeStats(kept=1, dropped_long_prompt=0, truncated_answer=0)


def test_tokenize_pairs_and_prompts_exact(opt_tokenizer):
    examples, stats = tokenize_pairs(HELLO, opt_tokenizer, max_prompt_len=8, max_answer_len=8)
    assert examples == [PairExample([2, 31414, 232, 2], [2, 31414, 89, 2])]
    assert stats == TokenizeStats(1, 0, 0)
    prompts, stats = tokenize_prompts(HELLO, opt_tokenizer, max_prompt_len=2)
    assert prompts == [[2, 31414]]
    assert stats == TokenizeStats(1, 0, 0)


def test_an_answer_ending_in_eos_gets_no_second_one(opt_tokenizer):
    """" world</s>" was trained as [232, 2, 2] (as OpenRLHF and TRL, EOS is appended only
    when the answer does not end in it)."""
    pair = [PreferencePair("Hello", " world</s>", " there")]
    (sft,), _ = tokenize_sft(pair, opt_tokenizer, max_prompt_len=8, max_answer_len=8)
    assert sft == SFTExample([2, 31414, 232, 2], [-100, -100, 232, 2])
    (rm,), _ = tokenize_pairs(pair, opt_tokenizer, max_prompt_len=8, max_answer_len=8)
    assert rm == PairExample([2, 31414, 232, 2], [2, 31414, 89, 2])


def test_tokenize_long_prompt_and_answer(opt_tokenizer):
    pairs = [
        PreferencePair("Hello " * 10, " world", " there"),  # 11 prompt tokens: dropped
        PreferencePair("Hello", " world" * 5, " there"),  # 6 answer tokens -> cut to 3
    ]
    examples, stats = tokenize_sft(pairs, opt_tokenizer, max_prompt_len=4, max_answer_len=3)
    assert examples == [SFTExample([2, 31414, 232, 232, 232], [-100, -100, 232, 232, 232])]
    assert stats == TokenizeStats(kept=1, dropped_long_prompt=1, truncated_answer=1)
    # a reward model reads its score at EOS, so its cut answers keep one (SFT's do not: it
    # would learn to stop mid-answer)
    examples, stats = tokenize_pairs(pairs, opt_tokenizer, max_prompt_len=4, max_answer_len=3)
    assert examples == [PairExample([2, 31414, 232, 232, 2], [2, 31414, 89, 2])]
    assert stats == TokenizeStats(kept=1, dropped_long_prompt=1, truncated_answer=1)
    prompts, stats = tokenize_prompts(pairs, opt_tokenizer, max_prompt_len=4)
    assert prompts == [[2, 31414]]
    assert stats == TokenizeStats(kept=1, dropped_long_prompt=1, truncated_answer=0)


def _no_bos():
    """The byte tokenizer adding no special tokens, as GPT-2's and Qwen's add none."""
    tok = byte_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A",
                                                                         special_tokens=[])
    assert tok("")["input_ids"] == []
    return tok


def test_an_empty_prompt_is_no_step_3_prompt(capsys):
    """With no BOS an empty prompt is 0 tokens: step 3 crashed generating from nothing
    (IndexError). It is dropped and counted there; SFT and reward-model examples keep it
    (the answer alone is still text to learn and to score)."""
    tok = _no_bos()
    pairs = [PreferencePair("", " a", " b"), PreferencePair("Hi", " a", " b")]
    prompts, stats = tokenize_prompts(pairs, tok, max_prompt_len=8)
    assert prompts == [tok("Hi")["input_ids"]]
    assert stats == TokenizeStats(kept=1, dropped_long_prompt=0, truncated_answer=0,
                                  dropped_empty_prompt=1)
    report_tokenized("step 3 prompts", stats, 8)
    assert capsys.readouterr().out == "step 3 prompts: 1 examples, 1 dropped (empty prompt: 0 " \
                                      "tokens)\n"
    (sft, _), stats = tokenize_sft(pairs, tok, 8, 8)
    assert sft.labels == sft.input_ids == [*tok(" a")["input_ids"], tok.eos_token_id]
    assert stats == TokenizeStats(2, 0, 0)
    assert tokenize_pairs(pairs, tok, 8, 8)[1] == TokenizeStats(2, 0, 0)
    _, stats = tokenize_prompts([pairs[0], PreferencePair("Hello", " a", " b")], tok, 2)
    with pytest.raises(DataError) as exc:
        require_examples(3, "prompts", stats, 2)
    assert one_line(exc) == ("step 3 has no prompts after filtering: 1 of 2 prompts are longer "
                             "than data.max_prompt_len=2 tokens, 1 of 2 prompts are empty (0 "
                             "tokens); add data or raise data.max_prompt_len")


def test_the_answers_cut_are_counted_as_answers(opt_tokenizer, capsys):
    """Step 2's "N answers cut" counted pairs with an answer cut: 1 here, not 2."""
    pairs = [PreferencePair("Hello", " world" * 5, " there" * 5)]
    _, stats = tokenize_pairs(pairs, opt_tokenizer, max_prompt_len=4, max_answer_len=3)
    assert stats == TokenizeStats(kept=1, dropped_long_prompt=0, truncated_answer=2)
    report_tokenized("step 2 train", stats, 4, 3)
    assert capsys.readouterr().out == ("step 2 train: 1 examples, 2 answers cut to "
                                       "data.max_answer_len=3 tokens\n")


def test_step_2_drops_and_counts_pairs_whose_answers_are_the_same_tokens(opt_tokenizer, capsys):
    """A tie (the same answer twice, or two that part only past max_answer_len) has a zero
    gradient in the pairwise loss and counted as a wrong answer in step 2's accuracy."""
    pairs = [PreferencePair("Hello", " world", " world"),                # the same text
             PreferencePair("Hello", " a b c d e", " a b c x y"),         # the same once cut
             PreferencePair("Hello", " world", " there")]
    examples, stats = tokenize_preferences(pairs, opt_tokenizer, max_prompt_len=8,
                                           max_answer_len=4)
    assert stats == TokenizeStats(kept=1, dropped_long_prompt=0, truncated_answer=0,
                                  dropped_tied=2)
    assert examples == tokenize_pairs(pairs[2:], opt_tokenizer, 8, 4)[0]
    # step 3 scores an answer as a pair of it with itself: nothing is dropped there
    assert tokenize_pairs(pairs, opt_tokenizer, 8, 4)[1].kept == 3
    assert tokenize_preferences(pairs, opt_tokenizer, 8, 5)[1].dropped_tied == 1
    report_tokenized("step 2 train", stats, 8, 4)
    assert capsys.readouterr().out == (
        "step 2 train: 1 examples, 2 dropped "
        "(chosen and rejected the same tokens, up to data.max_answer_len=4: no preference to "
        "learn)\n")
    _, stats = tokenize_preferences(pairs[:2], opt_tokenizer, 8, 4)
    with pytest.raises(DataError) as exc:
        require_examples(2, "training pairs", stats, 8)
    assert one_line(exc) == ("step 2 has no training pairs after filtering: 2 of 2 pairs have "
                             "the same chosen and rejected tokens up to data.max_answer_len; add "
                             "data or raise data.max_answer_len where answers part past it")


def test_tokenizer_without_eos(opt_tokenizer):
    opt_tokenizer.eos_token = None
    with pytest.raises(DataError, match="eos_token_id"):
        tokenize_sft(HELLO, opt_tokenizer, 8, 8)


def test_tokenize_real_hh_rlhf(hh_rlhf_path, opt_tokenizer):
    pairs, _ = load_pairs(str(hh_rlhf_path))
    examples, stats = tokenize_pairs(pairs, opt_tokenizer, max_prompt_len=256, max_answer_len=256)
    assert stats.kept == len(examples) > 0
    assert stats.kept + stats.dropped_long_prompt == len(pairs)
    assert all(len(ex.chosen_ids) <= 512 and ex.chosen_ids[0] == 2 for ex in examples)


# ---------------------------------------------------------------------------------------------
# Collating


def test_collate_sft_right_pads():
    batch = [SFTExample([5, 6, 7], [-100, 6, 7]), SFTExample([8], [8])]
    out = collate_sft(batch, pad_token_id=1)
    assert torch.equal(out["input_ids"], torch.tensor([[5, 6, 7], [8, 1, 1]]))
    assert torch.equal(out["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(out["labels"], torch.tensor([[-100, 6, 7], [8, -100, -100]]))
    assert out["input_ids"].dtype == torch.long


def test_collate_pairs_chosen_then_rejected():
    batch = [PairExample([5, 6], [5, 7, 8]), PairExample([9], [9, 4])]
    out = collate_pairs(batch, pad_token_id=0)
    assert torch.equal(out["input_ids"], torch.tensor([[5, 6, 0], [9, 0, 0], [5, 7, 8], [9, 4, 0]]))
    assert torch.equal(
        out["attention_mask"], torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    )


def test_collate_prompts_left_pads():
    out = collate_prompts([[2, 5, 6], [2]], pad_token_id=1)
    assert torch.equal(out["input_ids"], torch.tensor([[2, 5, 6], [1, 1, 2]]))
    assert torch.equal(out["attention_mask"], torch.tensor([[1, 1, 1], [0, 0, 1]]))
    with pytest.raises(ValueError):
        collate_prompts([], pad_token_id=1)


def test_every_tokenized_split_says_how_many_it_dropped(capsys):
    """Held-out examples whose prompt is too long are dropped like training ones, and the
    count is printed for both (the eval set used to shrink unsaid, to none: "eval
    perplexity nan" with no reason)."""
    pairs = [PreferencePair(("long " * 20 if i % 2 else "") + f"Q{i}", " a", " b")
             for i in range(40)]
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"seed": 5, "data": {
        "eval_fraction": 0.5, "max_prompt_len": 32, "max_answer_len": 8}})
    train, evals = train_eval_examples(cfg, 1, "examples", pairs, byte_tokenizer(), tokenize_sft)
    _, held_out = train_eval_split(pairs, 0.5, 5)
    long = sum(p.prompt.startswith("long") for p in held_out)
    assert 0 < long < len(held_out) and len(evals) == len(held_out) - long
    printed = capsys.readouterr().out
    assert f"step 1 eval: {len(evals)} examples, {long} dropped (prompt > data.max_prompt_len" \
        in printed


def test_max_samples_caps_every_steps_training_examples_after_the_filters(capsys):
    """data.max_samples (OpenRLHF's --max_samples): a seeded random choice of that many of
    the examples that pass the length filters, in their order; the held-out ones stay."""
    from steps.ppo import load_prompts

    pairs = [PreferencePair(("long " * 20 if i % 4 == 0 else "") + f"Q{i}", " a", " b")
             for i in range(40)]
    settings = {"seed": 5, "data": {"eval_fraction": 0.25, "max_prompt_len": 32,
                                    "max_answer_len": 8}}
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), settings)
    every, evals = train_eval_examples(cfg, 2, "pairs", pairs, byte_tokenizer(), tokenize_pairs)
    every_prompt = load_prompts(cfg, byte_tokenizer(), pairs, []).train
    assert len(every) == len(every_prompt) == 22   # 30 trained, 8 of them too long
    capsys.readouterr()
    cfg.data.max_samples = 10
    capped, capped_evals = train_eval_examples(cfg, 2, "pairs", pairs, byte_tokenizer(),
                                               tokenize_pairs)
    assert capped_evals == evals and len(capped) == 10
    where = [every.index(example) for example in capped]
    assert where == sorted(where) and where != list(range(10))   # a choice, in order
    again, _ = train_eval_examples(cfg, 2, "pairs", pairs, byte_tokenizer(), tokenize_pairs)
    assert again == capped   # the same on every run and rank
    prompts = load_prompts(cfg, byte_tokenizer(), pairs, []).train
    assert len(prompts) == 10 and set(map(tuple, prompts)) <= set(map(tuple, every_prompt))
    printed = capsys.readouterr().out
    assert "step 2 train: trains on 10 of its 22 examples (data.max_samples=10)" in printed
    assert "step 3 prompts: trains on 10 of its 22 examples (data.max_samples=10)" in printed
    cfg.data.max_samples = 22   # all there are: nothing to say
    assert train_eval_examples(cfg, 2, "pairs", pairs, byte_tokenizer(),
                               tokenize_pairs)[0] == every
    assert "max_samples" not in capsys.readouterr().out


def test_a_step_given_no_pairs_says_so():
    with pytest.raises(DataError) as exc:
        require_examples(1, "training examples", TokenizeStats(0, 0, 0), 8)
    assert one_line(exc) == ("step 1 has no training examples: its share of data.split holds "
                             "no pairs; add data or raise its weight in data.split")


def test_ptx_with_every_example_dropped_is_refused():
    """ppo.ptx.enabled=true with all of step 1's examples too long logged "0 examples, 2
    dropped" and trained without PTX."""
    from steps.ppo import load_prompts

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {"data": {
        "eval_fraction": 0.0, "max_prompt_len": 8, "max_answer_len": 8},
        "ppo": {"ptx": {"enabled": True}}})
    prompts = [PreferencePair("Q", " a", " b")]
    long = [PreferencePair("long " * 5, " a", " b")] * 2
    with pytest.raises(DataError) as exc:
        load_prompts(cfg, byte_tokenizer(), prompts, long)
    assert one_line(exc) == ("step 3 has no PTX examples (step 1's share) after filtering: 2 of "
                             "2 prompts are longer than data.max_prompt_len=8 tokens; add data, "
                             "raise data.max_prompt_len or set ppo.ptx.enabled=false")
    assert len(load_prompts(cfg, byte_tokenizer(), prompts, prompts).ptx) == 1


@pytest.mark.parametrize("sft_keys, targets", [
    ({}, [" yes"]), ({"multiturn": True}, [" sure", " yes"]),
    ({"train_on_prompt": True}, ["<s>\n\nHuman: hi\n\nAssistant: sure\n\nHuman: and?"
                                 "\n\nAssistant: yes"])])
def test_ptx_trains_on_step_1s_targets(sft_keys, targets):
    """ppo.ptx's examples have the targets step 1 trained on: the last reply, every reply
    (sft.multiturn) or every token (sft.train_on_prompt)."""
    from steps.ppo import load_prompts

    tok = byte_tokenizer()
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "data": {"eval_fraction": 0.0}, "sft": sft_keys, "ppo": {"ptx": {"enabled": True}}})
    dialogue = PreferencePair("\n\nHuman: hi\n\nAssistant: sure\n\nHuman: and?\n\nAssistant:",
                              " yes", "")
    (example,) = load_prompts(cfg, tok, [PreferencePair("Q", " a", " b")], [dialogue]).ptx
    assert target_texts(example, tok) == [*targets[:-1], targets[-1] + tok.eos_token]


def _sentencepiece_like():
    """A tokenizer built as Llama-2's tokenizer.json is (a "▁" prepended to every text and
    standing for spaces, BPE within words, byte fallback), trained here on two lines."""
    core = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    core.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    core.train_from_iterator(["Human: hi there\n\nAssistant: yes I can help",
                              "Human: what is 2+2\n\nAssistant: the answer is 4"] * 50,
                             trainers.BpeTrainer(vocab_size=120,
                                                 special_tokens=["<unk>", "<s>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<unk>")


def test_an_answer_is_tokenized_as_it_follows_its_prompt():
    """With a tokenizer that marks the start of every text (Llama-2's, Mistral's), an answer
    tokenized alone began with a lone "▁" that generating after the prompt never makes,
    and decoded to a double space; its ids are now those of prompt + answer after the
    prompt's, for SFT and reward-model examples alike. OPT's and the byte tokenizer's ids
    are unchanged (their answers tokenize the same either way)."""
    tok = _sentencepiece_like()
    pair = PreferencePair("\n\nHuman: hi there\n\nAssistant:", " yes I can help", " the answer")
    whole = tok(pair.prompt + pair.chosen, add_special_tokens=False)["input_ids"]
    assert tok(pair.chosen, add_special_tokens=False)["input_ids"][0] == tok.convert_tokens_to_ids(
        "▁")   # the lone marker the answer alone starts with
    (sft,), _ = tokenize_sft([pair], tok, 64, 64)
    answer = sft.input_ids[len(tok(pair.prompt)["input_ids"]):-1]   # between prompt and EOS
    assert tok(pair.prompt, add_special_tokens=False)["input_ids"] + answer == whole
    (pairs,), _ = tokenize_pairs([pair], tok, 64, 64)
    for ids, answer in ((sft.input_ids, pair.chosen), (pairs.chosen_ids, pair.chosen),
                        (pairs.rejected_ids, pair.rejected)):
        assert tok.decode(ids, skip_special_tokens=True) == pair.prompt + answer


def _appending_eos():
    """The byte tokenizer with a post-processor that also appends EOS (Llama's
    add_eos_token=True does this)."""
    tok = byte_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    assert tok("Hi")["input_ids"] == [1, 43, 76, 2]
    return tok


def test_prompts_keep_the_special_tokens_that_lead_and_drop_those_that_end(opt_tokenizer):
    """A post-processor's EOS stays out of prompts (SFT, reward and step-3 prompts all
    ended in EOS, so the model learnt to answer after the end of the text), and a prompt
    rendered with its own BOS gets no second one. OPT, whose BOS is its EOS, keeps it."""
    tok = _appending_eos()
    pair = PreferencePair("Human: hi\n\nAssistant:", " Hello!", " Go away.")
    bare = tok(pair.prompt, add_special_tokens=False)["input_ids"]
    answer = tok(pair.chosen, add_special_tokens=False)["input_ids"]
    (prompt,), _ = tokenize_prompts([pair], tok, 64)
    assert prompt == [1, *bare]
    (sft,), _ = tokenize_sft([pair], tok, 64, 64)
    assert sft.input_ids == [1, *bare, *answer, 2]
    rendered = PreferencePair("<s>" + pair.prompt, " Hello!", " Go away.")
    (prompt,), _ = tokenize_prompts([rendered], tok, 64)
    assert prompt == [1, *bare]
    (prompt,), _ = tokenize_prompts([pair], opt_tokenizer, 64)
    assert prompt == opt_tokenizer(pair.prompt)["input_ids"] and prompt[0] == 2


def test_rollout_answers_decode_as_they_follow_their_prompts():
    """Decoded alone, a SentencePiece answer lost its leading space: a reward function saw
    prompt + answer as "Assistant:yes" where the text is "Assistant: yes"."""
    tok = _sentencepiece_like()
    pair = PreferencePair("\n\nHuman: hi there\n\nAssistant:", " yes I can help", " no")
    (prompt,), _ = tokenize_prompts([pair], tok, 64)
    (sft,), _ = tokenize_sft([pair], tok, 64, 64)
    prompts, answers = decode_rollouts(tok, torch.tensor([sft.input_ids]), len(prompt))
    assert answers == [pair.chosen] and prompts[0] + answers[0] == pair.prompt + pair.chosen


def test_margins_are_read_from_their_field_and_reach_the_batch(tmp_path):
    """data.margin_key: each record's margin, for text and chat-message records alike,
    kept through the skipping of records, tokenizing and collating (margins [B], in the
    pairs' order); unread without the key; a missing or non-numeric one is refused."""
    records = [{"prompt": "\n\nHuman: a\n\nAssistant:", "chosen": " x", "rejected": " y",
                "margin": 2},
               {"prompt": "\n\nHuman: b\n\nAssistant:", "chosen": " ", "rejected": " y",
                "margin": 9.0},   # skipped: an empty answer
               {"prompt": "\n\nHuman: c\n\nAssistant:", "chosen": " z", "rejected": " w",
                "margin": 0.5}]
    path = write_jsonl(tmp_path / "m.jsonl", records)
    pairs, skipped = load_pairs(str(path), Fields(margin="margin"))
    assert skipped == 1 and [pair.margin for pair in pairs] == [2.0, 0.5]
    assert [pair.margin for pair in load_pairs(str(path))[0]] == [None, None]
    chats = write_jsonl(tmp_path / "chat.jsonl", [
        {"chosen": _chat(("user", "hi"), ("assistant", "Hello!")),
         "rejected": _chat(("user", "hi"), ("assistant", "Go.")), "score_gap": 1.5}])
    assert load_pairs(str(chats), Fields(margin="score_gap"))[0][0].margin == 1.5
    tok = byte_tokenizer()
    examples, _ = tokenize_preferences(pairs, tok, 64, 64)
    assert [example.margin for example in examples] == [2.0, 0.5]
    assert collate_pairs(examples, tok.pad_token_id)["margins"].tolist() == [2.0, 0.5]
    assert "margins" not in collate_pairs(tokenize_preferences(load_pairs(str(path))[0], tok,
                                                               64, 64)[0], tok.pad_token_id)
    with pytest.raises(DataError, match=r"records have no 'gap' field .* set data.margin_key "
                                        r"to the field that holds it"):
        load_pairs(str(path), Fields(margin="gap"))
    records[2]["margin"] = "big"
    with pytest.raises(DataError, match=r"m.jsonl record 3: field 'margin' \(data.margin_key\) "
                                        r'is "big", not a finite number'):
        load_pairs(str(write_jsonl(tmp_path / "m.jsonl", records)), Fields(margin="margin"))


def test_records_with_fields_of_other_names(tmp_path):
    """data.prompt_key / chosen_key / rejected_key: stack-exchange-paired's fields, and chat
    messages under other names; a field that is missing is named with the key to set."""
    paired = Fields("question", "response_j", "response_k")
    path = write_jsonl(tmp_path / "se.jsonl", [
        {"qid": 1, "question": "Why?", "response_j": " Because.", "response_k": " No."}])
    asked = ({"role": "user", "content": "Why?"},)
    assert load_pairs(str(path), paired) == ([PreferencePair(
        "\n\nHuman: Why?\n\nAssistant:", " Because.", " No.", asked)], 0)
    # the prompt field's name forgotten: the records read as transcripts, none has a turn
    with pytest.raises(DataError) as exc:
        load_pairs(str(path), Fields("prompt", "response_j", "response_k"))
    assert ("1 with no \"\\n\\nAssistant:\" in 'response_j' (no 'prompt' field, so read as "
            "hh-rlhf transcripts)); give the records a 'prompt' field that 'response_j' and "
            "'response_k' answer (or set data.prompt_key to the field that holds their "
            "prompts)") in one_line(exc)
    chats = Fields("prompt", "good", "bad")
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"good": _chat(("user", "hi"), ("assistant", "Hello!")),
         "bad": _chat(("user", "hi"), ("assistant", "Go."))}])
    (pair,), _ = load_pairs(str(path), chats)
    assert pair[:3] == ("\n\nHuman: hi\n\nAssistant:", " Hello!", " Go.")
    # the rejected answers of another shape are named against the chosen ones' field
    texts = write_jsonl(tmp_path / "texts.jsonl", [
        {"good": _chat(("user", "hi"), ("assistant", "Hello!")), "bad": "Go."}])
    with pytest.raises(DataError, match=r"field 'bad' is not a list of chat messages \(got "
                                        r"str\) as 'good' is elsewhere"):
        load_pairs(str(texts), chats)
    with pytest.raises(DataError, match=r"records have no 'response_j' field \(columns: good, "
                                        r"bad\); .*or set data.chosen_key to the field"):
        load_pairs(str(path), paired)
    sft, reward, ppo = load_blend([str(tmp_path / "se.jsonl")] * 5, [1, 0, 0], 0, fields=paired)
    assert len(sft) == 5 and not reward and not ppo


def test_sft_records_of_their_own(tmp_path):
    """data.sft_path: a prompt answered by another field (Alpaca's instruction/output), a
    bare prompt asked as the user's turn and the answer after "Assistant:"'s space; or whole
    dialogues (UltraChat's messages) answered by their last assistant message. Empty prompts
    or answers, and dialogues without a final answer, are skipped and counted."""
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Name a color.", "output": "Blue."},
        {"instruction": "\n\nHuman: hey\n\nAssistant:", "output": " Hello."},   # as written
        {"instruction": "", "output": "x"}, {"instruction": "Hi", "output": " "}])
    examples, skipped = load_sft_records(str(alpaca), "instruction", "output")
    assert skipped == 2
    assert [e[:3] for e in examples] == [("\n\nHuman: Name a color.\n\nAssistant:", " Blue.", ""),
                                         ("\n\nHuman: hey\n\nAssistant:", " Hello.", "")]
    chats = write_jsonl(tmp_path / "chats.jsonl", [
        {"messages": _chat(("system", "Be brief."), ("user", "hi"), ("assistant", "Hello!"))},
        {"messages": _chat(("user", "hi"))}])
    (example,), skipped = load_sft_records(str(chats), "messages", "response")
    assert skipped == 1
    assert example[:3] == ("Be brief.\n\nHuman: hi\n\nAssistant:", " Hello!", "")
    assert example.messages == tuple(_chat(("system", "Be brief."), ("user", "hi")))
    with pytest.raises(DataError, match=r"records have no 'response' field \(columns: "
                                        r"instruction, output\); set data.sft_answer_key"):
        load_sft_records(str(alpaca), "instruction", "response")
    with pytest.raises(DataError, match=r"records have no 'prompt' field .*; set "
                                        r"data.sft_prompt_key to the field"):
        load_sft_records(str(alpaca), "prompt", "output")


def test_multiturn_trains_on_every_assistant_reply_of_a_dialogue(tmp_path):
    """sft.multiturn: a dialogue's earlier assistant replies are targets too, each as its
    "Assistant:" turn writes it (after the space), never the user's or system's turns or
    the turn markers; in UltraChat's messages, hh text as written and DeepSpeed-Chat's
    single-spaced turns alike. Without it only the last reply is."""
    tok = byte_tokenizer()
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": _chat(
        ("system", "Be brief."), ("user", "hi"), ("assistant", "Hello!"), ("user", "2+2?"),
        ("assistant", "4"), ("user", "and 3+3?"), ("assistant", "6"))}])
    pairs, _ = load_sft_records(str(chats), "messages", "response")
    pairs += [PreferencePair("\n\nHuman: a\n\nAssistant: b c\n\nHuman: d\n\nAssistant:", " e", ""),
              PreferencePair(" Human: a Assistant: b Human: c Assistant:", " d", ""),
              PreferencePair("\n\nHuman: one turn\n\nAssistant:", " yes", "")]
    examples, stats = tokenize_sft(pairs, tok, 256, 16, multiturn=True)
    eos = tok.eos_token
    assert [target_texts(example, tok) for example in examples] == [
        [" Hello!", " 4", " 6" + eos], [" b c", " e" + eos], [" b", " d" + eos], [" yes" + eos]]
    assert (stats.earlier_replies, stats.unplaced_replies) == (4, 0)
    alone, stats = tokenize_sft(pairs, tok, 256, 16)
    assert [target_texts(example, tok) for example in alone] == [
        [" 6" + eos], [" e" + eos], [" d" + eos], [" yes" + eos]]
    assert [ex.input_ids for ex in alone] == [ex.input_ids for ex in examples]
    assert stats.earlier_replies == 0


def test_an_alpaca_input_follows_its_instruction_after_a_blank_line(tmp_path):
    """data.sft_input_key (default input): Alpaca's input is what its instruction works on,
    the user's turn after a blank line; it was dropped unsaid. Empty or null inputs add
    nothing; beside chat messages or hh turns, or not text, one is refused naming the
    record; data.sft_input_key=null reads none."""
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Translate. ", "input": " Hallo\n", "output": "Hello"},
        {"instruction": "Name a color.", "input": "", "output": "Blue"},
        {"instruction": "Name a fruit.", "input": None, "output": "Apple"}])
    examples, _ = load_sft_records(str(alpaca), "instruction", "output", "input")
    assert [e.prompt for e in examples] == ["\n\nHuman: Translate.\n\nHallo\n\nAssistant:",
                                            "\n\nHuman: Name a color.\n\nAssistant:",
                                            "\n\nHuman: Name a fruit.\n\nAssistant:"]
    assert examples[0].messages == ({"role": "user", "content": "Translate.\n\nHallo"},)
    unread, _ = load_sft_records(str(alpaca), "instruction", "output", None)
    assert unread[0].prompt == "\n\nHuman: Translate.\n\nAssistant:"
    for record, why in [
            ({"instruction": "\n\nHuman: hi\n\nAssistant:", "input": "x", "output": "y"},
             "field 'input' beside a prompt of chat messages or hh turns"),
            ({"instruction": _chat(("user", "hi")), "input": "x", "output": "y"},
             "field 'input' beside a prompt of chat messages or hh turns"),
            ({"instruction": "hi", "input": 3, "output": "y"}, r"field 'input' is not text")]:
        bad = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "ok", "output": "y"}, record])
        with pytest.raises(DataError, match=rf"record 2: {why}.*data.sft_input_key=null"):
            load_sft_records(str(bad), "instruction", "output", "input")


def test_a_bare_prompt_is_one_user_turn_in_every_step(tmp_path):
    """A prompt field of bare text (stack-exchange-paired's question) is asked as step 3
    asks ppo.prompt_data's and chat.py asks: "\\n\\nHuman: ...\\n\\nAssistant:", the
    answers after one space. Used as written, step 1 trained on "What is 2+3?5" while step 3
    and chat.py asked the model in hh text it had never read."""
    records = [{"question": "What is 2+3?", "good": "5", "bad": " 6"},
               {"question": "", "good": "alone", "bad": "x"},                  # stays empty
               {"question": "\n\nHuman: hi\n\nAssistant:", "good": " yo", "bad": " no"}]
    path = str(write_jsonl(tmp_path / "q.jsonl", records))
    pairs, _ = load_pairs(path, Fields("question", "good", "bad"))
    asked = load_prompt_records(path, "question")[0][0]
    assert pairs[0].prompt == asked.prompt == "\n\nHuman: What is 2+3?\n\nAssistant:"
    assert pairs[0][1:] == (" 5", " 6", asked.messages, None, None)   # no label, no margin
    assert pairs[1][:3] == ("", "alone", "x")
    assert pairs[2][:3] == ("\n\nHuman: hi\n\nAssistant:", " yo", " no")


def test_a_prompt_as_deepspeed_chat_writes_it_is_read_as_written(tmp_path):
    """DeepSpeed-Chat's get_prompt() writes " Human: ... Assistant:": turns already, not
    a bare question to frame again as "\\n\\nHuman:  Human: ..."."""
    path = write_jsonl(tmp_path / "ds.jsonl", [
        {"prompt": " Human: What is 2+3? Assistant:", "chosen": " 5", "rejected": " 6"}])
    (pair,), _ = load_pairs(str(path))
    assert pair[:3] == (" Human: What is 2+3? Assistant:", " 5", " 6")
    assert load_prompt_records(str(path))[0][0].prompt == " Human: What is 2+3? Assistant:"


def test_an_sft_answer_follows_the_cue_as_a_message_does(tmp_path):
    """An answer opening with a newline follows "Assistant:"'s space, as the same reply
    as a chat message does (the hh template writes one before every reply); it was
    glued to the colon."""
    answer = "\n```py\nx = 1\n```"
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "Code?", "response": answer}])
    chat = write_jsonl(tmp_path / "chat.jsonl", [
        {"messages": _chat(("user", "Code?"), ("assistant", answer))}])
    (from_text,), _ = load_sft_records(str(text))
    (from_chat,), _ = load_sft_records(str(chat), "messages")
    assert from_text[:3] == from_chat[:3] == ("\n\nHuman: Code?\n\nAssistant:", " " + answer, "")


def test_sft_answers_of_chat_messages_are_refused_naming_the_key(tmp_path):
    """TRL's prompt/completion messages: the answer field is read as text, and a list
    there was "not text ...; fix or remove that record", of the first record alone."""
    path = write_jsonl(tmp_path / "trl.jsonl", [
        {"prompt": _chat(("user", "hi")), "completion": _chat(("assistant", "Hello!"))}] * 2)
    with pytest.raises(DataError, match=r"field 'completion' holds chat messages, not text "
                                        r"answers; set data.sft_answer_key to a field"):
        load_sft_records(str(path), "prompt", "completion")
