"""Real Docker Engine, real Paddle: bootstrap base -> hermetic build -> verify -> no-op rebuild."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, invoke
from tests.integration.conftest import without_pushed
from tests.unit.test_cli import one_line_error

pytestmark = pytest.mark.images   # builds, verifies, compares the default engine's images (tests/conftest.py)


def docker(*args):
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600)


def test_base_is_ours_and_runs_python(cpu_image):
    from fleetbox.image import matrix
    v = matrix.load().get("cpu")
    info = json.loads(docker("image", "inspect", v.base_ref).stdout)[0]
    assert info["Config"]["Labels"]["io.fleetbox.base"] == "bookworm"
    assert info["Config"]["Labels"]["io.fleetbox.base.method"] in ("debootstrap", "os-image")
    out = docker("run", "--rm", "--network", "none", v.base_ref, "python3", "-c", "import sys; print(sys.version)")
    assert out.returncode == 0 and out.stdout.startswith("3.11"), out.stderr


def test_verify_passes_and_writes_a_report(cpu_image, tmp_path):
    report_path = tmp_path / "report.json"
    # the statement signed with a site's SSH key (an up-to-date build signs it), verify given the public key
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "site")], check=True)
    proc = invoke("build", "--variant", "cpu", "--sign-key", str(tmp_path / "site"))
    assert proc.returncode == 0 and "signed the provenance statement with" in proc.stdout, proc.stdout + proc.stderr
    proc = invoke("verify", "--variant", "cpu", "--json-out", str(report_path), "--trusted-keys",
                  str(tmp_path / "site.pub"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    checks = {c["check"]: c for c in report["checks"]}
    assert report["ok"] and all(c["ok"] for c in report["checks"])
    assert checks["import paddle"]["detail"].startswith("paddle 3.3.1")
    assert checks["compiled device"]["detail"] == "cpu"
    assert "installed successfully" in checks["paddle.utils.run_check()"]["detail"]
    assert checks["import scipy"]["detail"].startswith("scipy ") and checks["import cv2"]["detail"].startswith("opencv")
    assert checks["VisualDL's LogWriter"]["detail"] == "visualdl 2.5.3"
    assert "packages match" in checks["installed == lock"]["detail"]
    # held to its receipts: every Python package's files as its RECORD hashes them, the Debian ones from dpkg's
    # database, the statement of this very image
    assert re.fullmatch(r"\d+ packages as the SBOM says, \d{4,} files as their RECORDs hash them",
                        checks["SBOM: Python"]["detail"]), checks["SBOM: Python"]
    assert re.match(r"CycloneDX 1.6, \d{2,} Debian packages as it says", checks["SBOM"]["detail"]), checks["SBOM"]
    assert checks["provenance"]["detail"] == f"in-toto statement (SLSA provenance v1) of {cpu_image['image'].id[:19]}"
    assert re.fullmatch(r"signed by fleetbox \(SHA256:\S+\), naming this SBOM", checks["signature"]["detail"])
    assert "PASS  paddle.utils.run_check()" in proc.stdout
    assert os.path.exists(report["path"])   # the run keeps its own copy under runs/


def test_a_hang_up_during_verify_removes_its_container(cpu_image):
    """SIGHUP (a dropped SSH connection) while the probe runs: the container goes, as on Ctrl-C."""
    p = subprocess.Popen([sys.executable, "-m", "invoke", "verify", "--variant", "cpu"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not docker("ps", "-q", "--filter", "label=io.fleetbox.role=verify").stdout.split():
        assert time.monotonic() < deadline and p.poll() is None, p.communicate()
        time.sleep(0.1)
    p.send_signal(signal.SIGHUP)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "fleetbox: interrupted", out + err
    assert docker("ps", "-aq", "--filter", "label=io.fleetbox.role=verify").stdout.split() == []


def test_second_build_is_a_no_op(cpu_image):
    before = cpu_image["image"].id
    proc = invoke("build", "--variant", "cpu")
    assert proc.returncode == 0, proc.stderr
    assert "is up to date" in proc.stdout and "Step " not in proc.stdout
    after = json.loads(docker("image", "inspect", "fleetbox/paddle:cpu").stdout)[0]["Id"]
    assert after == before


def test_final_image_has_no_wheels_no_pip_cache_and_little_overhead(cpu_image):
    image = cpu_image["image"]
    find = docker("run", "--rm", "--network", "none", image.id, "sh", "-c",
                  "find / -xdev \\( -name '*.whl' -o -path '*/.cache/pip' -o -path /wheels \\) -print 2>/dev/null;"
                  "du -sb /opt/venv | cut -f1")
    lines = find.stdout.split()
    assert find.returncode == 0 and len(lines) == 1, f"unexpected files in the image: {lines[:-1]}"
    venv_bytes = int(lines[0])
    labels = image.labels
    base = json.loads(docker("image", "inspect", labels["org.opencontainers.image.base.name"]).stdout)[0]
    assert base["Id"] == labels["org.opencontainers.image.base.digest"]
    ratio = image.attrs["Size"] / (base["Size"] + venv_bytes)
    assert ratio <= 1.05, f"image is {ratio:.2f}x its base + environment"


def files_in_layers(ref: str, wanted) -> list[str]:
    """Every path in every layer of an image (from `docker save`) for which wanted(path) holds, whiteouts
    included: a file added in one layer and deleted in a later one is still shipped in the first."""
    import tarfile
    found = []
    save = subprocess.Popen(["docker", "save", ref], stdout=subprocess.PIPE)
    with tarfile.open(fileobj=save.stdout, mode="r|") as outer:
        for m in outer:
            if not m.isfile():
                continue
            f = outer.extractfile(m)
            try:   # a layer (layer.tar, or a blob in the OCI layout); the manifest and configs are not tars
                layer = tarfile.open(fileobj=f, mode="r|")
                found += [f"{m.name}: {x.name}" for x in layer if wanted(x.name)]
            except tarfile.ReadError:
                continue
    assert save.wait() == 0
    return found


def _wheel_or_pip_cache(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".whl") \
        or "/.cache/pip/" in f"/{path}/" or path.strip("/").split("/")[0] == "wheels"


def test_no_layer_of_the_image_holds_a_wheel(cpu_image, tmp_path):
    assert files_in_layers(cpu_image["image"].id, _wheel_or_pip_cache) == []
    # the check sees what the final filesystem cannot: a wheel copied in and deleted in a later layer
    labels = cpu_image["image"].labels
    (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    (tmp_path / "Dockerfile").write_text(f"FROM {labels['org.opencontainers.image.base.name']}\n"
                                         "COPY x-1.0-py3-none-any.whl /tmp/\nRUN rm /tmp/x-1.0-py3-none-any.whl\n")
    tag = "fleetbox-test/wheel-in-a-layer:1"
    assert docker("build", "--network", "none", "-q", "-t", tag, str(tmp_path)).returncode == 0
    try:
        assert docker("run", "--rm", tag, "sh", "-c", "ls /tmp/*.whl").returncode != 0   # gone from the filesystem
        hits = files_in_layers(tag, _wheel_or_pip_cache)
        assert any(h.endswith("tmp/x-1.0-py3-none-any.whl") for h in hits), hits
    finally:
        docker("rmi", "-f", tag)


def test_the_image_declares_no_volume(cpu_image):
    # a layer's wheelhouse mount must not become a VOLUME of the image (every job would get an empty /mnt)
    assert not cpu_image["image"].attrs["Config"].get("Volumes"), cpu_image["image"].attrs["Config"]


def test_image_carries_provenance(cpu_image):
    labels = cpu_image["image"].labels
    from fleetbox.image import locks, matrix
    v = matrix.load().get("cpu")
    text, entries = locks.read(v)
    assert labels["io.fleetbox.lock-sha256"] == locks.lock_hash(text)
    assert "paddlepaddle==3.3.1" in labels["io.fleetbox.pip-freeze"].split()
    assert labels["io.fleetbox.variant"] == "cpu" and labels["org.opencontainers.image.revision"]
    tags = set(cpu_image["image"].tags)
    assert {"fleetbox/paddle:cpu", "fleetbox/paddle:3.3.1-cpu-py311"} <= tags
    assert any(t.startswith("fleetbox/paddle:cpu-") and len(t) == len("fleetbox/paddle:cpu-") + 12 for t in tags)


def test_the_build_keeps_a_valid_sbom_of_every_locked_package_and_a_statement_of_the_image(cpu_image):
    from fleetbox import settings
    from fleetbox.image import locks, matrix, receipts, wheelhouse
    image = cpu_image["image"]
    v = matrix.load().get("cpu")
    _, entries = locks.read(v)
    kept = receipts.sbom_path(image.labels[settings.LABEL_INPUTS]).read_bytes()
    # in the image, where its label says (its last layer's), the very file kept here
    assert image.labels["io.fleetbox.sbom"] == "/opt/venv/fleetbox-sbom.cdx.json"
    inside = docker("run", "--rm", "--network", "none", image.id, "cat", image.labels["io.fleetbox.sbom"])
    assert inside.stdout.encode() == kept
    doc = receipts.check_sbom(kept.decode())   # its schema
    comps = {c["bom-ref"]: c for c in doc["components"]}
    manifest = json.loads((wheelhouse.default_dir(v) / wheelhouse.MANIFEST).read_text())["files"]
    for e in entries:   # each with the sha256 of the very wheel the wheelhouse holds, one the lock allows
        (h,) = comps[f"pypi:{e.name}"]["hashes"]
        assert comps[f"pypi:{e.name}"]["version"] == e.version and h["content"] in e.hashes
        assert h["content"] in manifest.values()
    debs = docker("run", "--rm", "--network", "none", image.id, "dpkg-query", "-W", "-f", "${Package} ${Version}\n")
    assert {(c["name"], c["version"]) for c in doc["components"] if c["purl"].startswith("pkg:deb/")} == \
        {tuple(ln.split()) for ln in debs.stdout.splitlines()}
    statement = receipts.check_statement(json.loads(receipts.provenance_path(image.id).read_text()))
    assert receipts.subject_digests(statement) == {image.id}
    assert [b["digest"]["sha256"] for b in statement["predicate"]["runDetails"]["byproducts"]] == \
        [d.removeprefix("sha256:") for d in image.attrs["RootFS"]["Layers"]]


def test_tampered_wheelhouse_stops_the_build_and_builds_nothing(cpu_image, tmp_path):
    from fleetbox.image import matrix, wheelhouse
    src = wheelhouse.default_dir(matrix.load().get("cpu"))
    dest = tmp_path / "cpu"
    dest.mkdir()
    for f in src.iterdir():
        os.link(f, dest / f.name) if f.suffix == ".whl" else (dest / f.name).write_bytes(f.read_bytes())
    pip = next(dest.glob("pip-*.whl"))
    pip.unlink()
    pip.write_bytes(b"not the locked pip")
    images_before = _images()
    proc = invoke("build", "--variant", "cpu", "--force", "--wheelhouse", str(dest))
    one_line_error(proc, pip.name, "which lock cpu.lock does not allow")
    assert _images() == images_before


def _images() -> list[str]:
    """Every image with each of its tags, sorted: `docker images` lists images made in the same second (a
    layer and the image's settings committed onto it) in no fixed order."""
    return sorted(without_pushed(docker("images", "-a", "--no-trunc", "--format",
                                        "{{.ID}} {{.Repository}}:{{.Tag}}").stdout.splitlines()))


def test_verify_fails_on_a_broken_image(cpu_image, tmp_path):
    (tmp_path / "Dockerfile").write_text(
        f"FROM {cpu_image['image'].id}\nRUN rm -rf /opt/venv/lib/python3.11/site-packages/cv2 "
        f"/opt/venv/lib/python3.11/site-packages/opencv_python_headless-*.dist-info\n")
    tag = "fleetbox-test/broken:cv2"
    assert docker("build", "--network", "none", "-q", "-t", tag, str(tmp_path)).returncode == 0
    try:
        proc = invoke("verify", "--variant", "cpu", "--image", tag)
        assert proc.returncode == 1
        assert "FAIL  import cv2" in proc.stdout and "PASS  import paddle" in proc.stdout
        # the package gone from the image, named by its SBOM in one line; no statement names the changed image
        assert re.search(r"FAIL +SBOM: Python +RuntimeError: 1 differ from the SBOM: "
                         r"opencv-python-headless==[0-9.]+ is not installed\n", proc.stdout), proc.stdout
        assert re.search(r"PASS +provenance +none of sha256:\w+ here \(it was built elsewhere\)", proc.stdout)
        assert "verify failed for cpu" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        docker("rmi", "-f", tag)


def test_vendor_base_that_cannot_be_had_is_one_clear_error():
    proc = invoke("base", "--variant", "dcu")
    one_line_error(proc, "paddle-dcu:dtk24.04.1-kylinv10-gcc82 is missing", "cannot be bootstrapped", "docker load")
