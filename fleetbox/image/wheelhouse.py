"""Offline wheelhouse per variant: the exact wheels of the lock, hash-checked, for a build with no network.

The folder (`wheelhouse/<variant>/`) holds the wheels, a copy of the lock and `manifest.json`; it can be
copied to an air-gapped machine and built there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urldefrag, urljoin

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from fleetbox import files, settings
from fleetbox.data import fetch
from fleetbox.errors import UserError
from fleetbox.image import locks
from fleetbox.image.matrix import Variant

MANIFEST = "manifest.json"
LOCK_COPY = "requirements.lock"


def default_dir(variant: Variant) -> Path:
    return settings.wheelhouse_root() / variant.name


def platforms(platform_tag: str) -> list[str]:
    """The platform tags a base with this glibc accepts, best first (as pip does on such a host)."""
    head, _, arch = platform_tag.partition("_2_")
    minor, _, arch = arch.partition("_")
    if head != "manylinux":
        raise UserError(f"unsupported platform tag {platform_tag!r}")
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    out = []
    for m in range(int(minor), 4, -1):
        out.append(f"manylinux_2_{m}_{arch}")
        if m in legacy:
            out.append(f"{legacy[m]}_{arch}")
    return out + [f"linux_{arch}"]   # Paddle's own index publishes linux_x86_64 GPU wheels


def target_tags(variant: Variant) -> list[Tag]:
    pyver = tuple(int(x) for x in variant.python_version.split("."))
    plats = platforms(variant.platform)
    return [*cpython_tags(pyver, platforms=plats), *compatible_tags(pyver, f"cp{pyver[0]}{pyver[1]}", plats)]


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    url: str
    sha256: str


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def index_files(sess, index: str, name: str) -> list[tuple[str, str, str]]:
    """(filename, url, sha256) for every file a PEP 503/691 simple index lists for `name`."""
    url = urljoin(index.rstrip("/") + "/", canonicalize_name(name) + "/")
    try:
        r = sess.get(url, timeout=60, headers={
            "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    except fetch.requests.RequestException as e:
        raise UserError(f"cannot reach index {index} ({type(e).__name__})") from None
    if r.status_code == 404:
        raise UserError(f"{name} is not on index {index}")
    r.raise_for_status()
    if r.headers.get("Content-Type", "").startswith("application/vnd.pypi.simple.v1+json"):
        return [(f["filename"], urljoin(url, f["url"]), f.get("hashes", {}).get("sha256", ""))
                for f in r.json()["files"]]
    parser = _Links()
    parser.feed(r.text)
    out = []
    for text, href in parser.links:
        link, frag = urldefrag(urljoin(url, href))
        sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else ""
        out.append((text or link.rsplit("/", 1)[-1], link, sha))
    return out


def select(entry: locks.Locked, files, tags: list[Tag]) -> Wheel:
    """The locked wheel for these tags: right name and version, a locked hash, the best-ranked tag."""
    rank = {t: i for i, t in enumerate(tags)}
    best = None
    for filename, url, sha in files:
        if not filename.endswith(".whl") or sha not in entry.hashes:
            continue
        try:
            name, version, _, wtags = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            continue
        score = min((rank[t] for t in wtags if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, Wheel(str(name), str(version), filename, url, sha))
    if best is None:
        raise UserError(f"no wheel of {entry.name}=={entry.version} with a locked hash fits "
                        f"{tags[0]} on {entry.index}")
    return best[1]


def plan(variant: Variant, entries: list[locks.Locked], sess=None) -> list[Wheel]:
    sess = sess or fetch.session()
    tags = target_tags(variant)
    return [select(e, index_files(sess, e.index or variant.index_for(e.name), e.name), tags) for e in entries]


def check_wheel(variant: Variant, path: Path, entries: list[locks.Locked],
                tags: list[Tag] | None = None) -> locks.Locked:
    """A wheelhouse file must be for the variant's Python/platform and carry a locked hash; returns its entry."""
    tags = tags or target_tags(variant)
    try:
        name, version, _, wtags = parse_wheel_filename(path.name)
    except InvalidWheelFilename:
        raise UserError(f"{path.name} is not a wheel") from None
    if not set(wtags) & set(tags):
        raise UserError(f"{path.name} is for {', '.join(sorted(map(str, wtags)))}, not variant {variant.name}'s "
                        f"Python {variant.python_version} on {variant.platform}")
    entry = next((e for e in entries if canonicalize_name(e.name) == name), None)
    if entry is None or str(version) != entry.version:
        raise UserError(f"{path.name} is not in lock {variant.lock_path.name}")
    digest = fetch.file_digest(path)
    if digest not in entry.hashes:
        raise UserError(f"{path} has sha256 {digest[:16]}…, which lock {variant.lock_path.name} does not allow; "
                        f"delete it and run `invoke wheels --variant {variant.name}`")
    return entry


def _read_manifest(manifest: Path, again: str) -> dict:
    """The manifest as ensure() writes it; anything else (a torn write, an edit) makes the wheelhouse incomplete."""
    try:
        data = json.loads(manifest.read_text())
        ok = (isinstance(data["lock_sha256"], str) and isinstance(data["files"], dict)
              and all(f == Path(f).name and f.endswith(".whl") for f in data["files"]))   # no paths out of dest
    except (OSError, ValueError, KeyError, TypeError):   # ValueError: bad JSON or bad UTF-8
        ok = False
    if not ok:
        raise UserError(f"wheelhouse manifest {manifest} is corrupt; {again}")
    return data


def verify(variant: Variant, dest: Path, lock_text: str, entries: list[locks.Locked]) -> list[Path]:
    """The wheelhouse's files, after checking it was made from this lock and holds exactly one right wheel
    per lock entry (a count alone would pass two wheels of one package and none of another)."""
    manifest = dest / MANIFEST
    again = f"run `invoke wheels --variant {variant.name}`"
    if not manifest.exists():
        raise UserError(f"no wheelhouse for {variant.name} at {dest}; {again}")
    data = _read_manifest(manifest, again)
    if data["lock_sha256"] != locks.lock_hash(lock_text):
        raise UserError(f"wheelhouse {dest} was made from another lock; {again}")
    tags = target_tags(variant)
    found: dict[tuple[str, str], list[Path]] = {}
    for filename in data["files"]:
        path = dest / filename
        if not path.exists():
            raise UserError(f"wheelhouse lacks {filename}; {again}")
        entry = check_wheel(variant, path, entries, tags)
        found.setdefault((entry.name, entry.version), []).append(path)
    for e in entries:
        wheels = found.get((e.name, e.version), [])
        if len(wheels) != 1:
            what = "no wheel" if not wheels else f"{len(wheels)} wheels ({', '.join(w.name for w in wheels)})"
            raise UserError(f"wheelhouse {dest} has {what} for {e.name}=={e.version}, not one; {again}")
    return [w for ws in found.values() for w in ws]


def ensure(variant: Variant, dest: Path | None = None, log=print) -> Path:
    """Download the lock's wheels into `dest` (reused when already complete). Returns the folder."""
    dest = dest or default_dir(variant)
    lock_text, entries = locks.read(variant)
    try:
        verify(variant, dest, lock_text, entries)
        log(f"wheelhouse {dest} is complete ({len(entries)} wheels); reused")
        return dest
    except UserError:
        pass
    sess = fetch.session()
    log(f"resolving {len(entries)} locked wheels for {variant.name} "
        f"(Python {variant.python_version}, {variant.platform})")
    wheels = plan(variant, entries, sess)
    dest.mkdir(parents=True, exist_ok=True)
    for i, w in enumerate(wheels, 1):
        log(f"[{i}/{len(wheels)}] {w.filename}")
        fetch.download(w.url, dest / w.filename, w.sha256, sess=sess)
    files.write_atomic(dest / LOCK_COPY, lock_text)
    files.write_json(dest / MANIFEST, {"variant": variant.name, "lock_sha256": locks.lock_hash(lock_text),
                                       "files": {w.filename: w.sha256 for w in wheels}},
                     sort_keys=True)   # the manifest last: a wheelhouse without one is incomplete
    verify(variant, dest, lock_text, entries)
    total = sum((dest / w.filename).stat().st_size for w in wheels)
    log(f"wheelhouse {dest}: {len(wheels)} wheels, {total / 2**20:.0f} MiB, all sha256 verified")
    return dest
