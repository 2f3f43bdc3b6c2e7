"""train.py: flags and Hydra overrides -> config, --help, and one-line refusals of bad input
(nothing is written for a refused run)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import steps.config
import train
from engine.config import HybridConfig

ROOT = Path(__file__).resolve().parent.parent
# keep anything that does run tiny and quiet
SMALL = ["data.demo_pairs=40", "logging.progress=false"]


def config(*argv: str):
    return train.build_config(train.parse_args(list(argv)))


def run_main(capsys, *argv: str) -> tuple[int, str]:
    code = train.main(list(argv))
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {lines}"
    assert lines[0].startswith("train.py: ")
    return lines[0]


def tree(path: Path) -> set[str]:
    """Every path under `path` (relative), hidden temp dirs included."""
    return {str(p.relative_to(path)) for p in path.rglob("*")} if path.exists() else set()


# ---------------------------------------------------------------------------------------------
# flags and overrides


def test_each_flag_maps_to_its_key():
    cfg = config("--actor-model", "X", "--reward-model", "R", "--step", "3", "1",
                 "--output-dir", "out/run", "--deployment-type", "single_gpu",
                 "--actor-zero-stage", "3", "--reward-zero-stage", "2")
    assert cfg.actor_model == "X"
    assert cfg.reward_model == "R"
    assert list(cfg.steps) == [1, 3]
    assert cfg.output_dir == "out/run"
    assert cfg.deployment_type == "single_gpu"
    assert cfg.actor_zero_stage == 3
    assert cfg.reward_zero_stage == 2


def test_hybrid_engine_flags_map_to_their_keys():
    defaults = config("--actor-model", "X").engine.hybrid
    assert defaults.enabled and defaults.pin_parameters and not defaults.release_inference_cache
    cfg = config("--actor-model", "X", "--no-enable-hybrid-engine", "--unpin-actor-parameters",
                 "--release-inference-cache", "--tp-gather-partition-size", "4").engine.hybrid
    assert not cfg.enabled and not cfg.pin_parameters and cfg.release_inference_cache
    assert cfg.gather_group_size == 4
    # the engine takes the composed group as its own config object
    assert OmegaConf.to_object(cfg) == HybridConfig(enabled=False, pin_parameters=False,
                                                    release_inference_cache=True,
                                                    gather_group_size=4)


def test_overrides_apply_and_may_mix_with_flags():
    cfg = config("ppo.kl_coef=0.05", "--actor-model", "X", "--step", "1", "sft.epochs=2",
                 "data.path=[a.jsonl,b.parquet]")
    assert cfg.ppo.kl_coef == 0.05
    assert cfg.sft.epochs == 2
    assert list(cfg.data.path) == ["a.jsonl", "b.parquet"]
    assert cfg.actor_model == "X" and list(cfg.steps) == [1]


def test_a_single_value_for_a_list_key_becomes_a_list():
    cfg = config("--actor-model", "X", "data.path=a.jsonl", "steps=2")
    assert list(cfg.data.path) == ["a.jsonl"]
    assert list(cfg.steps) == [2]


def test_no_model_flags_selects_the_demo_recipe():
    cfg = config()
    assert cfg.actor_model == "tiny-llama" and cfg.reward_model == "tiny-llama"
    assert list(cfg.data.path) == ["demo"]
    assert cfg.data.max_prompt_len == 64
    assert list(cfg.steps) == [1, 2, 3]


def test_a_model_flag_keeps_the_standard_recipe():
    cfg = config("--actor-model", "X")
    assert cfg.reward_model is None
    assert cfg.data.max_prompt_len == 256
    assert list(cfg.data.split) == [2, 4, 4]
    ppo = cfg.ppo
    assert ppo.kl_coef == 0.1
    assert ppo.clip_range == 0.2 and ppo.value_clip_range == 0.2
    assert ppo.gamma == 1.0 and ppo.lam == 0.95
    assert ppo.ema.beta == 0.992 and ppo.ema.enabled is False
    assert ppo.score_clip == 5
    assert ppo.max_new_tokens == cfg.data.max_answer_len == 256
    assert ppo.whiten_advantages is True and ppo.disable_dropout is True


def test_a_flag_beats_the_same_key_as_override():
    cfg = config("actor_model=Y", "--actor-model", "X", "steps=[2,3]", "--step", "1",
                 "output_dir=b", "--output-dir", "a", "actor_zero_stage=1",
                 "--actor-zero-stage", "2")
    assert cfg.actor_model == "X"
    assert list(cfg.steps) == [1]
    assert cfg.output_dir == "a"
    assert cfg.actor_zero_stage == 2


FLAG_ROWS = [row[:3] for rows in train.FLAGS.values() for row in rows]


@pytest.mark.parametrize("flag, key, options", FLAG_ROWS, ids=[r[0] for r in FLAG_ROWS])
def test_each_flag_of_the_table_sets_its_key(flag, key, options):
    if options.get("action") is argparse.BooleanOptionalAction:
        cases = {(flag,): True, (f"--no-{flag[2:]}",): False}
    elif "const" in options:
        cases = {(flag,): options["const"]}
    else:
        raw = str(options.get("choices", ["7"])[-1])
        value = options.get("type", str)(raw)
        cases = {(flag, raw): [value] if options.get("nargs") else value}
    for argv, value in cases.items():
        assert OmegaConf.select(config(*argv), key) == value, argv


def test_help_lists_every_flag_and_every_key_with_its_default_and_comment():
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag, key, _ in FLAG_ROWS:
        assert flag in proc.stdout and f"[{key}" in proc.stdout
    listing = proc.stdout.split("(steps/config.py):\n\n")[1]
    # the listing is the schema's defaults, which are what Hydra composes
    composed = OmegaConf.to_container(config("recipe=standard"))
    assert OmegaConf.to_container(OmegaConf.create(listing)) == composed
    notes = [note for _, _, note in steps.config.walk(steps.config.RunConfig()) if note]
    assert all(f"# {note}" in listing for note in notes) and len(notes) > 40
    assert "whiten_advantages: true " in listing and "disable_dropout: true " in listing


# ---------------------------------------------------------------------------------------------
# refused overrides


def test_unknown_key_is_one_line(capsys):
    code, err = run_main(capsys, "sft.nope=1")
    assert code == 2
    assert "sft.nope" in one_line(err)


@pytest.mark.parametrize("override", ["sft.epochs=[1", "foo", "=3"])
def test_malformed_override_is_one_line(capsys, override):
    code, err = run_main(capsys, override)
    assert code == 2
    assert override in one_line(err)


@pytest.mark.parametrize("override, said", [
    ("ppo.kl_coef=abc", "ppo.kl_coef=abc: ppo.kl_coef takes a number"),
    ("sft.epochs=true", "sft.epochs=true: sft.epochs takes a whole number"),
    ("sft.epochs=1.5", "sft.epochs=1.5: sft.epochs takes a whole number"),
    ("data.split=[a,b,c]", "data.split=[a,b,c]: data.split takes a number for each item"),
    ("sft.lora={dim: x}", "sft.lora.dim=x: sft.lora.dim takes a whole number"),
    ("ppo=3", "ppo=3: ppo is a section, not a value; set its keys, e.g. ppo.<name>=value"),
])
def test_wrongly_typed_value_is_refused_up_front(capsys, tmp_path, override, said):
    code, err = run_main(capsys, "--output-dir", str(tmp_path / "out"), override)
    assert code == 2
    assert one_line(err).startswith(f"train.py: {said}"), err
    assert not (tmp_path / "out").exists()


def test_an_override_without_equals_says_to_write_key_value(capsys):
    code, err = run_main(capsys, "ppo.kl_coef")
    assert code == 2
    assert one_line(err).startswith("train.py: bad override 'ppo.kl_coef': write key=value")


@pytest.mark.parametrize("argv, said", [
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--step", "4"], "argument --step: invalid choice: 4 (choose from 1, 2, 3)"),
])
def test_a_bad_flag_is_one_line_not_the_usage(capsys, argv, said):
    with pytest.raises(SystemExit) as exited:
        train.parse_args(argv)
    assert exited.value.code == 2
    assert one_line(capsys.readouterr().err) == f"train.py: {said}; see train.py --help"


def test_a_misspelt_preset_gets_a_suggestion(capsys, tmp_path):
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", "tiny-lama")
    assert "did you mean the preset tiny-llama?" in line, line


def test_a_model_path_that_is_a_file_says_so(capsys, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", str(weights))
    assert line == (f"train.py: --actor-model {weights}: a file, not a directory; pass the "
                    "directory that holds the model (its config.json)")


def test_a_model_path_one_level_too_high_names_the_models_in_it(capsys, tmp_path):
    """output/step3 for output/step3/actor: the refusal names the directories that would do."""
    step3 = tmp_path / "step3"
    for name, files in (("actor", ["config.json"]), ("critic", ["config.json"]),
                        ("profile", ["ops.txt"])):
        (step3 / name).mkdir(parents=True)
        for file in files:
            (step3 / name / file).write_text("{}")
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", str(step3))
    assert line.endswith(f"; the models in it: {step3 / 'actor'}, {step3 / 'critic'}"), line
    line = refusal("--output-dir", str(tmp_path / "out"), f"ppo.critic_path={step3}")
    assert line.startswith(f"ppo.critic_path={step3}: no config.json there"), line
    assert line.endswith(f"; the models in it: {step3 / 'actor'}, {step3 / 'critic'}"), line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", str(empty))
    assert line.endswith("pass a Hugging Face model directory (e.g. output/actor)"), line

# ---------------------------------------------------------------------------------------------
# bad input: exit 2, one line that names the problem, nothing written


def refused(capsys, out: Path, *argv: str) -> str:
    before = tree(out)
    code, err = run_main(capsys, "--output-dir", str(out), *argv, *SMALL)
    assert code == 2, err
    assert tree(out) == before, "a refused run wrote into the output dir"
    if not before:
        assert not out.exists()
    return one_line(err)


def test_missing_model_path(capsys, tmp_path):
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", "./no/such/dir")
    assert "./no/such/dir" in line and "--actor-model" in line


def test_a_missing_tokenizer_dir_is_named_as_its_key(capsys, tmp_path):
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", "tiny-llama",
                   f"tokenizer={tmp_path / 'no-tok'}")
    assert line.startswith(f"train.py: tokenizer={tmp_path / 'no-tok'}: no such directory"), line


@pytest.mark.parametrize("argv", [("--output-dir", ""), ("--output-dir", "  "), ("output_dir=",)])
def test_an_empty_output_dir_is_refused_and_nothing_lands_in_the_working_dir(
        capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(capsys, "--step", "1", "--actor-model", "tiny-llama", *argv, *SMALL)
    assert code == 2
    assert "--output-dir" in one_line(err) and "empty" in err
    assert tree(tmp_path) == set()


def test_unknown_preset_name_offline(capsys, tmp_path):
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", "tiny-nonexistent",
                   "data.path=[demo]")
    assert "tiny-nonexistent" in line and "offline" in line


def test_missing_data_file(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"
    line = refused(capsys, tmp_path / "out", f"data.path=[{missing}]")
    assert str(missing) in line and "not found" in line


def test_malformed_json_data_file(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b", "rejected": \n')
    line = refused(capsys, tmp_path / "out", f"data.path=[{bad}]")
    assert str(bad) in line


def test_data_file_without_rejected(capsys, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f"a{i}"}) + "\n"
                            for i in range(5)))
    line = refused(capsys, tmp_path / "out", f"data.path=[{data}]")
    assert "rejected" in line and str(data) in line


def test_no_examples_left_after_filtering(capsys, tmp_path):
    line = refused(capsys, tmp_path / "out", "data.max_prompt_len=1")
    assert "after filtering" in line and "max_prompt_len" in line


def test_a_share_of_the_split_left_empty_is_not_blamed_on_prompt_length(capsys, tmp_path):
    """2 pairs split 2/4/4 give step 1 none: "0 of 0 prompts are longer than
    data.max_prompt_len" it said, after loading its model."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": " a", "rejected": " b"})
                            + "\n" for i in range(2)))
    line = refused(capsys, tmp_path / "out", f"data.path=[{data}]")
    assert line == ("train.py: data.split=[2.0, 4.0, 4.0] gives step 1 none of the 2 pairs in "
                    "data.path; add data or raise entry 1 of data.split"), line
    line = refused(capsys, tmp_path / "out", f"data.path=[{data}]", "--step", "3",
                   "ppo.ptx.enabled=true", "ppo.actor_path=tiny-llama",
                   "ppo.reward_model_weight=0", "ppo.reward_fn=steps.demo:score")
    assert "gives ppo.ptx (step 1's share) none of the 2 pairs" in line
    assert line.endswith("or set ppo.ptx.enabled=false")


def test_gather_partition_size_must_be_positive(capsys, tmp_path):
    line = refused(capsys, tmp_path / "out", "--tp-gather-partition-size", "0")
    assert "--tp-gather-partition-size" in line and "1 or more" in line


ZERO3 = ("--actor-zero-stage", "3")


@pytest.mark.parametrize("argv, names", [
    ((*ZERO3, "--zero-quantized-weights", "engine.zeropp.weight_bits=3"),
     ["engine.zeropp.weight_bits=3", "8 or 4"]),
    ((*ZERO3, "--zero-quantized-gradients", "engine.zeropp.grad_bits=16"),
     ["grad_bits=16", "8 or 4"]),
    ((*ZERO3, "--zero-hpz-partition-size", "-1"),
     ["engine.zeropp.hpz=-1", "--zero-hpz-partition-size", "1 (off)"]),
    ((*ZERO3, "--zero-quantized-weights", "engine.zeropp.block=7"),
     ["engine.zeropp.block=7", "even"]),
    (("--zero-quantized-weights",), ["engine.zeropp", "--actor-zero-stage 3"]),
    (("--actor-zero-stage", "2", "--reward-zero-stage", "1", "--zero-hpz-partition-size", "2"),
     ["engine.zeropp", "--zero-hpz-partition-size", "--reward-zero-stage 3"]),
    (("engine.procs=4", "engine.procs_per_node=3"),
     ["engine.procs_per_node=3", "engine.procs=4", "divisor"]),
    (("engine.procs=4", "engine.procs_per_node=0"), ["engine.procs_per_node=0"]),
    (("--zero-quantized-nontrainable-weights",),
     ["engine.quantized_base", "no model of this run has LoRA", "ppo.actor_lora.dim"]),
    (("--zero-quantized-nontrainable-weights", "sft.lora.dim=8",
      "engine.quantized_base.bits=2"), ["engine.quantized_base.bits=2", "8 or 4"]),
], ids=["weight-bits", "grad-bits", "hpz-negative", "odd-block", "no-zero3-actor",
        "no-zero3-any", "procs-per-node-divides", "procs-per-node-zero", "quantized-no-lora",
        "quantized-bits"])
def test_zeropp_config_errors_name_the_key(capsys, tmp_path, argv, names):
    """check_zeropp refuses before anything starts (no torchrun launch either)."""
    line = refused(capsys, tmp_path / "out", *argv)
    for name in names:
        assert name in line, (name, line)


def test_zeropp_flags_with_zero3_pass_the_check():
    cfg = config(*ZERO3, "--zero-quantized-weights", "--zero-hpz-partition-size", "2",
                 "--zero-quantized-gradients", "engine.procs=4", "engine.procs_per_node=2")
    train.check_zeropp(cfg)
    assert (cfg.engine.zeropp.qwz, cfg.engine.zeropp.hpz, cfg.engine.zeropp.qgz) == (True, 2, True)
    train.check_zeropp(config("--reward-zero-stage", "3", "--zero-quantized-gradients"))


def test_step_2_needs_reward_model(capsys, tmp_path):
    line = refused(capsys, tmp_path / "out", "--actor-model", "tiny-llama", "--step", "2")
    assert "--reward-model" in line


def test_finished_model_is_not_overwritten_unless_asked(capsys, tmp_path):
    out = tmp_path / "out"
    (out / "actor").mkdir(parents=True)
    (out / "actor" / "config.json").write_text("{}")
    line = refused(capsys, out, "--step", "1")
    assert str(out / "actor") in line and "overwrite=true" in line
    assert (out / "actor" / "config.json").read_text() == "{}"

    code = train.main(["--output-dir", str(out), "--step", "1", "overwrite=true", *SMALL])
    assert code == 0, capsys.readouterr().err
    written = json.loads((out / "actor" / "config.json").read_text())
    assert written["model_type"] == "llama"
    assert (out / "actor" / "model.safetensors").exists()
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp dirs left behind"
    assert not (out / "reward").exists() and not (out / "step2").exists()


@pytest.mark.parametrize("argv, names", [
    (("ppo.algorithm=grpo", "ppo.samples_per_prompt=1"),   # the demo recipe's 4 pinned off
     ["ppo.samples_per_prompt=1", "grpo", "2 or more"]),
    (("ppo.reward_fn=nowhere_xyz:score",), ["ppo.reward_fn=nowhere_xyz:score", "cannot import"]),
    (("data.demo_task=sums",), ["data.demo_task=sums", "digits, distinct"]),
], ids=["grpo-group", "reward-fn", "demo-task"])
def test_step3_algorithm_errors_name_the_key(capsys, tmp_path, argv, names):
    """Refused before step 1 runs, so a long run does not fail at step 3."""
    line = refused(capsys, tmp_path / "out", *argv)
    assert all(name in line for name in names), line


# ---------------------------------------------------------------------------------------------
# every key in its schema's range, unreadable models and an unusable output dir: one line,
# naming the key or path, nothing written


@pytest.mark.parametrize("override, said", [
    ("sft.lr=-1e-3", "sft.lr=-0.001: give a learning rate above 0 and at most 1"),
    ("ppo.actor_lr=0", "ppo.actor_lr=0.0: give a learning rate above 0 and at most 1"),
    # AdamW moves each weight by about the rate: 1e38 overflowed step 3's Adam step size
    ("ppo.critic_lr=1e38", "ppo.critic_lr=1e+38: give a learning rate above 0 and at most 1"),
    ("rm.lora.learning_rate=2", "rm.lora.learning_rate=2.0: give a learning rate above 0"),
    ("rm.batch_size=0", "rm.batch_size=0: give 1 or more"),
    ("ppo.micro_batch_size=0", "ppo.micro_batch_size=0: give 1 or more"),
    ("sft.epochs=-1", "sft.epochs=-1: give 1 or more"),
    ("data.split=[1,-1,1]", "data.split=[1.0, -1.0, 1.0]: give 0 or more, for every entry"),
    ("data.split=[0,0,0]", "data.split=[0.0, 0.0, 0.0]: give at least one weight above 0"),
    ("data.eval_fraction=1", "data.eval_fraction=1.0: give a number in [0, 1)"),
    ("engine.device=tpu", "engine.device=tpu: choose auto, cpu, cuda or cuda:N"),
    ("engine.dtype=int8", "engine.dtype=int8: choose one of auto, float32"),
    ("ppo.temperature=0", "ppo.temperature=0.0: give a number above 0"),
    ("ppo.top_p=1.5", "ppo.top_p=1.5: give a number in (0, 1]"),
    ("ppo.gamma=2", "ppo.gamma=2.0: give a number in [0, 1]"),
    ("ppo.profile=[3,2]", "ppo.profile=[3, 2]: give [] or [first, last] with 1 <= first"),
    ("ppo.forward_batch_size=0", "ppo.forward_batch_size=0: give 1 or more"),
    ("sft.lr_scheduler=sine", "sft.lr_scheduler=sine: choose one of linear, cosine"),
    ("ppo.algorithm=kto", "ppo.algorithm=kto: choose one of ppo, grpo, rloo, reinforce_pp"),
    ("engine.max_skipped_steps=0", "engine.max_skipped_steps=0: give 1 or more"),
    ("ppo.actor_lora.dropout=1", "ppo.actor_lora.dropout=1.0: give a number in [0, 1)"),
    ("actor_zero_stage=5", "actor_zero_stage=5 (--actor-zero-stage): choose one of 0, 1, 2, 3"),
    ("engine.hybrid.gather_group_size=0", "(--tp-gather-partition-size): give 1 or more"),
    ("data.chat_template_kwargs={enable-thinking:0}", "data.chat_template_kwargs="
     "{'enable-thinking': 0}: give a mapping of variable names to values"),
    ("data.chat_template_kwargs=[1]", "data.chat_template_kwargs=[1]: give a mapping"),
    ("data.chat_template_kwargs={add_generation_prompt:true}", "(not messages or "
     "add_generation_prompt or continue_final_message: the steps set those)"),
    ("data.chat_template_kwargs={none:1}", "chat_template_kwargs={'none': 1}: give a mapping"),
    ("data.chat_template_kwargs={x:[1,nan]}", "(finite numbers)"),
    # without data.apply_chat_template no template reads them
    ("data.chat_template_kwargs={enable_thinking:false}", "data.chat_template_kwargs: the "
     "chat template reads them only with data.apply_chat_template=true"),
    ("sft.warmup_ratio=1", "sft.warmup_ratio=1.0: give a number in [0, 1)"),
    ("rm.warmup_steps=2 rm.warmup_ratio=0.1", "rm.warmup_steps=2 and rm.warmup_ratio=0.1: "
     "give one of them (the other 0)"),
    ("sft.multiturn=true sft.train_on_prompt=true", "sft.multiturn=true and "
     "sft.train_on_prompt=true: the prompt's tokens, earlier replies included, are trained "
     "on already"),
], ids=lambda v: v.split("=")[0] if "=" in v else None)
def test_out_of_range_values_are_refused_naming_the_key(capsys, tmp_path, override, said):
    line = refused(capsys, tmp_path / "out", *override.split())
    assert said in line, line


def test_a_split_of_zeros_is_refused_only_where_a_step_reads_data_path(tmp_path):
    """Steps with data of their own ignore data.split: --step 1 with data.sft_path was
    refused "give at least one weight above 0"; ppo.ptx still needs step 1's share."""
    zeros = ("--actor-model", "tiny-llama", "--output-dir", str(tmp_path / "out"),
             "data.split=[0,0,0]", "ppo.prompt_data=[q.jsonl]", "ppo.actor_path=tiny-llama",
             "ppo.reward_model_weight=0", "ppo.reward_fn=steps.demo:score")
    own = (*zeros, "data.sft_path=[sft.jsonl]")
    for chosen in (["--step", "1"], ["--step", "1", "3"], ["--step", "3"]):
        train.check_config(config(*own, *chosen))
    with pytest.raises(train.UserError, match=r"give at least one weight above 0"):
        train.check_config(config(*own, "--step", "1", "2"))
    with pytest.raises(train.UserError, match=r"ppo.ptx trains on step 1's share"):
        train.check_config(config(*zeros, "--step", "3", "ppo.ptx.enabled=true"))


def test_every_key_with_a_rule_accepts_its_default():
    steps.config.validate(OmegaConf.structured(steps.config.RunConfig))
    steps.config.validate(config())   # the demo recipe's values


def test_an_output_dir_that_is_a_file_is_refused(capsys, tmp_path):
    out = tmp_path / "out"
    out.write_text("not a directory")
    code, err = run_main(capsys, "--output-dir", str(out), *SMALL)
    assert code == 2 and one_line(err) == (f"train.py: --output-dir {out}: a file, not a "
                                           "directory; choose another path")
    assert out.read_text() == "not a directory"


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    from engine.models import byte_tokenizer, load_causal_lm

    good = tmp_path_factory.mktemp("models") / "good"
    load_causal_lm("tiny-llama", byte_tokenizer()).save_pretrained(good)
    byte_tokenizer().save_pretrained(good)
    return good


def broken_copy(good: Path, where: Path, kind: str) -> Path:
    """A copy of the model directory `good` broken in one way (`kind`)."""
    import shutil

    broken = where / kind
    shutil.copytree(good, broken)
    weights = broken / "model.safetensors"
    if kind == "truncated-weights":
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    elif kind == "not-safetensors":
        weights.write_bytes(b"PK\x03\x04 a zip, not safetensors")
    elif kind == "bad-config":
        (broken / "config.json").write_text("{not json")
    elif kind == "unknown-architecture":
        (broken / "config.json").write_text('{"model_type": "no-such-arch"}')
    elif kind == "no-weights":   # a copy broken off after config.json
        weights.unlink()
    elif kind == "no-tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (broken / name).unlink(missing_ok=True)
    return broken


BROKEN = {"truncated-weights": "a weights file is truncated or not safetensors",
          "not-safetensors": "a weights file is truncated or not safetensors",
          "bad-config": "config.json' is not a valid JSON file",
          "unknown-architecture": "no-such-arch",
          "no-weights": "the directory has config.json but no weights (one of "
                        "model.safetensors,",
          "no-tokenizer": "the directory has no tokenizer files"}


def test_tensorboard_without_its_package_is_refused_before_anything_runs(tmp_path,
                                                                          monkeypatch):
    """By check_config: a --step 3 run would have loaded its models first."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "tensorboard" else real(name, *args))
    assert refusal("--output-dir", str(tmp_path / "out"), "--step", "1", "--actor-model",
                   "tiny-llama", "logging.tensorboard=true") == (
        "logging.tensorboard=true: the tensorboard package is not installed (pip install "
        "tensorboard, or logging.tensorboard=false)")


@pytest.mark.parametrize("kind", BROKEN)
def test_an_unreadable_model_dir_is_one_line_and_leaves_nothing(capsys, tmp_path, saved_model,
                                                                 kind):
    broken = broken_copy(saved_model, tmp_path, kind)
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", str(broken),
                   "data.path=[demo]")
    assert f"--actor-model {broken}" in line and BROKEN[kind] in line, line


# ---------------------------------------------------------------------------------------------
# keys the schema lacks, flags the deployment ignores, output dirs that cannot be made,
# non-finite numbers, steps without data: refused up front (in-process: checked by
# check_config, so nothing would start if it failed to refuse)


def refusal(*argv: str) -> str:
    """check_config's one-line refusal of the run `argv`."""
    with pytest.raises(train.UserError) as caught:
        train.check_config(config(*argv))
    return str(caught.value)


@pytest.mark.parametrize("override, said", [
    ("+sft.epoch=2", "unknown key sft.epoch (did you mean sft.epochs?)"),
    ("++sft.epoch=2", "unknown key sft.epoch (did you mean sft.epochs?)"),
    ("sft.epoch=2", "unknown key sft.epoch (did you mean sft.epochs?)"),  # Hydra: "use +"
    ("+sft={epoch: 2}", "unknown key sft.epoch (did you mean sft.epochs?)"),
    ("sft.lora={dmi: 8}", "unknown key sft.lora.dmi (did you mean sft.lora.dim?)"),
    ("+sft.kl_coef=0.2", "unknown key sft.kl_coef (did you mean ppo.kl_coef?)"),
    ("+foo=2", "unknown key foo (train.py --help lists every key)"),
    ("+logging.wandb.tags=[a]", "unknown key logging.wandb.tags (train.py --help lists"),
], ids=["plus", "plus-plus", "plain", "plus-mapping", "mapping", "other-section", "top-level",
        "wandb"])
def test_unknown_keys_are_refused_with_the_nearest_known_one(capsys, tmp_path, override, said):
    line = refused(capsys, tmp_path / "out", "--step", "1", "--actor-model", "tiny-llama",
                   override)
    assert line.startswith(f"train.py: {said}"), line


def test_a_free_form_key_still_takes_any_value():
    cfg = config("--actor-model", "X", "ppo.actor_lora.target_modules=[q_proj,v_proj]")
    assert list(cfg.ppo.actor_lora.target_modules) == ["q_proj", "v_proj"]
    cfg.ppo.actor_lora.target_modules = {"q_proj": {"r": 4}}   # `Any`: not a section
    assert steps.config.unknown_keys(cfg) == []


@pytest.mark.parametrize("argv, said", [
    (("--nnodes", "2", "--node-rank", "1"), "--nnodes 2 (launch.nnodes)"),
    (("--node-rank", "1"), "--node-rank 1 (launch.node_rank)"),
    (("--master-addr", "10.0.0.1"), "--master-addr 10.0.0.1 (launch.master_addr)"),
    (("--master-port", "1234"), "--master-port 1234 (launch.master_port)"),
    (("--hostfile", "hosts"), "--hostfile hosts (launch.hostfile)"),
    (("--deployment-type", "single_node", "launch.nnodes=2"), "--nnodes 2 (launch.nnodes)"),
], ids=["nnodes", "node-rank", "master-addr", "master-port", "hostfile", "single-node"])
def test_rendezvous_flags_need_multi_node(argv, said):
    """Without multi_node a node would run the whole job alone, into the shared output dir."""
    line = refusal(*argv)
    assert line.startswith(said) and "add --deployment-type multi_node" in line, line


def test_rendezvous_flags_pass_with_multi_node():
    train.check_launch(config("--deployment-type", "multi_node", "--nnodes", "2",
                              "--node-rank", "1", "--master-addr", "10.0.0.1"))
    train.check_launch(config("--nnodes", "1"))   # one node is what it runs anyway


@pytest.mark.parametrize("argv, said", [
    (("ppo.critic_path=/no/such/critic",), "ppo.critic_path=/no/such/critic: no config.json"),
    (("--step", "2", "3", "--reward-model", "tiny-llama"), "step 3 needs the step-1 actor at"),
    (("--step", "1", "3", "--actor-model", "tiny-llama"), "step 3 needs the step-2 reward model"),
], ids=["typo", "no-step-1", "no-step-2"])
def test_step_3_models_are_checked_before_steps_1_and_2_train(tmp_path, argv, said):
    """Found only when step 3 started, such a mistake cost the whole of steps 1 and 2."""
    assert refusal("--output-dir", str(tmp_path / "out"), *argv).startswith(said)
    train.check_config(config("--output-dir", str(tmp_path / "out")))   # 1-2 make them
    # however a key spells them: the critic from the step-1 actor, a relative actor path
    out = Path(os.path.relpath(tmp_path / "out"))
    train.check_config(config("--output-dir", str(tmp_path / "out"), "ppo.critic_path="
                              f"{tmp_path / 'out' / 'actor'}", f"ppo.actor_path={out / 'actor'}"))


def test_a_rollout_longer_than_a_learned_position_table_is_refused_before_step_1(tmp_path):
    """A GPT-2 reads at most n_positions tokens: found when step 3 loaded it, that cost the
    whole of steps 1 and 2; read from the configs alone, it is refused up front."""
    line = refusal("--output-dir", str(tmp_path / "out"), "--actor-model", "tiny-gpt2",
                   "--reward-model", "tiny-llama", "ppo.max_new_tokens=5000")
    assert line.startswith("data.max_prompt_len=256 + ppo.max_new_tokens=5000"), line
    assert "reads up to 5256 tokens, but --actor-model tiny-gpt2 (gpt2" in line
    assert "at most 1024" in line
    # the reward model reads one token more (the EOS a cut-off answer gets)
    line = refusal("--output-dir", str(tmp_path / "out"), "--actor-model", "tiny-llama",
                   "--reward-model", "tiny-gpt2", "data.max_prompt_len=768",
                   "ppo.max_new_tokens=256")
    assert "reads up to 1025 tokens, but --reward-model tiny-gpt2" in line, line
    train.check_config(config("--output-dir", str(tmp_path / "out"), "--actor-model",
                              "tiny-llama", "--reward-model", "tiny-gpt2",
                              "data.max_prompt_len=767", "ppo.max_new_tokens=256"))
    # a model step 3 loads as it is, by its key: read from its config.json
    from transformers import GPT2Config

    short = tmp_path / "short-gpt2"
    GPT2Config(n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(short)
    (short / "model.safetensors").touch()   # never read: the config refuses it first
    line = refusal("--output-dir", str(tmp_path / "out"), "--step", "2", "3",
                   f"ppo.actor_path={short}", "--reward-model", "tiny-llama",
                   "data.max_prompt_len=32", "ppo.max_new_tokens=33")
    assert f"reads up to 65 tokens, but ppo.actor_path={short} (gpt2" in line, line
    assert "at most 64" in line


def test_under_torchrun_each_rank_checks_the_rollout_length(tmp_path, monkeypatch):
    """The launcher's process stays without transformers (tests/test_launch.py): there the
    check waits for the ranks, which make it before step 1 as one process does."""
    argv = ("--output-dir", str(tmp_path / "out"), "--actor-model", "tiny-gpt2",
            "--reward-model", "tiny-llama", "ppo.max_new_tokens=5000", "engine.procs=2")
    train.check_config(config(*argv))   # the launcher: torchrun's ranks will check
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")   # a rank
    assert "reads up to 5256 tokens, but --actor-model tiny-gpt2" in refusal(*argv)


def test_the_steps_key_runs_each_step_once_in_order():
    assert list(config("steps=[3,1,1]").steps) == [1, 3]


def test_an_output_dir_that_cannot_be_made_is_refused(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("{}\n")
    assert refusal("--output-dir", str(data / "out" / "run")) == (
        f"--output-dir {data / 'out' / 'run'}: {data} is a file, not a directory; choose "
        "another path")
    if Path("/proc/self").is_dir():   # Linux: made by no one, root included
        assert refusal("--output-dir", "/proc/nope") == (
            "--output-dir /proc/nope: cannot create it in /proc (not writable); choose "
            "another path")
    train.check_output_dir(tmp_path / "new" / "run")   # a writable place passes...
    assert list(tmp_path.iterdir()) == [data]          # ...and is left as it was


@pytest.mark.parametrize("override, said", [
    ("data.split=[inf,1,1]", "data.split=[inf, 1.0, 1.0]: not a finite number; give 0 or more, "
                             "for every entry"),
    ("sft.lr=inf", "sft.lr=inf: not a finite number; give a learning rate above 0 and at most 1"),
    ("ppo.kl_coef=1e999", "ppo.kl_coef=inf: not a finite number; give 0 or more"),
    ("ppo.gamma=nan", "ppo.gamma=nan: not a finite number; give a number in [0, 1]"),
    ("ppo.reward_fn_weight=inf", "ppo.reward_fn_weight=inf: give a finite number"),
], ids=["split", "lr", "overflow", "nan", "unruled-float"])
def test_non_finite_numbers_are_refused(override, said):
    assert refusal(override) == said


def test_a_yaml_inf_is_refused():
    yaml = OmegaConf.create("sft:\n  lr: .inf\nppo:\n  score_clip: .inf\n")
    cfg = OmegaConf.merge(OmegaConf.structured(steps.config.RunConfig), yaml)
    with pytest.raises(steps.config.BadValue, match=r"^sft.lr=inf: not a finite number"):
        steps.config.validate(cfg)


@pytest.mark.parametrize("argv, said", [
    (("--step", "2", "data.split=[1,0,0]"), "step 2 gets no data (its weight, entry 2, is 0)"),
    (("--step", "1", "data.split=[0,1,1]"), "step 1 gets no data (its weight, entry 1, is 0)"),
    (("--step", "3", "data.split=[1,1,0]", "ppo.reward_fn=steps.demo:score",
      "ppo.reward_model_weight=0"), "step 3 gets no data (its weight, entry 3, is 0)"),
    (("--step", "3", "data.split=[0,1,1]", "ppo.ptx.enabled=true"),
     "ppo.ptx trains on step 1's share, and its weight (entry 1) is 0"),
], ids=["step2", "step1", "step3-reward-fn", "ptx"])
def test_a_selected_step_without_data_is_refused_naming_the_split(tmp_path, argv, said):
    """Before step 1 runs, not blamed on data.max_prompt_len once step 2 finds no pairs."""
    out = ("--output-dir", str(tmp_path / "out"))   # not ./output: the demo may have run there
    line = refusal(*out, *argv)
    assert line.startswith("data.split=[") and said in line, line
    train.check_config(config(*out, "--step", "3", "data.split=[0,1,1]",   # step 3 alone: fine
                              "ppo.actor_path=tiny-llama", "ppo.reward_model_weight=0",
                              "ppo.reward_fn=steps.demo:score"))


# ---------------------------------------------------------------------------------------------
# Ctrl-C: one line that says what the same command does next, not a traceback


@pytest.mark.parametrize("checkpointed, resume, said", [
    (True, "auto", "run the same command to go on: step 1 is kept, step 2 resumes from its "
                   "last checkpoint, step 3 runs"),
    (False, "auto", "run the same command to go on: step 1 is kept, step 2 runs again "
                    "(stopped before its first checkpoint), step 3 runs"),
    (True, "false", "run the same command with resume=auto to go on: step 1 is kept, step 2 "
                    "resumes from its last checkpoint, step 3 runs"),
], ids=["checkpointed", "before-the-first-checkpoint", "resume-false"])
def test_ctrl_c_says_what_the_same_command_does_next(capsys, tmp_path, monkeypatch,
                                                     checkpointed, resume, said):
    import steps.reward
    import steps.sft

    out = tmp_path / "out"

    def sft(cfg, *_):
        (out / "actor").mkdir(parents=True)
        steps.config.step_dir(cfg, 1).mkdir()

    def interrupted_reward(cfg, *_):
        steps.config.step_dir(cfg, 2).mkdir()
        if checkpointed:
            (steps.config.step_dir(cfg, 2) / "checkpoints" / "step-00000004").mkdir(parents=True)
            (steps.config.step_dir(cfg, 2) / "checkpoints" / "step-00000004" / "state.json"
             ).write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(steps.sft, "run", sft)
    monkeypatch.setattr(steps.reward, "run", interrupted_reward)
    try:
        code, err = run_main(capsys, "--output-dir", str(out), f"resume={resume}", *SMALL)
    except KeyboardInterrupt:   # (escaping, it would stop pytest itself)
        pytest.fail("Ctrl-C escaped train.main as a traceback")
    assert code == 130
    assert one_line(err) == f"train.py: interrupted; {said}"


@pytest.mark.parametrize("dtype, warned", [("float16", True), ("bfloat16", False)])
def test_float16_on_the_cpu_is_said_to_be_slow(capsys, tmp_path, monkeypatch, dtype, warned):
    """The demo's step 1 took 90 s in float16 on the CPU against 4.7 s in float32."""
    import steps.sft

    def sft(cfg, *_):
        steps.config.step_dir(cfg, 1).mkdir(parents=True)

    monkeypatch.setattr(steps.sft, "run", sft)
    code = train.main(["--step", "1", "--output-dir", str(tmp_path / "out"), "engine.device=cpu",
                       f"engine.dtype={dtype}", *SMALL])
    assert code == 0
    said = "engine.dtype=float16 on the CPU: most CPUs have no float16 arithmetic"
    assert (said in capsys.readouterr().out) == warned
