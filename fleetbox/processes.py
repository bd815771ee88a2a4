"""Processes and signals, for any work that must finish its cleanup: signals held during it, SIGTERM taking
Ctrl-C's way out, a log that cannot fail, and a process's start time (a reused pid is another process)."""

from __future__ import annotations

import signal
from contextlib import contextmanager


@contextmanager
def signals_held():
    """Ctrl-C and SIGTERM wait until the block is done (users press Ctrl-C twice; cleanup must finish)."""
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def never_failing(log):
    def safe(line: str) -> None:
        try:
            log(line)
        except Exception:
            pass
    return safe


@contextmanager
def sigterm_as_interrupt():
    """SIGTERM (a scheduler, `kill`) takes the same way out as Ctrl-C."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def process_start(pid: int) -> int:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat field 22); 0 if it is gone (a
    zombie, killed and not yet reaped, counts as gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return 0 if fields[0] in ("Z", "X") else int(fields[19])
