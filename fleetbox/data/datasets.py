"""Offline dataset caches (`invoke cache`): Paddle's own cache layout, MD5-verified, portable as one archive.

A seeded cache folder looks exactly like `~/.cache/paddle/dataset`: `<module>/<basename of url>`. Mounted
(or baked) at that path in a container, unmodified code such as `paddle.vision.datasets.MNIST()` finds its
files, checks their MD5 and never touches the network.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import shutil
import tarfile
import tempfile
import threading
import time
import tomllib
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from fleetbox import files, settings
from fleetbox.archives import safe_extract, safe_member
from fleetbox.data import fetch
from fleetbox.errors import Failed, UserError
from fleetbox.options import integer

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
    try:
        for name, d in data.get("datasets", {}).items():
            files = tuple(DataFile(name, _name(d["module"], "module"), f["url"], _md5(f["md5"])) for f in d["files"])
            for f in files:   # the file's own name in the cache is the URL's last part
                if not PATH_NAME.fullmatch(f.url.rsplit("/", 1)[-1]):
                    raise ValueError(f"url {f.url!r} does not end in a file name")
            unpack = tuple((_name(u["file"], "unpack file"), _name(u["into"], "unpack into"),
                            _name(u.get("marker", ""), "unpack marker", empty=True)) for u in d.get("unpack", []))
            out[name] = Dataset(name, d["module"], d.get("loader", ""), files, d.get("note", ""), unpack)
    except KeyError as e:
        raise UserError(f"dataset manifest {path}: data set {name!r} lacks {e.args[0]!r}") from None
    except (TypeError, AttributeError, ValueError) as e:
        raise UserError(f"dataset manifest {path}: data set {name!r}: {e}") from None
    return out


# A cache path part: one plain name, never a path that leaves <cache>/<module>/ (the manifest can come from anyone)
PATH_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*")


def _name(value, what: str, empty: bool = False) -> str:
    if not (isinstance(value, str) and (PATH_NAME.fullmatch(value) or empty and value == "")):
        raise ValueError(f"{what} {value!r} is not a single file or folder name")
    return value


def _md5(value) -> str:
    if not (isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{32}", value)):
        raise ValueError(f"md5 {value!r} is not 32 hex digits")
    return value.lower()


def select(manifest: dict[str, Dataset], names) -> list[Dataset]:
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names or []) if n.strip()]
    if not names:
        raise UserError(f"name data sets with --datasets; known: {', '.join(manifest)}")
    unknown = [n for n in names if n not in manifest]
    if unknown:
        raise UserError(f"unknown data set {', '.join(map(repr, unknown))}; known: {', '.join(manifest)}")
    return [manifest[n] for n in dict.fromkeys(names)]


def source(f: DataFile, mirror: str | None) -> str:
    """Where a file comes from: its own URL, or the same <module>/<name> under a mirror URL or folder.
    A mirror without scheme:// is a folder, its name taken as is ('#' and '?' included)."""
    if not mirror:
        return f.url
    if fetch.URL.match(mirror):
        return mirror.rstrip("/") + "/" + f.relpath
    return str(Path(mirror) / f.relpath)


def _check_mirror(mirror: str) -> None:
    if not fetch.URL.match(mirror):
        if not Path(mirror).is_dir():
            raise UserError(f"mirror folder {mirror} does not exist")
        return
    try:
        url = urlsplit(mirror)
        url.port   # a bad port raises here
    except ValueError as e:
        raise UserError(f"mirror {fetch.shown(mirror)} is not a valid URL ({e})") from None
    if url.scheme.lower() not in ("http", "https"):
        raise UserError(f"mirror {fetch.shown(mirror)}: a mirror is an http(s) URL or a folder, not {url.scheme}://")
    if not url.hostname:
        raise UserError(f"mirror {fetch.shown(mirror)} is not a valid URL (no host)")
    try:
        fetch.session().head(mirror, timeout=10)
    except fetch.requests.RequestException as e:
        raise UserError(f"mirror {fetch.shown(mirror)} is unreachable ({type(e).__name__})") from None


def _folder(dest: Path) -> Path:
    """The nearest existing folder on the way to the cache `dest` (`dest` itself once it exists): where
    new folders for it would be made. One clear line when that is a file instead."""
    p = dest
    while not (p.exists() or p.is_symlink()) and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise UserError(f"the cache {dest} exists and is not a folder" if p == dest else
                        f"the cache {dest} cannot be made: {p} is not a folder")
    return p


def _mkdir(path: Path) -> None:
    """mkdir -p, each new folder 0755 whatever the umask: containers read the cache as other users too."""
    if path.is_dir():
        return
    _mkdir(path.parent)
    try:
        path.mkdir()
        path.chmod(0o755)
    except OSError as e:
        raise UserError(f"cannot make folder {path}: {e.strerror}") from None


def _share(root: Path) -> None:
    """Folders 0755 and files 0644 under `root` (itself included): readable by a container's non-root user."""
    root.chmod(0o755)
    for top, dirs, names in os.walk(root):
        for name in dirs:
            if not os.path.islink(p := os.path.join(top, name)):
                os.chmod(p, 0o755)
        for name in names:
            if not os.path.islink(p := os.path.join(top, name)):
                os.chmod(p, 0o644)


def _readable(fn, *args) -> None:
    """Make an existing cache readable by all where we may; a cache owned by someone else stays as it is."""
    try:
        fn(*args)
    except PermissionError:
        pass


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def seed(datasets: list[Dataset], dest: Path, mirror: str | None = None, log=print, retries: int = 4,
         backoff: float = 1.0, jobs: int = 4) -> list[dict]:
    """Download every file of the data sets into `dest`, verified by MD5; skip what is already verified.

    Up to `jobs` files at a time: MD5 caps one stream at what one core hashes (~700 MB/s), and remote
    servers often cap each connection, so several files at once use more cores and more connections.
    After a failure no further file starts, the running ones finish, and the first error is raised."""
    if jobs < 1:
        raise UserError(f"--jobs must be at least 1, not {jobs}")
    _folder(dest)
    if mirror:
        _check_mirror(mirror)
    files = [f for d in datasets for f in d.files]
    for module in dict.fromkeys(f.module for f in files):
        _mkdir(dest / module)
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
            _readable(target.chmod, 0o644)   # a cache seeded before fleetbox made files 0644
            return _row(f, target, "cached", 0.0)
        src = source(f, mirror)
        resumed = target.with_name(target.name + ".part").exists()
        with said:   # one whole line at a time from the worker threads
            log(f"[{i}/{len(files)}] {f.dataset}: {fetch.shown(src)}")
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


def unpack_all(datasets: list[Dataset], dest: Path, log=print, fresh: bool = False) -> None:
    """Extract what Paddle's loader would extract on first use, so a read-only cache works. A folder already
    unpacked is kept, unless `fresh` (a restore: its content must come from the verified archive alone).
    Extracted into a temp folder beside, then swapped in: never seen half-extracted; readable by all."""
    for d in datasets:
        for archive, into, marker in d.unpack:
            folder = dest / d.module / into
            if not fresh and (folder / marker).exists():
                _readable(_share, folder)   # unpacked before fleetbox made folders 0755
                continue
            log(f"unpacking {d.module}/{archive} into {d.module}/{into}/ (as Paddle's loader would)")
            staging = Path(tempfile.mkdtemp(prefix=f".{into}-", dir=dest / d.module))
            old = staging.with_name(staging.name + "-old")
            try:
                with tarfile.open(dest / d.module / archive) as tar:
                    safe_extract(tar, staging)
                _share(staging)   # mkdtemp made it 0700; the archive may carry private modes too
                if folder.exists() or folder.is_symlink():
                    folder.replace(old)
                staging.replace(folder)
            except (tarfile.TarError, OSError, UserError) as e:
                raise UserError(f"cannot unpack {d.module}/{archive}: {e}") from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)
                _remove(old)


def _row(f: DataFile, path: Path, status: str, seconds: float) -> dict:
    size = path.stat().st_size if path.exists() else 0
    return {"dataset": f.dataset, "file": f.relpath, "bytes": size, "status": status, "seconds": seconds}


def check(datasets: list[Dataset], dest: Path) -> list[dict]:
    """Re-check what is in the cache: ok, missing or bad (MD5 differs)."""
    _folder(dest)
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
    """One archive with the verified files and their checksums (temp name, then rename). It holds the
    files' contents, also where the cache holds links to them; not unpacked folders: a restore makes those
    anew from the verified archives."""
    _folder(dest)
    if not datasets:
        raise UserError(f"nothing to pack: no data set is seeded in {dest}; seed one with "
                        f"`invoke cache --datasets NAME`")
    require(datasets, dest)
    index = {"format": 1, "files": {}}
    for d in datasets:
        for f in d.files:
            p = dest / f.relpath
            index["files"][f.relpath] = {"md5": f.md5, "sha256": fetch.file_digest(p), "bytes": p.stat().st_size,
                                         "dataset": f.dataset}
    mode = "w:gz" if out.name.endswith((".tgz", ".tar.gz")) else "w"
    try:   # Ctrl-C included: no half-written pack is left behind
        with files.atomic(out) as part, tarfile.open(part, mode, dereference=True) as tar:   # links: their targets
            blob = json.dumps(index, indent=1, sort_keys=True).encode()
            info = tarfile.TarInfo(PACK_INDEX)
            info.size, info.mtime = len(blob), int(time.time())
            tar.addfile(info, io.BytesIO(blob))
            for rel in index["files"]:
                tar.add(dest / rel, arcname=f"dataset/{rel}", recursive=False)
        return out
    except BaseException as e:
        if isinstance(e, OSError):
            raise UserError(f"cannot write {out}: {e.strerror}") from None
        raise


PACK_RATIO, PACK_SLACK = 2, 4 << 20   # how much larger than its pack a pack's files may be
PACK_INDEX_MAX = 1 << 20               # an index names each file once: a few KiB for every data set we know


def restore(archive: Path, dest: Path, manifest: dict[str, Dataset] | None = None, log=print) -> list[dict]:
    """Restore a cache archive into `dest`. Only the manifest's files are accepted, each checked against the
    manifest's MD5 and the pack's SHA-256, in a temp folder; they move into place only when all passed, so a
    bad pack leaves `dest` as it was. Unpacked folders are then made anew from the verified archives."""
    manifest = load() if manifest is None else manifest
    if not archive.is_file():
        raise UserError(f"no such archive: {archive}")
    base = _folder(dest)
    staging = None
    try:
        # In dest or the folder that will hold it: the same file system, so moving into place is a rename.
        staging = Path(tempfile.mkdtemp(prefix=".restore-", dir=base))
        try:
            rows = _verified_copy(archive, staging, {f.relpath: f for d in manifest.values() for f in d.files})
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as e:
            raise UserError(f"{archive} is damaged or truncated ({' '.join(str(e).split())})") from None
        except OSError as e:
            if e.errno is None:   # gzip and bz2 report bad data so; a failed write always has an errno
                raise UserError(f"{archive} is damaged or truncated ({e})") from None
            raise
        for r in rows:   # every check passed: move into place
            target = dest / r["file"]
            _mkdir(target.parent)
            (staging / r["file"]).replace(target)
    except OSError as e:
        raise UserError(f"cannot restore into {dest}: {e.strerror}") from None
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    restored = {r["file"] for r in rows}
    unpack = [d for d in manifest.values() if d.unpack and all(f"{d.module}/{a}" in restored for a, *_ in d.unpack)]
    unpack_all(unpack, dest, log, fresh=True)
    return rows


def _index(blob: bytes, archive: Path) -> dict[str, dict]:
    """The pack's {relpath: {"md5", "sha256", ...}}, or one line saying it is not one."""
    try:
        files = json.loads(blob)["files"]
        ok = isinstance(files, dict) and all(
            isinstance(m, dict) and isinstance(m.get("md5"), str) and isinstance(m.get("sha256"), str)
            and type(m.get("bytes")) is int for m in files.values())
    except (ValueError, TypeError, KeyError):   # ValueError: not JSON, or not UTF-8
        ok = False
    if not ok:
        raise UserError(f"{archive}: its {PACK_INDEX} is not a cache index; make the pack again with "
                        f"`invoke cache --pack`")
    return files


def _verified_copy(archive: Path, staging: Path, known: dict[str, DataFile]) -> list[dict]:
    """Copy the pack's files into `staging` (0644), refusing anything but the manifest's files and any
    checksum that differs. Returns a row per file."""
    try:
        tar = tarfile.open(archive)
    except tarfile.TarError:   # its message lists every compression tried, over several lines
        raise UserError(f"{archive} is not a readable archive (damaged, truncated or not a tar file)") from None
    with tar:
        members = tar.getmembers()
        names = [safe_member(m) for m in members]
        if PACK_INDEX not in names:
            raise UserError(f"{archive} has no {PACK_INDEX}: not made by `invoke cache --pack`")
        # Before a byte is read or written: the data sets' files are compressed already, so their pack, gzipped or
        # not, is about their size; a few KiB that unpack to GiBs (a bomb, its index too) are no pack of them.
        unpacked, packed = sum(m.size for m in members if m.isfile()), archive.stat().st_size
        if unpacked > PACK_RATIO * packed + PACK_SLACK:
            raise UserError(f"refusing archive: {archive.name} ({packed} bytes) would unpack to {unpacked} bytes; "
                            f"a pack of data set files, compressed already, is about their size")
        held = members[names.index(PACK_INDEX)]
        if held.size > PACK_INDEX_MAX:
            raise UserError(f"refusing archive: its {PACK_INDEX} is {held.size} bytes; a cache index is a few KiB")
        index = _index((tar.extractfile(held) or io.BytesIO()).read(), archive)
        rows = {}
        for m, name in zip(members, names):
            if m.isdir() or name == PACK_INDEX:
                continue
            rel = name.removeprefix("dataset/")
            f = known.get(rel) if name.startswith("dataset/") else None
            if f is None:   # e.g. an unpacked folder's file: those are made here from the verified archives
                raise UserError(f"refusing archive: member {name!r} is no data set's file in the manifest")
            meta = index.get(rel)
            if meta is None or rel in rows:
                raise UserError(f"refusing archive: member {name!r} is not listed once in its {PACK_INDEX}")
            if meta["md5"] != f.md5:
                raise UserError(f"refusing archive: {rel} has MD5 {meta['md5']}, Paddle expects {f.md5}")
            if m.size != meta["bytes"]:   # before writing
                raise UserError(f"refusing archive: {rel} holds {m.size} bytes, its {PACK_INDEX} in {archive.name} "
                                f"says {meta['bytes']}")
            out = staging / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            md5, sha = hashlib.md5(), hashlib.sha256()
            with tar.extractfile(m) as src, open(out, "wb") as dst:
                while chunk := src.read(fetch.CHUNK):
                    md5.update(chunk)
                    sha.update(chunk)
                    dst.write(chunk)
            if md5.hexdigest() != f.md5 or sha.hexdigest() != meta["sha256"]:
                raise UserError(f"refusing archive: {rel} does not match its checksum in {archive.name}")
            out.chmod(0o644)
            rows[rel] = {"dataset": f.dataset, "file": rel, "bytes": m.size, "status": "restored", "seconds": 0.0}
    missing = sorted(set(index) - set(rows))
    if missing:
        raise UserError(f"refusing archive: {missing[0]} is listed in its {PACK_INDEX} but missing (truncated?)")
    if not rows:
        raise UserError(f"{archive} holds no files to restore")
    return list(rows.values())


def cache_command(datasets=None, mirror=None, dest=None, verify=False, pack_to=None, restore_from=None,
                  manifest=None, jobs=4, log=print) -> None:
    """`invoke cache`: restore a pack, pack, verify, or seed (in that order of precedence)."""
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
