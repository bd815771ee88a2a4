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
from fleetbox.run.result import JobResult, replaced_text


def first_start(job_dir: Path, job: dict) -> float | None:
    """When the job's first attempt began, as its folder says (run/jobfolder.py)."""
    return JobFolder.at(job_dir).starts(job)[0]


def step_rates(recs: list[dict]) -> dict[tuple[int, int], dict[int, tuple[float, float]]]:
    """(attempt, step): node: (when its last rank logged the step, its ranks' samples/s added up)."""
    by = defaultdict(lambda: defaultdict(lambda: [-math.inf, 0.0]))
    for r in recs:
        if "samples_per_s" in r:
            at = by[(r["attempt"], r["step"])][r["node"]]
            at[0], at[1] = max(at[0], r["time"]), at[1] + r["samples_per_s"]
    return {k: {node: (t, x) for node, (t, x) in nodes.items()} for k, nodes in by.items()}


def rate_lines(recs: list[dict], t0: float) -> dict[int, list[list[tuple[float, float]]]]:
    """Each node's samples/s against seconds since t0: one line per attempt (none drawn across the gap between
    a failure and its restart), each point the node's ranks added up at a step."""
    lines = defaultdict(lambda: defaultdict(list))   # node: attempt: points
    for (attempt, _), nodes in step_rates(recs).items():
        for node, (t, x) in nodes.items():
            lines[node][attempt].append((t - t0, x))
    return {node: [sorted(pts) for _, pts in sorted(by.items())] for node, by in sorted(lines.items())}


def node_rates(recs: list[dict], t0: float) -> dict[int, list[tuple[float, float]]]:
    """Each node's samples/s at each step (its ranks added up), against one time per step for every node (the
    nodes' median seconds since t0), so that the nodes' rates at a step fall on one x."""
    out = defaultdict(list)
    for _, nodes in sorted(step_rates(recs).items()):
        x = statistics.median(t for t, _ in nodes.values()) - t0
        for node, (_, rate) in nodes.items():
            out[node].append((x, rate))
    return dict(sorted(out.items()))


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
    n = total = comm = comm_of = 0.0
    for r in recs:   # one pass
        if "seconds" in r:
            n, total = n + 1, total + r["seconds"]
            if "comm_seconds" in r:
                comm, comm_of = comm + r["comm_seconds"], comm_of + r["seconds"]
    return {"step_seconds": total / n if n else None, "comm_share": comm / comm_of if comm_of > 0 else None}


def straggling(recs: list[dict]) -> dict:
    """Each rank's own work per step (median seconds of its `own_seconds`) and the stragglers among them (the same
    rule as live, hang.stragglers: {rank: the other ranks' median})."""
    own = defaultdict(list)
    for r in recs:
        if "own_seconds" in r and math.isfinite(r["own_seconds"]) and r["own_seconds"] >= 0:
            own[r["rank"]].append(r["own_seconds"])
    medians = {k: statistics.median(v) for k, v in sorted(own.items())}
    return {"own": medians, "stragglers": hang.stragglers(medians)}


SMALL = 8   # up to this many ranks (or nodes), every one drawn and named; beyond, a band and the ranks outside it
NAMED = 8   # at most this many ranks named in one line of report.md, then how many more


def by_rank(recs: list[dict]) -> dict[int, list[dict]]:
    """Each rank's records, in the order given: the one pass every per-rank figure reads."""
    out = defaultdict(list)
    for r in recs:
        out[r["rank"]].append(r)
    return dict(sorted(out.items()))


def some(items: list[str]) -> str:
    """At most NAMED of them, then how many more: a line a person reads at any size."""
    return ", ".join(items[:NAMED]) + (f" and {len(items) - NAMED} more" if len(items) > NAMED else "")


def outliers(values: dict[int, float]) -> list[int]:
    """The ranks whose value is far outside the others' (Tukey's fences: 3 interquartile ranges beyond the
    quartiles, and more than 1% of the median away, so identical ranks with a rounding's difference are not)."""
    finite = sorted(v for v in values.values() if math.isfinite(v))
    if len(finite) < 4:
        return []
    q1, _, q3 = statistics.quantiles(finite, n=4)
    mid, reach = statistics.median(finite), 3 * (q3 - q1)
    return sorted(k for k, v in values.items()
                  if not math.isfinite(v) or abs(v - mid) > 0.01 * abs(mid) and not q1 - reach <= v <= q3 + reach)


def band(points: dict[int, list[tuple[float, float]]], leave_out=()) -> list[tuple[float, float, float, float]]:
    """(x, median, min, max) over the series at each x, those in `leave_out` left out."""
    at = defaultdict(list)
    for k, pts in points.items():
        if k not in leave_out:
            for x, y in pts:
                at[x].append(y)
    return [(x, statistics.median(ys), min(ys), max(ys)) for x, ys in sorted(at.items())]


def draw_band(ax, points: dict[int, list[tuple[float, float]]], named: list[int], what: str, fmt: str = "-",
              **kw) -> None:
    """The series as a band (their median, their range) with each of `named` drawn on its own."""
    b = band(points, named)
    if b:
        ax.fill_between([x for x, *_ in b], [lo for *_, lo, _ in b], [hi for *_, hi in b], alpha=0.25, lw=0,
                        label=f"range of {len(points) - len(named)} {what}s")
        ax.plot([x for x, *_ in b], [m for _, m, *_ in b], fmt, lw=1, label=f"median of {len(points) - len(named)} "
                                                                             f"{what}s", **kw)
    for k in named:
        ax.plot([x for x, _ in points[k]], [y for _, y in points[k]], fmt, lw=1, label=f"{what} {k}", **kw)


def straggler_text(s: dict, ppn: int) -> str:
    if not s["own"]:
        return "unknown (the script reports no own time per step: fleetbox_metrics' Meter gives it from " \
               "comm_seconds, or log own_seconds)"
    if not s["stragglers"]:
        if len(s["own"]) > SMALL:
            ms = sorted(1000 * t for t in s["own"].values())
            return (f"none (own work per step: median {statistics.median(ms):.1f} ms over {len(ms)} ranks, "
                    f"{ms[0]:.1f} to {ms[-1]:.1f} ms)")
        return "none (own work per step: " + ", ".join(f"rank {k} {1000 * t:.1f} ms" for k, t in s["own"].items()) + ")"
    return some([f"node{k // ppn} (rank {k}): {1000 * s['own'][k]:.1f} ms a step of its own work against "
                 f"{1000 * m:.1f} ms for the other ranks" + (f" ({s['own'][k] / m:.1f}x)" if m > 0 else "")
                 for k, m in s["stragglers"].items()]).replace(", node", "; node")


def final_loss_text(final: dict[int, tuple[int, float]], odd: list[int]) -> str:
    """Each rank's last loss; beyond SMALL ranks, their median and range and the ranks outside it."""
    if len(final) <= SMALL:
        return ", ".join(f"rank {k} {v:.4f} (step {s})" for k, (s, v) in sorted(final.items())) or "none"
    usual = sorted(v for k, (_, v) in final.items() if k not in odd)
    steps = sorted({s for s, _ in final.values()})
    at = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]} to {steps[-1]}"
    return (f"median {statistics.median(usual):.4f} over {len(usual)} ranks ({usual[0]:.4f} to {usual[-1]:.4f}, "
            f"{at})" + (f"; outside it: {some([f'rank {k} {final[k][1]:.4f}' for k in odd])}" if odd else ""))


def steps_text(ranks: dict[int, list[dict]]) -> str:
    """How many steps each rank logged and its last: one figure where every rank has the same, else each
    different count with its ranks."""
    counts = {k: (len(rs), max(r["step"] for r in rs)) for k, rs in ranks.items()}
    if len(counts) <= SMALL:
        return ", ".join(f"rank {k} {n} (last {last})" for k, (n, last) in counts.items())
    groups = defaultdict(list)
    for k, c in counts.items():
        groups[c].append(k)
    (usual, most), *others = sorted(groups.items(), key=lambda g: -len(g[1]))
    return (f"{usual[0]} (last {usual[1]}) for {'all ' if not others else ''}{len(most)} ranks"
            + "".join(f"; {n} (last {last}): {some([f'rank {k}' for k in ks])}" for (n, last), ks in others))


def lr_series(ranks: dict[int, list[dict]]) -> dict[tuple, list[int]]:
    """Each distinct learning-rate series, [(step, lr)], with the ranks that logged it (data parallel: one for all)."""
    out = defaultdict(list)
    for k, rs in sorted(ranks.items()):
        if pts := tuple((r["step"], r["lr"]) for r in rs if metrics.number(r.get("lr"))):
            out[pts].append(k)
    return dict(out)


def lr_text(series: dict[tuple, list[int]], nranks: int) -> str:
    """The learning rate from its first step to its last, once where every rank logged the same."""
    if not series:
        return "not logged (found at each optimizer step, or a Meter's `lr`)"
    if len(series) == 1 and len(next(iter(series.values()))) == nranks:
        pts = next(iter(series))
        return f"{pts[0][1]:.4g} at step {pts[0][0]} to {pts[-1][1]:.4g} at step {pts[-1][0]}, the same on every rank"
    return "; ".join(f"{pts[0][1]:.4g} to {pts[-1][1]:.4g} ({some([f'rank {k}' for k in ks])})"
                     for pts, ks in list(series.items())[:NAMED]) + ("; ..." if len(series) > NAMED else "")


def world_changes(summary: dict) -> dict[int, int]:
    """{attempt: its nodes} for each attempt that ran on fewer nodes than the one before (--min-nodes)."""
    attempts = [a for a in summary.get("attempts", []) if isinstance(a.get("nodes"), int)]
    return {b["attempt"]: b["nodes"] for a, b in zip(attempts, attempts[1:]) if b["nodes"] < a["nodes"]}


def replaced_steps(r: dict, recs: list[dict]) -> tuple[int | None, int | None]:
    """For a node's host a spare took the place of (the summary's replaced): the last step the metrics show of
    the attempt before, and the first of the spare's attempt."""
    ran = {a: [x["step"] for x in recs if x["attempt"] == a] for a in (r["attempt"] - 1, r["attempt"])}
    before, after = ran[r["attempt"] - 1], ran[r["attempt"]]
    return (max(before) if before else None), (min(after) if after else None)


def draw(job_dir: Path) -> dict:
    """Write report.png and report.md for the job; returns what was drawn and what was missing. The records are
    grouped once; beyond SMALL ranks (nodes) the figures are bands with the ranks outside them drawn and named."""
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
        missing.append("no metrics lines (no optimizer step ran, or hang detection was off: metrics are found in the "
                       "training by its writer)")
    if not summary:
        missing.append("no summary.json (the job is still running, or was killed before it ended)")
    last = max((r["attempt"] for r in recs), default=0)
    start = job_start(job_dir, job)
    nranks = job.get("nodes", 0) * job.get("procs_per_node", 1)
    ranks = by_rank(recs)
    for k in range(nranks):
        if k not in ranks:
            missing.append(f"rank {k} printed no metrics")
    lines_last = [r for r in recs if r["attempt"] == last]
    ranks_last = by_rank(lines_last)
    final = {k: max(((r["step"], r["loss"]) for r in rs if "loss" in r), default=None, key=lambda p: p[0])
             for k, rs in ranks_last.items()}
    final = {k: v for k, v in final.items() if v is not None}
    odd = outliers({k: v for k, (_, v) in final.items()}) if len(final) > SMALL else []

    fig, (ax_loss, ax_rate, ax_own) = plt.subplots(3, 1, figsize=(9, 11))
    loss = {k: [(r["step"], r["loss"]) for r in rs if "loss" in r] for k, rs in ranks.items()}
    loss = {k: pts for k, pts in loss.items() if pts}
    if len(loss) <= SMALL:
        for k, pts in loss.items():
            ax_loss.plot([s for s, _ in pts], [v for _, v in pts], ".-", ms=2, lw=1, label=f"rank {k}")
    else:
        draw_band(ax_loss, loss, odd, "rank")
    ax_loss.set(xlabel="step", ylabel="loss", title=f"{job_dir.name}: loss by rank")
    lrs = lr_series(ranks_last)
    if lrs:   # the last attempt's: its steps are those of the loss drawn last
        ax_lr = ax_loss.twinx()
        for pts, ks in list(lrs.items())[:NAMED]:
            ax_lr.plot([s for s, _ in pts], [v for _, v in pts], "--", lw=1, color="grey",
                       label="learning rate" + ("" if len(lrs) == 1 else f" ({some([f'rank {k}' for k in ks])})"))
        ax_lr.set(ylabel="learning rate")
        ax_lr.legend(fontsize=7, loc="upper center")
    began = first_start(job_dir, job)   # the plot's time runs from the job's first start, over every attempt
    t0 = min([r["time"] for r in recs] + ([began] if began is not None else []), default=0.0)
    nodes = {rs[0]["node"] for rs in ranks.values()}
    rates = rate_lines(recs, t0) if len(nodes) <= SMALL else node_rates(recs, t0)
    if len(nodes) <= SMALL:
        for node, lines in sorted(rates.items()):
            color = None   # the node's one color, over each attempt's own line
            for pts in lines:
                (drawn,) = ax_rate.plot([t for t, _ in pts], [x for _, x in pts], lw=1, color=color,
                                        label=None if color else f"node{node}")
                color = drawn.get_color()
    else:
        draw_band(ax_rate, rates, [], "node")
    ax_rate.set(xlabel="seconds since the job started" if began is not None else "seconds since the first step",
                ylabel="samples/s", title="throughput by node")
    slow = straggling(lines_last)
    own = {k: [(r["step"], 1000 * r["own_seconds"]) for r in ranks_last[k] if "own_seconds" in r]
           for k in slow["own"]}
    if len(own) <= SMALL:
        for k, pts in own.items():
            ax_own.plot([s for s, _ in pts], [v for _, v in pts], ".", ms=2, label=f"rank {k}"
                        + (" (straggler)" if k in slow["stragglers"] else ""))
    else:
        draw_band(ax_own, own, sorted(slow["stragglers"])[:NAMED], "rank", fmt=".", ms=2)
    ax_own.set(xlabel="step", ylabel="ms", title="own work per step by rank (not waiting for the others)"
               + (f" (attempt {last})" if last else ""))
    word = backends.attempts_are(job, summary).removesuffix("s")
    shrank = world_changes(summary)
    spared = {}   # attempt: the nodes a spare took the place of from there
    for r in summary.get("replaced", []):
        spared.setdefault(r["attempt"], []).append(r["node"])
    for a in range(1, last + 1):   # where each restart (or allocation) began, where the world shrank, where spares came
        firsts = [r for r in recs if r["attempt"] == a]
        if firsts:
            at = min(r["step"] for r in firsts)
            ax_loss.axvline(at, color="grey", ls="--", lw=0.8)
            said = ([f"{shrank[a]} nodes from here"] if a in shrank else []) + \
                [f"node{k} on a spare from here" for k in spared.get(a, [])]
            if said:
                ax_loss.annotate("; ".join(said), (at, 0), xycoords=("data", "axes fraction"),
                                 rotation=90, fontsize=7, color="grey", va="bottom")
            ax_rate.axvline(min(r["time"] for r in firsts) - t0, color="grey", ls="--", lw=0.8)
            ax_rate.annotate(f"{word} {a + (1 if word == 'allocation' else 0)}"
                             + (f": {shrank[a]} nodes" if a in shrank else ""),
                             (min(r["time"] for r in firsts) - t0, 0), xycoords=("data", "axes fraction"),
                             rotation=90, fontsize=7, color="grey", va="bottom")
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
    first_step = min((r["time"] for r in lines_last), default=None)
    ok = summary.get("ok")
    state = "PASSED" if ok else "HUNG" if summary.get("hang") else "FAILED" if summary else "unfinished"
    per_node = "".join(f"; node{n} {x:.1f}" for n, x in rate["nodes"].items()) if len(rate["nodes"]) <= SMALL \
        else (lambda xs: f"; per node: median {statistics.median(xs.values()):.1f} over {len(xs)} nodes "
                         f"(node{min(xs, key=xs.get)} {min(xs.values()):.1f} to node{max(xs, key=xs.get)} "
                         f"{max(xs.values()):.1f})")(rate["nodes"])
    plotted = (f"loss of {', '.join(legend) or 'no rank'}" if len(loss) <= SMALL else
               f"loss: the median and range of {len(loss) - len(odd)} ranks" + (
                   f", and {some([f'rank {k}' for k in odd])} on their own" if odd else ""))
    plotted += (f"; samples/s of {', '.join(node_legend) or 'no node'}" if len(rates) <= SMALL else
                f"; samples/s: the median and range of {len(rates)} nodes")
    md = [f"# {job_dir.name}: {state}", "",
          f"- backend: {job.get('backend', summary.get('backend', '?'))}"
          + (f" ({job['runtime']})" if job.get("runtime") else "")
          + f", {job.get('nodes', '?')} node(s) x {job.get('procs_per_node', '?')} process(es)"
          + (f" ({summary['attempts'][0].get('nodes', '?')} at the start)" if shrank else ""),
          f"- image: {job.get('image', '?')}" + (f" (id {job['image_id'][7:19]}" if job.get("image_id") else "")
          + (f", content tag {job['content_tag'][:12]})" if job.get("content_tag")
             else ")" if job.get("image_id") else ""),
          f"- variant: {job.get('variant', '?')}, Paddle {_paddle(job)}",
          "- started: " + (dt.datetime.fromtimestamp(start).isoformat(timespec="seconds") if start else "unknown")
          + (f"; time to first step: {first_step - start:.1f} s" if start and first_step else ""),
          "- final loss: " + final_loss_text(final, odd),
          "- learning rate: " + lr_text(lrs, len(ranks_last)),
          ("- throughput: " + (f"{rate['total']:.1f} samples/s" if rate["ranks"] else
                                "unknown (no data loader's batch was seen; fleetbox_metrics' Meter counts samples)"))
          + (f" (attempt {last})" if last and rate["ranks"] else "") + (per_node if rate["ranks"] else ""),
          "- step time: " + (f"{1000 * times['step_seconds']:.1f} ms (mean over ranks and steps)"
                              if times["step_seconds"] is not None else "unknown")
          + (f", {100 * times['comm_share']:.1f}% in the script's own all-reduce"
             if times["comm_share"] is not None else ""),
          "- stragglers: " + straggler_text(slow, job.get("procs_per_node", 1)),
          "- steps: " + steps_text(ranks),
          f"- plotted: {plotted}"]
    for a in summary.get("attempts", []):
        md.append(f"- attempt {a['attempt']}" + (f" ({a['state']})" if a.get("state") else "")
                  + (f", on {shrank[a['attempt']]} nodes: the world shrank" if a["attempt"] in shrank else "")
                  + f": {a['ended']}")
    md += [f"- {replaced_text(r, *replaced_steps(r, recs))}" for r in summary.get("replaced", [])]
    if summary and not ok:
        md.append(f"- failure: {_failure(summary)}")
    if summary.get("hang"):
        md.append(f"- stacks and last lines of every rank: {summary['hang']['dir']}")
    if missing:
        md += ["", "## Missing", ""] + [f"- {m}" for m in missing]
    md += ["", "![report](report.png)", ""]
    files.write_atomic(job_dir / "report.md", "\n".join(md))
    return {"png": str(png), "md": str(job_dir / "report.md"), "legend": legend, "node_legend": node_legend,
            "missing": missing, "throughput": rate,
            "lr": {k: pts for pts, ks in lrs.items() for k in ks}, "shrank": shrank, "spared": spared,
            "stragglers": slow["stragglers"], "outliers": odd,
            **times}


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
