"""A job's metrics as VisualDL logs, for `invoke board`: VisualDL's record files, written here with the standard
library only, from what runs/<job>/ holds as it grows (every rank's metrics lines, attempts, hangs).

The runs (folders under the board's logdir, named as VisualDL lists them):

    <job>/attempt<N>/rank<r>   a rank in Docker's attempt N (attempt0 the first, each restart the next)
    <job>/alloc<N>/rank<r>     a rank in Slurm's allocation N (alloc1 the first)
    <job>/events               text: where each restart or allocation began, how each attempt ended, hangs,
                               stragglers (VisualDL's Text tab)

A rank's run has, each tagged train/<name> (one group of charts: VisualDL opens only its first group), every
scalar the rank logged (loss, samples_per_s, own_seconds, comm_seconds, the script's own), the Meter's `seconds` as
step_seconds, comm_share (comm_seconds / seconds), and `straggler`: 1 at a step where the rank's own work is a
straggler's against the others' (hang.stragglers over each rank's last STRAGGLER_STEPS steps, the rule the live
watcher and the report use), else 0.

The format (VisualDL 2.5.3's writer/record_writer.py and proto/record.proto): a file vdlrecords.<time>.log of
records, each an 8-byte little-endian length and then a `Record` protobuf {repeated Value values = 1}, where
Value is {int64 id = 1 (the step); string tag = 2; int64 timestamp = 3 (ms); float value = 4 | Text text = 12}
and Text is {string encoded_text_string = 1}. Few enough fields to encode by hand, so writing needs neither
protobuf nor VisualDL: the board's VisualDL server runs in its own environment (commands/board.py).
"""

from __future__ import annotations

import bisect
import math
import re
import statistics
import struct
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fleetbox import files
from fleetbox.run import backends, hang, metrics, records

EVENTS = "events"
GROUP = "train/"   # every chart in one group, as Paddle's own VisualDL callback tags them
FIXED = ("rank", "step", "time", "node", "attempt")   # a metrics line's place, not its values
RENAMED = {"seconds": "step_seconds"}                  # the Meter's `seconds` is the step's time


@dataclass(frozen=True)
class Point:
    tag: str
    step: int
    ms: int                  # wall clock, milliseconds
    value: float | str       # a scalar, or a text (the events run)


# -- the format --

def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1   # int64 as protobuf sends it: a negative step is ten bytes, as VisualDL's own writer makes
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


def _float32(x: float) -> bytes:
    try:
        return struct.pack("<f", x)
    except OverflowError:   # beyond float32: VisualDL's protobuf stores it as infinity
        return struct.pack("<f", math.copysign(math.inf, x))


def _record(tag: str, step: int, ms: int, one_value: bytes) -> bytes:
    """One record of a vdlrecords file: its length, then Record{values: [Value{step, tag, ms, one_value}]} (a zero
    step or time left out, as protobuf leaves out a field at its default)."""
    value = (_varint(1 << 3) + _varint(step) if step else b"") + _bytes(2, tag.encode()) \
        + (_varint(3 << 3) + _varint(ms) if ms else b"") + one_value
    rec = _bytes(1, value)
    return struct.pack("<Q", len(rec)) + rec


def record(p: Point) -> bytes:
    if isinstance(p.value, str):
        return _record(p.tag, p.step, p.ms, _bytes(12, _bytes(1, p.value.encode())))   # Text
    return _record(p.tag, p.step, p.ms, _varint(4 << 3 | 5) + _float32(p.value))       # float value


def display_name(name: str, ms: int) -> bytes:
    """The record VisualDL's LogWriter(display_name=...) starts a file with: the name its run is listed by (else
    the folder's whole path)."""
    return _record("meta_data_tag", 0, ms, _bytes(10, _bytes(1, name.encode())))


# -- a job's runs --

def attempt_label(attempts_are: str, attempt: int) -> str:
    """attempt<N> (restarts, numbered as runs/<job>/attempt<N>/) or alloc<N> (Slurm, numbered from 1 as alloc<N>/)."""
    return f"alloc{attempt + 1}" if attempts_are == "allocations" else f"attempt{attempt}"


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def scalars(rec: dict) -> dict[str, float]:
    """The scalars of one metrics line, by their VisualDL tag."""
    out = {GROUP + RENAMED.get(k, k): float(v) for k, v in rec.items() if k not in FIXED and _number(v)}
    if _number(rec.get("comm_seconds")) and _number(rec.get("seconds")) and rec["seconds"] > 0:
        out[GROUP + "comm_share"] = rec["comm_seconds"] / rec["seconds"]
    return out


def straggling(recs: list[dict], nranks: int) -> list[tuple[int, int, int, bool, float, float]]:
    """(rank, step, ms, straggles, own, others' median) at each step that every one of the attempt's `nranks`
    ranks has logged its own time for, once each has STRAGGLER_STEPS of them: a step's mark depends only on the
    steps up to it, so it never changes once written. Pure."""
    own: dict[int, dict[int, tuple[float, int]]] = defaultdict(dict)
    for r in recs:
        if _number(r.get("own_seconds")) and math.isfinite(r["own_seconds"]) and r["own_seconds"] >= 0:
            own[r["rank"]][r["step"]] = (float(r["own_seconds"]), int(r["time"] * 1000))
    if nranks < 2 or set(own) != set(range(nranks)):
        return []
    steps = sorted(set.intersection(*(set(v) for v in own.values())))
    order = {k: sorted(v) for k, v in own.items()}
    out = []
    for s in steps:
        window = {}
        for k, mine in order.items():
            upto = mine[max(0, (i := bisect.bisect_right(mine, s)) - hang.STRAGGLER_STEPS):i]
            if len(upto) < hang.STRAGGLER_STEPS:
                break
            window[k] = statistics.median(own[k][t][0] for t in upto)
        else:
            found = hang.stragglers(window)
            for k in sorted(window):
                others = statistics.median([t for j, t in window.items() if j != k])
                out.append((k, s, own[k][s][1], k in found, window[k], others))
    return out


def job_runs(recs: list[dict], prefix: str, attempts_are: str, nranks: int, ppn: int,
             ended: dict[int, str], hangs: dict[int, str]) -> dict[str, dict[str, list[Point]]]:
    """Every run of one job (`prefix`: its name on the board) from its metrics lines: {run: {tag: points}}, each
    tag's points in the order the rank logged them; the events run's under one tag per event (each said once).
    `ended`: how each finished attempt ended (summary.json); `hangs`: each hung attempt's verdict. Pure."""
    runs: dict[str, dict[str, list[Point]]] = defaultdict(lambda: defaultdict(list))
    events: list[tuple[int, Point]] = []   # (attempt, point), sorted by attempt then step
    by_attempt = defaultdict(list)
    for r in recs:
        by_attempt[r["attempt"]].append(r)
    for a, mine in sorted(by_attempt.items()):
        label = attempt_label(attempts_are, a)
        for r in mine:
            ms = int(r["time"] * 1000)
            for tag, v in scalars(r).items():
                runs[f"{prefix}/{label}/rank{r['rank']}"][tag].append(Point(tag, r["step"], ms, v))
        first = min(mine, key=lambda r: r["time"])
        if a:
            events.append((a, Point(f"{label}/began", first["step"], int(first["time"] * 1000),
                                    f"{label} began at step {first['step']}")))
        flagged = set()
        for k, s, ms, straggles, own, others in straggling(mine, nranks):
            runs[f"{prefix}/{label}/rank{k}"][GROUP + "straggler"].append(Point(GROUP + "straggler", s, ms,
                                                                                 float(straggles)))
            if straggles and k not in flagged:
                flagged.add(k)
                events.append((a, Point(f"{label}/straggler/rank{k}", s, ms, f"from step {s}: " + hang.straggler_line(
                    k, own, others, ppn, hang.STRAGGLER_STEPS))))
    for a in sorted(set(ended) | set(hangs)):
        mine = by_attempt.get(a, [])
        last = max(mine, key=lambda r: (r["step"], r["time"]), default=None)
        step, ms = (last["step"], int(last["time"] * 1000)) if last else (0, 0)
        label = attempt_label(attempts_are, a)
        if a in hangs:
            events.append((a, Point(f"{label}/hang", step, ms, hangs[a])))
        if a in ended:
            events.append((a, Point(f"{label}/ended", step, ms, f"{label} ended: {ended[a]}")))
    for _, p in sorted(events, key=lambda e: (e[0], e[1].step)):
        runs[f"{prefix}/{EVENTS}"][p.tag].append(Point(EVENTS, p.step, p.ms, p.value))
    return {run: dict(tags) for run, tags in runs.items()}


def read_job(job_dir: Path, prefix: str) -> dict[str, dict[str, list[Point]]]:
    """job_runs of what runs/<job>/ holds now (a job still running too: its workerlogs as far as written)."""
    job, summary = files.read_json(job_dir / records.JOB), files.read_json(job_dir / records.SUMMARY)
    attempts_are = summary.get("attempts_are") or getattr(backends.BACKENDS.get(job.get("backend")),
                                                          "attempts_are", "restarts")
    ppn = int(job.get("procs_per_node") or 1)
    ended = {int(a["attempt"]): str(a["ended"]) for a in summary.get("attempts", [])
             if isinstance(a, dict) and isinstance(a.get("attempt"), int) and a.get("ended")}
    hangs = {}
    for d in job_dir.glob("hang-*"):
        if (m := re.fullmatch(r"hang-(\d+)", d.name)) and (blame := d / "blame.txt").is_file():
            hangs[int(m.group(1))] = blame.read_text(errors="replace").strip().splitlines()[0] if blame.stat().st_size \
                else "hung"
    return job_runs(metrics.read(job_dir), prefix, attempts_are, int(job.get("nodes") or 0) * ppn, ppn, ended, hangs)


class Logs:
    """VisualDL logs under `root`, one folder per run, kept up with a job's runs by appending: each call writes the
    points each (run, tag) has gained since the last, so a run's file only grows, as VisualDL's reader expects."""

    def __init__(self, root: Path):
        self.root = root
        self.written: dict[tuple[str, str], int] = {}
        self.files: dict[str, Path] = {}

    def add(self, runs: dict[str, dict[str, list[Point]]]) -> int:
        """Append what is new; returns how many points that was."""
        total = 0
        for run, tags in sorted(runs.items()):
            new = []
            for tag, points in tags.items():
                done = self.written.get((run, tag), 0)
                new += points[done:]
                self.written[(run, tag)] = len(points)
            if not new:
                continue
            if run not in self.files:
                folder = self.root / run
                folder.mkdir(parents=True, exist_ok=True)
                self.files[run] = folder / f"vdlrecords.{int(time.time()):010d}.log"
                new_file = display_name(run, int(time.time() * 1000))
            else:
                new_file = b""
            with open(self.files[run], "ab") as f:   # one write: VisualDL may be reading the file as it grows
                f.write(new_file + b"".join(record(p) for p in new))
            total += len(new)
        return total
