"""Which image each Slurm runtime runs: exactly what was exported or pushed of the build here (its content hash in
the export's name and in its record), a user's --image in the runtime's own form, and never a name that only a
public registry could answer; else one line naming the command that makes one."""
import os
import shutil
import subprocess
import sys

import pytest

from fleetbox import ROOT
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import runtimes, slurm
from fleetbox.settings import FREEZE
from fleetbox.ship import exports, shipped
from tests.unit.conftest import REGISTRY, SHIPPED_HASH, run_node

CPU = matrix.load().get("cpu")
OLD, NEW = f"fleetbox/paddle:cpu-{'0' * 12}", f"fleetbox/paddle:cpu-{'1' * 12}"
IMAGED = [r for r in runtimes.RUNTIMES if runtimes.RUNTIMES[r].has_image]


def plan(runtime, tmp_path, monkeypatch, image=""):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    spec = spec_mod.JobSpec(variant=CPU, nodes=2, job_id="train-img-1", port=29555, image=image)
    return slurm.SlurmBackend(runtime).plan(spec)


def export(kind, tag, folder):
    """An export file (or folder) of build `tag`, named as `invoke export` names it, and its record."""
    fmt, squash = exports.KINDS[kind]
    path = exports.export_path(CPU, fmt, squash, folder, exports.content_part(CPU, tag))
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "charliecloud":   # the image's folder: its packages' freeze file in it
        freeze = path / FREEZE.lstrip("/")
        freeze.parent.mkdir(parents=True)
        freeze.write_text(f"paddlepaddle==3.3.1  # {tag}\n")
    else:
        path.write_bytes(b"image")
    shipped.record(CPU, kind, tag, str(path))
    return path


@pytest.mark.parametrize("runtime", IMAGED)
@pytest.mark.parametrize("built", [None, NEW])
def test_with_nothing_shipped_no_runtime_renders_an_image_and_the_line_names_the_command(
        runtime, built, shipped_here, tmp_path, monkeypatch):
    shipped_here.clear()
    shipped_here.built = built
    with pytest.raises(UserError) as e:
        plan(runtime, tmp_path, monkeypatch)
    said = str(e.value)
    assert "\n" not in said
    want = {"apptainer": ["invoke export --variant cpu --format sif", "invoke push --variant cpu"],
            "singularity": ["invoke export --variant cpu --format sif", "invoke push --variant cpu"],
            "pyxis": ["invoke export --variant cpu --format sqsh", "invoke push --variant cpu"],
            "charliecloud": ["invoke export --variant cpu --format charliecloud --squash",
                             "invoke export --variant cpu --format charliecloud`"],
            "podman": ["invoke push --variant cpu --registry"], "docker": ["invoke push --variant cpu --registry"]}
    assert all(w in said for w in want[runtime]), said
    assert (NEW in said) == bool(built) and ("invoke build --variant cpu" in said) == (not built), said


@pytest.mark.parametrize("runtime, kind", [("apptainer", "sif"), ("pyxis", "sqsh"), ("charliecloud", "charliecloud"),
                                           ("charliecloud", "charliecloud-squash")])
def test_an_export_of_an_earlier_build_is_never_run_after_a_rebuild(runtime, kind, shipped_here, tmp_path,
                                                                    monkeypatch):
    shipped_here.clear()
    old = export(kind, OLD, tmp_path / "elsewhere")   # --dest elsewhere: found through its record
    shipped_here.built = OLD
    p = plan(runtime, tmp_path, monkeypatch)
    assert p.image == str(old) and OLD.rsplit("-", 1)[1] in old.name and p.image_why == f"{kind} of {OLD}"
    assert f"IMAGE_REF={old}" in dict(p.files)["node.sh"] or f"--container-image={old}" in dict(p.files)["job.sbatch"] \
        or f" {old} " in dict(p.files)["node.sh"]
    shipped_here.built = NEW   # rebuilt here: the old export is of another build
    with pytest.raises(UserError, match=f"has no image of {NEW} .*; {OLD}: shipped of another build"):
        plan(runtime, tmp_path, monkeypatch)
    new = export(kind, NEW, tmp_path / "exports-new")
    assert plan(runtime, tmp_path, monkeypatch).image == str(new)


def test_an_export_replaced_or_removed_since_its_record_is_not_run(shipped_here, tmp_path, monkeypatch):
    shipped_here.clear()
    sif = export("sif", NEW, tmp_path / "e")
    shipped_here.built = NEW
    assert plan("apptainer", tmp_path, monkeypatch).image == str(sif)
    sif.write_bytes(b"another image")   # overwritten by hand (or by another tool): not the export recorded
    with pytest.raises(UserError, match="apptainer has no image of"):
        plan("apptainer", tmp_path, monkeypatch)
    export("sif", NEW, tmp_path / "e")
    sif.unlink()
    with pytest.raises(UserError, match="apptainer has no image of"):
        plan("apptainer", tmp_path, monkeypatch)


def test_a_folder_export_counts_only_while_it_holds_the_image_it_was_made_of(shipped_here, tmp_path, monkeypatch):
    shipped_here.clear()
    folder = export("charliecloud", NEW, tmp_path / "e")
    shipped_here.built = NEW
    assert plan("charliecloud", tmp_path, monkeypatch).image == str(folder)
    freeze = folder / FREEZE.lstrip("/")
    freeze.write_text("paddlepaddle==2.6.2\n")   # another image unpacked there since
    with pytest.raises(UserError, match="charliecloud has no image of"):
        plan("charliecloud", tmp_path, monkeypatch)
    export("charliecloud", NEW, tmp_path / "f")
    shutil.rmtree(tmp_path / "f" / folder.name / "opt")   # emptied: the folder alone is no image
    with pytest.raises(UserError, match="charliecloud has no image of"):
        plan("charliecloud", tmp_path, monkeypatch)


@pytest.mark.parametrize("damage", [{"made": "yesterday"}, {"size": "5"}, {"where": None}, {"mtime_ns": 1.5}])
def test_a_record_with_a_field_of_another_type_is_skipped_as_damaged(shipped_here, tmp_path, monkeypatch, damage):
    """Its docstring said so; a field of the wrong type raised TypeError in `train` instead."""
    import json
    shipped_here.clear()
    sif = export("sif", NEW, tmp_path / "e")
    shipped_here.built = NEW
    (rec,) = shipped.records_dir().glob("cpu-sif-*.json")
    good = json.loads(rec.read_text())
    rec.write_text(json.dumps({**good, **damage}))
    assert shipped.load(CPU) == []
    rec.write_text(json.dumps(good))
    assert [s.where for s in shipped.load(CPU)] == [str(sif)]


def test_a_push_is_run_in_each_runtimes_own_syntax_and_a_file_is_preferred(shipped_here, tmp_path, monkeypatch):
    shipped_here.clear()
    shipped_here.built = NEW
    ref = "10.1.2.3:5000/lab/paddle:cpu-" + "1" * 12
    shipped.record(CPU, shipped.REGISTRY, NEW, ref)
    got = {r: plan(r, tmp_path, monkeypatch).image for r in ("apptainer", "pyxis", "podman", "docker")}
    assert got == {"apptainer": f"docker://{ref}", "pyxis": "10.1.2.3:5000#lab/paddle:cpu-" + "1" * 12,
                   "podman": ref, "docker": ref}
    with pytest.raises(UserError, match="charliecloud has no image of"):   # ch-run runs no registry reference
        plan("charliecloud", tmp_path, monkeypatch)
    sif = export("sif", NEW, tmp_path / "e")   # on the shared file system: no pull on every node
    assert plan("apptainer", tmp_path, monkeypatch).image == str(sif)
    node = dict(plan("podman", tmp_path, monkeypatch).files)["node.sh"]
    assert f" {ref} python " in node and "--pull=never" not in node   # a registry: pulled where missing


def test_without_an_engine_here_the_newest_shipped_build_is_run_and_said(shipped_here, tmp_path, monkeypatch):
    shipped_here.clear()
    export("sif", OLD, tmp_path / "a")
    new = export("sif", NEW, tmp_path / "b")
    p = plan("apptainer", tmp_path, monkeypatch)
    assert p.image == str(new) and "no cpu image is built here: the newest build shipped" in p.image_why
    assert slurm.SlurmBackend("apptainer").describe(p).startswith(f"# image: {new} (sif of {NEW} (no cpu image")


@pytest.mark.parametrize("runtime, given, said", [
    ("apptainer", "host:5000/ns/paddle:cpu", "(docker://host:5000/ns/paddle:cpu for a registry image)"),
    ("apptainer", "docker://fleetbox/paddle:cpu", "names no registry, so apptainer would pull it from Docker Hub"),
    ("apptainer", "missing.sif", "apptainer runs an existing SIF file or sandbox folder"),
    ("pyxis", "host:5000/ns/paddle:cpu", "write host:5000#ns/paddle:cpu"),
    ("pyxis", "fleetbox/paddle:cpu", "write REGISTRY#fleetbox/paddle:cpu"),
    ("pyxis", "/shared/missing.sqsh", "no such squashfs file here"),
    ("charliecloud", "fleetbox/paddle:cpu", "charliecloud runs an image folder or a squashfs file"),
    ("podman", "docker://host:5000/x:1", "podman takes an image reference"),
])
def test_a_users_image_in_another_runtimes_form_is_one_line(runtime, given, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        plan(runtime, tmp_path, monkeypatch, image=given)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_users_image_in_the_runtimes_form_is_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.sif").write_bytes(b"x")
    (tmp_path / "tree").mkdir()
    cases = {("apptainer", "my.sif"): str(tmp_path / "my.sif"),   # absolute: node.sh runs in the script's folder
             ("apptainer", "docker://host:5000/ns/p:1"): "docker://host:5000/ns/p:1",
             ("apptainer", "docker://docker.io/library/x:1"): "docker://docker.io/library/x:1",
             ("pyxis", "my.sif"): str(tmp_path / "my.sif"), ("pyxis", "host:5000#ns/p:1"): "host:5000#ns/p:1",
             ("charliecloud", "tree"): str(tmp_path / "tree"),
             ("podman", "fleetbox/paddle:cpu"): "fleetbox/paddle:cpu",
             ("docker", "host:5000/ns/p:1"): "host:5000/ns/p:1"}
    for (runtime, given), want in cases.items():
        p = plan(runtime, tmp_path, monkeypatch, image=given)
        assert (p.image, p.image_why) == (want, "--image"), (runtime, given)


@pytest.mark.parametrize("runtime", ["podman", "docker"])
def test_an_engine_never_pulls_a_name_that_names_no_registry(runtime, stubs, tmp_path, monkeypatch):
    for image, local in (("fleetbox/paddle:cpu", True), ("sha256:" + "ab" * 32, True), ("ubuntu", True),
                         ("localhost/fleetbox/paddle:cpu", False), ("reg.example.org/f/p:cpu", False)):
        node = dict(plan(runtime, tmp_path, monkeypatch, image=image).files)["node.sh"]
        proc, calls = run_node(node, stubs, tmp_path)
        assert proc.returncode == 0, proc.stderr
        (call,) = [c for c in calls if c["tool"] == runtime]
        argv = call["argv"]
        assert ("--pull=never" in argv[:argv.index(image)]) == local, (image, argv)


@pytest.mark.parametrize("runtime", ["podman", "docker"])
def test_doctor_reads_an_engine_image_not_yet_pulled_as_a_reference_and_a_missing_local_one_as_missing(
        runtime, stubs, tmp_path):
    (stubs / runtime).write_text("#!/bin/sh\necho 'Error: no such image' >&2\nexit 125\n")   # inspect finds none
    for image, said, rc in (("reg.example.org/f/p:cpu", "fleetbox: image ref reg.example.org/f/p:cpu\n", 0),
                            ("fleetbox/paddle:cpu", "fleetbox: image missing Error: no such image\n", 3)):
        text = f"IMAGE_REF={image}\n{runtimes.get(runtime).identify(image)}\n"
        proc = subprocess.run(["bash", "-c", text], capture_output=True, text=True,
                              env={**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"})
        assert (proc.stdout, proc.returncode) == (said, rc), proc.stderr


def test_the_unit_tests_ship_every_runtimes_kind(tmp_path, monkeypatch):
    """What the other unit tests plan against (conftest.shipped_here): each runtime finds the cpu build shipped."""
    assert plan("charliecloud", tmp_path, monkeypatch).image.endswith(f"-{SHIPPED_HASH}.sqfs")
    assert plan("podman", tmp_path, monkeypatch).image == f"{REGISTRY}/paddle:cpu-{SHIPPED_HASH}"


def test_a_dry_run_on_a_login_node_with_nothing_shipped_ends_in_one_line(tmp_path):
    """As a user would: no engine answers here, no export or push: the dry-run names what makes an image."""
    env = {**os.environ, "FLEETBOX_EXPORTS": str(tmp_path / "none"), "FLEETBOX_RUNS": str(tmp_path / "runs"),
           "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"}
    proc = subprocess.run([sys.executable, "-m", "invoke", "train", "--backend", "slurm", "--runtime", "apptainer",
                           "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "fleetbox: error: apptainer has no cpu image: none is built here and none was shipped for it; run `invoke "
        "build --variant cpu`, then `invoke export --variant cpu --format sif` or `invoke push --variant cpu "
        "--registry HOST[:PORT]/NS`; or give --image"]
