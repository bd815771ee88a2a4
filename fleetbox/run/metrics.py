"""Host side of the metrics protocol (incontainer/fleetbox_metrics.py): every rank's lines, from every node's
worker logs and found metrics (incontainer/fleetbox_found.py) of every attempt and allocation, into
runs/<job>/metrics.jsonl."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from fleetbox import files
from fleetbox.incontainer.fleetbox_found import FILE as FOUND
from fleetbox.incontainer.fleetbox_found import PREFIX  # the writers', so writers and reader stay one protocol
from fleetbox.run.jobfolder import JobFolder


def attempts(job_dir: Path) -> list[tuple[int, Path]]:
    """(attempt, folder holding its node folders): earlier attempts in their folders (Docker's attempt<N>/,
    Slurm's alloc<N>/ = attempt N-1), the last one in the job folder itself."""
    return JobFolder.at(job_dir).attempts()


def metric_logs(job_dir: Path) -> list[tuple[int, int, Path]]:
    """(attempt, node, file) for every file of metrics lines of every attempt: each node's worker logs (a script's
    own lines) and the metrics found in its ranks' training."""
    return sorted(node_files(job_dir, "workerlog.*") + node_files(job_dir, FOUND.format(rank="*")))


def node_files(job_dir: Path, pattern: str) -> list[tuple[int, int, Path]]:
    """(attempt, node, file) for every file of every attempt's node folders that matches `pattern` (a glob)."""
    return JobFolder.at(job_dir).node_files(pattern)


# the optional fields the report adds up
NUMBERS = ("loss", "samples_per_s", "comm_seconds", "own_seconds", "samples", "seconds")
_scan = json.JSONDecoder().scan_once


def parse(line: str) -> dict | None:
    """A worker log line's metrics record, or None (another line, one cut short by a killed worker, a malformed
    one)."""
    if not line.startswith(PREFIX):
        return None
    text = line[len(PREFIX):].strip()
    try:
        rec, end = _scan(text, 0)   # json.loads without its checks around the C scanner: a million lines
    except (StopIteration, ValueError):
        return None
    return rec if end == len(text) and well_formed(rec) else None


FIELDS = ("rank", "step", "time", "node", "attempt", *NUMBERS)   # what a Record holds in its own slots
_FIELDS = frozenset(FIELDS)


class Record(Mapping):
    """A metrics record as the report holds a long job's (a million): its fields in slots, where a dict each was
    most of the report's memory, read as a mapping (r["loss"], "loss" in r at attribute speed; Mapping gives get,
    keys, values and ==); the script's own fields in `_extra`. `_text`: its JSON as the rank printed it, which the
    gather writes again rather than encode the record anew."""
    __slots__ = (*FIELDS, "_extra", "_text")

    def __init__(self, rec: dict, text: str, node: int, attempt: int, _set=object.__setattr__):
        extra = None
        for k, v in rec.items():
            if k in _FIELDS:
                _set(self, k, v)
            elif extra is None:
                extra = {k: v}
            else:
                extra[k] = v
        if extra is not None:
            self._extra = extra
        self.node, self.attempt, self._text = node, attempt, text

    def __getitem__(self, key: str):
        try:
            return getattr(self, key) if key in _FIELDS else self._extras()[key]
        except AttributeError:   # an unset slot
            raise KeyError(key) from None

    def __contains__(self, key: str) -> bool:
        return hasattr(self, key) if key in _FIELDS else key in self._extras()

    def _extras(self) -> dict:
        return getattr(self, "_extra", {})

    def items(self) -> list[tuple[str, object]]:
        return [(k, getattr(self, k)) for k in FIELDS if hasattr(self, k)] + list(self._extras().items())

    def __iter__(self):
        return (k for k, _ in self.items())

    def __len__(self) -> int:
        return len(self.items())



def read(job_dir: Path) -> list[Record]:   # each a Mapping, as the dicts it was
    """The job's metrics lines, each with its node and attempt (the folder's, whatever the line says), in time
    order."""
    out = []
    for attempt, node, log in metric_logs(job_dir):
        with open(log, errors="replace") as f:   # a line at a time: a week's log is not held whole
            for line in f:
                if (rec := parse(line)) is not None:
                    out.append(Record(rec, line[len(PREFIX):].strip(), node, attempt))
    out.sort(key=lambda r: (r.attempt, r.time))
    return out




INT64 = (-2**63, 2**63)


def number(x) -> bool:
    """A JSON number a float holds (NaN passes: a loss that went NaN is worth seeing); not a bool."""
    if type(x) is float:
        return True
    if type(x) is not int:
        return False
    try:
        float(x)
    except OverflowError:
        return False
    return True


def well_formed(rec) -> bool:
    """A metrics record the report can use: whole rank and step (int64, as VisualDL keeps them), a finite time, and
    numbers where it gives numbers (a script's malformed line is left out, never a traceback after the job). Once
    for every line of a long job: plain tests, no generators."""
    if type(rec) is not dict:
        return False
    rank, step, t = rec.get("rank"), rec.get("step"), rec.get("time")
    if type(rank) is not int or type(step) is not int or not (INT64[0] <= rank < INT64[1] and
                                                               INT64[0] <= step < INT64[1]):
        return False
    if not number(t) or not math.isfinite(t):
        return False
    for k in NUMBERS:
        if type(v := rec.get(k, 0.0)) is not float and not number(v):   # most are floats (absent: one)
            return False
    return True


def collect(job_dir: Path, recs: list[dict] | None = None) -> Path | None:
    """Write runs/<job>/metrics.jsonl (complete or absent) from `recs` (default: read them), each record's JSON
    text let go once written; None when no script printed metrics."""
    recs = read(job_dir) if recs is None else recs
    if not recs:
        return None
    with files.atomic(job_dir / "metrics.jsonl") as part, open(part, "w") as f:
        for r in recs:   # a line at a time: never the whole file in memory
            text = getattr(r, "_text", None)   # the rank's own object (never empty: it has a rank), ours added
            f.write(f'{text[:-1]}, "node": {r["node"]}, "attempt": {r["attempt"]}}}\n' if text else
                    json.dumps(dict(r.items())) + "\n")
            if text:   # written: what reads the records from here on reads their fields (the text was a third)
                del r._text
    return job_dir / "metrics.jsonl"
