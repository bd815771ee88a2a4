"""HPC paths for real: a 2-node Slurm cluster made by the test (runtimes Podman and Charliecloud), image
export for Charliecloud, and a registry on loopback (push, pull back with Podman, verify the pulled image)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from fleetbox import settings
from fleetbox.image import matrix
from fleetbox.run import hostnet, node_log, visualdl_logs
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import slurm as slurm_backend
from tests import slurmcluster
from tests.conftest import ROOT, ctrl_c_reaches_it, invoke, once
from tests.integration.conftest import GPU_VARIANT, ON_CPU, SITE_REGISTRY, paddle_opens
from tests.integration.test_datasets_in_image import READ_MNIST
from tests.integration.test_hangs import HANG_S, PLAIN, last_metric_time
from tests.integration.test_job_styles import STATIC, STATIC_ARGS
from tests.integration.test_train import assert_rows_are_the_runs_own_figures, study_of
from tests.unit.test_cli import one_line_error

needs = [t for t in ("slurmctld", "slurmd", "munged", "podman", "ch-run", "ch-convert", "skopeo", "docker-registry")
         if not shutil.which(t)]
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),   # under CI a skip fails the run
              pytest.mark.skipif(bool(needs), reason=f"missing {needs}: run scripts/setup-host.sh")]

# This machine refuses podman's default nofile/nproc limits: a site setting, passed as a cluster admin would.
PODMAN_ARGS = "--ulimit nofile=20000:20000 --ulimit nproc=32768:32768"
# The image the podman_image fixture loads into the nodes' (shared) Podman storage: a name the nodes hold, run with
# --pull=never (the pushed-reference default is test_slurm_podman_runs_the_image_pushed_to_the_sites_registry's).
LOCAL = ["--image", "fleetbox/paddle:cpu"]


@pytest.fixture(scope="module")
def charliecloud_image(cpu_image):
    def make():
        proc = invoke("export", "--variant", "cpu", "--format", "charliecloud")
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().splitlines()[-1].split(": ")[-1]
    return once("charliecloud-cpu", make)


def _into_podman(image, tag: str) -> None:
    """The engine's image into the nodes' (shared) Podman storage under `tag`, unless it is there already."""
    want = image.id.split(":")[1][:12]
    have = subprocess.run(["podman", "image", "inspect", "-f", "{{.Id}}", tag], capture_output=True, text=True).stdout
    if not have.startswith(want):   # same image ID: podman load keeps it
        save = subprocess.Popen(["docker", "save", tag], stdout=subprocess.PIPE)
        subprocess.run(["podman", "load", "-q"], stdin=save.stdout, check=True, capture_output=True)
        save.wait()
        if have.strip():   # the image this replaced is untagged now: GBs a run on a developer's machine
            subprocess.run(["podman", "rmi", have.strip()], capture_output=True)


def in_podman(cpu_image) -> None:
    """The cpu image in Podman's storage, once in this run, before any test of the run uses Podman; and what an
    earlier run left there removed (one killed mid-test left its job containers, which the tests count)."""
    def make():
        _into_podman(cpu_image["image"], "fleetbox/paddle:cpu")
        left = subprocess.run(["podman", "ps", "-aq", "--filter", "label=io.fleetbox.job"], capture_output=True,
                              text=True).stdout.split()
        if left:
            print(f"removing {len(left)} podman container(s) an earlier run left")
            subprocess.run(["podman", "rm", "-f", "--time", "0", *left], capture_output=True)
    once("podman-cpu", make)


@pytest.fixture(scope="module")
def podman_image(cpu_image):
    in_podman(cpu_image)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, cpu_image):
    d = tmp_path_factory.mktemp("slurm")
    env = slurmcluster.start(d)
    try:
        yield env
    finally:
        slurmcluster.stop(d)


@pytest.fixture(scope="module")
def modulefiles(tmp_path_factory):
    """A site's module of our own (Environment Modules, installed by setup-host.sh): it sets a variable the
    training script needs (smoke.py --require-env), and puts a folder on the loader's path, as a CUDA module does."""
    d = tmp_path_factory.mktemp("modulefiles")
    (d / "fbtest").mkdir()
    (d / "fbtest" / "1.0").write_text("#%Module1.0\nsetenv FBTEST_LOADED 1.0\n"
                                          "prepend-path LD_LIBRARY_PATH /opt/fbtest/lib\n")
    return str(d)


def slurm_train(env, *args):
    return invoke("train", "--backend", "slurm", *args, env=env, timeout=900)


def summary(proc):
    job_dir = proc.stdout.split("logs in ")[1].split()[0].rstrip(";")
    return json.loads(open(os.path.join(job_dir, "summary.json")).read()), job_dir


def podman_containers(job_id: str, running_only: bool = False) -> list[str]:
    """The Podman containers of fleetbox's job `job_id` (other tests' jobs may run beside it)."""
    return subprocess.run(["podman", "ps", *([] if running_only else ["-a"]), "-q", "--filter",
                           f"label=io.fleetbox.job={job_id}"], capture_output=True, text=True).stdout.split()


def test_export_charliecloud_runs_run_check_with_the_images_receipts_beside_it(charliecloud_image, cpu_image):
    proc = subprocess.run(["ch-run", "--set-env", charliecloud_image, "--", "python", "-c",
                           "import paddle; paddle.utils.run_check()"], capture_output=True, text=True,
                          env={**os.environ, "USER": "root"}, timeout=300)
    assert proc.returncode == 0 and "installed successfully" in proc.stdout, proc.stderr[-2000:]
    # the image's receipts beside the export: its SBOM, and its statement (a folder has no digest to add)
    from fleetbox.image import receipts
    image = cpu_image["image"]
    sbom = Path(f"{charliecloud_image}.sbom.json").read_text()
    assert sbom == receipts.sbom_path(image.labels["io.fleetbox.inputs-sha256"]).read_text()
    statement = receipts.check_statement(json.loads(Path(f"{charliecloud_image}.provenance.json").read_text()))
    assert receipts.subject_digests(statement) == {image.id}


@pytest.mark.docker   # its node.sh runs on this machine's network, on the plan's port
def test_charliecloud_run_as_a_user_finds_the_seeded_cache_in_its_home(charliecloud_image, seeded_mnist,
                                                                       monkeypatch):
    """On a cluster the job runs as the user, whose Paddle looks in ~/.cache/paddle/dataset, not /root: the
    real node.sh, run by a real non-root user with ch-run, must put the cache there."""
    user = "fleetbox-test"
    subprocess.run(["useradd", "-m", user], capture_output=True)   # may exist from an interrupted run
    shared = Path(tempfile.mkdtemp(prefix="fleetbox-user-"))
    try:
        shutil.copytree(seeded_mnist["dest"], shared / "cache")
        (shared / "ws").mkdir()
        (shared / "ws" / "read_mnist.py").write_text(READ_MNIST)
        (shared / "runs").mkdir()
        os.chmod(shared / "runs", 0o1777)
        subprocess.run(["chmod", "-R", "a+rX", str(shared)], check=True)
        monkeypatch.setenv("FLEETBOX_RUNS", str(shared / "runs"))
        spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=1, job_id="train-user-0001",
                                script=str(shared / "ws" / "read_mnist.py"), args=(json.dumps(seeded_mnist["md5"]),),
                                data_dir=str(shared / "cache"), image=charliecloud_image)
        plan = slurm_backend.SlurmBackend("charliecloud").plan(spec)
        (shared / "node.sh").write_text(dict(plan.files)["node.sh"])
        (shared / "runs" / "train-user-0001" / "node0").mkdir(parents=True)   # the batch script makes it
        (shared / "runs" / "train-user-0001" / "checkpoints").mkdir()          # submit makes it
        shutil.copytree(settings.HELPERS, shared / "runs" / "train-user-0001" / slurm_backend.HELPERS)   # and this
        subprocess.run(["chmod", "-R", "a+rwX", str(shared / "runs")], check=True)
        env = f"SLURM_NODEID=0 SLURM_NNODES=1 SLURM_JOB_ID=1 MASTER_IP=127.0.0.1 MASTER_PORT={plan.port}"
        proc = subprocess.run(["su", "-", user, "-c", f"{env} bash {shared / 'node.sh'}"], capture_output=True,
                              text=True, timeout=600)
        log = shared / "runs" / "train-user-0001" / "node0" / "workerlog.0"
        said = proc.stdout[-2000:] + proc.stderr[-2000:] + (log.read_text()[-2000:] if log.exists() else "")
        assert proc.returncode == 0, said
        out = json.loads([ln for ln in log.read_text().splitlines() if ln.startswith("{")][-1])
        assert out == {"home": f"/home/{user}/.cache/paddle/dataset", "train": 600, "test": 100, "label3": 4,
                       "shape": [28, 28]}
    finally:
        subprocess.run(["userdel", "-r", user], capture_output=True)
        shutil.rmtree(shared, ignore_errors=True)


def test_slurm_scaling_study_with_podman_one_and_two_nodes(cluster, podman_image):
    """`invoke scale` on Slurm: a 1-node and a 2-node job, each row its own run's figures; the 2-node run is the
    cluster's 2-node training job, checked as such (node addresses, metrics, report)."""
    proc = invoke("scale", "--backend", "slurm", "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                  "--nodes", "1,2", env=cluster, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    study, md = study_of(proc)
    rows = study["rows"]
    assert [(r["nodes"], r["state"]) for r in rows] == [(1, "PASSED"), (2, "PASSED")] and study["backend"] == "slurm"
    assert_rows_are_the_runs_own_figures(rows, ROOT / "runs")
    assert f"| fleetbox/paddle:cpu | 3.3.1 | 2 | 1 | 2 | {rows[1]['samples_per_s']:.1f} |" in md
    job_dir = str(ROOT / "runs" / rows[1]["job"])
    s = json.loads(open(os.path.join(job_dir, "summary.json")).read())
    assert s["scheduler_state"] == "COMPLETED" and s["ok"]
    assert s["smoke"]["world"] == 2 and s["smoke"]["params_identical"]   # the 2-node run's own smoke summary
    out = open(os.path.join(job_dir, f"slurm-{s['scheduler_job']}.out")).read()
    assert "master node1 = 10.213.77.11:" in out   # the first host, resolved to a numeric IP
    node1 = open(os.path.join(job_dir, "node1.log")).read()
    assert "fbn2e 10.213.77.12 -> master 10.213.77.11" in node1   # node 2 found its own NIC and address
    md = open(os.path.join(job_dir, "report.md")).read()   # the script's own figure; the allocation's start known
    assert f"- throughput: {s['smoke']['samples_per_s']:.1f} samples/s;" in md and "time to first step: " in md, md
    assert "- plotted: loss of rank 0, rank 1; samples/s of node0, node1" in md
    for k in (0, 1):
        assert os.path.exists(os.path.join(job_dir, f"node{k}", "workerlog.0"))


def test_slurm_two_nodes_with_charliecloud_run_the_export_of_the_build_here(cluster, cpu_image, charliecloud_image):
    """No --image: the export `invoke export` made of this build, found by its record, its content hash in its name."""
    content = next(t for t in cpu_image["image"].tags if t.startswith("fleetbox/paddle:cpu-"))
    assert Path(charliecloud_image).name == f"fleetbox-paddle-{content.split(':')[1]}.ch"
    proc = slurm_train(cluster, "--runtime", "charliecloud")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s, job_dir = summary(proc)
    assert s["ok"] and '"world": 2' in proc.stdout
    assert f"-c /workspace {charliecloud_image} -- python" in Path(job_dir, "node.sh").read_text()


def test_slurm_failing_rank_names_the_node(cluster, podman_image):
    proc = slurm_train(cluster, "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                       "--args", "--fail-rank 1 --fail-step -1 --hang-rank 0")
    one_line_error(proc, "train failed: node1 (rank 1) on node2 exited with exit code 3", job_output=True)
    # node0 hung, wrote nothing since long before; srun stopped it (node.sh exits 143): never the culprit
    summary = json.loads((Path(proc.stdout.split("logs in ")[1].split()[0]) / "summary.json").read_text())
    assert [n["state"] for n in summary["nodes"]] == ["stopped", "FAILED"] and summary["culprit"] == 1
    assert "nnodes: 2" in summary["launcher_config"]   # the failed node's launcher settings
    assert "    | nnodes: 2" in proc.stdout.split("Paddle's launcher on node1 ran with:")[1], proc.stdout[-3000:]
    assert podman_containers(summary["job_id"]) == []


def test_slurm_a_script_that_spawns_its_ranks_runs_them_on_one_node_and_a_failed_rank_is_named(cluster,
                                                                                                 podman_image):
    ok = slurm_train(cluster, "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                     "--cpus-per-node", "2", "--script", "train/spawn_smoke.py", "--args",
                     "--steps 20 --checkpoint-every 10")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr
    s, job_dir = summary(ok)
    assert [n["node"] for n in s["nodes"]] == ["node0"] and s["smoke"]["world"] == 2 and s["smoke"]["whole_run"]
    for r in (0, 1):   # each spawned rank's own log, in the node's folder as a launched rank's
        assert f'FLEETBOX-METRIC {{"rank": {r}, ' in Path(job_dir, "node0", f"workerlog.{r}").read_text()
    assert (Path(job_dir) / "checkpoints" / "step-00000020" / "COMPLETE").exists()
    bad = slurm_train(cluster, "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                      "--cpus-per-node", "2", "--script", "train/spawn_smoke.py", "--args",
                      "--fail-rank 1 --fail-step -1")
    one_line_error(bad, "train failed: node0 (rank 0) on ", " ended: its spawned rank 1 exited with exit code 3 "
                                                           "(log: workerlog.1)", job_output=True)
    assert podman_containers(s["job_id"]) == podman_containers(summary(bad)[0]["job_id"]) == []


def test_slurm_a_spare_takes_a_killed_nodes_place_in_the_same_allocation_and_the_job_ends_bit_for_bit(cluster,
                                                                                                       podman_image):
    """tests/integration/test_job_styles.py's static job (its ranks' parameters averaged, BatchNorm's statistics
    each rank's own), 2 nodes and a spare on the 3-node cluster: rank 1 is killed after step 6 (saved at 4). The
    next step runs in the same Slurm job (no requeue, no queue) on the spare in its node's place, from step 4, and
    every rank ends as in a run that never stopped. Without a spare, --min-nodes 1 goes on with the one node left;
    more spares than the partition has is one line."""
    def run(*more, ok=True):
        proc = slurm_train(cluster, "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL, *STATIC, *more)
        assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr
        if not ok:
            return proc, None
        s, job_dir = summary(proc)
        results = [json.loads(ln[7:]) for k in range(len(s["nodes"])) for ln in
                   Path(job_dir, f"node{k}", "workerlog.0").read_text().splitlines() if ln.startswith("RESULT ")]
        return s, {r["rank"]: r for r in results}

    _, want = run("--args", STATIC_ARGS)
    assert want[0]["params"] == want[1]["params"] and want[0]["losses"] == 12   # one model, two ranks' data
    s, got = run("--spare-nodes", "1", "--max-restarts", "1", "--args", f"{STATIC_ARGS} --kill-rank 1 --kill-at 6")
    failed, passed = s["attempts"]
    assert (failed["ok"], passed["ok"], failed["slurm_job"]) == (False, True, passed["slurm_job"]), s["attempts"]
    assert failed["ended"].startswith("failed (exit ") and failed["ended"].endswith(
        f"node2 left out, a spare in its place: restarted from step 4 in the same Slurm job {failed['slurm_job']}")
    (r,) = s["replaced"]
    assert (r["attempt"], r["node"], r["host"], r["by"], r["ran"]) == (1, 1, "node2", "node3", True), r
    assert sorted(n["host"] for n in s["nodes"]) == ["node1", "node3"] and s["ok"], s["nodes"]
    shown = subprocess.run(["scontrol", "show", "job", failed["slurm_job"]], capture_output=True, text=True,
                           env={**os.environ, **cluster}).stdout
    assert " Restarts=0 " in shown and " NumNodes=3 " in shown, shown   # Slurm never requeued it
    for r in (0, 1):
        assert got[r]["first"] == 4 and got[r]["sha256"] == want[r]["sha256"], (got, want)

    s, got = run("--min-nodes", "1", "--max-restarts", "1", "--args",
                 "--steps 12 --every 4 --optimizer sgd --average --kill-rank 1 --kill-at 6")
    assert [(a["ok"], a["nodes"]) for a in s["attempts"]] == [(False, 2), (True, 1)], s["attempts"]
    assert "node2 left out, one node fewer: restarted from step 4 in the same Slurm job" in s["attempts"][0]["ended"]
    assert [n["host"] for n in s["nodes"]] == ["node1"] and got[0]["first"] == 4, (s["nodes"], got)

    proc, _ = run("--spare-nodes", "2", "--args", STATIC_ARGS, ok=False)
    assert proc.stderr == "fleetbox: error: 4 nodes (2 and 2 spare(s)) are more than partition (the default) has: 3\n"


def test_slurm_two_nodes_with_podman_run_the_gpu_image_on_cpu(cluster, podman_image, cuda_image):
    """The GPU image built here (cu118-pypi), on the Slurm test cluster, its ranks on CPU: no GPU asked of Slurm,
    collectives on Gloo, the smoke job whole."""
    _into_podman(cuda_image["image"], f"fleetbox/paddle:{GPU_VARIANT}")
    proc = slurm_train(cluster, "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *ON_CPU,
                       "--image", f"fleetbox/paddle:{GPU_VARIANT}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s, job_dir = summary(proc)
    assert s["ok"] and s["scheduler_state"] == "COMPLETED"
    assert s["smoke"]["world"] == 2 and s["smoke"]["params_identical"] and s["smoke"]["loss_falls"]
    batch = open(os.path.join(job_dir, "job.sbatch")).read()
    assert "#SBATCH --gpus" not in batch and "#SBATCH --gres" not in batch   # nothing this cluster lacks
    log = open(os.path.join(job_dir, "node0", "workerlog.0")).read()
    assert "You are using GPU version Paddle" in log   # the GPU build, on CPU


def test_slurm_bad_partition_passes_slurms_message_on(cluster):
    proc = slurm_train(cluster, "--runtime", "podman", *LOCAL, "--partition", "nosuchpart")
    one_line_error(proc, "sbatch failed", "Invalid partition name specified")


def test_sbatch_missing_is_one_clear_line(cpu_image):
    proc = invoke("train", "--backend", "slurm", "--runtime", "podman", *LOCAL, env={"PATH": "/nonexistent"})
    one_line_error(proc, "sbatch not found: run on a Slurm login node")


def _blobs(storage: Path) -> dict[str, int]:
    """The registry's blobs (layers, configs, manifests) by digest, with their sizes, as stored on disk."""
    return {f"sha256:{d.parent.name}": d.stat().st_size
            for d in storage.glob("docker/registry/v2/blobs/sha256/*/*/data")}


def _manifest(ref: str) -> dict:
    host, rest = ref.split("/", 1)
    repo, tag = rest.rsplit(":", 1)
    out = subprocess.run(["curl", "-sf", "-H", "Accept: application/vnd.docker.distribution.manifest.v2+json",
                          f"http://{host}/v2/{repo}/manifests/{tag}"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_push_to_a_local_registry_pull_back_with_podman_and_verify(cpu_image, bumped, tmp_path):
    own = {"FLEETBOX_EXPORTS": str(tmp_path / "exports")}   # the push's record: this test's (its registry stops)
    cfg = tmp_path / "registry.yml"
    cfg.write_text(f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path}/data\n"
                   f"http:\n  addr: 127.0.0.1:5055\n")
    reg = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    pulled = "127.0.0.1:5055/fleetbox/paddle:cpu"
    try:
        for _ in range(100):
            if subprocess.run(["curl", "-sf", "http://127.0.0.1:5055/v2/"], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        proc = invoke("push", "--variant", "cpu", "--registry", "127.0.0.1:5055/fleetbox", env=own)
        assert proc.returncode == 0, proc.stderr
        assert "pushed 127.0.0.1:5055/fleetbox/paddle:cpu-" in proc.stdout
        (record,) = [json.loads(p.read_text()) for p in (tmp_path / "exports" / "records").iterdir()]
        content = next(t for t in cpu_image["image"].tags if t.startswith("fleetbox/paddle:cpu-"))
        assert (record["kind"], record["content_tag"], record["where"]) == (
            "registry", content, f"127.0.0.1:5055/fleetbox/paddle:{content.split(':')[1]}")
        cmds = invoke("pull-cmd", "--variant", "cpu", "--runtime", "podman", "--registry", "127.0.0.1:5055/fleetbox",
                      "--insecure").stdout
        pull = next(ln for ln in cmds.splitlines() if ln.startswith("podman pull") and ln.endswith(":cpu"))
        assert subprocess.run(pull.split(), capture_output=True).returncode == 0
        # run verify from the pulled image: podman -> docker, then `invoke verify --image`
        save = subprocess.Popen(["podman", "save", pulled], stdout=subprocess.PIPE)
        subprocess.run(["docker", "load", "-q"], stdin=save.stdout, check=True, capture_output=True)
        save.wait()
        v = invoke("verify", "--variant", "cpu", "--image", pulled)
        assert v.returncode == 0 and "PASS  paddle.utils.run_check()" in v.stdout, v.stdout[-2000:]
        refused = invoke("push", "--variant", "cpu", "--registry", "127.0.0.1:5099/fleetbox", env=own)
        one_line_error(refused, "127.0.0.1:5099/fleetbox/paddle:cpu-")
        tags = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                              text=True).stdout.split()
        assert not [t for t in tags if t.startswith("127.0.0.1:5099/")]   # a refused push leaves no tags

        # one pin changed (opencv): the second push sends only the opencv layer (the last one)
        first = _manifest("127.0.0.1:5055/fleetbox/paddle:cpu")
        held = _blobs(tmp_path / "data")
        again = bumped["run"]("push", "--variant", "cpu", "--registry", "127.0.0.1:5055/fleetbox")
        second = _manifest("127.0.0.1:5055/fleetbox/paddle:cpu")
        assert [x["digest"] for x in second["layers"]][:-1] == [x["digest"] for x in first["layers"]][:-1]
        new = {d: n for d, n in _blobs(tmp_path / "data").items() if d not in held}
        assert second["layers"][-1]["digest"] in new and len(new) == 3, new   # + the config and its manifest
        assert sum(new.values()) < 0.2 * sum(x["size"] for x in second["layers"]), new   # opencv: ~10% of it
        assert "1 layer(s) sent, " in again.stdout, again.stdout
    finally:
        reg.terminate()
        reg.wait()
        subprocess.run(["podman", "rmi", "-f", pulled], capture_output=True)
        images = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}} {{.ID}}"],
                                capture_output=True, text=True).stdout.splitlines()
        ours = [ln.split()[0] if not ln.split()[0].endswith(":<none>") else ln.split()[1]
                for ln in images if ln.startswith(("127.0.0.1:5055/", "127.0.0.1:5099/"))]
        if ours:
            subprocess.run(["docker", "rmi", *ours], capture_output=True)


def test_slurm_podman_runs_the_image_pushed_to_the_sites_registry(cluster, cpu_image, podman_image, tmp_path):
    """As at a site: a registry with TLS that the nodes reach (here on the cluster's own bridge address, trusted by
    Docker and Podman through certs.d, as a site's CA is); `invoke push` fills it, and `invoke train` with no --image
    runs on every node the pushed content tag, pulled there by Podman."""
    from tests import fabric
    addr = SITE_REGISTRY
    own = {**cluster, "FLEETBOX_EXPORTS": str(tmp_path / "exports")}
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    f"/CN={fabric.SLURM.subnet}.1", "-addext", f"subjectAltName=IP:{fabric.SLURM.subnet}.1",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True)
    (tmp_path / "registry.yml").write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path}/data\nhttp:\n  addr: {addr}\n"
        f"  tls:\n    certificate: {tmp_path}/cert.pem\n    key: {tmp_path}/key.pem\n")
    trusted = [Path(d) / addr for d in ("/etc/docker/certs.d", "/etc/containers/certs.d")]
    made = [d.parent for d in trusted if not d.parent.exists()]   # removed again after, with what they hold
    for d in trusted:
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "cert.pem", d / "ca.crt")
    reg = subprocess.Popen(["docker-registry", "serve", str(tmp_path / "registry.yml")], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    content = next(t for t in cpu_image["image"].tags if t.startswith("fleetbox/paddle:cpu-"))
    ref = f"{addr}/fleetbox/paddle:{content.split(':')[1]}"
    try:
        for _ in range(100):
            if subprocess.run(["curl", "-sf", "--cacert", str(tmp_path / "cert.pem"), f"https://{addr}/v2/"],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        subprocess.run(["podman", "rmi", "-f", ref], capture_output=True)   # pulled by the job, not left from before
        nothing = slurm_train(own, "--runtime", "podman", "--dry-run")
        one_line_error(nothing, f"podman has no image of {content}", "invoke push --variant cpu --registry")
        proc = invoke("push", "--variant", "cpu", "--registry", f"{addr}/fleetbox", env=own)
        assert proc.returncode == 0, proc.stderr
        proc = slurm_train(own, "--runtime", "podman", "--runtime-args", PODMAN_ARGS)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        s, job_dir = summary(proc)
        assert s["ok"] and '"world": 2' in proc.stdout
        node = Path(job_dir, "node.sh").read_text()
        assert f" {ref} python -m paddle" in node and "--pull=never" not in node
        pulled = subprocess.run(["podman", "image", "inspect", "-f", "{{.Id}}", ref], capture_output=True, text=True)
        assert pulled.returncode == 0 and cpu_image["image"].id.endswith(pulled.stdout.strip()), pulled.stderr
    finally:
        reg.terminate()
        reg.wait()
        subprocess.run(["podman", "rmi", "-f", ref], capture_output=True)
        tags = [content, *matrix.load().get("cpu").aliases]   # what invoke push tagged for the registry
        subprocess.run(["docker", "rmi", *[f"{addr}/fleetbox/paddle:{t.split(':')[1]}" for t in tags]],
                       capture_output=True)
        for d in trusted + made:
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("fmt,cmd", [("sif", "apptainer build {name}.sif docker-archive://{name}.tar"),
                                     ("sqsh", "enroot import -o {name}.sqsh docker-archive://{name}.tar")])
def test_export_without_its_tool_says_what_to_run_on_the_cluster(cpu_image, fmt, cmd, tmp_path):
    tool = {"sif": "apptainer", "sqsh": "enroot"}[fmt]
    proc = invoke("export", "--variant", "cpu", "--format", fmt, env={"PATH": path_without(tool, tmp_path)})
    content = next(t for t in cpu_image["image"].tags if t.startswith("fleetbox/paddle:cpu-"))
    name = f"fleetbox-paddle-{content.split(':')[1]}"   # the name carries the build's content hash
    one_line_error(proc, "is not installed here", "--format docker-archive", cmd.format(name=name),
                   f"give `invoke train` --image {name}.{fmt}")


def path_without(tool: str, tmp_path) -> str:
    """A PATH with every program of this one but `tool` (links in one folder), so a test can see how
    fleetbox behaves where a tool is missing without uninstalling it."""
    shadow = tmp_path / "bin"
    shadow.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for p in (Path(d).iterdir() if Path(d).is_dir() else ()):
            if p.name != tool and not (shadow / p.name).exists() and os.access(p, os.X_OK):
                (shadow / p.name).symlink_to(p)
    assert shutil.which(tool, path=str(shadow)) is None
    return str(shadow)


def test_ctrl_c_cancels_the_slurm_job_and_leaves_no_container(cluster, podman_image):
    import signal
    import sys
    job_id = f"slurm-ctrl-c-{os.getpid()}"
    p = subprocess.Popen([sys.executable, "-m", "invoke", "train", "--backend", "slurm", "--runtime", "podman",
                          "--runtime-args", PODMAN_ARGS, *LOCAL, "--job-id", job_id,
                          "--args", "--hang-rank 0 --hang-seconds 600"],
                         cwd=ROOT, env={**os.environ, **cluster}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=ctrl_c_reaches_it)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:   # wait until both nodes' containers run
        running = podman_containers(job_id, running_only=True)
        if len(running) == 2:
            break
        time.sleep(0.5)
    assert len(running) == 2, "the job's containers never started"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "scancel" in out
    job = out.split("submitted Slurm job ")[1].split()[0]
    env = {**os.environ, **cluster}
    for _ in range(60):
        state = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, env=env).stdout
        left = podman_containers(job_id)
        if "JobState=CANCELLED" in state and not left:
            break
        time.sleep(1)
    assert "JobState=CANCELLED" in state and left == []


HOSTILE_ARGS = "--tag '$(touch /tmp/fleetbox-pwned)' '`touch /tmp/fleetbox-pwned`' {rank} 'a b;c' \"q'uote\" '$HOME'"
HOSTILE_TAG = ["$(touch /tmp/fleetbox-pwned)", "`touch /tmp/fleetbox-pwned`", "0", "a b;c", "q'uote", "$HOME"]
HOSTILE_ENV = "FLEETBOX_TAG=$(touch /tmp/fleetbox-pwned); `id` $HOME {node}"


@pytest.mark.parametrize("runtime", ["podman", "charliecloud"])
def test_slurm_dry_run_is_what_slurm_got_and_hostile_values_arrive_unchanged(cluster, runtime, request):
    """The dry-run's job.sbatch equals, byte for byte, the script Slurm holds for the job (scontrol write
    batch_script) and its node.sh the one the nodes ran; hostile values reach the script unchanged."""
    if runtime == "podman":
        request.getfixturevalue("podman_image")
        extra = ["--runtime-args", PODMAN_ARGS, *LOCAL]
    else:
        extra = ["--image", request.getfixturevalue("charliecloud_image")]
    job = f"train-same-{runtime}-{int(time.time())}"
    common = ["--runtime", runtime, *extra, "--job-id", job, "--port", str(hostnet.random_port()),
              "--args", HOSTILE_ARGS, "--env", HOSTILE_ENV]
    dry = slurm_train(cluster, "--dry-run", *common)
    assert dry.returncode == 0, dry.stderr
    proc = slurm_train(cluster, *common)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s, job_dir = summary(proc)
    said_sbatch = dry.stdout.split(f"# {job_dir}/job.sbatch\n", 1)[1].split(f"\n# {job_dir}/node.sh\n")[0]
    said_node = dry.stdout.split(f"\n# {job_dir}/node.sh\n", 1)[1][:-1]   # print() added the last newline
    held = subprocess.run(["scontrol", "write", "batch_script", s["scheduler_job"], "-"], capture_output=True,
                          text=True, env={**os.environ, **cluster})
    assert held.returncode == 0, held.stderr
    assert held.stdout == said_sbatch
    assert open(os.path.join(job_dir, "node.sh")).read() == said_node
    assert not os.path.exists("/tmp/fleetbox-pwned")
    assert s["smoke"]["tag"] == HOSTILE_TAG
    assert s["smoke"]["env_tag"] == "$(touch /tmp/fleetbox-pwned); `id` $HOME node0"


TIME_LIMIT_STEPS = 200


def test_slurm_time_limit_checkpoints_and_continues_in_new_allocations_until_done(cluster, cpu_env):
    """With no container (runtime none: the env's Python on the nodes; the checkpoint folder, the signal path and
    the chain are the same for every runtime, and the container runtimes' checkpoint mounts are held by the requeue
    and hang tests). Detached, with a 3-minute limit: Slurm warns (USR1, 30 s before the limit, or up to a minute
    earlier), the job checkpoints and stops, and the next allocation goes on from there, without help and with no
    client attached, until smoke.py is done; it is judged on the whole run. `invoke jobs` and `invoke logs
    --follow` work from another shell, across allocations. Once the first allocation has saved a checkpoint, its
    limit is cut to 2 minutes (`scontrol update TimeLimit`, as a user may cut their own job's): Slurm's own warning
    then comes within 30-90 s of the allocation's start, too soon for 100 s of steps, which the second allocation's
    90-150 s of work then finishes (or, with Slurm's earliest warning, a third)."""
    env = {**os.environ, **cluster}
    p = subprocess.Popen([sys.executable, "-m", "invoke", "train", "--backend", "slurm", "--runtime", "none",
                          "--venv", str(cpu_env["path"]), "--time", "3m", "--signal-grace", "30",
                          "--max-allocations", "6", "--detach",
                          "--args", f"--steps {TIME_LIMIT_STEPS} --step-sleep 0.5 --checkpoint-every 10"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = p.stdout.readline() + p.stdout.readline() + p.stdout.readline()
    assert out.startswith("warning: --time 3m (180 s) less --signal-grace 30 s and the minute Slurm may warn early "
                          "leaves 90 s of work per allocation"), out
    assert " detached; see it with `invoke jobs`" in out, out + p.stderr.read()
    p.kill()   # the client is gone; Slurm carries the job
    p.wait()
    job_id = out.split("job ")[-1].split()[0]
    job_dir = ROOT / "runs" / job_id
    row = _slurm_row(job_id, env)
    assert row[1] == "slurm" and row[3] in ("PENDING", "RUNNING") and row[4] == "1", row
    board = BoardReader(job_dir, job_id)   # `invoke board`'s reading, live across the requeues' moves
    first = json.loads((job_dir / "handle.json").read_text())["scheduler_job"]
    deadline = time.monotonic() + 240
    while not list((job_dir / "checkpoints").glob("step-*/COMPLETE")):
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(1)
    cut = subprocess.run(["scontrol", "update", f"JobId={first}", "TimeLimit=2"], capture_output=True, text=True,
                         env=env)
    assert cut.returncode == 0, cut.stderr
    try:
        follow = invoke("logs", job_id, "--follow", env=env, timeout=600)   # until the chain ends
    finally:
        live = board.stop()
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout.count("fleetbox-checkpoint: told to stop: saved step") >= 1, follow.stdout[-3000:]
    assert '"whole_run": true' in follow.stdout   # the last allocation's FLEETBOX-SMOKE line, followed into
    row = _slurm_row(job_id, env)
    assert row[3] == "PASSED" and int(row[5]) == TIME_LIMIT_STEPS, row
    s = json.loads((job_dir / "summary.json").read_text())   # written by `invoke jobs`: no client followed
    allocs = s["attempts"]
    assert len(allocs) >= 2 and s["ok"], allocs
    assert [a["ended"].split()[0] for a in allocs[:-1]] == ["stopped"] * (len(allocs) - 1)
    assert allocs[-1]["ended"] == f"finished at checkpoint step {TIME_LIMIT_STEPS}"
    steps = [a["steps"] for a in allocs]
    assert steps[0][0] == 0 and all(b[0] == a[1] for a, b in zip(steps, steps[1:]))   # each goes on from the last
    assert all(a[1] > a[0] for a in steps), steps                                     # ... and made progress
    smoke = s["smoke"]
    assert smoke["steps"] == TIME_LIMIT_STEPS and smoke["whole_run"]
    assert smoke["loss_falls"] and smoke["params_identical"]
    assert smoke["resumed_from"] == steps[-1][0] > 0
    for a in allocs[:-1]:   # each allocation kept its own logs
        d = Path(a["logs"])
        assert (d / "node0.log").exists() and (d / "node1" / "workerlog.0").exists(), d
        assert "told to stop: saved step" in (d / "node0" / "workerlog.0").read_text()
        assert (job_dir / f"slurm-{a['slurm_job']}.out").exists()
    from fleetbox.run import records  # every file a chain leaves is on the docs' job-folder page
    assert records.undescribed(job_dir) == []
    # read as it grew, every 2 s across the allocations' moves, the board has what one read of the end has
    whole = {(run, tag): [(p.step, p.value) for p in ps]
             for run, tags in visualdl_logs.JobRuns(job_dir, job_id).read().items() for tag, ps in tags.items()}
    def ranks(got):   # (not the events: how each allocation ended is in the summary, written after)
        return {k: v for k, v in got.items() if not k[0].endswith("/events")}
    assert ranks(live) == ranks(whole) and board.reads > 10
    assert {run.split("/")[1] for run, _ in whole} == {f"alloc{a + 1}" for a in range(len(allocs))} | {"events"}
    for a, (first, last) in enumerate(steps):   # each allocation's ranks from where it resumed
        assert live[(f"{job_id}/alloc{a + 1}/rank1", "train/loss")][0][0] == first
    assert podman_containers(job_id) == []


class BoardReader:
    """`invoke board`'s reading of a job folder (visualdl_logs.JobRuns) every 2 s in a thread, as it grows:
    {(run, tag or event): [(step, value)]} of everything read."""

    def __init__(self, job_dir, job_id):
        self.runs, self.got, self.reads, self.done = visualdl_logs.JobRuns(job_dir, job_id), {}, 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _read(self):
        for run, tags in self.runs.read().items():
            for tag, ps in tags.items():
                self.got.setdefault((run, tag), []).extend((p.step, p.value) for p in ps)
        self.reads += 1

    def _watch(self):
        while not self.done.wait(2):
            try:
                self._read()
            except Exception:   # as the board's refresh: tried again next time (a lost line shows at the end)
                continue

    def stop(self):
        self.done.set()
        self.thread.join()
        self._read()
        while self.runs.behind:
            self._read()
        return self.got


def _slurm_row(job_id, env):
    proc = invoke("jobs", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [ln.split(None, 6) for ln in proc.stdout.splitlines() if ln.startswith(job_id + " ")]
    assert len(rows) == 1, proc.stdout
    return rows[0]


def test_slurm_a_real_failure_in_a_later_allocation_ends_the_chain_and_is_named(cluster, podman_image):
    """Allocation 1 is warned as Slurm would warn it at its time limit (USR1 to the batch script, sent here once it
    has a checkpoint), stops and continues; allocation 2 fails for real: the chain ends and names the node."""
    env = {**os.environ, **cluster}
    p = subprocess.Popen([sys.executable, "-m", "invoke", "train", "--backend", "slurm", "--runtime", "podman",
                          "--runtime-args", PODMAN_ARGS, *LOCAL, "--time", "5m", "--signal-grace", "60",
                          "--max-allocations", "4",
                          # rank 1 fails before joining, as in test_slurm_failing_rank_names_the_node: once the group
                          # has formed, rank 0's launcher can end first (250) and srun then stops rank 1's task (143)
                          # before its launcher reports 3 (seen once in CI: the blame gap noted on issue 11)
                          "--args", "--steps 400 --step-sleep 0.5 --checkpoint-every 10 --fail-rank 1 --fail-step -1 "
                                    "--fail-attempt 1"],
                         cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        first = ""
        while not first.startswith("submitted Slurm job "):   # submitted Slurm job N (...); logs in DIR
            first = p.stdout.readline()
            assert first, p.stderr.read()
        slurm_job, job_dir = first.split()[3], Path(first.split("logs in ")[1].strip())
        deadline = time.monotonic() + 240
        while not list((job_dir / "checkpoints").glob("step-*/COMPLETE")):
            assert time.monotonic() < deadline, "no checkpoint"
            time.sleep(1)
        warn = subprocess.run(["scancel", "--batch", "--signal=USR1", slurm_job], capture_output=True, text=True,
                              env=env)
        assert warn.returncode == 0, warn.stderr
        out, err = p.communicate(timeout=600)
    finally:
        p.kill()
    proc = subprocess.CompletedProcess(p.args, p.returncode, first + out, err)
    one_line_error(proc, "train failed: node1 (rank 1) on node2 exited with exit code 3 (over 2 allocations; ",
                   job_output=True)
    s, job_dir = summary(proc)
    assert [a["ended"].split()[0] for a in s["attempts"]] == ["stopped", "failed"], s["attempts"]
    first, second = (a["steps"] for a in s["attempts"])
    assert second[0] == first[1] > 0   # allocation 2 began from the checkpoint allocation 1 saved


def test_slurm_requeue_restarts_from_the_newest_checkpoint_as_an_attempt(cluster, podman_image):
    """`scontrol requeue` of a running job (what a node failure or preemption does): Slurm runs job.sbatch again
    in the same job. It is a restart of that allocation (attempt 1, so --resume never does not apply again, one
    --max-restarts spent) from the newest checkpoint, never a fresh start, and the chain's record shows it."""
    env = {**os.environ, **cluster}
    proc = invoke("train", "--backend", "slurm", "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                  "--detach",
                  "--max-restarts", "1", "--resume", "never",
                  "--args", "--steps 60 --step-sleep 0.5 --checkpoint-every 10", env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split("job ")[-1].split()[0]
    job_dir = ROOT / "runs" / job_id
    slurm_job = json.loads((job_dir / "handle.json").read_text())["scheduler_job"]
    assert "#SBATCH --requeue\n" in (job_dir / "job.sbatch").read_text()
    deadline = time.monotonic() + 240
    while not list((job_dir / "checkpoints").glob("step-*/COMPLETE")):
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(1)
    req = subprocess.run(["scontrol", "requeue", slurm_job], capture_output=True, text=True, env=env)
    assert req.returncode == 0, req.stderr
    follow = invoke("logs", job_id, "--follow", env=env, timeout=600)   # across the requeue, until it ends
    assert follow.returncode == 0, follow.stderr
    assert '"whole_run": true' in follow.stdout, follow.stdout[-3000:]
    row = _slurm_row(job_id, env)
    assert row[3] == "PASSED" and row[4] == "2", row
    s = json.loads((job_dir / "summary.json").read_text())
    cut, rerun = s["attempts"]
    assert cut["ended"].startswith("requeued by Slurm") and rerun["ended"] == "finished at checkpoint step 60"
    assert cut["slurm_job"] == rerun["slurm_job"] == slurm_job
    assert rerun["steps"][0] == cut["steps"][1] >= 10      # from the newest checkpoint, not step 0
    assert s["smoke"]["resumed_from"] == rerun["steps"][0] and s["smoke"]["whole_run"], s["smoke"]
    assert (Path(cut["logs"]) / "node0.log").exists()       # the cut run's logs, kept apart
    batch = (job_dir / f"slurm-{slurm_job}.out").read_text()
    assert "allocation 1 (Slurm job" in batch and "Slurm requeued job" in batch   # both runs' output kept


def test_slurm_a_stuck_rank_is_named_from_its_stacks_and_the_chain_restarts_and_passes(cluster, podman_image):
    """Detached (the client is gone once it submitted): the batch script's watcher notices rank 1 stuck at step
    30, keeps every rank's stacks, stops the step; the chain restarts in a new allocation from step 30."""
    env = {**os.environ, **cluster}
    proc = invoke("train", "--backend", "slurm", "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                  "--detach",
                  "--max-restarts", "1", "--hang-timeout", str(HANG_S), "--args",
                  "--steps 60 --checkpoint-every 10 --step-sleep 0.05 --hang-rank 1 --hang-step 30 --hang-attempt 0",
                  env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split("job ")[-1].split()[0]
    job_dir = ROOT / "runs" / job_id
    follow = invoke("logs", job_id, "--follow", env=env, timeout=600)
    assert follow.returncode == 0 and '"whole_run": true' in follow.stdout, follow.stdout[-3000:] + follow.stderr
    row = _slurm_row(job_id, env)
    assert row[3] == "PASSED" and row[4] == "2", row
    s = json.loads((job_dir / "summary.json").read_text())
    hung, rerun = s["attempts"]
    assert (hung["state"], rerun["state"]) == ("HUNG", "PASSED"), s["attempts"]
    assert hung["ended"].startswith("node1 (rank 1) hung: no progress since step 30 (") and \
        "in `load_batch_that_never_returns` (smoke.py:" in hung["ended"] and \
        "rank 0 waiting in `fused_allreduce_gradients`" in hung["ended"] and \
        hung["ended"].endswith(f"; restarted in Slurm job {rerun['slurm_job']}"), hung["ended"]
    assert s["smoke"]["resumed_from"] == 30 and s["smoke"]["whole_run"], s["smoke"]
    rank0, rank1 = ((job_dir / "hang-0" / f"rank{r}.txt").read_text() for r in (0, 1))
    assert "in load_batch_that_never_returns" in rank1 and "in fused_allreduce_gradients" in rank0
    out = (job_dir / f"slurm-{hung['slurm_job']}.out").read_text()
    assert "taking every rank's stacks" in out
    # every node's task ended within the deadline plus 10 s of the stuck rank's last progress
    ended = float(out.split("fleetbox: the job step ended at ")[1].split()[0])
    last = last_metric_time(job_dir / "alloc1" / "node1" / "workerlog.0")
    assert HANG_S <= ended - last <= HANG_S + 10, ended - last
    assert not podman_containers(job_id)


def test_slurm_a_plain_script_stuck_past_gloos_timeout_is_a_hang_named_from_the_stacks(cluster, podman_image,
                                                                                       tmp_path):
    """A script with no fleetbox helper and the default deadlines (10 min): Gloo's own 30 s timeout ends rank 0,
    waiting for stuck rank 1. node0's task holds (srun would stop node1 at once), the watcher takes the stacks
    while rank 1 is still stuck and names it; the attempt is HUNG, the chain restarts and passes."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    env = {**os.environ, **cluster}
    proc = invoke("train", "--backend", "slurm", "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                  "--max-restarts", "1", "--script", str(script), env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s, job_dir = summary(proc)
    hung, rerun = s["attempts"]
    assert (hung["state"], rerun["state"]) == ("HUNG", "PASSED"), s["attempts"]
    record = json.loads((Path(job_dir) / "hang-0" / "hang.json").read_text())
    assert (record["kind"], record["ranks"], record["node"], record["timed_out_nodes"]) == \
        ("collective", [1], 1, [0]), record
    assert hung["ended"].startswith("node1 (rank 1) hung: no progress since step ") and \
        "in `load_batch_that_never_returns` (plain.py:" in hung["ended"] and \
        "rank 0 timed out waiting in a collective" in hung["ended"], hung["ended"]
    out = (Path(job_dir) / f"slurm-{hung['slurm_job']}.out").read_text()
    assert "rank 0 timed out waiting in a collective (its own timeout)" in out
    node0 = (Path(job_dir) / "alloc1" / "node0.log").read_text()
    assert any(k == 0 and said.startswith("workerlog.0 ended waiting in a collective; holding the node")
               for k, _, said in node_log.lines(node0)), node0[-2000:]


def test_slurm_detached_job_is_cancelled_from_another_shell(cluster, podman_image):
    env = {**os.environ, **cluster}
    proc = invoke("train", "--backend", "slurm", "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                  "--detach",
                  "--max-allocations", "3", "--args", "--hang-rank 0 --hang-seconds 600", env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split("job ")[-1].split()[0]
    deadline = time.monotonic() + 120
    while len(podman_containers(job_id, running_only=True)) < 2:
        assert time.monotonic() < deadline, "the job's containers never started"
        time.sleep(0.5)
    assert _slurm_row(job_id, env)[3] == "RUNNING"
    # another job that only carries the same name (scancel --name would take it too)
    decoy = subprocess.run(["sbatch", "--parsable", f"--job-name=fleetbox-{job_id}", "--output=/dev/null",
                            "--wrap", "sleep 300"], capture_output=True, text=True, env=env)
    assert decoy.returncode == 0, decoy.stderr
    decoy = decoy.stdout.strip().split(";")[0]
    try:
        proc = invoke("cancel", job_id, env=env)
        handle = json.loads((ROOT / "runs" / job_id / "handle.json").read_text())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"scancel --user=root {handle['scheduler_job']}" in proc.stdout.splitlines(), proc.stdout
        deadline = time.monotonic() + 60
        while (row := _slurm_row(job_id, env))[3] != "CANCELLED" or podman_containers(job_id):
            assert time.monotonic() < deadline, row
            time.sleep(1)
        state = subprocess.run(["scontrol", "show", "job", decoy, "-o"], capture_output=True, text=True, env=env)
        assert "JobState=PENDING" in state.stdout or "JobState=RUNNING" in state.stdout, state.stdout
    finally:
        subprocess.run(["scancel", decoy], env=env)


# -- invoke doctor as a Slurm job on the allocation --

def doctor_report(proc) -> dict:
    path = (proc.stdout + proc.stderr).split("report: ")[-1].split()[0].rstrip(")")
    return json.loads(open(path).read())


def failing(report) -> set:
    return {(r["node"], r["check"]) for r in report["rows"] if not r["ok"]}


def test_slurm_without_a_container_runs_the_env_after_the_sites_module(cluster, cpu_env, modulefiles):
    """Runtime none: each node loads the module (its variable reaches every rank), then runs Paddle's launcher
    with the env's Python: the same job, no container."""
    proc = slurm_train({**cluster, "MODULEPATH": modulefiles}, "--runtime", "none", "--venv", str(cpu_env["path"]),
                       "--modules", "fbtest/1.0", "--args", "--steps 20 --require-env FBTEST_LOADED")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s, job_dir = summary(proc)
    assert s["ok"] and s["smoke"]["world"] == 2 and s["smoke"]["params_identical"] and s["smoke"]["steps"] == 20
    for k in (0, 1):
        log = Path(job_dir, f"node{k}.log").read_text()
        assert f"fleetbox: node {k} on node{k + 1}: modules loaded: fbtest/1.0" in log, log
        worker = Path(job_dir, f"node{k}", "workerlog.0").read_text()
        smoke = json.loads(worker.split("FLEETBOX-SMOKE ")[1].splitlines()[0])
        assert smoke["prefix"] == str(cpu_env["path"]) and smoke["rank"] == k   # the env's Python ran each rank
        assert "no hang detection" not in log + worker   # the helpers' sitecustomize ran, once
        progress = json.loads(Path(job_dir, f"node{k}", f"progress-rank{k}.json").read_text())
        assert progress["step"] == 20 and progress["done"], progress   # hang detection saw every step


def test_slurm_without_a_container_an_unknown_module_is_named_with_the_module_systems_message(cluster, cpu_env,
                                                                                              modulefiles):
    proc = slurm_train({**cluster, "MODULEPATH": modulefiles}, "--runtime", "none", "--venv", str(cpu_env["path"]),
                       "--modules", "fbtest/9.9", "--args", "--require-env FBTEST_LOADED")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    s, job_dir = summary(proc)
    k = s["culprit"]   # both nodes fail alike: the one srun reported first
    assert not s["ok"] and k in (0, 1) and s["nodes"][k]["exit_code"] == 4, s
    said = "\n".join(s["log_tail"])
    assert "ERROR: Unable to locate a modulefile for 'fbtest/9.9'" in said, said   # Environment Modules' own words
    assert f"fleetbox: node {k} on node{k + 1}: `module load fbtest/9.9` failed: ERROR: Unable to locate a " \
           f"modulefile for 'fbtest/9.9'" in said
    assert proc.stderr.splitlines()[-1].startswith(
        f"fleetbox: train failed: node{k} (rank {k}) on node{k + 1} stopped before the training: `module load "
        f"fbtest/9.9` failed: ERROR: Unable to locate a modulefile for 'fbtest/9.9' (exit 4) (logs: "), proc.stderr


def test_slurm_without_a_container_the_gpu_envs_ranks_open_the_libraries_paddle_opens_by_name(cluster, cuda_env,
                                                                                                modulefiles):
    """Runtime none with the GPU variant's env, its ranks on CPU: each node puts the env's GPU libraries ahead of
    what a module set, so every name Paddle opens loads in every rank (no activate, no root)."""
    names = paddle_opens()
    proc = slurm_train({**cluster, "MODULEPATH": modulefiles}, "--runtime", "none", "--venv", str(cuda_env["path"]),
                       *ON_CPU, "--modules", "fbtest/1.0", "--script", str(ROOT / "tests" / "probes" / "gpu_names.py"),
                       "--args", " ".join(names))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    _, job_dir = summary(proc)
    for k in (0, 1):
        worker = Path(job_dir, f"node{k}", "workerlog.0").read_text()
        said = json.loads(worker.split("FLEETBOX-NAMES ")[1].splitlines()[0])
        assert said["names"] == {n: "loaded" for n in names} and said["prefix"] == str(cuda_env["path"]), said
        path = said["ld_library_path"].split(":")   # (opencv's import put its own folder first, in the rank)
        ours = [k for k, p in enumerate(path) if p.startswith(f"{cuda_env['path']}/lib/python3.11/site-packages/"
                                                                  "nvidia/")]
        assert len(ours) == 11 and max(ours) < path.index("/opt/fbtest/lib"), said   # ahead of the module's

# What a rank was given: the CPUs it may run on, and its memory cgroup's limit (cgroup v1, as the cluster confines)
RESOURCES_PY = """import json, os, sys
path = next(ln.split(":", 2)[2] for ln in open("/proc/self/cgroup").read().splitlines() if ln.split(":")[1] == "memory")
parts = path.strip("/").split("/")   # the limit that holds: the lowest of the cgroup's and its parents'
limit = min(int(open("/".join(["/sys/fs/cgroup/memory", *parts[:n], "memory.limit_in_bytes"])).read())
            for n in range(len(parts) + 1))
print("FBRES " + json.dumps({"cpus": len(os.sched_getaffinity(0)), "mem_mb": limit >> 20}))
"""


def resources_seen(job_dir, nodes):
    return [json.loads(Path(job_dir, f"node{k}", "workerlog.0").read_text().split("FBRES ")[1].splitlines()[0])
            for k in range(nodes)]


def test_slurm_gives_each_nodes_ranks_the_cpus_and_memory_asked_for(cluster, cpu_env, tmp_path):
    """The cluster confines each task to what it asked for (task/cgroup, task/affinity), as a site does: by default
    a node's rank gets 2 CPUs (not Slurm's one a task), --cpus-per-node and --mem set them, and `all` gives whole
    nodes. Runtime none: the ranks run in the task's own cgroup."""
    if not slurmcluster.confines():
        pytest.fail("no cgroup v1 cpuset and memory controllers here: the cluster cannot confine tasks")
    script = tmp_path / "resources.py"
    script.write_text(RESOURCES_PY)
    runs = [([], 2, [{"cpus": slurm_backend.CPUS_PER_RANK[False], "mem_mb": slurmcluster.MEMORY_MB}] * 2),
            (["--cpus-per-node", "1", "--mem", "1500M"], 1, [{"cpus": 1, "mem_mb": 1500}]),
            (["--cpus-per-node", "all"], 1, [{"cpus": slurmcluster.CPUS, "mem_mb": slurmcluster.MEMORY_MB}])]
    for given, nodes, want in runs:
        proc = slurm_train(cluster, "--runtime", "none", "--venv", str(cpu_env["path"]), "--script", str(script),
                           "--nodes", str(nodes), *given)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        _, job_dir = summary(proc)
        assert resources_seen(job_dir, nodes) == want, given


def test_slurm_a_path_the_nodes_cannot_see_is_warned_about_and_stops_the_node_naming_it(cluster, cpu_env):
    """The script is in the cluster's login-only folder: a tmpfs here that no node sees. Submit warns in one line;
    the node stops before the training, in one line that names the script; the job fails saying so."""
    hidden = slurmcluster.LOGIN_ONLY
    script = hidden / "resources.py"
    script.write_text(RESOURCES_PY)
    proc = slurm_train(cluster, "--runtime", "none", "--venv", str(cpu_env["path"]), "--script", str(script),
                       "--nodes", "1")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    warned = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "warning: " in ln]
    assert warned == [f"warning: the script {script} is on tmpfs ({hidden}): Slurm's nodes see only file "
                      "systems they mount too (NFS, Lustre, GPFS, BeeGFS, CephFS, ...); a node that cannot see one "
                      "stops, naming it"], proc.stdout[-3000:]
    one_line_error(proc, f"train failed: node0 (rank 0) on node1 stopped before the training: {script} is not on "
                         f"this node: it must be on a file system every node mounts (exit 3)", job_output=True)


def test_a_user_without_root_installs_fleetbox_in_a_venv_plans_and_submits_a_slurm_job(cluster, charliecloud_image):
    """README's install on a login node: a user with no root copies the checkout to their home, makes a venv with
    the system's Python and pip-installs fleetbox into it; that fleetbox dry-runs and submits a 2-node Charliecloud
    job to the cluster, which runs as the user. pip's cache is kept between runs, never required."""
    from tests import checkout
    user, conf = "fleetbox-login", cluster["SLURM_CONF"]   # readable by every user, as a site's
    subprocess.run(["userdel", "-r", user], capture_output=True)   # left by an interrupted run
    subprocess.run(["useradd", "-m", "-s", "/bin/bash", user], check=True)
    cache = Path("/var/cache/fleetbox-tests/pip")
    cache.mkdir(parents=True, exist_ok=True)
    cache.chmod(0o1777)

    def as_user(command: str, timeout=900):
        env = f"SLURM_CONF={conf} PIP_CACHE_DIR={cache} PIP_DISABLE_PIP_VERSION_CHECK=1"
        return subprocess.run(["su", "-", user, "-c", f"export {env}; {command}"], capture_output=True, text=True,
                              timeout=timeout)
    try:
        checkout.copy(ROOT, Path(f"/home/{user}/fleetbox"))
        subprocess.run(["chown", "-R", f"{user}:{user}", f"/home/{user}"], check=True)
        proc = as_user("/usr/bin/python3 -m venv ~/venv && ~/venv/bin/pip install -q -e ~/fleetbox")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        train = ("cd ~/fleetbox && ~/venv/bin/invoke train --backend slurm --runtime charliecloud --nodes 2 "
                 f"--image {charliecloud_image}")
        proc = as_user(f"{train} --dry-run")
        assert proc.returncode == 0 and "#SBATCH --nodes=2" in proc.stdout, proc.stdout[-3000:] + proc.stderr
        proc = as_user(train)
        batch = "".join(p.read_text()[-3000:] for p in Path(f"/home/{user}/fleetbox/runs").glob("*/slurm-*.out"))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr + batch
        s, job_dir = summary(proc)
        assert s["ok"] and '"world": 2' in proc.stdout and job_dir.startswith(f"/home/{user}/fleetbox/runs/")
        uid = int(subprocess.run(["id", "-u", user], capture_output=True, text=True, check=True).stdout)
        assert {Path(job_dir, f"node{k}.log").stat().st_uid for k in (0, 1)} == {uid}   # it ran as the user
    finally:
        subprocess.run(["userdel", "-r", user], capture_output=True)


def test_slurm_a_controller_that_stops_answering_mid_job_is_not_the_jobs_end(cluster, cpu_env):
    """slurmctld stopped (SIGSTOP) for 25 s while a 2-node job trains, as a busy or restarting controller that
    answers no query for a while ("Socket timed out on send/recv operation"): the attached run asks again until it
    answers, and the job passes with its record right (it was read as ended, FAILED, at the first timed-out query)."""
    env = {**os.environ, **cluster}
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "train", "--backend", "slurm", "--runtime", "none",
                             "--venv", str(cpu_env["path"]), "--args", "--steps 60 --step-sleep 0.5"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while "RUNNING" not in subprocess.run(["squeue", "-h", "-o", "%T"], capture_output=True, text=True,
                                              env=env).stdout:
            assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
            time.sleep(0.5)
        time.sleep(5)   # into its training
        pid = slurmcluster.controller_pid()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(25)   # longer than scontrol's own timeout (MessageTimeout, 10 s) and many polls
        finally:
            os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:] + err
    s, job_dir = summary(subprocess.CompletedProcess([], 0, out, err))
    assert s["ok"] and s["scheduler_state"] == "COMPLETED" and s["smoke"]["steps"] == 60, s
    from fleetbox.run.records import Handle, JobState
    assert slurm_backend.SlurmBackend().job_state(Handle.load(Path(job_dir)))[0] == JobState.PASSED   # invoke jobs


def test_slurm_doctor_without_a_container_checks_the_env_on_every_node(cluster, cpu_env, tmp_path):
    """Passes with one env; fails naming node1 when node1's env was made from another lock (a copy of the env
    whose record says so: the test cluster's nodes share one file system, so {node} in --venv gives each its own)."""
    proc = invoke("doctor", "--backend", "slurm", "--runtime", "none", "--venv", str(cpu_env["path"]), "--nodes",
                  "2", "--quick", env=cluster, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    rep = doctor_report(proc)
    rows = {(r["node"], r["check"]): r for r in rep["rows"]}
    assert rep["ok"] and rep["runtime"] == "none"
    assert rows[("node1", "import paddle")]["value"] == "3.3.1" and rows[("node1", "same env")]["ok"]
    assert rows[("node0", "image")]["value"].startswith("env-sha256 ")
    assert rows[("node1", "route to master")]["value"] == "10.213.77.11 via fbn2e 10.213.77.12"
    envs = tmp_path / "envs"
    envs.mkdir()
    (envs / "node0").symlink_to(cpu_env["path"])
    subprocess.run(["cp", "-al", str(cpu_env["path"]), str(envs / "node1")], check=True)   # hard links: instant
    record = json.loads((envs / "node1" / "fleetbox-env.json").read_text())
    (envs / "node1" / "fleetbox-env.json").unlink()   # a new file: the original env's is left alone
    (envs / "node1" / "fleetbox-env.json").write_text(json.dumps({**record, "lock_sha256": "0" * 64}, indent=1))
    proc = invoke("doctor", "--backend", "slurm", "--runtime", "none", "--venv", str(envs / "{node}"), "--nodes",
                  "2", "--quick", env=cluster, timeout=900)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr
    rep = doctor_report(proc)
    assert failing(rep) == {("node1", "same env")}, proc.stdout[-3000:]
    row = next(r for r in rep["rows"] if (r["node"], r["check"]) == ("node1", "same env"))
    assert row["value"] == f"env-sha256:{'0' * 12} (node0: env-sha256:{record['lock_sha256'][:12]})", row
    assert "  ✗ node1 same env: node1 runs another env than node0" in proc.stdout


def test_slurm_doctor_with_podman_passes_every_check_and_sweeps(cluster, podman_image):
    proc = invoke("doctor", "--backend", "slurm", "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                  "--nodes", "2", env=cluster, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    rep = doctor_report(proc)
    rows = {(r["node"], r["check"]): r for r in rep["rows"]}
    assert rep["ok"] and failing(rep) == set() and rep["runtime"] == "podman"
    # each node in its own namespace, found by node.sh and measured in the container
    assert rows[("node1", "route to master")]["value"] == "10.213.77.11 via fbn2e 10.213.77.12"
    assert rows[("node0", "image")]["value"].startswith("id ") and rows[("node1", "same image")]["ok"]
    assert rep["facts"]["1"]["master"]["ok"] and rep["facts"]["0"]["joined"] == [1]
    assert rep["facts"]["1"]["limits"]["nofile"] == 20000   # the site's --runtime-args reached the container
    assert rep["sweep"]["world"] == 2 and all(r["wrong"] == 0 for r in rep["sweep"]["rows"])


def test_slurm_doctor_with_charliecloud_identifies_the_image_folder(cluster, charliecloud_image):
    proc = invoke("doctor", "--backend", "slurm", "--runtime", "charliecloud", "--image", charliecloud_image,
                  "--nodes", "2", "--quick", env=cluster, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    rep = doctor_report(proc)
    assert failing(rep) == set()
    values = {r["node"]: r["value"] for r in rep["rows"] if r["check"] == "image"}
    assert values["node0"].startswith("tree-sha256 ") and values["node0"] == values["node1"]


def test_slurm_doctor_names_a_tiny_shm_from_site_runtime_args_and_preflight_refuses(cluster, podman_image):
    args = ["--backend", "slurm", "--runtime", "podman", *LOCAL, "--runtime-args", PODMAN_ARGS + " --shm-size 64m",
            "--nodes", "2"]
    proc = invoke("doctor", *args, "--quick", env=cluster, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    rep = doctor_report(proc)
    assert failing(rep) == {("node0", "/dev/shm"), ("node1", "/dev/shm")}
    assert rep["facts"]["0"]["shm"]["total"] == 64 << 20
    assert "  ✗ node0 /dev/shm: shm is 64 MiB: the job would use --shm-size 8g; your --runtime-args override it" \
        in proc.stdout
    job_id = f"preflight-shm-{os.getpid()}"
    proc = slurm_train(cluster, *args[2:], "--preflight", "--job-id", job_id)
    assert proc.returncode == 1 and "the job was not started" in proc.stderr, proc.stdout[-3000:] + proc.stderr
    assert failing(doctor_report(proc)) == {("node0", "/dev/shm"), ("node1", "/dev/shm")}
    assert not (settings.runs_root() / job_id).exists()


def test_slurm_doctor_names_a_master_port_blocked_on_the_first_node(cluster, podman_image):
    from tests.integration.test_multihost import below_ephemeral
    port = str(below_ephemeral(29300, 2))
    rule = ["INPUT", "-p", "tcp", "--dport", port, "-j", "DROP"]
    subprocess.run(["nsenter", "--net=/run/netns/fbn1", "iptables", "-I", *rule], check=True)
    try:
        proc = invoke("doctor", "--backend", "slurm", "--runtime", "podman", "--runtime-args", PODMAN_ARGS, *LOCAL,
                      "--nodes", "2", "--port", port, "--quick", "--wait", "8", env=cluster, timeout=900)
    finally:
        subprocess.run(["nsenter", "--net=/run/netns/fbn1", "iptables", "-D", *rule], check=True)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    assert failing(doctor_report(proc)) == {("node1", "master port"), ("node0", "nodes joined")}, proc.stdout[-3000:]


def test_each_runtime_says_which_image_a_node_has(cpu_image, podman_image, tmp_path):
    """The lines node.sh runs for invoke doctor (runtimes.Runtime.identify), run by bash against real engines."""
    import hashlib
    import shlex

    from fleetbox.run.backends import runtimes

    def say(runtime, image):
        return subprocess.run(["bash", "-c", f"set -euo pipefail\nIMAGE_REF={shlex.quote(image)}\n"
                               f"{runtimes.get(runtime).identify(image)}"], capture_output=True, text=True)
    img = cpu_image["image"]
    tag = img.labels["io.fleetbox.inputs-sha256"]
    for runtime, ident in (("docker", img.id), ("podman", img.id.removeprefix("sha256:"))):
        p = say(runtime, "fleetbox/paddle:cpu")
        assert (p.returncode, p.stdout) == (0, f"fleetbox: image id {ident} {tag}\n"), p.stderr
        p = say(runtime, "fleetbox/paddle:no-such-tag")
        assert p.returncode == 3 and p.stdout.startswith("fleetbox: image missing "), p.stdout + p.stderr
    (tmp_path / "img.sqfs").write_bytes(b"x" * 1000)
    p = say("charliecloud", str(tmp_path / "img.sqfs"))
    assert p.stdout == f"fleetbox: image file-sha256 {hashlib.sha256(b'x' * 1000).hexdigest()}\n"
    (tmp_path / "tree" / "a").mkdir(parents=True)
    (tmp_path / "tree" / "a" / "b").write_text("hi")
    p = say("charliecloud", str(tmp_path / "tree"))
    assert p.stdout == f"fleetbox: image tree-sha256 {hashlib.sha256(b'a/b 2' + bytes([10])).hexdigest()}\n"
    assert say("apptainer", "docker://registry/x:1").stdout == "fleetbox: image ref docker://registry/x:1\n"
    p = say("apptainer", str(tmp_path / "none.sif"))
    assert p.returncode == 3 and p.stdout.startswith("fleetbox: image missing ")
