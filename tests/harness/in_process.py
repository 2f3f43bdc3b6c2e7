"""train.py's main run in the test's own process, its output captured: the same run as in a
fresh interpreter (one thread either way under the suite's xdist workers), without that
interpreter's start-up, importing torch and transformers: ~8 s on 2 slow cores."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass

import train


@dataclass
class TrainRun:
    """What a run printed and returned: subprocess.CompletedProcess's fields, so a check
    reads either kind of run the same way."""

    returncode: int
    stdout: str
    stderr: str

    def check(self) -> TrainRun:
        assert self.returncode == 0, \
            f"train.py exited {self.returncode}\n{self.stdout}\n{self.stderr}"
        return self


def train_here(args) -> TrainRun:
    """train.main(args) (each one str()-ed), its log lines (tqdm.write -> stdout) and errors
    captured."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        code = train.main([str(arg) for arg in args])
    return TrainRun(code, stdout.getvalue(), stderr.getvalue())
