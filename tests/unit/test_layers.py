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


def _calls(script: str, env: dict) -> list[list[str]]:
    """The docker commands the script would run, each as its argv (docker replaced by a recorder)."""
    import subprocess
    rec = "docker() { for a in \"$@\"; do printf '%s\\0' \"$a\"; done; printf '\\n\\0'; }\n"
    out = subprocess.run(["sh", "-c", rec + script], capture_output=True, env=env, check=True).stdout.decode()
    calls, cur = [], []
    for a in out.split("\0")[:-1]:
        if a == "\n":
            calls.append(cur)
            cur = []
        else:
            cur.append(a)
    return calls


def test_the_by_hand_script_passes_every_value_whole_and_takes_its_tags_from_the_environment():
    hostile = "/path with space/wh'eel$(touch /tmp/x)"
    layers_ = split()
    script = layers.by_hand(V, layers_, "fleetbox/base:x", hostile, "fleetbox/paddle:cpu-1",
                            layers.changes(V, ["PATH=/usr/bin"], {"a": "b c'd"}))
    runs = [c for c in _calls(script, {"PATH": "/usr/bin:/bin"}) if c[0] == "run"]
    commits = [c for c in _calls(script, {"PATH": "/usr/bin:/bin"}) if c[0] == "commit"]
    assert len(runs) == len(commits) == 4
    for call, layer in zip(runs, layers_):
        assert f"type=bind,dst=/mnt,readonly,src={hostile}" in call
        assert call[-5:] == ["sh", "-c", layer.script, "sh", layer.requirements]   # requirements arrive whole
    assert [c[-1] for c in commits] == [layers.layer_tag(x) for x in layers_[:-1]] + ["fleetbox/paddle:cpu-1"]
    assert 'LABEL "a"="b c\'d"' in commits[-1] and 'ENV PATH="/opt/venv/bin:/usr/bin"' in commits[-1]
    assert [r[r.index("--network") + 1] for r in runs] == ["none"] * 4
    # each layer runs from the one before; the first from the base
    assert [r[-6] for r in runs] == ["fleetbox/base:x"] + [c[-1] for c in commits[:-1]]
    mine = _calls(script, {"PATH": "/usr/bin:/bin", "WHEELHOUSE": "/w", "LAYERS": "me/l", "IMAGE": "me/img:1"})
    tags = [c[-1] for c in mine if c[0] == "commit"]
    assert tags == [f"me/l:{layers.layer_tag(x).split(':', 1)[1]}" for x in layers_[:-1]] + ["me/img:1"]
    assert all("type=bind,dst=/mnt,readonly,src=/w" in c for c in mine if c[0] == "run")


GPU_LOCK = """# fleetbox-lock: variant=cu126 inputs=x
nvidia-cublas-cu12==12.6.4.1 \\
    --hash=sha256:aa
    # via
    #   nvidia-cudnn-cu12
    #   paddlepaddle-gpu
nvidia-cudnn-cu12==9.5.1.17 \\
    --hash=sha256:bb
    # via paddlepaddle-gpu
numpy==2.2.6 \\
    --hash=sha256:cc
    # via
    #   opencv-python-headless
    #   paddlepaddle-gpu
    #   scipy
opencv-python-headless==4.12.0.88 \\
    --hash=sha256:dd
    # via fleetbox-lock-cu126 (images/matrix.toml [cu126])
paddlepaddle-gpu==3.3.1 \\
    --hash=sha256:ee
    # via fleetbox-lock-cu126 (images/matrix.toml [cu126])
    # from https://www.paddlepaddle.org.cn/packages/stable/cu126/
pip==25.3 \\
    --hash=sha256:ff
scipy==1.17.1 \\
    --hash=sha256:11
    # via fleetbox-lock-cu126 (images/matrix.toml [cu126])
setuptools==80.9.0 \\
    --hash=sha256:22
tqdm==4.67.1 \\
    --hash=sha256:33
    # via fleetbox-lock-cu126 (images/matrix.toml [cu126])
"""


def test_a_gpu_lock_puts_the_nvidia_wheels_in_paddles_layer_and_an_unclaimed_package_in_the_rest():
    gpu = matrix.load().get("cu126")
    got = {name: sorted(names) for name, names in layers.groups(gpu, GPU_LOCK)}
    assert list(got) == ["paddle", "scipy", "opencv-python-headless", "rest"]
    assert got["paddle"] == ["numpy", "nvidia-cublas-cu12", "nvidia-cudnn-cu12", "paddlepaddle-gpu", "pip",
                             "setuptools"]
    assert got["scipy"] == ["scipy"] and got["rest"] == ["tqdm"]   # numpy is Paddle's, not the extras'
