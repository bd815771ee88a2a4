"""A job's metrics as VisualDL logs, for `invoke board`: VisualDL's record files, written here with the standard
library only, from what runs/<job>/ holds as it grows (every rank's metrics lines, attempts, hangs). Each worker
log is read from where the last read stopped, known by its inode: a node folder moved into attempt<N>/ or alloc<N>/
at a restart or requeue is the same file, its lines still the attempt they were, and a run's file only grows.

The runs (folders under the board's logdir, named as VisualDL lists them):

    <job>/attempt<N>/rank<r>   a rank in Docker's attempt N (attempt0 the first, each restart the next)
    <job>/alloc<N>/rank<r>     a rank in Slurm's allocation N (alloc1 the first)
    <job>/events               text: where each restart or allocation began, how each attempt ended, hangs,
                               stragglers (VisualDL's Text tab)
    <job>/script/<attempt>/rank<r>/<logdir>
                               the script's own VisualDL logs (paddle.callbacks.VisualDL, a LogWriter), which
                               sitecustomize puts in each node's log folder: copied as they grow, whole records

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
import contextlib
import functools
import math
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from fleetbox import files, settings
from fleetbox.run import hang, metrics, records
from fleetbox.run.jobfolder import JobFolder

EVENTS = "events"
GROUP = "train/"   # every chart in one group, as Paddle's own VisualDL callback tags them
FIXED = ("rank", "step", "time", "node", "attempt")   # a metrics line's place, not its values
RENAMED = {"seconds": "step_seconds"}                  # the Meter's `seconds` is the step's time
COMPUTED = ("comm_share", "straggler")                 # ours: a script's own scalar of the name is left out
READ_LIMIT = 4 << 20   # bytes of one log per read: a long job's history is caught up over reads, memory bounded


class Point(NamedTuple):   # a tuple: a long job's board makes millions of them
    tag: str
    step: int
    ms: int                  # wall clock, milliseconds
    value: float | str       # a scalar, or a text (the events run)


# -- the format --

_ONE_BYTE = [bytes((n,)) for n in range(128)]   # most varints are a field's key or a short length: looked up


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _ONE_BYTE[n]
    n &= (1 << 64) - 1   # int64 as protobuf sends it: a negative step is ten bytes, as VisualDL's own writer makes
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bytes(field: int, data: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(data)) + data


_STEP, _MS, _FLOAT = _varint(1 << 3), _varint(3 << 3), _varint(4 << 3 | 5)   # the keys of a Value's fields


def _step_and_time(step: int, ms: int) -> tuple[bytes, bytes]:
    """A Value's step and time fields (a zero one left out), once for the scalars of one line."""
    return (_STEP + _varint(step) if step else b""), (_MS + _varint(ms) if ms else b"")


_when = functools.lru_cache(maxsize=64)(_step_and_time)   # once for the scalars of one line


@functools.lru_cache(maxsize=4096)
def _tag_field(tag: str) -> bytes:
    """A tag's field, once per tag (a long job writes millions of points under a handful of tags)."""
    return _bytes(2, tag.encode())


def _float32(x: float) -> bytes:
    try:
        return struct.pack("<f", x)
    except OverflowError:   # beyond float32: VisualDL's protobuf stores it as infinity
        return struct.pack("<f", math.copysign(math.inf, x))


def _record(tag: str, step: int, ms: int, one_value: bytes) -> bytes:
    """One record of a vdlrecords file: its length, then Record{values: [Value{step, tag, ms, one_value}]} (a zero
    step or time left out, as protobuf leaves out a field at its default)."""
    before, after = _when(step, ms)
    value = before + _tag_field(tag) + after + one_value
    rec = _bytes(1, value)
    return struct.pack("<Q", len(rec)) + rec


def record(p: Point) -> bytes:
    if isinstance(p.value, str):
        return _record(p.tag, p.step, p.ms, _bytes(12, _bytes(1, p.value.encode())))   # Text
    return _record(p.tag, p.step, p.ms, _FLOAT + _float32(p.value))                    # float value


_LENGTH, _SINGLE = struct.Struct("<Q").pack, struct.Struct("<f").pack
new_point = tuple.__new__   # Point(...) without its Python-level __new__: a long job's board makes millions
_VALUES = _varint(1 << 3 | 2)   # a Record's values field: its key


def encode(points: list[Point]) -> bytes:
    """The points as records, as record() makes each, in one pass: a run's points come a tag at a time, so each
    step's and time's fields are made once for all its tags (a long job's first fill writes millions)."""
    out, when = [], {}
    for p in points:
        tag, step, ms, value = p
        if type(value) is not float:
            out.append(record(p))
            continue
        try:
            before, after = when[step, ms]
        except KeyError:
            before, after = when[step, ms] = _step_and_time(step, ms)
        try:
            one = _SINGLE(value)
        except OverflowError:   # beyond float32: VisualDL's protobuf stores it as infinity
            one = _float32(value)
        v = before + _tag_field(tag) + after + _FLOAT + one
        rec = _VALUES + _ONE_BYTE[len(v)] + v if len(v) < 128 else _bytes(1, v)
        out.append(_LENGTH(len(rec)) + rec)
    return b"".join(out)


def display_name(name: str, ms: int) -> bytes:
    """The record VisualDL's LogWriter(display_name=...) starts a file with: the name its run is listed by (else
    the folder's whole path)."""
    return _record("meta_data_tag", 0, ms, _bytes(10, _bytes(1, name.encode())))


# -- a job's runs --

def _tag(name: str) -> str | None:
    """A script's scalar name as a tag, or None where VisualDL cannot hold it ('%', not UTF-8)."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return None
    return None if "%" in name or not name.strip() else GROUP + name


@functools.lru_cache(maxsize=4096)
def _tag_of(name: str) -> str | None:
    """A metrics line's field as its VisualDL tag; None for the line's place and our own tags (a script's field
    of one of their names is left out). Once per name."""
    return None if name in FIXED or name in COMPUTED else _tag(RENAMED.get(name, name))


_RENAMED_FROM = {to: src for src, to in RENAMED.items()}


@functools.lru_cache(maxsize=1024)
def line_tags(fields: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(field, tag) for each field of a metrics line with these fields that is a scalar on the board: once per
    shape of line, not once a line (a long job's lines have one or two shapes)."""
    return tuple((k, tag) for k in fields if (tag := _tag_of(k)) is not None
                 and not (k in _RENAMED_FROM and _RENAMED_FROM[k] in fields))   # the Meter's step time wins


def scalars(rec: dict) -> dict[str, float]:
    """The scalars of one metrics line, by their VisualDL tag (a number no float holds is left out)."""
    out = {tag: float(v) for k, tag in line_tags(tuple(rec)) if type(v := rec[k]) is float or metrics.number(v)}
    seconds, comm = rec.get("seconds"), rec.get("comm_seconds")
    if metrics.number(comm) and metrics.number(seconds) and seconds > 0:
        try:
            out[GROUP + "comm_share"] = float(comm / seconds)
        except OverflowError:
            pass
    return out


@dataclass
class _Attempt:
    """What the straggler marks and events of one attempt need from the lines read so far."""
    last: tuple[int, int] = (0, 0)                                   # (step, ms) of its newest line
    own: dict[int, list[tuple[int, float, int]]] = field(default_factory=dict)   # rank: (step, own, ms), recent
    done: float = -math.inf                                          # the newest step marked
    flagged: set[int] = field(default_factory=set)


def mark_stragglers(att: _Attempt, nranks: int) -> list[tuple[int, int, int, bool, float, float]]:
    """(rank, step, ms, straggles, own, others' median) for each step after the last marked that every one of the
    `nranks` ranks has logged its own time for, once each has STRAGGLER_STEPS of them up to it (hang.stragglers,
    the live watcher's and the report's rule). A step's mark depends only on lines up to it, so it is final."""
    if nranks < 2 or set(att.own) != set(range(nranks)):
        return []
    steps = sorted(set.intersection(*({s for s, _, _ in v if s > att.done} for v in att.own.values())))
    for mine in att.own.values():
        mine.sort(key=lambda e: e[0])   # stable: a step logged twice keeps its order
    keys = {k: [t for t, _, _ in mine] for k, mine in att.own.items()}
    values = {k: [o for _, o, _ in mine] for k, mine in att.own.items()}
    n, out = hang.STRAGGLER_STEPS, []
    for s in steps:
        window, ms = {}, {}
        for k, mine in att.own.items():
            if (i := bisect.bisect_right(keys[k], s)) < n:
                break
            window[k], ms[k] = hang.median(values[k][i - n:i]), mine[i - 1][2]
        else:
            others = hang.others_medians(window)
            found = hang.stragglers(window, others)
            for k in sorted(window):
                out.append((k, s, ms[k], k in found, window[k], others[k]))
    if steps:
        att.done = steps[-1]
        for k, mine in att.own.items():   # keep what later windows can still need
            older = [e for e in mine if e[0] <= att.done][-hang.STRAGGLER_STEPS:]
            mine[:] = older + [e for e in mine if e[0] > att.done]
    return out


class JobRuns:
    """One job's VisualDL runs (`prefix`: its name on the board), kept up with its folder: `read()` gives the points
    each run has gained since the last call, {run: {key: [Point]}} (the events run keyed by event, each said once)."""

    def __init__(self, job_dir: Path, prefix: str):
        self.dir, self.prefix = job_dir, prefix
        self.logs: dict[tuple[int, int], list] = {}   # (device, inode): [bytes read, attempt]
        self.attempts: dict[int, _Attempt] = {}
        self.said: set[str] = set()
        self.identity = None                          # job.json's inode: a new one is another run of the id
        self.copies: dict[tuple[int, int], list] = {}  # the script's VisualDL files, (device, inode): [bytes, where]
                                                       # (bytes -1: given up on)
        self.problems: list[str] = []                  # files left out, for the board to say (once each) ...
        self.left_out: set[str] = set()                # ... and every one said
        self.behind = False                           # the last read left lines for the next (READ_LIMIT)

    def _job(self) -> tuple[dict, dict]:
        return files.read_json(self.dir / records.JOB), files.read_json(self.dir / records.SUMMARY)

    def _new_lines(self) -> list[tuple[int, dict]]:
        """(attempt, record) of every line written since the last read. A log first seen while a restart moves
        node folders (listed differently before and after) waits for the next read."""
        before, settled = metrics.metric_logs(self.dir), None
        self.behind = False
        out = []
        for attempt, _, log in before:
            try:
                st = log.stat()
            except FileNotFoundError:   # moved meanwhile: read where it is next time
                continue
            key = (st.st_dev, st.st_ino)
            if key not in self.logs:
                if settled is None:
                    settled = metrics.metric_logs(self.dir) == before
                if not settled:
                    continue
                self.logs[key] = [0, attempt]
            seen = self.logs[key]
            if st.st_size <= seen[0]:
                continue
            try:
                with open(log, "rb") as f:
                    f.seek(seen[0])
                    data = f.read(min(st.st_size - seen[0], READ_LIMIT))
            except FileNotFoundError:   # moved since its stat: read where it is next time (known by its inode)
                continue
            self.behind |= st.st_size - seen[0] > READ_LIMIT
            whole = data[:data.rfind(b"\n") + 1]   # a line still being written waits ...
            if not whole and len(data) == READ_LIMIT:
                whole = data                        # ... unless no line of a limit's length ends: skipped
            seen[0] += len(whole)
            for line in whole.decode(errors="replace").splitlines():
                if (rec := metrics.parse(line)) is not None:
                    out.append((seen[1], rec))
        return out

    def script_records(self) -> dict[str, bytes]:
        """The whole records each of the script's own VisualDL files gained since the last call, by the file's
        place on the board (<prefix>/script/<attempt>/rank<r>/<logdir>/<file>): followed by inode, as the worker
        logs are, a record still being written left for the next call. A file that cannot be read is left out
        (said once in `problems`), and so is one that is a link or leads out of the job's folder."""
        name = JobFolder.at(self.dir).layout.attempt_name
        pattern = f"{settings.SCRIPT_VISUALDL}/**/vdlrecords*"
        before, settled, out = metrics.node_files(self.dir, pattern), None, {}
        inside = os.path.realpath(self.dir) + os.sep
        for attempt, _, path in before:
            key = None
            try:
                if path.is_symlink() or not os.path.realpath(path).startswith(inside):
                    continue
                st = path.stat()
                key = (st.st_dev, st.st_ino)
                if key not in self.copies:   # first seen while a restart moves node folders: its attempt next time
                    if settled is None:
                        settled = metrics.node_files(self.dir, pattern) == before
                    if not settled:
                        continue
                    parts = path.relative_to(self.dir).parts   # <node folder>/visualdl/<rank r>/<logdir>/<file>
                    inner = "/".join(parts[parts.index(settings.SCRIPT_VISUALDL) + 1:])
                    self.copies[key] = [0, f"{self.prefix}/script/{name(attempt)}/{inner}"]
                seen = self.copies[key]
                if seen[0] < 0 or st.st_size <= seen[0]:   # given up on, or nothing new
                    continue
                data = _records_from(path, seen[0], st.st_size)
            except FileNotFoundError:   # moved meanwhile: read where it is next time
                continue
            except (OSError, ValueError) as e:   # unreadable, or not VisualDL's records: left out from now on
                if key in self.copies:
                    self.copies[key][0] = -1
                if (said := f"{path.relative_to(self.dir)}: {e}") not in self.left_out:
                    self.left_out.add(said)
                    self.problems.append(said)
                continue
            self.behind |= st.st_size - seen[0] > len(data)
            if whole := whole_records(data):
                seen[0] += whole
                out[seen[1]] = data[:whole]
        return out

    def read(self) -> dict[str, dict[str, list[Point]]]:
        job, summary = self._job()
        try:
            identity = os.stat(self.dir / records.JOB).st_ino
        except FileNotFoundError:
            identity = None
        if self.identity is not None and identity != self.identity:
            raise ValueError("its id ran again since the board started (the earlier run is in run-<time>/): "
                             "start the board again to see the new run")
        self.identity = identity
        name = JobFolder.at(self.dir).layout.attempt_name
        ppn = int(job.get("procs_per_node") or 1)
        nranks = int(job.get("nodes") or 0) * ppn
        runs: dict[str, dict[str, list[Point]]] = {}

        def add(run: str, key: str, p: Point):
            runs.setdefault(f"{self.prefix}/{run}", {}).setdefault(key, []).append(p)

        def event(key: str, p: Point):
            if key not in self.said:
                self.said.add(key)
                add(EVENTS, key, Point(EVENTS, p.step, p.ms, p.value))

        new = self._new_lines()
        places = {}   # (attempt, rank): its attempt and its run's series, found once, not once a line
        for a, rec in new:
            rank, step, ms = rec["rank"], rec["step"], int(rec["time"] * 1000)
            if (place := places.get((a, rank))) is None:
                att = self.attempts.get(a) or self.attempts.setdefault(a, _Attempt())
                place = places[a, rank] = (att, runs.setdefault(f"{self.prefix}/{name(a)}/rank{rank}", {}))
            att, series = place
            if a and f"{name(a)}/began" not in self.said:
                event(f"{name(a)}/began", Point(EVENTS, step, ms, f"{name(a)} began at step {step}"))
            if (step, ms) > att.last:
                att.last = (step, ms)
            for tag, v in scalars(rec).items():   # a line's run named once, not once a scalar
                if (points := series.get(tag)) is None:
                    points = series[tag] = []
                points.append(new_point(Point, (tag, step, ms, v)))
            own = rec.get("own_seconds")
            if type(own) is float and 0 <= own < math.inf or metrics.number(own) and math.isfinite(own) and own >= 0:
                att.own.setdefault(rank, []).append((step, float(own), ms))
        straggler = GROUP + "straggler"
        for a, att in sorted(self.attempts.items()):
            label, marks = name(a), {}
            for k, s, ms, straggles, own, others in mark_stragglers(att, nranks):
                if (at := marks.get(k)) is None:
                    at = marks[k] = runs.setdefault(f"{self.prefix}/{label}/rank{k}", {}).setdefault(straggler, [])
                at.append(new_point(Point, (straggler, s, ms, float(straggles))))
                if straggles and k not in att.flagged:
                    att.flagged.add(k)
                    event(f"{label}/straggler/rank{k}", Point(EVENTS, s, ms, f"from step {s}: " + hang.straggler_line(
                        k, own, others, ppn, hang.STRAGGLER_STEPS)))
        for d in self.dir.glob("hang-*"):
            if (m := re.fullmatch(r"hang-(\d+)", d.name)) and (blame := d / "blame.txt").is_file():
                a = int(m.group(1))
                step, ms = self.attempts.get(a, _Attempt()).last
                said = blame.read_text(errors="replace").strip().splitlines()
                event(f"{name(a)}/hang", Point(EVENTS, step, ms, said[0] if said else "hung"))
        for e in summary.get("attempts", []):   # written when the job ends
            if isinstance(e, dict) and isinstance(e.get("attempt"), int) and e.get("ended"):
                label = name(e["attempt"])
                step, ms = self.attempts.get(e["attempt"], _Attempt()).last
                event(f"{label}/ended", Point(EVENTS, step, ms, f"{label} ended: {e['ended']}"))
        return runs


MAX_RECORD = 256 << 20   # a record's length beyond this is no VisualDL record (a scalar's is tens of bytes)


def _records_from(path: Path, at: int, size: int) -> bytes:
    """What `path` (of `size` bytes) holds from `at` on, READ_LIMIT of it, or more where its first record is bigger:
    all of that record once it is whole. ValueError: a length no record has."""
    with open(path, "rb") as f:
        f.seek(at)
        data = f.read(min(size - at, READ_LIMIT))
        if len(data) >= 8 and 8 + (n := struct.unpack("<Q", data[:8])[0]) > len(data):   # one big record
            if n > MAX_RECORD:
                raise ValueError(f"a record of {n} bytes at byte {at}: not VisualDL's records")
            if size - at >= 8 + n:
                data += f.read(8 + n - len(data))
    return data


def whole_records(data: bytes) -> int:
    """How many bytes at the start of `data` are whole records (an 8-byte length, then that many bytes)."""
    at = 0
    while at + 8 <= len(data) and at + 8 + (n := struct.unpack("<Q", data[at:at + 8])[0]) <= len(data):
        at += 8 + n
    return at


class Logs:
    """VisualDL logs under `root`, one folder per run, each run's file only growing (VisualDL reads it as it
    grows). Points a failed write could not put down are kept and written first next time."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, Path] = {}
        self.pending: dict[str, tuple[bytes, int]] = {}   # run: (records, how many)
        self.pending_copies: dict[str, bytes] = {}        # a copied file's place: its records
        self.named: set[str] = set()                      # the copies begun with their run's name

    def add(self, runs: dict[str, dict[str, list[Point]]]) -> int:
        """Append the points, after any a failed write left; returns how many were written."""
        total, failed = 0, None
        for run in sorted(set(runs) | set(self.pending)):
            points = [p for ps in runs.get(run, {}).values() for p in ps]
            left, n = self.pending.pop(run, (b"", 0))
            data, n = left + encode(points), n + len(points)
            if not data:
                continue
            try:
                if run not in self.files:
                    folder = self.root / run
                    folder.mkdir(parents=True, exist_ok=True)
                    path = folder / f"vdlrecords.{int(time.time()):010d}.log"
                    path.write_bytes(display_name(run, int(time.time() * 1000)))
                    self.files[run] = path
                with open(self.files[run], "ab") as f:   # one write: VisualDL may be reading the file as it grows
                    f.write(data)
            except OSError as e:   # kept for the next call; the other runs are still written
                self.pending[run], failed = (data, n), failed or e
                continue
            total += n
        if failed:
            raise failed
        return total

    def copy(self, records: dict[str, bytes]) -> int:
        """Append each file's new records (JobRuns.script_records) to its copy here, after any a failed write
        left; returns how many bytes were written. A copy starts with the display name of its run (its folder
        here, job first): the script's own LogWriter names none, and VisualDL would list the copy by its path."""
        total, failed = 0, None
        for where in sorted(set(records) | set(self.pending_copies)):
            data = self.pending_copies.pop(where, b"") + records.get(where, b"")
            path, size = self.root / where, None
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                name = b"" if where in self.named else display_name(os.path.dirname(where), int(time.time() * 1000))
                with open(path, "ab") as f:   # one write: VisualDL may be reading the file as it grows
                    size = f.tell()
                    f.write(name + data)
                self.named.add(where)
            except OSError as e:   # a part written is taken back: the next write starts on a whole record
                if size is not None:
                    with contextlib.suppress(OSError):
                        os.truncate(path, size)
                self.pending_copies[where], failed = data, failed or e
                continue
            total += len(data)
        if failed:
            raise failed
        return total
