#!/usr/bin/env python3
"""How long a restart takes and how much work it loses (`invoke train --max-restarts`), not a test.

Each round starts the 2-node smoke job as a whole `invoke train` process (one step every ~0.05 s, a checkpoint
every 20 steps, every step logged by rank 0), waits until it is past step `--kill-after`, then SIGKILLs node 1's
container and measures, from the kill:
  - detected: fleetbox's line that node 1 exited (the other node is then stopped after its grace);
  - restarting: the line that the attempt failed and the job starts again (old containers stopped and removed);
  - started: the new attempt's start line (containers created and started);
  - first step: the new attempt's first step line in rank 0's log (Paddle imported, group formed, restored);
and the work lost: steps done before the kill minus the step the new attempt resumed from.
Like with like: in the same rounds (order alternating), a fresh `invoke train` of the same job is timed from
process start to its first step, the floor any restart pays again (Paddle's start-up).
Target: first step <= 15 s after the kill on this machine.

Needs the cpu image (`invoke up`) and the Docker Engine to itself:
`flock /tmp/fleetbox-docker.lock python bench/restart.py [--repeat 3]`.
"""
import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import benchlib as bl
from benchlib import ROOT

STEP = re.compile(r"^step\s+(\d+)", re.M)


def start(job_id: str, restarts: int):
    argv = [sys.executable, "-m", "invoke", "train", "--nodes", "2", "--job-id", job_id, "--max-restarts",
            str(restarts), "--args", "--steps 100000 --step-sleep 0.05 --checkpoint-every 20 --log-every 1"]
    t0 = time.time()
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read():
        for ln in p.stdout:
            lines.append((time.time(), ln.rstrip("\n")))
    threading.Thread(target=read, daemon=True).start()
    return p, t0, lines


def wait_for(check, timeout=120.0, poll=0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = check()
        if v is not None:
            return v
        time.sleep(poll)
    raise SystemExit("timed out waiting: see the job's logs under runs/")


def first_step(log: Path, after_resume: bool):
    text = log.read_text(errors="replace") if log.exists() else ""
    if after_resume and "fleetbox-checkpoint: resumed from step" not in text:
        return None
    m = STEP.search(text)
    return time.time() if m else None


def stop(p):
    p.send_signal(2)   # Ctrl-C: fleetbox stops and removes the job
    p.wait(timeout=120)


def fresh(job_id: str) -> float:
    p, t0, _ = start(job_id, 0)
    t = wait_for(lambda: first_step(ROOT / "runs" / job_id / "node0" / "workerlog.0", False))
    stop(p)
    return t - t0


def restart(job_id: str, kill_after: int) -> dict:
    p, _, lines = start(job_id, 1)
    d = ROOT / "runs" / job_id
    log0 = d / "node0" / "workerlog.0"

    def past():
        steps = [int(s) for s in STEP.findall(log0.read_text(errors="replace"))] if log0.exists() else []
        return steps[-1] if steps and steps[-1] >= kill_after else None
    wait_for(past)
    name = f"fleetbox-{job_id}-node1"
    t_kill = time.time()
    subprocess.run(["docker", "kill", "--signal", "KILL", name], check=True, capture_output=True)
    t_first = wait_for(lambda: first_step(log0, True), timeout=180)
    old = (d / "attempt0" / "node0" / "workerlog.0").read_text(errors="replace")
    done = int(STEP.findall(old)[-1]) + 1
    resumed = int(re.search(r"resumed from step (\d+)", log0.read_text(errors="replace")).group(1))

    def at(pattern):
        return next((t for t, ln in lines if t >= t_kill and re.search(pattern, ln)), float("nan")) - t_kill
    phases = {"detected": at(r"node1 \(rank 1\) exited"), "restarting": at(r"^attempt 0 failed"),
              "started": at(rf"^job {re.escape(job_id)}: 2 node"), "first step": t_first - t_kill}
    stop(p)
    return {**phases, "lost": done - resumed, "done": done, "resumed": resumed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kill-after", type=int, default=50, help="kill once rank 0 is past this step")
    args = ap.parse_args()
    res = {"fresh": [], "restart": []}
    for i, arm in bl.rounds(["fresh", "restart"], args.repeat):
        job_id = f"bench-restart-{os.getpid()}-{i}-{arm}"
        r = fresh(job_id) if arm == "fresh" else restart(job_id, args.kill_after)
        res[arm].append(r)
        print(f"round {i} {arm}: {r if arm == 'restart' else f'{r:.2f} s to the first step'}", flush=True)
    print()
    print(f"fresh start, process start -> first step: {bl.med(res['fresh']):.2f} s {bl.spread(res['fresh'])}")
    for key in ("detected", "restarting", "started", "first step"):
        xs = [r[key] for r in res["restart"]]
        print(f"restart, kill -> {key:<11} {bl.med(xs):6.2f} s {bl.spread(xs)}")
    lost = [r["lost"] for r in res["restart"]]
    print(f"work lost: {bl.med(lost):.0f} steps {bl.spread(lost, '.0f')} (a checkpoint every 20 steps)")
    t = bl.med([r["first step"] for r in res["restart"]])
    print(f"target: first step <= 15 s after the kill: {'met' if t <= 15 else 'NOT met'} ({t:.2f} s); "
          f"restart / fresh start: {t / bl.med(res['fresh']):.2f}x")


if __name__ == "__main__":
    main()
