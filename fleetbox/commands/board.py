"""`invoke board JOB[,JOB...]`: watch jobs in VisualDL, Paddle's own dashboard, while they run and after.

Every --interval seconds the board writes what the jobs' folders hold as VisualDL logs (run/visualdl_logs.py)
into a folder of its own, and VisualDL's server shows them. A Slurm job's folder is on the shared disk, a
detached job's is here: the board reads them as they grow, from any shell, and nothing runs in the job for it.

The server comes from an environment the board makes for it, never the user's own Python and never the images:
VisualDL 2.5.3 (its last release) and what it needs, locked with hashes in board.lock, installed by uv into a venv
in the user's cache (settings.board_envs()/board-<lock hash>/, made beside that name and renamed once whole). It
runs with telemetry off and only its scalar and text tabs: its other tabs would `pip install` Paddle, paddle2onnx,
x2paddle, gradio and tritonclient as it starts.
"""

from __future__ import annotations

import hashlib
import os
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

LOCK = Path(__file__).with_name("board.lock")
READY = "fleetbox-board.json"     # written last: a folder with it is a whole environment
SERVER = ["-c", "import sys; from visualdl.server.app import main; sys.exit(main())"]   # its console script's
TABS = ("scalar", "text")
START_S = 60.0                    # VisualDL's first start imports matplotlib and pandas: seconds, not minutes


def env_dir() -> Path:
    return settings.board_envs() / f"board-{hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]}"


def environment(log=print) -> Path:
    """VisualDL's environment, made once per lock (uv, from the lock's hashes; PyPI or uv's configured index)."""
    final = env_dir()
    if (final / READY).is_file():
        return final
    log(f"board: making VisualDL's environment in {final} (once; {LOCK.name}, from PyPI or UV_DEFAULT_INDEX)")
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(f"{final.name}.partial-{secrets.token_hex(4)}")
    uv = locks.uv_binary()
    try:
        for argv in ([uv, "venv", "-q", "--python", sys.executable, str(part)],
                     [uv, "pip", "install", "-q", "--python", str(part / "bin" / "python"), "--require-hashes",
                      "-r", str(LOCK)]):
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                raise UserError(f"board: making VisualDL's environment failed ({Path(argv[0]).name} {argv[1]}): "
                                f"{tail[0]}")
        (part / READY).write_text(LOCK.read_text().split("\n", 1)[0] + "\n")
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
        study = sorted(d for d in root.glob(f"{name}-i*-n*p*") if (d / records.HANDLE).is_file())
        if not study:
            raise UserError(f"no job or scaling study {name} in {root} (see `invoke jobs`)")
        out.update({f"{name}/{d.name[len(name) + 1:]}": d for d in study})
    if not out:
        raise UserError("name a job: invoke board JOB[,JOB...]")
    return out


def refresh(logs: visualdl_logs.Logs, jobs: dict[str, Path], said: set[str], log=print) -> int:
    """Write what each job has gained since the last refresh; a job folder that cannot be read now is said once
    (`said` holds those)."""
    total = 0
    for name, job_dir in jobs.items():
        try:
            total += logs.add(visualdl_logs.read_job(job_dir, name))
        except (OSError, ValueError) as e:
            if name not in said:
                said.add(name)
                log(f"board: cannot read {job_dir} now ({type(e).__name__}: {e}); trying again")
    return total


def _port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise UserError(f"board: cannot listen on {host}:{port} ({e.strerror}); give another --port") from None


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    return " | ".join(lines[-3:]) or "no output"


def serve(names: str, host: str = "127.0.0.1", port: int = 8040, interval: float = 10.0, log=print,
          ready=None) -> None:
    """Show the jobs on VisualDL at http://host:port until Ctrl-C (SIGTERM, SIGHUP): the server stopped and the
    board's logs removed on every way out. `ready(url)` is called once the server answers."""
    jobs = targets(names)
    if interval <= 0:
        raise UserError(f"--interval {interval}: give a number of seconds above 0")
    _port_free(host, port)
    env = environment(log)
    root = Path(tempfile.mkdtemp(prefix="fleetbox-board-"))
    server = None
    try:
        with stops_as_interrupt():
            logs, said = visualdl_logs.Logs(root / "logs"), set()
            (root / "logs").mkdir()
            refresh(logs, jobs, said, log)
            server_log = root / "visualdl.log"
            with open(server_log, "wb") as out:
                server = subprocess.Popen(
                    [str(env / "bin" / "python"), *SERVER, "--logdir", str(root / "logs"), "--host", host,
                     "--port", str(port), "--disable-telemetry", "--component_tabs", *TABS,
                     "--cache-timeout", str(max(1.0, interval))],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "PYTHONNOUSERSITE": "1"})
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            _wait_up(server, url, server_log)
            log(f"board: {url}/app/scalar shows {', '.join(jobs)}; new points every {interval:g} s; Ctrl-C stops")
            if host in ("127.0.0.1", "localhost", "::1"):
                log(f"board: from another machine: ssh -N -L {port}:127.0.0.1:{port} {socket.gethostname()}, "
                    f"then open http://127.0.0.1:{port}")
            if ready:
                ready(url)
            while True:
                time.sleep(interval)
                if server.poll() is not None:
                    raise UserError(f"board: VisualDL's server ended (exit {server.returncode}): {_tail(server_log)}")
                refresh(logs, jobs, said, log)
    except KeyboardInterrupt:
        log("board: stopped")
    finally:
        with signals_held():
            if server is not None:
                _stop(server)
            shutil.rmtree(root, ignore_errors=True)


def _stop(server: subprocess.Popen) -> None:
    """The server's whole process group: SIGTERM, SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            pass
        try:
            server.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_up(server: subprocess.Popen, url: str, server_log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise UserError(f"board: VisualDL's server did not start (exit {server.returncode}): {_tail(server_log)}")
        try:
            with urllib.request.urlopen(f"{url}/app/api/runs", timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
    raise UserError(f"board: VisualDL's server did not answer within {START_S:.0f} s: {_tail(server_log)}")
