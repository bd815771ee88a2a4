"""The job's checkpoint folder on the host side: where it is, whether it can be written, what it holds.
The containers' side (saving, loading) is fleetbox/incontainer/fleetbox_checkpoint.py; the layout is its."""

from __future__ import annotations

import getpass
import json
import os
import time
from pathlib import Path

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.incontainer import fleetbox_checkpoint_folder as layout  # the folder's layout and owner (stdlib)
from fleetbox.processes import process_start, this_host
from fleetbox.run import backend, records
from fleetbox.run.spec import JOB_ID


def folder(checkpoint_dir: str, job_dir: Path) -> Path:
    return Path(checkpoint_dir).resolve() if checkpoint_dir else job_dir / "checkpoints"


def check_writable(path: Path) -> None:
    """One line now rather than a failure in every container later: the folder, or the nearest folder above
    it that exists, must be a folder we may write in (a read-only file system included)."""
    p = path
    while not p.exists():
        p = p.parent
    if not p.is_dir():
        raise UserError(f"checkpoint folder {path}: {p} is not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise UserError(f"checkpoint folder {path} is not writable ({p}: "
                        f"{'read-only file system' if _read_only(p) else 'permission denied'})")


def _read_only(p: Path) -> bool:
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def owner_record(job_id: str) -> dict:
    """What a job writes into the checkpoint folder it holds (OWNER): the job is its id in its runs folder; the
    process that took the folder (which may not have written the job's record yet) is its pid on its host."""
    pid = os.getpid()
    return {"job": job_id, "runs": str(settings.runs_root().resolve()), "user": getpass.getuser(),
            "host": this_host(), "pid": pid, "pid_start": process_start(pid),
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _word(value) -> str:
    """A value from an OWNER file, fit for one line: whatever is in the file (it may be anyone's)."""
    return " ".join(str(value).split())[:80] or "?"


def may_take(folder: str, found: dict | None, me: dict, ended) -> dict | None:
    """`found`, the folder's owner, when `me` may take the folder from it: it is `me`, no one, or a job that has
    ended (`ended(job folder)` -> (ended, state), asked of its backend); else one line naming the owner. A job
    whose record cannot be seen from here, or whose taking process runs, has not ended."""
    if not found or layout.same_job(found, me):
        return found
    runs, job, host = Path(str(found.get("runs", ""))), str(found["job"]), str(found.get("host", ""))
    who = f"job {_word(job)} of {_word(found.get('user'))} on {_word(host)} (runs folder {_word(runs)})"
    here, pid = host == this_host(), found.get("pid")
    try:
        recorded = JOB_ID.fullmatch(job) and runs.is_absolute() and (runs / job / records.HANDLE).exists()
    except OSError as e:   # another user's runs folder, say: whether the job has ended cannot be asked from here
        raise UserError(f"checkpoint folder {folder} belongs to {who}, whose record cannot be read from here "
                        f"({e.strerror or e}): if that job has ended, remove {Path(folder, layout.OWNER)}; else "
                        f"give another --checkpoint-dir") from None
    if not recorded:   # the job's record is not written yet, or not seen from here
        if here and isinstance(pid, int) and pid > 0 and process_start(pid) == found.get("pid_start"):
            raise UserError(f"checkpoint folder {folder} belongs to {who}, which is starting (its fleetbox, pid "
                            f"{pid}, runs): wait for it, cancel it, or give another --checkpoint-dir")
        if not here:
            raise UserError(f"checkpoint folder {folder} belongs to {who}, which cannot be asked from here: if "
                            f"that job has ended, remove {Path(folder, layout.OWNER)}; else give another "
                            f"--checkpoint-dir")
        return found   # its fleetbox here ended before it wrote the job's record: the job never started
    done, state = ended(runs / job)
    if not done:
        raise UserError(f"checkpoint folder {folder} belongs to {who}, which is {_word(state)}: wait for it, cancel "
                        f"it, or give another --checkpoint-dir")
    return found


def prepare(path: Path, resume: str, job_id: str, log=print, helper=None) -> None:
    """Take the folder for this job before anything in it is touched: it belongs to one live job at a time (a
    second job gets one line naming the first). Then the earlier run's markers go, and for `--resume never` its
    checkpoints are moved aside (never deleted), so nothing older is resumed by a later restart. `helper(*args)`
    runs fleetbox_checkpoint_folder's main where the folder is and returns its answer (default: here)."""
    me = owner_record(job_id)
    if helper is None:
        check_writable(path)
        helper = _here
    expected = may_take(str(path), helper("read", str(path)), me, backend.job_ended)
    for _ in range(3):   # another job may take it between our look and our take: look again
        try:
            got = helper("take", str(path), json.dumps({"me": me, "expected": expected, "resume": resume}))
        except OSError as e:
            raise UserError(f"checkpoint folder {path}: {e.strerror or e}"
                            + (" (setting the earlier checkpoints aside for --resume never)"
                               if resume == "never" else "")) from None
        if got.get("error"):
            raise UserError(f"checkpoint folder {path}: {got['error']}")
        if got["taken"]:
            if got["aside"]:
                log(f"--resume never: moved the earlier checkpoints to {got['aside']}")
            return
        expected = may_take(str(path), got["owner"], me, backend.job_ended)
    raise UserError(f"checkpoint folder {path}: other jobs keep taking it; give another --checkpoint-dir")


def _here(*args: str):
    """fleetbox_checkpoint_folder's verbs, in this process: the answer, or OSError as the helper meets it."""
    return layout.answer(list(args))


def release(path: Path, job_id: str, helper=None) -> None:
    """The job has ended: its OWNER goes, where it is still this job's (a folder another job took meanwhile is
    that job's). `helper` as in prepare."""
    (helper or _here)("release", str(path), json.dumps(owner_record(job_id)))


def steps(path: Path) -> list[int]:
    """Complete checkpoints' steps, newest first (as the helper itself reads the folder)."""
    return layout.complete_steps(str(path))


def state(path: Path) -> dict:
    """What the script last recorded: {"state": running | continue | done, "step": N}, or {}."""
    try:
        return json.loads((path / layout.STATE).read_text())
    except (OSError, ValueError):
        return {}
