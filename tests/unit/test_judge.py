"""One judge for every backend (fleetbox/run/judge.py): the same events on a job's nodes, as each backend records
them (Docker's containers, srun's messages and the chain's records, the pods' statuses, Podman's containers), give
the same node states and the same blamed node from each."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from fleetbox.run.backends import docker as docker_backend
from fleetbox.run.backends import kubernetes as kube
from fleetbox.run.backends import podman_play, slurm, slurm_step
from fleetbox.run.judge import JobFacts, NodeFacts, judge
from fleetbox.run.records import JobState
from tests.unit.test_docker_backend import FakeEngine, job

NODES = 4
T0 = 1_790_000_000.0
CRASH = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\nRuntimeError: boom\n"
# what a peer's worker says when the node it talks to is gone (Paddle 3 on CPU, recorded in tests/probes)
PEER_GONE = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n  what():  [enforce fail at "
             "/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:708] ex_ == nullptr. \n"
             "FatalError: `Process abort signal` is detected by the operating system.\n")
GLOO_TIMEOUT = ("RuntimeError: [/paddle/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                "waiting 30000ms for recv operation to complete\n")


@dataclass(frozen=True)
class End:
    """How one node ended: by itself (`code`, at `at` seconds after T0, saying `said`), stopped by fleetbox or
    the scheduler, or its container removed while the job ran."""
    how: str = "self"          # self | stopped | vanished
    code: int | None = 1
    at: float = 10.0
    said: str = ""
    oom: bool = False


@dataclass(frozen=True)
class Case:
    ends: dict[int, End]
    states: list[str]
    blamed: int | None
    timed_out: bool = False
    hang: dict | None = None
    cancelled: bool = False
    backends: tuple[str, ...] = ("docker", "slurm", "kubectl", "podman")
    oom: int | None = None     # the node said to be OOM-killed


STOPPED = End("stopped", 137, 20.0)
HANG = {"kind": "collective", "ranks": [2], "decided": True, "where": {}, "node": 2,
        "text": "hung: rank 2 stopped in train.py:12", "dir": "", "timed_out": {"0": "Timed out"},
        "timed_out_nodes": [0]}

CASES = {
    # node3 crashes; a moment later its peers' collectives fail (each by itself, before anyone stops them); all
    # in one second, as Kubernetes' finish times tell it
    "crash-then-peers-abort": Case(
        {3: End(at=10.2, said=CRASH), 0: End(at=10.3, said=PEER_GONE), 1: End(at=10.4, said=PEER_GONE),
         2: End(at=10.5, said=PEER_GONE)}, ["aborted", "aborted", "aborted", "FAILED"], 3),
    # the same, but the peers are seen to end first (a launcher that noticed at once): their words decide
    "peers-seen-first": Case(
        {0: End(at=10.1, said=PEER_GONE), 3: End(at=10.2, said=CRASH), 1: End(at=10.3, said=PEER_GONE),
         2: End(at=10.4, said=PEER_GONE)}, ["aborted", "aborted", "aborted", "FAILED"], 3),
    # node2 fails; two seconds later node0 fails of another error of its own (not a peer's): the first to end
    "two-failures": Case({2: End(at=10.0, said=CRASH), 0: End(at=12.0, said="ValueError: its own\n"), 1: STOPPED,
                          3: STOPPED}, ["aborted", "stopped", "FAILED", "stopped"], 2),
    # node1's container removed while the job ran; the others then stopped. Slurm has no container of a node to
    # lose, and a pod deleted by anyone looks as the Job controller's own deletions do: neither can tell it
    "node-removed": Case({1: End("vanished", None), 0: STOPPED, 2: STOPPED, 3: STOPPED},
                         ["stopped", "FAILED", "stopped", "stopped"], 1, backends=("docker", "podman")),
    # node2 hung; rank 0's collective timed out first (Gloo's own 30 s), then hang detection stopped the rest
    "hang-with-a-collective-timeout": Case(
        {0: End(at=10.0, said=GLOO_TIMEOUT), 1: STOPPED, 2: STOPPED, 3: STOPPED},
        ["timed out", "stopped", "hung", "stopped"], 2, hang=HANG),
    # the job's own time limit: every node stopped, no one to blame
    "deadline": Case({k: STOPPED for k in range(NODES)}, ["stopped"] * NODES, None, timed_out=True),
    # node1 killed by the OOM killer; the others stopped after it
    "oom": Case({1: End(code=137, at=10.0, said="Killed\n", oom=True), 0: STOPPED, 2: STOPPED, 3: STOPPED},
                ["stopped", "FAILED", "stopped", "stopped"], 1, oom=1),
    # cancelled (`invoke cancel`): every node stopped. Docker and Podman end an attached job's follow there, with
    # no result to judge (the job folder's CANCELLED says it)
    "cancel": Case({k: STOPPED for k in range(NODES)}, ["stopped"] * NODES, None, cancelled=True,
                   backends=("slurm", "kubectl")),
}


def _rfc3339(t: float, digits: int = 9) -> str:
    whole = dt.datetime.fromtimestamp(int(t), dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return whole + (f".{round((t % 1) * 10**digits):0{digits}d}" if digits else "") + "Z"


def _order(case: Case) -> list[int]:
    """The nodes in the order they ended."""
    return sorted(case.ends, key=lambda k: case.ends[k].at)


def _write_output(path: Path, end: End) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("LAUNCH INFO started\n" + end.said)


def docker_result(case: Case, tmp_path):
    engine = FakeEngine()
    b, plan = job(engine, NODES)
    plan = dataclasses.replace(plan, dir=tmp_path / "docker")
    live = docker_backend._Live(b, plan)
    for k in _order(case):
        end = case.ends[k]
        live.exits.append((k, end.code))
        live.finished[k] = _rfc3339(T0 + end.at) if end.how != "vanished" else ""
        live.oom[k] = end.oom
        live.stopped |= {k} if end.how == "stopped" else set()
        live.gone |= {k} if end.how == "vanished" else set()
        if end.how != "vanished":
            _write_output(plan.dir / f"node{k}" / docker_backend.OUTPUT, end)
    live.timed_out = case.timed_out
    live.hang = case.hang   # what the watcher kept
    return live.result()


def slurm_result(case: Case, tmp_path):
    d = tmp_path / "slurm"
    d.mkdir()
    lines, stopping = [], False
    for k in _order(case):   # srun reports each failed task as it ends; stopped ones after it began stopping
        end = case.ends[k]
        if end.how == "stopped" and not stopping:
            lines.append("srun: launch/slurm: _step_signal: Terminating StepId=77.0")
            stopping = True
        why = "Out Of Memory" if end.oom else "Terminated" if end.how == "stopped" else \
            f"Exited with exit code {end.code}"
        lines.append(f"srun: error: n{k + 1}: task {k}: {why}")
        _write_output(d / f"node{k}.log", end)
    (d / "slurm-77.out").write_text("\n".join(lines) + "\n")
    ended = "cancelled" if case.cancelled else "hung" if case.hang else "failed"
    records = [] if case.timed_out else [{"chain": "77", "allocation": 1, "slurm_job": "77", "ended": ended,
                                          "next": "", "exit": 1, "from_step": 0, "to_step": 0,
                                          "max_allocations": 1}]
    if case.hang is not None:
        (d / "hang-0").mkdir()
        (d / "hang-0" / "hang.json").write_text(json.dumps({**case.hang, "slurm_job": "77"}))
    h = slurm.SlurmHandle("slurm", "train-j", str(d), nodes=NODES, scheduler_job="77")
    state = "TIMEOUT" if case.timed_out else "CANCELLED" if case.cancelled else "FAILED"
    return slurm.SlurmBackend(runtime="podman").result(h, state, "77", records)


def kubectl_result(case: Case, tmp_path):
    d = tmp_path / "kubectl"
    pods = []
    for k, end in case.ends.items():
        term = {} if end.how == "stopped" and case.hang else {
            "exitCode": end.code, "finishedAt": _rfc3339(T0 + end.at, 0),   # the API's times are in seconds
            "reason": "OOMKilled" if end.oom else "Error"}
        md = {"name": f"train-j-{k}-x", "annotations": {kube.INDEX_ANNOTATION: str(k)}}
        if end.how == "stopped" and not case.hang:   # the Job controller (or a cancel) deleting it
            md["deletionTimestamp"] = _rfc3339(T0 + end.at, 0)
        pods.append({"metadata": md, "spec": {"nodeName": f"n{k + 1}"},
                     "status": {"containerStatuses": [{"name": kube.CONTAINER, "state": {"terminated": term}
                                                       if term else {"running": {}}}]}})
        _write_output(d / f"node{k}" / "container.log", end)   # gathered by `kubectl logs` as the job ended
    h = kube.KubeHandle("kubernetes", "train-j", str(d), NODES)
    state, note = (JobState.FAILED, "DeadlineExceeded: Job was active longer than specified deadline") \
        if case.timed_out else (JobState.CANCELLED, "") if case.cancelled else (JobState.FAILED, "BackoffLimitExceeded")
    return judge(kube.pod_facts(pods, h, state, note, case.hang), h.job_id, "kubernetes", h.dir)


def podman_result(case: Case, tmp_path):
    d = tmp_path / "podman"
    ctrs, ends = {}, {}
    for k, end in case.ends.items():
        if end.how == "vanished":
            continue
        ctrs[k] = {"State": "exited", "ExitCode": end.code}
        ends[k] = (T0 + end.at, end.oom)
        _write_output(d / f"node{k}" / "container.log", end)
    stopped = [k for k, end in case.ends.items() if end.how == "stopped"]
    h = kube.KubeHandle("kubernetes", "train-j", str(d), NODES, client="podman")
    return judge(podman_play.played_facts(h, ctrs, ends, stopped, case.timed_out, case.hang), h.job_id, "kubernetes",
                 h.dir)


RESULTS = {"docker": docker_result, "slurm": slurm_result, "kubectl": kubectl_result, "podman": podman_result}


@pytest.mark.parametrize(("name", "backend"), [(n, b) for n, case in CASES.items() for b in case.backends])
def test_every_backend_gives_the_same_verdict_for_the_same_events(name, backend, tmp_path):
    case = CASES[name]
    r = RESULTS[backend](case, tmp_path)
    assert ([n.state for n in r.nodes], r.culprit, r.timed_out, r.ok) == (case.states, case.blamed, case.timed_out,
                                                                          False)
    assert bool(r.hang) == bool(case.hang)
    if case.oom is not None:
        assert [n.oom_killed for n in r.nodes] == [k == case.oom for k in range(NODES)]
        assert r.reason().startswith(f"node{case.oom} (rank {case.oom}) ") and "out of memory" in r.reason()
    if case.blamed is not None and case.ends[case.blamed].how == "self":   # the failure shows its last lines
        assert r.log_tail[-1] == case.ends[case.blamed].said.splitlines()[-1]


def test_the_judge_alone_ranks_a_peers_abort_after_a_crash_in_one_tick(tmp_path):
    """Where the ends tie (a Kubernetes finish time is to the second) and no worker log has a time, the node that
    did not wait for a peer is the one to blame, whatever its rank."""
    out = {}
    for k, said in ((0, PEER_GONE), (1, CRASH)):
        out[k] = tmp_path / f"node{k}.log"
        out[k].write_text(said)
    facts = JobFacts([NodeFacts(k, str(out[k]), exit_code=1, ended=5.0, output=str(out[k])) for k in (0, 1)])
    assert judge(facts, "j", "x", str(tmp_path)).culprit == 1
    out[1].write_text(PEER_GONE)   # both waited: the order seen, as before
    assert judge(facts, "j", "x", str(tmp_path)).culprit == 0


def test_a_time_limit_that_made_the_job_save_to_continue_is_still_a_time_limit(tmp_path):
    """--timeout's stop is a SIGTERM: the script saves, says it will continue and exits 0. The job timed out; only
    a job every node of which ended well, told to stop from outside, is 'stopped to continue'."""
    case = Case({k: End("stopped", 0, 20.0) for k in range(NODES)}, ["ok"] * NODES, None, timed_out=True)
    engine = FakeEngine()
    b, plan = job(engine, NODES)
    Path(plan.checkpoints).mkdir(parents=True, exist_ok=True)
    (Path(plan.checkpoints) / "STATE").write_text(json.dumps({"state": "continue", "step": 40}))
    r = docker_result(case, tmp_path)
    assert (r.timed_out, r.reason()) == (True, "timed out")
    (tmp_path / "told").mkdir()
    live = docker_backend._Live(b, dataclasses.replace(plan, dir=tmp_path / "told"))
    live.exits = [(k, 0) for k in range(NODES)]
    assert live.result().reason() == "stopped at step 40 to continue, before its work was done"


def test_slurm_takes_each_tasks_first_report_and_only_the_jobs_tasks(tmp_path):
    d = tmp_path / "slurm"
    d.mkdir()
    (d / "slurm-77.out").write_text("srun: error: n2: task 1: Exited with exit code 3\n"
                                    "srun: error: n2: task 1: Exited with exit code 3\n"
                                    "srun: error: n9: task 8: Exited with exit code 1\n")
    h = slurm.SlurmHandle("slurm", "train-j", str(d), nodes=2, scheduler_job="77")
    r = slurm.SlurmBackend(runtime="podman").result(h, "FAILED", "77", [])
    assert ([n.state for n in r.nodes], r.culprit) == (["?", "FAILED"], 1)


def test_the_hold_after_a_collective_timeout_is_not_why_node_sh_stopped_its_node(tmp_path):
    from fleetbox.run import node_log
    log = tmp_path / "node0.log"
    log.write_text(f"fleetbox: node 0 on n1: eth0 10.0.0.1 -> master 10.0.0.1:29555\nTraceback ...\n"
                   f"fleetbox: node 0 on n1: workerlog.0 {node_log.HELD}\n")
    assert slurm_step.node_said(log) == ""
    log.write_text("fleetbox: node 0 on n1: `module load dtk/9` failed: no such module\n")
    assert slurm_step.node_said(log) == "`module load dtk/9` failed: no such module"
