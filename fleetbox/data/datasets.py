"""Offline dataset caches (`invoke cache`): Paddle's own cache layout, MD5-verified, portable as one archive.

A seeded cache folder looks exactly like `~/.cache/paddle/dataset`: `<module>/<basename of url>`. Mounted
(or baked) at that path in a container, unmodified code such as `paddle.vision.datasets.MNIST()` finds its
files, checks their MD5 and never touches the network.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
import tempfile
import threading
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from .. import settings
from . import fetch
from ..errors import UserError

PACK_INDEX = "fleetbox-cache.json"


@dataclass(frozen=True)
class DataFile:
    dataset: str
    module: str
    url: str
    md5: str

    @property
    def relpath(self) -> str:
        return f"{self.module}/{self.url.rsplit('/', 1)[-1]}"


@dataclass(frozen=True)
class Dataset:
    name: str
    module: str
    loader: str
    files: tuple[DataFile, ...]
    note: str = ""
    unpack: tuple[tuple[str, str, str], ...] = ()   # (archive, folder, marker): what Paddle extracts on first use


def load(path: Path | None = None) -> dict[str, Dataset]:
    path = Path(path or settings.datasets_manifest())
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"dataset manifest not found: {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"dataset manifest {path}: {e}") from None
    out = {}
    for name, d in data.get("datasets", {}).items():
        files = tuple(DataFile(name, d["module"], f["url"], f["md5"].lower()) for f in d["files"])
        unpack = tuple((u["file"], u["into"], u.get("marker", "")) for u in d.get("unpack", []))
        out[name] = Dataset(name, d["module"], d.get("loader", ""), files, d.get("note", ""), unpack)
    return out


def select(manifest: dict[str, Dataset], names) -> list[Dataset]:
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names or []) if n.strip()]
    if not names:
        raise UserError(f"name data sets with --datasets; known: {', '.join(manifest)}")
    unknown = [n for n in names if n not in manifest]
    if unknown:
        raise UserError(f"unknown data set {', '.join(map(repr, unknown))}; known: {', '.join(manifest)}")
    return [manifest[n] for n in dict.fromkeys(names)]


def _is_http(s: str) -> bool:
    return urlparse(s).scheme in ("http", "https")


def source(f: DataFile, mirror: str | None) -> str:
    """Where a file comes from: its own URL, or the same <module>/<name> under a mirror URL or folder."""
    if not mirror:
        return f.url
    if _is_http(mirror):
        return mirror.rstrip("/") + "/" + f.relpath
    return str(Path(mirror) / f.relpath)


def _check_mirror(mirror: str) -> None:
    if _is_http(mirror):
        try:
            fetch.session().head(mirror, timeout=10)
        except fetch.requests.RequestException as e:
            raise UserError(f"mirror {mirror} is unreachable ({type(e).__name__})") from None
    elif not Path(mirror).is_dir():
        raise UserError(f"mirror folder {mirror} does not exist")


def seed(datasets: list[Dataset], dest: Path, mirror: str | None = None, log=print, retries: int = 4,
         backoff: float = 1.0, jobs: int = 4) -> list[dict]:
    """Download every file of the data sets into `dest`, verified by MD5; skip what is already verified.

    Up to `jobs` files at a time: MD5 caps one stream at what one core hashes (~700 MB/s), and remote
    servers often cap each connection, so several files at once use more cores and more connections.
    After a failure no further file starts, the running ones finish, and the first error is raised."""
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1, not {jobs}")
    if mirror:
        _check_mirror(mirror)
    files = [f for d in datasets for f in d.files]
    stop, failed, said = fetch.Stop(), threading.Event(), threading.Lock()

    def one(i: int, f: DataFile) -> dict | None:
        if failed.is_set():   # a file failed: start no more
            return None
        try:
            return fetch_one(i, f)
        except BaseException:
            failed.set()
            raise

    def fetch_one(i: int, f: DataFile) -> dict:
        target = dest / f.relpath
        if target.exists() and fetch.file_digest(target, "md5") == f.md5:
            return _row(f, target, "cached", 0.0)
        src = source(f, mirror)
        resumed = target.with_name(target.name + ".part").exists()
        with said:   # one whole line at a time from the worker threads
            log(f"[{i}/{len(files)}] {f.dataset}: {src}")
        t = time.perf_counter()
        fetch.download(src, target, f.md5, "md5", retries=retries, backoff=backoff, stop=stop)
        return _row(f, target, "resumed" if resumed else "downloaded", time.perf_counter() - t)

    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="seed") as pool:
        futures = [pool.submit(one, i, f) for i, f in enumerate(files, 1)]
        try:
            wait(futures)
        except BaseException:   # Ctrl-C: stop the running downloads; their .part files resume next time
            stop.set()
            pool.shutdown(cancel_futures=True)
            raise
    errors = [fu.exception() for fu in futures if fu.exception()]
    if errors:
        raise errors[0]
    rows = [fu.result() for fu in futures]
    unpack_all(datasets, dest, log)
    return rows


def unpack_all(datasets: list[Dataset], dest: Path, log=print) -> None:
    """Extract what Paddle's loader would extract on first use, so a read-only cache works."""
    for d in datasets:
        for archive, into, marker in d.unpack:
            folder = dest / d.module / into
            if (folder / marker).exists():
                continue
            log(f"unpacking {d.module}/{archive} into {d.module}/{into}/ (as Paddle's loader would)")
            staging = Path(tempfile.mkdtemp(prefix=f".{into}-", dir=dest / d.module))
            try:
                with tarfile.open(dest / d.module / archive) as tar:
                    safe_extract(tar, staging)
                if folder.exists():
                    shutil.rmtree(folder)
                staging.replace(folder)
            except (tarfile.TarError, OSError, UserError) as e:
                raise UserError(f"cannot unpack {d.module}/{archive}: {e}") from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)


def _row(f: DataFile, path: Path, status: str, seconds: float) -> dict:
    size = path.stat().st_size if path.exists() else 0
    return {"dataset": f.dataset, "file": f.relpath, "bytes": size, "status": status, "seconds": seconds}


def check(datasets: list[Dataset], dest: Path) -> list[dict]:
    """Re-check what is in the cache: ok, missing or bad (MD5 differs)."""
    rows = []
    for d in datasets:
        for f in d.files:
            p = dest / f.relpath
            status = "missing" if not p.exists() else "ok" if fetch.file_digest(p, "md5") == f.md5 else "bad md5"
            rows.append(_row(f, p, status, 0.0))
    return rows


def identity(datasets: list[Dataset]) -> list[list[str]]:
    """What baked data sets contribute to an image's content hash."""
    return sorted([f.relpath, f.md5] for d in datasets for f in d.files)


def require(datasets: list[Dataset], dest: Path) -> list[Path]:
    """The verified files of these data sets, or a clear error saying how to seed them."""
    rows = check(datasets, dest)
    bad = [r for r in rows if r["status"] != "ok"]
    if bad:
        raise UserError(f"{bad[0]['file']} is {bad[0]['status']} in {dest}; run "
                        f"`invoke cache --datasets {','.join(d.name for d in datasets)}`")
    return [dest / f.relpath for d in datasets for f in d.files]


def table(rows: list[dict]) -> str:
    out = [f"  {'data set':<14} {'file':<44} {'size':>10}  {'status':<10} {'MB/s':>7}"]
    for r in rows:
        rate = f"{r['bytes'] / r['seconds'] / 1e6:7.1f}" if r["seconds"] > 0 else " " * 7
        out.append(f"  {r['dataset']:<14} {r['file']:<44} {r['bytes'] / 1e6:>8.1f}MB  {r['status']:<10} {rate}")
    return "\n".join(out)


def pack(datasets: list[Dataset], dest: Path, out: Path) -> Path:
    """One archive with the verified files and their checksums (temp name, then rename)."""
    require(datasets, dest)
    index = {"format": 1, "files": {}}
    for d in datasets:
        for f in d.files:
            p = dest / f.relpath
            index["files"][f.relpath] = {"md5": f.md5, "sha256": fetch.file_digest(p), "bytes": p.stat().st_size,
                                         "dataset": f.dataset}
    part = out.with_name(out.name + ".part")
    mode = "w:gz" if out.name.endswith((".tgz", ".tar.gz")) else "w"
    try:
        with tarfile.open(part, mode) as tar:
            blob = json.dumps(index, indent=1, sort_keys=True).encode()
            info = tarfile.TarInfo(PACK_INDEX)
            info.size, info.mtime = len(blob), int(time.time())
            tar.addfile(info, io.BytesIO(blob))
            for rel in index["files"]:
                tar.add(dest / rel, arcname=f"dataset/{rel}", recursive=False)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    return part.replace(out)


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract refusing absolute paths, '..', links and special files. Uses tarfile's "data" filter where
    this Python has it (3.11.4+), and the same checks done here before extracting where it does not."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    members = tar.getmembers()
    for m in members:
        _safe_member(m)
    tar.extractall(dest, members=members)


def _safe_member(m: tarfile.TarInfo) -> str:
    """The member's path inside dataset/, or a clear refusal."""
    p = PurePosixPath(m.name)
    if p.is_absolute() or m.name.startswith("/"):
        raise UserError(f"refusing archive: member {m.name!r} has an absolute path")
    if ".." in p.parts:
        raise UserError(f"refusing archive: member {m.name!r} climbs out with '..'")
    if m.issym() or m.islnk():
        raise UserError(f"refusing archive: member {m.name!r} is a link ({m.linkname!r})")
    if not (m.isfile() or m.isdir()):
        raise UserError(f"refusing archive: member {m.name!r} is not a regular file")
    return str(p)


def restore(archive: Path, dest: Path, manifest: dict[str, Dataset] | None = None, log=print) -> list[dict]:
    """Unpack a cache archive into `dest`, checking every member and every checksum before anything lands."""
    if not archive.is_file():
        raise UserError(f"no such archive: {archive}")
    known = {f.relpath: f.md5 for d in (manifest or {}).values() for f in d.files}
    try:
        tar = tarfile.open(archive)
    except tarfile.TarError as e:
        raise UserError(f"{archive} is not a readable archive ({e})") from None
    with tar:
        members = tar.getmembers()
        names = [_safe_member(m) for m in members]
        if PACK_INDEX not in names:
            raise UserError(f"{archive} has no {PACK_INDEX}: not made by `invoke cache --pack`")
        index = json.loads(tar.extractfile(members[names.index(PACK_INDEX)]).read())
        dest.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".restore-", dir=dest))
        try:
            rows = []
            for m, name in zip(members, names):
                if not m.isfile() or name == PACK_INDEX:
                    continue
                rel = name.removeprefix("dataset/")
                meta = index["files"].get(rel)
                if not name.startswith("dataset/") or meta is None:
                    raise UserError(f"refusing archive: member {name!r} is not listed in its {PACK_INDEX}")
                out = staging / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                md5, sha = hashlib.md5(), hashlib.sha256()
                with tar.extractfile(m) as src, open(out, "wb") as dst:
                    while chunk := src.read(fetch.CHUNK):
                        md5.update(chunk)
                        sha.update(chunk)
                        dst.write(chunk)
                if md5.hexdigest() != meta["md5"] or sha.hexdigest() != meta["sha256"]:
                    raise UserError(f"refusing archive: {rel} does not match its checksum in {archive.name}")
                if rel in known and known[rel] != meta["md5"]:
                    raise UserError(f"refusing archive: {rel} has MD5 {meta['md5']}, Paddle expects {known[rel]}")
                rows.append({"dataset": meta.get("dataset", ""), "file": rel, "bytes": m.size,
                             "status": "restored", "seconds": 0.0})
            missing = set(index["files"]) - {r["file"] for r in rows}
            if missing:
                raise UserError(f"refusing archive: {sorted(missing)[0]} is listed but missing")
            for r in rows:   # every check passed: move into place
                target = dest / r["file"]
                target.parent.mkdir(parents=True, exist_ok=True)
                (staging / r["file"]).replace(target)
            restored = {r["file"] for r in rows}
            unpack_all([d for d in (manifest or {}).values() if all(f.relpath in restored for f in d.files)],
                       dest, log)
            return rows
        except OSError as e:
            raise UserError(f"cannot restore into {dest}: {e.strerror}") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def cache_command(datasets=None, mirror=None, dest=None, verify=False, pack_to=None, restore_from=None,
                  manifest=None, jobs=4, log=print) -> None:
    """`invoke cache`: restore a pack, pack, verify, or seed (in that order of precedence)."""
    from ..errors import Failed
    from ..options import integer
    known = load(manifest)
    dest = Path(dest) if dest else settings.data_dir()
    if restore_from:
        rows = restore(Path(restore_from), dest, known, log=log)
        log(table(rows))
        log(f"restored {len(rows)} files into {dest}")
        return
    chosen = select(known, datasets) if (datasets or not pack_to) else [
        d for d in known.values() if all((dest / f.relpath).exists() for f in d.files)]
    if pack_to:
        out = pack(chosen, dest, Path(pack_to))
        log(f"packed {', '.join(d.name for d in chosen)} into {out} ({out.stat().st_size / 1e6:.1f} MB)")
        return
    if verify:
        rows = check(chosen, dest)
        log(table(rows))
        bad = [r for r in rows if r["status"] != "ok"]
        if bad:
            raise Failed(f"{len(bad)} of {len(rows)} files missing or bad in {dest}")
        return
    rows = seed(chosen, dest, mirror, log=log, jobs=integer("--jobs", jobs, 1))
    log(table(rows))
    log(f"cache {dest}: {len(rows)} files verified; mount it at {settings.CONTAINER_CACHE} (read-only)")
