"""data.apply_chat_template: the dialogues of all three steps written by the actor
tokenizer's chat template, the format saved with the trained model and used by chat.py;
without it, the hh-rlhf format, which is then what the model's tokenizer saves."""

from __future__ import annotations

import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from tokenizers import processors
from transformers import AutoTokenizer

import chat
from engine.chat_format import HH_TEMPLATE, turn_ends_with_eos, uses_hh, with_variables
from engine.models import (
    byte_tokenizer,
    load_causal_lm,
    load_reward_model,
    prompt_ids,
    sequence_scores,
)
from engine.parallel import frozen
from engine.runtime import Runtime
from steps import common, reward, scoring
from steps.config import RunConfig
from steps.data import DataError, PreferencePair
from steps.scoring import RewardScorer
from steps.tokenize import apply_chat_template, tokenize_pairs, tokenize_sft
from tests.harness.in_process import train_here
from tests.harness.sft_targets import target_texts

CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] "
          "+ '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Llama-2's rule: user and assistant take turns, from a user turn
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
               "{{ '[' + m['role'] + '] ' + m['content'] + '\\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}")
OWNER = "--actor-model probe"
# Qwen3's way: the reply's reasoning in <think> ... </think>, which enable_thinking=false
# writes empty into the generation prompt (the assistant's last reply carries an empty one)
THINKING = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{% if m['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}"
            "{% endif %}{{ m['content'] + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")
NO_THINKING = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def chatml(eos: str = "<|im_end|>", template: str = CHATML):
    """The built-in byte tokenizer with ChatML's turn tokens and template; <|im_end|> is its
    EOS, as in Qwen2.5-Instruct, unless `eos` says otherwise."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token, tok.chat_template = eos, template
    return tok


def without_messages(pairs: list[PreferencePair]) -> list[PreferencePair]:
    """`pairs` with no messages kept, to compare with pairs written out."""
    return [pair._replace(messages=None) for pair in pairs]


def turns(*texts: str) -> str:
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n"
                   for role, text in zip(("user", "assistant") * 3, texts, strict=False)
                   ) + "<|im_start|>assistant\n"


PAIRS = [PreferencePair("\n\nHuman: hi\n\nAssistant: Hello!\n\nHuman: and you?\n\nAssistant:",
                        " Fine.", " Bad."),
         PreferencePair("Name a color.", "Blue", "Seven")]   # a bare prompt: one user turn


def test_pairs_are_written_by_the_template():
    """hh text is read back into its turns; an answer is what the template writes after
    the prompt, ending with the turn's end token; a chat-message record's own messages
    are rendered exactly (the hh reading would split the text of this one)."""
    rendered, refused = apply_chat_template(PAIRS, chatml(), OWNER)
    assert refused == 0
    assert rendered[0].messages == ({"role": "user", "content": "hi"},   # kept: sft.multiturn
                                    {"role": "assistant", "content": "Hello!"},
                                    {"role": "user", "content": "and you?"})
    assert without_messages(rendered) == [PreferencePair(turns("hi", "Hello!", "and you?"), "Fine.<|im_end|>",
                                       "Bad.<|im_end|>"),
                        PreferencePair(turns("Name a color."), "Blue<|im_end|>",
                                       "Seven<|im_end|>")]
    said = ({"role": "user", "content": "x\n\nAssistant: y"},)
    (pair,), _ = apply_chat_template([PreferencePair("not read", " a", " b", said, margin=1.5)],
                                     chatml(), OWNER)
    assert pair.prompt == turns("x\n\nAssistant: y") and pair.messages == said
    assert pair.margin == 1.5   # data.margin_key's, kept through the rendering


def test_a_prompt_that_begins_with_the_human_turn_is_the_users():
    """A DeepSpeed-Chat style prompt field, "Human: ...\\n\\nAssistant:" (no "\\n\\n" before
    the first turn), was read as a system message "Human: hi" and no user turn."""
    pair = PreferencePair("Human: hi\n\nAssistant: Hello!\n\nHuman: and you?\n\nAssistant:",
                          " Fine.", " Bad.")
    (rendered,), refused = apply_chat_template([pair], chatml(), OWNER)
    assert refused == 0 and rendered._replace(messages=None) == PreferencePair(
        turns("hi", "Hello!", "and you?"),
                                                       "Fine.<|im_end|>", "Bad.<|im_end|>")


@pytest.mark.parametrize("eos, ending", [("<|im_end|>", ["<|im_end|>"]),
                                         ("</s>", ["<|im_end|>", "</s>"])])
def test_a_templated_answer_ends_with_the_turn_end_and_one_eos(eos, ending):
    """Where the turn's end token is the EOS (Qwen2.5-Instruct), it is not doubled; where
    it is not, the EOS follows it (generation stops on the EOS)."""
    tok = chatml(eos)
    rendered, _ = apply_chat_template(PAIRS, tok, OWNER)
    (example, _), _ = tokenize_sft(rendered, tok, max_prompt_len=64, max_answer_len=16)
    answer = [i for i in example.labels if i != -100]
    assert tok.convert_ids_to_tokens(answer[-len(ending):]) == ending
    assert tok.decode(answer, skip_special_tokens=False) == "Fine." + "".join(ending)
    assert example.input_ids[:len(example.input_ids) - len(answer)] == \
        tok(turns("hi", "Hello!", "and you?"))["input_ids"]
    assert turn_ends_with_eos(tok) == (eos == "<|im_end|>")


def test_multiturn_trains_on_each_reply_as_the_template_writes_it():
    """sft.multiturn in a chat template: each earlier reply is a target with its turn's
    end token (the model learns to end its turns), as the last is; a template that writes
    earlier replies otherwise than a reply it follows (Qwen3's drops their reasoning; here
    it capitalises them, at the same length) leaves them untrained, counted."""
    dialogue = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "3+3?"})
    pair = PreferencePair("not read", " 6", "", dialogue)
    tok = chatml()
    rendered, _ = apply_chat_template([pair], tok, OWNER)
    (example,), stats = tokenize_sft(rendered, tok, 256, 16, multiturn=True, templated=True)
    assert target_texts(example, tok) == ["Hello!<|im_end|>", "4<|im_end|>", "6<|im_end|>"]
    assert (stats.earlier_replies, stats.unplaced_replies) == (2, 0)
    capitalising = CHATML.replace("m['content']", "(m['content'] if m['role'] != 'assistant' "
                                  "or loop.last else m['content'].upper())")
    tok = chatml(template=capitalising)
    rendered, _ = apply_chat_template([pair], tok, OWNER)
    (example,), stats = tokenize_sft(rendered, tok, 256, 16, multiturn=True, templated=True)
    assert target_texts(example, tok) == ["4<|im_end|>", "6<|im_end|>"]   # "4" is "4" still
    assert (stats.earlier_replies, stats.unplaced_replies) == (1, 1)


def test_template_variables_render_as_the_keyword_arguments_would():
    """data.chat_template_kwargs set in the template itself render as apply_chat_template's
    keyword arguments do (values of every JSON kind); set again they replace the earlier
    ones, and none give the template back; a newline opening the template stays."""
    said = [{"role": "user", "content": "hi"}]
    echo = "\n{{ extra | tojson }}" + THINKING
    # lstrip_blocks strips the spaces before a template's first tag as before any other
    indented = "   {% if extra %}{{ extra }}{% endif %}\t{# a comment #}" + THINKING
    for template, variables in ((THINKING, {"enable_thinking": False}),
                                (THINKING, {"enable_thinking": True}),
                                (indented, {"extra": "x 🙂 {# end #}\n #"}),   # past the BMP
                                (echo, {"extra": {"a": [1, 2.5, None, True], "b": 'q"\né'}})):
        plain, baked = chatml(template=template), chatml(template=template)
        baked.chat_template = with_variables(template, variables)
        want = plain.apply_chat_template(said, tokenize=False, add_generation_prompt=True,
                                         **variables)
        assert baked.apply_chat_template(said, tokenize=False, add_generation_prompt=True) == want
        assert with_variables(with_variables(template, {"enable_thinking": 1}), variables) == \
            baked.chat_template
        assert with_variables(baked.chat_template, {}) == template
    assert want.startswith('\n{"a": [1, 2.5, null, true], "b": "q\\"\\né"}<|im_start|>')
    assert chatml(template=with_variables(indented, {"extra": "🙂"})).apply_chat_template(
        said, tokenize=False).startswith("🙂\t<|im_start|>")   # the three spaces stripped
    assert chatml(template=with_variables(THINKING, {"enable_thinking": False})) \
        .apply_chat_template(said, tokenize=False, add_generation_prompt=True).endswith(NO_THINKING)


def test_unset_template_variables_keep_those_a_step_before_set(tmp_path):
    """A saved actor's template keeps the variables step 1 set when a later run leaves
    data.chat_template_kwargs unset (`--step 2 3` after step 1), and {} clears them."""
    baked = with_variables(THINKING, {"enable_thinking": False})
    for kwargs, template in ((None, baked), ({}, THINKING),
                             ({"enable_thinking": True}, with_variables(THINKING, {
                                 "enable_thinking": True}))):
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
            "data": {"apply_chat_template": True, "chat_template_kwargs": kwargs}})
        assert common.saving_chat_format(cfg, chatml(template=baked)).chat_template == template


def test_the_hh_format_never_writes_eos_as_text():
    tok = byte_tokenizer()
    assert not turn_ends_with_eos(tok)
    tok.chat_template = HH_TEMPLATE
    assert not turn_ends_with_eos(tok)


def test_what_the_template_cannot_write_is_counted_or_refused():
    tok = chatml(template=ALTERNATING)
    two_users = PreferencePair("\n\nHuman: a\n\nHuman: b\n\nAssistant:", " c", " d")
    rendered, refused = apply_chat_template([PAIRS[1], two_users], tok, OWNER)
    assert refused == 1 and rendered[0].prompt == "[user] Name a color.\n[assistant] "
    with pytest.raises(DataError, match="refuses all 1 dialogues .*roles must alternate"):
        apply_chat_template([two_users], tok, OWNER)
    with pytest.raises(DataError, match=f"the tokenizer of {OWNER} has no chat template; .*"
                                        "data.apply_chat_template=false"):
        apply_chat_template(PAIRS, byte_tokenizer(), OWNER)
    # a template that writes the turns before a reply otherwise than in the prompt
    moving = CHATML.replace("{% if add_generation_prompt %}",
                            "{% if add_generation_prompt %}{{ '(prompt)' }}")
    with pytest.raises(DataError, match="refuses all 2 dialogues .*does not write the dialogue "
                                        "as its prompt followed by the reply"):
        apply_chat_template(PAIRS, chatml(template=moving), OWNER)


# Mistral-7B-Instruct-v0.3's: a system message goes into the last user turn
MISTRAL = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
           "{% set messages = messages[1:] %}{% endif %}{{ bos_token }}{% for m in messages %}"
           "{% if m['role'] == 'user' %}{% if loop.last and system is defined %}"
           "{{ '[INST] ' + system + '\\n\\n' + m['content'] + '[/INST]' }}"
           "{% else %}{{ '[INST] ' + m['content'] + '[/INST]' }}{% endif %}"
           "{% else %}{{ ' ' + m['content'] | trim + eos_token }}{% endif %}{% endfor %}")


def test_a_dialogue_the_template_writes_otherwise_before_its_reply_is_counted():
    """Mistral's template writes a dialogue with a system message otherwise once the reply
    follows: that dialogue is skipped and counted; the run stopped on it."""
    with_system = PreferencePair("Be terse.\n\nHuman: hi\n\nAssistant:", " Fine.", " Bad.")
    rendered, refused = apply_chat_template([PAIRS[1], with_system], chatml("</s>", MISTRAL),
                                            OWNER)
    assert refused == 1
    assert without_messages(rendered) == [PreferencePair("<s>[INST] Name a color.[/INST]", " Blue</s>",
                                       " Seven</s>")]
    # a step-3 prompt record has no reply to move: its prompt is what step 3 generates from
    asked = with_system._replace(chosen="", rejected="", label="4")
    (pair,), refused = apply_chat_template([asked], chatml("</s>", MISTRAL), OWNER)
    assert (without_messages([pair]), refused) == (
        [PreferencePair("<s>[INST] Be terse.\n\nhi[/INST]", "", "", label="4")], 0)


def test_the_reward_model_reads_rollouts_as_step_2_wrote_them():
    """Actor and reward model share a vocabulary but not an EOS, so rollouts are
    re-tokenized: a template's turn end that is the actor's EOS (<|im_end|>) is text the
    reward model was trained on, kept; the reward model's own EOS ends the text."""
    actor_tok, reward_tok = chatml(), chatml(eos="</s>")
    reward = frozen(load_reward_model("tiny-llama", reward_tok, seed=4), CPU)
    scorer = RewardScorer(reward, actor_tok, reward_tok, CPU.device)
    assert not scorer.reads_actor_ids and scorer.eos_in_text
    (pair, _), _ = apply_chat_template(PAIRS, actor_tok, OWNER)
    rollout = actor_tok(pair.prompt + pair.chosen)["input_ids"]   # generation stopped at EOS
    assert rollout[-1] == actor_tok.eos_token_id
    sequences = torch.tensor([rollout])
    got = scorer(sequences, torch.ones_like(sequences), len(prompt_ids([pair.prompt], actor_tok)[0][0]))
    (trained_on,), _ = tokenize_pairs([pair], reward_tok, 64, 16)
    ids = torch.tensor([trained_on.chosen_ids])
    assert reward_tok.convert_ids_to_tokens(trained_on.chosen_ids[-2:]) == ["<|im_end|>", "</s>"]
    torch.testing.assert_close(got, sequence_scores(reward, ids, torch.ones_like(ids)),
                               atol=1e-6, rtol=0)


# Llama-3-Instruct's: the template writes the BOS (<|begin_of_text|>) itself, contents trimmed
LLAMA3 = ("{% for m in messages %}{% set content = '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' %}"
          "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def llama3():
    """The byte tokenizer as Llama-3-Instruct's: <|begin_of_text|> its BOS (prepended, and
    written by the template), <|eot_id|> its EOS."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "additional_special_tokens": ["<|start_header_id|>",
                                                          "<|end_header_id|>"]})
    bos = ("<|begin_of_text|>", tok.bos_token_id)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[bos])
    tok.chat_template = LLAMA3
    return tok


def test_a_bos_the_template_writes_is_text_the_reward_model_reads(monkeypatch):
    """Step 2 tokenizes the template's text, <|begin_of_text|> included: a reward tokenizer
    of another family reads it as text. The re-tokenizing scorer dropped the actor's BOS
    with the other special tokens' text kept, so it scored rollouts without it."""
    actor_tok, reward_tok = llama3(), byte_tokenizer()   # <|begin_of_text|> is not its BOS
    read = []
    monkeypatch.setattr(scoring, "sequence_scores",
                        lambda model, ids, mask, packed: read.extend(ids.tolist())
                        or torch.zeros(len(ids)))
    scorer = RewardScorer(None, actor_tok, reward_tok, CPU.device)
    (pair, _), _ = apply_chat_template(PAIRS, actor_tok, OWNER)
    (sft,), _ = tokenize_sft([pair], actor_tok, 256, 16)
    assert sft.input_ids.count(actor_tok.bos_token_id) == 1   # not doubled by the tokenizer
    rollout = torch.tensor([sft.input_ids])                    # prompt + answer + <|eot_id|>
    scorer(rollout, torch.ones_like(rollout), len(prompt_ids([pair.prompt], actor_tok)[0][0]))
    (trained_on,), _ = tokenize_pairs([pair], reward_tok, 256, 16)
    assert reward_tok.decode(trained_on.chosen_ids[:18]) == "<s><|begin_of_text|>"
    assert read == [trained_on.chosen_ids]


def test_the_reward_model_reads_prompt_and_answer_tokenized_as_in_step_2(monkeypatch,
                                                                        opt_tokenizer_path):
    """Step 2 tokenizes an answer as it follows its prompt, or alone where the two do not
    split at the prompt's end: OPT reads Llama-3's "\n\n" that ends a prompt as one token,
    but as two before a word. The scorer tokenized the rollout's whole text instead, so an
    OPT reward model scored a Llama-3 actor's rollouts on ids it was never trained on."""
    actor_tok = llama3()
    reward_tok = AutoTokenizer.from_pretrained(opt_tokenizer_path)
    read = []
    monkeypatch.setattr(scoring, "sequence_scores",
                        lambda model, ids, mask, packed: read.extend(ids.tolist())
                        or torch.zeros(len(ids)))
    scorer = RewardScorer(None, actor_tok, reward_tok, CPU.device)
    (pair, _), _ = apply_chat_template(PAIRS, actor_tok, OWNER)
    assert pair.prompt.endswith("<|end_header_id|>\n\n")
    (sft,), _ = tokenize_sft([pair], actor_tok, 256, 16)
    rollout = torch.tensor([sft.input_ids])
    scorer(rollout, torch.ones_like(rollout), len(prompt_ids([pair.prompt], actor_tok)[0][0]))
    (trained_on,), _ = tokenize_pairs([pair], reward_tok, 256, 16)
    assert read == [trained_on.chosen_ids]
    whole = reward_tok(pair.prompt + pair.chosen)["input_ids"] + [reward_tok.eos_token_id]
    assert whole != trained_on.chosen_ids   # what the scorer read before


# ---------------------------------------------------------------------------------------------
# the three steps and chat.py


SMALL = {"recipe": "demo", "data.path": "[demo]", "data.demo_pairs": 80,
         "data.max_prompt_len": 96, "data.max_answer_len": 16, "sft.epochs": 1,
         "sft.batch_size": 8, "rm.epochs": 1, "rm.batch_size": 8, "ppo.epochs": 1,
         "ppo.rollout_batch_size": 16, "ppo.micro_batch_size": 8, "ppo.eval_prompts": 4,
         "ppo.samples_per_prompt": 1, "ppo.best_of_n": 2, "ppo.export": "last",
         "logging.progress": "false"}


def run_train(out: Path, **settings) -> str:
    return train_here(["--actor-model", "tiny-llama", "--reward-model", "tiny-llama",
                       "--output-dir", out,
                       *(f"{k}={v}" for k, v in {**SMALL, **settings}.items())]).check().stdout


def chat_prompts(model_dir: Path, monkeypatch) -> list[tuple[list[int], str | None]]:
    """(prompt ids, stop string) of each reply chat.py generated for two user turns."""
    seen, real_reply = [], chat.reply

    def spy(model, tokenizer, prompt_ids, args, out=None, stop=None):
        seen.append((list(prompt_ids), stop))
        return real_reply(model, tokenizer, prompt_ids, args, out, stop)

    monkeypatch.setattr(chat, "reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nmore\n"))
    with redirect_stdout(io.StringIO()):
        assert chat.main(["--path", str(model_dir), "--greedy", "--max-new-tokens", "4"]) == 0
    return seen


@pytest.mark.slow
def test_three_steps_and_chat_in_the_actors_chat_template(tmp_path, monkeypatch):
    tokenizer_dir = tmp_path / "chatml"
    chatml().save_pretrained(tokenizer_dir)
    out = tmp_path / "run"
    log = run_train(out, tokenizer=tokenizer_dir, **{"data.apply_chat_template": "true"})
    assert "dialogues skipped" not in log
    for name in ("actor", "step3/actor"):
        assert AutoTokenizer.from_pretrained(out / name).chat_template == CHATML, name
    tok = AutoTokenizer.from_pretrained(out / "step3" / "actor")
    (first, stop), (second, _) = chat_prompts(out / "step3" / "actor", monkeypatch)
    assert stop is None   # the reply ends at <|im_end|>, the EOS
    assert tok.decode(first, skip_special_tokens=False) == "<s>" + turns("hi")
    assert tok.decode(second, skip_special_tokens=False).startswith(
        "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(second, skip_special_tokens=False).endswith(
        "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_chat_template_kwargs_are_read_by_every_step_and_saved_with_the_model(tmp_path,
                                                                            monkeypatch):
    """data.chat_template_kwargs={enable_thinking: false}: steps 1 and 3 train and sample
    after Qwen3's empty thinking block (the generation prompt holds it, the answers do not),
    step 2 scores in that format, and the saved actor's template holds the variable, so
    transformers alone and chat.py render the prompt as training did."""
    tokenizer_dir = tmp_path / "thinking"
    chatml(template=THINKING).save_pretrained(tokenizer_dir)
    out = tmp_path / "run"
    settings = {"data.apply_chat_template": "true",
                "data.chat_template_kwargs": "{enable_thinking:false}"}
    seen = []
    real = apply_chat_template

    def recording(pairs, tokenizer, owner):
        rendered = real(pairs, tokenizer, owner)
        seen.append(rendered[0])
        return rendered

    monkeypatch.setattr(common, "apply_chat_template", recording)
    run_train(out, tokenizer=tokenizer_dir, **settings)
    assert len(seen) == 3   # steps 1, 2 and 3
    for rendered in seen:
        assert all(p.prompt.endswith(NO_THINKING) and "<think>" not in p.chosen + p.rejected
                   for p in rendered), rendered[:2]
    said = [{"role": "user", "content": "hi"}]
    for name in ("actor", "step3/actor"):
        saved = AutoTokenizer.from_pretrained(out / name)
        assert saved.apply_chat_template(said, tokenize=False, add_generation_prompt=True) == \
            "<|im_start|>user\nhi<|im_end|>\n" + NO_THINKING, name
    tok = AutoTokenizer.from_pretrained(out / "step3" / "actor")
    (first, _), _ = chat_prompts(out / "step3" / "actor", monkeypatch)
    assert tok.decode(first, skip_special_tokens=False) == \
        "<s><|im_start|>user\nhi<|im_end|>\n" + NO_THINKING


@pytest.mark.slow
def test_the_hh_format_is_saved_with_the_actor_and_chatted_in(tmp_path, monkeypatch):
    """A model trained on hh text, whose base tokenizer had a chat template of its own, is
    saved with the hh one: chat.py (and other tools) then talk to it as it was trained."""
    tokenizer_dir = tmp_path / "chatml"
    chatml(eos="</s>").save_pretrained(tokenizer_dir)
    out = tmp_path / "run"
    run_train(out, tokenizer=tokenizer_dir, steps="[1]")
    assert AutoTokenizer.from_pretrained(out / "actor").chat_template == HH_TEMPLATE
    tok = AutoTokenizer.from_pretrained(out / "actor")
    (first, stop), _ = chat_prompts(out / "actor", monkeypatch)
    assert stop == "\n\nHuman:"
    assert tok.decode(first, skip_special_tokens=False) == "<s>\n\nHuman: hi\n\nAssistant:"


def test_step_2_renders_in_the_format_step_3s_actor_was_saved_with(tmp_path):
    """Step 1 run without the flag saved its actor with the hh template: step 2 run with it
    renders in that format, the one step 3's actor generates in, not --actor-model's own."""
    tokenizer_dir = tmp_path / "chatml"
    chatml().save_pretrained(tokenizer_dir)
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-llama", "tokenizer": str(tokenizer_dir),
        "output_dir": str(tmp_path / "out"), "data": {"apply_chat_template": True}})
    tok, owner = reward.template_tokenizer(cfg)
    assert tok.chat_template == CHATML and owner == "--actor-model tiny-llama"
    saved = chatml()
    saved.chat_template = HH_TEMPLATE
    load_causal_lm("tiny-llama", saved).save_pretrained(tmp_path / "out" / "actor")
    saved.save_pretrained(tmp_path / "out" / "actor")
    tok, owner = reward.template_tokenizer(cfg)
    assert uses_hh(tok) and owner == f"the actor {tmp_path / 'out' / 'actor'}"


@pytest.mark.parametrize("step", [2, 3])
def test_steps_2_and_3_refuse_the_hh_format_for_an_actor_trained_in_its_template(tmp_path,
                                                                                  step):
    """`--step 2 3` without --apply-chat-template after a step 1 with it trained the reward
    model and PPO on hh text the actor never read, and saved it with the hh template."""
    from engine.errors import UserError
    from steps import ppo
    out = tmp_path / "out"
    saved = chatml()
    load_causal_lm("tiny-llama", saved).save_pretrained(out / "actor")
    saved.save_pretrained(out / "actor")
    if step == 3:
        load_reward_model("tiny-llama", saved).save_pretrained(out / "reward")
        saved.save_pretrained(out / "reward")
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), {
        "actor_model": "tiny-llama", "reward_model": "tiny-llama", "output_dir": str(out),
        "logging": {"progress": False}})
    pairs = [PreferencePair(f"\n\nHuman: q{i}\n\nAssistant:", " yes", " no") for i in range(40)]
    cpu = Runtime(device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(UserError, match=rf"^step {step}: step 1 trained the actor .* in its chat "
                                        r"template .*; pass --apply-chat-template to this run"):
        reward.run(cfg, pairs, cpu) if step == 2 else ppo.run(cfg, pairs, [], cpu)
    assert not (out / f"step{step}").exists() and (step == 3 or not (out / "reward").exists())
