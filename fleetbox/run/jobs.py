"""`invoke train` and `invoke up`'s training step: choose the backend, plan once, then describe that plan
(--dry-run) or run it, and report one JobResult."""

from __future__ import annotations

import re

from ..errors import Failed, UserError
from . import backend as backends
from .result import JobResult
from .spec import JobSpec


def train(spec: JobSpec, backend: str = "docker", backend_options: dict | None = None, dry_run: bool = False,
          timeout: float | None = None, log=print) -> JobResult | None:
    if timeout and backend != "docker":
        raise UserError(f"--timeout is for the docker backend; give {backend} its own limit (Slurm: --time)")
    b = backends.get(backend, **(backend_options or {}))
    with backends.sigterm_as_interrupt():   # planning starts probe containers on --hosts engines
        plan = b.plan(spec)
    if dry_run:
        log(b.describe(plan))
        return None
    result = b.run(plan, log=log if spec.debug else quiet(log), timeout=timeout)
    log(result.table())
    if not result.ok:
        raise Failed(f"train failed: {result.failure()}")
    return result


# Paddle's launcher logs every poll of its HTTP master (dozens of lines per job: /healthy, /<job>/info...);
# the log files keep them. Other HTTP logging (a user's own) is left alone.
LAUNCHER_POLLING = re.compile(
    r"\[node\d+\] .*HTTP Request: [A-Z]+ http://[\d.:\[\]a-fA-F]+/(healthy|[\w.-]+/info(/\S*)?) \"HTTP/[\d.]+ \d+")


def quiet(log):
    """The live stream without the launcher's polling lines (`--debug` shows them)."""
    return lambda line: None if LAUNCHER_POLLING.match(line) else log(line)
