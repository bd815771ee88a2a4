"""What the three benchmarks share: whole-process timing, interleaved order, medians and a plain table.

Rules they follow: whole process against whole process, same inputs and environment, interleaved rounds
(A B, then B A, ...), medians. Nothing here imports fleetbox, so timing code never shares its imports.
"""
from __future__ import annotations

import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Timed:
    wall: float        # seconds, start of the process to its exit
    cpu: float         # user + system seconds of the process and every descendant it waited for
    start: float       # time.time() at start and end (to line up with engine events and file times)
    end: float
    proc: subprocess.CompletedProcess


def run(argv, *, check: bool = True, timeout: float | None = None, **kw) -> Timed:
    """Run one whole process (output captured) and time it from start to exit."""
    argv = [str(a) for a in argv]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start, t = time.time(), time.perf_counter()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException:   # interrupted or timed out: let it clean up (containers, builds), then go on up
            stop(p)
            raise
    wall = time.perf_counter() - t
    end = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.CompletedProcess(argv, p.returncode, out, err)
    if check and proc.returncode != 0:
        sys.exit(f"{' '.join(argv[:5])} ... failed ({proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timed(wall, cpu, start, end, proc)


def stop(p: subprocess.Popen, grace: float = 60) -> None:
    """End a child we started that is still running when we are interrupted. Ctrl-C reached it too (a terminal
    signals the whole process group), so we only wait while it cleans up; a SIGTERM or SIGHUP sent to us
    alone, or a timeout, is passed on as one SIGTERM (invoke's tasks take it as Ctrl-C). SIGKILL only if it
    has not ended after `grace` seconds. A second signal would cut its own clean-up short."""
    if p.poll() is None and (not _received or _received[-1] != signal.SIGINT):
        p.terminate()
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def rounds(arms: list[str], repeat: int):
    """(round, arm) in alternating order: A B C, then C B A, then A B C ... so no arm always goes first
    (or always runs right after the same other arm)."""
    for i in range(repeat):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            yield i, arm


def med(xs) -> float:
    return statistics.median(xs)


def spread(xs, fmt: str = ".2f") -> str:
    return f"(min {min(xs):{fmt}}, max {max(xs):{fmt}})" if len(xs) > 1 else ""


def table(header: list[str], rows: list[list], indent: str = "  ") -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = []
    for n, r in enumerate(cells):
        out.append(indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            out.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(out)


_received: list[int] = []   # the signals that interrupted us, in order


def entry(main) -> None:
    """Run a benchmark's main(): SIGTERM and SIGHUP take Ctrl-C's way out, so every `finally` runs
    (containers, network namespaces, servers, scratch folders), and an interruption ends as one line."""
    def interrupt(signum, frame):
        _received.append(signum)
        raise KeyboardInterrupt
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(s) is not signal.SIG_IGN:   # a background job ignores SIGINT: keep it so
            signal.signal(s, interrupt)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted (cleaned up)", file=sys.stderr)
        sys.exit(130)


def private_runs_dir(tmp: Path) -> Path:
    """Point FLEETBOX_RUNS (for this process and the `invoke` processes it starts) at a scratch folder, so
    benchmark runs leave nothing under runs/."""
    d = Path(tmp) / "runs"
    d.mkdir(parents=True, exist_ok=True)
    os.environ["FLEETBOX_RUNS"] = str(d)
    return d


def disk(path) -> str:
    """The file system `path` is on, and for ext4 whether it has a journal: without one, ext4 skips every inode
    freed in the last 60 s when it allocates one, so a run that makes and removes many files pays more there
    (README.md, "Building", has the figures of both)."""
    found = subprocess.run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", str(path)], capture_output=True,
                           text=True).stdout.split()
    if len(found) < 2:
        return f"{path}: unknown"
    source, fstype = found[0].split("[", 1)[0], found[1]   # a bind mount's source: /dev/vda[/var/lib/docker]
    if fstype != "ext4":
        return f"{path}: {source}, {fstype}"
    dev = os.path.basename(os.path.realpath(source))   # a journal shows as /proc/fs/jbd2/<dev>-<inode>
    journal = any(p.name.rsplit("-", 1)[0] == dev for p in Path("/proc/fs/jbd2").glob("*"))
    return f"{path}: {source}, ext4 {'with' if journal else 'without'} a journal"


@contextmanager
def slurm_cluster(tmp: Path, image: str = "fleetbox/paddle:cpu"):
    """The Slurm test cluster (tests/slurmcluster.py) while the block runs, its nodes' Podman holding `image` from
    the Docker Engine; yields the environment its clients need. Stopped on every way out."""
    sys.path.insert(0, str(ROOT))
    from tests import slurmcluster  # the tests' own cluster, as they make it
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    subprocess.run(["podman", "load", "-q"], stdin=save.stdout, check=True, capture_output=True)
    save.wait()
    d = Path(tmp) / "slurm"
    d.mkdir()
    try:
        yield slurmcluster.start(d)
    finally:
        slurmcluster.stop(d)
