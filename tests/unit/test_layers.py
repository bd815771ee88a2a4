"""The environment's layer split (pure): Paddle's closure first, each extra apart, the rest, then settings;
keys that change with a layer's inputs and its parent's, and only then."""
import pytest

from fleetbox.build import layers, locks, matrix

V = matrix.load().get("cpu")
LOCK = V.lock_path.read_text()
ENTRIES = locks.parse(LOCK)
BASE = "sha256:" + "1" * 64


def split(lock=LOCK, base=BASE):
    return layers.plan(V, lock, locks.parse(lock), base, "/usr/bin/python3", "pip-25.3-py3-none-any.whl")


def test_paddle_and_its_closure_come_first_then_each_extra_then_the_settings():
    got = [(x.name, sorted(e.name for e in x.entries)) for x in split()]
    assert [n for n, _ in got] == ["paddle", "scipy", "opencv-python-headless", "last"]
    assert "numpy" in got[0][1] and "paddlepaddle" in got[0][1] and "pip" in got[0][1]
    assert got[1][1] == ["scipy"] and got[2][1] == ["opencv-python-headless"] and got[3][1] == []
    every = sorted(e.name for x in split() for e in x.entries)
    assert every == sorted(e.name for e in ENTRIES)   # each locked package in exactly one layer


def test_changing_one_extras_pin_changes_its_layer_and_the_ones_after_only():
    opencv = next(e for e in ENTRIES if e.name == "opencv-python-headless")
    changed = LOCK.replace(opencv.hashes[0], "f" * 64)
    a, b = split(), split(changed)
    assert [x.key == y.key for x, y in zip(a, b)] == [True, True, False, False]
    assert [x.key == y.key for x, y in zip(split(base="sha256:" + "2" * 64), a)] == [False] * 4


def test_the_requirements_of_a_layer_carry_every_hash_and_no_other_package():
    paddle = split()[0]
    for e in paddle.entries:
        assert f"{e.name}=={e.version} " + " ".join(f"--hash=sha256:{h}" for h in e.hashes) in paddle.requirements
    assert "scipy" not in paddle.requirements


def test_the_by_hand_script_quotes_every_value():
    script = layers.by_hand(V, split(), "fleetbox/base:x", "/path with space/wh'eel", "fleetbox/paddle:cpu-1",
                            layers.changes(V, ["PATH=/usr/bin"], {"a": "b c"}))
    assert "WHEELHOUSE='/path with space/wh'\"'\"'eel'" in script
    assert script.count("docker run ") == 4 and script.count("docker commit ") == 4
    assert "--change 'LABEL \"a\"=\"b c\"'" in script and "--change 'ENV PATH=\"/opt/venv/bin:/usr/bin\"'" in script
