"""The job folder's records: written whole or not at all, read back across versions, and a damaged one is one
line in `cancel` and `logs` and a row of its own in `invoke jobs`."""
import dataclasses
import json
import os
from pathlib import Path

import pytest

from fleetbox import files
from fleetbox.image import matrix
from fleetbox.run import plan as planner
from fleetbox.run import records
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends.docker import DockerPlan
from fleetbox.run.backends.slurm import SlurmPlan
from fleetbox.run.records import DamagedRecord, Handle, JobState
from tests.unit.test_cli import one_line_error


def test_an_interrupted_write_leaves_the_old_file_and_no_part(tmp_path):
    target = tmp_path / "summary.json"
    files.write_json(target, {"ok": True})
    with pytest.raises(KeyboardInterrupt):
        with files.atomic(target) as part:
            part.write_text('{"ok": fal')   # half a record, then Ctrl-C
            raise KeyboardInterrupt
    assert json.loads(target.read_text()) == {"ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_handle_from_an_older_or_newer_fleetbox_still_reads(tmp_path):
    older = {"backend": "docker", "job_id": "train-1", "dir": str(tmp_path), "nodes": 2, "hosts": ["", ""]}
    (tmp_path / "handle.json").write_text(json.dumps(older))   # before supervisor_start and checkpoints
    h = Handle.load(tmp_path)
    assert (h.nodes, h.supervisor_start, h.checkpoints) == (2, 0, "")
    (tmp_path / "handle.json").write_text(json.dumps({**older, "queue": "gpu"}))   # a field we do not know
    assert Handle.load(tmp_path).job_id == "train-1"


@pytest.mark.parametrize("text, why", [('{"backend": "docker", "job_id": "tr', "not JSON"),
                                       ("", "not JSON"),
                                       ('["docker"]', "not a Handle record"),
                                       ('{"job_id": "x", "dir": "/"}', "not a Handle record"),
                                       ('{"backend": "docker", "job_id": "x", "dir": "/", "nodes": []}', "damaged"),
                                       ('{"backend": "docker", "job_id": "x", "dir": "/", "checkpoints": null}',
                                        "null where str belongs"),
                                       ('{"backend": "docker", "job_id": "x", "dir": "/", "hosts": {"a": 1}}',
                                        "dict where a list belongs")])
def test_a_damaged_handle_says_which_file(tmp_path, text, why):
    (tmp_path / "handle.json").write_text(text)
    with pytest.raises(DamagedRecord, match=why) as e:
        Handle.load(tmp_path)
    assert str(tmp_path / "handle.json") in str(e.value)


def test_states_are_one_vocabulary_that_knows_its_ends():
    assert {s for s in JobState if s.is_terminal} == {JobState.PASSED, JobState.FAILED, JobState.HUNG,
                                                      JobState.CANCELLED, JobState.DIED}
    assert JobState.RUNNING == "RUNNING" and f"{JobState.UNKNOWN:<3}|" == "?  |"


def _docker_plan(tmp_path) -> DockerPlan:
    v = matrix.load().get("cu126")
    s = spec_mod.JobSpec(variant=v, nodes=2, env={"A": "$(id) {rank}"}, args=("--seed", "{rank}"),
                         mounts=(spec_mod.Mount("/data", "/data", False),))
    t = planner.template(s, "train-1", None, workspace=False, checkpoints="fleetbox-train-1-{node}-checkpoints")
    values = tuple(planner.node_values(k, 2, "train-1", "10.0.0.1", 23456, f"10.0.0.{k + 1}", "eth0")
                   for k in range(2))
    nodes = tuple(planner.replace(t, host=f"ssh://u@h{k + 1}").fill(x) for k, x in enumerate(values))   # --hosts
    return DockerPlan(s, "train-1", tmp_path, 23456, nodes, "fleetbox-train-1-{node}-checkpoints", t, values,
                      attempt=1, image_id="sha256:abc", content_tag="c0ffee", paddle="3.3.1", notes=("a note",))


def test_a_plan_goes_to_the_supervisor_as_json_and_comes_back_equal(tmp_path):
    plan = _docker_plan(tmp_path)
    records.save_plan(tmp_path, "docker", plan)
    name, back = records.load_plan(tmp_path, {"docker": DockerPlan}.__getitem__)
    assert name == "docker" and back == plan
    assert isinstance(back.dir, Path) and isinstance(back.spec.mounts[0], spec_mod.Mount)
    assert back.nodes[1].command == plan.nodes[1].command and back.template.env == plan.template.env
    slurm = SlurmPlan(plan.spec, "train-1", tmp_path, 23456, "podman", "img", (("node.sh", "#!/bin/bash\n"),))
    assert records.from_record(SlurmPlan, json.loads(json.dumps(records.to_record(slurm)))) == slurm


@pytest.mark.parametrize("text", ['{"backend": "docker", "plan": {"spec"', '{"backend": "docker", "plan": []}',
                                  '{"backend": "docker", "plan": {"spec": "x", "job_id": "j", "dir": "/", "port": 1}}',
                                  '{"backend": "nope", "plan": {}}'])
def test_a_damaged_plan_is_one_line(tmp_path, text):
    (tmp_path / "plan.json").write_text(text)
    with pytest.raises(DamagedRecord, match="plan.json cannot be read"):
        records.load_plan(tmp_path, {"docker": DockerPlan}.__getitem__)


def _truncated_job(runs: Path, job: str) -> None:
    (runs / job).mkdir(parents=True)
    whole = json.dumps({"backend": "docker", "job_id": job, "dir": str(runs / job), "nodes": 2})
    (runs / job / "handle.json").write_text(whole[:len(whole) // 2])   # as a full disk or a crash leaves it


def test_a_truncated_handle_is_one_line_in_cancel_and_logs_and_a_row_in_jobs(run_invoke, tmp_path):
    runs = tmp_path / "runs"
    _truncated_job(runs, "train-20261123-000000-dead")
    good = runs / "train-20261123-000001-beef"
    good.mkdir()
    Handle("docker", good.name, str(good), 2, ["", ""], supervisor=0).save()
    files.write_json(good / "summary.json", {"ok": True})
    env = {"FLEETBOX_RUNS": str(runs), "DOCKER_HOST": "unix:///nonexistent.sock"}
    for task in ("cancel", "logs"):
        one_line_error(run_invoke(task, "train-20261123-000000-dead", env=env),
                       "handle.json is damaged: not JSON (truncated?)",
                       "invoke clean --job train-20261123-000000-dead --force")
    proc = run_invoke("jobs", env=env)
    assert proc.returncode == 0, proc.stderr
    rows = {ln.split()[0]: ln.split() for ln in proc.stdout.splitlines()[1:]}
    assert rows["train-20261123-000000-dead"][1:4] == ["?", "?", "DAMAGED"]
    assert rows["train-20261123-000001-beef"][1:4] == ["docker", "2", "PASSED"]


# A handle.json as the fleetbox before per-backend handles wrote it: every backend's fields in one flat record.
OLD_HANDLE = {"backend": "", "job_id": "train-1", "dir": "", "nodes": 2, "hosts": ["", "ssh://u@h2"],
              "procs_per_node": 1, "scheduler_job": "", "supervisor": 4242, "supervisor_start": 77,
              "supervisor_host": "login1", "checkpoints": "/ckpt", "owner": "u@0123456789ab"}


@pytest.mark.parametrize("backend, own", [
    ("docker", {"hosts": ["", "ssh://u@h2"], "supervisor": 4242, "supervisor_start": 77, "supervisor_host": "login1"}),
    ("slurm", {"scheduler_job": "31"})])
def test_each_backend_reads_its_own_fields_from_a_flat_handle_and_writes_them_back_flat(tmp_path, backend, own):
    from fleetbox.run import backends
    written = {**OLD_HANDLE, "backend": backend, "dir": str(tmp_path), "scheduler_job": own.get("scheduler_job", "")}
    files.write_json(tmp_path / "handle.json", written)
    h = Handle.load(tmp_path)
    assert type(h) is backends.lookup(backend).handle_type and type(h) is not Handle
    assert {k: getattr(h, k) for k in own} == own
    assert (h.nodes, h.checkpoints, h.owner) == (2, "/ckpt", "u@0123456789ab")
    others = set(OLD_HANDLE) - set(own) - {f.name for f in dataclasses.fields(Handle)}
    assert not [k for k in others if hasattr(h, k)]   # another backend's fields are not this one's
    h.save()
    again = json.loads((tmp_path / "handle.json").read_text())
    assert again == {k: v for k, v in written.items() if k not in others}   # flat, as an older fleetbox reads it


def test_a_handle_made_or_read_for_a_backend_is_that_backends_own_type(tmp_path):
    from fleetbox.run import backends
    assert type(Handle("slurm", "j", str(tmp_path), 1, scheduler_job="9")) is backends.lookup("slurm").handle_type
    h = Handle("docker", "j", str(tmp_path), 2, ["", ""], supervisor=7)
    assert type(h) is backends.lookup("docker").handle_type and (h.hosts, h.supervisor) == (["", ""], 7)
    assert h.checkpoints_here() == ""
    assert Handle("docker", "j", "/d", 1, [""], checkpoints="/c").checkpoints_here() == "/c"
    assert Handle("docker", "j", "/d", 1, ["ssh://u@h"], checkpoints="/c").checkpoints_here() == ""   # on h


def test_a_handle_of_a_backend_this_fleetbox_does_not_have_reads_as_the_common_part(tmp_path, run_invoke):
    runs = tmp_path / "runs"
    (runs / "train-x").mkdir(parents=True)
    files.write_json(runs / "train-x" / "handle.json", {**OLD_HANDLE, "backend": "kube", "job_id": "train-x",
                                                       "dir": str(runs / "train-x"),
                                                       "pod": "p-0"})
    h = Handle.load(runs / "train-x")
    assert type(h) is Handle and (h.backend, h.nodes, h.checkpoints) == ("kube", 2, "/ckpt")
    proc = run_invoke("jobs", env={"FLEETBOX_RUNS": str(runs)})
    assert proc.returncode == 0, proc.stderr
    row = proc.stdout.splitlines()[1].split()
    assert row[:4] == ["train-x", "kube", "2", "?"] and "unknown backend 'kube'" in proc.stdout


def test_a_backend_declares_its_own_handle_fields_and_gets_them_back(tmp_path, monkeypatch):
    from fleetbox.errors import UserError
    from fleetbox.run import backends
    from tests.unit.test_backend_registry import EchoBackend, register_for_the_test

    @dataclasses.dataclass
    class EchoHandle(Handle):
        pids: list[int] = dataclasses.field(default_factory=list)

    class Echo2(EchoBackend):
        name = "echo2"
        handle_type = EchoHandle
    register_for_the_test(monkeypatch, Echo2)
    Handle("echo2", "e-1", str(tmp_path), 2, [11, 12]).save()
    h = Handle.load(tmp_path)
    assert type(h) is EchoHandle and h.pids == [11, 12]
    assert json.loads((tmp_path / "handle.json").read_text())["pids"] == [11, 12]

    class Bad(EchoBackend):
        name = "bad"
        options = ()
        handle_type = dict
    with pytest.raises(UserError, match="backend bad: its handle_type is not a fleetbox Handle"):
        backends.register(Bad)


def test_a_record_that_is_written_is_whole(tmp_path, monkeypatch):
    """handle.json goes through the atomic writer: a failure while writing keeps the previous one."""
    h = Handle("docker", "train-1", str(tmp_path), 2)
    h.save()

    def full_disk(self, data, *a, **k):   # as a full disk does: the file is opened (emptied), half written
        with open(self, "w") as f:
            f.write(data[:10])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError):
        Handle("docker", "train-1", str(tmp_path), 4).save()
    monkeypatch.undo()
    assert Handle.load(tmp_path).nodes == 2 and os.listdir(tmp_path) == ["handle.json"]


def _earlier_run(job_dir: Path, alloc: str) -> None:
    """What a finished run leaves: records, an earlier attempt's and the last one's logs with metrics lines, a
    report, checkpoints."""
    from fleetbox.run import metrics
    for d in (job_dir / alloc / "node0", job_dir / "node0"):
        d.mkdir(parents=True)
        (d / "workerlog.0").write_text(metrics.PREFIX + json.dumps(
            {"rank": 0, "step": 0, "time": 1.0, "loss": 1.0, "samples_per_s": 1.0}) + "\n")
    for name in (records.HANDLE, records.SUMMARY, records.JOB, "report.md", "metrics.jsonl"):
        (job_dir / name).write_text("{}")
    (job_dir / "checkpoints" / "step-00000010").mkdir(parents=True)


@pytest.mark.parametrize("alloc", ["attempt0", "alloc1"])   # Docker's restarts, Slurm's allocations
def test_a_job_id_run_again_sets_its_earlier_run_aside_whole_and_keeps_its_checkpoints(tmp_path, alloc):
    from fleetbox.run import metrics
    job_dir = tmp_path / "job"
    _earlier_run(job_dir, alloc)
    assert len(metrics.read(job_dir)) == 2   # as the new run's report would join them
    earlier = records.set_aside(job_dir, [job_dir / "checkpoints"])
    assert earlier is not None and records.EARLIER_RUN.fullmatch(earlier.name)
    assert sorted(p.name for p in job_dir.iterdir()) == sorted(["checkpoints", earlier.name])
    assert (earlier / alloc / "node0" / "workerlog.0").exists() and (earlier / records.SUMMARY).exists()
    assert (job_dir / "checkpoints" / "step-00000010").is_dir()
    assert metrics.read(job_dir) == [] and len(metrics.read(earlier)) == 2   # each run reads its own
    # a third run: the second's goes aside too, beside the first, which stays as it is
    _earlier_run_again = job_dir / "node1"
    _earlier_run_again.mkdir()
    (job_dir / records.HANDLE).write_text("{}")
    second = records.set_aside(job_dir, [job_dir / "checkpoints"])
    assert second != earlier and sorted(p.name for p in second.iterdir()) == ["handle.json", "node1"]
    assert records.set_aside(job_dir, [job_dir / "checkpoints"]) is None   # nothing left to set aside


def test_a_checkpoint_folder_elsewhere_is_not_kept_in_place_and_an_interrupted_move_goes_on(tmp_path):
    job_dir = tmp_path / "job"
    _earlier_run(job_dir, "attempt0")
    (job_dir / ".run-aside.partial").mkdir()   # a move that Ctrl-C cut short: part of the run is in it
    (job_dir / records.SUMMARY).rename(job_dir / ".run-aside.partial" / records.SUMMARY)
    earlier = records.set_aside(job_dir, [tmp_path / "elsewhere"])
    assert sorted(p.name for p in job_dir.iterdir()) == [earlier.name]
    assert (earlier / records.SUMMARY).exists() and (earlier / "checkpoints").is_dir()


def test_a_run_that_cannot_be_set_aside_is_one_line(tmp_path, monkeypatch):
    job_dir = tmp_path / "job"
    _earlier_run(job_dir, "attempt0")
    monkeypatch.setattr(os, "rename", lambda a, b: (_ for _ in ()).throw(PermissionError(13, "Permission denied")))
    with pytest.raises(records.UserError, match=r"cannot set the earlier run of job aside .*: Permission denied"):
        records.set_aside(job_dir)


def test_what_this_run_uses_and_any_checkpoint_folder_stay_in_place(tmp_path):
    """A --resume folder from the earlier run's set-aside checkpoints (what `--resume never` names), a mount, and
    another job's checkpoint folder (its OWNER: that job may be live) are not moved with the earlier run."""
    job_dir = tmp_path / "job"
    _earlier_run(job_dir, "attempt0")
    (job_dir / "checkpoints.before-20261127-000000" / "step-00000040").mkdir(parents=True)
    (job_dir / "data" / "mnist").mkdir(parents=True)
    (job_dir / "zs-checkpoints").mkdir()
    (job_dir / "zs-checkpoints" / "OWNER").write_text("{}")
    earlier = records.set_aside(job_dir, [job_dir / "checkpoints",
                                          job_dir / "checkpoints.before-20261127-000000" / "step-00000040",
                                          job_dir / "data" / "mnist"])
    assert sorted(p.name for p in job_dir.iterdir()) == sorted(
        ["checkpoints", "checkpoints.before-20261127-000000", "data", "zs-checkpoints", earlier.name])


def test_one_start_of_a_job_id_at_a_time(tmp_path):
    job_dir = tmp_path / "job"
    with records.starting(job_dir):
        with pytest.raises(records.UserError, match=r"^job job is being started or run by another fleetbox; "):
            with records.starting(job_dir):
                pass
    with records.starting(job_dir):   # let go on the way out
        (job_dir / "handle.json").write_text("{}")
    assert records.set_aside(job_dir) is not None   # its lock is no earlier run: only the handle went
    assert [p.name for p in job_dir.iterdir() if not p.name.startswith("run-")] == [records.STARTING]
    with pytest.raises(records.UserError):
        with records.starting(tmp_path / "refused"):   # a start refused: no folder left for it
            raise records.UserError("refused")
    assert not (tmp_path / "refused").exists()


def test_a_checkpoint_folder_that_holds_the_job_folder_is_refused_before_anything_moves(tmp_path, monkeypatch):
    from fleetbox.commands import train
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    job_dir = tmp_path / "runs" / "again"
    _earlier_run(job_dir, "attempt0")
    Handle("docker", "again", str(job_dir), 1, [""], supervisor=0).save()   # ended
    files.write_json(job_dir / records.SUMMARY, {"ok": True})
    for ckpt in (job_dir, tmp_path / "runs"):
        spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=1, job_id="again", checkpoint_dir=str(ckpt))
        with pytest.raises(records.UserError, match=r"holds the job's own folder .*: give the checkpoints a folder "
                                                    r"of their own"):
            train.train(spec, log=lambda m: None)
        assert (job_dir / records.SUMMARY).exists() and not list(job_dir.glob("run-*"))


def test_a_checkpoint_folders_aside_cut_short_stays_to_be_finished(tmp_path):
    """`--resume never` on the default folder, cut short: its .partial is beside the folder, in the job folder.
    Moved away with the earlier run, the next take could not finish it and would resume what was left."""
    job_dir = tmp_path / "job"
    _earlier_run(job_dir, "attempt0")
    (job_dir / "checkpoints.before-20261127-000000.partial" / "step-00000020").mkdir(parents=True)
    earlier = records.set_aside(job_dir, [job_dir / "checkpoints"])
    assert sorted(p.name for p in job_dir.iterdir()) == \
        sorted(["checkpoints", "checkpoints.before-20261127-000000.partial", earlier.name])


def test_the_start_lock_works_as_nfs_locks_it(tmp_path, monkeypatch):
    import errno
    import fcntl
    real_flock = fcntl.flock

    def nfs_flock(fd, op):   # an exclusive lock needs the file open for writing (flock(2), on NFS)
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, op)
    monkeypatch.setattr(records.fcntl, "flock", nfs_flock)
    with records.starting(tmp_path / "job"):
        pass


def test_a_plan_written_when_hosts_and_devices_were_the_specs_still_reads():
    """tests/recorded/plans/hosts: JobSpec had `hosts` and `devices` (Docker's) until they became the Docker
    backend's own options. The plan reads as it ran: its nodes on their engines with their GPUs, elsewhere."""
    from fleetbox import ROOT
    from fleetbox.run import backends
    name, plan = records.load_plan(ROOT / "tests" / "recorded" / "plans" / "hosts",
                                   lambda n: backends.lookup(n).plan_type)
    assert name == "docker" and type(plan) is DockerPlan
    assert [(n.host, n.gpus) for n in plan.nodes] == [("ssh://u@h1", "device=4,5"), ("ssh://u@h2", "device=4,5")]
    assert plan.elsewhere and (plan.spec.nodes, plan.spec.procs_per_node, plan.spec.gpus_per_node) == (2, 2, 2)
    assert not hasattr(plan.spec, "hosts") and not hasattr(plan.spec, "devices")


def test_an_id_another_owner_holds_is_refused_naming_theirs_and_one_without_an_owner_is_nobodys_ours():
    """The one refusal Docker's engines, a Kubernetes namespace and Podman's pods share."""
    from fleetbox.errors import UserError
    records.refuse_taken("j", "here", [("pod/j-0", "me"), ("network/j", "me")], "me")   # all ours: no refusal
    with pytest.raises(UserError, match=r"^job id j is taken here: pod/j-1, pod/j-2, pod/j-3, pod/j-4 \.\.\. are "
                                        r"bob's \(another user, or another runs folder\); nothing of theirs was "
                                        r"touched: give another --job-id$"):
        records.refuse_taken("j", "here", [("pod/j-0", "me"), *((f"pod/j-{k}", "bob") for k in range(1, 6))], "me")
    with pytest.raises(UserError, match=r"^job id j is taken here: network/j is no fleetbox job's \(no owner label\); "
                                        r"nothing of theirs"):
        records.refuse_taken("j", "here", [("network/j", "")], "me")
