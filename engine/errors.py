"""Errors a user can cause: train.py prints them as one line and exits non-zero."""

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line, like every other refusal, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


class UserError(Exception):
    """Bad input (a flag, a path, a config value). The message says what to do."""


class NonFiniteError(UserError):
    """Training produced NaN or inf where it must not go on: updates skipped too many times
    in a row, or non-finite weights about to be written, or sampling from non-finite
    scores. Nothing is written after it; the step's metrics and checkpoints stay."""
