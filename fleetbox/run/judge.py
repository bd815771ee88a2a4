"""One judge for every backend. A backend reports what happened on each of a job's nodes, in one shape
(`NodeFacts`, `JobFacts`); `judge` alone decides what that means: each node's state, the node to blame, whether
the job timed out or hung, and the `JobResult`. Where the backends once disagreed, the most careful rule
(Docker's) is the rule."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from fleetbox.run.hang import WAITED
from fleetbox.run.output import config_dump
from fleetbox.run.result import JobResult, NodeResult, culprit, read_lines, spawned_end, tail

VANISHED = "lost its container (removed while the job ran)"


@dataclass(frozen=True)
class NodeFacts:
    """What a backend saw of one node; never what it means."""
    rank: int
    logs: str                          # where its logs are (a folder, a file, a pod), as the table shows it
    host: str = "local"                # where it ran, as its backend names it: an engine URL, a node name
    exit_code: int | None = None       # None: never seen to end
    ended: float | None = None         # when its end was seen (seconds), or its place in the order the ends were
                                       # seen; None: not known (after every node whose end is known)
    stopped: bool = False              # fleetbox, or the scheduler for it, stopped it: its exit code is ours
    vanished: bool = False             # its container or pod was removed while the job ran
    oom: bool = False                  # the kernel's OOM killer ended it
    last_words: float | None = None    # when its failing worker last wrote to its log (result.last_words)
    finished_at: str = ""              # its end in its backend's words (shown, not judged)
    said: str = ""                     # why it ended, in its own script's words, where its exit code cannot say
    output: str = ""                   # the node's own output: the launcher's words (its settings, spawn's end)
    tail_of: str = ""                  # the log whose last lines a failure shows ("": its output)
    lost: str = ""                     # it could not be asked any more while the job ran (its engine, its machine):
                                       # why, in the backend's words

    @property
    def unseen(self) -> bool:
        """Its end was not seen: it vanished or was lost (blamed before any node whose end was seen)."""
        return self.vanished or bool(self.lost)


@dataclass(frozen=True)
class JobFacts:
    """What a backend saw of the whole job."""
    nodes: list[NodeFacts]             # where their ends tie, in the order the backend saw them end
    timed_out: bool = False            # the job's own time limit (--timeout, --k8s-deadline) ended it
    hang: dict | None = None           # the hang watcher's record (run/hang.py), where it stopped the job
    completed: bool = True             # the scheduler saw the job complete (no scheduler: every exit code says)
    ended: str = ""                    # why the job ended without a node's failure (a chain stopped, a cancel,
                                       # a checkpoint to continue), in words


def blamed(facts: JobFacts) -> int | None:
    """The node that failed first, by evidence: only a node that ended by itself can be to blame (one that was
    stopped exits 15 or 137 because it was); a vanished or lost one first; then one whose own words do not say it ended
    waiting for a peer; then the earliest last words where each of them has some, else the order the ends were
    seen. A hang blames whom its stacks blame; a time limit, no one."""
    if facts.hang is not None:
        return facts.hang["node"]
    if facts.timed_out:
        return None
    failed = sorted((n for n in facts.nodes if (n.unseen or n.exit_code not in (0, None)) and not n.stopped),
                    key=lambda n: (not n.unseen, float("inf") if n.ended is None else n.ended))
    failed = [n for n in failed if n.unseen or not waited(n)] or failed
    evidence = {n.rank: n.last_words for n in failed if n.last_words is not None and not n.unseen}
    return culprit([n.rank for n in failed], evidence)


def next_nodes(culprit: int | None, spares: int, may_shrink: bool) -> tuple[str, int | None]:
    """What a restart runs on, its culprit (the judge's) known: ("spare", node) a spare in its place while `spares`
    are left; else ("fewer", node) without it, where --min-nodes leaves room for one fewer (`may_shrink`); else
    ("same", None): the whole job again, on the same nodes."""
    if culprit is None:
        return "same", None
    if spares:
        return "spare", culprit
    if may_shrink:
        return "fewer", culprit
    return "same", None


def waited(n: NodeFacts, lines: int = 60) -> bool:
    """The node's own words end saying it waited for a peer that was gone (a collective's timeout, a peer's
    connection closed): it noticed another node's failure, and failed of it. Its worker's log (`tail_of`), and its
    output, where Paddle's launcher shows its failed worker's last lines: their last `lines` each."""
    return any(re.search(WAITED, "\n".join(tail(Path(p), lines))) for p in {n.tail_of, n.output} if p)


def state(n: NodeFacts, bad: int | None, hang: dict | None) -> str:
    if hang is not None and n.rank == bad:
        return "hung"
    if hang is not None and n.rank in hang.get("timed_out_nodes", ()):
        return "timed out"
    if n.exit_code == 0 and not n.unseen:
        return "ok"
    if n.rank == bad:
        return "FAILED"
    if n.stopped:
        return "stopped"
    if n.vanished:
        return "gone"
    if n.lost:
        return "lost"
    return "aborted" if n.exit_code is not None else "?"


def why(n: NodeFacts, bad: int | None) -> str:
    if n.vanished:
        return VANISHED
    if n.lost:
        return n.lost
    if n.rank != bad:
        return ""
    return n.said or (spawned_end(Path(n.output)) if n.output else "")


def judge(facts: JobFacts, job_id: str, backend: str, dir: str, kind: type[JobResult] = JobResult,
          **told) -> JobResult:
    """The job's result from what its backend saw. `told`: the result's fields that are the backend's own words
    (its scheduler's view, its attempts, the smoke report); `kind`: a backend's own result type, for its own."""
    bad = blamed(facts)
    hang = facts.hang
    nodes = [NodeResult(f"node{n.rank}", n.rank, n.host, n.exit_code, state(n, bad, hang), n.logs, n.finished_at,
                        n.oom, why(n, bad)) for n in sorted(facts.nodes, key=lambda n: n.rank)]
    ok = (facts.completed and not facts.timed_out and hang is None and not facts.ended and bool(nodes)
          and all(n.state == "ok" for n in nodes))
    r = kind(job_id, backend, ok, nodes, bad, facts.timed_out, dir, hang=hang,
             ended="" if ok or bad is not None or hang is not None else facts.ended, **told)
    blamed_node = next((n for n in facts.nodes if n.rank == bad), None)
    if blamed_node is not None and (shown := blamed_node.tail_of or blamed_node.output):
        r.log_tail = tail(Path(shown))
        r.launcher_config = config_dump(read_lines(Path(blamed_node.output))) if blamed_node.output else []
    return r

