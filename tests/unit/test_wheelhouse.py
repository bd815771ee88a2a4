import hashlib
import json

import pytest
from packaging.tags import Tag

from fleetbox.errors import UserError
from fleetbox.image import locks, matrix, wheelhouse


def test_platforms_expand_to_older_manylinux_and_legacy_aliases():
    p = wheelhouse.platforms("manylinux_2_36_x86_64")
    assert p[0] == "manylinux_2_36_x86_64" and p[-1] == "linux_x86_64"
    for legacy in ("manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "manylinux_2_28_x86_64"):
        assert legacy in p
    assert "manylinux_2_37_x86_64" not in p


def test_target_tags_follow_the_variants_python():
    cpu = wheelhouse.target_tags(matrix.load().get("cpu"))
    assert Tag("cp311", "cp311", "manylinux1_x86_64") in cpu and Tag("py3", "none", "any") in cpu
    assert Tag("cp310", "abi3", "manylinux2014_x86_64") in cpu
    assert Tag("cp312", "cp312", "manylinux1_x86_64") not in cpu
    dcu = wheelhouse.target_tags(matrix.load().get("dcu"))
    assert Tag("cp310", "cp310", "manylinux_2_28_x86_64") in dcu
    assert Tag("cp310", "cp310", "manylinux_2_31_x86_64") not in dcu


ENTRY = locks.Locked("numpy", "2.2.6", ("h-manylinux", "h-cp312", "h-old"), "https://pypi.org/simple")
FILES = [
    ("numpy-2.2.6-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "u1", "h-cp312"),
    ("numpy-2.2.6-cp311-cp311-manylinux_2_5_x86_64.manylinux1_x86_64.whl", "u2", "h-old"),
    ("numpy-2.2.6-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", "u3", "h-manylinux"),
    ("numpy-2.2.6-cp311-cp311-musllinux_1_2_x86_64.whl", "u4", "h-musl-not-locked"),
    ("numpy-2.2.6.tar.gz", "u5", "h-sdist"),
]


def test_select_picks_the_best_locked_wheel_for_the_target():
    w = wheelhouse.select(ENTRY, FILES, wheelhouse.target_tags(matrix.load().get("cpu")))
    assert (w.filename, w.url, w.sha256) == (FILES[2][0], "u3", "h-manylinux")


def test_select_refuses_when_no_locked_hash_fits():
    entry = locks.Locked("numpy", "2.2.6", ("h-cp312",), "https://pypi.org/simple")
    with pytest.raises(UserError, match="no wheel of numpy==2.2.6 with a locked hash fits cp311"):
        wheelhouse.select(entry, FILES, wheelhouse.target_tags(matrix.load().get("cpu")))


def _wheel(tmp_path, name, data=b"wheel bytes"):
    p = tmp_path / name
    p.write_bytes(data)
    return p, hashlib.sha256(data).hexdigest()


def test_check_wheel_rejects_wrong_python_and_wrong_hash(tmp_path):
    cpu = matrix.load().get("cpu")
    ok, digest = _wheel(tmp_path, "numpy-2.2.6-cp311-cp311-manylinux2014_x86_64.whl")
    entries = [locks.Locked("numpy", "2.2.6", (digest,), "")]
    wheelhouse.check_wheel(cpu, ok, entries)   # right tag, right hash: no error
    wrong_py, _ = _wheel(tmp_path, "numpy-2.2.6-cp312-cp312-manylinux2014_x86_64.whl")
    with pytest.raises(UserError, match=r"is for cp312-cp312-manylinux2014_x86_64, not variant cpu's Python 3.11"):
        wheelhouse.check_wheel(cpu, wrong_py, entries)
    tampered, _ = _wheel(tmp_path, "numpy-2.2.6-cp311-cp311-manylinux1_x86_64.whl", b"tampered")
    with pytest.raises(UserError, match="which lock cpu.lock does not allow"):
        wheelhouse.check_wheel(cpu, tampered, entries)


def _wheelhouse(tmp_path, entries_wheels, lock_text="the lock"):
    """A wheelhouse folder holding these wheels (name -> bytes), with a manifest that lists them all."""
    dest = tmp_path / "wh"
    dest.mkdir()
    for name, data in entries_wheels.items():
        (dest / name).write_bytes(data)
    (dest / "manifest.json").write_text(json.dumps({
        "variant": "cpu", "lock_sha256": locks.lock_hash(lock_text),
        "files": {n: hashlib.sha256(d).hexdigest() for n, d in entries_wheels.items()}}))
    return dest


def _locked(name, version, *datas):
    return locks.Locked(name, version, tuple(hashlib.sha256(d).hexdigest() for d in datas), "")


def test_verify_wants_exactly_one_wheel_per_lock_entry(tmp_path):
    """Two locked wheels of numpy and none of pip: as many files as entries, and still not complete."""
    cpu = matrix.load().get("cpu")
    a, b = b"numpy manylinux2014", b"numpy manylinux1"
    entries = [_locked("pip", "25.3", b"pip"), _locked("numpy", "2.2.6", a, b)]
    dest = _wheelhouse(tmp_path, {"numpy-2.2.6-cp311-cp311-manylinux2014_x86_64.whl": a,
                                  "numpy-2.2.6-cp311-cp311-manylinux1_x86_64.whl": b})
    with pytest.raises(UserError, match=r"has no wheel for pip==25.3, not one"):
        wheelhouse.verify(cpu, dest, "the lock", entries)
    entries = [_locked("numpy", "2.2.6", a, b)]
    with pytest.raises(UserError, match=r"has 2 wheels \(numpy-.*, numpy-.*\) for numpy==2.2.6, not one"):
        wheelhouse.verify(cpu, dest, "the lock", entries)


def test_verify_returns_the_one_wheel_of_each_entry(tmp_path):
    cpu = matrix.load().get("cpu")
    wheels = {"numpy-2.2.6-cp311-cp311-manylinux2014_x86_64.whl": b"numpy", "pip-25.3-py3-none-any.whl": b"pip"}
    dest = _wheelhouse(tmp_path, wheels)
    entries = [_locked("pip", "25.3", b"pip"), _locked("numpy", "2.2.6", b"numpy")]
    assert sorted(p.name for p in wheelhouse.verify(cpu, dest, "the lock", entries)) == sorted(wheels)


@pytest.mark.parametrize("text", ["{", "", "[]", "null", '{"files": {}}', '{"lock_sha256": "x", "files": ["a.whl"]}',
                                  '{"lock_sha256": "x", "files": {"../../etc/x.whl": "y"}}'])
def test_a_corrupt_manifest_is_an_incomplete_wheelhouse(tmp_path, text):
    cpu = matrix.load().get("cpu")
    dest = tmp_path / "wh"
    dest.mkdir()
    (dest / "manifest.json").write_text(text)
    with pytest.raises(UserError, match=r"wheelhouse manifest .*manifest.json is corrupt; run `invoke wheels"):
        wheelhouse.verify(cpu, dest, "the lock", [])
