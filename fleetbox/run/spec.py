"""A training job as data: what to run, on how many nodes, with which image, environment and mounts.
Pure: building and validating a spec reads no network, engine or host facts."""

from __future__ import annotations

import os
import re
import secrets
import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from fleetbox import options, settings
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.image.matrix import Variant
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


def from_options(variant: Variant, *, nodes=None, procs_per_node=None, script=None, args=None, image=None,
                 hosts=None, iface=None, ib_hca=None, debug=False, gpus_per_node=None, devices=None, port=None,
                 env=None, mount=None, data_dir=None, shm_size=None, job_id=None, checkpoint_dir=None, resume=None,
                 max_restarts=None, pass_env=None, hang_timeout=None, start_timeout=None) -> JobSpec:
    """A validated JobSpec from command-line strings (each by its option's name)."""
    host_list = tuple(options.items(hosts))
    if data_dir is None:   # the default cache is used when it exists here (a remote engine cannot see it)
        default = settings.data_dir()
        data_dir = str(default) if default.is_dir() and not host_list else ""
    elif data_dir and not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir} is not a folder")
    try:
        argv = tuple(shlex.split(args or ""))
    except ValueError as e:
        raise UserError(f"--args cannot be split into words: {e}") from None
    style = styles.of_script(Path(script or settings.DEFAULT_SCRIPT).resolve())   # before the GPUs are split
    spec = JobSpec(
        variant=variant, nodes=options.integer("--nodes", (1 if style.spawns else 2) if nodes is None else nodes, 1),
        procs_per_node=options.integer("--procs-per-node", 1 if procs_per_node is None else procs_per_node, 1),
        script=script or str(settings.DEFAULT_SCRIPT), args=argv, image=image or "", hosts=host_list,
        iface=iface or "", ib_hca=ib_hca or "", debug=bool(debug),
        gpus_per_node=options.integer("--gpus-per-node", gpus_per_node or 0, 0), devices=devices or "",
        on_cpu=variant.device != "cpu" and gpus_per_node is not None and not options.integer(
            "--gpus-per-node", gpus_per_node, 0),
        port=options.integer("--port", port, 1024, 65535) if port else 0, env=options.pairs("--env", env),
        mounts=tuple(parse_mount(m) for m in options.items(mount)), data_dir=data_dir,
        shm_size=shm_size or "8g", job_id=job_id or "", checkpoint_dir=checkpoint_dir or "",
        resume=resume or "auto", max_restarts=options.integer("--max-restarts", max_restarts or 0, 0),
        pass_env=tuple(options.items(pass_env)),
        hang_timeout=options.duration("--hang-timeout", hang_timeout, JobSpec.hang_timeout),
        start_timeout=options.duration("--start-timeout", start_timeout, JobSpec.start_timeout))
    if procs_per_node is None and spec.variant.device != "cpu" and (spec.gpus_per_node or spec.devices):
        # Paddle runs one process per device: as many as each node is given
        spec = replace(spec, procs_per_node=spec.gpus_per_node or max(1, len(spec.devices.split(",")) // spec.sharing))
    if style.spawns:
        given = "--procs-per-node" if procs_per_node is not None else "--gpus-per-node" if spec.gpus_per_node \
            else "--devices" if spec.devices else ""
        spec = spawning(spec, style, given)
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
