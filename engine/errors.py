"""Errors a user can cause: train.py prints them as one line and exits non-zero."""


class UserError(Exception):
    """Bad input (a flag, a path, a config value). The message says what to do."""
