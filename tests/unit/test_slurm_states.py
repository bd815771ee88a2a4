"""Slurm's job states as `invoke jobs` and `follow` read them, and `invoke cancel` of a chain, against stub
scontrol and scancel that answer as Slurm does and record what they were asked."""
import getpass
import json
import sys
import types

import pytest

from fleetbox.errors import UserError
from fleetbox.run.backends import slurm, slurm_step
from fleetbox.run.records import Handle, JobState

# scontrol show job ID -o: the state the test gave job ID in states.json (none: Slurm forgot it);
# scancel: records its argv, fails as Slurm does when told to (fail.json: message, exit code)
SCONTROL = r'''#!{py}
import json, os, sys
states = json.load(open(os.environ["STUB_DIR"] + "/states.json"))
job = sys.argv[3]
busy = os.environ["STUB_DIR"] + "/busy.json"   # {{job: how many queries more get no answer}}
left = json.load(open(busy)) if os.path.exists(busy) else {{}}
if left.get(job, 0) > 0:
    left[job] -= 1
    json.dump(left, open(busy, "w"))
    said = os.environ["STUB_DIR"] + "/said.txt"   # what it says then (default: a busy controller's words)
    print(open(said).read() if os.path.exists(said) else "slurm_load_jobs error: Socket timed out on send/recv "
          "operation", file=sys.stderr)
    sys.exit(1)
if job in states:
    print(f"JobId={{job}} JobName=fleetbox-x JobState={{states[job]}} Reason=None ExitCode=0:0")
else:
    print(f"slurm_load_jobs error: Invalid job id specified", file=sys.stderr)
    sys.exit(1)
'''
# sacct -j ID -X -n -P -o State,ExitCode: the accounting's record (accounted.json), or none kept here
SACCT = r'''#!{py}
import json, os, sys
path = os.environ["STUB_DIR"] + "/accounted.json"
if not os.path.exists(path):
    print("sacct: error: Slurm accounting storage is disabled", file=sys.stderr)
    sys.exit(1)
row = json.load(open(path)).get(sys.argv[2])
if row:
    print(row)
'''
SCANCEL = r'''#!{py}
import json, os, sys
d = os.environ["STUB_DIR"]
with open(d + "/scancel.jsonl", "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
if os.path.exists(d + "/fail.json"):
    msg, code, states = json.load(open(d + "/fail.json"))
    json.dump(states, open(d + "/states.json", "w"))
    print(msg, file=sys.stderr)
    sys.exit(code)
'''


@pytest.fixture
def stub_slurm(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("scontrol", SCONTROL), ("scancel", SCANCEL), ("sacct", SACCT),
                       ("sbatch", "#!/bin/sh\necho 9\n")):
        (d / name).write_text(text.format(py=sys.executable))
        (d / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}:/usr/bin:/bin")
    monkeypatch.setenv("STUB_DIR", str(d))

    def states(**by_job):
        (d / "states.json").write_text(json.dumps({k.lstrip("j"): v for k, v in by_job.items()}))
    states()
    return d, states


def chain(tmp_path, *recs):
    job_dir = tmp_path / "train-x"
    job_dir.mkdir()
    with open(job_dir / "allocations.jsonl", "w") as f:
        for rec in recs:
            f.write(json.dumps({"chain": "7", "max_allocations": 3, "from_step": 0, "to_step": 10, "state": "",
                                "exit": 0, **rec}) + "\n")
    return Handle("slurm", "train-x", str(job_dir), nodes=2, scheduler_job="7")


@pytest.mark.parametrize("state,ours", [
    ("PENDING", JobState.PENDING), ("CONFIGURING", JobState.STARTING), ("RUNNING", JobState.RUNNING),
    ("COMPLETING", JobState.RUNNING), ("REQUEUED", JobState.PENDING), ("REQUEUE_FED", JobState.PENDING),
    ("REQUEUE_HOLD", JobState.HELD), ("SPECIAL_EXIT", JobState.HELD), ("RESV_DEL_HOLD", JobState.HELD),
    ("RESIZING", JobState.RUNNING), ("SIGNALING", JobState.RUNNING), ("STAGE_OUT", JobState.RUNNING),
    ("STOPPED", JobState.SUSPENDED), ("SUSPENDED", JobState.SUSPENDED), ("SOME_NEW_STATE", JobState.UNKNOWN),
])
def test_every_state_slurm_has_not_ended_is_alive(state, ours, stub_slurm, tmp_path):
    _, states = stub_slurm
    states(j7=state)
    h = chain(tmp_path)
    assert slurm.alive(state)
    got, attempt, note = slurm.SlurmBackend().job_state(h)
    assert (got, attempt) == (ours, 1) and note == ("" if state in slurm.STATES else state)


@pytest.mark.parametrize("state", ["BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
                                   "OUT_OF_MEMORY", "PREEMPTED", "REVOKED", "TIMEOUT", slurm.FORGOTTEN])
def test_the_ended_states_are_not_alive(state):
    assert not slurm.alive(state)


def test_cancel_takes_the_chains_own_live_jobs_as_this_user_never_a_name(stub_slurm, tmp_path):
    """Allocation 1 (job 7) has ended and submitted job 8, which is pending: only 8 is cancelled, by id, as us."""
    d, states = stub_slurm
    states(j7="COMPLETED", j8="PENDING", j9="RUNNING")   # 9: someone's job of the same name
    h = chain(tmp_path, {"allocation": 1, "slurm_job": "7", "ended": "continue", "next": "8"})
    said = []
    slurm.SlurmBackend().cancel(h, said.append)
    calls = [json.loads(ln) for ln in (d / "scancel.jsonl").read_text().splitlines()]
    assert calls == [[f"--user={getpass.getuser()}", "8"]]
    assert said == [f"scancel --user={getpass.getuser()} 8"]
    assert (tmp_path / "train-x" / "CANCELLED.7").exists()


def test_a_failed_cancel_is_reported_in_one_line(stub_slurm, tmp_path):
    d, states = stub_slurm
    states(j7="RUNNING")
    (d / "fail.json").write_text(json.dumps(["scancel: error: Kill job error on job id 7: Access/permission denied",
                                             1, {"7": "RUNNING"}]))
    with pytest.raises(UserError, match=r"could not cancel Slurm job\(s\) 7 of train-x: .*permission denied") as e:
        slurm.SlurmBackend().cancel(chain(tmp_path), lambda _: None)
    assert "\n" not in str(e.value)


def test_a_job_that_ended_while_being_cancelled_is_no_failure(stub_slurm, tmp_path):
    d, states = stub_slurm
    states(j7="RUNNING")
    (d / "fail.json").write_text(json.dumps(["scancel: error: Kill job error on job id 7: Job/step already "
                                             "completing or completed", 1, {"7": "COMPLETED"}]))
    slurm.SlurmBackend().cancel(chain(tmp_path), lambda _: None)


def test_cancel_of_a_chain_that_has_ended_asks_nothing(stub_slurm, tmp_path):
    d, states = stub_slurm
    states(j7="COMPLETED")
    said = []
    slurm.SlurmBackend().cancel(chain(tmp_path), said.append)
    assert not (d / "scancel.jsonl").exists() and said == ["no Slurm job of train-x is alive (7)"]


def test_a_requeued_jobs_earlier_run_is_not_read_as_this_ones_failure():
    """With --open-mode=append every run of a requeued job writes to one slurm-<id>.out: only the newest counts,
    also when it stopped before starting anything (--max-restarts spent)."""
    cut = ("fleetbox: run 1 of Slurm job 7\n"
           "fleetbox: allocation 1 (Slurm job 7) starts from checkpoint step 0\n"
           "srun: error: node2: task 1: Terminated\n")
    rerun = ("fleetbox: run 2 of Slurm job 7\n"
             "fleetbox: Slurm requeued job 7 (restart count 1): allocation 2 goes on from the newest checkpoint\n")
    assert [f.rank for f in slurm_step.failures(cut + rerun)] == [1]
    assert slurm_step.failures(slurm_step.this_run(cut + rerun)) == []
    assert slurm_step.this_run("no marker\n") == "no marker\n"


def test_a_requeued_run_that_ends_with_no_record_ends_the_job(stub_slurm, tmp_path):
    """The rerun of a requeued job is cancelled (or hits the hard limit) before it writes its own line: the job
    has ended, and says how; while it runs, it is the next attempt."""
    _, states = stub_slurm
    h = chain(tmp_path, {"allocation": 1, "slurm_job": "7", "ended": "requeued", "next": "", "exit": -1})
    states(j7="RUNNING")
    assert slurm.SlurmBackend().job_state(h)[:2] == (JobState.RUNNING, 2)
    states(j7="CANCELLED")
    state, attempt, note = slurm.SlurmBackend().job_state(h)
    assert (state, attempt) == (JobState.FAILED, 2) and note.endswith(
        "that run ended with no record (Slurm: CANCELLED)"), note
    states()   # Slurm forgot it: what the chain recorded, not UNKNOWN for ever
    (tmp_path / "train-x" / "summary.json").unlink()
    assert slurm.SlurmBackend().job_state(h)[0] == JobState.FAILED


def test_cancel_also_takes_a_next_allocation_submitted_meanwhile(stub_slurm, tmp_path, monkeypatch):
    """Allocation 1 submits job 8 between our reading of allocations.jsonl and scancel: cancel reads again."""
    d, states = stub_slurm
    states(j7="RUNNING", j8="PENDING")
    h = chain(tmp_path)
    real = slurm._slurm

    def scancel_then_chain(*argv, check=True):
        out = real(*argv, check=check)
        if argv[0] == "scancel" and "7" in argv:   # the allocation had just submitted 8 and written its line
            with open(tmp_path / "train-x" / "allocations.jsonl", "a") as f:
                f.write(json.dumps({"chain": "7", "allocation": 1, "slurm_job": "7", "ended": "continue",
                                    "next": "8", "from_step": 0, "to_step": 10, "exit": 0}) + "\n")
        return out
    monkeypatch.setattr(slurm, "_slurm", scancel_then_chain)
    slurm.SlurmBackend().cancel(h, lambda _: None)
    calls = [json.loads(ln) for ln in (d / "scancel.jsonl").read_text().splitlines()]
    assert [c[1:] for c in calls] == [["7"], ["8"]]


def test_a_live_jobs_id_is_refused_from_any_shell(stub_slurm, tmp_path, monkeypatch):
    """A second submission with the id of a chain that is running, or between allocations (its next one pending),
    would overwrite its job.sbatch and handle.json and move its checkpoints: refused in one line."""
    from fleetbox.commands import train
    from fleetbox.image import matrix
    from fleetbox.run import spec as spec_mod
    _, states = stub_slurm
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    h = chain(tmp_path, {"allocation": 1, "slurm_job": "7", "ended": "continue", "next": "8"})
    h.save()
    again = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-x")
    states(j7="COMPLETED", j8="PENDING")
    with pytest.raises(UserError, match=r"^job train-x is PENDING \(slurm\): wait for it, `invoke cancel train-x`, "
                                        r"or give another --job-id$"):
        train.train(again, "slurm", {"runtime": "podman"}, log=lambda m: None)
    assert (tmp_path / "train-x" / "allocations.jsonl").exists()   # nothing of it touched
    states(j7="COMPLETED", j8="RUNNING")
    with pytest.raises(UserError, match="is RUNNING"):
        train.refuse_live("train-x")
    states(j7="COMPLETED", j8="COMPLETED")   # its chain has ended: the id may be used again
    with open(tmp_path / "train-x" / "allocations.jsonl", "a") as f:
        f.write(json.dumps({"chain": "7", "allocation": 2, "max_allocations": 3, "slurm_job": "8", "from_step": 10,
                            "to_step": 20, "state": "done", "exit": 0, "ended": "finished", "next": ""}) + "\n")
    train.refuse_live("train-x")
    train.refuse_live("train-never-run")


@pytest.mark.parametrize("env,mode", [({"WANDB_API_KEY": "secret"}, 0o700), ({}, None)])
def test_a_jobs_folder_holding_env_values_is_private(stub_slurm, tmp_path, monkeypatch, env, mode):
    """job.sbatch and node.sh hold --env values (tokens): the job's folder is the user's alone."""
    from fleetbox.image import matrix
    from fleetbox.run import spec as spec_mod
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    b = slurm.SlurmBackend("podman")
    plan = b.plan(spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-env", env=env))
    b.submit(plan, log=lambda m: None)
    assert ("secret" in (plan.dir / "node.sh").read_text()) == bool(env)
    got = plan.dir.stat().st_mode & 0o777
    assert got == mode if mode else got & 0o077, oct(got)


@pytest.fixture
def waits(monkeypatch):
    """The waits between queries, recorded instead of slept."""
    slept = []
    monkeypatch.setattr(slurm, "pause", slept.append)
    return slept


def busy(stub_dir, **by_job):
    (stub_dir / "busy.json").write_text(json.dumps({k.lstrip("j"): v for k, v in by_job.items()}))


def test_a_query_that_gets_no_answer_is_asked_again_and_never_read_as_the_jobs_end(stub_slurm, waits):
    d, states = stub_slurm
    states(j7="RUNNING")
    busy(d, j7=2)
    assert slurm.job_state("7") == ("RUNNING", "0:0") and waits == [1, 2]
    busy(d, j7=100)
    waits.clear()
    with pytest.raises(slurm.SlurmUnanswered, match=r"^Slurm did not answer about job 7: slurm_load_jobs error: "
                                                    r"Socket timed out on send/recv operation$"):
        slurm.job_state("7")
    assert waits == list(slurm.QUERY_WAITS)
    assert slurm.alive_or_unanswered("7")   # cancel still asks scancel


def test_only_slurms_own_answer_ends_a_job_and_the_accounting_says_how(stub_slurm, waits):
    d, states = stub_slurm
    states()   # scontrol: "Invalid job id specified"
    assert slurm.job_state("7") == (slurm.FORGOTTEN, "") and waits == []   # no accounting here
    (d / "accounted.json").write_text(json.dumps({"7": "CANCELLED by 1000|0:15", "8": "COMPLETED|0:0"}))
    assert slurm.job_state("7") == ("CANCELLED", "0:15") and slurm.job_state("8") == ("COMPLETED", "0:0")
    assert slurm.job_state("9") == (slurm.FORGOTTEN, "")   # the accounting does not hold it either
    (d / "accounted.json").write_text(json.dumps({"7": "RUNNING|0:0"}))   # a stale record of a job scontrol lost
    assert slurm.job_state("7") == (slurm.FORGOTTEN, "")


def test_cancel_while_slurm_does_not_answer_asks_scancel_at_once_for_the_chains_live_jobs(stub_slurm, waits,
                                                                                          tmp_path):
    """No waiting between queries (it runs while Ctrl-C is held), and not about an allocation the chain recorded as
    ended: scancel is asked for the rest."""
    d, states = stub_slurm
    h = chain(tmp_path, {"allocation": 1, "slurm_job": "7", "ended": "continue", "next": "8"})
    states(j7="COMPLETED", j8="RUNNING")
    busy(d, j7=100, j8=100)
    slurm.SlurmBackend().cancel(h, log=lambda m: None)
    asked = [json.loads(ln) for ln in (d / "scancel.jsonl").read_text().splitlines()]
    assert asked == [[f"--user={getpass.getuser()}", "8"]] and waits == []


def test_following_waits_through_an_outage_saying_so_once(stub_slurm, waits):
    d, states = stub_slurm
    states(j7="RUNNING")
    busy(d, j7=len(slurm.QUERY_WAITS) + 3)   # longer than one query's waits
    said = []
    assert slurm.patient_state("7", said.append) == ("RUNNING", "0:0")
    assert said == ["Slurm did not answer about job 7: slurm_load_jobs error: Socket timed out on send/recv "
                    "operation; asking again (a busy or restarting controller is not the job's end)"]


def test_while_slurm_does_not_answer_a_job_is_unknown_and_its_id_is_refused(stub_slurm, waits, tmp_path,
                                                                            monkeypatch):
    """`invoke jobs` shows Slurm's line, writes no result, and a second job with the same id is refused."""
    from fleetbox.commands import train
    d, states = stub_slurm
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    h = chain(tmp_path)
    h.save()
    states(j7="RUNNING")
    busy(d, j7=100)
    state, attempt, note = slurm.SlurmBackend().job_state(h)
    assert (state, attempt) == (JobState.UNKNOWN, 1) and note.startswith("Slurm did not answer about job 7: ")
    assert not (tmp_path / "train-x" / "summary.json").exists()
    with pytest.raises(UserError, match=r"^job train-x is in a state that cannot be told \(slurm; Slurm did not "
                                        r"answer about job 7: slurm_load_jobs error: Socket timed out"):
        train.refuse_live("train-x")


@pytest.mark.parametrize("said", [
    "scontrol: error: Couldn't find the specified plugin name for auth/munge looking at all files\n"
    "scontrol: fatal: failed to initialize auth plugin",
    "scontrol: error: s_p_parse_file: unable to status file /nowhere/slurm.conf: No such file or directory",
    "slurm_load_jobs error: Protocol authentication error",
])
def test_a_failure_that_asking_again_will_not_change_is_one_line_at_once(stub_slurm, waits, said):
    """Only a busy or restarting controller's words are asked again: an auth plugin that cannot start, a wrong
    SLURM_CONF or an expired credential was asked forever. Nothing is known of the job: never an end."""
    d, states = stub_slurm
    states(j7="RUNNING")
    busy(d, j7=100)
    (d / "said.txt").write_text(said)
    with pytest.raises(slurm.SlurmRefused) as e:
        slurm.patient_state("7", lambda m: None)
    assert str(e.value) == f"Slurm cannot be asked about job 7: {said.splitlines()[-1]}" and waits == []
    assert slurm.alive_or_unanswered("7")   # cancel still asks scancel


@pytest.mark.parametrize("said", [f"slurm_load_jobs error: {b}" for b in slurm.BUSY])
def test_each_busy_controllers_words_are_asked_again(stub_slurm, waits, said):
    d, states = stub_slurm
    states(j7="RUNNING")
    busy(d, j7=2)
    (d / "said.txt").write_text(said)
    assert slurm.job_state("7") == ("RUNNING", "0:0") and waits == [1, 2]


def test_following_stops_after_its_patience_leaving_the_job_as_it_is(stub_slurm, waits, tmp_path, monkeypatch):
    """FLEETBOX_SLURM_PATIENCE bounds even a busy controller's outage: the command stops following, says how to
    ask again, and neither cancels the job nor writes a result (`invoke jobs`: unknown, never FAILED)."""
    from fleetbox.errors import LeftRunning
    d, states = stub_slurm
    states(j7="RUNNING")
    busy(d, j7=10**6)
    monkeypatch.setenv("FLEETBOX_SLURM_PATIENCE", "0")
    with pytest.raises(LeftRunning, match=r"^Slurm did not answer about job 7: .*, for 0 s "
                                          r"\(FLEETBOX_SLURM_PATIENCE\): stopped following Slurm job 7, which may "
                                          r"still run; ask again with "):
        slurm.patient_state("7", lambda m: None)
    assert waits == list(slurm.QUERY_WAITS)   # one query's waits, then no more
    h = chain(tmp_path)
    monkeypatch.setattr(slurm.SlurmBackend, "submit", lambda self, plan, log=print: h)
    monkeypatch.setattr(slurm, "tail_file", lambda path, running, log, poll: running())
    with pytest.raises(LeftRunning):
        slurm.SlurmBackend()._run_once(types.SimpleNamespace(job_id="train-x", dir=tmp_path), log=lambda m: None)
    assert not (d / "scancel.jsonl").exists() and not (tmp_path / "train-x" / "summary.json").exists()


def test_following_goes_on_to_the_next_allocation_its_batch_script_recorded_while_slurm_was_asked(
        stub_slurm, tmp_path, monkeypatch):
    """Allocation 1's batch script records the next allocation (job 8) and exits between the chain's read and
    Slurm's answer about job 7. Following must read job 7's record, go on to job 8 and end only with it (it
    ended once job 7's record was written, asking for job 8's record, which did not exist yet)."""
    d, states = stub_slurm
    states(j7="RUNNING", j8="RUNNING")
    h = chain(tmp_path)
    asked = []

    def record(**rec):
        with open(tmp_path / "train-x" / "allocations.jsonl", "a") as f:
            f.write(json.dumps({"chain": "7", "max_allocations": 3, "from_step": 0, "state": "", **rec}) + "\n")

    def patient_state(job, log):
        asked.append(job)
        if asked == ["7"]:   # the chain was read (no record yet); the script records job 8 and exits
            record(allocation=1, slurm_job="7", ended="restart", next="8", to_step=30, exit=1)
            states(j7="COMPLETED", j8="RUNNING")
        elif asked.count("8") == 3:   # job 8 runs a while, then finishes
            record(allocation=2, slurm_job="8", ended="finished", next="", to_step=60, exit=0)
            states(j7="COMPLETED", j8="COMPLETED")
        return slurm.job_state(job)

    monkeypatch.setattr(slurm, "patient_state", patient_state)
    monkeypatch.setattr(slurm, "_record_of", lambda job_dir, chain, job: next(
        (r for r in slurm.allocations(job_dir, chain) if r["slurm_job"] == job), None))   # no wait for a record
    monkeypatch.setattr(slurm.SlurmBackend, "result", lambda self, handle, state, current, records: (state, current))
    said = []
    assert slurm.SlurmBackend().follow(h, said.append, poll=0) == ("COMPLETED", "8")
    assert said == ["allocation 1 (Slurm job 7) ended: failed (exit 1); restarted from step 30 in Slurm job 8",
                    "allocation 2 (Slurm job 8) ended: finished at checkpoint step 60"]


def test_a_chain_that_goes_on_while_slurm_is_asked_is_listed_running_and_given_no_result(stub_slurm, tmp_path,
                                                                                        monkeypatch):
    """`invoke jobs` in the same window: job 7 records job 8 and exits between the read and Slurm's answer. The
    job is allocation 2, running, and no summary is written (it judged allocation 1's end as the job's)."""
    d, states = stub_slurm
    states(j7="RUNNING", j8="RUNNING")
    h = chain(tmp_path)
    real, asked = slurm.job_state, []

    def job_state(job, waits=slurm.QUERY_WAITS):
        asked.append(job)
        if asked == ["7"]:
            with open(tmp_path / "train-x" / "allocations.jsonl", "a") as f:
                f.write(json.dumps({"chain": "7", "allocation": 1, "slurm_job": "7", "ended": "restart", "next": "8",
                                    "max_allocations": 3, "from_step": 0, "to_step": 30, "state": "", "exit": 1})
                        + "\n")
            states(j7="COMPLETED", j8="RUNNING")
        return real(job, waits)

    monkeypatch.setattr(slurm, "job_state", job_state)
    assert slurm.SlurmBackend().job_state(h) == (JobState.RUNNING, 2, "") and asked == ["7", "8"]
    assert not (tmp_path / "train-x" / "summary.json").exists()
