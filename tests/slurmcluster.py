"""A real Slurm cluster made by the tests: slurmctld here, one slurmd per node namespace; 3 nodes, so that a
2-node job can keep a spare.

Nodes are fabric.SLURM's namespaces (fbn1, fbn2, ... with their own addresses). Each slurmd gets its own UTS
namespace (hostname nodeN) and enters the node's network namespace with nsenter (not `ip netns exec`,
which remounts /sys so slurmd finds no cgroup filesystem). Clients use SLURM_CONF.

Like a site's, the cluster gives a job only what it asked for: CPUs and memory are consumable (select/cons_tres,
CR_Core_Memory), each task is bound to its CPUs (task/affinity) and, where cgroup v1's cpuset and memory
controllers are mounted (this machine's), confined to them and to its memory (task/cgroup: ConstrainCores,
ConstrainRAMSpace).

Like a login node's own disk, LOGIN_ONLY is seen here and by no node: a tmpfs here, and
each slurmd runs in a mount namespace of its own (slave: later mounts here still reach it) with an empty tmpfs over
that folder.
"""
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests import fabric


def _munge(d: Path):
    """Start munged unless it runs; remember that we did, so stop() ends it again."""
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["chown", "munge:munge", "/run/munge"], check=True)
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
        (d / "started-munged").touch()


CPUS, MEMORY_MB = os.cpu_count() or 1, 4000   # each node's: every CPU of this machine, a share of its memory
CGROUP_V1 = Path("/sys/fs/cgroup/cpuset/cpuset.cpus"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")


# What every user's jobs read, as on a site: the configuration (a job's SLURM_CONF is slurmd's) and slurmd's spool
# (a batch script runs from there), outside the cluster's own folder (a test's temporary folder, root's alone)
SITE = Path("/var/lib/fleetbox-test-slurm")
SPOOL = SITE / "spool"
LOGIN_ONLY = SITE / "login-only"   # only this machine sees it: a tmpfs here, each node's own empty one there


def controller_pid() -> int:
    """slurmctld's process id (its pid file, named in the cluster's slurm.conf)."""
    conf = (SITE / "slurm.conf").read_text()
    return int(Path(conf.split("SlurmctldPidFile=")[1].split()[0]).read_text())


def confines() -> bool:
    """Slurm's task/cgroup can confine tasks here: cgroup v1 with the cpuset and memory controllers."""
    return all(p.exists() for p in CGROUP_V1)


def conf(d: Path, addrs: list[str]) -> str:
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(f"NodeName=node{k} NodeAddr={ip} CPUs={CPUS} RealMemory={MEMORY_MB} State=UNKNOWN"
                      for k, ip in enumerate(addrs, 1))
    tasks = "ProctrackType=proctrack/cgroup\nTaskPlugin=task/cgroup,task/affinity" if confines() else \
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/affinity"
    return f"""ClusterName=fleetboxtest
SlurmctldHost={host}({fabric.SLURM.subnet}.1)
SlurmUser=root
AuthType=auth/munge
# a requeued job waits cred_expire before it starts again (default 120 s; Slurm takes no less than 5): a job
# step's credential must still reach its node within it, so not the least
AuthInfo=cred_expire=10
JobRequeue=1
{tasks}
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=5
StateSaveLocation={d}/state
SlurmdSpoolDir={SPOOL}/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
{nodes}
PartitionName=debug Nodes={','.join(f'node{k}' for k in range(1, len(addrs) + 1))} Default=YES MaxTime=INFINITE State=UP
"""


HOSTS = Path("/etc/hosts")
HOSTS_MARK = "# fleetbox test cluster"


def _names(addrs: list[str] | None) -> None:
    """The nodes' names in /etc/hosts while the cluster runs (None: taken out), as a site's DNS or hosts file
    has them: Paddle's launcher resolves its node's host name (getfqdn), which otherwise waits for the
    resolver's timeout (10 s here) in every launcher and rank. Rewritten in place: it may be a bind mount."""
    lines = [ln for ln in HOSTS.read_text().splitlines() if not ln.endswith(HOSTS_MARK)]
    lines += [f"{ip} node{k} {HOSTS_MARK}" for k, ip in enumerate(addrs or [], 1)]
    with open(HOSTS, "r+") as f:
        f.write("\n".join(lines) + "\n")
        f.truncate()


NODES = 3


def start(d: Path, n: int = NODES) -> dict:
    addrs = fabric.SLURM.network(n)
    _names(addrs)
    _munge(d)
    (d / "state").mkdir(parents=True, exist_ok=True)
    subprocess.run(["umount", "--lazy", str(LOGIN_ONLY)], capture_output=True)   # an earlier cluster's
    shutil.rmtree(SITE, ignore_errors=True)
    for k in range(1, n + 1):
        (SPOOL / f"node{k}").mkdir(parents=True, exist_ok=True)
    (SITE / "slurm.conf").write_text(conf(d, addrs))   # cgroup.conf is read from slurm.conf's folder
    (SITE / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainCores=yes\nConstrainRAMSpace=yes\n")
    env = {**os.environ, "SLURM_CONF": str(SITE / "slurm.conf")}
    hidden = LOGIN_ONLY
    hidden.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "fleetbox-login-only", str(hidden)], check=True)
    subprocess.run(["slurmctld", "-f", str(SITE / "slurm.conf")], check=True, env=env)
    for k in range(1, n + 1):
        netns = f"/run/netns/{fabric.SLURM.ns(k)}"
        subprocess.run(["unshare", "--uts", "--mount", "--propagation", "slave", "sh", "-c",
                        f"hostname node{k}; mount -t tmpfs -o size=1m fleetbox-node-local {hidden} && "
                        f"exec nsenter --net={netns} slurmd -N node{k} -f {SITE / 'slurm.conf'}"],
                       check=True, env=env)
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, env=env).stdout
        if out.count("idle") == n:
            return {"SLURM_CONF": str(SITE / "slurm.conf")}
        if time.monotonic() > deadline:
            raise RuntimeError(f"the test cluster did not come up: {out!r}; logs in {d}")
        time.sleep(0.5)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop(d: Path, n: int = NODES) -> None:
    pids = []
    for p in [d / "slurmctld.pid"] + [d / f"slurmd-node{k}.pid" for k in range(1, n + 1)]:
        try:
            pids.append(int(p.read_text()))
            os.kill(pids[-1], signal.SIGTERM)
        except (OSError, ValueError):
            pass
    # a slurmd busy ending a job step can outlive its SIGTERM (one was still running, in a namespace already
    # removed, minutes after its cluster stopped): wait for each, then kill what is left
    deadline = time.monotonic() + 15
    while (alive := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in alive:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    subprocess.run(["umount", "--lazy", str(LOGIN_ONLY)], capture_output=True)
    shutil.rmtree(SITE, ignore_errors=True)
    if (d / "started-munged").exists():
        subprocess.run(["pkill", "-x", "munged"], capture_output=True)
    fabric.SLURM.teardown(n)
    _names(None)
