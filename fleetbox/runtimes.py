"""Container runtimes on HPC nodes: how one node's container (a jobs.NodeRun) is started by each runtime.

Pure rendering to shell words. Values may hold shell variables ($SLURM_NODEID, $MASTER_IP, $IFACE, ...),
which stay expandable; everything else is quoted.
"""

from __future__ import annotations

import shlex
from dataclasses import replace

from .datasets import CONTAINER_CACHE
from .errors import UserError
from .jobs import WORKDIR, NodeRun

RUNTIMES = ("apptainer", "pyxis", "charliecloud", "podman", "docker")

# Runtimes that run the job as the calling user. Paddle keeps its cache under that user's home
# (`~/.cache/paddle/dataset`; /tmp/... when the home is missing or read-only), never under /root. So
# the home is mounted and the seeded cache goes where Paddle will look: the home as seen in the
# container (Apptainer and Pyxis mount it at its own path, Charliecloud's --home at /home/$USER).
USER_HOME = {"apptainer": "$HOME", "pyxis": "$HOME", "charliecloud": "/home/$USER"}
HOME_CACHE = ".cache/paddle/dataset"


def q(word: str) -> str:
    """Quote for bash, keeping $VARIABLES (and $(commands)) expandable."""
    if "$" in word:
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'
    return shlex.quote(word)


def words(ws: list[str]) -> str:
    return " ".join(q(w) for w in ws)


def check(runtime: str) -> str:
    if runtime not in RUNTIMES:
        raise UserError(f"unknown runtime {runtime!r}; choose one of: {', '.join(RUNTIMES)}")
    return runtime


def command(runtime: str, n: NodeRun, device: str, image: str, extra: list[str] = ()) -> list[str]:
    """The words that start node `n`'s container under `runtime` (pyxis: the command inside it).
    `extra`: site-specific runtime options, placed before the image."""
    check(runtime)
    words_ = _command(runtime, as_user(runtime, n), device, image)
    if extra and runtime != "pyxis":
        at = words_.index(image)
        words_[at:at] = list(extra)
    return words_


def as_user(runtime: str, n: NodeRun) -> NodeRun:
    """`n` with the dataset cache mounted where Paddle looks for it under `runtime`."""
    if runtime not in USER_HOME:
        return n
    home_cache = f"{USER_HOME[runtime]}/{HOME_CACHE}"
    return replace(n, mounts=tuple(replace(m, dst=home_cache) if m.dst == CONTAINER_CACHE else m for m in n.mounts))


def home_cache_dir(runtime: str, n: NodeRun) -> str | None:
    """The folder in the user's home (on the host) that must exist before the cache can be mounted over it."""
    if runtime in USER_HOME and any(m.dst == CONTAINER_CACHE for m in n.mounts):
        return f"$HOME/{HOME_CACHE}"
    return None


def _command(runtime: str, n: NodeRun, device: str, image: str) -> list[str]:
    if runtime == "docker":
        argv = n.argv()
        argv[argv.index("-d")] = "--rm"
        return argv
    if runtime == "podman":
        a = ["podman", "run", "--rm", "--name", n.name, "--network", "host", "--shm-size", n.shm_size,
             "--ulimit", "memlock=$(hard_limit l)",   # the node's own limit, as Slurm set it (NCCL/IB)
             "--add-host", "$(hostname):$NODE_IP",     # Gloo resolves the node's hostname
             "-w", WORKDIR, *n.cli_flags()]
        for d in n.devices:
            a += ["--device", d]
        if n.group_add:
            a += ["--group-add", "keep-groups"]
        if n.gpus:
            a += ["--device", "nvidia.com/gpu=all"]   # CDI
        return a + [image, *n.command]
    if runtime == "apptainer":
        a = ["apptainer", "exec", "--cleanenv", "--pwd", WORKDIR]
        if device == "cuda":
            a.append("--nv")
        elif device == "rocm":
            a.append("--rocm")
        for m in n.mounts:
            a += ["--bind", f"{m.src}:{m.dst}:{'ro' if m.ro else 'rw'}"]
        for k, v in n.env.items():
            a += ["--env", f"{k}={v}"]
        return a + [image, *n.command]
    if runtime == "charliecloud":
        # --set-env: the image's own environment (PATH to the venv); --home: the user's home, for the cache
        a = ["ch-run", "--set-env", "--home"]
        for k, v in n.env.items():
            a.append(f"--set-env={k}={v}")
        for m in n.mounts:
            a += ["-b", f"{m.src}:{m.dst}"]
        return a + ["-c", WORKDIR, image, "--", *n.command]
    return list(n.command)   # pyxis: srun runs the command inside --container-image


def srun_options(runtime: str, n: NodeRun, image: str) -> list[str]:
    """Options srun itself takes for a runtime (only pyxis lives inside srun)."""
    if runtime != "pyxis":
        return []
    mounts = ",".join(f"{m.src}:{m.dst}" + (":ro" if m.ro else "") for m in as_user(runtime, n).mounts)
    return [f"--container-image={image}", f"--container-mounts={mounts}", f"--container-workdir={WORKDIR}",
            "--container-mount-home"]


