"""`invoke train` and `invoke up`'s training step: choose the backend, plan once, then describe that plan
(--dry-run), run it, or leave it running (--detach), and report one JobResult."""

from __future__ import annotations

import shlex
from pathlib import Path

from fleetbox import settings
from fleetbox.commands import doctor, jobs
from fleetbox.errors import Failed, UserError
from fleetbox.processes import never_failing, stops_as_interrupt
from fleetbox.run import backends, checkpoints, hang, records, report
from fleetbox.run.backend import Plan
from fleetbox.run.output import quiet
from fleetbox.run.records import DamagedRecord, Handle, JobState
from fleetbox.run.result import JobResult
from fleetbox.run.spec import OPTIONS, JobSpec


def train(spec: JobSpec, backend: str = "docker", backend_options: dict | None = None, dry_run: bool = False,
          timeout: float | None = None, detach: bool = False, log=print, preflight: bool = False,
          command: str = "") -> JobResult | None:
    backends.check_timeout(backend, timeout)
    if timeout and detach:
        raise UserError("--timeout needs an attached job; a detached one ends with `invoke cancel`")
    b = backends.get(backend, **(backend_options or {}))
    asked = (spec.hang_timeout, spec.start_timeout) != (JobSpec.hang_timeout, JobSpec.start_timeout)
    if asked and not b.capabilities.watches_hangs:
        log(f"warning: the {b.name} backend does not detect hangs yet: --hang-timeout and --start-timeout have no "
            f"effect")
    if spec.job_id and not dry_run:   # a given id: one start at a time, and a run again starts clean
        job_dir = settings.runs_root() / spec.job_id
        with records.starting(job_dir):
            refuse_live(spec.job_id)
            ckpt = checkpoints.folder(spec.checkpoint_dir, job_dir).resolve()
            if ckpt == job_dir.resolve() or ckpt in job_dir.resolve().parents:
                raise UserError(f"--checkpoint-dir {spec.checkpoint_dir} holds the job's own folder {job_dir}: "
                                f"give the checkpoints a folder of their own")
            used = [ckpt] + [Path(p) for p in (spec.data_dir, *(m.src for m in spec.mounts)) if p and p[0] != "{"] \
                + ([Path(spec.resume)] if spec.resume not in ("auto", "never") else [])
            earlier = records.set_aside(job_dir, used)
            if earlier:
                log(f"job {spec.job_id} ran before: its earlier run is now in {earlier}")
            return _start(spec, b, dry_run, timeout, detach, log, preflight, command)
    return _start(spec, b, dry_run, timeout, detach, log, preflight, command)


def _start(spec: JobSpec, b, dry_run: bool, timeout: float | None, detach: bool, log, preflight: bool,
           command: str) -> JobResult | None:
    """Plan once, then describe that plan, run it, or leave it running."""
    if preflight and spec.spare_nodes:
        raise UserError("--preflight checks the nodes as --hosts names them; with --spare-nodes the job picks its "
                        "nodes as it starts (a host that fails its check gives its place to a spare): drop one")
    if preflight and not dry_run:   # the job's own plan (nodes, containers, ports) checked, then run as checked
        log(f"preflight: checking {spec.nodes} node(s) before starting the job")
        checked, plan = doctor.preflight(b, spec, log=log)
        if not checked["ok"]:
            bad = sum(not r["ok"] for r in checked["rows"])
            raise Failed(f"preflight: {bad} check(s) failed; the job was not started (report: {checked['path']})")
    else:
        with stops_as_interrupt():   # planning starts probe containers on --hosts engines
            plan = b.plan(spec)
    if dry_run and b.capabilities.watches_hangs:   # first: what follows is the backend's files, each to its end
        log("# " + hang.describe_deadlines(spec.hang_timeout, spec.start_timeout, spec.device, spec.env))
    for note in plan.notes:   # what it settled for, or was given, that the user should know: before it runs
        log(note)
    if dry_run:
        log(b.describe(plan))
        return None
    if detach:
        handle = b.detach(plan, log)
        log(f"job {plan.job_id} detached" + (f" ({handle.follower()})" if handle.follower() else "")
            + f"; see it with `invoke jobs`, `invoke logs {plan.job_id} --follow`; stop it with "
              f"`invoke cancel {plan.job_id}`")
        return None
    try:
        result = b.run(plan, log=log if spec.debug else quiet(log), timeout=timeout)
    except (KeyboardInterrupt, Failed):   # stopped, or the engine failed under it
        say_how_to_resume(plan, command, never_failing(log))
        raise
    log(result.table())
    draw_report(Path(result.dir), log)
    if not result.ok:
        say_how_to_resume(plan, command, log)
        raise Failed(f"train failed: {result.failure()}")
    return result


def say_how_to_resume(plan: Plan, command: str, log) -> None:
    """The one command that goes on from the job's newest checkpoint. Where that cannot be said in a command
    (Docker's --hosts volumes made fresh for --resume never), where its checkpoints are (its plan says)."""
    if command:
        log(plan.resume_note or f"to go on from its newest checkpoint: {resume_command(command, plan.job_id)}")


def resume_command(command: str, job_id: str) -> str:
    """The train command as given, with the job's id, without --dry-run, --detach or --resume never (a --resume
    PATH stays: the job's own checkpoints, once it has some, come first): run again, it goes on from the job's
    newest checkpoint."""
    given_id, resume = OPTIONS["job_id"].flag, OPTIONS["resume"].flag
    once = (OPTIONS["dry_run"].flag, OPTIONS["detach"].flag)
    words, out, i = shlex.split(command), [], 0
    while i < len(words):
        w = words[i]
        if w == "--":
            out += words[i:]
            break
        value = words[i + 1] if w in (given_id, resume) and i + 1 < len(words) else w.partition("=")[2]
        if w in (given_id, resume) or w.startswith((given_id + "=", resume + "=")):
            if w.startswith(resume) and value not in ("never", "auto"):
                out += [w] if "=" in w else [w, value]
            i += 1 if "=" in w else 2
            continue
        if w not in once:
            out.append(w)
        i += 1
    at = out.index("train") + 1 if "train" in out else len(out)
    return shlex.join(out[:at] + [given_id, job_id] + out[at:])


def refuse_live(job_id: str) -> None:
    """One job id, one live job: a job id whose job has not ended (running, pending, a Slurm chain between its
    allocations, containers its dead supervisor left) is refused, on every backend and from any machine that
    shares the runs folder; its record would be overwritten and its checkpoints moved under it."""
    try:
        h = Handle.load(settings.runs_root() / job_id)
    except FileNotFoundError:
        return
    except DamagedRecord as e:
        raise UserError(f"job {job_id} has a record that cannot be read ({e}); give another --job-id") from None
    row = jobs.describe(h)
    if not row["state"].is_terminal:
        state = "in a state that cannot be told" if row["state"] == JobState.UNKNOWN else row["state"].value
        raise UserError(f"job {job_id} is {state} ({h.backend}{'; ' + row['note'] if row['note'] else ''}): "
                        f"wait for it, `invoke cancel {job_id}`, or give another --job-id")


def draw_report(job_dir: Path, log=print) -> dict | None:
    """report.md and report.png of a run; a report that cannot be drawn never fails the job."""
    try:
        drawn = report.draw(job_dir)
    except Exception as e:   # a report is a view of the run, not part of it
        log(f"no report: {type(e).__name__}: {e}"[:300])
        return None
    log(f"report: {drawn['md']} ({Path(drawn['png']).name})"
        + (f"; missing: {'; '.join(drawn['missing'])}" if drawn["missing"] else ""))
    return drawn
