"""Test hosts made by the tests: network namespaces on one bridge, each with its own Docker Engine.

    root ns  fbr0 10.213.77.1/24 ─┐
                                  ├─ br0 (in namespace fbfab, away from Docker's FORWARD rules)
    fbn1     fbn1e 10.213.77.11 ──┤   dockerd on tcp://10.213.77.11:2375
    fbn2     fbn2e 10.213.77.12 ──┘   dockerd on tcp://10.213.77.12:2375

Two such fabrics, with names and addresses of their own, so that their tests run side by side: SLURM's hosts
(fbn*, 10.213.77.0/24) are the Slurm test cluster's nodes, RIG's (fbh*, 10.213.78.0/24) the multi-engine rig's.
Every address is inside namespaces these tests create. dockerd is started with `nsenter --net` (not
`ip netns exec`, which remounts /sys and hides the cgroup filesystem).
"""
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

STATE = Path("/var/lib/fleetbox-test")     # engines' data roots: kept, so a loaded image is reused next time
RUN = Path("/run/fleetbox-test")


def sh(*cmd, check=True):
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def stop_daemon(pidfile: Path, seconds: float = 20) -> None:
    """SIGTERM the daemon named by its pidfile and wait until it is gone (or `seconds` pass)."""
    if pidfile.exists():
        try:
            pid = int(pidfile.read_text())
            os.kill(pid, signal.SIGTERM)
            for _ in range(int(seconds / 0.2)):
                try:   # our own child (started by Popen) lingers as a zombie, which kill(pid, 0) still finds
                    if os.waitpid(pid, os.WNOHANG)[0]:
                        return
                except ChildProcessError:
                    pass
                os.kill(pid, 0)
                time.sleep(0.2)
        except (ProcessLookupError, ValueError):
            pass


@dataclass(frozen=True)
class Fabric:
    prefix: str   # host k's namespace is {prefix}k, its interface {prefix}ke; the bridge's namespace {prefix}fab
    subnet: str   # host k is {subnet}.{10 + k}; this machine, the hosts' route out, {subnet}.1

    def ns(self, k: int) -> str:
        return f"{self.prefix}{k}"

    def iface(self, k: int) -> str:
        return f"{self.prefix}{k}e"

    def addr(self, k: int) -> str:
        return f"{self.subnet}.{10 + k}"

    def _pid(self, k: int) -> Path:
        return RUN / f"{self.ns(k)}.pid"

    def teardown(self, n=2):
        for k in range(1, n + 1):
            stop_daemon(self._pid(k))
        sh("ip", "link", "del", f"{self.prefix}r0", check=False)   # a leftover veth makes the next setup fail
        for ns in [self.ns(k) for k in range(1, n + 1)] + [f"{self.prefix}fab"]:
            sh("ip", "netns", "del", ns, check=False)

    def network(self, n=2) -> list[str]:
        """Make the namespaces and the bridge (no engines); returns the hosts' addresses."""
        self.teardown(n)
        fab, out = f"{self.prefix}fab", f"{self.prefix}r0"
        sh("ip", "netns", "add", fab)
        sh("ip", "-n", fab, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", fab, "link", "set", "br0", "up")
        sh("ip", "link", "add", out, "type", "veth", "peer", "name", f"{out}p")
        sh("ip", "link", "set", f"{out}p", "netns", fab)
        sh("ip", "-n", fab, "link", "set", f"{out}p", "master", "br0", "up")
        sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", out)
        sh("ip", "link", "set", out, "up")
        for k in range(1, n + 1):
            ns, ip, e = self.ns(k), self.addr(k), self.iface(k)
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", e, "type", "veth", "peer", "name", f"{ns}p")
            sh("ip", "link", "set", e, "netns", ns)
            sh("ip", "link", "set", f"{ns}p", "netns", fab)
            sh("ip", "-n", fab, "link", "set", f"{ns}p", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", e)
            sh("ip", "-n", ns, "link", "set", e, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "route", "add", "default", "via", f"{self.subnet}.1")
        return [self.addr(k) for k in range(1, n + 1)]

    def setup(self, n=2) -> list[str]:
        """Make the fabric and start one engine per host; returns the engines' URLs."""
        addrs = self.network(n)
        urls = []
        RUN.mkdir(parents=True, exist_ok=True)
        for k, ip in enumerate(addrs, 1):
            ns = self.ns(k)
            (STATE / ns).mkdir(parents=True, exist_ok=True)
            log = open(RUN / f"{ns}.log", "w")
            subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "dockerd", "-H", f"tcp://{ip}:2375",
                              "--data-root", str(STATE / ns), "--exec-root", str(RUN / ns),
                              "--pidfile", str(self._pid(k)), "--bridge", "none", "--iptables=false",
                              "--ip-masq=false", "--tls=false"],
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            urls.append(f"tcp://{ip}:2375")
        for url in urls:
            deadline = time.monotonic() + 90
            while sh("docker", "-H", url, "info", check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"engine {url} did not come up; see {RUN}")
                time.sleep(0.5)
        for url in urls:   # the data roots are kept (the image): an earlier run killed mid-test left its containers
            left = sh("docker", "-H", url, "ps", "-aq").stdout.split()
            if left:
                print(f"fabric: removing {len(left)} container(s) an earlier run left on {url}")
                sh("docker", "-H", url, "rm", "-f", *left)
            if vols := sh("docker", "-H", url, "volume", "ls", "-q").stdout.split():
                sh("docker", "-H", url, "volume", "rm", "-f", *vols)
        return urls


SLURM = Fabric("fbn", "10.213.77")   # the Slurm test cluster's nodes (tests/slurmcluster.py)
RIG = Fabric("fbh", "10.213.78")     # the multi-engine rig's hosts (tests/integration/test_multihost.py)


def load_image(urls: list[str], ref: str) -> None:
    """Give every engine the image (skipped where it already has the same ID)."""
    want = sh("docker", "image", "inspect", "-f", "{{.Id}}", ref).stdout.strip()
    todo = [u for u in urls
            if sh("docker", "-H", u, "image", "inspect", "-f", "{{.Id}}", ref, check=False).stdout.strip() != want]
    procs = []
    for u in todo:
        save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE)
        procs.append((subprocess.Popen(["docker", "-H", u, "load", "-q"], stdin=save.stdout,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE), save))
        save.stdout.close()
    for load, save in procs:
        out, err = load.communicate(timeout=900)
        save.wait()
        if load.returncode != 0:
            raise RuntimeError(f"docker load failed: {err.decode()[-500:]}")
