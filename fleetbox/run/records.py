"""What a job folder (runs/<job-id>/) holds about the job, one record type per file, read and written here only:

    handle.json   Handle: enough to follow, ask, read and cancel the job from any shell
    job.json      JobInfo: what ran (image, its id and content tag, the commands), for reports
    plan.json     the plan a detached job's supervisor carries out (save_plan / load_plan)
    summary.json  JobResult (run/result.py): how the job ended, every node's exit, the node to blame
    run-<time>/   an earlier run of the same job id, set aside whole (set_aside)

Every record is written whole or not at all (files.write_atomic). A record missing a field or holding another reads:
missing fields take their defaults, unknown ones are left aside; one that cannot be read is DamagedRecord,
a UserError that says which file and what to do. States a job can be in are one vocabulary, JobState.
"""

from __future__ import annotations

import dataclasses
import fcntl
import getpass
import hashlib
import json
import os
import re
import time
import types
import typing
from contextlib import contextmanager
from dataclasses import KW_ONLY, asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from fleetbox import files, settings
from fleetbox.errors import UserError
from fleetbox.incontainer.fleetbox_checkpoint_folder import OWNER, partial_of  # a checkpoint folder's
from fleetbox.processes import process_start, this_host
from fleetbox.run.result import SUMMARY

HANDLE, JOB, PLAN = "handle.json", "job.json", "plan.json"
SUPERVISOR_READY, SUPERVISOR_LOG = "supervisor.ready", "supervisor.log"   # a detached job's supervisor


class JobState(StrEnum):
    """A job's state as `invoke jobs` shows it (TorchX's AppState, Ray's JobStatus, in our words)."""
    PENDING = "PENDING"       # queued (Slurm)
    STARTING = "STARTING"     # its supervisor runs, its containers are not all up yet
    RUNNING = "RUNNING"
    SUSPENDED = "SUSPENDED"   # Slurm suspended or stopped it
    HELD = "HELD"             # Slurm holds it (requeued on hold, special exit): it waits for a release
    ORPHANED = "ORPHANED"     # containers run, but nothing follows them (the supervisor died)
    PASSED = "PASSED"
    FAILED = "FAILED"
    HUNG = "HUNG"             # stopped by hang detection (run/hang.py): no progress within its deadline
    CANCELLED = "CANCELLED"
    DIED = "DIED"             # its supervisor ended without a result
    UNKNOWN = "?"             # the scheduler no longer knows it, or it cannot be asked
    DAMAGED = "DAMAGED"       # its handle.json cannot be read

    @property
    def is_terminal(self) -> bool:
        """Nothing more will happen to the job by itself."""
        return self in (JobState.PASSED, JobState.FAILED, JobState.HUNG, JobState.CANCELLED, JobState.DIED)


class DamagedRecord(UserError):
    """A record in a job folder that cannot be read (truncated, not JSON, not the record's shape)."""


def _load(cls, path: Path, required: tuple[str, ...], pick=None):
    """A record of type `cls` (or `pick(data)`'s, where given) from `path`, tolerant of an older or newer
    fleetbox's fields."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except ValueError:
        raise DamagedRecord(f"{path} is damaged: not JSON (truncated?)") from None
    except OSError as e:   # another user's folder on a shared runs folder, say
        raise DamagedRecord(f"{path} cannot be read: {e.strerror}") from None
    if not isinstance(data, dict) or any(k not in data for k in required):
        raise DamagedRecord(f"{path} is damaged: not a {cls.__name__} record (needs {', '.join(required)})")
    cls = pick(data) if pick else cls
    known = {f.name for f in dataclasses.fields(cls)}
    try:
        return from_record(cls, {k: v for k, v in data.items() if k in known})
    except (TypeError, ValueError) as e:
        raise DamagedRecord(f"{path} is damaged: {e}") from None


HANDLE_TYPES: dict[str, type[Handle]] = {}   # a backend's own handle type, by backend name (run/backends registers)


@dataclass
class Handle:
    """A submitted job: enough to follow, ask, read and cancel it (also from another process). What every
    backend's job has; a backend adds its own fields in a subclass (its `handle_type`), saved in the same flat
    handle.json. `Handle(backend, ...)` and `Handle.load` give the registered backend's own type; a handle of a
    backend this fleetbox does not have reads as this base, its own fields left aside."""
    backend: str
    job_id: str
    dir: str
    nodes: int = 0
    _: KW_ONLY
    procs_per_node: int = 1
    checkpoints: str = ""                             # the job's checkpoint folder (or, Docker --hosts, volume)
    owner: str = ""                                   # its containers' owner label (owner()); "": older fleetbox

    def __new__(cls, *args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else "")
        own = HANDLE_TYPES.get(backend) if cls is Handle and isinstance(backend, str) else None
        return super().__new__(own or cls)

    def save(self) -> None:
        files.write_json(Path(self.dir, HANDLE), asdict(self))

    def checkpoints_here(self) -> str:
        """The job's checkpoint folder where this machine can read it, else "" (a volume, a remote host's)."""
        return self.checkpoints if self.checkpoints.startswith("/") else ""

    def follower(self) -> str:
        """What follows the job for its backend, in a few words ("" where its scheduler does)."""
        return ""

    @classmethod
    def load(cls, job_dir: Path) -> Handle:
        """Raises FileNotFoundError when there is none, DamagedRecord when it cannot be read."""
        def own(data: dict) -> type[Handle]:
            b = data["backend"]
            return HANDLE_TYPES.get(b, cls) if cls is Handle and isinstance(b, str) else cls
        return _load(cls, Path(job_dir, HANDLE), ("backend", "job_id", "dir"), own)


@dataclass
class SupervisedHandle(Handle):
    """A job that a fleetbox process follows (an attached `invoke train`, or a detached job's supervisor,
    run/supervisor.py), not a scheduler: `invoke jobs` and `invoke cancel` ask that process."""
    _: KW_ONLY
    supervisor: int = 0                               # pid of the process that follows the job
    supervisor_start: int = 0                         # ... and its start time (clock ticks): a reused pid is not it
    supervisor_host: str = ""                         # ... and the machine it runs on ("": before it was recorded)

    def followed(self) -> bool:
        """The process that follows the job runs: the same pid and the same start time (a reused pid is another
        process), on this machine (see elsewhere())."""
        return self.supervisor > 0 and self.supervisor_start > 0 and not self.elsewhere() and \
            process_start(self.supervisor) == self.supervisor_start

    def elsewhere(self) -> str:
        """The machine the job's supervisor runs on when it is not this one (another login node sharing the runs
        folder), else "": from here its pid cannot be asked, and its engine may not be this machine's."""
        return self.supervisor_host if self.supervisor_host and self.supervisor_host != this_host() else ""

    def follower(self) -> str:
        return f"supervisor pid {self.supervisor}" if self.supervisor else ""


@dataclass
class JobInfo:
    """What a job ran, as its backend knew it at submit (job.json); the report reads it. A field the backend
    cannot know keeps its default."""
    job_id: str
    backend: str
    variant: str
    nodes: int
    procs_per_node: int
    image: str                       # the reference the nodes were given
    runtime: str = ""                # what started the containers, where the backend has several to choose from
    image_id: str = ""               # node 0's image ID, where it can be asked at submit ...
    content_tag: str = ""            # ... and our content tag, when it is one of our images
    paddle: str = ""                 # the image's Paddle version, where it says (our images' label, or the pin)
    started: float = 0.0             # when this attempt was started (time.time()); 0: its layout says (Layout.starts)
    first_started: float = 0.0       # ... and the first attempt's (a report's time runs from it)
    commands: list[str] = field(default_factory=list)   # each node's command, where each node has one of its own

    def save(self, job_dir: Path) -> None:
        files.write_json(Path(job_dir, JOB), asdict(self))


# -- plans as records (a detached job's supervisor gets its plan as JSON, not as a pickle) --

def to_record(value):
    """A dataclass (nested ones, tuples, Paths included) as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_record(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_record(v) for v in value]
    if isinstance(value, dict):
        return {k: to_record(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def from_record(cls, data: dict):
    """The dataclass `cls` from `to_record`'s output, each field converted back by its type."""
    if not isinstance(data, dict):
        raise TypeError(f"{type(data).__name__} where {cls.__name__} belongs")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: _convert(hints[k], v) for k, v in data.items() if k in fields})


def _convert(hint, value):
    """`value` as `hint` says; a value of the wrong kind (a null where none belongs, a list for a dict) is
    TypeError: damage, found here, not deep in a run."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return value
    if value is None:
        raise TypeError(f"null where {getattr(hint, '__name__', hint)} belongs")
    if dataclasses.is_dataclass(hint):
        return from_record(hint, value)
    if origin in (tuple, list) or hint in (tuple, list):
        if not isinstance(value, list):
            raise TypeError(f"{type(value).__name__} where a list belongs")
        item = args[0] if args else typing.Any
        return (tuple if tuple in (origin, hint) else list)(_convert(item, v) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{type(value).__name__} where a dict belongs")
        return value
    if hint is Path:
        return Path(value)
    if hint in (str, int, float, bool):   # a field of the wrong kind is damage, found here, not deep in a run
        kinds = (int, float) if hint is float else (hint,)
        if not isinstance(value, kinds) or (hint is not bool and isinstance(value, bool)):
            raise TypeError(f"{type(value).__name__} where {hint.__name__} belongs")
    return value


def save_plan(job_dir: Path, backend: str, plan) -> None:
    files.write_json(Path(job_dir, PLAN), {"backend": backend, "plan": to_record(plan)})


def load_plan(job_dir: Path, plan_type_of) -> tuple[str, object]:
    """(backend name, plan) from plan.json; `plan_type_of(name)` gives the backend's plan class."""
    path = Path(job_dir, PLAN)
    try:
        data = json.loads(path.read_text())
        return data["backend"], from_record(plan_type_of(data["backend"]), data["plan"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedRecord(f"{path} cannot be read ({type(e).__name__}: {e})") from None


EARLIER_RUN = re.compile(r"run-\d{8}-\d{6}(-\d+)?")
_ASIDE = ".run-aside.partial"   # an earlier run on its way to run-<time>/ (an interrupted move goes on from it)
STARTING = ".starting.lock"     # held by the fleetbox that starts (and, attached, runs) a job of this id


@contextmanager
def starting(job_dir: Path):
    """One start of a job id at a time, from its refusal of a live job until the job is followed: a second
    `invoke train --job-id` of the same id meanwhile gets one line (flock; on every way out it is let go)."""
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(job_dir / STARTING, os.O_RDWR | os.O_CREAT, 0o644)   # for writing: NFS's flock needs it
    except OSError as e:
        raise UserError(f"cannot start job {job_dir.name} in {job_dir}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"job {job_dir.name} is being started or run by another fleetbox; wait for it, "
                            f"`invoke cancel {job_dir.name}`, or give another --job-id") from None
        except OSError as e:
            raise UserError(f"cannot lock {job_dir / STARTING}: {e.strerror or e}") from None
        yield
    finally:
        try:   # nothing started (a refusal, a failed preflight): no folder is left for a job that never was
            if [e.name for e in job_dir.iterdir()] == [STARTING]:
                (job_dir / STARTING).unlink()
                job_dir.rmdir()
        except OSError:
            pass
        os.close(fd)


def set_aside(job_dir: Path, keep: list[Path] = ()) -> Path | None:
    """A job id run again, after its earlier run ended: everything that run left in the job folder (records,
    logs, metrics, reports, attempts) goes whole to run-<when its handle was written>/ before this run writes
    anything, so the folder's top, which the report, `invoke logs` and `invoke jobs` read, holds this run only.
    What stays: the paths in `keep` (the checkpoint folder, a --resume folder, mounts) and what holds them,
    any checkpoint folder (one with an OWNER: its job may be another, and live), and earlier run-*/.
    Returns the folder the earlier run went to, or None when there was none."""
    job_dir = Path(job_dir)
    keep = [Path(k).resolve() for k in keep]
    partial = job_dir / _ASIDE

    def stays(e: Path) -> bool:   # (a checkpoint folder's aside cut short is finished there by the next take)
        r = e.resolve()
        return e.name in (_ASIDE, STARTING) or bool(EARLIER_RUN.fullmatch(e.name)) or (e / OWNER).exists() \
            or any(r == k or r in k.parents or partial_of(k.name).fullmatch(e.name) for k in keep)
    entries = [e for e in (job_dir.iterdir() if job_dir.is_dir() else ()) if not stays(e)]
    if not entries and not partial.exists():
        return None
    handle = job_dir / HANDLE
    started = handle.stat().st_mtime if handle.exists() else time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    final, n = job_dir / f"run-{stamp}", 1
    while final.exists():   # two runs in one second
        n += 1
        final = job_dir / f"run-{stamp}-{n}"
    try:
        partial.mkdir(exist_ok=True)
        for e in entries:
            os.rename(e, partial / e.name)
        os.rename(partial, final)   # complete or not there: a reader never sees half a run under its final name
    except OSError as e:
        raise UserError(f"cannot set the earlier run of {job_dir.name} aside in {job_dir}: {e.strerror or e}; "
                        f"give another --job-id") from None
    return final


def owner() -> str:
    """Whose a job's containers are, as their LABEL_OWNER says: `user@<12 hex digits of the runs folder's path's
    sha256>`, the same wherever that folder has that path. On an engine several users share, sweeps, cancels
    and cleans match it: another user's job of the same id, or this user's from another runs folder, is not
    touched. Pure: planning writes nothing."""
    digest = hashlib.sha256(str(settings.runs_root().resolve()).encode()).hexdigest()[:12]
    return f"{getpass.getuser()}@{digest}"


def refuse_taken(job_id: str, where: str, held: list[tuple[str, str]], mine: str) -> None:
    """A job id whose objects (`held`: each one's name and LABEL_OWNER, "" where it has none) another owner holds
    is theirs, wherever they are (an engine, a namespace, a Podman): one line naming theirs, before anything of
    this run is made or removed."""
    theirs: dict[str, list[str]] = {}
    for what, who in held:
        if who != mine:
            theirs.setdefault(who, []).append(what)
    if theirs:
        who, objs = next(iter(theirs.items()))
        whose = f"{who}'s (another user, or another runs folder)" if who else "no fleetbox job's (no owner label)"
        raise UserError(f"job id {job_id} is taken {where}: {', '.join(objs[:4])}{' ...' if len(objs) > 4 else ''} "
                        f"{'is' if len(objs) == 1 else 'are'} {whose}; nothing of theirs was touched: give another "
                        f"--job-id")


# What a job's folder may hold, for the docs' page (commands/docs.py makes it from job_folder()); tests hold real
# jobs' folders to it, so a file a job starts to leave gets its line here, or in its backend's layout. <k>: a
# node's rank, <N>: a number, <time>: YYYYmmdd-HHMMSS.
JOB_FOLDER = {
    HANDLE: "how to follow, ask and cancel the job from any shell (backend, nodes, hosts, Slurm job, supervisor)",
    JOB: "what ran: the image, its id and content tag, Paddle's version, each node's command",
    SUMMARY: "how the job ended: every node's exit, the node to blame, the smoke report, every attempt",
    PLAN: "a detached Docker job's plan, as its supervisor carries it out",
    SUPERVISOR_READY: "a detached Docker job's supervisor has started the job",
    SUPERVISOR_LOG: "a detached Docker job's supervisor's own output",
    "metrics.jsonl": "every rank's metrics lines, every attempt's, each with its node and attempt",
    "report.md": "the run's report: nodes, image, throughput, time to first step, what failed",
    "report.png": "the run's plot: loss, samples/s, each rank's step time; restarts marked",
    "node<k>": "node k's logs: the launcher's workerlog.<rank>, the container's output (container.log), "
               "each rank's progress and the metrics found in its training (found-metrics-rank<r>.log) and, after "
               "a hang, its stacks; the script's own VisualDL logs (visualdl/rank<r>/<logdir>)",
    "hang-<N>": "a hang in attempt N: every rank's stacks and the verdict",
    "checkpoints": "the job's checkpoint folder, where no --checkpoint-dir is given",
    "checkpoints.before-<time>": "checkpoints `--resume never` set aside",
    "run-<time>": "an earlier run of the same job id, set aside whole when the id ran again",
    "CANCELLED": "stopped by `invoke cancel`, Ctrl-C, SIGTERM or a hang-up",
    "doctor.json": "`invoke doctor`'s report, in its probe job's folder",
    STARTING: "held while a job of this id starts (and, attached, runs)",
    _ASIDE: "an earlier run on its way to run-<time>/ (a move that was cut short)",
}
_PLACES = {"<k>": r"\d+", "<N>": r"\d+", "<time>": r"\d{8}-\d{6}(-\d+)?"}


BACKEND_ENTRIES: dict[str, dict[str, str]] = {}   # what else each backend leaves (its Layout's), by backend name


def job_folder() -> dict[str, str]:
    """Everything a job's folder may hold: what every job's has, then each registered backend's own."""
    out = dict(JOB_FOLDER)
    for entries in BACKEND_ENTRIES.values():
        out.update(entries)
    return out


def undescribed(job_dir: Path) -> list[str]:
    """What is in a job's folder that job_folder() does not describe."""
    patterns = []
    for name in job_folder():
        pattern = re.escape(name)
        for place, rx in _PLACES.items():
            pattern = pattern.replace(re.escape(place), rx)
        patterns.append(re.compile(pattern))
    return sorted(e.name for e in Path(job_dir).iterdir() if not any(p.fullmatch(e.name) for p in patterns))
