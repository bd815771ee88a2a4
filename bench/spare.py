#!/usr/bin/env python3
"""A spare in the same allocation against a restart through the queue, on Slurm (not a test).

The same 2-node smoke job on the 3-node test cluster (tests/slurmcluster.py), rank 1 failing at step 30 of its
first attempt (`--fail-rank 1 --fail-step 30 --fail-attempt 0`, a checkpoint every 20 steps), with
`--max-restarts 1` and either
  - spare: `--spare-nodes 1`: the next step runs at once in the same Slurm job, node3 in node2's place;
  - queue: no spare: the chain submits the next allocation (a new Slurm job), as every restart was before.
Rounds alternate the order. Per run, from the job's own records: the failure (rank 1's last metrics line in the
failed attempt) to rank 0's first step after it (its first metrics line in the last attempt), and the whole
`invoke train` process.

With `--busy S`, the queue is not empty: once the job runs, another user's job asks for 2 nodes for S seconds
(`sbatch --wrap "sleep S"`, waiting behind ours, as on a busy cluster). A restart through the queue then waits
behind it; a spare's step does not leave the allocation. Without it, the queue's figure is the least a restart
through the queue costs.

Needs root, the cpu image (`invoke up`), and the machine to itself (the cluster's names are fixed):
`python3 bench/spare.py [--repeat 3] [--busy 20]`.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import benchlib as bl
from benchlib import ROOT

PODMAN_ARGS = "--ulimit nofile=20000:20000 --ulimit nproc=32768:32768"   # this machine's limits (tests/test_hpc)
JOB = "--steps 60 --step-sleep 0.05 --log-every 1 --checkpoint-every 20 --fail-rank 1 --fail-step 30 " \
      "--fail-attempt 0"


def times(workerlog: Path) -> list[float]:
    return [json.loads(ln.split(" ", 1)[1])["time"] for ln in workerlog.read_text(errors="replace").splitlines()
            if ln.startswith("FLEETBOX-METRIC ")]


def gap(job_dir: Path, same_job: bool) -> float:
    """Seconds from rank 1's last step in the failed attempt to rank 0's first step in the last one (which ran in
    the failed one's Slurm job, or in another, as `same_job` says)."""
    s = json.loads((job_dir / "summary.json").read_text())
    failed, last = s["attempts"][0], s["attempts"][-1]
    if failed["ok"] or not last["ok"] or (failed["slurm_job"] == last["slurm_job"]) != same_job:
        raise SystemExit(f"the job did not fail once and pass as planned: {s['attempts']}")
    return times(job_dir / "node0" / "workerlog.0")[0] - times(Path(failed["logs"]) / "node1" / "workerlog.0")[-1]


def busy(job_dir: Path, seconds: float, env: dict, done: threading.Event, filler: list) -> None:
    """Once the job's Slurm job runs, another job asking 2 nodes for `seconds` waits behind it (its id in
    `filler`)."""
    handle = job_dir / "handle.json"
    while not done.is_set():
        if handle.exists():
            job = json.loads(handle.read_text())["scheduler_job"]
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                                   env=env).stdout.strip()
            if state == "RUNNING":
                filler.append(subprocess.run(
                    ["sbatch", "--parsable", "--nodes=2", "--output=/dev/null", "--job-name=bench-busy",
                     "--wrap", f"sleep {seconds:g}"], capture_output=True, text=True, check=True,
                    env=env).stdout.strip().split(";")[0])
                return
        time.sleep(0.2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--busy", type=float, default=0, help="seconds another user's 2-node job holds what it gets")
    a = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="fleetbox-bench-spare-") as tmp:
        runs = bl.private_runs_dir(Path(tmp))
        arms = {"spare": ["--spare-nodes", "1"], "queue": []}
        got = {arm: {"gap": [], "whole": []} for arm in arms}
        with bl.slurm_cluster(Path(tmp)) as env:
            for i, arm in bl.rounds(list(arms), a.repeat):
                job_id, done, filler = f"bench-spare-{arm}-{i}", threading.Event(), []
                job_dir = runs / job_id
                watcher = threading.Thread(target=busy, args=(job_dir, a.busy, {**os.environ, **env}, done, filler))
                if a.busy:
                    watcher.start()
                try:
                    t = bl.run([py, "-m", "invoke", "train", "--backend", "slurm", "--nodes", "2", "--job-id", job_id,
                                "--runtime", "podman", "--runtime-args", PODMAN_ARGS, "--image", "fleetbox/paddle:cpu",
                                "--max-restarts", "1", *arms[arm], "--args", JOB], cwd=ROOT,
                               env={**os.environ, **env}, timeout=900)
                finally:
                    done.set()
                    if a.busy:
                        watcher.join()
                    if filler:
                        subprocess.run(["scancel", *filler], env={**os.environ, **env}, check=False)
                got[arm]["gap"].append(gap(job_dir, same_job=arm == "spare"))
                got[arm]["whole"].append(t.wall)
                print(f"round {i} {arm:<5}: failure -> first step {got[arm]['gap'][-1]:6.2f} s, whole "
                      f"{t.wall:6.2f} s", flush=True)
    rows = [[arm, f"{bl.med(v['gap']):.2f} s {bl.spread(v['gap'])}", f"{bl.med(v['whole']):.2f} s "
             f"{bl.spread(v['whole'])}"] for arm, v in got.items()]
    print(f"\n2 nodes (3 allocated with the spare), rank 1 failing at step 30, {a.repeat} rounds each, interleaved"
          + (f"; another job asks 2 nodes for {a.busy:g} s once each runs" if a.busy else "; the queue empty"))
    print(bl.table(["restart", "failure -> first step after it (median)", "invoke train (median)"], rows))
    print(f"  queue - spare: {bl.med(got['queue']['gap']) - bl.med(got['spare']['gap']):.2f} s")


if __name__ == "__main__":
    bl.entry(main)
