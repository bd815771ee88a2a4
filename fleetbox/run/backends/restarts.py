"""Restarts made by the command that follows a job (an attached `invoke train`, Docker's supervisor), not by a
scheduler: the whole job again, from its newest checkpoint, with the same job id (torchrun's --max-restarts).
The Docker backend's, and the Kubernetes backend's where its controller would restart a pod alone."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

from fleetbox.errors import Failed, NodeRefused
from fleetbox.run import metrics
from fleetbox.run.backend import CANCELLED, Backend, Plan
from fleetbox.run.judge import next_nodes
from fleetbox.run.result import JobResult, fewer_line, spare_line, took_place

# what its layout's earlier-attempt folder holds (the job folder's reference page)
EARLIER = ("an earlier attempt's node folders and summary, where fleetbox restarted the job (the last attempt's are "
           "at the top)")


def fewer_note(spec) -> tuple[str, ...]:
    """What --min-nodes will do, for the plan's notes (--dry-run shows them)."""
    if not spec.may_shrink:
        return ()
    return (f"note: --min-nodes {spec.min_nodes}: a restart goes on without the node that failed or hung, from the "
            f"newest checkpoint, while {spec.min_nodes} or more are left",)


class ClientRestarts(Backend):
    """A backend whose `run` restarts the job itself (`restarting`), each attempt's plan from `for_attempt`."""

    def restarting(self, plan: Plan, log=print, timeout: float | None = None, on_submit=None) -> JobResult:
        """fleetbox's own restarts (torchrun's --max-restarts), for a backend that does them in its client: submit
        and follow; after a failure or a hang, the whole job again from its newest checkpoint, with the same job
        id (`for_attempt`), up to spec.max_restarts times: a spare in the failed node's place while one is left,
        else without it (--min-nodes), else on the same nodes. Each attempt keeps its own logs: the last in the
        job folder, earlier ones in the layout's attempt folders (`keep_attempt`). `ended(plan)` is called with
        the plan the job last ran, on every way out."""
        deadline = time.monotonic() + timeout if timeout else None
        restarts, attempts, result = plan.spec.max_restarts, [], None
        now = [plan]   # the plan the job runs now, also where _started gave a node's place to a spare and failed
        try:
            for attempt in range(restarts + 1):
                try:
                    result = self._started(now, attempt, log, deadline, on_submit)
                    plan = now[0]
                    why = result.reason()
                except Failed as e:   # the engine or cluster failed under the job: _run_once has cleaned up
                    if attempt == restarts:
                        raise
                    plan, result, why = now[0], None, str(e).removeprefix("train failed: ")
                attempts.append({"attempt": attempt, "ok": bool(result and result.ok), "ended": why,
                                 "state": result.state if result is not None else "FAILED", "logs": str(plan.dir),
                                 "nodes": plan.spec.nodes})
                if result is not None and (result.ok or result.timed_out) or attempt == restarts \
                        or (plan.dir / CANCELLED).exists():   # `invoke cancel` (its SIGTERM may come mid-cleanup)
                    break
                attempts[-1]["logs"] = str(self.keep_attempt(plan, attempt))
                plan = now[0] = self._next(plan, result, attempt, why, log)
            if result is not None and (len(attempts) > 1 or plan.replaced):
                result.attempts, result.replaced = attempts if len(attempts) > 1 else [], list(plan.replaced)
                result.save()
            metrics.collect(plan.dir)
            return result
        finally:
            self.ended(now[0])

    def _next(self, plan: Plan, result: JobResult | None, attempt: int, why: str, log) -> Plan:
        """The plan of the restart after a failed attempt, said in one line."""
        restarts = plan.spec.max_restarts
        how, node = next_nodes(None if result is None else result.culprit,
                               self.spares_left(plan) if self.capabilities.spares else 0, plan.spec.may_shrink)
        if how == "fewer" and not self.capabilities.fewer_nodes:
            how = "same"
        restart = f"(restart {attempt + 1} of {restarts})"
        if how == "same":
            log(f"attempt {attempt} failed: {why}; restarting the whole job from its newest checkpoint {restart}")
            return plan
        if how == "spare":
            plan = self._spare_for(plan, node, attempt + 1, why, ran=True)
            log(spare_line(attempt, why, plan.replaced[-1], plan.spec.nodes, restart))
            return plan
        host = self.host_of(plan, node)
        # the machine it ran on, where the result names a scheduler's node (kept out from here on)
        machine = next((n.host for n in result.nodes if n.rank == node), "") if self.capabilities.names_hosts else ""
        plan = self.without(plan, node, machine)
        log(fewer_line(attempt, why, node, host, plan.spec.nodes, plan.spec.procs_per_node, restart))
        return plan

    def _started(self, now: list, attempt: int, log, deadline: float | None, on_submit) -> JobResult:
        """Attempt `attempt` of the plan now[0] run to its end: a node whose engine refuses to start it is left out
        before the job starts, a spare in its place (now[0] the plan with it), while spares are left (no restart
        is spent on it)."""
        while True:
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                return self._run_once(self.for_attempt(now[0], attempt), log, left, on_submit)
            except NodeRefused as e:   # nothing of the job ran: _run_once has cleaned up
                if not (self.capabilities.spares and self.spares_left(now[0])) \
                        or (now[0].dir / CANCELLED).exists():
                    raise
                now[0] = self._spare_for(now[0], e.node, attempt, str(e), ran=False)
                log(f"{e}; {took_place(now[0].replaced[-1])}")

    def _spare_for(self, plan: Plan, node: int, attempt: int, why: str, ran: bool) -> Plan:
        """The plan with a spare in node `node`'s place from attempt `attempt` on, recorded in plan.replaced
        (`ran`: the host left out ran the attempt before; else it could not start it)."""
        host = self.host_of(plan, node)
        plan, spare = self.with_spare(plan, node)
        return replace(plan, replaced=(*plan.replaced, {"attempt": attempt, "node": node, "host": host, "by": spare,
                                                         "why": why, "ran": ran}))

    def ended(self, plan: Plan) -> None:
        """The job has ended (every way out of `restarting`), on the nodes of `plan`: what it held is let go."""

    def for_attempt(self, plan: Plan, attempt: int) -> Plan:
        """The plan of the job's attempt `attempt` (0: the first), for `restarting`."""
        return plan

    def without(self, plan: Plan, node: int, machine: str = "") -> Plan:
        """The plan on every node but `node` (a backend that capabilities.fewer_nodes says can); `machine`: where
        it ran, as the result names a scheduler's node ("": unnamed)."""
        raise NotImplementedError(f"the {self.name} backend does not go on with fewer nodes")

    def spares_left(self, plan: Plan) -> int:
        """How many spare nodes the plan still keeps (a backend that capabilities.spares says keeps them)."""
        return 0

    def with_spare(self, plan: Plan, node: int) -> tuple[Plan, str]:
        """The plan with its first spare in node `node`'s place, and where that spare is."""
        raise NotImplementedError(f"the {self.name} backend keeps no spare nodes")

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
