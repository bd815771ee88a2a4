"""The process that carries a detached Docker job (`invoke train --detach`): it runs the plan exactly as an
attached `invoke train` would (failures propagated, restarts, logs gathered, containers removed on every way
out, SIGTERM included) with no terminal, writing what it would have printed to runs/<job>/supervisor.log.

    python -m fleetbox.run.supervisor runs/<job>      (the plan is runs/<job>/plan.pickle, written by the client)

Its pid is in the job's handle.json (as an attached job's is the `invoke train` process): `invoke jobs` tells
a job whose supervisor died from one that is running.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path

READY, LOG, PLAN = "supervisor.ready", "supervisor.log", "plan.pickle"


def main(job_dir: str) -> int:
    from ..errors import Failed, UserError
    from . import backend as backends
    d = Path(job_dir)
    plan = pickle.loads((d / PLAN).read_bytes())
    with open(d / LOG, "a", buffering=1) as out:
        def log(line: str) -> None:
            out.write(f"{time.strftime('%H:%M:%S')} {line}\n")

        from .jobs import quiet
        b = backends.get("docker")
        try:
            result = b.run(plan, log=log if plan.spec.debug else quiet(log), on_submit=lambda handle: (d / READY).write_text(str(os.getpid())))
        except (UserError, Failed) as e:
            log(f"fleetbox: {e}")
            return 1
        except KeyboardInterrupt:   # SIGTERM (`invoke cancel`): run() has stopped and removed every container
            log("fleetbox: cancelled")
            return 130
        log(result.table())
        return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
