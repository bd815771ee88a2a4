"""Seeded caches used by real Paddle loaders inside the cpu image with the network off."""
import json
import subprocess

import pytest

from fleetbox import settings
from fleetbox.data import datasets as ds
from tests.conftest import invoke

pytestmark = pytest.mark.images   # builds, verifies, compares the default engine's images (tests/conftest.py)

LOADER_CONSTANTS = r"""
import inspect, json, re
import paddle.vision.datasets.mnist as m, paddle.vision.datasets.cifar as c
import paddle.vision.datasets.flowers as f, paddle.vision.datasets.voc2012 as v
def module_of(mod):   # the cache folder name the loader passes to Paddle's downloader
    names = set(re.findall(r"_check_exists_and_download\([^)]*?,\s*'([\w-]+)'", inspect.getsource(mod), re.S))
    if not names and hasattr(mod, "CACHE_DIR"):
        names = {mod.CACHE_DIR}
    assert len(names) == 1, names
    return names.pop()
mn = lambda cls: [[cls.NAME, getattr(cls, k + "_URL"), getattr(cls, k + "_MD5")]
                  for k in ("TRAIN_IMAGE", "TRAIN_LABEL", "TEST_IMAGE", "TEST_LABEL")]
print(json.dumps({
  "mnist": mn(m.MNIST), "fashion-mnist": mn(m.FashionMNIST),
  "cifar10": [[module_of(c), c.CIFAR10_URL, c.CIFAR10_MD5]],
  "cifar100": [[module_of(c), c.CIFAR100_URL, c.CIFAR100_MD5]],
  "flowers": [[module_of(f), f.DATA_URL, f.DATA_MD5], [module_of(f), f.LABEL_URL, f.LABEL_MD5],
              [module_of(f), f.SETID_URL, f.SETID_MD5]],
  "voc2012": [[module_of(v), v.VOC_URL, v.VOC_MD5]],
}))
"""

READ_MNIST = r"""
import json, sys
import paddle.vision.datasets as D
from paddle.dataset import common
# The test's synthetic files stand in for the real ones: only their MD5s differ from Paddle's constants.
for k, v in json.loads(sys.argv[1]).items():
    setattr(D.MNIST, k, v)
train, test = D.MNIST(mode="train", backend="cv2"), D.MNIST(mode="test", backend="cv2")
img, label = train[3]
print(json.dumps({"home": common.DATA_HOME, "train": len(train), "test": len(test), "label3": int(label[0]),
                  "shape": list(img.shape)}))
"""

READ_FLOWERS = r"""
import json, sys
import paddle.vision.datasets as D
import paddle.vision.datasets.flowers as F
for k, v in json.loads(sys.argv[1]).items():
    setattr(F, k, v)
train = D.Flowers(mode="train", backend="cv2")
img, label = train[0]
print(json.dumps({"train": len(train), "label0": int(label[0]), "shape": list(img.shape)}))
"""

def run_py(image, code, *args, mounts=()):
    argv = ["docker", "run", "--rm", "--network", "none"]
    for m in mounts:
        argv += ["-v", m]
    proc = subprocess.run(argv + [image, "python", "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_manifest_agrees_with_paddles_own_loaders(cpu_image):
    got = run_py(cpu_image["image"].id, LOADER_CONSTANTS)
    known = ds.load()
    for name, triples in got.items():
        mine = sorted([f.module, f.url, f.md5] for f in known[name].files)
        assert mine == sorted(triples), f"{name}: offline_cache/datasets.toml drifted from paddle's loader"


def test_paddles_mnist_loader_reads_the_seeded_cache_offline_and_read_only(cpu_image, seeded_mnist):
    out = run_py(cpu_image["image"].id, READ_MNIST, json.dumps(seeded_mnist["md5"]),
                 mounts=[f"{seeded_mnist['dest']}:{settings.CONTAINER_CACHE}:ro"])
    assert out == {"home": settings.CONTAINER_CACHE, "train": 600, "test": 100, "label3": 4, "shape": [28, 28]}


def test_flowers_is_unpacked_at_seed_time_so_a_read_only_cache_works(cpu_image, seeded_flowers):
    cache = seeded_flowers["dest"]
    assert (cache / "flowers" / "102flowers" / "jpg" / "image_00001.jpg").exists()
    out = run_py(cpu_image["image"].id, READ_FLOWERS, json.dumps(seeded_flowers["md5_attrs"]),
                 mounts=[f"{cache}:{settings.CONTAINER_CACHE}:ro"])
    assert out == {"train": 6, "label0": 102, "shape": [32, 40, 3]}   # labels stay 1-based: class 102 is 102


def test_build_bakes_seeded_datasets_into_a_thin_image(cpu_image, seeded_mnist):
    env = {"FLEETBOX_DATASETS_MANIFEST": str(seeded_mnist["manifest"]), "FLEETBOX_DATA": str(seeded_mnist["dest"])}
    proc = invoke("build", "--variant", "cpu", "--datasets", "mnist", env=env)
    assert proc.returncode == 0, proc.stderr
    tag = "fleetbox/paddle:cpu-with-mnist"
    inspect = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, text=True)
    assert inspect.returncode == 0, f"{tag} was not made:\n{proc.stdout}"
    image_id = json.loads(inspect.stdout)[0]["Id"]
    try:
        assert "baked" in proc.stdout
        out = run_py(tag, READ_MNIST, json.dumps(seeded_mnist["md5"]))   # no mount: the files are in the image
        assert out["train"] == 600 and out["home"] == settings.CONTAINER_CACHE
        again = invoke("build", "--variant", "cpu", "--datasets", "mnist", env=env)
        assert again.returncode == 0 and "nothing to bake" in again.stdout
        labels = json.loads(subprocess.run(["docker", "image", "inspect", tag], capture_output=True,
                                           text=True).stdout)[0]["Config"]["Labels"]
        assert "mnist/train-images-idx3-ubyte.gz" in labels["io.fleetbox.datasets"]
    finally:
        subprocess.run(["docker", "rmi", "-f", image_id], capture_output=True)


def test_verify_mounts_the_seeded_cache(cpu_image, seeded_mnist):
    proc = invoke("verify", "--variant", "cpu", env={"FLEETBOX_DATA": str(seeded_mnist["dest"])})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mounting the seeded dataset cache" in proc.stdout
    assert "PASS  dataset cache" in proc.stdout and "4 files under /root/.cache/paddle/dataset (mnist)" in proc.stdout
