"""`invoke board`'s refusals, before it makes or starts anything: a job it cannot find, a port in use; and which
runs a scaling study's name stands for."""
import socket

from tests.conftest import invoke
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
    one_line_error(invoke("board", "nosuch", env={"FLEETBOX_RUNS": str(tmp_path)}),
                   "no job or scaling study nosuch in")
    one_line_error(invoke("board", "../x", env={"FLEETBOX_RUNS": str(tmp_path)}), "'../x' is not a job id")


def test_a_port_in_use_is_one_line_before_any_environment_is_made(tmp_path):
    job(tmp_path / "runs", "solo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = invoke("board", "solo", "--port", str(port), env={"FLEETBOX_RUNS": str(tmp_path / "runs"),
                                                                 "FLEETBOX_BOARD_ENVS": str(tmp_path / "envs")})
    one_line_error(proc, f"cannot listen on 127.0.0.1:{port}", "give another --port")
    assert not (tmp_path / "envs").exists()
