"""Under CI a skipped test is a failure: a test that cannot run says so loudly instead of vanishing.
(Loaded by tests/conftest.py; `pytest -rs` lists skip reasons everywhere else.)"""
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI, where every skip is a failure: {reason}"
