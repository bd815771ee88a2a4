"""Processes and signals, for any work that must finish its cleanup: signals held during it, SIGTERM and SIGHUP
taking Ctrl-C's way out, a log that cannot fail, and a process's start time (a reused pid is another process)."""

from __future__ import annotations

import signal
import socket
from contextlib import contextmanager

# What asks a command to stop besides Ctrl-C: a scheduler or `kill` (SIGTERM), a dropped SSH connection or a
# closed terminal (SIGHUP). Each takes Ctrl-C's way out, through the same cleanup.
STOPS = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def signals_held():
    """Ctrl-C, SIGTERM and SIGHUP wait until the block is done (users press Ctrl-C twice; cleanup must finish)."""
    handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, *STOPS)}
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
def stops_as_interrupt():
    """SIGTERM and SIGHUP take the same way out as Ctrl-C; one that was ignored when we started (`nohup`)
    stays ignored."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = {sig: signal.getsignal(sig) for sig in STOPS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def process_start(pid: int) -> int:
    """When the process started, in clock ticks since boot (/proc/<pid>/stat field 22); 0 if it is gone (a
    zombie, killed and not yet reaped, counts as gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return 0 if fields[0] in ("Z", "X") else int(fields[19])


def this_host() -> str:
    """This machine's name, as a job's record keeps where its supervisor runs (login nodes share a runs folder;
    a pid means nothing on another one)."""
    return socket.gethostname()
