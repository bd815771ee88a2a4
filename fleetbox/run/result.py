"""One result type for every backend: each node's end, the node to blame, and one table and one failure
line that `train`, `verify --nodes` and both backends share."""

from __future__ import annotations

import json
import re
import signal
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fleetbox import files

SUMMARY = "summary.json"   # a job's result, in its folder (records.py names the folder's other files)


@dataclass
class NodeResult:
    node: str                    # node<rank>
    rank: int
    host: str                    # where it ran, as its backend names it: an engine URL, a node name, "local"
    exit_code: int | None        # None: never seen to end
    state: str                   # ok | FAILED | hung | timed out | stopped | aborted | gone | ?
    logs: str                    # this node's log folder (or file)
    finished_at: str = ""
    oom_killed: bool = False
    why: str = ""                # what ended it, when an exit code cannot say (e.g. its container was removed)


@dataclass
class JobResult:
    job_id: str
    backend: str
    ok: bool
    nodes: list[NodeResult]
    culprit: int | None = None   # rank of the node that failed in substance
    timed_out: bool = False
    dir: str = ""
    log_tail: list[str] = field(default_factory=list)
    launcher_config: list[str] = field(default_factory=list)   # the failed node's, kept out of the live output
    smoke: dict | None = None    # the smoke job's own report (FLEETBOX-SMOKE line of rank 0)
    scheduler: str = ""          # the scheduler's own view of the job, as its backend words it (after the state)
    end_state: str = ""          # how the scheduler saw a job end that no node failed, as its backend words it
    attempts: list[dict] = field(default_factory=list)   # with restarts: {attempt, ok, ended, logs} each
    replaced: list[dict] = field(default_factory=list)   # hosts a spare took the place of (Plan.replaced)
    ended: str = ""              # why a job that no node failed did not pass (e.g. a chain of allocations stopped)
    attempts_are: str = "restarts"   # what the backend calls a job's later attempts (Capabilities.attempts_are)
    name_host: bool = False          # the failure line names the failing node's host (a scheduler's node)
    hang: dict | None = None         # the job hung (run/hang.py): {kind, ranks, decided, where, node, text, dir}

    @property
    def state(self) -> str:
        """PASSED, HUNG or FAILED: as `invoke jobs` (JobState) and the summary say it."""
        return "PASSED" if self.ok else "HUNG" if self.hang else "FAILED"

    @property
    def failed(self) -> NodeResult | None:
        return next((n for n in self.nodes if n.rank == self.culprit), None) if self.culprit is not None else None

    def failure(self) -> str:
        """The one line that says why the job failed ("" when it passed)."""
        if self.ok:
            return ""
        n = len(self.attempts)
        after = "" if n < 2 else f"over {n} allocations; " if self.attempts_are == "allocations" \
            else f"after {n - 1} restart(s); "
        return f"{self.reason()} ({after}logs: {self.dir})"

    def reason(self) -> str:
        """Why the job ended, without where its logs are."""
        if self.ok:
            return "passed"
        if self.ended:
            why = self.ended
        elif self.hang:
            why = self.hang["text"]
        elif self.timed_out:
            why = "timed out"
        elif (bad := self.failed) is not None:
            where = f" on {bad.host}" if self.name_host else ""
            why = f"{bad.node} (rank {bad.rank}){where} " + (
                bad.why or f"exited with {exit_meaning(bad.exit_code, bad.oom_killed)}")
        else:
            why = f"job ended {self.end_state or 'without a result'}"
        return why

    def table(self) -> str:
        head = f"job {self.job_id}: {self.state}"
        if self.scheduler:
            head += f" ({self.scheduler})"
        out = [head, f"  {'node':<6} {'host':<28} {'rank':>4} {'exit':>5}  {'state':<8} logs"]
        for n in self.nodes:
            out.append(f"  {n.node:<6} {n.host:<28} {n.rank:>4} {str(n.exit_code):>5}  {n.state:<8} {n.logs}")
        for a in self.attempts:
            out.append(f"  attempt {a['attempt']}: {a['ended']}" + ("" if a["logs"] == self.dir else f" ({a['logs']})"))
        out += [f"  {replaced_text(r)}" for r in self.replaced]
        if self.smoke:
            out.append(f"  smoke: {smoke_line(self.smoke)}")
        if self.hang:
            out.append(f"  {self.hang['text']}; stacks and last lines: {self.hang['dir']}")
        elif (bad := self.failed) is not None:
            if self.launcher_config:
                out.append(f"  Paddle's launcher on {bad.node} ran with:")
                out += [f"    | {ln}" for ln in self.launcher_config]
            out.append(f"  {bad.node} (rank {bad.rank}) failed: "
                       f"{bad.why or exit_meaning(bad.exit_code, bad.oom_killed)}; last lines of its log:")
            out += [f"    | {ln}" for ln in self.log_tail]
        return "\n".join(out)

    def save(self) -> None:
        files.write_json(Path(self.dir, SUMMARY), asdict(self))

    @classmethod
    def from_summary(cls, summary: dict) -> JobResult:
        """A summary.json read back; the fields of a backend's own result type (SlurmResult's) are left out."""
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in summary.items() if k in names}
        return cls(**{**data, "nodes": [NodeResult(**n) for n in data.get("nodes", [])]})


def took_place(r: dict) -> str:
    """A spare in a node's place (JobResult.replaced), as the restart line and the result table say it."""
    return (f"the spare {r['by']} takes node{r['node']}'s place" + (f" ({r['host']} is left out for the rest of the "
                                                                    f"job)" if r["host"] else ""))


def spare_line(attempt: int, why: str, r: dict, nodes: int, restart: str) -> str:
    """The line that says attempt `attempt` failed and a spare takes the culprit's place (r: JobResult.replaced's)."""
    return (f"attempt {attempt} failed: {why}; {took_place(r)}: restarting from the newest checkpoint on {nodes} "
            f"nodes {restart}")


def fewer_line(attempt: int, why: str, node: int, host: str, nodes: int, procs_per_node: int, restart: str) -> str:
    """The line that says attempt `attempt` failed and the job goes on without node `node` (on `host`, "": unnamed),
    on `nodes` nodes: what changes for the script, and what tells it."""
    return (f"attempt {attempt} failed: {why}; going on without node{node}{f' ({host})' if host else ''} from the "
            f"newest checkpoint, on {nodes} nodes {restart}: the world is {nodes * procs_per_node} ranks, was "
            f"{(nodes + 1) * procs_per_node}; each rank's batch is the script's, so the global batch shrinks with it "
            f"(PADDLE_TRAINERS_NUM, and the checkpoint helper's saved_world, tell the script)")


def replaced_text(r: dict, failed_at: int | None = None, from_step: int | None = None) -> str:
    """A node's host left out, a spare in its place (JobResult.replaced), with the steps where known: the last
    the host ran, the first the spare ran."""
    ended = (f"failed at step {failed_at}" if failed_at is not None else "failed") if r.get("ran") \
        else "could not start the job"
    return (f"node{r['node']} on {r['host']} {ended} ({r['why']}); the spare {r['by']} took its place"
            f"{f' from step {from_step}' if from_step is not None else ''} (attempt {r['attempt']})")


def exit_meaning(code: int | None, oom_killed: bool = False) -> str:
    """`exit code 137 (killed by SIGKILL: out of memory)` rather than a bare number."""
    if code is None:
        return "no exit code"
    text = f"exit code {code}"
    if code > 128:
        try:
            name = signal.Signals(code - 128).name
        except ValueError:
            return text
        text += f" (killed by {name}" + (": out of memory" if oom_killed else "") + ")"
    return text


def culprit(failed: list[int], last_words: dict[int, float]) -> int | None:
    """The node that failed first, by evidence, not by the kind of its exit code.
    `last_words`: when each failed node's failing worker last wrote to its log. A peer can only notice a
    rank's death after that rank's process has ended, and then writes its own error (the Gloo/NCCL abort), so
    the earliest last words are the culprit's. When a node has none (it failed before its workers started,
    or its log came back without exact times), `failed` is in the order the nodes were seen to end."""
    if not failed:
        return None
    if all(r in last_words for r in failed):   # equal times (clock ticks) keep the order seen
        return min(failed, key=lambda r: last_words[r])
    return failed[0]


FAILED_WORKER = re.compile(r"status failed cmd .* log \S*?(workerlog\.\d+)")


def last_words(node_dir: Path, launcher_log: Path) -> float | None:
    """When the node's failing worker last wrote to its log (the file's time, as fine as the kernel's clock
    tick), if we can tell: the worker Paddle's launcher reported failed, else the node's only worker.
    `launcher_log`: where the node's launcher wrote, wherever its backend keeps it (its layout's output)."""
    text = launcher_log.read_text(errors="replace") if launcher_log.exists() else ""
    named = FAILED_WORKER.search(text)
    logs = [node_dir / named.group(1)] if named else sorted(node_dir.glob("workerlog.*"))
    if len(logs) != 1 or not logs[0].exists():
        return None
    return logs[0].stat().st_mtime_ns / 1e9


# how Paddle's spawn ends the script that spawned its ranks when one of them fails (2.6 and 3.x alike)
SPAWNED_END = re.compile(r"Process (\d+) terminated with (?:exit code (-?\d+)|signal (SIG\w+)|the following error)")


def spawned_end(node_log: Path, last: int = 64 << 10) -> str:
    """Which of the node's spawned ranks ended it and how, from the end of the node's own output ("" where no
    rank did): the script exits 1 whatever its rank's exit, so the exit code alone cannot say."""
    try:
        with open(node_log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - last))   # a log may be GiBs: Paddle's words are at its end
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    found = list(SPAWNED_END.finditer(text))
    if not found:
        return ""
    rank, code, sig = found[-1].groups()
    how = (f"exited with {exit_meaning(int(code))}" if code is not None else f"was killed by {sig}" if sig
           else "raised an error")
    return f"ended: its spawned rank {rank} {how} (log: workerlog.{rank})"


def smoke_report(node0_log: Path) -> dict | None:
    """The smoke job's FLEETBOX-SMOKE line, from rank 0's log."""
    for line in (node0_log.read_text(errors="replace").splitlines() if node0_log.exists() else []):
        if line.startswith("FLEETBOX-SMOKE "):
            return json.loads(line[len("FLEETBOX-SMOKE "):])
    return None


def smoke_line(s: dict) -> str:
    """The smoke job's measured figures: the loss, every rank's parameter checksum, the throughput."""
    sums = s.get("checksums", [])
    spread = max(sums) - min(sums) if sums else float("nan")
    return (f"loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, parameter checksums on {s['world']} ranks: "
            f"{', '.join(f'{x:.6f}' for x in sums)} (spread {spread:.1e}; identical: {s['params_identical']}), "
            f"{s['samples_per_s']:.0f} samples/s")


def read_lines(path: Path) -> list[str]:
    """A log's lines ([] when it is not there)."""
    return path.read_text(errors="replace").rstrip().splitlines() if path.exists() else []


def tail(path: Path, lines: int = 15, last: int = 64 << 10) -> list[str]:
    """A log's last lines, from its last `last` bytes at most (a log may be GiBs); [] when it is not there."""
    try:
        with open(path, "rb") as f:
            start = max(0, f.seek(0, 2) - last)
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    got = text.rstrip().splitlines()
    return (got[1:] if start and got else got)[-lines:]   # the first line cut where the read began
