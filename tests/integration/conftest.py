import os
import shutil
import subprocess

import pytest

from tests.conftest import invoke


def _engine_up():
    return shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def pytest_collection_modifyitems(config, items):
    if _engine_up():
        return
    skip = pytest.mark.skip(reason="no Docker Engine: run scripts/setup-host.sh (CI requires one)")
    for item in items:
        if "integration" in str(item.fspath):
            if os.environ.get("CI"):
                raise pytest.UsageError("CI=true but no Docker Engine is running: .ci/run must start dockerd")
            item.add_marker(skip)


def _ok(proc):
    assert proc.returncode == 0, f"{proc.args}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="session")
def cpu_image():
    """The real path a user takes: base (bootstrapped when no OS image can be had) -> wheels -> build."""
    _ok(invoke("base", "--variant", "cpu"))
    _ok(invoke("wheels", "--variant", "cpu"))
    # In CI (or when asked) build for real even if an image with the same inputs is cached on this machine.
    rebuild = os.environ.get("CI") or os.environ.get("FLEETBOX_TEST_REBUILD")
    build = _ok(invoke("build", "--variant", "cpu", *(["--force"] if rebuild else [])))
    from fleetbox import engine, images, matrix
    c = engine.client()
    image = images.resolve(c, matrix.load().get("cpu"))
    return {"image": image, "build": build, "client": c}
