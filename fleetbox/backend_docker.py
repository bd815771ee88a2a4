"""The Docker backend of `invoke train`: one container per node, on this machine or on `--hosts` engines.

It starts every node, streams rank 0's output live, stops every other node within seconds of the first
failure (Paddle's HTTP master does not notice a dead peer), gathers each node's logs under runs/<job-id>/,
and removes every container of the job, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
import threading
import time
from pathlib import Path

from . import ROOT, jobs, probes
from .datasets import safe_extract
from .engine import client as engine_client, image_or_none
from .errors import UserError

GRACE_S = 2.0        # after the first failure, let peers' own exits arrive (to name the real culprit)
STOP_TIMEOUT_S = 5   # SIGTERM, then SIGKILL: every node is down well within 10 s of the first failure
POLL_S = 0.25

def runs_root() -> Path:
    return Path(os.environ.get("FLEETBOX_RUNS", ROOT / "runs"))


def remote_log_dirs(spec: jobs.JobSpec) -> list[str]:
    """Per-node log folders on remote hosts (copied back when the job ends)."""
    return [f"/tmp/fleetbox-runs/{spec.job_id}/node{k}" for k in range(spec.nodes)]


def local_plan(spec: jobs.JobSpec, port: int) -> list[jobs.NodeRun]:
    """Every node on this machine: loopback master (numeric, as Paddle needs), this machine's NIC and address
    towards it, logs under runs/<job-id>/, the locked memory this machine's engine can give."""
    master_ip = "127.0.0.1"
    if spec.iface:
        jobs.check_iface(spec.iface)
    iface, own = jobs.route(master_ip)
    return jobs.plan_nodes(spec, master_ip, port, [spec.iface or iface] * spec.nodes,
                           [str(runs_root() / spec.job_id / f"node{k}") for k in range(spec.nodes)],
                           Path("/opt/hyhal").exists(), jobs.local_memlock(), [own] * spec.nodes)


class Job:
    """A running job: its plan, its engines and containers, and what happened to each node."""

    def __init__(self, spec: jobs.JobSpec, log=print):
        self.spec, self.log = spec, log
        self.dir = runs_root() / spec.job_id
        self.engines: dict[str, object] = {}
        self.containers: dict[int, object] = {}
        self.exits: list[tuple[int, int]] = []
        self.stopped: set[int] = set()   # nodes we stopped (rather than nodes that ended by themselves)
        self.finished: dict[int, str] = {}
        self.timed_out = False
        self.nodes: list[jobs.NodeRun] = []

    # -- planning against real engines --

    def engine(self, host: str):
        if host not in self.engines:
            self.engines[host] = engine_client(host or None)
        return self.engines[host]

    def prepare(self) -> list[jobs.NodeRun]:
        s = self.spec
        hosts = list(s.hosts) or [""] * s.nodes
        for host in dict.fromkeys(hosts):
            if image_or_none(self.engine(host), s.image_ref) is None:
                where = f"on {host}" if host else "here"
                raise UserError(f"image {s.image_ref} is not {where}; run `invoke build --variant {s.variant.name}`"
                                + (" there (or push it and pull it there)" if host else ""))
        if s.hosts:
            master_ip = jobs.host_address(s.hosts[0])
            port = s.port or jobs.random_port()
            probes_ = [self._probe(h, master_ip, port, check_port=(i == 0)) for i, h in enumerate(s.hosts)]
            caps = [p["memlock"] for p in probes_ if p["memlock"] != -1]
            self.nodes = jobs.plan_nodes(s, master_ip, port, [p["iface"] for p in probes_], remote_log_dirs(s),
                                         Path("/opt/hyhal").exists(), min(caps) if caps else -1,
                                         [p["local"] for p in probes_])
        else:
            if s.port:
                jobs.check_port("127.0.0.1", s.port)
            self.nodes = local_plan(s, s.port or jobs.free_port("127.0.0.1"))
        memlock = self.nodes[0].memlock
        if memlock != -1:
            self.log(f"note: the engine caps locked memory at {memlock} bytes, so containers get that, not "
                     f"unlimited (fine for Gloo/TCP; NCCL over InfiniBand needs unlimited)")
        return self.nodes

    def _probe(self, host: str, master_ip: str, port: int, check_port: bool) -> dict:
        """Ask a throwaway host-network container on `host` which NIC and own address reach the master,
        whether the port is free, and how much locked memory that engine's containers may get."""
        c = self.engine(host)
        out = c.containers.run(self.spec.image_ref, ["python", "-c", probes.source("netinfo"), master_ip, str(port)],
                               network_mode="host", remove=True, labels={jobs.LABEL_JOB: self.spec.job_id})
        info = json.loads(out.decode().strip().splitlines()[-1])
        if self.spec.iface:
            if self.spec.iface not in info["names"]:
                raise UserError(f"interface {self.spec.iface!r} does not exist on {host} "
                                f"(have: {', '.join(info['names'])})")
            return {**info, "iface": self.spec.iface}
        if check_port and not info["port_free"]:
            raise UserError(f"port {port} on {master_ip} is already in use; pick another with --port")
        if not info["iface"]:
            raise UserError(f"no interface on {host} routes to the master {master_ip}; pass --iface")
        return info

    # -- acting --

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "job.json").write_text(json.dumps({
            "job_id": self.spec.job_id, "variant": self.spec.variant.name, "nodes": self.spec.nodes,
            "procs_per_node": self.spec.procs_per_node, "image": self.spec.image_ref,
            "commands": [n.shell() for n in self.nodes]}, indent=1))
        import docker
        from concurrent.futures import ThreadPoolExecutor

        def create(n: jobs.NodeRun):
            if not n.host:
                Path(next(m.src for m in n.mounts if m.dst == jobs.LOG_DIR)).mkdir(parents=True, exist_ok=True)
            container = self.engine(n.host).containers.create(n.image, list(n.command), **n.sdk_kwargs())
            self.containers[n.rank] = container
            if n.host:   # a remote engine cannot see our files: copy the workspace in
                container.put_archive(jobs.WORKDIR, _tar_dir(self.spec.script_path.parent))

        for n in self.nodes:   # engine clients are made here, once, not from several threads
            self.engine(n.host)
        try:
            with ThreadPoolExecutor(max_workers=min(16, len(self.nodes))) as pool:
                list(pool.map(create, self.nodes))                     # all created before any starts
                list(pool.map(lambda r: self.containers[r].start(), sorted(self.containers)))
        except docker.errors.APIError as e:
            self.remove_all()
            why = (e.explanation or str(e)).strip().splitlines()[-1]
            raise UserError(f"the engine refused to start the job's containers: {why[:300]}") from None
        self.log(f"job {self.spec.job_id}: {self.spec.nodes} node(s) x {self.spec.procs_per_node} process(es), "
                 f"master {self.nodes[0].command[4]}, logs in {self.dir}")

    def stream_rank0(self) -> threading.Thread:
        def pump():
            buf = b""
            try:
                for chunk in self.containers[0].logs(stream=True, follow=True):
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        self.log(f"[node0] {line.decode(errors='replace')}")
            except Exception:   # the container went away: nothing more to show
                pass
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        return t

    def watch(self, timeout: float | None = None) -> None:
        """Until every node exited, or the first failure (plus a short grace) stops the rest."""
        deadline = time.monotonic() + timeout if timeout else None
        first_fail = None
        while True:
            for rank, c in self.containers.items():
                if rank in dict(self.exits):
                    continue
                c.reload()
                if c.status in ("exited", "dead"):
                    self.exits.append((rank, c.attrs["State"]["ExitCode"]))
                    if self.exits[-1][1] != 0 and first_fail is None:
                        first_fail = time.monotonic()
                        self.log(f"node{rank} (rank {rank}) exited with code {self.exits[-1][1]}; "
                                 f"stopping the other nodes")
            if len(self.exits) == len(self.containers):
                return
            if first_fail is not None and time.monotonic() - first_fail >= GRACE_S:
                self.stop_all()
                return
            if deadline and time.monotonic() > deadline:
                self.log(f"timeout after {timeout:.0f} s; stopping every node")
                self.timed_out = True
                self.stop_all()
                return
            time.sleep(POLL_S)

    def stop_all(self) -> None:
        seen = dict(self.exits)
        self.stopped |= {r for r in self.containers if r not in seen}
        threads = [threading.Thread(target=_stop, args=(c,)) for c in self.containers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for rank, c in self.containers.items():
            if rank not in seen:
                try:
                    c.reload()
                    self.exits.append((rank, c.attrs["State"]["ExitCode"]))
                except Exception:
                    self.exits.append((rank, 137))

    def gather(self) -> None:
        for rank, c in self.containers.items():
            d = self.dir / f"node{rank}"
            d.mkdir(parents=True, exist_ok=True)
            try:
                c.reload()
                self.finished[rank] = c.attrs["State"].get("FinishedAt", "")
                (d / "container.log").write_bytes(c.logs())
                if self.nodes[rank].host:   # remote: the log folder lives on that host; copy it out
                    bits, _ = c.get_archive(jobs.LOG_DIR + "/.")   # the folder's content, not the folder
                    with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                        safe_extract(tar, d)
            except Exception as e:
                (d / "gather-error.txt").write_text(str(e))

    def remove_all(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        def remove(c):
            try:
                c.remove(force=True)
            except Exception:
                pass
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(self.containers)))) as pool:
            list(pool.map(remove, self.containers.values()))

    def summary(self) -> dict:
        exits = dict(self.exits)
        bad = jobs.culprit(self.exits)
        rows = []
        for n in self.nodes:
            code = exits.get(n.rank)
            state = ("ok" if code == 0 else "FAILED" if n.rank == bad else "stopped" if n.rank in self.stopped
                     else "aborted" if code else "?")
            rows.append({"node": f"node{n.rank}", "host": n.host or "local", "rank": n.rank, "exit_code": code,
                         "state": state, "finished_at": self.finished.get(n.rank, ""),
                         "logs": str(self.dir / f"node{n.rank}")})
        result = {"job_id": self.spec.job_id, "ok": bad is None and not self.timed_out, "rows": rows,
                  "failed_rank": None if self.timed_out else bad, "timed_out": self.timed_out,
                  "smoke": _smoke_report(self.dir)}
        if result["failed_rank"] is not None:
            result["failed_exit_code"] = exits[bad]
            result["log_tail"] = _tail(self.dir / f"node{bad}")
        (self.dir / "summary.json").write_text(json.dumps(result, indent=1))
        return result


def _stop(c) -> None:
    try:
        c.stop(timeout=STOP_TIMEOUT_S)
    except Exception:
        pass


def _tar_dir(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(folder.iterdir()):
            if p.is_file():
                tar.add(p, arcname=p.name)
    return buf.getvalue()


def _tail(node_dir: Path, lines: int = 15) -> list[str]:
    """The end of the node's most telling log: the launcher's workerlog.0, else the container output."""
    for name in ("workerlog.0", "container.log"):
        p = node_dir / name
        if p.exists() and p.stat().st_size:
            return p.read_text(errors="replace").rstrip().splitlines()[-lines:]
    return []


def _smoke_report(job_dir: Path) -> dict | None:
    p = job_dir / "node0" / "workerlog.0"
    for line in (p.read_text(errors="replace").splitlines() if p.exists() else []):
        if line.startswith("FLEETBOX-SMOKE "):
            return json.loads(line[len("FLEETBOX-SMOKE "):])
    return None


def table(result: dict) -> str:
    out = [f"job {result['job_id']}: {'PASSED' if result['ok'] else 'FAILED'}",
           f"  {'node':<6} {'host':<28} {'rank':>4} {'exit':>5}  {'state':<8} logs"]
    for r in result["rows"]:
        out.append(f"  {r['node']:<6} {r['host']:<28} {r['rank']:>4} {str(r['exit_code']):>5}  {r['state']:<8} "
                   f"{r['logs']}")
    smoke = result.get("smoke")
    if smoke:
        out.append(f"  smoke: loss {smoke['first_loss']:.4f} -> {smoke['last_loss']:.4f}, parameters identical on "
                   f"{smoke['world']} ranks: {smoke['params_identical']}, {smoke['samples_per_s']:.0f} samples/s")
    if result.get("failed_rank") is not None:
        out.append(f"  node{result['failed_rank']} (rank {result['failed_rank']}) failed with exit code "
                   f"{result['failed_exit_code']}; last lines of its log:")
        out += [f"    | {ln}" for ln in result.get("log_tail", [])]
    return "\n".join(out)


def dry_run(spec: jobs.JobSpec) -> list[jobs.NodeRun]:
    """The exact containers, without starting anything. Uses this machine's facts for a local job; for
    --hosts, the NIC is --iface or a placeholder (it is found on each host when the job really starts)."""
    if spec.hosts:
        iface = spec.iface or "<NIC that routes to the master on that host; pass --iface>"
        return jobs.plan_nodes(spec, jobs.host_address(spec.hosts[0]), spec.port or 29500, [iface] * spec.nodes,
                               remote_log_dirs(spec), node_ips=[jobs.host_address(h) for h in spec.hosts])
    return local_plan(spec, spec.port or jobs.free_port("127.0.0.1"))


def run(spec: jobs.JobSpec, log=print, timeout: float | None = None) -> dict:
    """Run the job to its end; every container is removed whatever happens (Ctrl-C and SIGTERM included)."""
    job = Job(spec, log)
    job.prepare()
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        job.start()
        job.stream_rank0()
        job.watch(timeout)
    except KeyboardInterrupt:
        log(f"interrupted: stopping and removing every container of {spec.job_id}")
        job.stop_all()
        job.gather()
        job.remove_all()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    job.gather()
    job.remove_all()
    return job.summary()


def raise_interrupt(signum, frame):
    """SIGTERM (e.g. from a scheduler) takes the same cleanup path as Ctrl-C."""
    raise KeyboardInterrupt


def clean(hosts: list[str], log=print) -> int:
    """Remove every fleetbox job container left on these engines (by label). Returns how many."""
    n = 0
    for host in hosts or [""]:
        c = engine_client(host or None)
        for container in c.containers.list(all=True, filters={"label": jobs.LABEL_JOB}):
            container.remove(force=True)
            log(f"removed {container.name} ({container.labels.get(jobs.LABEL_JOB)}) on {host or 'this machine'}")
            n += 1
    return n
