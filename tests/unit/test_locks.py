import hashlib
import io
import socket
import zipfile
from dataclasses import replace

import pytest

from fleetbox.errors import UserError
from fleetbox.image import locks, matrix
from tests.httpserver import Server

SAMPLE = """# fleetbox-lock: variant=x inputs=abc
numpy==2.2.6 \\
    --hash=sha256:aaa \\
    --hash=sha256:bbb
    # via paddlepaddle-gpu
    # from https://pypi.org/simple
paddlepaddle-gpu==3.3.1 \\
    --hash=sha256:ccc
    # via fleetbox-lock-cu126
    # from https://www.paddlepaddle.org.cn/packages/stable/cu126/
"""


def test_parse_reads_versions_hashes_and_index():
    e = locks.parse(SAMPLE)
    assert [(x.name, x.version, x.hashes) for x in e] == [
        ("numpy", "2.2.6", ("aaa", "bbb")), ("paddlepaddle-gpu", "3.3.1", ("ccc",))]
    assert e[1].index.endswith("/cu126/") and e[0].index == "https://pypi.org/simple"


def test_uv_platform():
    assert locks.uv_platform("manylinux_2_36_x86_64") == "x86_64-manylinux_2_36"
    assert locks.uv_platform("manylinux_2_28_x86_64") == "x86_64-manylinux_2_28"
    with pytest.raises(UserError):
        locks.uv_platform("win_amd64")


def test_gpu_project_pins_paddle_to_an_explicit_index_and_argv_targets_python_and_platform(tmp_path):
    v = matrix.load().get("cu126")
    text = locks.project_file(v)
    assert '"paddlepaddle-gpu" = { index = "paddle" }' in text and "explicit = true" in text
    assert 'url = "https://www.paddlepaddle.org.cn/packages/stable/cu126/"' in text
    argv = locks.compile_argv(v, tmp_path / "p.toml", tmp_path / "o")
    for flag, val in [("--python-version", "3.11"), ("--python-platform", "x86_64-manylinux_2_36"),
                      ("--default-index", "https://pypi.org/simple")]:
        assert argv[argv.index(flag) + 1] == val
    assert "--generate-hashes" in argv and "--emit-index-annotation" in argv
    assert "[tool.uv.sources]" not in locks.project_file(matrix.load().get("cpu"))


def test_inputs_hash_changes_with_each_input():
    from dataclasses import replace
    v = matrix.load().get("cpu")
    h = locks.inputs_hash(v)
    for change in [dict(paddle="paddlepaddle==3.3.0"), dict(python_version="3.12"),
                   dict(platform="manylinux_2_28_x86_64"), dict(extras=("scipy==1.16.3",)),
                   dict(paddle_index="https://example.invalid/")]:
        assert locks.inputs_hash(replace(v, **change)) != h, change


def test_committed_cpu_lock_is_current_and_complete():
    v = matrix.load().get("cpu")
    text, entries = locks.read(v)
    names = {e.name for e in entries}
    assert {"paddlepaddle", "scipy", "opencv-python-headless", "numpy", "pip"} <= names
    assert all(e.hashes and e.index == "https://pypi.org/simple" for e in entries)


def test_missing_and_stale_locks_say_how_to_fix(tmp_path, monkeypatch):
    from dataclasses import replace
    monkeypatch.setattr(matrix, "LOCK_DIR", tmp_path)
    v = matrix.load().get("cu126")
    with pytest.raises(UserError, match=r"no lock for variant cu126 .*invoke lock --variant cu126.* on a machine "
                                        r"that reaches https://www.paddlepaddle.org.cn/packages/stable/cu126/"):
        locks.read(v)
    cpu = matrix.load().get("cpu")
    (tmp_path / "cpu.lock").write_text(locks.header(replace(cpu, python_version="3.12")) + SAMPLE)
    with pytest.raises(UserError, match="lock cpu.lock is stale"):
        locks.read(cpu)


def closed_port() -> int:
    """A loopback port nothing listens on: connecting is refused at once, with or without internet."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_wheel(name: str, version: str, requires: str = "") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        info = f"{name}-{version}.dist-info"
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                   + (f"Requires-Dist: {requires}\n" if requires else ""))
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return buf.getvalue()


@pytest.fixture
def pypi(tmp_path, monkeypatch):
    """A PEP 503 index on loopback holding one wheel, paddlepaddle 3.3.1; the checkout's lock folder moved
    aside, so a lock written to the default place would show (and not land in the checkout)."""
    monkeypatch.setattr(matrix, "LOCK_DIR", tmp_path / "default-locks")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    root = tmp_path / "index"
    wheel = tiny_wheel("paddlepaddle", "3.3.1")
    name = "paddlepaddle-3.3.1-py3-none-any.whl"
    (root / "files").mkdir(parents=True)
    (root / "files" / name).write_bytes(wheel)
    (root / "simple" / "paddlepaddle").mkdir(parents=True)
    (root / "simple" / "paddlepaddle" / "index.html").write_text(
        f'<a href="../../files/{name}#sha256={hashlib.sha256(wheel).hexdigest()}">{name}</a>\n')
    with Server(root) as s:
        yield f"{s.url}/simple", hashlib.sha256(wheel).hexdigest()


def test_lock_for_unreachable_paddle_index(pypi, tmp_path):
    index, _ = pypi
    dead = f"http://127.0.0.1:{closed_port()}/packages/stable/cu126/"
    v = replace(matrix.load().get("cu126"), pypi=index, paddle_index=dead)
    out = tmp_path / "out" / "cu126.lock"
    with pytest.raises(UserError, match=rf"^cannot reach {dead} \(ConnectionError\); run `invoke lock` where it is "
                                        r"reachable and commit the lock$"):
        locks.make(v, out=out)
    assert not (tmp_path / "out").exists() and not matrix.LOCK_DIR.exists()


def test_lock_is_written_where_asked_and_nowhere_else(pypi, tmp_path):
    index, digest = pypi
    v = replace(matrix.load().get("cpu"), pypi=index, extras=(), tools=(), no_deps=())
    out = tmp_path / "out" / "cpu.lock"
    assert locks.make(v, out=out) == out
    assert [(e.name, e.version, e.hashes, e.index) for e in locks.parse(out.read_text())] == [
        ("paddlepaddle", "3.3.1", (digest,), index)]
    assert out.read_text().startswith(locks.header(v))
    assert sorted(p.name for p in out.parent.iterdir()) == ["cpu.lock"]   # no staged file left behind
    assert not matrix.LOCK_DIR.exists()


def test_relocking_keeps_the_pins_it_can_and_upgrade_moves_them(tmp_path, monkeypatch):
    """Changing one pin must not move another package (nor the image layer it lives in): the lock's own pins
    are uv's preferences; --upgrade resolves afresh."""
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    root = tmp_path / "index"
    wheels = {("paddlepaddle", "3.3.1"): tiny_wheel("paddlepaddle", "3.3.1", "helper"),
              ("helper", "1.0"): tiny_wheel("helper", "1.0"), ("helper", "2.0"): tiny_wheel("helper", "2.0"),
              ("extra", "1.0"): tiny_wheel("extra", "1.0"), ("extra", "1.1"): tiny_wheel("extra", "1.1")}
    index_of(root, wheels)
    out = tmp_path / "cpu.lock"

    def pins(text):
        return {e.name: e.version for e in locks.parse(text)}

    with Server(root) as s:
        base = replace(matrix.load().get("cpu"), pypi=f"{s.url}/simple", tools=(), no_deps=())
        out.write_text(locks.header(base) + "helper==1.0 \\\n    --hash=sha256:" +
                       hashlib.sha256(wheels[("helper", "1.0")]).hexdigest() + "\n")
        locks.make(replace(base, extras=("extra==1.0",)), out=out)
        assert pins(out.read_text()) == {"paddlepaddle": "3.3.1", "helper": "1.0", "extra": "1.0"}
        locks.make(replace(base, extras=("extra==1.1",)), out=out)   # one pin changed: helper stays
        assert pins(out.read_text()) == {"paddlepaddle": "3.3.1", "helper": "1.0", "extra": "1.1"}
        locks.make(replace(base, extras=("extra==1.1",)), out=out, upgrade=True)
        assert pins(out.read_text()) == {"paddlepaddle": "3.3.1", "helper": "2.0", "extra": "1.1"}


def index_of(root, wheels: dict) -> None:
    """A PEP 503 index in folder `root` holding `wheels` ({(name, version): wheel bytes})."""
    (root / "files").mkdir(parents=True)
    for (name, version), data in wheels.items():
        fn = f"{name}-{version}-py3-none-any.whl"
        (root / "files" / fn).write_bytes(data)
        (root / "simple" / name).mkdir(parents=True, exist_ok=True)
        with open(root / "simple" / name / "index.html", "a") as f:
            f.write(f'<a href="../../files/{fn}#sha256={hashlib.sha256(data).hexdigest()}">{fn}</a>\n')


def test_a_no_deps_package_is_locked_without_its_dependencies_and_only_once(tmp_path, monkeypatch):
    """VisualDL's case: its LogWriter needs only what Paddle brings; its server's dependencies never enter."""
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    wheels = {("paddlepaddle", "3.3.1"): tiny_wheel("paddlepaddle", "3.3.1", "helper"),
              ("helper", "1.0"): tiny_wheel("helper", "1.0"),
              ("viewer", "2.5.3"): tiny_wheel("viewer", "2.5.3", "server-stack"),
              ("server-stack", "1.0"): tiny_wheel("server-stack", "1.0")}
    index_of(tmp_path / "index", wheels)
    out = tmp_path / "cpu.lock"
    with Server(tmp_path / "index") as s:
        v = replace(matrix.load().get("cpu"), pypi=f"{s.url}/simple", extras=(), tools=(), no_deps=("viewer==2.5.3",))
        locks.make(v, out=out)
        text = out.read_text()
        assert {e.name: e.version for e in locks.parse(text)} == {"paddlepaddle": "3.3.1", "helper": "1.0",
                                                                 "viewer": "2.5.3"}
        viewer = next(e for e in locks.parse(text) if e.name == "viewer")
        assert viewer.hashes == (hashlib.sha256(wheels[("viewer", "2.5.3")]).hexdigest(),)
        assert "    # via images/matrix.toml [cpu] no_deps\n" in text and str(tmp_path) not in text
        assert locks.inputs(v)["no_deps"] == ["viewer==2.5.3"] and locks.inputs_hash(v) != locks.inputs_hash(
            replace(v, no_deps=()))
        with pytest.raises(UserError, match=r"^matrix: variant cpu: helper is in no_deps and also needed by the "
                                            r"rest: list it once$"):
            locks.make(replace(v, no_deps=("helper==1.0",)), out=tmp_path / "other.lock")
    assert "no_deps" not in locks.inputs(replace(v, no_deps=()))   # the other variants' locks stay current


def test_constraints_reach_uv_and_the_lock_inputs_only_where_a_variant_has_them():
    from pathlib import Path
    m = matrix.load()
    gpu, cpu = m.get("cu118-pypi"), m.get("cpu")
    assert locks.inputs(gpu)["constraints"] == ["numpy==1.26.4"] and "constraints" not in locks.inputs(cpu)
    argv = locks.compile_argv(gpu, Path("p"), Path("o"), Path("c.txt"))
    assert argv[argv.index("--constraint") + 1] == "c.txt"
    assert "--constraint" not in locks.compile_argv(cpu, Path("p"), Path("o"))
    locks.read(gpu)   # the committed lock is current for these inputs (stale: a UserError)
