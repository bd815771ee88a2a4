"""A training job as data: what to run, on how many nodes, with which image, environment and mounts.
Pure: building and validating a spec reads no network, engine or host facts."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import time
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.image.matrix import Variant
from fleetbox.options import Option
from fleetbox.run import hang, placeholders, styles

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")   # a container name, a label, a folder, a Slurm job name


@dataclass(frozen=True)
class Mount:
    src: str
    dst: str
    ro: bool = True


@dataclass(frozen=True)
class JobSpec:
    variant: Variant
    nodes: int = 2
    procs_per_node: int = 1
    script: str = str(settings.DEFAULT_SCRIPT)
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    pass_env: tuple[str, ...] = ()       # variables passed by name from the caller's environment (secrets): never
                                         # printed or stored, read where a container is made
    mounts: tuple[Mount, ...] = ()       # extra bind mounts
    image: str = ""                      # default: the variant's alias (fleetbox/paddle:<variant>)
    iface: str = ""                      # NIC for NCCL/Gloo; default: the one that routes to the master
    ib_hca: str = ""                     # e.g. mlx5_0: InfiniBand on
    debug: bool = False
    gpus_per_node: int = 0
    on_cpu: bool = False                 # a GPU variant's image given no device (--gpus-per-node 0): its ranks run
                                         # on CPU, collectives on Gloo (a GPU build tested on a machine without one)
    port: int = 0                        # master port; 0: the plan picks one
    shm_size: str = "8g"                 # NCCL needs more than Docker's 64 MB default ("NCCL error 2")
    data_dir: str = ""                   # seeded dataset cache, mounted read-only at Paddle's cache path
    job_id: str = ""                     # "": the plan makes one
    checkpoint_dir: str = ""             # the folder (on a file system the nodes share, where they are elsewhere);
                                         # "": runs/<job>/checkpoints, or what the backend keeps them in
    resume: str = "auto"                 # auto | never | a checkpoint (step folder or checkpoint folder) to start from
    max_restarts: int = 0                # start the job again after a failure, this many times (as the backend
                                         # does it: at once, or in a new allocation)
    min_nodes: int = 0                   # a restart goes on without the failed node while this many are left (0:
                                         # never; each such restart is one of max_restarts)
    spare_nodes: int = 0                 # nodes kept in reserve: one takes the place of a node that fails, hangs or
                                         # fails its check at start, for the rest of the job
    hang_timeout: float = hang.HANG_TIMEOUT_S    # seconds without progress before the job counts as hung (0: off)
    start_timeout: float = hang.START_TIMEOUT_S  # seconds from the start to the first progress (0: off)
    command: tuple[str, ...] = ()        # the containers' command instead of Paddle's launcher (invoke doctor)
    image_identity: bool = False         # each node first says which image it has (invoke doctor; a backend that
                                         # reports_image)
    spawns: bool = False                 # the script starts its own ranks (paddle.distributed.spawn): run without
                                         # Paddle's launcher, on one node (run/styles.py tells, not an option)

    @property
    def may_shrink(self) -> bool:
        """--min-nodes lets a restart go on with one node fewer than this spec has."""
        return 0 < self.min_nodes < self.nodes

    @property
    def image_ref(self) -> str:
        return self.image or self.variant.aliases[0]

    @property
    def paddle_pin(self) -> str:
        """The variant's Paddle version when the job runs the variant's own image; "" for any other image."""
        return self.variant.paddle_version if self.image in ("", *self.variant.aliases) else ""

    @property
    def device(self) -> str:
        """What the ranks run on: the variant's device, or cpu."""
        return "cpu" if self.on_cpu else self.variant.device

    @property
    def gpus_each(self) -> int:
        """Accelerators each node gets: one per process (--gpus-per-node, where given, says the same)."""
        return self.gpus_per_node or self.procs_per_node

    @property
    def script_path(self) -> Path:
        return Path(self.script).resolve()


def new_job_id(kind: str = "train") -> str:
    """A fresh id for a job or study: <kind>-<time>-<4 hex digits>."""
    return f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def parse_mount(text: str) -> Mount:
    src, sep, rest = text.partition(":")
    dst, _, mode = rest.partition(":")
    if not sep or not src or not dst:
        raise UserError(f"--mount {text!r} must be SRC:DST[:ro|rw]")
    if mode not in ("", "ro", "rw"):
        raise UserError(f"--mount {text!r}: the mode must be ro or rw (got {mode!r})")
    return Mount(src, dst, ro=mode == "ro")


def _variant_help() -> str:
    """The matrix's variants, as its file names them (a broken file is said where a task reads it)."""
    try:
        m = matrix.load()
    except UserError:
        return "matrix variant (images/matrix.toml)"
    return "matrix variant (images/matrix.toml): " + ", ".join(
        name + (" (default)" if name == m.default else "") for name in m.variants)


# What the job is: JobSpec's options, each declared once, in the order `invoke train` lists them (its reference
# page does; --help sorts them itself). from_options reads them; tasks.py makes the tasks' options and help from
# them (a task may word one its own way); no backend's option may take their names.
JOB_OPTIONS: tuple[Option, ...] = (
    Option("nodes", "number of nodes: one container each (default 2)", kind=int, low=1),
    Option("procs_per_node", "training processes per node (default 1)", kind=int, low=1),
    Option("script", "training script (default train/smoke.py); its folder is the workspace"),
    Option("args", "arguments for the script, as one string (e.g. \"--epochs 2\"); or give them after --, word for "
                   "word (invoke train --nodes 2 -- --debug --epochs 2), also those that look like fleetbox's own"),
    Option("image", "image to run (default fleetbox/paddle:<variant>)"),
    Option("iface", "network interface for NCCL/Gloo (default: the one that routes to the master)"),
    Option("ib_hca", "InfiniBand HCA, e.g. mlx5_0 (sets NCCL_IB_HCA and NCCL_IB_DISABLE=0)"),
    Option("debug", "NCCL_DEBUG=INFO, and the launcher's HTTP polling lines in the live output", False, bool),
    Option("gpus_per_node", "GPUs per node (CUDA variants); 0: a GPU image's ranks run on CPU, collectives on Gloo",
           kind=int, low=0),
    Option("port", "master port (default: a free one here, a random one for Slurm)", kind=int, low=1024, high=65535),
    Option("env", "extra environment, comma-separated KEY=VALUE pairs", kind=dict),
    Option("pass_env", "variables passed by name from your environment, e.g. HF_TOKEN,WANDB_API_KEY: for secrets, "
                       "their values are never printed (--dry-run) or written to the job's folder", kind=tuple),
    Option("mount", "extra bind mounts, comma-separated SRC:DST[:ro]", kind=tuple, item=parse_mount),
    Option("data_dir", "seeded dataset cache to mount read-only at Paddle's cache path (default "
                       "offline_cache/dataset)"),
    Option("shm_size", "shared memory per container (default 8g; NCCL needs more than Docker's 64m)"),
    Option("job_id", "the job's id (default: train-<time>-<random>); with --port, a dry-run can be replayed exactly; "
                     "the same id again resumes that job from its newest checkpoint"),
    Option("checkpoint_dir", "the job's checkpoint folder, FLEETBOX_CHECKPOINT_DIR in the containers (default "
                             "runs/<job>/checkpoints; Slurm and a shared --hosts folder: on the shared file system)"),
    Option("resume", "auto (default: from the newest complete checkpoint), never, or a checkpoint folder to start "
                     "from"),
    Option("max_restarts", "after a node fails, start the whole job again from its newest checkpoint, up to N times "
                           "(default 0; docker: at once, slurm: in a new allocation, or in the same one on a spare "
                           "or fewer nodes)", kind=int, low=0),
    Option("min_nodes", "a restart goes on without the node that failed (or hung), from the newest checkpoint, while "
                        "at least M nodes are left (default: every node, always; docker, kubernetes, slurm)", kind=int,
           low=1),
    Option("spare_nodes", "nodes kept in reserve: one takes the place of a node that fails, hangs or fails its check "
                          "at start, and the job goes on from the newest checkpoint on as many nodes (docker: the "
                          "--hosts after the first N; slurm: K more nodes in the allocation; default 0)", kind=int,
           low=0),
    Option("hang_timeout", "a rank that makes no progress for this long is hung: every rank's stacks are kept, the "
                           "job stopped (and restarted with --max-restarts); 90, 90s, 20m, 1h; 0: off (default 10m)",
           kind=float),
    Option("start_timeout", "from the start to a rank's first progress, at most this long (default 15m; 0: off)",
           kind=float),
)

# How the tasks that run a job run it, beside what it is (the variant is JobSpec's too, but a task resolves its
# name): tasks.py reads them; no backend's option may take their names either (`--backend` is the registry's).
TASK_OPTIONS: tuple[Option, ...] = (
    Option("variant", _variant_help()),
    Option("timeout", "docker backend: stop the job after this long: 90, 90s, 20m, 1h (default: none; Slurm: "
                      "--time)"),
    Option("dry_run", "print the exact docker run command of every node (slurm: the sbatch script); start no job "
                      "(with --hosts, a throwaway probe container runs on each host to find its network)",
           False, bool),
    Option("detach", "start the job and return its id at once; it goes on without this terminal (docker: a "
                     "supervisor process; slurm: the queue): see `invoke jobs`, `invoke logs`, `invoke cancel`",
           False, bool),
    Option("preflight", "run `invoke doctor --quick` on the job's own nodes, containers and ports first, and start "
                        "nothing if a check fails", False, bool),
    Option("quick", "everything but the all-reduce sweep and the TCP throughput (what train --preflight runs)",
           False, bool),
    Option("wait", "how long each node waits for the others: 90, 90s, 2m (default 30s)"),
    Option("json_out", "also write the JSON report to this path"),
)

OPTIONS = {o.name: o for o in (*JOB_OPTIONS, *TASK_OPTIONS)}
FIELDS = {"mount": "mounts"}   # the JobSpec field an option sets, where it is named otherwise
# read by from_options itself: their defaults depend on the script, the hosts or what else is given
READ_HERE = ("nodes", "procs_per_node", "args", "data_dir")


def _default(name: str):
    """What JobSpec holds where the option is not given."""
    f = next(f for f in fields(JobSpec) if f.name == FIELDS.get(name, name))
    return f.default_factory() if f.default is MISSING else f.default


def from_options(variant: Variant, backend=None, **given) -> JobSpec:
    """A validated JobSpec from command-line strings, each by its option's name (JOB_OPTIONS; None: not given).
    `backend`: the Backend that will run it, made with its own options, where one is chosen: whether its nodes
    read this machine's files (`reads_here`), the defaults its options settle (`settle`) and its refusals
    (`check`)."""
    unknown = sorted(set(given) - {o.name for o in JOB_OPTIONS})
    if unknown:
        raise TypeError(f"from_options: no job option {', '.join(unknown)}")
    nodes, procs_per_node, args, data_dir, gpus_per_node = (
        given.get(name) for name in (*READ_HERE, "gpus_per_node"))
    if data_dir is None:   # the default cache is used when it exists here and the nodes can read it
        default = settings.data_dir()
        data_dir = str(default) if default.is_dir() and (backend is None or backend.capabilities.reads_here) else ""
    elif data_dir and not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir} is not a folder")
    try:
        argv = tuple(shlex.split(args or ""))
    except ValueError as e:
        raise UserError(f"--args cannot be split into words: {e}") from None
    script = OPTIONS["script"].read(given.get("script"), _default("script"))
    style = styles.of_script(Path(script).resolve())   # before the GPUs are split
    here = {"nodes": OPTIONS["nodes"].parse((1 if style.spawns else 2) if nodes is None else nodes),
            "procs_per_node": OPTIONS["procs_per_node"].parse(1 if procs_per_node is None else procs_per_node),
            "args": argv, "data_dir": data_dir,
            "on_cpu": variant.device != "cpu" and gpus_per_node is not None
            and not OPTIONS["gpus_per_node"].parse(gpus_per_node)}
    spec = JobSpec(variant=variant, **here, **{FIELDS.get(o.name, o.name): o.read(given.get(o.name), _default(o.name))
                                               for o in JOB_OPTIONS if o.name not in READ_HERE})
    settled_by = ""   # the flag that gave the ranks' count, where it was not given itself
    if procs_per_node is None and spec.variant.device != "cpu" and spec.gpus_per_node:
        # Paddle runs one process per device: as many as each node is given
        spec, settled_by = replace(spec, procs_per_node=spec.gpus_per_node), OPTIONS["gpus_per_node"].flag
    elif backend is not None:
        spec, settled_by = backend.settle(spec, procs_given=procs_per_node is not None)
    if style.spawns:
        spec = spawning(spec, style, OPTIONS["procs_per_node"].flag if procs_per_node is not None else settled_by)
    validate(spec)
    if backend is not None:
        backend.check(spec)
        if spec.may_shrink and not backend.capabilities.fewer_nodes:
            raise UserError(f"--min-nodes: the {backend.name} backend does not go on with fewer nodes yet (docker, "
                            f"slurm and kubernetes do); drop it")
        if spec.spare_nodes and not backend.capabilities.spares:
            raise UserError(f"--spare-nodes: the {backend.name} backend keeps no spare nodes yet (docker with --hosts, "
                            f"and slurm, do); drop it")
    for name in spec.pass_env:   # its value is read where a container is made: it must be there now
        if name not in os.environ:
            raise UserError(f"--pass-env {name}: it is not set in your environment")
    return spec


def spawning(spec: JobSpec, style: styles.Style, given: str = "") -> JobSpec:
    """The spec of a script that starts its own ranks: one node (Paddle's spawn starts them on the machine it
    runs on), as many ranks as its call says. Where the call does not say it as a number, the option `given`
    (--procs-per-node, or the GPUs each node gets) must: fleetbox watches every rank, so it must know how many."""
    where = f"{spec.script}:{style.line} starts its own ranks (paddle.distributed.spawn)"
    if spec.nodes != 1:
        raise on_one_machine(where, spec.nodes)
    if style.nprocs:
        if given and spec.procs_per_node != style.nprocs:
            raise UserError(f"{where} with nprocs={style.nprocs}, but {given} gives {spec.procs_per_node} rank(s) "
                            f"a node: give {style.nprocs}, or drop the option")
        return replace(spec, procs_per_node=style.nprocs, spawns=True)
    if not given:
        said = f"nprocs={style.text}" if style.text else "no nprocs (one rank per CPU or GPU it sees)"
        raise UserError(f"{where} with {said}: give --procs-per-node N, N the number of ranks it starts")
    return replace(spec, spawns=True)


def on_one_machine(where: str, machines: int) -> UserError:
    """A spawning script given more than one machine (`where` names it): its ranks start where it runs."""
    return UserError(f"{where}, on the machine it runs on: run it on one node (--nodes 1, one host), or start its "
                     f"ranks with Paddle's launcher (call the training function once, without spawn) to use "
                     f"{machines}")


def cpu_only(variant: Variant) -> UserError:
    """A CPU variant given devices (--gpus-per-node, or a backend's own: Docker's --devices)."""
    return UserError(f"variant {variant.name} is CPU-only: drop --gpus-per-node/--devices or choose a GPU variant "
                     f"({', '.join(matrix.gpu_variants())})")


def validate(spec: JobSpec) -> None:
    """Input errors a user can fix, each as one line."""
    if spec.nodes < 1:
        raise UserError(f"--nodes must be at least 1 (got {spec.nodes})")
    if spec.procs_per_node < 1:
        raise UserError(f"--procs-per-node must be at least 1 (got {spec.procs_per_node})")
    if not spec.script_path.is_file():
        raise UserError(f"training script not found: {spec.script}")
    if spec.variant.device == "cpu" and spec.gpus_per_node:
        raise cpu_only(spec.variant)
    if spec.on_cpu and spec.variant.device != "cuda":
        raise UserError(f"--gpus-per-node 0 runs a CUDA image on CPU; variant {spec.variant.name}'s containers need "
                        f"their devices: give --gpus-per-node 1 or more")
    if spec.device != "cpu" and spec.gpus_per_node and spec.gpus_per_node != spec.procs_per_node:
        raise UserError(f"--gpus-per-node {spec.gpus_per_node} with --procs-per-node {spec.procs_per_node}: Paddle "
                        f"runs one process per device; give the same number (or --procs-per-node alone)")
    if spec.port and not 1024 <= spec.port <= 65535:
        raise UserError(f"--port must be between 1024 and 65535 (got {spec.port})")
    if spec.job_id and not JOB_ID.fullmatch(spec.job_id):
        raise UserError(f"--job-id {spec.job_id!r}: use letters, digits, '.', '_' and '-' (at most 63)")
    if not re.fullmatch(r"[0-9]+[bkmg]?", spec.shm_size, re.I):
        raise UserError(f"--shm-size {spec.shm_size!r} must be a size such as 8g or 512m")
    if spec.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more (got {spec.max_restarts})")
    if spec.min_nodes > spec.nodes:
        raise UserError(f"--min-nodes {spec.min_nodes} is above --nodes {spec.nodes}")
    if spec.may_shrink and not spec.max_restarts:
        raise UserError(f"--min-nodes {spec.min_nodes} goes on with fewer nodes at a restart: give --max-restarts "
                        f"too (each time the job goes on without a node is one)")
    if spec.resume not in ("auto", "never") and not Path(spec.resume).is_dir():
        raise UserError(f"--resume {spec.resume}: give auto, never, or a checkpoint folder (not found here)")
    if placeholders.used(spec.checkpoint_dir):   # fleetbox itself reads and writes it, on this machine
        raise UserError(f"--checkpoint-dir {spec.checkpoint_dir}: give the path itself, without placeholders")
    if spec.checkpoint_dir and os.path.realpath(spec.checkpoint_dir) == "/":
        raise UserError("--checkpoint-dir /: give the checkpoints a folder of their own")
    for name in spec.pass_env:
        if not ENV_NAME.fullmatch(name):
            raise UserError(f"--pass-env {name!r}: give variable names, e.g. HF_TOKEN,WANDB_API_KEY")
        if name in spec.env:
            raise UserError(f"--pass-env {name}: also given a value with --env; give it once")
    for m in spec.mounts:
        if not m.src or not m.dst.startswith("/"):
            raise UserError(f"--mount {m.src}:{m.dst}: the destination must be an absolute path")


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")   # a variable name, as every runtime and shell takes it
