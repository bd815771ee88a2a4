"""A third backend, written here and registered the documented way (an entry point), with its own option
(--proc-steps), its own handle fields (each node's pid and start time), its own job folder layout (earlier tries
in tries/try<N>/, node folders n<k>/, each node's output in n<k>/out.log) and its own restarts: `invoke train`,
`jobs`, `logs`, `cancel` and `report` work on its jobs with no change to any fleetbox module. Each node is a real
local process that prints fleetbox's metrics lines."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.options import Option
from fleetbox.processes import process_start
from fleetbox.run.backend import CANCELLED, Backend, Capabilities, Doctoring, Plan, mark_cancelled
from fleetbox.run.jobfolder import Layout
from fleetbox.run.records import Handle, JobInfo, JobState
from fleetbox.run.result import JobResult, NodeResult
from fleetbox.run.spec import new_job_id
from tests.conftest import invoke
from tests.unit.test_backend_registry import installed, register_for_the_test
from tests.unit.test_cli import one_line_error

LAYOUT = Layout(earlier="tries/try<N>", first=1, node="n<k>", output="n<k>/out.log", entries={
    "tries": "proc: the earlier tries' node folders (try<N>/, from 1)", "n<k>": "proc: node k's folder"})

# What each node runs: its steps, a metrics line each in its worker log, a line each in its own output; with
# FAIL_FIRST, node 1's first try fails halfway. Its exit code goes to n<k>/exit.
NODE = r"""
import json, os, sys, time
steps, rank, try_, node_dir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
code = 0
with open(os.path.join(node_dir, "workerlog.0"), "a") as log, open(os.path.join(node_dir, "out.log"), "a") as out:
    for step in range(steps):
        if os.environ.get("FAIL_FIRST") and rank == 1 and try_ == 0 and step == steps // 2:
            print(f"node {rank} gives up at step {step}", file=out, flush=True)
            code = 3
            break
        rec = {"rank": rank, "step": step, "time": time.time(), "loss": 1.0 / (step + 1), "samples": 8, "seconds": 0.01}
        print("FLEETBOX-METRIC " + json.dumps(rec), file=log, flush=True)
        print(f"node {rank} step {step}", file=out, flush=True)
        time.sleep(float(os.environ.get("STEP_S", "0.01")))
open(os.path.join(node_dir, "exit"), "w").write(str(code))
sys.exit(code)
"""


@dataclass(frozen=True)
class ProcPlan(Plan):
    steps: int = 3


@dataclass
class ProcHandle(Handle):
    pids: list[int] = field(default_factory=list)     # each node's process ...
    starts: list[int] = field(default_factory=list)   # ... and its start time: a reused pid is not it


class ProcBackend(Backend):
    """Every node a local process; a failed try starts every node again, up to --max-restarts times."""
    name = "proc"
    about = "a local process per node (a test's backend)"
    plan_type = ProcPlan
    handle_type = ProcHandle
    layout = LAYOUT
    options = (Option("proc_steps", "with --backend proc: the steps each node runs", 3, int, low=1),
               Option("proc_cores", "with --backend proc: the cores each node has (default: as many as asked)", 0,
                      int, low=0))
    capabilities = Capabilities(restarts=True, attempts_are="tries")

    def __init__(self, proc_steps: int, proc_cores: int):
        self.steps, self.cores = proc_steps, proc_cores

    def settle(self, spec, procs_given: bool):   # its own option changes the job: a process per core
        if procs_given or not self.cores:
            return spec, ""
        return replace(spec, procs_per_node=self.cores), "--proc-cores"

    def check(self, spec) -> None:
        super().check(spec)
        if self.cores and spec.procs_per_node > self.cores:
            raise UserError(f"--procs-per-node {spec.procs_per_node}: a node has {self.cores} cores (--proc-cores)")

    def plan(self, spec) -> ProcPlan:
        job_id = spec.job_id or new_job_id()
        return ProcPlan(spec, job_id, settings.runs_root() / job_id, spec.port or 1, self.steps)

    def describe(self, plan: ProcPlan) -> str:
        return "\n".join(f"node {k}: {plan.steps} steps, {plan.spec.procs_per_node} process(es)"
                         for k in range(plan.spec.nodes))

    def _start(self, plan: ProcPlan, attempt: int) -> ProcHandle:
        pids = []
        for k in range(plan.spec.nodes):
            node_dir = plan.dir / f"n{k}"
            node_dir.mkdir(parents=True, exist_ok=True)
            p = subprocess.Popen([sys.executable, "-c", NODE, str(plan.steps), str(k), str(attempt), str(node_dir)],
                                 env={**os.environ, **plan.spec.env}, start_new_session=True,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            pids.append(p.pid)
        handle = ProcHandle(self.name, plan.job_id, str(plan.dir), plan.spec.nodes, pids,
                            [process_start(p) for p in pids])
        handle.save()
        return handle

    def submit(self, plan: ProcPlan, log=print) -> ProcHandle:
        self.plan_now = plan
        plan.make_dir()
        JobInfo(plan.job_id, self.name, plan.spec.variant.name, plan.spec.nodes, 1, plan.spec.image_ref,
                started=time.time(), first_started=time.time()).save(plan.dir)
        return self._start(plan, 0)

    def _wait(self, handle: ProcHandle) -> dict[int, int]:
        while not all(Path(handle.dir, f"n{k}", "exit").exists() for k in range(handle.nodes)):
            time.sleep(0.05)
        return {k: int(Path(handle.dir, f"n{k}", "exit").read_text()) for k in range(handle.nodes)}

    def follow(self, handle: ProcHandle, log=print, timeout=None) -> JobResult:
        plan, tries = self.plan_now, []
        while True:
            codes = self._wait(handle)
            ok = not any(codes.values())
            tries.append({"attempt": len(tries), "ok": ok, "ended": "passed" if ok else "failed", "logs": handle.dir})
            if ok or len(tries) > plan.spec.max_restarts:
                break
            earlier = plan.dir / LAYOUT.earlier.replace("<N>", str(len(tries)))   # try1/ holds the first
            earlier.mkdir(parents=True)
            tries[-1]["logs"] = str(earlier)
            for k in range(plan.spec.nodes):
                (plan.dir / f"n{k}").rename(earlier / f"n{k}")
            log(f"try {len(tries)} failed: starting every node again")
            handle = self._start(plan, len(tries))
        bad = next((k for k, c in codes.items() if c), None)
        nodes = [NodeResult(f"node{k}", k, "local", c, "ok" if not c else "FAILED", str(plan.dir / f"n{k}"))
                 for k, c in codes.items()]
        r = JobResult(handle.job_id, self.name, ok, nodes, bad, dir=handle.dir, attempts=tries,
                      attempts_are=self.capabilities.attempts_are)
        r.save()
        return r

    def status(self, handle) -> str:
        return self.job_state(handle)[0].value

    def logs(self, handle, node: int) -> str:
        return Path(handle.dir, f"n{node}", "out.log").read_text()

    def _running(self, handle: ProcHandle) -> list[int]:
        return [p for p, t in zip(handle.pids, handle.starts) if t and process_start(p) == t]

    def cancel(self, handle: ProcHandle, log=print, asked: bool = True) -> None:
        if asked:
            mark_cancelled(handle.dir)
        for pid in self._running(handle):
            os.killpg(pid, signal.SIGTERM)
            log(f"stopped pid {pid}")

    def job_state(self, handle: ProcHandle):
        d = Path(handle.dir)
        tries = len(list((d / "tries").glob("try*")))
        if (d / CANCELLED).exists():
            return JobState.CANCELLED, tries, ""
        if self._running(handle):
            return JobState.RUNNING, tries, ""
        summary = d / "summary.json"
        if summary.exists():
            return (JobState.PASSED if json.loads(summary.read_text())["ok"] else JobState.FAILED), tries, ""
        codes = [(d / f"n{k}" / "exit") for k in range(handle.nodes)]
        if all(c.exists() for c in codes):   # detached: nothing wrote a summary, the nodes' exits say
            return (JobState.PASSED if all(c.read_text() == "0" for c in codes) else JobState.FAILED), tries, ""
        return JobState.DIED, tries, "its processes ended without a word"

    def show_logs(self, handle, node: int, follow=False, log=print, poll=0.5) -> None:
        log(self.logs(handle, node).rstrip("\n"))


@pytest.fixture
def env(tmp_path):
    """The entry point as an installed package declares it, and a runs folder of the test's own (read when fleetbox
    is imported: these tests run invoke in a new process each time)."""
    return installed(tmp_path, "proc", f"proc = {__name__}:ProcBackend\n")


def _rows(env) -> dict:
    proc = invoke("jobs", env=env)
    assert proc.returncode == 0, proc.stderr
    return {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines()[1:]}


def test_a_third_backend_runs_through_train_jobs_logs_report_with_its_own_handle_and_folder(env, tmp_path,
                                                                                          monkeypatch):
    from fleetbox.run import records
    runs = tmp_path / "runs"
    proc = invoke("train", "--backend", "proc", "--nodes", "2", "--proc-steps", "6", "--max-restarts", "1",
                      "--env", "FAIL_FIRST=1", "--job-id", "p-1", env=env)
    assert proc.returncode == 0, proc.stderr
    job = runs / "p-1"
    handle = json.loads((job / "handle.json").read_text())
    assert handle["backend"] == "proc" and len(handle["pids"]) == 2 and all(handle["starts"])   # its own fields
    assert sorted(p.relative_to(job).as_posix() for p in job.glob("tries/*/*")) == ["tries/try1/n0", "tries/try1/n1"]
    register_for_the_test(monkeypatch, ProcBackend)   # here too, as the tasks have it
    assert records.undescribed(job) == []   # what it left is what its layout says, and fleetbox's own records

    assert _rows(env)["p-1"][1:5] == ["proc", "2", "PASSED", "1"]   # one earlier try
    logs = invoke("logs", "p-1", "--node", "1", env=env)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == [f"node 1 step {s}" for s in range(6)]   # the last try's, from n1/out.log

    metrics = [json.loads(ln) for ln in (job / "metrics.jsonl").read_text().splitlines()]
    # the first try: node 0 ran its 6 steps, node 1 gave up at step 3; the second: 6 each
    assert sorted((m["attempt"], m["node"], m["step"]) for m in metrics) == sorted(
        [(0, 0, s) for s in range(6)] + [(0, 1, s) for s in range(3)] + [(1, k, s) for k in (0, 1) for s in range(6)])
    (job / "report.md").unlink()
    rep = invoke("report", "p-1", env=env)
    assert rep.returncode == 0, rep.stderr
    md = (job / "report.md").read_text().splitlines()
    assert {"- backend: proc, 2 node(s) x 1 process(es)",
            "- final loss: rank 0 0.1667 (step 5), rank 1 0.1667 (step 5)",
            "- steps: rank 0 12 (last 5), rank 1 9 (last 5)",   # every try's: rank 1 gave up at step 3 in the first
            "- attempt 0: failed", "- attempt 1: passed"} <= set(md), md


def test_a_detached_job_of_a_third_backend_is_seen_running_and_cancelled(env, tmp_path):
    runs = tmp_path / "runs"
    env = {**env, "STEP_S": "0.2"}
    proc = invoke("train", "--backend", "proc", "--nodes", "2", "--proc-steps", "600", "--job-id", "p-2",
                      "--detach", env=env)
    assert proc.returncode == 0, proc.stderr
    pids = json.loads((runs / "p-2" / "handle.json").read_text())["pids"]
    try:
        assert _rows(env)["p-2"][1:4] == ["proc", "2", "RUNNING"]
        stop = invoke("cancel", "p-2", env=env)
        assert stop.returncode == 0, stop.stderr
        assert [ln for ln in stop.stdout.splitlines() if ln.startswith("stopped pid")] == [
            f"stopped pid {p}" for p in pids]
        assert _rows(env)["p-2"][1:4] == ["proc", "2", "CANCELLED"]
        deadline = time.monotonic() + 10
        while any(process_start(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(process_start(p) for p in pids)   # both nodes' processes are gone
    finally:
        for p in pids:
            try:
                os.killpg(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    shutil.rmtree(runs)


def test_a_third_backends_own_option_shapes_the_job_and_is_refused_elsewhere(env):
    """--proc-cores is the proc backend's alone, yet it changes the job (its processes a node), as Docker's
    --devices does: the backend settles and checks the job, with no change to any fleetbox module."""
    def described(*args):
        proc = invoke("train", "--backend", "proc", "--nodes", "2", *args, "--dry-run", env=env)
        assert proc.returncode == 0, proc.stderr
        return [ln for ln in proc.stdout.splitlines() if ln.startswith("node ")]
    assert described("--proc-cores", "4") == ["node 0: 3 steps, 4 process(es)", "node 1: 3 steps, 4 process(es)"]
    assert described("--proc-cores", "4", "--procs-per-node", "2")[0] == "node 0: 3 steps, 2 process(es)"
    assert described()[0] == "node 0: 3 steps, 1 process(es)"
    one_line_error(invoke("train", "--backend", "proc", "--proc-cores", "2", "--procs-per-node", "3", "--dry-run",
                          env=env), "--procs-per-node 3: a node has 2 cores (--proc-cores)")
    one_line_error(invoke("train", "--proc-cores", "2", "--dry-run", env=env), "--proc-cores is for --backend proc")
    one_line_error(invoke("train", "--backend", "proc", "--hosts", "tcp://a:1", "--dry-run", env=env),
                   "--hosts is for --backend docker")


def test_a_third_backends_scheduler_words_its_own_view_of_the_job(tmp_path):
    """JobResult names no scheduler itself: a backend with one gives its view of the job (after the state in the
    table) and how it saw a job end that no node failed, in its own words; a summary read back keeps them."""
    r = JobResult("q-1", "proc", False, [NodeResult("node0", 0, "local", None, "?", "x")], dir=str(tmp_path),
                  scheduler="queue ticket 42, EVICTED", end_state="EVICTED by the queue")
    assert r.table().splitlines()[0] == "job q-1: FAILED (queue ticket 42, EVICTED)"
    assert r.failure() == f"job ended EVICTED by the queue (logs: {tmp_path})"
    r.save()
    back = JobResult.from_summary(json.loads((tmp_path / "summary.json").read_text()))
    assert (back.scheduler, back.reason()) == ("queue ticket 42, EVICTED", "job ended EVICTED by the queue")
    bare = JobResult("q-2", "proc", False, [], dir=str(tmp_path))
    assert bare.table().splitlines()[0] == "job q-2: FAILED" and bare.reason() == "job ended without a result"


def test_doctor_tells_a_node_that_said_nothing_of_its_image_where_its_backend_keeps_what_it_said(monkeypatch,
                                                                                                  tmp_path):
    """A backend whose nodes report their image names where to look when one said nothing (its capabilities);
    doctor words none of its own. Slurm's words stay Slurm's."""
    from fleetbox.commands import checks, doctor
    from fleetbox.run import backends
    from tests.unit.test_preflight import PORT, Recording, spec

    class Reporting(Recording):   # its probe's nodes print no `fleetbox: image` line
        name = "reporting"
        doctoring = Doctoring(reports_image=True, unreported_fix="see what the queue kept (queue/<k>.err)")
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    b = Reporting()
    report = doctor.check(b, spec(port=PORT), b.plan, quick=True, log=lambda m: None)
    assert [(r["node"], r["fix"]) for r in report["rows"] if r["check"] == "image"] == [
        ("node0", "see what the queue kept (queue/<k>.err)"), ("node1", "see what the queue kept (queue/<k>.err)")]
    slurm = backends.get("slurm").doctoring.unreported_fix
    assert checks.reported_image_rows({0: ""}, 1, "img", slurm)[0].fix == \
        "node.sh did not run on this node: see the batch output (slurm-<id>.out)"
    assert checks.reported_image_rows({0: ""}, 1, "img")[0].fix == "the node's script did not run: see its output"


def test_doctor_tells_a_container_without_the_driver_what_its_backend_says_gives_it():
    """What gives a node's containers the NVIDIA driver is the backend's to say (Slurm's: its runtime's, from
    runtimes.py): doctor keys no fix by a runtime's name, so one that names a runtime but no fix gets none of it."""
    from fleetbox.commands import checks, doctor
    from fleetbox.image import matrix
    from fleetbox.run import backends
    from fleetbox.run.spec import JobSpec
    from tests.unit.test_backend_registry import EchoBackend
    from tests.unit.test_doctor import PORT, gpu_facts

    class Gpus(EchoBackend):
        name = "gpus"
        doctoring = Doctoring(runtime="podman", no_driver_fix="load the site's GPU module (module load nv)")

    class Silent(EchoBackend):
        name = "silent"
        doctoring = Doctoring(runtime="podman")
    job = JobSpec(variant=matrix.load().get("cu126"), nodes=2)

    def fix(b) -> str:
        rows = checks.evaluate(gpu_facts({"missing": "nvidia-smi"}), doctor.expect(job, PORT, b), "10.213.77.11")
        return next(r.fix for r in rows if r.node == "node0" and r.check == "GPU driver")
    said = "the container sees no NVIDIA driver: "
    assert fix(Gpus("x")) == said + "load the site's GPU module (module load nv)"
    assert fix(Silent("x")) == said + "check how the runtime gives a container the node's driver"
    assert fix(backends.get("slurm", runtime="pyxis")) == said + (
        "enroot's NVIDIA hook must run: /etc/enroot/hooks.d/98-nvidia.sh and libnvidia-container "
        "(nvidia-container-cli) on the node")
    assert fix(backends.get("docker")) == said + (
        "install the NVIDIA Container Toolkit on the node (`nvidia-ctk runtime configure --runtime=docker`)")


def test_a_job_whose_record_cannot_be_read_is_told_how_each_backend_stops_its_leftovers(monkeypatch, tmp_path):
    """Its backend is unknown, so every backend says its own way (Backend.leftovers): fleetbox's own words name
    none; Slurm's `scancel` is Slurm's, and a third backend's is added after it."""
    from fleetbox.commands import jobs
    from fleetbox.run import backends
    from tests.unit.test_backend_registry import EchoBackend
    k8s = backends.lookup("kubernetes").leftovers   # fleetbox's own third backend says its own too
    assert k8s("j-1").startswith("Kubernetes objects: `kubectl delete ") and \
        "-l io.fleetbox.job=j-1,io.fleetbox.owner=" in k8s("j-1")
    assert jobs._leftovers("j-1") == ("`invoke clean --job j-1 --force` removes its containers "
                                      f"(a Slurm job: `scancel --user=$USER --name=fleetbox-j-1`; {k8s('j-1')})")

    class Queued(EchoBackend):
        name = "queued"
        options = ()

        @classmethod
        def leftovers(cls, job_id: str) -> str:
            return f"a queued job: `qdel {job_id}`"
    register_for_the_test(monkeypatch, Queued)
    register_for_the_test(monkeypatch, EchoBackend)   # says nothing: `invoke clean` is enough for it
    assert jobs.damaged(tmp_path / "j-2", "not JSON")["note"] == (
        "not JSON; `invoke clean --job j-2 --force` removes its containers "
        f"(a Slurm job: `scancel --user=$USER --name=fleetbox-j-2`; {k8s('j-2')}; a queued job: `qdel j-2`)")
