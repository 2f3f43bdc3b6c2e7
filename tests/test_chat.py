"""chat.py: pure helpers, generation plumbing, and the CLI end to end on tiny random models."""

import ast
import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

import chat
from engine.chat_format import HUMAN, hh_messages, render, uses_hh
from engine.generation import SamplingSettings
from engine.inference_form import InferenceForm
from engine.models import byte_tokenizer, preset_config

ROOT = Path(__file__).resolve().parent.parent
CHAT = ROOT / "chat.py"


def tiny_model_dir(tokenizer_path, out: Path, arch: str = "opt") -> Path:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.save_pretrained(out)
    torch.manual_seed(0)  # same weights every run, so greedy replies are reproducible
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )
    if arch == "opt":
        config = OPTConfig(**common, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0)
        model = OPTForCausalLM(config)
    else:
        config = LlamaConfig(**common, intermediate_size=64, num_key_value_heads=2)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return out


def preset_model_dir(preset: str, out: Path, **config) -> Path:
    """A built-in preset (random weights, seed 0; `config` overrides) with its byte tokenizer."""
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(out)
    model_config = preset_config(preset, tokenizer)
    model_config.update(config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config).save_pretrained(out)
    return out


@pytest.fixture
def opt_dir(opt_tokenizer_path, tmp_path) -> Path:
    return tiny_model_dir(opt_tokenizer_path, tmp_path / "opt")


@pytest.fixture
def tokenizer(opt_tokenizer_path):
    return AutoTokenizer.from_pretrained(opt_tokenizer_path)


def run_chat(args, stdin: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(CHAT), *args],
        input=stdin,
        text=True,
        capture_output=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def replies(stdout: str) -> list[str]:
    return [
        line[len("Assistant:") :].strip()
        for line in stdout.splitlines()
        if line.startswith("Assistant:")
    ]


# -----------------------------------------------------------------------------
# pure helpers


def test_the_hh_template_writes_the_hh_rlhf_format(tokenizer):
    """A tokenizer without a chat template talks in the hh format train.py trains in."""
    assert tokenizer.chat_template is None and uses_hh(tokenizer)
    turns = [user("hello")]
    assert render(tokenizer, turns, True) == "\n\nHuman: hello\n\nAssistant:"
    turns += [{"role": "assistant", "content": "Hi there."}, user("how are you")]
    assert render(tokenizer, turns, True) == ("\n\nHuman: hello\n\nAssistant: Hi there."
                                              "\n\nHuman: how are you\n\nAssistant:")
    assert hh_messages(render(tokenizer, turns, True)) == turns   # and reads back


def test_cut_reply_and_display():
    assert chat.cut_reply(" Sure.\n\nHuman: and then?\n\nAssistant: x", HUMAN) == " Sure."
    assert chat.cut_reply(" no stop here", HUMAN) == " no stop here"
    # a chat template's reply ends at a stop token, not a text
    assert chat.cut_reply(" a\n\nHuman: b", None) == " a\n\nHuman: b"
    assert chat.display_reply(" Sure.\n") == "Sure."


def test_stream_safe_holds_back_what_may_change():
    assert chat.stream_safe(" Hi there", HUMAN) == "Hi there"
    assert chat.stream_safe(" Hi there\n\nHum", HUMAN) == "Hi there"  # may become the stop
    assert chat.stream_safe(" Hi there\n\nHuman: x", HUMAN) == "Hi there"
    assert chat.stream_safe(" caf\ufffd", HUMAN) == "caf"  # incomplete UTF-8 character
    assert chat.stream_safe(" a Hu", HUMAN) == "a Hu"  # only a "\n\nHuman:" prefix is held back
    assert chat.stream_safe(" Hi\n\nHum", None) == "Hi\n\nHum"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_without_oldest_exchange():
    talk = [user("a"), bot("b"), user("c"), bot("d"), user("e")]
    assert chat.without_oldest_exchange(talk) == talk[2:]
    assert chat.without_oldest_exchange(talk[2:]) == talk[4:]
    assert chat.without_oldest_exchange(talk[4:]) == talk[4:]   # the newest stays
    system = {"role": "system", "content": "Be brief."}
    assert chat.without_oldest_exchange([system, *talk]) == [system, *talk[2:]]


def char_encode(text: str) -> list[int]:
    """A stand-in tokenizer: BOS (0) plus one id per character."""
    return [0] + [ord(c) for c in text]


@pytest.fixture
def encode(tokenizer):
    """messages -> char_encode of their hh text"""
    return lambda messages: char_encode(render(tokenizer, messages, True))


def test_fit_history_keeps_short_history(encode):
    talk = [user("a"), bot("b"), user("c")]
    assert chat.fit_history(talk, encode, 1000, [0]) == (talk, encode(talk))


def test_fit_history_drops_oldest_whole_turns(encode):
    talk = [m for i in range(3) for m in (user(f"q{i}"), bot(f"r{i}"))] + [user("now")]
    # room for exactly the last two exchanges
    budget = len(encode(talk[4:]))
    fitted, ids = chat.fit_history(talk, encode, budget, [0])
    assert fitted == talk[4:]
    assert ids == encode(fitted)
    fitted, _ = chat.fit_history(talk, encode, budget - 1, [0])
    assert fitted == talk[6:]


def test_fit_history_keeps_tail_of_one_long_turn(encode):
    talk = [user("x" * 50)]
    fitted, ids = chat.fit_history(talk, encode, 20, [0])
    assert fitted == talk  # the text is kept; only the tokens fed to the model are cut
    assert len(ids) == 20
    assert ids[0] == 0  # BOS stays first
    assert ids[1:] == encode(talk)[-19:]  # ... followed by the newest tokens


def test_fit_history_with_real_tokenizer(tokenizer):
    def encode(messages):
        return tokenizer(render(tokenizer, messages, True))["input_ids"]

    talk = [m for i in range(10)
            for m in (user(f"question number {i} about things"), bot(f"answer {i}."))]
    talk.append(user("last one"))
    fitted, ids = chat.fit_history(talk, encode, 40, [tokenizer.bos_token_id])
    assert len(ids) <= 40 and ids[0] == tokenizer.bos_token_id and ids == encode(fitted)
    assert fitted[0]["role"] == "user" and fitted[-1] == user("last one")
    assert talk[-len(fitted):] == fitted and len(fitted) < len(talk)


# -----------------------------------------------------------------------------
# generation plumbing


def test_streamer_stops_on_stop_string(tokenizer):
    # the prompt's own "\n\nHuman:" does not count
    prompt = tokenizer("\n\nHuman: hi\n\nAssistant:")["input_ids"]
    new = tokenizer(" Hi there\n\nHuman: more", add_special_tokens=False)["input_ids"]
    streamer = chat.ReplyStreamer(tokenizer, prompt, io.StringIO())
    fired = [streamer(torch.tensor([tok])) for tok in new]
    colon = next(i for i in range(len(new)) if tokenizer.decode(new[: i + 1]).endswith("Human:"))
    assert fired == [i >= colon for i in range(len(new))]


def test_streamer_prints_only_final_text(tokenizer):
    prompt = tokenizer("\n\nHuman: hi\n\nAssistant:")["input_ids"]
    out = io.StringIO()
    streamer = chat.ReplyStreamer(tokenizer, prompt, out)
    seen = []
    for tok in tokenizer(" café ☃ ok\n\nHuman: x", add_special_tokens=False)["input_ids"]:
        streamer(torch.tensor([tok]))
        seen.append(out.getvalue())
    streamer.end()
    assert out.getvalue() == "café ☃ ok"
    assert all("\ufffd" not in s and "\n" not in s for s in seen)
    assert all(s.startswith(p) for p, s in zip(seen, seen[1:], strict=False))  # only appends


class ScriptedModel:
    """Stands in for an inference form: 'generates' a fixed text token by token."""

    def __init__(self, tokenizer, text):
        self.script = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.device = torch.device("cpu")
        self.generation_config = SimpleNamespace(eos_token_id=2)
        self.calls = []

    def generate(self, input_ids, attention_mask, sampling, *, on_token, **kw):
        self.calls.append(dict(input_ids=input_ids, sampling=sampling, **kw))
        ids = input_ids
        for tok in self.script[: sampling.max_new_tokens]:
            ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
            if on_token(torch.tensor([tok])):
                break
        return ids


def test_reply_cuts_at_next_human_turn(tokenizer, capsys):
    model = ScriptedModel(tokenizer, " Fine, thanks.\n\nHuman: and you?\n\nAssistant: ok")
    args = SimpleNamespace(max_new_tokens=50, greedy=True, temperature=0.7, top_p=0.9, top_k=0)
    prompt = tokenizer("\n\nHuman: how are you\n\nAssistant:")["input_ids"]
    raw = chat.reply(model, tokenizer, prompt, args)
    assert raw == " Fine, thanks."  # raw text keeps its leading space for the history
    assert capsys.readouterr().out == "Fine, thanks."
    # greedy: no sampling knobs; the model's own stop ids
    call = model.calls[0]
    assert call["sampling"] == SamplingSettings(max_new_tokens=50, do_sample=False)
    assert call["pad_token_id"] == tokenizer.pad_token_id and call["eos_token_id"] == [2]


def test_replies_stop_on_the_eos_training_taught_and_the_checkpoints_own(tokenizer):
    """A generation_config.json whose stop ids leave out the tokenizer's EOS (the one SFT
    taught the model to end with) made replies run on past it."""
    model = ScriptedModel(tokenizer, " ok")
    model.generation_config.eos_token_id = [50118, 3]
    args = SimpleNamespace(max_new_tokens=5, greedy=True)
    chat.reply(model, tokenizer, [2], args, out=io.StringIO())
    assert model.calls[0]["eos_token_id"] == sorted({tokenizer.eos_token_id, 3, 50118})


def test_reply_sampling_args(tokenizer):
    model = ScriptedModel(tokenizer, " ok")
    args = SimpleNamespace(max_new_tokens=5, greedy=False, temperature=0.5, top_p=0.8, top_k=7)
    chat.reply(model, tokenizer, [2], args, out=io.StringIO())
    assert model.calls[0]["sampling"] == SamplingSettings(
        max_new_tokens=5, temperature=0.5, top_p=0.8, top_k=7, do_sample=True
    )


# -----------------------------------------------------------------------------
# the whole program


def test_main_in_process_history_and_clear(opt_dir, monkeypatch, capsys):
    prompts, real_reply = [], chat.reply

    def spy(model, tokenizer, prompt_ids, args, out=None, stop=None):
        prompts.append(list(prompt_ids))
        return real_reply(model, tokenizer, prompt_ids, args, out, stop)

    monkeypatch.setattr(chat, "reply", spy)
    monkeypatch.setattr(
        sys, "stdin", io.StringIO("hello\n\nhow are you\nclear\nhello\nexit\nnever\n")
    )
    rc = chat.main(["--path", str(opt_dir), "--greedy", "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert len(replies(out)) == 3 and len(prompts) == 3  # empty line ignored, stops at exit
    first, second, after_clear = prompts
    # the second turn sees the whole history (as text: BPE may merge across the turn boundary)
    tok = AutoTokenizer.from_pretrained(opt_dir)
    assert tok.decode(second).startswith(tok.decode(first)) and len(second) > len(first)
    assert tok.decode(second).endswith("\n\nHuman: how are you\n\nAssistant:")
    assert after_clear == first  # clear started over
    assert replies(out)[0] == replies(out)[2]


def test_the_same_seed_samples_the_same_replies(opt_dir, monkeypatch, capsys):
    """--seed makes a sampled conversation reproducible: the same seed, the same replies;
    another seed, other replies (the tiny model's sampling is near uniform over 50k tokens)."""
    def sampled(seed: int) -> list[str]:
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nhow are you\n"))
        assert chat.main(["--path", str(opt_dir), "--seed", str(seed),
                          "--max-new-tokens", "12"]) == 0
        return replies(capsys.readouterr().out)

    first = sampled(7)
    assert len(first) == 2 and all(first), first
    assert sampled(7) == first
    assert sampled(8) != first


def test_main_truncates_history_to_context(opt_dir, monkeypatch, capsys):
    prompts = []

    def canned_reply(model, tokenizer, prompt_ids, args, out=None, stop=None):
        prompts.append(list(prompt_ids))  # only the prompts matter here: skip generation
        return " It is sunny."

    monkeypatch.setattr(chat, "reply", canned_reply)
    turns = ["hi"] * 5 + ["word " * 60]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\n"))
    # max_position_embeddings is 128: 100 new tokens leave 28 for the history
    rc = chat.main(["--path", str(opt_dir), "--greedy", "--max-new-tokens", "100"])
    assert rc == 0
    assert len(replies(capsys.readouterr().out)) == 6
    assert all(len(p) <= 28 and p[0] == 2 for p in prompts)  # fits, BOS first
    human = AutoTokenizer.from_pretrained(opt_dir)("\n\nHuman:", add_special_tokens=False)
    n_turns = [_count(p, human["input_ids"]) for p in prompts]
    assert n_turns[:2] == [1, 2]  # the history is kept while it fits ...
    assert 1 < n_turns[4] < 5  # ... then the oldest exchanges are dropped
    assert len(prompts[5]) == 28 and n_turns[5] <= 1  # a turn too long alone: its tail is kept


def _count(ids: list[int], sub: list[int]) -> int:
    return sum(ids[i : i + len(sub)] == sub for i in range(len(ids)))


@pytest.mark.parametrize(
    "preset, config, injected",
    [
        ("tiny-llama", {}, True),
        ("tiny-gpt-neox", {}, True),
        ("tiny-opt", {"do_layer_norm_before": False}, False),  # no inference modules
    ],
)
def test_replies_are_hf_generate_greedy(preset, config, injected, tmp_path, monkeypatch, caplog):
    """Through the model's inference form (fused modules, or HF generate as the fallback), each
    reply is what Hugging Face generate picks greedily, token for token."""
    path = preset_model_dir(preset, tmp_path / preset, **config)
    calls, real_generate = [], InferenceForm.generate

    def recording_generate(form, input_ids, *args, **kwargs):
        out = real_generate(form, input_ids, *args, **kwargs)
        calls.append((form.injected, input_ids[0].tolist(), out[0].tolist()))
        return out

    monkeypatch.setattr(InferenceForm, "generate", recording_generate)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nhow are you\n"))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    assert chat.main(["--path", str(path), "--greedy", "--max-new-tokens", "16"]) == 0
    shown = replies(out.getvalue())
    assert len(shown) == len(calls) == 2
    fallbacks = [r for r in caplog.records if "generating with the Hugging Face modules" in r.msg]
    assert len(fallbacks) == (0 if injected else 1)

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    for (was_injected, prompt, got), text in zip(calls, shown, strict=True):
        assert was_injected == injected
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                              do_sample=False, pad_token_id=tok.pad_token_id)[0].tolist()
        assert got == want[: len(got)]  # shorter only if the reply started a human turn
        new = want[len(prompt) :]
        assert text == chat.display_reply(chat.cut_reply(chat.decode_new(tok, prompt, new), HUMAN))


def test_cli_piped_conversation(opt_dir):
    stdin = "hello\nhow are you\nclear\nhello\nhi\nquit\nignored\n"
    proc = run_chat(["--path", str(opt_dir), "--greedy", "--max-new-tokens", "8"], stdin)
    assert proc.returncode == 0, proc.stderr
    got = replies(proc.stdout)
    assert len(got) == 4, proc.stdout
    assert got[0] == got[2]  # "hello" on a fresh history, before and after clear
    assert "Traceback" not in proc.stderr


def test_cli_llama_sampling_until_eof(opt_tokenizer_path, tmp_path):
    path = tiny_model_dir(opt_tokenizer_path, tmp_path / "llama", arch="llama")
    args = ["--path", str(path), "--seed", "0", "--max-new-tokens", "6", "--top-k", "20"]
    proc = run_chat(args, "hello\nhow are you\n")  # EOF ends the chat
    assert proc.returncode == 0, proc.stderr
    assert len(replies(proc.stdout)) == 2


def test_cli_interactive_prompts(opt_dir):
    """On a terminal the user gets a "Human: " prompt and an "Assistant: " prefix."""
    leader, follower = pty.openpty()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, str(CHAT), "--path", str(opt_dir), "--greedy", "--max-new-tokens", "4"]
    proc = subprocess.Popen(
        args, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=ROOT
    )
    os.close(follower)
    seen, sent = b"", 0
    deadline = time.time() + 60
    try:
        while time.time() < deadline and proc.poll() is None:
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:
                    break
            if seen.count(b"Human: ") > sent:  # a fresh prompt: answer it
                os.write(leader, [b"hello\n", b"quit\n"][min(sent, 1)])
                sent += 1
        assert proc.wait(timeout=max(1, deadline - time.time())) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    text = seen.decode(errors="replace")
    assert "Human: " in text and "Assistant: " in text


def test_error_missing_path_in_process(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert chat.main(["--path", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--path" in err and str(missing) in err
    assert "no such directory" in err and "output/step3/actor" in err
    assert "preset" not in err   # chat.py refuses them: random weights


def test_error_missing_path_cli(tmp_path):
    """A bad path fails in one line before torch and transformers are imported."""
    proc = run_chat(["--path", str(tmp_path / "nope")], "")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--path" in proc.stderr
    assert "Traceback" not in proc.stderr
    check = ("import sys, chat; rc = chat.main(['--path', sys.argv[1]]); "
             "print(rc, [m for m in ('torch', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", check, str(tmp_path / "nope")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["2", "[]"], proc.stdout + proc.stderr


def test_error_a_path_that_is_a_file(tmp_path, capsys):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    assert chat.main(["--path", str(weights)]) == 2
    assert capsys.readouterr().err == (f"chat.py: --path {weights}: a file, not a directory; "
                                       "pass the directory that holds the model (its "
                                       "config.json)\n")


@pytest.mark.parametrize("argv, said", [
    (["--path", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["--path", "x", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
])
def test_error_an_unknown_flag_is_one_line(argv, said, capsys):
    with pytest.raises(SystemExit) as exited:
        chat.parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"chat.py: {said}") and err.endswith("; see chat.py --help\n"), err
    assert err.count("\n") == 1


def test_help_describes_every_flag_with_the_default_it_uses(capsys):
    with pytest.raises(SystemExit):
        chat.parse_args(["--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    # an option's entry: its line, then the lines indented under it
    entries = dict(re.findall(r"^  (--[\w-]+)(.*(?:\n {6,}.*)*)", text, re.MULTILINE))
    described = {flag: " ".join(entry.split()) for flag, entry in entries.items()}
    assert set(described) == {"--path", "--max-new-tokens", "--temperature",
                              "--top-p", "--top-k", "--greedy", "--seed", "--device",
                              "--dtype", "--system", "--trust-remote-code"}
    for flag, entry in described.items():   # more than the metavar: a description
        assert len(entry.split()) > 2, (flag, entry)
    defaults = chat.parse_args(["--path", "x"])
    for flag in ("--max-new-tokens", "--temperature", "--top-p"):
        value = getattr(defaults, flag[2:].replace("-", "_"))
        assert f"(default {value})" in described[flag], (flag, described[flag])


def test_error_dir_without_config(tmp_path, capsys):
    assert chat.main(["--path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json" in err


def test_an_adapter_directory_loads_merged_into_its_base(tmp_path, capsys, monkeypatch):
    """ppo.export_weights=adapter writes LoRA alone: chat.py merges it into the base the
    adapter names (the trained model's logits) and talks; over a preset (random weights,
    a shape probe) it says so in one line."""
    from engine.config import LoraConfig, OptimConfig
    from engine.lora import apply_lora
    from engine.models import load_adapter, load_causal_lm
    from engine.runtime import Runtime
    from engine.trainer import TrainEngine

    base = preset_model_dir("tiny-llama", tmp_path / "base")
    tokenizer = byte_tokenizer()
    trained = apply_lora(load_causal_lm(str(base), tokenizer),
                         LoraConfig(dim=4, only_optimize_lora=True))
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    cpu = Runtime(device=torch.device("cpu"), dtype=torch.float32)
    engine = TrainEngine(trained, OptimConfig(), 1, cpu, lr=1e-3)
    engine.export(tokenizer, tmp_path / "adapter", adapter=True)
    ids = torch.randint(4, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    merged = load_adapter(str(tmp_path / "adapter"), str(base), tokenizer, flag="--path")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits,
                                   trained.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert chat.main(["--path", str(tmp_path / "adapter"), "--max-new-tokens", "4"]) == 0
    engine.module.name_or_path = "tiny-llama"   # as a probe over the preset writes it
    engine.module.peft_config["default"].base_model_name_or_path = "tiny-llama"
    engine.export(tokenizer, tmp_path / "probe", adapter=True)
    capsys.readouterr()
    assert chat.main(["--path", str(tmp_path / "probe")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an adapter over the preset tiny-llama" in err
    # an output dir copied elsewhere: its base path is gone, and the message says whose
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(config.read_text().replace(str(base), str(tmp_path / "moved")))
    assert chat.main(["--path", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err
    assert f"--path {tmp_path / 'adapter'}: its adapter_config.json's base_model_name_or_path" \
        in err and err.count("\n") == 1 and "edit it to where the base model is now" in err


@pytest.mark.parametrize("broken, said", [
    ("weights", "a weights file is truncated or not safetensors"),
    ("tokenizer", "the directory has no tokenizer files"),
    ("config", "is not a valid JSON file")])
def test_error_unreadable_model_dir(tmp_path, capsys, broken, said):
    """A truncated weights file, a folder without tokenizer files, a broken config.json:
    one line naming the path, as train.py says it."""
    model = preset_model_dir("tiny-llama", tmp_path / "m")
    if broken == "weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    elif broken == "tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (model / name).unlink(missing_ok=True)
    else:
        (model / "config.json").write_text("{not json")
    capsys.readouterr()   # (saving the model printed a progress bar)
    assert chat.main(["--path", str(model)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--path {model}" in err and said in err, err
    assert "tokenizer=DIR" not in err   # train.py's option: chat.py has none


def test_error_a_reward_model_or_a_preset(tmp_path, capsys, monkeypatch):
    """A reward model would chat through a random LM head, a preset is random weights:
    both refused in one line that says what to pass."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = byte_tokenizer()
    reward = tmp_path / "reward"
    tokenizer.save_pretrained(reward)
    AutoModelForSequenceClassification.from_config(
        preset_config("tiny-llama", tokenizer, num_labels=1)).save_pretrained(reward)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))   # were it loaded: no turns, rc 0
    capsys.readouterr()
    assert chat.main(["--path", str(reward)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--path {reward}: a reward model" in err, err
    assert "not a causal LM" in err and "output/step3/actor" in err
    assert chat.main(["--path", "tiny-llama"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--path tiny-llama: a built-in preset" in err, err


def test_error_hub_name_offline(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # so the name cannot match a local folder
    assert chat.main(["--path", "no-such-org/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unreachable" in err and "local directory" in err


@pytest.mark.parametrize(
    "flags",
    [["--temperature", "0"], ["--top-p", "0"], ["--max-new-tokens", "0"], ["--device", "cuda"],
     ["--top-k", "-1"], ["--seed", "-1"], ["--seed", str(2**32)]],
)
def test_error_bad_flags(flags, opt_dir, capsys):
    if flags == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert chat.main(["--path", str(opt_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flags[0] in err, err


def test_error_context_too_small(opt_dir, capsys):
    assert chat.main(["--path", str(opt_dir), "--max-new-tokens", "128"]) == 2
    assert "context" in capsys.readouterr().err


def test_chat_imports_only_the_engine():
    """chat.py loads and generates through engine/ and knows nothing of RLHF (steps/)."""
    tree = ast.parse(CHAT.read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add(node.module.split(".")[0])
    third_party = roots - set(sys.stdlib_module_names)
    assert third_party <= {"torch", "transformers", "engine"}, third_party


def test_a_system_message_opens_the_conversation_and_stays(opt_dir, monkeypatch, capsys):
    """--system: the text before the first human turn in the hh format (a chat template's
    system message otherwise); `clear` keeps it, and a template that has no system role
    refuses it in one line before the weights load."""
    prompts, real_reply = [], chat.reply

    def spy(model, tokenizer, prompt_ids, args, out=None, stop=None):
        prompts.append(list(prompt_ids))
        return real_reply(model, tokenizer, prompt_ids, args, out, stop)

    monkeypatch.setattr(chat, "reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nclear\nhi\n"))
    assert chat.main(["--path", str(opt_dir), "--greedy", "--max-new-tokens", "4",
                      "--system", "Be brief."]) == 0
    tok = AutoTokenizer.from_pretrained(opt_dir)
    first, after_clear = (tok.decode(ids) for ids in (prompts[0], prompts[1]))
    assert first == "</s>Be brief.\n\nHuman: hello\n\nAssistant:"
    assert after_clear == "</s>Be brief.\n\nHuman: hi\n\nAssistant:"
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('System role not supported') }}{% endif %}"
                         "{{ m['content'] }}{% endfor %}")
    tok.save_pretrained(opt_dir)
    capsys.readouterr()
    assert chat.main(["--path", str(opt_dir), "--system", "Be brief."]) == 2
    assert capsys.readouterr().err.strip() == (
        "chat.py: --system: the model's chat template refuses a system message (System role "
        "not supported); leave --system out")


def test_an_adapter_config_that_is_not_an_object_is_refused_in_one_line(tmp_path):
    """A JSON array there stopped in a raw AttributeError."""
    from engine.errors import UserError
    from engine.model_source import adapter_base
    (tmp_path / "adapter_config.json").write_text("[1]")
    with pytest.raises(UserError, match=r"adapter_config.json: holds a JSON list, not peft's "
                                        r"settings object; write the adapter again"):
        adapter_base(str(tmp_path))


@pytest.mark.parametrize("written, said", [
    ('{"base_model_name_or_path": ', r"adapter_config.json: cannot read it \(Expecting "
                                    r"value: .*\); write the adapter again "
                                    r"\(ppo.export_weights=adapter\)$"),
    ('{"r": 8}', r"adapter_config.json: names no base model \(base_model_name_or_path\); set "
                 r"it to the directory or hub name the adapter was trained over$")])
def test_an_adapter_config_that_is_unreadable_or_names_no_base_says_so(written, said,
                                                                         tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text(written)
    assert chat.main(["--path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert re.search(said, err.strip()) and len(err.strip().splitlines()) == 1, err
