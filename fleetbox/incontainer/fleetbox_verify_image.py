"""Runs inside a fleetbox image: checks Paddle, the device, scipy/opencv, VisualDL's LogWriter and the environment
vs the lock.

Prints one line `FLEETBOX-REPORT <json>` at the end; the host turns it into a table and a report file.
Standard library plus the image's own packages only.
"""
import contextlib
import glob
import io
import json
import os
import re
import sys
import traceback

EXPECT_DEVICE = os.environ.get("FLEETBOX_DEVICE", "cpu")
EXPECT_FREEZE = os.environ.get("FLEETBOX_EXPECT_FREEZE", "")
EXPECT_SBOM = os.environ.get("FLEETBOX_EXPECT_SBOM", "")   # the image's SBOM's packages, by kind: {"python": {...}}
NO_GPU = os.environ.get("FLEETBOX_NO_GPU", "")   # why the engine gave this container no GPU; "": it gave them all
checks = []
# The libraries Paddle 2.6 opens by unversioned name at run time on CUDA (paddle/phi/backends/dynload/
# dynamic_loader.cc), in an image whose libraries layer named them (NAMED); Paddle 3's GPU wheels open versioned
# names from their own nvidia-* folders instead. The driver's libcuda.so is the host's, given by the GPU runtime.
OPENS = {"cuda": ("libcublas.so", "libcublasLt.so", "libcudnn.so", "libcufft.so", "libcurand.so", "libcusolver.so",
                  "libcusparse.so", "libnvrtc.so", "libnccl.so", "libcupti.so", "libnvToolsExt.so")}
DRIVER = {"cuda": "libcuda.so"}
NAMED = "/etc/ld.so.conf.d/fleetbox-gpu-libraries.conf"   # layers.LIBRARY_NAMES
DRIVER_GPUS = "/proc/driver/nvidia/gpus"   # one entry per GPU where the host's NVIDIA driver is loaded


def norm(name):
    """A distribution's name as packaging's canonicalize_name gives it (the lock's and the SBOM's)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict:
    """The environment's distributions by name: only its own site-packages (setuptools puts its vendored copies on
    sys.path)."""
    import sysconfig
    from importlib import metadata
    return {norm(d.metadata["Name"]): d for d in metadata.distributions(path=[sysconfig.get_paths()["purelib"]])}


class NoGpu(Exception):
    """A check that passed as far as it can without a GPU: its detail says what it did."""


def check(name):
    def deco(fn):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                detail = fn()
            checks.append({"check": name, "ok": True, "detail": detail or ""})
        except NoGpu as e:
            checks.append({"check": name, "ok": True, "no_gpu": True, "detail": str(e)})
        except Exception as e:   # every failure becomes a row, not a crash
            tail = (out.getvalue().strip().splitlines() or [""])[-1]
            checks.append({"check": name, "ok": False, "detail": f"{type(e).__name__}: {e}"[:300],
                           "output": tail[:300], "trace": traceback.format_exc()[-1500:]})
        return fn
    return deco


@check("python")
def _python():
    return f"{sys.version.split()[0]} at {sys.executable}"


@check("import paddle")
def _paddle():
    import paddle
    return f"paddle {paddle.__version__} (commit {paddle.version.commit[:10]})"


@check("compiled device")
def _device():
    import paddle
    cuda, rocm = paddle.is_compiled_with_cuda(), paddle.is_compiled_with_rocm()
    got = "rocm" if rocm else "cuda" if cuda else "cpu"
    if got != EXPECT_DEVICE:
        raise RuntimeError(f"image is compiled for {got}, variant expects {EXPECT_DEVICE}")
    versions = ""
    if cuda and not rocm:
        versions = f", CUDA {paddle.version.cuda()}, cuDNN {paddle.version.cudnn()}"
    return f"{got}{versions}"


@check("device count")
def _count():
    import paddle
    if EXPECT_DEVICE == "cpu":
        return f"cpu ({os.cpu_count()} cores visible)"
    n = paddle.device.cuda.device_count()
    if n < 1 and NO_GPU and glob.glob(f"{DRIVER_GPUS}/*"):   # the host's driver, seen from in here
        raise RuntimeError(f"this machine has NVIDIA GPUs ({DRIVER_GPUS}), but its engine gave the "
                           f"container none: {NO_GPU}; set the NVIDIA container toolkit up for this engine")
    if n < 1 and NO_GPU:
        raise NoGpu(f"no GPU visible here: {NO_GPU}")
    if n < 1:
        raise RuntimeError(f"no {EXPECT_DEVICE} device visible in the container")
    return f"{n} {EXPECT_DEVICE} device(s)"


def _some(names: list) -> str:
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


def _libraries():
    """Every library Paddle's own libraries need (their ELF dependency closure, as the loader resolves it here) and
    every one Paddle opens by name at run time loads in this image; the driver's is the host's."""
    import ctypes
    import subprocess
    import sysconfig
    site = sysconfig.get_paths()["platlib"]
    elves = sorted({os.path.realpath(p) for p in (*glob.glob(f"{site}/paddle/base/*.so"),   # each file once, not
                                                   *glob.glob(f"{site}/paddle/libs/*.so*"),   # again by a link
                                                   *glob.glob(f"{site}/nvidia/*/lib/*.so*"))})
    missing = {}
    for path in elves:   # a library beside it counts as found: Paddle loads its own (libmklml_intel.so needs
                         # libiomp5.so, with no RUNPATH) after libphi.so has loaded their dependencies
        out = subprocess.run(["ldd", path], capture_output=True, text=True,
                             env={**os.environ, "LD_LIBRARY_PATH": os.path.dirname(path)}).stdout
        for line in out.splitlines():
            if "=> not found" in line and not line.split()[0].startswith(("libcuda.so", "libnvidia-")):
                # (the driver's: the host's, checked below)
                missing.setdefault(line.split()[0], set()).add(os.path.basename(path))
    problems = [f"{lib} (needed by {_some(sorted(by))}) is not in the image" for lib, by in sorted(missing.items())]
    names = OPENS[EXPECT_DEVICE] if os.path.exists(NAMED) else ()
    for name in names:
        try:
            ctypes.CDLL(name)
        except OSError as e:
            problems.append(f"{name}, which Paddle opens by name, does not load: {e}")
    if problems:
        raise RuntimeError("; ".join(problems))
    done = f"{len(elves)} libraries' dependencies found, {len(names)} opened by name"
    driver = DRIVER[EXPECT_DEVICE]
    try:
        ctypes.CDLL(driver)
    except OSError as e:
        if NO_GPU:
            raise NoGpu(f"{done}; {driver} is the host driver's: no GPU visible here") from None
        raise RuntimeError(f"{done}; but the host driver's {driver} does not load: {e}") from None
    return f"{done}, and the host driver's {driver}"


if EXPECT_DEVICE in OPENS:   # a CUDA image: a CPU one opens no library by name
    check("GPU libraries")(_libraries)


@check("paddle.utils.run_check()")
def _run_check():
    import paddle
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        paddle.utils.run_check()
    text = buf.getvalue()
    if "installed successfully" not in text:
        raise RuntimeError(f"run_check did not report success: {text.strip()[-200:]}")
    said = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if EXPECT_DEVICE != "cpu" and NO_GPU:   # says where it ran: "PaddlePaddle works well on 1 CPU."
        raise NoGpu(f"no GPU visible here: {next((ln for ln in said if 'works well on' in ln), said[-1])}")
    return said[-1]


@check("import scipy")
def _scipy():
    import numpy as np
    import scipy
    import scipy.linalg
    det = scipy.linalg.det(np.eye(3) * 2)
    assert abs(det - 8) < 1e-9, det
    return f"scipy {scipy.__version__}, numpy {np.__version__}"


@check("import cv2")
def _cv2():
    import cv2
    import numpy as np
    img = cv2.resize(np.zeros((8, 8, 3), np.uint8), (4, 4))
    assert img.shape == (4, 4, 3)
    return f"opencv {cv2.__version__}"


@check("VisualDL's LogWriter")
def _visualdl():
    """paddle.callbacks.VisualDL's writer (installed without VisualDL's server): one scalar written and read back
    from its record file (an 8-byte length, then the record)."""
    import struct
    import tempfile

    import visualdl
    with tempfile.TemporaryDirectory() as d:
        with visualdl.LogWriter(logdir=d) as w:
            w.add_scalar("train/loss", 0.5, step=3)
        (path,) = glob.glob(f"{d}/vdlrecords.*")
        data, records = open(path, "rb").read(), []
        while data:
            (n,) = struct.unpack("<Q", data[:8])
            records.append(data[8:8 + n])
            data = data[8 + n:]
        assert any(b"train/loss" in r and struct.pack("<f", 0.5) in r for r in records), records
    return f"visualdl {visualdl.__version__}"


@check("installed == lock")
def _freeze():
    if not EXPECT_FREEZE:
        return "no expectation given"
    want = {norm(n): v for n, v in (ln.split("==") for ln in EXPECT_FREEZE.split() if "==" in ln)}
    have = {n: d.version for n, d in installed().items()}
    diff = [f"{n} want {v} have {have.get(n)}" for n, v in want.items() if have.get(n) != v]
    extra = sorted(set(have) - set(want))
    if diff or extra:
        raise RuntimeError("; ".join(diff + [f"unlocked: {', '.join(extra)}"] * bool(extra)))
    return f"{len(want)} packages match"


@check("SBOM: Python")
def _sbom():
    """Every Python package the image's SBOM names is the one installed, at its version with every file as its
    RECORD hashes it (its wheel's hash was checked when it was installed), and nothing installed that it does not
    name. (Its Debian packages are checked from the host, by receipts.py's reading of dpkg's database.)"""
    import base64
    import hashlib
    if not EXPECT_SBOM:
        return "no SBOM given"
    want = json.loads(EXPECT_SBOM)
    dists = installed()
    wrong = [f"{n}=={v} is not installed" + (f" ({dists[n].version} is)" if n in dists else "")
             for n, v in sorted(want["python"].items()) if n not in dists or dists[n].version != v]
    wrong += [f"{n} {d.version} is installed and not in the SBOM" for n, d in sorted(dists.items())
              if n not in want["python"]]
    files = 0
    for n in sorted(set(want["python"]) & set(dists)):
        for f in dists[n].files or ():
            if f.hash is None or f.suffix == ".pyc":   # the build compiles every .py again, a wheel's .pyc too
                continue
            h = hashlib.new(f.hash.mode)   # not hashlib.file_digest: Python 3.11's, and the DCU image has 3.10
            try:
                with open(f.locate(), "rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
                got = h.digest()
            except OSError:
                wrong.append(f"{n}: {f} is missing")
                continue
            files += 1
            if base64.urlsafe_b64encode(got).rstrip(b"=").decode() != f.hash.value:
                wrong.append(f"{n}: {f} differs from its RECORD")
    if wrong:
        raise RuntimeError(f"{len(wrong)} differ from the SBOM: " + "; ".join(wrong[:5]))
    return f"{len(want['python'])} packages as the SBOM says, {files} files as their RECORDs hash them"


@check("dataset cache")
def _datasets():
    from paddle.dataset import common
    home = common.DATA_HOME
    files = sorted(os.path.relpath(os.path.join(d, f), home) for d, _, fs in os.walk(home) for f in fs)
    return f"{len(files)} files under {home}" + (f" ({', '.join(sorted({f.split('/')[0] for f in files}))})"
                                                  if files else "")


print("FLEETBOX-REPORT " + json.dumps({"checks": checks, "ok": all(c["ok"] for c in checks)}))
