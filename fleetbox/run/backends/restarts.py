"""Restarts made by the command that follows a job (an attached `invoke train`, Docker's supervisor), not by a
scheduler: the whole job again, from its newest checkpoint, with the same job id (torchrun's --max-restarts).
The Docker backend's, and the Kubernetes backend's where its controller would restart a pod alone."""

from __future__ import annotations

import re
import time
from pathlib import Path

from fleetbox.errors import Failed
from fleetbox.run import metrics
from fleetbox.run.backend import CANCELLED, Backend, Plan
from fleetbox.run.result import JobResult

# what its layout's earlier-attempt folder holds (the job folder's reference page)
EARLIER = ("an earlier attempt's node folders and summary, where fleetbox restarted the job (the last attempt's are "
           "at the top)")


def fewer(spec, result: JobResult | None) -> int | None:
    """The node a restart goes on without: the one that failed or hung (the judge's culprit), where --min-nodes
    leaves room for one fewer; None: the whole job again, on the same nodes."""
    if result is None or result.culprit is None or not spec.min_nodes or spec.nodes - 1 < spec.min_nodes:
        return None
    return result.culprit


class ClientRestarts(Backend):
    """A backend whose `run` restarts the job itself (`restarting`), each attempt's plan from `for_attempt`."""

    def restarting(self, plan: Plan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """fleetbox's own restarts (torchrun's --max-restarts), for a backend that does them in its client: submit
        and follow; after a failure or a hang, the whole job again from its newest checkpoint, with the same job
        id (`for_attempt`), up to spec.max_restarts times. Each attempt keeps its own logs: the last in the job
        folder, earlier ones in the layout's attempt folders (`keep_attempt`)."""
        deadline = time.monotonic() + timeout if timeout else None
        restarts, attempts = plan.spec.max_restarts, []
        for attempt in range(restarts + 1):
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                result = self._run_once(self.for_attempt(plan, attempt), log, left, on_submit)
                why = result.reason()
            except Failed as e:   # the engine or cluster failed under the job: _run_once has cleaned up
                if attempt == restarts:
                    raise
                result, why = None, str(e).removeprefix("train failed: ")
            attempts.append({"attempt": attempt, "ok": bool(result and result.ok), "ended": why,
                             "state": result.state if result is not None else "FAILED", "logs": str(plan.dir),
                             "nodes": plan.spec.nodes})
            if result is not None and (result.ok or result.timed_out) or attempt == restarts \
                    or (plan.dir / CANCELLED).exists():   # `invoke cancel` (its SIGTERM may have come mid-cleanup)
                break
            attempts[-1]["logs"] = str(self.keep_attempt(plan, attempt))
            left_out = fewer(plan.spec, result) if self.capabilities.fewer_nodes else None
            if left_out is None:
                log(f"attempt {attempt} failed: {why}; restarting the whole job from its newest checkpoint "
                    f"(restart {attempt + 1} of {restarts})")
                continue
            ranks, host = plan.spec.nodes * plan.spec.procs_per_node, self.host_of(plan, left_out)
            plan = self.without(plan, left_out)
            log(f"attempt {attempt} failed: {why}; going on without node{left_out}{f' ({host})' if host else ''} "
                f"from the newest checkpoint, on "
                f"{plan.spec.nodes} nodes (restart {attempt + 1} of {restarts}): the world is "
                f"{plan.spec.nodes * plan.spec.procs_per_node} ranks, was {ranks}; each rank's batch is the script's, "
                f"so the global batch shrinks with it (PADDLE_TRAINERS_NUM, and the checkpoint helper's "
                f"saved_world, tell the script)")
        if len(attempts) > 1:
            result.attempts = attempts
            result.save()
        metrics.collect(plan.dir)
        return result

    def for_attempt(self, plan: Plan, attempt: int) -> Plan:
        """The plan of the job's attempt `attempt` (0: the first), for `restarting`."""
        return plan

    def without(self, plan: Plan, node: int) -> Plan:
        """The plan on every node but `node` (a backend that capabilities.fewer_nodes says can)."""
        raise NotImplementedError(f"the {self.name} backend does not go on with fewer nodes")

    def host_of(self, plan: Plan, node: int) -> str:
        """Where node `node` of the plan runs, for the line that leaves it out ("": nowhere worth naming)."""
        return ""

    def keep_attempt(self, plan: Plan, attempt: int) -> Path:
        """Move a finished attempt's node folders and summary aside (the layout's attempt folder), so the next one
        starts with a clean folder."""
        aside = plan.dir / self.layout.earlier.replace("<N>", str(attempt + self.layout.first))
        if aside.exists():   # left by an earlier run of the same job id
            aside.rename(aside.with_name(f"{aside.name}.before-{time.strftime('%Y%m%d-%H%M%S')}"))
        aside.mkdir(parents=True)
        # the node folders, a node's output where it is outside them, the summary
        node, output = (re.escape(where.partition("/")[0]).replace("<k>", r"\d+")
                        for where in (self.layout.node, self.layout.output))
        for p in sorted(plan.dir.iterdir()):
            if re.fullmatch(rf"{node}(\.log)?|{output}|summary\.json", p.name) and p != aside:
                p.rename(aside / p.name)
        return aside
