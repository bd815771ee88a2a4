"""Layered builds for real: one changed pin makes only its layer and the ones after it again (the rest keep
their digests), and the by-hand script every build writes makes the very same layers, byte for byte."""
import json
import re
import subprocess
from pathlib import Path

import pytest

from fleetbox.image import layers, locks, matrix
from tests.conftest import invoke
from tests.integration.conftest import _ok, layer_digests, without_pushed

pytestmark = pytest.mark.images   # builds, verifies, compares the default engine's images (tests/conftest.py)


def docker(*args, check=True):
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=900, check=check)


def test_one_changed_pin_makes_only_its_layer_again_and_the_image_verifies(cpu_image, bumped):
    v = matrix.load().get("cpu")
    old = {e.name: e.version for e in locks.read(v)[1]}
    new = {e.name: e.version for e in locks.parse((bumped["src"] / "images/locks/cpu.lock").read_text())}
    # `invoke lock` kept every other pin (uv, left alone, would also move numpy: Paddle's layer)
    assert old.keys() == new.keys() and {k for k in old if old[k] != new[k]} == {"opencv-python-headless"}
    assert new["opencv-python-headless"] == "4.11.0.86"
    assert "opencv_python_headless-4.11.0.86" in bumped["wheels"].stdout   # the only wheel downloaded
    assert len(re.findall(r"^\[\d+/\d+\] ", bumped["wheels"].stdout, re.M)) == len(new)

    out = bumped["build"].stdout
    made = re.findall(r"^layer (\S+)\s+[\d.]+ MiB in", out, re.M)
    reused = re.findall(r"^layer (\S+)\s+reused", out, re.M)
    assert reused == ["paddle", "visualdl", "scipy"] and made == ["opencv-python-headless"], out

    main, mine = layer_digests(cpu_image["image"].id), layer_digests(bumped["ref"])
    base = layer_digests(v.base_ref)
    assert main[:len(base)] == mine[:len(base)] == base
    assert len(main) == len(mine) == len(base) + 4   # the settings add no layer
    assert mine[:-1] == main[:-1]                      # base, Paddle, VisualDL and scipy: the same digests
    assert mine[-1] != main[-1]

    # the changed layer's bytes against what the new opencv occupies once installed
    sizes = [h["Size"] for h in bumped_history(bumped["ref"])]
    assert sizes[0] == 0   # newest first: the settings, committed without a layer
    changed = sizes[1]
    du = docker("run", "--rm", "--network", "none", bumped["ref"], "sh", "-c",
                "cd /opt/venv/lib/python3.11/site-packages && du -scb cv2 opencv_python_headless* | tail -1").stdout
    installed = int(du.split()[0])
    assert installed > 50e6 and changed <= 1.1 * installed + 10e6, (changed, installed)

    proc = bumped["run"]("verify", "--variant", "cpu")
    assert "PASS  paddle.utils.run_check()" in proc.stdout and "packages match" in proc.stdout
    cv = docker("run", "--rm", "--network", "none", bumped["ref"], "python", "-c", "import cv2; print(cv2.__version__)")
    assert cv.stdout.strip() == "4.11.0"


def cpu_layers() -> list[str]:
    """The cpu image's layers, by name (paddle, visualdl, scipy, opencv-python-headless)."""
    v = matrix.load().get("cpu")
    return [name for name, _ in layers.groups(v, locks.read(v)[0])]


def bumped_history(ref: str) -> list[dict]:
    import docker as sdk
    return sdk.from_env().images.get(ref).history()


def _by_hand_script(cpu_image) -> Path:
    """The by-hand script of the build that made the current image (this run's, or an earlier run's when the
    image was already built)."""
    from fleetbox import settings
    tag = next(t for t in cpu_image["image"].tags if re.fullmatch(r"fleetbox/paddle:cpu-[0-9a-f]{12}", t))
    for plan in sorted(settings.runs_root().glob("build-cpu-*/plan.json"), reverse=True):
        if tag in json.loads(plan.read_text())["tags"] and (plan.parent / "by-hand.sh").exists():
            return plan.parent / "by-hand.sh"
    raise AssertionError(f"no build of {tag} left a by-hand.sh under {settings.runs_root()}")


def test_the_by_hand_commands_make_the_very_same_layers_byte_for_byte(cpu_image):
    """README's by-hand build, run beside ours (LAYERS and IMAGE set): every layer rebuilt from the base has
    the digest of ours (layers are reproducible), and the image's settings are ours."""
    script = _by_hand_script(cpu_image)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LAYERS": "fleetbox-test/by-hand-layers",
           "IMAGE": "fleetbox-test/by-hand:cpu"}
    try:
        proc = subprocess.run(["sh", str(script)], capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ours = cpu_image["image"].attrs["Config"]
        theirs = json.loads(docker("image", "inspect", "fleetbox-test/by-hand:cpu").stdout)[0]
        assert layer_digests("fleetbox-test/by-hand:cpu") == layer_digests(cpu_image["image"].id)
        for k in ("Env", "Cmd", "WorkingDir", "Volumes", "Entrypoint"):
            assert theirs["Config"].get(k) == ours.get(k), k
        # the labels of the build that wrote the script (its revision is the checkout's state then), and ours
        planned = json.loads((script.parent / "plan.json").read_text())["labels"]
        assert planned and planned.items() <= theirs["Config"]["Labels"].items()
        rev = "org.opencontainers.image.revision"
        assert {k: x for k, x in theirs["Config"]["Labels"].items() if k != rev} == \
            {k: x for k, x in ours["Labels"].items() if k != rev}
        # the by-hand layers went where LAYERS said, none to ours
        made = docker("images", "--format", "{{.Repository}}:{{.Tag}}", "fleetbox-test/by-hand-layers").stdout.split()
        assert len(made) == len(cpu_layers())
        left = docker("ps", "-a", "--filter", "name=fleetbox-layer-", "--format", "{{.Names}}").stdout.split()
        assert left == []
    finally:
        tags = docker("images", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
        mine = [t for t in tags if t.startswith(("fleetbox-test/by-hand-layers:", "fleetbox-test/by-hand:"))]
        if mine:
            docker("rmi", *mine, check=False)


def test_importing_writes_nothing_every_module_is_compiled_and_current(cpu_image):
    """compileall ran after the sources got their fixed time: no .pyc is stale, so nothing is written at
    import (a stale one would be compiled again in every container, on every start)."""
    ct = docker("create", "--network", "none", cpu_image["image"].id, "python", "-c",
                "import paddle, scipy.linalg, scipy.sparse, cv2, numpy, httpx").stdout.strip()
    try:
        _ok(subprocess.run(["docker", "start", "-a", ct], capture_output=True, text=True))
        assert docker("diff", ct).stdout.split() == []
    finally:
        docker("rm", "-f", ct, check=False)


def _commit(parent: str, tag: str) -> None:
    name = "fleetbox-test-commit"
    docker("rm", "-f", name, check=False)
    docker("run", "--name", name, "--network", "none", parent, "sh", "-c", f"echo {tag} > /made-by-test")
    docker("commit", name, tag)
    docker("rm", name)


def _all_tags() -> set[str]:
    return set(without_pushed(docker("images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()))


def test_clean_images_untags_older_builds_and_unused_layers_and_keeps_what_is_used(cpu_image, tmp_path):
    import os

    from fleetbox.image.images import BUILDER
    from fleetbox.processes import process_start, this_host
    v = matrix.load().get("cpu")
    old, held, child = "fleetbox/paddle:cpu-0123456789ab", "fleetbox/paddle:cpu-abcdefabcdef", "fleetbox-test/on-old:1"
    stale, under = "fleetbox/layers:test-000000000002", "fleetbox/layers:test-000000000001"
    chain, parent = set(), cpu_image["image"].id   # the image we built and every image it is built on
    while parent:
        chain.add(parent)
        parent = json.loads(docker("image", "inspect", parent).stdout)[0]["Parent"]
    ours = {t for t in _all_tags() if t.startswith("fleetbox/layers:")
            and json.loads(docker("image", "inspect", t).stdout)[0]["Id"] in chain}
    assert len(ours) == len(cpu_layers())
    try:
        _commit(v.base_ref, old)            # an older build of cpu: no alias points to it
        _commit(v.base_ref, held)           # an older build a data image is baked on
        _commit(held, child)
        _commit(v.base_ref, under)          # layers no image is built on, one on the other
        _commit(under, stale)
        # a killed build's layer container (stopped), and a running one (another build, live)
        docker("create", "--name", "fleetbox-layer-test-killed", "--network", "none", v.base_ref, "true")
        docker("run", "-d", "--name", "fleetbox-layer-test-live", "--network", "none", v.base_ref, "sleep", "300")
        # staging containers, stopped, with their volumes: a killed build's, and a live build's (this process)
        for name, builder in (("fleetbox-layer-stage-test-dead", f"{this_host()} 999999999 1"),
                              ("fleetbox-layer-stage-test-busy",
                               f"{this_host()} {os.getpid()} {process_start(os.getpid())}")):
            docker("volume", "create", name)
            docker("create", "--name", name, "--label", f"{BUILDER}={builder}", "--network", "none",
                   "--mount", f"type=volume,src={name},dst=/dev/fleetbox-stage", v.base_ref, "true")
        before = _all_tags()
        # from a runs folder of its own: the sweep of finished jobs' containers that comes first is the docker
        # group's to test, and leaves another runs folder's containers alone
        proc = _ok(invoke("clean", "--images", env={"FLEETBOX_RUNS": str(tmp_path / "runs")}))
        after = _all_tags()
        gone = before - after
        assert {old, stale, under} <= gone and not after - before
        assert {held, child, *cpu_image["image"].tags, v.base_ref} <= after
        assert ours <= after   # the layers of the image we built stay
        layers_gone = len([t for t in gone if t.startswith("fleetbox/layers:")])
        assert f"untagged {len(gone) - layers_gone} older build(s) and {layers_gone} unused build layer(s); " \
               "removed 2 container(s) of stopped builds" in proc.stdout, proc.stdout
        assert docker("image", "inspect", old, check=False).returncode != 0
        names = docker("ps", "-a", "--format", "{{.Names}}").stdout.split()
        assert "fleetbox-layer-test-live" in names and "fleetbox-layer-test-killed" not in names
        assert "fleetbox-layer-stage-test-busy" in names and "fleetbox-layer-stage-test-dead" not in names
        volumes = docker("volume", "ls", "-q", "--filter", "name=fleetbox-layer-stage-test-").stdout.split()
        assert volumes == ["fleetbox-layer-stage-test-busy"]
    finally:
        docker("rm", "-f", "fleetbox-layer-test-killed", "fleetbox-layer-test-live", "fleetbox-layer-stage-test-dead",
               "fleetbox-layer-stage-test-busy", check=False)
        docker("volume", "rm", "-f", "fleetbox-layer-stage-test-dead", "fleetbox-layer-stage-test-busy", check=False)
        left = [t for t in (old, held, child, stale, under) if t in _all_tags()]
        if left:
            docker("rmi", *left, check=False)


def test_settings_with_dollar_backslash_and_non_ascii_arrive_in_the_image_as_written(cpu_image):
    from fleetbox.image import layers
    v = matrix.load().get("cpu")
    value = "cost $HOME \\ naïve ${X:-y} 'q' \"dq\""
    change = layers.changes(v, [], {"io.fleetbox.test": value})
    ct = docker("create", "--network", "none", v.base_ref, "true").stdout.strip()
    tag = "fleetbox-test/settings:1"
    try:
        docker("commit", *[a for c in change for a in ("--change", c)], ct, tag)
        config = json.loads(docker("image", "inspect", tag).stdout)[0]["Config"]
        assert config["Labels"]["io.fleetbox.test"] == value
        assert "FLEETBOX_VARIANT=cpu" in config["Env"] and config["WorkingDir"] == "/workspace"
    finally:
        docker("rm", "-f", ct, check=False)
        docker("rmi", tag, check=False)


def test_sigterm_during_a_layer_stops_the_build_removes_its_container_and_tags_nothing(cpu_image):
    """A scheduler's SIGTERM mid-layer: the same way out as Ctrl-C (exit 130, one line), the layer's container
    and the container staging the later layers beside it gone with its volume, and no tag moved: the image and
    every layer tag are what they were."""
    import os
    import signal
    import sys
    import time

    from tests.conftest import ROOT
    before = {t: json.loads(docker("image", "inspect", t).stdout)[0]["Id"]
              for t in _all_tags() if t.startswith(("fleetbox/paddle:", "fleetbox/layers:"))}
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "build", "--variant", "cpu", "--force"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(docker("ps", "--filter", "name=fleetbox-layer-", "--format", "{{.Names}}").stdout.split()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        live = docker("ps", "--filter", "name=fleetbox-layer-", "--format", "{{.Names}}").stdout.split()
        assert sorted(n.rsplit("-", 1)[0] for n in live) == ["fleetbox-layer-paddle", "fleetbox-layer-stage"], live
        time.sleep(2)   # pip is installing
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and err.strip() == "fleetbox: interrupted", (proc.returncode, err[-2000:])
    assert docker("ps", "-a", "--filter", "name=fleetbox-layer-", "--format", "{{.Names}}").stdout.split() == []
    assert docker("volume", "ls", "-q", "--filter", "name=fleetbox-layer-").stdout.split() == []
    after = {t: json.loads(docker("image", "inspect", t).stdout)[0]["Id"]
             for t in _all_tags() if t.startswith(("fleetbox/paddle:", "fleetbox/layers:"))}
    assert after == before


def test_a_build_on_a_reused_paddle_layer_stages_the_later_layers_from_it_into_the_very_same_bytes(cpu_image,
                                                                                                  tmp_path):
    """scipy's and opencv's layers made again on reused ones (Paddle's, VisualDL's), as after a change to scipy's
    pin: scipy installs in place on VisualDL's layer while opencv is installed beside it, from that same image (its venv
    there already), then copied in; every layer has the digest the cold build gave it. Built in a copy of the
    checkout whose images have another name (tests/checkout.py, no pin changed), so the checkout's image keeps
    its tags; the two layer tags are made again, as they were."""
    from fleetbox.image import wheelhouse
    from tests.checkout import OPENCV_NOW, copy_with_pin, planned_layers, tags
    from tests.conftest import ROOT
    v = matrix.load().get("cpu")
    env = copy_with_pin(ROOT, tmp_path, "fleetbox-test/restaged", wheelhouse.default_dir(v), OPENCV_NOW, OPENCV_NOW)
    env["FLEETBOX_WHEELHOUSE"] = str(wheelhouse.default_dir(v).parent)   # the same lock: the checkout's wheels
    mine = sorted(t for t in planned_layers(ROOT) if t.startswith(("fleetbox/layers:scipy-",
                                                                    "fleetbox/layers:opencv-python-headless-")))
    assert len(mine) == 2, mine
    had = {t: _image_id(t) for t in mine if t in tags("fleetbox/layers")}   # the checkout image's parents
    if had:
        docker("rmi", "--no-prune", *had)   # untagged, kept (the checkout's image is built on them)
    try:
        proc = _ok(invoke("build", "--variant", "cpu", env=env, cwd=tmp_path / "src"))
        out = proc.stdout
        assert re.findall(r"^layer (\S+)\s+reused", out, re.M) == ["paddle", "visualdl"], out
        assert re.findall(r"^layer (\S+)\s+[\d.]+ MiB in\s+[\d.]+ s(.*)$", out, re.M) == [
            ("scipy", ""), ("opencv-python-headless", " (installed beside scipy)")], out
        assert layer_digests("fleetbox-test/restaged:cpu") == layer_digests(cpu_image["image"].id)
        assert docker("volume", "ls", "-q", "--filter", "name=fleetbox-layer-").stdout.split() == []
    finally:   # the tags back on the checkout image's parents, as the other tests expect them; ours removed,
        # also a layer made before a later one failed
        if tags("fleetbox-test/restaged"):
            docker("rmi", *tags("fleetbox-test/restaged"), check=False)
        made = {t: _image_id(t) for t in mine if t in tags("fleetbox/layers")}
        for t, image_id in had.items():
            docker("tag", image_id, t)
        ours = [i for t, i in made.items() if i != had.get(t)]
        if ours:
            docker("rmi", *ours, check=False)


def test_a_build_whose_layers_all_exist_commits_only_the_settings_onto_the_last_one(cpu_image, tmp_path):
    """Only the image is missing (a copy of the checkout whose images have another name, as a change of labels
    alone leaves it): every layer is reused and the settings are committed onto the last one, so the image has
    the very same layers, its own settings, and nothing is left behind."""
    from fleetbox import settings
    from fleetbox.image import wheelhouse
    from tests.checkout import OPENCV_NOW, copy_with_pin, tags
    from tests.conftest import ROOT
    v = matrix.load().get("cpu")
    env = copy_with_pin(ROOT, tmp_path, "fleetbox-test/settings-only", wheelhouse.default_dir(v), OPENCV_NOW,
                        OPENCV_NOW)
    env["FLEETBOX_WHEELHOUSE"] = str(wheelhouse.default_dir(v).parent)   # the same lock: the checkout's wheels
    try:
        out = _ok(invoke("build", "--variant", "cpu", env=env, cwd=tmp_path / "src")).stdout
        assert re.findall(r"^layer (\S+)\s+reused", out, re.M) == cpu_layers(), out
        assert not re.findall(r"^layer \S+\s+[\d.]+ MiB in", out, re.M), out
        assert layer_digests("fleetbox-test/settings-only:cpu") == layer_digests(cpu_image["image"].id)
        mine = json.loads(docker("image", "inspect", "fleetbox-test/settings-only:cpu").stdout)[0]["Config"]
        ours = cpu_image["image"].attrs["Config"]
        assert mine["Env"] == ours["Env"] and mine["WorkingDir"] == ours["WorkingDir"] == settings.WORKDIR
        assert mine["Labels"][settings.LABEL_FREEZE] == ours["Labels"][settings.LABEL_FREEZE]
        assert docker("ps", "-a", "--filter", "name=fleetbox-layer-", "--format", "{{.Names}}").stdout.split() == []
    finally:
        if tags("fleetbox-test/settings-only"):
            docker("rmi", *tags("fleetbox-test/settings-only"), check=False)


def _image_id(ref: str) -> str:
    return json.loads(docker("image", "inspect", ref).stdout)[0]["Id"]


def test_the_last_staged_layer_empties_the_stage_while_it_writes_the_freeze(cpu_image):
    """layers.copy_script(last=True) with two layers staged: the last one arrives and the freeze names it, and the
    stage is left empty (the earlier layer's folder too), so the build's removal of the volume has nothing to
    delete."""
    from fleetbox.image import layers
    site, vol = "/opt/venv/lib/python3.11/site-packages", "fleetbox-test-stage-last"
    try:
        docker("volume", "create", vol)
        mount = f"type=volume,src={vol},dst={layers.STAGE}"
        docker("run", "--rm", "--network", "none", "--mount", mount, cpu_image["image"].id, "sh", "-c",
               f"for i in 1 2; do d={layers.STAGE}/$i{site}; mkdir -p $d/pkg$i/sub $d/pkg$i-1.0.dist-info; "
               f"echo x > $d/pkg$i/sub/m.py; printf 'Metadata-Version: 2.1\\nName: pkg%s\\nVersion: 1.0\\n' $i "
               f"> $d/pkg$i-1.0.dist-info/METADATA; done")
        out = docker("run", "--rm", "--network", "none", "--mount", mount, cpu_image["image"].id, "sh", "-c",
                     f"{{ {layers.copy_script(last=True)}; }} > /dev/null; ls -A {layers.STAGE}; echo --; "
                     f"cat {site}/pkg2/sub/m.py; grep -c '^pkg2==1.0$' {layers.FREEZE}", "sh", "2").stdout.split()
        assert out == ["--", "x", "1"], out
    finally:
        docker("volume", "rm", "-f", vol, check=False)


def test_a_staged_layer_is_copied_in_as_installing_it_there_would(cpu_image):
    """layers.copy_script on an image whose site-packages folder has its own mode and owner (as a vendor's base
    may have a folder) and a file the layer writes over: the folder keeps its mode and owner and gets the fixed
    time (it has a new entry, as pip adding there and the settle after leave it); what the layer adds arrives
    whole with its own mode, owner and fixed time; the file written over holds the layer's bytes."""
    from fleetbox.image import layers
    v = matrix.load().get("cpu")
    site, vol, img, ct = "/opt/venv/lib/python3.11/site-packages", "fleetbox-test-stage", "fleetbox-test/odd:1", \
        "fleetbox-test-odd"
    try:
        docker("run", "--name", ct, "--network", "none", v.base_ref, "sh", "-c",
               f"mkdir -p {site} && chmod 700 {site} && chown 1000:1000 {site} && echo old > {site}/shared.py")
        docker("commit", ct, img)
        docker("volume", "create", vol)
        staged = f"{layers.STAGE}/1{site}"   # as stage_script leaves a layer: every path with the fixed time
        docker("run", "--rm", "--network", "none", "--mount", f"type=volume,src={vol},dst={layers.STAGE}",
               v.base_ref, "sh", "-c", f"mkdir -p {staged}/newpkg && echo new > {staged}/newpkg/__init__.py && "
               f"echo mine > {staged}/shared.py && find {layers.STAGE}/1 -exec touch -h -d @{layers.EPOCH} {{}} +")
        out = docker("run", "--rm", "--network", "none", "--mount",
                     f"type=volume,src={vol},dst={layers.STAGE},readonly", img, "sh", "-c",
                     f"{{ {layers.copy_script(last=False)}; }} > /dev/null; cd {site} && "
                     "stat -c '%n %a %u %Y' . newpkg newpkg/__init__.py shared.py && cat shared.py", "sh",
                     "1").stdout.splitlines()
        e = layers.EPOCH
        assert out == [f". 700 1000 {e}", f"newpkg 755 0 {e}", f"newpkg/__init__.py 644 0 {e}",
                       f"shared.py 644 0 {e}", "mine"], out
    finally:
        docker("rm", "-f", ct, check=False)
        docker("rmi", img, check=False)
        docker("volume", "rm", "-f", vol, check=False)
