"""Errors the user can fix: `tasks.py` prints them as one line and exits non-zero (no traceback)."""


class UserError(Exception):
    """A problem with input or environment, explained in one line that says what to do."""


class Failed(Exception):
    """The work ran and did not pass (a job, a check): one line saying what failed and where the logs are."""
