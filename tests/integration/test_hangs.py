"""Hang detection with the real Docker Engine and real Paddle (Gloo on CPU, two host-network containers): a rank
stuck mid-run or before joining is noticed within its deadline, every rank's stacks are kept, the stuck rank is
named from them, and the job restarts; a slow checkpoint save and a declared long phase are not hangs."""
import datetime as dt
import json
import re
from pathlib import Path

import pytest

from fleetbox.run import hang
from tests.conftest import ROOT, invoke
from tests.integration.conftest import ON_CPU
from tests.integration.test_train import job_containers, summary_of, when

pytestmark = pytest.mark.docker   # its jobs on the default engine, their containers counted (tests/conftest.py)


def metric_times(workerlog) -> dict[int, float]:
    """{step: when its metrics line was printed} of one rank."""
    return {(rec := json.loads(ln.split(" ", 1)[1]))["step"]: rec["time"] for ln in workerlog.read_text().splitlines()
            if ln.startswith("FLEETBOX-METRIC ")}


# The deadline of the tests that hang a rank on purpose: as short as the rule allows (a step here takes
# milliseconds, under the suite's load too), well inside Gloo's own 30 s timeout, which would end the waiting rank
HANG_S = 10


def last_metric_time(workerlog) -> float:
    return max(metric_times(workerlog).values())


def test_a_rank_stuck_mid_run_is_named_from_the_stacks_and_the_job_restarts_and_passes(cpu_image):
    proc = invoke("train", "--nodes", "2", "--hang-timeout", str(HANG_S), "--max-restarts", "1", "--args",
                  "--steps 60 --checkpoint-every 10 --step-sleep 0.05 --hang-rank 1 --hang-step 30 --hang-attempt 0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s = summary_of(proc)
    job = ROOT / s["dir"]
    assert [a["state"] for a in s["attempts"]] == ["HUNG", "PASSED"], s["attempts"]
    assert s["smoke"]["whole_run"] and s["smoke"]["resumed_from"] == 30 and s["smoke"]["params_identical"]
    first = json.loads((job / "attempt0" / "summary.json").read_text())
    h = first["hang"]
    assert (h["kind"], h["ranks"], h["decided"], first["culprit"]) == ("hang", [1], True, 1), h
    assert h["text"].startswith("node1 (rank 1) hung: no progress since step 30 (") and \
        "; in `load_batch_that_never_returns` (smoke.py:" in h["text"] and \
        "rank 0 waiting in `fused_allreduce_gradients` ← `allreduce_gradients` (smoke.py:" in h["text"], h["text"]
    assert [n["state"] for n in first["nodes"]] == ["stopped", "hung"]
    assert s["attempts"][0]["ended"] == h["text"]
    # every rank's stacks (all threads) and last lines are kept
    rank0, rank1 = ((job / "hang-0" / f"rank{r}.txt").read_text() for r in (0, 1))
    assert 'in load_batch_that_never_returns' in rank1 and 'in fused_allreduce_gradients' in rank0
    assert "in _flusher" in rank1   # every thread, not only the main one
    assert "FLEETBOX-METRIC" in rank1.split("== its Python stacks")[0]
    # stopped within the deadline plus 10 s of the stuck rank's last progress
    last = last_metric_time(job / "attempt0" / "node1" / "workerlog.0")
    stopped = max(when(n["finished_at"]).replace(tzinfo=dt.timezone.utc).timestamp() for n in first["nodes"])
    assert HANG_S <= stopped - last <= HANG_S + 10, stopped - last
    assert job_containers(s["job_id"]) == []


# A script as Paddle's own collective training docs write one: no line of fleetbox's. Rank 1 sleeps at step 30 of
# the first attempt, inside its loop (FLEETBOX_ATTEMPT: which attempt this is).
PLAIN = """import os, time
import paddle
import paddle.distributed as dist

def load_batch_that_never_returns():
    time.sleep(600)

dist.init_parallel_env()
model = paddle.DataParallel(paddle.nn.Linear(8, 1))
opt = paddle.optimizer.Adam(parameters=model.parameters())
for step in range(60):
    if dist.get_rank() == 1 and step == 30 and os.environ.get("FLEETBOX_ATTEMPT") == "0":
        load_batch_that_never_returns()
    loss = model(paddle.randn([16, 8])).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    time.sleep(0.05)
print("plain script done", flush=True)
"""


def test_a_plain_script_that_hangs_mid_run_is_noticed_named_and_restarted(cpu_image, tmp_path):
    """No fleetbox helper in the script: its steps are seen in the training itself (the optimizer's step), so a rank
    stuck mid-run is noticed at --hang-timeout, named from the stacks, and the job restarts and passes."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    proc = invoke("train", "--nodes", "2", "--hang-timeout", str(HANG_S), "--max-restarts", "1", "--script",
                  str(script))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s = summary_of(proc)
    assert [a["state"] for a in s["attempts"]] == ["HUNG", "PASSED"], s["attempts"]
    first = json.loads((ROOT / s["dir"] / "attempt0" / "summary.json").read_text())
    h = first["hang"]
    assert (h["kind"], h["ranks"], first["culprit"]) == ("hang", [1], 1), h
    assert h["text"].startswith("node1 (rank 1) hung: no progress since step ") and \
        "in `load_batch_that_never_returns` (plain.py:" in h["text"], h["text"]


def test_gloos_own_timeout_is_read_as_the_hang_it_is_and_the_rank_that_waited_is_never_blamed(cpu_image):
    """3 nodes with the default deadlines (10 min): Gloo's own 30 s timeout ends ranks 0 and 2, which wait for
    stuck rank 1 in the gradients' all-reduce. The stacks are taken while rank 1 is still stuck, rank 1 is named,
    no rank that waited is blamed, the attempt is HUNG; the job restarts and passes."""
    proc = invoke("train", "--nodes", "3", "--max-restarts", "1", "--args",
                  "--steps 60 --checkpoint-every 10 --hang-rank 1 --hang-step 30 --hang-attempt 0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert "timed out waiting in a collective (its own timeout): a peer is stuck; taking every rank's stacks" \
        in proc.stdout
    s = summary_of(proc)
    assert [a["state"] for a in s["attempts"]] == ["HUNG", "PASSED"], s["attempts"]
    first = json.loads((ROOT / s["dir"] / "attempt0" / "summary.json").read_text())
    h = first["hang"]
    assert (h["kind"], h["ranks"], first["culprit"]) == ("collective", [1], 1), h
    states = {n["node"]: (n["state"], n["exit_code"]) for n in first["nodes"]}
    assert states["node1"] == ("hung", 137), states
    # the first to time out ends the attempt; the other waiting rank timed out too, or was stopped still waiting
    timed_out = [k for k in (0, 2) if states[f"node{k}"] == ("timed out", 250)]
    assert timed_out == h["timed_out_nodes"] and timed_out, (states, h)
    for k in {0, 2} - set(timed_out):
        assert states[f"node{k}"][0] == "stopped" and h["where"][str(k)].startswith("waiting in `"), (states, h)
    assert h["text"].startswith("node1 (rank 1) hung: no progress since step 30 (") and \
        "in `load_batch_that_never_returns` (smoke.py:" in h["text"] and \
        f"rank {timed_out[0]} timed out waiting in a collective" in h["text"], h["text"]
    # each ended rank's line is Gloo's timeout, or its connection's end after a peer's timeout (one at least timed out)
    lines = h["timed_out"].values()
    assert all(re.search(hang.WAITED, line) for line in lines) and any("TIMEOUT" in line for line in lines), lines
    assert s["smoke"]["resumed_from"] == 30 and s["smoke"]["whole_run"], s["smoke"]


@pytest.mark.parametrize("how", ["attached", "detached"])
def test_a_rank_that_never_reaches_its_first_step_is_named_at_the_start_deadline(how, request):
    """Detached, the supervisor watches the deadlines: the client is gone once it started the job. The detached
    job runs the GPU image (its ranks on CPU): hang detection's helpers in the other image, under its Paddle."""
    request.getfixturevalue("cpu_image" if how == "attached" else "cuda_image")
    args = [*(ON_CPU if how == "detached" else ()), "--nodes", "2", "--start-timeout", "15", "--args",
            "--steps 20 --hang-rank 1"]
    if how == "attached":
        proc = invoke("train", *args)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stdout[-3000:] + proc.stderr
        said = proc.stderr
        assert said.startswith("fleetbox: train failed: node1 (rank 1) hung"), said
        s = summary_of(proc)
        assert f"job {s['job_id']}: HUNG" in proc.stdout
    else:
        proc = invoke("train", "--detach", *args)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job_id = proc.stdout.split("job ")[1].split()[0]
        follow = invoke("logs", job_id, "--follow", timeout=180)
        assert follow.returncode == 0, follow.stderr
        said = (ROOT / "runs" / job_id / "supervisor.log").read_text()
        s = json.loads((ROOT / "runs" / job_id / "summary.json").read_text())
        assert f"job {job_id}: HUNG" in said, said[-3000:]
    assert "node1 (rank 1) hung: no first step " in said and "in `main` (smoke.py:" in said and \
        "rank 0 waiting in `init_parallel_env`" in said, said[-3000:]
    assert s["hang"]["kind"] == "start" and s["hang"]["ranks"] == [1]
    assert "in main" in (ROOT / "runs" / s["job_id"] / "hang-0" / "rank1.txt").read_text()
    rows = [ln.split() for ln in invoke("jobs").stdout.splitlines() if ln.startswith(s["job_id"] + " ")]
    assert rows[0][3] == "HUNG", rows
    assert job_containers(s["job_id"]) == []


def test_a_slow_checkpoint_save_and_a_declared_long_phase_are_not_hangs(cpu_image):
    # every save writes two files 4 s slower each (8 s in all), the evaluation takes 9 s: both over the 6 s deadline
    proc = invoke("train", "--nodes", "2", "--hang-timeout", "6", "--args",
                  "--steps 50 --checkpoint-every 20 --slow-save 4 --phase-step 45 --phase-seconds 9")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    s = summary_of(proc)
    assert s["ok"] and s["hang"] is None and s["smoke"]["whole_run"]
    log = Path(s["dir"]) / "node0" / "workerlog.0"
    saves = [ln for ln in log.read_text().splitlines() if "saved step" in ln]
    assert len(saves) >= 2, saves
    # the pauses did happen and each outlasted the deadline: the saves after steps 19 and 39, the phase before 45
    t = metric_times(log)
    gaps = {after: t[after + 1] - t[after] for after in (19, 39, 44)}
    assert gaps[19] > 7.5 and gaps[39] > 7.5 and gaps[44] > 8.5, gaps
    assert "taking every rank's stacks" not in proc.stdout


def test_a_straggler_is_named_once_live_and_in_the_report_and_is_no_hang(cpu_image):
    """Rank 1 works 50 ms longer every step; rank 0 waits for it in the all-reduce, so both ranks' steps take as
    long: only their own work tells them apart."""
    proc = invoke("train", "--nodes", "2", "--hang-timeout", "20", "--args", "--steps 100 --slow-rank 1 --slow-ms 50")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    named = [ln for ln in proc.stdout.splitlines() if "straggler: " in ln]
    assert len(named) == 1 and "straggler: node1 (rank 1) works " in named[0], named
    own, others = (float(x) for x in re.findall(r"([\d.]+) ms", named[0]))
    assert 45 <= own <= 100 and others < 15, named
    s = summary_of(proc)
    assert s["ok"] and s["hang"] is None
    md = (Path(s["dir"]) / "report.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("- stragglers: "))
    assert line.startswith("- stragglers: node1 (rank 1): "), line
    own, others = (float(x) for x in re.findall(r"([\d.]+) ms", line))
    assert 45 <= own <= 100 and others < 15, line
