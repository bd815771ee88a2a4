"""`invoke venv`: the variant's locked environment as a venv, for machines without containers (HPC clusters).

The env is the image's environment without the image: the same lock, the same verified wheelhouse, the same pip
(the lock's own wheel) and the same install options, into `DEST/<variant>-<lock hash>/` with the network off. It
is made in a temporary folder beside that name and renamed to it once whole, so a folder under the final name is
always complete: it holds `fleetbox-env.json` (the record, written last) and `bin/python`, which is what other
code (the Slurm runtime) takes for a fleetbox env. A changed lock makes a new folder; an existing one is never
touched.

Before anything is made, the interpreter is held to the lock: its Python version, the machine's architecture, and
the machine's glibc against what the wheelhouse's wheels need (a manylinux wheel names the oldest glibc it runs
on; the env needs the newest of those).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import InvalidWheelFilename, parse_wheel_filename

from fleetbox import files, settings
from fleetbox.errors import UserError
from fleetbox.image import images, layers, locks, wheelhouse
from fleetbox.image.matrix import Variant
from fleetbox.processes import signals_held, stops_as_interrupt

RECORD = settings.ENV_RECORD        # the Slurm runtime reads these names: keep them
LIBRARIES = settings.ENV_LIBRARIES
FREEZE = layers.FREEZE.rsplit("/", 1)[1]   # pip's freeze, named as in an image
HELPERS = "fleetbox-helpers"        # the in-container helpers' copy, on the env's path through HELPERS.pth

# The legacy manylinux names and the glibc each stands for (PEP 600).
LEGACY_GLIBC = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}

# What the interpreter says about itself. Plain enough for any Python, so an old one gets "is Python 2.7", not a
# syntax error; the base interpreter is what the env's bin/python points at, also when PATH had a venv's python.
PROBE = ("import json, os, platform, sys; print(json.dumps({'version': platform.python_version(), "
         "'machine': platform.machine(), 'libc': platform.libc_ver(), "
         "'base': os.path.realpath(getattr(sys, '_base_executable', sys.executable))}))")


def env_name(variant_name: str, lock_sha256: str) -> str:
    return f"{variant_name}-{lock_sha256[:12]}"


def platform_arch(platform_tag: str) -> str:
    """manylinux_2_36_x86_64 -> x86_64 (the variant's platform; also the legacy manylinux names)."""
    m = re.fullmatch(r"manylinux(?:_\d+_\d+|2014|2010|1)_(\w+)", platform_tag)
    if not m:
        raise UserError(f"unsupported platform tag {platform_tag!r} (want manylinux_X_Y_ARCH)")
    return m.group(1)


def tag_glibc(platform_tag: str) -> tuple[int, int] | None:
    """The glibc a wheel's platform tag promises to run on: manylinux_2_17_x86_64 -> (2, 17), manylinux2014_x86_64
    -> (2, 17); None for a tag that names none (any, linux_x86_64, musllinux_...)."""
    m = re.match(r"manylinux_(\d+)_(\d+)_", platform_tag)
    if m:
        return int(m.group(1)), int(m.group(2))
    return LEGACY_GLIBC.get(platform_tag.split("_", 1)[0])


def wheel_glibc(filename: str) -> tuple[int, int] | None:
    """The glibc a wheel needs: the lowest its platform tags name (a wheel tagged manylinux_2_27 and manylinux_2_28
    runs on 2.27); None when it names no glibc (a pure-Python wheel)."""
    try:
        tags = parse_wheel_filename(filename)[3]
    except InvalidWheelFilename:
        raise UserError(f"{filename} is not a wheel") from None
    found = [g for g in (tag_glibc(t.platform) for t in tags) if g]
    return min(found) if found else None


def glibc_need(filenames) -> tuple[tuple[int, int], str] | None:
    """(glibc, wheel) for the wheel that needs the newest glibc (the first by name among equals); None when no
    wheel needs one."""
    needs = [(g, name) for name in sorted(filenames) if (g := wheel_glibc(name))]
    return max(needs, key=lambda x: x[0]) if needs else None


def parse_ldd(output: str) -> tuple[str, str]:
    """(C library, version) from `ldd --version` (stdout and stderr together): glibc's first line ends with its
    version ("ldd (Debian GLIBC 2.36-9+deb12u4) 2.36", "ldd (GNU libc) 2.28"); musl's ldd says "musl libc" and
    "Version 1.2.4". ("", "") for anything else."""
    lines = output.strip().splitlines()
    first = lines[0] if lines else ""
    if re.search(r"glibc|gnu libc|gnu c library", first, re.IGNORECASE):
        m = re.fullmatch(r"(\d+\.\d+)(?:\.\d+)?", first.split()[-1])
        return ("glibc", m.group(1)) if m else ("", "")
    if first.lower().startswith("musl libc"):
        m = re.search(r"^Version\s+(\S+)", output, re.MULTILINE)
        return "musl", m.group(1) if m else ""
    return "", ""


def machine_libc(ldd_output: str, interpreter_libc: tuple[str, str]) -> tuple[str, str]:
    """This machine's C library: what ldd says, else what the interpreter's platform.libc_ver() says (no ldd,
    or output we do not know)."""
    said = parse_ldd(ldd_output)
    if said[0]:
        return said
    lib, version = interpreter_libc
    return ("glibc", version) if lib == "glibc" and version else ("", "")


def _glibc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def _dotted(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class Interpreter:
    path: str       # as it is run (the --python value, or what was found on PATH)
    version: str    # "3.11.2"
    machine: str    # platform.machine(), as the interpreter reports it
    libc: tuple     # platform.libc_ver(): ("glibc", "2.36"), ("", "") where it cannot tell
    base: str       # the real path of the base interpreter


def parse_probe(path: str, output: str) -> Interpreter:
    try:
        data = json.loads(output.strip().splitlines()[-1])
        return Interpreter(path, str(data["version"]), str(data["machine"]), tuple(data["libc"]), str(data["base"]))
    except (IndexError, ValueError, KeyError, TypeError):
        raise UserError(f"{path} does not answer as Python does (asked for its version)") from None


def check_interpreter(variant: Variant, it: Interpreter) -> None:
    """The interpreter is the lock's Python on the lock's architecture, or one line saying why not."""
    want = variant.python_version
    have = ".".join(it.version.split(".")[:2])
    if have != want:
        raise UserError(f"{it.path} is Python {have}; the {variant.name} lock is for {want}: "
                        f"give --python a {want} interpreter")
    arch = platform_arch(variant.platform)
    if it.machine != arch:
        raise UserError(f"{it.path} runs on {it.machine}; the {variant.name} lock's wheels are for {arch} "
                        f"({variant.platform}): make the env on an {arch} machine")


def check_glibc(variant: Variant, libc: tuple[str, str], need: tuple[tuple[int, int], str] | None) -> None:
    """This machine's C library runs the lock's wheels, or one line saying why not."""
    if need is None:   # pure-Python wheels only: any C library does
        return
    glibc, wheel = need
    lib, version = libc
    if lib != "glibc":
        what = f"{lib} {version}".strip() if lib else "unknown (neither `ldd --version` nor Python names one)"
        raise UserError(f"this machine's C library is {what}, not glibc; the {variant.name} lock's wheels need "
                        f"glibc {_dotted(glibc)} or newer ({wheel}): make the env on a glibc system")
    if _glibc(version) < glibc:
        raise UserError(f"this machine's glibc is {version}; the {variant.name} lock's wheels need "
                        f"{_dotted(glibc)} or newer ({wheel}): make the env on a newer system")


def record(variant: Variant, lock_sha256: str, it: Interpreter, libc: tuple[str, str], made: float,
           revision: str) -> dict:
    return {"variant": variant.name, "lock_sha256": lock_sha256, "python": it.version, "interpreter": it.base,
            "machine": it.machine, "glibc": libc[1] if libc[0] == "glibc" else "", "platform": variant.platform,
            "made": int(made), "fleetbox_revision": revision}


def up_to_date(final: Path, lock_sha256: str) -> bool:
    """True when `final` is this lock's env, False when nothing is there; anything else there (a folder without a
    record: half made by hand, or someone's own) is refused and never touched."""
    if not os.path.lexists(final):
        return False
    try:
        data = json.loads((final / RECORD).read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise UserError(f"{final} exists but is not a fleetbox env (no {RECORD}); fleetbox leaves it alone: "
                        f"move it away or give another --dest") from None
    except (OSError, ValueError):
        raise UserError(f"{final / RECORD} cannot be read as a record; fleetbox leaves {final} alone: "
                        f"move it away or give another --dest") from None
    if not isinstance(data, dict) or data.get("lock_sha256") != lock_sha256:
        raise UserError(f"{final} was made from another lock than its name says; fleetbox leaves it alone: "
                        f"move it away or give another --dest")
    return True


def _child_env() -> dict[str, str]:
    """This environment without the user's Python and pip settings: a PYTHONPATH (an HPC module's site-packages)
    would make pip skip a locked package as "already satisfied", a PIP_USER or PIP_TARGET would install
    elsewhere, a pip.conf could add options."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    return {**env, "PIP_CONFIG_FILE": os.devnull}


# Where the interpreters run: `python -m` and `-c` put the current folder first on sys.path, and the folder a
# user runs from may hold a module named like a standard one (a json.py, a platform.py, a venv package).
CWD = "/"


def find_interpreter(variant: Variant, python: str | None) -> str:
    """The interpreter's absolute path (the steps run from another folder), not resolved: the venv links to it
    as named."""
    if python:
        found = shutil.which(python) if os.sep not in python else python
        if not found or not os.path.exists(found):
            raise UserError(f"--python {python}: no such interpreter")
        return os.path.abspath(found)
    for name in (f"python{variant.python_version}", "python3"):
        if found := shutil.which(name):
            return os.path.abspath(found)
    raise UserError(f"no python{variant.python_version} or python3 on PATH; give --python a "
                    f"{variant.python_version} interpreter")


def probe(path: str) -> Interpreter:
    try:
        proc = subprocess.run([path, "-c", PROBE], capture_output=True, text=True, timeout=60, env=_child_env(),
                              cwd=CWD)
    except OSError as e:
        raise UserError(f"{path} does not run: {e.strerror}") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"{path} did not answer within 60 s") from None
    if proc.returncode != 0:
        raise UserError(f"{path} does not run (exit {proc.returncode}): {_last_words(proc.stderr)[:200]}")
    return parse_probe(path, proc.stdout)


def _last_words(output: str) -> str:
    """The line of a failed program's output that says why: a Python traceback's last line, else the first
    (a wrapper's "pyenv: python3.12: command not found", before its advice)."""
    lines = [ln for ln in output.strip().splitlines() if ln.strip()] or ["(no output)"]
    return lines[-1] if lines[0].startswith("Traceback") else lines[0]


def ldd_output() -> str:
    """`ldd --version`, stdout and stderr together (musl's ldd answers on stderr, exit 1); "" without ldd."""
    try:
        proc = subprocess.run(["ldd", "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout + proc.stderr


def _run(argv: list, what: str, *, ok=(0,), stdin_text: str | None = None, env=None) -> str:
    """Run one step of the making, its output captured; stopped (Ctrl-C, SIGTERM), it is killed with everything it
    started (compileall's workers) before we go on, so nothing writes into the temporary folder once we remove it.
    Its own session: a terminal's Ctrl-C reaches us alone, and we stop it."""
    with subprocess.Popen([str(a) for a in argv], stdin=subprocess.PIPE if stdin_text else subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env=env, cwd=CWD) as p:
        try:
            out, err = p.communicate(stdin_text)
        except BaseException:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
    if p.returncode not in ok:
        raise UserError(f"{what} failed (exit {p.returncode}): {_last_words(err or out)[:300]}")
    return out


def _retarget(tmp: Path, final: Path) -> None:
    """The temporary path becomes the final one in the text files that name it: bin/'s console scripts (their
    shebangs) and activate scripts, and pyvenv.cfg's `command` line. The final path is the shorter one, so a
    shebang stays within its length limit."""
    old, new = str(tmp).encode(), str(final).encode()
    for p in [*(tmp / "bin").iterdir(), tmp / "pyvenv.cfg"]:
        if p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        if old in data and b"\0" not in data:   # a binary a wheel put in bin/ is left as it is
            p.write_bytes(data.replace(old, new))   # in place: the mode stays


def library_path_script(folders: list[str]) -> str:
    """The env's LIBRARIES file (ours; `folders` relative to the env, quoted): its GPU libraries' folders first on
    the dynamic loader's path, for the loader to find the names Paddle opens (an image lists them in
    ld.so.conf.d instead, which needs root)."""
    path = ":".join(f'"$VIRTUAL_ENV"/{shlex.quote(f)}' for f in folders)
    return ("# fleetbox: this env's GPU libraries' folders first on the loader's path (Paddle opens them by name)\n"
            f'LD_LIBRARY_PATH={path}"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"\nexport LD_LIBRARY_PATH\n')


# What the env's bin/activate gains (ours): the LIBRARIES file sourced, and deactivate putting LD_LIBRARY_PATH back
# as it was (unset where it was unset).
ACTIVATE_RESTORE = """    if [ -n "${_FLEETBOX_LD_SET:-}" ] ; then   # fleetbox: the loader's path as before activate
        if [ -n "${_FLEETBOX_OLD_LD_LIBRARY_PATH+set}" ] ; then
            LD_LIBRARY_PATH="$_FLEETBOX_OLD_LD_LIBRARY_PATH"
            export LD_LIBRARY_PATH
        else
            unset LD_LIBRARY_PATH
        fi
        unset _FLEETBOX_LD_SET _FLEETBOX_OLD_LD_LIBRARY_PATH
    fi
"""
ACTIVATE_SET = f"""
_FLEETBOX_LD_SET=1
if [ -n "${{LD_LIBRARY_PATH+set}}" ] ; then _FLEETBOX_OLD_LD_LIBRARY_PATH="$LD_LIBRARY_PATH" ; fi
. "$VIRTUAL_ENV/{LIBRARIES}"
"""


def name_libraries(tmp: Path, final: Path) -> None:
    """The env's GPU libraries under the names Paddle opens (layers.link_library_names), their folders in its
    LIBRARIES file, which its bin/activate sources (bash and zsh; deactivate undoes it)."""
    listing = tmp / f"{LIBRARIES}.folders"
    _run(["sh", "-c", layers.link_library_names('"$1"', '"$2"'), "sh", tmp, listing], "naming the GPU libraries")
    folders = [str(Path(line).relative_to(tmp)) for line in listing.read_text().splitlines()]
    listing.unlink()
    if not folders:
        raise UserError(f"the lock's GPU libraries installed no nvidia/*/lib folder into {final}")
    (tmp / LIBRARIES).write_text(library_path_script(folders))
    activate = tmp / "bin" / "activate"
    text = activate.read_text()
    head = "deactivate () {\n"
    if text.count(head) != 1:
        raise UserError(f"{activate.name} of this Python has no deactivate function as venv writes it: "
                        "cannot add the GPU libraries' folders to it")
    activate.write_text(text.replace(head, head + ACTIVATE_RESTORE) + ACTIVATE_SET)


def _build(variant: Variant, it: Interpreter, libc, wheel_dir: Path, entries, lock_sha: str, tmp: Path,
           final: Path, log) -> None:
    """Make the whole env in `tmp`, naming `final` wherever a path is kept."""
    python = tmp / "bin" / "python"
    site = tmp / "lib" / f"python{variant.python_version}" / "site-packages"
    env = _child_env()
    _run([it.path, "-m", "venv", "--without-pip", "--prompt", final.name, tmp], f"{it.path} -m venv", env=env)
    log(f"installing {len(entries)} wheels into {final} (offline, from {wheel_dir})")
    # as the image's layers do (layers.install_script): pip from the lock's own wheel, hashes required, no
    # resolving (the lock is complete)
    _run([python, wheel_dir / images.pip_wheel(entries) / "pip", "install", "--no-index", "--no-cache-dir",
          "--find-links", wheel_dir, "--require-hashes", "--only-binary", ":all:", "--no-deps", "--no-compile",
          "--disable-pip-version-check", "--quiet", "-r", "/dev/stdin"], "pip install",
         stdin_text=layers.requirements(entries), env=env)
    if variant.libraries:
        name_libraries(tmp, final)
    helpers = tmp / HELPERS
    helpers.mkdir()
    for src in sorted(settings.HELPERS.glob("*.py")):
        # the package's own file; and sitecustomize, which a job's launch puts on PYTHONPATH itself (hang
        # detection) and which would otherwise run in every Python of the env
        if src.name not in ("__init__.py", "sitecustomize.py"):
            shutil.copy(src, helpers / src.name)
    (site / f"{HELPERS}.pth").write_text(f"{final / HELPERS}\n")
    # the .pyc files name the final path (tracebacks); exit 1 is a file that does not compile (a Python 2
    # example some wheels ship), which pip would skip too
    _run([python, "-m", "compileall", "-q", "-j", "0", "-s", tmp, "-p", final, site, helpers], "compileall",
         ok=(0, 1), env={**env, "PYTHONHASHSEED": "0"})
    freeze = _run([python, "-m", "pip", "freeze", "--all", "--disable-pip-version-check"], "pip freeze",
                  env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
    (tmp / FREEZE).write_text(freeze)
    _retarget(tmp, final)
    files.write_json(tmp / RECORD, record(variant, lock_sha, it, libc, time.time(), images.source_revision()))


def make(variant: Variant, dest: Path, python: str | None = None, wheel_dir: Path | None = None,
         log=print) -> Path:
    """The variant's env under `dest` (made, or found up to date); returns its path."""
    lock_text, entries = locks.read(variant)
    lock_sha = locks.lock_hash(lock_text)
    dest = Path(os.path.abspath(dest))   # the path as given, not through symlinks: the one other nodes see too
    final = dest / env_name(variant.name, lock_sha)
    if variant.libraries and ":" in str(final):   # LD_LIBRARY_PATH separates its folders with ':'
        raise UserError(f"--dest {dest}: a GPU variant's env cannot be where the path has ':' (the loader's path "
                        f"would split it): give another --dest")
    if up_to_date(final, lock_sha):
        if variant.libraries and not (final / LIBRARIES).exists():
            raise UserError(f"{final} was made by an older fleetbox, without {LIBRARIES} (the names Paddle opens "
                            f"its GPU libraries by): move it away and make it again")
        log(f"{final} is up to date (lock sha256 {lock_sha[:12]}); nothing to make")
        log(str(final))
        return final
    path = find_interpreter(variant, python)
    it = probe(path)
    check_interpreter(variant, it)
    wheel_dir = Path(os.path.abspath(wheel_dir or wheelhouse.default_dir(variant)))
    wheels = wheelhouse.verify(variant, wheel_dir, lock_text, entries)
    libc = machine_libc(ldd_output(), it.libc)
    need = glibc_need(w.name for w in wheels)
    check_glibc(variant, libc, need)
    log(f"python {path}: Python {it.version} on {it.machine}, {' '.join(libc).strip() or 'C library unknown'}"
        + (f" (the wheels need glibc {_dotted(need[0])} or newer)" if need else ""))
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--dest {dest}: cannot make the folder: {e.strerror}") from None
    tmp = dest / f".{final.name}.tmp-{secrets.token_hex(4)}"   # beside it: the rename stays on one file system
    t0 = time.monotonic()
    try:
        with stops_as_interrupt():
            _build(variant, it, libc, wheel_dir, entries, lock_sha, tmp, final, log)
            try:
                os.rename(tmp, final)
            except OSError as e:
                if not up_to_date(final, lock_sha):   # True: another run made it meanwhile, and that one stands
                    raise UserError(f"cannot rename {tmp.name} to {final}: {e.strerror}") from None
    except OSError as e:   # a full disk, a folder we may not write
        raise UserError(f"making {final}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")) \
            from None
    finally:
        with signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"made the {variant.name} env in {time.monotonic() - t0:.0f} s; activate it with `. {final}/bin/activate`")
    log(str(final))
    return final
