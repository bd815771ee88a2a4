#!/usr/bin/env python3
"""A spare in the same allocation against a restart through the queue, on Slurm (not a test).

The same 2-node smoke job on the 3-node test cluster (tests/slurmcluster.py), rank 1 failing at step 30 of its
first attempt (`--fail-rank 1 --fail-step 30 --fail-attempt 0`, a checkpoint every 20 steps), with
`--max-restarts 1` and either
  - spare: `--spare-nodes 1`: the next step runs at once in the same Slurm job, node3 in node2's place;
  - queue: no spare: the chain submits the next allocation (a new Slurm job), as every restart was before.
Rounds alternate the order. Per run, from the job's own records: the failure (rank 1's last metrics line in the
failed attempt) to rank 0's first step after it (its first metrics line in the last attempt), and the whole
`invoke train` process. This cluster's queue is empty: the queue's figure is the least a restart through it
costs (a busy cluster adds the wait for nodes, minutes to days).

Needs root, the cpu image (`invoke up`), and the machine to itself (the cluster's names are fixed):
`python3 bench/spare.py [--repeat 3]`.
"""
import argparse
import json
import os
import sys
import tempfile
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="fleetbox-bench-spare-") as tmp:
        bl.private_runs_dir(Path(tmp))
        arms = {"spare": ["--spare-nodes", "1"], "queue": []}
        got = {arm: {"gap": [], "whole": []} for arm in arms}
        with bl.slurm_cluster(Path(tmp)) as env:
            for i, arm in bl.rounds(list(arms), a.repeat):
                t = bl.run([py, "-m", "invoke", "train", "--backend", "slurm", "--nodes", "2", "--runtime", "podman",
                            "--runtime-args", PODMAN_ARGS, "--image", "fleetbox/paddle:cpu", "--max-restarts", "1",
                            *arms[arm], "--args", JOB], cwd=ROOT, env={**os.environ, **env}, timeout=900)
                job_dir = Path(t.proc.stdout.split("logs in ")[1].split()[0].rstrip(";"))
                got[arm]["gap"].append(gap(job_dir, same_job=arm == "spare"))
                got[arm]["whole"].append(t.wall)
                print(f"round {i} {arm:<5}: failure -> first step {got[arm]['gap'][-1]:6.2f} s, whole "
                      f"{t.wall:6.2f} s", flush=True)
    rows = [[arm, f"{bl.med(v['gap']):.2f} s {bl.spread(v['gap'])}", f"{bl.med(v['whole']):.2f} s "
             f"{bl.spread(v['whole'])}"] for arm, v in got.items()]
    print(f"\n2 nodes (3 allocated with the spare), rank 1 failing at step 30, {a.repeat} rounds each, interleaved")
    print(bl.table(["restart", "failure -> first step after it (median)", "invoke train (median)"], rows))
    print(f"  queue - spare: {bl.med(got['queue']['gap']) - bl.med(got['spare']['gap']):.2f} s")


if __name__ == "__main__":
    bl.entry(main)
