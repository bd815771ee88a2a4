"""The fleet training scripts in train/, as 2-node jobs reading seeded caches offline (synthetic data)."""
import json
import os
import subprocess
import time

import pytest

from tests.conftest import ROOT, invoke

pytestmark = pytest.mark.docker   # its jobs on the default engine, their containers counted (tests/conftest.py)

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


def _max_difference(image_id, a, b) -> float:
    """The largest absolute difference between two checkpoints' parameters (loaded with Paddle in the image)."""
    code = ("import paddle, numpy as np, sys; a, b = paddle.load('/a'), paddle.load('/b'); "
            "assert a.keys() == b.keys(); "
            "print(max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a))")
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", "-v", f"{a}:/a:ro", "-v", f"{b}:/b:ro",
                          image_id, "python", "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


@pytest.mark.parametrize("script", ["lenet_mnist", "resnet_flowers"])
def test_a_job_run_again_with_its_id_resumes_mid_epoch(cpu_image, seeded_mnist, seeded_flowers, script):
    """Stopped one step before the end of its first epoch (P steps), then run again with the same job id for two
    epochs: it goes on from step P-1 (the first epoch's last batch, not its first) and ends where an
    uninterrupted run ends."""
    if script == "lenet_mnist":
        files = {"--train-images": "train-images-idx3-ubyte.gz", "--train-labels": "train-labels-idx1-ubyte.gz",
                 "--test-images": "t10k-images-idx3-ubyte.gz", "--test-labels": "t10k-labels-idx1-ubyte.gz"}
        args = " ".join(f"{k} {CACHE}/mnist/{v}" for k, v in files.items()) + " --batch-size 32 --max-steps 4"
        data, per_epoch = seeded_mnist["dest"], 4
    else:   # 6 training images, 3 per rank
        f = f"{CACHE}/flowers"
        args = (f"--data-file {f}/102flowers.tgz --label-file {f}/imagelabels.mat --setid-file {f}/setid.mat "
                f"--image-size 32 --batch-size 1")
        data, per_epoch = seeded_flowers["dest"], 3
    tag = f"{script}-{os.getpid()}-{time.monotonic_ns()}"

    def train(job, more):
        proc = invoke("train", "--nodes", "2", "--script", f"train/{script}.py", "--args", f"{args} {more}",
                      "--data-dir", str(data), "--job-id", job)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
        return train_report(proc)

    whole = train(f"{tag}-a", f"--epochs 2 --checkpoint-every {per_epoch}")
    assert whole["resumed_from"] == 0 and whole["steps"] == 2 * per_epoch
    part = train(f"{tag}-b", f"--epochs 1 --checkpoint-every {per_epoch - 1}")
    assert part["steps"] == per_epoch
    again = train(f"{tag}-b", f"--epochs 2 --checkpoint-every {per_epoch}")
    assert again["resumed_from"] == per_epoch - 1 and again["steps"] == 2 * per_epoch   # history carried over
    runs = ROOT / "runs"
    a, b = (runs / f"{tag}-{x}" / "checkpoints" / f"step-{2 * per_epoch:08d}" / "model.pdparams" for x in "ab")
    difference = _max_difference(cpu_image["image"].id, a, b)
    print(f"{script}: largest parameter difference, resumed against uninterrupted: {difference:g}; "
          f"bit for bit: {again['params_sha256'] == whole['params_sha256']}")
    assert difference == 0.0 and again["params_sha256"] == whole["params_sha256"]
