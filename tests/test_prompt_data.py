"""ppo.prompt_data: step 3's prompts from their own records (OpenRLHF's --prompt_data), each
with a label (ppo.label_key, e.g. a math problem's reference answer) that a reward function
taking (prompt, answer, label) checks answers against, as rule-reward RL on math needs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import train
from engine.models import byte_tokenizer, prompt_ids
from engine.tracking import read_metrics
from steps.data import DataError, PreferencePair, load_prompt_records
from steps.ppo import prompt_labels, report_labels
from steps.scoring import RewardFunction, decode_rollouts, takes_label
from steps.tokenize import collate_prompts
from tests.harness.in_process import train_here


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_prompt_records_with_labels_text_and_messages(tmp_path):
    records = [{"question": "What is 2+3?", "answer": 5},
               {"question": "   ", "answer": 1},                              # empty: skipped
               {"question": "What is 1+1?"}]                                  # no label: None
    prompts, skipped = load_prompt_records(str(write_jsonl(tmp_path / "q.jsonl", records)),
                                           prompt_key="question", label_key="answer")
    assert skipped == 1
    # a bare question is the user's turn, asked in the hh-rlhf format the model trained in
    assert prompts == [
        PreferencePair("\n\nHuman: What is 2+3?\n\nAssistant:", "", "", (user("What is 2+3?"),), 5),
        PreferencePair("\n\nHuman: What is 1+1?\n\nAssistant:", "", "", (user("What is 1+1?"),),
                       None)]
    framed = write_jsonl(tmp_path / "hh.jsonl", [{"prompt": "Human: hi\n\nAssistant:"}])
    assert load_prompt_records(str(framed))[0][0].prompt == "Human: hi\n\nAssistant:"  # as is
    chats = [{"prompt": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "2+2?"}], "label": "4"},
             {"prompt": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "answered already"}], "label": "x"}]
    (prompt,), skipped = load_prompt_records(str(write_jsonl(tmp_path / "c.jsonl", chats)))
    assert skipped == 1   # a dialogue that ends in an answer has nothing to ask
    assert prompt.prompt == "Be brief.\n\nHuman: 2+2?\n\nAssistant:" and prompt.label == "4"
    assert prompt.messages == tuple(chats[0]["prompt"])


def test_hh_text_prompts_that_end_in_a_reply_are_skipped_like_such_messages(tmp_path):
    """An hh-rlhf file's `chosen` given as prompts (ppo.prompt_key=chosen) held each answer
    in its prompt, used as written with no count; hh text is read as messages are now: a
    dialogue ending in a reply is skipped and counted, one ending in a Human turn gets the
    cue to reply, in its own spacing (DeepSpeed-Chat's single spaces too)."""
    records = [{"prompt": "\n\nHuman: hi\n\nAssistant: hello there"},          # a reply
               {"prompt": "\n\nHuman: hi\n\nAssistant: yes\n\nHuman: and?"},     # no cue
               {"prompt": "\n\nHuman: hi\n\nAssistant:"},                         # as is
               {"prompt": " Human: hi Assistant: yes Human: and?"},                 # no cue
               {"prompt": " Human: hi Assistant: hello there"}]                     # a reply
    prompts, skipped = load_prompt_records(str(write_jsonl(tmp_path / "hh.jsonl", records)))
    assert skipped == 2
    assert [p.prompt for p in prompts] == [
        "\n\nHuman: hi\n\nAssistant: yes\n\nHuman: and?\n\nAssistant:",
        "\n\nHuman: hi\n\nAssistant:", " Human: hi Assistant: yes Human: and? Assistant:"]


def test_deepspeed_chat_single_spaced_turns_read_as_messages():
    """Under --apply-chat-template its " Assistant:" cue and later turns landed inside one
    user message."""
    from engine.chat_format import hh_messages
    assert hh_messages(" Human: q Assistant: a Human: r Assistant:") == [
        user("q"), {"role": "assistant", "content": "a"}, user("r")]
    assert hh_messages("\n\nHuman: q Assistant: a") == [user("q Assistant: a")]  # hh's own


def test_prompt_records_without_the_prompt_field_name_the_key(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "What is 2+3?"}])
    with pytest.raises(DataError, match=r"records have no 'prompt' field \(columns: question\); "
                                        r"set ppo.prompt_key"):
        load_prompt_records(str(path))
    with pytest.raises(DataError, match=r"data file not found: .*missing.jsonl; check "
                                        r"ppo.prompt_data"):
        load_prompt_records(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"   # said to be "0 records, all empty or ending in ..."
    empty.write_text("")
    with pytest.raises(DataError, match=rf"^data file {empty}: no records; check "
                                        r"ppo.prompt_data$"):
        load_prompt_records(str(empty))


def test_skipped_prompt_records_are_counted_and_a_file_of_only_those_is_refused(tmp_path,
                                                                               caplog):
    """Empty prompts and dialogues that end in the assistant's turn are dropped, never
    unsaid: the count is a warning naming the file, and a file with nothing else is refused
    with it."""
    from steps.data import load_prompt_data

    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "What is 2+3?"}, {"prompt": "  "},
                                                  {"prompt": ""}, {"prompt": "What is 4+4?"}])
    dialogues = write_jsonl(tmp_path / "dialogues.jsonl", [
        {"prompt": [user("hi"), {"role": "assistant", "content": "hello"}]},
        {"prompt": [user("What is 1+1?")]}])
    with caplog.at_level("WARNING", logger="steps.data"):
        pairs = load_prompt_data([str(text), str(dialogues)], "prompt", "label")
    assert len(pairs) == 3
    said = "empty prompts or dialogues ending in an assistant message"
    assert f"{text}: skipped 2 {said}" in caplog.text
    assert f"{dialogues}: skipped 1 {said}" in caplog.text
    unusable = write_jsonl(tmp_path / "unusable.jsonl", [{"prompt": ""}, {"prompt": " "}])
    with pytest.raises(DataError, match=rf"^data file {unusable}: no usable prompts \(2 "
                                        r"records, all .*\); check ppo.prompt_data$"):
        load_prompt_data([str(unusable)], "prompt", "label")


def test_a_reward_function_gets_the_label_of_its_prompt():
    """By the prompt's text as decode_rollouts gives it from left-padded rows; a function
    taking (prompt, answer) is called as before."""
    tok = byte_tokenizer()
    pairs = [PreferencePair("What is 2+3?", "", "", None, "5"),
             PreferencePair("What is 1+1?", "", "", None, "2"),
             PreferencePair("Say hi.", "", "", None, None)]
    labels = prompt_labels(pairs, tok)
    assert labels == {"What is 2+3?": "5", "What is 1+1?": "2"}
    rows = collate_prompts(prompt_ids([p.prompt for p in pairs], tok)[0], tok.pad_token_id)
    answers = tok([" 5", " 3", " !"], add_special_tokens=False)["input_ids"]
    sequences = torch.cat([rows["input_ids"], torch.tensor(answers)], dim=1)
    texts = decode_rollouts(tok, sequences, rows["input_ids"].shape[1])

    def right(prompt, answer, label):
        return float(label is not None and answer.strip() == label)

    assert takes_label(right) and takes_label(lambda prompt, answer, **extra: 0.0)
    # a third parameter of the function's own is never handed the label
    assert not takes_label(lambda prompt, answer: 0.0)
    assert not takes_label(lambda prompt, answer, weight=0.5: 0.0)
    assert RewardFunction(right, "t:right", labels=labels)(*texts) == [1.0, 0.0, 0.0]
    assert RewardFunction(lambda p, a: len(a), "t:len", labels=labels)(*texts) == [2, 2, 2]


def test_prompts_that_repeat_with_another_label_keep_the_first(capsys):
    pairs = [PreferencePair("Q", "", "", None, "1"), PreferencePair("Q", "", "", None, "2")]
    assert prompt_labels(pairs, byte_tokenizer()) == {"Q": "1"}
    assert "1 repeat an earlier prompt with another label" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# step 3 end to end

CHECKER = '''
import re
CALLS = []

def right(prompt, answer, label):
    """1 when the answer holds the reference number, else 0."""
    CALLS.append((prompt, label))
    return float(str(label) in re.findall(r"\\d+", answer))
'''


@pytest.mark.slow
def test_step3_on_prompt_data_with_a_checker_of_labels(tmp_path, monkeypatch):
    """GRPO on prompt records alone, rewarded by a checker of their labels: data.path (a hub
    name, offline here) is not read, the checker sees every prompt's own label, and the
    gold score of the evaluations is the same checker's."""
    (tmp_path / "checker_of_labels.py").write_text(CHECKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [{"question": f"\n\nHuman: What is {a}+{b}?\n\nAssistant:", "answer": a + b}
               for a in range(6) for b in range(4)]
    data = write_jsonl(tmp_path / "sums.jsonl", records)
    out = tmp_path / "run"
    # a model flag: not the demo recipe, so data.path is its default, a hub dataset
    log = train_here(["--actor-model", "tiny-llama", "--step", "3", "--output-dir", out,
                      "ppo.actor_path=tiny-llama",
                      f"ppo.prompt_data=[{data}]", "ppo.prompt_key=question",
                      "ppo.label_key=answer", "ppo.algorithm=grpo",
                      "ppo.samples_per_prompt=2", "ppo.rollout_batch_size=4",
                      "ppo.micro_batch_size=8", "ppo.max_new_tokens=4",
                      "ppo.reward_fn=checker_of_labels:right", "ppo.reward_model_weight=0",
                      "ppo.eval_reward_fn=checker_of_labels:right", "ppo.eval_prompts=2",
                      "ppo.best_of_n=2", "data.eval_fraction=0.1",
                      "logging.progress=false"]).check().stdout
    assert "step 3 prompts [" in log and "24, 24 with a 'answer' label" in log
    assert "data ['Dahoas/rm-static']" not in log
    calls = sys.modules["checker_of_labels"].CALLS
    assert calls and all(label == eval(re.search(r"(\d+\+\d+)", prompt)[1])
                         for prompt, label in calls)
    rows = read_metrics(out / "step3" / "metrics.jsonl")
    assert any("eval/ground_truth" in row for row in rows)
    assert (out / "step3" / "actor" / "model.safetensors").exists()


def test_prompt_data_is_read_only_when_step_3_runs(tmp_path):
    """A config that names step 3's prompts for a later --step 3 (here: a file not made
    yet) must not stop steps 1-2, which never use them."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "chosen": " yes", "rejected": " no"}
        for i in range(10)])
    cfg = train.build_config(train.parse_args([
        "--actor-model", "tiny-llama", "--step", "1", f"data.path=[{pairs}]",
        f"ppo.prompt_data=[{tmp_path / 'later.jsonl'}]"]))
    # data.path split between steps 1 and 2 alone (2/4/4 -> 2/4/0): step 3 has its prompts
    shares = train.load_data(cfg, [1])
    assert [len(share) for share in shares] == [3, 7, 0]
    with pytest.raises(DataError, match=r"later.jsonl; check ppo.prompt_data"):
        train.load_data(cfg, [1, 3])


def test_a_share_of_data_path_left_empty_counts_data_paths_pairs_alone(tmp_path):
    """Step 3's prompts are not data.path's pairs: counted among them, 1 pair and 24
    prompts were refused as 'none of the 25 pairs in data.path'."""
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "\n\nHuman: q\n\nAssistant:", "chosen": " yes", "rejected": " no"}])
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"q{i}"} for i in range(24)])
    cfg = train.build_config(train.parse_args([
        "--actor-model", "tiny-llama", "--step", "1", "3", f"data.path=[{pairs}]",
        f"ppo.prompt_data=[{prompts}]", "data.split=[1,4,4]"]))
    with pytest.raises(DataError, match=r"gives step 1 none of the 1 pairs in data.path"):
        train.load_data(cfg, [1, 3])


def test_a_prompt_data_source_that_cannot_be_read_names_ppo_prompt_data(tmp_path, monkeypatch):
    """Not data.path, which the fix would send the user to: hub names, directories and
    saved datasets of ppo.prompt_data are refused naming the key that gave them."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match=r"pass the local file path in ppo.prompt_data$"):
        load_prompt_records("nobody-here/math-prompts-not-cached")
    with pytest.raises(DataError, match=r"name the files in ppo.prompt_data$"):
        load_prompt_records(str(tmp_path))
    (tmp_path / "test.jsonl").write_text('{"prompt": "Hi"}\n')
    with pytest.raises(DataError, match=r"name the file to train on in ppo.prompt_data$"):
        load_prompt_records(str(tmp_path))


def test_a_prompt_record_of_another_shape_is_named_against_the_prompts(tmp_path):
    """Prompt records have no 'chosen' field to blame: a null among chat-message prompts is
    named against the prompts, which are messages elsewhere."""
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]},
                                              {"prompt": None}])
    with pytest.raises(DataError, match=r"record 2: field 'prompt' is not a list of chat "
                                        r"messages \(got null\) as 'prompt' is elsewhere"):
        load_prompt_records(str(path))


def test_labels_that_no_function_takes_are_reported(capsys):
    """Labels read for a run rewarded by the reward model alone, with no gold function,
    would otherwise go unused unsaid."""
    report_labels({"What is 2+3?": 5}, [], "answer")
    assert ("step 3: 1 prompts have a label, and no ppo.reward_fn or ppo.eval_reward_fn is set "
            "to take it: the labels are not used") in capsys.readouterr().out
    report_labels({}, [], "answer")
    assert capsys.readouterr().out == ""


def test_a_reward_function_and_labels_that_do_not_meet_are_reported(capsys):
    """A function without a `label` parameter never sees the prompts' labels, and one with
    it gets None when no prompt has a label: each is said, and a match says nothing."""
    def plain(prompt, answer):
        return 0.0

    def checked(prompt, answer, label=None):
        return 0.0

    labels = {"What is 2+3?": 5}
    report_labels(labels, [RewardFunction(plain, "t:plain", labels=labels)], "answer")
    assert ("step 3: ppo.reward_fn=t:plain has no `label` parameter: the prompts' labels are "
            "not passed to it") in capsys.readouterr().out
    report_labels({}, [RewardFunction(checked, "t:checked", "ppo.eval_reward_fn")], "answer")
    assert ("step 3: ppo.eval_reward_fn=t:checked takes a label, and no step-3 prompt has one "
            "(ppo.prompt_data records' 'answer' field): it gets None") in capsys.readouterr().out
    report_labels(labels, [RewardFunction(checked, "t:checked", labels=labels)], "answer")
    report_labels({}, [RewardFunction(plain, "t:plain")], "answer")
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------------------------------------
# step 1's examples of their own (data.sft_path)


def test_sft_path_gives_step_1_its_examples_and_data_path_the_rest(tmp_path):
    """data.sft_path replaces step 1's share: data.path is split between steps 2 and 3
    alone (its first weight ignored), and read only when they (or nothing but step 1) run."""
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": f"Say {i}.", "input": "in French" if i == 1 else "", "output": f"{i}"}
        for i in range(5)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "chosen": " yes", "rejected": " no"}
        for i in range(10)])
    cfg = train.build_config(train.parse_args([
        "--actor-model", "tiny-llama", f"data.path=[{pairs}]", f"data.sft_path=[{alpaca}]",
        "data.sft_prompt_key=instruction", "data.sft_answer_key=output", "data.split=[0,1,1]"]))
    sft, reward, ppo = train.load_data(cfg, [1, 2, 3])
    assert [len(sft), len(reward), len(ppo)] == [5, 5, 5]
    assert sft[0][:3] == ("\n\nHuman: Say 0.\n\nAssistant:", " 0", "")
    assert sft[1].prompt == "\n\nHuman: Say 1.\n\nin French\n\nAssistant:"   # data.sft_input_key
    offline = cfg.copy()
    offline.data.path = ["no-such/hub-dataset"]   # step 1 alone: data.path is not read
    assert [len(share) for share in train.load_data(offline, [1])] == [5, 0, 0]


def test_an_empty_share_counts_the_pairs_of_data_path_alone(tmp_path):
    """Step 1's own examples are no pairs of data.path: 1 pair left step 2 none "of the 6
    pairs in data.path", counting the 5 examples of data.sft_path."""
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": f"Say {i}.", "output": f"{i}"} for i in range(5)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": "\n\nHuman: q\n\nAssistant:", "chosen": " yes", "rejected": " no"}])
    cfg = train.build_config(train.parse_args([
        "--actor-model", "tiny-llama", f"data.path=[{pairs}]", f"data.sft_path=[{alpaca}]",
        "data.sft_prompt_key=instruction", "data.sft_answer_key=output", "data.split=[2,1,4]"]))
    with pytest.raises(DataError, match=r"gives step 2 none of the 1 pairs in data.path"):
        train.load_data(cfg, [1, 2])


@pytest.mark.slow
def test_step_1_trains_on_sft_path_alone(tmp_path):
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": f"What is {a}+{b}?", "output": f"{a + b}"}
        for a in range(5) for b in range(4)])
    log = train_here(["--actor-model", "tiny-llama", "--step", "1", "--output-dir",
                      tmp_path / "out", f"data.sft_path=[{alpaca}]",
                      "data.sft_prompt_key=instruction", "data.sft_answer_key=output",
                      "sft.epochs=1", "sft.batch_size=4", "logging.progress=false"]).check().stdout
    assert "step 1 examples [" in log and "]: 20" in log and "data [" not in log
    assert "step 1 train: 19 examples" in log   # one held out (data.eval_fraction 0.05)
    assert (tmp_path / "out" / "actor" / "model.safetensors").exists()


def test_held_out_prompts_past_eval_prompts_are_counted(capsys):
    """Held out by data.eval_fraction, evaluated up to ppo.eval_prompts: the rest were left
    out of both without a word."""
    from omegaconf import OmegaConf

    from steps.config import RunConfig
    from steps.ppo import load_prompts
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "data": {"eval_fraction": 0.2}, "ppo": {"eval_prompts": 8}})
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " a", " b") for i in range(100)]
    prompts = load_prompts(cfg, byte_tokenizer(), pairs, [])
    assert len(prompts.eval) == 8 and len(prompts.train) == 80
    assert ("step 3: 12 held-out prompts past ppo.eval_prompts=8 are neither trained on nor "
            "evaluated") in capsys.readouterr().out


@pytest.mark.slow
def test_held_out_data_of_their_own_for_every_step(tmp_path, monkeypatch):
    """data.eval_path: steps 1 and 2 train on all of their share of data.path and evaluate
    on its pairs; ppo.eval_prompt_data: step 3 trains on all of its prompts and evaluates
    on these, whose labels the gold scorer gets."""
    (tmp_path / "checker_of_labels.py").write_text(CHECKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "checker_of_labels", raising=False)   # its CALLS anew
    pair = lambda i: {"prompt": f"\n\nHuman: q{i}\n\nAssistant:", "chosen": " yes",  # noqa: E731
                      "rejected": " no"}
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [pair(i) for i in range(20)])
    test = write_jsonl(tmp_path / "test.jsonl", [pair(i) for i in range(100, 106)])
    held = write_jsonl(tmp_path / "held.jsonl", [
        {"prompt": f"What is {a}+{a}?", "answer": 2 * a} for a in range(3)])
    out = tmp_path / "run"
    log = train_here(["--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
                      "--output-dir", out, f"data.path=[{pairs}]", f"data.eval_path=[{test}]",
                      f"ppo.eval_prompt_data=[{held}]", "ppo.label_key=answer",
                      "ppo.eval_reward_fn=checker_of_labels:right", "ppo.best_of_n=0",
                      "ppo.eval_every=0", "ppo.rollout_batch_size=4", "ppo.micro_batch_size=4",
                      "ppo.max_new_tokens=4", "sft.batch_size=4", "rm.batch_size=4",
                      "logging.progress=false"]).check().stdout
    assert f"held-out pairs ['{test}']: 6, for steps 1 and 2" in log
    # 20 pairs split 2/4/4: 4, 8 and 8, none of them held out
    for said in ("step 1 train: 4 examples", "step 1 eval: 6 examples",
                 "step 2 train: 8 examples", "step 2 eval: 6 examples",
                 f"step 3 held-out prompts ['{held}']: 3, 3 with a 'answer' label",
                 "step 3 prompts: 8 examples", "step 3 eval prompts: 3 examples"):
        assert said in log, said
    calls = sys.modules["checker_of_labels"].CALLS
    assert calls and {label for _, label in calls} == {0, 2, 4}
    assert all(label == 2 * int(re.search(r"What is (\d+)\+", prompt)[1])
               for prompt, label in calls)
    rows = read_metrics(out / "step3" / "metrics.jsonl")
    assert any("eval/ground_truth" in row for row in rows)


def test_held_out_sources_that_hold_nothing_are_refused(tmp_path):
    """An empty data.eval_path or ppo.eval_prompt_data source is refused naming its key
    (it would leave a step unevaluated unsaid); either is read only when a step that uses
    it runs."""
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    cfg = train.build_config(train.parse_args([
        "--actor-model", "tiny-llama", f"data.eval_path=[{empty}]",
        f"ppo.eval_prompt_data=[{tmp_path / 'later.jsonl'}]"]))
    assert train.load_held_out(cfg, []) == {}
    with pytest.raises(DataError, match=rf"^data file {empty}: no records; check "
                                        r"data.eval_path$"):
        train.load_held_out(cfg, [2])
    with pytest.raises(DataError, match=r"later.jsonl; check ppo.eval_prompt_data"):
        train.load_held_out(OmegaConf.merge(cfg, {"data": {"eval_path": []}}), [1, 3])
    with pytest.raises(DataError, match=r"^data.eval_path: 'demo' is not a source of held-out"):
        train.load_held_out(OmegaConf.merge(cfg, {"data": {"eval_path": ["demo"]}}), [1])


def test_held_out_data_that_filtering_empties_is_refused(capsys):
    """Held-out data the user gave must evaluate something: all of it too long is refused
    as the training data would be, naming the key; what ppo.eval_prompts leaves out of it
    is counted (it takes nothing from training), and so is what is training data too."""
    from steps.common import train_eval_examples
    from steps.config import RunConfig
    from steps.ppo import load_prompts
    from steps.tokenize import tokenize_sft

    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "data": {"max_prompt_len": 24}, "ppo": {"eval_prompts": 2}})
    tok = byte_tokenizer()
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " a", " b") for i in range(6)]
    long = [PreferencePair(f"\n\nHuman: {'why ' * 10}{i}\n\nAssistant:", " a", " b")
            for i in range(3)]
    train_set, evals = train_eval_examples(cfg, 1, "training examples", pairs, tok,
                                           tokenize_sft, pairs[:3])
    assert len(train_set) == 6 and len(evals) == 3   # all trained on, the given ones held out
    assert ("step 1: 3 of the 3 held-out pairs (data.eval_path) are training data too; "
            "evaluate on data kept out of training") in capsys.readouterr().out
    with pytest.raises(DataError, match=r"^step 1 has no held-out examples \(data.eval_path\) "
                                        r"after filtering: 3 of 3 prompts are longer than "
                                        r"data.max_prompt_len=24 tokens; add data, raise "
                                        r"data.max_prompt_len or drop data.eval_path$"):
        train_eval_examples(cfg, 1, "training examples", pairs, tok, tokenize_sft, long)
    with pytest.raises(DataError, match=r"^step 3 has no held-out prompts \(ppo.eval_prompt_data"
                                        r"\) after filtering: .* or drop ppo.eval_prompt_data$"):
        load_prompts(cfg, tok, pairs, [], long)
    prompts = load_prompts(cfg, tok, pairs, [], pairs[:5])
    assert len(prompts.train) == 6 and len(prompts.eval) == 2
    said = capsys.readouterr().out
    assert ("step 3: 3 held-out prompts past ppo.eval_prompts=2 are not evaluated (raise "
            "ppo.eval_prompts to evaluate on them)") in said
    assert "step 3: 5 of the 5 held-out prompts (ppo.eval_prompt_data) are training" in said
    load_prompts(cfg, tok, pairs, [], [pairs[0]._replace(prompt="\n\nHuman: q\n\nAssistant:")])
    assert "training data too" not in capsys.readouterr().out
