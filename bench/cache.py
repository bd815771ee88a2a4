#!/usr/bin/env python3
"""Dataset seeding throughput against curl, same loopback server, same files, one run (not a test).

`invoke cache`'s seeding (streaming download + MD5 in the same pass + temp name and rename, several
files at a time) against `curl -o` fetching the same files one after another (target: >= 0.9x, MD5
included). For a fuller picture it also runs, in the same interleaved rounds:
- `curl --parallel` with as many transfers at once as seeding uses (no MD5),
- seeding one file at a time (`jobs=1`): one stream, so MD5 on one core is its ceiling,
- `curl -o` then `md5sum`, which gives the same guarantee as seeding,
and prints one core's MD5 speed on this machine (the most any single verified stream can reach).
Usage: python bench/cache.py [--mb 400] [--repeat 3]
"""
import argparse
import hashlib
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetbox.data import datasets as ds  # noqa: E402

JOBS = 4   # seeding's default
SEED, SEED_ONE = f"invoke cache seeding ({JOBS} at a time)", "invoke cache seeding, one at a time"
CURL, CURL_PAR, CURL_MD5 = "curl -o, one after another", f"curl --parallel ({JOBS} at a time)", "curl -o, then md5sum"
MNIST = (9912422, 28881, 1648877, 4542)   # bytes of the four real files, in NAMES order
NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=400, help="total size of the four files")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not shutil.which("curl"):
        sys.exit("curl is needed: apt-get install -y curl")

    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        tmp = Path(tmp)
        rng = random.Random(0)
        sizes = [int(args.mb * 1e6 * n / sum(MNIST)) for n in MNIST]   # MNIST's own proportions
        md5 = {}
        for name, size in zip(NAMES, sizes):
            p = tmp / "srv" / "mnist" / name
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "wb") as f:   # incompressible content, written in 1 MB pieces
                for _ in range(size // 2**20):
                    f.write(rng.randbytes(2**20))
                f.write(rng.randbytes(size % 2**20))
            md5[name] = hashlib.md5(p.read_bytes()).hexdigest()
        total = sum(sizes)
        # The server runs in its own process, so neither client shares an interpreter (or a GIL) with it.
        proc = subprocess.Popen([sys.executable, "-m", "tests.httpserver", str(tmp / "srv")], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        url = proc.stdout.readline().strip()
        try:
            manifest = tmp / "datasets.toml"
            manifest.write_text('[datasets.mnist]\nmodule = "mnist"\nfiles = [\n' + ",\n".join(
                f'  {{ url = "{url}/mnist/{n}", md5 = "{m}" }}' for n, m in md5.items()) + "\n]\n")
            chosen = ds.select(ds.load(manifest), "mnist")
            urls = [f"{url}/mnist/{n}" for n in NAMES]

            def seeding(jobs):
                def run(out):
                    ds.seed(chosen, out, log=lambda m: None, jobs=jobs)
                return run

            def curl(out, parallel=False, md5sum=False):
                if parallel:
                    cmd = ["curl", "-sSf", "--parallel", "--parallel-max", str(JOBS)]
                    for u, n in zip(urls, NAMES):
                        cmd += ["-o", str(out / n), u]
                    subprocess.run(cmd, check=True, capture_output=True)   # it draws a meter even with -s
                    return
                for u, n in zip(urls, NAMES):
                    subprocess.run(["curl", "-sSf", "-o", str(out / n), u], check=True)
                    if md5sum:
                        subprocess.run(["md5sum", str(out / n)], check=True, capture_output=True)

            methods = {
                SEED: seeding(JOBS),
                CURL: curl,
                CURL_PAR: lambda out: curl(out, parallel=True),
                SEED_ONE: seeding(1),
                CURL_MD5: lambda out: curl(out, md5sum=True),
            }
            times = {m: [] for m in methods}
            cpu = {m: [] for m in methods}
            for i in range(args.repeat):   # interleaved, so all see the same machine load
                for m, run in methods.items():
                    out = tmp / f"out{i}"
                    out.mkdir()
                    os.sync()   # the previous method's dirty pages are flushed outside the timing
                    t, c = time.perf_counter(), cpu_seconds()
                    run(out)
                    times[m].append(time.perf_counter() - t)
                    cpu[m].append(cpu_seconds() - c)
                    shutil.rmtree(out)
        finally:
            proc.terminate()
            proc.wait()

    med = {m: statistics.median(t) for m, t in times.items()}
    ceiling = md5_speed(64 << 20)
    print(f"{len(NAMES)} files, {total / 1e6:.0f} MB, loopback HTTP server (sendfile) in its own process, "
          f"median of {args.repeat}:")
    for m, t in med.items():
        print(f"  {m:<40} {total / t / 1e6:8.1f} MB/s  ({t:.2f} s, {statistics.median(cpu[m]):.2f} s CPU)")
    print(f"  one core's MD5 (hashlib)                 {ceiling / 1e6:8.1f} MB/s  (ceiling of any one verified stream)")
    print(f"  ratio seeding / curl one after another   {med[CURL] / med[SEED]:8.2f}x  (target >= 0.9x)")
    print(f"  ratio seeding / curl --parallel          {med[CURL_PAR] / med[SEED]:8.2f}x")
    print(f"  ratio one at a time / curl one after another {med[CURL] / med[SEED_ONE]:4.2f}x")
    print(f"  ratio seeding / curl + md5sum            {med[CURL_MD5] / med[SEED]:8.2f}x")


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (curl, md5sum); not the server's."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def md5_speed(nbytes: int) -> float:
    """One core's MD5 throughput over in-memory data."""
    data = random.Random(1).randbytes(1 << 20)
    h, t = hashlib.md5(), time.perf_counter()
    for _ in range(nbytes >> 20):
        h.update(data)
    return nbytes / (time.perf_counter() - t)


if __name__ == "__main__":
    main()
