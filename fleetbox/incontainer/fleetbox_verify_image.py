"""Runs inside a fleetbox image: checks Paddle, the device, scipy/opencv and the environment vs the lock.

Prints one line `FLEETBOX-REPORT <json>` at the end; the host turns it into a table and a report file.
Standard library plus the image's own packages only.
"""
import contextlib
import io
import json
import os
import sys
import traceback

EXPECT_DEVICE = os.environ.get("FLEETBOX_DEVICE", "cpu")
EXPECT_FREEZE = os.environ.get("FLEETBOX_EXPECT_FREEZE", "")
checks = []


def check(name):
    def deco(fn):
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                detail = fn()
            checks.append({"check": name, "ok": True, "detail": detail or ""})
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
    if n < 1:
        raise RuntimeError(f"no {EXPECT_DEVICE} device visible in the container")
    return f"{n} {EXPECT_DEVICE} device(s)"


@check("paddle.utils.run_check()")
def _run_check():
    import paddle
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        paddle.utils.run_check()
    text = buf.getvalue()
    if "installed successfully" not in text:
        raise RuntimeError(f"run_check did not report success: {text.strip()[-200:]}")
    return [ln for ln in text.splitlines() if ln.strip()][-1]


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


@check("installed == lock")
def _freeze():
    import sysconfig
    from importlib import metadata
    if not EXPECT_FREEZE:
        return "no expectation given"
    def norm(name):
        return name.lower().replace("_", "-").replace(".", "-")
    want = {norm(n): v for n, v in (ln.split("==") for ln in EXPECT_FREEZE.split() if "==" in ln)}
    # Only the environment's own site-packages: setuptools puts its vendored copies on sys.path.
    site = sysconfig.get_paths()["purelib"]
    have = {norm(d.metadata["Name"]): d.version for d in metadata.distributions(path=[site])}
    diff = [f"{n} want {v} have {have.get(n)}" for n, v in want.items() if have.get(n) != v]
    extra = sorted(set(have) - set(want))
    if diff or extra:
        raise RuntimeError("; ".join(diff + [f"unlocked: {', '.join(extra)}"] * bool(extra)))
    return f"{len(want)} packages match"


@check("dataset cache")
def _datasets():
    from paddle.dataset import common
    home = common.DATA_HOME
    files = sorted(os.path.relpath(os.path.join(d, f), home) for d, _, fs in os.walk(home) for f in fs)
    return f"{len(files)} files under {home}" + (f" ({', '.join(sorted({f.split('/')[0] for f in files}))})"
                                                  if files else "")


print("FLEETBOX-REPORT " + json.dumps({"checks": checks, "ok": all(c["ok"] for c in checks)}))
