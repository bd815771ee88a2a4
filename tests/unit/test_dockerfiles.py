import json
import re
import shutil
import subprocess

import pytest

from fleetbox.image import bases, images, locks, matrix
from fleetbox.image.images import DATA_DOCKERFILE

LOCK = "pip==25.3 \\\n    --hash=sha256:aa\n"
BASE_ID = "sha256:" + "1" * 64


def render(text: str, args: dict[str, str]) -> str:
    """The Dockerfile as a build with these args sees it: each ARG's default is the value passed, and the
    ARGs before the first FROM are filled into the FROM lines (hadolint checks no image it cannot read)."""
    declared = set(re.findall(r"^ARG (\w+)", text, re.M))
    assert set(args) <= declared, f"build args the Dockerfile does not declare: {sorted(set(args) - declared)}"
    assert all(v.strip() for v in args.values()), f"empty build arg: {args}"
    text = re.sub(r"^ARG (\w+)(=.*)?$", lambda m: f"ARG {m[1]}={json.dumps(args[m[1]])}" if m[1] in args else m[0],
                  text, flags=re.M)
    return re.sub(r"^FROM .*$", lambda m: re.sub(r"\$\{(\w+)\}", lambda v: args.get(v[1], v[0]), m[0]),
                  text, flags=re.M)


def used_by(variant: matrix.Variant) -> list[tuple[str, str]]:
    """(name, rendered text) of every Dockerfile the variant's base, image and data image are built from."""
    out = []
    p = bases.plan(variant)
    if p.method != "vendor":   # a vendor base is tagged as is: no Dockerfile
        out.append(("base.Dockerfile", render(bases.BASE_DOCKERFILE.read_text(), bases.build_args(p))))
    plan = images.plan(variant, BASE_ID, (LOCK, locks.parse(LOCK)))
    out.append(("data.Dockerfile", render(DATA_DOCKERFILE.read_text(), {"IMAGE": plan.tag})))
    return out


@pytest.mark.parametrize("variant", sorted(matrix.load().variants))
def test_every_variants_dockerfiles_pass_hadolint(variant, tmp_path):
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install -e '.[dev]'"
    for name, text in used_by(matrix.load().get(variant)):
        path = tmp_path / name
        path.write_text(text)
        proc = subprocess.run([hadolint, "--failure-threshold", "info", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{name} as {variant} renders it:\n{proc.stdout}{proc.stderr}\n{text}"


def test_rendering_fills_the_variants_values():
    """What the lint above sees differs per variant: dcu uses its vendor base as is."""
    dcu, cpu = dict(used_by(matrix.load().get("dcu"))), dict(used_by(matrix.load().get("cpu")))
    assert "base.Dockerfile" not in dcu and "FROM debian:bookworm\n" in cpu["base.Dockerfile"]
    assert f"ARG IMAGE=\"{images.plan(matrix.load().get('cpu'), BASE_ID, (LOCK, locks.parse(LOCK))).tag}\"" \
        in cpu["data.Dockerfile"]


def test_the_image_has_every_mount_point_fleetbox_binds():
    """Charliecloud (and Apptainer without overlay) cannot create a bind target: each must exist in the image."""
    from fleetbox import settings
    from fleetbox.image import layers
    wanted = {settings.WORKDIR, settings.LOG_DIR, settings.HELPERS_DIR, settings.CHECKPOINT_DIR, settings.RESUME_DIR,
              settings.CONTAINER_CACHE}
    assert wanted <= set(settings.BIND_TARGETS), sorted(wanted - set(settings.BIND_TARGETS))
    made = re.search(r"mkdir -p ([^;]+);", layers.last_script()).group(1).split()
    assert wanted <= set(made), sorted(wanted - set(made))
