"""The backends, by name: the only place that knows which backends exist (`train --backend NAME`).

fleetbox's own backends are registered here; another package registers its own through the entry point group
`fleetbox.backends` (`name = "module:Class"`, as TorchX's `torchx.schedulers`), or in-process with register().
A backend's options are declared on its class (Backend.options) and reach `invoke train`, `doctor` and `scale`
from here.
"""

from __future__ import annotations

from importlib import metadata

from fleetbox.errors import UserError
from fleetbox.run import spec
from fleetbox.run.backend import BACKENDS, Backend, Capabilities, Option
from fleetbox.run.backends.docker import DockerBackend
from fleetbox.run.backends.kubernetes import KubernetesBackend
from fleetbox.run.backends.runtimes import pull_commands  # noqa: F401 (`invoke pull-cmd`: the runtimes' commands)
from fleetbox.run.backends.slurm import SlurmBackend
from fleetbox.run.jobfolder import LAYOUTS, Layout
from fleetbox.run.records import BACKEND_ENTRIES, HANDLE_TYPES, Handle

ENTRY_POINTS = "fleetbox.backends"
DEFAULT = DockerBackend.name   # containers through Docker Engines: this machine or --hosts
UNLOADED: dict[str, str] = {}   # a plugin that could not be registered, and why (said when it is chosen)


def register(cls: type[Backend]) -> type[Backend]:
    """Add a backend; its options may not take a flag another backend (or the job itself) already has."""
    if not (isinstance(cls, type) and issubclass(cls, Backend) and cls.name):
        raise UserError(f"{cls!r} is not a named fleetbox Backend")
    taken = {o.name: b.name for b in BACKENDS.values() if b is not cls for o in b.options}
    for o in cls.options:
        if o.name in taken or o.name in RESERVED:
            raise UserError(f"backend {cls.name}: option {o.flag} is {taken.get(o.name, 'the job')}'s already")
    if not (isinstance(cls.handle_type, type) and issubclass(cls.handle_type, Handle)):
        raise UserError(f"backend {cls.name}: its handle_type is not a fleetbox Handle")
    if not isinstance(cls.layout, Layout):
        raise UserError(f"backend {cls.name}: its layout is not a fleetbox Layout")
    BACKENDS[cls.name] = cls
    HANDLE_TYPES[cls.name] = cls.handle_type
    LAYOUTS[cls.name] = cls.layout
    BACKEND_ENTRIES[cls.name] = cls.layout.entries
    return cls


# the options of every task that runs a job (run/spec.py declares them; `--backend` is BACKEND, below): a
# backend's own options take other names
RESERVED = frozenset(o.name for o in (*spec.JOB_OPTIONS, *spec.TASK_OPTIONS)) | {"backend"}


def _load_entry_points() -> None:
    """Every installed plugin backend. One that cannot be loaded stops no task: it is left out, and choosing it
    says why in one line."""
    for ep in metadata.entry_points(group=ENTRY_POINTS):
        try:
            cls = ep.load()
            if getattr(cls, "name", None) != ep.name:
                raise UserError(f"the class is named {getattr(cls, 'name', None)!r}, not {ep.name!r}")
            register(cls)
        except Exception as e:   # anything a plugin's import can raise
            UNLOADED[ep.name] = f"{ep.value}: {type(e).__name__}: {e}"[:300]


def choices() -> str:
    """The --backend help: every registered backend, the default first."""
    names = [DEFAULT] + [n for n in BACKENDS if n != DEFAULT]
    return " or ".join(f"{n} ({'default: ' if n == DEFAULT else ''}{BACKENDS[n].about})" for n in names)


def lookup(name: str) -> type[Backend]:
    if name in UNLOADED:
        raise UserError(f"backend {name} could not be loaded ({UNLOADED[name]})")
    if name not in BACKENDS:
        raise UserError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def attempts_are(job: dict, summary: dict) -> str:
    """What a job's later attempts are ("restarts", or a scheduler's chain's "allocations"): its summary says,
    else the backend its job.json names."""
    return summary.get("attempts_are") or capabilities(job.get("backend")).attempts_are


def capabilities(name) -> Capabilities:
    """A backend's capabilities as its class declares them; a backend this fleetbox does not have: the defaults."""
    cls = BACKENDS.get(name) if isinstance(name, str) else None
    return cls.capabilities if cls is not None else Capabilities()


def sized(name: str, options: dict, nodes: int) -> dict:
    """The backend's own options for a run of the job at `nodes` nodes (Backend.sized)."""
    return lookup(name).sized(options, nodes)


def get(name: str, **options) -> Backend:
    """The backend, made with its options: those given, the declared defaults for the rest."""
    cls = lookup(name)
    return cls(**{o.name: o.default for o in cls.options} | options)


def all_options(train: bool = True) -> list[tuple[str, Option]]:
    """(backend name, option) of every registered backend, for the front door."""
    return [(b.name, o) for b in BACKENDS.values() for o in b.options if train or not o.train_only]


def configure(name: str, given: dict) -> dict:
    """The chosen backend's options given on the command line (`given`: every backend option, None where not
    given; get() adds the declared defaults): ints parsed and checked; an option of another backend is refused
    in one line."""
    cls = lookup(name)
    foreign = [(owner, o) for owner, o in all_options() if owner != name and given.get(o.name) is not None]
    if len(foreign) == 1 and foreign[0][1].name in cls.foreign:
        (owner, o), = foreign
        raise UserError(f"{o.flag} is for the {owner} backend; {cls.foreign[o.name]}")
    if foreign:
        flags = " and ".join(o.flag for _, o in foreign)
        owners = sorted({owner for owner, _ in foreign})
        raise UserError(f"{flags} {'is' if len(foreign) == 1 else 'are'} for --backend {' or '.join(owners)}")
    return {o.name: o.parse(given[o.name]) for o in cls.options if given.get(o.name) is not None}


def check_timeout(name: str, timeout: float | None) -> None:
    """`--timeout` is an attached run's own limit; a backend with a queue has its own."""
    cls = lookup(name)
    if timeout and not cls.capabilities.timeout:
        able = " or ".join(b.name for b in BACKENDS.values() if b.capabilities.timeout)
        raise UserError(f"--timeout is for the {able} backend; give {name} its own limit "
                        f"({cls.capabilities.own_limit})")


def clean(hosts: list[str], job: str = "", force: bool = False, log=print) -> tuple[int, int]:
    """`invoke clean`: every backend removes what its earlier jobs left behind."""
    removed = kept = 0
    for name in BACKENDS:
        r, k = get(name).clean(hosts, job, force, log)
        removed, kept = removed + r, kept + k
    return removed, kept


register(DockerBackend)
register(SlurmBackend)
register(KubernetesBackend)
_load_entry_points()
BACKEND = Option("backend", choices(), DEFAULT)   # `--backend`: every backend registered by now
