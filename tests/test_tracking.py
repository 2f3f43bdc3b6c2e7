"""metrics.jsonl and the wandb mirror (offline: no key, no network)."""

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


def test_wandb_auto_mode_is_offline_without_a_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert _wandb_mode("auto") == "online"
    assert _wandb_mode("disabled") == "disabled"


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
    tracker.close()
    runs = list((tmp_path / "step2" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert json.loads((tmp_path / "step2" / "metrics.jsonl").read_text()) == {
        "step": 3, "eval/accuracy": 0.75}


def test_wandb_missing_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` raises ImportError
    with pytest.raises(UserError, match="logging.wandb.enabled=true: the wandb package"):
        Tracker(tmp_path / "step1", wandb_settings={"enabled": True}, config={})
