"""The wheelhouse against a real PEP 503 index on loopback (the same code path as PyPI and Paddle's index)."""
import hashlib
import json
from dataclasses import replace

import pytest

from fleetbox.errors import UserError
from fleetbox.image import locks, matrix, wheelhouse
from tests.httpserver import Server

WHEELS = {
    "pip-25.3-py3-none-any.whl": b"pip wheel",
    "paddlepaddle-3.3.1-cp311-cp311-manylinux1_x86_64.whl": b"paddle cp311",
    "paddlepaddle-3.3.1-cp312-cp312-manylinux1_x86_64.whl": b"paddle cp312",
}


def sha(b):
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def index(tmp_path, monkeypatch):
    root = tmp_path / "index"
    for project in ("pip", "paddlepaddle"):
        d = root / "simple" / project
        d.mkdir(parents=True)
        links = "".join(f'<a href="../../files/{n}#sha256={sha(b)}">{n}</a>\n'
                        for n, b in WHEELS.items() if n.startswith(project + "-"))
        (d / "index.html").write_text(f"<html><body>{links}</body></html>")
    (root / "files").mkdir()
    for n, b in WHEELS.items():
        (root / "files" / n).write_bytes(b)
    monkeypatch.setattr(matrix, "LOCK_DIR", tmp_path / "locks")
    with Server(root) as s:
        v = replace(matrix.load().get("cpu"), pypi=f"{s.url}/simple", extras=(), tools=("pip==25.3",))
        lock = (locks.header(v) + "paddlepaddle==3.3.1 \\\n"
                + "".join(f"    --hash=sha256:{sha(b)} \\\n" for n, b in WHEELS.items() if "paddle" in n)
                + f"    # from {s.url}/simple\npip==25.3 \\\n"
                + f"    --hash=sha256:{sha(WHEELS['pip-25.3-py3-none-any.whl'])}\n")
        (tmp_path / "locks").mkdir()
        v.lock_path.write_text(lock)
        yield s, v


def test_wheelhouse_downloads_the_right_wheels_then_reuses(index, tmp_path):
    server, v = index
    dest = tmp_path / "wh"
    wheelhouse.ensure(v, dest, log=lambda m: None)
    manifest = json.loads((dest / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["paddlepaddle-3.3.1-cp311-cp311-manylinux1_x86_64.whl",
                                         "pip-25.3-py3-none-any.whl"]
    assert (dest / "requirements.lock").read_text() == v.lock_path.read_text()
    n = len(server.requests)
    msgs = []
    wheelhouse.ensure(v, dest, log=msgs.append)
    assert len(server.requests) == n and "reused" in msgs[-1]


def test_a_tampered_wheel_is_caught_and_replaced(index, tmp_path):
    _, v = index
    dest = tmp_path / "wh"
    wheelhouse.ensure(v, dest, log=lambda m: None)
    target = dest / "pip-25.3-py3-none-any.whl"
    target.write_bytes(b"evil")
    text, entries = locks.read(v)
    with pytest.raises(UserError, match="pip-25.3-py3-none-any.whl has sha256 .* which lock cpu.lock does not allow"):
        wheelhouse.verify(v, dest, text, entries)
    wheelhouse.ensure(v, dest, log=lambda m: None)
    assert target.read_bytes() == b"pip wheel"


def test_a_lock_change_makes_the_wheelhouse_incomplete(index, tmp_path):
    _, v = index
    dest = tmp_path / "wh"
    wheelhouse.ensure(v, dest, log=lambda m: None)
    v.lock_path.write_text(v.lock_path.read_text() + "\n")
    text, entries = locks.read(v)
    with pytest.raises(UserError, match="made from another lock"):
        wheelhouse.verify(v, dest, text, entries)


@pytest.mark.parametrize("data", [b'{"variant": "cpu", "lock_sha', b"[]", b"\xff\xfe"])
def test_a_corrupt_manifest_is_made_again(index, tmp_path, data):
    """A torn or garbled manifest: no traceback, the wheelhouse is fetched and verified again."""
    server, v = index
    dest = tmp_path / "wh"
    wheelhouse.ensure(v, dest, log=lambda m: None)
    good = (dest / "manifest.json").read_text()
    (dest / "manifest.json").write_bytes(data)
    n = len(server.requests)
    msgs = []
    wheelhouse.ensure(v, dest, log=msgs.append)
    assert (dest / "manifest.json").read_text() == good
    assert len(server.requests) > n and "all sha256 verified" in msgs[-1]   # not "reused"
