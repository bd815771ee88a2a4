"""Hang detection as every backend uses it: when a job counts as stuck (Watch, on the ranks' progress files
that the helpers write, fleetbox/incontainer/fleetbox_progress.py), and whom the ranks' Python stacks blame
(blame, on faulthandler's dumps, fleetbox/incontainer/sitecustomize.py). The rules are pure; the file work
(asking for the stacks, waiting for them, keeping them) goes through a reader and a writer each backend gives
(Docker: its containers' log folders; Slurm: the shared file system). Standard library only: a Slurm batch
script runs this file as a program on its node (`python3 hang.py JOB_DIR ...`, see main()).

The deadlines (nvidia-resiliency-ext's initial and heartbeat timeouts, and its sections, in our words), on the
job's progress (collective training moves in lock step, see Watch):
- start: from the task's start to the first progress;
- hang: from the last progress of any rank to the next;
- a phase declared on any rank (an evaluation, a checkpoint save): its own limit, else the start deadline;
- every rank's script ended (each said so at its exit): the start deadline, for the processes' and nodes' exits.
Progress is when fleetbox saw a rank's file change (this machine's clock: nodes' clocks may differ). A script
that reports no progress at all (no rank ever said it would) gets the start deadline only for ranks whose
process never started; a job from which no file at all arrives is never called hung (its image may not run
our helpers).
"""

from __future__ import annotations

import bisect
import glob
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

PROGRESS = "progress-rank{rank}.json"  # what fleetbox_progress writes in each node's log folder
STACKS = "stacks-rank{rank}.txt"
REQUEST = "STACKS-REQUEST"          # sitecustomize's relay in each node's launcher reads it
HANG_TIMEOUT_S = 600.0              # --hang-timeout default (JobSpec): well inside Paddle's 30 min collective timeout
START_TIMEOUT_S = 900.0             # --start-timeout default (JobSpec): a slow image pull, a big model's load
STACKS_WAIT_S = 8.0                 # for every rank's stacks, after asking
# A collective's own deadline ended a rank: it waited there for a peer that is stuck. Gloo's is its built-in
# 30 s (Paddle's Gloo process group passes it none); it aborts the waiting ranks long before any hang deadline,
# with this in their logs. An extended regular expression: node.sh greps for it too.
COLLECTIVE_TIMEOUT = r"gloo::TimeoutException|gloo/transport/tcp/[A-Za-z_]+\.cc:[0-9]+\].*(TIMEOUT|Timed out)"
# ... and a rank that waited in the same collective for a rank that timeout ended (three or more ranks): its
# connection closes first, or Gloo's I/O thread aborts the process on that connection's second failure (its
# `ex_ == nullptr` check). Alone, it is a peer's crash, not a hang.
PEER_GONE = r"gloo/transport/tcp/[A-Za-z_]+\.cc:[0-9]+\].*(Connection (closed|reset) by peer|ex_ == nullptr)"
WAITED = f"{COLLECTIVE_TIMEOUT}|{PEER_GONE}"
GLOO_TIMEOUT_S = 30.0
# A timeout is a hang's only where the job had made no progress for most of it: Gloo names a peer's death a
# TIMEOUT too, at once, and a crash's peers must not make it a hang
TIMEOUT_QUIET_S = 20.0
TIMED_OUT = "COLLECTIVE-TIMEOUT"    # node.sh's mark in its log folder (Slurm): a rank there timed out so
# an earlier run's: cleared first (with the metrics found in its training: fleetbox_found.FILE)
LEFT_OVER = ("progress-rank*.json", "stacks-rank*.txt", "found-metrics-rank*.log", REQUEST, TIMED_OUT)
# NCCL's process-group timeout (Paddle's comm-task watchdog; PADDLE_PG_TIMEOUT, ms, 30 min unset) is set above
# fleetbox's own deadlines: fleetbox's detection, with every rank's stacks, comes first
PG_TIMEOUT_S = 1800.0
PG_MARGIN_S = 300.0


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def pg_timeout_ms(hang_s: float, start_s: float) -> int:
    """PADDLE_PG_TIMEOUT for NCCL jobs: Paddle's own 30 min, or more, so that it stays above our deadlines."""
    return int(max(PG_TIMEOUT_S, max(hang_s, start_s) + PG_MARGIN_S) * 1000)


def describe_deadlines(hang_s: float, start_s: float, device: str = "cpu", env: dict | None = None) -> str:
    """What --dry-run says about hang detection, and which collective timeout applies to the job."""
    if not hang_s and not start_s:
        return "hang detection: off (--hang-timeout 0 --start-timeout 0): nothing of it runs in the job"
    hang = f"no progress for {duration(hang_s)}" if hang_s else "no hang deadline (--hang-timeout 0)"
    start = f"no first progress within {duration(start_s)}" if start_s else "no start-up deadline (--start-timeout 0)"
    if device == "cpu":
        collective = (f"Gloo's own {GLOO_TIMEOUT_S:.0f} s collective timeout (Paddle sets no other) ends the ranks "
                      f"that wait for a stuck one first: read as a hang, the stuck rank named from the others' stacks")
    elif (env or {}).get("PADDLE_PG_TIMEOUT"):
        collective = f"NCCL's process-group timeout: PADDLE_PG_TIMEOUT={env['PADDLE_PG_TIMEOUT']} ms (your --env)"
    else:
        collective = (f"NCCL's process-group timeout: PADDLE_PG_TIMEOUT={pg_timeout_ms(hang_s, start_s)} ms, "
                      f"above these deadlines")
    return (f"hang detection: {hang}; {start} -> every rank's stacks kept, the job stopped as after a failure; "
            f"{collective}. Progress: fleetbox_metrics, fleetbox_checkpoint or fleetbox_progress steps, else the "
            f"training's own (an optimizer's step, a static program's run, a data loader's batch); paddle.save and "
            f"paddle.load are phases")


@dataclass
class Stall:
    kind: str                  # "hang": no progress for the hang deadline; "start": none before the start one;
    #                            "collective": a collective's own timeout ended ranks (they waited for a stuck one)
    ranks: list[int]           # the ranks past their deadline (collective: those it ended)
    idle: dict[int, float]     # seconds since each rank's last progress (or since the start)
    steps: dict[int, int | None]   # each rank's last step
    since: dict[int, float]    # wall time of each rank's last progress (or of the start)


def finite(v) -> bool:
    """A number a float holds (10**400 does not: an OverflowError later), not NaN or infinite."""
    try:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    except OverflowError:
        return False


def clean(record) -> dict | None:
    """A progress record held to its shape (it comes from a file any script could write), else None."""
    if not isinstance(record, dict) or not finite(record.get("seq")):
        return None
    step, phase, limit = record.get("step"), record.get("phase"), record.get("phase_limit")
    if step is not None and not finite(step) or phase is not None and not isinstance(phase, str):
        return None
    if limit is not None and not (finite(limit) and limit > 0):
        return None
    own, own_n = record.get("own_s"), record.get("own_n")
    return {"seq": record["seq"], "step": step, "phase": phase, "phase_limit": limit,
            "reports": record.get("reports") is True, "done": record.get("done") is True,
            "own_s": float(own) if finite(own) and own >= 0 else None,
            "own_n": own_n if isinstance(own_n, int) and not isinstance(own_n, bool) else 0}


# -- stragglers: slow, not stuck --

STRAGGLER_STEPS = 20        # fleetbox_progress.WINDOW: a rank's own time is the median of its last this many steps
STRAGGLER_RATIO = 1.5       # a straggler's own time per step against the other ranks' median ...
STRAGGLER_FLOOR_S = 0.005   # ... and this much more at least (2 ms against 1 ms is noise, not a straggler)


def median(values) -> float:
    """statistics.median of numbers, without its generality (the board asks it a million times in a long job's
    first fill)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def others_medians(own: dict[int, float]) -> dict[int, float]:
    """Each rank's other ranks' median (none where it is alone), from one sort of them all (a NaN, which no sort
    places, the slow way)."""
    if any(v != v for v in own.values()):
        return {r: statistics.median([t for k, t in own.items() if k != r]) for r in own if len(own) > 1}
    ordered, out = sorted(own.values()), {}
    for r, mine in own.items():
        i = bisect.bisect_left(ordered, mine)   # one occurrence of its own value left out
        rest = ordered[:i] + ordered[i + 1:]
        if n := len(rest):
            out[r] = rest[n // 2] if n % 2 else (rest[n // 2 - 1] + rest[n // 2]) / 2
    return out


def stragglers(own: dict[int, float], others: dict[int, float] | None = None) -> dict[int, float]:
    """The ranks whose own work per step (seconds: not waiting for their peers) is at least STRAGGLER_RATIO times
    the other ranks' median and STRAGGLER_FLOOR_S more, with that median: {rank: others' median} (`others`: each
    rank's, where known already). Collective training waits for its slowest rank every step, so every rank's whole
    step is the straggler's; only the part a rank works on its own tells them apart. Pure."""
    others = others_medians(own) if others is None else others
    return {r: m for r, m in others.items() if own[r] >= STRAGGLER_RATIO * m and own[r] - m >= STRAGGLER_FLOOR_S}


def straggler_line(rank: int, own: float, others: float, ppn: int, steps: int) -> str:
    times = f", {own / others:.1f}x" if others > 0 else ""
    return (f"straggler: node{rank // ppn} (rank {rank}) works {1000 * own:.1f} ms a step on its own against "
            f"{1000 * others:.1f} ms for the other ranks (median of its last {steps} steps{times}): every step "
            f"waits for it")


@dataclass
class Watch:
    """The ranks' progress as seen by a backend polling their files; verdict() says when the job is stuck.

    Collective training moves in lock step, so progress is the job's: the job is stuck when no rank has made
    progress for the deadline (a rank that finished, or one that reports nothing itself while rank 0 logs for
    all, is not stuck while its peers go on); a phase declared on any rank holds the deadline for all (they
    wait for it in their next collective), up to its limit."""
    world: int
    hang_s: float
    start_s: float
    started: float = field(default_factory=time.monotonic)   # the task's start (monotonic)
    records: dict[int, dict] = field(default_factory=dict)
    changed: dict[int, float] = field(default_factory=dict)   # monotonic time each rank's record last changed
    wall: dict[int, float] = field(default_factory=dict)      # ... and the wall clock then
    named: set[int] = field(default_factory=set)              # stragglers already named

    def see(self, rank: int, record, now: float | None = None) -> None:
        record = clean(record)
        if record is None or not 0 <= rank < self.world:
            return
        now = time.monotonic() if now is None else now
        old = self.records.get(rank)
        if old is None or old["seq"] != record["seq"]:
            self.changed[rank], self.wall[rank] = now, time.time() - (time.monotonic() - now)
        self.records[rank] = record

    def new_stragglers(self, ppn: int) -> list[str]:
        """A line for each rank that has become a straggler since the last call (each named once), among the
        ranks whose own time covers STRAGGLER_STEPS steps."""
        full = {r: rec["own_s"] for r, rec in self.records.items()
                if rec["own_s"] is not None and rec["own_n"] >= STRAGGLER_STEPS and not rec["done"]}
        found = stragglers(full)
        lines = [straggler_line(r, full[r], m, ppn, self.records[r]["own_n"]) for r, m in sorted(found.items())
                 if r not in self.named]
        self.named.update(found)
        return lines

    def quiet(self, now: float | None = None) -> float:
        """Seconds since the job's last progress (any rank's), or since its start."""
        now = time.monotonic() if now is None else now
        return now - max(self.changed.values(), default=self.started)

    def deadline(self) -> tuple[float, str] | None:
        """When the job counts as stuck (monotonic) and which deadline that is; None: none applies."""
        recs = self.records
        phases = []
        for r, rec in recs.items():
            if rec["phase"] and not rec["done"]:
                # no limit of its own: the start-up deadline's, or its default where --start-timeout 0 turned
                # that off (a phase is never unbounded: a rank stuck in a save is still found)
                limit = rec["phase_limit"] or self.start_s or START_TIMEOUT_S
                phases.append(self.changed[r] + limit)
        if len(recs) == self.world and all(rec["done"] for rec in recs.values()):
            # every rank ended its script: what is left (its processes', launchers' and nodes' exits, slow under
            # load) is no step, given the longer of the two deadlines, bounded all the same (a process stuck at its
            # exit is still found), where detection is on at all
            if not self.hang_s:
                return None
            return max(self.changed.values()) + max(self.hang_s, self.start_s or START_TIMEOUT_S), "hang"
        if any(rec["step"] is not None for rec in recs.values()):   # it has made progress: the hang deadline
            if not self.hang_s:
                return None
            return max([max(self.changed.values()) + self.hang_s, *phases]), "hang"
        reporting = any(rec["reports"] for rec in recs.values())
        if not self.start_s or not (reporting or len(recs) < self.world):
            return None   # a script that reports nothing, every rank started: nothing to wait for
        return max([self.started + self.start_s, *phases]), "start"

    def verdict(self, now: float | None = None) -> Stall | None:
        if not self.records:   # nothing arrives at all: not ours to judge
            return None
        now = time.monotonic() if now is None else now
        d = self.deadline()
        if d is None or now <= d[0]:
            return None
        idle = {r: now - self.changed.get(r, self.started) for r in range(self.world)}
        if d[1] == "start":   # the ranks that never started, else those without a first step
            late = [r for r in range(self.world) if r not in self.records] or \
                [r for r in range(self.world) if self.records[r]["step"] is None]
        else:
            late = [r for r in range(self.world) if idle[r] > self.hang_s]
        return self.stall(d[1], late or list(range(self.world)), now)

    def collective_stall(self, read, ranks, ppn: int) -> Stall | None:
        """The job as stuck in a collective, where that collective's own timeout ended some of `ranks` (they
        waited there for a stuck peer, timed_out()) and the job had made no progress for most of that timeout;
        None otherwise (Gloo names a peer's crash a timeout too: no hang)."""
        if self.quiet() < TIMEOUT_QUIET_S:
            return None
        waited = timed_out(read, ranks, ppn)
        return self.stall("collective", sorted(waited)) if waited else None

    def stall(self, kind: str, ranks: list[int], now: float | None = None) -> Stall:
        """The job as stuck now, `ranks` the ones to name (verdict's, or those a collective's timeout ended)."""
        now = time.monotonic() if now is None else now
        wall_now = time.time() - (time.monotonic() - now)
        return Stall(kind, ranks, idle={r: now - self.changed.get(r, self.started) for r in range(self.world)},
                     steps={r: (self.records.get(r) or {}).get("step") for r in range(self.world)},
                     since={r: self.wall.get(r, wall_now - (now - self.started)) for r in range(self.world)})


def timed_out(read, ranks, ppn: int) -> dict[int, str]:
    """The ranks among `ranks` that a collective's own timeout ended, each with its log's line: those whose log
    ends with the timeout, and where there is one, those whose peer it ended first. None without a timeout."""
    timeouts, gone = {}, {}
    for r in ranks:
        tail = (read(r // ppn, f"workerlog.{r % ppn}", last=64 << 10) or b"").decode(errors="replace")
        for pattern, found in ((COLLECTIVE_TIMEOUT, timeouts), (PEER_GONE, gone)):
            hits = [ln.strip() for ln in tail.splitlines() if re.search(pattern, ln)]
            if hits and r not in timeouts:
                found[r] = hits[-1][-300:]
    return {**gone, **timeouts} if timeouts else {}


def announce(stall: Stall) -> str:
    """The line a backend says when it takes the stacks."""
    ranks = ", ".join(f"rank {r}" for r in stall.ranks)
    if stall.kind == "collective":
        return (f"{ranks} timed out waiting in a collective (its own timeout): a peer is stuck; taking every rank's "
                f"stacks, then stopping the job")
    return (f"no progress for {duration(max(stall.idle[r] for r in stall.ranks))} ({ranks}, "
            f"{'start-up deadline' if stall.kind == 'start' else 'hang deadline'}): taking every rank's stacks, "
            f"then stopping the job")


# -- the stacks --

FRAME = re.compile(r'\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')
THREAD = re.compile(r"(Current thread|Thread) 0x[0-9a-f]+(?: \[.*\])? \(most recent call first\):")   # 3.14: [name]


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def paddle(self) -> bool:
        return "/paddle/" in self.file

    def short(self) -> str:
        return f"`{self.func}` ({self.file.rsplit('/', 1)[-1]}:{self.line})"


def main_stack(dump: str) -> list[Frame] | None:
    """The main thread's frames, innermost first, from one faulthandler dump of all threads (None: no dump).
    The main thread is the one whose outermost frame is a module's top level; else the one that took the
    signal. Where it waits for its data loader's thread, that thread's frames in the script's code come first
    (a Dataset's __getitem__ stuck reading is where the rank is)."""
    threads, cur = [], None
    for line in dump.splitlines():
        if m := THREAD.match(line):
            cur = (m.group(1) == "Current thread", [])
            threads.append(cur)
        elif cur is not None and (f := FRAME.match(line)):
            cur[1].append(Frame(f["file"], int(f["line"]), f["func"]))
    threads = [t for t in threads if t[1]]
    if not threads:
        return None
    main = ([t for t in threads if t[1][-1].func == "<module>"] or [t for t in threads if t[0]] or threads)[0][1]
    if LOADER in main[0].file:   # the main thread waits for its data loader's thread: where that one is comes first
        for _, frames in threads:
            if frames is not main and user_frames(frames) and (at := _loader_part(frames)) is not None:
                return frames[:at] + main
    return main


LOADER = "/paddle/io/dataloader/"   # Paddle's DataLoader reads a batch in a thread of its own (num_workers=0 too)


def _loader_part(frames: list[Frame]) -> int | None:
    """Where a thread's frames enter Paddle's data loader (a loader thread), None if they do not."""
    return next((i for i, f in enumerate(frames) if LOADER in f.file), None)


def waits(f: Frame) -> bool:
    """A frame where a rank waits for its peers: Paddle's collectives, or a backward pass (DataParallel's
    all-reduce runs in it)."""
    return "/paddle/distributed/" in f.file and f.func != "<module>" or f.paddle and f.func == "backward"


def collective(frames: list[Frame]) -> Frame | None:
    """The collective the stack waits in (the call the script made: the outermost waiting frame of Paddle's
    run of frames there); None when the rank is in code of its own, even under a wrapper of Paddle's that
    calls it (DataParallel's forward, a PyLayer's backward)."""
    for i, f in enumerate(frames):   # innermost first
        if f in user_frames([f]):
            return None
        if waits(f):
            op = f
            for g in frames[i + 1:]:
                if not g.paddle:
                    break
                op = g if waits(g) else op
            return op
    return None


def user_frames(frames: list[Frame]) -> list[Frame]:
    """The script's own frames (not Paddle's, not the standard library's, not site-packages'), innermost first."""
    return [f for f in frames if not (f.paddle or "/site-packages/" in f.file or re.search(r"/python3\.\d+/", f.file))]


def where(frames: list[Frame] | None) -> str:
    """Where a rank is, in a few words."""
    if frames is None:
        return "gave no stack"
    mine = user_frames(frames) or frames
    op = collective(frames)
    if op is not None:
        return f"waiting in `{op.func}`" + (f" ← {mine[0].short()}" if mine else "")
    return "in " + " ← ".join(f.short() for f in mine[:2])


@dataclass
class Blame:
    ranks: list[int]           # the ranks to blame (one where the stacks decide; empty where they cannot)
    decided: bool
    where: dict[int, str]      # every rank, where it is


def blame(stacks: dict[int, list[Frame] | None], world: int, waited: dict[int, str] | None = None) -> Blame:
    """The rank that is not in a collective while its peers wait in one. The checkpoint helper's per-step
    agreement and DataParallel's all-reduce keep the ranks in lock step, so a healthy peer of a stuck rank
    waits inside a collective; a stuck rank is elsewhere. A rank that a collective's own timeout ended
    (`waited`: its log says so) waited inside one, with or without a stack. A rank without a stack, where every
    other waits in a collective, is not named: a stack can go missing for other reasons. Anything but one rank
    outside cannot be decided from the stacks, and is said so."""
    waited = waited or {}
    stacks = {r: stacks.get(r) for r in range(world)}
    places = {r: "timed out waiting in a collective" if s is None and r in waited else where(s)
              for r, s in stacks.items()}
    outside = [r for r, s in stacks.items() if s is not None and collective(s) is None and r not in waited]
    missing = [r for r, s in stacks.items() if s is None and r not in waited]
    inside = [r for r in stacks if r not in outside and r not in missing]
    if world == 1 and outside:
        return Blame(outside, True, places)
    if len(outside) == 1 and not missing and inside:
        return Blame(outside, True, places)
    return Blame([], False, places)


def summary(stall: Stall, b: Blame, procs_per_node: int = 1) -> str:
    """The line the job's summary gives, e.g. `node1 (rank 1) hung: no progress since step 30 (12:03:11, 20 s);
    in `load_batch` (smoke.py:88) ← `main` (smoke.py:131). rank 0 waiting in `all_reduce` ← ...`."""
    def since(r: int) -> str:
        at = time.strftime("%H:%M:%S", time.localtime(stall.since[r]))
        if stall.steps.get(r) is None:
            return f"no first step {duration(stall.idle[r])} after it started ({at})"
        return f"no progress since step {stall.steps[r]} ({at}, {duration(stall.idle[r])})"
    if b.decided:
        r = b.ranks[0]
        others = [f"rank {o} {b.where[o]}" for o in sorted(b.where) if o != r]
        return (f"node{r // procs_per_node} (rank {r}) hung: {since(r)}; {b.where[r]}"
                + (". " + "; ".join(others) if others else ""))
    first = stall.ranks[0]
    if stall.kind == "collective":
        return (f"the job hung: rank {first} timed out waiting in a collective; the stacks cannot tell which rank "
                f"is stuck: " + "; ".join(f"rank {r} {b.where[r]}" for r in sorted(b.where)))
    return (f"the job hung: rank {first}: {since(first)}; the stacks cannot tell which rank is stuck: "
            + "; ".join(f"rank {r} {b.where[r]}" for r in sorted(b.where)))


# -- the file work, through a backend's reader and writer: read(node, name) -> bytes | None, write(node, name,
# data) --

def stacks_file(rank: int) -> str:
    return STACKS.format(rank=rank)


def ask_for_stacks(read, write, nodes: int, ppn: int, attempt: int, wait: float = STACKS_WAIT_S,
                   poll: float = 0.25, gone=()) -> dict[int, int]:
    """Ask every node's launcher for its ranks' stacks; wait until every rank's stacks file has grown (or
    `wait` seconds), but for the ranks `gone` (ended: none will come). Returns each file's size before the
    request: the new part is this dump."""
    before = {r: len(read(r // ppn, stacks_file(r)) or b"") for r in range(nodes * ppn)}
    request = f"{attempt}-{time.time()}\n".encode()
    for k in range(nodes):
        try:
            write(k, REQUEST, request)
        except Exception:   # a node that is gone: the others still answer
            pass
    end, waiting = time.monotonic() + wait, set(before) - set(gone)
    while waiting and time.monotonic() < end:
        time.sleep(poll)
        waiting = {r for r in waiting if len(read(r // ppn, stacks_file(r)) or b"") <= before[r]}
    time.sleep(poll)   # a dump still being written: its last lines
    return before


def keep(out: str, read, nodes: int, ppn: int, attempt: int, before: dict[int, int], stall: Stall,
         **extra) -> dict:
    """Every rank's new stacks and last lines into `out` (rank<r>.txt), whom they blame (blame.txt), and the
    record a job's summary carries (hang.json, with `extra`). After a collective's timeout, every rank it
    ended by now (its log says so) counts as waiting in it."""
    os.makedirs(out, exist_ok=True)
    stacks = {}
    for r in range(nodes * ppn):
        dump = (read(r // ppn, stacks_file(r)) or b"")[before.get(r, 0):].decode(errors="replace")
        stacks[r] = main_stack(dump)
        log = read(r // ppn, f"workerlog.{r % ppn}", last=64 << 10) or b""   # its end: a log may be GiBs
        last = log.decode(errors="replace").rstrip().splitlines()[-20:]
        _write_whole(os.path.join(out, f"rank{r}.txt"), (
            f"rank {r} (node{r // ppn}), attempt {attempt}\n\n== the last lines of its log ==\n" + "\n".join(last)
            + "\n\n== its Python stacks, every thread (faulthandler) ==\n" + (dump or "(none arrived)\n")).encode())
    waited = timed_out(read, range(nodes * ppn), ppn) if stall.kind == "collective" else {}
    # a peer's end says where Gloo's I/O thread was, not the rank: one that gave a stack is judged by its stack
    waited = {r: line for r, line in waited.items() if re.search(COLLECTIVE_TIMEOUT, line) or stacks[r] is None}
    b = blame(stacks, len(stacks), waited)
    text = summary(stall, b, ppn)
    _write_whole(os.path.join(out, "blame.txt"), (text + "\n").encode())
    record = {"kind": stall.kind, "ranks": b.ranks, "decided": b.decided, "where": {str(r): w for r, w in
              b.where.items()}, "node": b.ranks[0] // ppn if b.decided else None, "text": text, "dir": out,
              "timed_out": {str(r): line for r, line in waited.items()},
              "timed_out_nodes": sorted({r // ppn for r in waited}), **extra}
    _write_whole(os.path.join(out, "hang.json"), json.dumps(record, indent=1).encode())
    return record


def _write_whole(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


class NodeFiles:
    """How the watcher reaches each node's log folder: the backend's transport. This one: node folders on one file
    system (runs/<job>/node<k>/: Docker's local nodes, Slurm's shared file system). A backend whose nodes' folders
    are elsewhere (a container's, a pod's) gives its own read and write, and its own read_many where one call per
    node is cheaper than one per file; `parallel`: the nodes are read side by side (each a slow exec)."""

    parallel = False

    def __init__(self, job_dir: str):
        self.job_dir = job_dir

    def read(self, k: int, name: str, last: int | None = None) -> bytes | None:
        """A file of node k's log folder (its `last` bytes); None where it is not there."""
        try:
            with open(os.path.join(self.job_dir, f"node{k}", name), "rb") as f:
                if last is not None:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - last))
                return f.read()
        except OSError:
            return None

    def read_many(self, k: int, names: list[str]) -> list[bytes | None]:
        return [self.read(k, n) for n in names]

    def write(self, k: int, name: str, data: bytes) -> None:
        _write_whole(os.path.join(self.job_dir, f"node{k}", name), data)

    def running(self) -> bool:
        """Every node runs: the job's deadlines count from then (a pod still pending is not a rank late to start)."""
        return True


class Watcher:
    """The one hang watcher, which every backend drives (Slurm's batch script, through main(), too): at each look,
    at most every `every` seconds, every rank's progress is read through the backend's `files`, new stragglers
    named; at a deadline (Watch.verdict), or once a collective's own timeout ended a rank of a node (a node held
    with its mark, node_script.hold_after_timeout, or one the backend saw end), every rank's stacks are asked
    for and kept in `out` with whom they blame: that record is what look() returns (JobResult.hang), and the
    backend then stops the job. `extra`: what the record also keeps (Slurm's job id)."""

    def __init__(self, out: str, nodes: int, ppn: int, hang_s: float, start_s: float, attempt: int, files: NodeFiles,
                 log=print, every: float = 1.0, **extra):
        self.out, self.nodes, self.ppn, self.attempt, self.files = out, nodes, ppn, attempt, files
        self.log, self.every, self.extra = log, every, extra
        self.watch = Watch(nodes * ppn, hang_s, start_s)
        self.on = bool(hang_s or start_s)
        self.next, self.started = 0.0, False
        self.held: set[int] = set()    # the nodes a collective's timeout may have ended (held, failed), last look
        self.ended: set[int] = set()   # ... and every node that ended: none answers for its stacks

    def look(self, ended=(), failed=(), at_once: bool = False, deadlines: bool = True) -> dict | None:
        """The hang's record once the job is stuck (its stacks taken); None until then, or between looks."""
        stall = self.stuck(ended, failed, at_once, deadlines)
        return None if stall is None else self.take(stall)

    def stuck(self, ended=(), failed=(), at_once: bool = False, deadlines: bool = True) -> Stall | None:
        """Whether the job is stuck, by its ranks' progress read now. `ended`: the nodes the backend saw end (no
        stacks will come from them); `failed`: those of them that failed (a peer's timeout may have ended them);
        `at_once`: look now, not at the cadence; `deadlines`: judge the deadlines too (a backend that has seen a
        node fail asks only whether a collective's timeout ended it)."""
        if not self.on or (time.monotonic() < self.next and not at_once):
            return None
        self.next = time.monotonic() + self.every
        if not self.started:
            if not self.files.running():
                return None
            self.started, self.watch.started = True, time.monotonic()
        ppn = self.ppn

        def node(k: int) -> list[bytes | None]:   # its ranks' progress, and its mark
            return self.files.read_many(k, [PROGRESS.format(rank=k * ppn + i) for i in range(ppn)] + [TIMED_OUT])
        if self.files.parallel and self.nodes > 1:   # one exec or request per node, side by side
            with ThreadPoolExecutor(max_workers=min(16, self.nodes)) as pool:
                found = list(pool.map(node, range(self.nodes)))
        else:
            found = [node(k) for k in range(self.nodes)]
        for k, datas in enumerate(found):
            for i, data in enumerate(datas[:-1]):
                try:
                    self.watch.see(k * ppn + i, json.loads(data) if data else None)
                except ValueError:   # caught mid-write: the next look has it
                    pass
        for line in self.watch.new_stragglers(ppn):   # slow, not stuck: named once
            self.log(line)
        stall = self.watch.verdict() if deadlines else None
        # a node held after a collective's timeout ended a rank of it, or one that failed: asked once each time
        # another is (a peer's crash alone is no hang)
        held = {k for k, datas in enumerate(found) if datas[-1] is not None} | set(failed)
        new, self.held, self.ended = held - self.held, held, held | set(ended)
        if stall is None and new:
            stall = self.watch.collective_stall(self.files.read, [r for k in sorted(held)
                                                                   for r in range(k * ppn, (k + 1) * ppn)], ppn)
        return stall

    def take(self, stall: Stall) -> dict:
        """Every rank's stacks (but those of nodes that ended: none will come), kept with whom they blame."""
        self.log(announce(stall))
        f, ppn = self.files, self.ppn
        before = ask_for_stacks(f.read, f.write, self.nodes, ppn, self.attempt,
                                gone=[r for k in sorted(self.ended) for r in range(k * ppn, (k + 1) * ppn)])
        record = keep(self.out, f.read, self.nodes, ppn, self.attempt, before, stall, **self.extra)
        self.log(record["text"])
        return record


def clear(node_dir: str) -> None:
    """What an earlier run of the same job id left in a node's log folder for hang detection (a request for
    stacks, the pids of processes long gone): removed before the node starts."""
    for pattern in LEFT_OVER:
        for p in glob.glob(os.path.join(glob.escape(node_dir), pattern)):
            try:
                os.remove(p)
            except OSError:
                pass


def main(argv: list[str]) -> int:
    """A Slurm batch script's watcher: python3 hang.py JOB_DIR NODES PPN HANG_S START_S ATTEMPT SRUN_PID.
    Reads the ranks' progress on the shared file system; at a deadline keeps every rank's stacks in
    JOB_DIR/hang-<attempt>/ and stops the job step (SIGTERM to srun, SIGKILL 10 s later); exit 3 then."""
    job_dir, nodes, ppn, hang_s, start_s, attempt, srun = argv
    w = Watcher(os.path.join(job_dir, f"hang-{attempt}"), int(nodes), int(ppn), float(hang_s), float(start_s),
                int(attempt), NodeFiles(job_dir), log=lambda line: print(f"fleetbox: {line}", flush=True),
                slurm_job=os.environ.get("SLURM_JOB_ID", ""))
    while (stall := w.stuck()) is None:
        time.sleep(w.every)
    try:
        w.take(stall)
    finally:   # whatever happened above, the stuck job does not keep its allocation
        stop(int(srun))
    return 3


def stop(pid: int) -> None:
    """srun asked to end the step (SIGTERM: it signals every task), then made to (SIGKILL) if it is still
    there after 10 s, and still srun (a pid is reused once its process is reaped)."""
    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"srun" in f.read()
        except OSError:
            return False
    for sig, after in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        if not alive():
            return
        os.kill(pid, sig)
        end = time.monotonic() + after
        while time.monotonic() < end and alive():
            time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
