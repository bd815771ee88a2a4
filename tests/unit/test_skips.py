"""Under CI every skip is a failure (tests/skips.py); elsewhere a skip is listed with its reason."""
import os
import subprocess
import sys

from tests.conftest import ROOT


def _pytest_on(tmp_path, ci: bool):
    (tmp_path / "test_needs_a_tool.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.skipif(True, reason='the frobnicator is missing')\n"
        "def test_marked():\n    pass\n\n"
        "def test_skips_itself():\n    pytest.skip('no engine here')\n\n"
        "def test_runs():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skips", "-rfEs", "-q", "-p", "no:cacheprovider",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, env=env)


def test_under_ci_a_skip_fails_the_run(tmp_path):
    proc = _pytest_on(tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed, 1 error" in proc.stdout   # a skip marker fails in setup (an error)
    assert "skipped under CI, where every skip is a failure: Skipped: the frobnicator is missing" in proc.stdout
    assert "no engine here" in proc.stdout


def test_elsewhere_a_skip_is_listed_with_its_reason(tmp_path):
    proc = _pytest_on(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 2 skipped" in proc.stdout and "the frobnicator is missing" in proc.stdout
