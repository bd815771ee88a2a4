#!/usr/bin/env python3
"""Hang detection's two costs (`invoke train --hang-timeout`), not a test.

1. Latency: a 2-node smoke job whose rank 1 gets stuck at step 30 (`--hang-rank 1 --hang-step 30`), with
   `--hang-timeout H`. From rank 1's last progress (its last metrics line's time) to every container stopped
   (the engine's FinishedAt), split into: the deadline itself (H), noticing it (fleetbox's "taking every
   rank's stacks" line), the stacks, and the stop. Target: every container stopped within H + 10 s.
2. Overhead: the same smoke job (`--steps N`, no sleeps) with detection on (the default deadlines: progress
   files, the faulthandler and relay in every container) and off (`--hang-timeout 0 --start-timeout 0`: none
   of it runs), interleaved whole `invoke train` processes; the median step time of rank 0's metrics and
   the process's wall time. This machine's noise is several per cent: compare medians, not single rounds.

3. With --plain, the overhead for a script with no line of fleetbox's, whose steps hang detection sees in the
   training itself (sitecustomize wraps the optimizer's step): the same plain script with detection on and off,
   interleaved whole processes; the median of the step times the script measures itself, and the wall time.

Needs the cpu image (`invoke up`) and the Docker Engine to itself:
`flock /tmp/fleetbox-docker.lock python bench/hang.py [--repeat 3] [--steps 300] [--hang-timeout 10] [--plain]`.
"""
import argparse
import datetime as dt
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

import benchlib as bl
from benchlib import ROOT


def job_dir(out: str) -> Path:
    return Path(re.search(r"logs in (\S+)", out).group(1).rstrip(","))


def metrics(workerlog: Path) -> list[dict]:
    return [json.loads(ln.split(" ", 1)[1]) for ln in workerlog.read_text(errors="replace").splitlines()
            if ln.startswith("FLEETBOX-METRIC ")]


def finished(ts: str) -> float:
    return dt.datetime.fromisoformat(ts[:26].rstrip("Z")).replace(tzinfo=dt.timezone.utc).timestamp()


def latency(hang_timeout: float) -> dict:
    argv = [sys.executable, "-m", "invoke", "train", "--nodes", "2", "--hang-timeout", str(hang_timeout),
            "--args", "--steps 200 --step-sleep 0.05 --hang-rank 1 --hang-step 30"]
    t = bl.run(argv, check=False, cwd=ROOT)
    if "hung" not in t.proc.stderr:
        sys.exit(f"the job did not end as hung:\n{t.proc.stdout[-2000:]}\n{t.proc.stderr}")
    d = job_dir(t.proc.stdout)
    s = json.loads((d / "summary.json").read_text())
    last = metrics(d / "node1" / "workerlog.0")[-1]["time"]
    stopped = max(finished(n["finished_at"]) for n in s["nodes"])
    # the stacks were asked for once the deadline passed: the request file's time
    asked = max((d / f"node{k}" / "STACKS-REQUEST").stat().st_mtime for k in (0, 1))
    stacks = max((d / f"node{k}" / f"stacks-rank{k}.txt").stat().st_mtime for k in (0, 1))
    return {"stopped": stopped - last, "noticed": asked - last - hang_timeout, "stacks": stacks - asked,
            "stop": stopped - stacks, "named": s["hang"]["ranks"] == [1]}


def overhead(arm: str, steps: int) -> dict:
    off = ["--hang-timeout", "0", "--start-timeout", "0"] if arm == "off" else []
    t = bl.run([sys.executable, "-m", "invoke", "train", "--nodes", "2", *off, "--args",
                f"--steps {steps} --checkpoint-every 100"], cwd=ROOT)
    d = job_dir(t.proc.stdout)
    seconds = [m["seconds"] for m in metrics(d / "node0" / "workerlog.0") if "seconds" in m][5:]   # warm
    watched = (d / "node0" / "progress-rank0.json").exists()
    if watched != (arm == "on"):
        sys.exit(f"arm {arm}: progress files {'present' if watched else 'absent'}")
    return {"step_ms": statistics.median(seconds) * 1000, "wall": t.wall}


# No fleetbox helper: each step's own time, measured by the script, printed by rank 0
PLAIN = """import sys, time
import paddle
import paddle.distributed as dist
dist.init_parallel_env()
net = paddle.nn.Sequential(paddle.nn.Linear(256, 256), paddle.nn.ReLU(), paddle.nn.Linear(256, 1))
model = paddle.DataParallel(net)
opt = paddle.optimizer.Adam(parameters=model.parameters())
x = paddle.randn([64, 256])
for step in range(int(sys.argv[1])):
    t = time.perf_counter()
    loss = model(x).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    if dist.get_rank() == 0:
        print(f"BENCH-STEP {time.perf_counter() - t:.6f}", flush=True)
"""


def plain_job(options: list[str], steps: int, script: Path, warm: int) -> tuple[Path, list[float], float]:
    """`script` (no fleetbox line; rank 0 prints each step's time as BENCH-STEP) as a 2-node job with `options`:
    its folder, rank 0's step times after the first `warm`, and the whole process's wall time."""
    t = bl.run([sys.executable, "-m", "invoke", "train", "--nodes", "2", *options, "--script", str(script),
                "--args", str(steps)], cwd=ROOT)
    d = job_dir(t.proc.stdout)
    log = (d / "node0" / "workerlog.0").read_text(errors="replace")
    return d, [float(ln.split()[1]) for ln in log.splitlines() if ln.startswith("BENCH-STEP ")][warm:], t.wall


def plain(arm: str, steps: int, script: Path) -> dict:
    off = ["--hang-timeout", "0", "--start-timeout", "0"] if arm == "plain-off" else []
    d, seconds, wall = plain_job(off, steps, script, warm=5)
    rec = d / "node0" / "progress-rank0.json"
    seen = json.loads(rec.read_text())["step"] if rec.exists() else None
    if (arm == "plain-on") != (seen == steps):   # on: every step seen in the training itself; off: none
        sys.exit(f"arm {arm}: progress file says step {seen} of {steps}")
    return {"step_ms": statistics.median(seconds) * 1000, "wall": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--hang-timeout", type=float, default=10)
    ap.add_argument("--plain", action="store_true", help="only the overhead for a script with no line of ours")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleetbox-bench-hang-") as tmp:
        bl.private_runs_dir(Path(tmp))
        if args.plain:
            script = Path(tmp) / "plain.py"
            script.write_text(PLAIN)
            res = {"plain-on": [], "plain-off": []}
            for i, arm in bl.rounds(list(res), args.repeat):
                res[arm].append(plain(arm, args.steps, script))
                print(f"round {i} {arm}: " + ", ".join(f"{k} {v:.2f}" for k, v in res[arm][-1].items()), flush=True)
            on, off = (bl.med([r["step_ms"] for r in res[a]]) for a in res)
            won, woff = (bl.med([r["wall"] for r in res[a]]) for a in res)
            print(f"\nplain script, step time, detection on {on:.3f} ms, off {off:.3f} ms: "
                  f"{100 * (on / off - 1):+.1f}% "
                  f"{bl.spread([r['step_ms'] for r in res['plain-on']])} / "
                  f"{bl.spread([r['step_ms'] for r in res['plain-off']])}")
            print(f"whole job ({args.steps} steps), on {won:.1f} s, off {woff:.1f} s: {100 * (won / woff - 1):+.1f}%")
            return
        res = {"hang": [], "on": [], "off": []}
        for i, arm in bl.rounds(["on", "off", "hang"], args.repeat):
            r = latency(args.hang_timeout) if arm == "hang" else overhead(arm, args.steps)
            res[arm].append(r)
            print(f"round {i} {arm}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in r.items()), flush=True)
    print()
    h = res["hang"]
    print(bl.table(["last progress -> (s)", "median", "spread"], [
        [k, f"{bl.med([r[k] for r in h]):.2f}", bl.spread([r[k] for r in h])]
        for k in ("noticed", "stacks", "stop", "stopped")]))
    print(f"  (noticed: after the {args.hang_timeout:g} s deadline; stopped: from the last progress, in all)")
    worst = bl.med([r["stopped"] for r in h])
    print(f"target: every container stopped within the deadline + 10 s: "
          f"{'met' if worst <= args.hang_timeout + 10 else 'NOT met'} ({worst:.2f} s); "
          f"stuck rank named in {sum(r['named'] for r in h)} of {len(h)}")
    on, off = (bl.med([r["step_ms"] for r in res[a]]) for a in ("on", "off"))
    won, woff = (bl.med([r["wall"] for r in res[a]]) for a in ("on", "off"))
    print(f"step time, detection on {on:.2f} ms, off {off:.2f} ms: {100 * (on / off - 1):+.1f}% "
          f"{bl.spread([r['step_ms'] for r in res['on']])} / {bl.spread([r['step_ms'] for r in res['off']])}")
    print(f"whole job ({args.steps} steps), on {won:.1f} s, off {woff:.1f} s: {100 * (won / woff - 1):+.1f}%")


if __name__ == "__main__":
    bl.entry(main)
