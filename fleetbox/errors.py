"""Errors the user can fix: `tasks.py` prints them as one line and exits non-zero (no traceback)."""


class UserError(Exception):
    """A problem with input or environment, explained in one line that says what to do."""
