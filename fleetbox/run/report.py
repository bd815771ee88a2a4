"""A run's report, from whatever the job left in runs/<job>/ (also for a failed or cancelled run):
report.png (loss against step for every rank; samples/s over time for every node; each rank's own work per
step, where stragglers show; restarts and allocations marked) and report.md (nodes, image, variant, Paddle,
final loss, throughput, time to first step, stragglers, failures, and what is missing). Drawn on this machine
with matplotlib; the images stay as they are."""

from __future__ import annotations

import datetime as dt
import math
import statistics
from collections import defaultdict
from pathlib import Path

from fleetbox import files
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import backends, hang, metrics, records
from fleetbox.run.jobfolder import JobFolder
from fleetbox.run.result import JobResult


def first_start(job_dir: Path, job: dict) -> float | None:
    """When the job's first attempt began, as its folder says (run/jobfolder.py)."""
    return JobFolder.at(job_dir).starts(job)[0]


def rate_lines(recs: list[dict], t0: float) -> dict[int, list[list[tuple[float, float]]]]:
    """Each node's samples/s against seconds since t0: one line per attempt (none drawn across the gap between
    a failure and its restart), each point the node's ranks added up at a step."""
    by = defaultdict(lambda: defaultdict(list))
    for r in recs:
        if "samples_per_s" in r:
            by[(r["node"], r["attempt"])][r["step"]].append((r["time"], r["samples_per_s"]))
    out = defaultdict(list)
    for (node, _), steps in sorted(by.items()):
        out[node].append(sorted((max(t for t, _ in v) - t0, sum(x for _, x in v)) for v in steps.values()))
    return dict(out)


def job_start(job_dir: Path, job: dict) -> float | None:
    """When the job's last attempt began, as its folder says."""
    return JobFolder.at(job_dir).starts(job)[1]


def throughput(recs: list[dict]) -> dict:
    """samples/s of each rank over its steps (the samples and seconds its Meter counted), per node and in all."""
    by_rank = defaultdict(lambda: [0.0, 0.0, None])
    for r in recs:
        if "samples" in r and "seconds" in r:
            acc = by_rank[r["rank"]]
            acc[0] += r["samples"]
            acc[1] += r["seconds"]
            acc[2] = r["node"]
    ranks = {k: s / t for k, (s, t, _) in by_rank.items() if t > 0}
    nodes = defaultdict(float)
    for k, rate in ranks.items():
        nodes[by_rank[k][2]] += rate
    return {"total": sum(ranks.values()), "ranks": dict(sorted(ranks.items())), "nodes": dict(sorted(nodes.items()))}


def timing(recs: list[dict]) -> dict:
    """Mean seconds per step over every rank's steps, and the share of it the script spent communicating (its
    `comm_seconds` metric; None when it does not report one)."""
    timed = [r for r in recs if "seconds" in r]
    total = sum(r["seconds"] for r in timed)
    comm = [r for r in timed if "comm_seconds" in r]
    return {"step_seconds": total / len(timed) if timed else None,
            "comm_share": sum(r["comm_seconds"] for r in comm) / sum(r["seconds"] for r in comm)
            if comm and sum(r["seconds"] for r in comm) > 0 else None}


def straggling(recs: list[dict]) -> dict:
    """Each rank's own work per step (median seconds of its `own_seconds`) and the stragglers among them (the same
    rule as live, hang.stragglers: {rank: the other ranks' median})."""
    own = defaultdict(list)
    for r in recs:
        if "own_seconds" in r and math.isfinite(r["own_seconds"]) and r["own_seconds"] >= 0:
            own[r["rank"]].append(r["own_seconds"])
    medians = {k: statistics.median(v) for k, v in sorted(own.items())}
    return {"own": medians, "stragglers": hang.stragglers(medians)}


def straggler_text(s: dict, ppn: int) -> str:
    if not s["own"]:
        return "unknown (the script reports no own time per step: fleetbox_metrics' Meter gives it from " \
               "comm_seconds, or log own_seconds)"
    if not s["stragglers"]:
        return "none (own work per step: " + ", ".join(f"rank {k} {1000 * t:.1f} ms" for k, t in s["own"].items()) + ")"
    return "; ".join(f"node{k // ppn} (rank {k}): {1000 * s['own'][k]:.1f} ms a step of its own work against "
                     f"{1000 * m:.1f} ms for the other ranks" + (f" ({s['own'][k] / m:.1f}x)" if m > 0 else "")
                     for k, m in s["stragglers"].items())


def draw(job_dir: Path) -> dict:
    """Write report.png and report.md for the job; returns what was drawn and what was missing."""
    import matplotlib  # noqa: PLC0415 (deferred: matplotlib takes a second to load; only drawing needs it)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (deferred: matplotlib takes a second to load; only drawing needs it)

    if not job_dir.is_dir():
        raise UserError(f"no job folder {job_dir}")
    recs = metrics.read(job_dir)
    metrics.collect(job_dir, recs)
    job, summary = files.read_json(job_dir / records.JOB), files.read_json(job_dir / records.SUMMARY)
    missing = []
    if not recs:
        missing.append("no metrics lines (the script does not use fleetbox_metrics, or no step ran)")
    if not summary:
        missing.append("no summary.json (the job is still running, or was killed before it ended)")
    last = max((r["attempt"] for r in recs), default=0)
    start = job_start(job_dir, job)
    nranks = job.get("nodes", 0) * job.get("procs_per_node", 1)
    seen = {r["rank"] for r in recs}
    for k in range(nranks):
        if k not in seen:
            missing.append(f"rank {k} printed no metrics")

    fig, (ax_loss, ax_rate, ax_own) = plt.subplots(3, 1, figsize=(9, 11))
    by_rank = defaultdict(list)
    for r in recs:
        if "loss" in r:
            by_rank[r["rank"]].append((r["step"], r["loss"]))
    for k, pts in sorted(by_rank.items()):
        ax_loss.plot([s for s, _ in pts], [v for _, v in pts], ".-", ms=2, lw=1, label=f"rank {k}")
    ax_loss.set(xlabel="step", ylabel="loss", title=f"{job_dir.name}: loss by rank")
    began = first_start(job_dir, job)   # the plot's time runs from the job's first start, over every attempt
    t0 = min([r["time"] for r in recs] + ([began] if began is not None else []), default=0.0)
    for node, lines in sorted(rate_lines(recs, t0).items()):
        color = None   # the node's one color, over each attempt's own line
        for pts in lines:
            (drawn,) = ax_rate.plot([t for t, _ in pts], [x for _, x in pts], lw=1, color=color,
                                    label=None if color else f"node{node}")
            color = drawn.get_color()
    ax_rate.set(xlabel="seconds since the job started" if began is not None else "seconds since the first step",
                ylabel="samples/s", title="throughput by node")
    lines_last = [r for r in recs if r["attempt"] == last]
    slow = straggling(lines_last)
    for k in slow["own"]:
        pts = [(r["step"], 1000 * r["own_seconds"]) for r in lines_last if r["rank"] == k and "own_seconds" in r]
        ax_own.plot([s for s, _ in pts], [v for _, v in pts], ".", ms=2, label=f"rank {k}"
                    + (" (straggler)" if k in slow["stragglers"] else ""))
    ax_own.set(xlabel="step", ylabel="ms", title="own work per step by rank (not waiting for the others)"
               + (f" (attempt {last})" if last else ""))
    word = backends.attempts_are(job, summary).removesuffix("s")
    for a in range(1, last + 1):   # where each restart (or allocation) began
        firsts = [r for r in recs if r["attempt"] == a]
        if firsts:
            ax_loss.axvline(min(r["step"] for r in firsts), color="grey", ls="--", lw=0.8)
            ax_rate.axvline(min(r["time"] for r in firsts) - t0, color="grey", ls="--", lw=0.8)
            ax_rate.annotate(f"{word} {a + (1 if word == 'allocation' else 0)}",
                             (min(r["time"] for r in firsts) - t0, 0), rotation=90, fontsize=7, color="grey")
    for ax in (ax_loss, ax_rate, ax_own):
        if ax.lines:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    legend = [t.get_text() for t in ax_loss.get_legend().get_texts()] if ax_loss.get_legend() else []
    node_legend = [t.get_text() for t in ax_rate.get_legend().get_texts()] if ax_rate.get_legend() else []
    png = job_dir / "report.png"
    with files.atomic(png) as part:
        fig.savefig(part, format="png", dpi=90)
    plt.close(fig)

    rate, times = throughput(lines_last), timing(lines_last)
    final = {}
    for r in lines_last:
        if "loss" in r and r["step"] >= final.get(r["rank"], (-1, 0))[0]:
            final[r["rank"]] = (r["step"], r["loss"])
    first_step = min((r["time"] for r in lines_last), default=None)
    ok = summary.get("ok")
    state = "PASSED" if ok else "HUNG" if summary.get("hang") else "FAILED" if summary else "unfinished"
    md = [f"# {job_dir.name}: {state}", "",
          f"- backend: {job.get('backend', summary.get('backend', '?'))}"
          + (f" ({job['runtime']})" if job.get("runtime") else "")
          + f", {job.get('nodes', '?')} node(s) x {job.get('procs_per_node', '?')} process(es)",
          f"- image: {job.get('image', '?')}" + (f" (id {job['image_id'][7:19]}" if job.get("image_id") else "")
          + (f", content tag {job['content_tag'][:12]})" if job.get("content_tag")
             else ")" if job.get("image_id") else ""),
          f"- variant: {job.get('variant', '?')}, Paddle {_paddle(job)}",
          "- started: " + (dt.datetime.fromtimestamp(start).isoformat(timespec="seconds") if start else "unknown")
          + (f"; time to first step: {first_step - start:.1f} s" if start and first_step else ""),
          "- final loss: " + (", ".join(f"rank {k} {v:.4f} (step {s})" for k, (s, v) in sorted(final.items()))
                                or "none"),
          ("- throughput: " + (f"{rate['total']:.1f} samples/s" if rate["ranks"] else
                                "unknown (the script reported no samples; fleetbox_metrics' Meter counts them)"))
          + (f" (attempt {last})" if last and rate["ranks"] else "")
          + "".join(f"; node{n} {x:.1f}" for n, x in rate["nodes"].items()),
          "- step time: " + (f"{1000 * times['step_seconds']:.1f} ms (mean over ranks and steps)"
                              if times["step_seconds"] is not None else "unknown")
          + (f", {100 * times['comm_share']:.1f}% in the script's own all-reduce"
             if times["comm_share"] is not None else ""),
          "- stragglers: " + straggler_text(slow, job.get("procs_per_node", 1)),
          "- steps: " + ", ".join(f"rank {k} {len(mine)} (last {max(mine)})"
                                  for k in sorted(seen) for mine in [[r["step"] for r in recs if r["rank"] == k]]),
          f"- plotted: loss of {', '.join(legend) or 'no rank'}; samples/s of {', '.join(node_legend) or 'no node'}"]
    for a in summary.get("attempts", []):
        md.append(f"- attempt {a['attempt']}" + (f" ({a['state']})" if a.get("state") else "") + f": {a['ended']}")
    if summary and not ok:
        md.append(f"- failure: {_failure(summary)}")
    if summary.get("hang"):
        md.append(f"- stacks and last lines of every rank: {summary['hang']['dir']}")
    if missing:
        md += ["", "## Missing", ""] + [f"- {m}" for m in missing]
    md += ["", "![report](report.png)", ""]
    files.write_atomic(job_dir / "report.md", "\n".join(md))
    return {"png": str(png), "md": str(job_dir / "report.md"), "legend": legend, "node_legend": node_legend,
            "missing": missing, "throughput": rate, "stragglers": slow["stragglers"], **times}


def _paddle(job: dict) -> str:
    """The image's Paddle version as the job recorded it; for a job.json from before it did, the variant's pin
    when the job ran the variant's own image."""
    if "paddle" in job:
        return job["paddle"] or "unknown (the image does not say)"
    try:
        v = matrix.load().get(job.get("variant"))
    except UserError:
        return "unknown"
    return v.paddle_version if job.get("image") in v.aliases else "unknown"


def _failure(summary: dict) -> str:
    """The failure line, as the job's summary says it."""
    try:
        return JobResult.from_summary(summary).reason()
    except TypeError:
        return "see summary.json"
