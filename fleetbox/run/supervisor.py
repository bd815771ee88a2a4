"""The process that carries a detached Docker job (`invoke train --detach`): it runs the plan exactly as an
attached `invoke train` would (failures propagated, restarts, logs gathered, containers removed on every way
out, SIGTERM included) with no terminal, writing what it would have printed to runs/<job>/supervisor.log.

    python -m fleetbox.run.supervisor runs/<job>      (the plan is runs/<job>/plan.pickle, written by start())

Its pid is in the job's handle.json (as an attached job's is the `invoke train` process): `invoke jobs` tells
a job whose supervisor died from one that is running.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

from fleetbox import ROOT
from fleetbox.errors import Failed, UserError
from fleetbox.run import backends
from fleetbox.run.backend import Handle
from fleetbox.run.output import quiet

READY, LOG, PLAN = "supervisor.ready", "supervisor.log", "plan.pickle"


def start(plan, log) -> Handle:
    """Start the supervisor of a detached Docker job and return once it has started the job (or say, in one
    line, why it could not)."""
    plan.dir.mkdir(parents=True, exist_ok=True)
    for name in (READY, "summary.json"):
        (plan.dir / name).unlink(missing_ok=True)
    part = plan.dir / f".{PLAN}.part"
    part.write_bytes(pickle.dumps(plan))
    part.rename(plan.dir / PLAN)
    with open(plan.dir / LOG, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fleetbox.run.supervisor", str(plan.dir)], cwd=ROOT,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    try:
        while not (plan.dir / READY).exists():
            if proc.poll() is not None:
                said = [ln for ln in (plan.dir / LOG).read_text(errors="replace").splitlines()
                        if "fleetbox: " in ln]
                why = said[-1].split("fleetbox: ", 1)[1] if said else f"it exited with {proc.returncode}"
                raise Failed(f"the detached job did not start: {why} (log: {plan.dir / LOG})")
            time.sleep(0.1)
    except KeyboardInterrupt:   # the supervisor cleans up on SIGTERM, as an attached job does on Ctrl-C
        proc.terminate()
        proc.wait(timeout=60)
        raise
    return Handle.load(plan.dir)


def main(job_dir: str) -> int:
    d = Path(job_dir)
    plan = pickle.loads((d / PLAN).read_bytes())
    with open(d / LOG, "a", buffering=1) as out:
        def log(line: str) -> None:
            out.write(f"{time.strftime('%H:%M:%S')} {line}\n")

        b = backends.get("docker")
        try:
            result = b.run(plan, log=log if plan.spec.debug else quiet(log),
                           on_submit=lambda handle: (d / READY).write_text(str(os.getpid())))
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
