"""Small synthetic MNIST files in the real idx + gzip format, written by the tests."""
import gzip
import hashlib
import random
import struct
from pathlib import Path

NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
         "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")


def label(i, seed):
    return (i + seed) % 10


def images(n, seed):
    """Noise (incompressible, so files have a real size) with a bright band at a row the image's label gives: a
    small CNN learns it in a few dozen steps, so a loss falls as on the real digits."""
    body = bytearray(random.Random(seed).randbytes(n * 28 * 28))
    for i in range(n):
        row = 4 + 2 * label(i, seed)
        body[i * 784 + row * 28:i * 784 + (row + 2) * 28] = b"\xff" * 56
    return struct.pack(">IIII", 2051, n, 28, 28) + bytes(body)


def labels(n, seed):
    return struct.pack(">II", 2049, n) + bytes(label(i, seed) for i in range(n))


def write(folder: Path, n_train=600, n_test=100, pad=0) -> dict[str, str]:
    """Write the four files into folder/mnist/; return {name: md5}. Counts must be multiples of 100
    (Paddle parses in blocks of 100). `pad` grows the training set (for benches)."""
    d = Path(folder) / "mnist"
    d.mkdir(parents=True, exist_ok=True)
    blobs = {NAMES[0]: images(n_train + pad, 1), NAMES[1]: labels(n_train + pad, 1),
             NAMES[2]: images(n_test, 2), NAMES[3]: labels(n_test, 2)}
    out = {}
    for name, raw in blobs.items():
        data = gzip.compress(raw, compresslevel=1, mtime=0)
        (d / name).write_bytes(data)
        out[name] = hashlib.md5(data).hexdigest()
    return out


def manifest(path: Path, base_url: str, md5s: dict[str, str]) -> Path:
    files = ",\n".join(f'  {{ url = "{base_url}/mnist/{n}", md5 = "{m}" }}' for n, m in md5s.items())
    Path(path).write_text(f'[datasets.mnist]\nmodule = "mnist"\nloader = "paddle.vision.datasets.MNIST"\n'
                          f'files = [\n{files}\n]\n')
    return Path(path)
