"""`invoke jobs / logs / cancel / report`, which work on any job from any shell through its
runs/<job>/handle.json; what each step means for a backend is the backend's (run/backends/)."""

from __future__ import annotations

from pathlib import Path

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.run import backends, checkpoints
from fleetbox.run import report as report_mod
from fleetbox.run.records import DamagedRecord, Handle, JobState
from fleetbox.run.spec import JOB_ID


def find(job_id: str) -> Handle:
    if not JOB_ID.fullmatch(job_id or ""):
        raise UserError(f"{job_id!r} is not a job id")
    try:
        return Handle.load(settings.runs_root() / job_id)
    except FileNotFoundError:
        raise UserError(f"no job {job_id} in {settings.runs_root()} (see `invoke jobs`)") from None
    except DamagedRecord as e:
        raise DamagedRecord(f"{e}; {_leftovers(job_id)}") from None


def describe(h: Handle) -> dict:
    """One row of `invoke jobs`: what the job is doing now, as far as this machine can tell."""
    row = {"job": h.job_id, "backend": h.backend, "nodes": h.nodes, "state": JobState.UNKNOWN, "attempt": 0,
           # a folder here (--hosts volumes and folders are on the other machines)
           "checkpoint": (checkpoints.steps(Path(h.checkpoints_here())) or [0])[0] if h.checkpoints_here() else None,
           "note": ""}
    try:
        row["state"], row["attempt"], row["note"] = backends.get(h.backend).job_state(h)
    except UserError as e:   # a backend this fleetbox does not know, or one that cannot be asked
        row["note"] = str(e)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:   # an older record, half a folder
        row["note"] = f"cannot tell its state ({type(e).__name__}: {e})"[:200]
    return row


def damaged(job_dir: Path, why: str) -> dict:
    """The row of a job whose handle.json cannot be read: shown, never dropped."""
    return {"job": job_dir.name, "backend": "?", "nodes": "?", "state": JobState.DAMAGED, "attempt": "-",
            "checkpoint": None, "note": f"{why}; {_leftovers(job_dir.name)}"}


def _leftovers(job_id: str) -> str:
    """What stops a job whose record cannot be read (its backend unknown): `invoke clean`, and every backend's own
    way where that is not enough (Backend.leftovers)."""
    own = "; ".join(way for b in backends.BACKENDS.values() if (way := b.leftovers(job_id)))
    return f"`invoke clean --job {job_id} --force` removes its containers" + (f" ({own})" if own else "")


def _mtime(path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:   # removed since the folder was listed: skipped below
        return 0.0


def listing(log=print) -> list[dict]:
    rows = []
    for hj in sorted(settings.runs_root().glob("*/handle.json"), key=_mtime):
        try:
            rows.append(describe(Handle.load(hj.parent)))
        except DamagedRecord as e:
            rows.append(damaged(hj.parent, str(e).split(": ", 1)[-1]))
        except FileNotFoundError:   # removed while we looked
            continue
    log(f"{'job':<36} {'backend':<7} {'nodes':>5} {'state':<9} {'attempt':>7} {'ckpt step':>9}  note")
    for r in rows:
        step = "-" if r["checkpoint"] is None else str(r["checkpoint"])
        log(f"{r['job']:<36} {r['backend']:<7} {r['nodes']:>5} {r['state']:<9} {r['attempt']:>7} {step:>9}  "
            f"{r['note']}")
    return rows


def report(job_id: str, log=print) -> dict | None:
    """`invoke report JOB`: draw the run's report again, from whatever the job left (failed or cancelled too)."""
    if not JOB_ID.fullmatch(job_id or ""):
        raise UserError(f"{job_id!r} is not a job id")
    job_dir = settings.runs_root() / job_id
    if not job_dir.is_dir():
        raise UserError(f"no job {job_id} in {settings.runs_root()} (see `invoke jobs`)")
    drawn = report_mod.draw(job_dir)
    log(f"report: {drawn['md']} ({Path(drawn['png']).name})")
    for m in drawn["missing"]:
        log(f"missing: {m}")
    return drawn


def logs(job_id: str, node: int = 0, follow: bool = False, log=print, poll: float = 0.5) -> None:
    """A node's output, from the engine (Docker) or the node's log file (Slurm); --follow goes on until the job
    ends, across restarts and allocations. Ctrl-C stops following and leaves the job alone."""
    h = find(job_id)
    if not 0 <= node < h.nodes:
        raise UserError(f"--node {node}: job {job_id} has nodes 0..{h.nodes - 1}")
    try:
        backends.get(h.backend).show_logs(h, node, follow, log, poll)
    except KeyboardInterrupt:
        log(f"stopped following; job {job_id} goes on (`invoke cancel {job_id}` stops it)")


def cancel(job_id: str, log=print) -> None:
    """Stop a job from any shell: a Docker job's supervisor is asked (SIGTERM) and cleans up as on Ctrl-C;
    without one, the job's containers are removed; a Slurm chain is cancelled whole."""
    h = find(job_id)
    backends.get(h.backend).cancel(h, log)
