"""Metrics: one JSON object per logged step in <step dir>/metrics.jsonl, mirrored to
wandb when enabled (offline when there is no API key or its server is unreachable) and to
TensorBoard event files in <step dir>/tensorboard when asked. The file is strict JSON: a
NaN or inf metric (a skipped update's gradient norm) is written as null, which `jq`,
pandas and JSON parsers outside Python read; wandb and TensorBoard get the float itself."""

from __future__ import annotations

import importlib.util
import json
import math
import netrc
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tqdm import tqdm

from engine.errors import UserError
from engine.model_source import server_reachable


def _wandb_mode(mode: str, base_url: str, run_dir: Path) -> str:
    """"auto" is online when a wandb API key is configured (env or ~/.netrc) and its server
    (`base_url`) can be reached; else offline, into `run_dir` (`wandb sync` uploads it).
    Online with no network, wandb.init retries for 90 s and then fails the run."""
    if mode != "auto":
        return mode
    if not _wandb_key_configured(base_url):
        return "offline"
    if not server_reachable(base_url):
        tqdm.write(f"wandb: {urlparse(base_url).hostname} is unreachable, so the run is logged "
                   f"offline under {run_dir / 'wandb'} (upload it later with `wandb sync`)")
        return "offline"
    return "online"


def _wandb_key_configured(base_url: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        logins = netrc.netrc()
    except (OSError, netrc.NetrcParseError):
        return False
    return any(logins.authenticators(host) is not None
               for host in (urlparse(base_url).hostname, "api.wandb.ai"))


class Tracker:
    # callables whose metrics join every row, e.g. the comm meter's (engine.log_comm)
    row_sources: list[Callable[[], dict[str, Any]]] = []

    def __init__(self, step_dir: Path, *, wandb_settings: dict | None = None,
                 config: dict | None = None, enabled: bool = True, keep_rows: int | None = None,
                 tensorboard: bool = False):
        """`keep_rows`: continue a resumed run's metrics.jsonl (and its TensorBoard events)
        after its first `keep_rows` rows (those written before the checkpoint); None starts
        them afresh."""
        self.enabled = enabled
        self.path = Path(step_dir) / "metrics.jsonl"
        self.answers_path = Path(step_dir) / "answers.jsonl"
        self._wandb = self._tensorboard = None
        self.rows = 0
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_rows is not None and self.path.exists():
            kept = self.path.read_text().splitlines(keepends=True)[:keep_rows]
        self.path.write_text("".join(kept))
        self.rows = len(kept)
        # the last step a resumed run keeps (-1: none); None for a fresh start
        kept_until = (json.loads(kept[-1])["step"] if kept else -1) if keep_rows is not None \
            else None
        _keep_answers(self.answers_path, kept_until)
        if tensorboard:
            self._tensorboard = _tensorboard_writer(self.path.parent / "tensorboard",
                                                    kept_until)
        ws = wandb_settings or {}
        if ws.get("enabled"):
            try:
                import wandb
            except ImportError:
                raise UserError("logging.wandb.enabled=true: the wandb package is not installed "
                                "(pip install wandb, or logging.wandb.enabled=false)") from None

            base_url = os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url
            mode = _wandb_mode(ws.get("mode", "auto"), base_url, self.path.parent)
            try:
                self._wandb = wandb.init(
                    project=ws.get("project"), name=ws.get("run_name"), group=ws.get("group"),
                    dir=str(self.path.parent), config=config, reinit="finish_previous",
                    mode=mode)
            except wandb.errors.Error as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise UserError(f"logging.wandb (mode {mode}): wandb could not start the run "
                                f"({reason}); set logging.wandb.mode=offline to log locally, "
                                "or logging.wandb.enabled=false") from exc

    def read_sources(self) -> dict[str, Any]:
        """The row sources' metrics now (what they counted since the previous row), for a
        row logged later (`log(..., sources=)`): a summary written after the exports, which
        they must not count."""
        if not self.enabled:
            return {}
        return {k: v for source in self.row_sources for k, v in source().items()}

    def log(self, metrics: dict[str, Any], step: int,
            sources: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        metrics = {**metrics, **(self.read_sources() if sources is None else sources)}
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        line = json.dumps({k: _finite_or_none(v) for k, v in row.items()}, allow_nan=False)
        with self.path.open("a") as f:
            f.write(line + "\n")
        self.rows += 1
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._tensorboard is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, int | float):
                    self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()   # a killed run keeps what it logged, as metrics.jsonl

    def log_answers(self, answers: list[dict[str, Any]], step: int) -> None:
        """Sample answers (prompt, answer, scores) of the policy at `step`, one JSON object
        each in answers.jsonl, and a table in wandb (TRL's log_completions): what the
        numbers were of."""
        if not self.enabled or not answers:
            return
        rows = [{k: _plain(v) for k, v in answer.items()} for answer in answers]
        with self.answers_path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **{k: _finite_or_none(v)
                                                     for k, v in row.items()}},
                                   allow_nan=False, ensure_ascii=False) + "\n")
        if self._wandb is not None:
            import wandb

            columns = list(dict.fromkeys(k for row in rows for k in row))
            self._wandb.log({"eval/answers": wandb.Table(
                columns=columns, data=[[row.get(k) for k in columns] for row in rows])},
                step=step)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def _keep_answers(path: Path, kept_until: int | None) -> None:
    """answers.jsonl as metrics.jsonl keeps it: a fresh start (`kept_until` None) removes
    it; a resumed run keeps the answers up to step `kept_until`."""
    if kept_until is None or not path.exists():
        path.unlink(missing_ok=True)
        return
    lines = path.read_text(encoding="utf-8").split("\n")
    path.write_text("".join(line + "\n" for line in lines
                            if line.strip() and json.loads(line)["step"] <= kept_until),
                    encoding="utf-8")


def require_tensorboard() -> None:
    """logging.tensorboard needs the tensorboard package (an optional extra): refused up
    front, before a step runs, when it is not installed."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError("logging.tensorboard=true: the tensorboard package is not installed "
                        "(pip install tensorboard, or logging.tensorboard=false)")


def _tensorboard_writer(directory: Path, kept_until: int | None):
    """A SummaryWriter into `directory`. A fresh start (`kept_until` None) clears an earlier
    attempt's events; a resumed one drops those after step `kept_until` (past the
    checkpoint, logged again now), so that no step shows twice."""
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter

    if kept_until is None:
        shutil.rmtree(directory, ignore_errors=True)
        return SummaryWriter(str(directory))
    return SummaryWriter(str(directory), purge_step=kept_until + 1)


def _plain(value: Any) -> Any:
    """A metric as JSON writes it: floats to 7 significant digits, an fp32 value's precision
    (to 6 decimals, a learning rate of 9.65e-6 read 1e-05, and a KL of 4e-7 read 0.0)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return float(f"{value:.7g}")
    return value


def _finite_or_none(value: Any) -> Any:
    """A float JSON can hold: NaN and inf have no JSON spelling (Python's json writes `NaN`,
    which strict parsers refuse), so they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """A metrics.jsonl's rows, with a null (a NaN or inf when logged) read back as NaN, so
    `math.isfinite` and formatting work on every value."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [{k: math.nan if v is None else v for k, v in row.items()} for row in rows]
