import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.skips"]

# What an integration test holds, named by the fixtures that hold it (a test holds what its fixtures hold, so a
# new test is placed by what it uses); a unit test holds nothing. Tests that hold the same resource run one after
# another in one pytest-xdist worker (--dist loadgroup: the mark's group); groups that share nothing, and tests
# that hold nothing, run side by side. A test holding several runs in the group of the first of RESOURCES it holds.
# Where no fixture says it, a module's mark does (pytestmark).
RESOURCES = {
    "slurm": {"cluster"},    # the Slurm test cluster, in fabric.SLURM's namespaces
    "rig": {"hosts", "rig_engines"},   # the multi-engine rig: fabric.RIG's namespaces, an engine in each
    "docker": set(),         # the default engine's jobs: this machine's ports (their host network; each job picks
                             # its own, and two at once could pick the same) and `invoke clean`'s engine-wide sweep
    "images": {"bumped", "kit"},   # the default engine's images and verify's containers: builds, `invoke verify`,
                                   # the engine's images compared before and after (a tampered kit's load, whose
                                   # site, a namespace and engine of its own, only test_kit uses)
    "podman": {"podman_image", "podman_cpu", "podman_built"},   # root Podman's containers and storage
    "browser": set(),        # Chromium: shares nothing, held beside the engine's jobs
}
# the user's own file of defaults (~/.config/fleetbox/config.toml) never reaches a test: tests that read one set it
os.environ["FLEETBOX_CONFIG"] = "/nonexistent/fleetbox-tests/config.toml"
SHARED = "FLEETBOX_TEST_SHARED"   # the run's folder that every worker sees (made and removed by the first process)


def pytest_configure(config):
    for name in RESOURCES:
        config.addinivalue_line("markers", f"{name}: the test holds this resource (tests/conftest.py: RESOURCES)")
    if SHARED not in os.environ:   # the run's first process (xdist's controller, or the only one): the shared folder
        os.environ[SHARED] = config._fleetbox_shared = tempfile.mkdtemp(prefix="fleetbox-tests-")


def pytest_unconfigure(config):
    if d := getattr(config, "_fleetbox_shared", None):
        shutil.rmtree(d, ignore_errors=True)
        del os.environ[SHARED]


@pytest.hookimpl(tryfirst=True)   # before xdist's own, which reads the group mark
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name != "integration":
            continue
        held = set(item.fixturenames) | {m.name for m in item.iter_markers()}
        names = [name for name, fixtures in RESOURCES.items() if held & (fixtures | {name})]
        for name in names:
            item.add_marker(name)
        if names:
            item.add_marker(pytest.mark.xdist_group(names[0]))



def once(name: str, make):
    """make() once in this run, by whichever worker asks first; the others wait for it and get what it returned
    (JSON). A make() that fails writes nothing: the next to ask tries again, and fails as loudly."""
    d = Path(os.environ[SHARED])
    done = d / f"{name}.json"
    with open(d / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            made = done.with_suffix(".part")   # a worker killed while writing leaves no half a result
            made.write_text(json.dumps(make()))
            made.replace(done)
        return json.loads(done.read_text())


def shared_dir(name: str) -> Path:
    """A folder of the run's, the same in every worker."""
    d = Path(os.environ[SHARED]) / name
    d.mkdir(exist_ok=True)
    return d


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


def invoke_here(*args, env=None, cwd=ROOT, command="invoke"):
    """`invoke ARGS` as invoke() does, but in this process, for a unit test that needs only the command line's
    parsing and output: what it prints, its exit code (a CompletedProcess), `env` set while it runs. A task that
    starts other processes or waits on signals is run by invoke() instead. `command`: "fleetbox" runs the
    fleetbox command instead (from `cwd`)."""
    import contextlib
    import io

    if command == "fleetbox":
        from fleetbox.cli import program
    else:
        from invoke.main import program
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = dict(os.environ), sys.argv, os.getcwd()
    os.environ.update(env or {})
    sys.argv = [command, *args]   # as `python -m invoke` has it: tasks.py reads it (_refuse_invokes_own)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            program.run([command, *args])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        sys.argv = saved[1]
        os.chdir(saved[2])
    return subprocess.CompletedProcess([command, *args], code, out.getvalue(), err.getvalue())


@pytest.fixture
def run_invoke():
    return invoke_here
