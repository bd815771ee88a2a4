"""The fleet training scripts in train/, as 2-node jobs reading seeded caches offline (synthetic data)."""
import json

from tests.conftest import invoke

CACHE = "/root/.cache/paddle/dataset"


def train_report(proc):
    lines = [ln.split("FLEETBOX-TRAIN ", 1)[1] for ln in proc.stdout.splitlines() if "FLEETBOX-TRAIN " in ln]
    assert lines, proc.stdout[-3000:]
    return json.loads(lines[-1])


def test_lenet_mnist_with_fleet_on_two_nodes(cpu_image, seeded_mnist):
    files = {"--train-images": "train-images-idx3-ubyte.gz", "--train-labels": "train-labels-idx1-ubyte.gz",
             "--test-images": "t10k-images-idx3-ubyte.gz", "--test-labels": "t10k-labels-idx1-ubyte.gz"}
    args = " ".join(f"{k} {CACHE}/mnist/{v}" for k, v in files.items()) + " --max-steps 4 --batch-size 32"
    proc = invoke("train", "--nodes", "2", "--script", "train/lenet_mnist.py", "--args", args,
                  "--data-dir", str(seeded_mnist["dest"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    r = train_report(proc)
    assert r["world"] == 2 and r["rank"] == 0 and r["last_loss"] is not None and 0 <= r["test_accuracy"] <= 1


def test_resnet_flowers_with_fleet_shifts_labels(cpu_image, seeded_flowers):
    f = f"{CACHE}/flowers"
    args = (f"--data-file {f}/102flowers.tgz --label-file {f}/imagelabels.mat --setid-file {f}/setid.mat "
            f"--image-size 32 --batch-size 2 --max-steps 1")
    proc = invoke("train", "--nodes", "2", "--script", "train/resnet_flowers.py", "--args", args,
                  "--data-dir", str(seeded_flowers["dest"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    r = train_report(proc)
    assert r["world"] == 2 and r["steps"] == 1 and r["last_loss"] > 0
    assert r["classes"] == [101]   # every training image is Flowers class 102: 0-based, it is 101
