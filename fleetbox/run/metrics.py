"""Host side of the metrics protocol (incontainer/fleetbox_metrics.py): every rank's lines, from every node's
worker logs of every attempt and allocation, into runs/<job>/metrics.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

from fleetbox import files
from fleetbox.incontainer.fleetbox_metrics import PREFIX  # the writer's, so writer and reader stay one protocol
from fleetbox.run.jobfolder import JobFolder


def attempts(job_dir: Path) -> list[tuple[int, Path]]:
    """(attempt, folder holding its node folders): earlier attempts in their folders (Docker's attempt<N>/,
    Slurm's alloc<N>/ = attempt N-1), the last one in the job folder itself."""
    return JobFolder.at(job_dir).attempts()


def worker_logs(job_dir: Path) -> list[tuple[int, int, Path]]:
    """(attempt, node, log) for every node's worker log of every attempt."""
    return node_files(job_dir, "workerlog.*")


def node_files(job_dir: Path, pattern: str) -> list[tuple[int, int, Path]]:
    """(attempt, node, file) for every file of every attempt's node folders that matches `pattern` (a glob)."""
    return JobFolder.at(job_dir).node_files(pattern)


_scan = json.JSONDecoder().scan_once


class Record(dict):
    """A metrics record, with its JSON as the rank printed it: the gather writes that again rather than encode the
    record anew (a long job has a million)."""
    __slots__ = ("text",)


def parse(line: str) -> Record | None:
    """A worker log line's metrics record, or None (another line, one cut short by a killed worker, a malformed
    one)."""
    if not line.startswith(PREFIX):
        return None
    text = line[len(PREFIX):].strip()
    try:
        rec, end = _scan(text, 0)   # json.loads without its checks around the C scanner: a million lines
    except (StopIteration, ValueError):
        return None
    if end != len(text) or not well_formed(rec):
        return None
    out = Record()
    for k, v in rec.items():   # the names every record shares, shared: a long job's records are most of memory
        out[_KEYS.get(k, k)] = v
    out.text = text
    return out


def read(job_dir: Path) -> list[dict]:
    """The job's metrics lines, each with its node and attempt (the folder's, whatever the line says), in time
    order."""
    out = []
    for attempt, node, log in worker_logs(job_dir):
        with open(log, errors="replace") as f:   # a line at a time: a week's log is not held whole
            for line in f:
                if (rec := parse(line.rstrip("\n"))) is not None:
                    rec["node"], rec["attempt"] = node, attempt
                    out.append(rec)
    out.sort(key=lambda r: (r["attempt"], r["time"]))
    return out


# the optional fields the report adds up
NUMBERS = ("loss", "samples_per_s", "comm_seconds", "own_seconds", "samples", "seconds")
_KEYS = {k: k for k in ("rank", "step", "time", "node", "attempt", *NUMBERS)}


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
        if k in rec and not number(rec[k]):
            return False
    return True


def collect(job_dir: Path, recs: list[dict] | None = None) -> Path | None:
    """Write runs/<job>/metrics.jsonl (complete or absent) from `recs` (default: read them); None when no script
    printed metrics."""
    recs = read(job_dir) if recs is None else recs
    if not recs:
        return None
    with files.atomic(job_dir / "metrics.jsonl") as part, open(part, "w") as f:
        for r in recs:   # a line at a time: never the whole file in memory
            text = getattr(r, "text", None)   # the rank's own object (never empty: it has a rank), ours added
            f.write(f'{text[:-1]}, "node": {r["node"]}, "attempt": {r["attempt"]}}}\n' if text else
                    json.dumps(r) + "\n")
    return job_dir / "metrics.jsonl"
