"""One result type for every backend: each node's end, the node to blame, and one table and one failure
line that `train`, `verify --nodes` and both backends share."""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class NodeResult:
    node: str                    # node<rank>
    rank: int
    host: str                    # engine URL, Slurm node name, or "local"
    exit_code: int | None        # None: never seen to end
    state: str                   # ok | FAILED | stopped | aborted | ?
    logs: str                    # this node's log folder (or file)
    finished_at: str = ""
    oom_killed: bool = False


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
    smoke: dict | None = None    # the smoke job's own report (FLEETBOX-SMOKE line of rank 0)
    scheduler_job: str = ""      # Slurm's job id
    scheduler_state: str = ""    # Slurm's final JobState

    @property
    def failed(self) -> NodeResult | None:
        return next((n for n in self.nodes if n.rank == self.culprit), None) if self.culprit is not None else None

    def failure(self) -> str:
        """The one line that says why the job failed ("" when it passed)."""
        if self.ok:
            return ""
        if self.timed_out:
            why = "timed out"
        elif (bad := self.failed) is not None:
            where = f" on {bad.host}" if self.backend == "slurm" else ""
            why = f"{bad.node} (rank {bad.rank}){where} exited with {exit_meaning(bad.exit_code, bad.oom_killed)}"
        else:
            why = f"job ended {self.scheduler_state or 'without a result'}"
        return f"{why} (logs: {self.dir})"

    def table(self) -> str:
        head = f"job {self.job_id}: {'PASSED' if self.ok else 'FAILED'}"
        if self.scheduler_job:
            head += f" (Slurm job {self.scheduler_job}, {self.scheduler_state})"
        out = [head, f"  {'node':<6} {'host':<28} {'rank':>4} {'exit':>5}  {'state':<8} logs"]
        for n in self.nodes:
            out.append(f"  {n.node:<6} {n.host:<28} {n.rank:>4} {str(n.exit_code):>5}  {n.state:<8} {n.logs}")
        if self.smoke:
            s = self.smoke
            out.append(f"  smoke: loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, parameters identical on "
                       f"{s['world']} ranks: {s['params_identical']}, {s['samples_per_s']:.0f} samples/s")
        if (bad := self.failed) is not None:
            out.append(f"  {bad.node} (rank {bad.rank}) failed with {exit_meaning(bad.exit_code, bad.oom_killed)}; "
                       f"last lines of its log:")
            out += [f"    | {ln}" for ln in self.log_tail]
        return "\n".join(out)

    def save(self) -> None:
        Path(self.dir, "summary.json").write_text(json.dumps(asdict(self), indent=1))


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


def culprit(exits: list[tuple[int, int]]) -> int | None:
    """The node that failed in substance, from (rank, exit code) in the order the exits were seen.
    A real exit code (1..127) beats a signal-style one (>= 128): peers abort (SIGABRT, exit 250) when a rank
    disappears, sometimes before that rank's own launcher has reported."""
    failed = [(r, c) for r, c in exits if c != 0]
    real = [r for r, c in failed if 0 < c < 128]
    return real[0] if real else failed[0][0] if failed else None


def smoke_report(node0_log: Path) -> dict | None:
    """The smoke job's FLEETBOX-SMOKE line, from rank 0's log."""
    for line in (node0_log.read_text(errors="replace").splitlines() if node0_log.exists() else []):
        if line.startswith("FLEETBOX-SMOKE "):
            return json.loads(line[len("FLEETBOX-SMOKE "):])
    return None


def tail(path: Path, lines: int = 15) -> list[str]:
    return path.read_text(errors="replace").rstrip().splitlines()[-lines:] if path.exists() else []
