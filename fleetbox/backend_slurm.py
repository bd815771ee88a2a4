"""The Slurm backend of `invoke train`: the same JobSpec, rendered as an sbatch script, submitted and followed.

One srun task per node (`--kill-on-bad-exit=1 --wait=60`); the master is the first host of the allocation,
resolved to a numeric IP; rank = $SLURM_NODEID, nnodes = $SLURM_NNODES; the node's NIC and own address are
found on the node itself. The container is started by the chosen runtime (see runtimes.py).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import hpc, jobs, probes, runtimes
from .backend_docker import raise_interrupt, runs_root
from .errors import UserError

NODE_VARS = {"rank": "$SLURM_NODEID", "master": "$MASTER_IP", "port": "$MASTER_PORT", "iface": "$IFACE",
             "node_ip": "$NODE_IP"}

# The node's NIC and own address towards the master, found on the node (iproute2); on the master itself
# `ip route get` answers "local ... dev lo", so the interface holding the address is looked up instead.
ROUTE_SH = r'''route_to() {
  local out dev src
  out=$(ip -o route get "$1")
  dev=$(sed -n 's/.* dev \([^ ]*\).*/\1/p' <<<"$out")
  src=$(sed -n 's/.* src \([^ ]*\).*/\1/p' <<<"$out")
  if [ "$dev" = lo ] && [ "${1#127.}" = "$1" ]; then
    dev=$(ip -o -4 addr show | awk -v ip="$1" 'index($4, ip "/") == 1 {print $2; exit}')
    src=$1
  fi
  echo "$dev $src"
}'''

@dataclass(frozen=True)
class SlurmJob:
    spec: jobs.JobSpec
    runtime: str
    image: str
    partition: str = ""
    time_limit: str = ""
    account: str = ""
    port: int = 29500
    runtime_args: tuple[str, ...] = ()   # site-specific runtime options, e.g. podman --ulimit values

    @property
    def dir(self) -> Path:
        return runs_root() / self.spec.job_id


def template_node(sj: SlurmJob) -> jobs.NodeRun:
    """Node 0's container with every per-node value replaced by the shell variable that carries it."""
    s = sj.spec
    (n,) = jobs.plan_nodes(replace(s, nodes=1, hosts=()), NODE_VARS["master"], 0, [NODE_VARS["iface"]],
                           [str(sj.dir / "node$SLURM_NODEID")], node_ips=[NODE_VARS["node_ip"]])
    cmd = [c for c in n.command]
    cmd[cmd.index("--master") + 1] = "$MASTER_IP:$MASTER_PORT"
    cmd[cmd.index("--nnodes") + 1] = "$SLURM_NNODES"
    cmd[cmd.index("--rank") + 1] = NODE_VARS["rank"]
    env = {**n.env, "FLEETBOX_NODE": NODE_VARS["rank"], "FLEETBOX_SLURM_JOB": "$SLURM_JOB_ID"}
    labels = {**n.labels, jobs.LABEL_NODE: "node$SLURM_NODEID", jobs.LABEL_RANK: NODE_VARS["rank"]}
    return replace(n, name=f"fleetbox-{s.job_id}-node$SLURM_NODEID", command=tuple(cmd), env=env, labels=labels)


def render_node_script(sj: SlurmJob) -> str:
    """What every srun task runs on its node."""
    n = template_node(sj)
    lines = ["#!/bin/bash", f"# fleetbox {sj.spec.job_id}: one node's part (runtime {sj.runtime}); "
             f"run by srun on every node", "set -euo pipefail", 'export USER="${USER:-$(id -un)}"']
    if sj.runtime == "podman":
        lines.append('hard_limit() { local v; v=$(ulimit -H"$1"); [ "$v" = unlimited ] && v=-1; echo "$v:$v"; }')
    if sj.runtime == "pyxis":
        # the wrapper runs inside the image (Python, no iproute2): the same probe the Docker backend uses
        src = runtimes.q(probes.source("netinfo"))
        lines.append(f'read -r IFACE NODE_IP <<<"$(python -c {src} "$MASTER_IP" --plain)"')
    else:
        lines.append(ROUTE_SH)
        lines.append('read -r IFACE NODE_IP <<<"$(route_to "$MASTER_IP")"')
    if sj.spec.iface:
        lines.append(f"IFACE={runtimes.q(sj.spec.iface)}")
    lines += ['[ -n "$IFACE" ] || { echo "fleetbox: no interface on $(hostname) routes to $MASTER_IP" >&2; exit 2; }',
              'echo "fleetbox: node $SLURM_NODEID on $(hostname): $IFACE $NODE_IP -> master $MASTER_IP:$MASTER_PORT"']
    if sj.runtime != "pyxis":   # the node's log folder and, for runtimes run as the user, the cache's mount point
        made = [str(sj.dir / "node$SLURM_NODEID"), runtimes.home_cache_dir(sj.runtime, n)]
        lines.append("mkdir -p " + runtimes.words([d for d in made if d]))
    else:   # inside the container: the variables the launcher needs
        lines += [f"export {k}={runtimes.q(v)}" for k, v in n.env.items()]
    run = runtimes.words(runtimes.command(sj.runtime, n, sj.spec.variant.device, sj.image, list(sj.runtime_args)))
    if sj.runtime in ("docker", "podman"):
        # A killed client leaves its container running: remove it when Slurm stops this task, at once (Slurm
        # sends SIGKILL after KillWait, which may be shorter than podman's 10 s graceful stop).
        rm = f"{sj.runtime} rm -f" + (" --time 0" if sj.runtime == "podman" else "")
        lines += [f'trap \'{rm} "{n.name}" >/dev/null 2>&1; exit 143\' TERM INT',
                  f"{run} &", "wait $!"]
    else:
        lines.append("exec " + run)
    return "\n".join(lines) + "\n"


def render_sbatch(sj: SlurmJob) -> str:
    s = sj.spec
    n = template_node(sj)
    head = ["#!/bin/bash", f"#SBATCH --job-name=fleetbox-{s.job_id}", f"#SBATCH --nodes={s.nodes}",
            "#SBATCH --ntasks-per-node=1", f"#SBATCH --output={sj.dir}/slurm-%j.out"]
    for flag, val in (("partition", sj.partition), ("time", sj.time_limit), ("account", sj.account)):
        if val:
            head.append(f"#SBATCH --{flag}={val}")
    if s.variant.device == "cuda" and not s.devices:
        head.append(f"#SBATCH --gpus-per-node={s.gpus_per_node or 1}")
    body = [
        "set -euo pipefail",
        "# the master: first host of the allocation, as a numeric IP (Paddle's master needs one)",
        'MASTER_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_ADDR=$(scontrol show node \"$MASTER_HOST\" -o | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')",
        "MASTER_IP=$(getent ahostsv4 \"${MASTER_ADDR:-$MASTER_HOST}\" | awk 'NR == 1 {print $1}')",
        f"MASTER_PORT={sj.port}",
        "export MASTER_IP MASTER_PORT",
        'echo "fleetbox: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, master $MASTER_HOST = $MASTER_IP:$MASTER_PORT"',
    ]
    if sj.runtime == "pyxis" and (home_cache := runtimes.home_cache_dir(sj.runtime, n)):
        # the dataset cache's mount point in the (shared) home; Pyxis mounts before node.sh runs
        body.append(f"mkdir -p {runtimes.q(home_cache)}")
    body += [
        "set +e",
        runtimes.words(["srun", "--kill-on-bad-exit=1", "--wait=60", "--nodes=$SLURM_NNODES", "--ntasks-per-node=1",
                        f"--output={sj.dir}/node%n.log", *runtimes.srun_options(sj.runtime, n, sj.image),
                        "bash", str(sj.dir / "node.sh")]),
        "rc=$?",
    ]
    if sj.runtime in ("docker", "podman"):   # whatever a killed task left behind, on every node
        rt = sj.runtime
        body.append(f"srun --nodes=$SLURM_NNODES --ntasks-per-node=1 --output=/dev/null bash -c "
                    f"'{rt} ps -aq --filter label={jobs.LABEL_JOB}={s.job_id} | xargs -r {rt} rm -f' || true")
    body.append('exit "$rc"')
    return "\n".join(head + body) + "\n"


# ---- acting: submit, follow, gather ----

def _slurm(*argv, check=True) -> subprocess.CompletedProcess:
    if not shutil.which(argv[0]):
        raise UserError(f"{argv[0]} not found: run on a Slurm login node (or install Slurm's client tools)")
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise UserError(f"{argv[0]} failed: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return proc


def submit(sj: SlurmJob) -> str:
    sj.dir.mkdir(parents=True, exist_ok=True)
    (sj.dir / "node.sh").write_text(render_node_script(sj))
    (sj.dir / "job.sbatch").write_text(render_sbatch(sj))
    out = _slurm("sbatch", "--parsable", str(sj.dir / "job.sbatch")).stdout.strip()
    return out.split(";")[0]


def job_state(job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) from scontrol; works without accounting while the job is remembered."""
    out = _slurm("scontrol", "show", "job", job_id, "-o", check=False).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"ExitCode=(\S+)", out)
    return (state.group(1) if state else "UNKNOWN"), (code.group(1) if code else "")


FAILED_TASK = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-\d+)?: (?:Exited with exit code (\d+)|(Killed|Terminated))")


def failures(batch_output: str) -> list[tuple[int, int, str]]:
    """(rank, exit code, node) of failed tasks, in the order srun reported them (one task per node)."""
    out = []
    for m in FAILED_TASK.finditer(batch_output):
        code = int(m.group(3)) if m.group(3) else 137
        out.append((int(m.group(2)), code, m.group(1)))
    return out


def follow(sj: SlurmJob, job_id: str, log=print, poll: float = 1.0) -> dict:
    """Stream node 0's output until the job ends; scancel on Ctrl-C/SIGTERM; return a summary."""
    log(f"submitted Slurm job {job_id} ({sj.spec.nodes} nodes, runtime {sj.runtime}); logs in {sj.dir}")
    node0, pos, state = sj.dir / "node0.log", 0, "PENDING"
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        while True:
            if node0.exists():
                with open(node0, errors="replace") as f:
                    f.seek(pos)
                    chunk = f.read()
                    pos = f.tell()
                for line in chunk.splitlines():
                    log(f"[node0] {line}")
            state, code = job_state(job_id)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        log(f"interrupted: scancel {job_id}")
        subprocess.run(["scancel", job_id], capture_output=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    batch = sj.dir / f"slurm-{job_id}.out"
    text = batch.read_text(errors="replace") if batch.exists() else ""
    fails = failures(text)
    bad = jobs.culprit([(r, c) for r, c, _ in fails])
    result = {"job_id": sj.spec.job_id, "slurm_job": job_id, "state": state, "exit_code": code,
              "ok": state == "COMPLETED" and not fails, "runtime": sj.runtime, "failed_rank": bad,
              "tasks": [{"rank": r, "exit_code": c, "node": n} for r, c, n in fails]}
    if bad is not None:
        r, c, n = next(f for f in fails if f[0] == bad)
        result.update(failed_node=n, failed_exit_code=c)
        p = sj.dir / f"node{bad}.log"
        result["log_tail"] = p.read_text(errors="replace").splitlines()[-15:] if p.exists() else []
    (sj.dir / "summary.json").write_text(json.dumps(result, indent=1))
    return result


def table(result: dict) -> str:
    out = [f"slurm job {result['slurm_job']} ({result['job_id']}, {result['runtime']}): {result['state']}, "
           f"exit {result['exit_code']}"]
    for t in result["tasks"]:
        out.append(f"  rank {t['rank']} on {t['node']}: exit code {t['exit_code']}")
    if result.get("failed_rank") is not None:
        out.append(f"  {result['failed_node']} (rank {result['failed_rank']}) failed with exit code "
                   f"{result['failed_exit_code']}; last lines of its log:")
        out += [f"    | {ln}" for ln in result.get("log_tail", [])]
    return "\n".join(out)


def make(spec: jobs.JobSpec, runtime: str, image: str = "", partition: str = "", time_limit: str = "",
         account: str = "", port: int = 0, runtime_args: str = "") -> SlurmJob:
    import shlex
    runtimes.check(runtime)
    img = image or hpc.runtime_image(spec.variant, runtime, spec.image_ref)
    return SlurmJob(spec, runtime, img, partition, time_limit, account,
                    port or jobs.random_port(), tuple(shlex.split(runtime_args)))
