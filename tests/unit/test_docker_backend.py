"""The Docker backend against a fake engine, without Docker (cog's pattern: a fake of the SDK surface the
backend uses, each container's life scripted). Every way a job can end is checked in milliseconds: all
pass, one node fails, a peer aborts first, the engine fails, Ctrl-C / SIGTERM, a refused create, a timeout,
an OOM kill; that the engine gets exactly what `describe()` shows; and status/logs/cancel from another
process. Every path must leave no container behind.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import shlex
import signal
import subprocess
import tarfile
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest
import requests

from fleetbox import files, settings
from fleetbox.errors import Failed, UserError
from fleetbox.image import matrix
from fleetbox.run import records
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import docker as docker_backend
from fleetbox.run.backends.docker import DockerBackend
from fleetbox.run.records import Handle, JobState

JOB = "train-fake-0001"
IMAGE = "fleetbox/paddle:cpu"


# -- the fake engine --

@dataclass
class Life:
    """How one node's container behaves once started."""
    code: int | None = None               # its exit code; None: runs until stopped
    after: int = 1                        # ... reached on this many-th reload while running
    oom: bool = False                     # State.OOMKilled when it exits by itself
    stop_code: int = 137                  # exit code when stopped (137: SIGKILL; Paddle's launcher says 15)
    error: BaseException | None = None    # reload raises this ...
    errors: int = 1                       # ... this many times
    kill_with: int | None = None          # the first reload sends this signal to this process (a `kill`, a hang-up)
    start_error: BaseException | None = None   # start() raises this (e.g. Ctrl-C while the job starts)
    finished: str = ""                    # FinishedAt as the engine writes it (default: a ticking clock)
    stop_signal: int | None = None        # stop() sends this signal to this process (a second Ctrl-C)
    output: str = ""                      # what it prints (default: a hello and a bye)


_ticks = iter(range(10**9))


def _clock() -> str:
    """The engine's finish times: later calls, later times (RFC 3339 with nanoseconds, as Docker writes)."""
    n = next(_ticks)
    return f"2025-01-01T00:{n // 60 % 60:02d}:{n % 60:02d}.000000000Z"


class FakeContainer:
    def __init__(self, image, command, kwargs, life: Life):
        self.image, self.command, self.kwargs, self.life = image, command, kwargs, life
        self.name = kwargs["name"]
        self.labels = dict(kwargs["labels"])
        self.rank = int(self.labels[settings.LABEL_RANK])
        self.output = (life.output or f"hello from node{self.rank}\nbye from node{self.rank}\n").encode()
        self.status = "created"
        self.attrs = {"State": {"ExitCode": 0, "FinishedAt": "0001-01-01T00:00:00Z", "OOMKilled": False}}
        self.started = self.stopped = self.removed = False
        self.removes: list[bool] = []     # the `force` of every remove call
        self.running_reloads = 0

    def start(self):
        assert self.status == "created" and not self.removed, f"{self.name} started twice or after removal"
        if self.life.start_error is not None:
            raise self.life.start_error
        self.started, self.status = True, "running"

    def _exit(self, code: int, oom: bool = False):
        self.status = "exited"
        self.attrs["State"].update(ExitCode=code, OOMKilled=oom, FinishedAt=self.life.finished or _clock())

    def reload(self):
        if self.removed:
            raise docker.errors.NotFound(f"No such container: {self.name}")
        if self.life.kill_with is not None:
            sig, self.life.kill_with = self.life.kill_with, None
            os.kill(os.getpid(), sig)
        if self.life.error is not None and self.life.errors > 0:
            self.life.errors -= 1
            raise self.life.error
        if self.status == "running" and self.life.code is not None:
            self.running_reloads += 1
            if self.running_reloads >= self.life.after:
                self._exit(self.life.code, self.life.oom)

    def stop(self, timeout=None):
        if self.life.stop_signal is not None:
            os.kill(os.getpid(), self.life.stop_signal)
        if self.status == "running":
            self.stopped = True
            self._exit(self.life.stop_code)

    def remove(self, force=False):
        self.removes.append(force)
        if self.removed:
            raise docker.errors.NotFound(f"No such container: {self.name}")
        if self.status == "running" and not force:
            raise docker.errors.APIError("Conflict", explanation="cannot remove a running container")
        self.removed = True

    def logs(self, stream=False, follow=False):
        if stream:
            return iter(self.output.splitlines(keepends=True))
        return self.output


class _Images:
    def __init__(self, refs):
        self.refs = set(refs)

    def get(self, ref):
        if ref not in self.refs:
            raise docker.errors.ImageNotFound(f"No such image: {ref}")
        return types.SimpleNamespace(id="sha256:" + "0" * 64, labels={"io.fleetbox.inputs-sha256": "1" * 64})


class _Containers:
    def __init__(self, engine: "FakeEngine"):
        self.engine = engine

    def create(self, image, command, **kwargs):
        rank = int(kwargs["labels"][settings.LABEL_RANK])
        refusal = self.engine.refuse.get(rank)
        if isinstance(refusal, list):   # one per create: None, made
            refusal = refusal.pop(0)
        if refusal is not None:
            raise refusal
        life = self.engine.lives.get(rank, Life(code=0))
        if isinstance(life, list):   # one Life per attempt of a restarted job
            life = life.pop(0)
        c = FakeContainer(image, command, kwargs, life)
        with self.engine.lock:   # the backend creates from several threads
            self.engine.made[rank] = c
            self.engine.history.append(c)
        return c

    def list(self, all=False, filters=None, ignore_removed=False):
        want = (filters or {}).get("label") or []   # one label or a list, every one of them (Docker's AND)
        pairs = [w.partition("=") for w in ([want] if isinstance(want, str) else want)]
        found = [c for c in self.engine.made.values() if not c.removed and (all or c.status == "running")
                 and not any(key not in c.labels or value and c.labels[key] != value for key, _, value in pairs)]
        # docker-py lists ids, then inspects each: one removed in between raises unless ignore_removed
        for c in self.engine.vanish_while_listing:
            c.removed = True
            if not ignore_removed:
                raise docker.errors.NotFound(f"No such container: {c.name}")
        return [c for c in found if not c.removed]

    def run(self, *args, **kwargs):
        raise AssertionError("the network probe runs only for --hosts jobs")


class FakeEngine:
    """The Docker SDK client as the backend uses it, with each node's container scripted by a Life."""

    def __init__(self, lives: dict[int, Life] | None = None, images=(IMAGE,), refuse=None):
        self.lives = lives or {}
        self.refuse = refuse or {}        # rank -> the exception its create raises (a list: one per create)
        self.images = _Images(images)
        self.containers = _Containers(self)
        self.made: dict[int, FakeContainer] = {}
        self.history: list[FakeContainer] = []   # every container ever made (restarts make new ones)
        self.lock = threading.Lock()
        self.vanish_while_listing: list[FakeContainer] = []
        self.volumes = type("Volumes", (), {"list": lambda self, filters=None: []})()

    def connect(self, host):
        assert host is None, "a local job talks to this machine's engine only"
        return self

    def all_removed(self) -> bool:
        return bool(self.made) and all(c.removed and True in c.removes for c in self.made.values())


# -- helpers --

@pytest.fixture(autouse=True)
def fast(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    monkeypatch.setattr(docker_backend, "POLL_S", 0.01)
    monkeypatch.setattr(docker_backend, "GRACE_S", 0.05)


def make_spec(nodes=2, **kw) -> spec_mod.JobSpec:
    return spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=nodes, job_id=JOB, **kw)


def job(engine: FakeEngine, nodes=2, **spec_kw):
    """A backend on the fake engine and its plan for a local job."""
    b = DockerBackend(connect=engine.connect)
    return b, b.plan(make_spec(nodes, **spec_kw))


def run(engine: FakeEngine, nodes=2, spec_kw=None, **kw):
    b, plan = job(engine, nodes, **(spec_kw or {}))
    lines: list[str] = []
    return b, plan, b.run(plan, log=lines.append, **kw), lines


def eventually(check, within=2.0) -> bool:
    """For rank 0's output, which a background thread prints."""
    end = time.monotonic() + within
    while not check() and time.monotonic() < end:
        time.sleep(0.01)
    return check()


def states(result) -> list[str]:
    return [n.state for n in result.nodes]


# -- how a job ends --

def test_all_nodes_pass():
    engine = FakeEngine({0: Life(code=0, after=3), 1: Life(code=0, after=1)})
    b, plan, r, lines = run(engine)
    assert r.ok and r.culprit is None and not r.timed_out and r.failure() == ""
    assert states(r) == ["ok", "ok"] and [n.exit_code for n in r.nodes] == [0, 0]
    assert all(c.started and not c.stopped for c in engine.made.values())
    assert engine.all_removed()
    summary = json.loads((plan.dir / "summary.json").read_text())
    assert summary["ok"] is True and summary["job_id"] == JOB
    for k in (0, 1):
        assert (plan.dir / f"node{k}" / "container.log").read_text() == f"hello from node{k}\nbye from node{k}\n"
    assert eventually(lambda: "[node0] bye from node0" in lines)   # rank 0's output is streamed live
    assert not b.live                                # nothing of the job is kept once it ended


def test_failed_node_stops_the_others_and_is_blamed():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=3, after=2)})
    b, plan, r, lines = run(engine)
    assert engine.made[0].stopped and not engine.made[1].stopped
    assert not r.ok and r.culprit == 1
    assert states(r) == ["stopped", "FAILED"] and r.nodes[1].exit_code == 3
    assert "node1 (rank 1)" in r.failure() and "exit code 3" in r.failure()
    assert engine.all_removed()
    assert any("node1 (rank 1) exited with code 3; stopping the other nodes" in ln for ln in lines)
    assert json.loads((plan.dir / "summary.json").read_text())["culprit"] == 1


# The launcher's output around its configuration dump, as a real node's container.log has it.
TS = "LAUNCH INFO 2026-11-24 02:15:39,021 "
LAUNCHER_OUTPUT = "".join(f"{ln}\n" for ln in (
    f"{TS}-----------  Configuration  ----------------------", f"{TS}master: 10.213.77.11:20916", f"{TS}nnodes: 2",
    f"{TS}--------------------------------------------------", f"{TS}Job: default, mode collective, replicas 2[2:2]",
    "rank 1: failing on purpose at step 10 with exit code 3"))


@pytest.mark.parametrize("fails", [True, False], ids=["failed", "passed"])
def test_a_failed_jobs_summary_shows_the_failed_nodes_launcher_configuration(fails):
    """The dump is kept out of the live output; a failure is when its settings matter."""
    engine = FakeEngine({0: Life(code=None if fails else 0), 1: Life(code=3 if fails else 0, after=2,
                                                                     output=LAUNCHER_OUTPUT)})
    b, plan, r, lines = run(engine)
    assert r.ok is not fails
    assert r.launcher_config == (["master: 10.213.77.11:20916", "nnodes: 2"] if fails else [])
    table = r.table().splitlines()
    if fails:
        at = table.index("  Paddle's launcher on node1 ran with:")
        assert table[at + 1:at + 4] == ["    | master: 10.213.77.11:20916", "    | nnodes: 2",
                                        "  node1 (rank 1) failed: exit code 3; last lines of its log:"]
    assert json.loads((plan.dir / "summary.json").read_text())["launcher_config"] == r.launcher_config


def _last_words(plan, when: dict[int, float]) -> None:
    """Each node's worker log, last written at `when[rank]` (what Paddle's launcher leaves in the log folder)."""
    for rank, t in when.items():
        p = plan.dir / f"node{rank}" / "workerlog.0"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"rank {rank} last words\n")
        os.utime(p, ns=(int(t * 1e9), int(t * 1e9)))


@pytest.mark.parametrize("codes", [(250, 3), (3, 1), (1, 137)], ids=["abort-vs-3", "3-vs-1", "1-vs-137"])
def test_blame_goes_by_last_words_not_by_exit_code_or_finish_order(monkeypatch, codes):
    # rank 0's container is seen to end first, but rank 1's worker wrote its last words earlier: rank 0 only
    # noticed rank 1's death (a Gloo error, an abort) afterwards. The exit codes must not matter.
    monkeypatch.setattr(docker_backend, "GRACE_S", 5.0)   # both exit by themselves well within the grace
    engine = FakeEngine({0: Life(code=codes[0], after=1), 1: Life(code=codes[1], after=3)})
    b, plan = job(engine)
    _last_words(plan, {0: 1_700_000_000.5, 1: 1_700_000_000.2})
    r = b.run(plan, log=lambda _: None)
    assert engine.made[0].attrs["State"]["FinishedAt"] < engine.made[1].attrs["State"]["FinishedAt"]
    assert not r.ok and r.culprit == 1 and states(r) == ["aborted", "FAILED"]
    assert not any(c.stopped for c in engine.made.values())
    assert r.failure().startswith(f"node1 (rank 1) exited with exit code {codes[1]}")
    assert engine.all_removed()


def test_finish_times_compare_as_times_not_as_text(monkeypatch):
    # Docker trims trailing zeros: "...:00.12Z" is earlier than "...:00.123Z" though it sorts after it as text
    monkeypatch.setattr(docker_backend, "GRACE_S", 5.0)
    engine = FakeEngine({0: Life(code=1, after=1, finished="2025-01-01T00:00:00.123Z"),
                         1: Life(code=1, after=3, finished="2025-01-01T00:00:00.12Z")})
    b, plan, r, lines = run(engine)
    assert r.culprit == 1


@pytest.mark.parametrize("case", ["tie", "two-workers-per-node"])
def test_last_words_that_cannot_decide_leave_it_to_the_finish_order(monkeypatch, case):
    monkeypatch.setattr(docker_backend, "GRACE_S", 5.0)
    engine = FakeEngine({0: Life(code=1, after=1), 1: Life(code=1, after=3)})   # node0 ends first
    b = DockerBackend(connect=engine.connect)
    plan = b.plan(make_spec(2, procs_per_node=2 if case == "two-workers-per-node" else 1))
    _last_words(plan, {0: 10.0, 1: 10.0} if case == "tie" else {0: 10.5, 1: 10.2})
    assert b.run(plan, log=lambda _: None).culprit == 0


def test_without_last_words_the_first_to_finish_is_blamed(monkeypatch):
    monkeypatch.setattr(docker_backend, "GRACE_S", 5.0)
    engine = FakeEngine({0: Life(code=3, after=3), 1: Life(code=250, after=1)})
    b, plan, r, lines = run(engine)
    assert r.culprit == 1 and states(r) == ["aborted", "FAILED"]   # node1 ended first; no log says otherwise


@pytest.mark.parametrize("error", [
    docker.errors.APIError("500 Server Error: Internal Server Error", explanation="engine is shutting down"),
    requests.exceptions.ConnectionError("Connection aborted."),
], ids=["api-error", "connection-lost"])
def test_engine_error_while_watching_cleans_up(error):
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None, error=error, errors=10**6)})
    b, plan = job(engine)
    with pytest.raises(Failed, match="the Docker Engine failed while running the job"):
        b.run(plan, log=lambda _: None)
    assert engine.all_removed()
    assert not b.live
    assert (plan.dir / "summary.json").exists()


def test_container_removed_behind_our_back_names_that_node():
    gone = docker.errors.NotFound("No such container: fleetbox-train-fake-0001-node1")
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None, error=gone, errors=10**6, after=2)})
    b, plan, r, lines = run(engine)
    assert not r.ok and r.culprit == 1 and states(r) == ["stopped", "FAILED"] and r.nodes[1].exit_code is None
    assert r.failure().startswith("node1 (rank 1) lost its container (removed while the job ran) (logs: ")
    assert engine.made[0].stopped and engine.all_removed()


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"), KeyboardInterrupt()],
                         ids=["closed-pipe", "ctrl-c"])
def test_an_error_right_after_the_start_leaves_nothing_running(error):
    # the terminal is gone (or Ctrl-C lands) when submit says the job started: run() never gets a handle
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan = job(engine)

    def log(line):
        if line.startswith(f"job {JOB}:"):
            raise error
    with pytest.raises(type(error)):
        b.run(plan, log=log)
    assert engine.all_removed() and not b.live


def test_a_closed_terminal_during_the_run_still_cleans_up():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=3, after=2)})
    b, plan = job(engine)

    started = []

    def log(line):   # every line after the start fails, as writing to a closed pipe does
        if started:
            raise BrokenPipeError(32, "Broken pipe")
        if line.startswith(f"job {JOB}:"):
            started.append(line)
    with pytest.raises(BrokenPipeError):
        b.run(plan, log=log)
    assert engine.all_removed() and (plan.dir / "summary.json").exists()


def test_a_second_ctrl_c_does_not_stop_the_cleanup():
    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        engine = FakeEngine({0: Life(code=None, stop_signal=signal.SIGINT),
                             1: Life(code=None, error=KeyboardInterrupt(), errors=1)})
        b, plan = job(engine)
        with pytest.raises(KeyboardInterrupt):
            b.run(plan, log=lambda _: None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert engine.all_removed() and (plan.dir / "summary.json").exists()


@pytest.mark.parametrize("where", ["create", "start"])
def test_interrupt_while_the_job_starts_leaves_nothing(where):
    # Ctrl-C (or SIGTERM, which becomes the same) while node1's container is being created or started
    if where == "create":
        engine = FakeEngine(refuse={1: KeyboardInterrupt()})
    else:
        engine = FakeEngine({1: Life(code=None, start_error=KeyboardInterrupt())})
    b, plan = job(engine)
    with pytest.raises(KeyboardInterrupt):
        b.run(plan, log=lambda _: None)
    assert engine.made and all(c.removed for c in engine.made.values())
    assert not any(c.status == "running" and not c.removed for c in engine.made.values())
    assert not b.live


def test_ctrl_c_stops_and_removes_every_container():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None, error=KeyboardInterrupt(), errors=1)})
    b, plan = job(engine)
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        b.run(plan, log=lines.append)
    assert all(c.stopped for c in engine.made.values())
    assert engine.all_removed()
    assert f"interrupted: cancelling {JOB} (another Ctrl-C will not stop the cleanup)" in lines
    assert (plan.dir / "summary.json").exists()   # what happened is kept
    h = Handle.load(plan.dir)
    h.supervisor = 0   # the process that ran it has ended (here: the test's own goes on)
    assert b.job_state(h)[0] == JobState.CANCELLED   # stopped, not FAILED


class _NotMapped(BaseException):
    """What SIGTERM or SIGHUP raises here unless the backend maps it to KeyboardInterrupt."""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_a_hang_up_cancel_like_ctrl_c(sig):
    """A `kill`, or a dropped SSH connection / closed terminal (SIGHUP): every container stopped and removed."""
    def not_mapped(signum, frame):
        raise _NotMapped
    previous = signal.signal(sig, not_mapped)   # never let a stray signal end pytest
    try:
        engine = FakeEngine({0: Life(code=None, kill_with=sig), 1: Life(code=None)})
        b, plan = job(engine)
        with pytest.raises(KeyboardInterrupt):
            b.run(plan, log=lambda _: None)
        assert signal.getsignal(sig) is not_mapped   # the caller's handler is back
    finally:
        signal.signal(sig, previous)
    assert all(c.stopped for c in engine.made.values())
    assert engine.all_removed()


def test_a_hang_up_ignored_by_nohup_stays_ignored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)   # as `nohup invoke train ...` starts it
    try:
        engine = FakeEngine({0: Life(code=0, after=2, kill_with=signal.SIGHUP), 1: Life(code=0, after=2)})
        b, plan = job(engine)
        try:
            result = b.run(plan, log=lambda _: None)
        except KeyboardInterrupt:
            pytest.fail("the ignored hang-up stopped the job")
        assert result.ok   # the hang-up changed nothing
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_refused_create_removes_what_was_created():
    refusal = docker.errors.APIError("409 Client Error: Conflict",
                                     explanation='Conflict. The container name "/x" is already in use')
    engine = FakeEngine(refuse={1: refusal})
    b, plan = job(engine)
    with pytest.raises(UserError, match="node1's engine refused to start its container: .*already in use"):
        b.run(plan, log=lambda _: None)
    assert list(engine.made) == [0]
    assert engine.made[0].removed and not engine.made[0].started


def test_timeout_stops_every_node():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan, r, lines = run(engine, timeout=0.2)
    assert r.timed_out and not r.ok and r.culprit is None
    assert "timed out" in r.failure()
    assert all(c.stopped for c in engine.made.values())
    assert engine.all_removed()


def test_oom_kill_is_named():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=137, after=2, oom=True)})
    b, plan, r, lines = run(engine)
    assert not r.ok and r.culprit == 1 and r.nodes[1].oom_killed and not r.nodes[0].oom_killed
    assert "node1 (rank 1) exited with exit code 137 (killed by SIGKILL: out of memory)" in r.failure()
    assert engine.all_removed()


# -- blame and states when we stopped nodes --

def test_timeout_marks_no_node_failed():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan, r, lines = run(engine, timeout=0.2)
    assert states(r) == ["stopped", "stopped"]


def test_node_stopped_by_us_is_never_blamed():
    engine = FakeEngine({0: Life(code=None, stop_code=15), 1: Life(code=137, after=2, oom=True)})
    b, plan, r, lines = run(engine)
    assert r.culprit == 1 and states(r) == ["stopped", "FAILED"]


# -- what the engine gets --

def _flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_engine_gets_what_describe_shows():
    engine = FakeEngine()
    b, plan = job(engine, nodes=3)
    shown = b.describe(plan).splitlines()
    r = b.run(plan, log=lambda _: None)
    assert r.ok and sorted(engine.made) == [0, 1, 2]
    for k, node in enumerate(plan.nodes):
        c = engine.made[k]
        want = docker_backend.sdk_kwargs(node)
        assert c.image == node.image == IMAGE and c.command == list(node.command)
        assert c.kwargs == want        # docker.types values compare by value (they are dicts)
        for key in ("name", "environment", "labels", "volumes", "network_mode", "shm_size", "working_dir"):
            assert c.kwargs[key] == want[key], key
        # the dry-run line for this node says the same
        argv = shlex.split(shown[shown.index(f"# node{k} (rank {k}) on this machine") + 1])
        assert argv[-len(c.command):] == c.command and argv[-len(c.command) - 1] == c.image
        assert _flag_values(argv, "--name") == [c.kwargs["name"]]
        assert _flag_values(argv, "--network") == [c.kwargs["network_mode"]]
        assert _flag_values(argv, "--shm-size") == [c.kwargs["shm_size"]]
        assert _flag_values(argv, "-w") == [c.kwargs["working_dir"]]
        assert dict(e.split("=", 1) for e in _flag_values(argv, "-e")) == c.kwargs["environment"]
        assert dict(e.split("=", 1) for e in _flag_values(argv, "--label")) == c.kwargs["labels"]
        assert [v if v.endswith(":ro") else v + ":rw" for v in _flag_values(argv, "-v")] == c.kwargs["volumes"]
        assert c.kwargs["labels"][settings.LABEL_JOB] == JOB and c.kwargs["labels"][settings.LABEL_RANK] == str(k)


# -- another process: status, logs, cancel by label --

def test_status_logs_cancel_from_another_process():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=0, after=1)})
    starter, plan = job(engine)
    starter.submit(plan, log=lambda _: None)              # started; this process never follows it
    engine.made[1].reload()                               # node1 ends by itself
    other = DockerBackend(connect=engine.connect)         # e.g. `invoke job-status` in another shell
    handle = Handle.load(plan.dir)
    assert handle.job_id == JOB and other.live == {}
    assert other.status(handle) == "RUNNING"
    assert other.logs(handle, 0) == "hello from node0\nbye from node0\n"
    foreign = FakeContainer(IMAGE, ["sleep"], {"name": "fleetbox-other-node0", "labels": {
        settings.LABEL_JOB: "train-other-0002", settings.LABEL_RANK: "0"}}, Life(code=None))
    foreign.start()
    engine.made[99] = foreign                             # another job's container on the same engine
    twin = FakeContainer(IMAGE, ["sleep"], {"name": "fleetbox-twin-node0", "labels": {
        settings.LABEL_JOB: JOB, settings.LABEL_RANK: "0", settings.LABEL_OWNER: "ann@0123456789ab"}}, Life(code=None))
    twin.start()
    engine.made[98] = twin                                # the same job id, another user's (a shared daemon)
    other.cancel(handle, log=lambda _: None)
    assert all(engine.made[k].removed and engine.made[k].removes == [True] for k in (0, 1))
    assert not foreign.removed and not twin.removed
    assert other.status(handle) == "GONE"


# -- invoke clean --

def test_clean_keeps_live_jobs_unless_asked_and_tolerates_races():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=0, after=1)})
    starter, plan = job(engine)
    starter.submit(plan, log=lambda _: None)
    engine.made[1].reload()                               # node1 finished; node0 still runs
    vanished = FakeContainer(IMAGE, ["true"], {"name": "fleetbox-old-node0", "labels": {
        settings.LABEL_JOB: "train-old-0003", settings.LABEL_RANK: "0"}}, Life(code=0))
    vanished.status = "exited"
    vanished.remove = lambda force=False: (_ for _ in ()).throw(docker.errors.NotFound("gone meanwhile"))
    engine.made[98] = vanished                            # removed by its own job between list and remove
    starting = FakeContainer(IMAGE, ["true"], {"name": "fleetbox-new-node0", "labels": {
        settings.LABEL_JOB: "train-new-0004", settings.LABEL_RANK: "0"}}, Life(code=0))
    engine.made[97] = starting                            # created, not yet started: a job that is starting
    listed_then_gone = FakeContainer(IMAGE, ["true"], {"name": "fleetbox-gone-node0", "labels": {
        settings.LABEL_JOB: "train-gone-0005", settings.LABEL_RANK: "0"}}, Life(code=0))
    engine.made[96] = listed_then_gone
    engine.vanish_while_listing.append(listed_then_gone)  # removed while the engine is being asked
    theirs = FakeContainer(IMAGE, ["true"], {"name": "fleetbox-theirs-node0", "labels": {
        settings.LABEL_JOB: "train-theirs-0006", settings.LABEL_RANK: "0", settings.LABEL_OWNER: "ann@0123456789ab"}},
        Life(code=0))
    theirs.status = "exited"
    engine.made[95] = theirs                              # another user's (or runs folder's) job, ended
    b = DockerBackend(connect=engine.connect)
    said = []
    # node1 ended, but its job runs (node0): kept, with what holds it; the starting job's too
    assert b.clean([], log=said.append) == (0, 3)
    assert f"kept fleetbox-{JOB}-node1: exited; its job {JOB} is RUNNING (`invoke cancel {JOB}` stops it; " \
        "--force removes it)" in said
    assert not starting.removes and not engine.made[1].removed and not engine.made[0].removed
    assert b.clean([], job=JOB, log=lambda _: None) == (0, 2)   # naming the job does not make it ended
    engine.vanish_while_listing.clear()
    assert b.clean([], job=JOB, force=True, log=lambda _: None) == (2, 0)
    assert engine.made[0].removed and engine.made[1].removed
    assert b.clean([], force=True, log=lambda _: None) == (1, 0) and starting.removed   # never theirs
    assert not theirs.removes


def test_clean_force_removes_running_containers():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    starter, plan = job(engine)
    starter.submit(plan, log=lambda _: None)
    b = DockerBackend(connect=engine.connect)
    assert b.clean([], log=lambda _: None) == (0, 2)
    assert b.clean([], force=True, log=lambda _: None) == (2, 0)
    assert all(c.removed for c in engine.made.values())


def test_mount_sources_are_checked_with_placeholders_filled(tmp_path):
    from fleetbox.run.spec import Mount
    engine = FakeEngine()
    b = DockerBackend(connect=engine.connect)
    home = os.path.expanduser("~")
    with pytest.raises(UserError, match=f"mount source {home}/fleetbox-nothing-here does not exist here"):
        b.plan(make_spec(mounts=(Mount("{home}/fleetbox-nothing-here", "/data"),)))
    import getpass
    (tmp_path / getpass.getuser()).mkdir()
    plan = b.plan(make_spec(mounts=(Mount(f"{tmp_path}/{{user}}", "/data"),)))   # exists once filled
    assert any(m.dst == "/data" for m in plan.nodes[0].mounts)
    assert engine.made == {}


def packed(ws, **kw) -> tuple[dict, list[str]]:
    """What pack_dir puts in the archive (name -> bytes) and the lines it says."""
    said = []
    out = ws.parent / "ws.tar"
    docker_backend.pack_dir(ws, out, log=said.append, **kw)
    with tarfile.open(out) as tar:
        assert not any(m.issym() or m.islnk() for m in tar.getmembers())
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}, said


def test_the_workspace_for_remote_engines_holds_sub_folders_and_links_inside_it(tmp_path):
    ws = tmp_path / "ws"
    (ws / "pkg" / "deep").mkdir(parents=True)
    (ws / "main.py").write_text("main")
    (ws / "pkg" / "deep" / "mod.py").write_text("mod")
    (ws / "alias.py").symlink_to(ws / "pkg" / "deep" / "mod.py")   # absolute, inside: its content travels
    (ws / "pkg" / "up").symlink_to(ws)                       # a loop back up: copied once
    (ws / ".#main.py").symlink_to("root@host.1234")          # an editor's lock file: dangling, skipped
    files, said = packed(ws)
    assert files == {"main.py": b"main", "alias.py": b"mod", "pkg/deep/mod.py": b"mod"} and said == []


def test_a_remote_engine_gets_the_workspace_streamed_from_a_file_not_from_memory(monkeypatch):
    """The folder is packed once to a file each node's upload reads as it sends (it was bytes in memory: 6.3 GiB)."""
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan = job(engine)
    plan = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, host=f"tcp://10.0.0.{k + 1}:2375")
                                                 for k, n in enumerate(plan.nodes)))
    monkeypatch.setattr(b, "engine", lambda host: engine)
    sent = []

    def put_archive(self, path, data):
        assert not isinstance(data, (bytes, bytearray)) and data.tell() == 0   # a stream, read from its start
        with tarfile.open(fileobj=data, mode="r|") as tar:   # read as a stream, the way the SDK sends it
            sent.append((self.rank, path, sorted(m.name for m in tar)))
        return True
    monkeypatch.setattr(FakeContainer, "put_archive", put_archive, raising=False)
    live = docker_backend._Live(b, plan)
    try:
        live.start(log=lambda _: None)
    finally:
        live.remove_all()
    def files(folder, prefix=""):
        return sorted(str(Path(prefix, p.relative_to(folder))) for p in folder.rglob("*") if p.is_file())
    both = [(k, settings.WORKDIR, files(plan.spec.script_path.parent)) for k in (0, 1)] + \
        [(k, "/", files(settings.HELPERS, settings.HELPERS_DIR.lstrip("/"))) for k in (0, 1)]
    assert sorted(sent) == sorted(both)


def test_links_leaving_the_workspace_are_not_followed_and_are_named(tmp_path):
    ws, home = tmp_path / "ws", tmp_path / "home"
    ws.mkdir()
    (home / ".ssh").mkdir(parents=True)
    (home / ".npmrc").write_text("//registry/:_authToken=secret")
    (home / ".ssh" / "id_ed25519").write_text("key")
    (ws / "train.py").write_text("main")
    (ws / "home").symlink_to(home)                           # a folder outside
    (ws / "npmrc").symlink_to(home / ".npmrc")               # a file outside
    (ws / "up").symlink_to("..")                             # relative, leaving
    files, said = packed(ws)
    assert files == {"train.py": b"main"}
    assert sorted(said) == sorted(f"warning: not copied to the remote engines: {n} -> {t} leaves {ws}"
                                  for n, t in [("home", home), ("npmrc", home / ".npmrc"), ("up", "..")])


def test_a_workspace_over_the_bound_is_refused_naming_the_file(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_bytes(b"x" * 600)
    (ws / "data.bin").write_bytes(b"x" * 600)
    with pytest.raises(UserError, match=r"more than 0 MiB .*\(reached at data.bin\): keep data out of it"):
        packed(ws, limit=1000)
    assert packed(ws, limit=1200)[0].keys() == {"a.py", "data.bin"}


def test_a_workspace_that_cannot_be_packed_is_one_line(tmp_path, monkeypatch):
    import errno
    import tarfile
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.py").write_text("a")

    def full(self, name, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ws.tar"))
    monkeypatch.setattr(tarfile.TarFile, "add", full)
    with pytest.raises(UserError, match=rf"^cannot pack {ws} for the remote engines: No space left on device \("):
        packed(ws)


class _Probe:
    def __init__(self, wait_error=None, code=0, out=b"", err=b""):
        self.wait_error, self.code, self.out, self.err, self.removes = wait_error, code, out, err, []

    def wait(self, timeout=None):
        if self.wait_error is not None:
            raise self.wait_error
        return {"StatusCode": self.code}

    def logs(self, stdout=True, stderr=False):
        return self.out if stdout else self.err

    def remove(self, force=False):
        self.removes.append(force)


@pytest.mark.parametrize("case", ["ctrl-c", "probe-fails"])
def test_the_hosts_probe_container_is_removed_on_every_way_out(case):
    probe = _Probe(KeyboardInterrupt()) if case == "ctrl-c" else _Probe(code=1, err=b"Traceback\nOSError: no route")
    engine = type("Engine", (), {"containers": type("C", (), {"run": lambda self, *a, **kw: probe})()})()
    b = DockerBackend(connect=lambda host: engine)
    with pytest.raises(KeyboardInterrupt if case == "ctrl-c" else UserError):
        b._probe(make_spec(), JOB, "tcp://10.213.77.11:2375", "10.213.77.11", 29500, check_port=True)
    assert probe.removes == [True]


def test_missing_image_is_a_user_error():
    engine = FakeEngine(images=())
    b = DockerBackend(connect=engine.connect)
    with pytest.raises(UserError, match=r"image fleetbox/paddle:cpu is not here; run `invoke build --variant cpu`"):
        b.plan(make_spec())
    assert engine.made == {}


# -- restarts (--max-restarts) --

def test_a_failed_node_restarts_the_whole_job_from_its_checkpoints():
    engine = FakeEngine({0: [Life(code=None), Life(code=0, after=2)], 1: [Life(code=3, after=2), Life(code=0)]})
    b, plan, r, lines = run(engine, spec_kw={"max_restarts": 2, "args": ("--tag", "try-{attempt}")})
    assert r.ok and r.job_id == JOB
    # by rank: an attempt's nodes are created concurrently, in either order
    first, second = (sorted(h, key=lambda c: c.rank) for h in (engine.history[:2], engine.history[2:]))
    assert len(engine.history) == 4 and all(c.removed for c in engine.history)
    assert first[0].stopped and [c.name for c in first] == [c.name for c in second]   # the same job, again
    for c in first:
        assert c.kwargs["environment"]["FLEETBOX_ATTEMPT"] == "0" and c.command[-1] == "try-0"
    for c in second:   # told which attempt it is ({attempt} filled again); the checkpoints are the same
        assert c.kwargs["environment"]["FLEETBOX_ATTEMPT"] == "1" and c.command[-1] == "try-1"
        assert f"{plan.checkpoints}:{settings.CHECKPOINT_DIR}:rw" in c.kwargs["volumes"]
        assert {k: v for k, v in c.kwargs.items() if k != "environment"} == \
            {k: v for k, v in first[c.rank].kwargs.items() if k != "environment"}
    assert [(a["attempt"], a["ok"]) for a in r.attempts] == [(0, False), (1, True)]
    assert r.attempts[0]["ended"] == "node1 (rank 1) exited with exit code 3"
    # each attempt keeps its own logs: the first moved aside, the last in the job folder
    assert r.attempts[0]["logs"] == str(plan.dir / "attempt0") and r.attempts[1]["logs"] == str(plan.dir)
    assert json.loads((plan.dir / "attempt0" / "summary.json").read_text())["culprit"] == 1
    assert (plan.dir / "attempt0" / "node1" / "container.log").exists()
    assert (plan.dir / "node1" / "container.log").exists()
    assert json.loads((plan.dir / "summary.json").read_text())["attempts"] == r.attempts
    info = json.loads((plan.dir / "job.json").read_text())   # the report's time runs from the first attempt
    assert 0 < info["first_started"] < info["started"]
    assert any(ln.startswith("attempt 0 failed: node1 (rank 1) exited with exit code 3; restarting the whole job")
               for ln in lines)
    assert "attempt 0: node1 (rank 1) exited with exit code 3" in r.table()


def test_with_min_nodes_a_restart_goes_on_without_the_node_that_failed_numbered_again():
    """--nodes 3 --min-nodes 2: node1 fails; the next attempt runs the other two as node0 and node1 (Paddle's
    launcher told 2 nodes), on the same checkpoints; a second failure there restarts those two, never fewer."""
    engine = FakeEngine({0: [Life(code=None), Life(code=3, after=2), Life(code=0)],
                         1: [Life(code=3, after=2), Life(code=None), Life(code=0)], 2: [Life(code=None)]})
    b, plan, r, lines = run(engine, nodes=3, spec_kw={"max_restarts": 2, "min_nodes": 2})
    assert r.ok, r.failure()
    made = [sorted(h, key=lambda c: c.rank) for h in (engine.history[:3], engine.history[3:5], engine.history[5:])]
    assert [len(m) for m in made] == [3, 2, 2] and len(engine.history) == 7 and all(c.removed for c in engine.history)
    for attempt, nodes in ((1, made[1]), (2, made[2])):
        for k, c in enumerate(nodes):   # numbered again: node0 and node1 of a 2-node job
            env = c.kwargs["environment"]
            assert (c.rank, env["FLEETBOX_NODE"], env["FLEETBOX_ATTEMPT"]) == (k, str(k), str(attempt))
            assert c.command[c.command.index("--nnodes") + 1] == "2", c.command
            assert f"{plan.checkpoints}:{settings.CHECKPOINT_DIR}:rw" in c.kwargs["volumes"]
    assert made[0][0].command[made[0][0].command.index("--nnodes") + 1] == "3"
    assert [(a["attempt"], a["ok"], a["nodes"]) for a in r.attempts] == [(0, False, 3), (1, False, 2), (2, True, 2)]
    assert len(r.nodes) == 2 and json.loads((plan.dir / "job.json").read_text())["nodes"] == 2
    assert (plan.dir / "attempt0" / "node2").is_dir() and not (plan.dir / "node2").exists()
    said = [ln for ln in lines if ln.startswith("attempt ")]
    assert said[0].startswith("attempt 0 failed: node1 (rank 1) exited with exit code 3; going on without node1 "
                              "from the newest checkpoint, on 2 nodes (restart 1 of 2): the world is 2 ranks, was 3")
    assert said[1].startswith("attempt 1 failed: node0 (rank 0) exited with exit code 3; restarting the whole job")


def test_a_plan_without_a_node_keeps_each_left_nodes_devices_also_in_a_detached_jobs_supervisor():
    """`without` reads the plan alone: a supervisor's backend, made from the plan's JSON with no --devices, leaves
    node1 out of 3 (GPUs 2,3 / 4,5 / 6,7): node0 keeps 2,3 and the old node2 keeps 6,7; then node0 out of those
    two: the old node2 alone, master at its own address, its devices still 6,7."""
    from fleetbox.run import records
    engine = FakeEngine(images=("fleetbox/paddle:cu118-pypi",))
    b = DockerBackend(connect=engine.connect, devices="2,3,4,5,6,7")
    plan = b.plan(spec_mod.JobSpec(variant=matrix.load().get("cu118-pypi"), nodes=3, job_id=JOB, procs_per_node=2,
                                   max_restarts=2, min_nodes=1))
    assert [v["gpus"] for v in plan.values] == ["2,3", "4,5", "6,7"]
    carried = records.from_record(type(plan), json.loads(json.dumps(records.to_record(plan))))
    two = DockerBackend(connect=engine.connect).without(carried, 1)
    assert [(v["rank"], v["nnodes"], v["gpus"]) for v in two.values] == [("0", "2", "2,3"), ("1", "2", "6,7")]
    assert two.spec.nodes == 2 and [n.labels[settings.LABEL_RANK] for n in two.nodes] == ["0", "1"]
    assert [n.gpus for n in two.nodes] == [plan.nodes[0].gpus, plan.nodes[2].gpus]
    one = DockerBackend(connect=engine.connect).without(two, 0)
    assert [(v["rank"], v["nnodes"], v["gpus"], v["master_ip"]) for v in one.values] == \
        [("0", "1", "6,7", plan.values[2]["node_ip"])]


def with_spare(plan, host=""):
    """A local plan given a spare on this machine's fake engine (a real one is a --hosts engine, probed)."""
    return dataclasses.replace(plan, spares=({"host": host, "iface": "lo", "local": "127.0.0.9"},))


def test_a_spare_takes_the_failed_nodes_place_then_with_none_left_the_whole_job_restarts():
    """node1 fails: the spare takes its place (its address, the same ranks and world); node1 fails again, no spare
    is left, so the same nodes again. The summary names the node left out; the restart lines say what happened."""
    engine = FakeEngine({0: [Life(code=None), Life(code=None), Life(code=0)],
                         1: [Life(code=3, after=2), Life(code=3, after=2), Life(code=0)]})
    b, plan = job(engine, max_restarts=2)
    lines: list[str] = []
    r = b.run(with_spare(plan), log=lines.append)
    assert r.ok, r.failure()
    made = [sorted(h, key=lambda c: c.rank) for h in (engine.history[:2], engine.history[2:4], engine.history[4:])]
    ips = [[c.command[c.command.index("--host") + 1] for c in m] for m in made]
    assert ips[0][1] != "127.0.0.9" and ips[1][1] == ips[2][1] == "127.0.0.9" and ips[1][0] == ips[0][0]
    for m in made:   # the same world each time: two nodes
        assert [c.command[c.command.index("--nnodes") + 1] for c in m] == ["2", "2"]
    assert [(a["attempt"], a["ok"], a["nodes"]) for a in r.attempts] == [(0, False, 2), (1, False, 2), (2, True, 2)]
    assert r.replaced == [{"attempt": 1, "node": 1, "host": "", "by": "",
                           "why": "node1 (rank 1) exited with exit code 3", "ran": True}]
    assert json.loads((plan.dir / "summary.json").read_text())["replaced"] == r.replaced
    said = [ln for ln in lines if ln.startswith("attempt ")]
    assert said[0].startswith("attempt 0 failed: node1 (rank 1) exited with exit code 3; the spare  takes node1's "
                              "place: restarting from the newest checkpoint on 2 nodes (restart 1 of 2)")
    assert said[1].startswith("attempt 1 failed: node1 (rank 1) exited with exit code 3; restarting the whole job")


def test_a_node_whose_engine_refuses_its_container_is_replaced_by_a_spare_before_the_job_starts():
    """No restart is spent: node1's create is refused, the spare takes its place, and attempt 0 runs; without a
    spare the same refusal is the job's one line."""
    refusal = docker.errors.APIError("409", explanation='Conflict. The container name "/x" is already in use')
    engine = FakeEngine(refuse={1: [refusal, None]})
    b, plan = job(engine)
    lines: list[str] = []
    r = b.run(with_spare(plan), log=lines.append)
    assert r.ok and r.attempts == [] and engine.all_removed()
    assert sorted(c.rank for c in engine.history) == [0, 0, 1]   # the first try's node0 made, then removed
    (new,) = [c for c in engine.history if c.rank == 1]
    assert new.command[new.command.index("--host") + 1] == "127.0.0.9"
    assert r.replaced[0]["attempt"] == 0 and r.replaced[0]["why"].startswith(
        "node1's engine refused to start its container: Conflict.")
    assert any(ln.startswith("node1's engine refused to start its container: ") and "; the spare  takes node1's place"
               in ln for ln in lines)
    assert r.replaced[0]["ran"] is False and "node1 on  could not start the job" in r.table()


def test_the_job_lets_its_checkpoint_folder_go_once_from_the_plan_it_last_ran(monkeypatch):
    """ended(plan) runs once, on every way out, with the plan of the nodes the job last ran on: after a spare took
    a node's place at the start, also when the next refusal, with no spare left, ends the job."""
    seen = []
    monkeypatch.setattr(DockerBackend, "ended", lambda self, plan: seen.append(plan))
    refusal = docker.errors.APIError("409", explanation="Conflict")
    b, plan = job(FakeEngine(refuse={1: [refusal, None]}))
    assert b.run(with_spare(plan), log=lambda _: None).ok
    assert len(seen) == 1 and seen[0].spares == () and len(seen[0].replaced) == 1
    b, plan = job(FakeEngine(refuse={1: [refusal, refusal]}))
    with pytest.raises(UserError, match="node1's engine refused"):
        b.run(with_spare(plan), log=lambda _: None)
    assert len(seen) == 2 and seen[1].spares == () and seen[1].replaced[0]["node"] == 1


def test_a_refusal_of_every_node_alike_is_the_jobs_own_line_and_spends_no_spare():
    refusal = docker.errors.APIError("400", explanation="invalid mount config for type bind")
    engine = FakeEngine(refuse={0: refusal, 1: refusal})
    b, plan = job(engine)
    with pytest.raises(UserError) as e:
        b.run(with_spare(plan), log=lambda _: None)
    assert type(e.value) is UserError
    assert str(e.value) == "every node's engine refused to start its container: invalid mount config for type bind"


def test_a_spare_in_the_masters_place_is_the_new_master_for_every_node_and_is_carried_to_a_supervisor():
    from fleetbox.run import records
    engine = FakeEngine()
    b = DockerBackend(connect=engine.connect)
    plan = with_spare(b.plan(make_spec(3)), "tcp://h9:2375")
    carried = records.from_record(type(plan), json.loads(json.dumps(records.to_record(plan))))
    assert carried.spares == plan.spares
    new, by = DockerBackend(connect=engine.connect).with_spare(carried, 0)
    assert by == "tcp://h9:2375" and new.spares == () and new.spec.nodes == 3
    assert [n.host for n in new.nodes] == ["tcp://h9:2375", "", ""]
    assert [(v["rank"], v["nnodes"], v["master_ip"]) for v in new.values] == [(str(k), "3", "127.0.0.9")
                                                                              for k in range(3)]
    assert [v["node_ip"] for v in new.values] == ["127.0.0.9"] + [v["node_ip"] for v in plan.values[1:]]
    assert all(n.command[n.command.index("--master") + 1].startswith("127.0.0.9:") for n in new.nodes)
    assert "# spare on tcp://h9:2375: " in b.describe(plan) and "# spare" not in b.describe(new)


def test_hosts_that_fail_their_check_at_start_give_their_place_to_spares_in_order():
    assert docker_backend.assign(("a", "b", "c", "d"), 2, {}) == (["a", "b"], ["c", "d"], (), ())
    nodes, spares, said, left = docker_backend.assign(("a", "b", "c", "d"), 2, {"a": "no image", "c": "unreachable"})
    assert (nodes, spares) == (["d", "b"], [])
    assert said == ("note: node0's host a failed its check at start (no image); the spare d takes its place",
                    "note: the spare c failed its check at start (unreachable): it is left out")
    assert left == ({"attempt": 0, "node": 0, "host": "a", "by": "d", "why": "no image", "ran": False},)
    with pytest.raises(UserError, match=r"^unreachable \(node1's host, and no spare is left to take its place\)$"):
        docker_backend.assign(("a", "b", "c"), 2, {"b": "unreachable", "c": "no image"})


def planned_on_hosts(monkeypatch, hosts, nodes, spares, ready_fails=(), probe_fails=(), busy=()):
    """A --hosts plan whose engines are scripted: `ready_fails` hosts fail their first check (unreachable, no
    image), `probe_fails` their network probe, `busy` have the port taken. Returns the plan and every probe made
    (host, the master address it was asked to reach)."""
    from fleetbox.run import hostnet
    ip = {h: f"10.0.0.{k + 1}" for k, h in enumerate(hosts)}
    monkeypatch.setattr(hostnet, "host_address", lambda url: ip[url])
    monkeypatch.setattr(hostnet, "random_port", lambda: 29500)
    monkeypatch.setattr(hostnet, "check_room", lambda port, count: None)
    b, probes = DockerBackend(hosts=hosts), []

    def ready(spec, host, owner):
        if host in ready_fails:
            raise docker_backend._Broken(f"{host} unreachable", host)
        return types.SimpleNamespace(id="sha256:" + "0" * 64, labels={})

    def probe(spec, job_id, host, master_ip, port, check_port, spare=False):
        probes.append((host, master_ip))
        if host in probe_fails:
            raise docker_backend._Broken(f"{host}: the network probe failed", host)
        if host in busy and (check_port or spare):
            if spare:
                raise docker_backend._Broken(f"{host}: port in use", host)
            raise UserError(f"port {port} on {master_ip} is already in use; pick another with --port")
        return {"iface": "eth0", "local": ip[host], "memlock": 1000 + 10 * hosts.index(host), "names": ["eth0"]}
    monkeypatch.setattr(b, "_ready", ready)
    monkeypatch.setattr(b, "_probe", probe)
    return b.plan(make_spec(nodes, spare_nodes=spares)), probes


def test_a_plan_on_hosts_gives_a_failed_hosts_place_to_a_spare_and_probes_again_against_a_new_master(monkeypatch):
    plan, probes = planned_on_hosts(monkeypatch, ("a", "b", "c", "d"), 2, 2, ready_fails={"b"}, probe_fails={"c"})
    assert [n.host for n in plan.nodes] == ["a", "d"] and plan.spares == ()
    assert [r["host"] for r in plan.replaced] == ["b"] and plan.replaced[0]["by"] == "d"
    assert plan.notes[:2] == ("note: node1's host b failed its check at start (b unreachable); the spare d takes its "
                              "place", "note: the spare c failed its check at start (c: the network probe failed): it "
                              "is left out")
    assert plan.template.memlock == 1000   # the lowest of every host probed, the spares' too
    assert probes == [("a", "10.0.0.1"), ("c", "10.0.0.1"), ("d", "10.0.0.1")]   # a, asked once, is not asked again
    # the master fails its probe: a spare is node0 and the master, and every host is asked again to reach it
    plan, probes = planned_on_hosts(monkeypatch, ("a", "b", "c"), 2, 1, probe_fails={"a"})
    assert [n.host for n in plan.nodes] == ["c", "b"] and plan.values[0]["master_ip"] == "10.0.0.3"
    assert probes[-2:] == [("c", "10.0.0.3"), ("b", "10.0.0.3")]
    # a spare whose port is taken could not be the master: left out; the master's own is the user's line
    plan, _ = planned_on_hosts(monkeypatch, ("a", "b", "c"), 2, 1, busy={"c"})
    assert plan.spares == () and any("the spare c failed its check at start (c: port in use)" in n for n in plan.notes)
    with pytest.raises(UserError) as e:
        planned_on_hosts(monkeypatch, ("a", "b", "c"), 2, 1, busy={"a"})
    assert type(e.value) is UserError and str(e.value).startswith("port 29500 on 10.0.0.1 is already in use")
    with pytest.raises(UserError, match=r"^a unreachable \(node0's host, and no spare is left to take its place\)$"):
        planned_on_hosts(monkeypatch, ("a", "b", "c"), 2, 1, ready_fails={"a", "c"})


def test_after_the_last_restart_the_last_failure_is_named():
    engine = FakeEngine({0: [Life(code=None), Life(code=None)], 1: [Life(code=3), Life(code=7)]})
    b, plan, r, lines = run(engine, spec_kw={"max_restarts": 1})
    assert not r.ok and r.culprit == 1 and r.nodes[1].exit_code == 7
    assert r.failure() == f"node1 (rank 1) exited with exit code 7 (after 1 restart(s); logs: {plan.dir})"
    assert len(engine.history) == 4 and all(c.removed for c in engine.history)


def test_without_restarts_a_failure_ends_the_job():
    engine = FakeEngine({0: [Life(code=None), Life(code=0)], 1: [Life(code=3), Life(code=0)]})
    b, plan, r, lines = run(engine)
    assert not r.ok and len(engine.history) == 2 and r.attempts == [] and not (plan.dir / "attempt0").exists()


def test_an_engine_lost_under_the_job_is_a_failed_attempt():
    error = requests.exceptions.ConnectionError("Connection aborted")
    engine = FakeEngine({0: [Life(code=None, error=error), Life(code=0)], 1: [Life(code=None), Life(code=0)]})
    b, plan, r, lines = run(engine, spec_kw={"max_restarts": 1})
    assert r.ok and r.attempts[0]["ended"].startswith("the Docker Engine failed while running the job")
    assert all(c.removed for c in engine.history)


def test_a_remote_node_whose_engine_stops_answering_is_lost_and_blamed_and_no_call_waits_on_that_engine(
        monkeypatch):
    """--hosts: node1's engine stops answering mid-run. That node is lost (the judge blames it: a spare or
    --min-nodes can leave it out), the others are stopped, and nothing more is asked of the lost engine (each call
    would wait for the client's timeout): no stop, no remove, no log copy. This machine's own engine lost stays the
    whole job's failure (test_an_engine_lost_under_the_job_is_a_failed_attempt)."""
    monkeypatch.setattr(docker_backend, "GRACE_S", 0)
    from fleetbox.run.judge import judge
    b, plan = job(FakeEngine())
    plan = dataclasses.replace(plan, nodes=(plan.nodes[0], dataclasses.replace(plan.nodes[1], host="tcp://h2:2375")))
    live = docker_backend._Live(b, plan)
    lost = requests.exceptions.ConnectionError("Connection aborted")
    for k, life in ((0, Life(code=None)), (1, Life(code=None, error=lost, errors=10**6))):
        c = FakeContainer(IMAGE, ["x"], {"name": f"n{k}", "labels": {settings.LABEL_RANK: str(k)}}, life)
        c.status = "running"
        live.containers[k] = c
    said: list[str] = []
    live.watch(said.append)
    live.gather()
    live.remove_all()
    r = judge(live.facts(), JOB, "docker", str(plan.dir))
    assert r.culprit == 1 and [n.state for n in r.nodes] == ["stopped", "FAILED"]
    assert r.reason() == "node1 (rank 1) was lost: its engine (tcp://h2:2375) stopped answering (Connection aborted)"
    assert said[0].startswith("node1's engine (tcp://h2:2375) stopped answering; stopping the other nodes")
    one, two = live.containers[0], live.containers[1]
    assert one.stopped and one.removed and not two.stopped and not two.removes
    assert (plan.dir / "node1" / "gather-error.txt").read_text().startswith("was lost: its engine (tcp://h2:2375)")
    # an error the engine answered with is not a lost node: the job's own failure, as before
    live = docker_backend._Live(b, plan)
    for k, life in ((0, Life(code=None)), (1, Life(code=None, error=docker.errors.APIError("500"), errors=10**6))):
        c = FakeContainer(IMAGE, ["x"], {"name": f"n{k}", "labels": {settings.LABEL_RANK: str(k)}}, life)
        c.status = "running"
        live.containers[k] = c
    with pytest.raises(docker.errors.APIError):
        live.watch(lambda _: None)
    assert live.lost == {}


def test_a_timeout_or_ctrl_c_is_not_restarted():
    engine = FakeEngine({0: [Life(code=None)] * 2, 1: [Life(code=None)] * 2})
    b, plan, r, lines = run(engine, spec_kw={"max_restarts": 3}, timeout=0.2)
    assert r.timed_out and len(engine.history) == 2
    engine = FakeEngine({0: Life(code=None, error=KeyboardInterrupt()), 1: Life(code=None)})
    with pytest.raises(KeyboardInterrupt):
        run(engine, spec_kw={"max_restarts": 3})
    assert len(engine.history) == 2 and engine.all_removed()


def test_resume_never_moves_older_checkpoints_aside(tmp_path):
    ckpt = tmp_path / "ck"
    (ckpt / "step-00000040").mkdir(parents=True)
    (ckpt / "step-00000040" / "COMPLETE").write_text("{}")
    lines = []
    b, plan = job(FakeEngine(), checkpoint_dir=str(ckpt), resume="never")
    b.run(plan, log=lines.append)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("ck.before-")]
    assert len(aside) == 1 and (aside[0] / "step-00000040" / "COMPLETE").exists()
    assert [p.name for p in ckpt.iterdir()] == [".owner.lock"]   # and the job's OWNER is gone with the job
    assert any(f"moved the earlier checkpoints to {aside[0]}" in ln for ln in lines)
    b, plan = job(FakeEngine(), checkpoint_dir=str(aside[0]))   # auto: they stay where they are
    b.run(plan, log=lines.append)
    assert (aside[0] / "step-00000040").exists()


def test_a_restart_with_resume_never_keeps_the_checkpoints_of_its_own_first_attempt(tmp_path):
    ckpt = tmp_path / "ck"
    engine = FakeEngine({0: [Life(code=None), Life(code=0)], 1: [Life(code=3), Life(code=0)]})
    b, plan = job(engine, checkpoint_dir=str(ckpt), resume="never", max_restarts=1)
    real_reload = FakeContainer.reload

    def attempt0_saves(self):   # the first attempt's script saves step 10 before node 1 fails
        if self.kwargs["environment"]["FLEETBOX_ATTEMPT"] == "0":
            (ckpt / "step-00000010").mkdir(parents=True, exist_ok=True)
            (ckpt / "step-00000010" / "COMPLETE").write_text("{}")
        return real_reload(self)
    FakeContainer.reload = attempt0_saves
    try:
        r = b.run(plan, log=lambda _: None)
    finally:
        FakeContainer.reload = real_reload
    assert r.ok and (ckpt / "step-00000010" / "COMPLETE").exists()   # attempt 1 found them where they were
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ck.before-")]


def test_running_the_same_job_id_while_it_runs_is_refused():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan = job(engine)
    b.submit(plan, log=lambda _: None)
    with pytest.raises(UserError, match=f"job {JOB} is running"):
        DockerBackend(connect=engine.connect).plan(make_spec())
    b.cancel(Handle.load(plan.dir), log=lambda _: None)


def test_a_cancel_between_attempts_starts_no_other(tmp_path):
    engine = FakeEngine({0: [Life(code=None), Life(code=0)], 1: [Life(code=3), Life(code=0)]})
    b, plan = job(engine, max_restarts=3)
    real_stop = FakeContainer.stop

    def cancelled_while_stopping(self, timeout=None):   # `invoke cancel` while attempt 0 is being cleaned up
        (plan.dir / "CANCELLED").touch()
        return real_stop(self, timeout)
    FakeContainer.stop = cancelled_while_stopping
    try:
        r = b.run(plan, log=lambda _: None)
    finally:
        FakeContainer.stop = real_stop
    assert not r.ok and len(engine.history) == 2 and all(c.removed for c in engine.history)


def test_jobs_tells_running_orphaned_died_passed_and_cancelled_apart(monkeypatch):
    from fleetbox.commands import jobs
    from fleetbox.processes import process_start
    from fleetbox.run import backends
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan = job(engine)
    b.submit(plan, log=lambda _: None)
    monkeypatch.setattr(backends, "get", lambda name, **kw: DockerBackend(connect=engine.connect))
    h = Handle.load(plan.dir)
    assert h.supervisor == os.getpid() and h.supervisor_start == process_start(os.getpid())
    assert jobs.describe(h)["state"] == "RUNNING"             # this process follows it
    gone = Handle(**{**h.__dict__, "supervisor_start": h.supervisor_start + 1})   # the pid, reused by another
    row = jobs.describe(gone)
    assert row["state"] == "ORPHANED" and "is gone: nothing propagates failures" in row["note"]
    (plan.dir / "summary.json").write_text(json.dumps({"ok": True}))
    assert jobs.describe(gone)["state"] == "PASSED"
    (plan.dir / "summary.json").unlink()
    b.cancel(h, log=lambda _: None, asked=False)             # stopped by an error: its summary says how
    assert jobs.describe(gone)["state"] == "FAILED"
    (plan.dir / "summary.json").unlink()
    assert jobs.describe(gone)["state"] == "DIED"             # no containers, no summary, no supervisor
    (plan.dir / "CANCELLED").touch()
    assert jobs.describe(gone)["state"] == "CANCELLED"


def test_a_ctrl_c_just_after_the_follow_let_go_of_the_job_still_removes_it_marked_cancelled():
    """The follow hands its live part back before it reads the result: a Ctrl-C then finds this process's job with
    no live part. It is still this process's to remove, never "already ended" in place of the interrupt."""
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan = job(engine)
    h = b.submit(plan, log=lambda _: None)
    b.live.pop(h.job_id)
    b.cancel(Handle.load(plan.dir), log=lambda _: None)
    assert engine.all_removed() and (plan.dir / "CANCELLED").read_text() == ""


def test_a_job_followed_from_another_machine_says_where_and_is_not_removed_behind_its_supervisor(monkeypatch):
    """Login nodes share the runs folder: from another one, the supervisor's pid cannot be asked and this
    machine's engine is not the job's; the job is neither DIED nor ORPHANED, and cancel leaves it alone."""
    from fleetbox import processes
    from fleetbox.commands import jobs, train
    from fleetbox.run import backends, records
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan = job(engine)
    b.submit(plan, log=lambda _: None)
    monkeypatch.setattr(backends, "get", lambda name, **kw: DockerBackend(connect=engine.connect))
    here = processes.this_host()
    assert Handle.load(plan.dir).supervisor_host == here and jobs.describe(Handle.load(plan.dir))["state"] == "RUNNING"
    monkeypatch.setattr(records, "this_host", lambda: "login2")   # the same folder, seen from another machine
    h = Handle.load(plan.dir)
    assert h.elsewhere() == here and not h.followed()
    row = jobs.describe(h)
    assert (row["state"], row["note"]) == (
        JobState.UNKNOWN, f"its supervisor (pid {os.getpid()}) runs on {here}: `invoke jobs` there tells its state")
    elsewhere = DockerBackend(connect=engine.connect)   # `invoke cancel` on that machine: not the job's process
    with pytest.raises(UserError, match=f"^job {JOB} is followed by its supervisor on {here} .*cancel it there"):
        elsewhere.cancel(h, log=lambda _: None)
    with pytest.raises(UserError, match=f"^job {JOB} is in a state .*runs on {here}"):   # nor is its id reused there
        train.refuse_live(JOB)
    assert all(c.status == "running" and not c.removes for c in engine.made.values())
    (plan.dir / "summary.json").write_text(json.dumps({"ok": False}))   # it ended there
    assert jobs.describe(h)["state"] == "FAILED"
    with pytest.raises(UserError, match="has already ended"):
        elsewhere.cancel(h, log=lambda _: None)


def test_a_hosts_job_followed_from_another_machine_is_asked_of_its_engines(monkeypatch):
    from fleetbox.run import records
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    b, plan = job(engine)
    b.submit(plan, log=lambda _: None)
    h = Handle.load(plan.dir)
    h.hosts = ["tcp://10.0.0.1:2375", "tcp://10.0.0.2:2375"]   # engines every login node reaches
    monkeypatch.setattr(b, "engine", lambda host: engine)
    monkeypatch.setattr(records, "this_host", lambda: "login2")
    assert b.job_state(h)[0] == JobState.RUNNING and "runs on" in b.job_state(h)[2]
    for c in engine.made.values():
        c._exit(0)
    assert b.job_state(h)[0] == JobState.UNKNOWN


@pytest.mark.parametrize("where", ["source", "destination", "checkpoints"])
def test_a_colon_in_a_bind_is_refused_before_the_job_makes_anything(tmp_path, monkeypatch, where):
    """Docker reads SRC:DST:MODE: a ':' in a path failed at container creation, after the job's folders existed."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    src = tmp_path / ("a:b" if where == "source" else "ab")
    src.mkdir()
    kw = {"mounts": (spec_mod.Mount(str(src), "/data:x" if where == "destination" else "/data"),)}
    if where == "checkpoints":
        kw["checkpoint_dir"] = str(tmp_path / "ck:1")
    with pytest.raises(UserError, match="holds ':', which docker reads as a separator") as e:
        job(FakeEngine(), **kw)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ck:1").exists()


def test_an_engine_error_while_planning_is_one_line(tmp_path, monkeypatch):
    """The engine goes away between connecting and asking for the image: one line, not a traceback."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    engine = FakeEngine()

    def gone(ref):
        raise docker.errors.APIError("500 Server Error: Internal Server Error (\"connection reset\")")
    engine.images.get = gone
    with pytest.raises(UserError, match=r"^the Docker Engine failed while planning the job: 500 Server Error") as e:
        job(engine)
    assert "\n" not in str(e.value)


def test_a_supervisor_that_does_not_stop_in_60_s_is_killed_and_its_job_removed(tmp_path, monkeypatch):
    """Ctrl-C while a detached job starts: its supervisor is asked to stop; one stuck past 60 s is killed and the
    job's containers removed here, not a TimeoutExpired traceback."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    engine = FakeEngine()
    b, plan = job(engine)
    said = []

    class Stuck:
        def __init__(self, *a, **kw):
            said.append("started")

        def poll(self):
            return None

        def terminate(self):
            said.append("terminate")

        def kill(self):
            said.append("kill")

        def wait(self, timeout=None):
            if timeout is not None:
                raise subprocess.TimeoutExpired("supervisor", timeout)
            said.append("reaped")
    monkeypatch.setattr(docker_backend.subprocess, "Popen", Stuck)
    monkeypatch.setattr(docker_backend.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setattr(b, "clean", lambda hosts, job="", force=False, log=print: said.append(("clean", job)))
    with pytest.raises(KeyboardInterrupt):
        b.detach(plan, log=lambda m: None)
    assert said == ["started", "terminate", "kill", "reaped", ("clean", plan.job_id)]


def test_a_jobs_folder_is_private_when_the_job_has_env_values():
    engine = FakeEngine({0: Life(code=0), 1: Life(code=0)})
    b, plan, r, lines = run(engine, spec_kw={"env": {"HF_TOKEN": "secret"}})
    assert r.ok and plan.dir.stat().st_mode & 0o777 == 0o700


def test_a_job_id_another_owner_has_containers_of_is_refused_naming_them():
    """Containers are named by job id, and an engine's names are unique: the start would fail half way (409)."""
    engine = FakeEngine({0: Life(code=0), 1: Life(code=0)})
    twin = FakeContainer(IMAGE, ["sleep"], {"name": f"fleetbox-{JOB}-node0", "labels": {
        settings.LABEL_JOB: JOB, settings.LABEL_RANK: "0", settings.LABEL_OWNER: "ann@0123456789ab"}}, Life(code=0))
    twin.status = "exited"   # left behind, not running: it still holds the name
    engine.made[99] = twin
    with pytest.raises(UserError, match=rf"^job id {JOB} is taken on this machine's engine: container/fleetbox-{JOB}-"
                                        r"node0 is ann@0123456789ab's \(another user, or another runs folder\); "
                                        r"nothing of theirs was touched: give another --job-id$"):
        job(engine)
    twin.labels[settings.LABEL_OWNER] = records.owner()   # this user's own, ended: no refusal
    b, plan = job(engine)
    assert plan.nodes[0].labels[settings.LABEL_OWNER] == records.owner()


def test_hosts_checkpoint_volumes_are_named_for_their_owner():
    a = docker_backend.checkpoint_volume(JOB, "ann@0123456789ab")
    b = docker_backend.checkpoint_volume(JOB, "bob@0123456789ab")
    assert a != b and a.startswith(f"fleetbox-{JOB}-") and a.endswith("-{node}-checkpoints")


def test_the_owner_is_the_user_and_the_runs_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "a"))
    a = records.owner()
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "b"))
    assert a != records.owner() and a.split("@")[0] == records.owner().split("@")[0] == getpass.getuser()
    assert not (tmp_path / "a").exists()   # nothing written to tell it


def test_a_job_cancelled_from_another_machine_has_ended_once_its_summary_or_its_removal_is_written(tmp_path):
    """Its supervisor there is still stopping it (the ranks may be saving a last checkpoint): before, it read as
    CANCELLED, and its checkpoint folder could be taken meanwhile. It has ended once the supervisor wrote its
    summary, or `invoke cancel` removed the containers itself (no summary ever comes then)."""
    (tmp_path / "CANCELLED").touch()
    h = Handle("docker", JOB, str(tmp_path), 2, ["", ""], supervisor=4242, supervisor_start=1,
               supervisor_host="fleetbox-login2")
    state, _, note = DockerBackend(connect=FakeEngine().connect).job_state(h)
    assert (state, note) == (JobState.UNKNOWN, "cancelling: its supervisor (pid 4242) runs on fleetbox-login2")
    (tmp_path / "CANCELLED").write_text(docker_backend.REMOVED + "\n")
    assert DockerBackend(connect=FakeEngine().connect).job_state(h)[0] == JobState.CANCELLED
    files.write_json(tmp_path / "summary.json", {"ok": False})   # a stopped job's summary: still CANCELLED
    assert DockerBackend(connect=FakeEngine().connect).job_state(h)[0] == JobState.CANCELLED
    (tmp_path / "CANCELLED").unlink()
    assert DockerBackend(connect=FakeEngine().connect).job_state(h)[0] == JobState.FAILED


def test_a_stop_marked_where_the_folder_cannot_be_written_still_cancels(monkeypatch):
    """Touching CANCELLED failed (a stale NFS handle, a removed folder): the error replaced the Ctrl-C, and the
    job's containers were never stopped."""
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None, error=KeyboardInterrupt(), errors=1)})
    b, plan = job(engine)
    real = Path.touch
    monkeypatch.setattr(Path, "touch", lambda self, *a, **k: (_ for _ in ()).throw(OSError(116, "Stale file "
                        "handle")) if self.name == "CANCELLED" else real(self, *a, **k))
    with pytest.raises(KeyboardInterrupt):
        b.run(plan, log=lambda _: None)
    assert engine.all_removed()


def test_a_cancel_that_removes_the_containers_itself_says_so_for_other_machines():
    engine = FakeEngine({0: Life(code=None), 1: Life(code=None)})
    starter, plan = job(engine)
    starter.submit(plan, log=lambda _: None)
    h = Handle.load(plan.dir)
    h.supervisor = 0   # nothing follows it (a dead supervisor): cancel removes the containers itself
    DockerBackend(connect=engine.connect).cancel(h, log=lambda _: None)
    assert (plan.dir / "CANCELLED").read_text().strip() == docker_backend.REMOVED
