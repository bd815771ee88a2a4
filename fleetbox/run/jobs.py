"""`invoke train` and `invoke up`'s training step: choose the backend, plan once, then describe that plan
(--dry-run), run it, or leave it running (--detach) and report one JobResult; and `invoke jobs / logs /
cancel`, which work on any job from any shell through its runs/<job>/handle.json."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from .. import ROOT, settings
from ..errors import Failed, UserError
from . import backend as backends, checkpoints, supervisor
from .backend import CANCELLED, Handle, process_start
from .result import JobResult
from .spec import JOB_ID, JobSpec


def train(spec: JobSpec, backend: str = "docker", backend_options: dict | None = None, dry_run: bool = False,
          timeout: float | None = None, detach: bool = False, log=print, preflight: bool = False) -> JobResult | None:
    if timeout and backend != "docker":
        raise UserError(f"--timeout is for the docker backend; give {backend} its own limit (Slurm: --time)")
    if timeout and detach:
        raise UserError("--timeout needs an attached job; a detached one ends with `invoke cancel`")
    b = backends.get(backend, **(backend_options or {}))
    if preflight and not dry_run:   # the same nodes, containers and ports the job will use, checked first
        from dataclasses import replace
        from .. import doctor
        log(f"preflight: checking {spec.nodes} node(s) before starting the job")
        report = doctor.run(spec, backend, backend_options, quick=True, log=log)
        if not report["ok"]:
            bad = sum(not r["ok"] for r in report["rows"])
            raise Failed(f"preflight: {bad} check(s) failed; the job was not started (report: {report['path']})")
        spec = replace(spec, port=report["port"])   # the ports just checked
    with backends.sigterm_as_interrupt():   # planning starts probe containers on --hosts engines
        plan = b.plan(spec)
    if dry_run:
        log(b.describe(plan))
        return None
    if detach:
        handle = supervise(plan, log) if backend == "docker" else b.submit(plan, log)
        log(f"job {plan.job_id} detached" + (f" (supervisor pid {handle.supervisor})" if handle.supervisor else "")
            + f"; see it with `invoke jobs`, `invoke logs {plan.job_id} --follow`; stop it with "
              f"`invoke cancel {plan.job_id}`")
        return None
    result = b.run(plan, log=log if spec.debug else quiet(log), timeout=timeout)
    log(result.table())
    draw_report(Path(result.dir), log)
    if not result.ok:
        raise Failed(f"train failed: {result.failure()}")
    return result


# Paddle's launcher logs every poll of its HTTP master (dozens of lines per job: /healthy, /<job>/info...);
# the log files keep them. Other HTTP logging (a user's own) is left alone.
LAUNCHER_POLLING = re.compile(
    r"\[node\d+\] .*HTTP Request: [A-Z]+ http://[\d.:\[\]a-fA-F]+/(healthy|[\w.-]+/info(/\S*)?) \"HTTP/[\d.]+ \d+")


METRICS = re.compile(r"\[node\d+\] FLEETBOX-METRIC ")   # one per step per rank: metrics.jsonl has them


def quiet(log):
    """The live stream without the launcher's polling lines and the metrics lines (`--debug` shows them;
    the log files keep them)."""
    return lambda line: None if LAUNCHER_POLLING.match(line) or METRICS.match(line) else log(line)


# -- detached jobs --

def supervise(plan, log) -> Handle:
    """Start the supervisor of a detached Docker job and return once it has started the job (or say, in one
    line, why it could not)."""
    plan.dir.mkdir(parents=True, exist_ok=True)
    for name in (supervisor.READY, "summary.json"):
        (plan.dir / name).unlink(missing_ok=True)
    part = plan.dir / f".{supervisor.PLAN}.part"
    part.write_bytes(pickle.dumps(plan))
    part.rename(plan.dir / supervisor.PLAN)
    with open(plan.dir / supervisor.LOG, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fleetbox.run.supervisor", str(plan.dir)], cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        while not (plan.dir / supervisor.READY).exists():
            if proc.poll() is not None:
                said = [ln for ln in (plan.dir / supervisor.LOG).read_text(errors="replace").splitlines()
                        if "fleetbox: " in ln]
                why = said[-1].split("fleetbox: ", 1)[1] if said else f"it exited with {proc.returncode}"
                raise Failed(f"the detached job did not start: {why} (log: {plan.dir / supervisor.LOG})")
            time.sleep(0.1)
    except KeyboardInterrupt:   # the supervisor cleans up on SIGTERM, as an attached job does on Ctrl-C
        proc.terminate()
        proc.wait(timeout=60)
        raise
    return Handle.load(plan.dir)


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
        from .slurm_backend import ACTIVE, allocations, job_state
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
        log(f"{r['job']:<36} {r['backend']:<7} {r['nodes']:>5} {r['state']:<9} {r['attempt']:>7} {step:>9}  {r['note']}")
    return rows


def draw_report(job_dir: Path, log=print) -> dict | None:
    """report.md and report.png of a run; a report that cannot be drawn never fails the job."""
    from . import report
    try:
        drawn = report.draw(job_dir)
    except Exception as e:   # a report is a view of the run, not part of it
        log(f"no report: {type(e).__name__}: {e}"[:300])
        return None
    log(f"report: {drawn['md']} ({Path(drawn['png']).name})"
        + (f"; missing: {'; '.join(drawn['missing'])}" if drawn["missing"] else ""))
    return drawn


def report(job_id: str, log=print) -> dict | None:
    """`invoke report JOB`: draw the run's report again, from whatever the job left (failed or cancelled too)."""
    if not JOB_ID.fullmatch(job_id or ""):
        raise UserError(f"{job_id!r} is not a job id")
    job_dir = settings.runs_root() / job_id
    if not job_dir.is_dir():
        raise UserError(f"no job {job_id} in {settings.runs_root()} (see `invoke jobs`)")
    from . import report as report_mod
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
    from .docker_backend import DockerBackend
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
    from .slurm_backend import ACTIVE, SlurmBackend, tail_file
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
    import json
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
