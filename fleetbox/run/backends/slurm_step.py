"""A Slurm job step's end: what srun and each node's script said of every node (the facts the judge reads), and,
inside the allocation, what the next step runs on after one failed (a spare in the culprit's place, or one node
fewer: `main`).

Standard library and the judge only (PACKED lists the modules; the import-linter contract "allocation" holds it):
`submit` packs them into the job folder (ALLOCATION_PYZ), and the batch script runs them with the node's own
python3, as it does run/hang.py, since fleetbox may be installed where no node sees it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

from fleetbox import files
from fleetbox.run import node_log
from fleetbox.run.judge import JobFacts, NodeFacts, judge, next_nodes
from fleetbox.run.result import JobResult, fewer_line, last_words, spare_line

REQUEUED_RUN = "requeued"   # how chain.sh records a run that Slurm cut short and ran again in the same job
# how chain.sh records a step that failed and was followed by another in the same allocation: a spare in a node's
# place, or one node fewer (main)
HERE = ("spare", "fewer")
UNRECORDED = "unrecorded"   # a step that followed one of HERE and ended with no record of its own (unrecorded)
REPLACED = "replaced.jsonl"   # each spare's place (JobResult.replaced), one line each, by main
ALLOCATION_PYZ = "allocation.pyz"   # this module and the judge's, as the batch script runs them (pack)

FAILED_TASK = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-\d+)?: "
                         r"(?:Exited with exit code (\d+)|(Killed|Terminated|Out Of Memory))")
SIGNALLED = {"Killed": 128 + 9, "Out Of Memory": 128 + 9, "Terminated": 128 + 15}
STEP_STOPPING = re.compile(r"srun: .*(Terminating StepId|Job step aborted)")
# where a run of the batch script begins (a requeue runs it again), and where each of its steps does (chain.sh)
RUN_START = re.compile(r"^fleetbox: (run \d+ of Slurm job |allocation \d+ \(Slurm job \S+\) starts )", re.M)
NODE_EXITS = (2, 3, 4, 5)   # node.sh's own: no route or allocation, no image or env, modules, GPU prerequisite
IMAGE_MISSING = re.compile(r"^fleetbox: (image missing .+)$")   # runtimes.Runtime.identify's own line


class TaskFailure(NamedTuple):
    rank: int
    code: int
    node: str
    oom: bool = False
    stopped: bool = False   # reported killed, or after srun began stopping the step: maybe srun's doing


def goes_on(rec: dict) -> bool:
    """Another run follows the allocation `rec` records: the next Slurm job, or a run in the same one."""
    return bool(rec["next"]) or rec["ended"] in (REQUEUED_RUN, *HERE)


def unrecorded(rec: dict, state: str) -> dict:
    """The record of the step that followed `rec` (one of HERE) in the same Slurm job and ended with none of its
    own (its batch script was ended: a time limit, a cancel, a node lost; Slurm's final `state`)."""
    return {**rec, "allocation": rec["allocation"] + 1, "nodes": rec["nodes"] - (rec["ended"] == "fewer"),
            "from_step": rec["to_step"], "ended": UNRECORDED, "exit": -1, "state": state, "left_out": ""}


def this_run(batch_output: str) -> str:
    """The batch output of the job's newest step: a requeued job appends each run's to the same file, and a run
    may hold several steps (a spare's, one node fewer)."""
    starts = [m.start() for m in RUN_START.finditer(batch_output)]
    return batch_output[starts[-1]:] if starts else batch_output


def failures(batch_output: str) -> list[TaskFailure]:
    """Failed tasks in the order srun reported them (one task per node). srun names a task killed by a
    signal rather than giving its code: we give the shell's 128+N."""
    out, stopping = [], False
    for ln in batch_output.splitlines():
        stopping = stopping or bool(STEP_STOPPING.search(ln))
        if m := FAILED_TASK.search(ln):
            code = int(m.group(3)) if m.group(3) else SIGNALLED[m.group(4)]
            out.append(TaskFailure(int(m.group(2)), code, m.group(1), m.group(4) == "Out Of Memory",
                                   stopping or m.group(4) in ("Killed", "Terminated")))
    return out


def node_said(node_log_path: Path) -> str:
    """Why node.sh stopped its node before the training started (a module, the allocation, the image or env), from
    the line it printed last; "" when the training ran."""
    lines = [ln for ln in (node_log_path.read_text(errors="replace") if node_log_path.exists() else "").splitlines()
             if ln]
    last = next((ln for ln in reversed(lines) if node_log.HELD not in ln), "")   # the hold's line is after it
    said = node_log.lines(last)
    return said[0][2] if said else m.group(1) if (m := IMAGE_MISSING.match(last)) else ""


def node_host(node_log_path: Path) -> str:
    """The Slurm node a task ran on, from the line node.sh prints first."""
    return node_log.host(node_log_path.read_text(errors="replace") if node_log_path.exists() else "")


def hang_of(job_dir: Path, rec: dict) -> dict | None:
    """What hang detection kept of an allocation that hung (hang-<attempt>/hang.json, written by that Slurm job's
    own watcher), else None."""
    found = files.read_json(job_dir / f"hang-{rec['allocation'] - 1}" / "hang.json")
    return found if found and found.get("slurm_job") == rec["slurm_job"] else None


def chain_end(rec: dict) -> str:
    """How one allocation ended, in words."""
    step = rec["to_step"]
    return {
        "finished": f"finished at checkpoint step {step}",
        "continue": f"stopped at the time limit with a checkpoint at step {step}; continued in Slurm job {rec['next']}",
        "no-progress": f"allocation {rec['allocation']} made no progress (its newest checkpoint is still step "
                       f"{rec['from_step']}): not continuing",
        "max-allocations": f"stopped at step {step} to continue, but --max-allocations {rec['max_allocations']} "
                           f"was reached",
        "restart": f"failed (exit {rec['exit']}); restarted from step {step} in Slurm job {rec['next']}",
        "failed": f"failed (exit {rec['exit']})",
        "hung": "hung (stopped by hang detection)",
        "cancelled": "cancelled",
        "submit-failed": f"could not submit the next allocation (see slurm-{rec['slurm_job']}.out)",
        REQUEUED_RUN: f"requeued by Slurm (a node failure, preemption or scontrol requeue) at checkpoint step {step}; "
                      f"restarted in the same Slurm job {rec['slurm_job']}",
        "requeue-refused": "requeued by Slurm, but --max-restarts was spent: not run again",
        "spare": f"failed (exit {rec['exit']}); {went_on(rec)}",
        "fewer": f"failed (exit {rec['exit']}); {went_on(rec)}",
        UNRECORDED: f"ended with no record of its own (Slurm: {rec.get('state')})",
    }.get(rec["ended"], rec["ended"])


def went_on(rec: dict) -> str:
    """How the step after `rec` (one of HERE) went on, in words."""
    how = "a spare in its place" if rec["ended"] == "spare" else "one node fewer"
    return (f"{rec.get('left_out')} left out, {how}: restarted from step {rec['to_step']} in the same Slurm job "
            f"{rec['slurm_job']}")


def facts(job_dir: Path, slurm_job: str, nodes: int, procs_per_node: int, state: str, last: dict | None) -> JobFacts:
    """What srun reported of each of the newest step's `nodes` tasks (in the order it reported them, in Slurm job
    `slurm_job`'s batch output), what the chain recorded of its last allocation, and Slurm's state of the job."""
    batch = job_dir / f"slurm-{slurm_job}.out"
    fails = failures(this_run(batch.read_text(errors="replace") if batch.exists() else ""))
    one_worker = procs_per_node == 1
    # the time limit ended it, the chain not going on (it records each allocation it ends: this one, none)
    timed_out = state == "TIMEOUT" and (last is None or last["slurm_job"] != slurm_job or last["ended"] == UNRECORDED)
    cancelled = state == "CANCELLED" or bool(last and last["ended"] == "cancelled")
    out, ranks = [], set()
    for f in fails:
        if f.rank in ranks or not 0 <= f.rank < nodes:   # srun's first word of each of the job's tasks
            continue
        log = job_dir / f"node{f.rank}.log"
        said = node_said(log) if f.code in NODE_EXITS else ""   # node.sh stopped it, saying why
        # srun --kill-on-bad-exit stops the other tasks after the first failure: a task it reports after that
        # was stopped by Slurm, not failing by itself (at the time limit or a cancel, Slurm stopped every one)
        stopped = (bool(out) or timed_out or cancelled) and f.stopped
        out.append(NodeFacts(f.rank, str(log), f.node or node_host(log), f.code, len(out), stopped, oom=f.oom,
                             last_words=last_words(job_dir / f"node{f.rank}", log)
                             if one_worker and not stopped else None,
                             said=f"stopped before the training: {said} (exit {f.code})" if said else "",
                             output=str(log)))
        ranks.add(f.rank)
    for k in range(nodes):   # the others ended well if the job did; else Slurm did not say
        if k not in ranks:
            log = job_dir / f"node{k}.log"
            out.append(NodeFacts(k, str(log), node_host(log), 0 if state == "COMPLETED" else None, output=str(log)))
    chain = last["ended"] if last and last["ended"] != UNRECORDED else "finished"
    return JobFacts(out, timed_out, hang_of(job_dir, last) if last else None,   # its stacks blame a node
                    completed=state == "COMPLETED" and chain == "finished",
                    ended="" if timed_out or chain in ("finished", "failed", "restart", "hung", *HERE)
                    else chain_end(last) + (f"; that run ended with no record (Slurm: {state})"
                                            if chain == REQUEUED_RUN else ""))


class Next(NamedTuple):
    """What the next step in the allocation runs on: `host` left out, on `nodes` nodes; `spent`: it spends one of
    --max-restarts (a node that never started the training spends none, while a spare takes its place)."""
    host: str
    nodes: int
    spent: bool
    line: str                 # the restart's line, as the batch output says it
    replaced: dict | None     # the spare's place (JobResult.replaced), None for one node fewer


def next_step(job_dir: Path, slurm_job: str, allocation: int, procs_per_node: int, min_nodes: int, restarts: int,
              max_restarts: int, step: list[str], spares: list[str]) -> Next | None:
    """After allocation `allocation`'s step on the hosts `step` (Slurm's names, in the order its node ids follow)
    failed: the judge's culprit left out, the first of `spares` in its place, else one node fewer while --min-nodes
    allows; None where the next step is not this allocation's (no culprit, no restart left, or every node stopped
    before the training alike: the job's own failure, which no other node mends)."""
    last = {"allocation": allocation, "slurm_job": slurm_job, "ended": "restart"}
    seen = facts(job_dir, slurm_job, len(step), procs_per_node, "RUNNING", last)
    result = judge(seen, job_dir.name, "slurm", str(job_dir), JobResult, attempts_are="allocations", name_host=True)
    bad = next((n for n in seen.nodes if n.rank == result.culprit), None)
    how, node = next_nodes(result.culprit, len(spares), 0 < min_nodes < len(step))
    if how == "same" or bad is None:
        return None
    said = [n.exit_code for n in seen.nodes if n.said]
    if len(step) > 1 and len(said) == len(step) and len(set(said)) == 1:
        return None
    # a node that stopped before the training is its own fault (no restart spent) only where another node of the
    # step got past the same checks: its workers started
    trained = [k for k in range(len(step)) if k != node and any((job_dir / f"node{k}").glob("workerlog.*"))]
    spent = not (bad.said and how == "spare" and trained)
    if spent and restarts >= max_restarts:
        return None
    host, why = step[node] if node < len(step) else bad.host, result.reason()   # Slurm's name: the step's order
    restart = f"(restart {restarts + 1} of {max_restarts})" if spent else "(no restart spent: it never started)"
    if how == "spare":
        r = {"attempt": allocation, "node": node, "host": host, "by": spares[0], "why": why, "ran": not bad.said}
        return Next(host, len(step), spent, spare_line(allocation - 1, why, r, len(step), restart), r)
    return Next(host, len(step) - 1, spent,
                fewer_line(allocation - 1, why, node, host, len(step) - 1, procs_per_node, restart), None)


def main(argv: list[str]) -> int:
    """The batch script's question after a failed step: python3 allocation.pyz JOB_DIR CHAIN ALLOCATION PPN
    MIN_NODES RESTARTS MAX_RESTARTS STEP SPARES (STEP, SPARES: the hosts, comma-separated; "-" for none). Prints
    `HOST NODES SPENT` (next_step; SPENT 1 or 0), or nothing; the restart's line goes to standard error, and a
    spare's place to REPLACED."""
    job_dir, chain, allocation, ppn, min_nodes, restarts, max_restarts, step, spares = argv
    hosts = [[h for h in s.split(",") if h and h != "-"] for s in (step, spares)]
    slurm_job = os.environ.get("SLURM_JOB_ID", "")
    got = next_step(Path(job_dir), slurm_job, int(allocation), int(ppn), int(min_nodes), int(restarts),
                    int(max_restarts), *hosts)
    if got is None:
        return 0
    if got.replaced is not None:
        with open(Path(job_dir, REPLACED), "a") as f:
            f.write(json.dumps({"chain": chain, **got.replaced}) + "\n")
    print(f"fleetbox: {got.line}", file=sys.stderr, flush=True)
    print(got.host, got.nodes, int(got.spent))
    return 0


def replaced(job_dir: Path, chain: str) -> list[dict]:
    """Each spare's place in the chain that began with Slurm job `chain` (JobResult.replaced)."""
    p = job_dir / REPLACED
    recs = [json.loads(ln) for ln in (p.read_text().splitlines() if p.exists() else []) if ln.strip()]
    return [{k: v for k, v in r.items() if k != "chain"} for r in recs if r.get("chain") == chain]


# What the pack holds: this module and what it imports, the standard library apart (the "allocation" contract)
PACKED = ("fleetbox/__init__.py", "fleetbox/files.py", "fleetbox/run/__init__.py", "fleetbox/run/hang.py",
          "fleetbox/run/judge.py", "fleetbox/run/node_log.py", "fleetbox/run/output.py", "fleetbox/run/result.py",
          "fleetbox/incontainer/__init__.py", "fleetbox/incontainer/fleetbox_found.py",
          "fleetbox/incontainer/fleetbox_progress.py")


def pack(dest: Path) -> None:
    """ALLOCATION_PYZ: a zip python3 runs (`__main__.py` calls main), with this module at its top (its package's
    __init__ loads every backend) and fleetbox's modules it needs, at their paths."""
    root = Path(files.__file__).parent.parent
    with files.atomic(dest) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("__main__.py", "import sys\nimport slurm_step\nsys.exit(slurm_step.main(sys.argv[1:]))\n")
        z.write(__file__, "slurm_step.py")
        for name in PACKED:
            z.write(root / name, name)

