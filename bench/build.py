#!/usr/bin/env python3
"""Build benchmarks for the cpu variant, measured side by side in one run (not a test).

1. Whole-process time of a no-op `invoke build --variant cpu` against a plain `docker build` of the same
   Dockerfile and context with a warm layer cache (target: <= 0.6 s and >= 2x faster).
2. Final image size against its base plus the installed environment (target: <= 1.05x).

Needs the cpu image built (`invoke up`). Usage: python bench/build.py [--repeat N]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetbox import engine  # noqa: E402
from fleetbox.build import images, locks, matrix, wheelhouse  # noqa: E402


def timed(argv, **kw):
    t = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:4])}... failed:\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t, proc


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    v = matrix.load().get("cpu")
    c = engine.client()
    image = images.resolve(c, v)
    lock_text, entries = locks.read(v)
    wheels = wheelhouse.verify(v, wheelhouse.default_dir(v), lock_text, entries)
    p = images.plan(v, c.images.get(v.base_ref).id, (lock_text, entries))
    if image.id != c.images.get(p.tag).id:
        sys.exit("the cpu image is not current: run `invoke build --variant cpu` first")

    with tempfile.TemporaryDirectory(prefix="bench-build-", dir=ROOT) as tmp:
        ctx = images._context(p, wheels, lock_text, Path(tmp))   # the very context invoke build sends
        ctx_mb = sum(f.stat().st_size for f in ctx.rglob("*") if f.is_file()) / 1e6
        docker_argv = ["docker", "build", "--network", "none", "-q", "-t", "fleetbox-bench/plain:cpu"]
        for k, val in p.build_args.items():
            docker_argv += ["--build-arg", f"{k}={val}"]
        docker_argv.append(str(ctx))
        print(f"warming docker's layer cache with one plain build ({ctx_mb:.0f} MB context)...", flush=True)
        timed(docker_argv, timeout=1800)

        noop, plain = [], []
        for _ in range(args.repeat):   # interleaved, so both see the same machine load
            t, proc = timed([sys.executable, "-m", "invoke", "build", "--variant", "cpu"], cwd=ROOT)
            assert "up to date" in proc.stdout, proc.stdout
            noop.append(t)
            t, _ = timed(docker_argv)
            plain.append(t)
        subprocess.run(["docker", "rmi", "-f", "fleetbox-bench/plain:cpu"], capture_output=True)
        subprocess.run(["docker", "image", "prune", "-f", "--filter", "label=io.fleetbox.stage=install"],
                       capture_output=True)   # the plain build's install stage (it holds the wheels)

    base = c.images.get(v.base_ref)
    venv = subprocess.run(["docker", "run", "--rm", "--network", "none", image.id, "du", "-sb", "/opt/venv"],
                          capture_output=True, text=True, check=True).stdout.split()[0]
    size, base_size, venv_size = image.attrs["Size"], base.attrs["Size"], int(venv)

    m_noop, m_plain = statistics.median(noop), statistics.median(plain)
    print(f"\nno-op build, median of {args.repeat} (whole process):")
    print(f"  invoke build --variant cpu      {m_noop:6.2f} s   (target <= 0.60 s)")
    print(f"  docker build, warm layer cache  {m_plain:6.2f} s   ({ctx_mb:.0f} MB context)")
    print(f"  speed-up                        {m_plain / m_noop:6.1f}x  (target >= 2x)")
    print("\nimage size:")
    print(f"  final image                     {size / 1e6:7.0f} MB")
    print(f"  base + environment              {(base_size + venv_size) / 1e6:7.0f} MB"
          f"  ({base_size / 1e6:.0f} + {venv_size / 1e6:.0f})")
    print(f"  ratio                           {size / (base_size + venv_size):7.3f}x (target <= 1.05x)")
    print(json.dumps({"noop_s": m_noop, "plain_warm_s": m_plain, "speedup": m_plain / m_noop,
                      "size_ratio": size / (base_size + venv_size)}))


if __name__ == "__main__":
    main()
