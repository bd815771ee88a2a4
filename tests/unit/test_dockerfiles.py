import json
import re
import shutil
import subprocess

import pytest

from fleetbox.image import bases, images, layers, locks, matrix
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
    wanted = {settings.WORKDIR, settings.LOG_DIR, settings.HELPERS_DIR, settings.CHECKPOINT_DIR, settings.RESUME_DIR,
              settings.CONTAINER_CACHE}
    assert wanted <= set(settings.BIND_TARGETS), sorted(wanted - set(settings.BIND_TARGETS))
    last = layers.plan(matrix.load().get("cpu"), *locks.read(matrix.load().get("cpu")), BASE_ID, "python3", "p.whl")[-1]
    made = re.search(r"mkdir -p ([^;]+);", last.script).group(1).split()
    assert wanted <= set(made), sorted(wanted - set(made))


# -- the variants' own Dockerfiles (invoke build --dockerfile) --

def with_lock() -> list[str]:
    return [v for v in sorted(matrix.load().variants) if matrix.load().get(v).lock_path.exists()]


@pytest.mark.parametrize("variant", with_lock() or ["cpu"])
def test_the_committed_dockerfile_of_a_variant_with_a_lock_is_current_and_passes_hadolint(variant, tmp_path):
    v = matrix.load().get(variant)
    path = images.dockerfile_path(v)
    assert path.exists(), f"{path.name} missing: `invoke build --variant {variant} --dockerfile` writes it"
    assert path.read_text() == images.render_dockerfile(v), \
        f"{path.name} is stale: `invoke build --variant {variant} --dockerfile` renders it again"
    proc = subprocess.run([shutil.which("hadolint") or "hadolint", "--failure-threshold", "info", str(path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_variants_dockerfile_holds_one_run_per_layer_with_its_pins_and_what_varies_as_build_arguments():
    v = matrix.load().get("cpu")
    lock_text, entries = locks.read(v)
    text = images.render_dockerfile(v)
    split = images.plan(v, BASE_ID, (lock_text, entries)).layers
    assert images.variant_layers(text) == [x.name for x in split]
    runs = re.findall(r"^RUN .*?(?<!\\)$", text, re.M | re.S)
    assert len(runs) == len(split)
    for layer, run in zip(split, runs):   # each layer's own script, its requirements inline, every hash
        assert run.rstrip().endswith(layer.script)
        for e in layer.entries:
            assert f"'{e.name}=={e.version} " + " ".join(f"--hash=sha256:{h}" for h in e.hashes) + "'" in run
        assert "from=wheelhouse,target=/mnt" in run
        assert (layers.FREEZE in run) is layer.last   # the last layer also writes the freeze file
    assert "--no-index" in text and "--require-hashes" in text
    # no SHELL: it would stay in the image's settings; the RUNs run under /bin/sh as invoke build's do
    assert "SHELL" not in text
    last_run = text.rindex("\nRUN ")
    for arg in ("REVISION", "BASE_DIGEST", "CONTENT_HASH"):   # what differs by machine or commit: never inline,
        assert f'"${{{arg}}}"' in text and text.index(f"\nARG {arg}=unknown") > last_run   # and after the RUNs
    assert not re.search(r"\b[0-9a-f]{40}\b", text)   # no commit, image or base digest: the same on every machine


def test_changing_one_pin_changes_that_layers_line_and_the_labels_that_name_the_lock_only():
    import difflib
    v = matrix.load().get("cpu")
    lock_text, entries = locks.read(v)
    old = next(e for e in entries if e.name == "opencv-python-headless")
    lines = lock_text.splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"{old.name}=={old.version}"))
    end = next(i for i in range(at + 1, len(lines)) if not lines[i].startswith("    --hash"))
    bumped = "".join(lines[:at] + [f"{old.name}==4.11.0.86 \\\n", "    --hash=sha256:" + "ab" * 32 + "\n"]
                     + lines[end:])
    render = images.dockerfile_text
    diff = [ln for ln in difflib.unified_diff(render(v, lock_text, entries).splitlines(),
                                              render(v, bumped, locks.parse(bumped)).splitlines(), lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert len(diff) == 6, "\n".join(diff)
    assert diff[0].startswith(f"-      '{old.name}=={old.version} ") and \
        diff[1] == f"+      '{old.name}==4.11.0.86 --hash=sha256:{'ab' * 32}' \\"
    assert {d[1:].strip().split("=")[0] for d in diff[2:]} == {'"io.fleetbox.lock-sha256"', '"io.fleetbox.pip-freeze"'}


def test_rendering_a_variant_without_a_lock_says_how_to_make_it_in_one_line(run_invoke):
    from tests.unit.test_cli import one_line_error
    one_line_error(run_invoke("build", "--variant", "cu126", "--dockerfile"), "no lock for variant cu126",
                   "`invoke lock --variant cu126`")
    assert not (images.ROOT / "images" / "cu126.Dockerfile").exists()


def test_dry_run_prints_the_dockerfile_and_writes_nothing(run_invoke):
    v = matrix.load().get("cpu")
    before = images.dockerfile_path(v).stat().st_mtime_ns
    proc = run_invoke("build", "--variant", "cpu", "--dockerfile", "--dry-run")
    assert proc.returncode == 0 and proc.stdout == images.render_dockerfile(v), proc.stderr
    assert images.dockerfile_path(v).stat().st_mtime_ns == before
