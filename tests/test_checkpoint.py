"""Checkpoints in one process: a TrainEngine saved mid-training and loaded into a fresh one
continues bit for bit; only complete checkpoints count; old ones are pruned; train.py plans
which steps to skip, resume or run; metrics continue after the checkpoint's rows."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

import train
from engine.checkpoint import Checkpointer
from engine.config import OptimConfig
from engine.errors import UserError
from engine.models import byte_tokenizer, load_causal_lm
from engine.runtime import Runtime
from engine.tracking import Tracker
from engine.trainer import TrainEngine

CPU = Runtime(device=torch.device("cpu"), dtype=torch.float32)


def engine_at(seed: int = 0, warmup_steps: int = 2) -> TrainEngine:
    model = load_causal_lm("tiny-llama", byte_tokenizer(), seed=seed)
    return TrainEngine(model, OptimConfig(warmup_steps=warmup_steps), total_steps=10,
                       runtime=CPU, lr=1e-2)


def train_steps(engine: TrainEngine, first: int, count: int) -> None:
    for step in range(first, first + count):
        ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def test_resumed_engine_continues_exactly(tmp_path):
    engine = engine_at()
    train_steps(engine, 0, 3)
    ckpt = Checkpointer(tmp_path, CPU, every=3)
    ckpt.save(3, {"actor": engine}, {"actor": engine.progress_state(), "note": "x"})
    train_steps(engine, 3, 2)

    resumed = engine_at(seed=1)  # other initial weights: everything must come from the file
    state = Checkpointer(tmp_path, CPU, every=3).load({"actor": resumed})
    resumed.load_progress_state(state["actor"])
    assert state["note"] == "x" and resumed.steps == 3 and resumed.lr == pytest.approx(
        engine_at().scheduler.lr_lambdas[0](3) * 1e-2)
    train_steps(resumed, 3, 2)
    for (name, want), got in zip(engine.module.state_dict().items(),
                                 resumed.module.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    assert resumed.lr == engine.lr


def test_a_checkpoint_before_any_update_leaves_the_optimizer_untouched(tmp_path):
    """Taking the optimizer's state before its first update (every step so far skipped)
    must neither count an Adam step here nor in the engine resumed from it: either would
    shrink the first real update by its bias correction."""
    def first_update(engine: TrainEngine) -> dict[str, torch.Tensor]:
        train_steps(engine, 0, 1)
        return {name: p.detach().clone() for name, p in engine.module.named_parameters()}

    want = first_update(engine_at(warmup_steps=0))
    engine = engine_at(warmup_steps=0)
    Checkpointer(tmp_path, CPU, every=1).save(1, {"actor": engine}, {})
    assert not engine.optimizer.state
    resumed = engine_at(seed=1, warmup_steps=0)
    Checkpointer(tmp_path, CPU, every=1).load({"actor": resumed})
    for got in (first_update(engine), first_update(resumed)):
        for name, value in want.items():
            assert torch.equal(got[name], value), name


@pytest.mark.parametrize("damage", ["truncated", "no metadata", "broken state"])
def test_a_damaged_checkpoint_is_refused_in_one_line_saying_what_to_do(tmp_path, damage):
    """A run that resumes (resume=auto, the default) from a damaged checkpoint used to
    stop in a traceback, every later run into that directory too."""
    engine = engine_at()
    train_steps(engine, 0, 1)
    path = Checkpointer(tmp_path, CPU, every=1).save(1, {"actor": engine}, {"x": 1})
    if damage == "truncated":
        shard = next(path.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "no metadata":
        (path / ".metadata").unlink()
    else:
        (path / "state.json").write_text("{")
    with pytest.raises(UserError, match=rf"checkpoint {path} cannot be loaded \(\w+.*\): .*"
                                        "delete it .* or pass resume=false") as error:
        Checkpointer(tmp_path, CPU, every=1).load({"actor": engine_at()})
    assert "\n" not in str(error.value)


class _RunsCode:
    """Unpickled, it would make a directory: the stand-in for any code a pickle can run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.makedirs, (self.marker,)


@pytest.mark.parametrize("where", ["param_groups", "metadata"])
def test_a_checkpoint_that_would_run_code_on_resume_is_refused(tmp_path, where):
    """DCP unpickles a checkpoint's .metadata and its non-tensor entries (the optimizer's
    param_groups) with plain pickle: a crafted checkpoint ran code on resume. Both are now
    read by allow-lists (weights_only, DCP's metadata classes), and the resume is refused
    in one line before anything runs."""
    import pickle
    marker = tmp_path / "ran"
    engine = engine_at()
    train_steps(engine, 0, 1)
    if where == "param_groups":
        honest = engine.state_dict
        engine.state_dict = lambda: {**(state := honest()), "optimizer": {
            **state["optimizer"], "param_groups": [
                {**group, "eps": _RunsCode(marker)} for group in state["optimizer"]["param_groups"]]}}
    path = Checkpointer(tmp_path, CPU, every=1).save(1, {"actor": engine}, {"x": 1})
    if where == "metadata":
        metadata = pickle.loads((path / ".metadata").read_bytes())
        metadata.planner_data = _RunsCode(marker)
        (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match=rf"checkpoint {path} cannot be loaded \(.*\): .*"
                                        "delete it .* or pass resume=false") as error:
        Checkpointer(tmp_path, CPU, every=1).load({"actor": engine_at()})
    assert "\n" not in str(error.value)
    assert not marker.exists()


def test_only_complete_checkpoints_count_and_old_ones_go(tmp_path):
    engine = engine_at()
    ckpt = Checkpointer(tmp_path, CPU, every=1, keep=2)
    assert ckpt.latest() is None and ckpt.load({"actor": engine}) is None
    for tag in (1, 2, 3):
        ckpt.save(tag, {"actor": engine}, {})
    assert [p.name for p in ckpt.complete()] == ["step-00000002", "step-00000003"]
    (tmp_path / "checkpoints" / "step-00000009").mkdir()   # killed before state.json
    (tmp_path / "checkpoints" / ".step-00000010.tmp").mkdir()
    assert ckpt.latest().name == "step-00000003"
    ckpt.save(4, {"actor": engine}, {})
    assert not (tmp_path / "checkpoints" / ".step-00000010.tmp").exists()
    every_4 = Checkpointer(tmp_path, CPU, every=4)
    assert every_4.due(8) and not every_4.due(7) and not every_4.due(0)
    assert not Checkpointer(tmp_path, CPU, every=0).due(8)


def plan(out, *argv):
    return train.plan_steps(train.build_config(train.parse_args(
        ["--output-dir", str(out), *argv])))


def fake_checkpoint(out, step):
    (out / f"step{step}" / "checkpoints" / "step-00000004").mkdir(parents=True)
    (out / f"step{step}" / "checkpoints" / "step-00000004" / "state.json").write_text("{}")


def test_plan_fresh_interrupted_and_refused_runs(tmp_path):
    assert plan(tmp_path) == [(1, "run"), (2, "run"), (3, "run")]
    for name in ("actor", "reward"):
        (tmp_path / name).mkdir()
    fake_checkpoint(tmp_path, 3)
    assert plan(tmp_path) == [(1, "skip"), (2, "skip"), (3, "resume")]
    assert plan(tmp_path, "--resume") == [(1, "skip"), (2, "skip"), (3, "resume")]
    assert plan(tmp_path, "--step", "3") == [(3, "resume")]
    with pytest.raises(UserError, match="already holds a finished step-1 model"):
        plan(tmp_path, "resume=false")
    assert plan(tmp_path, "resume=false", "overwrite=true") == [(1, "run"), (2, "run"),
                                                               (3, "run")]
    with pytest.raises(UserError, match="holds no interrupted run"):
        plan(tmp_path / "elsewhere", "--resume")


def test_a_resume_under_settings_that_shape_the_step_differently_is_refused(tmp_path):
    """Resumed with sft.batch_size 8 -> 16, step 1 read its checkpoint's data position in
    batches of the new size: it skipped 240 examples it never saw, and said nothing."""
    started = ["--output-dir", str(tmp_path), "--step", "1", "sft.batch_size=8"]
    fake_checkpoint(tmp_path, 1)
    snapshot = train.build_config(train.parse_args(started))   # as start_step writes it
    (tmp_path / "step1" / "config.yaml").write_text(OmegaConf.to_yaml(snapshot, resolve=True))
    assert plan(tmp_path, *started[2:]) == [(1, "resume")]
    # what only reports, bounds memory, or shapes another step may change
    assert plan(tmp_path, *started[2:], "sft.log_every=1", "sft.eval_batch_size=2",
                "sft.eval_every=5", "rm.lr=1e-3", "ppo.kl_coef=0.5",
                "logging.progress=false") == [(1, "resume")]
    with pytest.raises(UserError) as refused:
        plan(tmp_path, "--step", "1", "sft.batch_size=16", "seed=7", "data.demo_pairs=50")
    assert str(refused.value) == (
        "resuming step 1 with settings that differ from those it started with (seed: 1234 -> "
        "7, data.demo_pairs: 6000 -> 50, sft.batch_size: 8 -> 16); set them back, or pass "
        "resume=false to start step 1 afresh")
    with pytest.raises(UserError, match=r"\(sft.lora.dim: 0 -> 4\)"):
        plan(tmp_path, *started[2:], "sft.lora.dim=4")
    assert plan(tmp_path, "--step", "1", "sft.batch_size=16", "resume=false") == [(1, "run")]


def test_step_3_resumes_under_another_answer_log_but_not_another_evaluation_schedule(tmp_path):
    """ppo.log_answers only reports; ppo.eval_every decides which policies export=best can
    pick, so a resume under another one is refused (sft/rm.eval_every, which pick nothing,
    may change)."""
    for name in ("actor", "reward"):
        (tmp_path / name).mkdir()
    fake_checkpoint(tmp_path, 3)
    snapshot = train.build_config(train.parse_args(["--output-dir", str(tmp_path)]))
    (tmp_path / "step3" / "config.yaml").write_text(OmegaConf.to_yaml(snapshot, resolve=True))
    assert plan(tmp_path, "ppo.log_answers=0", "sft.eval_every=5") == [
        (1, "skip"), (2, "skip"), (3, "resume")]
    with pytest.raises(UserError, match=r"\(ppo.eval_every: 10 -> 5\)"):
        plan(tmp_path, "ppo.eval_every=5")


def test_a_step_interrupted_before_its_first_checkpoint_runs_again(tmp_path):
    """Killed in step 2 before any checkpoint (the demo's step 3, 143 iterations, never
    reaches the default interval of 200), the same command refused: step 1 "already holds
    a finished model". Such a step is now run again, the finished steps before it kept;
    so is a step 3 killed between its exports. A step marked finished is not touched."""
    (tmp_path / "actor").mkdir()
    (tmp_path / "step1").mkdir()
    (tmp_path / "step2").mkdir()                      # started, no reward model, no checkpoint
    assert plan(tmp_path) == [(1, "skip"), (2, "restart"), (3, "run")]
    assert plan(tmp_path, "--resume") == [(1, "skip"), (2, "restart"), (3, "run")]
    with pytest.raises(UserError, match="already holds a finished step-1 model"):
        plan(tmp_path, "resume=false")
    (tmp_path / "reward").mkdir()
    (tmp_path / "step3" / "actor").mkdir(parents=True)   # killed before the critic's export
    assert plan(tmp_path) == [(1, "skip"), (2, "skip"), (3, "restart")]
    with pytest.raises(UserError, match="already holds a finished step-1 model"):
        plan(tmp_path, "ppo.algorithm=grpo")        # critic-free: step 3 wrote all it writes
    (tmp_path / "step3" / "finished").touch()        # written by this run: finished
    with pytest.raises(UserError, match="already holds a finished step-1 model"):
        plan(tmp_path)


def test_metrics_continue_after_the_checkpoints_rows(tmp_path):
    tracker = Tracker(tmp_path)
    for step in range(1, 6):
        tracker.log({"loss": float(step)}, step)
    resumed = Tracker(tmp_path, keep_rows=3)
    resumed.log({"loss": 40.0}, 4)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["loss"] for r in rows] == [1.0, 2.0, 3.0, 40.0] and resumed.rows == 4
    Tracker(tmp_path)  # a fresh start empties it
    assert (tmp_path / "metrics.jsonl").read_text() == ""
