"""`invoke venv`'s pure parts (the env's name, the glibc the wheels need, ldd's output, the checks' lines) and its
promise that the env appears whole or not at all."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fleetbox import processes
from fleetbox.errors import UserError
from fleetbox.image import layers, locks, matrix, venvs

CPU = matrix.load().get("cpu")

# The cpu wheelhouse's wheels, as `invoke wheels --variant cpu` fetched them.
CPU_WHEELS = [
    "anyio-4.16.0-py3-none-any.whl", "certifi-2026.10.18-py3-none-any.whl", "h11-0.16.0-py3-none-any.whl",
    "httpcore-1.0.9-py3-none-any.whl", "httpx-0.28.1-py3-none-any.whl", "idna-3.20-py3-none-any.whl",
    "networkx-3.6.1-py3-none-any.whl", "numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "opencv_python_headless-4.12.0.88-cp37-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "opt_einsum-3.3.0-py3-none-any.whl", "paddlepaddle-3.3.1-cp311-cp311-manylinux1_x86_64.whl",
    "pillow-13.0.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", "pip-25.3-py3-none-any.whl",
    "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl",
    "safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    "scipy-1.17.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", "setuptools-80.9.0-py3-none-any.whl",
    "typing_extensions-4.16.0-py3-none-any.whl",
]

# `ldd --version` as these systems print it (stdout, then stderr).
LDD_DEBIAN12 = """ldd (Debian GLIBC 2.36-9+deb12u4) 2.36
Copyright (C) 2022 Free Software Foundation, Inc.
This is free software; see the source for copying conditions.  There is NO
warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE.
Written by Roland McGrath and Ulrich Drepper.
"""
LDD_RHEL8 = """ldd (GNU libc) 2.28
Copyright (C) 2018 Free Software Foundation, Inc.
This is free software; see the source for copying conditions.  There is NO
warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE.
Written by Roland McGrath and Ulrich Drepper.
"""
LDD_KYLIN_V10 = """ldd (GNU libc) 2.28
Copyright (C) 2018 Free Software Foundation, Inc.
This is free software; see the source for copying conditions.  There is NO
warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE.
Written by Roland McGrath and Ulrich Drepper.
"""
LDD_UBUNTU2204 = """ldd (Ubuntu GLIBC 2.35-0ubuntu3.8) 2.35
Copyright (C) 2022 Free Software Foundation, Inc.
This is free software; see the source for copying conditions.  There is NO
warranty; not even for MERCHANTABILITY or FITNESS FOR A PARTICULAR PURPOSE.
Written by Roland McGrath and Ulrich Drepper.
"""
LDD_CENTOS7 = "ldd (GNU libc) 2.17\nCopyright (C) 2012 Free Software Foundation, Inc.\n"
LDD_MUSL = """musl libc (x86_64)
Version 1.2.4
Dynamic Program Loader
Usage: /lib/ld-musl-x86_64.so.1 [options] [--] pathname [args]
"""


def test_the_env_is_named_by_variant_and_lock_hash():
    assert venvs.env_name("cpu", "0cec9610702c6eabeda4e97d8bda17a4d53cd7ec") == "cpu-0cec9610702c"


@pytest.mark.parametrize("tag,arch", [("manylinux_2_36_x86_64", "x86_64"), ("manylinux_2_28_aarch64", "aarch64"),
                                      ("manylinux2014_x86_64", "x86_64")])
def test_the_architecture_comes_from_the_variants_platform(tag, arch):
    assert venvs.platform_arch(tag) == arch


def test_a_platform_tag_without_an_architecture_is_one_line():
    with pytest.raises(UserError, match="unsupported platform tag 'win_amd64'"):
        venvs.platform_arch("win_amd64")


@pytest.mark.parametrize("name,glibc", [
    ("paddlepaddle-3.3.1-cp311-cp311-manylinux1_x86_64.whl", (2, 5)),
    ("x-1-cp311-cp311-manylinux2010_x86_64.whl", (2, 12)),
    ("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", (2, 17)),
    ("numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (2, 17)),
    # two tags: the lowest is what it runs on
    ("scipy-1.17.1-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", (2, 27)),
    ("x-1-cp311-cp311-manylinux_2_28_x86_64.manylinux_2_24_x86_64.whl", (2, 24)),
    ("pip-25.3-py3-none-any.whl", None),
    ("paddlepaddle_gpu-3.2.2-cp311-cp311-linux_x86_64.whl", None),
    ("x-1-cp311-cp311-musllinux_1_2_x86_64.whl", None),
])
def test_a_wheel_needs_the_lowest_glibc_its_tags_name(name, glibc):
    assert venvs.wheel_glibc(name) == glibc


def test_the_env_needs_the_newest_glibc_of_its_wheels_and_names_that_wheel():
    assert venvs.glibc_need(CPU_WHEELS) == ((2, 27), "pillow-13.0.0-cp311-cp311-manylinux_2_27_x86_64."
                                                     "manylinux_2_28_x86_64.whl")
    assert venvs.glibc_need(["numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                             "x-1-cp311-cp311-manylinux_2_31_x86_64.whl", "paddlepaddle-3.3.1-cp311-cp311-"
                             "manylinux1_x86_64.whl"]) == ((2, 31), "x-1-cp311-cp311-manylinux_2_31_x86_64.whl")
    assert venvs.glibc_need(reversed(CPU_WHEELS))[1].startswith("pillow-")   # pillow and scipy need 2.27: by name
    assert venvs.glibc_need(["pip-25.3-py3-none-any.whl", "idna-3.20-py3-none-any.whl"]) is None


@pytest.mark.parametrize("output,libc", [
    (LDD_DEBIAN12, ("glibc", "2.36")),
    (LDD_RHEL8, ("glibc", "2.28")),
    (LDD_KYLIN_V10, ("glibc", "2.28")),
    (LDD_UBUNTU2204, ("glibc", "2.35")),
    (LDD_CENTOS7, ("glibc", "2.17")),
    (LDD_MUSL, ("musl", "1.2.4")),
    ("", ("", "")),
    ("ldd: unrecognized option '--version'\n", ("", "")),
])
def test_ldd_version_output_says_the_c_library(output, libc):
    assert venvs.parse_ldd(output) == libc


def test_without_ldd_the_interpreter_says_the_glibc():
    assert venvs.machine_libc("", ("glibc", "2.17")) == ("glibc", "2.17")
    assert venvs.machine_libc("", ("", "")) == ("", "")
    assert venvs.machine_libc(LDD_MUSL, ("glibc", "2.36")) == ("musl", "1.2.4")   # ldd first
    assert venvs.machine_libc(LDD_RHEL8, ("glibc", "2.36")) == ("glibc", "2.28")


def _it(version="3.11.2", machine="x86_64", path="/usr/bin/python3"):
    return venvs.Interpreter(path, version, machine, ("glibc", "2.36"), "/usr/bin/python3.11")


def test_another_python_version_is_one_line():
    with pytest.raises(UserError) as e:
        venvs.check_interpreter(CPU, _it("3.12.1", path="/usr/bin/python3.12"))
    assert str(e.value) == ("/usr/bin/python3.12 is Python 3.12; the cpu lock is for 3.11: give --python a 3.11 "
                            "interpreter")
    with pytest.raises(UserError, match="is Python 3.1; the cpu lock is for 3.11"):   # not a prefix match
        venvs.check_interpreter(CPU, _it("3.1.5"))
    with pytest.raises(UserError, match="is Python 2.7;"):
        venvs.check_interpreter(CPU, _it("2.7.18"))
    venvs.check_interpreter(CPU, _it("3.11.13"))


def test_another_architecture_is_one_line():
    with pytest.raises(UserError) as e:
        venvs.check_interpreter(CPU, _it(machine="aarch64"))
    assert str(e.value) == ("/usr/bin/python3 runs on aarch64; the cpu lock's wheels are for x86_64 "
                            "(manylinux_2_36_x86_64): make the env on an x86_64 machine")


NEED = ((2, 27), "pillow-13.0.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl")


def test_an_older_glibc_than_the_wheels_need_is_one_line_naming_the_wheel():
    with pytest.raises(UserError) as e:
        venvs.check_glibc(CPU, venvs.parse_ldd(LDD_CENTOS7), NEED)
    assert str(e.value) == ("this machine's glibc is 2.17; the cpu lock's wheels need 2.27 or newer "
                            f"({NEED[1]}): make the env on a newer system")
    with pytest.raises(UserError, match="glibc is 2.9;"):   # compared as numbers: 2.9 < 2.27
        venvs.check_glibc(CPU, ("glibc", "2.9"), NEED)
    venvs.check_glibc(CPU, venvs.parse_ldd(LDD_RHEL8), NEED)   # 2.28 runs the cpu env
    venvs.check_glibc(CPU, ("glibc", "2.27"), NEED)


def test_musl_is_not_glibc():
    with pytest.raises(UserError) as e:
        venvs.check_glibc(CPU, venvs.parse_ldd(LDD_MUSL), NEED)
    assert str(e.value) == ("this machine's C library is musl 1.2.4, not glibc; the cpu lock's wheels need glibc "
                            f"2.27 or newer ({NEED[1]}): make the env on a glibc system")
    with pytest.raises(UserError, match="C library is unknown"):
        venvs.check_glibc(CPU, ("", ""), NEED)
    venvs.check_glibc(CPU, ("musl", "1.2.4"), None)   # pure-Python wheels run anywhere


def test_the_probe_reads_what_the_interpreter_says():
    out = subprocess.run([sys.executable, "-c", venvs.PROBE], capture_output=True, text=True, check=True).stdout
    it = venvs.parse_probe("py", out)
    assert it.version == ".".join(map(str, sys.version_info[:3])) and it.base == os.path.realpath(sys._base_executable)
    assert it.machine == os.uname().machine and it.libc[0] == "glibc"
    with pytest.raises(UserError, match="^/bin/echo does not answer as Python does"):
        venvs.parse_probe("/bin/echo", "-c import json\n")


def test_the_requirements_name_every_locked_hash():
    entries = [locks.Locked("numpy", "2.2.6", ("aa", "bb"), "https://pypi.org/simple"),
               locks.Locked("pip", "25.3", ("cc",), "")]
    text = layers.requirements(entries)
    assert text == "numpy==2.2.6 --hash=sha256:aa --hash=sha256:bb\npip==25.3 --hash=sha256:cc\n"
    _, cpu = locks.read(CPU)
    lines = layers.requirements(cpu).splitlines()
    assert [ln.split()[0] for ln in lines] == [f"{e.name}=={e.version}" for e in cpu]
    assert [ln.split()[1:] for ln in lines] == [[f"--hash=sha256:{h}" for h in e.hashes] for e in cpu]


def test_an_env_with_this_locks_record_is_up_to_date(tmp_path):
    assert venvs.up_to_date(tmp_path / "cpu-0cec9610702c", "0cec" * 16) is False
    env = tmp_path / "cpu-0cec9610702c"
    env.mkdir()
    (env / venvs.RECORD).write_text(json.dumps({"lock_sha256": "0cec" * 16}))
    assert venvs.up_to_date(env, "0cec" * 16) is True
    with pytest.raises(UserError, match="was made from another lock"):
        venvs.up_to_date(env, "0ced" * 16)


@pytest.mark.parametrize("what", ["folder", "file", "bad-record"])
def test_a_final_name_without_a_record_is_refused_and_left_alone(tmp_path, what):
    env = tmp_path / "cpu-0cec9610702c"
    if what == "file":
        env.write_text("mine")
    else:
        env.mkdir()
        (env / ("notes" if what == "folder" else venvs.RECORD)).write_text("mine")
    before = sorted((p.name, p.read_text()) for p in tmp_path.rglob("*") if p.is_file())
    with pytest.raises(UserError, match="fleetbox leaves it alone|fleetbox leaves .* alone"):
        venvs.up_to_date(env, "0cec" * 16)
    assert sorted((p.name, p.read_text()) for p in tmp_path.rglob("*") if p.is_file()) == before


def test_the_temporary_path_becomes_the_final_one_in_bin_and_pyvenv_cfg(tmp_path):
    tmp, final = tmp_path / ".cpu-x.tmp-1234", tmp_path / "cpu-x"
    (tmp / "bin").mkdir(parents=True)
    (tmp / "bin" / "pip").write_text(f"#!{tmp}/bin/python\nimport pip\n")
    (tmp / "bin" / "pip").chmod(0o755)
    (tmp / "bin" / "activate").write_text(f"VIRTUAL_ENV='{tmp}'\nexport VIRTUAL_ENV\n")
    binary = f"\x7fELF\0{tmp}\0".encode()
    (tmp / "bin" / "tool").write_bytes(binary)
    (tmp / "bin" / "python").symlink_to("/usr/bin/python3")
    (tmp / "pyvenv.cfg").write_text(f"home = /usr/bin\ncommand = /usr/bin/python3 -m venv {tmp}\n")
    venvs._retarget(tmp, final)
    assert (tmp / "bin" / "pip").read_text() == f"#!{final}/bin/python\nimport pip\n"
    assert (tmp / "bin" / "pip").stat().st_mode & 0o777 == 0o755
    assert (tmp / "bin" / "activate").read_text() == f"VIRTUAL_ENV='{final}'\nexport VIRTUAL_ENV\n"
    assert (tmp / "pyvenv.cfg").read_text().endswith(f"venv {final}\n")
    assert (tmp / "bin" / "tool").read_bytes() == binary   # a binary is never edited (its lengths would move)
    assert os.readlink(tmp / "bin" / "python") == "/usr/bin/python3"


@pytest.fixture
def no_build(monkeypatch):
    """make() up to the build, with the wheelhouse, interpreter and machine taken as fine."""
    monkeypatch.setattr(venvs.wheelhouse, "verify", lambda *a: [])
    monkeypatch.setattr(venvs, "find_interpreter", lambda v, p: "/usr/bin/python3.11")
    monkeypatch.setattr(venvs, "probe", lambda p: _it())
    monkeypatch.setattr(venvs, "ldd_output", lambda: LDD_DEBIAN12)


def _half_build(then):
    def build(variant, it, libc, wheel_dir, entries, lock_sha, tmp, final, log):
        (tmp / "bin").mkdir(parents=True)
        (tmp / "bin" / "python").write_text("half")
        then()
    return build


class ReachedTheTest(Exception):
    pass


@pytest.mark.parametrize("stop", [KeyboardInterrupt, UserError("pip install failed"), OSError(28, "No space left"),
                                  signal.SIGTERM, signal.SIGHUP], ids=["ctrl-c", "error", "disk-full", "sigterm",
                                                                       "sighup"])
def test_a_stopped_make_leaves_nothing_in_dest(tmp_path, monkeypatch, no_build, stop):
    def then():
        if isinstance(stop, signal.Signals):
            os.kill(os.getpid(), stop)
            time.sleep(5)   # the signal arrives before this ends
        raise stop

    def reached(*a):   # what the test's own handler does: make() must take the signal as Ctrl-C instead
        raise ReachedTheTest
    monkeypatch.setattr(venvs, "_build", _half_build(then))
    before = {s: signal.signal(s, reached) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises((KeyboardInterrupt, UserError)):
            venvs.make(CPU, tmp_path / "envs", log=lambda line: None)
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert list((tmp_path / "envs").iterdir()) == []


def test_the_env_appears_under_its_name_only_whole(tmp_path, monkeypatch, no_build):
    seen = []

    def build(variant, it, libc, wheel_dir, entries, lock_sha, tmp, final, log):
        seen.append((tmp.parent, tmp.name, final.exists()))
        (tmp / venvs.RECORD).parent.mkdir(parents=True)
        (tmp / venvs.RECORD).write_text(json.dumps({"lock_sha256": lock_sha}))
    monkeypatch.setattr(venvs, "_build", build)
    lines = []
    final = venvs.make(CPU, tmp_path / "envs", log=lines.append)
    lock_sha = locks.lock_hash(locks.read(CPU)[0])
    assert final == tmp_path / "envs" / f"cpu-{lock_sha[:12]}" and lines[-1] == str(final)
    parent, tmp_name, existed = seen[0]
    assert parent == tmp_path / "envs" and tmp_name.startswith(f".{final.name}.tmp-") and not existed
    assert [p.name for p in (tmp_path / "envs").iterdir()] == [final.name]
    lines.clear()
    assert venvs.make(CPU, tmp_path / "envs", log=lines.append) == final   # the same lock again: nothing made
    assert len(seen) == 1 and lines == [f"{final} is up to date (lock sha256 {lock_sha[:12]}); nothing to make",
                                        str(final)]


def test_a_stopped_step_is_killed_with_what_it_started(tmp_path):
    """compileall's workers, pip: nothing may still write into the temporary folder once it is removed."""
    pid_file = tmp_path / "pid"
    with pytest.raises(KeyboardInterrupt), processes.stops_as_interrupt():
        signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGTERM))
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        try:
            venvs._run(["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], "sleep")
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while processes.process_start(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes.process_start(grandchild) == 0


PYENV_SHIM = """pyenv: python3.12: command not found

The `python3.12' command exists in these Python versions:
  3.12.1

Note: See 'pyenv help global' for tips on allowing multiple
      Python versions to be found at the same time.
"""
TRACEBACK = """Traceback (most recent call last):
  File "<string>", line 1, in <module>
ModuleNotFoundError: No module named 'json'
"""


def test_a_failing_step_is_one_line_that_says_why():
    with pytest.raises(UserError) as e:
        venvs._run(["sh", "-c", "echo working; echo 'ERROR: no such wheel' >&2; echo 'details' >&2; exit 3"],
                   "pip install")
    assert str(e.value) == "pip install failed (exit 3): ERROR: no such wheel"
    assert venvs._run(["sh", "-c", "echo one; exit 1"], "compileall", ok=(0, 1)) == "one\n"
    assert venvs._last_words(PYENV_SHIM) == "pyenv: python3.12: command not found"
    assert venvs._last_words(TRACEBACK) == "ModuleNotFoundError: No module named 'json'"


def test_a_relative_python_is_found_from_where_the_user_is(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3.11").symlink_to(sys.executable)
    monkeypatch.chdir(tmp_path)
    assert venvs.find_interpreter(CPU, "bin/python3.11") == str(tmp_path / "bin" / "python3.11")
    monkeypatch.setenv("PATH", "bin")
    assert venvs.find_interpreter(CPU, None) == str(tmp_path / "bin" / "python3.11")
    assert venvs.find_interpreter(CPU, "python3.11") == str(tmp_path / "bin" / "python3.11")
    with pytest.raises(UserError, match="--python python3.99: no such interpreter"):
        venvs.find_interpreter(CPU, "python3.99")


def test_steps_run_outside_the_users_folder(tmp_path, monkeypatch):
    """Modules in the folder a user runs from would be what `python -m venv` and the probe's imports find."""
    (tmp_path / "venv").mkdir()
    for name in ("venv/__init__.py", "venv/__main__.py", "json.py"):
        (tmp_path / name).write_text("raise SystemExit('not the standard library')\n")
    monkeypatch.chdir(tmp_path)
    venvs._run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "env"], "venv")
    assert (tmp_path / "env" / "bin" / "python").exists()
    assert venvs.probe(sys.executable).version == ".".join(map(str, sys.version_info[:3]))


@pytest.mark.parametrize("args,needle", [
    ([], "--dest is required"),
    (["--dest", "{tmp}/envs", "--python", "/nonexistent/python3.11"], "--python /nonexistent/python3.11: no such"),
    (["--dest", "{tmp}/envs", "--python", "no-such-python-here"], "--python no-such-python-here: no such"),
    (["--dest", "{tmp}/envs", "--python", "/bin/false"], "/bin/false does not run (exit 1)"),
    (["--dest", "{tmp}/envs", "--python", "{tmp}/notes.txt"], "{tmp}/notes.txt does not run: Permission denied"),
    (["--dest", "{tmp}/envs", "--python", "/bin/echo"], "/bin/echo does not answer as Python does"),
    (["--dest", "{tmp}/envs", "--wheelhouse", "{tmp}/none"], "no wheelhouse for cpu at {tmp}/none"),
    (["--variant", "cu118", "--dest", "{tmp}/envs"], "no lock for variant cu118"),
])
def test_bad_input_is_one_line_and_makes_nothing(run_invoke, tmp_path, args, needle):
    from tests.unit.test_cli import one_line_error
    (tmp_path / "notes.txt").write_text("not a program\n")
    proc = run_invoke("venv", *[a.format(tmp=tmp_path) for a in args])
    one_line_error(proc, needle.format(tmp=tmp_path))
    assert not (tmp_path / "envs").exists()


def _lib_env(tmp_path):
    """A venv with an nvidia/*/lib folder as a GPU wheel leaves it (a real library, under its versioned name only),
    one folder with no library, and one with its unversioned name already there."""
    env = tmp_path / "env"
    venvs._run([sys.executable, "-m", "venv", "--without-pip", env], "venv")
    site = env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages" / "nvidia"
    real = next(p for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1",
                            "/lib64/libz.so.1") if os.path.exists(p))
    for name in ("fbtest", "empty", "kept"):
        (site / name / "lib").mkdir(parents=True)
    (site / "fbtest" / "lib" / "libfbtest.so.8").write_bytes(open(real, "rb").read())
    (site / "kept" / "lib" / "libkept.so.2").write_bytes(b"")
    (site / "kept" / "lib" / "libkept.so").write_text("its own")
    return env, site


LOADS = "import ctypes, sys; ctypes.CDLL('libfbtest.so'); print('loaded')"


def test_an_activated_env_loads_its_gpu_libraries_by_the_names_paddle_opens_and_deactivate_restores_the_path(
        tmp_path):
    env, site = _lib_env(tmp_path)
    bare = subprocess.run([env / "bin" / "python", "-c", LOADS], capture_output=True, text=True)
    assert bare.returncode != 0 and "libfbtest.so: cannot open shared object file" in bare.stderr
    venvs.name_libraries(env, env)
    assert os.readlink(site / "fbtest" / "lib" / "libfbtest.so") == "libfbtest.so.8"
    assert (site / "kept" / "lib" / "libkept.so").read_text() == "its own"   # a name already there is kept
    assert sorted(p.name for p in (site / "empty" / "lib").iterdir()) == []
    assert not (env / f"{venvs.LIBRARIES}.folders").exists()
    folders = [f"{site}/{n}/lib" for n in ("empty", "fbtest", "kept")]
    for before, after in (("export LD_LIBRARY_PATH=/site/cuda", "/site/cuda"), ("unset LD_LIBRARY_PATH", "unset"),
                          ("export LD_LIBRARY_PATH=", "")):
        proc = subprocess.run(["bash", "-euc", f'{before}; . "$1/bin/activate"; echo "$LD_LIBRARY_PATH"; python -c '
                               f'"{LOADS}"; deactivate; echo "${{LD_LIBRARY_PATH-unset}}"', "bash", env],
                              capture_output=True, text=True, env={**os.environ, "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].split(":")[:3] == folders and lines[0].split(":")[3:] == ([after] if after not in
                                                                                  ("unset", "") else []), lines
        assert lines[1:] == ["loaded", after], lines


def test_an_env_whose_gpu_libraries_left_no_folder_is_refused(tmp_path):
    env = tmp_path / "env"
    venvs._run([sys.executable, "-m", "venv", "--without-pip", env], "venv")
    with pytest.raises(UserError, match=f"^the lock's GPU libraries installed no nvidia/\\*/lib folder into "
                                        f"{tmp_path}/final$"):
        venvs.name_libraries(env, tmp_path / "final")
    assert not (env / venvs.LIBRARIES).exists()


GPU = matrix.load().get("cu118-pypi")


def test_a_gpu_env_made_without_the_library_names_is_not_taken_for_up_to_date(tmp_path):
    """An env an older fleetbox made from this lock lacks fleetbox-libraries.sh: Paddle would fail at its first
    cuDNN call, so it is named rather than used."""
    lock_sha = locks.lock_hash(locks.read(GPU)[0])
    final = tmp_path / "envs" / venvs.env_name(GPU.name, lock_sha)
    final.mkdir(parents=True)
    (final / venvs.RECORD).write_text(json.dumps({"lock_sha256": lock_sha}))
    with pytest.raises(UserError, match=f"^{final} was made by an older fleetbox, without fleetbox-libraries.sh"):
        venvs.make(GPU, tmp_path / "envs", log=lambda line: None)
    (final / venvs.LIBRARIES).write_text("")
    assert venvs.make(GPU, tmp_path / "envs", log=lambda line: None) == final


def test_a_gpu_env_is_not_made_where_its_path_would_split_the_loaders(tmp_path):
    with pytest.raises(UserError, match="a GPU variant's env cannot be where the path has ':'"):
        venvs.make(GPU, tmp_path / "a:b", log=lambda line: None)
    assert not (tmp_path / "a:b").exists()
