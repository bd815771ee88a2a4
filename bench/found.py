#!/usr/bin/env python3
"""The cost of finding metrics in the training itself (incontainer/fleetbox_found.py), not a test.

The same plain script (a small CNN fed by a DataLoader, no line of fleetbox) as a 2-node CPU job with finding on
(the default) and off (`--env FLEETBOX_FIND_METRICS=0`), hang detection on in both: interleaved whole
`invoke train` processes; per round, the median of the step times rank 0 measures itself (from one batch's
arrival to the next: the loader, forward, backward, the optimizer's step, with every wrapper of ours in it).
The noise is the spread of each arm's rounds; the cost is within it when the medians' difference is smaller.

Needs the cpu image (`invoke up`) and the Docker Engine to itself:
`flock /tmp/fleetbox-docker.lock python bench/found.py [--repeat 5] [--steps 400]`.
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import benchlib as bl
from hang import plain_job

# No fleetbox line: each step's time from one batch to the next, printed by rank 0
PLAIN = """import sys, time
import paddle
import paddle.distributed as dist
dist.init_parallel_env()
paddle.seed(1)
net = paddle.nn.Sequential(paddle.nn.Conv2D(1, 8, 3, padding=1), paddle.nn.ReLU(), paddle.nn.MaxPool2D(2),
                           paddle.nn.Flatten(), paddle.nn.Linear(8 * 14 * 14, 10))
model = paddle.DataParallel(net)
opt = paddle.optimizer.Adam(learning_rate=paddle.optimizer.lr.ExponentialDecay(0.001, 0.999),
                            parameters=model.parameters())
data = paddle.io.TensorDataset([paddle.randn([6400, 1, 28, 28]), paddle.randint(0, 10, [6400, 1])])
loader = paddle.io.DataLoader(data, batch_size=32, shuffle=True)
steps, t = int(sys.argv[1]), None
while steps > 0:
    for x, y in loader:
        if t is not None and dist.get_rank() == 0:
            print(f"BENCH-STEP {time.perf_counter() - t:.6f}", flush=True)
        t = time.perf_counter()
        loss = paddle.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        opt._learning_rate.step()
        steps -= 1
        if steps == 0:
            break
"""


def one(arm: str, steps: int, script: Path) -> dict:
    off = ["--env", "FLEETBOX_FIND_METRICS=0"] if arm == "off" else []
    d, seconds, wall = plain_job(off, steps, script, warm=20)
    found = d / "node0" / "found-metrics-rank0.log"
    n = len(found.read_text().splitlines()) if found.exists() else 0
    if n != (steps if arm == "on" else 0):   # on: every step found; off: none
        sys.exit(f"arm {arm}: {n} steps found of {steps}")
    return {"step_ms": statistics.median(seconds) * 1000, "wall": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--steps", type=int, default=400)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fleetbox-bench-found-") as tmp:
        bl.private_runs_dir(Path(tmp))
        script = Path(tmp) / "plain.py"
        script.write_text(PLAIN)
        res = {"on": [], "off": []}
        for i, arm in bl.rounds(list(res), args.repeat):
            res[arm].append(one(arm, args.steps, script))
            print(f"round {i} {arm}: " + ", ".join(f"{k} {v:.3f}" for k, v in res[arm][-1].items()), flush=True)
    on, off = (bl.med([r["step_ms"] for r in res[a]]) for a in ("on", "off"))
    print(f"\nstep time, finding on {on:.3f} ms, off {off:.3f} ms: {on - off:+.3f} ms ({100 * (on / off - 1):+.1f}%)")
    print(f"noise (each arm's rounds): on {bl.spread([r['step_ms'] for r in res['on']])}, "
          f"off {bl.spread([r['step_ms'] for r in res['off']])}")


if __name__ == "__main__":
    bl.entry(main)
