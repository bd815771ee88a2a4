"""`invoke scale`: the same job at each size (nodes x processes per node) and for each image, one run after
another on either backend, then a table and a plot of what each run measured itself: samples/s, speed-up
and parallel efficiency against the image's smallest run, mean time per step and the share of it spent in
the script's own all-reduce, and each image against the first one at the same size.

The per-rank batch stays the same at every size (weak scaling, as data-parallel training is run), so ideal
scaling is samples/s growing with the number of ranks. Every run is an ordinary job with its own runs/<job>/
folder, logs and report; the study's table and plot are in runs/<study>/."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from fleetbox import files, options, settings
from fleetbox.commands import train as train_cmd
from fleetbox.errors import Failed, UserError
from fleetbox.processes import signals_held, stops_as_interrupt
from fleetbox.run import backends, hostnet, metrics, records
from fleetbox.run import plan as planner
from fleetbox.run import report as report_mod
from fleetbox.run.spec import JobSpec, new_job_id, validate


@dataclass(frozen=True)
class Cell:
    image: str     # as given ("": the variant's own)
    nodes: int
    procs: int

    @property
    def ranks(self) -> int:
        return self.nodes * self.procs


def cells(nodes: str, procs: str | None, images: str | None) -> list[Cell]:
    """Every run of the study, image by image, smallest first."""
    def sizes(option, text):
        got = [options.integer(option, v, 1) for v in options.items(text)]
        if not got:
            raise UserError(f"{option} takes a comma-separated list of sizes, e.g. 1,2,4")
        if len(set(got)) != len(got):
            raise UserError(f"{option} {text}: each size once")
        return sorted(got)
    image_list = options.items(images) or [""]
    if len(set(image_list)) != len(image_list):
        raise UserError(f"--image {images}: each image once")
    return [Cell(img, n, p) for img in image_list
            for n in sizes("--nodes", nodes) for p in sizes("--procs-per-node", procs or "1")]


def job_id(study: str, index: int, cell: Cell) -> str:
    return f"{study}-i{index}-n{cell.nodes}p{cell.procs}"


def measure(job_dir: Path) -> dict:
    """What a run measured itself (its last attempt's metrics lines): samples/s added up over ranks as each
    rank's Meter does, mean step time, communication share, steps per rank."""
    recs = metrics.read(job_dir)
    last = max((r["attempt"] for r in recs), default=0)
    recs = [r for r in recs if r["attempt"] == last]
    ranks = {r["rank"] for r in recs}
    rate = report_mod.throughput(recs)
    return {"samples_per_s": rate["total"] if rate["ranks"] else None,
            **report_mod.timing(recs), "steps": len(recs) // len(ranks) if ranks else 0,
            "ranks_reporting": len(ranks), "stragglers": sorted(report_mod.straggling(recs)["stragglers"])}


def table(rows: list[dict]) -> list[dict]:
    """Each row with its speed-up and efficiency against its image's smallest run that measured, and its
    samples/s against the first image's run of the same size. Pure."""
    out = []
    for row in rows:
        same_image = [r for r in rows if r["image"] == row["image"] and r["samples_per_s"]]
        base = min(same_image, key=lambda r: (r["ranks"], r["nodes"]), default=None)
        first = next((r for r in rows if r["image"] == rows[0]["image"] and r["nodes"] == row["nodes"]
                      and r["procs"] == row["procs"] and r["samples_per_s"]), None)
        x = row["samples_per_s"]
        speedup = x / base["samples_per_s"] if x and base else None
        out.append({**row, "speedup": speedup,
                    "efficiency": speedup / (row["ranks"] / base["ranks"]) if speedup else None,
                    "vs_first_image": x / first["samples_per_s"] if x and first else None})
    return out


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


def markdown(study: str, spec: JobSpec, backend: str, rows: list[dict]) -> str:
    images = list(dict.fromkeys(r["image"] for r in rows))
    head = ["image", "Paddle", "nodes", "procs/node", "ranks", "samples/s", "speed-up", "efficiency",
            "step ms", "comm share", "straggler"] + (["vs first image"] if len(images) > 1 else []) + ["run"]
    lines = [f"# {study}: scaling of {Path(spec.script).name} ({backend})", "",
             "Weak scaling: every rank keeps its batch, so ideal samples/s grows with the ranks. samples/s is what "
             "the ranks' own metrics add up to; speed-up and efficiency are against the image's smallest run; "
             "step ms is the mean over ranks and steps; comm share is the part of it in the script's own "
             "all-reduce (\"-\": the script does not report one); straggler names a rank whose own work per step "
             "was 1.5x the other ranks' (its figures then are its pace, not the image's).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells_ = [r["image"], r["paddle"] or "?", str(r["nodes"]), str(r["procs"]), str(r["ranks"]),
                  _f(r["samples_per_s"], ".1f"), _f(r["speedup"], ".2f"), _f(r["efficiency"], ".0%"),
                  _f(r["step_seconds"] and 1000 * r["step_seconds"], ".1f"), _f(r["comm_share"], ".0%"),
                  ", ".join(f"rank {k}" for k in r.get("stragglers") or []) or "-"]
        if len(images) > 1:
            cells_.append(_f(r["vs_first_image"], ".2f"))
        cells_.append(f"{r['job']}: {r['state']}")
        lines.append("| " + " | ".join(cells_) + " |")
    bad = [r for r in rows if r["state"] != "PASSED"]
    if bad:
        lines += ["", "## Runs that did not pass", ""] + [f"- {r['job']}: {r['failure'] or r['state']}" for r in bad]
    unmeasured = [r for r in rows if r["state"] == "PASSED" and r["failure"]]
    if unmeasured:
        lines += ["", "## Runs that passed without figures", ""] + [f"- {r['job']}: {r['failure']}" for r in unmeasured]
    lines += ["", "![scaling](scale.png)", ""]
    return "\n".join(lines)


def draw(path: Path, rows: list[dict]) -> list[str]:
    """scale.png: samples/s and efficiency against ranks (one line per image and processes per node, its ideal
    dashed) and each run's step time split into compute and communication. Returns the legend."""
    import matplotlib  # noqa: PLC0415 (deferred: matplotlib takes a second to load; only drawing needs it)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (deferred: matplotlib takes a second to load; only drawing needs it)

    fig, (ax_rate, ax_eff, ax_step) = plt.subplots(1, 3, figsize=(14, 4.5))
    many_procs, ideal = len({r["procs"] for r in rows}) > 1, set()
    for image, procs in dict.fromkeys((r["image"], r["procs"]) for r in rows):   # one line per image (and procs)
        mine = sorted((r for r in rows if (r["image"], r["procs"]) == (image, procs) and r["samples_per_s"]),
                      key=lambda r: r["ranks"])
        if not mine:
            continue
        label = f"{image}, {procs} proc/node" if many_procs else image
        line, = ax_rate.plot([r["ranks"] for r in mine], [r["samples_per_s"] for r in mine], "o-", label=label)
        if image not in ideal:   # from the image's smallest run, as speed-up and efficiency are
            ideal.add(image)
            same = sorted({r["ranks"] for r in rows if r["image"] == image})
            base = min((r for r in rows if r["image"] == image and r["samples_per_s"]),
                       key=lambda r: (r["ranks"], r["nodes"]))
            ax_rate.plot(same, [base["samples_per_s"] * n / base["ranks"] for n in same], "--",
                         color=line.get_color(), lw=0.8)
        ax_eff.plot([r["ranks"] for r in mine], [100 * r["efficiency"] for r in mine], "o-", color=line.get_color())
    ax_rate.set(xlabel="ranks", ylabel="samples/s", title="throughput (dashed: ideal)")
    ax_eff.set(xlabel="ranks", ylabel="%", title="parallel efficiency", ylim=(0, 110))
    for ax in (ax_rate, ax_eff):
        ax.set_xticks(sorted({r["ranks"] for r in rows}))
    timed = [r for r in rows if r["step_seconds"]]
    labels = [f"{r['nodes']}x{r['procs']}" + (f"\n{r['image'][-24:]}" if len(set(x['image'] for x in rows)) > 1
                                              else "") for r in timed]
    comm = [1000 * r["step_seconds"] * (r["comm_share"] or 0) for r in timed]
    compute = [1000 * r["step_seconds"] - c for r, c in zip(timed, comm)]
    pos = list(range(len(timed)))
    ax_step.bar(pos, compute, label="compute and the rest")
    ax_step.bar(pos, comm, bottom=compute, label="all-reduce")
    ax_step.set_xticks(pos, labels)
    ax_step.set(xlabel="nodes x processes", ylabel="ms per step", title="mean step time")
    if timed:
        ax_step.legend(fontsize=7)
    for ax in (ax_rate, ax_eff, ax_step):
        if not ax.lines and not ax.patches:
            ax.text(0.5, 0.5, "no run measured", ha="center", va="center", transform=ax.transAxes)
    legend = []
    if ax_rate.lines:
        ax_rate.legend(fontsize=7)
        legend = [t.get_text() for t in ax_rate.get_legend().get_texts()]
    fig.tight_layout()
    with files.atomic(path) as part:
        fig.savefig(part, format="png", dpi=90)
    plt.close(fig)
    return legend


def write(out: Path, study: str, spec: JobSpec, backend: str, rows: list[dict]) -> dict:
    """scale.json, scale.md and scale.png, each complete or absent."""
    rows = table(rows)
    out.mkdir(parents=True, exist_ok=True)
    legend = draw(out / "scale.png", rows)
    for name, text in (("scale.json", json.dumps({"study": study, "backend": backend, "script": spec.script,
                                                 "args": list(spec.args), "rows": rows}, indent=1)),
                       ("scale.md", markdown(study, spec, backend, rows))):
        files.write_atomic(out / name, text)
    return {"rows": rows, "legend": legend, "md": str(out / "scale.md"), "png": str(out / "scale.png")}


def run(spec: JobSpec, study_cells: list[Cell], backend: str = "docker", backend_options: dict | None = None,
        timeout: float | None = None, log=print, study: str = "", dry_run: bool = False) -> dict | None:
    """Run every cell as its own job, then write the study's table and plot (also when a run failed, or after
    Ctrl-C: the runs that ended are in it, the others marked). Raises Failed when any run failed. `dry_run`:
    print every run's job as `invoke train --dry-run` would, and start nothing."""
    if spec.job_id:
        raise UserError("--job-id names one job; a study names its runs <study>-i<image>-n<nodes>p<procs>")
    if spec.spawns:   # its nprocs, not the study, says how many ranks it has
        raise UserError(f"{spec.script} starts its own ranks (paddle.distributed.spawn), as many as its call says: a "
                        f"study needs a script Paddle's launcher starts at each size")
    backends.check_timeout(backend, timeout)   # the same refusals train makes, once for the whole study
    sized = {n: backends.sized(backend, dict(backend_options or {}), n)   # a run of N nodes: Docker's first N hosts
             for n in sorted({c.nodes for c in study_cells}, reverse=True)}
    if spec.port:
        hostnet.check_room(spec.port, planner.ports_needed(max(c.nodes for c in study_cells),
                                                            max(c.procs for c in study_cells)))
    study = study or new_job_id("scale")
    images = list(dict.fromkeys(c.image for c in study_cells))
    plan = [(job_id(study, images.index(c.image), c),
             replace(spec, nodes=c.nodes, procs_per_node=c.procs, image=c.image,
                     job_id=job_id(study, images.index(c.image), c)), sized[c.nodes]) for c in study_cells]
    for _, s, given in plan:   # every run's input, before the first one starts
        validate(s)
        backends.get(backend, **given).check(s)
    rows = [{"image": s.image_ref, "paddle": "", "nodes": c.nodes, "procs": c.procs, "ranks": c.ranks, "job": jid,
             "state": "not run", "samples_per_s": None, "step_seconds": None, "comm_share": None, "steps": 0,
             "ranks_reporting": 0, "failure": ""} for c, (jid, s, _) in zip(study_cells, plan)]
    out = settings.runs_root() / study
    if dry_run:
        for i, (jid, s, given) in enumerate(plan):
            log(f"# scale: run {i + 1}/{len(plan)}: {s.image_ref}, {s.nodes} node(s) x {s.procs_per_node} "
                f"process(es) (job {jid})")
            train_cmd.train(s, backend, given, dry_run=True, log=log)
        return None
    log(f"scale: study {study}: {len(plan)} run(s), {backend} backend; table in {out}/scale.md")
    done = None
    try:
        with stops_as_interrupt():   # SIGTERM between runs too: the same way out as Ctrl-C
            failed = _run_all(plan, rows, backend, timeout, log)
    finally:   # the table of what ended, also after Ctrl-C or an error (each run marked as it ended)
        try:
            with signals_held():
                done = write(out, study, spec, backend, rows)
            log(f"scale: {done['md']} ({Path(done['png']).name})")
        except Exception as e:   # the study's own error (or Ctrl-C) is the one to report, not the table's
            log(f"scale: no table: {type(e).__name__}: {e}"[:300])
    if done is None:
        raise Failed(f"scale: the table could not be written in {out}")
    for r in done["rows"]:
        log(f"  {r['image']:<28} {r['nodes']:>2} x {r['procs']:<2} {_f(r['samples_per_s'], '10.1f')} samples/s  "
            f"speed-up {_f(r['speedup'], '.2f'):>5}  efficiency {_f(r['efficiency'], '.0%'):>4}  "
            f"step {_f(r['step_seconds'] and 1000 * r['step_seconds'], '.1f'):>6} ms  "
            f"comm {_f(r['comm_share'], '.0%'):>4}  {r['state']}")
    if failed:
        raise Failed(f"scale: {failed} of {len(plan)} run(s) did not pass (see {done['md']})")
    return done


def _run_all(plan, rows, backend, timeout, log) -> int:
    """Each run in turn, its row filled as it ends; the number that did not pass."""
    failed = 0
    for i, ((jid, s, given), row) in enumerate(zip(plan, rows)):
        log(f"scale: run {i + 1}/{len(plan)}: {s.image_ref}, {s.nodes} node(s) x {s.procs_per_node} "
            f"process(es) (job {jid})")
        try:
            train_cmd.train(s, backend, given, timeout=timeout, log=log)
        except Failed as e:
            row["state"], row["failure"] = "FAILED", str(e)
        except UserError as e:   # this run could not start (say, an image a node lacks): the others go on
            row["state"], row["failure"] = "NOT STARTED", str(e)
        except KeyboardInterrupt:   # the run cleaned up after itself; the study stops here
            row["state"] = "INTERRUPTED"
            raise
        except BaseException as e:
            row["state"], row["failure"] = "ERROR", f"{type(e).__name__}: {e}"
            raise
        else:
            row["state"] = "PASSED"
        job = settings.runs_root() / jid
        row["paddle"] = files.read_json(job / records.JOB).get("paddle", "")
        if row["state"] == "PASSED":   # a failed run's figures are in its own report, not the study's
            try:
                row.update(measure(job))
            except (TypeError, ValueError, KeyError) as e:   # hand-written metrics lines of another script
                row["failure"] = f"its metrics could not be read: {e}"
            if row["samples_per_s"] is None:
                row["failure"] = row["failure"] or "it passed but reported no throughput (fleetbox_metrics Meter)"
        failed += row["state"] != "PASSED"
    return failed
