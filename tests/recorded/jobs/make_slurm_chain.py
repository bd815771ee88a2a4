"""Make a Slurm job of two allocations with this checkout's fleetbox, without a cluster, as a fixture:

    python3 tests/recorded/jobs/make_slurm_chain.py

fleetbox's own code writes every record and script: SlurmBackend.plan and submit (job.sbatch, node.sh, job.json,
handle.json), the rendered job.sbatch and node.sh run by bash as Slurm would run them (allocations.jsonl,
alloc1/, started.<N>, each allocation's batch output as slurm-<N>.out), the in-container helpers
(fleetbox_metrics' lines, fleetbox_progress' files) and SlurmBackend.follow, as an attached `invoke train`
ends (summary.json). Stand-ins, on PATH: sbatch (hands out Slurm job ids 7, 8), scontrol (the node's address;
every job COMPLETED), srun (runs node.sh once per node, its output to node<k>.log), and the env's `python`,
which plays Paddle's launcher and the training script: it runs 8 steps from the newest checkpoint through
fleetbox_metrics.Meter, writes a checkpoint's COMPLETE marker every 4 steps and STATE as fleetbox_checkpoint
does ("continue" at the time limit after 8 steps, "done" at step 16). Runs in /tmp/fleetbox-recorded; the job
folder is copied here with its path as @JOB_DIR@, without hang.py and helpers/ (copies of fleetbox's source).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORK = Path("/tmp/fleetbox-recorded")
TOKEN = "@JOB_DIR@"

SBATCH = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/sbatch.log"
n=$(cat "$(dirname "$0")/next-id"); echo $((n + 1)) > "$(dirname "$0")/next-id"
echo "$n"
"""
SCONTROL = """#!/bin/sh
case "$2" in
  hostnames) echo localhost;;
  node) echo "NodeName=localhost NodeAddr=127.0.0.1 State=IDLE";;
  job) echo "JobId=$3 JobName=fleetbox JobState=COMPLETED Reason=None ExitCode=0:0";;
esac
"""
SRUN = """#!{py}
import os, subprocess, sys
args = sys.argv[1:]
output = next(a.split("=", 1)[1] for a in args if a.startswith("--output="))
cmd = args[next(i for i, a in enumerate(args) if not a.startswith("-")):]
procs = []
for k in range(int(os.environ["SLURM_NNODES"])):
    log = open(output.replace("%n", str(k)), "w")
    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  env={{**os.environ, "SLURM_NODEID": str(k), "SLURM_PROCID": str(k)}}))
sys.exit(max(p.wait() for p in procs))
"""
# Paddle's launcher and the training script, in one: the worker's lines go to its workerlog and, as the launcher
# echoes them, to the node's output
PYTHON = """#!{py}
import contextlib, json, os, sys, time
args = sys.argv[1:]
assert args[:2] == ["-m", "paddle.distributed.launch"], args
rank, log_dir = int(args[args.index("--rank") + 1]), args[args.index("--log_dir") + 1]
print(f"LAUNCH INFO stand-in for paddle.distributed.launch: rank {{rank}} of {{args[args.index('--nnodes') + 1]}}, "
      f"master {{args[args.index('--master') + 1]}}", flush=True)
os.environ["PADDLE_TRAINER_ID"] = str(rank)
import fleetbox_checkpoint_folder as layout
import fleetbox_metrics
ckpt = os.environ["FLEETBOX_CHECKPOINT_DIR"]
start = (layout.complete_steps(ckpt) or [0])[0]
end = min(start + 8, 16)


class Both:
    def __init__(self, f):
        self.f = f

    def write(self, s):
        self.f.write(s)
        sys.__stdout__.write(s)

    def flush(self):
        self.f.flush()
        sys.__stdout__.flush()


with open(os.path.join(log_dir, "workerlog.0"), "w") as f, contextlib.redirect_stdout(Both(f)):
    print(f"fleetbox-checkpoint: resumed from step {{start}}" if start else "fleetbox-checkpoint: no checkpoint yet")
    meter = fleetbox_metrics.Meter()
    for step in range(start, end):
        time.sleep(0.02 + 0.005 * rank)
        meter.step(step, loss=2.0 * 0.9 ** step + 0.05 * rank, samples=64, comm_seconds=0.005)
        if rank == 0 and (step + 1) % 4 == 0:
            d = os.path.join(ckpt, f"step-{{step + 1:08d}}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, layout.COMPLETE), "w") as m:
                json.dump({{"step": step + 1, "world": 2, "time": time.time(), "files": {{}}}}, m)
            print(f"fleetbox-checkpoint: saved step {{step + 1}}")
    if rank == 0:
        with open(os.path.join(ckpt, layout.STATE), "w") as m:
            json.dump({{"state": "done" if end >= 16 else "continue", "step": end, "time": time.time()}}, m)
    if end < 16:
        print(f"fleetbox-checkpoint: stopping at step {{end}} for the next allocation")
print("LAUNCH INFO Exit code 0", flush=True)
"""


def tool(path: Path, text: str) -> None:
    path.write_text(text.format(py=sys.executable) if "{py}" in text else text)
    path.chmod(0o755)


def allocation(job_dir: Path, slurm_job: str, env: dict) -> None:
    """job.sbatch, run as Slurm runs it: its output appended to slurm-<job>.out."""
    with open(job_dir / f"slurm-{slurm_job}.out", "a") as out:
        proc = subprocess.run(["bash", str(job_dir / "job.sbatch")], stdout=out, stderr=subprocess.STDOUT,
                              env={**env, "SLURM_JOB_ID": slurm_job}, timeout=120)
    assert proc.returncode == 0, (job_dir / f"slurm-{slurm_job}.out").read_text()


def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    bin_, venv = WORK / "bin", WORK / "env"
    (venv / "bin").mkdir(parents=True)
    bin_.mkdir()
    for name, text in (("sbatch", SBATCH), ("scontrol", SCONTROL), ("srun", SRUN)):
        tool(bin_ / name, text)
    (bin_ / "next-id").write_text("7\n")
    tool(venv / "bin" / "python", PYTHON)
    (venv / "fleetbox-env.json").write_text(json.dumps({"variant": "cpu"}))   # what `invoke venv` records
    os.environ.update(FLEETBOX_RUNS=str(WORK / "runs"), PATH=f"{bin_}:{os.environ['PATH']}")
    sys.path.insert(0, str(ROOT))
    from fleetbox.image import matrix
    from fleetbox.run import spec as spec_mod
    from fleetbox.run.backends import slurm

    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, job_id=spec_mod.new_job_id())
    backend = slurm.SlurmBackend("none", venv=str(venv), time="00:30:00", max_allocations=3)
    handle = backend.submit(backend.plan(spec))
    job_dir = Path(handle.dir)
    env = {**os.environ, "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "2", "SLURM_RESTART_COUNT": "0"}
    allocation(job_dir, handle.scheduler_job, env)
    # the next allocation gets what allocation 1's sbatch exported (--export=ALL,NAME=VALUE,...)
    exported = (bin_ / "sbatch.log").read_text().splitlines()[-1].split("--export=ALL,")[1].split()[0]
    allocation(job_dir, "8", {**env, **dict(kv.split("=", 1) for kv in exported.split(","))})
    said = []
    backend.follow(handle, log=said.append, poll=0.05)
    print("\n".join(said))

    dst = HERE / job_dir.name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(job_dir, dst, ignore=shutil.ignore_patterns(slurm.HANG_PY, slurm.HELPERS))
    for f in dst.rglob("*"):
        if f.is_file():
            f.write_text(f.read_text().replace(str(job_dir), TOKEN))
    print(f"{dst}: {sum(f.stat().st_size for f in dst.rglob('*') if f.is_file())} bytes")


if __name__ == "__main__":
    main()
