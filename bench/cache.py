#!/usr/bin/env python3
"""Dataset seeding throughput against curl, same loopback server, same files, one run (not a test).

`invoke cache`'s seeding (streaming download + MD5 in the same pass + temp name and rename) against
`curl -o` fetching the same files one after another (target: >= 0.9x, MD5 included), and against
`curl -o` followed by `md5sum`, which gives the same guarantee as seeding. Also prints CPU seconds, since
on a 2-core machine the server, the receiver and MD5 share two cores.
Usage: python bench/cache.py [--mb 400] [--repeat 3]
"""
import argparse
import hashlib
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

from fleetbox import datasets as ds  # noqa: E402

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
        sizes = [int(args.mb * 1e6 * w) for w in (0.70, 0.05, 0.20, 0.05)]
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
            seed_t, curl_t, curlmd5_t, seed_cpu = [], [], [], []
            for i in range(args.repeat):   # interleaved, so both see the same machine load
                dest = tmp / f"seed{i}"
                t, c0 = time.perf_counter(), time.process_time()
                ds.seed(chosen, dest, log=lambda m: None)
                seed_t.append(time.perf_counter() - t)
                seed_cpu.append(time.process_time() - c0)
                shutil.rmtree(dest)
                out = tmp / f"curl{i}"
                out.mkdir()
                t = time.perf_counter()
                for n in NAMES:
                    subprocess.run(["curl", "-sSf", "-o", str(out / n), f"{url}/mnist/{n}"], check=True)
                curl_t.append(time.perf_counter() - t)
                shutil.rmtree(out)
                out.mkdir()
                t = time.perf_counter()
                for n in NAMES:
                    subprocess.run(["curl", "-sSf", "-o", str(out / n), f"{url}/mnist/{n}"], check=True)
                    subprocess.run(["md5sum", str(out / n)], check=True, capture_output=True)
                curlmd5_t.append(time.perf_counter() - t)
                shutil.rmtree(out)
        finally:
            proc.terminate()
            proc.wait()

    s, c, cm = statistics.median(seed_t), statistics.median(curl_t), statistics.median(curlmd5_t)
    print(f"{len(NAMES)} files, {total / 1e6:.0f} MB, loopback HTTP server in its own process, median of {args.repeat}:")
    print(f"  invoke cache seeding (MD5 + rename)  {total / s / 1e6:8.1f} MB/s  ({s:.2f} s, "
          f"{statistics.median(seed_cpu):.2f} s CPU)")
    print(f"  curl -o                              {total / c / 1e6:8.1f} MB/s  ({c:.2f} s)")
    print(f"  curl -o, then md5sum                 {total / cm / 1e6:8.1f} MB/s  ({cm:.2f} s)")
    print(f"  ratio seeding / curl                 {c / s:8.2f}x  (target >= 0.9x)")
    print(f"  ratio seeding / curl + md5sum        {cm / s:8.2f}x")


if __name__ == "__main__":
    main()
