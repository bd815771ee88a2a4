"""`invoke board`'s refusals, before it makes or starts anything: a job it cannot find, a port in use; and which
runs a scaling study's name stands for."""
import socket
import sys

from tests.conftest import invoke_here  # refusals only: in this process
from tests.unit.test_cli import one_line_error


def job(root, name):
    (root / name).mkdir(parents=True)
    (root / name / "handle.json").write_text("{}")


def test_a_study_stands_for_its_runs_and_an_unknown_name_is_one_line(tmp_path, monkeypatch):
    from fleetbox.commands import board
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    for name in ("solo", "st-i0-n1p1", "st-i0-n2p1", "stx-i0-n1p1"):
        job(tmp_path, name)
    (tmp_path / "st-i0-n4p1").mkdir()   # a run that never started: no handle
    assert board.targets("solo,st") == {"solo": tmp_path / "solo", "st/i0-n1p1": tmp_path / "st-i0-n1p1",
                                        "st/i0-n2p1": tmp_path / "st-i0-n2p1"}
    one_line_error(invoke_here("board", "nosuch", env={"FLEETBOX_RUNS": str(tmp_path)}),
                   "no job or scaling study nosuch in")
    one_line_error(invoke_here("board", "../x", env={"FLEETBOX_RUNS": str(tmp_path)}), "'../x' is not a job id")


def test_a_port_in_use_is_one_line_before_any_environment_is_made(tmp_path):
    job(tmp_path / "runs", "solo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = invoke_here("board", "solo", "--port", str(port), env={"FLEETBOX_RUNS": str(tmp_path / "runs"),
                                                                 "FLEETBOX_BOARD_ENVS": str(tmp_path / "envs")})
    one_line_error(proc, f"cannot listen on 127.0.0.1:{port}", "give another --port")
    assert not (tmp_path / "envs").exists()


def test_a_job_that_cannot_be_read_is_said_once_per_reason_and_the_others_go_on(tmp_path):
    from fleetbox.commands import board
    from fleetbox.run import visualdl_logs as vdl
    good = tmp_path / "good"
    (good / "node0").mkdir(parents=True)
    (good / "job.json").write_text('{"backend": "docker", "nodes": 1, "procs_per_node": 1}')
    (good / "node0" / "workerlog.0").write_text('FLEETBOX-METRIC {"rank": 0, "step": 1, "time": 5.0, "loss": 1}\n')
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "job.json").write_text('{"nodes": "several"}')   # from a hand-edited record
    logs, said, lines = vdl.Logs(tmp_path / "logs"), {}, []
    jobs = {"bad": vdl.JobRuns(bad, "bad"), "good": vdl.JobRuns(good, "good")}
    assert board.refresh(logs, jobs, said, lines.append) == 1
    assert board.refresh(logs, jobs, said, lines.append) == 0
    assert len(lines) == 1 and lines[0].startswith("board: cannot show bad now (") and "trying again" in lines[0]
    (bad / "job.json").write_text("{}")
    board.refresh(logs, jobs, said, lines.append)
    assert said == {} and len(lines) == 1


def test_a_board_wheelhouse_without_the_locks_wheels_is_one_line_and_leaves_no_environment(tmp_path, monkeypatch):
    """The board's own wheelhouse (as a kit places it) is used with no index; one that lacks a wheel fails in one
    line naming the folder, and nothing half-made is left (uv, for real, offline)."""
    import pytest

    from fleetbox import settings
    from fleetbox.commands import board
    from fleetbox.errors import UserError
    monkeypatch.setenv("FLEETBOX_WHEELHOUSE", str(tmp_path / "wh"))
    monkeypatch.setenv("FLEETBOX_BOARD_ENVS", str(tmp_path / "envs"))
    wheels = settings.board_wheels()
    wheels.mkdir(parents=True)
    (wheels / "six-1.17.0-py2.py3-none-any.whl").write_bytes(b"not a wheel")
    said = []
    with pytest.raises(UserError) as e:
        board.environment(log=said.append)
    assert said == [f"board: making VisualDL's environment in {board.env_dir()} (once; board.lock, from {wheels}, "
                    f"no index)"]
    assert str(e.value).startswith("board: making VisualDL's environment failed (uv pip): ")
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert str(e.value).endswith(f" ({wheels} lacks a wheel of board.lock for Python {py} here: fill it again, or "
                                 f"empty it to use an index)") and "\n" not in str(e.value)
    assert list((tmp_path / "envs").iterdir()) == []
