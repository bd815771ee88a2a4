"""Run by every Python in a fleetbox job container (the helpers folder is first on PYTHONPATH), for hang
detection; it does nothing outside a job (no FLEETBOX_PROGRESS_DIR).

- In a training rank (Paddle's launcher sets PADDLE_TRAINER_ID): faulthandler writes every thread's Python
  stack to <log folder>/stacks-rank<r>.txt on SIGUSR2 (a C-level handler: it works while the rank is stuck in
  a collective or holds the GIL; SIGTERM and SIGUSR1 belong to fleetbox_checkpoint), and the rank's progress
  file is started with its pid.
- In Paddle's launcher: a thread waits for fleetbox's request (<log folder>/STACKS-REQUEST, written from
  outside the container on every runtime) and sends SIGUSR2 to the ranks of this node, which only this
  container's processes can signal.

Then the next sitecustomize on the path, if any (Debian's), runs as it would have.
"""
import os
import signal
import sys

STACKS_SIGNAL = signal.SIGUSR2
REQUEST = "STACKS-REQUEST"


def _rank_setup(d: str) -> None:
    import faulthandler

    import fleetbox_progress
    out = open(os.path.join(d, f"stacks-rank{fleetbox_progress.rank()}.txt"), "a")   # open for the process's life
    faulthandler.register(STACKS_SIGNAL, file=out, all_threads=True)
    fleetbox_progress.started()


def _relay(d: str) -> None:
    import glob
    import json
    import threading
    import time

    def loop():
        done = ""
        while True:
            time.sleep(0.5)
            try:
                with open(os.path.join(d, REQUEST)) as f:
                    asked = f.read().strip()
            except OSError:
                continue
            if not asked or asked == done:
                continue
            done = asked
            for p in glob.glob(os.path.join(d, "progress-rank*.json")):
                try:
                    with open(p) as f:
                        os.kill(int(json.load(f)["pid"]), STACKS_SIGNAL)
                except (OSError, ValueError, KeyError, TypeError):
                    pass   # a rank that has ended, or a file being replaced: the others still dump
    threading.Thread(target=loop, name="fleetbox-stacks-relay", daemon=True).start()


def _next_sitecustomize() -> None:
    """The sitecustomize this one shadows (the next on sys.path), run as its own module."""
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception:   # as Python treats a failing sitecustomize: never fatal
            pass


def _main() -> None:
    d = os.environ.get("FLEETBOX_PROGRESS_DIR")
    if d and os.path.isdir(d):
        try:
            if os.environ.get("PADDLE_TRAINER_ID") is not None:
                _rank_setup(d)
            elif "paddle.distributed.launch" in getattr(sys, "orig_argv", ()):
                _relay(d)
        except Exception as e:   # detection is a help, never a reason for a rank not to start
            print(f"fleetbox: no hang detection in this process: {type(e).__name__}: {e}", file=sys.stderr)
    _next_sitecustomize()


_main()
