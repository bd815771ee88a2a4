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


def parse(line: str) -> dict | None:
    """A worker log line's metrics record, or None (another line, one cut short by a killed worker, a malformed
    one)."""
    if not line.startswith(PREFIX):
        return None
    try:
        rec = json.loads(line[len(PREFIX):])
    except ValueError:
        return None
    return rec if well_formed(rec) else None


def read(job_dir: Path) -> list[dict]:
    """The job's metrics lines, each with its node and attempt (the folder's, whatever the line says), in time
    order."""
    out = []
    for attempt, node, log in worker_logs(job_dir):
        for line in log.read_text(errors="replace").splitlines():
            if (rec := parse(line)) is not None:
                out.append({**rec, "node": node, "attempt": attempt})
    out.sort(key=lambda r: (r["attempt"], r["time"]))
    return out


# the optional fields the report adds up
NUMBERS = ("loss", "samples_per_s", "comm_seconds", "own_seconds", "samples", "seconds")


def well_formed(rec) -> bool:
    """A metrics record the report can use: whole rank and step (int64, as VisualDL keeps them), a finite time, and
    numbers where it gives numbers (a script's malformed line is left out, never a traceback after the job)."""
    def number(x):   # NaN passes (a loss that went NaN is worth seeing); a number no float holds does not
        try:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and (float(x) or True)
        except OverflowError:
            return False
    return isinstance(rec, dict) and all(isinstance(rec.get(k), int) and not isinstance(rec.get(k), bool)
                                         and -2**63 <= rec[k] < 2**63 for k in ("rank", "step")) \
        and number(rec.get("time")) and math.isfinite(rec["time"]) and all(number(rec[k]) for k in NUMBERS if k in rec)


def collect(job_dir: Path, recs: list[dict] | None = None) -> Path | None:
    """Write runs/<job>/metrics.jsonl (complete or absent) from `recs` (default: read them); None when no script
    printed metrics."""
    recs = read(job_dir) if recs is None else recs
    if not recs:
        return None
    return files.write_atomic(job_dir / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
