"""The Docker backend: one container per node, on this machine or on `--hosts` engines.

It starts every node, streams rank 0's output live, stops every other node within seconds of the first
failure (Paddle's HTTP master does not notice a dead peer), gathers each node's logs under runs/<job-id>/,
and removes every container of the job, also on Ctrl-C, SIGTERM and engine errors.
On `--hosts` engines the logs stay in each container (no folder on that host) and are copied out at the end.
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from fleetbox import ROOT, engine, files, incontainer, settings
from fleetbox import options as options_mod
from fleetbox.archives import safe_extract
from fleetbox.errors import Failed, NodeRefused, UserError
from fleetbox.options import Option
from fleetbox.processes import process_start, this_host
from fleetbox.run import checkpoints, hang, hostnet, placeholders, records, shell
from fleetbox.run import plan as planner
from fleetbox.run import spec as spec_mod
from fleetbox.run.backend import CANCELLED, Capabilities, Doctoring, Plan, job_ended, mark_cancelled
from fleetbox.run.backends import restarts, runtimes
from fleetbox.run.backends.restarts import ClientRestarts
from fleetbox.run.jobfolder import Layout
from fleetbox.run.judge import JobFacts, NodeFacts, judge
from fleetbox.run.records import Handle, JobInfo, JobState, SupervisedHandle
from fleetbox.run.result import JobResult, last_words, smoke_report

GRACE_S = 2.0        # after the first failure, let peers' own exits arrive (to name the real culprit)
STOP_TIMEOUT_S = 5   # SIGTERM, then SIGKILL: every node is down well within 10 s of the first failure
POLL_S = 0.25
REMOVED = "containers removed"   # what CANCELLED says once `invoke cancel` removed them itself: the job has ended
OUTPUT = "container.log"   # a node's container output, in its node folder (the layout's output)


@dataclass(frozen=True)
class DockerPlan(Plan):
    nodes: tuple[planner.NodeRun, ...]    # every node's container, placeholders filled
    checkpoints: str = ""                  # the checkpoint folder here, or (--hosts) each engine's volume
    template: planner.NodeRun | None = None   # the nodes before their placeholders were filled ...
    values: tuple[dict, ...] = ()             # ... with these values (a restart fills them again)
    attempt: int = 0
    image_id: str = ""                        # node 0's image, for the run's report
    content_tag: str = ""
    paddle: str = ""                          # the image's Paddle version, where it says (our images' label)
    spares: tuple[dict, ...] = ()             # --spare-nodes left, in order: {host, iface, local} as probed

    @property
    def elsewhere(self) -> bool:
        """The nodes run on other machines' engines (--hosts): no folder here is theirs."""
        return any(n.host for n in self.nodes)


@dataclass
class DockerHandle(SupervisedHandle):
    """A Docker job: its engines, and the process that follows it (an attached `invoke train`, or a detached
    job's supervisor)."""
    hosts: list[str] = field(default_factory=list)   # the engines ("" for this machine)

    def checkpoints_here(self) -> str:
        return "" if any(self.hosts) else super().checkpoints_here()   # --hosts: on the other machines


def argv(n: planner.NodeRun) -> list[str]:
    """The `docker run -d` command that creates and starts node `n`'s container (what --dry-run prints)."""
    return ["docker", *(["-H", n.host] if n.host else []), "run", "-d", *runtimes.run_flags(n), n.image, *n.command]


def shell_line(n: planner.NodeRun) -> str:
    return shell.line(argv(n))


def sdk_kwargs(n: planner.NodeRun) -> dict:
    """The same container for the Docker SDK's containers.create (image and command excluded)."""
    import docker.types  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
    kw = {"name": n.name, "network_mode": "host", "shm_size": n.shm_size, "working_dir": settings.WORKDIR,
          "ulimits": [docker.types.Ulimit(name="memlock", soft=n.memlock, hard=n.memlock),
                      docker.types.Ulimit(name="stack", soft=planner.STACK_BYTES, hard=planner.STACK_BYTES)],
          "labels": dict(n.labels),
          # a variable passed by name, from this process's environment, as the CLI's `-e NAME` does
          "environment": {**n.env, **{k: os.environ[k] for k in n.pass_env if k in os.environ}},
          "volumes": [f"{m.src}:{m.dst}:{'ro' if m.ro else 'rw'}" for m in n.mounts]}
    return {**kw, **engine.device_kwargs(n.devices, n.group_add, n.security_opt, n.gpus)}


DEVICE_ID = re.compile(r"[0-9]+|GPU-[0-9A-Fa-f-]+")   # an index, or an NVIDIA/AMD UUID


def check_devices(devices: str, sharing: int, each: int, procs: int) -> None:
    """--devices, split in order among the `sharing` nodes of one machine, gives each node `each` devices, one
    per process, without overlap."""
    ids = devices.split(",")
    if not all(DEVICE_ID.fullmatch(i) for i in ids):
        raise UserError(f"--devices {devices!r}: give device ids separated by commas, e.g. 0,1")
    if len(set(ids)) != len(ids):
        raise UserError(f"--devices {devices} names a device twice: two processes would share it")
    if len(ids) % sharing:
        raise UserError(f"--devices {devices}: {len(ids)} device(s) cannot be split evenly among {sharing} "
                        f"nodes on this machine")
    if len(ids) // sharing != each:
        raise UserError(f"--devices {devices}: {len(ids)} device(s) for {sharing} node(s) of {procs} process(es) "
                        f"each; each process needs its own device")


class _Broken(UserError):
    """A --hosts engine that cannot run the job (unreachable, no image, its probe failed): with --spare-nodes a
    spare takes its place; without, the line the user reads."""

    def __init__(self, message: str, host: str, brief: str = ""):
        super().__init__(message)
        self.host, self.brief = host, brief or message   # brief: as a note says it, where a spare took its place


def assign(hosts: tuple[str, ...], nodes: int, broken: dict[str, str]) \
        -> tuple[list[str], list[str], tuple[str, ...], tuple[dict, ...]]:
    """--hosts' first `nodes` are the nodes, the rest the spares; a host that failed its check at start (`broken`:
    why) is left out, the first spare left taking a node's place. Returns the nodes' hosts, the spares left, a note
    for each host left out, and the nodes' left out (Plan.replaced)."""
    spares = [h for h in hosts[nodes:] if h not in broken]
    chosen, said, replaced = [], (), ()
    for k, host in enumerate(hosts[:nodes]):
        if host not in broken:
            chosen.append(host)
            continue
        if not spares:
            raise UserError(f"{broken[host]} (node{k}'s host, and no spare is left to take its place)")
        chosen.append(spares.pop(0))
        replaced += ({"attempt": 0, "node": k, "host": host, "by": chosen[-1], "why": broken[host], "ran": False},)
        said += (f"note: node{k}'s host {host} failed its check at start ({broken[host]}); the spare {chosen[-1]} "
                 f"takes its place",)
    said += tuple(f"note: the spare {h} failed its check at start ({broken[h]}): it is left out"
                  for h in dict.fromkeys(hosts[nodes:]) if h in broken)
    return chosen, spares, said, replaced


def renumbered(plan: DockerPlan, old: list[tuple[str, dict]], master_ip: str) -> DockerPlan:
    """The plan's nodes made again from (engine, earlier values) in order, numbered from 0 for plan.spec.nodes: each
    keeps its address, interface, devices and home; the master is at `master_ip` (without, with_spare)."""
    values = tuple(planner.node_values(k, len(old), plan.job_id, master_ip, plan.port, v["node_ip"], v["iface"],
                                       v["home"], v["user"], procs=plan.spec.procs_per_node, gpus=v["gpus"])
                   for k, (_, v) in enumerate(old))
    return replace(plan, values=values,
                   nodes=tuple(replace(plan.template, host=host).fill(v) for (host, _), v in zip(old, values)))


def node_gpus(spec: spec_mod.JobSpec, rank: int, devices: str = "", sharing: int = 0) -> str:
    """The accelerator ids node `rank` gets: each node one per process, or --gpus-per-node. The `sharing` nodes
    of one machine (0: every node) share its GPUs, so node k takes the k-th block: of `devices` in order, else
    GPUs kM .. kM+M-1; with --hosts (sharing 1) each node has its own machine's."""
    if spec.device == "cpu":
        return ""
    per, sharing = spec.gpus_each, sharing or spec.nodes
    ids = devices.split(",") if devices else [str(i) for i in range(per * sharing)]
    block = rank % sharing
    return ",".join(ids[block * per:(block + 1) * per])


class DockerBackend(ClientRestarts):
    name = "docker"
    about = "containers via Docker Engines"
    plan_type = DockerPlan
    handle_type = DockerHandle
    layout = Layout(earlier="attempt<N>", first=0, node="node<k>", output=f"node<k>/{OUTPUT}", entries={
        "attempt<N>": restarts.EARLIER,
        "CANCELLED": "Docker: stopped by `invoke cancel`, Ctrl-C, SIGTERM or a hang-up; `containers removed` once "
                     "`invoke cancel` removed them itself"})
    # restarts: the whole job again, at once, from its newest checkpoint (run); hangs: _Live.watch reads the
    # ranks' progress files
    capabilities = Capabilities(timeout=True, restarts=True, watches_hangs=True, fewer_nodes=True, spares=True)
    doctoring = Doctoring(no_driver_fix=runtimes.Docker.no_driver_fix)   # its containers: Docker Engine's
    SUPERVISOR_STOP_S = 60   # `invoke cancel`: how long a job's supervisor has to clean up before this does
    options = (
        Option("hosts", "docker backend: comma-separated Docker Engine URLs, one per node "
                        "(ssh://user@h1,ssh://user@h2); master = first; train --spare-nodes K: K more after them", (),
               kind=tuple),
        Option("devices", "docker backend: the accelerator ids the job may use, e.g. 4,5,6,7, split among the nodes "
                          "(Slurm gives each node its own: --gpus-per-node)", ""),
    )

    def __init__(self, hosts=(), devices: str = "", connect=engine.client):
        self.hosts = tuple(options_mod.items(hosts) if isinstance(hosts, str) else hosts)   # one engine per node
        self.devices = devices or ""      # the ids this machine's nodes split among them
        self.connect = connect            # host URL ("" = this machine) -> engine client; tests pass a fake
        self.engines: dict[str, object] = {}
        self.live: dict[str, _Live] = {}
        if self.hosts:   # each node's engine is another machine's
            self.capabilities = replace(type(self).capabilities, reads_here=False)

    def engine(self, host: str):
        if host not in self.engines:
            self.engines[host] = self.connect(host or None)
        return self.engines[host]

    @property
    def sharing(self) -> int:
        """Nodes that share one machine's devices: one per machine with --hosts (each has its own)."""
        return 1 if self.hosts else 0

    def settle(self, spec: spec_mod.JobSpec, procs_given: bool) -> tuple[spec_mod.JobSpec, str]:
        if procs_given or spec.variant.device == "cpu" or not self.devices:
            return spec, ""
        each = max(1, len(self.devices.split(",")) // (self.sharing or spec.nodes))   # one process per device
        return replace(spec, procs_per_node=each), "--devices"

    def check(self, spec: spec_mod.JobSpec) -> None:
        """--devices split among the nodes that share a machine (every node, unless --hosts), one per process; one
        --hosts engine per node, and no folder of this machine's given to them."""
        if self.devices:
            if spec.variant.device == "cpu":
                raise spec_mod.cpu_only(spec.variant)
            if spec.on_cpu:
                raise UserError("--gpus-per-node 0 runs on CPU: drop --devices, or give as many GPUs as processes")
            check_devices(self.devices, self.sharing or spec.nodes, spec.gpus_each, spec.procs_per_node)
        if not self.hosts:
            if spec.spare_nodes:
                raise UserError("--spare-nodes needs --hosts: the spares are the hosts after the first N (on one "
                                "machine, a restart there is the same)")
            return super().check(spec)
        if spec.spawns and len(self.hosts) > 1:
            raise spec_mod.on_one_machine(f"{spec.script} starts its own ranks (paddle.distributed.spawn)",
                                          len(self.hosts))
        spares = self.hosts[spec.nodes:]
        if len(set(spares)) != len(spares) or set(spares) & set(self.hosts[:spec.nodes]):
            raise UserError("--spare-nodes: --hosts names a spare twice, or a node's host as a spare; a spare must "
                            "be a machine no node runs on")
        if len(self.hosts) != spec.nodes + spec.spare_nodes:
            spares = f" and {spec.spare_nodes} spare(s)" if spec.spare_nodes else ""
            raise UserError(f"--hosts names {len(self.hosts)} hosts for {spec.nodes} nodes{spares}: give one per node"
                            + (", then the spares" if spares else ""))
        for flag, value, asks in (("--min-nodes", spec.min_nodes, spec.may_shrink),
                                  ("--spare-nodes", spec.spare_nodes, spec.spare_nodes and spec.max_restarts)):
            if asks and not spec.checkpoint_dir:
                raise UserError(f"{flag} {value} with --hosts needs a --checkpoint-dir every host shares: each host's "
                                f"own volume holds its own ranks' state, which the nodes after a restart cannot read")
        if spec.resume not in ("auto", "never"):
            raise UserError("--resume PATH needs the folder on every node; with --hosts, copy it into the job's "
                            "checkpoint volume or use a shared --checkpoint-dir")
        if spec.checkpoint_dir and (not spec.checkpoint_dir.startswith("/") or ".." in spec.checkpoint_dir.split("/")):
            raise UserError(f"--checkpoint-dir {spec.checkpoint_dir}: with --hosts, give the folder's absolute path "
                            f"(the same on every host), without ..")

    @classmethod
    def sized(cls, options: dict, nodes: int) -> dict:
        """The first N of --hosts for N nodes."""
        given = options.get("hosts") or ()
        hosts = tuple(options_mod.items(given) if isinstance(given, str) else given)
        if not hosts:
            return options
        if len(hosts) < nodes:
            raise UserError(f"--hosts names {len(hosts)} hosts; the largest run needs {nodes} (the first N are used "
                            f"for N nodes)")
        return {**options, "hosts": hosts[:nodes]}

    # -- plan: read the hosts' facts, decide everything --

    def plan(self, spec: spec_mod.JobSpec) -> DockerPlan:
        try:
            return self._plan(spec)
        except Exception as e:
            if (why := engine_failure(e)) is None:
                raise
            raise UserError(f"the Docker Engine failed while planning the job: {why}") from None

    def _plan(self, spec: spec_mod.JobSpec) -> DockerPlan:
        self.check(spec)   # a spec made without from_options (a study's runs, Python callers) too
        job_id = spec.job_id or spec_mod.new_job_id()
        owner = records.owner()
        broken: dict[str, str] = {}   # a --hosts engine that failed its check at start: why (--spare-nodes)
        image = None
        for host in dict.fromkeys(self.hosts or [""]):
            try:
                found = self._ready(spec, host, owner)
            except _Broken as e:
                if not spec.spare_nodes:
                    raise
                broken[host] = e.brief
                continue
            image = image or found
        said: tuple[str, ...] = ()
        spares: tuple[dict, ...] = ()
        replaced: tuple[dict, ...] = ()
        if self.hosts:
            port = spec.port or hostnet.random_port()
            hostnet.check_room(port, planner.ports_needed(spec.nodes, spec.procs_per_node))
            probed: dict[tuple, dict] = {}   # a host asked once per master and place (the loop goes round again)

            def probe(host: str, master_ip: str, master: bool, spare: bool) -> dict:
                if (host, master_ip, master, spare) not in probed:
                    probed[host, master_ip, master, spare] = self._probe(spec, job_id, host, master_ip, port,
                                                                         check_port=master, spare=spare)
                return probed[host, master_ip, master, spare]
            while True:   # a host whose probe fails leaves the nodes (or the spares); a spare takes its place
                hosts, spare_hosts, said, replaced = assign(self.hosts, spec.nodes, broken)
                master_ip = hostnet.host_address(hosts[0])
                try:
                    facts = [probe(h, master_ip, i == 0, i >= spec.nodes) for i, h in enumerate(hosts + spare_hosts)]
                except _Broken as e:
                    if not spec.spare_nodes:
                        raise
                    broken[e.host] = e.brief
                    continue
                break
            caps = [f["memlock"] for f in facts if f["memlock"] != -1]   # a spare's too: it may run a node
            memlock = min(caps) if caps else -1
            facts, spares = facts[:spec.nodes], tuple(
                {"host": h, "iface": f["iface"], "local": f["local"]} for h, f in zip(spare_hosts, facts[spec.nodes:]))
        else:
            hosts = [""] * spec.nodes
            master_ip = "127.0.0.1"
            if spec.iface:
                hostnet.check_iface(spec.iface)
            iface, own = hostnet.route(master_ip)
            need = planner.ports_needed(spec.nodes, spec.procs_per_node)   # every node shares this host
            if spec.port:
                hostnet.check_port(master_ip, spec.port, need)
            port = spec.port or hostnet.free_block(master_ip, need)
            facts = [{"iface": spec.iface or iface, "local": own}] * spec.nodes
            memlock = hostnet.memlock()
        labels = image.labels or {}
        return self._settled(spec, job_id, master_ip, port, facts, memlock, image.id,
                             labels.get(settings.LABEL_INPUTS, ""), _paddle_of(labels) or spec.paddle_pin,
                             hosts=hosts, spares=spares, said=said, replaced=replaced)

    def _ready(self, spec: spec_mod.JobSpec, host: str, owner: str):
        """The image on `host`'s engine, once the engine answers and runs nothing of this job id; _Broken where
        the host cannot run the job (--spare-nodes: a spare takes its place)."""
        try:
            self.engine(host)
        except engine.Unreachable as e:
            raise _Broken(str(e), host, f"cannot reach the Docker Engine at {e.where} ({e.why})") from None
        try:
            if spec.job_id:
                self._refuse_taken(host, spec.job_id, owner)
            found = engine.image_or_none(self.engine(host), spec.image_ref)
        except Exception as e:
            if not host or (failure := engine_failure(e)) is None:   # this machine's engine: the job's failure
                raise
            raise _Broken(f"{host}'s engine failed: {failure}", host) from None
        if found is None:
            where = f"on {host}" if host else "here"
            raise _Broken(f"image {spec.image_ref} is not {where}; run `invoke build --variant {spec.variant.name}`"
                          + (" there (or push it and pull it there)" if host else ""), host)
        return found

    def probe_plan(self, plan: DockerPlan, spec: spec_mod.JobSpec) -> DockerPlan:
        """The job's settled values reused (each node's interface and address, the master's, the engines' locked
        memory, the image): the probe runs on exactly what the job will, with no second network probe."""
        facts = [{"iface": v["iface"], "local": v["node_ip"]} for v in plan.values]
        return self._settled(replace(spec, port=plan.port), spec.job_id, plan.values[0]["master_ip"], plan.port,
                             facts, plan.template.memlock, plan.image_id, plan.content_tag, plan.paddle,
                             hosts=[n.host for n in plan.nodes], spares=plan.spares, replaced=plan.replaced)

    def _settled(self, spec: spec_mod.JobSpec, job_id: str, master_ip: str, port: int, facts: list[dict],
                 memlock: int, image_id: str, content_tag: str, paddle: str, hosts: list[str],
                 spares: tuple[dict, ...] = (), said: tuple[str, ...] = (), replaced: tuple[dict, ...] = ()) \
            -> DockerPlan:
        """The plan, once what the engines said is settled: `hosts` each node's engine ("": this machine's),
        `facts` per node its interface and own address ({iface, local}), `memlock` what its containers may lock,
        `spares` the --spare-nodes kept in reserve, `said` what became of the hosts that failed their check."""
        owner, fresh = records.owner(), ""
        if self.hosts:
            # no folder here is seen there: each engine keeps the checkpoints in a volume of its own (a fresh
            # one for --resume never), unless --checkpoint-dir names a folder every host shares
            shared = bool(spec.checkpoint_dir)
            fresh = f"-{secrets.token_hex(3)}" if spec.resume == "never" and not shared else ""
            ckpt = os.path.normpath(spec.checkpoint_dir) if spec.checkpoint_dir else \
                checkpoint_volume(job_id, owner) + fresh   # a volume per node, even on a shared engine
            t = planner.template(spec, job_id, None, workspace=False, hyhal_present=Path("/opt/hyhal").exists(),
                                 memlock=memlock, checkpoints=ckpt, shared_checkpoints=shared, owner=owner)
            home, user = "", ""
            if any(placeholders.used(s) & {"home", "user"} for _, s in t.strings()):
                raise UserError("{home} and {user} are not known for --hosts engines; give the paths there")
        else:
            ckpt = checkpoints.folder(spec.checkpoint_dir, settings.runs_root() / job_id)
            t = planner.template(spec, job_id, str(settings.runs_root() / job_id / "{node}"),
                                 hyhal_present=Path("/opt/hyhal").exists(), memlock=memlock,
                                 checkpoints=str(ckpt), owner=owner)
            home, user = str(Path.home()), getpass.getuser()
        runtimes.Docker().check(t, spec.image_ref)   # binds the engine would split: before anything is made
        if not self.hosts:
            checkpoints.check_writable(ckpt)
        values = tuple(planner.node_values(k, spec.nodes, job_id, master_ip, port, facts[k]["local"],
                                           facts[k]["iface"], home, user, procs=spec.procs_per_node,
                                           gpus=node_gpus(spec, k, self.devices, self.sharing))
                       for k in range(spec.nodes))
        nodes = tuple(replace(t, host=hosts[k]).fill(values[k]) for k in range(spec.nodes))
        if not self.hosts:   # Docker would make a missing source an empty folder; our log folders come later
            for m in nodes[0].mounts:
                if m.dst not in (settings.LOG_DIR, settings.CHECKPOINT_DIR) and not Path(m.src).exists():
                    raise UserError(f"mount source {m.src} does not exist here")
        notes = said + (() if t.memlock == -1 else (
            f"note: the engine caps locked memory at {t.memlock} bytes, so containers get that, not unlimited "
            f"(fine for Gloo/TCP; NCCL over InfiniBand needs unlimited)",))
        if spares:
            notes += (f"note: --spare-nodes: {', '.join(s['host'] for s in spares)} kept in reserve: a node that "
                      f"fails or hangs is left out for the rest of the job, a spare in its place, from the newest "
                      f"checkpoint",)
        notes += restarts.fewer_note(spec)
        resume_note = "" if not fresh else (
            f"its checkpoints are in a fresh volume per node (fleetbox-{job_id}-*-checkpoints-*) on each host; a run "
            f"of the same id without --resume never reads the job's first ones, not these")
        return DockerPlan(spec, job_id, settings.runs_root() / job_id, port, nodes, str(ckpt), t, values,
                          image_id=image_id, content_tag=content_tag, paddle=paddle, notes=notes,
                          resume_note=resume_note, spares=spares, replaced=replaced)

    def _probe(self, spec, job_id: str, host: str, master_ip: str, port: int, check_port: bool,
               spare: bool = False) -> dict:
        """Ask a throwaway host-network container on `host` which NIC and own address reach the master,
        whether the port is free (`check_port`, or on a `spare`, which may become the master), and how much locked
        memory that engine's containers may get. _Broken where the host cannot run a node."""
        try:
            code, out, why = self._throwaway(host, spec.image_ref, job_id, "fleetbox_netinfo", [master_ip, str(port)],
                                             network_mode="host")
        except Exception as e:
            if (failure := engine_failure(e)) is None:
                raise
            raise _Broken(f"{host}'s engine failed the network probe: {failure}", host) from None
        if code != 0:
            raise _Broken(f"the network probe failed on {host} (exit {code}): {why[:200]}", host)
        info = json.loads(out.decode().strip().splitlines()[-1])
        if spare and not info["port_free"]:
            raise _Broken(f"port {port} is in use on {host}, were it to become the master", host)
        if check_port and not info["port_free"]:
            raise UserError(f"port {port} on {master_ip} is already in use; pick another with --port")
        if spec.iface:
            if spec.iface not in info["names"]:
                raise _Broken(f"interface {spec.iface!r} does not exist on {host} (have: {', '.join(info['names'])})",
                              host)
            return {**info, "iface": spec.iface}
        if not info["iface"]:
            raise _Broken(f"no interface on {host} routes to the master {master_ip}; pass --iface", host)
        return info

    def _refuse_taken(self, host: str, job_id: str, owner: str) -> None:
        """A job id whose containers run here is refused. Containers are named by job id and an engine's names are
        unique: another owner's of this id, running or left, would collide half way through the start, so it is
        named now."""
        found = self.engine(host).containers.list(all=True, ignore_removed=True,
                                                  filters={"label": labelled(job_id, "")})
        records.refuse_taken(job_id, f"on {host or 'this machine'}'s engine", sorted(
            (f"container/{c.name}", c.labels.get(settings.LABEL_OWNER, "")) for c in found), owner)
        if any(c.status in ("created", "running", "restarting", "paused") for c in found):
            raise UserError(f"job {job_id} is running (see `invoke jobs`); wait for it or "
                            f"`invoke cancel {job_id}` before running it again")

    def _throwaway(self, host: str, image: str, job_id: str, helper: str, args: list[str], **kwargs):
        """Run one of our in-container helpers (`python -c`) in a throwaway container of `image` on `host`:
        (exit status, its stdout, the last line of its stderr). The container is removed on every way out
        (Ctrl-C while planning included), not only after a clean exit."""
        c = self.engine(host).containers.run(image, ["python", "-c", incontainer.source(helper), *args], detach=True,
                                             labels={settings.LABEL_JOB: job_id, settings.LABEL_OWNER: records.owner()},
                                             **kwargs)
        try:
            code = c.wait(timeout=120).get("StatusCode")
            err = c.logs(stdout=False, stderr=True).decode(errors="replace").strip().splitlines() or ["?"]
            return code, c.logs(stdout=True, stderr=False), err[-1]
        finally:
            _quietly(lambda: c.remove(force=True))

    def _checkpoint_helper(self, plan: DockerPlan, host: str = ""):
        """checkpoints.prepare's helper for a folder every --hosts engine shares: fleetbox_checkpoint_folder in a
        container on `host` (default: the first node's), with the folder's parent mounted (the folder itself is set
        aside from it)."""
        folder, host = PurePosixPath(plan.checkpoints), host or plan.nodes[0].host
        parent = PurePosixPath("/fleetbox/parent")

        def helper(*args: str):
            argv = [str(parent / folder.name) if a == str(folder) else a for a in args]
            code, out, why = self._throwaway(host, plan.spec.image_ref, plan.job_id, "fleetbox_checkpoint_folder",
                                             argv, volumes={str(folder.parent): {"bind": str(parent), "mode": "rw"}})
            lines = out.decode(errors="replace").strip().splitlines()
            if code not in (0, 1) or not lines:
                raise UserError(f"checkpoint folder {folder} on {host}: the helper failed (exit {code}): {why[:200]}")
            answer = json.loads(lines[-1])
            if isinstance(answer, dict) and answer.get("aside"):   # as the hosts see it
                answer["aside"] = str(folder.parent / PurePosixPath(answer["aside"]).relative_to(parent))
            return answer
        return helper

    def run(self, plan: DockerPlan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """Submit and follow to the end; after a failure (a node's non-zero exit, a killed container, a lost
        engine), stop every node and start the whole job again from its newest checkpoint, with the same job id,
        up to spec.max_restarts times (torchrun's --max-restarts). Each attempt keeps its own logs: the last in
        the job folder, earlier ones under attempt<N>/."""
        return self.restarting(plan, log, timeout, on_submit)

    def ended(self, plan: DockerPlan) -> None:
        """The checkpoint folder let go, from the nodes the job last ran on (a spare may be node0's now): on the
        first whose engine answers."""
        if not plan.elsewhere:
            _quietly(lambda: checkpoints.release(Path(plan.checkpoints), plan.job_id))
            return
        for host in dict.fromkeys(n.host for n in plan.nodes) if plan.spec.checkpoint_dir else ():
            try:
                return checkpoints.release(Path(plan.checkpoints), plan.job_id, self._checkpoint_helper(plan, host))
            except Exception:   # that engine is gone: the next
                continue

    def without(self, plan: DockerPlan, node: int, machine: str = "") -> DockerPlan:
        """The plan on every node but `node`, numbered again from 0: each node left keeps its engine, address,
        interface and devices (the failed node's sit idle), and the first is the master, at its own address. From
        the plan alone: a detached job's supervisor has no --hosts or --devices of its own. (`machine` is not
        needed: the failed node's engine is its machine, left out with it.)"""
        keep = [k for k in range(len(plan.nodes)) if k != node]
        master_ip = plan.values[0]["master_ip"] if keep[0] == 0 else plan.values[keep[0]]["node_ip"]
        return renumbered(replace(plan, spec=replace(plan.spec, nodes=len(keep))),
                          [(plan.nodes[k].host, plan.values[k]) for k in keep], master_ip)

    def host_of(self, plan: DockerPlan, node: int) -> str:
        return plan.nodes[node].host

    def spares_left(self, plan: DockerPlan) -> int:
        return len(plan.spares)

    def with_spare(self, plan: DockerPlan, node: int) -> tuple[DockerPlan, str]:
        """The plan with its first spare in node `node`'s place: the same ranks, that node's engine, address and
        interface the spare's (the master's too, where it is node 0's), its devices the node's. From the plan
        alone, as `without`."""
        spare = plan.spares[0]
        old = [(n.host, v) if k != node else (spare["host"], {**v, "node_ip": spare["local"], "iface": spare["iface"]})
               for k, (n, v) in enumerate(zip(plan.nodes, plan.values))]
        master_ip = spare["local"] if node == 0 else plan.values[0]["master_ip"]
        return renumbered(replace(plan, spares=plan.spares[1:]), old, master_ip), spare["host"]

    def for_attempt(self, plan: DockerPlan, attempt: int) -> DockerPlan:
        """The same nodes with {attempt} filled again (FLEETBOX_ATTEMPT, and wherever the user wrote it)."""
        return replace(plan, attempt=attempt, nodes=tuple(
            replace(plan.template, host=n.host).fill({**v, "attempt": str(attempt)})
            for n, v in zip(plan.nodes, plan.values)))

    def describe(self, plan: DockerPlan) -> str:
        out = []
        for k, n in enumerate(plan.nodes):
            out += [f"# node{k} (rank {k}) on {n.host or 'this machine'}", shell_line(n)]
        out += [f"# spare on {s['host']}: takes the place of a node that fails or hangs" for s in plan.spares]
        return "\n".join(out)

    # -- acting --

    def submit(self, plan: DockerPlan, log=print) -> DockerHandle:
        plan.make_dir()
        spec = plan.spec
        if plan.attempt == 0:   # a restart goes on with the same folders
            (plan.dir / CANCELLED).unlink(missing_ok=True)
            if not plan.elsewhere:
                checkpoints.prepare(Path(plan.checkpoints), spec.resume, plan.job_id, log)
            elif spec.checkpoint_dir:   # a folder every host shares: taken there (volumes are the job's own)
                checkpoints.prepare(Path(plan.checkpoints), spec.resume, plan.job_id, log,
                                    helper=self._checkpoint_helper(plan))
        now = time.time()
        first = files.read_json(plan.dir / records.JOB).get("first_started") if plan.attempt else None
        JobInfo(plan.job_id, self.name, spec.variant.name, spec.nodes, spec.procs_per_node, spec.image_ref,
                image_id=plan.image_id, content_tag=plan.content_tag, paddle=plan.paddle, started=now,
                first_started=first if isinstance(first, (int, float)) and first else now,
                commands=[shell_line(n) for n in plan.nodes]).save(plan.dir)
        handle = DockerHandle(self.name, plan.job_id, str(plan.dir), spec.nodes, [n.host for n in plan.nodes],
                        procs_per_node=spec.procs_per_node, supervisor=os.getpid(),
                        supervisor_start=process_start(os.getpid()), supervisor_host=this_host(),
                        checkpoints=plan.checkpoints, owner=plan.nodes[0].labels.get(settings.LABEL_OWNER, ""))
        handle.save()
        live = self.live[plan.job_id] = _Live(self, plan)
        try:
            with engine_errors(plan.dir):
                live.start(log)   # removes what it created on any error, Ctrl-C included
            log(f"job {plan.job_id}: {spec.nodes} node(s) x {spec.procs_per_node} process(es), master "
                f"{master_of(plan)}, logs in {plan.dir}")
        except BaseException:   # no handle reaches run(): nothing would cancel what runs
            del self.live[plan.job_id]
            live.remove_all()
            raise
        return handle

    def follow(self, handle: DockerHandle, log=print, timeout: float | None = None) -> JobResult:
        live = self.live[handle.job_id]
        with engine_errors(handle.dir):
            pump = live.stream_rank0(log)
            live.watch(log, timeout)
            pump.join(timeout=2)   # rank 0's last lines before the summary
            live.gather()
            live.remove_all()
        del self.live[handle.job_id]
        return live.result()

    def status(self, handle: DockerHandle) -> str:
        states = [c.status for c in self._containers(handle)]
        if not states:
            return "GONE"
        return "RUNNING" if any(s in ("created", "running", "restarting") for s in states) else "EXITED"

    def logs(self, handle: DockerHandle, node: int) -> str:
        for c in self._containers(handle):
            if c.labels.get(settings.LABEL_RANK) == str(node):
                return c.logs().decode(errors="replace")
        p = Path(handle.dir) / f"node{node}" / OUTPUT
        return p.read_text(errors="replace") if p.exists() else ""

    def cancel(self, handle: DockerHandle, log=print, asked: bool = True) -> None:
        """This process's job: stopped, its logs kept, removed. Another's (`invoke cancel` from any shell): its
        supervisor (a detached job's, or another shell's `invoke train`) is asked (SIGTERM) and cleans up as on
        Ctrl-C; without one, or when it does not stop in time, the job's containers are removed here."""
        live = self.live.pop(handle.job_id, None)
        if live is not None:   # this process started it: stop, keep the logs, remove
            if asked:
                mark_cancelled(handle.dir)
            live.stop_all()
            live.gather()
            live.remove_all()
            live.result()
            return
        ours = handle.supervisor == os.getpid() and not handle.elsewhere()   # its follow here ended just now
        if where := handle.elsewhere():   # its containers are not ours to remove behind its supervisor
            if files.read_json(Path(handle.dir) / records.SUMMARY):
                raise UserError(f"job {handle.job_id} has already ended (see `invoke jobs`)")
            raise UserError(f"job {handle.job_id} is followed by its supervisor on {where} (pid {handle.supervisor}), "
                            f"not this machine: cancel it there; were {where} gone for good, `invoke clean --job "
                            f"{handle.job_id} --force` on the machines that run its containers removes them")
        following = handle.followed() and not ours
        if not (following or ours) and self.status(handle) == "GONE":
            raise UserError(f"job {handle.job_id} has already ended (see `invoke jobs`)")
        if asked:
            mark_cancelled(handle.dir)   # first: a supervisor between attempts does not start another
        if following:
            log(f"asking the supervisor (pid {handle.supervisor}) to stop job {handle.job_id}")
            os.kill(handle.supervisor, signal.SIGTERM)
            end = time.monotonic() + self.SUPERVISOR_STOP_S
            while handle.followed() and time.monotonic() < end:
                time.sleep(0.2)
            if not handle.followed():
                log(f"job {handle.job_id} cancelled; logs in {handle.dir}")
                return
            log(f"the supervisor did not stop within {self.SUPERVISOR_STOP_S:g} s; removing the job's containers")
        for c in self._containers(handle):   # not ours: keep what each said, then remove it
            rank = c.labels.get(settings.LABEL_RANK, "x")
            d = Path(handle.dir) / f"node{rank}"
            _quietly(lambda: (d.mkdir(parents=True, exist_ok=True), files.write_atomic(d / OUTPUT, c.logs())))
            _quietly(lambda: c.remove(force=True))
        if asked and not ours:
            files.write_atomic(Path(handle.dir) / CANCELLED, REMOVED + "\n")   # ended: no supervisor writes a summary
            log(f"job {handle.job_id}: containers removed; logs in {handle.dir}")

    def detach(self, plan: DockerPlan, log=print) -> DockerHandle:
        """A supervisor process carries the job (python -m fleetbox.run.supervisor): this returns once it has
        started the job, or says in one line why it could not."""
        plan.make_dir()
        for name in (records.SUPERVISOR_READY, records.SUMMARY):
            (plan.dir / name).unlink(missing_ok=True)
        records.save_plan(plan.dir, self.name, plan)
        out_log = plan.dir / records.SUPERVISOR_LOG
        with open(out_log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fleetbox.run.supervisor", str(plan.dir)], cwd=ROOT,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        try:
            while not (plan.dir / records.SUPERVISOR_READY).exists():
                if proc.poll() is not None:
                    said = [ln for ln in out_log.read_text(errors="replace").splitlines() if "fleetbox: " in ln]
                    why = said[-1].split("fleetbox: ", 1)[1] if said else f"it exited with {proc.returncode}"
                    raise Failed(f"the detached job did not start: {why} (log: {out_log})")
                time.sleep(0.1)
        except KeyboardInterrupt:   # the supervisor cleans up on SIGTERM, as an attached job does on Ctrl-C
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:   # stuck: stop it, and remove what it had started ourselves
                proc.kill()
                proc.wait()
                self.clean(list(dict.fromkeys([n.host for n in plan.nodes] + [s["host"] for s in plan.spares])),
                           job=plan.job_id, force=True,
                           log=lambda m: None)
            raise
        return Handle.load(plan.dir)

    def engine_facts(self, spec: spec_mod.JobSpec) -> list[dict]:
        """Each node's engine (reachable, its version) and the image there (ID and content tag)."""
        hosts = list(self.hosts) or [""] * spec.nodes
        facts = []
        for host in hosts:
            try:
                c = self.engine(host)
            except UserError as e:
                facts.append({"host": host, "version": None, "error": str(e), "image": None})
                continue
            img = engine.image_or_none(c, spec.image_ref)
            facts.append({"host": host, "version": c.version().get("Version", "?"), "error": "",
                          "image": (img.id, (img.labels or {}).get(settings.LABEL_INPUTS, "")) if img else None})
        return facts

    # -- from any shell --

    def job_state(self, handle: DockerHandle) -> tuple[JobState, int, str]:
        d = Path(handle.dir)
        attempt = len([p for p in d.iterdir() if p.is_dir() and re.fullmatch(r"attempt\d+", p.name)])
        if where := handle.elsewhere():
            return self._state_elsewhere(handle, where, attempt)
        following = handle.followed()
        if not following and (d / CANCELLED).exists():
            return JobState.CANCELLED, attempt, ""
        summary = files.read_json(d / records.SUMMARY)
        if summary and not following:
            return ended_as(summary), attempt, ""
        try:
            state = self.status(handle)
        except UserError as e:
            return JobState.UNKNOWN, attempt, str(e)
        if following:
            return (JobState.RUNNING if state == "RUNNING" else JobState.STARTING), attempt, ""
        if state == "RUNNING":
            return JobState.ORPHANED, attempt, (f"its supervisor (pid {handle.supervisor}) is gone: nothing propagates "
                                                f"failures or restarts; `invoke cancel {handle.job_id}` removes it")
        return JobState.DIED, attempt, f"its supervisor (pid {handle.supervisor}) ended without a summary"

    def _state_elsewhere(self, handle: DockerHandle, where: str, attempt: int) -> tuple[JobState, int, str]:
        """A job followed from another machine: its files say how it ended; while it runs, only `--hosts` engines
        can be asked from here (this machine's own engine is not the one its containers run on)."""
        d = Path(handle.dir)
        summary = files.read_json(d / records.SUMMARY)
        if summary:   # a stopped job has a summary too
            return (JobState.CANCELLED if (d / CANCELLED).exists() else ended_as(summary)), attempt, ""
        who = f"its supervisor (pid {handle.supervisor}) runs on {where}"
        if (d / CANCELLED).exists():   # asked to stop: done once the containers were removed (stop() says so)
            if (d / CANCELLED).read_text(errors="replace").strip() == REMOVED:
                return JobState.CANCELLED, attempt, ""
            return JobState.UNKNOWN, attempt, f"cancelling: {who}"   # its supervisor there is stopping it
        if all(handle.hosts):
            try:
                if self.status(handle) == "RUNNING":
                    return JobState.RUNNING, attempt, who
            except UserError as e:
                return JobState.UNKNOWN, attempt, f"{who}; {e}"
        return JobState.UNKNOWN, attempt, f"{who}: `invoke jobs` there tells its state"

    def show_logs(self, handle: DockerHandle, node: int, follow: bool = False, log=print, poll: float = 0.5) -> None:
        """From the engine while the node's container exists (a restart makes a new one: followed too), else what
        the job left in its folder."""
        seen, shown = set(), False
        while True:
            mine = [c for c in self._containers(handle)
                    if c.labels.get(settings.LABEL_RANK) == str(node) and c.id not in seen]
            if mine:
                c = mine[0]
                seen.add(c.id)
                buf = b""
                try:
                    for chunk in (c.logs(stream=True, follow=True) if follow else [c.logs()]):
                        buf += chunk
                        while b"\n" in buf:
                            ln, buf = buf.split(b"\n", 1)
                            log(ln.decode(errors="replace"))
                except Exception:   # removed while we read: the job moved on
                    pass
                if buf:
                    log(buf.decode(errors="replace"))
            elif not seen and not shown:   # nothing running: what the job left in its folder
                p = Path(handle.dir) / f"node{node}" / OUTPUT
                if p.exists():
                    log(p.read_text(errors="replace").rstrip("\n"))
                    shown = True
                elif not follow:
                    raise UserError(f"no output of node {node} yet (job {handle.job_id})")
            if not follow or not handle.followed():
                return
            time.sleep(poll)

    def _containers(self, handle: DockerHandle) -> list:
        found = []
        for host in dict.fromkeys(handle.hosts or [""]):
            found += self.engine(host).containers.list(
                all=True, ignore_removed=True, filters={"label": labelled(handle.job_id, handle.owner)})
        return found

    def clean(self, hosts: list[str], job: str = "", force: bool = False, log=print) -> tuple[int, int]:
        """Remove this user's fleetbox job containers left on these engines (found by label; another owner's are
        not looked at): the finished ones, or every one of `job`, or every one with `force`. A container whose
        job has not ended (its record in the runs folder says so) is kept whatever its state, unless `force`:
        a --hosts node that finished while its peers run holds its logs until the job gathers them. A running
        container is kept too unless `job` or `force`. Returns (removed, kept)."""
        import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
        label = f"{settings.LABEL_JOB}={job}" if job else settings.LABEL_JOB
        mine, ended = records.owner(), {}
        removed = kept = 0
        for host in hosts or [""]:
            where = host or "this machine"
            for c in self.engine(host).containers.list(all=True, ignore_removed=True, filters={"label": label}):
                if c.labels.get(settings.LABEL_OWNER, mine) != mine:   # none: an older fleetbox's, taken as ours
                    continue
                of = c.labels.get(settings.LABEL_JOB, "")
                if of not in ended:   # a label that is no job id names no record: nothing to ask
                    ended[of] = job_ended(settings.runs_root() / of, self) if spec_mod.JOB_ID.fullmatch(of) \
                        else (True, "")
                if not ended[of][0] and not force:
                    log(f"kept {c.name}: {c.status}; its job {of} is {ended[of][1]} (`invoke cancel {of}` stops it; "
                        f"--force removes it)")
                    kept += 1
                    continue
                # "created": a job that is starting (a failed start removes its own)
                if c.status in ("created", "running", "restarting", "paused") and not (job or force):
                    log(f"kept {c.name}: {c.status} ({of}; --job or --force removes it)")
                    kept += 1
                    continue
                try:
                    c.remove(force=True)
                except docker.errors.NotFound:
                    continue   # gone between list and remove (its job cleaned up itself)
                except docker.errors.APIError as e:
                    if e.status_code == 409:   # a removal already in progress
                        continue
                    why = (e.explanation or str(e)).strip()[:200]
                    raise UserError(f"cannot remove {c.name} on {where}: {why}") from None
                log(f"removed {c.name} ({of}) on {where}")
                removed += 1
            if job:   # a --hosts job's checkpoint volumes, this owner's (and an older fleetbox's, which had none)
                ours = [re.escape(checkpoint_volume(job, mine)).replace(re.escape("{node}"), r"node\d+"),
                        rf"fleetbox-{re.escape(job)}-node\d+-checkpoints"]
                for v in self.engine(host).volumes.list(filters={"name": f"fleetbox-{job}-"}):
                    if any(re.fullmatch(f"{pattern}(-[0-9a-f]+)?", v.name) for pattern in ours):
                        _quietly(v.remove)
                        log(f"removed volume {v.name} on {where}")
        return removed, kept


def checkpoint_volume(job_id: str, owner: str) -> str:
    """A --hosts node's checkpoint volume ({node} left to fill): named for the job and its owner, so a job of the
    same id of another owner (or runs folder) on a shared engine neither resumes from nor writes into it."""
    return f"fleetbox-{job_id}-{hashlib.sha256(owner.encode()).hexdigest()[:8]}-{{node}}-checkpoints"


def labelled(job_id: str, owner: str) -> list[str]:
    """The label filter of one job's containers: its id and its owner (a handle from an older fleetbox has none)."""
    return [f"{settings.LABEL_JOB}={job_id}"] + ([f"{settings.LABEL_OWNER}={owner}"] if owner else [])


def ended_as(summary: dict) -> JobState:
    """How a job ended, from its summary.json."""
    return JobState.PASSED if summary.get("ok") else JobState.HUNG if summary.get("hang") else JobState.FAILED


def master_of(plan: DockerPlan) -> str:
    """The launcher's master (a script that spawns its own ranks has none: they meet on its own machine)."""
    cmd = plan.nodes[0].command
    return cmd[cmd.index("--master") + 1] if "--master" in cmd else "none (the script spawns its ranks)"


class _Live:
    """A job this process started: its containers and what happened to each node."""

    def __init__(self, backend: DockerBackend, plan: DockerPlan):
        self.backend, self.plan = backend, plan
        self.containers: dict[int, object] = {}
        self.exits: list[tuple[int, int]] = []
        self.stopped: set[int] = set()   # nodes we stopped (rather than nodes that ended by themselves)
        self.finished: dict[int, str] = {}
        self.oom: dict[int, bool] = {}
        self.gone: set[int] = set()      # containers removed behind our back while the job ran
        self.lost: dict[int, str] = {}   # --hosts nodes whose engine stopped answering while the job ran: why
        self.timed_out = False
        self.hang: dict | None = None      # the job hung: what the hang watcher kept (JobResult.hang)

    def start(self, log=print) -> None:
        import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
        import requests  # noqa: PLC0415 (deferred: with the Docker SDK, only where an engine is used)
        nodes = self.plan.nodes
        # a remote engine cannot see our files: the workspace is copied in (packed once, to a temporary file
        # each node's upload streams from)
        with tempfile.TemporaryDirectory(prefix="fleetbox-workspace-") as tmp:
            packs = {}
            if any(n.host for n in nodes):
                packs = {settings.WORKDIR: Path(tmp, "workspace.tar"), "/": Path(tmp, "helpers.tar")}
                pack_dir(self.plan.spec.script_path.parent, packs[settings.WORKDIR], log=log)
                pack_dir(settings.HELPERS, packs["/"], settings.HELPERS_DIR.lstrip("/"), log=log)

            def create(k: int):
                n = nodes[k]
                if n.host and self.plan.attempt:   # an earlier attempt's, left on an engine that was lost and is back
                    _quietly(lambda: self.backend.engine(n.host).containers.get(n.name).remove(force=True))
                if not n.host:
                    logs = Path(next(m.src for m in n.mounts if m.dst == settings.LOG_DIR))
                    logs.mkdir(parents=True, exist_ok=True)
                    hang.clear(str(logs))
                container = self.backend.engine(n.host).containers.create(n.image, list(n.command), **sdk_kwargs(n))
                self.containers[k] = container
                for where, pack in packs.items() if n.host else ():
                    with open(pack, "rb") as f:
                        container.put_archive(where, f)

            def each(pool, act, ks) -> None:
                """`act` on every node in `ks`; a refusal, or (--hosts) an engine that stops answering, is that
                node's (NodeRefused: a spare may take its place), unless every node was refused alike (the job's
                own containers are wrong: one line)."""
                refused = {}

                def one(k: int):
                    try:
                        act(k)
                    except docker.errors.APIError as e:
                        refused[k] = "refused to start its container: " + (
                            e.explanation or str(e)).strip().splitlines()[-1][:300]
                    except requests.exceptions.ConnectionError as e:
                        if not nodes[k].host:
                            raise
                        refused[k] = f"stopped answering: {engine_failure(e)}"
                        self.lost[k] = refused[k]   # nothing more is asked of it (remove_all)
                list(pool.map(one, ks))
                if not refused:
                    return
                k = min(refused)
                if len(refused) == len(nodes) > 1 and len(set(refused.values())) == 1:
                    raise UserError(f"every node's engine {refused[k]}")
                where = f" ({nodes[k].host})" if nodes[k].host else ""
                raise NodeRefused(f"node{k}'s engine{where} {refused[k]}", k)

            for n in nodes:   # engine clients are made here, once, not from several threads
                self.backend.engine(n.host)
            try:
                with ThreadPoolExecutor(max_workers=min(16, len(nodes))) as pool:
                    each(pool, create, range(len(nodes)))   # all created before any starts
                    each(pool, lambda k: self.containers[k].start(), sorted(self.containers))
            except BaseException:
                self.remove_all()
                raise

    def stream_rank0(self, log) -> threading.Thread:
        def pump():
            buf = b""
            try:
                for chunk in self.containers[0].logs(stream=True, follow=True):
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        log(f"[node0] {line.decode(errors='replace')}")
            except Exception:   # the container went away: nothing more to show
                pass
            if buf:
                log(f"[node0] {buf.decode(errors='replace')}")
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        return t

    def watch(self, log, timeout: float | None = None) -> None:
        """Until every node exited, or the first failure (plus a short grace) stops the rest."""
        import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
        import requests  # noqa: PLC0415 (deferred: with the Docker SDK, only where an engine is used)
        deadline = time.monotonic() + timeout if timeout else None
        first_fail = None
        spec = self.plan.spec
        hangs = hang.Watcher(str(self.plan.dir / f"hang-{self.plan.attempt}"), len(self.containers),
                             spec.procs_per_node, spec.hang_timeout, spec.start_timeout, self.plan.attempt,
                             ContainerFiles(self), log)
        seen = 0
        while True:
            for rank, c in self.containers.items():
                if rank in dict(self.exits):
                    continue
                try:
                    c.reload()
                except docker.errors.NotFound:   # removed behind our back: that node is lost
                    self.gone.add(rank)
                    self.exits.append((rank, None))
                    if first_fail is None:
                        first_fail = time.monotonic()
                        log(f"node{rank}'s container was removed while the job ran; stopping the other nodes")
                    continue
                except requests.exceptions.ConnectionError as e:   # a --hosts node's engine (its machine) no
                    # longer answers: that node is lost (an error the engine answered with is the job's)
                    if not (host := self.plan.nodes[rank].host):
                        raise   # this machine's engine: every node's (engine_errors)
                    self.lost[rank] = f"was lost: its engine ({host}) stopped answering ({engine_failure(e)})"
                    self.exits.append((rank, None))
                    if first_fail is None:
                        first_fail = time.monotonic()
                        log(f"node{rank}'s engine ({host}) stopped answering; stopping the other nodes (where that "
                            f"engine comes back, `invoke clean --hosts {host} --job {self.plan.job_id}` removes what "
                            f"is left of the job there)")
                    continue
                if c.status in ("exited", "dead"):
                    self.exits.append((rank, c.attrs["State"]["ExitCode"]))
                    if self.exits[-1][1] != 0 and first_fail is None:
                        first_fail = time.monotonic()
                        log(f"node{rank} (rank {rank}) exited with code {self.exits[-1][1]}; stopping the other nodes")
            # the deadlines until the first failure; then, at each new end, at once: a rank that a collective's own
            # timeout ended waited for a stuck peer, whose stacks are taken while it is still where it hung
            new_end = len(self.exits) > seen
            seen = len(self.exits)
            if (first_fail is None or new_end) and (stuck := hangs.look(
                    ended=[k for k, _ in self.exits], failed=[k for k, c in self.exits if c], at_once=new_end,
                    deadlines=first_fail is None)) is not None:
                self.hang = stuck
                self.stop_all(timeout=1)
                return
            if len(self.exits) == len(self.containers):
                return
            if first_fail is not None and time.monotonic() - first_fail >= GRACE_S:
                self.stop_all()
                return
            if deadline and time.monotonic() > deadline:
                log(f"timeout after {timeout:g} s; stopping every node")
                self.timed_out = True
                self.stop_all()
                return
            time.sleep(POLL_S)

    def answering(self) -> list:
        """The containers whose engine still answers (a lost one's would hold every call for its timeout)."""
        return [c for k, c in self.containers.items() if k not in self.lost]

    def stop_all(self, timeout: float = STOP_TIMEOUT_S) -> None:
        seen = dict(self.exits)
        self.stopped |= {r for r in self.containers if r not in seen}
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(self.containers)))) as pool:
            list(pool.map(lambda c: _quietly(lambda: c.stop(timeout=timeout)), self.answering()))
        for rank, c in self.containers.items():
            if rank not in seen:
                try:
                    c.reload()
                    self.exits.append((rank, c.attrs["State"]["ExitCode"]))
                except Exception:
                    self.exits.append((rank, 137))

    def gather(self) -> None:
        for rank, c in self.containers.items():
            d = self.plan.dir / f"node{rank}"
            d.mkdir(parents=True, exist_ok=True)
            if rank in self.gone:
                continue
            if rank in self.lost:
                (d / "gather-error.txt").write_text(self.lost[rank] + "\n")
                continue
            try:
                c.reload()
                state = c.attrs["State"]
                self.finished[rank] = state.get("FinishedAt", "")
                self.oom[rank] = bool(state.get("OOMKilled"))
                files.write_atomic(d / OUTPUT, c.logs())
                if self.plan.nodes[rank].host:   # remote: the log folder is in the container; copy it out
                    bits, _ = c.get_archive(settings.LOG_DIR + "/.")   # the folder's content, not the folder
                    with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                        safe_extract(tar, d)
            except Exception as e:
                (d / "gather-error.txt").write_text(str(e))

    def remove_all(self) -> None:
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(self.containers)))) as pool:
            list(pool.map(lambda c: _quietly(lambda: c.remove(force=True)), self.answering()))

    def facts(self) -> JobFacts:
        """What the engines said of each node, in the order their ends were seen."""
        exits, d = dict(self.exits), self.plan.dir
        one_worker = self.plan.spec.procs_per_node == 1
        seen = [r for r, _ in self.exits] + [k for k in range(len(self.plan.nodes)) if k not in exits]
        nodes = []
        for k in seen:
            here, n, code = d / f"node{k}", self.plan.nodes[k], exits.get(k)
            stopped, gone = k in self.stopped, k in self.gone
            worker = here / "workerlog.0"
            nodes.append(NodeFacts(
                k, str(here), n.host or "local", code, finish_time(self.finished.get(k, "")), stopped, gone,
                self.oom.get(k, False),
                # a worker's last words are its log file's time: only here (not --hosts), with one worker
                last_words(here, here / OUTPUT) if one_worker and not n.host and not gone and not stopped
                and code not in (0, None) else None,
                self.finished.get(k, ""), output=str(here / OUTPUT),
                tail_of=str(worker) if worker.exists() and worker.stat().st_size else "", lost=self.lost.get(k, "")))
        # every node ended well, but told to stop from outside (SIGTERM): saved, not finished
        well = not self.timed_out and self.hang is None and all(exits.get(k) == 0 for k in range(len(self.plan.nodes)))
        said = checkpoints.state(Path(self.plan.checkpoints)) if well and not self.plan.elsewhere else {}
        return JobFacts(nodes, self.timed_out, self.hang,
                        ended=f"stopped at step {said.get('step')} to continue, before its work was done"
                        if said.get("state") == "continue" else "")

    def result(self) -> JobResult:
        caps = self.backend.capabilities
        d = self.plan.dir
        r = judge(self.facts(), self.plan.job_id, self.backend.name, str(d), attempts_are=caps.attempts_are,
                  name_host=caps.names_hosts, smoke=smoke_report(d / "node0" / "workerlog.0"))
        r.save()
        return r


class ContainerFiles(hang.NodeFiles):
    """The hang watcher's transport to each node's log folder while the job runs: here (a local node's is
    bind-mounted), or (--hosts) in its container on its engine."""

    def __init__(self, live: _Live):
        super().__init__(str(live.plan.dir))
        self.live = live

    def read(self, k: int, name: str, last: int | None = None) -> bytes | None:
        if not self.live.plan.nodes[k].host:
            return super().read(k, name, last)
        if k in self.live.lost:
            return None
        try:
            bits, _ = self.live.containers[k].get_archive(f"{settings.LOG_DIR}/{name}")
            with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                member = tar.next()
                data = tar.extractfile(member).read() if member is not None and member.isfile() else None
                return data[-last:] if data is not None and last else data
        except Exception:   # not there (yet), or the container went away
            return None

    def write(self, k: int, name: str, data: bytes) -> None:
        if not self.live.plan.nodes[k].host:
            super().write(k, name, data)
            return
        if k in self.live.lost:
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        self.live.containers[k].put_archive(settings.LOG_DIR, buf.getvalue())


class engine_errors:
    """An engine error while starting or following a job (connection lost, engine stopped) becomes one line;
    the backend's run() then cancels the job (stop, gather what can be, remove)."""

    def __init__(self, job_dir):
        self.job_dir = job_dir

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is not None and (why := engine_failure(e)) is not None:
            raise Failed(f"train failed: the Docker Engine failed while running the job: {why} "
                         f"(logs: {self.job_dir})") from None
        return False


def engine_failure(e: BaseException) -> str | None:
    """An engine error (connection lost, engine stopped, a refusal) in one line; None for anything else."""
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
    import requests  # noqa: PLC0415 (deferred: with the Docker SDK, only where an engine is used)
    if isinstance(e, (docker.errors.DockerException, requests.RequestException)):
        return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    return None


def finish_time(ts: str) -> float:
    """Docker's FinishedAt (RFC 3339, nanoseconds, trailing zeros trimmed) as seconds; unknown: last."""
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z", ts or "")
    if not m or m.group(1).startswith("0001"):
        return float("inf")
    whole = dt.datetime.fromisoformat(m.group(1)).replace(tzinfo=dt.timezone.utc).timestamp()
    return whole + (int(m.group(2)) / 10 ** len(m.group(2)) if m.group(2) else 0.0)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:
        pass


def pack_dir(folder: Path, out: Path, prefix: str = "", log=print, limit: int = settings.WORKSPACE_MAX) -> None:
    """The folder as a remote engine gets it, written to `out`: every file in every sub-folder, under `prefix`.
    A link inside the folder is copied as what it points at (an absolute link would dangle on the other
    host); a link that leaves the folder is skipped with a line (it would ship whatever it points at: a home
    folder's secrets); more than `limit` bytes is refused, naming the file that crossed it."""
    root = os.path.realpath(folder)

    def leaves(p: Path) -> bool:
        real = os.path.realpath(p)
        if real == root or real.startswith(root + os.sep):
            return False
        log(f"warning: not copied to the remote engines: {p.relative_to(folder)} -> {os.readlink(p)} leaves "
            f"{folder}")
        return True

    try:
        _pack(folder, out, prefix, limit, root, leaves)
    except OSError as e:   # a file that cannot be read, a full temporary folder
        raise UserError(f"cannot pack {folder} for the remote engines: {e.strerror or e}"
                        + (f" ({e.filename})" if e.filename else "")) from None


def _pack(folder: Path, out: Path, prefix: str, limit: int, root: str, leaves) -> None:
    total, seen = 0, set()
    with tarfile.open(out, "w") as tar:
        for top, dirs, names in os.walk(folder, followlinks=True):
            if os.path.realpath(top) in seen:   # a link back up the tree: once is enough
                dirs[:] = []
                continue
            seen.add(os.path.realpath(top))
            dirs[:] = sorted(d for d in dirs if not (Path(top, d).is_symlink() and leaves(Path(top, d))))
            for name in sorted(names):
                p = Path(top, name)
                if not p.exists() or (p.is_symlink() and leaves(p)):   # dangling: an editor's lock file
                    continue
                if not p.is_file():   # a socket or a fifo: nothing to copy
                    continue
                total += p.stat().st_size
                if total > limit:
                    raise UserError(f"the script's folder {folder} holds more than {limit >> 20} MiB to copy to every "
                                    f"remote engine (reached at {p.relative_to(folder)}): keep data out of it "
                                    f"(--data-dir, --mount)")
                tar.add(os.path.realpath(p), arcname=str(Path(prefix, Path(top).relative_to(folder), name)))


def _paddle_of(labels: dict) -> str:
    """The Paddle version an image says it has: our images' version label (another image's may be its OS's)."""
    return labels.get("org.opencontainers.image.version", "") if labels.get(settings.LABEL_INPUTS) else ""
