"""Progress, for fleetbox's hang detection: a rank that makes no progress for `--hang-timeout` (or none before
`--start-timeout`) gets every rank's stacks taken and the job stopped (and restarted, with --max-restarts).

fleetbox_metrics and fleetbox_checkpoint report every step for you (a checkpoint save is a phase). A script that
uses neither gets its steps counted from the training itself (sitecustomize: an optimizer's step, a static
program's Executor.run, paddle.Model's train_batch), or reports them itself, and declares a long stretch that is
not a step:

    import fleetbox_progress                  # on PYTHONPATH in every fleetbox job container
    fleetbox_progress.step(n)                 # after each training step
    with fleetbox_progress.phase("evaluation"):   # no hang while inside, up to the job's --start-timeout
        evaluate()                            # (or `limit` seconds: phase("compile", limit=3600))

A step may say how long this rank worked on its own (`step(n, own=seconds)`: not waiting for its peers in a
collective; fleetbox_metrics' Meter gives it from the script's `comm_seconds`): the file then carries the
median of the last WINDOW such times, from which fleetbox names a straggler while the job runs.

Each rank keeps one small file, $FLEETBOX_PROGRESS_DIR/progress-rank<r>.json, rewritten whole (a rename) by a
background thread at most once a second and only when something changed: a step never waits on the file
system (entering a phase wakes the thread to write at once: the phase may be long). The thread writes what the loop last
reported, so a stuck loop stops the file changing even though the thread lives on. A rank's child processes
(a subprocess, a data loader's workers) write nothing: the rank's own pid is in FLEETBOX_PROGRESS_PID.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import math
import os
import statistics
import threading
import time

DIR_ENV = "FLEETBOX_PROGRESS_DIR"
OWNER_ENV = "FLEETBOX_PROGRESS_PID"   # the rank's own process (sitecustomize sets it): its children inherit it
EVERY_S = 1.0
WINDOW = 20   # steps whose own time a rank's file gives the median of (a straggler "stays" slow over them)
WARM_UP = 5   # steps whose own time is left out

_lock = threading.Lock()          # the state
_writing = threading.Lock()       # the file: the flusher and started()/exit may write at once
_state = {"seq": 0, "step": None, "phase": None, "phase_limit": None, "reports": False, "done": False,
          "explicit": False}   # explicit: the script reports its own steps (step(), or the helpers imported)
_auto = 0   # the steps sitecustomize saw in the training itself (auto_step)
_own = collections.deque(maxlen=WINDOW)   # this rank's own seconds of its last steps (their median is written)
_warm = 0   # own times seen and left out
_written = -1       # the seq last written
_thread = None
_soon = threading.Event()   # a phase began: the flusher writes now, not at its next second
_also = []   # more for the flusher to write each time it wakes (fleetbox_found's metrics)


def rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID") or os.environ.get("PADDLE_GLOBAL_RANK") or 0)


def path():
    """This rank's progress file (the name fleetbox's run/hang.py reads); None outside a job, and in a rank's
    child process (a subprocess, a data loader's worker): that is not the rank's progress."""
    d, owner = os.environ.get(DIR_ENV), os.environ.get(OWNER_ENV)
    if not d or owner and owner != str(os.getpid()):
        return None
    return os.path.join(d, f"progress-rank{rank()}.json")


def _write() -> None:
    global _written
    p = path()
    with _writing:
        with _lock:
            if p is None or _state["seq"] == _written:
                return
            rec = {**_state, "own_s": statistics.median(_own) if _own else None, "own_n": len(_own),
                   "rank": rank(), "pid": os.getpid(), "time": time.time()}
            seq = _state["seq"]
        tmp = f"{p}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(rec, f)
            os.replace(tmp, p)
            _written = seq
        except OSError:   # a full or vanished log folder: detection goes blind, training goes on
            pass


def _flusher() -> None:
    while True:
        _soon.wait(EVERY_S)   # a second, or less where a phase began
        _soon.clear()
        _write()
        _write_also()


def _changed(**values) -> None:
    global _thread
    if path() is None:
        return
    with _lock:
        _state.update(values, seq=_state["seq"] + 1)
        if _thread is None or not _thread.is_alive():   # none yet, or a forked child's (threads do not fork)
            _thread = threading.Thread(target=_flusher, name="fleetbox-progress", daemon=True)
            _thread.start()


def started() -> None:
    """The rank's process runs (called by the helpers' sitecustomize): written at once, with its pid; at its
    exit, it says it is done (a rank that finished is never waited for)."""
    _changed()
    _write()
    atexit.register(_finished)


def _finished() -> None:
    _changed(done=True)
    _write()


def _write_also() -> None:
    for write in _also:
        try:
            write()
        except Exception:   # never a reason for the progress itself to stop (a false hang)
            pass


def also(write) -> None:
    """`write()` is called by the same background thread each time it wakes. Its last write, at the rank's exit, is
    its own to register (fleetbox_found's must run before Paddle's exit handlers, registered after this module's)."""
    if write not in _also:
        _also.append(write)


def reporting() -> None:
    """This script reports progress (fleetbox_metrics and fleetbox_checkpoint say so when imported): from then
    on, no step before --start-timeout is a hang at start."""
    if not _state["explicit"]:
        _changed(reports=True, explicit=True)
        _write()


def step(n, own=None) -> None:
    """Step `n` is done; `own`: the seconds of it this rank spent on its own work, not waiting for its peers."""
    global _warm
    if path() is None:   # outside a job, or a rank's child (which may hold a copy of a lock taken when it forked)
        return
    if own is not None and math.isfinite(own) and own >= 0:
        with _lock:   # the median is taken when the file is written (at most once a second), not every step
            if _warm < WARM_UP:   # the first steps compile and warm caches, unevenly across ranks
                _warm += 1
            else:
                _own.append(float(own))
    _changed(step=int(n), reports=True, explicit=True)


def auto_step() -> None:
    """A step seen in the training itself (sitecustomize wraps an optimizer's step, Executor.run and
    Model.train_batch), for a script that reports none: counted here. A script that reports its own steps (or
    imports fleetbox_metrics or fleetbox_checkpoint) is left to them."""
    global _auto
    if _state["explicit"] or path() is None:
        return
    _auto += 1
    _changed(step=_auto, reports=True)


@contextlib.contextmanager
def phase(name: str, limit: float | None = None):
    """A long stretch that is not a step (an evaluation, a checkpoint save, a first step that compiles): while
    inside, no progress is expected for `limit` seconds (default: the job's --start-timeout)."""
    outer = (_state["phase"], _state["phase_limit"])
    _changed(phase=str(name), phase_limit=limit, reports=True)
    if path() is not None:   # the rank itself (a forked child's copy of the event may hold a lock it never frees)
        _soon.set()   # written at once, by the flusher: the phase may be long from its first second, and the
                      # training thread never waits on the file system (every paddle.save and load is a phase)
    try:
        yield
    finally:
        _changed(phase=outer[0], phase_limit=outer[1])
