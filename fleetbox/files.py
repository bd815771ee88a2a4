"""Files that are complete or absent: everything fleetbox writes under a final name is written beside it first
(`.<name>.part`) and renamed over it once whole, so a reader (another shell's `invoke jobs`, a crash, Ctrl-C)
never sees half a file. Downloads keep their own `.part` to resume from (data/fetch.py)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic(path: Path):
    """Yield the name to write to (for writers that take a path: a plot, a tool); on success it becomes `path`,
    on any error (Ctrl-C included) it is removed and `path` is left as it was."""
    path = Path(path)
    part = path.with_name(f".{path.name}.part")
    try:
        yield part
        os.replace(part, path)
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def write_atomic(path: Path, data: str | bytes) -> Path:
    with atomic(path) as part:
        if isinstance(data, bytes):
            part.write_bytes(data)
        else:
            part.write_text(data)
    return Path(path)


def write_json(path: Path, data, **dumps) -> Path:
    return write_atomic(path, json.dumps(data, **({"indent": 1} | dumps)))


def read_json(path: Path) -> dict:
    """A JSON object from `path`; {} when it is absent, unreadable or not an object (a view of a run that tolerates
    what is missing; records that must tell damage apart read through run/records.py)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
