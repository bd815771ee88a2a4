"""The job lifecycle every backend implements (TorchX's Scheduler shape, in our words):

    spec --plan--> Plan --describe--> what --dry-run prints
                   Plan --submit--> Handle --follow / status / logs / cancel--> JobResult

`plan` makes every choice once (job id, port, per-node values); `describe` and `submit` only read the plan,
so a dry-run shows exactly what runs. `run` is submit + follow, with cancel on every way out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import KW_ONLY, dataclass, replace
from pathlib import Path

from fleetbox.errors import LeftRunning, UserError
from fleetbox.options import Option
from fleetbox.processes import never_failing, signals_held, stops_as_interrupt
from fleetbox.run import metrics
from fleetbox.run.jobfolder import Layout
from fleetbox.run.records import DamagedRecord, Handle, JobState, SupervisedHandle
from fleetbox.run.result import JobResult
from fleetbox.run.spec import JobSpec

CANCELLED = "CANCELLED"   # in the job folder: the job was stopped, not failed (a backend may name one per chain)


def mark_cancelled(job_dir: str | Path) -> None:
    """The job was stopped by its user, not failed (CANCELLED); never in the way of the stop itself (a folder that
    cannot be written)."""
    try:
        Path(job_dir, CANCELLED).touch()
    except OSError:
        pass
BACKENDS: dict[str, type[Backend]] = {}   # by name; run/backends registers them


@dataclass(frozen=True)
class Plan:
    """What a backend will do, fully decided. Backends add their own fields."""
    spec: JobSpec
    job_id: str
    dir: Path          # runs/<job-id>/ on this machine
    port: int
    _: KW_ONLY
    notes: tuple[str, ...] = ()   # what the user should know of what it settled for or was given (a line each)
    resume_note: str = ""   # where a stopped job's checkpoints are, where no command can go on from them ("": the
    #                         job's own command, run again, does)
    replaced: tuple[dict, ...] = ()   # nodes' hosts left out so far, a spare in each one's place: {attempt (the
    #                                   first without it), node, host, by (the spare), why, ran (the host ran the
    #                                   attempt before; else it could not start the job)}

    def make_dir(self) -> Path:
        """The job's folder; private to the user (0700) when the job has --env values, which its scripts and
        records hold (a token, a password) and which no one else on a shared login node should read."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.spec.env:
            self.dir.chmod(0o700)
        return self.dir


@dataclass(frozen=True)
class Capabilities:
    """What a backend carries out, and what the rest of fleetbox must know of how it runs a job, as one value:
    fleetbox asks this, never the backend's name. A backend declares its own on the class; where they follow
    its options (Slurm's runtime, Docker's --hosts), its instance holds its own."""
    timeout: bool = False            # `--timeout` stops an attached run; otherwise the backend's own limit does ...
    own_limit: str = ""              # ... set this way (said when --timeout is refused)
    restarts: bool = False           # carries out --max-restarts (else a job asking for restarts is refused)
    fewer_nodes: bool = False        # carries out --min-nodes: a restart without the node that failed
    spares: bool = False             # carries out --spare-nodes: a spare takes the place of the node that failed
    watches_hangs: bool = False      # carries out --hang-timeout / --start-timeout (run/hang.py's Watcher)
    attempts_are: str = "restarts"   # what a job's later attempts are called (a scheduler's chain: allocations)
    names_hosts: bool = False        # a failure names the node's host (a scheduler's node names mean something)
    reads_here: bool = True          # the nodes read this machine's files at their paths (the dataset cache, a
                                     # checkpoint folder): here, or on a file system they share with it


@dataclass(frozen=True)
class Doctoring:
    """What `invoke doctor` must know of how a backend runs a job (the core asks none of it). A backend declares
    its own on the class; where it follows its options (Slurm's runtime), its instance holds its own."""
    runtime: str = ""                # what starts the containers, for doctor's advice ("": the backend's name)
    label: str = ""                  # how doctor names where its probe runs ("": the backend's name)
    runtime_args: tuple[str, ...] = ()   # extra options the user gave the runtime (doctor's probe shows them)
    reports_image: bool = False      # a job with spec.image_identity says which image each node has ...
    unreported_fix: str = ""         # ... and where to look when a node said nothing ("": its output)
    no_driver_fix: str = ""          # what gives the containers the node's NVIDIA driver, where one has none
    shm_settable: bool = True        # --shm-size reaches the container (else the node's /dev/shm counts)
    runs_in_image: bool = True       # the job runs in an image (else in an env on the nodes: doctor checks that
                                     # Paddle imports there)
    unconfined: str = ""             # why the job's devices are not confined to what the scheduler allocated


class Backend(ABC):
    """One way to run a job. A new backend is a subclass registered with run/backends (README: writing a backend);
    nothing outside run/backends/ asks which backend it is: it asks the backend, and its `capabilities`."""
    name = ""
    about = ""                     # a few words for `--backend` in `invoke --help train`
    plan_type: type[Plan] = Plan   # what `plan` returns (a detached job's plan is read back as one)
    handle_type: type[Handle] = SupervisedHandle   # what `submit` returns, with the backend's own fields (handle.json)
    layout = Layout()                    # where its jobs' files are in their folders: fleetbox's default layout
                                         # unless it declares its own (run/jobfolder.py)
    options: tuple[Option, ...] = ()
    foreign: dict[str, str] = {}         # what it says of another backend's option given to it, by name
    capabilities = Capabilities()
    doctoring = Doctoring()

    # -- what a job is on this backend: its own options (Docker's --hosts, --devices) with the job's --

    def settle(self, spec: JobSpec, procs_given: bool) -> tuple[JobSpec, str]:
        """The job's defaults that follow from the backend's own options (from_options asks): the spec, and the
        flag that gave its ranks' count ("": none did). `procs_given`: --procs-per-node was given."""
        return spec, ""

    def check(self, spec: JobSpec) -> None:
        """The backend's refusals of a job, its own options' with the job's, each one line (from_options asks,
        and a study for each of its runs)."""
        ck = spec.checkpoint_dir
        if ck and self.capabilities.reads_here and Path(ck).exists() and not Path(ck).is_dir():
            raise UserError(f"--checkpoint-dir {ck} is not a folder")

    @classmethod
    def sized(cls, options: dict, nodes: int) -> dict:
        """The backend's own options for a run of the job at `nodes` nodes (a study's smaller runs), or a refusal
        where they cannot give one."""
        return options

    @abstractmethod
    def plan(self, spec: JobSpec) -> Plan: ...

    @abstractmethod
    def describe(self, plan: Plan) -> str: ...

    @abstractmethod
    def submit(self, plan: Plan, log=print) -> Handle: ...

    @abstractmethod
    def follow(self, handle: Handle, log=print, timeout: float | None = None) -> JobResult: ...

    @abstractmethod
    def cancel(self, handle: Handle, log=print, asked: bool = True) -> None:
        """Stop the job, every node, logs kept: from this process or any shell (`invoke cancel`). `asked`: the user
        stopped it (Ctrl-C, SIGTERM, a hang-up, `invoke cancel`), so it is marked cancelled (`invoke jobs` says
        CANCELLED, and no restart follows); else an error under the job ended it, and it is only removed."""

    # -- from any shell, through the job's handle.json --

    @abstractmethod
    def job_state(self, handle: Handle) -> tuple[JobState, int, str]:
        """(state, attempt, note): what a submitted job is doing now, as far as this machine can tell."""

    @abstractmethod
    def show_logs(self, handle: Handle, node: int, follow: bool = False, log=print, poll: float = 0.5) -> None:
        """`invoke logs`: a node's output; with `follow`, until the job ends (across restarts and allocations)."""

    def detach(self, plan: Plan, log=print) -> Handle:
        """`--detach`: start the job and return; by default the backend's own scheduler carries it."""
        return self.submit(plan, log)

    def probe_plan(self, plan: Plan, spec: JobSpec) -> Plan:
        """`train --preflight`: a short job of its own (`spec`: doctor's probe, with its own job id and command)
        on what the job's `plan` settled, its port first, before that plan runs. By default `spec` planned again
        at the plan's port; a backend whose planning asks the nodes (Docker's network probe) may reuse what the
        plan settled instead."""
        return self.plan(replace(spec, port=plan.port))

    def engine_facts(self, spec: JobSpec) -> list[dict] | None:
        """For `invoke doctor`, before anything starts: each node's engine and image, where the backend can see
        them from here ({host, version, error, image: (id, content tag) | None}); None where it cannot."""
        return None

    def clean(self, hosts: list[str], job: str = "", force: bool = False, log=print) -> tuple[int, int]:
        """`invoke clean`: remove what earlier jobs of this backend left behind; (removed, kept running)."""
        return 0, 0

    @classmethod
    def leftovers(cls, job_id: str) -> str:
        """How to stop what a job of this backend left running where `invoke clean` cannot, said when the job's
        record cannot be read (so its backend is not known): "" where `invoke clean` does it all."""
        return ""

    def run(self, plan: Plan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """Submit and follow to the end (cancelled on every way out), then gather every rank's metrics lines. A
        backend that restarts a failed job itself says how here (Docker); a scheduler's chain does it in its own
        scripts (Slurm)."""
        if plan.spec.max_restarts and not self.capabilities.restarts:
            raise UserError(f"the {self.name} backend does not restart jobs: drop --max-restarts")
        result = self._run_once(plan, log, timeout, on_submit)
        metrics.collect(plan.dir)
        return result

    def _run_once(self, plan: Plan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """Submit and follow to the end. Ctrl-C, SIGTERM and any error cancel the job before going on up."""
        handle = None
        with stops_as_interrupt():
            try:
                handle = self.submit(plan, log)
                if on_submit is not None:
                    on_submit(handle)
                return self.follow(handle, log, timeout)
            except LeftRunning:   # the job goes on: this command only stopped following it
                raise
            except BaseException as e:
                if handle is not None:
                    log = never_failing(log)   # the terminal may be gone (a closed pipe): clean up all the same
                    asked = isinstance(e, KeyboardInterrupt)   # Ctrl-C, SIGTERM, a hang-up: stopped, not failed
                    log(f"{'interrupted' if asked else 'stopped by an error'}: cancelling {plan.job_id} (another "
                        f"Ctrl-C will not stop the cleanup)")
                    with signals_held():
                        self.cancel(handle, log, asked)
                raise


def job_ended(job_dir: Path, asker: Backend | None = None) -> tuple[bool, str]:
    """Whether the job whose folder this is has ended, as its backend tells from here (`asker` where it is that
    backend, with its engines): (ended, its state in a few words). A job whose record is gone has ended; one
    that cannot be asked has not."""
    try:
        h = Handle.load(job_dir)
    except FileNotFoundError:
        return True, "gone"
    except DamagedRecord:
        return False, "in a state that cannot be told (its handle.json cannot be read)"
    cls = BACKENDS.get(h.backend)
    if cls is None:
        return False, f"run by a backend this fleetbox does not have ({h.backend})"
    try:
        b = asker if asker is not None and asker.name == h.backend else cls(**{o.name: o.default for o in cls.options})
        state, _, note = b.job_state(h)
    except (UserError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return False, f"in a state that cannot be told ({type(e).__name__}: {e})"[:200]
    return state.is_terminal, state.value + (f" ({note})" if note else "")
