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
    hosts: tuple[str, ...] = ()          # one Docker Engine URL per node (ssh://user@h1, tcp://IP:2375); empty: here
    iface: str = ""                      # NIC for NCCL/Gloo; default: the one that routes to the master
    ib_hca: str = ""                     # e.g. mlx5_0: InfiniBand on
    debug: bool = False
    gpus_per_node: int = 0
    devices: str = ""                    # accelerator ids, e.g. "0,1"
    on_cpu: bool = False                 # a GPU variant's image given no device (--gpus-per-node 0): its ranks run
                                         # on CPU, collectives on Gloo (a GPU build tested on a machine without one)
    port: int = 0                        # master port; 0: the plan picks one
    shm_size: str = "8g"                 # NCCL needs more than Docker's 64 MB default ("NCCL error 2")
    data_dir: str = ""                   # seeded dataset cache, mounted read-only at Paddle's cache path
    job_id: str = ""                     # "": the plan makes one
    checkpoint_dir: str = ""             # host folder (shared for Slurm); "": runs/<job>/checkpoints (--hosts: volume)
    resume: str = "auto"                 # auto | never | a checkpoint (step folder or checkpoint folder) to start from
    max_restarts: int = 0                # Docker: start the whole job again after a failure, this many times
    hang_timeout: float = hang.HANG_TIMEOUT_S    # seconds without progress before the job counts as hung (0: off)
    start_timeout: float = hang.START_TIMEOUT_S  # seconds from the start to the first progress (0: off)
    command: tuple[str, ...] = ()        # the containers' command instead of Paddle's launcher (invoke doctor)
    image_identity: bool = False         # Slurm: node.sh first says which image the node has (invoke doctor)
    spawns: bool = False                 # the script starts its own ranks (paddle.distributed.spawn): run without
                                         # Paddle's launcher, on one node (run/styles.py tells, not an option)

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
    def sharing(self) -> int:
        """Nodes that share one machine's devices: every node on this machine, one per machine with --hosts."""
        return 1 if self.hosts else self.nodes

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
    Option("hosts", "docker backend: comma-separated Docker Engine URLs, one per node (ssh://user@h1,ssh://user@h2); "
                    "master = first", kind=tuple),
    Option("iface", "network interface for NCCL/Gloo (default: the one that routes to the master)"),
    Option("ib_hca", "InfiniBand HCA, e.g. mlx5_0 (sets NCCL_IB_HCA and NCCL_IB_DISABLE=0)"),
    Option("debug", "NCCL_DEBUG=INFO, and the launcher's HTTP polling lines in the live output", False, bool),
    Option("gpus_per_node", "GPUs per node (CUDA variants); 0: a GPU image's ranks run on CPU, collectives on Gloo",
           kind=int, low=0),
    Option("devices", "docker backend: the accelerator ids the job may use, e.g. 4,5,6,7, split among the nodes "
                      "(Slurm gives each node its own: --gpus-per-node)"),
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
                           "(default 0; docker: at once, slurm: in a new allocation)", kind=int, low=0),
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


def from_options(variant: Variant, **given) -> JobSpec:
    """A validated JobSpec from command-line strings, each by its option's name (JOB_OPTIONS; None: not given)."""
    unknown = sorted(set(given) - {o.name for o in JOB_OPTIONS})
    if unknown:
        raise TypeError(f"from_options: no job option {', '.join(unknown)}")
    nodes, procs_per_node, args, data_dir, gpus_per_node = (
        given.get(name) for name in (*READ_HERE, "gpus_per_node"))
    host_list = OPTIONS["hosts"].read(given.get("hosts"), ())
    if data_dir is None:   # the default cache is used when it exists here (a remote engine cannot see it)
        default = settings.data_dir()
        data_dir = str(default) if default.is_dir() and not host_list else ""
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
    if procs_per_node is None and spec.variant.device != "cpu" and (spec.gpus_per_node or spec.devices):
        # Paddle runs one process per device: as many as each node is given
        spec = replace(spec, procs_per_node=spec.gpus_per_node or max(1, len(spec.devices.split(",")) // spec.sharing))
    if style.spawns:
        given_as = "--procs-per-node" if procs_per_node is not None else "--gpus-per-node" if spec.gpus_per_node \
            else "--devices" if spec.devices else ""
        spec = spawning(spec, style, given_as)
    validate(spec)
    for name in spec.pass_env:   # its value is read where a container is made: it must be there now
        if name not in os.environ:
            raise UserError(f"--pass-env {name}: it is not set in your environment")
    return spec


def spawning(spec: JobSpec, style: styles.Style, given: str = "") -> JobSpec:
    """The spec of a script that starts its own ranks: one node (Paddle's spawn starts them on the machine it
    runs on), as many ranks as its call says. Where the call does not say it as a number, the option `given`
    (--procs-per-node, or the GPUs each node gets) must: fleetbox watches every rank, so it must know how many."""
    where = f"{spec.script}:{style.line} starts its own ranks (paddle.distributed.spawn)"
    if spec.nodes != 1 or len(spec.hosts) > 1:
        n = max(spec.nodes, len(spec.hosts))
        raise UserError(f"{where}, on the machine it runs on: run it on one node (--nodes 1, one host), or start its "
                        f"ranks with Paddle's launcher (call the training function once, without spawn) to use {n}")
    if style.nprocs:
        if given and spec.procs_per_node != style.nprocs:
            raise UserError(f"{where} with nprocs={style.nprocs}, but {given} gives {spec.procs_per_node} rank(s) "
                            f"a node: give {style.nprocs}, or drop the option")
        return replace(spec, procs_per_node=style.nprocs, spawns=True)
    if not given:
        said = f"nprocs={style.text}" if style.text else "no nprocs (one rank per CPU or GPU it sees)"
        raise UserError(f"{where} with {said}: give --procs-per-node N, N the number of ranks it starts")
    return replace(spec, spawns=True)


def validate(spec: JobSpec) -> None:
    """Input errors a user can fix, each as one line."""
    if spec.nodes < 1:
        raise UserError(f"--nodes must be at least 1 (got {spec.nodes})")
    if spec.procs_per_node < 1:
        raise UserError(f"--procs-per-node must be at least 1 (got {spec.procs_per_node})")
    if not spec.script_path.is_file():
        raise UserError(f"training script not found: {spec.script}")
    if spec.variant.device == "cpu" and (spec.gpus_per_node or spec.devices):
        raise UserError(f"variant {spec.variant.name} is CPU-only: drop --gpus-per-node/--devices "
                        f"or choose a GPU variant ({', '.join(matrix.gpu_variants())})")
    if spec.on_cpu and spec.variant.device != "cuda":
        raise UserError(f"--gpus-per-node 0 runs a CUDA image on CPU; variant {spec.variant.name}'s containers need "
                        f"their devices: give --gpus-per-node 1 or more")
    if spec.on_cpu and spec.devices:
        raise UserError("--gpus-per-node 0 runs on CPU: drop --devices, or give as many GPUs as processes")
    if spec.device != "cpu":
        validate_devices(spec)
    if spec.hosts and len(spec.hosts) != spec.nodes:
        raise UserError(f"--hosts names {len(spec.hosts)} hosts for {spec.nodes} nodes: give one per node")
    if spec.port and not 1024 <= spec.port <= 65535:
        raise UserError(f"--port must be between 1024 and 65535 (got {spec.port})")
    if spec.job_id and not JOB_ID.fullmatch(spec.job_id):
        raise UserError(f"--job-id {spec.job_id!r}: use letters, digits, '.', '_' and '-' (at most 63)")
    if not re.fullmatch(r"[0-9]+[bkmg]?", spec.shm_size, re.I):
        raise UserError(f"--shm-size {spec.shm_size!r} must be a size such as 8g or 512m")
    if spec.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more (got {spec.max_restarts})")
    if spec.resume not in ("auto", "never"):
        if not Path(spec.resume).is_dir():
            raise UserError(f"--resume {spec.resume}: give auto, never, or a checkpoint folder (not found here)")
        if spec.hosts:
            raise UserError("--resume PATH needs the folder on every node; with --hosts, copy it into the job's "
                            "checkpoint volume or use a shared --checkpoint-dir")
    if placeholders.used(spec.checkpoint_dir):   # fleetbox itself reads and writes it, on this machine
        raise UserError(f"--checkpoint-dir {spec.checkpoint_dir}: give the path itself, without placeholders")
    if spec.checkpoint_dir and not spec.hosts and Path(spec.checkpoint_dir).exists() \
            and not Path(spec.checkpoint_dir).is_dir():
        raise UserError(f"--checkpoint-dir {spec.checkpoint_dir} is not a folder")
    if spec.checkpoint_dir and spec.hosts and (not spec.checkpoint_dir.startswith("/") or
                                               ".." in spec.checkpoint_dir.split("/")):
        raise UserError(f"--checkpoint-dir {spec.checkpoint_dir}: with --hosts, give the folder's absolute path "
                        f"(the same on every host), without ..")
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
DEVICE_ID = re.compile(r"[0-9]+|GPU-[0-9A-Fa-f-]+")   # an index, or an NVIDIA/AMD UUID


def validate_devices(spec: JobSpec) -> None:
    """Each process its own device: --gpus-per-node equals --procs-per-node, and --devices, split in order among
    the nodes that share this machine (every node, unless --hosts), covers them without overlap."""
    if spec.gpus_per_node and spec.gpus_per_node != spec.procs_per_node:
        raise UserError(f"--gpus-per-node {spec.gpus_per_node} with --procs-per-node {spec.procs_per_node}: Paddle "
                        f"runs one process per device; give the same number (or --procs-per-node alone)")
    if not spec.devices:
        return
    ids = spec.devices.split(",")
    if not all(DEVICE_ID.fullmatch(i) for i in ids):
        raise UserError(f"--devices {spec.devices!r}: give device ids separated by commas, e.g. 0,1")
    if len(set(ids)) != len(ids):
        raise UserError(f"--devices {spec.devices} names a device twice: two processes would share it")
    if len(ids) % spec.sharing:
        raise UserError(f"--devices {spec.devices}: {len(ids)} device(s) cannot be split evenly among {spec.sharing} "
                        f"nodes on this machine")
    if len(ids) // spec.sharing != spec.gpus_each:
        raise UserError(f"--devices {spec.devices}: {len(ids)} device(s) for {spec.sharing} node(s) of "
                        f"{spec.procs_per_node} process(es) each; each process needs its own device")
