"""The Kubernetes backend's Indexed Job run for real on this machine: `invoke train --backend kubernetes
--k8s-client podman` plays the Job lowered to one Pod per index (pods_for_podman) with `podman kube play`
(Podman 4.3), with the same image, helpers (ConfigMaps) and checkpoint claim (a Podman volume of the claim's name)
as a cluster would get. Every name the tests make starts with fleetbox-k8s- and is removed after."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from fleetbox.run import metrics, records
from fleetbox.run.backends.kube_pods import owner_label
from fleetbox.run.backends.podman_play import pods_for_podman
from tests.conftest import ROOT, ctrl_c_reaches_it
from tests.integration.test_hpc import LOCAL, in_podman
from tests.unit.test_cli import one_line_error

needs = [t for t in ("podman", "catatonit") if not shutil.which(t)]   # catatonit: the pods' pause image
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),   # under CI a skip fails the run
              pytest.mark.skipif(bool(needs), reason=f"missing {needs}: run scripts/setup-host.sh")]

# This machine refuses podman's default nofile/nproc limits (cf. test_hpc's PODMAN_ARGS): a site setting, given
# as a site gives it to `podman kube play`, in containers.conf
CONTAINERS_CONF = '[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n'


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def podman_cpu(cpu_image, tmp_path_factory):
    """The cpu image in Podman's storage (test_hpc's, once in the run), and the site's containers.conf."""
    in_podman(cpu_image)
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return {"CONTAINERS_CONF": str(conf)}


@pytest.fixture
def job():
    """A job id of this test's own, and afterwards nothing of it left: pods, volumes (its claim's), network."""
    name = f"fleetbox-k8s-{uuid.uuid4().hex[:8]}"
    yield name
    pods = podman("pod", "ps", "-q", "--filter", f"label=io.fleetbox.job={name}").split()
    if pods:
        subprocess.run(["podman", "pod", "rm", "-f", "-t", "0", *pods], capture_output=True)
    for v in podman("volume", "ls", "-q", "--filter", f"name={name}").split():
        if v.startswith(name):
            subprocess.run(["podman", "volume", "rm", "-f", v], capture_output=True)
    subprocess.run(["podman", "network", "rm", "-f", name], capture_output=True)


def train(job: str, *args: str, nodes: int = 2) -> list[str]:
    return [sys.executable, "-m", "invoke", "train", "--backend", "kubernetes", "--k8s-client", "podman",
            "--nodes", str(nodes), *LOCAL, "--job-id", job, "--k8s-checkpoint-claim", f"{job}-ckpt",
            "--k8s-checkpoint-size", "1Gi", *args]


def assert_nothing_left(job: str) -> None:
    """No pod, container or network of the job; of its volumes, the claim's alone (its checkpoints)."""
    assert podman("pod", "ps", "-q", "--filter", f"label=io.fleetbox.job={job}").split() == []
    assert podman("ps", "-aq", "--filter", f"label=io.fleetbox.job={job}").split() == []
    assert [v for v in podman("volume", "ls", "-q").split() if v.startswith(job)] == [f"{job}-ckpt"]
    assert job not in podman("network", "ls", "--format", "{{.Name}}").split()


def test_two_ranks_pass_under_podman_kube_play_with_the_jobs_own_pod_template(podman_cpu, job, tmp_path):
    """...and another owner's job of the same id (another runs folder: another user's, or this user's other
    project) is refused while it runs, nothing of it touched."""
    p = subprocess.Popen(train(job, "--args", "--steps 20 --checkpoint-every 10 --step-sleep 0.2"), cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **podman_cpu, "PYTHONUNBUFFERED": "1"})
    try:
        said = []
        while not any(ln.startswith(f"played {job} ") for ln in said):
            said.append(p.stdout.readline())
            assert said[-1], "".join(said)
        theirs = subprocess.run(train(job), cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={**os.environ, **podman_cpu, "FLEETBOX_RUNS": str(tmp_path / "runs")})
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    one_line_error(theirs, f"job id {job} is taken on this machine's Podman: pod/{job}-0, pod/{job}-1, network/{job} "
                                  f"are {owner_label(records.owner())}'s",
                   "nothing of theirs was touched")
    assert p.returncode == 0, "".join(said) + out
    d = ROOT / "runs" / job
    # what Podman played is the Job's pod template, lowered (pods_for_podman) at the addresses it was given
    job_obj, svc = (next(m for m in yaml.safe_load_all((d / "manifests.yaml").read_text()) if m["kind"] == kind)
                    for kind in ("Job", "Service"))
    played = [m for m in yaml.safe_load_all((d / "played.yaml").read_text()) if m["kind"] == "Pod"]
    ips = [a["ip"] for a in played[0]["spec"]["hostAliases"]]
    assert played == pods_for_podman(job_obj, svc, ips) and len(set(ips)) == 2
    # both ranks trained, each in its own node folder, and the loss fell
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert {(r["rank"], r["node"]) for r in recs} == {(0, 0), (1, 1)}
    for rank in (0, 1):
        steps = [r["step"] for r in recs if r["rank"] == rank]
        assert sorted(steps) == list(range(steps[0], steps[0] + 20)), steps
    assert metrics.read(d) and recs[-1]["loss"] < recs[0]["loss"]
    for k in (0, 1):
        assert f"fleetbox: node {k} on {job}-{k}: " in (d / f"node{k}" / "container.log").read_text()
    # the checkpoint folder is the claim's volume: the job's checkpoints, step 10 and 20, are on it
    mount = Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", f"{job}-ckpt").strip())
    assert {"step-00000010", "step-00000020"} <= {p.name for p in mount.iterdir()}
    assert_nothing_left(job)


def test_a_killed_pod_fails_the_job_named_and_every_node_is_stopped(podman_cpu, job):
    p = subprocess.Popen(train(job, "--args", "--steps 3000 --step-sleep 0.05 --checkpoint-every 1000"),
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **podman_cpu})
    try:
        # mid-run: node 1's rank has written metrics lines (its logs' emptyDir is a volume of this machine's)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            mount = podman("volume", "inspect", "--format", "{{.Mountpoint}}", f"{job}-1-logs").strip()
            log = Path(mount, "workerlog.0") if mount else None
            if log and log.exists() and sum(metrics.parse(ln) is not None for ln in log.read_text().splitlines()) > 3:
                break
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("node 1 trained no steps in 120 s")
        subprocess.run(["podman", "kill", f"{job}-1-paddle"], check=True, capture_output=True)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0, out
    assert "node1 (rank 1) exited with exit code 137" in out, out[-3000:]
    summary = json.loads((ROOT / "runs" / job / "summary.json").read_text())
    assert summary["culprit"] == 1 and not summary["ok"]
    # node 0 stopped by fleetbox, or ended by itself (its peer gone) before it was seen to: never the one named
    assert [n["state"] for n in summary["nodes"]] in (["stopped", "FAILED"], ["aborted", "FAILED"])
    assert_nothing_left(job)


def test_ctrl_c_cancels_the_job_and_leaves_nothing_but_the_claim(podman_cpu, job):
    # unbuffered, and Ctrl-C only once the client has said it played the pods: an interrupt inside a write to a
    # buffered stdout drops what was buffered (the client's own lines, which this test reads)
    p = subprocess.Popen(train(job, "--args", "--steps 3000 --step-sleep 0.05"), cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**os.environ, **podman_cpu, "PYTHONUNBUFFERED": "1"},
                         preexec_fn=ctrl_c_reaches_it)
    said = []
    try:
        while not any(ln.startswith(f"played {job} ") for ln in said):   # it ends in one, or the output ends
            said.append(p.stdout.readline())
            assert said[-1], "".join(said)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:   # both nodes' containers run
            running = podman("ps", "-q", "--filter", f"label=io.fleetbox.job={job}", "--filter", "status=running")
            if len(running.split()) == 2:
                break
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.5)
        else:
            pytest.fail("the job's containers never ran")
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=120)
        out = "".join(said) + out
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and f"interrupted: cancelling {job}" in out, out[-3000:]
    assert (ROOT / "runs" / job / "CANCELLED").exists()
    assert_nothing_left(job)


def test_a_hung_rank_is_named_from_its_pods_stacks_and_the_job_goes_on_from_the_claim_without_its_node(
        podman_cpu, job):
    """Hang detection in the command that follows the job (the ranks' progress and stacks read and asked for
    through `podman exec`, as `kubectl exec` does on a cluster), then fleetbox's own restart with --min-nodes: the
    same objects for 2 nodes of 3 played again, FLEETBOX_ATTEMPT 1, resuming from the claim. The deadline leaves
    the stacks 20 s before Gloo's own 30 s timeout ends the waiting ranks: at 20 s, `podman exec` under load once
    reached rank 0 after that, and it gave no stack (the record could not tell which rank was stuck). (The whole
    job restarting on the same nodes: the next test.)"""
    proc = subprocess.run(train(job, "--hang-timeout", "10", "--max-restarts", "1", "--min-nodes", "2", "--args",
                                "--steps 60 --checkpoint-every 10 --step-sleep 0.05 --hang-rank 1 --hang-step 30 "
                                "--hang-attempt 0", nodes=3),
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **podman_cpu}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = ROOT / "runs" / job
    s = json.loads((d / "summary.json").read_text())
    assert [(a["state"], a["nodes"]) for a in s["attempts"]] == [("HUNG", 3), ("PASSED", 2)], s["attempts"]
    assert s["smoke"]["resumed_from"] == 30 and s["smoke"]["whole_run"] and s["smoke"]["params_identical"]
    assert s["smoke"]["world"] == 2 and len(s["nodes"]) == 2
    assert "going on without node1 from the newest checkpoint, on 2 nodes (restart 1 of 1)" in proc.stdout
    first = json.loads((d / "attempt0" / "summary.json").read_text())
    h = first["hang"]
    assert (h["kind"], h["ranks"], h["decided"], first["culprit"]) == ("hang", [1], True, 1), h
    assert "in `load_batch_that_never_returns` (smoke.py:" in h["text"], h["text"]
    assert [n["state"] for n in first["nodes"]] == ["stopped", "hung", "stopped"]
    # every rank's stacks, taken in its pod while it was stuck
    assert "in load_batch_that_never_returns" in (d / "hang-0" / "rank1.txt").read_text()
    assert "in fused_allreduce_gradients" in (d / "hang-0" / "rank0.txt").read_text()
    # the restart ran the same objects, but for its attempt
    assert "FLEETBOX_ATTEMPT=1" in (d / "manifests.yaml").read_text()
    assert_nothing_left(job)


def test_gloos_own_timeout_holds_the_waiting_pod_and_the_stuck_rank_is_blamed(podman_cpu, job):
    """The default deadlines (10 min): Gloo's own 30 s timeout ends rank 0, which waits for stuck rank 1. Rank 0's
    pod is held, still running (hang.hold_after_timeout in the node script), until the hang watch has rank 1's
    stacks: rank 1 is named, never rank 0; the job restarts and passes. With --resume never, from its own
    checkpoint: an earlier run's newer one on the claim was set aside by the first pod (Podman 4.3 mounts the
    claim's volume whole: its root is the job's folder)."""
    subprocess.run(["podman", "volume", "create", f"{job}-ckpt"], check=True, capture_output=True)
    claim = Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", f"{job}-ckpt").strip())
    (claim / "step-00000050").mkdir()
    (claim / "step-00000050" / "COMPLETE").touch()
    proc = subprocess.run(train(job, "--max-restarts", "1", "--resume", "never", "--args",
                                "--steps 60 --checkpoint-every 10 --hang-rank 1 --hang-step 30 --hang-attempt 0"),
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **podman_cpu}, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "timed out waiting in a collective (its own timeout): a peer is stuck" in proc.stdout, proc.stdout[-3000:]
    d = ROOT / "runs" / job
    s = json.loads((d / "summary.json").read_text())
    assert [a["state"] for a in s["attempts"]] == ["HUNG", "PASSED"], s["attempts"]
    first = json.loads((d / "attempt0" / "summary.json").read_text())
    h = first["hang"]
    assert (h["kind"], h["ranks"], h["timed_out_nodes"], first["culprit"]) == ("collective", [1], [0], 1), h
    assert "in `load_batch_that_never_returns` (smoke.py:" in h["text"], h["text"]
    assert "ended waiting in a collective; holding the node" in (d / "attempt0" / "node0" / "container.log").read_text()
    assert s["smoke"]["resumed_from"] == 30 and s["smoke"]["whole_run"], s["smoke"]
    (aside,) = claim.glob("before-*")   # inside the folder: the claim's is a mount point in the pod
    assert [p.name for p in aside.iterdir()] == ["step-00000050"]
    assert "--resume never: moved the earlier checkpoints to /fleetbox/checkpoints/before-" in (
        d / "attempt0" / "node0" / "container.log").read_text()
    assert_nothing_left(job)
