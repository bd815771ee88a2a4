import pytest

from fleetbox.build import locks, matrix
from fleetbox.errors import UserError

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
