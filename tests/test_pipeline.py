"""End to end: train.py runs steps 1 (SFT), 2 (reward model) and 3 (PPO) on tiny presets and
on real hh-rlhf data, and what it writes is usable without this project (transformers alone,
chat.py). Each full run is a module-scoped fixture shared by several tests."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.errors import UserError
from engine.model_source import model_source
from engine.models import (
    byte_tokenizer,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    sequence_scores,
)
from engine.tracking import read_metrics
from tests.harness.in_process import TrainRun, train_here

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
HH_RLHF = SHARED / "data" / "hh-rlhf-harmless-base-test.jsonl.gz"
OPT_TOKENIZER = SHARED / "tokenizers" / "opt"
OPT_HELLO_WORLD = [2, 31414, 232]  # "Hello world" with the OPT tokenizer (BOS </s> first)

# Small enough that a whole three-step run takes seconds on two CPU cores.
BASE = {
    "recipe": "demo",
    "data.path": "[demo]",
    "data.demo_pairs": 160,
    "data.max_prompt_len": 64,
    "data.max_answer_len": 12,
    "sft.epochs": 1,
    "sft.batch_size": 8,
    "rm.epochs": 1,
    "rm.batch_size": 8,
    "ppo.rollout_batch_size": 8,
    "ppo.micro_batch_size": 4,
    "ppo.eval_prompts": 8,
    "logging.progress": "false",
    # pinned, so that changes to the demo recipe do not change what these tests run
    "sft.lr": 2e-3, "sft.warmup_steps": 0,
    "rm.lr": 1e-3, "rm.warmup_steps": 0,
    "ppo.epochs": 1, "ppo.ppo_epochs": 1, "ppo.actor_lr": 2e-4, "ppo.critic_lr": 5e-4,
    "ppo.warmup_steps": 0, "ppo.samples_per_prompt": 1, "ppo.best_of_n": 8,
    # these tests check what training did to the last policy; export=best has its own tests
    "ppo.export": "last",
}
# Smaller still, for the runs that only need to show that something works.
SMALL = {**BASE, "data.demo_pairs": 80, "ppo.rollout_batch_size": 16,
         "ppo.micro_batch_size": 8, "ppo.eval_prompts": 4}

MODEL_DIRS = ("actor", "reward", "step3/actor", "step3/critic")
STEP3_KEYS = ("reward/score", "reward/kl", "answer/length", "train/clip_fraction",
              "train/value_loss", "time/generate", "time/train", "time/generate_tokens_per_s",
              "time/gather", "time/experience", "time/other", "time/iteration",
              "time/samples_per_s", "time/prefill", "time/decode", "time/decode_step_ms")
PHASES = ("gather", "generate", "experience", "train", "other")


def overrides(settings: dict, **extra) -> list[str]:
    return [f"{key}={value}" for key, value in {**settings, **extra}.items()]


def run_train(*args, settings: dict = BASE, **extra) -> TrainRun:
    return train_here([*args, *overrides(settings, **extra)])


def metrics(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    assert lines, f"{path} is empty"
    for line in lines:   # strict JSON: NaN and inf are written as null
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{path}: {name}"))
    rows = read_metrics(path)
    assert all(isinstance(row, dict) for row in rows)
    return rows


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def relative_change(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> float:
    """||new - old|| / ||old|| over all matrices (>= 2-D) of two state dicts with equal keys."""
    assert new.keys() == old.keys()
    diff = sum(float((new[k] - old[k]).float().norm() ** 2) for k in old if old[k].ndim >= 2)
    base = sum(float(old[k].float().norm() ** 2) for k in old if old[k].ndim >= 2)
    return math.sqrt(diff / base)


def assert_model_dir(model_dir: Path) -> None:
    assert model_dir.is_dir(), model_dir
    assert (model_dir / "config.json").is_file()
    assert (model_dir / "model.safetensors").is_file()
    assert (model_dir / "tokenizer_config.json").is_file()
    assert (model_dir / "tokenizer.json").is_file() or (model_dir / "vocab.json").is_file()
    assert not any("lora_" in key for key in weights(model_dir)), "LoRA was not merged"


def assert_no_leftovers(out: Path) -> None:
    left = [p for pattern in (".*.tmp-*", ".*.old-*") for p in out.rglob(pattern)]
    assert not left, f"unfinished exports left behind: {left}"


def model_type(model_dir: Path) -> str:
    return json.loads((model_dir / "config.json").read_text())["model_type"]


def shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"shared fixture not found at {path} (../shared is absent)")
    return path


# ---------------------------------------------------------------------------------------------
# Runs shared by the tests


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from a second thread, and on a shared machine a busy
    neighbour makes two spinning threads 10-50x slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def subprocess_env() -> dict[str, str]:
    """Environment of a child interpreter: offline, one thread, nothing of ours on its path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


_FULL_RUNS: dict[str, tuple[Path, TrainRun]] = {}   # one run per preset for the whole module


def full_run(tmp_path_factory, arch: str) -> tuple[Path, TrainRun]:
    if arch not in _FULL_RUNS:
        out = tmp_path_factory.mktemp(arch)
        _FULL_RUNS[arch] = out, run_train("--actor-model", arch, "--reward-model", arch,
                                          "--output-dir", out).check()
    return _FULL_RUNS[arch]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory) -> tuple[Path, TrainRun]:
    return full_run(tmp_path_factory, "tiny-llama")


PRESET_TYPES = {"tiny-llama": "llama", "tiny-opt": "opt", "tiny-gpt2": "gpt2",
                "tiny-gpt-neox": "gpt_neox"}


@pytest.fixture(scope="module", params=list(PRESET_TYPES))
def pipeline(request, tmp_path_factory) -> tuple[str, Path, TrainRun]:
    if request.param == "tiny-llama":
        return (request.param, *request.getfixturevalue("llama_run"))
    return (request.param, *full_run(tmp_path_factory, request.param))


@pytest.fixture(scope="module")
def opt_tokenizer() -> Path:
    return shared(OPT_TOKENIZER)


@pytest.fixture(scope="module")
def hh_run(tmp_path_factory, opt_tokenizer) -> tuple[Path, TrainRun, TrainRun]:
    """Steps 1 and 2 on real hh-rlhf data with the OPT tokenizer, then a short step 3.

    The file holds ~2300 pairs and the OPT vocabulary makes every token's logits 50k wide
    (~1.3 s per SFT batch of 8 on one core), so the split is skewed to keep each run short:
    steps 1 and 2 get 1/30 and 4/30 of the pairs (~77 and ~307), and the step-3 run (same
    output dir, its own split) ~1/120 of them as prompts."""
    data = shared(HH_RLHF)
    out = tmp_path_factory.mktemp("hh")
    models = ["--actor-model", "tiny-opt", "--reward-model", "tiny-opt", "--output-dir", out]
    real = {**BASE, "tokenizer": opt_tokenizer, "data.path": f"[{data}]",
            "data.max_prompt_len": 128, "data.max_answer_len": 32, "ppo.eval_prompts": 0}
    first = run_train("--step", "1", "2", *models, settings=real,
                      **{"data.split": "[1,4,25]"}).check()
    third = run_train("--step", "3", *models, settings=real,
                      **{"data.split": "[60,59,1]", "ppo.max_new_tokens": 8,
                         "ppo.rollout_batch_size": 16, "ppo.micro_batch_size": 8}).check()
    return out, first, third


# ---------------------------------------------------------------------------------------------
# 1. All three steps on each preset: what lands in the output dir


def test_three_steps_write_models_configs_and_metrics(pipeline):
    arch, out, run = pipeline
    for name in MODEL_DIRS:
        assert_model_dir(out / name)
    assert not (out / "step3" / "actor_ema").exists()
    assert_no_leftovers(out)
    for name in MODEL_DIRS:
        assert model_type(out / name) == PRESET_TYPES[arch], name

    for step in (1, 2, 3):
        cfg = OmegaConf.load(out / f"step{step}" / "config.yaml")
        assert cfg.actor_model == arch and cfg.reward_model == arch
        assert cfg.output_dir == str(out)
        assert cfg.data.max_answer_len == 12
        assert cfg.ppo.max_new_tokens == 12  # the snapshot is resolved
        assert (out / f"step{step}" / "metrics.jsonl").is_file()

    sft_rows = metrics(out / "step1" / "metrics.jsonl")
    assert math.isfinite(sft_rows[-1]["eval/perplexity"])
    rm_rows = metrics(out / "step2" / "metrics.jsonl")
    assert 0.0 <= rm_rows[-1]["eval/accuracy"] <= 1.0
    # the reward model carries its held-out scores' statistics (ppo.normalize_reward's)
    rm_config = json.loads((out / "reward" / "config.json").read_text())
    assert rm_config["score_mean"] == pytest.approx(rm_rows[-1]["eval/score_mean"], rel=1e-6)
    assert rm_config["score_std"] == pytest.approx(rm_rows[-1]["eval/score_std"], rel=1e-6)
    assert rm_config["score_std"] > 0

    ppo_rows = metrics(out / "step3" / "metrics.jsonl")
    iterations = [row for row in ppo_rows if "reward/score" in row]
    assert len(iterations) == ppo_rows[-1]["iterations"] > 0
    for row in iterations:
        missing = [key for key in STEP3_KEYS if key not in row]
        assert not missing, f"step-3 metrics lack {missing}: {row}"
        assert all(math.isfinite(row[key]) for key in STEP3_KEYS), row
        assert 0 < row["answer/length"] <= 12
        # the time breakdown adds up to the iteration (each figure rounded to 1e-6)
        assert sum(row[f"time/{p}"] for p in PHASES) == pytest.approx(
            row["time/iteration"], abs=1e-5)
        # the inference decoder's split of the generate phase, within it
        assert 0 < row["time/prefill"] + row["time/decode"] <= row["time/generate"] + 1e-5
        assert row["time/decode_step_ms"] > 0
    # the running memory peak on every iteration (a run cut off early still has it),
    # never falling, and the summary's the last of it or above. On the CPU it is the
    # kernel's VmHWM, max(high-water mark, current RSS), whose RSS is a sum of per-CPU
    # counters that may run a few dozen pages ahead: a reading can sit ~0.2 MiB above
    # a later one, hence the slack
    peaks = [row["memory/peak_mib"] for row in iterations + ppo_rows[-1:]]
    assert 0 < peaks[0] and all(b > a - 1 for a, b in itertools.pairwise(peaks)), peaks
    assert {"eval/reward_before", "eval/reward_after"} <= ppo_rows[-1].keys()
    assert "step 3 (PPO) done" in run.stdout
    assert "step 3 iteration 1: " in run.stdout and "step 3 mean iteration: " in run.stdout
    # the hybrid engine has inference modules for every preset's architecture
    assert "generating with the gathered Hugging Face modules" not in run.stdout


def test_step3_is_the_same_without_the_hybrid_engine(llama_run, tmp_path):
    """Generating on the training model instead of the inference form changes nothing in
    step 3 but its speed: the same metrics, the same trained actor."""
    out, _ = llama_run
    plain = tmp_path / "plain"
    run_train("--actor-model", "tiny-llama", "--reward-model", "tiny-llama", "--step", "3",
              "--output-dir", plain, "--no-enable-hybrid-engine",
              **{"ppo.actor_path": out / "actor", "ppo.reward_path": out / "reward"}).check()

    def without_times(path: Path) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))}
                for row in metrics(path / "step3" / "metrics.jsonl")]

    assert without_times(plain) == without_times(out)
    got, want = weights(plain / "step3" / "actor"), weights(out / "step3" / "actor")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_step3_packed_trains_as_padded(llama_run, tmp_path, monkeypatch):
    """ppo.packing runs the actor's, reference's, critic's and reward model's forwards
    without the rollouts' padding: the same run to rounding (the same answers, losses,
    scores, KL and evaluations) as the padded one; an OPT actor, whose attention would mix
    the packed rollouts, is refused before step 3 starts."""
    import engine.models
    out, _ = llama_run
    tokens = []   # (padded, packed) of each forward

    def counted(input_ids, attention_mask, unpadded=engine.models.unpadded):
        layout = unpadded(input_ids, attention_mask)
        tokens.append((input_ids.numel(), layout.input_ids.numel()))
        return layout

    monkeypatch.setattr(engine.models, "unpadded", counted)
    packed = tmp_path / "packed"
    run_train("--actor-model", "tiny-llama", "--reward-model", "tiny-llama", "--step", "3",
              "--output-dir", packed, **{"ppo.actor_path": out / "actor",
                                         "ppo.reward_path": out / "reward",
                                         "ppo.packing": True}).check()

    def numbers(path: Path) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.startswith(("time/", "memory/"))}
                for row in metrics(path / "step3" / "metrics.jsonl")]

    got, want = numbers(packed), numbers(out)
    assert [row.keys() for row in got] == [row.keys() for row in want]
    for row_got, row_want in zip(got, want, strict=True):
        for key, value in row_want.items():
            assert row_got[key] == pytest.approx(value, rel=1e-3, abs=1e-4), key
    # the demo's rollouts are alike in length: its forwards pack little (bench/packing.py)
    assert tokens and all(packed_tokens <= padded_tokens for padded_tokens, packed_tokens in tokens)
    assert sum(p for _, p in tokens) < sum(p for p, _ in tokens)
    refused = tmp_path / "opt"
    run = run_train("--step", "3", "--output-dir", refused, settings=SMALL, **{
        "ppo.actor_path": "tiny-opt", "ppo.reward_fn": "steps.demo:score",
        "ppo.reward_model_weight": 0, "ppo.packing": True})
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "train.py: ppo.packing=true: ppo.actor_path tiny-opt is of model type opt, whose "
        "attention would mix packed sequences (packing supports falcon, gemma, gpt2, gpt_neox, llama, "
        "mistral, phi3, qwen2, qwen3); set ppo.packing=false"], run.stderr
    assert not (refused / "step3").exists()


# ---------------------------------------------------------------------------------------------
# 2. The exports are plain Hugging Face directories

LOAD_WITH_TRANSFORMERS = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

spec = json.loads(sys.argv[1])
result = {}
for d in spec["causal"]:
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        logits = model(**tok(["Give me some even digits."], return_tensors="pt")).logits
    result[d] = {"vocab": len(tok), "finite": bool(torch.isfinite(logits).all()),
                 "width": logits.shape[-1]}
for d in spec["classifier"]:
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(d).eval()
    batch = tok(spec["texts"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    result[d] = {"num_labels": model.config.num_labels, "logits": logits.tolist(),
                 "input_ids": batch["input_ids"].tolist(),
                 "attention_mask": batch["attention_mask"].tolist()}
result["project_modules"] = sorted(
    name for name, module in list(sys.modules.items())
    if (getattr(module, "__file__", None) or "").startswith(tuple(spec["project"])))
print(json.dumps(result))
"""


def load_outside_project(tmp_path: Path, causal: list[Path], classifier: list[Path],
                         texts: list[str]) -> dict:
    """Load model dirs in a fresh interpreter that can import transformers but not this
    project (cwd outside the repo, no PYTHONPATH)."""
    spec = {"causal": [str(d) for d in causal], "classifier": [str(d) for d in classifier],
            "texts": texts,
            "project": [str(ROOT / name) for name in ("engine", "steps", "train.py", "chat.py")]}
    proc = subprocess.run([sys.executable, "-c", LOAD_WITH_TRANSFORMERS, json.dumps(spec)],
                          cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.pop("project_modules") == []
    return result


EXPORT_TEXTS = ["\n\nHuman: Give me some even digits.\n\nAssistant: 2 4 6 8",
                "\n\nHuman: Which digits are small?\n\nAssistant: 1",
                "\n\nHuman: List a few big digits.\n\nAssistant:"]


@pytest.fixture(scope="module")
def loaded_exports(tmp_path_factory) -> dict:
    """Every preset's four exports loaded in one fresh interpreter: its start-up (importing
    torch and transformers, ~8 s here) once, not once a preset."""
    outs = [full_run(tmp_path_factory, preset)[0] for preset in PRESET_TYPES]
    causal = [out / name for out in outs for name in ("actor", "step3/actor")]
    classifier = [out / name for out in outs for name in ("reward", "step3/critic")]
    return load_outside_project(tmp_path_factory.mktemp("load"), causal, classifier,
                                EXPORT_TEXTS)


def test_exports_load_with_transformers_alone(pipeline, loaded_exports):
    _, out, _ = pipeline
    causal = [out / "actor", out / "step3" / "actor"]
    classifier = [out / "reward", out / "step3" / "critic"]
    result = loaded_exports

    for d in causal:
        got = result[str(d)]
        assert got["finite"] and got["width"] >= got["vocab"]
    for d in classifier:
        assert result[str(d)]["num_labels"] == 1

    # HF's own pooling (last non-pad token) == our score at the last real token
    got = result[str(out / "reward")]
    input_ids, mask = torch.tensor(got["input_ids"]), torch.tensor(got["attention_mask"])
    lengths = mask.sum(1)
    assert len(set(lengths.tolist())) == len(EXPORT_TEXTS), "the batch should need padding"
    assert (mask[:, :1] == 1).all(), "the batch should be right-padded"
    hf_logits = torch.tensor(got["logits"])
    assert hf_logits.shape == (len(EXPORT_TEXTS), 1)
    tokenizer = load_tokenizer(str(out / "reward"), flag="test")
    model = load_reward_model(str(out / "reward"), tokenizer).eval()
    with torch.no_grad():
        ours = sequence_scores(model, input_ids, mask)
    torch.testing.assert_close(ours, hf_logits[:, 0], atol=1e-5, rtol=0)
    assert ours.std() > 0, "scores should depend on the text"


# ---------------------------------------------------------------------------------------------
# 3. Step 3 starts from the step-1 actor and the step-2 reward model


def test_step3_starts_from_step1_actor_and_reward_model(pipeline):
    _, out, _ = pipeline
    sft, ppo_actor = weights(out / "actor"), weights(out / "step3" / "actor")
    reward, critic = weights(out / "reward"), weights(out / "step3" / "critic")

    assert sft.keys() == ppo_actor.keys()
    assert any(not torch.equal(sft[k], ppo_actor[k]) for k in sft), "PPO did not train"
    # close to where it started: a fresh random init would be ~1.4 away in relative terms
    assert 0 < relative_change(ppo_actor, sft) < 0.3

    assert model_type(out / "step3" / "critic") == model_type(out / "reward")
    assert json.loads((out / "step3" / "critic" / "config.json").read_text())["architectures"] \
        == json.loads((out / "reward" / "config.json").read_text())["architectures"]
    assert {k: v.shape for k, v in critic.items()} == {k: v.shape for k, v in reward.items()}
    assert 0 < relative_change(critic, reward) < 0.3


# ---------------------------------------------------------------------------------------------
# 4. LoRA: trained adapters are merged into plain exports


def test_sft_lora_exports_merged_plain_model(tmp_path):
    out = tmp_path / "lora"
    run_train("--actor-model", "tiny-llama", "--step", "1", "--output-dir", out,
              settings=SMALL, **{"sft.lora.dim": 4, "sft.lora.only_optimize_lora": "true"}
              ).check()
    assert_model_dir(out / "actor")
    assert not (out / "reward").exists() and not (out / "step3").exists()

    exported = weights(out / "actor")
    init = load_causal_lm("tiny-llama", byte_tokenizer(), seed=1234).state_dict()  # cfg.seed
    assert exported.keys() == init.keys(), "not a plain LlamaForCausalLM state dict"
    model = AutoModelForCausalLM.from_pretrained(out / "actor")
    assert type(model).__name__ == "LlamaForCausalLM"

    # only the adapters trained: adapted projections moved, everything else is the init
    adapted = [k for k in init if k.endswith("q_proj.weight")]
    assert adapted and all(not torch.equal(exported[k], init[k]) for k in adapted)
    for key in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        torch.testing.assert_close(exported[key], init[key], atol=0, rtol=0)


def test_ppo_with_lora_ema_and_ptx(llama_run, tmp_path):
    src, _ = llama_run
    out = tmp_path / "ppo-lora"
    run = run_train("--step", "3", "--output-dir", out, settings=SMALL, **{
        "ppo.actor_path": src / "actor", "ppo.reward_path": src / "reward",
        "ppo.actor_lora.dim": 4, "ppo.critic_lora.dim": 4,
        "ppo.ema.enabled": "true", "ppo.ptx.enabled": "true"}).check()
    assert "step 3 PTX" in run.stdout
    for name in ("actor", "critic", "actor_ema"):
        assert_model_dir(out / "step3" / name)  # includes: no lora_ keys left
    assert_no_leftovers(out)
    assert not (out / "actor").exists(), "step 3 must not write step-1 outputs"

    rows = [row for row in metrics(out / "step3" / "metrics.jsonl") if "reward/score" in row]
    assert rows and all(math.isfinite(row["train/ptx_loss"]) for row in rows)
    # the EMA evaluated beside the last policy, on the same prompts and sampling seeds
    summary = metrics(out / "step3" / "metrics.jsonl")[-1]
    assert "the EMA (actor_ema): reward" in run.stdout
    assert math.isfinite(summary["eval/reward_ema"]) and summary["eval/kl_ema"] >= 0
    assert summary["eval/kl_ema"] != summary["eval/kl_after"]

    start, actor = weights(src / "actor"), weights(out / "step3" / "actor")
    ema = weights(out / "step3" / "actor_ema")
    assert ema.keys() == actor.keys() == start.keys()
    assert relative_change(actor, start) > 0, "the merged LoRA actor did not move"
    # beta=0.992 over a few steps: the EMA stays between the start and the trained actor
    assert 0 < relative_change(ema, start) < relative_change(actor, start)


GOLD_SCHEDULE = """
calls = 0
SCHEDULE = {schedule}

def score(prompt, answer):
    # the same score for every answer of an evaluation, from a schedule of evaluations
    # (4 prompts, each answered sampled then greedy: 8 calls each)
    global calls
    calls += 1
    return SCHEDULE[min((calls - 1) // 8, len(SCHEDULE) - 1)]
"""


@pytest.mark.parametrize("lora", [0, 4])
@pytest.mark.parametrize("schedule, peak", [([0.9, 0.5, 0.4, 0.3], 0),
                                            ([0.2, 0.5, 0.9, 0.3], 2)])
def test_export_best_writes_the_policy_of_the_best_evaluation(llama_run, tmp_path, monkeypatch,
                                                             schedule, peak, lora):
    """A gold score that peaks and then falls: the step-3 actor written is the peak's. At
    iteration 0 that is the step-1 actor itself, to the last bit (LoRA: adapters at 0).
    The policy of the last iteration is evaluated once, not again after the loop."""
    from steps import ppo

    src, _ = llama_run
    evaluations, evaluate = [], ppo.evaluate
    monkeypatch.setattr(ppo, "evaluate", lambda *a: evaluations.append(1) or evaluate(*a))
    module = f"gold_{peak}_{lora}"
    (tmp_path / f"{module}.py").write_text(GOLD_SCHEDULE.format(schedule=schedule))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"
    run = run_train("--step", "3", "--output-dir", out, settings=SMALL, **{
        "ppo.actor_path": src / "actor", "ppo.reward_path": src / "reward",
        "ppo.eval_reward_fn": f"{module}:score", "ppo.export": "best", "ppo.eval_every": 1,
        "ppo.best_of_n": 0, "ppo.kl_budget": 100, "ppo.actor_lora.dim": lora,
        "ppo.rollout_batch_size": 8,
        "ppo.micro_batch_size": 8, "data.eval_fraction": 0.25}).check()
    summary = metrics(out / "step3" / "metrics.jsonl")[-1]
    assert summary["iterations"] >= 3
    assert len(evaluations) == 1 + summary["iterations"]   # the SFT policy's, then each one
    assert summary["eval/iteration_exported"] == peak
    assert summary["eval/ground_truth_exported"] == max(schedule)
    assert f"exported the best evaluated policy (iteration {peak}:" in run.stdout
    start, exported = weights(src / "actor"), weights(out / "step3" / "actor")
    moved = relative_change(exported, start)
    assert moved == 0 if peak == 0 else moved > 0


def test_steps_1_and_2_with_lora_over_an_int4_base(tmp_path):
    out = tmp_path / "int4"
    run = run_train("--step", "1", "2", "--output-dir", out, "--actor-model", "tiny-llama",
                    "--reward-model", "tiny-opt", "--zero-quantized-nontrainable-weights",
                    settings=SMALL, **{"engine.quantized_base.bits": 4, "sft.lora.dim": 4,
                                       "rm.lora.dim": 4, "sft.log_every": 1}).check()
    assert run.stdout.count("modules as int4") == 2, run.stdout
    # the reward model's score head trains (it starts random) and stays out of the integers
    assert "1 trained head" in run.stdout
    for name in ("actor", "reward"):
        assert_model_dir(out / name)
    losses = [r["train/loss"] for r in metrics(out / "step1" / "metrics.jsonl") if "train/lr" in r]
    assert losses[-1] < losses[0]


def test_step3_from_a_preset_over_a_quantized_base(tmp_path):
    """ppo.actor_path may name a preset (random weights, no step 1: a shape probe): GRPO
    with a rule reward over its int4 base; a shape preset in full precision is refused."""
    out = tmp_path / "probe"
    run = run_train("--step", "3", "--output-dir", out, "--zero-quantized-nontrainable-weights",
                    settings=SMALL, **{
                        "ppo.actor_path": "tiny-llama", "engine.quantized_base.bits": 4,
                        "ppo.actor_lora.dim": 4, "ppo.algorithm": "grpo",
                        "ppo.samples_per_prompt": 2,
                        "ppo.reward_fn": "steps.demo:score", "ppo.reward_model_weight": 0}
                    ).check()
    assert "modules as int4" in run.stdout and "step 3 (GRPO) done" in run.stdout
    assert "generating from the quantized base" in run.stdout
    assert_model_dir(out / "step3" / "actor")
    # PPO with a small critic of another architecture (ppo.critic_path), beside the probe
    ppo = run_train("--step", "3", "--output-dir", tmp_path / "ppo",
                    "--zero-quantized-nontrainable-weights", settings=SMALL, **{
                        "ppo.actor_path": "tiny-llama", "ppo.critic_path": "tiny-opt",
                        "ppo.actor_lora.dim": 4, "ppo.reward_fn": "steps.demo:score",
                        "ppo.reward_model_weight": 0, "ppo.export_weights": "adapter"}).check()
    assert "step 3 (PPO) done" in ppo.stdout
    critic = json.loads((tmp_path / "ppo" / "step3" / "critic" / "config.json").read_text())
    assert critic["model_type"] == "opt"
    # the actor as its LoRA adapter alone (a 70B probe cannot write its merged weights)
    adapter = tmp_path / "ppo" / "step3" / "actor"
    assert json.loads((adapter / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "tiny-llama"
    assert (adapter / "adapter_model.safetensors").exists()
    with pytest.raises(UserError, match="a LoRA adapter over tiny-llama"):
        model_source(str(adapter), "--path")
    other = tmp_path / "other-tokenizer"
    opt_tokenizer = load_tokenizer("tiny-opt", tokenizer=str(OPT_TOKENIZER))
    load_causal_lm("tiny-opt", opt_tokenizer).save_pretrained(other)
    opt_tokenizer.save_pretrained(other)
    for critic_path, message in ((tmp_path / "nowhere", "ppo.critic_path"),
                                 (other, "its tokenizer differs from the actor's")):
        refused = run_train("--step", "3", "--output-dir", tmp_path / "refused", settings=SMALL,
                            **{"ppo.actor_path": "tiny-llama", "ppo.critic_path": critic_path,
                               "ppo.reward_fn": "steps.demo:score",
                               "ppo.reward_model_weight": 0})
        assert refused.returncode == 2 and message in refused.stderr, refused.stderr
    refused = run_train("--step", "3", "--output-dir", tmp_path / "full", settings=SMALL, **{
        "ppo.actor_path": "llama-7b", "ppo.reward_fn": "steps.demo:score",
        "ppo.reward_model_weight": 0})
    assert refused.returncode == 2 and "llama-7b: a shape preset is built straight into a " \
        "quantized base" in refused.stderr
    refused = run_train("--step", "3", "--output-dir", tmp_path / "full", settings=SMALL, **{
        "ppo.actor_path": "tiny-llama", "ppo.reward_fn": "steps.demo:score",
        "ppo.reward_model_weight": 0, "ppo.export_weights": "adapter"})
    assert refused.returncode == 2 and "ppo.export_weights=adapter writes LoRA's weights alone" \
        in refused.stderr


def test_ppo_lora_over_an_int8_base_with_its_own_reference(llama_run, tmp_path):
    """--zero-quantized-nontrainable-weights: actor and critic LoRA over int8 bases, the
    reference is the actor with adapters off (so the first rollout's KL is exactly 0), and
    the exports are plain merged models."""
    src, _ = llama_run
    out = tmp_path / "ppo-int8"
    run = run_train("--step", "3", "--output-dir", out, "--zero-quantized-nontrainable-weights",
                    settings=SMALL, **{
                        "ppo.actor_path": src / "actor", "ppo.reward_path": src / "reward",
                        "ppo.actor_lora.dim": 4, "ppo.critic_lora.dim": 4,
                        "ppo.ema.enabled": "true"}).check()
    assert run.stdout.count("modules as int8") == 2, run.stdout   # actor and critic
    rows = [row for row in metrics(out / "step3" / "metrics.jsonl") if "reward/kl" in row]
    assert rows[0]["reward/kl"] == 0.0
    for name in ("actor", "critic", "actor_ema"):
        assert_model_dir(out / "step3" / name)
        assert not any(k.endswith("_scale") for k in weights(out / "step3" / name))
    start, actor = weights(src / "actor"), weights(out / "step3" / "actor")
    assert actor.keys() == start.keys()
    # the export is the dequantized base plus the trained LoRA: near the start, not on it
    assert 0 < relative_change(actor, start) < 0.2


# ---------------------------------------------------------------------------------------------
# 5. Real data and a real tokenizer


def dropped(log: str, what: str) -> int:
    found = re.search(rf"{what}: \d+ examples, (\d+) dropped \(prompt > data.max_prompt_len=128",
                      log)
    assert found, f"no dropped-prompt count for {what} in:\n{log}"
    return int(found.group(1))


def test_real_hh_rlhf_data_with_opt_tokenizer(hh_run):
    out, first, third = hh_run
    assert dropped(first.stdout, "step 1 train") > 0
    assert dropped(first.stdout, "step 2 train") > 0
    assert dropped(third.stdout, "step 3 prompts") > 0

    for name in MODEL_DIRS:
        assert_model_dir(out / name)
        tok = AutoTokenizer.from_pretrained(out / name)
        assert tok("Hello world")["input_ids"] == OPT_HELLO_WORLD, name
        assert json.loads((out / name / "config.json").read_text())["vocab_size"] == len(tok)
    assert_no_leftovers(out)
    rows = [row for row in metrics(out / "step3" / "metrics.jsonl") if "reward/score" in row]
    assert rows and all(0 < row["answer/length"] <= 8 for row in rows)


def test_dpo_on_real_hh_rlhf_pairs_with_opt_tokenizer(hh_run, opt_tokenizer, tmp_path):
    """DPO from the hh-rlhf step-1 actor on the same file's pairs (its own split: ~38 for
    step 3): the transcripts read and filtered as for steps 1 and 2, the held-out pairs (a
    third of them) evaluated, the sampled answers' KL measured (no ground truth: not the
    demo's data), and an export in the actor's tokenizer with no critic."""
    actor, _, _ = hh_run
    out = tmp_path / "dpo"
    settings = {**BASE, "data.path": f"[{shared(HH_RLHF)}]", "data.max_prompt_len": 128,
                "data.max_answer_len": 32, "ppo.max_new_tokens": 8, "dpo.eval_prompts": 2,
                "dpo.batch_size": 4, "dpo.lr": 1e-4, "data.eval_fraction": 0.3}
    run = run_train("--step", "3", "--output-dir", out, "ppo.algorithm=dpo",
                    f"ppo.actor_path={actor / 'actor'}", settings=settings,
                    **{"data.split": "[30,29,1]"}).check()
    assert dropped(run.stdout, "step 3 train") > 0
    summary = metrics(out / "step3" / "metrics.jsonl")[-1]
    assert {"eval/accuracy", "eval/margin", "eval/kl", "eval/loss_before"} <= summary.keys()
    assert "eval/ground_truth" not in summary and summary["eval/kl"] >= 0
    assert_model_dir(out / "step3" / "actor")
    assert AutoTokenizer.from_pretrained(out / "step3" / "actor")("Hello world")[
        "input_ids"] == OPT_HELLO_WORLD
    assert not (out / "step3" / "critic").exists()
    assert_no_leftovers(out)


# ---------------------------------------------------------------------------------------------
# 6. Actor and reward model with different tokenizers


def test_step3_with_different_actor_and_reward_tokenizers(llama_run, opt_tokenizer, tmp_path):
    actor_src, _ = llama_run  # tiny-llama, built-in byte tokenizer
    reward_src = tmp_path / "opt-reward"
    run_train("--reward-model", "tiny-opt", "--step", "2", "--output-dir", reward_src,
              settings=SMALL, tokenizer=opt_tokenizer).check()
    assert AutoTokenizer.from_pretrained(reward_src / "reward")("Hello world")["input_ids"] \
        == OPT_HELLO_WORLD

    out = tmp_path / "mixed"
    run = run_train("--step", "3", "--output-dir", out, settings=SMALL, **{
        "ppo.actor_path": actor_src / "actor", "ppo.reward_path": reward_src / "reward"}).check()
    assert "tokenizers differ" in run.stdout
    for name in ("actor", "critic"):
        assert_model_dir(out / "step3" / name)
    actor_vocab = AutoTokenizer.from_pretrained(actor_src / "actor").get_vocab()
    critic_tok = AutoTokenizer.from_pretrained(out / "step3" / "critic")
    assert critic_tok.get_vocab() == actor_vocab
    assert critic_tok.get_vocab() != AutoTokenizer.from_pretrained(reward_src / "reward") \
        .get_vocab()
    # the critic reads the actor's tokens, so it starts from the actor, not the reward model
    assert model_type(out / "step3" / "critic") == model_type(actor_src / "actor") == "llama"
    rows = [row for row in metrics(out / "step3" / "metrics.jsonl") if "reward/score" in row]
    assert rows and all(math.isfinite(row["reward/score"]) for row in rows)


# ---------------------------------------------------------------------------------------------
# 7. chat.py on the PPO actor


def test_chat_with_step3_actor(llama_run, tmp_path):
    out, _ = llama_run
    proc = subprocess.run(
        [sys.executable, str(ROOT / "chat.py"), "--path", str(out / "step3" / "actor"),
         "--greedy", "--max-new-tokens", "8"],
        input="Give me some even digits.\nquit\n", capture_output=True, text=True,
        cwd=tmp_path, env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    replies = [line for line in proc.stdout.splitlines() if line.startswith("Assistant:")]
    assert len(replies) == 1, proc.stdout


# ---------------------------------------------------------------------------------------------
# 8. Steps in separate invocations; step 3 alone needs steps 1 and 2


def test_steps_1_2_then_step_3_in_same_dir(tmp_path):
    """Also covers the other two presets: a GPT-NeoX actor with a GPT-2 reward model."""
    out = tmp_path / "split"
    models = ["--actor-model", "tiny-gpt-neox", "--reward-model", "tiny-gpt2"]
    run_train(*models, "--step", "1", "2", "--output-dir", out, settings=SMALL).check()
    assert_model_dir(out / "actor")
    assert_model_dir(out / "reward")
    assert not (out / "step3").exists()

    run_train(*models, "--step", "3", "--output-dir", out, settings=SMALL).check()
    for name in MODEL_DIRS:
        assert_model_dir(out / name)
    assert_no_leftovers(out)
    assert model_type(out / "step3" / "actor") == "gpt_neox"
    assert model_type(out / "step3" / "critic") == "gpt2"
    assert OmegaConf.load(out / "step3" / "config.yaml").steps == [3]
    assert OmegaConf.load(out / "step1" / "config.yaml").steps == [1, 2]
    assert metrics(out / "step3" / "metrics.jsonl")
    assert relative_change(weights(out / "step3" / "actor"), weights(out / "actor")) > 0

    # a finished step 3 is not replaced by accident, and its files stay as they were
    before = (out / "step3" / "metrics.jsonl").read_text()
    again = run_train(*models, "--step", "3", "--output-dir", out, settings=SMALL)
    assert again.returncode == 2 and "overwrite=true" in again.stderr, again.stderr
    assert (out / "step3" / "metrics.jsonl").read_text() == before
    # nor by a replacement run that is refused for a missing input
    config = (out / "step3" / "config.yaml").read_text()
    refused = run_train(*models, "--step", "3", "--output-dir", out, settings=SMALL,
                        overwrite="true", **{"ppo.actor_path": out / "missing"})
    assert refused.returncode == 2 and "ppo.actor_path" in refused.stderr, refused.stderr
    assert (out / "step3" / "metrics.jsonl").read_text() == before
    assert (out / "step3" / "config.yaml").read_text() == config
    assert_model_dir(out / "step3" / "actor")


def test_step3_alone_in_empty_dir_fails_cleanly(tmp_path):
    out = tmp_path / "empty"
    run = run_train("--step", "3", "--output-dir", out, settings=SMALL)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "ppo.actor_path" in lines[0], run.stderr
    assert lines[0].startswith("train.py: ")
    assert not (out / "step3").exists(), "a refused step 3 should leave nothing behind"


# ---------------------------------------------------------------------------------------------
# 4. Step-3 and logging defects that must stay fixed


def dropout_opt_dirs(root: Path) -> tuple[Path, Path]:
    """A tiny OPT actor and reward model with OPT's real dropout rates (0.1), saved as
    plain HF directories."""
    from transformers import AutoModelForSequenceClassification

    from engine.models import preset_config

    tok = byte_tokenizer()
    config = preset_config("tiny-opt", tok)
    config.dropout = config.attention_dropout = config.activation_dropout = 0.1
    torch.manual_seed(0)
    dirs = root / "actor", root / "reward"
    for cls, d in zip((AutoModelForCausalLM, AutoModelForSequenceClassification), dirs,
                      strict=True):
        config.num_labels = 1
        cls.from_config(config).save_pretrained(d)
        tok.save_pretrained(d)
    return dirs


@pytest.mark.parametrize("disable, temperature", [("true", 1.0), ("true", 0.7),
                                                  ("false", 1.0)])
def test_first_ppo_update_has_ratio_one_despite_dropout(tmp_path, disable, temperature):
    """Old log-probs (rollout) and new ones (first update, same weights, same rows) agree
    exactly when dropout is off in step 3, as by default, also when sampling at a
    temperature; with OPT's dropout left on they do not, which is the defect
    ppo.disable_dropout fixes."""
    actor, reward = dropout_opt_dirs(tmp_path)
    run_train("--actor-model", "tiny-opt", "--reward-model", "tiny-opt", "--step", "3",
              "--output-dir", tmp_path / "out", settings=SMALL,
              **{"ppo.actor_path": actor, "ppo.reward_path": reward, "ppo.log_every": 1,
                 "ppo.micro_batch_size": SMALL["ppo.rollout_batch_size"],
                 "ppo.disable_dropout": disable, "ppo.temperature": temperature}).check()
    first = next(r for r in metrics(tmp_path / "out" / "step3" / "metrics.jsonl")
                 if "train/ratio" in r)
    if disable == "true":
        assert first["train/ratio"] == 1.0
        assert first["train/approx_kl"] == 0.0 and first["train/clip_fraction"] == 0.0
    else:
        assert first["train/ratio"] != 1.0 and first["train/approx_kl"] > 0


def test_logged_losses_are_the_mean_over_the_micro_batches(tmp_path, monkeypatch):
    """Step 3 logs each statistic as its mean over the iteration's updates (2 PPO epochs x
    2 micro-batches), and step 1 its loss as the mean over an accumulation window's
    batches (each batch's loss is its share of that mean), not the last micro-batch's."""
    from steps import ppo, sft

    seen_ppo, seen_sft = [], []

    def recording_train_on(*args, **kwargs):
        stats, norms = train_on(*args, **kwargs)
        seen_ppo.append(stats)
        return stats, norms

    def recording_loss(*args, **kwargs):
        loss, stats = batch_loss(*args, **kwargs)
        seen_sft.append(float(loss.detach()))
        return loss, stats

    train_on, batch_loss = ppo.train_on, sft.batch_loss
    monkeypatch.setattr(ppo, "train_on", recording_train_on)
    monkeypatch.setattr(sft, "batch_loss", recording_loss)
    out = tmp_path / "out"
    run_train("--actor-model", "tiny-llama", "--reward-model", "tiny-llama", "--step", "1", "2",
              "3", "--output-dir", out, settings=SMALL,
              **{"ppo.ppo_epochs": 2, "ppo.log_every": 1, "sft.grad_accum": 2,
                 "sft.batch_size": 4, "sft.log_every": 1}).check()

    rows = [r for r in metrics(out / "step1" / "metrics.jsonl") if "train/grad_norm" in r]
    assert len(rows) >= 2
    for i, row in enumerate(rows):
        window = seen_sft[2 * i:2 * i + 2]
        # (metrics.jsonl rounds)
        assert row["train/loss"] == pytest.approx(sum(window), rel=1e-6, abs=1e-6)
        assert row["train/loss"] != pytest.approx(window[-1], rel=1e-4)

    rows = [r for r in metrics(out / "step3" / "metrics.jsonl") if "train/policy_loss" in r]
    assert len(rows) >= 2 and len(seen_ppo) == 4 * len(rows)
    for i, row in enumerate(rows):
        updates = seen_ppo[4 * i:4 * i + 4]
        for name in ("train/policy_loss", "train/value_loss", "train/ratio"):
            assert row[name] == pytest.approx(sum(u[name] for u in updates) / 4,
                                                rel=1e-6, abs=1e-6)
        assert row["train/value_loss"] != pytest.approx(updates[-1]["train/value_loss"],
                                                        rel=1e-4)


@pytest.mark.parametrize("algorithm", ["rloo", "ppo"])
def test_step_1_then_3_with_a_reward_function_alone(tmp_path, algorithm):
    """No step 2 and no reward model: the demo's scorer rewards the answers. RLOO builds no
    critic (none is exported); PPO starts its critic from the actor. The adaptive KL
    coefficient is logged every iteration and rises while the KL is over its target; the penalty for answers cut off
    without EOS lowers their score."""
    out = tmp_path / algorithm
    run_train("--actor-model", "tiny-llama", "--step", "1", "3", "--output-dir", out,
              settings=SMALL, **{"ppo.algorithm": algorithm, "ppo.samples_per_prompt": 2,
                                 "ppo.rollout_batch_size": 6,
                                 "ppo.reward_fn": "steps.demo:score",
                                 "ppo.reward_model_weight": 0, "ppo.kl_target": 0.005,
                                 "ppo.kl_horizon": 100, "ppo.missing_eos_penalty": 1.0,
                                 "data.max_answer_len": 6}).check()
    assert not (out / "reward").exists() and not (out / "step2").exists()
    assert_model_dir(out / "step3" / "actor")
    assert (out / "step3" / "critic").exists() == (algorithm == "ppo")
    logged = metrics(out / "step3" / "metrics.jsonl")
    rows = [r for r in logged if "kl_coef" in r]
    # it starts where the baseline's samples put the target, at least the recipe's 0.05
    start = logged[0].get("baseline/best_of_8_kl_coef_at_target", 0.0)
    assert len(rows) >= 3 and rows[0]["kl_coef"] == pytest.approx(max(start, 0.05))
    # adapted after every iteration: up while the KL is over the target, never below the
    # recipe's coefficient (the floor)
    for now, after in zip(rows[:-1], rows[1:], strict=True):
        assert after["kl_coef"] >= 0.05
        if now["reward/kl"] > 0.005:
            assert after["kl_coef"] > now["kl_coef"], (now, after)
    # (RLOO's advantages are often all 0 here: both answers of a group cut off alike)
    assert any(r["reward/kl"] > 0.005 for r in rows[:-1]) or algorithm == "rloo"
    assert ("train/value_loss" in rows[0]) == (algorithm == "ppo")
    # the demo's score is in [0, 1]; six-token answers are often cut off, and those score
    # at most 1 - 1, so the mean score is at most the share that ended
    assert any(r["reward/score"] < 0 for r in rows)
    assert all(r["reward/score"] <= r["answer/ended_with_eos"] + 1e-6 for r in rows)
    summary = metrics(out / "step3" / "metrics.jsonl")[-1]
    assert summary["memory/peak_mib"] > 0 and summary["memory/trained_mib"] > 0


# ---------------------------------------------------------------------------------------------
# Numerical guards through train.py


def poison_updates(monkeypatch, module, name: str, poisoned: set[int]) -> None:
    """Make `module.name` (a loss function returning a loss or a (loss, ...) result) return a
    NaN loss on its calls numbered in `poisoned` (from 1)."""
    original, calls = getattr(module, name), [0]

    def loss_fn(*args, **kwargs):
        out = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] not in poisoned:
            return out
        if isinstance(out, tuple) and not hasattr(out, "_replace"):
            return (out[0] * float("nan"), *out[1:])
        return out._replace(loss=out.loss * float("nan"))

    monkeypatch.setattr(module, name, loss_fn)


def test_non_finite_update_in_step3_is_skipped_and_logged(llama_run, tmp_path, monkeypatch):
    """A NaN policy loss on the third update: that update is skipped, the run goes on, every
    later metrics row counts it, and the exported actor is finite."""
    from steps import ppo

    out, _ = llama_run
    poison_updates(monkeypatch, ppo, "policy_loss", {3})
    run_train("--step", "3", "--output-dir", tmp_path, settings=SMALL,
              **{"ppo.actor_path": out / "actor", "ppo.reward_path": out / "reward",
                 "ppo.log_every": 1, "engine.max_skipped_steps": 2}).check()
    rows = [r for r in metrics(tmp_path / "step3" / "metrics.jsonl") if "train/grad_norm" in r]
    skipped = [r["train/skipped_steps"] for r in rows]
    assert skipped[0] == 0 and skipped[-1] == 1 and skipped == sorted(skipped)
    assert all(r["train/critic_skipped_steps"] == 0 for r in rows)
    assert any(math.isnan(r["train/grad_norm"]) for r in rows)
    assert all(torch.isfinite(w).all() for w in weights(tmp_path / "step3" / "actor").values())


def test_step3_in_fp16_logs_both_loss_scales(llama_run, tmp_path):
    """engine.dtype=fp16 (GPUs without bf16): step 3's rows give the actor's and the
    critic's loss scale and overflow count, as steps 1-2's give theirs."""
    out, _ = llama_run
    run_train("--step", "3", "--output-dir", tmp_path, settings=SMALL,
              **{"ppo.actor_path": out / "actor", "ppo.reward_path": out / "reward",
                 "ppo.log_every": 1, "engine.dtype": "fp16"}).check()
    rows = [r for r in metrics(tmp_path / "step3" / "metrics.jsonl") if "train/grad_norm" in r]
    assert rows
    for prefix in ("train/", "train/critic_"):
        assert all(r[f"{prefix}loss_scale"] * 2 ** r[f"{prefix}scale_overflows"] == 2**16
                   for r in rows)
    assert all(torch.isfinite(w).all() for w in weights(tmp_path / "step3" / "actor").values())


@pytest.mark.parametrize("span, recorded", [("[1,2]", "1-2"), ("[2,9]", "2-2")])
def test_profile_records_the_chosen_iterations(llama_run, tmp_path, span, recorded):
    """ppo.profile=[first,last]: torch.profiler over those step-3 iterations (this run has
    2: a span past the end closes with the run), an op table and a Chrome trace in
    step3/profile, and a log line naming them."""
    out, _ = llama_run
    run = run_train("--step", "3", "--output-dir", tmp_path, settings=SMALL,
                    **{"ppo.actor_path": out / "actor", "ppo.reward_path": out / "reward",
                       "ppo.profile": span}).check()
    assert "step 3 (PPO) done: 2 iterations" in run.stdout
    profile = tmp_path / "step3" / "profile"
    ops = (profile / "ops.txt").read_text()
    assert ops.startswith(f"iterations {recorded}, ops by cpu_time_total") and "aten::mm" in ops
    events = json.loads((profile / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    assert f"step 3 profile of iterations {recorded}: {profile / 'ops.txt'}" in run.stdout


@pytest.mark.parametrize("step", [1, 3])
def test_non_finite_updates_in_a_row_stop_the_run(llama_run, tmp_path, monkeypatch, step):
    """engine.max_skipped_steps NaN updates in a row: exit 2 with one line naming the step,
    where it stopped and what went non-finite; no model is exported, the metrics stay."""
    from steps import ppo, sft

    out, _ = llama_run
    if step == 1:
        poison_updates(monkeypatch, sft, "batch_loss", set(range(3, 100)))
        args = ("--actor-model", "tiny-llama", "--step", "1")
        extra = {"sft.log_every": 1, "sft.batch_size": 2}
    else:
        poison_updates(monkeypatch, ppo, "policy_loss", set(range(3, 100)))
        args = ("--step", "3")
        extra = {"ppo.actor_path": out / "actor", "ppo.reward_path": out / "reward",
                 "ppo.rollout_batch_size": 8, "ppo.micro_batch_size": 4}   # 2 updates each
    result = run_train(*args, "--output-dir", tmp_path / "out", settings=SMALL,
                       **{**extra, "engine.max_skipped_steps": 3})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    where = "step 1 epoch 1 batch 5: actor" if step == 1 else "step 3 iteration 3: actor"
    assert lines[0].startswith(f"train.py: {where}: 3 updates in a row skipped"), lines[0]
    assert "non-finite loss" in lines[0]
    assert not (tmp_path / "out" / "actor").exists()
    assert not (tmp_path / "out" / "step3" / "actor").exists()
    assert metrics(tmp_path / "out" / f"step{step}" / "metrics.jsonl")
