"""The pure part of running a job: one node's container as a template whose per-node values are
placeholders ({rank}, {master_ip}, ...). Backends fill the template per node (Docker: with values; Slurm: with
shell variables) and spell it for what starts the containers (run/backends: the Docker CLI and SDK, a runtime's
command line)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fleetbox import settings
from fleetbox.run import hang, placeholders
from fleetbox.run.spec import JobSpec, Mount
from fleetbox.settings import LABEL_JOB, LABEL_NODE, LABEL_OWNER, LABEL_RANK, LABEL_VARIANT, LOG_DIR, WORKDIR

STACK_BYTES = 67108864
HIP_VISIBLE = "HIP_VISIBLE_DEVICES"   # how a ROCm node that sees every GPU is told its own
ALL_RENDER_NODES = "/dev/dri"   # a ROCm device list's entry for every GPU's render node (a job gets only its own)


@dataclass(frozen=True)
class NodeRun:
    """Everything one node's container needs. In a template, strings hold placeholders; `fill` makes a node."""
    name: str
    host: str                     # engine URL, "" for this machine
    image: str
    command: tuple[str, ...]
    env: dict
    mounts: tuple[Mount, ...]
    labels: dict
    shm_size: str
    devices: tuple[str, ...] = ()
    group_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()
    gpus: str = ""                # docker --gpus syntax: "device=0,1" (a template: "device={gpus}"); "" none
    accelerator: str = ""         # the variant's device: cuda | rocm | "" (CPU)
    pass_env: tuple[str, ...] = ()   # variables passed by name: their values come from the environment they start in
    memlock: int = -1             # -1 unlimited (NCCL/InfiniBand); lower only where the engine cannot raise it

    def fill(self, values: dict[str, str]) -> "NodeRun":
        def f(s):
            return placeholders.fill(s, values)
        return replace(self, name=f(self.name), command=tuple(map(f, self.command)), gpus=f(self.gpus),
                       env={k: f(v) for k, v in self.env.items()}, labels={k: f(v) for k, v in self.labels.items()},
                       mounts=tuple(Mount(f(m.src), f(m.dst), m.ro) for m in self.mounts))

    def strings(self):
        """Every user-visible string of the node, with where it goes (for checks of what a runtime can carry)."""
        yield "image", self.image
        yield from (("argument", c) for c in self.command)
        yield from ((f"--env {k}", v) for k, v in self.env.items())
        for m in self.mounts:
            yield "mount source", m.src
            yield "mount destination", m.dst


def network_env(iface: str, ib_hca: str = "", debug: bool = False) -> dict:
    env = {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}
    if ib_hca:
        env.update(NCCL_IB_HCA=ib_hca, NCCL_IB_DISABLE="0")
    else:
        env["NCCL_IB_DISABLE"] = "1"
    if debug:
        env.update(NCCL_DEBUG="INFO", GLOG_v="1")
    return env


def block_width(procs: int) -> int:
    """Ports pinned per node: the launcher takes 1 + procs (its candidate port, one endpoint per process) and
    skips busy ones, so twice that leaves room for ports an earlier attempt's connections still hold."""
    return 2 * (1 + procs)


def trainer_ports(port: int, rank: int, procs: int) -> tuple[int, int]:
    """Node `rank`'s pinned ports (first, last), just above the master port. Paddle's launcher takes its
    candidate port (node 0's becomes the trainers' TCP store) and each process's endpoint from PORT_RANGE
    (by default a random one of 35100-64000, which no firewall rule can name); every node has its own
    block, so nodes sharing one host (local Docker) never collide."""
    width = block_width(procs)
    first = port + 1 + rank * width
    return first, first + width - 1


def ports_needed(nnodes: int, procs: int) -> int:
    """The master port and every node's block."""
    return 1 + nnodes * block_width(procs)


def launch_command(spec: JobSpec) -> tuple[str, ...]:
    """`--host` is the node's own address towards the master: without it Paddle takes the address its
    hostname resolves to (often 127.0.1.1), never recognises itself as the master, and waits forever
    ("master not ready"); its trainer endpoints would be unreachable from other nodes too."""
    return ("python", "-m", "paddle.distributed.launch", "--master", "{master_ip}:{master_port}",
            "--host", "{node_ip}", "--nnodes", "{nnodes}", "--rank", "{rank}",
            "--nproc_per_node", str(spec.procs_per_node), "--log_dir", LOG_DIR,
            "--log_overwrite", "true",   # a job id used again: its ranks' logs are this run's, not appended to
            f"{WORKDIR}/{spec.script_path.name}", *spec.args)


SPAWN_ENV = {"FLEETBOX_STYLE": "spawn", "FLEETBOX_LOG_DIR": LOG_DIR}   # what sitecustomize's spawn path reads


def rank_command(spec: JobSpec) -> tuple[str, ...]:
    """What a node runs: Paddle's launcher, which starts the script once per rank, or, for a script that starts
    its own ranks (spec.spawns), the script itself: inside the launcher, Paddle's spawn refuses to run."""
    if spec.spawns:
        return ("python", f"{WORKDIR}/{spec.script_path.name}", *spec.args)
    return launch_command(spec)


def ranks_log_dir(n: NodeRun) -> str | None:
    """Where node `n`'s ranks write their logs (workerlog.<local rank>): the launcher's --log_dir, or the folder
    sitecustomize's spawn path writes to; None for a command of another kind (invoke doctor's)."""
    if "--log_dir" in n.command:
        return n.command[n.command.index("--log_dir") + 1]
    return n.env.get("FLEETBOX_LOG_DIR")


def device_options(spec: JobSpec, hyhal_present: bool = True) -> dict:
    """Devices by variant: CUDA -> GPU requests; DCU/ROCm -> /dev/kfd, /dev/dri, video, /opt/hyhal; CPU -> none.
    Which GPUs each node gets is filled per node ({gpus}, as the backend splits them); a scheduler's allocation
    replaces it."""
    v = spec.variant
    if spec.device == "cuda":
        return {"gpus": "device={gpus}"}
    if spec.device == "rocm":
        rt = v.runtime
        mounts = []
        for m in rt.get("mounts", []):
            src, dst, *mode = m.split(":")
            if src != "/opt/hyhal" or hyhal_present:
                mounts.append(Mount(src, dst, ro=mode == ["ro"]))
        return {"devices": tuple(rt.get("devices", [])), "group_add": tuple(rt.get("group_add", [])),
                "security_opt": tuple(rt.get("security_opt", [])), "mounts": tuple(mounts),
                "env": {HIP_VISIBLE: "{gpus}"}}
    return {}


def _abs(path: str) -> str:
    """An absolute path for a mount source given relative to here; one that starts with a placeholder
    ({home}/x) is resolved on the node."""
    return path if path.startswith("{") else str(Path(path).resolve())


def checkpoint_env(spec: JobSpec, shared: bool = True) -> dict:
    """What fleetbox_checkpoint reads (`never` and a path count for attempt 0 only: later attempts go on from
    the job's own checkpoints)."""
    resume = spec.resume if spec.resume in ("auto", "never") else settings.RESUME_DIR
    env = {"FLEETBOX_CHECKPOINT_DIR": settings.CHECKPOINT_DIR, "FLEETBOX_RESUME": resume,
           "FLEETBOX_ATTEMPT": "{attempt}"}
    if not shared:   # every node has its own folder: each node's first rank writes the replicated state there
        env["FLEETBOX_CHECKPOINT_SCOPE"] = "node"
    return env


def template(spec: JobSpec, job_id: str, log_dir: str | None, workspace: bool = True, hyhal_present: bool = True,
             memlock: int = -1, host: str = "", checkpoints: str = "", shared_checkpoints: bool = True,
             owner: str = "") -> NodeRun:
    """Pure: node {rank}'s container. `log_dir` is the folder (on the node's host) mounted at LOG_DIR, with
    placeholders (None: no mount, the logs stay in the container until it is removed); `workspace`: mount the
    script's folder and fleetbox's helpers (False where the backend copies them in); `checkpoints`: the job's
    checkpoint folder on the node's host, or a volume name, mounted read-write at CHECKPOINT_DIR; `owner`: whose
    the container is (records.owner()), a label sweeps and cleans match."""
    dev = device_options(spec, hyhal_present)
    user_path = spec.env.get("PYTHONPATH", "")
    watched = {}
    if spec.hang_timeout or spec.start_timeout:   # run/hang.py reads the progress; NCCL's own timeout comes later
        watched = {"FLEETBOX_PROGRESS_DIR": LOG_DIR}
        if spec.device != "cpu":
            watched["PADDLE_PG_TIMEOUT"] = str(hang.pg_timeout_ms(spec.hang_timeout, spec.start_timeout))
    env = {"PYTHONUNBUFFERED": "1", "FLEETBOX_JOB": job_id, "FLEETBOX_NODE": "{rank}",
           "FLEETBOX_VISUALDL_DIR": f"{LOG_DIR}/{settings.SCRIPT_VISUALDL}",
           "PORT_RANGE": "{port_range}",
           **watched, **network_env("{iface}", spec.ib_hca, spec.debug), **dev.get("env", {}),
           **(checkpoint_env(spec, shared_checkpoints) if checkpoints else {}),
           **(SPAWN_ENV if spec.spawns and not spec.command else {}), **spec.env,
           "PYTHONPATH": settings.HELPERS_DIR + (f":{user_path}" if user_path else "")}
    mounts = [Mount(str(spec.script_path.parent), WORKDIR, ro=True),
              Mount(str(settings.HELPERS), settings.HELPERS_DIR, ro=True)] if workspace else []
    if log_dir is not None:
        mounts.append(Mount(log_dir, LOG_DIR, ro=False))
    if checkpoints:
        mounts.append(Mount(checkpoints, settings.CHECKPOINT_DIR, ro=False))
    if spec.resume not in ("auto", "never"):
        mounts.append(Mount(str(Path(spec.resume).resolve()), settings.RESUME_DIR, ro=True))
    if spec.data_dir:
        mounts.append(Mount(str(Path(spec.data_dir).resolve()), settings.CONTAINER_CACHE, ro=True))
    mounts += list(dev.get("mounts", ()))
    mounts += [Mount(_abs(m.src), m.dst, m.ro) for m in spec.mounts]
    return NodeRun(
        name=f"fleetbox-{job_id}-{{node}}", host=host, image=spec.image_ref,
        command=spec.command or rank_command(spec), env=env, mounts=tuple(mounts),
        labels={LABEL_JOB: job_id, LABEL_NODE: "{node}", LABEL_RANK: "{rank}", LABEL_VARIANT: spec.variant.name,
                **({LABEL_OWNER: owner} if owner else {})},
        shm_size=spec.shm_size, devices=dev.get("devices", ()), group_add=dev.get("group_add", ()),
        security_opt=dev.get("security_opt", ()), gpus=dev.get("gpus", ""), memlock=memlock,
        accelerator="" if spec.device == "cpu" else spec.device, pass_env=spec.pass_env)


def node_values(rank: int, nnodes: int, job_id: str, master_ip: str, port: int, node_ip: str, iface: str,
                home: str = "", user: str = "", attempt: int = 0, procs: int = 1, gpus: str = "") -> dict[str, str]:
    """The placeholders' values on one node."""
    first, last = trainer_ports(port, rank, procs)
    return {"port_range": f"{first}:{last}", "gpus": gpus, "rank": str(rank), "node": f"node{rank}",
            "nnodes": str(nnodes),
            "job_id": job_id, "home": home, "user": user, "master_ip": master_ip, "master_port": str(port),
            "node_ip": node_ip, "iface": iface, "attempt": str(attempt)}
