"""images/cpu.Dockerfile built by another builder, for real: `podman build` (buildah, Debian's package) with the
network off and the wheelhouse as a named build context makes an image that `invoke verify` passes, whose
layers hold the same files as those of `invoke build`'s image (paths, modes, owners, sizes, contents, times, link
targets), but for the paths a builder manages itself, and whose settings (environment, working folder, command,
labels) are the same."""
import hashlib
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from fleetbox.image import images, matrix, wheelhouse
from tests.conftest import invoke

# podman builds; the image is then loaded into the default engine, where verify runs it (tests/conftest.py)
pytestmark = pytest.mark.images

TAG = "localhost/fleetbox-test/dockerfile:cpu"
# What buildah (1.28) itself puts into the layers, whatever the RUN does; `invoke build` has neither:
BUILDER_OWN = {
    "run",       # /run's entry in every RUN layer: buildah mounts its own files (.containerenv) there
    ".wh.mnt",   # the first RUN's layer removes /mnt: buildah removes a RUN --mount's target after the RUN,
                 # also one the base had (the image then has no /mnt; later RUNs make and remove it again)
}
BUILDER_LABELS = {"io.buildah.version"}
BUILD_CONTAINER = {"Hostname", "Image", "AttachStdin", "AttachStdout", "AttachStderr", "Tty", "OpenStdin", "StdinOnce"}


def saved_layers(archive: Path) -> tuple[dict, list[str], list[dict]]:
    """(config, diff IDs, each layer's files {path: (type, mode, uid, gid, size, sha256, mtime, link)}) of a
    `docker save` archive."""
    out = []
    with tarfile.open(archive) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())[0]
        config = json.loads(tar.extractfile(manifest["Config"]).read())
        for name in manifest["Layers"]:
            files = {}
            with tarfile.open(fileobj=tar.extractfile(name)) as layer:
                for m in layer:
                    digest = hashlib.sha256(layer.extractfile(m).read()).hexdigest() if m.isfile() else ""
                    files[m.name.rstrip("/").removeprefix("./")] = (m.type, m.mode, m.uid, m.gid, m.size, digest,
                                                                     m.mtime, m.linkname)
            out.append(files)
    return config, config["rootfs"]["diff_ids"], out


@pytest.fixture
def podman_built(cpu_image, tmp_path):
    v = matrix.load().get("cpu")
    labels = cpu_image["image"].labels
    had_base = subprocess.run(["podman", "image", "exists", v.base_ref]).returncode == 0
    save = subprocess.Popen(["docker", "save", v.base_ref], stdout=subprocess.PIPE)   # the same base, by ID
    try:
        subprocess.run(["podman", "load", "-q"], stdin=save.stdout, check=True, capture_output=True)
    finally:
        save.stdout.close()
        assert save.wait() == 0
    ctx = tmp_path / "context"   # nothing is sent: the wheels come from the named context, bind-mounted
    ctx.mkdir()
    cmd = ["podman", "build", "--format", "docker", "--network", "none", "--pull=never",
           "--build-context", f"wheelhouse={wheelhouse.default_dir(v)}",
           "--build-arg", f"BASE_IMAGE={v.base_ref}",
           *[a for arg, label in (("BASE_DIGEST", "org.opencontainers.image.base.digest"),
                                  ("REVISION", "org.opencontainers.image.revision"),
                                  ("CONTENT_HASH", "io.fleetbox.inputs-sha256"))
             for a in ("--build-arg", f"{arg}={labels[label]}")],
           "-f", str(images.dockerfile_path(v)), "-t", TAG, str(ctx)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        yield tmp_path
    finally:
        for f in tmp_path.glob("*.tar"):   # whole images: 1.3 GB each
            f.unlink()
        subprocess.run(["podman", "rmi", "-f", TAG, *([] if had_base else [v.base_ref])], capture_output=True)
        subprocess.run(["docker", "rmi", "-f", TAG], capture_output=True)
        subprocess.run(["podman", "image", "prune", "-f"], capture_output=True)


def test_podman_builds_the_dockerfile_into_the_same_files_and_settings_and_verify_passes(cpu_image, podman_built):
    d = podman_built
    subprocess.run(["docker", "save", "-o", str(d / "ours.tar"), cpu_image["image"].id], check=True)
    subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(d / "theirs.tar"), TAG], check=True,
                   capture_output=True)
    ours_config, ours_ids, ours = saved_layers(d / "ours.tar")
    theirs_config, theirs_ids, theirs = saved_layers(d / "theirs.tar")
    n = len(images.variant_layers(images.dockerfile_path(matrix.load().get("cpu")).read_text()))
    assert ours_ids[:-n] == theirs_ids[:len(ours_ids) - n], "not the same base"   # the base's layers: the same
    assert len(theirs) == len(ours), (len(theirs), len(ours))   # one layer per RUN, as ours: one per layer
    for k, (mine, other) in enumerate(zip(ours[-n:], theirs[-n:])):
        other = {p: f for p, f in other.items() if p not in BUILDER_OWN}   # ours are compared whole
        assert mine.keys() == other.keys(), (k, sorted(mine.keys() ^ other.keys())[:20])
        differ = [p for p in mine if mine[p] != other[p]]
        assert not differ, (k, [(p, mine[p], other[p]) for p in differ[:5]])
    # the whole of the settings, every field either builder writes: the environment as a mapping (its order is
    # the builder's), an empty field as none; left out, the builder's own label and what describes the container
    # the layer was made in rather than the image (docker commit keeps its Hostname, Image and Attach* fields)
    def settings_of(c):
        c = {k: v for k, v in c.items() if v not in (None, "", [], {}, False) and k not in BUILD_CONTAINER}
        c["Env"] = dict(e.split("=", 1) for e in c.get("Env", []))
        c["Labels"] = {k: v for k, v in c.get("Labels", {}).items() if k not in BUILDER_LABELS}
        return c
    assert settings_of(ours_config["config"]) == settings_of(theirs_config["config"])
    print(f"layer digests: ours {[i[7:19] for i in ours_ids[-n:]]}, podman's {[i[7:19] for i in theirs_ids[-n:]]}")
    # the engine verify uses
    (d / "ours.tar").unlink()
    load = subprocess.run(["docker", "load", "-i", str(d / "theirs.tar")], capture_output=True, text=True)
    assert load.returncode == 0, load.stderr
    proc = invoke("verify", "--image", TAG)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
