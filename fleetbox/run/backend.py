"""The job lifecycle every backend implements (TorchX's Scheduler shape, in our words):

    spec --plan--> Plan --describe--> what --dry-run prints
                   Plan --submit--> Handle --follow / status / logs / cancel--> JobResult

`plan` makes every choice once (job id, port, per-node values); `describe` and `submit` only read the plan,
so a dry-run shows exactly what runs. `run` is submit + follow, with cancel on every way out.
"""

from __future__ import annotations

import json
import re
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleetbox.errors import Failed, UserError
from fleetbox.processes import never_failing, signals_held, sigterm_as_interrupt
from fleetbox.run import metrics
from fleetbox.run.result import JobResult
from fleetbox.run.spec import JobSpec

CANCELLED = "CANCELLED"   # in the job folder: `invoke cancel` asked (Slurm: CANCELLED.<first Slurm job>)


@dataclass(frozen=True)
class Plan:
    """What a backend will do, fully decided. Backends add their own fields."""
    spec: JobSpec
    job_id: str
    dir: Path          # runs/<job-id>/ on this machine
    port: int


@dataclass
class Handle:
    """A submitted job: enough to follow, ask, read and cancel it (also from another process, via job.json)."""
    backend: str
    job_id: str
    dir: str
    nodes: int = 0
    hosts: list[str] = field(default_factory=list)   # Docker: the engines ("" for this machine)
    procs_per_node: int = 1
    scheduler_job: str = ""                           # Slurm: its job id (the first of a chain of allocations)
    supervisor: int = 0                               # pid of the process that follows the job (0: Slurm alone)
    supervisor_start: int = 0                         # ... and its start time (clock ticks): a reused pid is not it
    checkpoints: str = ""                             # the job's checkpoint folder (or --hosts volume)

    def save(self) -> None:
        Path(self.dir, "handle.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, job_dir: Path) -> "Handle":
        return cls(**json.loads(Path(job_dir, "handle.json").read_text()))


class Backend(ABC):
    name = ""

    @abstractmethod
    def plan(self, spec: JobSpec) -> Plan: ...

    @abstractmethod
    def describe(self, plan: Plan) -> str: ...

    @abstractmethod
    def submit(self, plan: Plan, log=print) -> Handle: ...

    @abstractmethod
    def follow(self, handle: Handle, log=print, timeout: float | None = None) -> JobResult: ...

    @abstractmethod
    def status(self, handle: Handle) -> str: ...

    @abstractmethod
    def logs(self, handle: Handle, node: int) -> str: ...

    @abstractmethod
    def cancel(self, handle: Handle, log=print) -> None: ...

    def run(self, plan: Plan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """Submit and follow to the end; after a failure (a node's non-zero exit, a killed container, a lost
        engine), stop every node and start the whole job again from its newest checkpoint, with the same job id,
        up to spec.max_restarts times (torchrun's --max-restarts). Each attempt keeps its own logs: the last in
        the job folder, earlier ones under attempt<N>/."""
        deadline = time.monotonic() + timeout if timeout else None
        restarts, attempts = plan.spec.max_restarts, []
        for attempt in range(restarts + 1):
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                result = self.run_once(self.for_attempt(plan, attempt), log, left, on_submit)
                why = result.reason()
            except Failed as e:   # the engine failed under the job: run_once has cleaned up
                if attempt == restarts:
                    raise
                result, why = None, str(e).removeprefix("train failed: ")
            attempts.append({"attempt": attempt, "ok": bool(result and result.ok), "ended": why,
                             "logs": str(plan.dir)})
            if result is not None and (result.ok or result.timed_out) or attempt == restarts \
                    or (plan.dir / CANCELLED).exists():   # `invoke cancel` (its SIGTERM may have come mid-cleanup)
                break
            attempts[-1]["logs"] = str(self.keep_attempt(plan, attempt))
            log(f"attempt {attempt} failed: {why}; restarting the whole job from its newest checkpoint "
                f"(restart {attempt + 1} of {restarts})")
        if len(attempts) > 1:
            result.attempts = attempts
            result.save()
        metrics.collect(plan.dir)
        return result

    def for_attempt(self, plan: Plan, attempt: int) -> Plan:
        """The plan of a restart (the same job, told which attempt it is)."""
        if attempt:
            raise UserError(f"the {self.name} backend does not restart jobs")
        return plan

    def keep_attempt(self, plan: Plan, attempt: int) -> Path:
        """Move a finished attempt's logs aside (to attempt<N>/), so the next one starts with a clean folder."""
        aside = plan.dir / f"attempt{attempt}"
        if aside.exists():   # left by an earlier run of the same job id
            aside.rename(aside.with_name(f"{aside.name}.before-{time.strftime('%Y%m%d-%H%M%S')}"))
        aside.mkdir()
        for p in sorted(plan.dir.iterdir()):
            if re.fullmatch(r"node\d+(\.log)?|summary\.json", p.name):
                p.rename(aside / p.name)
        return aside

    def run_once(self, plan: Plan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """Submit and follow to the end. Ctrl-C, SIGTERM and any error cancel the job before going on up."""
        handle = None
        with sigterm_as_interrupt():
            try:
                handle = self.submit(plan, log)
                if on_submit is not None:
                    on_submit(handle)
                return self.follow(handle, log, timeout)
            except BaseException as e:
                if handle is not None:
                    log = never_failing(log)   # the terminal may be gone (a closed pipe): clean up all the same
                    why = "interrupted" if isinstance(e, KeyboardInterrupt) else "stopped by an error"
                    log(f"{why}: cancelling {plan.job_id} (another Ctrl-C will not stop the cleanup)")
                    with signals_held():
                        self.cancel(handle, log)
                raise
