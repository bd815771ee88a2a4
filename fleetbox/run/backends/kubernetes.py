"""The Kubernetes backend: the same plan as Kubernetes objects, in one of three shapes (--k8s-kind):

  indexed    an Indexed Job and a headless Service (the default: nothing but Kubernetes itself). A node's rank is
             its pod's completion index (JOB_COMPLETION_INDEX); the master is the index-0 pod's stable name
             <job>-0.<job> (the pod's hostname, under the Service as its subdomain).
  volcano    a Volcano Job (batch.volcano.sh/v1alpha1): gang-scheduled (minAvailable = nodes), its `svc` plugin
             names the pods (<job>-node-<k>.<job>), its `env` plugin gives the rank (VK_TASK_INDEX).
  paddlejob  a Kubeflow PaddleJob (kubeflow.org/v1, Training Operator v1): its Worker replicas, the master the
             operator's Service of worker 0 (<job>-worker-0), the rank the pod's replica-index label.

Every shape runs one pod template: fleetbox's node (run/plan.py's NodeRun) as one container whose command is a
short shell script. The per-node values a Docker or Slurm node gets as placeholders ({rank}, {master_ip},
{node_ip}, {iface}, {port_range}) are found there, in the pod: the rank from the shape's index, the master's
numeric IP from its name (Paddle's launcher needs an IP to tell that it is the master), the node's interface
and address towards it (fleetbox_netinfo, as Slurm's runtimes run it in the image).

`plan` and `describe` are pure (no cluster, no kubectl): --dry-run prints the manifests as multi-document YAML.
Running them is the client's (--k8s-client, client_of), each with the same verbs (submit, state, logs, streaming,
follow, down): Kubectl, `kubectl apply` with the kubeconfig kubectl finds, or, on this machine, PodmanPlay,
`podman kube play` (podman_play.py: Podman 4.3 plays no Job or Service, so the Indexed Job is lowered to one Pod
per index, on a network of the job's own).
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import math
import os
import re
import shutil
import subprocess
import time
from dataclasses import KW_ONLY, dataclass, field, replace
from pathlib import Path

from fleetbox import files, settings
from fleetbox.errors import UserError
from fleetbox.processes import process_start, signals_held, this_host
from fleetbox.run import hostnet, node_log, placeholders, records
from fleetbox.run import plan as planner
from fleetbox.run import spec as spec_mod
from fleetbox.run.backend import CANCELLED, Capabilities, Doctoring, Option, Plan, mark_cancelled
from fleetbox.run.backends import node_script, restarts
from fleetbox.run.backends.kube_pods import (
    COMPLETION_INDEX,
    CONTAINER,
    INDEX_ANNOTATION,
    POD_IP_REF,
    POD_IP_VAR,
    PodFiles,
    hang_watcher,
    kubelet_literal,
    owner_label,
    to_yaml,
)
from fleetbox.run.backends.podman_play import PodmanPlay
from fleetbox.run.backends.restarts import ClientRestarts
from fleetbox.run.jobfolder import Layout
from fleetbox.run.judge import JobFacts, NodeFacts, judge
from fleetbox.run.records import Handle, JobInfo, JobState, SupervisedHandle
from fleetbox.run.result import JobResult
from fleetbox.run.shell import Raw, line

KINDS = ("indexed", "volcano", "paddlejob")
ATTEMPT_LABEL = "io.fleetbox.attempt"   # a pod's attempt, of fleetbox's own restarts
# how the Job controller (and the Training Operator) says activeDeadlineSeconds ended a job, in its condition
DEADLINE_SAID = "longer than specified deadline"
SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"   # kubectl's in a pod
# server-side: a client-side apply keeps each object whole in an annotation, 256 KiB at most, and a script's
# ConfigMap may hold up to 1 MiB; an existing claim (an earlier run's) is taken over, not refused
APPLY = ("apply", "--server-side", "--force-conflicts", "--field-manager=fleetbox", "-f", "-")
CLIENTS = ("kubectl", "podman")
SAYS = node_log.says("$NODE_INDEX")   # the node script's line of the node log protocol, its start (run/node_log.py)
MASTER_PORT_NAME = "master"
VOLCANO_TASK = "node"      # the Volcano Job's one task: its pods are <job>-node-<k>
PADDLE_WORKER = "Worker"   # the PaddleJob's one replica type: its pods and Services are <job>-worker-<k>

# What each shape gives a pod, and where it comes from
VOLCANO_INDEX = "VK_TASK_INDEX"              # Volcano's env plugin
VOLCANO_VERSION = "volcano.sh/job-version"   # Volcano's pod annotation: one more each time it restarts the job
KUBEFLOW_INDEX = "training.kubeflow.org/replica-index"   # the Training Operator's pod label

# The shell's own variables in the node script, as run/placeholders.py names them; a pod's user may have no $USER,
# and the device plugin chooses a pod's devices, and shows it only those
NODE_VARS = node_script.node_vars("NODE_INDEX", user=Raw('"$(id -un)"'), gpus="")

# What the Training Operator gives a PaddleJob's pods (training-operator pkg/controller.v1/paddlepaddle/envvar.go),
# which Paddle's launcher would take over fleetbox's flags (--master, --nnodes, --job_id)
PADDLE_OPERATOR_ENV = ("PADDLE_MASTER", "PADDLE_NNODES", "PADDLE_JOB_ID")

# The master's name resolves once its pod has an address (the headless Service publishes pods not yet ready);
# its pod may start later than the others (an image pull): wait for it this long.
MASTER_WAIT_S = 600
RESOLVE_PY = ("import socket, sys, time\n"
              "for _ in range(int(sys.argv[2]) // 2):\n"
              "    try: print(socket.gethostbyname(sys.argv[1])); break\n"
              "    except OSError: time.sleep(2)\n"
              "else: sys.exit(\"fleetbox: the master \" + sys.argv[1] + \" does not resolve\")")
# The checkpoint folder on the claim taken by the first pod of a run (rank 0, attempt 0), as fleetbox takes a
# folder here (run/checkpoints.py): the earlier run's markers cleared and, for --resume never, its checkpoints set
# aside (inside the folder: the claim's subPath is a mount point), before any rank can train or save
TAKE_PY = ("import json, sys\n"
           f"sys.path.insert(0, {settings.HELPERS_DIR!r})\n"
           "import fleetbox_checkpoint_folder as folder\n"
           "where, me, resume, says = sys.argv[1:5]\n"
           "try: got = folder.take(where, json.loads(me), None, resume)\n"
           "except OSError as e: sys.exit(f'{says}checkpoint folder {where}: {e.strerror or e}')\n"
           "o = got['owner'] or {}\n"
           "if not got['taken']: sys.exit(f'{says}checkpoint folder {where} belongs to job {o.get(\"job\")} of '\n"
           "                              f'{o.get(\"user\")} (runs folder {o.get(\"runs\")})')\n"
           "if got['aside']: print(f'{says}--resume never: moved the earlier checkpoints to {got[\"aside\"]}')")

# Kubernetes' own rules for what becomes a name or a label (apimachinery's validation)
RFC1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
RFC1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")   # a Service's name
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
QUALIFIED = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")   # domain/name
QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|[KMGTPE]i|[kMGTPE])?")
CONFIGMAP_KEY = re.compile(r"[-._a-zA-Z0-9]+")
CONFIGMAP_MAX = 1 << 20   # what the API server stores in one object (etcd's limit)
SHM_UNITS = {"": "", "b": "", "k": "Ki", "m": "Mi", "g": "Gi"}   # Docker's --shm-size units are binary


def dns_label(what: str, value: str, rule=RFC1123_LABEL, rule_name: str = "an RFC 1123 label") -> str:
    if len(value) > 63 or not rule.fullmatch(value):
        raise UserError(f"{what} {value!r} is not a Kubernetes name: it must be {rule_name} (lowercase letters, "
                        f"digits and '-', {'starting with a letter, ' if rule is RFC1035_LABEL else ''}at most 63)")
    return value


def dns_subdomain(what: str, value: str) -> str:
    if len(value) > 253 or not all(RFC1123_LABEL.fullmatch(p) for p in value.split(".")):
        raise UserError(f"{what} {value!r} is not a Kubernetes name: lowercase letters, digits, '-' and '.' "
                        f"(RFC 1123 subdomain, at most 253)")
    return value


def shm_quantity(size: str) -> str:
    """--shm-size (Docker's 8g, 512m) as a Kubernetes quantity (8Gi, 512Mi)."""
    m = re.fullmatch(r"([0-9]+)([bkmg]?)", size, re.I)
    if not m:
        raise UserError(f"--shm-size {size!r} must be a size such as 8g or 512m")
    return m.group(1) + SHM_UNITS[m.group(2).lower()]


@dataclass(frozen=True)
class Names:
    """Every name the job's objects take, and the master's, for one shape."""
    job: str
    kind: str
    owner: str = ""   # its objects' owner label (owner_label)

    @property
    def service(self) -> str:   # the headless Service (Volcano's svc plugin names its own the job's name)
        return self.job

    def pod(self, rank: int) -> str:
        """The pod's hostname (and the name its peers reach it by, under the Service)."""
        return {"indexed": f"{self.job}-{rank}", "volcano": f"{self.job}-{VOLCANO_TASK}-{rank}",
                "paddlejob": f"{self.job}-{PADDLE_WORKER.lower()}-{rank}"}[self.kind]

    @property
    def master(self) -> str:
        # the Training Operator makes a Service per pod, named as the pod: no subdomain
        return self.pod(0) if self.kind == "paddlejob" else f"{self.pod(0)}.{self.service}"

    @property
    def claim_folder(self) -> str:
        """The job's folder on the checkpoint claim: its owner's and its own (another owner's job of the same id
        neither resumes from it nor writes into it)."""
        return f"{self.owner}/{self.job}"

    @property
    def helpers(self) -> str:
        return f"{self.job}-helpers"

    @property
    def script(self) -> str:
        return f"{self.job}-script"

    def check(self, nodes: int) -> None:
        """The job id names a Service (an RFC 1035 label) and, with the last rank, a pod's hostname."""
        dns_label("--job-id", self.job, RFC1035_LABEL, "an RFC 1035 label")
        last = self.pod(nodes - 1)
        if len(last) > 63:
            raise UserError(f"--job-id {self.job!r} is too long for Kubernetes: its last pod's hostname {last!r} "
                            f"has {len(last)} characters, at most 63")


@dataclass(frozen=True)
class KubePlan(Plan):
    kind: str = "indexed"
    namespace: str = ""
    manifests: tuple = ()     # the objects, in the order they are applied (dicts, as JSON would hold them)
    secret: str = ""          # the Secret --pass-env reads from ("": none)
    secret_made: bool = False  # ... fleetbox's own, made from this environment (not one --k8s-secret names)
    client: str = "kubectl"   # what runs them (--k8s-client)
    attempt: int = 0          # fleetbox's own restarts: which attempt these manifests run (FLEETBOX_ATTEMPT)
    avoid: tuple[str, ...] = ()   # machines a failed node ran on, kept out for the rest of the job (--min-nodes)


@dataclass
class KubeHandle(SupervisedHandle):   # its supervisor: the command that follows it (restarts, hangs), if attached
    _: KW_ONLY
    kind: str = "indexed"
    namespace: str = ""                                # where its objects are, and the kubeconfig context
    context: str = ""                                  # (kubectl's at submit; every later call uses these)
    objects: list[str] = field(default_factory=list)   # each object applied, as kubectl names it (the job last);
    client: str = "kubectl"                            # podman's: pod/, volume/ and network/<name>
    attempt: int = 0
    hang_timeout: float = 0.0   # the job's deadlines, for the client's hang watch (follow)
    start_timeout: float = 0.0

    def scope(self) -> list[str]:
        """kubectl's words for where the job is (at)."""
        return at(self.context, self.namespace)


class KubernetesBackend(ClientRestarts):
    name = "kubernetes"
    about = "Kubernetes objects: an Indexed Job, a Volcano Job or a PaddleJob"
    plan_type = KubePlan
    handle_type = KubeHandle
    layout = Layout(earlier="attempt<N>", first=0, node="node<k>", output="node<k>/container.log", entries={
        "attempt<N>": restarts.EARLIER,
        "manifests.yaml": "Kubernetes: the objects applied, as YAML (a Secret's values never)",
        "played.yaml": "Kubernetes, --k8s-client podman: the objects as Podman played them (the Job as Pods)"})
    # restarts: the whole job, Volcano's (maxRetry) or fleetbox's own (run); hangs: run/hang.py's watcher, in the
    # command that follows the job; the time limit is the cluster's
    capabilities = Capabilities(own_limit="kubernetes: --k8s-deadline (activeDeadlineSeconds)", restarts=True,
                                watches_hangs=True, names_hosts=True,
                                reads_here=False)   # the nodes read this machine's files only through ConfigMaps
    doctoring = Doctoring(runtime="kubernetes")
    foreign = {"hosts": "Kubernetes chooses the nodes", "devices": "Kubernetes' device plugins choose the GPUs: "
               "give --gpus-per-node"}
    options = (
        Option("k8s_kind", "with --backend kubernetes: indexed (default: an Indexed Job and a headless Service), "
                           "volcano (a Volcano Job, gang-scheduled) or paddlejob (a Kubeflow PaddleJob, Training "
                           "Operator v1)", "indexed"),
        Option("k8s_namespace", "with --backend kubernetes: the namespace (default: kubectl's)", ""),
        Option("k8s_client", "with --backend kubernetes: kubectl (default: the cluster of kubectl's kubeconfig) or "
                             "podman (this machine's Podman, `podman kube play`: the Indexed Job as one Pod per "
                             "index)", "kubectl"),
        Option("k8s_gpu_resource", "with --backend kubernetes: the extended resource a CUDA node asks for, one per "
                                   "process (default nvidia.com/gpu)", "nvidia.com/gpu"),
        Option("k8s_dcu_resource", "with --backend kubernetes: the extended resource a DCU (ROCm) node asks for, one "
                                   "per process (default hygon.com/dcu; HAMi's: hygon.com/dcunum)", "hygon.com/dcu"),
        Option("k8s_host_network", "with --backend kubernetes: the pods on their nodes' network (hostNetwork: "
                                   "InfiniBand, no overlay); default: the pod network", False, bool),
        Option("k8s_files", "with --backend kubernetes: configmap (default: the script and fleetbox's helpers from "
                            "ConfigMaps) or image (the image holds them at /workspace and /fleetbox/helpers)",
               "configmap"),
        Option("k8s_checkpoint_claim", "with --backend kubernetes: a PersistentVolumeClaim every node mounts at the "
                                       "checkpoint folder (default: none; checkpoints go with the pods)", ""),
        Option("k8s_checkpoint_size", "with --backend kubernetes: make the claim too (ReadWriteMany), this big, "
                                      "e.g. 100Gi", ""),
        Option("k8s_secret", "with --backend kubernetes: the Secret --pass-env's variables come from, one key each "
                             "(default <job>-env)", ""),
        Option("k8s_deadline", "with --backend kubernetes: the job's time limit (activeDeadlineSeconds): 90, 90s, "
                               "20m, 1h (default: none)", 0.0, float),
        Option("k8s_queue", "with --backend kubernetes --k8s-kind volcano: the Volcano queue (default: Volcano's)",
               ""),
        Option("k8s_cpu", "with --backend kubernetes: CPUs each node asks for and is held to, e.g. 16 or 15500m "
                          "(default: none)", ""),
        Option("k8s_memory", "with --backend kubernetes: memory each node asks for and is held to, e.g. 64Gi "
                             "(default: none)", ""),
    )

    def __init__(self, k8s_kind: str = "indexed", k8s_namespace: str = "", k8s_gpu_resource: str = "nvidia.com/gpu",
                 k8s_dcu_resource: str = "hygon.com/dcu", k8s_host_network: bool = False,
                 k8s_files: str = "configmap", k8s_checkpoint_claim: str = "", k8s_checkpoint_size: str = "",
                 k8s_secret: str = "", k8s_deadline: float = 0.0, k8s_queue: str = "", k8s_cpu: str = "",
                 k8s_memory: str = "", k8s_client: str = "kubectl"):
        if k8s_kind not in KINDS:
            raise UserError(f"--k8s-kind {k8s_kind!r}: choose {', '.join(KINDS)}")
        if k8s_client not in CLIENTS:
            raise UserError(f"--k8s-client {k8s_client!r}: choose {', '.join(CLIENTS)}")
        if k8s_files not in ("configmap", "image"):
            raise UserError(f"--k8s-files {k8s_files!r}: choose configmap or image")
        if k8s_namespace:
            dns_label("--k8s-namespace", k8s_namespace)
        for flag, value in (("--k8s-gpu-resource", k8s_gpu_resource), ("--k8s-dcu-resource", k8s_dcu_resource)):
            if not QUALIFIED.fullmatch(value or "") or len(value) > 253:
                raise UserError(f"{flag} {value!r} is not an extended resource name (domain/name, e.g. "
                                f"nvidia.com/gpu)")
        if k8s_checkpoint_claim:
            dns_subdomain("--k8s-checkpoint-claim", k8s_checkpoint_claim)
        if k8s_checkpoint_size and not k8s_checkpoint_claim:
            raise UserError("--k8s-checkpoint-size makes the claim --k8s-checkpoint-claim names: give its name")
        for flag, value in (("--k8s-checkpoint-size", k8s_checkpoint_size), ("--k8s-cpu", k8s_cpu),
                            ("--k8s-memory", k8s_memory)):
            if value and not QUANTITY.fullmatch(value):
                raise UserError(f"{flag} {value!r} is not a Kubernetes quantity (e.g. 16, 500m, 64Gi)")
        if k8s_secret:
            dns_subdomain("--k8s-secret", k8s_secret)
        if k8s_queue and k8s_kind != "volcano":
            raise UserError("--k8s-queue is Volcano's: give it with --k8s-kind volcano")
        if k8s_queue:
            dns_subdomain("--k8s-queue", k8s_queue)
        if k8s_deadline < 0:
            raise UserError(f"--k8s-deadline must be positive (got {k8s_deadline:g})")
        self.kind, self.namespace, self.host_network, self.files = k8s_kind, k8s_namespace, k8s_host_network, k8s_files
        self.resource = {"cuda": k8s_gpu_resource, "rocm": k8s_dcu_resource}
        self.claim, self.claim_size, self.secret = k8s_checkpoint_claim, k8s_checkpoint_size, k8s_secret
        self.deadline = math.ceil(k8s_deadline) if k8s_deadline else 0   # whole seconds, never shorter
        self.queue, self.cpu, self.memory = k8s_queue, k8s_cpu, k8s_memory
        self.client = k8s_client
        if k8s_client == "podman":   # the job's nodes are this machine's containers; a failure names a rank
            if why := PodmanPlay.cannot(kind=k8s_kind, host_network=k8s_host_network, deadline=k8s_deadline):
                raise UserError(why)
            self.capabilities = replace(self.capabilities, names_hosts=False)
            self.doctoring = replace(self.doctoring, runtime="podman")
        if k8s_kind != "volcano":   # fleetbox's own restarts (run): they may go on with fewer nodes
            self.capabilities = replace(self.capabilities, fewer_nodes=True)

    # -- what a job is here --

    def check(self, spec: spec_mod.JobSpec) -> None:
        if spec.checkpoint_dir:
            raise UserError("--checkpoint-dir is a folder here; the kubernetes backend keeps checkpoints on a claim: "
                            "give --k8s-checkpoint-claim")
        if spec.resume not in ("auto", "never"):
            raise UserError(f"--resume {spec.resume}: the nodes cannot read this machine's folders; give auto or "
                            f"never (they resume from --k8s-checkpoint-claim)")
        for m in spec.mounts:   # hostPath volumes: a path on each node
            if placeholders.used(m.src) or not m.src.startswith("/"):
                raise UserError(f"--mount {m.src}:{m.dst}: on Kubernetes the source is a path on each node: give "
                                f"it absolute, without placeholders")
        if self.client == "podman" and (why := PodmanPlay.cannot(pass_env=spec.pass_env)):
            raise UserError(why)
        if spec.may_shrink and self.kind == "volcano":
            raise UserError(f"--min-nodes {spec.min_nodes} with --k8s-kind volcano: Volcano's controller restarts the "
                            f"whole job, on every node; give --k8s-kind indexed or paddlejob")
        if spec.may_shrink and not self.claim:
            raise UserError(f"--min-nodes {spec.min_nodes} on kubernetes needs --k8s-checkpoint-claim: the nodes left "
                            f"resume from it (without one, the checkpoints go with the pods)")

    # -- plan and describe (pure) --

    def plan(self, spec: spec_mod.JobSpec) -> KubePlan:
        job_id = spec.job_id or spec_mod.new_job_id()
        names = self.names(job_id)
        names.check(spec.nodes)
        # on the pod network every pod has its own address: one port fits every job (the Training Operator's);
        # on the nodes' own network it may be taken: a random one, as for Slurm's nodes
        port = spec.port or (36543 if not self.host_network else hostnet.random_port())
        secret = (self.secret or f"{job_id}-env") if spec.pass_env else ""
        manifests = self.render(spec, names, port, secret)
        return KubePlan(spec, job_id, settings.runs_root() / job_id, port, self.kind, self.namespace,
                        tuple(manifests), secret, bool(secret) and not self.secret, self.client,
                        notes=restarts.fewer_note(spec),
                        resume_note="" if self.claim else "it had no --k8s-checkpoint-claim: its checkpoints went "
                                                          "with its pods")

    def names(self, job_id: str) -> Names:
        return Names(job_id, self.kind, owner_label(records.owner()))

    def for_attempt(self, plan: KubePlan, attempt: int) -> KubePlan:
        """The same objects, their pods' FLEETBOX_ATTEMPT the restart's (fleetbox's own restarts)."""
        if attempt == plan.attempt:
            return plan
        return replace(plan, attempt=attempt, manifests=tuple(self.render(
            plan.spec, self.names(plan.job_id), plan.port, plan.secret, attempt, plan.avoid)))

    def without(self, plan: KubePlan, node: int, machine: str = "") -> KubePlan:
        """The same objects for one node fewer (an Indexed Job's completions, a PaddleJob's replicas), the pods
        numbered again from index 0 and kept off the `machine` the failed one ran on, for the rest of the job
        (--min-nodes); the scheduler places them on the others."""
        spec, avoid = replace(plan.spec, nodes=plan.spec.nodes - 1), (*plan.avoid, *([machine] if machine else []))
        return replace(plan, spec=spec, avoid=avoid, manifests=tuple(self.render(
            spec, self.names(plan.job_id), plan.port, plan.secret, plan.attempt, avoid)))

    def render(self, spec: spec_mod.JobSpec, names: Names, port: int, secret: str, attempt: int = 0,
               avoid: tuple[str, ...] = ()) -> list[dict]:
        """Every object of the job, in the order they are applied: the ConfigMaps and the claim before the pods
        that mount them."""
        objs = []
        if self.files == "configmap":
            objs += self.config_maps(spec, names)
        if self.claim_size:
            objs.append(self.meta({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                   "metadata": {"name": self.claim},
                                   "spec": {"accessModes": ["ReadWriteMany"],   # every node mounts it at once
                                            "resources": {"requests": {"storage": self.claim_size}}}}, names))
        template = self.pod_template(spec, names, port, secret, attempt, avoid)
        if self.kind == "indexed":
            objs += [self.headless_service(names), self.indexed_job(spec, names, template)]
        elif self.kind == "volcano":
            objs.append(self.volcano_job(spec, names, template))
        else:
            objs.append(self.paddle_job(spec, names, template, port))
        return objs

    def meta(self, obj: dict, names: Names) -> dict:
        """The labels every object of the job has (its id, its owner), and its namespace where one is given."""
        md = obj["metadata"]
        md["labels"] = {settings.LABEL_JOB: names.job, settings.LABEL_OWNER: names.owner, **md.get("labels", {})}
        if self.namespace:
            md["namespace"] = self.namespace
        return obj

    def config_maps(self, spec: spec_mod.JobSpec, names: Names) -> list[dict]:
        """fleetbox's helpers and the script (the script alone: the folder Docker mounts may be large)."""
        helpers = {p.name: p.read_text() for p in sorted(settings.HELPERS.glob("*.py"))}
        script = spec.script_path
        if not CONFIGMAP_KEY.fullmatch(script.name):
            raise UserError(f"the script's name {script.name!r} cannot be a ConfigMap key (letters, digits, '-', "
                            f"'_', '.'): rename it, or give --k8s-files image")
        try:
            text = script.read_text()
        except UnicodeDecodeError:
            raise UserError(f"the script {script} is not UTF-8 text: a ConfigMap cannot hold it; give --k8s-files "
                            f"image") from None
        if len(text.encode()) > CONFIGMAP_MAX - 4096:
            raise UserError(f"the script {script} is over 1 MiB, more than a ConfigMap holds: give --k8s-files image")
        return [self.meta({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}, names)
                for name, data in ((names.helpers, helpers), (names.script, {script.name: text}))]

    def headless_service(self, names: Names) -> dict:
        """The pods' DNS names (<pod hostname>.<service>), published before they are ready: the master's is
        looked up as soon as its pod has an address."""
        return self.meta({"apiVersion": "v1", "kind": "Service", "metadata": {"name": names.service},
                          "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                                   "selector": {settings.LABEL_JOB: names.job}}}, names)

    def node_run(self, spec: spec_mod.JobSpec, job_id: str) -> planner.NodeRun:
        """The node as the other backends have it: logs in the pod (an emptyDir), the checkpoints on the claim; no
        HIP_VISIBLE_DEVICES: the device plugin shows the pod its own DCUs only, as they are numbered there."""
        t = planner.template(spec, job_id, "logs", workspace=False, checkpoints=self.claim, shared_checkpoints=True)
        return replace(t, env={k: v for k, v in t.env.items() if k != planner.HIP_VISIBLE})

    def node_script(self, spec: spec_mod.JobSpec, names: Names, port: int, t: planner.NodeRun, attempt: int = 0) \
            -> str:
        """What the container runs: the node's values found in the pod, then Paddle's launcher (exec: it is the
        container's process, and gets its signals)."""
        rank_from = {"indexed": COMPLETION_INDEX, "volcano": VOLCANO_INDEX, "paddlejob": "KUBEFLOW_REPLICA_INDEX"}
        values = {**NODE_VARS, "nnodes": str(spec.nodes), "job_id": names.job, "master_port": str(port)}
        lines = [
            "set -eu",
            f'NODE_INDEX="${rank_from[self.kind]}"',
            # Volcano counts its restarts of the whole job (its version); the others' are fleetbox's own
            'FLEETBOX_ATTEMPT="${VOLCANO_JOB_VERSION:-0}"' if self.kind == "volcano" else
            f"FLEETBOX_ATTEMPT={attempt:d}",
            f"MASTER_NAME={line([names.master])}",
            # the master is this pod on rank 0 (the launcher tells that it is the master by the address)
            'if [ "$NODE_INDEX" = 0 ]; then MASTER_IP="$NODE_POD_IP"; else '
            f'MASTER_IP="$(python -c {line([RESOLVE_PY])} "$MASTER_NAME" {MASTER_WAIT_S})"; fi',
            f'set -- $(python {settings.HELPERS_DIR}/fleetbox_netinfo.py "$MASTER_IP" --plain)',
            'IFACE="${1:-}"; NODE_IP="${2:-$NODE_POD_IP}"',
        ]
        if spec.iface:
            lines.append(f"IFACE={line([spec.iface])}")
        lines += ['[ -n "$IFACE" ] || { echo "fleetbox: no interface of $(hostname) holds $NODE_IP" >&2; exit 2; }',
                  node_script.port_range("NODE_INDEX", str(port), spec.procs_per_node),
                  f'echo "{SAYS}$IFACE $NODE_IP -> master $MASTER_NAME = $MASTER_IP:{port}"']
        if self.claim:
            me = {"job": names.job, "runs": str(settings.runs_root().resolve()), "user": getpass.getuser()}
            lines.append('if [ "$NODE_INDEX" = 0 ] && [ "$FLEETBOX_ATTEMPT" = 0 ]; then '
                         f'python -c {line([TAKE_PY, settings.CHECKPOINT_DIR, json.dumps(me), spec.resume])} '
                         f'"{SAYS}"; fi')
        lines += [f"export {k}={line([placeholders.to_shell(v, values)])}" for k, v in t.env.items()
                  if placeholders.used(v)]
        if self.kind == "paddlejob":   # the operator's (training-operator pkg/controller.v1/paddlepaddle/envvar.go):
            lines.append(f"unset {' '.join(PADDLE_OPERATOR_ENV)}")   # the launcher would take them over its flags
        launch = line(placeholders.to_shell(w, values) for w in t.command)
        if not (spec.hang_timeout or spec.start_timeout):
            lines.append("exec " + launch)
            return "\n".join(lines)
        # the launcher as a child (ours, raw shell): a rank that a collective's own timeout ended holds its pod,
        # still running, until the client's hang watch has its stuck peers' stacks (its controller would end them
        # at the first failed pod); a stop (the kubelet's SIGTERM) is passed on, and holds nothing
        lines += [f"{launch} &", "LAUNCHER=$!",
                  """trap 'STOPPING=1; kill -TERM "$LAUNCHER" 2>/dev/null || true' TERM INT""",
                  *node_script.WAIT_LAUNCHER,
                  node_script.hold_after_timeout(settings.LOG_DIR, SAYS, node_script.HOLD_S, bash=False),
                  'exit "$rc"']
        return "\n".join(lines)

    def pod_template(self, spec: spec_mod.JobSpec, names: Names, port: int, secret: str, attempt: int = 0,
                     avoid: tuple[str, ...] = ()) -> dict:
        t = self.node_run(spec, names.job)
        env = [{"name": POD_IP_VAR, "valueFrom": POD_IP_REF}]
        if self.kind == "indexed":   # as the Job controller sets it (it adds none where the pod has one)
            env.append({"name": COMPLETION_INDEX, "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}})
        elif self.kind == "volcano":
            env.append({"name": "VOLCANO_JOB_VERSION", "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.annotations['{VOLCANO_VERSION}']"}}})
        else:
            env.append({"name": "KUBEFLOW_REPLICA_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": f"metadata.labels['{KUBEFLOW_INDEX}']"}}})
        # values the same on every node; those with placeholders are the node script's exports
        env += [{"name": k, "value": kubelet_literal(v)} for k, v in t.env.items() if not placeholders.used(v)]
        env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": secret, "key": k}}} for k in t.pass_env]
        mounts, volumes = [{"name": "dshm", "mountPath": "/dev/shm"}], [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_quantity(spec.shm_size)}}]
        if self.files == "configmap":
            mounts += [{"name": "helpers", "mountPath": settings.HELPERS_DIR, "readOnly": True},
                       {"name": "workspace", "mountPath": settings.WORKDIR, "readOnly": True}]
            volumes += [{"name": "helpers", "configMap": {"name": names.helpers}},
                        {"name": "workspace", "configMap": {"name": names.script}}]
        for i, m in enumerate(t.mounts):
            if m.dst == settings.LOG_DIR:   # the ranks' logs, for as long as the pod is kept
                vol = {"name": "logs", "emptyDir": {}}
            elif m.dst == settings.CHECKPOINT_DIR:
                vol = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": m.src}}
            else:   # the dataset cache, a DCU node's /opt/hyhal, --mount: paths on each node
                vol = {"name": f"host{i}", "hostPath": {"path": m.src}}
            volumes.append(vol)
            mounts.append({"name": vol["name"], "mountPath": m.dst, **({"readOnly": True} if m.ro else {}),
                           # each owner's job its own folder of the claim (as Docker's runs/<job>/checkpoints):
                           # every job naming the claim shares it
                           **({"subPath": names.claim_folder} if m.dst == settings.CHECKPOINT_DIR else {})})
        resources = {}
        if t.accelerator:   # one device per process, as the device plugin counts them
            resources[self.resource[t.accelerator]] = str(spec.gpus_each)
        if self.cpu:
            resources["cpu"] = self.cpu
        if self.memory:
            resources["memory"] = self.memory
        container = {"name": CONTAINER, "image": t.image,
                     "command": ["/bin/sh", "-c", kubelet_literal(self.node_script(spec, names, port, t, attempt))],
                     "env": env, "ports": [{"name": MASTER_PORT_NAME, "containerPort": port}],
                     "volumeMounts": mounts}
        if resources:   # limits alone: Kubernetes asks for the same (extended resources allow nothing else)
            container["resources"] = {"limits": resources}
        if any(o == "seccomp=unconfined" for o in t.security_opt):   # a DCU's runtime needs it (matrix.toml)
            container["securityContext"] = {"seccompProfile": {"type": "Unconfined"}}
        pod = {"restartPolicy": "Never", "containers": [container], "volumes": volumes}
        if self.kind == "indexed":
            pod["subdomain"] = names.service
        if self.host_network:   # and still the cluster's DNS, for the master's name
            pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
        if avoid:   # the machines failed nodes ran on: none of this job's pods goes there again
            pod["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": list(avoid)}]}]}}}
        labels = {settings.LABEL_JOB: names.job, settings.LABEL_OWNER: names.owner,
                  settings.LABEL_VARIANT: spec.variant.name}
        if self.kind != "volcano":   # fleetbox's own restarts: which attempt a pod is of
            labels[ATTEMPT_LABEL] = str(attempt)
        return {"metadata": {"labels": labels}, "spec": pod}

    def indexed_job(self, spec: spec_mod.JobSpec, names: Names, template: dict) -> dict:
        # backoffLimit 0: the first failed pod fails the Job (its controller ends the other pods); a pod made again
        # alone could not join its peers' collective: fleetbox restarts the whole job (restarting)
        job = {"completionMode": "Indexed", "completions": spec.nodes, "parallelism": spec.nodes,
               "backoffLimit": 0, "template": template}
        if self.deadline:
            job["activeDeadlineSeconds"] = self.deadline
        return self.meta({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": names.job}, "spec": job},
                         names)

    def volcano_job(self, spec: spec_mod.JobSpec, names: Names, template: dict) -> dict:
        if self.deadline:   # a Volcano Job has no deadline of its own: each pod's, from its start
            template = {**template, "spec": {**template["spec"], "activeDeadlineSeconds": self.deadline}}
        restart = spec.max_restarts > 0
        job = {"schedulerName": "volcano", "minAvailable": spec.nodes,   # all nodes at once, or none (gang)
               # svc: the headless Service and each pod's hostname; env: VK_TASK_INDEX
               "plugins": {"svc": ["--publish-not-ready-addresses"], "env": []},
               "policies": [{"event": "PodFailed", "action": "RestartJob" if restart else "TerminateJob"},
                            {"event": "PodEvicted", "action": "RestartJob" if restart else "TerminateJob"}],
               "tasks": [{"name": VOLCANO_TASK, "replicas": spec.nodes, "template": template}]}
        if restart:   # Volcano's default is 3; without restarts the policies end the job at the first failure
            job["maxRetry"] = spec.max_restarts
        if self.queue:
            job["queue"] = self.queue
        return self.meta({"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": {"name": names.job},
                          "spec": job}, names)

    def paddle_job(self, spec: spec_mod.JobSpec, names: Names, template: dict, port: int) -> dict:
        policy = "Never"   # as the Indexed Job's: the operator restarts a pod alone; fleetbox the whole job
        template = {**template, "spec": {**template["spec"], "restartPolicy": policy}}
        run = {"cleanPodPolicy": "None", "backoffLimit": 0}   # pods kept: their logs
        if self.deadline:
            run["activeDeadlineSeconds"] = self.deadline
        return self.meta({"apiVersion": "kubeflow.org/v1", "kind": "PaddleJob", "metadata": {"name": names.job},
                          "spec": {"runPolicy": run, "paddleReplicaSpecs": {PADDLE_WORKER: {
                              "replicas": spec.nodes, "restartPolicy": policy, "template": template}}}}, names)

    def describe(self, plan: KubePlan) -> str:
        how = ("kubectl apply -f -" if plan.client == "kubectl" else
               "podman kube play, as one Pod per index (pods_for_podman), on a network of the job's own")
        head = [f"# {plan.job_id}: {plan.spec.nodes} node(s) as a{'n' if plan.kind == 'indexed' else ''} "
                f"{plan.kind} job; apply with: {how}"]
        if plan.secret:
            head.append(f"# --pass-env {','.join(plan.spec.pass_env)}: from the Secret {plan.secret} (made from your "
                        f"environment at submit; its values are not shown)")
        if not self.claim:
            head.append("# no --k8s-checkpoint-claim: the job's checkpoints go with its pods")
        return "\n".join(head) + "\n" + to_yaml(plan.manifests)

    # -- acting: kubectl, with the kubeconfig it finds --

    def run(self, plan: KubePlan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """Volcano restarts the whole job itself (RestartJob, its version the attempt); a Job or a PaddleJob
        would make a failed pod again alone: fleetbox restarts the whole job instead, from this client."""
        applied: list[KubeHandle] = []   # each attempt's, once applied (a refused one has none)

        def submitted(handle: KubeHandle) -> None:
            applied.append(handle)
            if on_submit is not None:
                on_submit(handle)
        try:
            if self.kind == "volcano":
                return super().run(plan, log, timeout, submitted)
            return self.restarting(plan, log, timeout, submitted)
        finally:   # the Secret fleetbox made (its values are this shell's): no longer needed once the job ended
            if plan.secret_made and applied:
                with signals_held():
                    kubectl(*label_delete(applied[-1].scope(), ["secret"], plan.job_id,
                                          owner_label(records.owner()))[1:], check=False)

    def detach(self, plan: KubePlan, log=print) -> KubeHandle:
        if plan.client == "podman":
            raise UserError(PodmanPlay.cannot(detach=True))
        if plan.spec.max_restarts and self.kind != "volcano":
            raise UserError(f"--max-restarts with --detach: the {self.kind} kind's restarts are fleetbox's own, "
                            f"made by the command that follows the job; stay attached, or give --k8s-kind volcano "
                            f"(its controller restarts the whole job)")
        if plan.spec.hang_timeout or plan.spec.start_timeout:
            log("note: hang detection runs in the command that follows the job: a detached job has none (its "
                "time limit: --k8s-deadline)")
        handle = self.submit(plan, log)
        handle.supervisor = handle.supervisor_start = 0   # nothing follows it
        handle.save()
        return handle

    @staticmethod
    def objects(plan: KubePlan) -> list[str]:
        """Each object as kubectl names it (kind.group/name): a claim is left out, it outlives the job (its
        checkpoints)."""
        return [kubectl_name(m) for m in plan.manifests if m["kind"] != "PersistentVolumeClaim"]

    def submit(self, plan: KubePlan, log=print) -> KubeHandle:
        plan.make_dir()
        (plan.dir / records.SUMMARY).unlink(missing_ok=True)   # an earlier run's (a restart's is kept aside)
        if plan.attempt == 0:   # an earlier run's cancel (a restart's is this run's: it stops the restarts)
            (plan.dir / CANCELLED).unlink(missing_ok=True)
        JobInfo(plan.job_id, self.name, plan.spec.variant.name, plan.spec.nodes, plan.spec.procs_per_node,
                plan.spec.image_ref, paddle=plan.spec.paddle_pin).save(plan.dir)
        handle = KubeHandle(self.name, plan.job_id, str(plan.dir), plan.spec.nodes,
                            procs_per_node=plan.spec.procs_per_node, checkpoints=self.claim, owner=records.owner(),
                            kind=plan.kind, client=plan.client, attempt=plan.attempt, **following(plan))
        return self.client_of(plan).submit(plan, handle, log)

    @classmethod
    def leftovers(cls, job_id: str) -> str:
        kinds = ["secret", "configmap", "service", "job.batch", "job.batch.volcano.sh", "paddlejob.kubeflow.org"]
        return (f"Kubernetes objects: `{line(label_delete([], kinds, job_id, owner_label(records.owner())))}` "
                f"(with --namespace and --context where it ran; a kind the cluster lacks, left out)")

    def job_state(self, handle: KubeHandle) -> tuple[JobState, int, str]:
        """What the job's controller says of it (its object is the last one applied)."""
        if Path(handle.dir, CANCELLED).exists():
            return JobState.CANCELLED, handle.attempt, ""
        if files.read_json(Path(handle.dir, records.SUMMARY)).get("hang"):   # stopped by hang detection
            return self.between_attempts(handle, JobState.HUNG, handle.attempt, "")
        state, attempt, note = self.client_of(handle).state(handle)
        return self.between_attempts(handle, state, attempt if handle.kind == "volcano" else handle.attempt, note)

    @staticmethod
    def between_attempts(handle: KubeHandle, state: JobState, attempt: int, note: str) \
            -> tuple[JobState, int, str]:
        """An attempt that ended while the command that follows the job lives (asked from another process): it may
        restart it, so the job goes on."""
        if state in (JobState.FAILED, JobState.HUNG) and handle.followed() and handle.supervisor != os.getpid():
            return JobState.RUNNING, attempt, f"attempt {attempt} {state.value.lower()}; {handle.follower()} may " \
                                              f"restart it"
        return state, attempt, note

    def logs(self, handle: KubeHandle, node: int) -> str:
        return self.client_of(handle).logs(handle, node)

    def show_logs(self, handle: KubeHandle, node: int, follow: bool = False, log=print, poll: float = 0.5) -> None:
        """A node's output; with `follow`, each of its pods' in turn (a restart makes new ones), as it comes, until
        the job ends."""
        if not follow:
            log(self.logs(handle, node).rstrip("\n"))
            return
        shown: set[str] = set()
        while True:
            h = Handle.load(Path(handle.dir))   # a restart saves its attempt's
            # ended, and nothing follows it that may restart it (its attempt failed, the next one not applied yet)
            ended = self.job_state(h)[0].is_terminal and not h.followed()
            key, argv = self.streaming(h, node)
            if key is not None and key not in shown:
                shown.add(key)
                p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace")
                try:
                    for said in p.stdout:
                        log(said.rstrip("\n"))
                finally:   # a closed pipe, Ctrl-C: the stream stops with us
                    if p.poll() is None:
                        p.kill()
                    p.wait()
                    p.stdout.close()
                continue
            if ended:
                if not shown:   # it ended before: what was kept
                    log(self.logs(h, node).rstrip("\n"))
                return
            time.sleep(poll)

    def streaming(self, handle: KubeHandle, node: int) -> tuple[str | None, list[str]]:
        """(which container it is, the words that stream its output) for node's pod now; (None, []): none yet."""
        return self.client_of(handle).streaming(handle, node)

    def follow(self, handle: KubeHandle, log=print, timeout: float | None = None,
               poll: float | None = None) -> JobResult:
        """Until the job ended, as its client tells (the job's controller, or Podman's containers), or hang detection
        stopped it; then each node's output kept in node<k>/container.log, and each node's end."""
        return self.client_of(handle).follow(handle, log, timeout, poll)

    def cancel(self, handle: KubeHandle, log=print, asked: bool = True) -> None:
        """The job's objects, deleted (their pods with them); a claim is left: it holds the checkpoints."""
        if asked:
            mark_cancelled(handle.dir)   # first: its state is no longer the controller's to say, no restart follows
        self.client_of(handle).down(handle, log)

    def client_of(self, of: KubePlan | KubeHandle) -> Kubectl | PodmanPlay:
        """What runs the job's objects (--k8s-client): kubectl, or this machine's Podman."""
        if of.client == "podman":
            return PodmanPlay(of.job_id, of.nodes if isinstance(of, KubeHandle) else of.spec.nodes)
        return Kubectl(self)


class Kubectl:
    """The kubectl client: the job's objects applied to the cluster of kubectl's kubeconfig (its context and
    namespace at submit, kept in the handle), and followed through its API server."""

    POLL_S = 5.0   # an API server's answers, asked no more often than this

    def __init__(self, backend: KubernetesBackend):
        self.backend = backend

    def submit(self, plan: KubePlan, handle: KubeHandle, log=print) -> KubeHandle:
        if plan.attempt == 0:
            context, namespace = where(plan.namespace)
        else:   # a restart acts where the job's first attempt did, whatever kubectl's context is by then
            first = Handle.load(plan.dir)
            context, namespace = first.context, first.namespace
        scope = at(context, namespace)
        mine = owner_label(records.owner())
        docs = list(plan.manifests)
        if plan.secret_made:   # its values from this environment, on stdin only: never printed or written here
            secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": plan.secret}, "type": "Opaque",
                      "stringData": {k: os.environ[k] for k in plan.spec.pass_env}}
            docs.insert(0, self.backend.meta(secret, self.backend.names(plan.job_id)))
        elif plan.secret:   # the user's own: read, never written, labelled or deleted
            has_keys(scope, plan.secret, plan.spec.pass_env, log)
        kinds = kinds_of(docs)
        refuse_taken(scope, [*kinds, "pod"], plan.job_id, mine, namespace)
        (plan.dir / "manifests.yaml").write_text(to_yaml(plan.manifests))   # what was applied, the Secret aside
        handle = replace(handle, namespace=namespace, context=context, objects=(
            ["secret/" + plan.secret] if plan.secret_made else []) + self.backend.objects(plan))
        handle.save()   # first: whatever is applied from here on, a cancel finds
        by_label = label_delete(scope, kinds, plan.job_id, mine)
        # an earlier run of this job id left its objects (a finished job's are kept): applied again they would be
        # "unchanged", and the old job's status read as this one's. Deleted first, and waited for, their pods too
        # (an earlier attempt's, still on their way out), the claim kept; only this owner's (refuse_taken)
        gone = kubectl(*label_delete(scope, [*kinds, "pod"], plan.job_id, mine)[1:],
                       "--cascade=foreground", "--wait").stdout.strip().splitlines()
        if gone and not plan.attempt:   # a restart's are its earlier attempt's
            log(f"{plan.job_id}: deleted what an earlier run of it left ({', '.join(w.split()[0] for w in gone)})")
        try:
            kubectl(*scope, *APPLY, stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
        except BaseException:   # a failed or interrupted apply may have made some objects: none is left
            with signals_held():
                kubectl(*by_label[1:], check=False)
            raise
        if (plan.dir / CANCELLED).exists():   # `invoke cancel` came while this applied (a restart): it found none
            with signals_held():
                kubectl(*by_label[1:], check=False)
            log(f"{plan.job_id}: cancelled while it was applied; deleted")
            return handle
        log(f"applied {plan.job_id} ({plan.kind}, {plan.spec.nodes} nodes) in namespace {namespace}"
            + (f" of context {context}" if context else "") + f"; see it with `{line(['kubectl', *scope])} get "
            f"pods -l {settings.LABEL_JOB}={plan.job_id}`")
        return handle

    def state(self, handle: KubeHandle) -> tuple[JobState, int, str]:
        """What the job's controller says of it (its object is the last one applied)."""
        if not handle.objects:
            return JobState.UNKNOWN, handle.attempt, "no object was applied"
        proc = kubectl(*handle.scope(), "get", handle.objects[-1], "-o", "json", check=False)
        if proc.returncode != 0:
            said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
            return JobState.UNKNOWN, handle.attempt, said[-1] if said else f"kubectl exit {proc.returncode}"
        try:
            status = json.loads(proc.stdout).get("status") or {}
        except ValueError:
            return JobState.UNKNOWN, handle.attempt, "kubectl gave no JSON"
        return state_of(handle.kind, status)

    def logs(self, handle: KubeHandle, node: int) -> str:
        kept = Path(handle.dir, f"node{node}", "container.log")
        if kept.exists():   # gathered when the job ended (its pods may be gone)
            return kept.read_text(errors="replace")
        pods = {pod_rank(p, handle.kind): p["metadata"]["name"] for p in self.pods(handle)}
        if node not in pods:
            raise UserError(f"job {handle.job_id} has no pod of rank {node} (yet)")
        return kubectl(*handle.scope(), "logs", pods[node], "-c", CONTAINER).stdout

    def streaming(self, handle: KubeHandle, node: int) -> tuple[str | None, list[str]]:
        try:
            pod = next((p for p in self.pods(handle) if pod_rank(p, handle.kind) == node), None)
        except UserError:   # a busy API server: asked again
            return None, []
        if pod is None:
            return None, []
        md = pod["metadata"]
        return md.get("uid") or md["name"], ["kubectl", *handle.scope(), "logs", "-f", md["name"], "-c",
                                             CONTAINER]

    def follow(self, handle: KubeHandle, log=print, timeout: float | None = None,
               poll: float | None = None) -> JobResult:
        """Until the job's controller says it ended (Volcano's restarts included), or hang detection stopped it,
        asking every `poll` seconds (default POLL_S); the time limit is the controller's (--k8s-deadline)."""
        poll = poll or self.POLL_S
        told, hung = None, None
        hangs = hang_watcher(handle, PodFiles(*self.in_pods(handle)), log, poll)
        while True:
            state, _, note = self.backend.job_state(handle)
            if state == JobState.UNKNOWN and "(NotFound)" in note:   # its object is gone: it will not end
                state, note = JobState.FAILED, "gone (deleted while the job ran)"
            if state != told:
                log(f"{handle.job_id}: {state.value}" + (f" ({note})" if note else ""))
                told = state
            if state.is_terminal:
                break
            if (hung := hangs.look()) is not None:
                break
            time.sleep(poll)
        pods = self.pods(handle)
        for p in pods:   # what `invoke logs` shows once the pods are gone
            out = kubectl(*handle.scope(), "logs", p["metadata"]["name"], "-c", CONTAINER, check=False)
            d = Path(handle.dir, f"node{pod_rank(p, handle.kind)}")
            d.mkdir(parents=True, exist_ok=True)
            files.write_atomic(d / "container.log", out.stdout)
        if hung is not None:   # the job's object, and its pods with it: they would wait for the stuck rank
            log(f"{handle.job_id}: hung; deleting {handle.objects[-1]} and its pods")
            kubectl(*label_delete(handle.scope(), [handle.objects[-1].partition("/")[0]],
                                  handle.job_id, owner_label(handle.owner))[1:], "--cascade=foreground", check=False)
        facts = pod_facts(pods, handle, state, note, hung)
        result = judge(facts, handle.job_id, self.backend.name, handle.dir, name_host=True)
        result.save()
        return result

    def pods(self, handle: KubeHandle) -> list[dict]:
        """The job's pods, by rank (the newest of a rank's pods where its controller made it again)."""
        selector = selector_of(handle.job_id, owner_label(handle.owner)) + (
            f",{ATTEMPT_LABEL}={handle.attempt}" if handle.kind != "volcano" else "")   # never an earlier attempt's
        out = kubectl(*handle.scope(), "get", "pods", "-l", selector, "-o", "json")
        by_rank: dict[int, dict] = {}
        for p in sorted(listed(out, "pods"), key=lambda p: p.get("metadata", {}).get("creationTimestamp", "")):
            r = pod_rank(p, handle.kind)
            if r is not None:
                by_rank[r] = p
        return [by_rank[r] for r in sorted(by_rank)]

    def in_pods(self, handle: KubeHandle):
        """For PodFiles: `kubectl exec` into node k's pod, and whether every node's pod runs (asked again until they
        all do; a pod on its way out, an earlier attempt's, is none of them)."""
        names: dict[int, str] = {}

        def running() -> bool:
            try:
                pods = self.pods(handle)
            except UserError:   # a busy API server: the next look asks again
                return False
            names.clear()
            names.update({pod_rank(p, handle.kind): p["metadata"]["name"] for p in pods
                          if p.get("status", {}).get("phase") == "Running"
                          and not p["metadata"].get("deletionTimestamp")})
            return len(names) == handle.nodes

        def argv(k: int) -> list[str] | None:
            if k not in names:
                running()
            return ["kubectl", *handle.scope(), "exec", "-i", names[k], "-c", CONTAINER, "--"] \
                if k in names else None
        return argv, running

    def down(self, handle: KubeHandle, log=print) -> None:
        """The job's objects, deleted (their pods with them); a claim is left: it holds the checkpoints."""
        if not handle.objects:
            return
        # by its id and owner, never by name alone: a stale handle's names may be another owner's job's now
        argv = label_delete(handle.scope(), kinds_of_names(handle.objects), handle.job_id,
                            owner_label(handle.owner))
        log(line(argv))
        kubectl(*argv[1:])


def following(plan: KubePlan) -> dict:
    """The handle's fields for the command that follows the job: this process (a detached job's are cleared), and
    the deadlines its hang watch keeps."""
    return {"supervisor": os.getpid(), "supervisor_start": process_start(os.getpid()),
            "supervisor_host": this_host(), "hang_timeout": plan.spec.hang_timeout,
            "start_timeout": plan.spec.start_timeout}


def kinds_of(docs) -> list[str]:
    """The kinds of the job's objects, as kubectl names them (kind.group), in order; never a claim's (its
    checkpoints outlive the job)."""
    kinds = [kubectl_name(d).partition("/")[0] for d in docs if d["kind"] != "PersistentVolumeClaim"]
    return list(dict.fromkeys(kinds))


def kinds_of_names(objects: list[str]) -> list[str]:
    """The kinds of objects named kind/name, in order."""
    return list(dict.fromkeys(o.partition("/")[0] for o in objects))


def at(context: str, namespace: str) -> list[str]:
    """kubectl's words for where a job's objects are: its kubeconfig context and namespace (each where known)."""
    return (["--context", context] if context else []) + (["--namespace", namespace] if namespace else [])


def where(namespace: str) -> tuple[str, str]:
    """The context and namespace a submit acts in, kubectl's now (`namespace`: the one given): the handle keeps
    them, so a later cancel, log or follow acts there, whatever kubectl's are then. With no kubeconfig context (in
    a pod), kubectl's namespace is its service account's."""
    context = kubectl("config", "current-context", check=False).stdout.strip()
    if not namespace and context:
        namespace = kubectl(*at(context, ""), "config", "view", "--minify", "-o", "jsonpath={..namespace}",
                            check=False).stdout.strip()
    elif not namespace:
        try:
            namespace = Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip()
        except OSError:
            pass
    return context, namespace or "default"


def selector_of(job_id: str, owner: str) -> str:
    """The label selector of one job's objects: its id and its owner (owner_label)."""
    return f"{settings.LABEL_JOB}={job_id},{settings.LABEL_OWNER}={owner}"


def label_delete(scope: list[str], kinds: list[str], job_id: str, owner: str) -> list[str]:
    """`kubectl delete` of every object of these kinds that bears the job's id and owner (argv)."""
    return ["kubectl", *scope, "delete", ",".join(kinds), "-l", selector_of(job_id, owner), "--ignore-not-found"]


def refuse_taken(scope: list[str], kinds: list[str], job_id: str, mine: str, namespace: str) -> None:
    """An id whose objects another owner holds (another user, or this user's other runs folder) is theirs: one line
    naming them, and nothing of theirs touched (Docker's _refuse_taken, for a namespace)."""
    found = listed(kubectl(*scope, "get", ",".join(kinds), "-l", f"{settings.LABEL_JOB}={job_id}", "-o", "json"),
                   ",".join(kinds))
    records.refuse_taken(job_id, f"in namespace {namespace}", [
        (f"{o.get('kind', '?').lower()}/{o.get('metadata', {}).get('name', '?')}",
         o.get("metadata", {}).get("labels", {}).get(settings.LABEL_OWNER, "")) for o in found], mine)


def has_keys(scope: list[str], secret: str, keys, log=print) -> None:
    """The Secret --k8s-secret names (the user's own) holds a key for each --pass-env variable: else one line, before
    anything is applied (its pods would wait in CreateContainerConfigError). A Secret this user may use but not read
    (an admin's) is said so, and used."""
    proc = kubectl(*scope, "get", "secret", secret, "-o", "json", check=False)
    if proc.returncode != 0 and "(Forbidden)" in proc.stderr:
        log(f"note: --k8s-secret {secret}: kubectl may not read it here, so its keys are not checked "
            f"({', '.join(keys)} must be among them)")
        return
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise UserError(f"--k8s-secret {secret}: {said[-1] if said else 'kubectl cannot read it'} (make it first, "
                        f"e.g. kubectl create secret generic {secret} --from-env-file=FILE)")
    try:
        data = json.loads(proc.stdout).get("data") or {}
    except (ValueError, AttributeError):
        raise UserError(f"kubectl get secret {secret} gave no JSON object") from None
    if missing := [k for k in keys if k not in data]:
        raise UserError(f"--k8s-secret {secret} has no key {', '.join(missing)} for --pass-env (its keys: "
                        f"{', '.join(sorted(data)) or 'none'})")


def pod_facts(pods: list[dict], handle: KubeHandle, state: JobState, note: str, hung: dict | None) -> JobFacts:
    """What the pods' statuses say of each node, and what the job's controller says of the job (`state`,
    `note`); `hung`: hang detection stopped the job, deleting every pod still running."""
    by_rank = {pod_rank(p, handle.kind): p for p in pods}
    nodes = []
    for k in range(handle.nodes):
        p = by_rank.get(k, {})
        term = next((s.get("state", {}).get("terminated") for s in p.get("status", {}).get(
            "containerStatuses", []) if s.get("name") == CONTAINER), None) or {}
        code = term.get("exitCode")
        if not p and state == JobState.PASSED:   # its controller counted it succeeded; its pod is gone since
            code = 0
        log = str(Path(handle.dir, f"node{k}", "container.log"))
        nodes.append(NodeFacts(
            k, p.get("metadata", {}).get("name", "?"), p.get("spec", {}).get("nodeName", "?"), code,
            rfc3339(term.get("finishedAt", "")),
            # the job's controller stops the rest once one pod failed (deleting them); hang detection, all
            stopped=bool(p.get("metadata", {}).get("deletionTimestamp")) or (hung is not None and code is None),
            oom=term.get("reason") == "OOMKilled", finished_at=term.get("finishedAt", ""), output=log))
    timed_out = state == JobState.FAILED and DEADLINE_SAID in note   # --k8s-deadline: a restart gets a new one
    return JobFacts(nodes, timed_out, hung, completed=state == JobState.PASSED,
                    ended="" if state == JobState.PASSED or timed_out else note or state.value)


def rfc3339(ts: str) -> float | None:
    """A Kubernetes time (RFC 3339, to the second) as seconds; None where there is none."""
    try:
        return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() if ts else None
    except ValueError:
        return None


def pod_rank(pod: dict, kind: str) -> int | None:
    """A pod's rank, from what its controller wrote on it; None where it says none."""
    md = pod.get("metadata", {})
    if kind == "indexed":
        value = md.get("annotations", {}).get(INDEX_ANNOTATION)
    elif kind == "paddlejob":
        value = md.get("labels", {}).get(KUBEFLOW_INDEX)
    else:   # <job>-node-<k>: Volcano's pod names
        m = re.search(r"-(\d+)$", md.get("name", ""))
        value = m.group(1) if m else None
    return int(value) if value is not None and str(value).isdigit() else None


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """kubectl with the given words (never a shell: no quoting to get wrong), with the kubeconfig it finds; with
    `check`, a failure is one line, kubectl's own."""
    if not shutil.which("kubectl"):
        raise UserError("kubectl not found: install it, with a kubeconfig for your cluster (or use --dry-run)")
    proc = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        verb = next((a for a, before in zip(args, ("", *args), strict=False)
                     if not a.startswith("--") and before not in ("--namespace", "--context")), "")
        raise UserError(f"kubectl {verb} failed: {said[-1] if said else f'exit {proc.returncode}'}")
    return proc


def listed(out: subprocess.CompletedProcess, what: str) -> list[dict]:
    try:
        return list(json.loads(out.stdout)["items"])
    except (ValueError, KeyError, TypeError):
        raise UserError(f"kubectl get {what} gave no list") from None


def kubectl_name(obj: dict) -> str:
    """kind.group/name, as kubectl takes it (a core kind has no group): never another group's kind of the name."""
    group = obj["apiVersion"].rpartition("/")[0]
    return f"{obj['kind'].lower()}{'.' + group if group else ''}/{obj['metadata']['name']}"


# What each controller's status says (its own words), as fleetbox's states
VOLCANO_PHASES = {"Pending": JobState.PENDING, "Inqueue": JobState.PENDING, "Running": JobState.RUNNING,
                  "Restarting": JobState.RUNNING, "Completing": JobState.RUNNING, "Completed": JobState.PASSED,
                  "Aborting": JobState.RUNNING, "Aborted": JobState.CANCELLED, "Terminating": JobState.RUNNING,
                  "Terminated": JobState.FAILED, "Failed": JobState.FAILED}


def state_of(kind: str, status: dict) -> tuple[JobState, int, str]:
    """(state, attempt, note) from the job object's status: a Job's conditions, a Volcano Job's phase (and its
    retries), a PaddleJob's newest condition."""
    conds = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if kind == "indexed":
        done = {c.get("type"): c for c in conds}
        if "Complete" in done:
            return JobState.PASSED, 0, ""
        if "Failed" in done:
            return JobState.FAILED, 0, done["Failed"].get("message") or done["Failed"].get("reason", "")
        return (JobState.RUNNING if status.get("active") else JobState.PENDING), status.get("failed", 0), ""
    if kind == "volcano":
        phase = (status.get("state") or {}).get("phase", "")
        return VOLCANO_PHASES.get(phase, JobState.UNKNOWN), status.get("retryCount", 0), \
            "" if phase in VOLCANO_PHASES else phase
    last = (conds or [{}])[-1]   # the Training Operator appends its conditions in order
    kind_of = {"Succeeded": JobState.PASSED, "Failed": JobState.FAILED, "Running": JobState.RUNNING,
               "Restarting": JobState.RUNNING, "Created": JobState.PENDING, "Suspended": JobState.SUSPENDED}
    state = kind_of.get(last.get("type", ""), JobState.PENDING)
    return state, 0, last.get("message", "") if state == JobState.FAILED else ""
