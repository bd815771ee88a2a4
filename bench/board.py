#!/usr/bin/env python3
"""What `invoke board` costs a long job, not a test: a synthetic job folder of R ranks x N steps (lines shaped as
train/smoke.py's), then, in a fresh process each round, the board's first fill (every line read and written as
VisualDL records, READ_LIMIT bytes of a log at a time: the board serves after the first of them, and catches up
on the rest while it serves) and a steady refresh (100 new steps per rank, read from
where the last read stopped), each the median of the rounds, with the peak memory and the records' size.

`python bench/board.py [--ranks 8] [--steps 50000] [--repeat 3]` (no Docker, no VisualDL server).
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import ROOT

sys.path.insert(0, str(ROOT))
from fleetbox.run.visualdl_logs import READ_LIMIT  # noqa: E402 (the checkout's, as the rounds import it)

ROUND = r"""
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fleetbox.run import visualdl_logs as vdl
job, out, ranks, steps = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
watch, logs = vdl.JobRuns(job, "j"), vdl.Logs(out)
t, first = time.perf_counter(), logs.add(watch.read())
serving_s = time.perf_counter() - t   # the board's server starts here, on the history's first bounded part
while watch.behind:   # the rest, as the board catches up while it serves
    first += logs.add(watch.read())
first_s = time.perf_counter() - t
for k in range(ranks):
    with open(job / f"node{k}" / "workerlog.0", "a") as f:
        f.write("".join(sys.argv[6].replace("RANK", str(k)).replace("STEP", str(s)) + "\n"
                        for s in range(steps, steps + 100)))
t = time.perf_counter(); steady = logs.add(watch.read()); steady_s = time.perf_counter() - t
print(json.dumps({"serving_s": serving_s, "first_s": first_s, "first_points": first, "steady_s": steady_s,
                  "steady_points": steady,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "records_mb": sum(f.stat().st_size for f in out.rglob("*.log")) / 1e6}))
"""
LINE = ('FLEETBOX-METRIC {"rank": RANK, "step": STEP, "time": 1795797000.5, "loss": 0.00025197837385348976, '
        '"samples_per_s": 1106.7582655880312, "comm_seconds": 0.003656198998214677, "samples": 64.0, '
        '"seconds": 0.05782653899223078, "own_seconds": 0.0541703399940161}')


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    results = []
    for _ in range(a.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            job = Path(tmp) / "j"
            job.mkdir()
            (job / "job.json").write_text(json.dumps({"backend": "docker", "nodes": a.ranks, "procs_per_node": 1}))
            for k in range(a.ranks):
                (job / f"node{k}").mkdir()
                (job / f"node{k}" / "workerlog.0").write_text("".join(
                    LINE.replace("RANK", str(k)).replace("STEP", str(s)) + "\n" for s in range(a.steps)))
            done = subprocess.run([sys.executable, "-c", ROUND, str(ROOT), str(job), str(Path(tmp) / "logs"),
                                   str(a.ranks), str(a.steps), LINE], capture_output=True, text=True, check=True)
            results.append(json.loads(done.stdout))
    med = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"{a.ranks} ranks x {a.steps} steps, median of {a.repeat} fresh processes:")
    print(f"  serving after:  {med['serving_s']:.1f} s (the history's first {READ_LIMIT >> 20} MiB a log)")
    print(f"  first fill:     {med['first_s']:.1f} s, {med['first_points']:.0f} points (the whole history, "
          f"while serving)")
    print(f"  steady refresh: {1000 * med['steady_s']:.0f} ms for {med['steady_points']:.0f} new points")
    print(f"  peak memory {med['peak_mb']:.0f} MB; VisualDL records {med['records_mb']:.0f} MB")


if __name__ == "__main__":
    main()
