"""The job's checkpoint folder on the host side: where it is, whether it can be written, what it holds.
The containers' side (saving, loading) is fleetbox/incontainer/fleetbox_checkpoint.py; the layout is its."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fleetbox.errors import UserError
from fleetbox.incontainer import (
    fleetbox_checkpoint as layout,  # the folder's layout is the helper's (stdlib only at import)
)


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


def prepare(path: Path, resume: str, log=print) -> None:
    """Make the folder (as the user running fleetbox). `--resume never` with checkpoints already there (a job
    id used again): they are moved aside, not deleted, so nothing older is resumed by a later restart."""
    check_writable(path)
    path.mkdir(parents=True, exist_ok=True)
    for marker in (layout.STOP, layout.STATE):   # an earlier run's: the script records its own state again
        (path / marker).unlink(missing_ok=True)
    if resume == "never" and steps(path):
        stamp = time.strftime('%Y%m%d-%H%M%S')
        aside = _unused(path.with_name(f"{path.name}.before-{stamp}"))
        try:
            try:
                path.rename(aside)
                path.mkdir()
            except OSError:   # a mount point (EBUSY, EXDEV): its contents go aside inside it, out of the helper's view
                aside = _unused(path / f"before-{stamp}")
                aside.mkdir()
                for entry in [e for e in path.iterdir() if e != aside and not e.name.startswith("before-")]:
                    entry.rename(aside / entry.name)
        except OSError as e:
            raise UserError(f"--resume never: cannot move the earlier checkpoints in {path} aside: "
                            f"{e.strerror or e}") from None
        log(f"--resume never: moved the earlier checkpoints to {aside}")


def _unused(path: Path) -> Path:
    """`path`, or path-2, path-3, ... where it exists (two runs in one second)."""
    n, p = 1, path
    while p.exists():
        n += 1
        p = path.with_name(f"{path.name}-{n}")
    return p


def steps(path: Path) -> list[int]:
    """Complete checkpoints' steps, newest first (as the helper itself reads the folder)."""
    return layout.complete_steps(str(path))


def state(path: Path) -> dict:
    """What the script last recorded: {"state": running | continue | done, "step": N}, or {}."""
    try:
        return json.loads((path / layout.STATE).read_text())
    except (OSError, ValueError):
        return {}
