"""A copy of this checkout (its tracked files, as they are in the working tree) with one pin of a
variant changed and its images renamed, so builds in the copy leave the checkout's aliases alone while
sharing its layers (tagged by content). Used by the layer tests and bench/build.py."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

OPENCV_NOW, OPENCV_BUMPED = "opencv-python-headless==4.12.0.88", "opencv-python-headless==4.11.0.86"


def copy(root: Path, dest: Path) -> Path:
    """The checkout's tracked files, as they are in the working tree, copied to `dest` (what a clone would hold)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (root / name).is_file():   # a file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / name, dest / name)
    return dest


def copy_with_pin(root: Path, tmp: Path, image: str, wheel_dir: Path, old=OPENCV_NOW, new=OPENCV_BUMPED,
                  variant: str = "cpu") -> dict:
    """The copy at tmp/src, with `old` -> `new` in [variants.<variant>] and images called `image`; its wheelhouse
    at tmp/wheelhouse starts as hard links of `wheel_dir`'s wheels. Returns the environment to run it with."""
    src = copy(root, tmp / "src")
    m = src / "images" / "matrix.toml"
    text = m.read_text()
    at = text.index(f"[variants.{variant}]")
    head, mine = text[:at], text[at:]
    if head.count('image = "fleetbox/paddle"') != 1 or old not in mine.split("[variants.", 2)[1]:
        raise RuntimeError(f"images/matrix.toml no longer has {old} in [variants.{variant}]: update "
                           f"tests/checkout.py")
    m.write_text(head.replace('image = "fleetbox/paddle"', f'image = "{image}"') + mine.replace(old, new, 1))
    mine = tmp / "wheelhouse" / variant
    mine.mkdir(parents=True)
    for w in wheel_dir.glob("*.whl"):
        os.link(w, mine / w.name)
    return {"FLEETBOX_WHEELHOUSE": str(tmp / "wheelhouse"), "FLEETBOX_RUNS": str(tmp / "runs")}


def tags(repo: str) -> list[str]:
    out = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}", repo],
                         capture_output=True, text=True).stdout
    return [t for t in out.split() if not t.endswith(":<none>")]


def planned_layers(src: Path, env: dict | None = None) -> set[str]:
    """The layer tags a build of the cpu variant in checkout `src` would make or reuse (its own fleetbox)."""
    code = ("from fleetbox import engine; from fleetbox.image import images, layers, matrix; "
            "p = images.dry_run(matrix.load().get('cpu'), engine.client()); "
            "print(' '.join(layers.layer_tag(x) for x in p.layers))")
    out = subprocess.run([sys.executable, "-c", code], cwd=src, env={**os.environ, **(env or {})},
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def made_since(layers_before: set[str], image_repo: str) -> list[str]:
    """The tags a build in the copy added: new layer tags, and every tag of the copy's images."""
    return [t for t in tags("fleetbox/layers") if t not in layers_before] + tags(image_repo)
