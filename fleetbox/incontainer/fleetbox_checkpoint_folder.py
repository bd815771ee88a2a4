"""A job's checkpoint folder before the job starts: what counts as a checkpoint, whose the folder is, and a fresh
start. fleetbox runs this here (fleetbox/run/checkpoints.py imports it), or where the folder is on other machines
(--hosts with a shared --checkpoint-dir) in a throwaway container on the first host:

    python -c "$(this file)" read FOLDER                  -> the owner record, or null
    python -c "$(this file)" take FOLDER REQUEST_JSON     -> take()'s answer
    python -c "$(this file)" release FOLDER OWNER_JSON    -> whether its OWNER went

Standard library only. A folder holds one live job at a time: OWNER names it ({"job", "runs", "user", "host",
"since"}; a job is its id in its runs folder). A job takes a folder that is its own, no one's, or held by a job
fleetbox has found ended: `expected`, the owner as it was read then, so one that took it meanwhile is not
overwritten. Each look-and-write is one step under a lock (flock on .owner.lock, in the folder).
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import sys
import time

STEP_DIR = re.compile(r"step-(\d{8})")
COMPLETE, STATE = "COMPLETE", "STATE"
STOP = "STOP"   # written by fleetbox (Slurm's warning before the time limit): checkpoint now, then stop
OWNER, LOCK = "OWNER", ".owner.lock"
ASIDE = re.compile(r"before-\d{8}-\d{6}(-\d+)?(\.partial)?")   # earlier checkpoints set aside inside the folder
PARTIAL = ".partial"


def complete_steps(folder: str) -> list[int]:
    """Steps with a COMPLETE marker, newest first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    steps = [int(m.group(1)) for n in names if (m := STEP_DIR.fullmatch(n))
             and os.path.exists(os.path.join(folder, n, COMPLETE))]
    return sorted(steps, reverse=True)


def owner(folder: str) -> dict | None:
    """The folder's owner record; None when it has none (a damaged one counts as none: no job could hold it)."""
    try:
        with open(os.path.join(folder, OWNER)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("job"), str) else None


def same_job(a: dict | None, b: dict | None) -> bool:
    return bool(a and b) and (a.get("job"), a.get("runs")) == (b.get("job"), b.get("runs"))


def _locked(folder: str) -> int:
    """The folder's lock, held until the descriptor is closed. Opened for writing (NFS emulates flock with
    byte-range locks, which need it), and made writable by all: a lock file another user made (a --hosts
    helper runs as root) is then still ours to lock; read-only where it is not."""
    path = os.path.join(folder, LOCK)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY)
    else:
        try:
            os.fchmod(fd, 0o666)   # umask took some bits; only its owner can give them back
        except OSError:
            pass
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def take(folder: str, me: dict, expected: dict | None, resume: str) -> dict:
    """Make `me` the folder's owner when it is mine, no one's, or still `expected`; then clear the earlier run's
    markers and, for `resume == "never"`, set its checkpoints aside (moved, never deleted). Returns
    {"taken": bool, "owner": the owner found, "aside": where the checkpoints went, or ""}."""
    os.makedirs(folder, exist_ok=True)
    fd = _locked(folder)
    try:
        found = owner(folder)
        if found and not same_job(found, me) and found != expected:
            return {"taken": False, "owner": found, "aside": ""}
        _write_json(os.path.join(folder, OWNER), me)
        _finish_aside(folder)
        for marker in (STOP, STATE):   # an earlier run's: the script records its own state again
            try:
                os.unlink(os.path.join(folder, marker))
            except FileNotFoundError:
                pass
        aside = _set_aside(folder) if resume == "never" and complete_steps(folder) else ""
        return {"taken": True, "owner": found, "aside": aside}
    finally:
        os.close(fd)


def release(folder: str, me: dict) -> bool:
    """The job has ended: its OWNER goes, where it is still this job's (one another job took meanwhile is that
    job's). True when it went."""
    if not os.path.isdir(folder):
        return False
    fd = _locked(folder)
    try:
        if not same_job(owner(folder), me):
            return False
        os.unlink(os.path.join(folder, OWNER))
        return True
    finally:
        os.close(fd)


def _movable(folder: str) -> list[str]:
    return [e for e in os.listdir(folder) if e not in (OWNER, LOCK) and not ASIDE.fullmatch(e)]


def _set_aside(folder: str) -> str:
    """Everything but the owner and the lock goes to FOLDER.before-<time> beside it, or where the folder is a
    mount point (another file system there: EXDEV) to before-<time>/ inside it, out of the helper's view. The
    folder itself stays (its lock and owner with it). The moves go to <that>.partial, renamed once all are in:
    nothing is half there under its final name, and an interrupted move is finished by the next take."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    entries = _movable(folder)
    final = _unused(f"{folder.rstrip('/')}.before-{stamp}")
    try:
        os.mkdir(final + PARTIAL)
        os.rename(os.path.join(folder, entries[0]), os.path.join(final + PARTIAL, entries[0]))
    except OSError:   # the parent is another file system or cannot be written: inside the folder, then
        try:
            os.rmdir(final + PARTIAL)
        except OSError:
            pass
        final = _unused(os.path.join(folder, f"before-{stamp}"))
        os.mkdir(final + PARTIAL)
    return _move_all(folder, final + PARTIAL)


def _move_all(folder: str, partial: str) -> str:
    for e in _movable(folder):
        if os.path.join(folder, e) != partial:
            os.rename(os.path.join(folder, e), os.path.join(partial, e))
    final = _unused(partial[:-len(PARTIAL)])
    os.rename(partial, final)
    return final


def partial_of(name: str) -> re.Pattern:
    """A setting aside of the folder `name` that was cut short: the sibling it was going to."""
    return re.compile(re.escape(name) + r"\.before-\d{8}-\d{6}(-\d+)?" + re.escape(PARTIAL))


def _finish_aside(folder: str) -> None:
    """A setting aside that was cut short (Ctrl-C, a removed helper container): what it had not moved yet goes
    where the rest went, so nothing of that run is resumed. Only folders named as fleetbox names them count."""
    parent, name = os.path.split(folder.rstrip("/"))
    parent = parent or "."
    try:
        beside = [os.path.join(parent, e) for e in os.listdir(parent) if partial_of(name).fullmatch(e)]
    except OSError:   # a parent that cannot be listed: nothing of ours can be there
        beside = []
    inside = [os.path.join(folder, e) for e in os.listdir(folder) if ASIDE.fullmatch(e) and e.endswith(PARTIAL)]
    for partial in beside + inside:
        if os.path.isdir(partial) and not os.path.islink(partial):
            _move_all(folder, partial)


def _unused(path: str) -> str:
    """`path`, or path-2, path-3, ... where it exists (two runs in one second)."""
    n, p = 1, path
    while os.path.exists(p):
        n += 1
        p = f"{path}-{n}"
    return p


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def answer(argv: list[str]):
    """What a verb gives: read FOLDER, take FOLDER REQUEST_JSON, release FOLDER OWNER_JSON. Raises OSError as the
    folder does (main reports it; fleetbox, calling this in its own process, says it)."""
    if argv[0] == "read":
        return owner(argv[1])
    if argv[0] == "release":
        return release(argv[1], json.loads(argv[2]))
    req = json.loads(argv[2])
    return take(argv[1], req["me"], req["expected"], req["resume"])


def main(argv: list[str]) -> int:
    verbs = {"read": 2, "take": 3, "release": 3}
    if not argv or verbs.get(argv[0]) != len(argv):
        print("usage: read FOLDER | take FOLDER REQUEST_JSON | release FOLDER OWNER_JSON", file=sys.stderr)
        return 2
    try:
        said = answer(argv)
    except OSError as e:
        print(json.dumps({"error": f"{e.filename or argv[1]}: {e.strerror or e}"}))
        return 1
    print(json.dumps(said))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
