import os
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


@pytest.fixture
def run_invoke():
    return invoke
