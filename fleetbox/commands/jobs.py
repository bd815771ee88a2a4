"""`invoke jobs / logs / cancel / report`, which work on any job from any shell through its
runs/<job>/handle.json."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import asdict
from pathlib import Path

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.processes import process_start
from fleetbox.run import backends, checkpoints
from fleetbox.run import report as report_mod
from fleetbox.run.backend import CANCELLED, Handle
from fleetbox.run.backends.docker import DockerBackend
from fleetbox.run.backends.slurm import ACTIVE, SlurmBackend, allocations, job_state, tail_file
from fleetbox.run.result import JobResult
from fleetbox.run.spec import JOB_ID


def alive(h: Handle) -> bool:
    """The job's supervisor runs: the same pid and the same start time (a reused pid is another process)."""
    return h.supervisor > 0 and h.supervisor_start > 0 and process_start(h.supervisor) == h.supervisor_start


def find(job_id: str) -> Handle:
    if not JOB_ID.fullmatch(job_id or ""):
        raise UserError(f"{job_id!r} is not a job id")
    d = settings.runs_root() / job_id
    if not (d / "handle.json").exists():
        raise UserError(f"no job {job_id} in {settings.runs_root()} (see `invoke jobs`)")
    return Handle.load(d)


def describe(h: Handle) -> dict:
    """One row of `invoke jobs`: what the job is doing now, as far as this machine can tell."""
    d = Path(h.dir)
    summary = _json(d / "summary.json")
    row = {"job": h.job_id, "backend": h.backend, "nodes": h.nodes, "state": "?", "attempt": 0,
           # a folder here (--hosts volumes and folders are on the other machines)
           "checkpoint": (checkpoints.steps(Path(h.checkpoints)) or [0])[0]
           if h.checkpoints.startswith("/") and not any(h.hosts) else None,
           "note": ""}
    if h.backend == "slurm":
        b, recs = backends.get("slurm"), allocations(d, h.scheduler_job)
        chained = bool(recs and recs[-1]["next"])
        row["attempt"] = len(recs) + 1 if chained or not recs else len(recs)
        cancelled = (d / f"{CANCELLED}.{h.scheduler_job}").exists()
        if not summary or chained:
            current = b.current(h, recs)
            try:
                state = job_state(current)[0]
            except UserError as e:
                row["note"] = str(e)
                return row
            if state in ACTIVE:
                row["state"] = state
                return row
            if state == "UNKNOWN":   # Slurm has forgotten it (MinJobAge): what the chain recorded, else nothing
                if not recs or chained:
                    row["state"], row["note"] = "?", f"Slurm no longer knows job {current}"
                    return row
                state = "COMPLETED" if recs[-1]["exit"] == 0 else "FAILED"
            # the chain has ended and no one followed it (a detached job): its result, from its files
            summary = asdict(b.result(h, state, current, recs))
        row["state"] = "CANCELLED" if cancelled else "PASSED" if summary["ok"] else "FAILED"
        row["note"] = "" if summary["ok"] or cancelled else JobResult(**{**summary, "nodes": []}).reason()
        return row
    row["attempt"] = len([p for p in d.iterdir() if p.is_dir() and re.fullmatch(r"attempt\d+", p.name)])
    following = alive(h)
    if not following and (d / CANCELLED).exists():
        row["state"] = "CANCELLED"
        return row
    if summary and not following:
        row["state"] = "PASSED" if summary["ok"] else "FAILED"
        return row
    try:
        state = backends.get("docker").status(h)
    except UserError as e:
        row["note"] = str(e)
        return row
    if following:
        row["state"] = "RUNNING" if state == "RUNNING" else "STARTING"
    else:
        row["state"] = "ORPHANED" if state == "RUNNING" else "DIED"
        row["note"] = (f"its supervisor (pid {h.supervisor}) is gone: nothing propagates failures or restarts; "
                       f"`invoke cancel {h.job_id}` removes it" if state == "RUNNING" else
                       f"its supervisor (pid {h.supervisor}) ended without a summary")
    return row


def listing(log=print) -> list[dict]:
    rows = []
    for hj in sorted(settings.runs_root().glob("*/handle.json"), key=lambda p: p.stat().st_mtime):
        try:
            rows.append(describe(Handle.load(hj.parent)))
        except (ValueError, TypeError, KeyError, OSError):
            continue   # a handle from an older fleetbox, or half a folder
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
        if h.backend == "docker":
            _docker_logs(h, node, follow, log, poll)
        else:
            _file_logs(h, Path(h.dir) / f"node{node}.log", follow, log, poll)
    except KeyboardInterrupt:
        log(f"stopped following; job {job_id} goes on (`invoke cancel {job_id}` stops it)")


def _docker_logs(h: Handle, node: int, follow: bool, log, poll: float) -> None:
    b, seen, shown = DockerBackend(), set(), False
    while True:
        mine = [c for c in b._containers(h) if c.labels.get(settings.LABEL_RANK) == str(node) and c.id not in seen]
        if mine:
            c = mine[0]
            seen.add(c.id)
            buf = b""
            try:
                for chunk in (c.logs(stream=True, follow=True) if follow else [c.logs()]):
                    buf += chunk
                    while b"\n" in buf:
                        ln, buf = buf.split(b"\n", 1)
                        log(ln.decode(errors="replace"))
            except Exception:   # removed while we read: the job moved on
                pass
            if buf:
                log(buf.decode(errors="replace"))
        elif not seen and not shown:   # nothing running: what the job left in its folder
            p = Path(h.dir) / f"node{node}" / "container.log"
            if p.exists():
                log(p.read_text(errors="replace").rstrip("\n"))
                shown = True
            elif not follow:
                raise UserError(f"no output of node {node} yet (job {h.job_id})")
        if not follow or not alive(h):
            return
        time.sleep(poll)   # a restart makes a new container for the node: follow that one too


def _file_logs(h: Handle, path: Path, follow: bool, log, poll: float) -> None:
    tail_file(path, lambda: follow and SlurmBackend().status(h) in ACTIVE, log, poll)


def cancel(job_id: str, log=print, wait: float = 60) -> None:
    """Stop a job from any shell: a Docker job's supervisor is asked (SIGTERM) and cleans up as on Ctrl-C;
    without one, the job's containers are removed; a Slurm chain is cancelled whole."""
    h = find(job_id)
    if h.backend == "slurm":
        backends.get("slurm").cancel(h, log)
        return
    b = backends.get("docker")
    following = alive(h) and h.supervisor != os.getpid()
    if not following and b.status(h) == "GONE":
        raise UserError(f"job {job_id} has already ended (see `invoke jobs`)")
    (Path(h.dir) / CANCELLED).touch()   # first: a supervisor between attempts does not start another
    if following:
        log(f"asking the supervisor (pid {h.supervisor}) to stop job {job_id}")
        os.kill(h.supervisor, signal.SIGTERM)
        end = time.monotonic() + wait
        while alive(h) and time.monotonic() < end:
            time.sleep(0.2)
        if not alive(h):
            log(f"job {job_id} cancelled; logs in {h.dir}")
            return
        log(f"the supervisor did not stop within {wait:g} s; removing the job's containers")
    b.cancel(h, log)
    log(f"job {job_id}: containers removed; logs in {h.dir}")


def _json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
