import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import fabric
from tests.conftest import ROOT, invoke, once, shared_dir

# test_hpc's site registry (the slurm group), for which `invoke push` tags the cpu image on the default engine while
# the images group compares that engine's images before and after a build, a clean or a load: its tags are the
# push's, never theirs
SITE_REGISTRY = f"{fabric.SLURM.subnet}.1:5443"


def without_pushed(lines) -> list[str]:
    """`docker images` lines less the site registry's tags."""
    return [ln for ln in lines if f"{SITE_REGISTRY}/" not in ln]


def _engine_up():
    return shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def pytest_collection_modifyitems(config, items):
    if _engine_up():
        return
    skip = pytest.mark.skip(reason="no Docker Engine: run scripts/setup-host.sh (CI requires one)")
    for item in items:
        if "integration" in str(item.fspath) and not item.get_closest_marker("no_docker"):
            if os.environ.get("CI"):
                raise pytest.UsageError("CI=true but no Docker Engine is running: .ci/run must start dockerd")
            item.add_marker(skip)


def _ok(proc):
    assert proc.returncode == 0, f"{proc.args}\nSTDOUT:\n{proc.stdout[-3000:]}\nSTDERR:\n{proc.stderr[-3000:]}"
    return proc


def _images() -> None:
    """The images the tests use, made once in this run as a user makes them (base, wheels, build), both before any
    test uses one: no test sees another's build change the engine's images. .ci/run builds them for real before
    the tests; here the builds are then up to date."""
    def make():
        _ok(invoke("base", "--variant", "cpu"))
        for variant in ("cpu", GPU_VARIANT):   # the GPU image after the cpu one: the same base
            _ok(invoke("wheels", "--variant", variant))
            _ok(invoke("build", "--variant", variant))
    once("images", make)


def _built(variant: str) -> dict:
    _images()
    from fleetbox import engine
    from fleetbox.image import built, matrix
    return {"image": built.resolve(engine.client(), matrix.load().get(variant))}


GPU_VARIANT = "cu118-pypi"   # the GPU image built here (PyPI's paddlepaddle-gpu); its ranks run on CPU here
ON_CPU = ("--variant", GPU_VARIANT, "--gpus-per-node", "0")


@pytest.fixture(scope="session")
def cpu_image():
    """The real path a user takes: base (bootstrapped when no OS image can be had) -> wheels -> build."""
    return _built("cpu")


@pytest.fixture(scope="session")
def cuda_image():
    """The GPU image, built with cpu_image (after it: the same base)."""
    return _built(GPU_VARIANT)


@pytest.fixture(params=["cpu", GPU_VARIANT])
def image_args(request):
    """A test that runs on both images: the train options that choose the image (the GPU one's ranks on CPU)."""
    request.getfixturevalue("cpu_image" if request.param == "cpu" else "cuda_image")
    return () if request.param == "cpu" else ON_CPU


def layer_digests(ref: str) -> list[str]:
    out = subprocess.run(["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", ref],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.fixture(scope="session")
def bumped(cpu_image, tmp_path_factory):
    """A user changing one pin, as the README says, in a copy of this checkout (tests/checkout.py):
    opencv-python-headless 4.12.0.88 -> 4.11.0.86 in images/matrix.toml, then `invoke lock`, `invoke wheels`,
    `invoke build`. The copy's images are fleetbox-test/paddle; only the new opencv wheel is downloaded."""
    from fleetbox.image import matrix, wheelhouse
    from tests.checkout import copy_with_pin, made_since, planned_layers, tags
    tmp = tmp_path_factory.mktemp("bumped")
    env = copy_with_pin(ROOT, tmp, "fleetbox-test/paddle", wheelhouse.default_dir(matrix.load().get("cpu")))

    def run(*args):
        return _ok(invoke(*args, env=env, cwd=tmp / "src"))

    before = set(tags("fleetbox/layers"))
    try:
        run("lock", "--variant", "cpu")
        wheels = run("wheels", "--variant", "cpu")
        # the copy's own image and layers (the changed pin's and after) are made here: a run killed before its
        # teardown may have left them tagged, and reusing them would hide what this build makes
        own = planned_layers(tmp / "src", env) - planned_layers(ROOT)
        leftover = [t for t in tags("fleetbox/layers") if t in own] + tags("fleetbox-test/paddle")
        if leftover:
            subprocess.run(["docker", "rmi", "--no-prune", *leftover], capture_output=True)
        before = set(tags("fleetbox/layers"))
        build = run("build", "--variant", "cpu")
        yield {"src": tmp / "src", "run": run, "build": build, "wheels": wheels, "ref": "fleetbox-test/paddle:cpu"}
    finally:
        made = made_since(before, "fleetbox-test/paddle")
        if made:
            subprocess.run(["docker", "rmi", *made], capture_output=True)


MD5_ATTRS = {"train-images-idx3-ubyte.gz": "TRAIN_IMAGE_MD5", "train-labels-idx1-ubyte.gz": "TRAIN_LABEL_MD5",
             "t10k-images-idx3-ubyte.gz": "TEST_IMAGE_MD5", "t10k-labels-idx1-ubyte.gz": "TEST_LABEL_MD5"}


@pytest.fixture(scope="session")
def seeded_mnist(tmp_path_factory):
    """Synthetic MNIST served over loopback HTTP and seeded with `invoke cache`, as a user would."""
    from tests import mnistgen
    from tests.httpserver import Server
    tmp = tmp_path_factory.mktemp("mnist")
    md5s = mnistgen.write(tmp / "srv")
    with Server(tmp / "srv") as s:
        manifest = mnistgen.manifest(tmp / "datasets.toml", s.url, md5s)
        _ok(invoke("cache", "--datasets", "mnist", "--manifest", str(manifest), "--dest", str(tmp / "cache")))
    return {"dest": tmp / "cache", "manifest": manifest, "md5": {MD5_ATTRS[n]: m for n, m in md5s.items()}}


@pytest.fixture(scope="session")
def seeded_flowers(cpu_image, tmp_path_factory):
    """A tiny Flowers set in Paddle's real formats (made in the image, which has cv2 and scipy), seeded from a
    folder mirror with `invoke cache`, which also unpacks the images as Paddle would."""
    import hashlib

    from tests.conftest import ROOT
    tmp = tmp_path_factory.mktemp("flowers")
    srv = tmp / "srv"
    srv.mkdir()
    subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{srv}:/out",
                    "-v", f"{ROOT / 'tests/probes'}:/probes:ro", cpu_image["image"].id,
                    "python", "/probes/make_flowers.py", "/out"], check=True, capture_output=True)
    names = ("102flowers.tgz", "imagelabels.mat", "setid.mat")
    md5 = {n: hashlib.md5((srv / "flowers" / n).read_bytes()).hexdigest() for n in names}
    manifest = tmp / "datasets.toml"
    manifest.write_text(
        '[datasets.flowers]\nmodule = "flowers"\n'
        'unpack = [{ file = "102flowers.tgz", into = "102flowers", marker = "jpg" }]\nfiles = [\n'
        + ",\n".join(f'  {{ url = "http://origin.invalid/flowers/{n}", md5 = "{m}" }}' for n, m in md5.items())
        + "\n]\n")
    _ok(invoke("cache", "--datasets", "flowers", "--manifest", str(manifest), "--dest", str(tmp / "cache"),
               "--mirror", str(srv)))
    return {"dest": tmp / "cache", "md5_attrs": {"DATA_MD5": md5["102flowers.tgz"],
                                                 "LABEL_MD5": md5["imagelabels.mat"], "SETID_MD5": md5["setid.mat"]}}


def _env(variant: str) -> dict:
    """`invoke venv` of `variant` from its verified wheelhouse (no container, no network), made once in this run
    into a folder every worker shares."""
    def make():
        _ok(invoke("wheels", "--variant", variant))
        dest = shared_dir(f"envs-{variant}")
        proc = _ok(invoke("venv", "--variant", variant, "--dest", str(dest)))
        return {"path": proc.stdout.strip().splitlines()[-1], "dest": str(dest), "stdout": proc.stdout,
                "stderr": proc.stderr}
    made = once(f"env-{variant}", make)
    return {"path": Path(made["path"]), "dest": Path(made["dest"]),
            "proc": subprocess.CompletedProcess([], 0, made["stdout"], made["stderr"])}


@pytest.fixture(scope="session")
def cpu_env():
    """The cpu variant's locked environment as a venv: what a site without containers puts on its shared file
    system."""
    return _env("cpu")


@pytest.fixture(scope="session")
def cuda_env():
    """The GPU variant's env, made as cpu_env is: its NVIDIA libraries, no container, no GPU."""
    return _env(GPU_VARIANT)


def paddle_opens() -> list[str]:
    """The libraries Paddle 2.6 opens by name on CUDA, as verify's probe lists them (importing it runs it)."""
    import ast
    source = (ROOT / "fleetbox" / "incontainer" / "fleetbox_verify_image.py").read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.Assign) and n.targets[0].id == "OPENS")
    return list(ast.literal_eval(node.value)["cuda"])
