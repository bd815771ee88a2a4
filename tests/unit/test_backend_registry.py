"""A backend defined here, outside fleetbox, and registered the documented way (an entry point in the group
`fleetbox.backends`): `invoke train --backend echo` plans, describes and runs it, and `invoke --help train`
shows its own option, with no edit to any fleetbox module."""
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.run import spec as spec_mod
from fleetbox.run.backend import Backend, Option, Plan
from fleetbox.run.records import Handle, JobInfo, JobState
from fleetbox.run.result import JobResult, NodeResult
from fleetbox.run.spec import new_job_id
from tests.conftest import ROOT, invoke
from tests.unit.test_cli import one_line_error


@dataclass(frozen=True)
class EchoPlan(Plan):
    word: str = ""


class EchoBackend(Backend):
    """Every node is a local process that prints a word: the smallest backend that runs for real."""
    name = "echo"
    about = "a process per node that says a word (a test's backend)"
    plan_type = EchoPlan
    options = (Option("echo_word", "with --backend echo: the word every node says", "hello"),)

    def __init__(self, echo_word: str):   # no default here: the option's declared one must arrive
        self.word = echo_word

    def plan(self, spec) -> EchoPlan:
        job_id = spec.job_id or new_job_id()
        return EchoPlan(spec, job_id, settings.runs_root() / job_id, spec.port or 1, self.word)

    def argv(self, plan: EchoPlan, rank: int) -> list[str]:
        return [sys.executable, "-c", "import sys; print(sys.argv[1], sys.argv[2])", plan.word, f"node{rank}"]

    def describe(self, plan: EchoPlan) -> str:
        return "\n".join(" ".join(self.argv(plan, k)[3:]) for k in range(plan.spec.nodes))

    def submit(self, plan: EchoPlan, log=print) -> Handle:
        plan.dir.mkdir(parents=True, exist_ok=True)
        JobInfo(plan.job_id, self.name, plan.spec.variant.name, plan.spec.nodes, 1, plan.spec.image_ref).save(plan.dir)
        for k in range(plan.spec.nodes):
            with open(plan.dir / f"node{k}.log", "w") as out:
                subprocess.Popen(self.argv(plan, k), stdout=out, stderr=out).wait()
        handle = Handle(self.name, plan.job_id, str(plan.dir), plan.spec.nodes)
        handle.save()
        return handle

    def follow(self, handle: Handle, log=print, timeout=None) -> JobResult:
        nodes = [NodeResult(f"node{k}", k, "local", 0, "ok", str(Path(handle.dir) / f"node{k}.log"))
                 for k in range(handle.nodes)]
        for n in nodes:
            log(f"[{n.node}] {Path(n.logs).read_text().strip()}")
        r = JobResult(handle.job_id, self.name, True, nodes, dir=handle.dir)
        r.save()
        return r

    def status(self, handle: Handle) -> str:
        return "EXITED"

    def logs(self, handle: Handle, node: int) -> str:
        return (Path(handle.dir) / f"node{node}.log").read_text()

    def cancel(self, handle: Handle, log=print, asked: bool = True) -> None:
        pass   # every node has ended by the time submit returns

    def job_state(self, handle: Handle):
        return JobState.PASSED, 0, ""

    def show_logs(self, handle: Handle, node: int, follow=False, log=print, poll=0.5) -> None:
        log(self.logs(handle, node).rstrip("\n"))


def installed(tmp_path, package: str, entry_points: str, runs: str = "runs") -> dict:
    """The environment of a task that finds `entry_points` (lines `name = module:Class`) as an installed package
    declares them (a dist-info folder on PYTHONPATH), with a runs folder of the test's own."""
    dist = tmp_path / "site" / f"fleetbox_{package}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fleetbox-{package}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[fleetbox.backends]\n{entry_points}")
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)]), "FLEETBOX_RUNS": str(tmp_path / runs)}


def register_for_the_test(monkeypatch, cls) -> None:
    """Register `cls` here as a task does, and every registry as it was after the test."""
    from fleetbox.run import backends, records
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))
    for registry in (records.HANDLE_TYPES, backends.LAYOUTS, records.BACKEND_ENTRIES):
        monkeypatch.setitem(registry, cls.name, None)   # removed after the test (register() replaces it)
    backends.register(cls)


@pytest.fixture
def plugin(tmp_path):
    """The entry point, as an installed package would declare it."""
    return installed(tmp_path, "echo", f"echo = {__name__}:EchoBackend\n")


# A plugin's entry point is read when fleetbox is imported: these tests run invoke in a new process each time.
def test_a_backend_from_an_entry_point_is_offered_planned_described_and_run(plugin, tmp_path):
    helptext = " ".join(invoke("--help", "train", env=plugin).stdout.split())   # unwrapped
    assert "--echo-word=STRING with --backend echo: the word every node says" in helptext
    assert "or echo (a process per node that says a word (a test's backend))" in helptext
    assert "--echo-word" not in invoke("--help", "train").stdout   # without the plugin: not there

    dry = invoke("train", "--backend", "echo", "--echo-word", "hi there", "--nodes", "3", "--dry-run", env=plugin)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines() == ["hi there node0", "hi there node1", "hi there node2"]

    proc = invoke("train", "--backend", "echo", "--nodes", "2", "--job-id", "echo-1", env=plugin)
    assert proc.returncode == 0, proc.stderr
    assert "[node1] hello node1" in proc.stdout   # the option's default
    summary = json.loads((tmp_path / "runs" / "echo-1" / "summary.json").read_text())
    assert summary["ok"] and summary["backend"] == "echo"
    jobs = invoke("jobs", env=plugin)
    assert ["echo-1", "echo", "2", "PASSED"] in [ln.split()[:4] for ln in jobs.stdout.splitlines()]
    logs = invoke("logs", "echo-1", "--node", "1", env=plugin)
    assert logs.stdout.strip() == "hello node1", logs.stderr

    one_line_error(invoke("train", "--echo-word", "x", "--dry-run", env=plugin),
                   "--echo-word is for --backend echo")
    one_line_error(invoke("train", "--backend", "echo", "--partition", "gpu", "--dry-run", env=plugin),
                   "--partition is for --backend slurm")


def test_a_plugin_that_cannot_load_stops_no_task_and_is_named_when_chosen(tmp_path):
    env = installed(tmp_path, "broken", f"broken = no_such_module:Broken\necho = {__name__}:EchoBackend\n", "r")
    listed = invoke("--list", env=env)
    assert listed.returncode == 0 and "train" in listed.stdout, listed.stderr
    one_line_error(invoke("train", "--backend", "broken", "--dry-run", env=env),
                   "backend broken could not be loaded (no_such_module:Broken: ModuleNotFoundError")
    dry = invoke("train", "--backend", "echo", "--dry-run", "--nodes", "1", env=env)   # the good one still works
    assert dry.stdout.strip() == "hello node0", dry.stderr


def test_registering_takes_the_class_and_refuses_a_taken_flag(monkeypatch):
    from fleetbox.run import backends
    register_for_the_test(monkeypatch, EchoBackend)   # every registry as it was after the test
    assert backends.get("echo", **backends.configure("echo", {"echo_word": "x", "partition": None})).word == "x"
    with pytest.raises(UserError, match="unknown backend 'nope'; choose one of: docker, slurm, kubernetes, echo"):
        backends.lookup("nope")

    class Clash(EchoBackend):
        name = "clash"
        options = (Option("partition", "mine too"),)
    with pytest.raises(UserError, match="option --partition is slurm's already"):
        backends.register(Clash)

    class Job(EchoBackend):
        name = "job"
        options = (Option("nodes", "the job's own"),)
    with pytest.raises(UserError, match="option --nodes is the job's already"):
        backends.register(Job)


def test_a_backends_capabilities_and_doctoring_are_one_value_each_its_instance_holding_its_own():
    from fleetbox.run import backends
    from fleetbox.run.backend import Capabilities, Doctoring

    class Tries(EchoBackend):
        name = "tries"
        capabilities = Capabilities(timeout=True, restarts=True, attempts_are="tries")
    assert EchoBackend.capabilities == Capabilities() and EchoBackend.doctoring == Doctoring()   # its own
    assert Tries("x").capabilities.attempts_are == "tries"
    slurm = backends.get("slurm", runtime="apptainer")
    assert (slurm.doctoring.runtime, slurm.doctoring.label, slurm.doctoring.shm_settable) == \
        ("apptainer", "slurm/apptainer", False)
    assert backends.lookup("slurm").doctoring.runtime == ""   # the class's: before any runtime is chosen
    assert backends.capabilities("nope") == Capabilities() and backends.capabilities(None) == Capabilities()
    assert (backends.get("docker").capabilities.reads_here, backends.get("docker", hosts="tcp://a,tcp://b")
            .capabilities.reads_here, backends.lookup("docker").capabilities.reads_here) == (True, False, True)

    class Local(backends.lookup("slurm")):   # a site's Slurm: its own capabilities survive its runtime's doctoring
        capabilities = replace(backends.lookup("slurm").capabilities, restarts=False)
    site = Local("none", venv="/x")
    assert not site.capabilities.restarts and site.doctoring.label == "slurm/none"


def test_writing_a_backend_names_every_capability():
    import dataclasses

    from fleetbox.run.backend import Capabilities, Doctoring
    page = (ROOT / "docs" / "explanation" / "writing-a-backend.md").read_text()
    assert [f.name for c in (Capabilities, Doctoring) for f in dataclasses.fields(c) if f"`{f.name}`" not in page] == []


@pytest.mark.parametrize("taken", sorted(
    {o.name for o in (*spec_mod.JOB_OPTIONS, *spec_mod.TASK_OPTIONS)} | {"backend"}))
def test_a_backend_may_not_take_the_name_of_any_option_a_job_task_has(monkeypatch, taken):
    """The names were a list beside the tasks that drifted: --hang-timeout and --start-timeout were not on it."""
    from fleetbox.run import backends
    monkeypatch.setattr(backends, "BACKENDS", dict(backends.BACKENDS))

    class Taker(EchoBackend):
        name = "taker"
        options = (Option(taken, "mine"),)
    with pytest.raises(UserError, match=f"backend taker: option --{taken.replace('_', '-')} is the job's already"):
        backends.register(Taker)
    assert "taker" not in backends.BACKENDS
