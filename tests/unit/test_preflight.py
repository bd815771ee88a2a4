"""`invoke train --preflight` is a step of the job's own plan: the backend chosen once, the job planned once, the
quick doctor run on that plan (its nodes, port and image: Backend.probe_plan), and, when every check passes,
that very plan run. A backend defined here records every call; Docker's probe_plan on a fake engine reuses what
the job's plan settled, with no second network probe."""
import json
import types
from pathlib import Path

import pytest

from fleetbox import settings
from fleetbox.commands import doctor, train
from fleetbox.commands.checks import PROBE_MARK
from fleetbox.errors import Failed
from fleetbox.image import matrix
from fleetbox.run import backends
from fleetbox.run import spec as spec_mod
from fleetbox.run.backend import BACKENDS, Backend, Plan
from fleetbox.run.backends.docker import DockerBackend
from fleetbox.run.jobfolder import Layout
from fleetbox.run.records import Handle, JobState
from fleetbox.run.result import JobResult, NodeResult
from tests.unit.test_doctor import PORT, healthy_node


class Recording(Backend):
    """Every node a file; a probe's nodes print what the healthy two-node rig's probe prints on PORT. Records each
    call. An unpinned plan takes another port each time (PORT first), as Docker's and Slurm's do."""
    name = "recording"
    layout = Layout(output="node<k>.log")

    def __init__(self, broken: int | None = None, image_missing: bool = False, interrupt: bool = False):
        self.broken, self.image_missing, self.interrupt = broken, image_missing, interrupt
        self.calls: list[tuple] = []
        self.ports = iter(range(PORT, PORT + 1000, 50))

    def plan(self, spec) -> Plan:
        job_id = spec.job_id or spec_mod.new_job_id()
        plan = Plan(spec, job_id, settings.runs_root() / job_id, spec.port or next(self.ports))
        self.calls.append(("plan", plan))
        return plan

    def probe_plan(self, plan, spec) -> Plan:
        self.calls.append(("probe_plan", plan))
        return super().probe_plan(plan, spec)

    def engine_facts(self, spec):
        if not self.image_missing:
            return None
        return [{"host": "", "version": "27.0", "error": "", "image": None if k == 1 else ("sha256:" + "0" * 64, "")}
                for k in range(spec.nodes)]

    def describe(self, plan) -> str:
        return f"# {plan.job_id}"

    def submit(self, plan, log=print) -> Handle:
        self.calls.append(("submit", plan))
        plan.make_dir()
        for k in range(plan.spec.nodes):
            said = "trained"
            if plan.job_id.startswith("doctor-") and k != self.broken:
                said = PROBE_MARK + json.dumps(healthy_node(k))
            (plan.dir / f"node{k}.log").write_text(said + "\n")
        return Handle(self.name, plan.job_id, str(plan.dir), plan.spec.nodes)

    def follow(self, handle, log=print, timeout=None) -> JobResult:
        if self.interrupt and handle.job_id.startswith("doctor-"):
            raise KeyboardInterrupt
        nodes = [NodeResult(f"node{k}", k, "local", 0, "ok", str(Path(handle.dir) / f"node{k}.log"))
                 for k in range(handle.nodes)]
        return JobResult(handle.job_id, self.name, True, nodes, dir=handle.dir)

    def status(self, handle) -> str:
        return "EXITED"

    def logs(self, handle, node: int) -> str:
        return ""

    def cancel(self, handle, log=print, asked=True) -> None:
        self.calls.append(("cancel", handle.job_id))

    def job_state(self, handle):
        return JobState.PASSED, 0, ""

    def show_logs(self, handle, node: int, follow=False, log=print, poll=0.5) -> None:
        pass

    def of(self, kind: str) -> list:
        return [c[1] for c in self.calls if c[0] == kind]


@pytest.fixture
def chosen(monkeypatch, tmp_path):
    """The backend `backends.get` gives, and each name it was asked for."""
    monkeypatch.setitem(BACKENDS, Recording.name, Recording)
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    got = types.SimpleNamespace(backend=Recording(), asked=[])

    def get(name, **kw):
        got.asked.append(name)
        return got.backend
    monkeypatch.setattr(backends, "get", get)
    return got


def spec(**kw) -> spec_mod.JobSpec:
    return spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, **kw)


@pytest.mark.parametrize("job_id", ["", "J"])
def test_the_job_is_planned_once_and_runs_on_the_plan_the_probe_checked(chosen, job_id):
    lines: list[str] = []
    result = train.train(spec(job_id=job_id), backend="recording", preflight=True, log=lines.append)
    b = chosen.backend
    assert chosen.asked == ["recording"]   # one backend, for the job and its preflight
    planned = b.of("plan")
    job = [p for p in planned if not p.job_id.startswith("doctor-")]
    assert len(job) == 1 and (not job_id or job[0].job_id == job_id)
    assert b.of("probe_plan") == job   # the probe planned from the job's plan, and only from it
    probe, ran = b.of("submit")
    assert probe.job_id.startswith("doctor-") and probe.port == job[0].port
    assert ran is job[0] and result.job_id == job[0].job_id   # the very plan that was probed runs
    report = json.loads((settings.runs_root() / probe.job_id / "doctor.json").read_text())
    assert report["ok"] and report["port"] == ran.port and report["backend"] == "recording"
    assert lines[0] == "preflight: checking 2 node(s) before starting the job"
    assert any(ln.startswith(f"doctor {probe.job_id}: probing 2 node(s) in the job's own container (recording), "
                             f"master port {ran.port}") for ln in lines), lines
    assert any(ln.startswith("every check passed; report: ") for ln in lines), lines


def test_without_preflight_the_job_is_planned_once_and_nothing_probes(chosen):
    train.train(spec(job_id="J"), backend="recording", log=lambda m: None)
    b = chosen.backend
    assert chosen.asked == ["recording"] and [p.job_id for p in b.of("plan")] == ["J"]
    assert b.of("probe_plan") == [] and b.of("submit") == b.of("plan")


def test_a_failed_check_starts_nothing_and_names_the_report(chosen):
    chosen.backend.broken = 1   # node1's probe says nothing
    lines: list[str] = []
    with pytest.raises(Failed) as e:
        train.train(spec(job_id="J"), backend="recording", preflight=True, log=lines.append)
    probe = chosen.backend.of("submit")
    assert [p.job_id.startswith("doctor-") for p in probe] == [True]   # the probe ran, the job did not
    path = settings.runs_root() / probe[0].job_id / "doctor.json"
    assert str(e.value) == f"preflight: 1 check(s) failed; the job was not started (report: {path})"
    assert [(r["node"], r["check"]) for r in json.loads(path.read_text())["rows"] if not r["ok"]] \
        == [("node1", "probe")]
    assert not (settings.runs_root() / "J").exists()   # nothing of the job is left


def test_a_missing_image_is_a_failed_check_before_anything_is_planned(chosen):
    chosen.backend.image_missing = True
    with pytest.raises(Failed, match=r"^preflight: 1 check\(s\) failed; the job was not started \(report: "):
        train.train(spec(job_id="J"), backend="recording", preflight=True, log=lambda m: None)
    assert chosen.backend.calls == []   # no plan (whose missing image would be an error, not a row), no probe
    assert not (settings.runs_root() / "J").exists()


def test_ctrl_c_during_the_probe_cancels_it_and_starts_nothing(chosen):
    chosen.backend.interrupt = True
    with pytest.raises(KeyboardInterrupt):
        train.train(spec(job_id="J"), backend="recording", preflight=True, log=lambda m: None)
    b = chosen.backend
    probe = b.of("submit")
    assert len(probe) == 1 and probe[0].job_id.startswith("doctor-") and b.of("cancel") == [probe[0].job_id]
    assert not (settings.runs_root() / "J").exists()


def test_doctor_alone_plans_its_probe_as_a_job_of_its_own(chosen):
    """`invoke doctor`: no job to check, so no probe_plan; the probe planned from the spec as before."""
    report = doctor.run(spec(port=PORT), backend="recording", quick=True, log=lambda m: None)
    b = chosen.backend
    assert report["ok"] and chosen.asked == ["recording"] and b.of("probe_plan") == []
    assert [p.job_id.startswith("doctor-") for p in b.of("plan")] == [True]


# -- Docker: the probe on what the job's plan settled --

class _Throwaway:
    """The network probe's container on one host: its answer, then removed."""
    def __init__(self, host: str, ip: str):
        self.out = json.dumps({"iface": f"eth-{host[-1]}", "local": ip, "names": ["lo", f"eth-{host[-1]}"],
                               "memlock": 65536, "port_free": True}).encode()

    def wait(self, timeout=None):
        return {"StatusCode": 0}

    def logs(self, stdout=True, stderr=False):
        return self.out if stdout else b""

    def remove(self, force=False):
        pass


def test_docker_probes_on_the_jobs_settled_network_without_probing_it_again(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    hosts = ("tcp://10.213.77.11:2375", "tcp://10.213.77.12:2375")
    runs: list[str] = []

    def engine(host):
        ip = host.split("//")[1].split(":")[0]
        containers = types.SimpleNamespace(list=lambda **kw: [],
                                           run=lambda *a, **kw: runs.append(host) or _Throwaway(host, ip))
        image = types.SimpleNamespace(id="sha256:" + "a" * 64, labels={settings.LABEL_INPUTS: "b" * 64})
        return types.SimpleNamespace(containers=containers, images=types.SimpleNamespace(get=lambda ref: image))
    b = DockerBackend(hosts=hosts, connect=engine)
    job = b.plan(spec(job_id="J"))
    assert runs == list(hosts)   # the job's plan asked each host once
    probe_spec = spec(job_id="doctor-x", command=("python", "-c", "probe"), image_identity=True)
    probe = b.probe_plan(job, probe_spec)
    assert runs == list(hosts)   # ... and the probe asked none again
    assert probe.job_id == "doctor-x" and probe.port == job.port and probe.spec.port == job.port
    assert probe.dir == settings.runs_root() / "doctor-x"
    same = ("master_ip", "master_port", "node_ip", "iface", "port_range")
    assert [{k: v[k] for k in same} for v in probe.values] == [{k: v[k] for k in same} for v in job.values]
    assert [v["node_ip"] for v in probe.values] == ["10.213.77.11", "10.213.77.12"]
    assert probe.template.memlock == job.template.memlock == 65536 and probe.notes == job.notes
    assert (probe.image_id, probe.content_tag) == (job.image_id, job.content_tag)
    assert [n.host for n in probe.nodes] == list(hosts)
    assert all(n.labels[settings.LABEL_JOB] == "doctor-x" for n in probe.nodes)
    assert probe.nodes[0].command != job.nodes[0].command
