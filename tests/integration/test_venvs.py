"""`invoke venv` for real: the cpu lock's env made from the verified wheelhouse, no container (one build, ~20-60 s,
shared by the tests here). It needs no Docker Engine."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
from packaging.utils import canonicalize_name

from fleetbox.data import fetch
from fleetbox.image import kernels, locks, matrix, wheelhouse
from tests.conftest import ROOT, invoke
from tests.integration.conftest import GPU_VARIANT, _ok, paddle_opens
from tests.unit.test_cli import one_line_error

pytestmark = pytest.mark.no_docker

CPU = matrix.load().get("cpu")
CLEAN = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}   # as a user's shell might


@pytest.fixture(scope="module")
def env(cpu_env):
    """The session's env (conftest.cpu_env: `invoke venv` into a fresh folder), which the Slurm tests also run."""
    lock_text, entries = locks.read(CPU)
    return {"dest": cpu_env["dest"], "path": cpu_env["path"], "made": cpu_env["proc"],
            "lock_sha256": locks.lock_hash(lock_text), "entries": entries}


def python(env, *args):
    return subprocess.run([env["path"] / "bin" / "python", *args], capture_output=True, text=True, timeout=300,
                          env=CLEAN)


def test_the_env_runs_the_locked_paddle_scipy_cv2_and_the_helpers(env):
    proc = python(env, "-c", "import paddle, scipy, cv2, fleetbox_checkpoint; print(paddle.__version__); "
                             "print(fleetbox_checkpoint.__file__)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, helper = proc.stdout.strip().splitlines()[-2:]
    paddle = next(e for e in env["entries"] if e.name == CPU.paddle_name)
    assert version == paddle.version == CPU.paddle_version
    assert helper == str(env["path"] / "fleetbox-helpers" / "fleetbox_checkpoint.py")


def test_pip_freeze_is_exactly_the_lock(env):
    proc = python(env, "-m", "pip", "freeze", "--all", "--disable-pip-version-check")
    assert proc.returncode == 0, proc.stderr
    pins = {(canonicalize_name(e.name), e.version) for e in env["entries"]}

    def read(text):
        return {(canonicalize_name(n), v) for n, v in (ln.split("==") for ln in text.split())}
    assert read(proc.stdout) == pins and len(proc.stdout.split()) == len(pins)
    assert read((env["path"] / "fleetbox-freeze.txt").read_text()) == pins


def test_the_env_is_named_by_its_lock_and_recorded(env):
    assert env["path"] == env["dest"] / f"cpu-{env['lock_sha256'][:12]}"
    record = json.loads((env["path"] / "fleetbox-env.json").read_text())
    version = python(env, "-c", "import platform; print(platform.python_version())").stdout.strip()
    assert record["lock_sha256"] == env["lock_sha256"] and record["variant"] == "cpu"
    assert record["python"] == version and version.startswith("3.11.")
    assert record["platform"] == CPU.platform and record["machine"] == os.uname().machine
    assert os.access(env["path"] / "bin" / "python", os.X_OK)
    assert f"installing {len(locks.read(CPU)[1])} wheels into" in env["made"].stdout   # every locked one


def test_nothing_temporary_is_left(env):
    assert os.listdir(env["dest"]) == [env["path"].name]   # no .<name>.tmp-* beside it
    temporary = f"{env['dest']}/.{env['path'].name}.tmp-".encode()
    for p in [*(env["path"] / "bin").iterdir(), env["path"] / "pyvenv.cfg"]:
        if p.is_file() and not p.is_symlink():
            assert temporary not in p.read_bytes(), p
            assert b".tmp-" not in p.read_bytes(), p   # nor its name (the prompt of the activate scripts)
    # a console script runs from the final path, and the byte code names it (tracebacks)
    pip = subprocess.run([env["path"] / "bin" / "pip", "--version"], capture_output=True, text=True, env=CLEAN)
    assert pip.returncode == 0 and str(env["path"]) in pip.stdout, pip.stderr
    proc = python(env, "-c", "import marshal, paddle, importlib.util as u; p = u.cache_from_source(paddle.__file__); "
                             "print(marshal.loads(open(p, 'rb').read()[16:]).co_filename)")
    assert proc.stdout.strip() == str(env["path"] / "lib/python3.11/site-packages/paddle/__init__.py"), proc.stderr


def test_the_same_lock_again_is_a_no_op(env):
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (env["path"], env["path"] / "fleetbox-env.json")]
    again = _ok(invoke("venv", "--variant", "cpu", "--dest", str(env["dest"])))
    assert f"{env['path']} is up to date" in again.stdout and "installing" not in again.stdout
    assert again.stdout.strip().splitlines()[-1] == str(env["path"])
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (env["path"], env["path"] / "fleetbox-env.json")] \
        == before
    assert os.listdir(env["dest"]) == [env["path"].name]


def _version(exe: str) -> str:
    try:
        proc = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                              text=True, timeout=30, env=CLEAN)
    except OSError:
        return ""
    return proc.stdout.strip() if proc.returncode == 0 else ""


def another_python(tmp_path) -> tuple[str, str]:
    """(interpreter, its major.minor): a real one of another version where this machine has one (PATH, /usr/bin,
    pyenv's versions); else a tiny script that answers fleetbox's probe as Python 3.99 would (it runs, but it is
    no Python: the unit tests hold the check to real interpreters' output too)."""
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found = [shutil.which(f"python3.{m}") for m in range(6, 20)]
    found += sorted(glob.glob("/usr/bin/python3.*") + glob.glob("/usr/local/bin/python3.*"))
    found += sorted(glob.glob(f"{pyenv}/versions/3.*/bin/python3"), reverse=True)
    for exe in filter(None, found):
        version = _version(exe)
        if version and version != CPU.python_version:
            return exe, version
    fake = tmp_path / "python3.99"
    fake.write_text("#!/bin/sh\necho '{\"version\": \"3.99.0\", \"machine\": \"%s\", \"libc\": [\"glibc\", \"2.36\"], "
                    "\"base\": \"%s\"}'\n" % (os.uname().machine, fake))
    fake.chmod(0o755)
    return str(fake), "3.99"


def test_another_python_version_is_one_line_and_makes_nothing(env, tmp_path):
    exe, version = another_python(tmp_path)
    dest = tmp_path / "envs"
    proc = invoke("venv", "--variant", "cpu", "--dest", str(dest), "--python", exe)
    one_line_error(proc, f"{exe} is Python {version}; the cpu lock is for 3.11: give --python a 3.11 interpreter")
    assert proc.returncode == 2 and not dest.exists()
    print(f"checked with {exe} (Python {version})", file=sys.stderr)


def test_the_gpu_variants_env_opens_every_library_paddle_opens_by_name_once_activated(cuda_env):
    """The cu118-pypi env: NVIDIA's wheels ship versioned names only; activated, each name Paddle opens loads (no
    root, no ldconfig), and Paddle is the GPU build. Not activated, the names do not load: what activate adds."""
    names = paddle_opens()
    probe = str(ROOT / "tests" / "probes" / "gpu_names.py")
    env = cuda_env["path"]
    bare = subprocess.run([env / "bin" / "python", probe, *names], capture_output=True, text=True, env=CLEAN)
    said = json.loads(bare.stdout.split("FLEETBOX-NAMES ")[1])
    assert "cannot open shared object file" in said["names"]["libcudnn.so"], said
    proc = subprocess.run(["bash", "-euc", '. "$1/bin/activate"; shift; python "$@"; python -c "import paddle; '
                           'print(paddle.__version__, paddle.is_compiled_with_cuda(), paddle.version.cuda())"',
                           "bash", env, probe, *names], capture_output=True, text=True, env=CLEAN, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.split("FLEETBOX-NAMES ")[1].splitlines()[0])
    assert said["names"] == {n: "loaded" for n in names} and len(names) == 11, said
    assert said["prefix"] == str(env)
    assert proc.stdout.strip().splitlines()[-1] == f"{matrix.load().get(GPU_VARIANT).paddle_version} True 11.8"


def test_the_gpu_variants_kernels_are_measured_from_its_wheel_as_its_record_says(cuda_env):
    """What `invoke doctor` holds a node's GPUs to is measured from the wheel, never typed: the wheelhouse's Paddle
    wheel read again gives the record kept beside the lock, and the list once written by hand into the matrix (and
    named by Paddle's own warning on a P100, "arch: 61 70 75 80 86", Paddle #54713). libpaddle.so has no PTX: no
    first-run compilation for a newer GPU."""
    v = matrix.load().get(GPU_VARIANT)
    entry = kernels.paddle_entry(v, locks.read(v)[1])
    (wheel,) = [w for w in wheelhouse.default_dir(v).glob("paddlepaddle_gpu-*.whl") if fetch.file_digest(w)
                in entry.hashes]
    k = kernels.measure(wheel, log=lambda *_: None)
    assert k == kernels.load(v) and k.measured
    assert k.architectures == ("6.1", "7.0", "7.5", "8.0", "8.6")
    assert [k.how(c) for c in ("8.0", "8.9", "9.0", "10.0")] == ["native", "native", "", ""]
    libpaddle = k.libraries["paddle/base/libpaddle.so"]
    assert sum(libpaddle.values()) > 100 and not any(kind == "ptx" for images in libpaddle for kind, _ in images)
    assert sum(k.libraries["paddle/libs/libphi.so"].values()) > 600 and k.strays()[0] < 10
