#!/usr/bin/env python3
"""Build benchmarks for a variant (--variant, default cpu): whole process against whole process, interleaved (not a
test). cu118-pypi's one changed pin is Paddle's (2.6.2 -> 2.6.1): its libraries layer, below Paddle's, is kept.

1. A no-op `invoke build --variant cpu` (target: <= 0.6 s).
2. A cold hermetic build, `invoke build --variant cpu --force` (network off, every layer made again: verify
   the wheelhouse, run and commit each layer with the wheelhouse mounted read-only), against a fair floor: a
   bare install of the same wheelhouse with the same pip, the lock's own wheel (as the build runs it), into a
   fresh venv on the host by an interpreter of the image's Python version, then byte-compiled on every core as
   the build does (pip would compile on one): `PY -m venv --without-pip V && V/bin/python WHEELHOUSE/pip-<ver>.whl/pip
   install --no-index --find-links WHEELHOUSE --require-hashes --no-deps --no-compile -r images/locks/cpu.lock &&
   V/bin/python -m compileall -q -j 0 V/lib`, one process. Targets: median ratio <= 1.5x, and the best cold
   build against the best floor of the interleaved rounds (the bar) <= 1.5x. Each side's disk is named (its
   file system, and for ext4 whether it has a journal: the ratio depends on it, README.md). Each forced build's
   per-layer profile (its build.log: container start, pip, fixed times, compileall, fixed times again, the
   script's end, commit) is printed as medians over the rounds.
3. Final image size against its base plus the installed environment (target: <= 1.05x).
4. One changed pin: in a copy of the checkout (tests/checkout.py) with opencv-python-headless 4.12.0.88 ->
   4.11.0.86, locked and its wheel fetched first (not timed), `invoke build --variant cpu` as a user runs it
   after the change (the copy's own opencv layer removed before each round). Targets: <= 0.3x the
   cold build; the bytes of the layers whose digest changed <= 1.1x what opencv occupies installed + 10 MB.
Rounds alternate the order (A B, B A, ...); medians. Every round of sections 2 and 4 starts with the page
cache dropped (root only), so no round pays for what an earlier one left cached.

The sections name the cpu variant's pin and targets; `--variant cu118-pypi` runs the same on the GPU image, whose
one changed pin is Paddle (2.6.2 -> 2.6.1: its libraries layer is kept, and the layers after Paddle's keep their
digests where their files are the same). Needs the variant's image built (`invoke up`) and the Docker Engine to
itself; section 2 replaces the image with an identical rebuild. Run it as
`flock /tmp/fleetbox-docker.lock python bench/build.py [--variant V] [--repeat 5] [--cold-repeat 2]`.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import benchlib as bl
from benchlib import ROOT

sys.path.insert(0, str(ROOT))
from fleetbox import engine  # noqa: E402
from fleetbox.image import built, images, locks, matrix, wheelhouse  # noqa: E402
from tests.checkout import OPENCV_BUMPED, OPENCV_NOW, copy_with_pin, made_since, tags  # noqa: E402

# each variant's one changed pin (old, new) and what the changed package occupies installed (site-packages globs)
PINS = {"cpu": (OPENCV_NOW, OPENCV_BUMPED, "cv2 opencv_python_headless*"),
        "cu118-pypi": ("paddlepaddle-gpu==2.6.2", "paddlepaddle-gpu==2.6.1", "paddle paddlepaddle_gpu*")}
PIP = "venv + the lock's pip + compileall (host)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="rounds of section 1")
    ap.add_argument("--cold-repeat", type=int, default=2, help="rounds of section 2 (about 1.5 min each)")
    ap.add_argument("--pin-repeat", type=int, default=3, help="rounds of section 4")
    ap.add_argument("--variant", default="cpu", choices=sorted(PINS))
    args = ap.parse_args()
    NOOP = f"invoke build --variant {args.variant}"
    COLD, ONEPIN = f"{NOOP} --force", f"{NOOP} after one pin changed"

    v = matrix.load().get(args.variant)
    c = engine.client()
    image = built.resolve(c, v)
    lock_text, entries = locks.read(v)
    wheel_dir = wheelhouse.default_dir(v)   # what invoke build uses (FLEETBOX_WHEELHOUSE, else wheelhouse/)
    wheelhouse.verify(v, wheel_dir, lock_text, entries)   # the bench needs a complete wheelhouse
    p = images.plan(v, c.images.get(v.base_ref).id, (lock_text, entries))
    if image.id != c.images.get(p.tag).id:
        sys.exit(f"the {v.name} image is not current: run `invoke build --variant {v.name}` first")

    with tempfile.TemporaryDirectory(prefix="bench-build-", dir=ROOT) as tmp:
        tmp = Path(tmp)
        bl.private_runs_dir(tmp)   # build logs of the forced builds go here, not under runs/
        t1 = {NOOP: []}
        for _, arm in bl.rounds([NOOP], args.repeat):
            t = bl.run([sys.executable, "-m", "invoke", "build", "--variant", v.name], cwd=ROOT)
            assert "up to date" in t.proc.stdout, t.proc.stdout
            t1[arm].append(t.wall)

        lock = ROOT / "images" / "locks" / f"{v.name}.lock"
        # the floor runs the pip the build runs (the lock's wheel), from an interpreter of the image's version
        pip_wheel = images.pip_wheel(entries)
        floor_pip = wheel_dir / pip_wheel / "pip"
        python = shutil.which(f"python{v.python_version}") or sys.executable
        host_version = subprocess.run([python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                                      capture_output=True, text=True, check=True).stdout.strip()
        image_version = subprocess.run(["docker", "run", "--rm", "--network", "none", image.id, "python", "-c",
                                        "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                                       capture_output=True, text=True, check=True).stdout.strip()
        if host_version.rsplit(".", 1)[0] != image_version.rsplit(".", 1)[0]:
            sys.exit(f"no Python {image_version.rsplit('.', 1)[0]} on this host for a fair floor (found {python}, "
                     f"{host_version})")
        sides = {COLD: f"{pip_wheel.split('-py3')[0]} (the lock's wheel) in the image's Python {image_version}",
                 PIP: f"{pip_wheel.split('-py3')[0]} (the lock's wheel) in the host's Python {host_version}"}
        # where each side writes: the engine's data root (on this machine only if its socket is) and the venv's
        local = os.environ.get("DOCKER_HOST", "unix://").startswith("unix://")
        disks = {COLD: bl.disk(c.info()["DockerRootDir"]) if local else "the engine's, not on this machine",
                 PIP: bl.disk(tmp)}
        print(f"cold builds: {args.cold_repeat} round(s) of {COLD!r} and of {PIP!r}...", flush=True)
        t2 = {COLD: [], PIP: []}
        for i, arm in bl.rounds([COLD, PIP], args.cold_repeat):
            cold_cache()
            if arm == COLD:
                t = bl.run([sys.executable, "-m", "invoke", "build", "--variant", v.name, "--force"], cwd=ROOT,
                           timeout=1800)
                assert "built " in t.proc.stdout, t.proc.stdout
            else:
                venv = tmp / f"venv-{i}"
                t = bl.run(["sh", "-c", '"$1" -m venv --without-pip "$0" && "$0/bin/python" "$2" install --no-index '
                            '--find-links "$3" --require-hashes --no-deps --no-compile -r "$4" && '
                            '"$0/bin/python" -m compileall -q -j 0 "$0/lib" > /dev/null', venv, python, floor_pip,
                            wheel_dir, lock], timeout=1800)
                shutil.rmtree(venv)
            t2[arm].append(t.wall)
            print(f"  round {i + 1} {arm:<{len(COLD)}} {t.wall:6.1f} s", flush=True)

        profiles = read_profiles(tmp / "runs", v.name)
        if args.pin_repeat:
            print(f"one changed pin: {args.pin_repeat} round(s) of {ONEPIN!r}...", flush=True)
            t4, changed, installed, total = one_pin(c, tmp, wheel_dir, args.pin_repeat, v.name)

    image = built.resolve(c, v)   # section 2 rebuilt it
    base = c.images.get(v.base_ref)
    venv = subprocess.run(["docker", "run", "--rm", "--network", "none", image.id, "du", "-sb", "/opt/venv"],
                          capture_output=True, text=True, check=True).stdout.split()[0]
    size, base_size, venv_size = image.attrs["Size"], base.attrs["Size"], int(venv)

    m_noop = bl.med(t1[NOOP])
    w = max(map(len, (NOOP, COLD, PIP, ONEPIN)))
    m_cold, m_pip = bl.med(t2[COLD]), bl.med(t2[PIP])
    print(f"\nno-op build, median of {args.repeat} (whole process):")
    print(f"  {NOOP:<{w}} {m_noop:6.2f} s   (target <= 0.60 s) {bl.spread(t1[NOOP])}")
    print(f"\ncold build, median of {args.cold_repeat} (whole process):")
    print(f"  {COLD:<{w}} {m_cold:6.1f} s   (hermetic: network off, no layer cache) {bl.spread(t2[COLD], '.1f')}")
    print(f"  {PIP:<{w}} {m_pip:6.1f} s   (same wheelhouse and lock) {bl.spread(t2[PIP], '.1f')}")
    print(f"  {'ratio':<{w}} {m_cold / m_pip:6.2f}x  (target <= 1.5x); best build against best floor: "
          f"{min(t2[COLD]) / min(t2[PIP]):.2f}x (bar: <= 1.5x)")
    for arm, pip in sides.items():
        print(f"  pip of {arm!r}: {pip}")
    for arm, where in disks.items():
        print(f"  disk of {arm!r}: {where}")
    print("\ncold build per layer, medians of the forced builds (s):")
    print(profile_table(profiles))
    print("\nimage size:")
    print(f"  final image                     {size / 1e6:7.0f} MB")
    print(f"  base + environment              {(base_size + venv_size) / 1e6:7.0f} MB"
          f"  ({base_size / 1e6:.0f} + {venv_size / 1e6:.0f})")
    print(f"  ratio                           {size / (base_size + venv_size):7.3f}x (target <= 1.05x)")
    if not args.pin_repeat:
        print(json.dumps({"noop_s": m_noop, "cold_s": m_cold, "floor_s": m_pip, "cold_ratio": m_cold / m_pip,
                          "best_ratio": min(t2[COLD]) / min(t2[PIP]), "profile": profiles,
                          "size_ratio": size / (base_size + venv_size), "caches_dropped": all(DROPPED),
                          "disks": disks}))
        return
    m_pin = bl.med(t4)
    old, new, _ = PINS[v.name]
    print(f"\none changed pin ({old} -> {new.split('==')[1]}), median of {args.pin_repeat}:")
    print(f"  {ONEPIN:<{w}} {m_pin:6.1f} s   ({m_pin / m_cold:.2f}x the cold build; target <= 0.3x) "
          f"{bl.spread(t4, '.1f')}")
    print(f"  layers whose digest changed     {changed / 1e6:7.1f} MB of {total / 1e6:.0f} MB "
          f"({changed / total:.1%}); {old.split('==')[0]} installed {installed / 1e6:.1f} MB "
          f"(target <= {(1.1 * installed + 10e6) / 1e6:.1f} MB, where the pin's layer is the last)")
    print(json.dumps({"noop_s": m_noop, "cold_s": m_cold, "floor_s": m_pip, "cold_ratio": m_cold / m_pip,
                      "best_ratio": min(t2[COLD]) / min(t2[PIP]), "profile": profiles,
                      "size_ratio": size / (base_size + venv_size), "one_pin_s": m_pin,
                      "one_pin_ratio": m_pin / m_cold, "one_pin_changed_bytes": changed,
                      "variant": v.name, "pin_installed_bytes": installed, "caches_dropped": all(DROPPED),
                      "disks": disks}))


DROP = Path("/proc/sys/vm/drop_caches")


DROPPED = []   # one bool per round that asked: were the caches dropped (the JSON line says whether all were)


def cold_cache() -> None:
    """Each timed build round starts from the same state: nothing written left unflushed, nothing cached
    (measured on these machines: a pip install of the lock took 5.5 s after the caches were dropped, 7 to 12 s
    with the page cache that earlier rounds had filled, all of it in system time). This machine's cache only:
    an engine elsewhere (DOCKER_HOST) keeps its own. Not possible without root: said."""
    os.sync()
    try:
        DROP.write_text("3\n")
        DROPPED.append(True)
    except OSError as e:
        DROPPED.append(False)
        print(f"  (caches not dropped before the round: {e})", flush=True)


def read_profiles(runs: Path, variant: str) -> dict[str, dict[str, float]]:
    """{layer: {phase: median seconds}} over the forced builds' build.log files (images.PROFILE lines)."""
    seen: dict[str, dict[str, list[float]]] = {}
    for log in sorted(runs.glob(f"build-{variant}-*/build.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith(images.PROFILE + " "):
                rec = json.loads(line.split(" ", 1)[1])
                mine = seen.setdefault(rec.pop("layer"), {})
                for phase, secs in rec.items():
                    mine.setdefault(phase, []).append(secs)
    return {layer: {p: bl.med(v) for p, v in phases.items()} for layer, phases in seen.items()}


def profile_table(profiles: dict[str, dict[str, float]]) -> str:
    phases = list(dict.fromkeys(p for ph in profiles.values() for p in ph))
    rows = [f"  {'layer':<24}" + "".join(f"{p:>18}" for p in phases) + f"{'sum':>10}"]
    for layer, ph in profiles.items():
        rows.append(f"  {layer:<24}" + "".join(f"{ph.get(p, 0.0):18.2f}" for p in phases)
                    + f"{sum(ph.values()):10.2f}")
    rows.append(f"  {'all layers':<24}" + "".join(f"{sum(ph.get(p, 0.0) for ph in profiles.values()):18.2f}"
                                                  for p in phases)
                + f"{sum(sum(ph.values()) for ph in profiles.values()):10.2f}")
    return "\n".join(rows)


def _digests(c, ref: str) -> list[str]:
    return c.images.get(ref).attrs["RootFS"]["Layers"]


def one_pin(c, tmp: Path, wheel_dir: Path, repeat: int, variant: str):
    """Section 4: rebuild times, then the changed layers' bytes, the changed package's installed size, the
    image's size."""
    v = matrix.load().get(variant)
    old, new, installed_as = PINS[variant]
    env = {**os.environ, **copy_with_pin(ROOT, tmp, "fleetbox-bench/paddle", wheel_dir, old, new, variant)}
    src, ref = tmp / "src", f"fleetbox-bench/paddle:{variant}"
    for step in (["lock"], ["wheels"]):
        bl.run([sys.executable, "-m", "invoke", *step, "--variant", variant], cwd=src, env=env, timeout=1800)
    before = set(tags("fleetbox/layers"))
    times = []
    try:
        for _ in range(repeat):
            made = made_since(before, "fleetbox-bench/paddle")
            if made:
                subprocess.run(["docker", "rmi", *made], capture_output=True, check=True)
            cold_cache()
            t = bl.run([sys.executable, "-m", "invoke", "build", "--variant", variant], cwd=src, env=env,
                       timeout=1800)
            assert "built " in t.proc.stdout, t.proc.stdout
            times.append(t.wall)
        ours, mine = _digests(c, built.resolve(c, v).id), _digests(c, ref)
        # newest first: the settings (committed without a layer), then one entry per layer, so layer i is entry
        # len - i. A layer after a changed one keeps its digest where its files are the same (a staged layer
        # holds only its own files): the changed ones are not always the last.
        history = c.images.get(ref).history()
        changed = sum(history[len(mine) - i]["Size"] for i, (a, b) in enumerate(zip(ours, mine)) if a != b)
        du = subprocess.run(["docker", "run", "--rm", "--network", "none", ref, "sh", "-c",
                             f"cd /opt/venv/lib/python3.11/site-packages && du -scb {installed_as} | tail -1"],
                            capture_output=True, text=True, check=True).stdout
        return times, changed, int(du.split()[0]), c.images.get(ref).attrs["Size"]
    finally:
        made = made_since(before, "fleetbox-bench/paddle")
        if made:
            subprocess.run(["docker", "rmi", *made], capture_output=True)


if __name__ == "__main__":
    bl.entry(main)
