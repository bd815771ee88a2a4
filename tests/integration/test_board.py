"""`invoke board` on a real 2-node job while it runs, opened in a real browser (headless Chromium): the page asks
VisualDL's server for both ranks' loss series and gets the job's own values, a second load shows the points the
job made since, and Ctrl-C stops the server and removes the board's files."""
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import pytest

from fleetbox.run import visualdl_logs
from tests.conftest import ROOT, ctrl_c_reaches_it, invoke
from tests.integration.browser import Browser

pytestmark = [pytest.mark.docker, pytest.mark.browser]   # jobs on the default engine, and Chromium

INTERVAL = 2   # the board's --interval: VisualDL's cache follows it, so new points show within twice that


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_losses(job_dir: Path) -> dict[int, dict[int, float]]:
    """Each rank's loss by step, from its own metrics lines in the node's worker log."""
    out = {}
    for log in job_dir.glob("node*/workerlog.*"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("FLEETBOX-METRIC "):
                rec = json.loads(line[len("FLEETBOX-METRIC "):])
                if "loss" in rec:
                    out.setdefault(rec["rank"], {})[rec["step"]] = rec["loss"]
    return out


def loss_series(got) -> dict[str, list]:
    """The last loss series the page received per run: {run: [[ms, step, value], ...]}."""
    out = {}
    for g in got:
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(g["url"]).query)
        assert g["status"] == 200, g
        out[q["run"][0]] = json.loads(g["body"])["data"] or []
    return out


def start_board(job_id: str, port: int) -> subprocess.Popen:
    """`invoke board JOB` on loopback, once it says its address (the first board makes its environment)."""
    board = subprocess.Popen([sys.executable, "-m", "invoke", "board", job_id, "--port", str(port),
                              "--interval", str(INTERVAL)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it)
    lines = []
    while not any(ln.startswith("board: http://") for ln in lines):
        line = board.stdout.readline()
        assert line, "".join(lines) + board.stderr.read()
        lines.append(line)
    assert f"board: http://127.0.0.1:{port}/app/scalar shows {job_id}" in "".join(lines), lines
    return board


def stop_board(board: subprocess.Popen) -> None:
    """Ctrl-C: the board stops cleanly."""
    board.send_signal(signal.SIGINT)
    out, err = board.communicate(timeout=30)
    assert board.returncode == 0 and "board: stopped" in out and "Traceback" not in err, out + err


def stop_quietly(board: subprocess.Popen | None) -> None:
    """A test's way out: Ctrl-C first, so that the board removes its files and its server goes with it."""
    if board is not None and board.poll() is None:
        board.send_signal(signal.SIGINT)
        try:
            board.wait(30)
        except subprocess.TimeoutExpired:
            board.kill()
            board.wait()


def test_a_running_jobs_board_shows_both_ranks_loss_in_a_real_browser_and_new_points_on_a_second_load(
        cpu_image, tmp_path):
    job_id = f"board-{os.getpid()}-{time.monotonic_ns()}"
    port, boards_before = free_port(), set(Path(tempfile.gettempdir()).glob("fleetbox-board-*"))
    board = None
    try:
        proc = invoke("train", "--nodes", "2", "--job-id", job_id, "--detach",
                      "--args", "--steps 3000 --step-sleep 0.05 --checkpoint-every 1000")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        board = start_board(job_id, port)
        url = f"http://127.0.0.1:{port}/app/scalar"
        runs = {f"{job_id}/attempt0/rank0", f"{job_id}/attempt0/rank1"}
        want = r"/app/api/scalar/list\?.*tag=train%2Floss"
        with Browser() as browser:
            deadline = time.monotonic() + 120
            while True:   # reloaded, as a user would, until both ranks have logged and the board has written
                try:
                    first = loss_series(browser.load(url, want, settle=2.0, timeout=10, at_least=2))
                    if runs <= set(first) and all(first[r] for r in runs):
                        break
                except TimeoutError:   # nothing to chart yet: the page asks for no series
                    first = None
                assert time.monotonic() < deadline, first
            browser.screenshot(tmp_path / "board.png")
            time.sleep(2 * INTERVAL + 2)
            second = loss_series(browser.load(url, want, settle=2.0, timeout=60, at_least=2))
        assert (tmp_path / "board.png").stat().st_size > 20_000, tmp_path / "board.png"   # charts drawn, kept
        own = own_losses(ROOT / "runs" / job_id)
        for run in runs:
            rank = int(run.rsplit("rank", 1)[1])
            for series in (first[run], second[run]):
                assert all(abs(v - own[rank][step]) <= 1e-6 * max(1.0, abs(own[rank][step]))
                           for _, step, v in series), (run, series[:3], own[rank])
            assert max(s for _, s, _ in second[run]) > max(s for _, s, _ in first[run]), (first[run], second[run])
        assert first[f"{job_id}/attempt0/rank0"] != first[f"{job_id}/attempt0/rank1"]   # each rank its own
        stop_board(board)
        assert set(Path(tempfile.gettempdir()).glob("fleetbox-board-*")) == boards_before   # its files removed
        with pytest.raises(ConnectionRefusedError):   # and its server gone: nothing listens on the port
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        stop_quietly(board)
        invoke("cancel", job_id)
        invoke("clean", "--job", job_id, "--force")


def _varint(data: bytes, at: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = data[at]
        n, at, shift = n | (b & 0x7F) << shift, at + 1, shift + 7
        if b < 0x80:
            return n, at


def _fields(data: bytes):
    """(field number, value) of a protobuf message: ints for varints, bytes for the rest."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        kind = key & 7
        if kind == 0:
            value, at = _varint(data, at)
        elif kind == 2:
            n, at = _varint(data, at)
            value, at = data[at:at + n], at + n
        else:   # 5: 4 bytes, 1: 8 bytes
            n = 4 if kind == 5 else 8
            value, at = data[at:at + n], at + n
        yield key >> 3, value


def file_scalars(path: Path, tag: str) -> dict[int, float]:
    """A VisualDL record file's scalars of `tag` by step, read as VisualDL's proto says (Record{repeated Value
    values = 1}; Value{int64 id = 1; string tag = 2; int64 timestamp = 3; float value = 4})."""
    data, out = path.read_bytes(), {}
    while data:
        n = int.from_bytes(data[:8], "little")
        for _, value in _fields(data[8:8 + n]):
            v = dict(_fields(value))
            if v.get(2) == tag.encode() and 4 in v:
                out[v.get(1, 0)] = struct.unpack("<f", v[4])[0]
        data = data[8 + n:]
    return out


def test_a_scripts_own_visualdl_callback_logs_into_the_job_folder_and_shows_beside_fleetboxs(cpu_image, tmp_path):
    """train/fit.py with Paddle's paddle.callbacks.VisualDL(log_dir="vdl_log"), as Paddle's docs show it: the image
    has VisualDL's writer, its relative log_dir lands in the node's log folder (the workspace is read-only), and
    the board's page gets its loss series as the file holds it, beside fleetbox's own runs."""
    job_id = f"board-vdl-{os.getpid()}-{time.monotonic_ns()}"
    port, board = free_port(), None
    try:
        proc = invoke("train", "--nodes", "2", "--job-id", job_id, "--script", str(ROOT / "train" / "fit.py"),
                      "--args", "--epochs 2 --visualdl vdl_log")
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        job = ROOT / "runs" / job_id
        (written,) = job.glob("node*/visualdl/rank*/vdl_log/vdlrecords.*.log")   # Paddle's callback: rank 0 only
        assert written.relative_to(job).parts[:4] == ("node0", "visualdl", "rank0", "vdl_log"), written
        own = file_scalars(written, "train/loss")
        assert len(own) == 2 * 4096 // 2 // 64, own   # every batch of both epochs (rank 0's half of the data)
        board = start_board(job_id, port)
        run = f"{job_id}/script/attempt0/rank0/vdl_log"
        with Browser() as browser:
            series = loss_series(browser.load(f"http://127.0.0.1:{port}/app/scalar",
                                              r"/app/api/scalar/list\?.*tag=train%2Floss", settle=2.0, timeout=60,
                                              at_least=3))
            browser.screenshot(tmp_path / "board.png")
        assert {f"{job_id}/attempt0/rank0", f"{job_id}/attempt0/rank1", run} <= set(series), repr(sorted(series))
        assert {step: v for _, step, v in series[run]} == pytest.approx(own, rel=1e-6), (series[run][:3], own)
        stop_board(board)
    finally:
        stop_quietly(board)
        invoke("clean", "--job", job_id, "--force")


def board_pids(port: int) -> list[int]:
    """The VisualDL servers listening on `port` (their command lines name it)."""
    out = subprocess.run(["pgrep", "-f", f"visualdl.server.app.*--port {port}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_stopped_or_killed_board_takes_its_server_with_it(tmp_path, how):
    """...and (SIGHUP's case) a --private board serves on a socket in a folder only its user can open, no port;
    (SIGTERM's) a history longer than one read (READ_LIMIT) is served from its first part, the rest caught up on
    while it serves."""
    private, long = how == signal.SIGHUP, how == signal.SIGTERM
    runs = tmp_path / "runs"
    (runs / "j" / "node0").mkdir(parents=True)
    (runs / "j" / "handle.json").write_text("{}")
    (runs / "j" / "job.json").write_text(json.dumps({"backend": "docker", "nodes": 1, "procs_per_node": 1}))
    steps = 80_000 if long else 5   # 80,000 lines: 5.3 MB, beyond one read of a log
    (runs / "j" / "node0" / "workerlog.0").write_text(
        "".join('FLEETBOX-METRIC {"rank": 0, "step": %d, "time": %d.5, "loss": 1.0}\n' % (s, 1000 + s)
                for s in range(steps)))
    assert (os.path.getsize(runs / "j" / "node0" / "workerlog.0") > visualdl_logs.READ_LIMIT) == long
    port, boards_before = free_port(), set(Path(tempfile.gettempdir()).glob("fleetbox-board-*"))
    board = subprocess.Popen([sys.executable, "-m", "invoke", "board", "j", "--port", str(port),
                              *(["--private"] if private else [])], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "FLEETBOX_RUNS": str(runs)})
    try:
        lines = []
        while not any(" shows j; " in ln for ln in lines):
            line = board.stdout.readline()
            assert line, "".join(lines) + board.stderr.read()
            lines.append(line)
        (server,) = board_pids(port)
        if private:
            from fleetbox.commands.board import _ask_socket
            sock = Path(lines[-1].split()[1])
            assert lines[-1] == f"board: {sock} (a socket only you can open) shows j; new points every 10 s; " \
                                "Ctrl-C stops\n" and sock.is_socket()
            assert sock.parent.stat().st_mode & 0o777 == 0o700   # no other user reaches the socket in it
            assert b"rank0" in _ask_socket(sock)   # VisualDL answers there, with the job's run
            with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
                pass   # and on no port
            assert f"ssh -N -L {port}:{sock} " in board.stdout.readline()
        if long:   # served on the history's first part: the rest comes into the run VisualDL reads meanwhile
            (written,) = (set(Path(tempfile.gettempdir()).glob("fleetbox-board-*")) - boards_before)
            (records,) = written.glob("logs/j/attempt0/rank0/vdlrecords.*.log")
            deadline = time.monotonic() + 60
            while len(file_scalars(records, "train/loss")) < steps:
                assert time.monotonic() < deadline, len(file_scalars(records, "train/loss"))
                time.sleep(0.5)
        board.send_signal(how)
        board.wait(30)
        deadline = time.monotonic() + 15
        while board_pids(port):
            assert time.monotonic() < deadline, f"VisualDL's server (pid {server}) outlived the board"
            time.sleep(0.2)
        left = set(Path(tempfile.gettempdir()).glob("fleetbox-board-*")) - boards_before
        if how == signal.SIGKILL:   # nothing of ours runs after SIGKILL: only the server is stopped, by Linux
            assert board.returncode == -signal.SIGKILL
        else:
            after = board.stdout.read()
            assert board.returncode == 0 and "board: stopped" in after and not left
            caught_up = ("board: the rest of the history follows while it serves\nboard: the whole history is "
                         "shown\n")
            assert (caught_up in after) == long, lines + [after]
    finally:
        if board.poll() is None:
            board.kill()
            board.wait()
        for pid in board_pids(port):
            os.kill(pid, signal.SIGKILL)
        if how == signal.SIGKILL:   # the folder a killed board cannot remove
            for d in set(Path(tempfile.gettempdir()).glob("fleetbox-board-*")) - boards_before:
                shutil.rmtree(d)
