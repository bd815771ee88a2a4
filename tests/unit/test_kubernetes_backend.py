"""The Kubernetes backend, offline: each shape (an Indexed Job with its headless Service, a Volcano Job, a
PaddleJob) rendered for a CPU and GPU variants, 2 nodes x 2 processes, and validated as a cluster would: the
built-in kinds with kubernetes-validate --strict against Kubernetes 1.30's schemas, Volcano's and Kubeflow's
against their CRDs' own openAPIV3Schema (tests/recorded/crds/, README there). A broken manifest is refused by
both, so the validation can fail. The node's wiring (its rank, the master, its address and ports) is checked by
running the container's own script with a stand-in python; kubectl is a stand-in that records its calls."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import types
from dataclasses import replace
from functools import cache

import jsonschema
import kubernetes_validate
import pytest
import yaml

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import backends, records
from fleetbox.run import plan as planner
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends.kube_pods import owner_label
from fleetbox.run.backends.kubernetes import APPLY, KubeHandle
from fleetbox.run.records import Handle
from tests.conftest import ROOT

K8S = "1.30.0"   # the Kubernetes version whose schemas (bundled with kubernetes-validate) the built-in kinds meet
CRDS = ROOT / "tests" / "recorded" / "crds"
CRD_OF = {("batch.volcano.sh/v1alpha1", "Job"): ("batch.volcano.sh_jobs.yaml", "v1alpha1"),
          ("kubeflow.org/v1", "PaddleJob"): ("kubeflow.org_paddlejobs.yaml", "v1")}
JOB = "fb-job"
PORT = 36543
KINDS = ("indexed", "volcano", "paddlejob")


def backend(**options):
    return backends.get("kubernetes", **options)


def spec(variant="cpu", **kw):
    return spec_mod.JobSpec(variant=matrix.load().get(variant), nodes=2, procs_per_node=2, job_id=JOB, **kw)


def strict(schema):
    """The schema as the API server's strict field validation reads it: an object that lists its properties takes
    no other field (unless it keeps unknown fields, or says what others it takes)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("enum", "default", "example") else v for k, v in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@cache
def crd_validator(api_version: str, kind: str):
    file, version = CRD_OF[(api_version, kind)]
    crd = yaml.safe_load((CRDS / file).read_text())
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    assert crd["spec"]["group"] == api_version.split("/")[0]
    schema = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(strict(schema))


def validate(obj: dict) -> None:
    """Raises where a cluster would refuse the object."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_OF:
        crd_validator(*key).validate(obj)
    else:
        kubernetes_validate.validate(obj, K8S, strict=True)


def refused(obj: dict) -> bool:
    try:
        validate(obj)
    except (jsonschema.ValidationError, kubernetes_validate.ValidationError):
        return True
    return False


def manifests(kind="indexed", variant="cpu", **options):
    b = backend(k8s_kind=kind, **options)
    return b, b.plan(spec(variant))


def the(plan, kind: str) -> dict:
    (obj,) = [m for m in plan.manifests if m["kind"] == kind]
    return obj


def template_of(obj: dict) -> dict:
    """The pod template of a job of any shape."""
    if obj["kind"] == "PaddleJob":
        return obj["spec"]["paddleReplicaSpecs"]["Worker"]["template"]
    if obj["apiVersion"].startswith("batch.volcano.sh"):
        return obj["spec"]["tasks"][0]["template"]
    return obj["spec"]["template"]


JOB_KIND = {"indexed": "Job", "volcano": "Job", "paddlejob": "PaddleJob"}


@pytest.mark.parametrize("variant", ["cpu", "cu126", "dcu"])
@pytest.mark.parametrize("kind", KINDS)
def test_each_shape_renders_for_each_device_and_a_cluster_would_take_every_object(kind, variant):
    b, plan = manifests(kind, variant, k8s_checkpoint_claim="ckpt", k8s_checkpoint_size="50Gi", k8s_deadline=3600.0)
    kinds = [m["kind"] for m in plan.manifests]
    assert kinds == ["ConfigMap", "ConfigMap", "PersistentVolumeClaim", *(["Service"] if kind == "indexed" else []),
                     JOB_KIND[kind]]
    for m in plan.manifests:
        validate(m)
    # what --dry-run prints is these objects, read back as YAML
    assert list(yaml.safe_load_all(b.describe(plan))) == list(plan.manifests)

    job = plan.manifests[-1]
    pod = template_of(job)["spec"]
    (c,) = pod["containers"]
    limits = c.get("resources", {}).get("limits", {})
    assert limits == {"cpu": {}, "cu126": {"nvidia.com/gpu": "2"}, "dcu": {"hygon.com/dcu": "2"}}[variant]
    assert (c.get("securityContext") == {"seccompProfile": {"type": "Unconfined"}}) == (variant == "dcu")
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"] == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    assert vols["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    mounted = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounted[settings.CHECKPOINT_DIR] == "checkpoints" and mounted["/dev/shm"] == "dshm"
    # the claim is shared by every job naming it: each owner's job has its own folder of it; every object, and
    # every pod, bears the owner
    (ckpt,) = [m for m in c["volumeMounts"] if m["mountPath"] == settings.CHECKPOINT_DIR]
    mine = owner_label(records.owner())
    assert ckpt["subPath"] == f"{mine}/{JOB}"
    assert {m["metadata"]["labels"][settings.LABEL_OWNER] for m in plan.manifests} == {mine}
    assert template_of(job)["metadata"]["labels"][settings.LABEL_OWNER] == mine
    assert ({"hostPath": {"path": "/opt/hyhal"}} in [{k: v for k, v in x.items() if k != "name"}
                                                      for x in vols.values()]) == (variant == "dcu")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FLEETBOX_CHECKPOINT_DIR"] == settings.CHECKPOINT_DIR and planner.HIP_VISIBLE not in env
    assert planner.HIP_VISIBLE not in c["command"][2]   # the device plugin numbers the pod's DCUs
    deadline = {"indexed": job["spec"].get("activeDeadlineSeconds"), "volcano": pod.get("activeDeadlineSeconds"),
                "paddlejob": job["spec"].get("runPolicy", {}).get("activeDeadlineSeconds")}[kind]
    assert deadline == 3600


def test_the_indexed_job_and_its_service_wire_the_master_and_ranks():
    _, plan = manifests("indexed")
    svc, job = the(plan, "Service"), the(plan, "Job")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    labels = template_of(job)["metadata"]["labels"]
    assert svc["spec"]["selector"] and labels | svc["spec"]["selector"] == labels   # it selects the job's pods
    assert job["spec"] | {"template": None} == {"completionMode": "Indexed", "completions": 2, "parallelism": 2,
                                                "backoffLimit": 0, "template": None}
    pod = template_of(job)["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"] == JOB and pod["restartPolicy"] == "Never"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def test_volcano_gang_schedules_every_node_and_restarts_the_whole_job():
    _, plan = manifests("volcano")
    spec_ = plan.manifests[-1]["spec"]
    assert (spec_["schedulerName"], spec_["minAvailable"], spec_["tasks"][0]["replicas"]) == ("volcano", 2, 2)
    assert set(spec_["plugins"]) == {"svc", "env"} and "maxRetry" not in spec_
    # the CRD takes any words here; Volcano's admission webhook (pkg/webhooks/admission/jobs/validate/util.go,
    # policyEventMap and policyActionMap) takes these among others
    assert {p["action"] for p in spec_["policies"]} == {"TerminateJob"}
    assert {p["event"] for p in spec_["policies"]} == {"PodFailed", "PodEvicted"}
    b = backend(k8s_kind="volcano", k8s_queue="research")
    restarting = b.plan(spec(max_restarts=3)).manifests[-1]["spec"]
    assert restarting["maxRetry"] == 3 and {p["action"] for p in restarting["policies"]} == {"RestartJob"}
    assert restarting["queue"] == "research"


def test_the_paddlejob_is_what_the_training_operator_finds():
    _, plan = manifests("paddlejob")
    spec_ = plan.manifests[-1]["spec"]
    worker = spec_["paddleReplicaSpecs"]["Worker"]
    (c,) = worker["template"]["spec"]["containers"]
    # the operator finds the container and its port by these names (kubeflowv1.PaddleJobDefault*)
    assert c["name"] == "paddle" and c["ports"] == [{"name": "master", "containerPort": PORT}]
    assert worker["replicas"] == 2 and worker["restartPolicy"] == worker["template"]["spec"]["restartPolicy"]
    assert spec_["runPolicy"]["backoffLimit"] == 0
    # restarts are fleetbox's, of the whole job: the operator restarts no pod alone
    restarting = backend(k8s_kind="paddlejob").plan(spec(max_restarts=2)).manifests[-1]["spec"]
    assert restarting["runPolicy"]["backoffLimit"] == 0
    assert restarting["paddleReplicaSpecs"]["Worker"]["restartPolicy"] == "Never"


@pytest.mark.parametrize("kind", ["indexed", "paddlejob"])
def test_a_restart_without_a_node_is_the_same_objects_for_one_node_fewer(kind):
    """--min-nodes: fleetbox's own restart after node1 failed runs the same objects for 2 nodes of 3, numbered
    again (an Indexed Job's completions, a PaddleJob's replicas), on the same claim; each node's launcher is told
    the new world."""
    b = backend(k8s_kind=kind, k8s_checkpoint_claim="ck")
    plan = b.plan(replace(spec(max_restarts=1, min_nodes=2), nodes=3))
    assert any(n.startswith("note: --min-nodes 2: a restart goes on without the node") for n in plan.notes)
    fewer = b.for_attempt(b.without(plan, 1, "kube-n3"), 1)
    job = fewer.manifests[-1]
    validate(job)
    assert "affinity" not in template_of(plan.manifests[-1])["spec"]   # the failed pod's machine, kept out
    assert template_of(job)["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] \
        == {"nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                                         "values": ["kube-n3"]}]}]}
    assert template_of(b.without(fewer, 0, "kube-n1").manifests[-1])["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] \
        == ["kube-n3", "kube-n1"]
    count = job["spec"]["completions"] if kind == "indexed" else job["spec"]["paddleReplicaSpecs"]["Worker"]["replicas"]
    assert fewer.spec.nodes == 2 and count == 2
    script = template_of(job)["spec"]["containers"][0]["command"][-1]
    assert "FLEETBOX_ATTEMPT=1\n" in script and " --nnodes 2 " in script
    assert " --nnodes 3 " in template_of(plan.manifests[-1])["spec"]["containers"][0]["command"][-1]
    assert [v["persistentVolumeClaim"]["claimName"] for v in template_of(job)["spec"]["volumes"]
            if "persistentVolumeClaim" in v] == ["ck"]
    assert [m for m in fewer.manifests if m["kind"] != job["kind"]] == \
        [m for m in plan.manifests if m["kind"] != job["kind"]]


# -- the node's wiring, by value: the container's script run with a stand-in python --

PYTHON = r'''#!{py}
import json, os, sys
if sys.argv[1:2] == ["-c"] and "fleetbox_checkpoint_folder" in sys.argv[2]:   # the claim's folder taken, for real
    code = sys.argv[2].replace({helpers_dir!r}, os.environ["HELPERS"])
    os.execv(sys.executable, [sys.executable, "-c", code, os.environ["CLAIM"], *sys.argv[4:]])
elif sys.argv[1:2] == ["-c"]:   # the master's name, resolved
    print(json.dumps({{"resolve": sys.argv[3:]}}), file=open(os.environ["OUT"] + ".resolve", "a"))
    print("10.0.0.1")
elif sys.argv[1].endswith("fleetbox_netinfo.py"):
    print("eth7", os.environ["NODE_POD_IP"])
else:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, open(os.environ["OUT"], "w"))
'''


def kubelet_expand(text: str, known: dict) -> str:
    """What the kubelet makes of an env value, a command or its args (its expansion, third_party/forked/golang/
    expansion): $$ is $, $(NAME) a known variable's value (left as written where unknown)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and text[i + 1:i + 2] == "$":
            out.append("$")
            i += 2
        elif text[i] == "$" and text[i + 1:i + 2] == "(" and ")" in text[i + 2:]:
            end = text.index(")", i + 2)
            name = text[i + 2:end]
            out.append(known[name] if name in known else text[i:end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def run_script(container: dict, env: dict, tmp_path) -> dict:
    """The container's command run as the kubelet would: its env values (each may name those before it, and the
    downward API's, `env`) and its command expanded as it expands them."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "python").write_text(PYTHON.format(py=sys.executable, helpers_dir=settings.HELPERS_DIR))
    (bin_ / "python").chmod(0o755)
    out = tmp_path / "launch.json"
    values = dict(env)
    for e in container["env"]:
        if "value" in e:
            values[e["name"]] = kubelet_expand(e["value"], values)
    command = [kubelet_expand(w, values) for w in container["command"]]
    proc = subprocess.run(command, env={**values, "PATH": f"{bin_}:/usr/bin:/bin", "OUT": str(out),
                                        "HOME": str(tmp_path), **env},
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(out.read_text())
    resolved = tmp_path / "launch.json.resolve"
    got["resolved"] = [json.loads(ln)["resolve"] for ln in resolved.read_text().splitlines()] \
        if resolved.exists() else []
    resolved.unlink(missing_ok=True)
    return got


@pytest.mark.parametrize("kind,index_env,master", [
    ("indexed", "JOB_COMPLETION_INDEX", f"{JOB}-0.{JOB}"),
    ("volcano", "VK_TASK_INDEX", f"{JOB}-node-0.{JOB}"),
    ("paddlejob", "KUBEFLOW_REPLICA_INDEX", f"{JOB}-worker-0"),
])
def test_a_node_takes_its_rank_from_its_shapes_index_and_the_master_from_rank_0s_name(kind, index_env, master,
                                                                                      tmp_path):
    _, plan = manifests(kind)
    (c,) = template_of(plan.manifests[-1])["spec"]["containers"]
    if kind == "paddlejob":   # the downward API gives it from the operator's label
        assert {"name": "KUBEFLOW_REPLICA_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['training.kubeflow.org/replica-index']"}}} in c["env"]
    one = run_script(c, {index_env: "1", "NODE_POD_IP": "10.0.0.2"}, tmp_path)
    argv = one["argv"]
    opt = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert argv[:2] == ["-m", "paddle.distributed.launch"]
    assert (opt["--rank"], opt["--nnodes"], opt["--nproc_per_node"]) == ("1", "2", "2")
    assert (opt["--master"], opt["--host"]) == (f"10.0.0.1:{PORT}", "10.0.0.2")
    assert one["resolved"] == [[master, "600"]]   # the master's name, asked of the cluster's DNS
    first, last = planner.trainer_ports(PORT, 1, 2)
    assert {k: one["env"][k] for k in ("FLEETBOX_NODE", "PORT_RANGE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")} \
        == {"FLEETBOX_NODE": "1", "PORT_RANGE": f"{first}:{last}", "GLOO_SOCKET_IFNAME": "eth7",
            "NCCL_SOCKET_IFNAME": "eth7"}
    zero = run_script(c, {index_env: "0", "NODE_POD_IP": "10.0.0.9"}, tmp_path)
    zopt = {zero["argv"][i]: zero["argv"][i + 1] for i in range(len(zero["argv"]) - 1)}
    # rank 0 is the master: its own address, as its launcher must see it to know itself
    assert (zopt["--rank"], zopt["--master"], zopt["--host"], zero["resolved"]) == ("0", f"10.0.0.9:{PORT}",
                                                                                     "10.0.0.9", [])


@pytest.mark.parametrize("kind,index_env,version", [("indexed", "JOB_COMPLETION_INDEX", None),
                                                     ("volcano", "VK_TASK_INDEX", "VOLCANO_JOB_VERSION")])
def test_the_first_pod_of_a_run_takes_the_claims_folder_and_resume_never_sets_the_earlier_run_aside(
        kind, index_env, version, tmp_path):
    """Before any rank trains: rank 0's pod of attempt 0 clears the earlier run's markers and, with --resume never,
    moves its checkpoints aside, as fleetbox does for a folder here (beside it; in a pod, where the claim's subPath
    is a mount point, inside it: the integration test); no other pod, and no restart, touches them."""
    from fleetbox.incontainer import fleetbox_checkpoint_folder as folder
    claim = tmp_path / "claim"

    def earlier_run():
        for step in (40, 50):
            (claim / f"step-{step:08d}").mkdir(parents=True)
            (claim / f"step-{step:08d}" / folder.COMPLETE).touch()
        (claim / folder.STATE).write_text('{"state": "done", "step": 50}')

    def node(resume: str, rank: int, attempt: int) -> list[str]:
        b = backend(k8s_kind=kind, k8s_checkpoint_claim="ckpt")
        plan = b.for_attempt(b.plan(spec(resume=resume)), attempt) if not version else b.plan(spec(resume=resume))
        (c,) = template_of(plan.manifests[-1])["spec"]["containers"]
        run_script(c, {index_env: str(rank), "NODE_POD_IP": "10.0.0.9", "CLAIM": str(claim),
                       "HELPERS": str(settings.HELPERS), **({version: str(attempt)} if version else {})}, tmp_path)
        return sorted(p.name for p in claim.iterdir())

    earlier_run()
    assert node("never", 1, 0) == node("never", 0, 1) == ["STATE", "step-00000040", "step-00000050"]
    assert node("never", 0, 0) == sorted([folder.OWNER, folder.LOCK])
    (aside,) = tmp_path.glob("claim.before-*")
    assert sorted(p.name for p in aside.iterdir()) == ["step-00000040", "step-00000050"]   # (its STATE cleared)
    assert folder.complete_steps(str(claim)) == []   # a restart resumes from this run's own checkpoints only
    shutil.rmtree(claim)
    earlier_run()   # --resume auto: the steps stay, to resume from; the earlier run's state goes
    assert node("auto", 0, 0) == sorted([folder.OWNER, folder.LOCK, "step-00000040", "step-00000050"])
    assert json.loads((claim / folder.OWNER).read_text())["job"] == JOB


@pytest.mark.parametrize("kind,index_env", [("indexed", "JOB_COMPLETION_INDEX"), ("volcano", "VK_TASK_INDEX"),
                                             ("paddlejob", "KUBEFLOW_REPLICA_INDEX")])
def test_what_paddles_launcher_would_take_over_its_flags_is_not_in_its_env(kind, index_env, tmp_path):
    _, plan = manifests(kind)
    (c,) = template_of(plan.manifests[-1])["spec"]["containers"]
    # Paddle's launcher reads POD_IP over --host: the pod's address has a name of fleetbox's own
    assert "POD_IP" not in {e["name"] for e in c["env"]}
    operator = {"PADDLE_MASTER": "10.9.9.9:1", "PADDLE_NNODES": "7", "PADDLE_JOB_ID": "theirs"}
    got = run_script(c, {index_env: "1", "NODE_POD_IP": "10.0.0.2", **operator}, tmp_path)
    left = {k: got["env"][k] for k in operator if k in got["env"]}
    # the Training Operator's (a PaddleJob's pods only) are unset before the launcher
    assert left == ({} if kind == "paddlejob" else operator)


def test_user_values_reach_the_script_quoted(tmp_path):
    hostile = "a b'; touch /tmp/pwned; '$(id)"
    b = backend()
    plan = b.plan(spec(args=(hostile,), env={"X": "{rank} " + hostile}, iface="eth 0"))
    (c,) = template_of(plan.manifests[-1])["spec"]["containers"]
    got = run_script(c, {"JOB_COMPLETION_INDEX": "1", "NODE_POD_IP": "10.0.0.2"}, tmp_path)
    assert got["argv"][-1] == hostile and got["env"]["X"] == "1 " + hostile
    assert got["env"]["GLOO_SOCKET_IFNAME"] == "eth 0"


def test_the_kubelets_expansion_leaves_user_values_and_the_scripts_own_as_written(tmp_path):
    b = backend()
    plan = b.plan(spec(args=("$(POD_IP)", "x$$y", "$(NODE_POD_IP)"),
                       env={"A": "a$$b", "B": "$(POD_IP)", "C": "$(NODE_POD_IP)"}))
    (c,) = template_of(plan.manifests[-1])["spec"]["containers"]
    got = run_script(c, {"JOB_COMPLETION_INDEX": "1", "NODE_POD_IP": "10.0.0.2"}, tmp_path)
    assert got["argv"][-3:] == ["$(POD_IP)", "x$$y", "$(NODE_POD_IP)"]
    assert (got["env"]["A"], got["env"]["B"], got["env"]["C"]) == ("a$$b", "$(POD_IP)", "$(NODE_POD_IP)")
    # the script's own $(...) and $((...)) are the shell's still
    opt = {got["argv"][i]: got["argv"][i + 1] for i in range(len(got["argv"]) - 1)}
    assert (opt["--master"], opt["--host"]) == (f"10.0.0.1:{PORT}", "10.0.0.2")
    first, last = planner.trainer_ports(PORT, 1, 2)
    assert got["env"]["PORT_RANGE"] == f"{first}:{last}"


# -- what a cluster refuses, the validators refuse --

def test_a_broken_object_is_refused_by_the_validators():
    _, plan = manifests("indexed")
    job, svc = the(plan, "Job"), the(plan, "Service")
    assert not refused(job) and not refused(svc)
    misspelled = json.loads(json.dumps(job))
    misspelled["spec"]["completionMod"] = misspelled["spec"].pop("completionMode")
    wrong_type = json.loads(json.dumps(job))
    wrong_type["spec"]["completions"] = "2"
    deep = json.loads(json.dumps(job))
    deep["spec"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    assert refused(misspelled) and refused(wrong_type) and refused(deep)
    bad_svc = json.loads(json.dumps(svc))
    bad_svc["spec"]["publishNotReadyAddresses"] = "yes"
    assert refused(bad_svc)


@pytest.mark.parametrize("kind", ["volcano", "paddlejob"])
def test_a_broken_custom_resource_is_refused_by_its_crds_schema(kind):
    _, plan = manifests(kind)
    job = plan.manifests[-1]
    assert not refused(job)

    def broken(change):
        j = json.loads(json.dumps(job))
        change(j)
        return refused(j)

    if kind == "volcano":
        assert broken(lambda j: j["spec"].__setitem__("minAvailble", j["spec"].pop("minAvailable")))
        assert broken(lambda j: j["spec"]["tasks"][0].__setitem__("replicas", "2"))
        assert broken(lambda j: j["spec"]["plugins"].__setitem__("svc", "--publish-not-ready-addresses"))
    else:
        assert broken(lambda j: j["spec"].__setitem__("paddleReplicaSpec", j["spec"].pop("paddleReplicaSpecs")))
        assert broken(lambda j: j["spec"]["runPolicy"].__setitem__("backoffLimit", "0"))
    # the pod template is checked as deep as the CRD describes it
    assert broken(lambda j: template_of(j)["spec"]["containers"][0].__setitem__("imagee", "x"))


# -- Podman's kube play: one Pod per index --

def test_the_indexed_job_lowers_to_one_pod_per_index_equal_to_its_template_but_the_index_and_names():
    b, plan = manifests("indexed", k8s_namespace="ml")
    job, svc = the(plan, "Job"), the(plan, "Service")
    from fleetbox.run.backends.podman_play import pods_for_podman
    pods = pods_for_podman(job, svc, ["10.88.0.10", "10.88.0.11"])
    assert len(pods) == 2
    aliases = [{"ip": "10.88.0.10", "hostnames": [f"{JOB}-0.{JOB}", f"{JOB}-0"]},
               {"ip": "10.88.0.11", "hostnames": [f"{JOB}-1.{JOB}", f"{JOB}-1"]}]
    for k, pod in enumerate(pods):
        for p in pods:
            validate(p)
        expected = json.loads(json.dumps(job["spec"]["template"]))
        expected["metadata"] |= {"name": f"{JOB}-{k}", "namespace": "ml",
                                 "annotations": {"batch.kubernetes.io/job-completion-index": str(k)}}
        expected["spec"] |= {"hostname": f"{JOB}-{k}", "hostAliases": aliases}
        env = expected["spec"]["containers"][0]["env"]
        env[[e["name"] for e in env].index("JOB_COMPLETION_INDEX")] = {"name": "JOB_COMPLETION_INDEX",
                                                                       "value": str(k)}
        # Podman resolves no status.podIP: the pod's own address, as the kubelet would give it
        env[[e["name"] for e in env].index("NODE_POD_IP")] = {"name": "NODE_POD_IP", "value": aliases[k]["ip"]}
        # Podman takes no $$ for $ (the kubelet does): the command and env values as the kubelet would give them
        for e in env:
            if "value" in e:
                e["value"] = kubelet_expand(e["value"], {})
        c0 = expected["spec"]["containers"][0]
        c0["command"] = [kubelet_expand(w, {}) for w in c0["command"]]
        assert "$$" not in c0["command"][2] and "$((" in c0["command"][2]
        # Podman 4.3 publishes a containerPort on the host (each pod has its own address: none), and makes an
        # emptyDir a volume of its name that every pod naming it would share (each pod's own name)
        del expected["spec"]["containers"][0]["ports"]
        own = {v["name"] for v in expected["spec"]["volumes"] if "emptyDir" in v}
        assert own == {"dshm", "logs"}
        for v in expected["spec"]["volumes"] + expected["spec"]["containers"][0]["volumeMounts"]:
            if v["name"] in own:
                v["name"] = f"{JOB}-{k}-{v['name']}"
        assert pod == {"apiVersion": "v1", "kind": "Pod", **expected}
    assert job["spec"]["template"]["spec"].get("hostAliases") is None   # the Job itself is left as it was
    plan = b.plan(spec(env={"A": "a$$b"}, args=("$(NODE_POD_IP)",)))
    (c,) = pods_for_podman(the(plan, "Job"), the(plan, "Service"))[0]["spec"]["containers"]
    assert {"name": "A", "value": "a$$b"} in c["env"] and "'$(NODE_POD_IP)'" in c["command"][2]
    assert '"$NODE_INDEX"' in c["command"][2] and "$$" not in c["command"][2]
    assert pods_for_podman(job, svc)[1]["spec"]["hostAliases"][0]["ip"] == "127.0.0.1"
    # a Podman that takes $$ for $ in commands as the kubelet does (4.7 and later), but not in env values, gets
    # the command as the kubelet would, the env values undone
    from fleetbox.run.backends.podman_play import Dollars
    (c,) = pods_for_podman(the(plan, "Job"), the(plan, "Service"), takes=Dollars(command=True))[0]["spec"][
        "containers"]
    assert c["command"] == template_of(the(plan, "Job"))["spec"]["containers"][0]["command"]
    assert {"name": "A", "value": "a$$b"} in c["env"] and "$$" in c["command"][2]
    (c,) = pods_for_podman(the(plan, "Job"), the(plan, "Service"), takes=Dollars(env=True))[0]["spec"]["containers"]
    assert {"name": "A", "value": "a$$$$b"} in c["env"] and "$$" not in c["command"][2]


@pytest.mark.parametrize("version,echoes,taken", [("4.3.1", "$$ $$", (False, False)),
                                                  ("5.2.0", "$ $$", (True, False)), ("6.0", "$ $", (True, True))])
def test_where_podman_takes_dollars_as_the_kubelet_is_asked_of_it_once_per_version(version, echoes, taken,
                                                                                   tmp_path, monkeypatch):
    from fleetbox.run.backends.podman_play import PROBE_SCRIPT, dollars_taken
    calls = stand_in(tmp_path, monkeypatch, "podman", PODMAN)
    monkeypatch.setenv("PODMAN_VERSION", version)
    monkeypatch.setenv("PODMAN_ECHOES", echoes)
    assert dollars_taken("img") == taken
    (play,) = [c for c in calls() if c["argv"][:2] == ["kube", "play"]]
    (probe,) = yaml.safe_load(play["stdin"])["spec"]["containers"]
    assert (probe["command"], probe["env"]) == (["sh", "-c", PROBE_SCRIPT, "$$"], [{"name": "F", "value": "$$"}])
    assert play["argv"][3:5] == ["--network", "none"]
    assert calls()[-1]["argv"][:2] == ["pod", "rm"] and calls()[-1]["argv"][-1] == \
        yaml.safe_load(play["stdin"])["metadata"]["name"]
    assert dollars_taken("img") == taken and len(calls()) == 6   # known: only the version asked
    # what the probe's script prints, run as each would give it its words
    argv_env = {"4.3.1": ("$$", "$$"), "5.2.0": ("$", "$$"), "6.0": ("$", "$")}[version]
    assert subprocess.run(["sh", "-c", PROBE_SCRIPT, argv_env[0]], env={"F": argv_env[1]}, capture_output=True,
                          text=True).stdout.strip() == echoes
    monkeypatch.setenv("PODMAN_ECHOES", "$(echo)")
    monkeypatch.setenv("PODMAN_VERSION", "9.9")
    with pytest.raises(UserError, match=r"gave '\$\(echo\)' for an argument and an env value written \$\$"):
        dollars_taken("img")


# -- names and options --

@pytest.mark.parametrize("job_id,needle", [
    ("My_Job", "not a Kubernetes name: it must be an RFC 1035 label"),
    ("1job", "starting with a letter"),
    ("j" * 62, "its last pod's hostname"),
])
def test_a_job_id_that_cannot_name_the_objects_is_refused_in_one_line(job_id, needle):
    with pytest.raises(UserError, match=needle):
        backend().plan(spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, job_id=job_id))


@pytest.mark.parametrize("options,needle", [
    ({"k8s_kind": "mpijob"}, "--k8s-kind 'mpijob': choose indexed, volcano, paddlejob"),
    ({"k8s_namespace": "ML"}, "--k8s-namespace 'ML' is not a Kubernetes name"),
    ({"k8s_gpu_resource": "gpu"}, "--k8s-gpu-resource 'gpu' is not an extended resource name"),
    ({"k8s_checkpoint_size": "5Gi"}, "--k8s-checkpoint-size makes the claim"),
    ({"k8s_memory": "lots"}, "--k8s-memory 'lots' is not a Kubernetes quantity"),
    ({"k8s_queue": "q"}, "--k8s-queue is Volcano's"),
    ({"k8s_secret": "a;b"}, "--k8s-secret 'a;b' is not a Kubernetes name"),
    ({"k8s_client": "oc"}, "--k8s-client 'oc': choose kubectl, podman"),
    ({"k8s_client": "podman", "k8s_kind": "volcano"}, "--k8s-client podman runs the indexed kind only"),
    ({"k8s_client": "podman", "k8s_host_network": True}, "Podman 4.3 drops hostAliases on the host's network"),
    ({"k8s_client": "podman", "k8s_deadline": 60.0}, "--k8s-deadline is the Job controller's; Podman has none"),
])
def test_a_bad_option_is_refused_in_one_line(options, needle):
    with pytest.raises(UserError, match=needle.replace("(", r"\(")):
        backend(**options)


def test_pass_env_comes_from_the_secret_by_name_and_its_values_are_never_rendered(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "s3cret")
    b = backend(k8s_secret="tokens")
    plan = b.plan(spec(pass_env=("HF_TOKEN",)))
    (c,) = template_of(plan.manifests[-1])["spec"]["containers"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "tokens", "key": "HF_TOKEN"}}} in c["env"]
    assert "s3cret" not in b.describe(plan)
    assert backend().plan(spec(pass_env=("HF_TOKEN",))).secret == f"{JOB}-env"


def test_host_networking_keeps_the_clusters_dns_for_the_masters_name():
    _, plan = manifests("indexed", k8s_host_network=True)
    pod = template_of(plan.manifests[-1])["spec"]
    assert (pod["hostNetwork"], pod["dnsPolicy"]) == (True, "ClusterFirstWithHostNet")
    validate(plan.manifests[-1])


def test_what_the_nodes_cannot_read_here_is_refused():
    b = backend()
    for given, needle in (({"checkpoint_dir": "/tmp"}, "--checkpoint-dir is a folder here"),
                          ({"mounts": (spec_mod.Mount("{home}/x", "/x"),)}, "the source is a path on each node")):
        with pytest.raises(UserError, match=needle):
            b.check(spec(**given))


def test_the_yaml_writer_round_trips_what_yaml_would_misread():
    from fleetbox.run.backends.kube_pods import to_yaml
    doc = {"a": ["yes", "no", "on", "null", "1", "0x1", "1e3", "-x", "a: b", "#c", " lead", "tab\there", "", "~"],
           "b": {"c": "line1\nline2", "d": "ends\n", "e": "trailing \nspace", "f": True, "g": 3, "h": {}, "i": []},
           "j": [{"k": 1, "l": [1, 2]}, []]}
    assert list(yaml.safe_load_all(to_yaml([doc, {"x": "y"}]))) == [doc, {"x": "y"}]


# -- kubectl, a stand-in that records its calls --

KUBECTL = r'''#!{py}
import json, os, sys
args = sys.argv[1:]
stdin = sys.stdin.read() if "-f" in args else ""
with open(os.environ["KUBECTL_OUT"], "a") as f:
    f.write(json.dumps({{"argv": args, "stdin": stdin}}) + "\n")
if args[:2] == ["config", "current-context"]:
    print(os.environ.get("KUBECTL_CONTEXT", ""))
elif "get" in args and "-l" in args and "pods" not in args:   # a job id's objects, of every kind: whose they are
    print(os.environ.get("KUBECTL_TAKEN", '{{"items": []}}'))
elif "get" in args and "json" in args:
    print(os.environ.get("KUBECTL_SAYS", "{{}}"))
'''


def stand_in(tmp_path, monkeypatch, name: str, source: str):
    """`name` on PATH as `source` (a script that writes each call to $<NAME>_OUT), a runs folder of the test's
    own; returns what reads the calls so far."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    (d / name).write_text(source.format(py=sys.executable))
    (d / name).chmod(0o755)
    out = tmp_path / f"{name}.jsonl"
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    monkeypatch.setenv(f"{name.upper()}_OUT", str(out))
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return lambda: [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []


@pytest.fixture
def kubectl(tmp_path, monkeypatch):
    return stand_in(tmp_path, monkeypatch, "kubectl", KUBECTL)


def test_submit_applies_the_plan_and_the_secret_on_stdin_then_asks_and_deletes_by_owner_where_it_was_applied(
        kubectl, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "s3cret")
    monkeypatch.setenv("KUBECTL_CONTEXT", "site-a")
    b = backend(k8s_kind="volcano", k8s_namespace="ml")
    plan = b.plan(spec(pass_env=("HF_TOKEN",)))
    h = b.submit(plan, log=lambda *_: None)
    context, taken, earlier, apply = kubectl()
    assert context["argv"] == ["config", "current-context"]
    where, mine = ["--context", "site-a", "--namespace", "ml"], owner_label(records.owner())
    # whose the id's objects are is asked first; then what an earlier run of it left, this owner's, is deleted (and
    # waited for), the claim never
    assert taken["argv"] == [*where, "get", "secret,configmap,job.batch.volcano.sh,pod", "-l",
                             f"{settings.LABEL_JOB}={JOB}", "-o", "json"]
    assert earlier["argv"] == [*where, "delete", "secret,configmap,job.batch.volcano.sh,pod", "-l",
                               f"{settings.LABEL_JOB}={JOB},{settings.LABEL_OWNER}={mine}", "--ignore-not-found",
                               "--cascade=foreground", "--wait"]
    assert apply["argv"] == [*where, *APPLY]
    applied = json.loads(apply["stdin"])["items"]
    assert applied[0] == {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "stringData": {"HF_TOKEN": "s3cret"},
                          "metadata": {"name": f"{JOB}-env", "namespace": "ml",
                                       "labels": {settings.LABEL_JOB: JOB, settings.LABEL_OWNER: mine}}}
    assert applied[1:] == list(plan.manifests)
    assert "s3cret" not in (plan.dir / "manifests.yaml").read_text() + (plan.dir / "handle.json").read_text()
    assert h.objects == [f"secret/{JOB}-env", f"configmap/{JOB}-helpers", f"configmap/{JOB}-script",
                         f"job.batch.volcano.sh/{JOB}"]

    # kubectl's context changed since: the job is still asked, and cancelled, where it was applied
    monkeypatch.setenv("KUBECTL_CONTEXT", "site-b")
    monkeypatch.setenv("KUBECTL_SAYS", json.dumps({"status": {"state": {"phase": "Running"}, "retryCount": 1}}))
    h = Handle.load(plan.dir)
    assert b.job_state(h)[:2] == ("RUNNING", 1)
    assert kubectl()[-1]["argv"] == [*where, "get", f"job.batch.volcano.sh/{JOB}", "-o", "json"]
    b.cancel(h, log=lambda *_: None)
    assert kubectl()[-1]["argv"] == [*where, "delete", "secret,configmap,job.batch.volcano.sh", "-l",
                                     f"{settings.LABEL_JOB}={JOB},{settings.LABEL_OWNER}={mine}",
                                     "--ignore-not-found"]
    assert b.job_state(h)[0] == "CANCELLED"


def test_an_id_another_owner_holds_in_the_namespace_is_refused_and_nothing_of_theirs_is_touched(kubectl, tmp_path,
                                                                                                monkeypatch):
    theirs = {"kind": "Job", "metadata": {"name": JOB, "labels": {settings.LABEL_JOB: JOB,
                                                                   settings.LABEL_OWNER: "bob.0123456789ab"}}}
    monkeypatch.setenv("KUBECTL_TAKEN", json.dumps({"items": [theirs]}))
    short_sleeps(monkeypatch, "another owner's job was applied and followed")
    b = backend()
    with pytest.raises(UserError, match=rf"^job id {JOB} is taken in namespace default: job/{JOB} is "
                                        r"bob.0123456789ab's \(another user, or another runs folder\); nothing of "
                                        r"theirs was touched: give another --job-id$"):
        b.run(b.plan(spec()), log=lambda *_: None)
    # kubectl's context and namespace asked, then whose the id's objects are; nothing deleted or applied
    assert [c["argv"][:2] for c in kubectl()] == [["config", "current-context"], ["--namespace", "default"]] \
        and kubectl()[-1]["argv"][2] == "get"
    # this user's own objects of the id, from another runs folder, are another owner's too
    mine = {settings.LABEL_JOB: JOB, settings.LABEL_OWNER: owner_label(records.owner())}
    monkeypatch.setenv("KUBECTL_TAKEN", json.dumps({"items": [{**theirs, "metadata": {**theirs["metadata"],
                                                                                     "labels": mine}}]}))
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "other-runs"))
    with pytest.raises(UserError, match=f"job id {JOB} is taken"):
        b.submit(b.plan(spec()), log=lambda *_: None)


def test_kubectls_namespace_is_the_kubeconfigs_else_in_a_pod_its_service_accounts(kubectl, tmp_path, monkeypatch):
    from fleetbox.run.backends import kubernetes
    monkeypatch.setattr(kubernetes, "SERVICE_ACCOUNT_NAMESPACE", str(tmp_path / "namespace"))
    assert kubernetes.where("") == ("", "default")   # no context, no service account: kubectl's default
    (tmp_path / "namespace").write_text("team-a\n")
    assert kubernetes.where("") == ("", "team-a") and kubernetes.where("ml") == ("", "ml")
    monkeypatch.setenv("KUBECTL_CONTEXT", "site-a")   # a kubeconfig's context: its namespace (none here: default)
    assert kubernetes.where("") == ("site-a", "default")


FORBIDDEN = KUBECTL.replace("if args[:2] == [\"config\", \"current-context\"]:",
                            r'''if args[-4:-2] == ["secret", "team-tokens"]:
    print('Error from server (Forbidden): secrets "team-tokens" is forbidden', file=sys.stderr)
    sys.exit(1)
elif args[:2] == ["config", "current-context"]:''')


def test_a_secret_the_user_may_use_but_not_read_is_said_and_used(kubectl, tmp_path, monkeypatch):
    assert FORBIDDEN != KUBECTL
    (tmp_path / "bin" / "kubectl").write_text(FORBIDDEN.format(py=sys.executable))
    said, b = [], backend(k8s_secret="team-tokens")
    b.submit(b.plan(spec(pass_env=("HF_TOKEN",))), log=said.append)
    assert said[0] == "note: --k8s-secret team-tokens: kubectl may not read it here, so its keys are not checked " \
                      "(HF_TOKEN must be among them)"
    assert any("apply" in c["argv"] for c in kubectl())


def test_a_secret_the_user_made_is_read_never_written_labelled_or_deleted(kubectl, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "from-this-shell")
    b = backend(k8s_secret="team-tokens")
    plan = b.plan(spec(pass_env=("HF_TOKEN", "WANDB_API_KEY")))
    monkeypatch.setenv("KUBECTL_SAYS", json.dumps({"data": {"HF_TOKEN": "eA=="}}))
    with pytest.raises(UserError, match=r"^--k8s-secret team-tokens has no key WANDB_API_KEY for --pass-env \(its "
                                        r"keys: HF_TOKEN\)$"):
        b.submit(plan, log=lambda *_: None)
    assert [c["argv"][2:] for c in kubectl()[1:]] == [["get", "secret", "team-tokens", "-o", "json"]]
    monkeypatch.setenv("KUBECTL_SAYS", json.dumps({"data": {"HF_TOKEN": "eA==", "WANDB_API_KEY": "eQ=="},
                                                   "items": [], "status": {"conditions": [
                                                       {"type": "Complete", "status": "True"}]}}))
    short_sleeps(monkeypatch, "a completed job was followed as if it ran")
    assert b.run(plan, log=lambda *_: None).ok
    calls = kubectl()
    apply = next(c for c in calls if "apply" in c["argv"])
    assert [i["kind"] for i in json.loads(apply["stdin"])["items"]] == ["ConfigMap", "ConfigMap", "Service", "Job"]
    assert "from-this-shell" not in json.dumps(calls)
    assert not [c for c in calls if "delete" in c["argv"] and "secret" in c["argv"][c["argv"].index("delete") + 1]]
    b.cancel(Handle.load(plan.dir), log=lambda *_: None)
    assert "secret" not in kubectl()[-1]["argv"][kubectl()[-1]["argv"].index("delete") + 1]


def test_the_secret_fleetbox_made_is_deleted_when_the_job_ends(kubectl, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "s3cret")
    b = backend()
    plan = b.plan(spec(pass_env=("HF_TOKEN",)))
    # a run refused before it applied anything deletes nothing, whatever an earlier run's handle says
    plan.make_dir()
    KubeHandle("kubernetes", JOB, str(plan.dir), 2, owner=records.owner(), namespace="theirs").save()
    monkeypatch.setenv("KUBECTL_TAKEN", json.dumps({"items": [{"kind": "Job", "metadata": {
        "name": JOB, "labels": {settings.LABEL_OWNER: "bob.0123456789ab"}}}]}))
    with pytest.raises(UserError, match="is taken"):
        b.run(plan, log=lambda *_: None)
    assert not [c for c in kubectl() if "delete" in c["argv"]]
    monkeypatch.delenv("KUBECTL_TAKEN")
    monkeypatch.setenv("KUBECTL_SAYS", json.dumps({"items": [], "status": {"conditions": [
        {"type": "Complete", "status": "True"}]}}))
    short_sleeps(monkeypatch, "a completed job was followed as if it ran")
    assert b.run(plan, log=lambda *_: None).ok
    assert kubectl()[-1]["argv"] == ["--namespace", "default", "delete", "secret", "-l",
                                     f"{settings.LABEL_JOB}={JOB},{settings.LABEL_OWNER}="
                                     f"{owner_label(records.owner())}", "--ignore-not-found"]


PODMAN = r'''#!{py}
import json, os, sys
args = sys.argv[1:]
stdin = sys.stdin.read() if args[-1:] == ["-"] else ""
with open(os.environ["PODMAN_OUT"], "a") as f:
    f.write(json.dumps({{"argv": args, "stdin": stdin}}) + "\n")
if args[:2] == ["network", "inspect"]:
    print(json.dumps([{{"subnets": [{{"subnet": "10.89.7.0/24", "gateway": "10.89.7.1"}}]}}]))
if args[:2] == ["volume", "exists"]:
    sys.exit(1)
if args[:2] == ["pod", "ps"]:   # a pod of the job id left here, whoever's
    print(os.environ.get("PODMAN_PODS", "[]"))
if args[:1] == ["version"]:
    print(os.environ.get("PODMAN_VERSION", "4.3.1"))
if args[:1] == ["logs"]:   # what the probe's command, `echo $$`, printed
    print(os.environ.get("PODMAN_ECHOES", "$$ $$"))
if args[:2] == ["kube", "play"] and "none" in args:   # the probe: played
    sys.exit(0)
if args[:2] == ["kube", "play"]:
    print("[starting container 1f: runc create failed: error setting rlimits]", file=sys.stderr)
    print("Error: failed to start 2 containers", file=sys.stderr)
    sys.exit(125)
'''


@pytest.mark.parametrize("echoes,taken", [("$$ $$", (False, False)), ("$ $$", (True, False))])
def test_podman_plays_the_lowered_pods_on_the_jobs_own_network_and_a_failed_play_leaves_nothing(echoes, taken,
                                                                                                 tmp_path, monkeypatch):
    """...the pods lowered for what this Podman does with $$ (it was asked: the probe's echo)."""
    from fleetbox.run.backends.podman_play import pods_for_podman
    podman_calls = stand_in(tmp_path, monkeypatch, "podman", PODMAN)
    monkeypatch.setenv("PODMAN_ECHOES", echoes)
    for bad, needle in (({"pass_env": ("HF_TOKEN",)}, "--pass-env reads a Secret"),):
        with pytest.raises(UserError, match=needle):
            backend(k8s_client="podman").check(spec(**bad))
    b = backend(k8s_client="podman", k8s_checkpoint_claim="ckpt", k8s_checkpoint_size="1Gi")
    plan = b.plan(spec(args=("--tag", "a b;$(id)")))
    (ckpt,) = [m for m in pods_for_podman(the(plan, "Job"), the(plan, "Service"))[0]["spec"]["containers"][0][
        "volumeMounts"] if m["mountPath"] == settings.CHECKPOINT_DIR]
    # the owner's job's own folder of the claim's volume (Podman 4.3 mounts the volume whole: docs)
    assert (ckpt["name"], ckpt["subPath"]) == ("checkpoints", f"{owner_label(records.owner())}/{JOB}")
    with pytest.raises(UserError, match=r"podman kube play failed: Error: failed to start 2 containers \(.*rlimits"
                                        r".*: Podman gives every container its default open-file and process limits "
                                        r"\(nofile, nproc\), above what this machine allows; set lower ones as "
                                        r"default_ulimits in containers.conf"):
        b.submit(plan, log=lambda *_: None)
    calls = podman_calls()
    play = next(c for c in calls if c["argv"][:2] == ["kube", "play"] and JOB in c["argv"])
    assert play["argv"] == ["kube", "play", "--quiet", "--network", JOB, "--ip", "10.89.7.2", "--ip", "10.89.7.3",
                            "-"]
    played = list(yaml.safe_load_all(play["stdin"]))
    job, svc = the(plan, "Job"), the(plan, "Service")
    assert [m["kind"] for m in played] == ["ConfigMap", "ConfigMap", "PersistentVolumeClaim", "Pod", "Pod"]
    assert played[3:] == pods_for_podman(job, svc, ["10.89.7.2", "10.89.7.3"], taken)
    # whatever was made is removed: the pods, the ConfigMaps' and emptyDirs' volumes, the network; never the claim
    after = [c["argv"] for c in calls[calls.index(play) + 1:]]
    assert after[0] == ["pod", "rm", "--force", "--ignore", "--time", "0", f"{JOB}-0", f"{JOB}-1"]
    removed = {a[-1] for a in after[1:]}
    assert removed == {f"{JOB}-helpers", f"{JOB}-script", JOB} | {f"{JOB}-{k}-{v}" for k in (0, 1)
                                                                  for v in ("dshm", "logs")}
    assert "ckpt" not in removed
    # its record says it never started: the id is free again (it was "a state that cannot be told" until a cancel)
    from fleetbox.commands import train
    assert b.job_state(Handle.load(plan.dir))[0] == "FAILED"
    assert json.loads((plan.dir / "summary.json").read_text())["ended"].startswith("its pods did not start: ")
    train.refuse_live(JOB)


def test_an_id_another_owner_holds_on_podman_is_refused_and_this_owners_leftovers_are_removed(tmp_path,
                                                                                              monkeypatch):
    podman_calls = stand_in(tmp_path, monkeypatch, "podman", PODMAN)
    b = backend(k8s_client="podman")
    pod = {"Name": f"{JOB}-0", "Labels": {settings.LABEL_JOB: JOB, settings.LABEL_OWNER: "bob.0123456789ab"}}
    monkeypatch.setenv("PODMAN_PODS", json.dumps([pod]))
    with pytest.raises(UserError, match=rf"^job id {JOB} is taken on this machine's Podman: pod/{JOB}-0 is "
                                        r"bob.0123456789ab's \(another user, or another runs folder\); nothing of "
                                        r"theirs was touched: give another --job-id$"):
        b.run(b.plan(spec()), log=lambda *_: None)
    assert [c["argv"][:2] for c in podman_calls()] == [["pod", "ps"], ["network", "ls"]]   # asked, nothing removed
    pod["Labels"][settings.LABEL_OWNER] = owner_label(records.owner())   # this owner's, an earlier run's (of 3 nodes)
    monkeypatch.setenv("PODMAN_PODS", json.dumps([pod, {**pod, "Name": f"{JOB}-2"}]))
    said = []
    with pytest.raises(UserError, match="podman kube play failed"):
        b.run(b.plan(spec()), log=said.append)
    argvs = [c["argv"] for c in podman_calls()]
    assert argvs[4] == ["pod", "rm", "--force", "--ignore", "--time", "0", f"{JOB}-0", f"{JOB}-1", f"{JOB}-2"]
    assert argvs.index(argvs[4]) < argvs.index(next(a for a in argvs if a[:2] == ["network", "create"]))
    assert f"{JOB}: removed what an earlier run of it left" in said


@pytest.mark.parametrize("kind,status,state", [
    ("indexed", {"conditions": [{"type": "Complete", "status": "True"}]}, "PASSED"),
    ("indexed", {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}, "FAILED"),
    ("indexed", {"active": 2}, "RUNNING"),
    ("indexed", {}, "PENDING"),
    ("volcano", {"state": {"phase": "Completed"}}, "PASSED"),
    ("volcano", {"state": {"phase": "Inqueue"}}, "PENDING"),
    ("paddlejob", {"conditions": [{"type": "Created", "status": "True"}, {"type": "Running", "status": "True"},
                                  {"type": "Succeeded", "status": "True"}]}, "PASSED"),
    ("paddlejob", {"conditions": [{"type": "Failed", "status": "True", "message": "x"}]}, "FAILED"),
])
def test_each_controllers_status_reads_as_a_fleetbox_state(kind, status, state):
    from fleetbox.run.backends.kubernetes import state_of
    assert state_of(kind, status)[0] == state


def test_train_dry_run_prints_the_manifests_and_another_backend_refuses_its_options(run_invoke):
    from tests.unit.test_cli import one_line_error
    proc = run_invoke("train", "--backend", "kubernetes", "--k8s-kind", "paddlejob", "--nodes", "2", "--job-id",
                      JOB, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in docs] == ["ConfigMap", "ConfigMap", "PaddleJob"]
    for d in docs:
        validate(d)
    one_line_error(run_invoke("train", "--k8s-kind", "volcano", "--dry-run"), "--k8s-kind is for --backend kubernetes")


FAILING_APPLY = KUBECTL + r'''
if "apply" in args:
    print("configmap/fb-job-helpers created\nsecret/fb-job-env created")
    print('error: no matches for kind "Job" in version "batch.volcano.sh/v1alpha1"', file=sys.stderr)
    sys.exit(1)
'''


def test_a_failed_apply_deletes_what_it_made_by_the_jobs_label_and_keeps_the_handle(kubectl, tmp_path,
                                                                                   monkeypatch):
    (tmp_path / "bin" / "kubectl").write_text(FAILING_APPLY.format(py=sys.executable))
    monkeypatch.setenv("HF_TOKEN", "s3cret")
    b = backend(k8s_kind="volcano", k8s_namespace="ml", k8s_checkpoint_claim="ckpt", k8s_checkpoint_size="1Gi")
    plan = b.plan(spec(pass_env=("HF_TOKEN",)))
    with pytest.raises(UserError, match="kubectl apply failed"):
        b.run(plan, log=lambda *_: None)
    argvs = [c["argv"] for c in kubectl() if c["argv"][-1] != "--wait"]   # the earlier run's, deleted first
    apply = argvs.index(["--namespace", "ml", *APPLY])
    assert argvs[apply + 1] == ["--namespace", "ml", "delete", "secret,configmap,job.batch.volcano.sh", "-l",
                                selector(), "--ignore-not-found"]   # never the claim
    assert (plan.dir / "handle.json").exists()
    from fleetbox.run.backends.kubernetes import KubernetesBackend
    assert f"kubectl delete secret,configmap,service,job.batch,job.batch.volcano.sh,paddlejob.kubeflow.org -l " \
           f"{selector()} --ignore-not-found" in KubernetesBackend.leftovers(JOB)


def selector() -> str:
    """The label selector of the test job's objects, this owner's (the owner is the runs folder's: the test's)."""
    return f"{settings.LABEL_JOB}={JOB},{settings.LABEL_OWNER}={owner_label(records.owner())}"


LEFT_BEFORE = KUBECTL + r'''
if "delete" in args and "--wait" in args:
    print('configmap "fb-job-helpers" deleted\njob.batch "fb-job" deleted')
'''


def test_the_same_job_id_again_deletes_what_the_earlier_run_left_and_says_so(kubectl, tmp_path, monkeypatch):
    (tmp_path / "bin" / "kubectl").write_text(LEFT_BEFORE.format(py=sys.executable))
    monkeypatch.setenv("KUBECTL_SAYS", json.dumps({"items": [], "status": {"conditions": [
        {"type": "Complete", "status": "True"}]}}))
    b = backend(k8s_checkpoint_claim="ckpt", k8s_checkpoint_size="1Gi")
    said = []
    b.run(b.plan(spec()), log=said.append)
    argvs = [c["argv"][2:] for c in kubectl() if "config" not in c["argv"]]
    assert argvs[1:3] == [["delete", "configmap,service,job.batch,pod", "-l", selector(), "--ignore-not-found",
                           "--cascade=foreground", "--wait"], list(APPLY)]
    assert [s for s in said if "earlier run" in s] == [
        f"{JOB}: deleted what an earlier run of it left (configmap, job.batch)"]
    said.clear()
    (tmp_path / "bin" / "kubectl").write_text(KUBECTL.format(py=sys.executable))
    b.run(b.plan(spec()), log=said.append)
    assert not [s for s in said if "earlier run" in s]   # nothing was left: nothing said


GONE = KUBECTL.replace("elif \"get\" in args and \"json\" in args:", r'''elif "get" in args and "pods" not in args:
    print('Error from server (NotFound): jobs.batch "fb-job" not found', file=sys.stderr)
    sys.exit(1)
elif "get" in args and "json" in args:''')


def test_a_job_whose_object_was_deleted_while_it_ran_is_followed_to_failed(kubectl, tmp_path, monkeypatch):
    assert GONE != KUBECTL
    (tmp_path / "bin" / "kubectl").write_text(GONE.format(py=sys.executable))
    monkeypatch.setenv("KUBECTL_SAYS", json.dumps({"items": []}))
    b = backend()
    plan = b.plan(spec())
    h = b.submit(plan, log=lambda *_: None)
    slept = []

    def sleep(s):   # the follow loop's: a few polls, not forever
        slept.append(s)
        assert len(slept) < 20, "follow keeps polling a job whose object is gone"
    own_sleep(monkeypatch, sleep)
    said = []
    result = b.follow(h, log=said.append, poll=0.01)
    assert not result.ok and said == [f"{JOB}: FAILED (gone (deleted while the job ran))"]


def test_the_docs_put_no_secret_on_argv_and_say_what_a_restart_is_per_shape():
    doc = (ROOT / "docs" / "explanation" / "kubernetes.md").read_text()
    assert "--from-literal" not in doc and "--from-env-file=/dev/stdin" in doc
    assert "is 0, so the first failed pod fails the job" in doc and "`--detach` with `--max-restarts`" in doc


# A cluster as kubectl shows it, for a job whose attempt 0 hangs and whose attempt 1 passes: its pods' log folders
# are the recorded job's (a rank stuck before its first step), read and written through `kubectl exec`; a request
# for stacks is answered with that job's recorded dumps, as sitecustomize's relay answers it.
CLUSTER = r"""#!{py}
import json, os, re, shutil, sys
args, scope = sys.argv[1:], []
while args[:1] in (["--namespace"], ["--context"]):   # where the job is: recorded on its own
    scope, args = scope + args[:2], args[2:]
stdin = sys.stdin.buffer.read() if (args[:1] == ["apply"] or "cat >" in " ".join(args)) else b""
with open(os.environ["KUBECTL_OUT"], "a") as f:
    f.write(json.dumps({{"argv": args, "scope": scope,
                        "stdin": stdin.decode(errors="replace") if "-f" in args else ""}}) + "\n")
state, recorded = os.environ["KUBECTL_STATE"], os.environ.get("KUBECTL_RECORDED", "")
attempt = int(open(os.path.join(state, "attempt")).read()) if os.path.exists(os.path.join(state, "attempt")) else 0
# every attempt's pods: an earlier attempt's still on their way out (deleted in the background)
pods = {{f"fb-job-{{k}}-x{{a}}": (k, a) for a in range(attempt + 1) for k in (0, 1)
        if a < attempt or not (k == 1 and os.environ.get("KUBECTL_NOT_YET"))}}   # a pod not made yet
if args[:2] == ["config", "current-context"]:   # kubectl's context: another one once the job was applied
    print("site-b" if os.path.exists(os.path.join(state, "attempt")) else "site-a")
elif args[:1] == ["apply"]:
    job = next(i for i in json.loads(stdin)["items"] if i["kind"] == "Job")
    attempt = re.search(r"FLEETBOX_ATTEMPT=(\d+)", job["spec"]["template"]["spec"]["containers"][0]["command"][2])[1]
    open(os.path.join(state, "attempt"), "w").write(attempt)
    for k in (0, 1):   # each pod's log folder, as the recorded job's node left it
        d = os.path.join(state, f"fb-job-{{k}}-x{{attempt}}")
        os.makedirs(d, exist_ok=True)
        if recorded:
            shutil.copy(os.path.join(recorded, f"node{{k}}", f"progress-rank{{k}}.json"), d)
    if os.environ.get("KUBECTL_CANCELLED_AT") == attempt:   # `invoke cancel` from another shell, meanwhile
        open(os.environ["KUBECTL_CANCEL"], "w").close()
elif args[:2] == ["get", "pods"]:
    want = dict(kv.split("=") for kv in args[args.index("-l") + 1].split(","))
    items = []
    for n, (k, a) in pods.items():
        labels = {{"io.fleetbox.job": "fb-job", "io.fleetbox.owner": os.environ["KUBECTL_OWNER"],
                  "io.fleetbox.attempt": str(a)}}
        if any(labels.get(key) != v for key, v in want.items()):
            continue
        done = os.environ.get(f"KUBECTL_PODS_{{a}}") == "done"
        items.append({{"metadata": {{"name": n, "labels": labels, "creationTimestamp": f"2026-11-28T00:00:0{{a}}Z",
                                   "annotations": {{"batch.kubernetes.io/job-completion-index": str(k)}},
                                   **({{"deletionTimestamp": "2026-11-28T00:01:00Z"}} if a < attempt else {{}})}},
                      "spec": {{"nodeName": f"gpu{{k}}"}},
                      "status": {{"phase": "Succeeded" if done else "Running", "containerStatuses": [
                          {{"name": "paddle", "state": {{"terminated": {{"exitCode": 0}}}} if done else
                           {{"running": {{}}}}}}]}}}})
    print(json.dumps({{"items": items}}))
elif args[:1] == ["get"] and "-l" in args:   # a job id's objects, of every kind: none but this owner's
    print('{{"items": []}}')
elif args[:1] == ["get"]:
    print(os.environ.get(f"KUBECTL_JOB_{{attempt}}", '{{"status": {{"active": 2}}}}'))
elif args[:1] == ["exec"]:
    pod, cmd = args[2], args[args.index("--") + 1:]
    if pod not in pods:
        sys.exit(1)
    at = lambda path: os.path.join(state, pod, os.path.basename(path))
    if cmd[0] == "sh" and "cat >" in cmd[2]:   # the writer: a request for stacks, answered by the recorded dumps
        open(at(cmd[-1]), "wb").write(stdin)
        k = pods[pod][0]
        shutil.copy(os.path.join(recorded, f"node{{k}}", f"stacks-rank{{k}}.txt"), os.path.join(state, pod))
    elif cmd[0] == "sh":   # several files, each then a NUL (as the script gives them: run by sh)
        os.execvp("sh", ["sh", "-c", cmd[2], "sh", *(at(path) for path in cmd[4:])])
    elif not os.path.exists(at(cmd[-1])):
        sys.exit(1)
    else:
        data = open(at(cmd[-1]), "rb").read()
        sys.stdout.buffer.write(data[-int(cmd[2]):] if cmd[0] == "tail" else data)
elif args[:1] == ["logs"]:
    print(f"the output of {{[a for a in args[1:] if not a.startswith('-')][0]}}")
"""


def test_a_hang_on_a_cluster_is_found_through_kubectl_exec_and_fleetbox_restarts_the_whole_job(kubectl, tmp_path,
                                                                                               monkeypatch):
    (tmp_path / "bin" / "kubectl").write_text(CLUSTER.format(py=sys.executable))
    (tmp_path / "cluster").mkdir()
    monkeypatch.setenv("KUBECTL_STATE", str(tmp_path / "cluster"))
    monkeypatch.setenv("KUBECTL_OWNER", owner_label(records.owner()))
    monkeypatch.setenv("KUBECTL_RECORDED", str(ROOT / "tests" / "recorded" / "jobs" / "train-20261127-201444-43d0"))
    monkeypatch.setenv("KUBECTL_JOB_1", COMPLETE)
    monkeypatch.setenv("KUBECTL_PODS_1", "done")
    b = backend()
    plan = b.plan(replace(spec(max_restarts=1, start_timeout=1.0, hang_timeout=0.0), procs_per_node=1))
    short_sleeps(monkeypatch, "the hung job was followed as if it ran")
    said = []
    result = b.run(plan, log=said.append)
    assert result.ok and [a["state"] for a in result.attempts] == ["HUNG", "PASSED"], said
    first = json.loads((plan.dir / "attempt0" / "summary.json").read_text())
    h = first["hang"]
    assert (h["kind"], h["ranks"], h["decided"], first["culprit"]) == ("start", [1], True, 1), h
    assert [n["state"] for n in first["nodes"]] == ["stopped", "hung"]
    assert "in `main` (smoke.py:76)" in h["text"] and "waiting in `init_parallel_env`" in h["text"]
    assert "the output of fb-job-1-x0" in (plan.dir / "attempt0" / "node1" / "container.log").read_text()
    calls = [c["argv"] for c in kubectl()]
    # the ranks' progress read in their pods, the stacks asked for there, then the hung job deleted with its pods
    exec_ = ["exec", "-i", "fb-job-1-x0", "-c", "paddle", "--"]
    assert [*exec_, "sh", "-c", 'for f; do [ ! -f "$f" ] || { printf +; cat -- "$f"; }; printf "\\0"; done', "sh",
            f"{settings.LOG_DIR}/progress-rank1.json", f"{settings.LOG_DIR}/COLLECTIVE-TIMEOUT"] in calls
    assert ["exec", "-i", "fb-job-0-x0", "-c", "paddle", "--", "sh", "-c", 'cat > "$1.tmp" && mv -f "$1.tmp" "$1"',
            "sh", f"{settings.LOG_DIR}/STACKS-REQUEST"] in calls
    hung_delete = calls.index(["delete", "job.batch", "-l", selector(), "--ignore-not-found", "--cascade=foreground"])
    # the restart: what the attempt left deleted by label, then the same objects applied, FLEETBOX_ATTEMPT 1
    applies = [k for k, c in enumerate(calls) if c == list(APPLY)]
    assert len(applies) == 2 and applies[0] < hung_delete < applies[1]
    assert calls[applies[1] - 1][:2] == ["delete", "configmap,service,job.batch,pod"]
    jobs = [next(i for i in json.loads(kubectl()[k]["stdin"])["items"] if i["kind"] == "Job") for k in applies]
    scripts = [j["spec"]["template"]["spec"]["containers"][0]["command"][2] for j in jobs]
    assert ["FLEETBOX_ATTEMPT=0" in scripts[0], "FLEETBOX_ATTEMPT=1" in scripts[1]] == [True, True]
    assert [j["spec"]["backoffLimit"] for j in jobs] == [0, 0]
    assert scripts[0].replace("FLEETBOX_ATTEMPT=0", "FLEETBOX_ATTEMPT=1") == scripts[1]
    assert b.job_state(Handle.load(plan.dir))[:2] == ("PASSED", 1)
    # kubectl's context changed once the job was applied: the restart, and everything since, acted where the job is
    assert {tuple(c["scope"]) for c in kubectl() if c["argv"][0] != "config"} == {
        ("--context", "site-a", "--namespace", "default")}


def own_sleep(monkeypatch, sleep) -> None:
    """The backend's time.sleep (its follow loops' polls), never another module's or thread's."""
    from fleetbox.run.backends import kubernetes
    monkeypatch.setattr(kubernetes, "time", types.SimpleNamespace(sleep=sleep, monotonic=time.monotonic,
                                                                  time=time.time))


COMPLETE = json.dumps({"status": {"conditions": [{"type": "Complete", "status": "True"}]}})


def short_sleeps(monkeypatch, stuck: str) -> None:
    """The follow loops' polls (5 s) shortened, and a loop that never ends failed with `stuck`, not waited for."""
    slept = []

    def short_sleep(s):
        slept.append(s)
        assert len(slept) < 100, stuck
        time.sleep(min(s, 0.05))
    own_sleep(monkeypatch, short_sleep)


@pytest.fixture
def cluster(kubectl, tmp_path, monkeypatch):
    (tmp_path / "bin" / "kubectl").write_text(CLUSTER.format(py=sys.executable))
    (tmp_path / "cluster").mkdir()
    monkeypatch.setenv("KUBECTL_STATE", str(tmp_path / "cluster"))
    monkeypatch.setenv("KUBECTL_OWNER", owner_label(records.owner()))
    return kubectl


def test_the_hang_watch_never_reads_an_earlier_attempts_pods_on_their_way_out(cluster, tmp_path, monkeypatch):
    from fleetbox.run.backends.kubernetes import Kubectl
    (tmp_path / "cluster" / "attempt").write_text("1")   # attempt 0's pods terminating; attempt 1's just applied
    monkeypatch.setenv("KUBECTL_PODS_1", "done")          # (or, here, already ended: not running either)
    b = backend()
    h = KubeHandle("kubernetes", JOB, str(tmp_path), 2, owner=records.owner(), objects=[f"job.batch/{JOB}"], attempt=1)
    argv, running = Kubectl(b).in_pods(h)
    assert (running(), argv(0), argv(1)) == (False, None, None)
    monkeypatch.delenv("KUBECTL_PODS_1")
    monkeypatch.setenv("KUBECTL_NOT_YET", "1")           # rank 1's new pod not made yet: its old one is not it
    assert (running(), argv(0)[3], argv(1)) == (False, "fb-job-0-x1", None)
    monkeypatch.delenv("KUBECTL_NOT_YET")
    assert running() and argv(1)[3] == "fb-job-1-x1"


def test_an_attempt_that_ended_while_its_client_lives_is_running_to_another_shell(cluster, tmp_path, monkeypatch):
    from fleetbox.processes import process_start, this_host
    monkeypatch.setenv("KUBECTL_JOB_0", json.dumps({"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}))
    b = backend()
    client = subprocess.Popen(["sleep", "30"])
    try:
        for pid, seen in ((client.pid, "RUNNING"), (os.getpid(), "FAILED")):   # (the client itself: its end)
            h = KubeHandle("kubernetes", JOB, str(tmp_path), 2, owner=records.owner(), objects=[f"job.batch/{JOB}"],
                           supervisor=pid, supervisor_start=process_start(pid), supervisor_host=this_host())
            state, attempt, note = b.job_state(h)
            assert (state, attempt) == (seen, 0), note
        live = replace(h, supervisor=client.pid, supervisor_start=process_start(client.pid))
        assert note == "BackoffLimitExceeded" and "may restart it" in b.job_state(live)[2]
    finally:
        client.kill()
        client.wait()
    assert b.job_state(replace(h, supervisor=client.pid))[0] == "FAILED"   # the client gone: its end


def test_the_cancel_of_an_earlier_run_of_the_id_does_not_cancel_this_one(cluster, monkeypatch):
    monkeypatch.setenv("KUBECTL_JOB_0", COMPLETE)
    monkeypatch.setenv("KUBECTL_PODS_0", "done")
    b = backend()
    plan = b.plan(spec())
    plan.make_dir()
    (plan.dir / "CANCELLED").touch()
    assert b.run(plan, log=lambda *_: None).ok


def test_a_cancel_while_a_restart_is_applied_deletes_it_and_ends_the_job(cluster, tmp_path, monkeypatch):
    b = backend()
    plan = b.plan(spec(max_restarts=2))
    monkeypatch.setenv("KUBECTL_JOB_0", json.dumps({"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}))
    monkeypatch.setenv("KUBECTL_CANCELLED_AT", "1")
    monkeypatch.setenv("KUBECTL_CANCEL", str(plan.dir / "CANCELLED"))
    short_sleeps(monkeypatch, "a cancelled job was followed as if it ran")
    result = b.run(plan, log=lambda *_: None)
    calls = [c["argv"] for c in cluster()]
    applies = [k for k, c in enumerate(calls) if c == list(APPLY)]
    assert len(applies) == 2 and not result.ok   # attempt 1 applied, then cancelled: no attempt 2
    assert calls[applies[1] + 1] == ["delete", "configmap,service,job.batch", "-l", selector(), "--ignore-not-found"]
    assert b.job_state(Handle.load(plan.dir))[0] == "CANCELLED"


def test_a_job_ended_by_its_deadline_is_timed_out_and_not_restarted(cluster, monkeypatch):
    b = backend(k8s_deadline=60)
    plan = b.plan(spec(max_restarts=2))
    monkeypatch.setenv("KUBECTL_JOB_0", json.dumps({"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "DeadlineExceeded",
         "message": "Job was active longer than specified deadline"}]}}))
    short_sleeps(monkeypatch, "a job past its deadline was followed as if it ran")
    result = b.run(plan, log=lambda *_: None)
    assert result.timed_out and not result.ok and result.culprit is None and result.reason() == "timed out"
    assert [c["argv"] for c in cluster()].count(list(APPLY)) == 1


def test_restarts_that_need_the_client_are_refused_detached(kubectl):
    b = backend()
    with pytest.raises(UserError, match="--max-restarts with --detach: the indexed kind's restarts are fleetbox"):
        b.detach(b.plan(spec(max_restarts=1)), log=lambda *_: None)
    assert kubectl() == []   # nothing applied
    with pytest.raises(UserError, match="--detach with --k8s-client podman"):
        backend(k8s_client="podman").detach(backend(k8s_client="podman").plan(spec()), log=lambda *_: None)


def test_following_a_nodes_logs_streams_each_of_its_pods_across_a_restart_until_the_job_ends(cluster, tmp_path,
                                                                                              monkeypatch):
    """Attempt 0 has failed and its client has not applied attempt 1 yet: the logs are followed on, to attempt 1's
    pod, and end with the job once nothing follows it."""
    (tmp_path / "cluster" / "attempt").write_text("0")
    monkeypatch.setenv("KUBECTL_JOB_0", json.dumps({"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}))
    monkeypatch.setenv("KUBECTL_JOB_1", COMPLETE)
    monkeypatch.setenv("KUBECTL_PODS_0", "done")
    monkeypatch.setenv("KUBECTL_PODS_1", "done")
    b = backend(k8s_namespace="ml")
    plan = b.plan(spec())
    plan.make_dir()
    from fleetbox.processes import process_start, this_host
    h = KubeHandle("kubernetes", JOB, str(plan.dir), 2, owner=records.owner(), objects=[f"job.batch/{JOB}"],
                   namespace="ml", supervisor=os.getpid(), supervisor_start=process_start(os.getpid()),
                   supervisor_host=this_host())
    h.save()
    slept = []

    def restart_meanwhile(s):   # the client applies attempt 1 while the logs wait, then ends
        slept.append(s)
        assert len(slept) < 20, "the logs are followed past the job's end"
        if len(slept) == 3:
            (tmp_path / "cluster" / "attempt").write_text("1")
            replace(h, attempt=1, supervisor=0).save()
        time.sleep(min(s, 0.05))
    own_sleep(monkeypatch, restart_meanwhile)
    said = []
    b.show_logs(Handle.load(plan.dir), 1, follow=True, log=said.append, poll=0.01)
    assert said == ["the output of fb-job-1-x0", "the output of fb-job-1-x1"]
    assert [(c["scope"], c["argv"]) for c in cluster() if "logs" in c["argv"]] == [
        (["--namespace", "ml"], ["logs", "-f", f"fb-job-1-x{k}", "-c", "paddle"]) for k in (0, 1)]


def held_node(tmp_path, launcher: str) -> subprocess.Popen:
    """The pod's script from its launch on (as the kubelet gives it to sh), its launcher `launcher` (sh), its log
    folder tmp_path, its hold 30 s."""
    from fleetbox.run.backends.kube_pods import kubelet_unescape
    from fleetbox.run.backends.node_script import HOLD_S
    _, plan = manifests("indexed")
    (c,) = template_of(plan.manifests[-1])["spec"]["containers"]
    lines = kubelet_unescape(c["command"][2]).splitlines()
    at = lines.index("LAUNCHER=$!")
    script = "\n".join(["set -eu", "NODE_INDEX=0", f"sh -c {shlex.quote(launcher)} &", *lines[at:]])
    assert f"sleep {HOLD_S} & wait" in script
    script = script.replace(settings.LOG_DIR, str(tmp_path)).replace(f"sleep {HOLD_S} &", "sleep 30 &")
    with open(tmp_path / "out.txt", "w") as out:   # a file: a pipe would also wait for what the shell started
        return subprocess.Popen(["sh", "-c", script], stdout=out, stderr=subprocess.STDOUT)


GLOO_TIMEOUT = "[/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:1234: TIMEOUT"


def test_a_pod_whose_rank_gloos_timeout_ended_is_held_marked_and_a_stop_ends_the_hold_at_once(tmp_path):
    p = held_node(tmp_path, f"echo {shlex.quote(GLOO_TIMEOUT)} > {tmp_path}/workerlog.0; exit 250")
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "COLLECTIVE-TIMEOUT").exists():   # held: the mark the hang watch reads
            assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "out.txt").read_text()
            time.sleep(0.05)
        time.sleep(0.3)
        assert p.poll() is None   # still running: its stuck peers' stacks can be taken
        stopped = time.monotonic()
        p.send_signal(signal.SIGTERM)   # the kubelet's, to the shell alone (the pod's PID 1)
        p.wait(timeout=20)
    finally:
        p.kill()
    out = (tmp_path / "out.txt").read_text()
    assert time.monotonic() - stopped < 3 and p.returncode == 250, out   # at once, with the launcher's exit
    assert f"fleetbox: node 0 on {os.uname().nodename}: workerlog.0 ended waiting in a collective; holding the node" \
        in out


def test_a_pod_whose_rank_crashed_is_not_held_and_ends_with_its_launchers_exit(tmp_path):
    p = held_node(tmp_path, f"echo 'Traceback: ValueError' > {tmp_path}/workerlog.0; exit 7")
    p.wait(timeout=10)
    assert p.returncode == 7 and not (tmp_path / "COLLECTIVE-TIMEOUT").exists(), (tmp_path / "out.txt").read_text()


@pytest.mark.parametrize("breaking", ["\x85", "\u2028", "\u2029"], ids=["NEL", "LS", "PS"])
def test_a_character_yaml_reads_as_a_line_break_comes_back_as_itself(breaking):
    """U+0085 in a job's --args came back from manifests.yaml (and what `podman kube play` reads) as a newline."""
    import yaml

    from fleetbox.run.backends.kube_pods import to_yaml
    b = backend(k8s_kind="indexed")
    plan = b.plan(spec(args=("--note", f"a{breaking}b")))
    assert list(yaml.safe_load_all(to_yaml(plan.manifests))) == json.loads(json.dumps(plan.manifests))
    assert f"a{breaking}b" in json.dumps(plan.manifests, ensure_ascii=False)
