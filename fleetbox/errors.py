"""Errors the user can fix: `tasks.py` prints them as one line and exits non-zero (no traceback)."""


class UserError(Exception):
    """A problem with input or environment, explained in one line that says what to do."""


class LeftRunning(UserError):
    """The command stops following a job that goes on (its scheduler cannot be asked now): nothing is cancelled, and
    the line says how to ask again."""


class NodeRefused(UserError):
    """A node's engine refused to start its part of the job: that node is broken, not the job (a spare may take its
    place)."""

    def __init__(self, message: str, node: int):
        super().__init__(message)
        self.node = node


class Failed(Exception):
    """The work ran and did not pass (a job, a check): one line saying what failed and where the logs are."""


# How a task ends, as its exit status says (tasks.py; the docs' reference is made from this).
PASSED, FAILED, USER_ERROR, INTERRUPTED, OUTPUT_CLOSED = 0, 1, 2, 130, 141
EXIT_CODES = {
    PASSED: "done; a job or check passed",
    FAILED: "the work ran and did not pass (a job, a check): the last line says what failed and where the logs are",
    USER_ERROR: "nothing was done, or nothing more: an input or the environment needs fixing, as the last line says",
    INTERRUPTED: "Ctrl-C (or SIGTERM): what was started was stopped and cleaned up",
    OUTPUT_CLOSED: "the output was closed (`| head`): fleetbox stopped quietly",
}
