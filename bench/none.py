#!/usr/bin/env python3
"""No container against Podman on the same Slurm cluster: a 2-node job's time to its first step (not a test).

The same smoke job (`--args "--steps N"`), submitted with `invoke train --backend slurm` on the test cluster
(tests/slurmcluster.py: slurmctld plus a slurmd in each of its network namespaces), once with `--runtime none
--venv ENV` (the env made by `invoke venv` from the same lock and wheelhouse as the image) and once with
`--runtime podman` (the image, loaded into Podman). Rounds alternate the order. Per run, from the job's own
records: the allocation's start (job.sbatch's "allocation 1 started at" line) to rank 0's first step (the time
of its first FLEETBOX-METRIC line, written when step 0 ends), and the whole `invoke train` process.

Needs root, the cpu image (`invoke up`) and the wheelhouse, and the machine to itself (the cluster's names are
fixed): `python3 bench/none.py [--repeat 3] [--steps 20]`.
"""
import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import benchlib as bl
from benchlib import ROOT

PODMAN_ARGS = "--ulimit nofile=20000:20000 --ulimit nproc=32768:32768"   # this machine's limits (tests/test_hpc)


def first_step(job_dir: Path) -> float:
    """Seconds from the allocation's start to the end of rank 0's first step."""
    batch = next(job_dir.glob("slurm-*.out")).read_text()
    start = float(re.search(r"allocation 1 started at (\d+\.\d+)", batch).group(1))
    for ln in (job_dir / "node0" / "workerlog.0").read_text().splitlines():
        if ln.startswith("FLEETBOX-METRIC "):
            return json.loads(ln.split(" ", 1)[1])["time"] - start
    raise SystemExit(f"no step in {job_dir}/node0/workerlog.0")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="fleetbox-bench-none-") as tmp:
        bl.private_runs_dir(Path(tmp))
        env_made = bl.run([py, "-m", "invoke", "venv", "--variant", "cpu", "--dest", Path(tmp) / "envs"], cwd=ROOT)
        venv = env_made.proc.stdout.strip().splitlines()[-1]
        arms = {"none": ["--runtime", "none", "--venv", venv],
                "podman": ["--runtime", "podman", "--runtime-args", PODMAN_ARGS]}
        got = {arm: {"first": [], "whole": []} for arm in arms}
        with bl.slurm_cluster(Path(tmp)) as env:
            for i, arm in bl.rounds(list(arms), a.repeat):
                t = bl.run([py, "-m", "invoke", "train", "--backend", "slurm", "--nodes", "2", *arms[arm],
                            "--args", f"--steps {a.steps}"], cwd=ROOT, env={**os.environ, **env},
                           timeout=900)
                job_dir = Path(t.proc.stdout.split("logs in ")[1].split()[0].rstrip(";"))
                got[arm]["first"].append(first_step(job_dir))
                got[arm]["whole"].append(t.wall)
                print(f"round {i} {arm:<6}: first step {got[arm]['first'][-1]:6.2f} s, whole {t.wall:6.2f} s",
                      flush=True)
    rows = [[arm, f"{bl.med(v['first']):.2f} s {bl.spread(v['first'])}", f"{bl.med(v['whole']):.2f} s "
             f"{bl.spread(v['whole'])}"] for arm, v in got.items()]
    print(f"\n2 nodes, {a.steps} steps, {a.repeat} rounds each, interleaved; env made by invoke venv in "
          f"{env_made.wall:.1f} s")
    print(bl.table(["runtime", "allocation start -> first step (median)", "invoke train (median)"], rows))
    ratio = bl.med(got["none"]["first"]) / bl.med(got["podman"]["first"])
    print(f"  time to first step, none / podman: {ratio:.2f}x")


if __name__ == "__main__":
    bl.entry(main)
