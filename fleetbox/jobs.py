"""Training jobs as data: a JobSpec (nodes x processes, image, script, env, mounts, devices, network) and
the pure planning that turns it into one container per node. Backends (Docker here) act on the plan.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shlex
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from . import ROOT
from .datasets import CONTAINER_CACHE
from .errors import UserError
from .matrix import Variant
from .probes import netinfo

LOG_DIR = "/fleetbox/logs"     # inside each node's container; --log_dir of paddle.distributed.launch
WORKDIR = "/workspace"
DEFAULT_SCRIPT = ROOT / "train" / "smoke.py"
LABEL_JOB, LABEL_NODE, LABEL_RANK = "io.fleetbox.job", "io.fleetbox.node", "io.fleetbox.rank"


@dataclass(frozen=True)
class JobSpec:
    variant: Variant
    nodes: int = 2
    procs_per_node: int = 1
    script: str = str(DEFAULT_SCRIPT)
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    mounts: tuple[str, ...] = ()         # extra "SRC:DST[:ro]" bind mounts
    image: str = ""                      # default: the variant's alias (fleetbox/paddle:<variant>)
    hosts: tuple[str, ...] = ()          # one Docker Engine URL per node (ssh://user@h1, tcp://IP:2375); empty: here
    iface: str = ""                      # NIC for NCCL/Gloo; default: the one that routes to the master
    ib_hca: str = ""                     # e.g. mlx5_0: InfiniBand on
    debug: bool = False
    gpus_per_node: int = 0
    devices: str = ""                    # accelerator ids, e.g. "0,1"
    port: int = 0                        # master port; 0: pick a free one
    shm_size: str = "8g"                 # NCCL needs more than Docker's 64 MB default ("NCCL error 2")
    data_dir: str = ""                   # seeded dataset cache, mounted read-only at Paddle's cache path
    job_id: str = ""

    @property
    def image_ref(self) -> str:
        return self.image or self.variant.aliases[0]

    @property
    def script_path(self) -> Path:
        return Path(self.script).resolve()


def new_job_id() -> str:
    return f"train-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


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
                        f"or choose a GPU variant (cu118, cu126, cu129, dcu)")
    if spec.hosts and len(spec.hosts) != spec.nodes:
        raise UserError(f"--hosts names {len(spec.hosts)} hosts for {spec.nodes} nodes: give one per node")
    if spec.port and not 1024 <= spec.port <= 65535:
        raise UserError(f"--port must be between 1024 and 65535 (got {spec.port})")
    for m in spec.mounts:
        if ":" not in m:
            raise UserError(f"--mount {m!r} must be SRC:DST[:ro]")


# ---- network facts (read from this machine; for remote hosts a probe container answers the same) ----

def route(master_ip: str) -> tuple[str, str]:
    """(interface, own address) this machine uses to reach the master (on the master: the one holding it)."""
    try:
        iface, local = netinfo.route(master_ip)
    except OSError as e:
        raise UserError(f"no route to master {master_ip}: {e.strerror}") from None
    if not iface:
        raise UserError(f"no interface holds {local}, the address that routes to {master_ip}; pass --iface")
    return iface, local


def check_iface(name: str) -> None:
    have = netinfo.interfaces()
    if name not in have:
        raise UserError(f"interface {name!r} does not exist here (have: {', '.join(have)})")


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def random_port() -> int:
    """A master port for machines we cannot ask (remote hosts, Slurm nodes)."""
    return 29000 + int.from_bytes(os.urandom(2), "big") % 20000


def check_port(ip: str, port: int) -> None:
    if not netinfo.port_free(ip, port):
        raise UserError(f"port {port} on {ip} is already in use; pick another with --port")


def host_address(url: str) -> str:
    """Numeric IPv4 of a Docker host URL (ssh://user@h1, tcp://h1:2375): Paddle's master must be an IP."""
    host = urlparse(url).hostname
    if not host:
        raise UserError(f"cannot tell the address of host {url!r}: use ssh://USER@HOST or tcp://HOST:PORT")
    try:
        ipaddress.IPv4Address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        raise UserError(f"cannot resolve host {host!r} of {url}") from None


# ---- the plan: one container per node ----

@dataclass(frozen=True)
class Mount:
    src: str
    dst: str
    ro: bool = True


@dataclass(frozen=True)
class NodeRun:
    """Everything `docker run` needs for one node; rendered both as CLI argv and as SDK arguments."""
    name: str
    host: str                     # engine URL, "" for this machine
    rank: int
    image: str
    command: tuple[str, ...]
    env: dict
    mounts: tuple[Mount, ...]
    labels: dict
    shm_size: str
    devices: tuple[str, ...] = ()
    group_add: tuple[str, ...] = ()
    security_opt: tuple[str, ...] = ()
    gpus: str = ""                # "all", "2" or "device=0,1" (docker --gpus syntax); "" none
    memlock: int = -1             # -1 unlimited (NCCL/InfiniBand); lower only where the engine cannot raise it

    def cli_flags(self) -> list[str]:
        """Labels, volumes and environment in the `docker run` spelling (Podman takes the same)."""
        a = []
        for k, v in self.labels.items():
            a += ["--label", f"{k}={v}"]
        for m in self.mounts:
            a += ["-v", f"{m.src}:{m.dst}" + (":ro" if m.ro else "")]
        for k, v in self.env.items():
            a += ["-e", f"{k}={v}"]
        return a

    def argv(self) -> list[str]:
        a = ["docker"] + (["-H", self.host] if self.host else []) + [
            "run", "-d", "--name", self.name, "--network", "host", "--shm-size", self.shm_size,
            "--ulimit", f"memlock={self.memlock}:{self.memlock}", "--ulimit", "stack=67108864", "-w", WORKDIR,
            *self.cli_flags()]
        for d in self.devices:
            a += ["--device", d]
        for g in self.group_add:
            a += ["--group-add", g]
        for s in self.security_opt:
            a += ["--security-opt", s]
        if self.gpus:
            a += ["--gpus", self.gpus]
        return a + [self.image, *self.command]

    def shell(self) -> str:
        return shlex.join(self.argv())

    def sdk_kwargs(self) -> dict:
        import docker.types
        kw = {"name": self.name, "network_mode": "host", "shm_size": self.shm_size, "working_dir": WORKDIR,
              "ulimits": [docker.types.Ulimit(name="memlock", soft=self.memlock, hard=self.memlock),
                          docker.types.Ulimit(name="stack", soft=67108864, hard=67108864)],
              "labels": dict(self.labels), "environment": dict(self.env),
              "volumes": {m.src: {"bind": m.dst, "mode": "ro" if m.ro else "rw"} for m in self.mounts}}
        if self.devices:
            kw["devices"] = [f"{d}:{d}:rwm" for d in self.devices]
        if self.group_add:
            kw["group_add"] = list(self.group_add)
        if self.security_opt:
            kw["security_opt"] = list(self.security_opt)
        if self.gpus:
            if self.gpus == "all":
                req = docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
            elif self.gpus.startswith("device="):
                req = docker.types.DeviceRequest(device_ids=self.gpus[7:].split(","), capabilities=[["gpu"]])
            else:
                req = docker.types.DeviceRequest(count=int(self.gpus), capabilities=[["gpu"]])
            kw["device_requests"] = [req]
        return kw


def network_env(iface: str, ib_hca: str = "", debug: bool = False) -> dict:
    env = {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}
    if ib_hca:
        env.update(NCCL_IB_HCA=ib_hca, NCCL_IB_DISABLE="0")
    else:
        env["NCCL_IB_DISABLE"] = "1"
    if debug:
        env.update(NCCL_DEBUG="INFO", GLOG_v="1")
    return env


def launch_command(spec: JobSpec, rank: int, master: str, node_ip: str) -> tuple[str, ...]:
    """`--host` is the node's own address towards the master: without it Paddle takes the address its
    hostname resolves to (often 127.0.1.1), never recognises itself as the master, and waits forever
    ("master not ready"); its trainer endpoints would be unreachable from other nodes too."""
    return ("python", "-m", "paddle.distributed.launch", "--master", master, "--host", node_ip,
            "--nnodes", str(spec.nodes), "--rank", str(rank), "--nproc_per_node", str(spec.procs_per_node),
            "--log_dir", LOG_DIR, f"{WORKDIR}/{spec.script_path.name}", *spec.args)


def device_options(spec: JobSpec, hyhal_present: bool = True) -> dict:
    """Devices by variant: CUDA -> GPU requests; DCU/ROCm -> /dev/kfd, /dev/dri, video, /opt/hyhal; CPU -> none."""
    v = spec.variant
    if v.device == "cuda":
        gpus = f"device={spec.devices}" if spec.devices else str(spec.gpus_per_node) if spec.gpus_per_node else "all"
        return {"gpus": gpus}
    if v.device == "rocm":
        rt = v.runtime
        env = {"HIP_VISIBLE_DEVICES": spec.devices} if spec.devices else {}
        mounts = []
        for m in rt.get("mounts", []):
            src, dst, *mode = m.split(":")
            if src != "/opt/hyhal" or hyhal_present:
                mounts.append(Mount(src, dst, ro=mode == ["ro"]))
        return {"devices": tuple(rt.get("devices", [])), "group_add": tuple(rt.get("group_add", [])),
                "security_opt": tuple(rt.get("security_opt", [])), "mounts": tuple(mounts), "env": env}
    return {}


def plan_nodes(spec: JobSpec, master_ip: str, port: int, ifaces: list[str], log_dirs: list[str],
               hyhal_present: bool = True, memlock: int = -1, node_ips: list[str] | None = None) -> list[NodeRun]:
    """Pure: the container of every node. `ifaces[k]`/`node_ips[k]` are node k's NIC and own address towards
    the master (default: the master's own address, as for nodes on one machine); `log_dirs[k]` the folder
    (on node k's host) mounted at LOG_DIR."""
    node_ips = node_ips or [master_ip] * spec.nodes
    master = f"{master_ip}:{port}"
    dev = device_options(spec, hyhal_present)
    runs = []
    for rank in range(spec.nodes):
        env = {"PYTHONUNBUFFERED": "1", "FLEETBOX_JOB": spec.job_id, "FLEETBOX_NODE": str(rank),
               **network_env(ifaces[rank], spec.ib_hca, spec.debug), **dev.get("env", {}), **spec.env}
        mounts = [Mount(log_dirs[rank], LOG_DIR, ro=False)]
        if not spec.hosts:   # a remote engine cannot see this folder: the backend copies the workspace in
            mounts.insert(0, Mount(str(spec.script_path.parent), WORKDIR, ro=True))
        if spec.data_dir:
            mounts.append(Mount(str(Path(spec.data_dir).resolve()), CONTAINER_CACHE, ro=True))
        mounts += list(dev.get("mounts", ()))
        for m in spec.mounts:
            src, dst, *mode = m.split(":")
            mounts.append(Mount(str(Path(src).resolve()), dst, ro=mode == ["ro"]))
        runs.append(NodeRun(
            name=f"fleetbox-{spec.job_id}-node{rank}", host=spec.hosts[rank] if spec.hosts else "", rank=rank,
            image=spec.image_ref, command=launch_command(spec, rank, master, node_ips[rank]), env=env, mounts=tuple(mounts),
            labels={LABEL_JOB: spec.job_id, LABEL_NODE: f"node{rank}", LABEL_RANK: str(rank),
                    "io.fleetbox.variant": spec.variant.name},
            shm_size=spec.shm_size, devices=dev.get("devices", ()), group_add=dev.get("group_add", ()),
            security_opt=dev.get("security_opt", ()), gpus=dev.get("gpus", ""), memlock=memlock))
    return runs


def local_memlock() -> int:
    """-1 (unlimited) unless this machine's hard limit is lower: dockerd, started here, cannot go above it."""
    return netinfo.memlock_limit()


def culprit(exits: list[tuple[int, int]]) -> int | None:
    """The node that failed in substance, from (rank, exit code) in the order the exits were seen.
    A real exit code (1..127) beats a signal-style one (>= 128): peers abort (SIGABRT, exit 250) when a rank
    disappears, sometimes before that rank's own launcher has reported."""
    failed = [(r, c) for r, c in exits if c != 0]
    real = [r for r, c in failed if 0 < c < 128]
    return real[0] if real else failed[0][0] if failed else None
