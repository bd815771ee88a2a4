"""Extracting archives that may be hostile: nothing lands outside the target folder, no links, no devices."""

from __future__ import annotations

import tarfile
from pathlib import Path, PurePosixPath

from fleetbox.errors import UserError


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract refusing absolute paths, '..', links, special files and sparse files, all checked before anything
    is written; tarfile's "data" filter too where this Python has it (3.11.4+)."""
    members = tar.getmembers()
    for m in members:
        safe_member(m)
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
        return
    tar.extractall(dest, members=members)


def safe_member(m: tarfile.TarInfo) -> str:
    """The member's path, or a clear refusal (absolute, climbing out with '..', a link, a special file)."""
    p = PurePosixPath(m.name)
    if p.is_absolute() or m.name.startswith("/"):
        raise UserError(f"refusing archive: member {m.name!r} has an absolute path")
    if ".." in p.parts:
        raise UserError(f"refusing archive: member {m.name!r} climbs out with '..'")
    if m.issparse():   # a few KiB in the archive that write as many GiB as its header says
        raise UserError(f"refusing archive: member {m.name!r} is a sparse file")
    if m.issym() or m.islnk():
        raise UserError(f"refusing archive: member {m.name!r} is a link ({m.linkname!r})")
    if not (m.isfile() or m.isdir()):
        raise UserError(f"refusing archive: member {m.name!r} is not a regular file")
    return str(p)
