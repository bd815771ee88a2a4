"""The job's checkpoint folder on the host: one live job holds it at a time (a second job gets one line naming the
first, before anything in the folder is touched), an ended job's folder is taken over, and `--resume never`
moves earlier checkpoints aside, never deletes them, also twice in one second and when the folder is a mount
point (another file system: nothing in it can be renamed out of it)."""
import errno
import fcntl
import json
import os
from pathlib import Path

import pytest

from fleetbox import files
from fleetbox.errors import UserError
from fleetbox.incontainer import fleetbox_checkpoint_folder as layout
from fleetbox.processes import process_start, this_host
from fleetbox.run import backends, checkpoints  # noqa: F401 (backends: registered, as where a job runs)
from fleetbox.run.records import Handle
from fleetbox.run.result import JobResult


def with_step(path: Path, step: int) -> None:
    d = path / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "COMPLETE").write_text(json.dumps({"step": step}))


def quiet(m):
    pass


def test_never_twice_in_one_second_keeps_both_earlier_sets(tmp_path, monkeypatch):
    monkeypatch.setattr(layout.time, "strftime", lambda fmt: "20261124-010203")
    ck = tmp_path / "ck"
    for step in (10, 20):
        with_step(ck, step)
        checkpoints.prepare(ck, "never", "job-a", log=quiet)
        assert checkpoints.steps(ck) == []
    asides = sorted(p.name for p in tmp_path.iterdir() if p.name != "ck")
    assert asides == ["ck.before-20261124-010203", "ck.before-20261124-010203-2"]
    assert checkpoints.steps(tmp_path / asides[1]) == [20]
    assert layout.owner(str(ck))["job"] == "job-a" and not (tmp_path / asides[1] / layout.OWNER).exists()


def test_never_on_a_mount_point_moves_the_checkpoints_aside_inside_it(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    with_step(ck, 10)
    (ck / "notes.txt").write_text("mine")
    real = os.rename

    def rename(src, dst):
        if ck in Path(src).parents and ck not in Path(dst).parents:   # out of the mount: another file system
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(src))
        return real(src, dst)
    monkeypatch.setattr(layout.os, "rename", rename)
    said = []
    checkpoints.prepare(ck, "never", "job-a", log=said.append)
    (aside,) = [p for p in ck.iterdir() if p.name.startswith("before-")]
    assert checkpoints.steps(ck) == [] and checkpoints.steps(aside) == [10]
    assert (aside / "notes.txt").read_text() == "mine" and said == [f"--resume never: moved the earlier "
                                                                     f"checkpoints to {aside}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]   # nothing left beside it


def test_a_folder_whose_checkpoints_cannot_be_moved_is_one_line(tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    with_step(ck, 10)

    def rename(src, dst):
        raise OSError(errno.EACCES, "Permission denied", str(src))
    monkeypatch.setattr(layout.os, "rename", rename)
    with pytest.raises(UserError, match=r"checkpoint folder .*ck: Permission denied \(setting the earlier "
                                        r"checkpoints aside for --resume never\)") as e:
        checkpoints.prepare(ck, "never", "job-a", log=quiet)
    assert "\n" not in str(e.value) and checkpoints.steps(ck) == [10]


def _job(runs: Path, job_id: str, ended: bool) -> None:
    """A Docker job's record as `invoke jobs` reads it: starting (its supervisor, this test's process, runs; its
    containers are not up) or ended (its supervisor gone, its summary written)."""
    d = runs / job_id
    d.mkdir(parents=True)
    me = os.getpid()
    Handle("docker", job_id, str(d), 1, [""], supervisor=0 if ended else me, supervisor_start=process_start(me),
           supervisor_host=this_host()).save()
    if ended:
        JobResult(job_id, "docker", True, [], dir=str(d)).save()


@pytest.fixture
def runs(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    return tmp_path / "runs"


def _owned(ck: Path, job_id: str, host: str = "", taker_runs: bool = False) -> None:
    """OWNER as a job's fleetbox wrote it when it took the folder: that process gone (it may have been a Slurm
    submit, or a detach's parent), or still running (this test's)."""
    ck.mkdir(exist_ok=True)
    rec = checkpoints.owner_record(job_id)
    if not taker_runs:
        rec["pid"], rec["pid_start"] = _gone_pid(), 1
    files.write_json(ck / layout.OWNER, rec | ({"host": host} if host else {}))


def _gone_pid() -> int:
    import subprocess
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_folder_a_live_job_holds_is_refused_in_one_line_and_left_untouched(runs, tmp_path, resume):
    ck = tmp_path / "ck"
    _job(runs, "first", ended=False)
    _owned(ck, "first")
    with_step(ck, 10)
    files.write_json(ck / layout.STATE, {"state": "running", "step": 10})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "runs" not in p.parts)
    with pytest.raises(UserError) as e:
        checkpoints.prepare(ck, resume, "second", log=quiet)
    assert str(e.value).startswith(f"checkpoint folder {ck} belongs to job first of ")
    assert "which is STARTING" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if "runs" not in p.parts) == before
    assert checkpoints.state(ck) == {"state": "running", "step": 10} and checkpoints.steps(ck) == [10]
    assert layout.owner(str(ck))["job"] == "first"


def test_a_folder_taken_by_a_job_that_has_no_record_yet_is_refused_while_its_fleetbox_runs(runs, tmp_path):
    """Between the taking and the job's handle.json (a Slurm submit takes seconds), the record is not there:
    before, that read as a job that had ended."""
    ck = tmp_path / "ck"
    _owned(ck, "first", taker_runs=True)
    with pytest.raises(UserError, match=rf"belongs to job first .* which is starting \(its fleetbox, pid "
                                        rf"{os.getpid()}, runs\)"):
        checkpoints.prepare(ck, "never", "second", log=quiet)
    _owned(ck, "first")   # that fleetbox ended without a record: the job never started
    checkpoints.prepare(ck, "auto", "second", log=quiet)
    assert layout.owner(str(ck))["job"] == "second"


def test_a_folder_whose_job_ended_is_taken_over(runs, tmp_path):
    ck = tmp_path / "ck"
    _job(runs, "first", ended=True)
    _owned(ck, "first")
    with_step(ck, 10)
    checkpoints.prepare(ck, "auto", "second", log=quiet)
    assert layout.owner(str(ck))["job"] == "second" and checkpoints.steps(ck) == [10]   # resumable


@pytest.mark.parametrize("runs_here", [False, True])
def test_a_folder_whose_owner_cannot_be_asked_from_here_names_the_file_to_remove(runs, tmp_path, runs_here):
    """Another machine's job: its runs folder is not seen here, or a folder of that path is, but without the
    job's record (login nodes with runs folders of their own): before, that read as a job that had ended."""
    ck = tmp_path / "ck"
    where = runs if runs_here else Path("/nowhere/runs")
    runs.mkdir(exist_ok=True)
    ck.mkdir()
    files.write_json(ck / layout.OWNER, {"job": "theirs", "runs": str(where), "user": "ann", "host": "login2"})
    with pytest.raises(UserError, match=rf"belongs to job theirs of ann on login2 \(runs folder {where}\), "
                                        rf"which cannot be asked from here: if that job has ended, remove "
                                        rf"{ck}/OWNER"):
        checkpoints.prepare(ck, "never", "mine", log=quiet)


def test_an_owner_file_of_many_lines_gives_one_line(runs, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    files.write_json(ck / layout.OWNER, {"job": "x", "runs": "/r\nfleetbox: error: forged", "user": "a\nb",
                                          "host": "h\n"})
    with pytest.raises(UserError) as e:
        checkpoints.prepare(ck, "auto", "mine", log=quiet)
    assert "\n" not in str(e.value) and "of a b on h (runs folder /r fleetbox: error: forged)" in str(e.value)


def test_the_same_job_run_again_takes_its_own_folder_and_release_gives_it_up(runs, tmp_path):
    ck = tmp_path / "ck"
    checkpoints.prepare(ck, "auto", "first", log=quiet)
    checkpoints.prepare(ck, "auto", "first", log=quiet)
    checkpoints.release(ck, "second")   # not its owner: nothing
    assert layout.owner(str(ck))["job"] == "first"
    checkpoints.release(ck, "first")
    assert layout.owner(str(ck)) is None


def test_a_job_that_took_the_folder_between_our_look_and_our_take_is_not_overwritten(runs, tmp_path):
    ck = tmp_path / "ck"
    _job(runs, "old", ended=True)
    _owned(ck, "old")
    looked = []

    def helper(*args):
        if args[0] == "read" and not looked:   # our look sees "old"; then "quick" takes the folder
            looked.append(1)
            answer = checkpoints._here(*args)
            _owned(ck, "quick", taker_runs=True)
            return answer
        return checkpoints._here(*args)
    with pytest.raises(UserError, match="belongs to job quick .* which is starting"):
        checkpoints.prepare(ck, "auto", "mine", log=quiet, helper=helper)
    assert layout.owner(str(ck))["job"] == "quick"


def test_a_setting_aside_cut_short_is_finished_by_the_next_take(runs, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    for step in (10, 20, 30):
        with_step(ck, step)
    real, moved = os.rename, []

    def rename(src, dst):   # Ctrl-C after the first step went
        if moved:
            raise KeyboardInterrupt
        moved.append(src)
        return real(src, dst)
    monkeypatch.setattr(layout.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.prepare(ck, "never", "first", log=quiet)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ck.before-") and not p.name.endswith(".partial")]
    monkeypatch.setattr(layout.os, "rename", real)
    checkpoints.prepare(ck, "auto", "first", log=quiet)   # nothing of that run is resumed
    assert checkpoints.steps(ck) == []
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("ck.before-")]
    assert not aside.name.endswith(".partial") and checkpoints.steps(aside) == [30, 20, 10]


def test_the_lock_works_as_nfs_locks_it(runs, tmp_path, monkeypatch):
    """NFS emulates flock with byte-range locks: an exclusive lock needs the file open for writing (flock(2)).
    Before, the lock was opened read-only, and every take on an NFS home failed."""
    real_flock = layout.fcntl.flock

    def nfs_flock(fd, op):
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, op)
    monkeypatch.setattr(layout.fcntl, "flock", nfs_flock)
    ck = tmp_path / "ck"
    checkpoints.prepare(ck, "auto", "mine", log=quiet)
    checkpoints.release(ck, "mine")
    assert layout.owner(str(ck)) is None and (ck / layout.LOCK).stat().st_mode & 0o777 == 0o666   # open to all


def test_a_lock_file_that_cannot_be_opened_for_writing_is_locked_read_only(runs, tmp_path, monkeypatch):
    """Another user's lock file, not open to all (a root helper's, made before the lock was opened to all)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / layout.LOCK).touch()
    opened, real = [], os.open

    def theirs(path, flags, *a):
        opened.append(flags)
        if flags & os.O_RDWR:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, flags, *a)
    monkeypatch.setattr(layout.os, "open", theirs)
    checkpoints.prepare(ck, "auto", "mine", log=quiet)
    assert opened == [os.O_RDWR | os.O_CREAT, os.O_RDONLY] and layout.owner(str(ck))["job"] == "mine"


def test_a_folder_only_named_like_a_cut_short_aside_is_left_alone(runs, tmp_path):
    ck = tmp_path / "ck"
    with_step(ck, 10)
    (tmp_path / "ck.before-20240101-000000.copy.partial").mkdir()   # an rsync of someone's, say
    (ck / "before-upload.partial").write_text("a user's file")
    checkpoints.prepare(ck, "auto", "mine", log=quiet)
    assert checkpoints.steps(ck) == [10] and (ck / "before-upload.partial").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "runs") == \
        ["ck", "ck.before-20240101-000000.copy.partial"]


def test_a_folder_whose_owner_runs_folder_this_user_cannot_read_is_refused_in_one_line(runs, tmp_path):
    """Another user's job on this host: its runs folder is theirs (0700). Asking whether it ended raised a
    PermissionError traceback; it is one line naming the file to remove. Run without root's power to read any
    folder (as a user is), the runs folder another user's."""
    import subprocess
    import sys

    from tests.conftest import ROOT
    theirs = tmp_path / "theirs"
    (theirs / "train-them").mkdir(parents=True)
    (theirs / "train-them" / "handle.json").write_text("{}")
    os.chown(theirs, 65534, 65534)   # nobody's
    theirs.chmod(0o700)
    ck = tmp_path / "ck"
    ck.mkdir()
    files.write_json(ck / layout.OWNER, {"job": "train-them", "runs": str(theirs), "user": "ann",
                                         "host": this_host(), "pid": 1, "pid_start": 1})
    probe = ("from pathlib import Path\nfrom fleetbox.errors import UserError\nfrom fleetbox.run import backends, "
             "checkpoints\ntry:\n    checkpoints.prepare(Path(%r), 'auto', 'mine', log=print)\nexcept UserError as e:\n"
             "    print(e)\n" % str(ck))
    proc = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-c", probe],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "FLEETBOX_RUNS": str(runs)})
    assert proc.stdout == (f"checkpoint folder {ck} belongs to job train-them of ann on {this_host()} (runs folder "
                           f"{theirs}), whose record cannot be read from here (Permission denied): if that job has "
                           f"ended, remove {ck}/OWNER; else give another --checkpoint-dir\n"), proc.stderr[-2000:]
    assert layout.owner(str(ck))["job"] == "train-them"
