"""`invoke board JOB[,JOB...]`: watch jobs in VisualDL, Paddle's own dashboard, while they run and after.

Every --interval seconds the board writes what the jobs' folders hold as VisualDL logs (run/visualdl_logs.py)
into a folder of its own, and VisualDL's server shows them. A Slurm job's folder is on the shared disk, a
detached job's is here: the board reads them as they grow, from any shell, and nothing runs in the job for it.

The server comes from an environment the board makes for it, never the user's own Python and never the images:
VisualDL 2.5.3 (its last release) and what it needs, locked with hashes in board.lock, installed by uv into a venv
in the user's cache (settings.board_envs()/board-<lock hash>/, made beside that name and renamed once whole): from
the board's own wheelhouse (settings.board_wheels(), which `invoke kit` carries) with no index, where it is, else
from PyPI or uv's configured index. It
runs with telemetry off and only its scalar and text tabs: its other tabs would `pip install` Paddle, paddle2onnx,
x2paddle, gradio and tritonclient as it starts.
"""

from __future__ import annotations

import ctypes
import hashlib
import http.client
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from fleetbox import options, settings
from fleetbox.errors import UserError
from fleetbox.image import locks
from fleetbox.processes import signals_held, stops_as_interrupt
from fleetbox.run import records, visualdl_logs
from fleetbox.run.spec import JOB_ID

READY = "fleetbox-board.json"     # written last: a folder with it is a whole environment
# VisualDL's server as its console script starts it (visualdl.server.app._run), but for the thread that asks
# http://HOST:PORT/ until it answers, which on a Unix socket (--private) never does: a DNS lookup of "unix" every
# 0.5 s for the board's life. fleetbox asks once itself (_wait_up).
SERVER = ["-c", "from visualdl.server.app import ParseArgs, create_app, parse_args; a = ParseArgs(**parse_args()); "
                "create_app(a).run(debug=False, host=a.host, port=a.port, threaded=False)"]
TABS = ("scalar", "text")
NO_PROXY = {"no_proxy": "127.0.0.1,localhost,::1", "NO_PROXY": "127.0.0.1,localhost,::1"}   # its own checks
RUNS_API = "/app/api/runs"        # what VisualDL answers once it serves
START_S = 60.0                    # VisualDL's first start imports matplotlib and pandas: seconds, not minutes


def env_dir() -> Path:
    """One environment per lock and interpreter (a venv is tied to the Python that made it; a shared home may be
    seen from machines of another kind)."""
    key = settings.BOARD_LOCK.read_bytes() + (f"\n{platform.machine()} {sys.version} "
                                              f"{os.path.realpath(sys.executable)}").encode()
    return settings.board_envs() / f"board-{hashlib.sha256(key).hexdigest()[:12]}"


def _die_with_us() -> None:
    """Popen's preexec_fn: the child gets SIGTERM when the board dies, even by SIGKILL (Linux's PR_SET_PDEATHSIG),
    so no server or install outlives it holding the port or filling a folder."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # 1: PR_SET_PDEATHSIG


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """uv in a process group of its own, killed whole if the board is stopped meanwhile."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_die_with_us)
    try:
        out, err = proc.communicate()
    except BaseException:
        with signals_held():
            _stop(proc, grace=0)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def environment(log=print) -> Path:
    """VisualDL's environment, made once per lock (uv, from the lock's hashes): from the board's wheelhouse with no
    index where there is one, else from PyPI or uv's configured index."""
    final = env_dir()
    if (final / READY).is_file():
        return final
    wheels = settings.board_wheels()
    offline = wheels.is_dir() and any(wheels.glob("*.whl"))
    source = ["--offline", "--no-index", "--find-links", str(wheels)] if offline else []
    log(f"board: making VisualDL's environment in {final} (once; {settings.BOARD_LOCK.name}, "
        + (f"from {wheels}, no index)" if offline else "from PyPI or UV_DEFAULT_INDEX)"))
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(f"{final.name}.partial-{secrets.token_hex(4)}")
    uv = locks.uv_binary()
    try:
        for argv in ([uv, "venv", "-q", "--python", sys.executable, str(part)],
                     [uv, "pip", "install", "-q", "--python", str(part / "bin" / "python"), "--require-hashes",
                      "-r", str(settings.BOARD_LOCK), *source]):
            done = _run(argv)
            if done.returncode:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                hint = (f" ({wheels} lacks a wheel of {settings.BOARD_LOCK.name} for Python "
                        f"{sys.version_info[0]}.{sys.version_info[1]} here: fill it again, or empty it to use an index)"
                        if offline and argv[1] == "pip" else "")
                raise UserError(f"board: making VisualDL's environment failed ({Path(argv[0]).name} {argv[1]}): "
                                f"{tail[0]}{hint}")
        (part / READY).write_text(settings.BOARD_LOCK.read_text().split("\n", 1)[0] + "\n")
        try:
            part.rename(final)
        except OSError:   # another board made it meanwhile
            if not (final / READY).is_file():
                raise
    finally:
        with signals_held():
            shutil.rmtree(part, ignore_errors=True)
    return final


def targets(names: str) -> dict[str, Path]:
    """{name on the board: job folder} for each job id, or each run of a scaling study (<study>-i<k>-n<N>p<P>,
    shown as <study>/i<k>-n<N>p<P>)."""
    out = {}
    root = settings.runs_root()
    for name in options.items(names):
        if not JOB_ID.fullmatch(name):
            raise UserError(f"{name!r} is not a job id")
        if (root / name / records.HANDLE).is_file():
            out[name] = root / name
            continue
        runs = re.compile(rf"{re.escape(name)}-i(\d+)-n(\d+)p(\d+)")   # scale.job_id's names
        study = sorted((d for d in root.glob(f"{name}-i*") if runs.fullmatch(d.name)
                        and (d / records.HANDLE).is_file()),
                       key=lambda d: tuple(int(x) for x in runs.fullmatch(d.name).groups()))
        if not study:
            raise UserError(f"no job or scaling study {name} in {root} (see `invoke jobs`)")
        out.update({f"{name}/{d.name[len(name) + 1:]}": d for d in study})
    if not out:
        raise UserError("name a job: invoke board JOB[,JOB...]")
    return out


def refresh(logs: visualdl_logs.Logs, jobs: dict[str, visualdl_logs.JobRuns], said: dict[str, str],
            log=print) -> int:
    """Write what each job has gained since the last refresh (how many points and bytes). A job that cannot be
    read now is said once per reason (`said`: the last one per job) and tried again next time; the others go on."""
    total = 0
    for name, runs in jobs.items():
        try:
            total += logs.add(runs.read()) + logs.copy(runs.script_records())
            for problem in runs.problems:   # a file left out: said once, the rest goes on
                log(f"board: {name}: left out {problem}")
            runs.problems.clear()
            said.pop(name, None)
        except Exception as e:   # a job folder half moved, removed, a disk full: the board goes on
            why = f"{type(e).__name__}: {e}"
            if said.get(name) != why:
                said[name] = why
                log(f"board: cannot show {name} now ({why}); trying again")
    return total


def _port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"board: cannot listen on {host}:{port} ({e.strerror}); give another --port") from None


def _tail(path: Path) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace")) if path.is_file() else ""   # its colours
    lines = text.strip().splitlines()
    return " | ".join(lines[-3:]) or "no output"


def serve(names: str, host: str = "127.0.0.1", port: int = 8040, interval: float = 10.0, private: bool = False,
          log=print) -> None:
    """Show the jobs on VisualDL at http://host:port until Ctrl-C (SIGTERM, SIGHUP): the server stopped and the
    board's logs removed on every way out (after a SIGKILL the server still stops: _die_with_us). `private`: on a
    Unix socket in the board's own folder (0700) instead of a port, which no other user of the machine can open
    (127.0.0.1 is every user's); `port` is then the one the ssh line forwards from."""
    if private and host != "127.0.0.1":
        raise UserError(f"--private serves on a socket, not on an address: give no --host (got {host})")
    jobs = targets(names)
    if not interval or interval <= 0:
        raise UserError(f"--interval {interval}: give a number of seconds above 0")
    if not host.strip():
        raise UserError("--host: give an address to listen on (127.0.0.1, or 0.0.0.0 for every network)")
    if not private:
        _port_free(host, port)
    root, server = None, None
    try:
        with stops_as_interrupt():
            env = environment(log)
            root = Path(tempfile.mkdtemp(prefix="fleetbox-board-"))   # 0700: this user's alone
            logs, said = visualdl_logs.Logs(root / "logs"), {}
            runs = {name: visualdl_logs.JobRuns(job_dir, name) for name, job_dir in jobs.items()}
            (root / "logs").mkdir()
            refresh(logs, runs, said, log)   # a long job's history: its first bounded part, then served at once
            server_log, sock = root / "visualdl.log", root / "board.sock"
            with open(server_log, "wb") as out:
                server = subprocess.Popen(   # werkzeug, VisualDL's server, takes unix://PATH for a Unix socket
                    [str(env / "bin" / "python"), *SERVER, "--logdir", str(root / "logs"), "--host",
                     f"unix://{sock}" if private else host,
                     "--port", str(port), "--disable-telemetry", "--component_tabs", *TABS,
                     "--cache-timeout", str(max(1.0, interval))],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    preexec_fn=_die_with_us, env={**os.environ, "PYTHONNOUSERSITE": "1", **NO_PROXY})
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            _wait_up(server, (lambda: _ask_socket(sock)) if private else (lambda: _ask(url)), server_log)
            shown = f"{sock} (a socket only you can open)" if private else f"{url}/app/scalar"
            log(f"board: {shown} shows {', '.join(jobs)}; new points every {interval:g} s; Ctrl-C stops")
            if private or host in ("127.0.0.1", "localhost", "::1"):
                log(f"board: from another machine: ssh -N -L {port}:{sock if private else f'127.0.0.1:{port}'} "
                    f"{socket.gethostname()}, then open http://127.0.0.1:{port}/app/scalar")
            if catching := any(r.behind for r in runs.values()):
                log("board: the rest of the history follows while it serves")
            wait = not catching
            while True:
                if wait:   # the rest of a long history comes a bounded part at a time, with no wait between
                    time.sleep(interval)
                if server.poll() is not None:
                    raise UserError(f"board: VisualDL's server ended (exit {server.returncode}): {_tail(server_log)}")
                gained = refresh(logs, runs, said, log)
                behind = any(r.behind for r in runs.values())
                if catching and not behind:
                    log("board: the whole history is shown")
                    catching = False
                wait = not (behind and gained)   # a job that cannot be read now waits, as on every refresh
    except KeyboardInterrupt:
        log("board: stopped")
    finally:
        with signals_held():
            if server is not None:
                _stop(server)
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)


def _stop(proc: subprocess.Popen, grace: float = 10) -> None:
    """A child's whole process group: SIGTERM, SIGKILL after `grace` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _ask(url: str) -> None:
    """VisualDL's list of runs at `url`, asked directly (never through a site's http_proxy); OSError until it
    answers."""
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{url}{RUNS_API}", timeout=2):
        pass


class _OnSocket(http.client.HTTPConnection):
    """HTTP over a Unix socket (the board's with --private)."""

    def __init__(self, path: Path):
        super().__init__("localhost", timeout=2)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.socket_path))


def _ask_socket(path: Path) -> bytes:
    """What VisualDL's list of runs says on the socket; OSError until it answers."""
    conn = _OnSocket(path)
    try:
        conn.request("GET", RUNS_API)
        answer = conn.getresponse()
        if answer.status != 200:
            raise OSError(f"HTTP {answer.status}")
        return answer.read()
    finally:
        conn.close()


def _wait_up(server: subprocess.Popen, ask, server_log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise UserError(f"board: VisualDL's server did not start (exit {server.returncode}): {_tail(server_log)}")
        try:
            ask()
            return
        except (urllib.error.URLError, http.client.HTTPException, OSError):
            time.sleep(0.3)
    raise UserError(f"board: VisualDL's server did not answer within {START_S:.0f} s: {_tail(server_log)}")
