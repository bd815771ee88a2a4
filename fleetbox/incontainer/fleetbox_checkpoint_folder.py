"""A job's checkpoint folder before the job starts: what counts as a checkpoint, whose the folder is, and a fresh
start. fleetbox runs this here (fleetbox/run/checkpoints.py imports it), or where the folder is on other machines
(--hosts with a shared --checkpoint-dir) in a throwaway container on the first host:

    python -c "$(this file)" read FOLDER               -> the owner record, or null
    python -c "$(this file)" take FOLDER REQUEST_JSON  -> take()'s answer

Standard library only. A folder holds one live job at a time: OWNER names it ({"job", "runs", "user", "host",
"since"}; a job is its id in its runs folder). A job takes a folder that is its own, no one's, or held by a job
fleetbox has found ended: `expected`, the owner as it was read then, so one that took it meanwhile is not
overwritten. The check and the write are one step under a lock (flock on .owner.lock, in the folder).
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
ASIDE = re.compile(r"before-\d{8}-\d{6}(-\d+)?")   # earlier checkpoints set aside inside a folder (a mount point)


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


def take(folder: str, me: dict, expected: dict | None, resume: str) -> dict:
    """Make `me` the folder's owner when it is mine, no one's, or still `expected`; then clear the earlier run's
    markers and, for `resume == "never"`, set its checkpoints aside (moved, never deleted). Returns
    {"taken": bool, "owner": the owner found, "aside": where the checkpoints went, or ""}."""
    os.makedirs(folder, exist_ok=True)
    fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        found = owner(folder)
        if found and not same_job(found, me) and found != expected:
            return {"taken": False, "owner": found, "aside": ""}
        _write_json(os.path.join(folder, OWNER), me)
        for marker in (STOP, STATE):   # an earlier run's: the script records its own state again
            try:
                os.unlink(os.path.join(folder, marker))
            except FileNotFoundError:
                pass
        aside = _set_aside(folder) if resume == "never" and complete_steps(folder) else ""
        return {"taken": True, "owner": found, "aside": aside}
    finally:
        os.close(fd)


def _set_aside(folder: str) -> str:
    """Everything but the owner and the lock goes to FOLDER.before-<time> beside it, or where the folder is a
    mount point (another file system there: EXDEV) to before-<time>/ inside it, out of the helper's view. The
    folder itself stays (its lock and owner with it)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    entries = [e for e in os.listdir(folder) if e not in (OWNER, LOCK) and not ASIDE.fullmatch(e)]
    aside = _unused(f"{folder.rstrip('/')}.before-{stamp}")
    try:
        os.mkdir(aside)
        first = entries[0] if entries else None
        if first is not None:
            os.rename(os.path.join(folder, first), os.path.join(aside, first))
    except OSError:   # the parent is another file system or cannot be written: inside the folder, then
        try:
            os.rmdir(aside)
        except OSError:
            pass
        aside, first = _unused(os.path.join(folder, f"before-{stamp}")), None
        os.mkdir(aside)
    for e in entries:
        if e != first:
            os.rename(os.path.join(folder, e), os.path.join(aside, e))
    return aside


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


def main(argv: list[str]) -> int:
    if argv[:1] == ["read"] and len(argv) == 2:
        print(json.dumps(owner(argv[1])))
        return 0
    if argv[:1] == ["take"] and len(argv) == 3:
        try:
            req = json.loads(argv[2])
            print(json.dumps(take(argv[1], req["me"], req["expected"], req["resume"])))
        except OSError as e:
            print(json.dumps({"error": f"{e.filename or argv[1]}: {e.strerror or e}"}))
            return 1
        return 0
    print("usage: read FOLDER | take FOLDER REQUEST_JSON", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
