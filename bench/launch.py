#!/usr/bin/env python3
"""Launch overhead and scaling of `invoke train`, measured side by side in one run (not a test).

1. Wall time of `invoke train --nodes 2` (smoke job, whole process: containers, gathering, cleanup) against
   the same 2-node job started as bare `paddle.distributed.launch` processes on the host (target <= 1.25x).
   The host side runs from a venv installed from the same wheelhouse and lock as the image.
2. samples/s of the smoke job on 2 nodes against 1 node (the smoke job's own all-reduced figure).

Needs the cpu image and wheelhouse (`invoke up`). Usage: python bench/launch.py [--repeat 3] [--steps 300]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetbox.run.hostnet import free_port  # noqa: E402

VENV = Path(os.environ.get("FLEETBOX_BENCH_VENV", "/var/cache/fleetbox/bench-venv"))


def host_paddle() -> Path:
    """A host venv with exactly the image's packages (offline, from the wheelhouse, hashes required)."""
    py = VENV / "bin" / "python"
    if not py.exists():
        print(f"making {VENV} from the wheelhouse (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                        str(ROOT / "wheelhouse" / "cpu"), "--require-hashes", "-r",
                        str(ROOT / "images" / "locks" / "cpu.lock")], check=True)
    return py


def bare(py: Path, steps: int) -> float:
    port, t = free_port("127.0.0.1"), time.perf_counter()
    with tempfile.TemporaryDirectory() as logs:
        procs = [subprocess.Popen([str(py), "-m", "paddle.distributed.launch", "--master", f"127.0.0.1:{port}",
                                   "--host", "127.0.0.1", "--nnodes", "2", "--rank", str(r), "--nproc_per_node",
                                   "1", "--log_dir", f"{logs}/node{r}", str(ROOT / "train" / "smoke.py"),
                                   "--steps", str(steps)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=logs)
                 for r in (0, 1)]
        codes = [p.wait() for p in procs]
    if any(codes):
        sys.exit(f"bare launch failed: {codes}")
    return time.perf_counter() - t


def fleetbox(nodes: int, steps: int) -> tuple[float, dict]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "invoke", "train", "--nodes", str(nodes), "--args",
                           f"--steps {steps}"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.exit(f"invoke train failed:\n{proc.stderr[-2000:]}")
    job_dir = proc.stdout.split("logs in ")[1].split()[0]
    return wall, json.loads((Path(job_dir) / "summary.json").read_text())["smoke"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    py = host_paddle()
    bare(py, 60)   # warm the page cache for both sides (60 steps: enough for smoke's loss check)
    fleetbox(2, 60)
    ours, theirs, rate1, rate2 = [], [], [], []
    for _ in range(args.repeat):   # interleaved, so both see the same machine load
        wall, smoke = fleetbox(2, args.steps)
        ours.append(wall)
        rate2.append(smoke["samples_per_s"])
        theirs.append(bare(py, args.steps))
        rate1.append(fleetbox(1, args.steps)[1]["samples_per_s"])
    o, b = statistics.median(ours), statistics.median(theirs)
    spread = lambda xs: f"(min {min(xs):.2f}, max {max(xs):.2f})"
    r1, r2 = statistics.median(rate1), statistics.median(rate2)
    print(f"2-node smoke job ({args.steps} steps), median of {args.repeat}:")
    print(f"  invoke train --nodes 2 (containers)       {o:6.2f} s {spread(ours)}")
    print(f"  bare paddle.distributed.launch x2 (host)  {b:6.2f} s {spread(theirs)}")
    print(f"  ratio of medians                           {o / b:6.2f}x  (target <= 1.25x)")
    print(f"  ratio of minimums                          {min(ours) / min(theirs):6.2f}x  (Paddle's launcher polls its "
          f"workers every 2 s, which quantises both)")
    print(f"throughput (smoke job's all-reduced samples/s), median of {args.repeat}:")
    print(f"  1 node   {r1:10.0f} samples/s")
    print(f"  2 nodes  {r2:10.0f} samples/s   ({r2 / r1:.2f}x of 1 node; both nodes share this machine's cores)")


if __name__ == "__main__":
    main()
