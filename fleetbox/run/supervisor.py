"""The process that carries a detached job (`invoke train --detach` on a backend without a scheduler of its
own: Docker): it runs the plan exactly as an attached `invoke train` would (failures propagated, restarts,
logs gathered, containers removed on every way out, SIGTERM included) with no terminal, writing what it would
have printed to runs/<job>/supervisor.log.

    python -m fleetbox.run.supervisor runs/<job>      (the plan is runs/<job>/plan.json, written by the backend)

Its pid is in the job's handle.json (as an attached job's is the `invoke train` process): `invoke jobs` tells
a job whose supervisor died from one that is running.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from fleetbox.errors import Failed, UserError
from fleetbox.run import backends, records
from fleetbox.run.output import quiet


def main(job_dir: str) -> int:
    d = Path(job_dir)
    with open(d / records.SUPERVISOR_LOG, "a", buffering=1) as out:
        def log(line: str) -> None:
            out.write(f"{time.strftime('%H:%M:%S')} {line}\n")

        try:
            name, plan = records.load_plan(d, lambda name: backends.lookup(name).plan_type)
            b = backends.get(name)
            result = b.run(plan, log=log if plan.spec.debug else quiet(log),
                           on_submit=lambda handle: (d / records.SUPERVISOR_READY).write_text(str(os.getpid())))
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
