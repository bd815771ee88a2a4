import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.skips"]


def invoke(*args, env=None, timeout=1800, cwd=ROOT):
    """Run `invoke ARGS` as a user would, from the checkout (or from `cwd`, a copy of it: `python -m` puts the
    copy's own fleetbox first); returns the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def ctrl_c_reaches_it() -> None:
    """Popen's preexec_fn for a child a test sends Ctrl-C: SIGINT at its default, as a terminal's foreground job
    has it, whatever this run inherited (a non-interactive shell's background job ignores SIGINT, and so would
    the child, Python then installing no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def run_invoke():
    return invoke
