"""A job's folder (runs/<job-id>/) as its backend lays it out: where each attempt's node folders are, and each
node's own output. Backends declare their Layout (Backend.layout); everything else (metrics, the report, the
board, doctor) reads a job's folder through JobFolder, never by a backend's file names.

The last attempt's node folders are in the job folder itself; an earlier attempt's are in the folder its
layout names (fleetbox's default: attempt<N>/ from 0; Slurm's: alloc<N>/ from 1).
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from fleetbox.run.records import HANDLE, JOB

LAYOUTS: dict[str, Layout] = {}   # by backend name; run/backends registers each backend's
RECORD_MAX = 1 << 20              # a handle.json or job.json is a few hundred bytes


@dataclass(frozen=True)
class Layout:
    """Where a backend puts a job's files, as patterns in which <N> is an attempt's number and <k> a node's
    rank. A backend with other files than these extends it (Slurm's reads its allocations' start times).
    The defaults are fleetbox's default layout, the one a backend that declares none has (Backend.layout); a
    backend that declares its own names every place itself, so that these may change without moving its files."""
    earlier: str = "attempt<N>"   # an earlier attempt's folder, in the job folder (it may be nested: tries/<N>)
    first: int = 0                # the <N> of the first attempt's folder
    node: str = "node<k>"         # a node's folder in an attempt's: its worker logs, progress, stacks
    output: str = "node<k>/container.log"   # a node's own output, in an attempt's: what `invoke logs` shows
    entries: dict = field(default_factory=dict, hash=False)   # what else the backend leaves: {pattern: what}

    def __post_init__(self):
        """A pattern that names no place, or one outside the job's folder, would be found wrong after the job
        ran (its metrics gathered from nowhere): refused when the backend is declared."""
        for name, text, needs in (("earlier", self.earlier.rpartition("/")[2], "<N>"), ("node", self.node, "<k>"),
                                  ("output", self.output, "<k>")):
            if needs not in text:
                raise ValueError(f"Layout {name}={text!r} must hold {needs}")
        for name in ("earlier", "node", "output"):
            path = getattr(self, name)
            if path.startswith("/") or ".." in path.split("/") or "<N>" in path.rpartition("/")[0]:
                raise ValueError(f"Layout {name}={path!r} must be a path inside the job's folder (<N> in its last "
                                 f"part)")

    def attempt_name(self, attempt: int) -> str:
        """The name of an attempt (0: the first), as its folder is named once it is an earlier one."""
        return self.earlier.rpartition("/")[2].replace("<N>", str(attempt + self.first))

    def starts(self, job_dir: Path, job: dict) -> tuple[float | None, float | None]:
        """When the first attempt and the last one began, as far as the folder says (job.json)."""
        def when(t):
            return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and t else None
        last = when(job.get("started"))
        return when(job.get("first_started")) or last, last


def _numbered(parent: Path, pattern: str, place: str) -> list[tuple[int, Path]]:
    """(number, folder) of each folder in `parent` whose name is `pattern` with a number at <`place`>."""
    rx = re.compile(re.escape(pattern).replace(re.escape(f"<{place}>"), r"(\d+)"))
    return [(int(m[1]), d) for d in (parent.iterdir() if parent.is_dir() else [])
            if (m := rx.fullmatch(d.name)) and d.is_dir()]


class JobFolder:
    """A job's folder read through its backend's layout (`at`: the one its records name)."""

    def __init__(self, path: Path, layouts: tuple[Layout, ...]):
        self.path, self.layouts = Path(path), layouts

    @classmethod
    def at(cls, path: Path) -> JobFolder:
        """The folder with its backend's layout, as its handle.json or job.json name the backend. A folder that
        names none, or one this fleetbox does not have, is read with every known layout (the union)."""
        path = Path(path)
        for record in (HANDLE, JOB):
            try:   # a record, not whatever stands under its name (a FIFO: not waited on; a link to a device)
                with open(os.open(path / record, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                        continue
                    name = json.loads(f.read(RECORD_MAX)).get("backend")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(name, str) and name in LAYOUTS:
                return cls(path, (LAYOUTS[name],))
        union = []
        for layout in LAYOUTS.values():
            if layout not in union:
                union.append(layout)
        return cls(path, tuple(union) or (Layout(),))

    @property
    def layout(self) -> Layout:
        return self.layouts[0]

    def attempts(self) -> list[tuple[int, Path]]:
        """(attempt, folder holding its node folders): earlier attempts in their folders, the last one in the job
        folder itself."""
        found = {}
        for layout in self.layouts:
            parent, _, leaf = layout.earlier.rpartition("/")
            for n, d in _numbered(self.path / parent, leaf, "N"):
                found.setdefault(n - layout.first, d)
        return sorted(found.items()) + [(len(found), self.path)]

    def nodes(self, attempt_dir: Path) -> list[tuple[int, Path]]:
        """(rank, folder) of every node folder in an attempt's folder."""
        found = {}
        for layout in self.layouts:
            for k, d in _numbered(attempt_dir, layout.node, "k"):
                found.setdefault(k, d)
        return sorted(found.items())

    def node_files(self, pattern: str) -> list[tuple[int, int, Path]]:
        """(attempt, node, file) for every file of every attempt's node folders that matches `pattern` (a glob)."""
        return [(attempt, k, f) for attempt, d in self.attempts() for k, node_dir in self.nodes(d)
                for f in sorted(node_dir.glob(pattern)) if f.is_file()]

    def output(self, node: int, attempt_dir: Path | None = None) -> Path:
        """A node's own output (of the last attempt, unless its folder is given)."""
        return (attempt_dir or self.path) / self.layout.output.replace("<k>", str(node))

    def starts(self, job: dict) -> tuple[float | None, float | None]:
        """When the job's first attempt and its last one began, as far as its folder says."""
        return self.layout.starts(self.path, job)
