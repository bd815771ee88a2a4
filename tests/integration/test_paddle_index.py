"""The Paddle 3 GPU variants' lock, as at a site: `invoke lock` against a package index laid out as Paddle's own
(…/packages/stable/cu126/paddlepaddle-gpu/, a PEP 503 page whose links point to another path, without sha256
fragments, the wheels tagged linux_x86_64), serving a stand-in paddlepaddle-gpu wheel whose metadata declares
what Paddle's does, and PyPI for everything else: the real nvidia-*-cu12 packages resolve with hashes. Paddle's own
index is not reachable from here, which the unreachable case shows for real.

What the stand-in's metadata holds: the Requires-Dist of paddlepaddle 3.3.1 (PyPI's CPU wheel, read from the
cpu wheelhouse) and the NVIDIA packages Paddle's setup.py pins for each CUDA (PADDLE_CUDA_INSTALL_REQUIREMENTS,
Linux x86_64; those of 12.6 are the ones Paddle #75926 quotes from a real 3.2.0 cu126 wheel)."""
import io
import os
import re
import subprocess
import sys
import zipfile

import pytest

from fleetbox.image import locks, matrix, wheelhouse
from tests.conftest import ROOT
from tests.httpserver import Server
from tests.unit.test_cli import one_line_error

pytestmark = pytest.mark.no_docker

LINUX = "; platform_system == 'Linux' and platform_machine == 'x86_64'"
NVIDIA = {
    "12.6": ["nvidia-cuda-nvrtc-cu12==12.6.77", "nvidia-cuda-runtime-cu12==12.6.77", "nvidia-cuda-cupti-cu12==12.6.80",
             "nvidia-cudnn-cu12==9.5.1.17", "nvidia-cublas-cu12==12.6.4.1", "nvidia-cufft-cu12==11.3.0.4",
             "nvidia-curand-cu12==10.3.7.77", "nvidia-cusolver-cu12==11.7.1.2", "nvidia-cusparse-cu12==12.5.4.2",
             "nvidia-cusparselt-cu12==0.6.3", "nvidia-nccl-cu12==2.25.1", "nvidia-nvtx-cu12==12.6.77",
             "nvidia-nvjitlink-cu12==12.6.85", "nvidia-cufile-cu12==1.11.1.6"],
    "12.9": ["nvidia-cuda-nvrtc-cu12==12.9.41", "nvidia-cuda-runtime-cu12==12.9.37", "nvidia-cuda-cupti-cu12==12.9.19",
             "nvidia-cudnn-cu12==9.9.0.52", "nvidia-cublas-cu12==12.9.0.13", "nvidia-cufft-cu12==11.4.0.6",
             "nvidia-curand-cu12==10.3.10.19", "nvidia-cusolver-cu12==11.7.4.40", "nvidia-cusparse-cu12==12.5.9.5",
             "nvidia-cusparselt-cu12==0.7.1", "nvidia-nccl-cu12==2.26.5", "nvidia-nvtx-cu12==12.9.19",
             "nvidia-nvjitlink-cu12==12.9.41", "nvidia-cufile-cu12==1.14.0.30"]}


def paddle_requires() -> list[str]:
    """What paddlepaddle 3.3.1 declares, from PyPI's CPU wheel in the cpu wheelhouse (.ci/run fetches it)."""
    (wheel,) = wheelhouse.default_dir(matrix.load().get("cpu")).glob("paddlepaddle-3.3.1-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [ln.split(": ", 1)[1] for ln in z.read(meta).decode().splitlines() if ln.startswith("Requires-Dist: ")]


def stand_in(version: str, requires: list[str]) -> tuple[str, bytes]:
    name = f"paddlepaddle_gpu-{version}-cp311-cp311-linux_x86_64.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        info = f"paddlepaddle_gpu-{version}.dist-info"
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: paddlepaddle-gpu\nVersion: " + version + "\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                   "Tag: cp311-cp311-linux_x86_64\n")
        z.writestr(f"{info}/RECORD", "")
    return name, buf.getvalue()


def lock(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "invoke", "lock", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "UV_NO_CONFIG": "1"})


@pytest.mark.parametrize("variant", ["cu126", "cu129"])
def test_the_paddle_3_gpu_lock_pins_and_hashes_every_nvidia_package_from_an_index_laid_out_as_paddles(
        variant, tmp_path):
    v = matrix.load().get(variant)
    cuda, before = v.accel["cuda"], locks_here()
    name, wheel = stand_in(v.paddle_version, paddle_requires() + [r + LINUX for r in NVIDIA[cuda]])
    root = tmp_path / "index"
    page = root / "packages" / "stable" / f"cu{cuda.replace('.', '')}" / "paddlepaddle-gpu"
    files = root / "stable" / f"cu{cuda.replace('.', '')}" / "paddlepaddle-gpu"
    page.mkdir(parents=True)
    files.mkdir(parents=True)
    (files / name).write_bytes(wheel)
    with Server(root) as s:
        (page / "index.html").write_text(f'<html><body><a href="{s.url}/{files.relative_to(root)}/{name}">{name}</a>'
                                         f'<br></body></html>\n')
        mirror = f"{s.url}/packages/stable/cu{cuda.replace('.', '')}/"
        out = tmp_path / f"{variant}.lock"
        proc = lock("--variant", variant, "--paddle-index", mirror, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    entries = {e.name.lower(): e for e in locks.parse(text)}
    assert text.startswith(locks.header(v))   # the matrix's inputs: the mirror is not one
    assert proc.stdout.strip().splitlines()[-1] == f"wrote {out} ({len(entries)} packages, sha256 hashes, Python " \
                                                   f"3.11, manylinux_2_36_x86_64)"
    paddle = entries["paddlepaddle-gpu"]
    assert (paddle.version, paddle.index) == (v.paddle_version, mirror)
    assert paddle.hashes == (__import__("hashlib").sha256(wheel).hexdigest(),)
    for pin in NVIDIA[cuda]:
        pkg, version = pin.split("==")
        e = entries[pkg]
        assert (e.version, e.index) == (version, v.pypi) and e.hashes, e
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in e.hashes)
    assert locks_here() == before   # the stand-in's lock is never the checkout's


def test_the_lock_without_paddles_index_is_one_line():
    """This machine reaches PyPI and not Paddle's index: the same command, as the GPU guide gives it."""
    before = locks_here()
    proc = lock("--variant", "cu126", timeout=120)
    one_line_error(proc, "cannot reach https://www.paddlepaddle.org.cn/packages/stable/cu126/ (",
                   "); run `invoke lock` where it is reachable and commit the lock")
    assert locks_here() == before


def locks_here() -> dict[str, bytes]:
    """The checkout's locks and records, as they are."""
    return {p.name: p.read_bytes() for p in (ROOT / "images" / "locks").iterdir()}
