#!/usr/bin/env python3
"""Build benchmarks for the cpu variant: whole process against whole process, interleaved (not a test).

1. A no-op `invoke build --variant cpu` (target: <= 0.6 s).
2. A cold hermetic build, `invoke build --variant cpu --force` (network off, every layer made again: verify
   the wheelhouse, run and commit each layer with the wheelhouse mounted read-only), against a bare install of the same
   wheelhouse into a fresh venv on the host: `python3 -m venv V && V/bin/pip install --no-index --find-links
   WHEELHOUSE --require-hashes -r images/locks/cpu.lock`, as one process (target: <= 1.5x; the Dockerfile
   build measured about 65 s against 21 s).
3. Final image size against its base plus the installed environment (target: <= 1.05x).
Rounds alternate the order (A B, B A, ...); medians.

Needs the cpu image built (`invoke up`) and the Docker Engine to itself; section 2 replaces the cpu image
with an identical rebuild. Run it as
`flock /tmp/fleetbox-docker.lock python bench/build.py [--repeat 5] [--cold-repeat 2]`.
"""
import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib as bl
from benchlib import ROOT

sys.path.insert(0, str(ROOT))
from fleetbox import engine  # noqa: E402
from fleetbox.build import images, locks, matrix, wheelhouse  # noqa: E402

NOOP = "invoke build --variant cpu"
COLD, PIP = "invoke build --variant cpu --force", "python3 -m venv + pip install (host)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of section 1")
    ap.add_argument("--cold-repeat", type=int, default=2, help="rounds of section 2 (about 1.5 min each)")
    args = ap.parse_args()

    v = matrix.load().get("cpu")
    c = engine.client()
    image = images.resolve(c, v)
    lock_text, entries = locks.read(v)
    wheel_dir = wheelhouse.default_dir(v)   # what invoke build uses (FLEETBOX_WHEELHOUSE, else wheelhouse/)
    wheelhouse.verify(v, wheel_dir, lock_text, entries)   # the bench needs a complete wheelhouse
    p = images.plan(v, c.images.get(v.base_ref).id, (lock_text, entries))
    if image.id != c.images.get(p.tag).id:
        sys.exit("the cpu image is not current: run `invoke build --variant cpu` first")

    with tempfile.TemporaryDirectory(prefix="bench-build-", dir=ROOT) as tmp:
        tmp = Path(tmp)
        bl.private_runs_dir(tmp)   # build logs of the forced builds go here, not under runs/
        t1 = {NOOP: []}
        for _, arm in bl.rounds([NOOP], args.repeat):
            t = bl.run([sys.executable, "-m", "invoke", "build", "--variant", "cpu"], cwd=ROOT)
            assert "up to date" in t.proc.stdout, t.proc.stdout
            t1[arm].append(t.wall)

        print(f"cold builds: {args.cold_repeat} round(s) of {COLD!r} and a fresh host venv...", flush=True)
        lock = ROOT / "images" / "locks" / f"{v.name}.lock"
        t2 = {COLD: [], PIP: []}
        for i, arm in bl.rounds([COLD, PIP], args.cold_repeat):
            if arm == COLD:
                t = bl.run([sys.executable, "-m", "invoke", "build", "--variant", "cpu", "--force"], cwd=ROOT,
                           timeout=1800)
                assert "built " in t.proc.stdout, t.proc.stdout
            else:
                venv = tmp / f"venv-{i}"
                t = bl.run(["sh", "-c", '"$1" -m venv "$0" && "$0/bin/pip" install --no-index --find-links "$2" '
                            '--require-hashes -r "$3"', venv, sys.executable, wheel_dir, lock], timeout=1800)
                shutil.rmtree(venv)
            t2[arm].append(t.wall)

    image = images.resolve(c, v)   # section 2 rebuilt it
    base = c.images.get(v.base_ref)
    venv = subprocess.run(["docker", "run", "--rm", "--network", "none", image.id, "du", "-sb", "/opt/venv"],
                          capture_output=True, text=True, check=True).stdout.split()[0]
    size, base_size, venv_size = image.attrs["Size"], base.attrs["Size"], int(venv)

    m_noop = bl.med(t1[NOOP])
    w = max(map(len, (NOOP, COLD, PIP)))
    m_cold, m_pip = bl.med(t2[COLD]), bl.med(t2[PIP])
    print(f"\nno-op build, median of {args.repeat} (whole process):")
    print(f"  {NOOP:<{w}} {m_noop:6.2f} s   (target <= 0.60 s) {bl.spread(t1[NOOP])}")
    print(f"\ncold build, median of {args.cold_repeat} (whole process):")
    print(f"  {COLD:<{w}} {m_cold:6.1f} s   (hermetic: network off, no layer cache) {bl.spread(t2[COLD], '.1f')}")
    print(f"  {PIP:<{w}} {m_pip:6.1f} s   (same wheelhouse and lock) {bl.spread(t2[PIP], '.1f')}")
    print(f"  {'ratio':<{w}} {m_cold / m_pip:6.2f}x  (target <= 1.5x)")
    print("\nimage size:")
    print(f"  final image                     {size / 1e6:7.0f} MB")
    print(f"  base + environment              {(base_size + venv_size) / 1e6:7.0f} MB"
          f"  ({base_size / 1e6:.0f} + {venv_size / 1e6:.0f})")
    print(f"  ratio                           {size / (base_size + venv_size):7.3f}x (target <= 1.05x)")
    print(json.dumps({"noop_s": m_noop, "cold_s": m_cold, "bare_pip_s": m_pip, "cold_ratio": m_cold / m_pip,
                      "size_ratio": size / (base_size + venv_size)}))


if __name__ == "__main__":
    bl.entry(main)
