"""Getting images onto HPC container platforms: export/convert (`invoke export`) and registry push (`invoke push`);
the pull/convert commands each runtime needs (`invoke pull-cmd`) are the runtime's own (run/backends/runtimes.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from fleetbox import files, settings
from fleetbox.engine import image_or_none
from fleetbox.errors import UserError
from fleetbox.image import built, receipts
from fleetbox.image.matrix import Variant
from fleetbox.ship import kit_load, shipped

FORMATS = ("docker-archive", "charliecloud", "sif", "sqsh")
# What an export is, as its record names it (ship/shipped.py): the format, and for Charliecloud whether squashed.
KINDS = {"docker-archive": ("docker-archive", False), "sif": ("sif", False), "sqsh": ("sqsh", False),
         "charliecloud": ("charliecloud", False), "charliecloud-squash": ("charliecloud", True)}
SUFFIX = {"docker-archive": ".tar", "sif": ".sif", "sqsh": ".sqsh", "charliecloud": ".ch",
          "charliecloud-squash": ".sqfs"}


def export_kind(fmt: str, squash: bool = False) -> str:
    return next(k for k, v in KINDS.items() if v == (fmt, squash and fmt == "charliecloud"))


def export_command(variant: Variant, kind: str) -> str:
    """The command that makes an export of this kind of the variant's image."""
    fmt, squash = KINDS[kind]
    return f"invoke export --variant {variant.name} --format {fmt}" + " --squash" * squash


def export_name(variant: Variant, image_tag: str = "") -> str:
    """fleetbox-paddle-<variant>-<content hash>: the name says which build it holds (an export made before a
    rebuild is never taken for the new image); without a content tag (an image not built by fleetbox for this
    variant), `image_tag` is what stands in for it (e.g. id-<image id>)."""
    return f"fleetbox-paddle-{variant.name}" + (f"-{image_tag}" if image_tag else "")


def content_part(variant: Variant, content_tag: str) -> str:
    """The hash part of a content tag (<image>:<variant>-<hash>)."""
    return content_tag.rsplit(":", 1)[1].removeprefix(f"{variant.name}-")


def export_path(variant: Variant, fmt: str, squash: bool = False, dest: Path | None = None,
                image_tag: str = "") -> Path:
    suffix = SUFFIX[export_kind(fmt, squash)]
    return (dest or settings.exports_dir()) / f"{export_name(variant, image_tag)}{suffix}"


def export_argv(fmt: str, image: str, out: Path, archive: Path | None = None) -> list[str]:
    """Pure: the converter command for a format (docker-archive is written by fleetbox itself)."""
    if fmt == "charliecloud":
        return ["ch-convert", "-i", "docker", image, str(out)]
    if fmt == "sif":
        src = f"docker-archive://{archive}" if archive else f"docker-daemon://{image}"
        return ["apptainer", "build", str(out), src]
    if fmt == "sqsh":
        return ["enroot", "import", "-o", str(out), f"dockerd://{image}"]
    raise UserError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")


def _tool_missing(fmt: str, image: str, name: str, variant: Variant) -> str:
    made = name + SUFFIX[export_kind(fmt, squash=True)]   # Charliecloud's: a squashfs file, one file to copy
    on_cluster = {
        "charliecloud": f"ch-convert -i docker-archive {name}.tar {made}",
        "sif": f"apptainer build {made} docker-archive://{name}.tar",
        "sqsh": f"enroot import -o {made} docker-archive://{name}.tar",
    }[fmt]
    tool = export_argv(fmt, image, Path("x"))[0]
    return (f"{tool} is not installed here; run `invoke export --variant {variant.name} --format docker-archive`, "
            f"copy {name}.tar to the cluster, run there: {on_cluster}, and give `invoke train` --image {made}")


def export(c, variant: Variant, fmt: str, image: str, squash: bool = False, dest: Path | None = None,
           log=print, sign_key: Path | None = None) -> Path:
    """Write the image in `fmt` under a name that carries its content hash; temp name first, renamed once
    complete; then record it (ship/shipped.py), so `train` finds it wherever it was written."""
    if fmt not in FORMATS:
        raise UserError(f"unknown export format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    if sign_key is not None:
        receipts.check_key(sign_key)
    img = image_or_none(c, image)
    if img is None:
        raise UserError(f"image {image} is not here; build it (invoke build --variant {variant.name}) or pull it")
    content = built.content_tag(img, variant)
    if sign_key is not None and not content:
        raise UserError(f"--sign-key signs the statement of an image built here; {image} is not the {variant.name} "
                        f"image built here")
    tag = content_part(variant, content) if content else f"id-{img.id.removeprefix('sha256:')[:12]}"
    out = export_path(variant, fmt, squash, dest.resolve() if dest else None, tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "docker-archive":
        digest = _docker_archive(img, content or image, out, log)
    else:
        _convert(fmt, image, out, export_name(variant, tag), variant, log)
        digest = kit_load.sha256_file(out) if out.is_file() else None
    if content:
        said = receipts.beside(out, (img.labels or {}).get(settings.LABEL_INPUTS, ""), img.id, digest)
        if sign_key is not None:   # this statement names the export: signed as it is
            if len(said) < 2:
                raise UserError(f"--sign-key: no provenance statement of {content} here to sign (receipts/); "
                                f"`invoke build --variant {variant.name}` keeps one")
            said.append(receipts.sign(said[1], sign_key))
        log(f"receipts beside it: {', '.join(p.name for p in said)}" if said else
            f"note: no receipts of {content} here (receipts/); `invoke build --variant {variant.name}` keeps them")
        shipped.record(variant, export_kind(fmt, squash), content, str(out))
    else:
        log(f"note: {image} is not the {variant.name} image built here (no content tag): `train` uses it only "
            f"when given --image {out}")
    log(f"exported {out} ({out.stat().st_size / 1e6:.0f} MB), sha256 {digest[:16]}… in {out.name}.sha256"
        if fmt == "docker-archive" else f"exported {image} as {fmt}: {out}")
    return out


def _convert(fmt: str, image: str, out: Path, name: str, variant: Variant, log) -> None:
    tool = export_argv(fmt, image, out)[0]
    if not shutil.which(tool):
        raise UserError(_tool_missing(fmt, image, name, variant))
    part = out.with_name(out.name + ".part")   # by hand: the converters may write a folder (Charliecloud)
    _remove(part)
    argv = export_argv(fmt, image, part)
    log(f"running {' '.join(argv)}")
    env = {**os.environ, "PATH": "/usr/bin:" + os.environ.get("PATH", "")}   # ch-* want Debian's python3
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        _remove(part)
        last = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise UserError(f"{tool} failed: {last[0][:300]}")
    _remove(out)
    part.rename(out)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def _docker_archive(img, image: str, out: Path, log) -> str:
    """`docker save` with a sha256 file beside it, for air-gapped transfer (sha256sum -c checks it); the image is
    named in it by `image` (its content tag, where it has one: what `docker load` on a node then holds)."""
    h = hashlib.sha256()
    log(f"saving {image} to {out}")
    try:
        with files.atomic(out) as part, open(part, "wb") as f:
            for chunk in img.save(named=image if image in img.tags else True):
                h.update(chunk)
                f.write(chunk)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    files.write_atomic(Path(f"{out}.sha256"), f"{h.hexdigest()}  {out.name}\n")
    return h.hexdigest()


# ---- registries ----

def registry_refs(variant: Variant, registry: str, content_tag: str | None) -> list[str]:
    """HOST[:PORT]/NAMESPACE/paddle:<tag> for the content tag (when known) and every alias."""
    if not registry:
        raise UserError("--registry is missing: give the HOST[:PORT]/NAMESPACE the image was pushed to (`invoke "
                        "push --registry`)")
    if "/" not in registry.strip("/"):
        raise UserError(f"--registry must be HOST[:PORT]/NAMESPACE (got {registry!r})")
    base = registry.rstrip("/") + "/" + variant.image.split("/")[-1]
    tags = [content_tag.split(":", 1)[1]] if content_tag else []
    tags += [a.split(":", 1)[1] for a in variant.aliases]
    return [f"{base}:{t}" for t in tags]


def push_variant(c, variant: Variant, registry: str, log=print) -> list[str]:
    """Push the variant's image built here (its content tag and aliases) and record the content tag's reference,
    which `train` then runs on the nodes (ship/shipped.py)."""
    image = built.resolve(c, variant)
    content = built.content_tag(image, variant)
    if content is None:
        raise UserError(f"image {variant.aliases[0]} has no content tag; run `invoke build --variant {variant.name}`")
    refs = push(c, image, registry_refs(variant, registry, content), log)
    shipped.record(variant, shipped.REGISTRY, content, refs[0])
    return refs


def push(c, image, refs: list[str], log=print) -> list[str]:
    """Tag and push every ref; if the registry refuses, the local tags made for it are removed again."""
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)
    try:
        for ref in refs:
            repo, tag = ref.rsplit(":", 1)
            image.tag(repo, tag)
            log(f"pushing {ref}")
            status: dict[str, str] = {}   # layer -> how it ended: sent, or found in the registry
            try:
                for line in c.images.push(repo, tag, stream=True, decode=True):
                    if "error" in line:
                        raise UserError(f"the registry refused {ref}: {line['error'].strip()}")
                    if line.get("id") and (line.get("status") in ("Pushed", "Layer already exists")
                                           or str(line.get("status", "")).startswith("Mounted from")):
                        status[line["id"]] = "sent" if line["status"] == "Pushed" else "there"
                sent = sum(1 for x in status.values() if x == "sent")
                log(f"  {sent} layer(s) sent, {len(status) - sent} already in the registry")
            except docker.errors.APIError as e:
                raise UserError(f"push of {ref} failed: {(e.explanation or str(e)).strip()[:300]}") from None
    except UserError:
        for ref in refs:
            try:
                c.images.remove(ref, noprune=True)
            except docker.errors.APIError:
                pass
        raise
    return refs
