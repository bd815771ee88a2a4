import hashlib

import pytest
from packaging.tags import Tag

from fleetbox.build import locks, matrix, wheelhouse
from fleetbox.errors import UserError


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
