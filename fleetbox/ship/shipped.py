"""What was shipped of each variant's image, and from which build: one record per export file (`invoke export`,
any --dest) and per registry push (`invoke push`), each naming the image's content tag, so that `train` on a
cluster runs exactly the image built here, or says which command makes it.

Records live in exports/records/ (FLEETBOX_EXPORTS), one JSON file per destination: exporting or pushing to the
same place again replaces its record. A record counts only while what it names is still there as it was made
(an export file of the same size and modification time; a folder holding the same image, its freeze file the
same); a registry reference is trusted as pushed.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fleetbox import engine, files, settings
from fleetbox.errors import UserError
from fleetbox.image import built
from fleetbox.image.matrix import Variant

REGISTRY = "registry"   # a record's kind for a pushed reference; the others are export kinds (export_kind)


@dataclass(frozen=True)
class Shipped:
    variant: str
    kind: str            # an export kind (sif, sqsh, charliecloud, charliecloud-squash, docker-archive) or registry
    content_tag: str     # the image's content tag, <image>:<variant>-<hash>
    where: str           # the export's absolute path, or HOST[:PORT]/NS/NAME:TAG in a registry
    made: float          # when (epoch seconds)
    size: int = -1       # an export file's size and mtime when it was made (-1: a folder, or a registry)
    mtime_ns: int = -1
    freeze: str = ""     # a folder export's: the sha256 of its image's freeze file (settings.FREEZE), "" if none

    def well_formed(self) -> bool:
        """Every field of the type it is declared with (a record edited by hand, or damaged, is none)."""
        numbers = (self.made, self.size, self.mtime_ns)
        return all(isinstance(v, str) for v in (self.variant, self.kind, self.content_tag, self.where,
                                                 self.freeze)) and \
            all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) and \
            all(isinstance(v, int) for v in numbers[1:])

    def present(self) -> bool:
        """What the record names is still there, unchanged (a file replaced since is not this export)."""
        if self.kind == REGISTRY:
            return True
        p = Path(self.where)
        if self.size < 0:   # a folder: the image's own packages in it, as they were (a folder that merely exists,
            return bool(self.freeze) and freeze_digest(p) == self.freeze   # emptied or replaced, is not it)
        try:
            st = p.stat()
        except OSError:
            return False
        return p.is_file() and (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns)


def freeze_digest(folder: Path) -> str:
    """The sha256 of the freeze file in an image's folder (its packages, as the last layer wrote them), "" where it
    has none."""
    try:
        return hashlib.sha256((folder / settings.FREEZE.lstrip("/")).read_bytes()).hexdigest()
    except OSError:
        return ""


def records_dir() -> Path:
    return settings.exports_dir() / "records"


def record(variant: Variant, kind: str, content_tag: str, where: str) -> Shipped:
    """Write (or replace) the record of one export or push."""
    size = mtime = -1
    if kind != REGISTRY and Path(where).is_file():
        st = Path(where).stat()
        size, mtime = st.st_size, st.st_mtime_ns
    freeze = freeze_digest(Path(where)) if kind != REGISTRY and Path(where).is_dir() else ""
    s = Shipped(variant.name, kind, content_tag, where, time.time(), size, mtime, freeze)
    name = f"{variant.name}-{kind}-{hashlib.sha256(where.encode()).hexdigest()[:16]}.json"
    records_dir().mkdir(parents=True, exist_ok=True)
    files.write_json(records_dir() / name, asdict(s))
    return s


def load(variant: Variant) -> list[Shipped]:
    """The variant's records whose export or push is still there, newest first (damaged records are skipped:
    they name nothing that can be trusted)."""
    out = []
    for p in sorted(records_dir().glob(f"{variant.name}-*.json")):
        data = files.read_json(p)
        try:
            s = Shipped(**data)
        except TypeError:
            continue
        if not s.well_formed():
            continue
        if s.variant == variant.name and s.content_tag and s.present():
            out.append(s)
    return sorted(out, key=lambda s: -s.made)


def built_here(variant: Variant) -> str | None:
    """The content tag of the variant's image built on this machine, or None where no engine answers or none is
    built (a login node that only holds exports)."""
    try:
        return built.content_tag(built.resolve(engine.client(), variant), variant)
    except UserError:
        return None
