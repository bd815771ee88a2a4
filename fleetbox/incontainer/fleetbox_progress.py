"""Progress, for fleetbox's hang detection: a rank that makes no progress for `--hang-timeout` (or none before
`--start-timeout`) gets every rank's stacks taken and the job stopped (and restarted, with --max-restarts).

fleetbox_metrics and fleetbox_checkpoint report every step for you (a checkpoint save is a phase). A script that
uses neither reports its steps itself, and declares a long stretch that is not a step:

    import fleetbox_progress                  # on PYTHONPATH in every fleetbox job container
    fleetbox_progress.step(n)                 # after each training step
    with fleetbox_progress.phase("evaluation"):   # no hang while inside, up to the job's --start-timeout
        evaluate()                            # (or `limit` seconds: phase("compile", limit=3600))

Each rank keeps one small file, $FLEETBOX_PROGRESS_DIR/progress-rank<r>.json, rewritten whole (a rename) by a
background thread at most once a second and only when something changed: the training loop itself never
waits on the file system. The thread writes what the loop last reported, so a stuck loop stops the file
changing even though the thread lives on.
"""
import contextlib
import json
import os
import threading
import time

DIR_ENV = "FLEETBOX_PROGRESS_DIR"
EVERY_S = 1.0

_lock = threading.Lock()
_state = {"seq": 0, "step": None, "phase": None, "phase_limit": None, "reports": False}
_written = -1       # the seq last written
_thread = None


def rank() -> int:
    return int(os.environ.get("PADDLE_TRAINER_ID") or os.environ.get("PADDLE_GLOBAL_RANK") or 0)


def path():
    d = os.environ.get(DIR_ENV)
    return os.path.join(d, f"progress-rank{rank()}.json") if d else None


def _write() -> None:
    global _written
    p = path()
    with _lock:
        if p is None or _state["seq"] == _written:
            return
        rec = {**_state, "rank": rank(), "pid": os.getpid(), "time": time.time()}
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
        time.sleep(EVERY_S)
        _write()


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
    """The rank's process runs (called by the helpers' sitecustomize): written at once, with its pid."""
    _changed()
    _write()


def reporting() -> None:
    """This script reports progress (fleetbox_metrics and fleetbox_checkpoint say so when imported): from then
    on, no step before --start-timeout is a hang at start."""
    if not _state["reports"]:
        _changed(reports=True)
        _write()


def step(n) -> None:
    """Step `n` is done."""
    _changed(step=int(n), reports=True)


@contextlib.contextmanager
def phase(name: str, limit: float | None = None):
    """A long stretch that is not a step (an evaluation, a checkpoint save, a first step that compiles): while
    inside, no progress is expected for `limit` seconds (default: the job's --start-timeout)."""
    outer = (_state["phase"], _state["phase_limit"])
    _changed(phase=str(name), phase_limit=limit, reports=True)
    _write()   # at once: the phase may be long from its first second
    try:
        yield
    finally:
        _changed(phase=outer[0], phase_limit=outer[1])
