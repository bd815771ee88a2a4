#!/usr/bin/env python3
"""`invoke venv` benchmark for the cpu variant: whole process against whole process, interleaved (not a test).

`invoke venv --variant cpu --dest FRESH` (check the interpreter and machine, verify the wheelhouse, make the venv,
pip from the lock's own wheel with --no-compile, byte-compile with compileall, copy the helpers, freeze, record,
rename) against a bare install of the same wheelhouse with the same pip wheel into a fresh venv:
`PY -m venv --without-pip X && X/bin/python WHEELHOUSE/pip-<ver>-py3-none-any.whl/pip install --no-index
--find-links WHEELHOUSE --require-hashes --no-deps -r images/locks/cpu.lock`, which byte-compiles as it installs
(the same work). Both from the same interpreter, the one `invoke venv` picks by default. Target: <= 1.2x.
Also the no-op: `invoke venv` again on the env it made (the lock unchanged).
Rounds alternate the order (A B, B A, ...); medians. Each round makes its env in a fresh folder, removed
afterwards (not timed).

Needs the cpu wheelhouse (`invoke wheels --variant cpu`, or FLEETBOX_WHEELHOUSE). Run it as
`python3 bench/venv.py [--repeat 3]`.
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
from fleetbox.image import images, locks, matrix, venvs, wheelhouse  # noqa: E402

OURS, BARE = "invoke venv --variant cpu", "python3 -m venv + pip install (same pip wheel)"
NOOP = "invoke venv --variant cpu (up to date)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of each arm (about 20-40 s each)")
    args = ap.parse_args()

    v = matrix.load().get("cpu")
    lock_text, entries = locks.read(v)
    wheel_dir = wheelhouse.default_dir(v).resolve()   # what invoke venv uses (FLEETBOX_WHEELHOUSE, else wheelhouse/)
    wheelhouse.verify(v, wheel_dir, lock_text, entries)   # the bench needs a complete wheelhouse
    python = venvs.find_interpreter(v, None)
    pip = wheel_dir / images.pip_wheel(entries) / "pip"
    pip_version = subprocess.run([python, pip, "--version"], capture_output=True, text=True,
                                 check=True).stdout.split(" from ")[0]
    print(f"interpreter {python}; both sides run {pip_version} from {pip.parent.name}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-venv-", dir=ROOT) as tmp:
        tmp = Path(tmp)
        times = {OURS: [], BARE: []}
        print(f"{args.repeat} round(s) of {OURS!r} and {BARE!r}...", flush=True)
        for i, arm in bl.rounds([OURS, BARE], args.repeat):
            dest = tmp / f"{'ours' if arm == OURS else 'bare'}-{i}"
            if arm == OURS:
                t = bl.run([sys.executable, "-m", "invoke", "venv", "--variant", "cpu", "--dest", dest,
                            "--python", python], cwd=ROOT, timeout=1800)
                assert "installing" in t.proc.stdout, t.proc.stdout
            else:
                t = bl.run(["sh", "-c", '"$1" -m venv --without-pip "$0" && "$0/bin/python" "$2" install --no-index '
                            '--find-links "$3" --require-hashes --no-deps -r "$4"', dest, python, pip, wheel_dir,
                            v.lock_path], timeout=1800)
            times[arm].append(t.wall)
            print(f"  round {i + 1} {arm:<{max(map(len, times))}} {t.wall:6.1f} s", flush=True)
            if arm == OURS and i == 0:   # the no-op, on the env this round made
                noop = [bl.run([sys.executable, "-m", "invoke", "venv", "--variant", "cpu", "--dest", dest,
                                "--python", python], cwd=ROOT) for _ in range(3)]
                assert all("is up to date" in n.proc.stdout for n in noop)
            shutil.rmtree(dest)

    m_ours, m_bare, m_noop = bl.med(times[OURS]), bl.med(times[BARE]), bl.med([n.wall for n in noop])
    w = max(map(len, (OURS, BARE, NOOP)))
    print(f"\nmaking the cpu env, median of {args.repeat} (whole process; {pip_version} on both sides):")
    print(f"  {OURS:<{w}} {m_ours:6.1f} s   {bl.spread(times[OURS], '.1f')}")
    print(f"  {BARE:<{w}} {m_bare:6.1f} s   {bl.spread(times[BARE], '.1f')}")
    print(f"  {'ratio':<{w}} {m_ours / m_bare:6.2f}x  (target <= 1.2x)")
    print(f"  {NOOP:<{w}} {m_noop:6.2f} s   (median of 3)")
    print(json.dumps({"venv_s": m_ours, "bare_pip_s": m_bare, "ratio": m_ours / m_bare, "noop_s": m_noop,
                      "pip": pip_version, "python": python}))


if __name__ == "__main__":
    bl.entry(main)
