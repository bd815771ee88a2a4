"""The environment's layer split (pure): Paddle's closure first, each extra apart, then the rest; keys that
change with a layer's inputs and its parent's, and only then."""
import os

import pytest

from fleetbox.errors import UserError
from fleetbox.image import layers, locks, matrix

V = matrix.load().get("cpu")
LOCK = V.lock_path.read_text()
ENTRIES = locks.parse(LOCK)
BASE = "sha256:" + "1" * 64


def split(lock=LOCK, base=BASE):
    return layers.plan(V, lock, locks.parse(lock), base, "/usr/bin/python3", "pip-25.3-py3-none-any.whl")


def test_paddle_and_its_closure_come_first_then_each_extra():
    got = [(x.name, sorted(e.name for e in x.entries)) for x in split()]
    assert [n for n, _ in got] == ["paddle", "visualdl", "scipy", "opencv-python-headless"]
    assert "numpy" in got[0][1] and "paddlepaddle" in got[0][1] and "pip" in got[0][1]
    # VisualDL's writer changes as rarely as Paddle: below the extras, so that their bumps leave it alone; locked
    # without its dependencies, none of its own comes with it
    assert got[1][1] == ["visualdl"] and got[2][1] == ["scipy"] and got[3][1] == ["opencv-python-headless"]
    every = sorted(e.name for x in split() for e in x.entries)
    assert every == sorted(e.name for e in ENTRIES)   # each locked package in exactly one layer


def test_changing_one_extras_pin_changes_its_layer_and_the_ones_after_only():
    opencv = next(e for e in ENTRIES if e.name == "opencv-python-headless")
    changed = LOCK.replace(opencv.hashes[0], "f" * 64)
    a, b = split(), split(changed)
    assert [x.key == y.key for x, y in zip(a, b)] == [True, True, True, False]
    assert [x.key == y.key for x, y in zip(split(base="sha256:" + "2" * 64), a)] == [False] * 4


def test_the_requirements_of_a_layer_carry_every_hash_and_no_other_package():
    paddle = split()[0]
    for e in paddle.entries:
        assert f"{e.name}=={e.version} " + " ".join(f"--hash=sha256:{h}" for h in e.hashes) in paddle.requirements
    assert "scipy" not in paddle.requirements


def _calls(script: str, env: dict, tmp_path) -> list[list[str]]:
    """The docker commands the script would run, each as its argv (docker replaced by a recorder; a commit
    answers with a made-up image ID naming its tag)."""
    import subprocess
    rec = tmp_path / "calls"
    stub = (f"docker() {{ for a in \"$@\"; do printf '%s\\0' \"$a\" >> {rec}; done; printf '\\n\\0' >> {rec}; "
            "if [ \"$1\" = commit ]; then eval \"echo id-of-\\${$#}\"; fi; }\n")
    rec.write_bytes(b"")
    subprocess.run(["sh", "-c", stub + script], capture_output=True, env=env, check=True)
    calls, cur = [], []
    for a in rec.read_bytes().decode().split("\0")[:-1]:
        if a == "\n":
            calls.append(cur)
            cur = []
        else:
            cur.append(a)
    return calls


BASE_ID = "sha256:" + "b" * 64


def test_the_by_hand_script_passes_every_value_whole_and_takes_its_tags_from_the_environment(tmp_path):
    hostile = "/path with space,comma/wh'eel$(touch /tmp/x)"
    layers_ = split()
    script = layers.by_hand(V, layers_, BASE_ID, hostile, "fleetbox/paddle:cpu-1",
                            layers.changes(V, ["PATH=/usr/bin"], {"a": "b c'd"}))
    calls = _calls(script, {"PATH": "/usr/bin:/bin"}, tmp_path)
    runs, commits = [c for c in calls if c[0] == "run"], [c for c in calls if c[0] == "commit"]
    assert len(runs) == 4 and len(commits) == 5 and [c[0] for c in calls].count("rm") == 5
    for call, layer in zip(runs, layers_):
        # docker reads --mount as CSV: the quoted field keeps the comma in the path
        assert f'type=bind,dst=/mnt,readonly,"src={hostile}"' in call
        assert call[-5:] == ["sh", "-c", layer.script, "sh", layer.requirements]   # requirements arrive whole
    assert [c[-1] for c in commits] == [layers.layer_tag(x) for x in layers_] + ["fleetbox/paddle:cpu-1"]
    assert 'LABEL "a"="b c\'d"' in commits[-1] and 'ENV PATH="/opt/venv/bin:/usr/bin"' in commits[-1]
    assert [r[r.index("--network") + 1] for r in runs] == ["none"] * 4
    # each layer runs from the image ID the one before gave; the first from the base's ID
    assert [r[-6] for r in runs] == [BASE_ID] + [f"id-of-{c[-1]}" for c in commits[:-2]]
    # the settings: committed from a container of the last layer that is created, never run
    created = [c for c in calls if c[0] == "create"]
    assert len(created) == 1 and created[0][-1] == f"id-of-{commits[-2][-1]}"
    assert calls.index(created[0]) == calls.index(commits[-1]) - 1
    mine = _calls(script, {"PATH": "/usr/bin:/bin", "WHEELHOUSE": "/w", "LAYERS": "me/l", "IMAGE": "me/img:1"},
                  tmp_path)
    tags = [c[-1] for c in mine if c[0] == "commit"]
    assert tags == [f"me/l:{layers.layer_tag(x).split(':', 1)[1]}" for x in layers_] + ["me/img:1"]
    assert all('type=bind,dst=/mnt,readonly,"src=/w"' in c for c in mine if c[0] == "run")
    with pytest.raises(UserError, match="double quote"):
        layers.by_hand(V, layers_, BASE_ID, '/a"b', "x:1", [])


def test_settings_reach_commit_as_written_no_variable_expanded_non_ascii_kept():
    got = layers.changes(V, [], {"io.x": "cost $HOME \\ é"})
    assert 'LABEL "io.x"="cost \\$HOME \\\\ é"' in got


def test_a_hostile_pip_wheel_name_stays_one_word():
    script = layers.install_script("/usr/bin/python3", "pip-1$(touch x).whl", first=True)
    assert script.count("pip-1$(touch x).whl") == script.count("'/mnt/pip-1$(touch x).whl/pip'") == 1


def test_the_last_layer_is_marked_not_named_and_finishes_the_environment():
    odd = split()
    assert [x.last for x in odd] == [False, False, False, True]
    assert [layers.FREEZE in x.script for x in odd] == [False, False, False, True]
    assert layers.FREEZE in layers.copy_script(last=True) and layers.FREEZE not in layers.copy_script(last=False)


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


class _Engine:
    """Just enough of docker-py's client for one layer: create works, commit fails as a full disk would."""
    def __init__(self):
        self.removed, self.api = [], self

    def remove_container(self, name, force=False):
        self.removed.append((name, force))

    @property
    def containers(self):
        return self

    def create(self, image, command, name, **kw):
        import types
        self.name, self.command = name, command

        return types.SimpleNamespace(start=lambda: None, wait=lambda: {"StatusCode": 0}, logs=lambda: b"ok\n",
                                     commit=self.commit)

    def commit(self, **kw):
        import docker
        raise docker.errors.APIError("500", explanation="write /var/lib/docker/...: no space left on device")


def test_an_engine_error_in_a_layer_is_one_line_and_the_container_is_removed(tmp_path):
    import io

    from fleetbox.image import images
    engine, layer = _Engine(), split()[0]
    removals = images._Removals(engine)
    with pytest.raises(UserError, match=r"^layer paddle: the engine refused: write .*no space left on device$"):
        try:
            images._run_and_commit(engine, "sha256:p", layer.name, layer.script, [layer.requirements], [],
                                   "fleetbox/layers:x", [], io.StringIO(), removals)
        finally:
            removals.wait()
    assert engine.removed == [(engine.name, True)] and engine.name.startswith("fleetbox-layer-paddle-")
    assert engine.command == ["sh", "-c", layer.script, "sh", layer.requirements]


class _StageEngine(_Engine):
    """The staging container: its volume is made, it starts, and pip fails in it (or the engine refuses the
    volume)."""
    def __init__(self, refuse_volume=False):
        super().__init__()
        self.refuse_volume, self.made, self.volumes_removed = refuse_volume, [], []

    @property
    def volumes(self):
        return self

    def remove_volume(self, name, force=False):
        self.volumes_removed.append((name, force))

    def create(self, *args, **kw):   # volumes.create(name) and containers.create(image, command, name=..., ...)
        import types

        import docker
        if not kw:
            if self.refuse_volume:
                raise docker.errors.APIError("500", explanation="no space left on device")
            self.made.append(args[0])
            return None
        self.name, self.kw, self.image = kw["name"], kw, args[0]
        logs = b"fleetbox-phase start 1.0\nERROR: No matching distribution found for scipy==1.17.1\n"
        return types.SimpleNamespace(start=lambda: None, wait=lambda: {"StatusCode": 1}, logs=lambda: logs)


def test_a_stage_that_fails_is_one_line_and_its_container_and_volume_are_removed(tmp_path):
    import io

    from fleetbox.image import images
    engine, staged = _StageEngine(), split()[1:]
    removals = images._Removals(engine)
    with pytest.raises(UserError, match=r"^installing visualdl, scipy, opencv-python-headless beside the first "
                                        r"layer failed "
                                        r"\(exit 1\): ERROR: No matching distribution found for scipy==1.17.1$"):
        try:
            with images._staged(engine, "sha256:p", staged, str(tmp_path),
                                {"PYTHON": "/usr/bin/python3", "PIP_WHEEL": "pip-25.3-py3-none-any.whl"},
                                io.StringIO(), removals) as stage:
                assert engine.made == []   # nothing runs until the first layer's own container does
                stage.start()
                stage.start()   # once: every layer made in place says it runs
                stage.wait()
        finally:
            removals.wait()
    name = engine.name
    assert name.startswith("fleetbox-layer-stage-") and engine.made == [name]
    assert engine.kw["network_mode"] == "none" and engine.kw["cpu_shares"] == 2 and engine.image == "sha256:p"
    assert images._building(engine.kw["labels"])   # this process: a clean --images now leaves it alone
    assert [m["Target"] for m in engine.kw["mounts"]] == [layers.WHEELS, layers.STAGE]
    assert engine.removed == [(name, True)] and engine.volumes_removed == [(name, True)]


def test_an_engine_refusing_the_stage_volume_is_one_line_and_nothing_is_left(tmp_path):
    import io

    from fleetbox.image import images
    engine = _StageEngine(refuse_volume=True)
    removals = images._Removals(engine)
    with pytest.raises(UserError, match=r"^installing visualdl, scipy, opencv-python-headless: the engine refused: "
                                        r"no space"):
        try:
            with images._staged(engine, "sha256:p", split()[1:], str(tmp_path),
                                {"PYTHON": "/usr/bin/python3", "PIP_WHEEL": "p.whl"}, io.StringIO(), removals) as stage:
                stage.start()
        finally:
            removals.wait()
    assert len(engine.removed) == 1 and engine.removed[0][0].startswith("fleetbox-layer-stage-")
    assert engine.volumes_removed == [(engine.removed[0][0], True)]


def test_nothing_to_stage_makes_no_container():
    from fleetbox.image import images
    engine = _StageEngine()
    with images._staged(engine, "sha256:p", [], "/w", {}, None, images._Removals(engine)) as stage:
        assert stage is None
    assert engine.made == [] and engine.removed == [] and engine.volumes_removed == []


def test_a_hostile_pip_wheel_name_stays_one_word_when_staging():
    script = layers.stage_script("/usr/bin/python3", "pip-1$(touch x).whl")
    assert script.count("pip-1$(touch x).whl") == script.count("'/mnt/pip-1$(touch x).whl/pip'") == 1


def test_which_layers_are_made_staged_and_from_what():
    from fleetbox.image import images
    paddle, visualdl, scipy, opencv = split()
    every = {"paddle": "sha256:p", "visualdl": "sha256:v", "scipy": "sha256:s", "opencv-python-headless": "sha256:o"}
    # cold: Paddle's made in place from the base, the others beside it
    made, staged, parent = images.making(split(), dict.fromkeys(every), "sha256:base")
    assert (made, staged, parent) == ([paddle, visualdl, scipy, opencv], [visualdl, scipy, opencv], "sha256:base")
    # scipy's pin changed: scipy's made in place from VisualDL's layer, opencv beside it
    made, staged, parent = images.making(split(), {**every, "scipy": None, "opencv-python-headless": None}, "b")
    assert (made, staged, parent) == ([scipy, opencv], [opencv], "sha256:v")
    # opencv's pin changed: nothing to stage
    assert images.making(split(), {**every, "opencv-python-headless": None}, "b") == ([opencv], [], "sha256:s")
    # nothing changed but the settings: no layer made, they go onto the last one
    assert images.making(split(), every, "b") == ([], [], "sha256:o")


def test_a_staging_container_is_live_while_its_build_runs_here():
    import os
    import subprocess

    from fleetbox.image import images
    from fleetbox.processes import process_start, this_host
    assert images._building({images.BUILDER: f"{this_host()} {os.getpid()} {process_start(os.getpid())}"})
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not images._building({images.BUILDER: f"{this_host()} {gone.pid} 12345"})
    assert not images._building({images.BUILDER: f"{this_host()} {os.getpid()} 1"})   # the pid reused
    assert images._building({images.BUILDER: "another-login-node 1 1"})   # cannot be asked: kept
    assert not images._building({})   # not a staging container
    for odd in ("", "x", f"{this_host()} 12", f"{this_host()} {os.getpid()} soon", f"{this_host()} -1 1 extra"):
        assert not images._building({images.BUILDER: odd}), odd


def test_a_layers_profile_is_the_time_between_its_phase_lines():
    out = "fleetbox-phase start 100.0\nCollecting x\nfleetbox-phase pip 112.5\nfleetbox-phase fixed-times 113.25\n" \
          "fleetbox-phase compileall 120.0\n"
    assert layers.phase_marks(out)[0] == ("start", 100.0)
    assert layers.profile(layers.phase_marks(out)) == {"pip": 12.5, "fixed-times": 0.75, "compileall": 6.75}
    assert layers.profile(layers.phase_marks("no phases")) == {}
    # a phase line as the shell prints it reads back
    import subprocess
    said = subprocess.run(["sh", "-c", f"{layers._phase('start')}; {layers._phase('pip')}"],
                          capture_output=True, text=True, check=True).stdout
    got = layers.profile(layers.phase_marks(said))
    assert list(got) == ["pip"] and got["pip"] >= 0, said


class _SettingsEngine:
    """Just enough of docker-py's client for the settings' commit: records what is created and started."""
    def __init__(self, refuse=False):
        self.refuse, self.api, self.calls, self.removed = refuse, self, [], []

    @property
    def containers(self):
        return self

    def create(self, image, name, **kw):
        import types

        import docker
        self.calls.append(("create", image, name, kw))

        def commit(**settings):
            if self.refuse:
                raise docker.errors.APIError("500", explanation="No such image: sha256:o")
            self.calls.append(("commit", settings))
            return "the image"
        return types.SimpleNamespace(start=lambda: self.calls.append(("start",)), commit=commit)

    def remove_container(self, name, force=False):
        self.removed.append(name)


def test_the_settings_are_committed_from_a_container_that_never_runs_and_a_refusal_is_one_line():
    import io

    from fleetbox.image import images
    for refuse in (False, True):
        engine, out = _SettingsEngine(refuse), io.StringIO()
        removals = images._Removals(engine)
        try:
            if refuse:
                with pytest.raises(UserError, match=r"^the image's settings: the engine refused: No such image"):
                    images._settings(engine, "sha256:o", "fleetbox/paddle:cpu-1", ["LABEL a=b"], out, removals)
            else:
                assert images._settings(engine, "sha256:o", "fleetbox/paddle:cpu-1", ["LABEL a=b"], out,
                                        removals) == "the image"
        finally:
            removals.wait()
        (_, image, name, kw), *rest = engine.calls
        assert image == "sha256:o" and kw == {"network_mode": "none"} and name.startswith("fleetbox-layer-settings-")
        assert ("start",) not in rest   # never run: nothing it could write becomes a layer
        assert rest == ([] if refuse else [("commit", {"repository": "fleetbox/paddle", "tag": "cpu-1",
                                                       "changes": ["LABEL a=b"]})])
        assert engine.removed == [name]


PYPI_GPU = matrix.load().get("cu118-pypi")
PYPI_GPU_LOCK = PYPI_GPU.lock_path.read_text()


def test_the_gpu_libraries_are_a_layer_of_their_own_below_paddles_and_a_paddle_bump_keeps_it():
    got = dict(layers.groups(PYPI_GPU, PYPI_GPU_LOCK))
    assert [name for name, _ in layers.groups(PYPI_GPU, PYPI_GPU_LOCK)][:2] == ["libraries", "paddle"]
    assert got["libraries"] == {layers.requirement_name(x) for x in PYPI_GPU.libraries}
    assert "paddlepaddle-gpu" in got["paddle"] and not any(n.startswith("nvidia-") for n in got["paddle"])
    entries = locks.parse(PYPI_GPU_LOCK)
    before = layers.plan(PYPI_GPU, PYPI_GPU_LOCK, entries, BASE, "/usr/bin/python3", "pip-25.3-py3-none-any.whl")
    bumped = [e if e.name != "paddlepaddle-gpu" else locks.Locked(e.name, "2.6.3", ("f" * 64,), e.index)
              for e in entries]
    after = layers.plan(PYPI_GPU, PYPI_GPU_LOCK, bumped, BASE, "/usr/bin/python3", "pip-25.3-py3-none-any.whl")
    assert before[0].key == after[0].key and before[1].key != after[1].key


def test_only_the_libraries_layer_names_them_for_the_loader_and_only_the_first_makes_the_venv():
    entries = locks.parse(PYPI_GPU_LOCK)
    planned = layers.plan(PYPI_GPU, PYPI_GPU_LOCK, entries, BASE, "/usr/bin/python3", "pip-25.3-py3-none-any.whl")
    named = [layer.name for layer in planned if "ldconfig" in layer.script]
    assert named == ["libraries"]
    assert layers.LIBRARY_NAMES in planned[0].script and "-m venv" in planned[0].script
    assert not any("-m venv" in layer.script for layer in planned[1:])


def test_the_naming_step_gives_each_library_its_unversioned_name_once_and_lists_every_folder(tmp_path):
    """The libraries layer's own shell, run on a copy of NVIDIA's layout; ldconfig (this machine's cache) stands
    in as a command that rewrites the auxiliary cache, which must come back as it was."""
    import subprocess
    site = tmp_path / "opt/venv/lib/python3.11/site-packages/nvidia"
    for rel in ("cudnn/lib/libcudnn.so.8", "cudnn/lib/libcudnn_ops_infer.so.8", "cuda_cupti/lib/libcupti.so.11.8",
                "cuda_cupti/lib/libcheckpoint.so", "nccl/lib/libnccl.so.2", "nccl/lib/libnccl.so"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(rel)
    aux = tmp_path / "aux-cache"
    aux.write_text("the base's")
    os.utime(aux, (315532800, 315532800))
    step = layers._name_libraries().replace(layers.VENV, str(tmp_path / "opt/venv")).replace(
        layers.LIBRARY_NAMES, str(tmp_path / "names.conf")).replace("/var/cache/ldconfig/aux-cache", str(aux))
    step = step.replace("ldconfig;", f"echo rewritten > {aux};").replace("fleetbox-phase", "phase")
    subprocess.run(["sh", "-c", step], check=True)
    assert aux.read_text() == "the base's" and aux.stat().st_mtime == 315532800   # the layer records it unchanged
    assert (site / "cudnn/lib/libcudnn.so").resolve() == site / "cudnn/lib/libcudnn.so.8"
    assert (site / "cudnn/lib/libcudnn_ops_infer.so").resolve() == site / "cudnn/lib/libcudnn_ops_infer.so.8"
    assert (site / "cuda_cupti/lib/libcupti.so").resolve() == site / "cuda_cupti/lib/libcupti.so.11.8"
    assert not (site / "nccl/lib/libnccl.so").is_symlink()   # a name the wheel has is left alone
    assert (tmp_path / "names.conf").read_text().split() == [str(site / d / "lib") for d in
                                                            ("cuda_cupti", "cudnn", "nccl")]
    (site / "nvtx/lib").mkdir(parents=True)   # a folder with no library: no link named for a pattern
    subprocess.run(["sh", "-c", step], check=True)
    assert sorted(p.name for p in (site / "nvtx/lib").iterdir()) == []


def test_the_naming_step_stops_the_layer_where_there_is_no_library_folder(tmp_path):
    import subprocess
    step = layers._name_libraries().replace(layers.VENV, str(tmp_path / "opt/venv")).replace(
        layers.LIBRARY_NAMES, str(tmp_path / "names.conf")).replace("ldconfig;", "true;")
    proc = subprocess.run(["sh", "-c", step], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr == "fleetbox: no nvidia/*/lib folder in the libraries layer\n"
