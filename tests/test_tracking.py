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
    tracker.close()
    runs = list((tmp_path / "step2" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    assert json.loads((tmp_path / "step2" / "metrics.jsonl").read_text()) == {
        "step": 3, "eval/accuracy": 0.75}


def test_wandb_missing_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)   # `import wandb` raises ImportError
    with pytest.raises(UserError, match="logging.wandb.enabled=true: the wandb package"):
        Tracker(tmp_path / "step1", wandb_settings={"enabled": True}, config={})
