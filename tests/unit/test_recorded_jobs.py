"""Job folders that fleetbox wrote before issue 52 reshaped its records (tests/recorded/jobs/, whose README says
which commit wrote each and how) still read: `invoke jobs`, `logs` and `report` on them give what their records
hold, with no Docker Engine and no Slurm to ask."""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from fleetbox.commands import jobs
from fleetbox.run import records
from fleetbox.run.backends import docker as docker_backend
from fleetbox.run.records import Handle
from tests.conftest import ROOT
from tests.unit.test_cli import one_line_error

RECORDED = ROOT / "tests" / "recorded" / "jobs"
TOKEN = b"@JOB_DIR@"   # where each record had its job folder's absolute path
RESTARTED = "train-20261127-200651-b1e4"   # Docker: node1 killed in attempt 0, restarted, passed
FAILED = "train-20261127-201021-6c8c"      # Docker: 1 node, spawned rank 1 exited 3
DETACHED = "train-20261127-201444-43d0"    # Docker, detached: node1 hung before its first step
DAMAGED = "train-20261127-215841-99d5"     # Docker, passed; its handle.json cut in half
CHAIN = "train-20261127-225842-88dc"       # Slurm: two allocations (jobs 7 and 8), passed
ALL = (RESTARTED, FAILED, DETACHED, DAMAGED, CHAIN)

# Slurm's commands, on PATH: each records that it was asked and fails. A job that has ended is read from its
# files: none of them may be asked.
ASKED = r'''#!{py}
import json, os, sys
with open(os.path.join(os.path.dirname(sys.argv[0]), "asked.jsonl"), "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + "\n")
sys.exit(1)
'''


@pytest.fixture
def runs(tmp_path):
    """Every recorded job folder, in a runs folder of the test's own, with its path back in its records."""
    root = tmp_path / "runs"
    for job in ALL:
        dst = root / job
        shutil.copytree(RECORDED / job, dst)
        for f in dst.rglob("*"):
            if f.is_file() and TOKEN in (data := f.read_bytes()):
                f.write_bytes(data.replace(TOKEN, str(dst).encode()))
    return root


@pytest.fixture
def env(runs, tmp_path):
    """A user's shell with these runs, an engine that is not there, and Slurm's commands that only record."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("scontrol", "squeue", "sacct", "sbatch", "scancel", "srun"):
        (bin_ / name).write_text(ASKED.format(py=sys.executable))
        (bin_ / name).chmod(0o755)
    return {"FLEETBOX_RUNS": str(runs), "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock",
            "PATH": f"{bin_}:{os.environ['PATH']}"}


def asked(env) -> list:
    p = Path(env["PATH"].split(":")[0], "asked.jsonl")
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


def test_every_recorded_folder_holds_only_what_the_job_folder_describes(runs):
    for job in ALL:
        assert records.undescribed(runs / job) == [], job


def test_the_recorded_handles_read_back_whole(runs):
    """Every field a backend follows a job by, as the record holds it (the damaged one: one line that says which
    file)."""
    restarted, detached, chain = (Handle.load(runs / j) for j in (RESTARTED, DETACHED, CHAIN))
    assert (restarted.backend, restarted.nodes, restarted.hosts, restarted.procs_per_node) == ("docker", 2, ["", ""], 1)
    assert restarted.dir == str(runs / RESTARTED) and restarted.checkpoints == str(runs / RESTARTED / "checkpoints")
    assert (restarted.supervisor, restarted.supervisor_start, restarted.owner) == (30405, 192023, "root@bfce88a8cebf")
    assert (detached.supervisor, detached.supervisor_start, detached.supervisor_host) == (6723, 239290, "vm")
    assert (chain.backend, chain.scheduler_job, chain.nodes) == ("slurm", "7", 2)
    assert not hasattr(chain, "supervisor") and not hasattr(chain, "hosts")   # Docker's, empty in its record
    with pytest.raises(records.DamagedRecord, match=r"/handle\.json is damaged: not JSON \(truncated\?\)$"):
        Handle.load(runs / DAMAGED)


def test_jobs_lists_each_recorded_job_as_its_records_say_without_an_engine_or_slurm(run_invoke, env):
    proc = run_invoke("jobs", env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    rows = {ln.split()[0]: ln.split(maxsplit=6) for ln in proc.stdout.splitlines()[1:]}
    assert set(rows) == set(ALL)
    # job, backend, nodes, state, attempt (attempt<N>/ folders; Slurm: allocations), newest complete checkpoint
    assert rows[RESTARTED][:6] == [RESTARTED, "docker", "2", "PASSED", "1", "160"]
    assert rows[FAILED][:4] == [FAILED, "docker", "1", "FAILED"]
    assert rows[DETACHED][:4] == [DETACHED, "docker", "2", "HUNG"]
    assert rows[CHAIN][:6] == [CHAIN, "slurm", "2", "PASSED", "2", "16"]
    assert rows[DAMAGED][:6] == [DAMAGED, "?", "?", "DAMAGED", "-", "-"]
    assert rows[DAMAGED][6].startswith("not JSON (truncated?); `invoke clean --job")
    assert asked(env) == []


def test_logs_of_the_slurm_job_are_the_nodes_log_of_its_last_allocation(run_invoke, env, runs):
    for node in (0, 1):
        proc = run_invoke("logs", CHAIN, "--node", str(node), env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == (runs / CHAIN / f"node{node}.log").read_text().splitlines()
        metrics = [json.loads(ln.split(" ", 1)[1]) for ln in proc.stdout.splitlines()
                   if ln.startswith("FLEETBOX-METRIC ")]
        # allocation 2 (Slurm job 8) ran steps 8..15 from checkpoint 8; allocation 1's lines are in alloc1/
        assert {m["rank"] for m in metrics} == {node} and [m["step"] for m in metrics] == list(range(8, 16))
    assert asked(env) == []


class NoContainers:
    """An engine that holds none of the job's containers (an ended job's are removed): DockerBackend.show_logs
    asks the engine first, whatever the job's state."""
    class containers:
        @staticmethod
        def list(**filters):
            return []


@pytest.mark.parametrize("job,node,last", [
    (RESTARTED, 1, "LAUNCH INFO 2026-11-27 20:07:05,329 Exit code 0"),
    (FAILED, 0, "Exception: Process 1 terminated with exit code 3."),
    (DETACHED, 1, "LAUNCH INFO 2026-11-27 20:15:01,065 Exit with signal 15"),
])
def test_logs_of_a_docker_job_are_its_nodes_container_output(job, node, last, runs, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(runs))
    monkeypatch.setattr(docker_backend.DockerBackend, "engine", lambda self, host: NoContainers())
    said = []
    jobs.logs(job, node, log=said.append)
    lines = "\n".join(said).splitlines()
    assert lines == (runs / job / f"node{node}" / "container.log").read_text().splitlines()
    assert lines[-1] == last


def test_logs_of_an_ended_docker_job_ask_the_engine_today(run_invoke, env):
    """Today an ended Docker job's logs need its engine (show_logs lists the job's containers before it reads
    container.log): without one, one line."""
    one_line_error(run_invoke("logs", RESTARTED, "--node", "1", env=env), "cannot reach the Docker Engine at unix://")


def test_a_damaged_handle_is_one_line_in_logs(run_invoke, env, runs):
    one_line_error(run_invoke("logs", DAMAGED, "--node", "0", env=env),
                   f"{runs / DAMAGED / 'handle.json'} is damaged: not JSON (truncated?)",
                   f"invoke clean --job {DAMAGED} --force")


# What each report says of its job, every figure from the records: the summary's state, attempts and failure,
# job.json's shape, image and Paddle, the worker logs' metrics (the final loss of each rank's last step in the
# last attempt, the steps of every attempt, the last attempt's throughput).
REPORTED = {
    RESTARTED: ["# train-20261127-200651-b1e4: PASSED",
                "- backend: docker, 2 node(s) x 1 process(es)",
                "- image: fleetbox/paddle:cpu (id fb708021fd14, content tag 4f5b09e793a6)",
                "- variant: cpu, Paddle 3.3.1",
                "- final loss: rank 0 0.1397 (step 159), rank 1 0.2714 (step 159)",
                "- throughput: 20526.0 samples/s (attempt 1); node0 9969.6; node1 10556.4",
                "- steps: rank 0 16 (last 159), rank 1 16 (last 159)",
                "- attempt 0 (FAILED): node1 (rank 1) exited with exit code 247",
                "- attempt 1 (PASSED): passed"],
    FAILED: ["# train-20261127-201021-6c8c: FAILED",
             "- backend: docker, 1 node(s) x 2 process(es)",
             "- final loss: none",
             "- failure: node0 (rank 0) ended: its spawned rank 1 exited with exit code 3 (log: workerlog.1)",
             "- rank 0 printed no metrics", "- rank 1 printed no metrics"],
    DETACHED: ["# train-20261127-201444-43d0: HUNG",
               "- backend: docker, 2 node(s) x 1 process(es)",
               "- failure: node1 (rank 1) hung: no first step 12 s after it started (20:14:47); in `main` "
               "(smoke.py:76) ← `<module>` (smoke.py:174). rank 0 waiting in `init_parallel_env` ← `main` "
               "(smoke.py:81)",
               "- stacks and last lines of every rank: {dir}/hang-0"],
    DAMAGED: ["# train-20261127-215841-99d5: PASSED",   # the report reads no handle
              "- final loss: rank 0 0.0266 (step 59), rank 1 0.0298 (step 59)",
              "- steps: rank 0 8 (last 59), rank 1 8 (last 59)"],
    CHAIN: ["# train-20261127-225842-88dc: PASSED",
            "- backend: slurm (none), 2 node(s) x 1 process(es)",
            "- final loss: rank 0 0.4118 (step 15), rank 1 0.4618 (step 15)",
            "- throughput: 5593.8 samples/s (attempt 1); node0 3064.4; node1 2529.3",
            "- steps: rank 0 16 (last 15), rank 1 16 (last 15)",
            "- attempt 0 (PASSED): stopped at the time limit with a checkpoint at step 8; continued in Slurm job 8",
            "- attempt 1 (PASSED): finished at checkpoint step 16"],
}
# metrics lines in each job's worker logs, every attempt's (the report gathers them into metrics.jsonl)
METRICS = {RESTARTED: 32, FAILED: 0, DETACHED: 0, DAMAGED: 16, CHAIN: 32}


@pytest.mark.parametrize("job", ALL)
def test_report_gives_the_figures_the_records_hold(job, run_invoke, env, runs):
    proc = run_invoke("report", job, env=env)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[0] == f"report: {runs / job / 'report.md'} (report.png)"
    md = (runs / job / "report.md").read_text().splitlines()
    for line in REPORTED[job]:
        assert line.format(dir=runs / job) in md, (line, md)
    assert (runs / job / "report.png").stat().st_size > 0
    gathered = runs / job / "metrics.jsonl"
    assert (len(gathered.read_text().splitlines()) if gathered.exists() else 0) == METRICS[job]
    assert asked(env) == []


def test_a_job_folder_removed_while_jobs_lists_is_left_out(tmp_path, monkeypatch):
    """Another shell removes a job's folder between the listing of the runs folder and the reading of its record:
    that job is left out, and the listing goes on."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    gone = tmp_path / "train-20261129-000000-gone" / "handle.json"   # listed, then removed
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter([gone]))
    assert jobs.listing(log=lambda line: None) == []
