"""Gloo all-reduce against raw TCP on one shaped link: is the collective near the wire?

Two hosts made like the tests' rig (network namespaces on one bridge, a Docker Engine each), every host's
link shaped with `tc ... tbf` (default 1 Gbit/s; a veth reports 10000 Mb/s whatever the limit, so measured
raw TCP is the reference). Each round runs, interleaved:

  A  a plain TCP stream node1 -> node0 between two Python processes in the namespaces, outside containers
     (an iperf-like floor independent of fleetbox);
  B  `invoke doctor --nodes 2 --hosts ...` (whole process): its probe's raw TCP node1 -> node0 in the job's
     containers, and the Gloo all-reduce sweep run by Paddle's launcher.

Printed: medians over rounds of the stream rate, the probe's rate, and the sweep's bus bandwidth at 64 MB,
with busbw / raw TCP (target >= 0.8). Run as root:  python bench/collective.py [--rate 1gbit] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import benchlib as bl
from benchlib import ROOT

sys.path.insert(0, str(ROOT))
from tests import fabric  # noqa: E402  (the rig the tests use)

SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("", int(sys.argv[1])))
s.listen(1); c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.monotonic(); n += len(b)
print(n, time.monotonic() - t0)
"""
SOURCE = r"""
import socket, sys, time
n = int(sys.argv[3]); block = b"\0" * (1 << 20)
for _ in range(100):
    try: c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.1)
while n > 0:
    c.sendall(block[:min(n, 1 << 20)]); n -= 1 << 20
c.close()
"""


def stream(bytes_: int, port: int = 45900) -> float:
    """A: node1 -> node0, plain Python in the namespaces; bytes per second as the receiver saw them."""
    sink = subprocess.Popen(["nsenter", "--net=/run/netns/fbn1", sys.executable, "-c", SINK, str(port)],
                            stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    subprocess.run(["nsenter", "--net=/run/netns/fbn2", sys.executable, "-c", SOURCE, f"{fabric.SUBNET}.11",
                    str(port), str(bytes_)], check=True)
    n, secs = sink.communicate(timeout=600)[0].split()
    return int(n) / float(secs)


def doctor(urls: list[str]) -> dict:
    """B: the whole `invoke doctor` process; its report."""
    t = bl.run([sys.executable, "-m", "invoke", "doctor", "--nodes", "2", "--hosts", ",".join(urls)], cwd=ROOT,
               check=False, timeout=1200)
    text = t.proc.stdout + t.proc.stderr
    if "report: " not in text:
        raise SystemExit(f"doctor gave no report:\n{text[-3000:]}")
    rep = json.loads(open(text.split("report: ")[-1].split()[0].rstrip(")")).read())
    if not rep["ok"]:
        raise SystemExit(f"doctor failed on the rig:\n{t.proc.stdout[-3000:]}")
    tcp = rep["facts"]["0"]["tcp"]["1"]
    top = rep["sweep"]["rows"][-1]
    return {"probe": tcp["bytes"] / tcp["seconds"], "busbw": top["busbw"] * 1e9, "size": top["size"],
            "wall": t.wall, "rows": rep["sweep"]["rows"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", default="1gbit", help="tbf rate on every host's link (default 1gbit)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bytes", type=int, default=256 << 20, help="bytes of the plain stream (default 256 MiB)")
    a = p.parse_args()
    urls = fabric.setup(2)
    try:
        fabric.load_image(urls, "fleetbox/paddle:cpu")
        for k in (1, 2):
            fabric.sh("tc", "-n", f"fbn{k}", "qdisc", "add", "dev", f"fbn{k}e", "root", "tbf", "rate", a.rate,
                      "burst", "256kb", "latency", "50ms")
        streams, runs = [], []
        for r in range(a.rounds):   # interleaved: A B, then B A, ...
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for what in order:
                if what == "A":
                    streams.append(stream(a.bytes))
                else:
                    runs.append(doctor(urls))
            print(f"round {r + 1}: stream {streams[-1] / 1e9:.3f} GB/s, probe {runs[-1]['probe'] / 1e9:.3f} GB/s, "
                  f"busbw {runs[-1]['busbw'] / 1e9:.3f} GB/s at {runs[-1]['size'] >> 20} MiB "
                  f"(doctor {runs[-1]['wall']:.1f} s)", flush=True)
    finally:
        fabric.teardown(2)
    med = statistics.median
    s, pr, bus = med(streams), med(x["probe"] for x in runs), med(x["busbw"] for x in runs)
    print(f"\nlink: tbf {a.rate} on each host's veth; {a.rounds} rounds, medians")
    print(f"  raw TCP, plain stream (A)        {s / 1e9:7.3f} GB/s")
    print(f"  raw TCP, doctor's probe (B)      {pr / 1e9:7.3f} GB/s")
    print(f"  Gloo all-reduce busbw @ 64 MiB   {bus / 1e9:7.3f} GB/s")
    print(f"  busbw / raw TCP (stream)         {bus / s:7.2f}   (target >= 0.8)")
    print(f"  busbw / raw TCP (probe)          {bus / pr:7.2f}")
    print("  sweep of the last round (size, busbw GB/s): " +
          ", ".join(f"{r['size'] >> 10}K {r['busbw']:.3f}" for r in runs[-1]["rows"][::4]))


if __name__ == "__main__":
    main()
