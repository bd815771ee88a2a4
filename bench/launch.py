#!/usr/bin/env python3
"""Launch overhead and scaling of `invoke train`: whole process against whole process (not a test).

1. `python3 -m invoke train --nodes 2 --args "--steps N"` (the smoke job: plan, two containers, rank 0
   streamed, logs gathered, containers removed) against the same 2-node job as two bare
   `paddle.distributed.launch` processes on the host (target: <= 1.25x, ratio of medians).
   Like with like: the bare side runs from a venv installed from the same wheelhouse and lock as the image,
   with the command and environment of fleetbox's own plan for that job (DockerBackend().plan: the image's
   ENV with /opt/venv mapped to the venv, then every node's env, HOME and HOSTNAME; nothing inherited from
   this shell), the plan's stack and memlock limits, the workspace as working folder, rank output to a file
   as Docker keeps it. Rounds alternate the order: A B, B A, A B ...
2. fleetbox's own overhead, measured in those same `invoke train` runs from timestamps (nothing estimated
   from other runs): process start, job.json/handle.json (written once the plan is made), the engine's
   create/start/die/destroy events for the job's containers, container.log (written by the gather), process
   exit. Plus the plan alone: DockerBackend().plan() with a fresh engine client, timed in this process.
3. samples/s of the smoke job (its own all-reduced figure): 2 nodes in containers, 2 bare, 1 node.

Needs the cpu image and wheelhouse (`invoke up`), and the Docker Engine to itself: run it as
`flock /tmp/fleetbox-docker.lock python bench/launch.py [--repeat 5] [--steps 300]`.
"""
import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import benchlib as bl
from benchlib import ROOT

sys.path.insert(0, str(ROOT))
from fleetbox import engine, settings  # noqa: E402
from fleetbox.image import matrix, wheelhouse  # noqa: E402
from fleetbox.run import plan as planner  # noqa: E402
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends.docker import DockerBackend  # noqa: E402

VENV = Path(os.environ.get("FLEETBOX_BENCH_VENV", "/var/cache/fleetbox/bench-venv"))
OURS, BARE = "invoke train --nodes 2 (containers)", "bare paddle.distributed.launch x2 (host)"
PHASES = ["start-up + plan (python, invoke, imports, plan)", "create + start containers",
          "containers running (Paddle: launch, train, exit)", "notice the exits + gather logs", "remove containers",
          "result, summary.json, process exit"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="rounds (Paddle's launcher adds 0-3 s of noise per run)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    v = matrix.load().get("cpu")
    py = host_paddle(v)
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        bl.private_runs_dir(Path(tmp))   # job folders go here, not under runs/
        image_env = engine.client().images.get(v.aliases[0]).attrs["Config"]["Env"]
        tag = f"bench-{os.getpid()}"
        plan(v, 2, 60, f"{tag}-warm-plan")   # imports, so the timed plans below are plans only
        ours(v, 60, f"{tag}-warm-a")        # warm the page cache for both sides (60 steps: smoke's loss check)
        bare(plan(v, 2, 60, f"{tag}-warm-b")[0], py, image_env)

        walls = {OURS: [], BARE: []}
        rates = {OURS: [], BARE: [], "1 node (container)": []}
        phases, plans = [], []
        for i, arm in bl.rounds([OURS, BARE], args.repeat):
            if arm == OURS:
                wall, ph, rate = ours(v, args.steps, f"{tag}-{i}-a")
                phases.append(ph)
            else:
                p, plan_s = plan(v, 2, args.steps, f"{tag}-{i}-b")
                plans.append(plan_s)
                wall, rate = bare(p, py, image_env)
            walls[arm].append(wall)
            rates[arm].append(rate)
        for i in range(args.repeat):   # after the pairs, so the 1-node runs never sit between A and B
            rates["1 node (container)"].append(ours(v, args.steps, f"{tag}-{i}-one", nodes=1)[2])

    n = args.repeat
    o, b = bl.med(walls[OURS]), bl.med(walls[BARE])
    print(f"\n1. 2-node smoke job ({args.steps} steps), whole process, median of {n} (order A B, B A, ...):")
    print(bl.table(["", "s", "spread"], [[a, f"{bl.med(w):.2f}", bl.spread(w)] for a, w in walls.items()]))
    print(f"  ratio of medians   {o / b:.2f}x  (target <= 1.25x: {'met' if o / b <= 1.25 else 'NOT met'})")
    print(f"  ratio of minimums  {min(walls[OURS]) / min(walls[BARE]):.2f}x  (Paddle's launcher sleeps a random 0-2 s "
          f"before its master starts and polls its workers once a second: up to ~3 s of noise on both sides)")

    rows = [[name, f"{bl.med(xs):.3f}", bl.spread(xs, '.3f')] for name, xs in zip(PHASES, zip(*phases))]
    overhead = [sum(x for k, x in enumerate(ph) if k != 2) for ph in phases]
    rows.append(["fleetbox's own overhead (all but 'running')", f"{bl.med(overhead):.3f}", bl.spread(overhead, '.3f')])
    rows.append(["plan alone (DockerBackend().plan, fresh client)", f"{bl.med(plans):.3f}", bl.spread(plans, '.3f')])
    print(f"\n2. where `invoke train --nodes 2` spends its time, measured in the runs above, median of {n}:")
    print(bl.table(["phase", "s", "spread"], rows))
    print("  (each phase between two timestamps of the same run; medians per phase need not add up to the total)")

    print(f"\n3. throughput (smoke job's all-reduced samples/s), median of {n}:")
    print(bl.table(["", "samples/s", "spread"],
                   [[a, f"{bl.med(r):.0f}", bl.spread(r, '.0f')] for a, r in rates.items()]))
    r1, r2 = bl.med(rates["1 node (container)"]), bl.med(rates[OURS])
    print(f"  2 nodes / 1 node (containers): {r2 / r1:.2f}x (both nodes share this machine's {os.cpu_count()} cores)")


def host_paddle(v) -> Path:
    """A host venv with exactly the image's packages (offline, from the same wheelhouse, hashes required)."""
    py = VENV / "bin" / "python"
    if not py.exists():
        print(f"making {VENV} from the wheelhouse (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                        str(wheelhouse.default_dir(v)), "--require-hashes", "-r",
                        str(ROOT / "images" / "locks" / f"{v.name}.lock")], check=True)
    return py


def plan(v, nodes: int, steps: int, job_id: str):
    """fleetbox's plan for the smoke job (what `invoke train` would run), and how long planning took."""
    spec = spec_mod.from_options(v, nodes=nodes, args=f"--steps {steps}", job_id=job_id)
    t = time.perf_counter()
    p = DockerBackend().plan(spec)
    return p, time.perf_counter() - t


def ours(v, steps: int, job_id: str, nodes: int = 2):
    """`invoke train` as a whole process; (wall s, its phases from timestamps, samples/s)."""
    t = bl.run([sys.executable, "-m", "invoke", "train", "--variant", v.name, "--nodes", nodes,
                "--args", f"--steps {steps}", "--job-id", job_id], cwd=ROOT)
    d = settings.runs_root() / job_id
    return t.wall, phases(t, d, job_id), samples_per_s(d / "node0" / "workerlog.0")


def phases(t: bl.Timed, d: Path, job_id: str) -> list[float]:
    """The run's phases (PHASES), each between two timestamps of this run: the process's start and exit
    (this process's clock), the job files' modification times and the engine's container events (the same
    machine's clock)."""
    out = subprocess.run(["docker", "events", "--since", f"{t.start - 1:.3f}", "--until", f"{time.time():.3f}",
                          "--filter", "type=container", "--filter", f"label={settings.LABEL_JOB}={job_id}",
                          "--format", "{{json .}}"], capture_output=True, text=True, check=True).stdout
    ev: dict[str, list[float]] = {}
    for line in out.splitlines():
        e = json.loads(line)
        ev.setdefault(e["Action"], []).append(e["timeNano"] / 1e9)
    planned = next(p.stat().st_mtime for p in (d / "handle.json", d / "job.json") if p.exists())
    gathered = max(p.stat().st_mtime for p in d.glob("node*/container.log"))
    marks = [t.start, planned, max(ev["start"]), max(ev["die"]), gathered, max(ev["destroy"]), t.end]
    if marks != sorted(marks) or min(ev["create"]) < planned:
        print(f"warning: {job_id}: timestamps out of order {marks}", file=sys.stderr)
    return [b - a for a, b in zip(marks, marks[1:])]


def bare(p, py: Path, image_env: list[str]):
    """The plan's nodes as bare processes on the host; (wall s, samples/s)."""
    venv = next((e.split("=", 1)[1] for e in image_env if e.startswith("VIRTUAL_ENV=")), "/opt/venv")
    base = dict(e.split("=", 1) for e in image_env)
    base = {k: val.replace(venv, str(VENV)) for k, val in base.items()}   # the image's venv is ours here
    procs, logs = [], []
    t = time.perf_counter()
    try:
        for node in p.nodes:
            to_host = {m.dst: m.src for m in node.mounts}

            def host_path(a: str) -> str:
                for dst, src in to_host.items():
                    if a == dst or a.startswith(dst + "/"):
                        return src + a[len(dst):]
                return a
            env = {**base, **node.env, "HOME": str(Path.home()), "HOSTNAME": socket.gethostname()}
            exe = shutil.which(node.command[0], path=env["PATH"])
            assert exe and Path(exe).is_relative_to(VENV), exe
            log_dir = Path(to_host[settings.LOG_DIR])
            log_dir.mkdir(parents=True, exist_ok=True)
            logs.append(open(log_dir / "container.log", "wb"))
            procs.append(subprocess.Popen([exe, *map(host_path, node.command[1:])], env=env,
                                          cwd=host_path(settings.WORKDIR), stdout=logs[-1], stderr=subprocess.STDOUT,
                                          preexec_fn=limits(node.memlock), start_new_session=True))
        codes = [q.wait() for q in procs]
        wall = time.perf_counter() - t
    finally:   # interrupted: each launcher and its workers (its own process group, started here) go
        for q in procs:
            if q.poll() is None:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    os.killpg(q.pid, sig)
                    try:
                        q.wait(timeout=10)
                        break
                    except subprocess.TimeoutExpired:
                        pass
        for f in logs:
            f.close()
    if any(codes):
        sys.exit(f"bare launch failed: {codes} (logs: {p.dir})")
    return wall, samples_per_s(p.dir / "node0" / "workerlog.0")


def limits(memlock: int):
    """The containers' ulimits (plan.STACK_BYTES, the plan's memlock) for a bare process."""
    def apply():
        resource.setrlimit(resource.RLIMIT_STACK, (planner.STACK_BYTES, planner.STACK_BYTES))
        m = resource.RLIM_INFINITY if memlock == -1 else memlock
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (m, m))
        except (ValueError, OSError):
            pass   # the host cannot raise it: the container could not either (the plan says so)
    return apply


def samples_per_s(worker_log: Path) -> float:
    """The smoke job's own figure, from rank 0's FLEETBOX-SMOKE line."""
    for line in worker_log.read_text(errors="replace").splitlines():
        if line.startswith("FLEETBOX-SMOKE "):
            return json.loads(line[len("FLEETBOX-SMOKE "):])["samples_per_s"]
    sys.exit(f"no FLEETBOX-SMOKE line in {worker_log}")


if __name__ == "__main__":
    bl.entry(main)
