"""metrics.jsonl and its wandb (offline: no key, no network) and TensorBoard mirrors."""

import json
import math
import sys

import pytest
import torch

from engine.errors import UserError
from engine.tracking import Tracker, _wandb_mode, read_metrics


def test_metrics_jsonl_one_object_per_logged_step(tmp_path):
    tracker = Tracker(tmp_path / "step1")
    tracker.log({"train/loss": 1.234567891, "epoch": 0}, step=1)
    tracker.log({"train/loss": 0.5, "train/lr": 9.65e-6, "train/approx_kl": 4.123456789e-7},
                step=2)
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "step1" / "metrics.jsonl").read_text()
            .splitlines()]
    # 7 significant digits, however small: rounded to 6 decimals the rate read 1e-05 and
    # the KL 0.0
    assert rows == [{"step": 1, "train/loss": 1.234568, "epoch": 0},
                    {"step": 2, "train/loss": 0.5, "train/lr": 9.65e-6,
                     "train/approx_kl": 4.123457e-7}]


def test_non_finite_metrics_are_strict_json_nulls_read_back_as_nan(tmp_path):
    """Python's json writes NaN/Infinity, which jq, pandas' strict readers and every JSON
    parser outside Python refuse; a skipped update logs a NaN gradient norm."""
    tracker = Tracker(tmp_path / "step3")
    tracker.log({"train/grad_norm": float("nan"), "train/loss": torch.tensor(float("-inf")),
                 "train/kl": float("inf"), "train/skipped_steps": 1}, step=3)
    line = (tmp_path / "step3" / "metrics.jsonl").read_text()
    assert json.loads(line, parse_constant=lambda name: pytest.fail(name)) == {
        "step": 3, "train/grad_norm": None, "train/loss": None, "train/kl": None,
        "train/skipped_steps": 1}
    [row] = read_metrics(tmp_path / "step3" / "metrics.jsonl")
    assert math.isnan(row["train/grad_norm"]) and row["train/skipped_steps"] == 1


def test_wandb_auto_mode_is_online_only_with_a_key_and_a_server_that_answers(
        monkeypatch, tmp_path, capsys):
    """With a key but no network, "auto" went online and wandb.init failed the run after
    retrying for 90 s; it logs offline now and says so."""
    url = "https://api.wandb.example"
    reachable = []
    monkeypatch.setattr("engine.tracking.server_reachable",
                        lambda u: reachable.append(u) or u == url)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _wandb_mode("auto", url, tmp_path) == "offline"
    assert reachable == []   # no key: nothing to probe
    (tmp_path / ".netrc").write_text("machine api.wandb.example login user password "
                                     + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _wandb_mode("auto", url, tmp_path) == "online"   # the login for its host
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_mode("auto", url, tmp_path) == "online"
    capsys.readouterr()
    assert _wandb_mode("auto", "https://api.unreachable.example", tmp_path) == "offline"
    assert capsys.readouterr().out == (
        f"wandb: api.unreachable.example is unreachable, so the run is logged offline under "
        f"{tmp_path / 'wandb'} (upload it later with `wandb sync`)\n")
    assert _wandb_mode("disabled", url, tmp_path) == "disabled"
    assert _wandb_mode("online", "https://api.unreachable.example", tmp_path) == "online"


def test_wandb_that_cannot_start_the_run_is_one_clear_error(monkeypatch, tmp_path):
    """logging.wandb.mode=online with no network: wandb's CommError and its traceback
    became one line that says how to go on."""
    wandb = pytest.importorskip("wandb")

    def no_server(**kwargs):
        raise wandb.errors.CommError('Timed out while retrying: Post "https://api.example/'
                                     'graphql": no such host\nConsider increasing the '
                                     'init_timeout setting')

    monkeypatch.setattr(wandb, "init", no_server)
    with pytest.raises(UserError) as exc:
        Tracker(tmp_path / "step1", wandb_settings={"enabled": True, "mode": "online"},
                config={})
    assert str(exc.value) == (
        'logging.wandb (mode online): wandb could not start the run (Timed out while retrying: '
        'Post "https://api.example/graphql": no such host); set logging.wandb.mode=offline '
        "to log locally, or logging.wandb.enabled=false")


def test_wandb_offline_run_is_written_inside_the_step_dir(monkeypatch, tmp_path):
    pytest.importorskip("wandb")   # a project dependency; missing on the GPU device's image
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    settings = {"enabled": True, "mode": "auto", "project": "rlhf-test", "run_name": "t"}
    tracker = Tracker(tmp_path / "step2", wandb_settings=settings, config={"step": 2})
    tracker.log({"eval/accuracy": 0.75}, step=3)
    tracker.log_answers([{"prompt": "Q:", "answer": " 4", "reward": 1.5},
                         {"prompt": "Q2:", "answer": " é", "reward": -0.5}], step=3)
    tracker.close()
    runs = list((tmp_path / "step2" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    # the answers as a table (TRL's log_completions), beside answers.jsonl
    [table] = runs[0].parent.glob("files/media/table/eval/answers_3_*.table.json")
    written = json.loads(table.read_text(encoding="utf-8"))
    assert (written["columns"], written["data"]) == (
        ["prompt", "answer", "reward"], [["Q:", " 4", 1.5], ["Q2:", " é", -0.5]])
    assert json.loads((tmp_path / "step2" / "metrics.jsonl").read_text()) == {
        "step": 3, "eval/accuracy": 0.75}


def test_wandb_missing_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` raises ImportError
    with pytest.raises(UserError, match="logging.wandb.enabled=true: the wandb package"):
        Tracker(tmp_path / "step1", wandb_settings={"enabled": True}, config={})


def _tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard reads the event files in `directory`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_every_numeric_metric_and_a_resume_shows_no_step_twice(tmp_path):
    """logging.tensorboard (DeepSpeed-Chat's --enable_tensorboard): the rows' numbers as
    scalars. A resumed run logs again the steps after its checkpoint: those from before the
    kill are dropped, as metrics.jsonl drops its rows; a fresh start clears them all."""
    pytest.importorskip("tensorboard")   # the dev extra; missing on the GPU device's image
    step_dir = tmp_path / "step3"
    tracker = Tracker(step_dir, tensorboard=True)
    for step in (1, 2, 3):
        tracker.log({"train/loss": 1.0 / step, "note": "text", "train/grad_norm": math.nan},
                    step=step)
    tracker.close()   # killed after step 3; its checkpoint was at step 2
    scalars = _tensorboard_scalars(step_dir / "tensorboard")
    assert set(scalars) == {"train/loss", "train/grad_norm"}   # text has no scalar
    assert scalars["train/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert all(math.isnan(value) for _, value in scalars["train/grad_norm"])

    resumed = Tracker(step_dir, tensorboard=True, keep_rows=2)
    resumed.log({"train/loss": 0.25}, step=3)
    resumed.close()
    assert _tensorboard_scalars(step_dir / "tensorboard")["train/loss"] == [
        (1, 1.0), (2, 0.5), (3, 0.25)]
    assert [row["step"] for row in read_metrics(step_dir / "metrics.jsonl")] == [1, 2, 3]

    fresh = Tracker(step_dir, tensorboard=True)
    fresh.log({"train/loss": 2.0}, step=1)
    fresh.close()
    assert _tensorboard_scalars(step_dir / "tensorboard") == {"train/loss": [(1, 2.0)]}


def test_tensorboard_missing_is_one_clear_error(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "tensorboard" else real(name, *args))
    with pytest.raises(UserError) as err:
        Tracker(tmp_path / "step1", tensorboard=True)
    assert str(err.value) == ("logging.tensorboard=true: the tensorboard package is not "
                              "installed (pip install tensorboard, or logging.tensorboard=false)")
    assert not (tmp_path / "step1" / "tensorboard").exists()


def test_answers_are_kept_as_their_metrics_rows_are(tmp_path):
    """answers.jsonl (ppo.log_answers): one object per answer, its text as written; a
    resumed run keeps those up to its kept rows' last step (it logs the later ones again),
    a fresh start removes them, and a step that shows none writes nothing."""
    step_dir = tmp_path / "step3"
    tracker = Tracker(step_dir)
    for step in (0, 2, 4):
        tracker.log({"eval/reward": float(step)}, step=step)
        tracker.log_answers([{"prompt": "Q:", "answer": f" é{step}", "reward": 0.123456789},
                             {"prompt": "Q2:", "answer": "", "reward": math.nan}], step)
    tracker.log_answers([], 5)
    tracker.close()
    path = step_dir / "answers.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows[:2] == [{"step": 0, "prompt": "Q:", "answer": " é0", "reward": 0.1234568},
                        {"step": 0, "prompt": "Q2:", "answer": "", "reward": None}]
    assert [row["step"] for row in rows] == [0, 0, 2, 2, 4, 4]

    Tracker(step_dir, keep_rows=2).close()   # its checkpoint was at step 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 0, 2, 2]
    Tracker(step_dir, keep_rows=0).close()
    assert path.read_text() == ""
    Tracker(step_dir).close()
    assert not path.exists()
