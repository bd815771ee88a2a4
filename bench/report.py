#!/usr/bin/env python3
"""What a large job's report costs, not a test: a synthetic job folder of R ranks (8 a node) x N steps of
train/smoke.py's metrics lines (two ranks' loss off the others', one rank slow), then, in a fresh process each
round, the gather (every worker log read into metrics.jsonl) and `invoke report` (the gather again, report.png and
report.md), each the median of the rounds, with the process's peak memory. The sizes run interleaved.

`python bench/report.py [--ranks 64,256,1024] [--steps 1000] [--repeat 3] [--keep DIR]` (no Docker): --keep
copies each size's report.png and report.md to DIR/<ranks>/, to be looked at.
"""
import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import ROOT, entry, med, rounds, table

ROUND = r"""
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from fleetbox.run import metrics, report
job = Path(sys.argv[2])
t = time.perf_counter(); metrics.collect(job); gather_s = time.perf_counter() - t
t = time.perf_counter(); report.draw(job); report_s = time.perf_counter() - t
print(json.dumps({"gather_s": gather_s, "report_s": report_s,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "longest_md_line": max(map(len, (job / "report.md").read_text().splitlines()))}))
"""


def make_job(job: Path, ranks: int, steps: int) -> None:
    ppn = min(8, ranks)
    job.mkdir(parents=True)
    (job / "job.json").write_text(json.dumps({"backend": "slurm", "nodes": ranks // ppn, "procs_per_node": ppn,
                                              "variant": "cpu", "image": "fleetbox/paddle:cpu"}))
    for node in range(ranks // ppn):
        folder = job / f"node{node}"
        folder.mkdir()
        for local in range(ppn):
            k = node * ppn + local
            off = 0.3 if k in (5, ranks - 3) else 0.0   # two ranks whose loss is not the others'
            own = 0.09 if k == ranks // 2 else 0.05 + 0.001 * (k % 7)   # one straggler
            (folder / f"workerlog.{local}").write_text("".join(
                "FLEETBOX-METRIC " + json.dumps({
                    "rank": k, "step": s, "time": 1795797000.0 + 0.06 * s + 0.0001 * k,
                    "loss": 2.0 * math.exp(-s / 300) + off + 0.01 * ((k * 7919 + s * 104729) % 13) / 13,
                    "samples_per_s": 1100.0, "comm_seconds": 0.004, "samples": 64.0, "seconds": 0.058,
                    "own_seconds": own}) + "\n" for s in range(steps)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="64,256,1024")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", type=Path, help="copy each size's report.png and report.md here")
    a = ap.parse_args()
    sizes = [int(x) for x in a.ranks.split(",")]
    results: dict[int, list[dict]] = {n: [] for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {n: Path(tmp) / f"job-{n}" for n in sizes}
        for n, job in jobs.items():
            make_job(job, n, a.steps)
        for _, n in rounds([str(n) for n in sizes], a.repeat):
            done = subprocess.run([sys.executable, "-c", ROUND, str(ROOT), str(jobs[int(n)])],
                                  capture_output=True, text=True, check=True)
            results[int(n)].append(json.loads(done.stdout))
        if a.keep:
            for n, job in jobs.items():
                (a.keep / str(n)).mkdir(parents=True, exist_ok=True)
                for name in ("report.png", "report.md"):
                    shutil.copy(job / name, a.keep / str(n) / name)
    print(f"{a.steps} steps a rank, 8 ranks a node; median of {a.repeat} fresh processes per size, interleaved:")
    print(table(["ranks", "metrics lines", "gather s", "report s", "peak MB", "longest report.md line"],
                [[n, n * a.steps, f"{med([r['gather_s'] for r in rs]):.2f}",
                  f"{med([r['report_s'] for r in rs]):.2f}", f"{med([r['peak_mb'] for r in rs]):.0f}",
                  rs[0]["longest_md_line"]] for n, rs in results.items()]))


if __name__ == "__main__":
    entry(main)
