"""Hang detection's rules (run/hang.py): when a job counts as stuck, and whom the stacks blame. The stacks are
faulthandler dumps recorded from real 2-rank Paddle jobs (Gloo on CPU, in the fleetbox image) in
tests/probes/hang-stacks/: a rank stuck in a data loader at step 30 and its peer in the gradients' all-reduce
(at-step-*), a rank asleep before joining and its peer in init_parallel_env (at-start-*), and a DataParallel
peer waiting in backward (backward-rank0), and a paddle.Model.fit job whose rank 1 is stuck in its Dataset's
__getitem__, read by the DataLoader's own thread, while rank 0 waits in backward (fit-loader-*)."""
import json
import os
import re
from pathlib import Path

import pytest

from fleetbox import options
from fleetbox.errors import UserError
from fleetbox.run import hang

STACKS = Path(__file__).parent.parent / "probes" / "hang-stacks"


def stack(name):
    return hang.main_stack((STACKS / f"{name}.txt").read_text())


def rec(seq, step=None, phase=None, limit=None, reports=True):
    return {"seq": seq, "step": step, "phase": phase, "phase_limit": limit, "reports": reports}


# -- deadlines --

def test_the_job_is_stuck_when_no_rank_made_progress_for_the_hang_deadline():
    """Lock step: while any rank goes on, the job does (rank 0 may log for all, a rank may have finished)."""
    w = hang.Watch(2, hang_s=20, start_s=100, started=0)
    w.see(0, rec(1, step=1), now=1)
    w.see(1, rec(1, step=1), now=1)
    w.see(0, rec(2, step=2), now=10)
    w.see(1, rec(1, step=1), now=10)          # the same record read again: not progress
    assert w.verdict(now=29.9) is None        # rank 1 idle for 28.9 s, but rank 0 went on at 10
    stall = w.verdict(now=30.5)
    assert stall.kind == "hang" and stall.ranks == [0, 1] and stall.steps == {0: 2, 1: 1}
    assert stall.idle == {0: 20.5, 1: 29.5}


def test_a_rank_that_finished_or_reports_nothing_is_not_waited_for_while_its_peers_go_on():
    w = hang.Watch(3, hang_s=20, start_s=60, started=0)
    w.see(0, rec(1, step=1), now=1)
    w.see(1, rec(1, reports=True), now=1)     # imported the metrics helper, logs nothing itself
    w.see(2, {**rec(1, step=1), "done": True}, now=1)   # finished its share
    for t in range(2, 1000, 10):
        w.see(0, rec(t, step=t), now=t)
        assert w.verdict(now=t + 5) is None


def test_garbage_in_a_progress_file_is_left_aside():
    w = hang.Watch(2, hang_s=20, start_s=60, started=0)
    for bad in (None, [], "x", {"seq": "1"}, {"seq": 1, "step": "3"}, {"seq": 1, "phase": 5},
                {"seq": 1, "phase": "e", "phase_limit": "1h"}, {"seq": 1, "phase": "e", "phase_limit": -1},
                {"seq": 1, "phase": "e", "phase_limit": float("inf")}, {"seq": 1, "phase": "e", "phase_limit": True}):
        w.see(0, bad, now=1)
    assert w.records == {} and w.verdict(now=10 ** 6) is None


def test_before_the_first_step_only_the_start_deadline_counts():
    w = hang.Watch(2, hang_s=5, start_s=60, started=0)
    w.see(0, rec(1), now=1)                   # started, says it will report, no step yet
    w.see(1, rec(1), now=1)
    assert w.verdict(now=59) is None          # the hang deadline does not apply before a first step
    stall = w.verdict(now=61)
    assert stall.kind == "start" and stall.ranks == [0, 1] and stall.steps == {0: None, 1: None}


def test_a_rank_whose_process_never_started_is_late_at_the_start_deadline():
    w = hang.Watch(2, hang_s=5, start_s=60, started=0)
    w.see(0, rec(1, reports=False), now=1)    # a script that reports nothing: its started rank is never late
    assert w.verdict(now=59) is None
    assert w.verdict(now=61).ranks == [1] and w.verdict(now=61).kind == "start"
    w.see(1, rec(1, reports=False), now=1001)
    assert w.verdict(now=10 ** 6) is None


def test_nothing_at_all_arriving_is_never_a_hang():
    """An image whose Python does not run our helpers: no file from any rank, nothing to judge by."""
    w = hang.Watch(4, hang_s=5, start_s=5, started=0)
    w.see(0, None, now=1)
    w.see(9, rec(1), now=1)                   # not a rank of this job
    assert w.verdict(now=10 ** 6) is None


def test_a_phase_on_any_rank_holds_the_deadline_for_all_up_to_its_limit_or_the_start_deadline():
    w = hang.Watch(2, hang_s=10, start_s=100, started=0)
    w.see(0, rec(1, step=5), now=1)
    w.see(1, rec(1, step=5, phase="evaluation", limit=30), now=1)   # rank 1 only: rank 0 waits for it
    assert w.verdict(now=30.9) is None and w.verdict(now=31.5).kind == "hang"
    w.see(1, rec(2, step=6), now=31.5)        # the phase ended: the hang deadline again
    assert w.verdict(now=41) is None and w.verdict(now=42) is not None
    w.see(0, rec(2, step=6, phase="checkpoint save"), now=42)       # no limit: the start deadline
    assert w.verdict(now=141) is None and w.verdict(now=142.5) is not None


def test_with_no_start_deadline_a_phase_keeps_its_own_limit_or_holds_the_deadline_while_it_lasts():
    """--start-timeout 0 turns off the start-up deadline, not the phases: a checkpoint save longer than
    --hang-timeout is no hang (it was: its limit fell back to the start deadline, 0)."""
    w = hang.Watch(2, hang_s=10, start_s=0, started=0)
    w.see(0, rec(1, step=5), now=1)
    w.see(1, rec(1, step=5, phase="checkpoint save"), now=1)   # no limit of its own: the default start deadline's
    assert w.verdict(now=1 + hang.START_TIMEOUT_S - 1) is None
    assert w.verdict(now=1 + hang.START_TIMEOUT_S + 1).kind == "hang"   # a rank stuck in a save is still found
    w.see(1, rec(2, step=6, phase="evaluation", limit=30), now=2)   # its own limit holds
    assert w.verdict(now=31.9) is None and w.verdict(now=32.5).kind == "hang"


def test_zero_turns_each_deadline_off():
    w = hang.Watch(1, hang_s=0, start_s=0, started=0)
    w.see(0, rec(1, step=1), now=1)
    assert w.verdict(now=10 ** 6) is None
    w = hang.Watch(2, hang_s=0, start_s=0, started=0)
    w.see(0, rec(1), now=1)
    assert w.verdict(now=10 ** 6) is None


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("20m", 1200), ("1h", 3600), ("0", 0),
                                          ("1.5m", 90), (None, 600)])
def test_durations(text, seconds):
    assert options.duration("--hang-timeout", text, 600) == seconds


@pytest.mark.parametrize("text", ["-5", "5x", "m", "1e3", "ten"])
def test_a_duration_that_is_not_one_is_one_line(text):
    with pytest.raises(UserError, match=r"--hang-timeout takes seconds, or minutes or hours like 90, 90s, 20m, "
                                        r"1h; 0 turns it off"):
        options.duration("--hang-timeout", text, 600)


@pytest.mark.parametrize("text,seconds", [("90", 90), ("90s", 90), ("5m", 300), ("1h", 3600), ("2.5", 2.5)])
def test_every_duration_option_takes_the_same_forms(text, seconds):
    """Before, --timeout took plain seconds only while --hang-timeout took 5m."""
    assert options.seconds("--timeout", text) == options.duration("--hang-timeout", text, 0) == seconds


# -- the stacks --

def test_the_main_thread_is_read_not_the_progress_thread():
    frames = stack("at-step-rank1")
    assert [f.func for f in frames] == ["load_batch_that_never_returns", "main", "<module>"]
    assert hang.main_stack("nothing like a dump\n") is None


def test_collectives_are_told_from_the_rest():
    assert hang.collective(stack("at-step-rank0")).func == "fused_allreduce_gradients"
    assert hang.collective(stack("at-start-rank0")).func == "init_parallel_env"
    assert hang.collective(stack("backward-rank0")).func == "backward"
    assert hang.collective(stack("at-step-rank1")) is None and hang.collective(stack("at-start-rank1")) is None


def test_the_one_rank_outside_a_collective_is_blamed():
    b = hang.blame({0: stack("at-step-rank0"), 1: stack("at-step-rank1")}, 2)
    assert (b.ranks, b.decided) == ([1], True)
    assert b.where == {0: "waiting in `fused_allreduce_gradients` ← `allreduce_gradients` (smoke.py:155)",
                       1: "in `load_batch_that_never_returns` (smoke.py:144) ← `main` (smoke.py:93)"}
    b = hang.blame({0: stack("at-start-rank0"), 1: stack("at-start-rank1")}, 2)
    assert (b.ranks, b.where[0]) == ([1], "waiting in `init_parallel_env` ← `main` (smoke.py:73)")
    b = hang.blame({0: stack("backward-rank0"), 1: stack("at-step-rank1"), 2: stack("backward-rank0")}, 3)
    assert (b.ranks, b.where[0]) == ([1], "waiting in `backward` ← `<module>` (dp.py:12)")


def test_two_ranks_outside_a_collective_cannot_be_decided():
    b = hang.blame({0: stack("at-step-rank0"), 1: stack("at-step-rank1"), 2: stack("at-start-rank1")}, 3)
    assert (b.ranks, b.decided) == ([], False)


def test_a_rank_that_gives_no_stack_is_not_named():
    """A stack goes missing for other reasons (an image without the relay, a slow file system): never a guess."""
    b = hang.blame({0: stack("at-step-rank0"), 2: stack("backward-rank0")}, 3)
    assert (b.ranks, b.decided, b.where[1]) == ([], False, "gave no stack")
    assert not hang.blame({0: stack("at-step-rank1")}, 2).decided       # one outside, one silent


def test_a_rank_in_its_own_code_under_a_wrapper_of_paddles_is_not_in_a_collective():
    """DataParallel's forward (in paddle/distributed/) calls the model: a rank stuck in the model is in its own
    code; with NCCL its healthy peer may wait at a host sync, outside too: undecided, not the wrong rank."""
    own = hang.main_stack('''Current thread 0x00007f0adf580100 (most recent call first):
  File "/workspace/model.py", line 30 in forward
  File "/opt/venv/lib/python3.11/site-packages/paddle/nn/layer/layers.py", line 1426 in _dygraph_call_func
  File "/opt/venv/lib/python3.11/site-packages/paddle/distributed/parallel.py", line 560 in forward
  File "/opt/venv/lib/python3.11/site-packages/paddle/nn/layer/layers.py", line 1426 in __call__
  File "/workspace/train.py", line 12 in <module>
''')
    sync = hang.main_stack('''Thread 0x00007f0adf580100 [MainThread] (most recent call first):
  File "/opt/venv/lib/python3.11/site-packages/paddle/base/dygraph/math_op_patch.py", line 201 in __float__
  File "/workspace/train.py", line 14 in <module>
''')   # Python 3.14 names the thread
    assert hang.collective(own) is None and hang.where(own) == "in `forward` (model.py:30) ← `<module>` (train.py:12)"
    assert sync is not None and hang.collective(sync) is None
    assert not hang.blame({0: sync, 1: own}, 2).decided
    assert hang.blame({0: stack("at-step-rank0"), 1: own}, 2).ranks == [1]


def test_every_rank_in_a_collective_cannot_be_decided():
    """Mismatched collectives (rank 0 in the all-reduce, rank 1 still in init): every rank waits."""
    b = hang.blame({0: stack("at-step-rank0"), 1: stack("at-start-rank0")}, 2)
    assert (b.ranks, b.decided) == ([], False)


def test_the_summary_line_names_the_rank_where_it_is_and_where_its_peers_wait():
    stall = hang.Stall("hang", [1], idle={0: 21.0, 1: 20.4}, steps={0: 30, 1: 29},
                       since={0: 1795503486.0, 1: 1795503485.0})
    b = hang.blame({0: stack("at-step-rank0"), 1: stack("at-step-rank1")}, 2)
    text = hang.summary(stall, b)
    at = __import__("time").strftime("%H:%M:%S", __import__("time").localtime(1795503485.0))
    assert text == (f"node1 (rank 1) hung: no progress since step 29 ({at}, 20 s); in "
                    f"`load_batch_that_never_returns` (smoke.py:144) ← `main` (smoke.py:93). rank 0 waiting in "
                    f"`fused_allreduce_gradients` ← `allreduce_gradients` (smoke.py:155)")
    assert hang.summary(stall, b, procs_per_node=2).startswith("node0 (rank 1) hung")
    undecided = hang.blame({0: stack("at-step-rank0"), 1: stack("at-start-rank0")}, 2)
    text = hang.summary(stall, undecided)
    assert text.startswith("the job hung: rank 1: no progress since step 29") and \
        "the stacks cannot tell which rank is stuck: rank 0 waiting in `fused_allreduce_gradients`" in text and \
        "rank 1 waiting in `init_parallel_env`" in text
    start = hang.Stall("start", [1], idle={0: 30.0, 1: 30.0}, steps={0: None, 1: None}, since={0: 0.0, 1: 0.0})
    assert "no first step 30 s after it started" in hang.summary(start, hang.blame(
        {0: stack("at-start-rank0"), 1: stack("at-start-rank1")}, 2))


def test_with_both_deadlines_off_nothing_of_detection_runs_in_the_containers():
    """No FLEETBOX_PROGRESS_DIR: the helpers write no progress, sitecustomize registers nothing (bench/hang.py
    measures on against off)."""
    from fleetbox.image import matrix
    from fleetbox.run import plan, spec
    on = spec.JobSpec(variant=matrix.load().get("cpu"))
    assert plan.template(on, "j", "/logs").env["FLEETBOX_PROGRESS_DIR"] == "/fleetbox/logs"
    for hang_s, start_s in ((0, 900), (600, 0)):
        one = spec.JobSpec(variant=matrix.load().get("cpu"), hang_timeout=hang_s, start_timeout=start_s)
        assert "FLEETBOX_PROGRESS_DIR" in plan.template(one, "j", "/logs").env
    off = spec.JobSpec(variant=matrix.load().get("cpu"), hang_timeout=0, start_timeout=0)
    assert "FLEETBOX_PROGRESS_DIR" not in plan.template(off, "j", "/logs").env


@pytest.mark.parametrize("given,said", [
    ([], "hang detection: no progress for 10 min; no first progress within 15 min -> every rank's stacks kept, "
         "the job stopped as after a failure; Gloo's own 30 s collective timeout (Paddle sets no other) ends the "
         "ranks that wait for a stuck one first: read as a hang, the stuck rank named from the others' stacks. "
         "Progress: fleetbox_metrics, fleetbox_checkpoint or fleetbox_progress steps, else the training's own (an "
         "optimizer's step, a static program's run, a data loader's batch); paddle.save and paddle.load are phases"),
    (["--hang-timeout", "90s", "--start-timeout", "0"], "hang detection: no progress for 90 s; no start-up deadline "
                                                         "(--start-timeout 0) -> every rank's stacks kept"),
    (["--hang-timeout", "0", "--start-timeout", "0"],
     "hang detection: off (--hang-timeout 0 --start-timeout 0): nothing of it runs in the job"),
])
@pytest.mark.parametrize("backend", ["docker", "slurm"])
def test_dry_run_says_the_deadlines_before_the_backends_files(run_invoke, backend, given, said):
    # slurm: an image named, so whatever this machine's engine holds, the plan is the same
    slurm = ["--runtime", "podman", "--image", "fleetbox/paddle:cpu"]
    proc = run_invoke("train", "--backend", backend, *(slurm if backend == "slurm" else []), "--dry-run", *given)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# " + said), lines[0]
    watcher = any("hang.py" in ln and "python3 -I" in ln for ln in lines)
    assert watcher is (backend == "slurm" and "off" not in said), lines   # the batch script's watcher, if any


def _rec(seq, own=None, own_n=0, step=5, done=False):
    return {"seq": seq, "step": step, "reports": True, "own_s": own, "own_n": own_n, "done": done}


def test_a_straggler_is_named_once_when_its_own_time_over_a_full_window_is_well_above_the_others():
    w = hang.Watch(world=3, hang_s=60, start_s=60)
    for r, own in ((0, 0.002), (1, 0.0021), (2, 0.052)):
        w.see(r, _rec(1, own, own_n=hang.STRAGGLER_STEPS - 1))
    assert w.new_stragglers(ppn=1) == []   # not over a whole window yet
    for r, own in ((0, 0.002), (1, 0.0021), (2, 0.052)):
        w.see(r, _rec(2, own, own_n=hang.STRAGGLER_STEPS))
    assert w.new_stragglers(ppn=1) == [
        "straggler: node2 (rank 2) works 52.0 ms a step on its own against 2.0 ms for the other ranks (median of its "
        "last 20 steps, 25.4x): every step waits for it"]
    w.see(2, _rec(3, 0.06, own_n=hang.STRAGGLER_STEPS))
    assert w.new_stragglers(ppn=1) == []   # one line, not a flood
    assert w.verdict() is None             # slow is not stuck


@pytest.mark.parametrize("own,slow", [
    ({0: 0.010, 1: 0.0151}, {1: 0.010}),           # just over 1.5x and 5 ms more
    ({0: 0.010, 1: 0.0149}, {}),
    ({0: 0.001, 1: 0.004}, {}),                    # 4x but 3 ms: noise on a short step
    ({0: 0.0, 1: 0.006}, {1: 0.0}),                # peers that only wait
    ({0: 0.05, 1: 0.05, 2: 0.2, 3: 0.21}, {2: 0.05, 3: 0.05}),   # two slow ranks of four: both named
    ({0: 0.05}, {}),                               # one rank: no others to compare with
])
def test_the_straggler_rule(own, slow):
    assert hang.stragglers(own) == pytest.approx(slow)


def test_progress_records_keep_a_ranks_own_time_only_when_it_is_a_number():
    assert hang.clean(_rec(1, 0.01, 20))["own_s"] == 0.01
    for bad in ("0.01", -1, float("inf"), float("nan"), True, 10**400):   # 10**400: no float holds it
        assert hang.clean(_rec(1, bad, 20))["own_s"] is None
    assert hang.clean({"seq": 1, "phase": "e", "phase_limit": 10**400}) is None
    w = hang.Watch(world=2, hang_s=60, start_s=60)
    w.see(0, _rec(1, 10**400, 20))
    w.see(1, _rec(1, 0.01, 20))
    assert w.new_stragglers(ppn=1) == [] and w.verdict() is None   # the watcher goes on
    assert hang.clean({"seq": 1})["own_n"] == 0


def test_the_helpers_window_is_the_one_the_watcher_waits_for(tmp_path, monkeypatch):
    """fleetbox_metrics' Meter gives the step's own time (less comm_seconds); the progress file its running
    median over fleetbox_progress.WINDOW steps, which the watcher reads."""
    from fleetbox.incontainer import fleetbox_metrics, fleetbox_progress
    assert fleetbox_progress.WINDOW == hang.STRAGGLER_STEPS
    monkeypatch.setenv("FLEETBOX_PROGRESS_DIR", str(tmp_path))
    monkeypatch.setenv("PADDLE_TRAINER_ID", "0")
    monkeypatch.setenv(fleetbox_progress.OWNER_ENV, str(os.getpid()))
    monkeypatch.setattr(fleetbox_progress, "_own", type(fleetbox_progress._own)(maxlen=fleetbox_progress.WINDOW))
    monkeypatch.setattr(fleetbox_progress, "_warm", fleetbox_progress.WARM_UP)   # past the warm-up
    meter = fleetbox_metrics.Meter()
    times = iter([0.0, 0.030, 0.060, 0.100] + [0.1 + 0.02 * i for i in range(1, 40)])
    monkeypatch.setattr(fleetbox_metrics.time, "perf_counter", lambda: next(times))
    meter.last = next(times)
    for step, comm in enumerate([0.025, 0.010, 0.030] + [0.015] * 39):
        meter.step(step, loss=1.0, samples=8, comm_seconds=comm)
    fleetbox_progress._write()
    rec = hang.clean(json.loads((tmp_path / "progress-rank0.json").read_text()))
    # steps of 30, 30, 40 ms, then 20 ms each with 15 ms of waiting: 5 ms of own work each, the last 20
    assert rec["own_n"] == 20 and rec["own_s"] == pytest.approx(0.005)


def test_a_rank_waiting_for_its_data_loaders_thread_is_where_that_thread_is():
    """fit's DataLoader reads batches in a thread (num_workers=0 too): the main thread waits in `__next__`, the
    script's own code that is stuck runs in the loader's thread."""
    stacks = {0: stack("fit-loader-rank0"), 1: stack("fit-loader-rank1")}
    assert [f.func for f in stacks[1][:3]] == ["trouble", "__getitem__", "__next__"]
    b = hang.blame(stacks, 2)
    assert b.decided and b.ranks == [1]
    assert b.where == {0: "waiting in `backward` ← `main` (fit.py:78)",
                       1: "in `trouble` (fit.py:72) ← `__getitem__` (fit.py:35)"}


# -- a collective's own timeout (Gloo's 30 s): the ranks it ends waited for a stuck one --

TIMEOUTS = Path(__file__).parent.parent / "probes" / "collective-timeout"


def folder(logs: dict[int, str]):
    """read(node, name, last) over workerlog.0 texts, one rank per node."""
    def read(k, name, last=None):
        data = logs.get(k, "").encode() if name == "workerlog.0" else None
        return data[-last:] if data is not None and last else data
    return read


def test_the_ranks_a_collective_timeout_ended_are_read_from_their_logs():
    """Recorded in the fleetbox image: a plain script's rank (Gloo's exception ends the process) and smoke.py's,
    which catches it and prints it; a peer that died instead (the connection closed) is not a timeout, nor is the
    script's own."""
    plain = (TIMEOUTS / "gloo-plain-rank0.log").read_text()
    caught = (TIMEOUTS / "gloo-caught-rank0.log").read_text()
    died = "W1127 backward.cc:697] gloo::IoException\n  what():  [/paddle/third_party/gloo/gloo/transport/tcp/" \
           "pair.cc:534] Connection closed by peer [10.213.77.12]:29105\n"
    own = "RuntimeError: TIMEOUT: the data server did not answer in 30 s\n"   # the script's own, not Gloo's
    got = hang.timed_out(folder({0: plain, 1: "step 29\n", 2: caught, 4: own}), range(5), 1)
    assert sorted(got) == [0, 2]
    assert got[0].startswith("what():  [/paddle/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:80] TIMEOUT")
    assert got[2].startswith("gradient all-reduce failed: [/paddle/third_party/gloo/")
    # a peer's end, where a timeout ended that peer: it waited in the same collective; alone: a crash's cascade
    assert sorted(hang.timed_out(folder({0: plain, 3: died}), range(4), 1)) == [0, 3]
    assert hang.timed_out(folder({3: died, 4: own}), range(5), 1) == {}
    # recorded: 3 ranks, rank 1 stuck; rank 2 timed out, and rank 0's Gloo I/O thread aborted on the connection
    # rank 2 closed, before rank 0's own timeout could say so
    aborted = (TIMEOUTS / "gloo-loop-abort-rank0.log").read_text()
    got = hang.timed_out(folder({0: aborted, 1: "step 29\n", 2: caught}), range(3), 1)
    assert sorted(got) == [0, 2] and "pair.cc:708] ex_ == nullptr" in got[0], got
    assert hang.timed_out(folder({0: aborted}), range(3), 1) == {}   # alone: a crash's cascade


def test_a_rank_a_collective_timeout_ended_waited_and_its_stuck_peer_is_named():
    """The ended rank gives no stack (its process is gone); its log says it waited in a collective."""
    stacks = {0: None, 1: stack("at-step-rank1")}
    b = hang.blame(stacks, 2, {0: "TIMEOUT"})
    assert (b.ranks, b.decided, b.where[0]) == ([1], True, "timed out waiting in a collective")
    assert not hang.blame(stacks, 2).decided   # without its log's word, a missing stack is never a guess
    # a stuck rank's peer that the timeout has not ended yet still waits in its collective
    b = hang.blame({0: None, 1: stack("at-step-rank1"), 2: stack("at-step-rank0")}, 3, {0: "TIMEOUT"})
    assert b.ranks == [1]


def collective_verdict(tmp_path, logs: dict[int, str], first: int) -> dict:
    """hang.keep after rank `first` timed out in a collective: one rank per node with the `logs` (workerlog.0
    texts), rank 1 stuck at step 30 with its stack (the others at step 29, no stack: gone)."""
    for k, text in logs.items():
        (tmp_path / f"node{k}").mkdir()
        (tmp_path / f"node{k}" / "workerlog.0").write_text(text)
    (tmp_path / "node1" / "stacks-rank1.txt").write_text((STACKS / "at-step-rank1.txt").read_text())
    w = hang.Watch(len(logs), 600, 900)
    for r in logs:
        w.see(r, rec(1, step=30 if r == 1 else 29))
    return hang.keep(str(tmp_path / "hang-0"), hang.NodeFiles(str(tmp_path)).read, len(logs), 1, 0, {},
                     w.stall("collective", [first]))


def test_after_a_collective_timeout_the_record_names_the_stuck_rank_and_the_ranks_that_timed_out(tmp_path):
    rec_ = collective_verdict(tmp_path, {0: (TIMEOUTS / "gloo-plain-rank0.log").read_text(), 1: "step 30\n"}, 0)
    assert (rec_["kind"], rec_["ranks"], rec_["node"], rec_["timed_out_nodes"]) == ("collective", [1], 1, [0])
    assert rec_["text"].startswith("node1 (rank 1) hung: no progress since step 30 (") and \
        rec_["text"].endswith("rank 0 timed out waiting in a collective"), rec_["text"]
    assert "TIMEOUT" in rec_["timed_out"]["0"]


def test_a_rank_whose_gloo_thread_aborted_in_the_cascade_is_not_taken_for_the_stuck_one(tmp_path):
    """Recorded (3 nodes, rank 1 stuck at step 30): rank 2 timed out, rank 0 aborted in Gloo's I/O thread; neither
    gave a stack (both gone). Rank 1, the only rank outside a collective, is named."""
    got = collective_verdict(tmp_path, {0: (TIMEOUTS / "gloo-loop-abort-rank0.log").read_text(), 1: "step 29\n",
                                        2: (TIMEOUTS / "gloo-caught-rank0.log").read_text()}, 2)
    assert (got["ranks"], got["decided"], got["timed_out_nodes"]) == ([1], True, [0, 2]), got


def test_a_stuck_rank_whose_gloo_thread_also_saw_a_peer_go_is_still_named_by_its_stack(tmp_path):
    """The abort line comes from Gloo's I/O thread: it says nothing of where the rank's main thread is."""
    got = collective_verdict(tmp_path, {0: (TIMEOUTS / "gloo-caught-rank0.log").read_text(),
                                        1: (TIMEOUTS / "gloo-loop-abort-rank0.log").read_text()}, 0)
    assert (got["ranks"], got["decided"], got["timed_out_nodes"]) == ([1], True, [0]), got


def test_the_ranks_that_timed_out_are_not_waited_for_when_taking_stacks(tmp_path):
    """Their processes are gone: asking them would cost the whole wait."""
    import time
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").mkdir()
    read = hang.NodeFiles(str(tmp_path)).read

    def write(k, name, data):   # node 1's relay answers at once; node 0 has none left
        (tmp_path / f"node{k}" / name).write_bytes(data)
        if k == 1:
            (tmp_path / "node1" / "stacks-rank1.txt").write_text("dump")
    t0 = time.monotonic()
    hang.ask_for_stacks(read, write, 2, 1, 0, wait=5, poll=0.05, gone=[0])
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("variant,given,want", [
    ("cu126", [], "1800000"),                                  # Paddle's own 30 min is above our deadlines
    ("cu126", ["--hang-timeout", "45m"], str((45 * 60 + 300) * 1000)),   # raised above ours
    ("cu126", ["--env", "PADDLE_PG_TIMEOUT=60000"], "60000"),   # the user's own wins, and is said so
    ("cpu", [], None),                                          # Gloo reads no such setting
    ("cu126", ["--hang-timeout", "0", "--start-timeout", "0"], None),
])
def test_nccls_timeout_is_set_above_fleetboxs_deadlines_and_the_dry_run_says_which_applies(run_invoke, variant,
                                                                                          given, want):
    proc = run_invoke("train", "--backend", "slurm", "--runtime", "apptainer", "--image", "/dev/null",
                      "--variant", variant, "--dry-run", *given)
    assert proc.returncode == 0, proc.stderr
    said = re.findall(r"PADDLE_PG_TIMEOUT=(\d+)", proc.stdout)
    assert said == ([want] * 2 if want else []), said   # the first line, then the node's export
    if variant == "cpu":
        assert "Gloo's own 30 s collective timeout" in proc.stdout.splitlines()[0]
    if "--env" in given:
        assert "PADDLE_PG_TIMEOUT=60000 ms (your --env)" in proc.stdout.splitlines()[0]


def watch(job_dir, nodes, srun_pid, quiet):
    """run/hang.py as the batch script runs it (a program, -I), its quiet time before a timeout counts as a hang
    set to `quiet` seconds (20 in a job: a test cannot wait that long)."""
    import subprocess
    import sys
    run = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('hang', {hang.__file__!r}); "
           f"m = sys.modules['hang'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
           f"m.TIMEOUT_QUIET_S = {quiet}; "
           f"sys.exit(m.main({[str(job_dir), str(nodes), '1', '600', '900', '0', str(srun_pid)]!r}))")
    return subprocess.Popen([sys.executable, "-I", "-c", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_the_slurm_watcher_takes_no_timeout_for_a_hang_while_the_job_was_moving(tmp_path):
    """Gloo names a peer's death a TIMEOUT too, at once: a rank that crashed leaves its peer's log with one. The
    job had made progress within the quiet time: no stacks are taken, nothing is stopped."""
    import subprocess
    import time
    for k in (0, 1):
        (tmp_path / f"node{k}").mkdir()
        (tmp_path / f"node{k}" / f"progress-rank{k}.json").write_text(json.dumps(rec(5, step=9)))
    (tmp_path / "node0" / "workerlog.0").write_text((TIMEOUTS / "gloo-plain-rank0.log").read_text())
    srun = subprocess.Popen(["bash", "-c", "exec -a srun sleep 60"])
    watcher = watch(tmp_path, 2, srun.pid, quiet=30.0)
    try:
        time.sleep(1.5)   # it has seen the progress
        (tmp_path / "node0" / hang.TIMED_OUT).touch()
        time.sleep(2.5)
        assert watcher.poll() is None and srun.poll() is None and not (tmp_path / "hang-0").exists()
        assert not (tmp_path / "node1" / hang.REQUEST).exists()
    finally:
        srun.kill()
        watcher.kill()


def test_the_slurm_watcher_takes_the_stacks_when_a_node_says_its_rank_timed_out_in_a_collective(tmp_path):
    """run/hang.py as the batch script runs it, 3 nodes, rank 1 stuck: node.sh's marks, rank 1's relay answering
    the request, a stand-in for srun. Node 2's mark alone (its peer closed the connection) is no hang; once node 0
    says its rank timed out, the watcher keeps the stacks naming rank 1, stops 'srun' and exits 3, long before any
    deadline, waiting for no rank of a marked node."""
    import subprocess
    import threading
    import time
    for k in (0, 1, 2):
        (tmp_path / f"node{k}").mkdir()
        (tmp_path / f"node{k}" / f"progress-rank{k}.json").write_text(json.dumps(rec(5, step=29 + (k == 1))))
    died = "what():  [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.1.1.1]:7"
    (tmp_path / "node2" / "workerlog.0").write_text(died + "\n")
    (tmp_path / "node2" / hang.TIMED_OUT).touch()
    srun = subprocess.Popen(["bash", "-c", "exec -a srun sleep 60"])
    answered = threading.Event()

    def relay():   # node 1's launcher: a stack dump once asked
        while not (tmp_path / "node1" / hang.REQUEST).exists():
            time.sleep(0.05)
        (tmp_path / "node1" / "stacks-rank1.txt").write_text((STACKS / "at-step-rank1.txt").read_text())
        answered.set()
    threading.Thread(target=relay, daemon=True).start()
    watcher = watch(tmp_path, 3, srun.pid, quiet=1.0)
    try:
        time.sleep(2.5)   # the watcher looks once a second: it has seen node 2's mark
        assert watcher.poll() is None and not (tmp_path / "hang-0").exists()
        (tmp_path / "node0" / "workerlog.0").write_text((TIMEOUTS / "gloo-plain-rank0.log").read_text())
        (tmp_path / "node0" / hang.TIMED_OUT).touch()
        t0 = time.monotonic()
        out, err = watcher.communicate(timeout=60)
        took = time.monotonic() - t0
        assert watcher.returncode == 3 and answered.is_set(), out + err
        assert took < hang.STACKS_WAIT_S, took   # nodes 0 and 2 are not waited for: their ranks are gone
        assert srun.wait(timeout=15) is not None
        record = json.loads((tmp_path / "hang-0" / "hang.json").read_text())
        assert (record["kind"], record["node"], record["timed_out_nodes"]) == ("collective", 1, [0, 2])
        assert out.splitlines()[0] == ("fleetbox: rank 0, rank 2 timed out waiting in a collective (its own "
                                       "timeout): a peer is stuck; taking every rank's stacks, then stopping the job")
    finally:
        srun.kill()
        watcher.kill()


class Answering(hang.NodeFiles):
    """Node folders on one file system whose nodes' relays answer a request for stacks at once, each rank with its
    recorded dump (as sitecustomize's relay does); the requests counted per node."""

    def __init__(self, job_dir, dumps: dict[int, str]):
        super().__init__(job_dir)
        self.dumps, self.asked = dumps, []

    def write(self, k, name, data):
        super().write(k, name, data)
        if name == hang.REQUEST:
            self.asked.append(k)
            if k in self.dumps:
                with open(os.path.join(self.job_dir, f"node{k}", hang.stacks_file(k)), "a") as f:
                    f.write(self.dumps[k])


def test_the_one_watcher_finds_a_rank_late_to_start_through_the_backends_files(tmp_path):
    """Watcher, as every backend drives it: rank 1 never reports; past the start deadline its stacks are asked
    of every node through the transport and kept with whom they blame."""
    for k in (0, 1):
        (tmp_path / f"node{k}").mkdir()
    (tmp_path / "node0" / hang.PROGRESS.format(rank=0)).write_text(json.dumps(rec(1)))
    files = Answering(str(tmp_path), {k: (STACKS / f"at-start-rank{k}.txt").read_text() for k in (0, 1)})
    said = []
    w = hang.Watcher(str(tmp_path / "hang-0"), 2, 1, 0, 60, 0, files, said.append)
    assert w.look() is None and w.look() is None   # the second within its cadence: not even read
    w.watch.started -= 61   # the start deadline has passed
    got = w.look(at_once=True)
    assert (got["kind"], got["ranks"], got["node"], sorted(files.asked)) == ("start", [1], 1, [0, 1]), got
    assert said[0].startswith("no progress for ") and said[-1] == got["text"]
    assert json.loads((tmp_path / "hang-0" / "hang.json").read_text())["node"] == 1


def test_the_one_watcher_takes_the_stacks_when_a_node_is_held_after_a_collective_timeout(tmp_path):
    """A node held with its mark (node_script.hold_after_timeout), its rank's log ending with Gloo's timeout, the
    job quiet for most of that timeout: a hang, decided once the mark is read; its ranks are not waited for."""
    for k in (0, 1):
        (tmp_path / f"node{k}").mkdir()
        (tmp_path / f"node{k}" / hang.PROGRESS.format(rank=k)).write_text(json.dumps(rec(1, step=30 - k)))
    (tmp_path / "node0" / "workerlog.0").write_text((TIMEOUTS / "gloo-plain-rank0.log").read_text())
    files = Answering(str(tmp_path), {1: (STACKS / "at-step-rank1.txt").read_text()})
    w = hang.Watcher(str(tmp_path / "hang-0"), 2, 1, 600, 900, 0, files, lambda _: None)
    assert w.look() is None
    w.watch.changed = {r: t - hang.TIMEOUT_QUIET_S for r, t in w.watch.changed.items()}   # quiet since
    assert w.look(at_once=True) is None   # no node held: a peer's crash is no hang
    (tmp_path / "node0" / hang.TIMED_OUT).write_text("")
    got = w.look(at_once=True)
    assert (got["kind"], got["ranks"], got["node"], got["timed_out_nodes"]) == ("collective", [1], 1, [0]), got


def test_the_one_watcher_asks_of_a_node_that_ended_well_nothing_and_after_a_failure_no_deadline(tmp_path):
    """A node that ended well is no sign of a collective's timeout, even with one in its log; a backend that saw
    a node fail asks only whether a collective's timeout ended it, not the deadlines (its own grace decides)."""
    for k in (0, 1):
        (tmp_path / f"node{k}").mkdir()
        (tmp_path / f"node{k}" / hang.PROGRESS.format(rank=k)).write_text(json.dumps(rec(1, step=5)))
    (tmp_path / "node1" / "workerlog.0").write_text((TIMEOUTS / "gloo-plain-rank0.log").read_text())
    files = Answering(str(tmp_path), {})
    w = hang.Watcher(str(tmp_path / "hang-0"), 2, 1, 600, 900, 0, files, lambda _: None)
    assert w.look() is None
    w.watch.changed = {r: t - 601 for r, t in w.watch.changed.items()}   # past the hang deadline, and quiet
    assert w.look(ended=[1], at_once=True, deadlines=False) is None and files.asked == []
    got = w.look(ended=[1], failed=[1], at_once=True, deadlines=False)
    assert (got["kind"], files.asked) == ("collective", [0, 1]), got


def test_once_every_rank_ended_its_script_the_exits_get_the_start_deadline_not_the_hang_one():
    """After its last step a rank saves, reports and says it is done at its exit; its processes' and node's exits
    follow, seconds later under load, and are no step: no hang at --hang-timeout (a clean-clone run saw one
    declared there, the job's containers exiting 0). A process stuck at its exit is still found, later."""
    w = hang.Watch(2, hang_s=10, start_s=100, started=0)
    for r in (0, 1):
        w.see(r, rec(1, step=60), now=1)
    w.see(0, {**rec(2, step=60), "done": True}, now=2)
    assert w.verdict(now=12.5).kind == "hang"     # one rank still in its script: the hang deadline holds
    w.see(1, {**rec(2, step=60), "done": True}, now=3)
    assert w.verdict(now=13.5) is None and w.verdict(now=102.9) is None
    assert w.verdict(now=103.5).kind == "hang"
    # the longer deadline of the two, and none where hang detection is off
    w = hang.Watch(1, hang_s=300, start_s=60, started=0)
    w.see(0, {**rec(1, step=60), "done": True}, now=1)
    assert w.verdict(now=290) is None and w.verdict(now=302).kind == "hang"
    w = hang.Watch(1, hang_s=0, start_s=60, started=0)
    w.see(0, {**rec(1, step=60), "done": True}, now=1)
    assert w.verdict(now=10 ** 6) is None
