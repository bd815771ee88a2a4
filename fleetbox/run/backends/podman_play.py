"""The Kubernetes backend's objects on this machine (--k8s-client podman): `podman kube play` (4.3) runs Pods,
ConfigMaps, Secrets and claims, but no Job or Service, so the Indexed Job is lowered to one Pod per index
(pods_for_podman) on a network of the job's own, and PodmanPlay follows its containers as the Docker backend follows
its own. The Kubernetes backend hands a job to it where its client is podman; the objects are the backend's."""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from fleetbox import files, settings
from fleetbox.errors import UserError
from fleetbox.processes import never_failing, signals_held
from fleetbox.run import records
from fleetbox.run.backend import Plan
from fleetbox.run.backends import kube_pods as kube
from fleetbox.run.judge import VANISHED, JobFacts, NodeFacts, judge
from fleetbox.run.records import JobState, SupervisedHandle
from fleetbox.run.result import JobResult, exit_meaning, smoke_report
from fleetbox.run.shell import line


class Dollars(NamedTuple):
    """Where this Podman takes $$ for $ in a kube play, as the kubelet does (dollars_taken): in a container's
    command and args, in its env values."""
    command: bool = False
    env: bool = False


def pods_for_podman(job: dict, service: dict, ips: list[str] | None = None,
                    takes: Dollars = Dollars()) -> list[dict]:
    """An Indexed Job as one Pod per index: each its pod template, with its index where the Job controller would
    put it (the annotation, JOB_COMPLETION_INDEX, the hostname <job>-<index>) and hostAliases for the names the
    headless Service would publish (`ips`: each index's address; default 127.0.0.1, the pods on the host's
    network). What Podman does otherwise than a kubelet is lowered too: it resolves no status.podIP (the pod's
    address is given, as the kubelet would give it), publishes every containerPort on the host (dropped: each pod
    has its own address), makes an emptyDir a volume of its name, which every pod naming it would share (named
    <pod>-<name>), and, where it takes no $$ for $ in the command or the env values (`takes`, as dollars_taken
    found: Podman 4.3 in neither, 4.7 and later in commands), undoes it there as the kubelet would."""
    name, nodes, svc = job["metadata"]["name"], job["spec"]["completions"], service["metadata"]["name"]
    ips = ips or ["127.0.0.1"] * nodes
    if len(ips) != nodes:
        raise UserError(f"{len(ips)} address(es) for {nodes} pods")
    aliases = [{"ip": ip, "hostnames": [f"{name}-{k}.{svc}", f"{name}-{k}"]} for k, ip in enumerate(ips)]
    pods = []
    for k in range(nodes):
        t = json.loads(json.dumps(job["spec"]["template"]))   # a deep copy (plain data)
        md = t["metadata"]
        md["name"] = f"{name}-{k}"
        md.setdefault("annotations", {})[kube.INDEX_ANNOTATION] = str(k)
        if "namespace" in job["metadata"]:
            md["namespace"] = job["metadata"]["namespace"]
        t["spec"]["hostname"] = f"{name}-{k}"
        t["spec"]["hostAliases"] = aliases
        own = {v["name"]: f"{name}-{k}-{v['name']}" for v in t["spec"].get("volumes", []) if "emptyDir" in v}
        for v in t["spec"].get("volumes", []):
            v["name"] = own.get(v["name"], v["name"])
        for c in t["spec"]["containers"]:
            c.pop("ports", None)
            for m in c.get("volumeMounts", []):
                m["name"] = own.get(m["name"], m["name"])
            in_command, in_env = ((lambda w: w) if taken else kube.kubelet_unescape for taken in takes)
            c["env"] = [{"name": kube.COMPLETION_INDEX, "value": str(k)} if e["name"] == kube.COMPLETION_INDEX
                        else {"name": e["name"], "value": ips[k]} if e.get("valueFrom") == kube.POD_IP_REF
                        else {**e, "value": in_env(e["value"])} if "value" in e else e
                        for e in c["env"]]
            for key in ("command", "args"):
                if key in c:
                    c[key] = [in_command(w) for w in c[key]]
        pods.append({"apiVersion": "v1", "kind": "Pod", **t})
    return pods


class PodmanPlay:
    """The Indexed Job on this machine (--k8s-client podman): its pods lowered (pods_for_podman), played with
    `podman kube play` with its ConfigMaps (volumes, as Podman makes them) and claim (a named volume of the claim's
    name, kept), each pod at its own address on a network of the job's own (named as the job), which the
    hostAliases name. Followed as the Docker backend follows its containers: the first node to fail is named,
    every other one stopped, the logs gathered into runs/<job>/node<k>/, then every pod, volume (the claim's
    aside) and the network removed."""

    POLL_S = 1.0
    STOP_S = 5   # seconds a stopped node has to end before it is killed

    @staticmethod
    def cannot(kind: str = "indexed", host_network: bool = False, deadline: float = 0.0, pass_env=(),
               detach: bool = False) -> str:
        """What of a Kubernetes job this machine's Podman cannot run, in one line ("": nothing)."""
        if kind != "indexed":
            return f"--k8s-client podman runs the indexed kind only (Podman has no {kind} controller)"
        if host_network:
            return ("--k8s-client podman takes no --k8s-host-network: Podman 4.3 drops hostAliases on the host's "
                    "network, and the master's name would not resolve")
        if deadline:
            return "--k8s-deadline is the Job controller's; Podman has none: give --k8s-client kubectl"
        if pass_env:
            return ("--pass-env reads a Secret, which `podman kube play` (4.3) does not make: run it with "
                    "--k8s-client kubectl")
        if detach:
            return ("--detach with --k8s-client podman: nothing would follow the pods (stop the others at a failure, "
                    "gather the logs, remove them); stay attached")
        return ""

    def __init__(self, job_id: str, nodes: int):
        self.job_id, self.nodes = job_id, nodes

    @classmethod
    def of(cls, handle: SupervisedHandle) -> PodmanPlay:
        return cls(handle.job_id, handle.nodes)

    def container(self, rank: int) -> str:
        return f"{self.job_id}-{rank}-{kube.CONTAINER}"   # Podman names a pod's container <pod>-<container>

    def objects(self, manifests) -> list[str]:
        """What playing the job makes, as `down` removes it: the network, the pods, the ConfigMaps' volumes and
        each pod's emptyDir volumes (the claim's volume is kept)."""
        by_kind = kinds(manifests)
        return [f"network/{self.job_id}", *(f"pod/{self.job_id}-{k}" for k in range(self.nodes)),
                *(f"volume/{m['metadata']['name']}" for m in by_kind.get("ConfigMap", [])),
                *(f"volume/{self.job_id}-{k}-{v['name']}" for k in range(self.nodes)
                  for v in by_kind["Job"][0]["spec"]["template"]["spec"]["volumes"] if "emptyDir" in v)]

    def submit(self, plan: Plan, handle: SupervisedHandle, log=print) -> SupervisedHandle:
        """Play the job (`plan.manifests`); `handle`: the Kubernetes backend's, which gets objects() as its
        objects."""
        by_kind = kinds(plan.manifests)
        handle = replace(handle, objects=self.objects(plan.manifests))
        mine = kube.owner_label(handle.owner)
        if left := self.refuse_taken(mine):   # an earlier run's, this owner's (of any size): removed
            self.down(replace(handle, objects=list(dict.fromkeys([*handle.objects, *left]))), log=lambda *_: None)
            log(f"{plan.job_id}: removed what an earlier run of it left")
        handle.save()   # first: whatever is made from here on, a cancel finds
        (plan.dir / "manifests.yaml").write_text(kube.to_yaml(plan.manifests))
        try:
            podman("network", "create", "--label", f"{settings.LABEL_JOB}={self.job_id}", "--label",
                   f"{settings.LABEL_OWNER}={mine}", self.job_id)
            net = json.loads(podman("network", "inspect", self.job_id).stdout)[0]["subnets"][0]
            gateway = ipaddress.ip_address(net.get("gateway") or "0.0.0.0")
            free = (str(a) for a in ipaddress.ip_network(net["subnet"]).hosts() if a != gateway)
            ips = [next(free) for _ in range(self.nodes)]
            lowered = pods_for_podman(by_kind["Job"][0], by_kind["Service"][0], ips,
                                      dollars_taken(plan.spec.image_ref))
            # a claim made before (an earlier run's checkpoints) is kept as it is, as `kubectl apply` keeps it:
            # Podman would refuse to make its volume again
            claims = [m for m in by_kind.get("PersistentVolumeClaim", [])
                      if podman("volume", "exists", m["metadata"]["name"], check=False).returncode != 0]
            docs = by_kind.get("ConfigMap", []) + claims + lowered
            (plan.dir / "played.yaml").write_text(kube.to_yaml(docs))   # what Podman plays, as played
            podman("kube", "play", "--quiet", "--network", self.job_id, *(w for ip in ips for w in ("--ip", ip)),
                   "-", stdin=kube.to_yaml(docs))
        except BaseException as e:
            with signals_held():
                self.down(handle, never_failing(log))
                # its record says it never started: the job has ended, and its id is free again
                judge(JobFacts([], ended=f"its pods did not start: {str(e) or type(e).__name__}"[:400]),
                      handle.job_id, "kubernetes", handle.dir).save()
            if isinstance(e, UserError) and "setting rlimit" in str(e):
                raise UserError(f"{e}: Podman gives every container its default open-file and process limits "
                                f"(nofile, nproc), above what this machine allows; set lower ones as default_ulimits "
                                f"in containers.conf (docs/explanation/kubernetes.md)") from None
            raise
        log(f"played {plan.job_id} ({self.nodes} pods) with podman; see it with `podman pod ps --filter "
            f"label={settings.LABEL_JOB}={plan.job_id}`")
        return handle

    def refuse_taken(self, mine: str) -> list[str]:
        """The pods and network of this job id left here (pod/<name>, network/<name>); refused in one line, nothing
        of theirs touched, where another owner's (its labels: kube.owner_label) are among them. The network's name
        is the job's: it counts whatever its labels say."""
        pods, nets = (listed(podman(*argv, "--format", "json").stdout, argv[0]) for argv in (
            ("pod", "ps", "--filter", f"label={settings.LABEL_JOB}={self.job_id}"),
            ("network", "ls", "--filter", f"name=^{self.job_id}$")))
        found = [(f"{what}/{o.get(name, '?')}", (o.get(labels) or {}).get(settings.LABEL_OWNER, ""))
                 for what, name, labels, objs in (("pod", "Name", "Labels", pods), ("network", "name", "labels", nets))
                 for o in sorted(objs, key=lambda o, name=name: str(o.get(name)))]
        records.refuse_taken(self.job_id, "on this machine's Podman", found, mine)
        return list(dict.fromkeys(what for what, _ in found))

    def containers(self) -> dict[int, dict]:
        """The job's node containers by rank, as `podman ps` sees them (State, ExitCode, ExitedAt)."""
        out = podman("ps", "-a", "--filter", f"label={settings.LABEL_JOB}={self.job_id}", "--format", "json").stdout
        names = {self.container(k): k for k in range(self.nodes)}
        return {names[n]: c for c in listed(out, "ps") for n in c.get("Names", []) if n in names}

    def running(self) -> bool:
        """Every node's container runs."""
        ctrs = self.containers()
        return len(ctrs) == self.nodes and all(c.get("State") == "running" for c in ctrs.values())

    def state(self, handle: SupervisedHandle) -> tuple[JobState, int, str]:
        ctrs = self.containers()
        if not ctrs:   # gone: the job ended here (its result says how) or never started
            try:
                return (JobState.PASSED if json.loads(Path(handle.dir, records.SUMMARY).read_text())["ok"]
                        else JobState.FAILED), 0, ""
            except (OSError, ValueError, KeyError):
                return JobState.UNKNOWN, 0, "no pod of the job"
        failed = [k for k, c in ctrs.items() if c.get("State") == "exited" and c.get("ExitCode")]
        if failed:
            return JobState.FAILED, 0, f"node{failed[0]} exit {ctrs[failed[0]]['ExitCode']}"
        if len(ctrs) == self.nodes and all(c.get("State") == "exited" for c in ctrs.values()):
            return JobState.PASSED, 0, ""
        return (JobState.RUNNING if any(c.get("State") == "running" for c in ctrs.values()) else
                JobState.PENDING), 0, ""

    def ends(self, ranks) -> dict[int, tuple[float, bool]]:
        """When each rank's container ended, to the nanosecond (ps's ExitedAt is in seconds), and whether the
        OOM killer ended it."""
        ranks = list(ranks)
        out = podman("container", "inspect", "--format", "{{.State.FinishedAt.UnixNano}} {{.State.OOMKilled}}",
                     *(self.container(k) for k in ranks), check=False).stdout.splitlines() if ranks else []
        return {k: (int(t) / 1e9, oom == "true") for k, (t, _, oom) in
                zip(ranks, (ln.partition(" ") for ln in out), strict=False) if t.isdigit() and int(t) > 0}

    def streaming(self, handle: SupervisedHandle, node: int) -> tuple[str | None, list[str]]:
        """(which container it is, the words that stream its output) for node's container now; (None, []): none
        yet."""
        name = self.container(node)
        found = podman("container", "inspect", "--format", "{{.Id}}", name, check=False).stdout.strip()
        return (found, ["podman", "logs", "-f", name]) if found else (None, [])

    def logs(self, handle: SupervisedHandle, node: int) -> str:
        if not 0 <= node < self.nodes:
            raise UserError(f"job {handle.job_id} has no node {node}")
        kept = Path(handle.dir, f"node{node}", "container.log")
        if kept.exists():   # gathered when the job ended
            return kept.read_text(errors="replace")
        proc = podman("logs", self.container(node), check=False, merge=True)
        if proc.returncode != 0:
            raise UserError(f"job {handle.job_id} has no container of node {node} (yet)")
        return proc.stdout

    def follow(self, handle: SupervisedHandle, log=print, timeout: float | None = None,
               poll: float | None = None) -> JobResult:
        """Until every node ended well, one failed (the first to end so), one was lost, or `timeout`; asking every
        `poll` seconds (default POLL_S)."""
        poll = poll or self.POLL_S
        began, seen, timed_out, hung = time.monotonic(), set(), False, None
        hangs = kube.hang_watcher(handle, kube.PodFiles(lambda k: ["podman", "exec", "-i", self.container(k)],
                                               self.running), log, poll)
        while True:
            ctrs = self.containers()
            seen |= set(ctrs)
            if lost := sorted(seen - set(ctrs)):
                log(f"{handle.job_id}: node{lost[0]} {VANISHED}: stopping the others")
                break
            if failed := sorted(k for k, c in ctrs.items() if c.get("State") == "exited" and c.get("ExitCode")):
                # which of them is to blame is the judge's, once their ends are read
                log(f"{handle.job_id}: " + "; ".join(f"node{k} failed ({exit_meaning(ctrs[k].get('ExitCode'))})"
                                                     for k in failed) + ": stopping the others")
                break
            if len(ctrs) == self.nodes and all(c.get("State") == "exited" for c in ctrs.values()):
                break
            if timeout is not None and time.monotonic() - began > timeout:
                timed_out = True
                break
            if (hung := hangs.look()) is not None:
                break
            time.sleep(poll)
        stopped = [k for k, c in ctrs.items() if c.get("State") != "exited"]
        if stopped:
            podman("stop", "--time", str(self.STOP_S), *(self.container(k) for k in stopped), check=False)
        ends = self.containers()
        for k in range(self.nodes):
            d = Path(handle.dir, f"node{k}")
            d.mkdir(parents=True, exist_ok=True)
            if k not in ends:
                continue
            # its output, and its ranks' logs out of the pod's emptyDir
            files.write_atomic(d / "container.log", podman("logs", self.container(k), check=False,
                                                            merge=True).stdout)
            podman("cp", f"{self.container(k)}:{settings.LOG_DIR}/.", str(d), check=False)
        facts = played_facts(handle, ends, self.ends(ends), stopped, timed_out, hung)
        self.down(handle, log=lambda *_: None)
        result = judge(facts, handle.job_id, "kubernetes", handle.dir,
                       smoke=smoke_report(Path(handle.dir, "node0", "workerlog.0")))
        result.save()
        return result

    def down(self, handle: SupervisedHandle, log=print) -> None:
        """Every pod, ConfigMap volume and the network, whatever is left of them; the claim's volume is kept."""
        kinds: dict[str, list[str]] = {}
        for o in handle.objects:
            kind, _, name = o.partition("/")
            kinds.setdefault(kind, []).append(name)
        if kinds.get("pod"):
            log(line(["podman", "pod", "rm", "--force", "--ignore", "--time", "0", *kinds["pod"]]))
            podman("pod", "rm", "--force", "--ignore", "--time", "0", *kinds["pod"], check=False)
        for v in kinds.get("volume", []):
            podman("volume", "rm", "--force", v, check=False)
        for n in kinds.get("network", []):
            podman("network", "rm", "--force", n, check=False)


# The probe: a pod whose container echoes an argument and an env value, each written $$. The kubelet gives the
# container $ for both; Podman 4.3 gives $$ for both; Podman 4.7 and later expand commands (containers/podman#19630,
# "Expand env variables for cmds/entrypoint with format $(ENV)"), and env values, as far as its issues say
# (containers/podman#24181), not
PROBE_SCRIPT = 'echo "$0 $F"'
VERSION = re.compile(r"[0-9A-Za-z.+~-]{1,40}")


def dollars_taken(image: str) -> Dollars:
    """Where this machine's Podman takes $$ for $ in a kube play, as the kubelet does: asked of it, by playing one
    pod of `image` (the probe), never assumed from its version; the answer kept per version in the user's cache."""
    version = podman("version", "--format", "{{.Client.Version}}").stdout.strip()
    known = settings.user_cache() / f"podman-{version}-dollars.json" if VERSION.fullmatch(version) else None
    said = files.read_json(known) if known else {}
    if isinstance(said.get("command"), bool) and isinstance(said.get("env"), bool):
        return Dollars(said["command"], said["env"])
    probe = f"fleetbox-probe-{secrets.token_hex(4)}"
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": probe},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "echo", "image": image, "command": ["sh", "-c", PROBE_SCRIPT, "$$"],
               "env": [{"name": "F", "value": "$$"}]}]}}
    try:
        podman("kube", "play", "--quiet", "--network", "none", "-", stdin=kube.to_yaml([pod]))
        podman("wait", f"{probe}-echo")
        out = podman("logs", f"{probe}-echo").stdout.split()
    finally:
        podman("pod", "rm", "--force", "--ignore", "--time", "0", probe, check=False)
    if len(out) != 2 or not set(out) <= {"$", "$$"}:
        raise UserError(f"podman kube play gave {' '.join(out)[:80]!r} for an argument and an env value written "
                        f"$$: neither $ (as the kubelet) nor $$ (as Podman 4.3)")
    taken = Dollars(out[0] == "$", out[1] == "$")
    if known:
        try:
            known.parent.mkdir(parents=True, exist_ok=True)
            files.write_json(known, {**taken._asdict(), "podman": version})
        except OSError:   # a home that cannot be written: asked again next time
            pass
    return taken


def kinds(manifests) -> dict[str, list[dict]]:
    """The job's objects by kind, each kind's in order."""
    by_kind: dict[str, list[dict]] = {}
    for m in manifests:
        by_kind.setdefault(m["kind"], []).append(m)
    return by_kind


def played_facts(handle: SupervisedHandle, ctrs: dict[int, dict], ends: dict[int, tuple[float, bool]], stopped,
                 timed_out: bool, hung: dict | None) -> JobFacts:
    """What Podman says of each node's container once the job ended (`ctrs`: as `podman ps` lists them; `ends`:
    when each ended, and whether the OOM killer ended it); `stopped`: the nodes fleetbox stopped; a node whose
    container is not there was removed while the job ran."""
    nodes = []
    for k in range(handle.nodes):
        c, (at, oom) = ctrs.get(k, {}), ends.get(k, (None, False))
        d = Path(handle.dir, f"node{k}")
        nodes.append(NodeFacts(k, str(d), exit_code=c.get("ExitCode") if c.get("State") == "exited" else None,
                               ended=at, stopped=k in stopped, vanished=k not in ctrs, oom=oom,
                               output=str(d / "container.log")))
    return JobFacts(nodes, timed_out, hung)


def listed(out: str, what: str) -> list[dict]:
    """podman's JSON list of `what`; one line where it gave none."""
    try:
        found = json.loads(out or "[]")
    except ValueError:
        found = None
    if not isinstance(found, list):
        raise UserError(f"podman {what} gave no JSON list")
    return [f for f in found if isinstance(f, dict)]


def podman(*args: str, stdin: str | None = None, check: bool = True, merge: bool = False) -> \
        subprocess.CompletedProcess:
    """podman with the given words (never a shell); with `check`, a failure is one line, podman's own; `merge`:
    its stderr in its stdout (a container's output, both streams)."""
    if not shutil.which("podman"):
        raise UserError("podman not found: install Podman 4.3 or later (or use --k8s-client kubectl)")
    proc = subprocess.run(["podman", *args], input=stdin, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merge else subprocess.PIPE, errors="replace")
    if check and proc.returncode != 0:
        said = [ln.strip() for ln in ((proc.stderr or "") + "\n" + proc.stdout).splitlines() if ln.strip()]
        first = next((ln for ln in said if "error" in ln.lower() and "level=warning" not in ln), "")
        last = said[-1] if said else f"exit {proc.returncode}"   # kube play's last: "failed to start 2 containers"
        raise UserError(f"podman {' '.join(args[:2])} failed: {last}" + (f" ({first})" if first != last else ""))
    return proc
