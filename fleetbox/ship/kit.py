"""`invoke kit`: one archive for an air-gapped site, made on a connected machine. It holds

    kit-load.py          the loader (standard library only: it runs before fleetbox is installed)
    kit.json             variant, fleetbox revision, Python and machine, each part's files and size, each
                         file's size
    source/              the fleetbox source at its revision (git archive HEAD)
    lock/                the variant's lock (also when it is not committed: `invoke lock` where the index is)
    host-wheels/         wheels of fleetbox's own host dependencies, so the site needs no package index
    board-wheels/        the board's VisualDL environment, its lock's wheels (placed as the site's wheelhouse/board/)
    wheelhouse/          the variant's verified wheelhouse
    base/, image/        the base image (and with --with-image the built image) as `docker save` archives
    datasets/            the dataset cache pack
    MANIFEST.sha256      the sha256 of every other file (sha256sum's format)

Parts are kept in <out>.parts/ and reused while their inputs are unchanged (their files are not rewritten);
the archive is written with fixed metadata, so the same parts make the same kit, byte for byte."""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

from fleetbox import ROOT, engine, settings
from fleetbox.data import datasets as ds
from fleetbox.engine import image_or_none
from fleetbox.errors import UserError
from fleetbox.files import atomic, read_json, write_atomic, write_json
from fleetbox.image import images, locks, receipts, wheelhouse
from fleetbox.image.matrix import Variant
from fleetbox.ship import kit_load

PARTS_STATE = "parts.json"


def _digest(*values) -> str:
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


GLIBC = (2, 28)   # the host wheels are chosen for this glibc or newer (Debian 10+, RHEL 8+)


def host_requirements(rev: str) -> list[str]:
    """fleetbox's own dependencies and its build backend, from pyproject.toml at `rev`, and pip (the site's
    Python may have no ensurepip)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pyproject.toml"], capture_output=True,
                          text=True, check=True).stdout
    project = tomllib.loads(text)
    return [*project["project"]["dependencies"], *project["build-system"]["requires"], "pip"]


def host_platforms() -> list[str]:
    """pip's --platform list for wheels that run on GLIBC or newer on this machine's architecture."""
    arch = platform.machine()
    return [f"manylinux_{GLIBC[0]}_{m}_{arch}" for m in range(GLIBC[1], 16, -1)] + [f"manylinux2014_{arch}"]


def _download(d: Path, requirements: list[str], what: str) -> None:
    """pip's download of `requirements` into `d`: wheels only, for this Python on GLIBC or newer (the site's)."""
    py = f"{sys.version_info[0]}.{sys.version_info[1]}"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--dest", str(d),
                           *[f"--platform={p}" for p in host_platforms()], f"--python-version={py}",
                           "--implementation=cp", f"--abi=cp{sys.version_info[0]}{sys.version_info[1]}",
                           *requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"pip could not download {what}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def revision(variant: Variant) -> str:
    """HEAD, which the kit carries; refused when tracked files differ from it (the site would get HEAD
    without them), except the variant's lock (made by `invoke lock` where the index is, carried apart)."""
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        raise UserError(f"a kit carries the fleetbox source from git; {ROOT} is not a git checkout") from None
    changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--name-only", "HEAD"], capture_output=True,
                             text=True).stdout.split()
    changed = [f for f in changed if f != str(variant.lock_path.relative_to(ROOT))]
    if changed:
        raise UserError(f"tracked files differ from HEAD {rev[:12]} ({', '.join(changed[:3])}"
                        f"{', ...' if len(changed) > 3 else ''}): commit them first, the kit carries HEAD")
    return rev


class Part:
    """One folder of the kit: its key (a digest of its inputs) and how to make its files."""

    def __init__(self, name: str, key: str, make, **info):
        self.name, self.key, self.make, self.info = name, key, make, info


def _parts(variant: Variant, client, datasets: list, data_dir: Path, manifest: Path, with_image: bool,
           log) -> list[Part]:
    rev = revision(variant)
    if not variant.lock_path.exists():
        raise UserError(f"no lock for {variant.name} ({variant.lock_path}): run `invoke lock --variant "
                        f"{variant.name}` where its index ({variant.paddle_index or 'PyPI'}) is reachable")
    lock_text, _ = locks.read(variant)
    base = image_or_none(client, variant.base_ref)
    if base is None:
        raise UserError(f"base {variant.base_ref} is not here: run `invoke base --variant {variant.name}` first")
    loader = Path(kit_load.__file__)

    def source(d: Path):
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(d / "fleetbox-src.tar"), rev],
                       check=True, capture_output=True)

    def lock(d: Path):
        shutil.copyfile(variant.lock_path, d / variant.lock_path.name)

    def host_wheels(d: Path):
        _download(d, host_requirements(rev), "fleetbox's host dependencies")

    def board_wheels(d: Path):   # hash-checked by pip against the lock, as uv checks them again at the site
        _download(d, ["--require-hashes", "-r", str(settings.BOARD_LOCK)], "the board's VisualDL environment")

    def wheels(d: Path):   # the lock's wheels and the wheelhouse's own records, not older wheels beside them
        src = wheelhouse.ensure(variant, log=log)
        listed = json.loads((src / wheelhouse.MANIFEST).read_text())["files"]
        for name in sorted([*listed, wheelhouse.MANIFEST, wheelhouse.LOCK_COPY]):
            try:   # the same bytes; a link when on one file system (no 300 MB copy)
                os.link(src / name, d / name)
            except OSError:
                shutil.copyfile(src / name, d / name)

    def save(refs: list[str], name: str):
        def make(d: Path):   # the docker CLI keeps every tag named in one archive
            proc = subprocess.run(["docker", "save", "-o", str(d / name), *refs], capture_output=True, text=True)
            if proc.returncode != 0:
                raise UserError(f"docker save {' '.join(refs)} failed: {proc.stderr.strip()[-300:]}")
        return make

    parts = [Part("loader", _digest(kit_load.sha256_file(loader)),
                  lambda d: shutil.copyfile(loader, d / "kit-load.py")),
             Part("source", _digest(rev), source, revision=rev),
             Part("lock", _digest(lock_text), lock, place=str(variant.lock_path.relative_to(ROOT))),
             Part("host-wheels", _digest(host_requirements(rev), sys.version_info[:2], host_platforms()), host_wheels),
             Part("board-wheels", _digest(settings.BOARD_LOCK.read_text(), sys.version_info[:2], host_platforms()),
                  board_wheels),
             Part("wheelhouse", _digest(lock_text, variant.name), wheels),
             Part("base", _digest(base.id, variant.base_ref), save([variant.base_ref], "base.tar"),
                  tags=[variant.base_ref])]
    if with_image:   # the image this lock and base make, not whatever the alias names now
        plan = images.plan(variant, base.id, locks.read(variant))
        image = image_or_none(client, plan.tag)
        if image is None:
            raise UserError(f"{plan.tag} (this lock and base) is not built: run `invoke build --variant "
                            f"{variant.name}` first")
        tags = sorted(t for t in image.tags if t.startswith(f"{variant.image}:"))
        # with its receipts (image/receipts.py), which the loader puts in the site's receipts/
        statement = receipts.provenance_path(image.id)
        held = [p for p in (receipts.sbom_path((image.labels or {}).get(settings.LABEL_INPUTS, "")), statement,
                            Path(f"{statement}{receipts.SIGNATURE_SUFFIX}")) if p.is_file()]

        def image_part(d: Path):
            save(tags, "image.tar")(d)
            for p in held:
                shutil.copyfile(p, d / p.name)
        parts.append(Part("image", _digest(image.id, tags, [(p.name, kit_load.sha256_file(p)) for p in held]),
                          image_part, tags=tags, receipts=[p.name for p in held]))
    if datasets:
        def pack(d: Path):   # with the manifest that names them: the site restores against the same one
            ds.pack(datasets, data_dir, d / "datasets.tar")
            shutil.copyfile(manifest, d / "datasets.toml")
        parts.append(Part("datasets", _digest(ds.identity(datasets), manifest.read_text()), pack,
                          names=[x.name for x in datasets]))
    return parts


def _current(part_dir: Path, recorded: dict) -> bool:
    """The part's files are the ones recorded (size and mtime), so their recorded sha256 still holds."""
    files = recorded.get("files", {})
    if not files:
        return False
    for rel, (size, mtime, _) in files.items():
        try:
            st = (part_dir / rel).stat()
        except OSError:
            return False
        if st.st_size != size or st.st_mtime_ns != mtime:
            return False
    return len([p for p in part_dir.rglob("*") if p.is_file()]) == len(files)


def make(variant: Variant, out: Path, datasets: list | None = None, data_dir: Path | None = None,
         manifest: Path | None = None, with_image: bool = False, log=print) -> dict:
    out = out.resolve()
    if out.is_dir():
        raise UserError(f"--out {out} is a folder; name the kit file, e.g. {out}/fleetbox-{variant.name}.kit")
    parts = _parts(variant, engine.client(), datasets or [], data_dir or settings.data_dir(),
                   manifest or settings.datasets_manifest(), with_image, log)   # its checks first
    out.parent.mkdir(parents=True, exist_ok=True)
    parts_dir = out.with_name(out.name + ".parts")
    parts_dir.mkdir(exist_ok=True)
    state = read_json(parts_dir / PARTS_STATE)
    folders = {"loader": ".", "source": "source", "lock": "lock", "host-wheels": "host-wheels",
               "board-wheels": "board-wheels", "wheelhouse": "wheelhouse", "base": "base", "image": "image",
               "datasets": "datasets"}
    new_state, rows = {}, []
    for p in parts:
        d = parts_dir / p.name
        rec = state.get(p.name, {})
        if rec.get("key") == p.key and _current(d, rec):
            new_state[p.name], how = rec, "reused"
        else:
            tmp = parts_dir / f".{p.name}.part"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                p.make(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            shutil.rmtree(d, ignore_errors=True)
            tmp.rename(d)
            files = {}
            for f in sorted(x for x in d.rglob("*") if x.is_file()):
                st = f.stat()
                files[str(f.relative_to(d))] = [st.st_size, st.st_mtime_ns, kit_load.sha256_file(f)]
            new_state[p.name], how = {"key": p.key, "files": files}, "made"
            write_json(parts_dir / PARTS_STATE, {**state, **new_state})   # a made part survives a later failure
        size = sum(v[0] for v in new_state[p.name]["files"].values())
        rows.append((p.name, len(new_state[p.name]["files"]), size, how))
        log(f"  {p.name:<12} {len(new_state[p.name]['files']):>4} file(s) {size / 2**20:>9.1f} MiB  {how}")
    for stale in set(state) - {p.name for p in parts}:   # a part this kit no longer has (say, --with-image)
        shutil.rmtree(parts_dir / stale, ignore_errors=True)
    if new_state != state:
        write_json(parts_dir / PARTS_STATE, new_state)

    # what goes into the archive: path in the kit -> (file here, sha256)
    entries = {}
    for p in parts:
        top = folders[p.name]
        for rel, (_, _, sha) in new_state[p.name]["files"].items():
            entries[rel if top == "." else f"{top}/{rel}"] = (parts_dir / p.name / rel, sha)
    rev = next(p.info["revision"] for p in parts if p.name == "source")
    info = {"format": 1, "variant": variant.name, "revision": rev,
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}", "machine": platform.machine(),
            "glibc": f"{GLIBC[0]}.{GLIBC[1]}",
            "parts": {p.name: {"files": [f"{folders[p.name]}/{r}" if folders[p.name] != "." else r
                                         for r in new_state[p.name]["files"]],
                               "bytes": sum(v[0] for v in new_state[p.name]["files"].values()), **p.info}
                      for p in parts},
            # every file's size, read by the loader before it writes a byte of that file
            "sizes": {name: src.stat().st_size for name, (src, _) in sorted(entries.items())}}
    info_blob = json.dumps(info, indent=1, sort_keys=True).encode()
    manifest = "".join(f"{sha}  {name}\n" for name, (_, sha) in sorted(
        {**entries, kit_load.KIT_JSON: (None, hashlib.sha256(info_blob).hexdigest())}.items())).encode()
    manifest_sha = hashlib.sha256(manifest).hexdigest()

    sidecar = out.with_name(out.name + ".sha256")
    side = read_json(out.with_name(f".{out.name}.kit.json"))
    if out.exists() and side.get("manifest") == manifest_sha and side.get("bytes") == out.stat().st_size \
            and side.get("mtime_ns") == out.stat().st_mtime_ns:
        kit_sha, how = side["sha256"], "unchanged; not rewritten"
        if not sidecar.exists() or sidecar.read_text() != f"{kit_sha}  {out.name}\n":
            write_atomic(sidecar, f"{kit_sha}  {out.name}\n")
    else:
        kit_sha, how = _write_tar(out, entries, info_blob, manifest), "written"
        st = out.stat()
        write_json(out.with_name(f".{out.name}.kit.json"), {"manifest": manifest_sha, "sha256": kit_sha,
                                                              "bytes": st.st_size, "mtime_ns": st.st_mtime_ns})
        write_atomic(sidecar, f"{kit_sha}  {out.name}\n")
    total = out.stat().st_size
    log(f"kit {out}: {total / 2**20:.1f} MiB, {len(entries) + 2} files ({how})")
    q = shlex.quote(out.name)
    log(f"kit sha256 {kit_sha} (also in {sidecar.name}): send it apart from the kit; at the site")
    log(f"  sha256sum -c {shlex.quote(sidecar.name)} && tar -xf {q} kit-load.py && "
        f"python3 kit-load.py {q} --expect {kit_sha}")
    return {"out": str(out), "sha256": kit_sha, "parts": rows, "bytes": total, "written": how == "written"}


def _write_tar(out: Path, entries: dict, info_blob: bytes, manifest: bytes) -> str:
    """The archive with fixed metadata (owner 0, time 0, mode 0644): the loader first, then the manifest (a
    damaged part is found as soon as it is read), kit.json, the parts; its sha256."""
    h = hashlib.sha256()

    class Hashing(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def writable(self):
            return True

        def write(self, b):
            h.update(b)
            return self.f.write(b)

    def info(name, size):
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
        return ti

    order = sorted(n for n in entries if n != "kit-load.py")
    with atomic(out) as part, open(part, "wb") as raw, \
            tarfile.open(fileobj=Hashing(raw), mode="w|", format=tarfile.PAX_FORMAT) as tar:   # Ctrl-C: no half kit
        with open(entries["kit-load.py"][0], "rb") as f:
            tar.addfile(info("kit-load.py", entries["kit-load.py"][0].stat().st_size), f)
        tar.addfile(info(kit_load.MANIFEST, len(manifest)), io.BytesIO(manifest))
        tar.addfile(info(kit_load.KIT_JSON, len(info_blob)), io.BytesIO(info_blob))
        for name in order:
            src = entries[name][0]
            with open(src, "rb") as f:
                tar.addfile(info(name, src.stat().st_size), f)
    return h.hexdigest()


def load(kit: Path, dest: Path | None, expect: str | None, log=print, no_expect: bool = False,
         skip_images: bool = False, trusted_keys: Path | None = None) -> dict:
    """`invoke kit --load`: the loader the kit carries, run from this fleetbox."""
    dest = dest or Path(f"fleetbox-{kit.name.rsplit('.', 1)[0]}")
    try:
        return kit_load.load(kit, dest, expect, log=log, no_expect=no_expect, skip_images=skip_images,
                             trusted_keys=trusted_keys)
    except kit_load.Refused as e:
        raise UserError(f"kit refused: {e}") from None
