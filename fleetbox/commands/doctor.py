"""`invoke doctor`: prove a cluster is ready before a job burns queue hours.

The probe (incontainer/fleetbox_doctor.py) runs on every node in the job's own container, started by the same
backend and plan as the job with only the command changed; it reports raw facts, and the checks (checks.py,
pure) hold each to its threshold: a table per node with ✓/✗, the measured value, the threshold and, for every
✗, the fix in one line; a JSON report. The full check adds a Gloo/NCCL all-reduce sweep
(incontainer/fleetbox_collective.py, run through Paddle's own launcher) next to the raw TCP throughput the
probe measured. What differs by backend (the engines it can see from here, whether its nodes report their
image, its runtime) the doctor asks the backend.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path

from fleetbox import files, settings
from fleetbox.commands.checks import (
    BLAST_BYTES,
    Expect,
    Row,
    allocated_gpu_rows,
    confinement_rows,
    engine_rows,
    evaluate,
    parse_probe,
    parse_sweep,
    prerequisite_rows,
    probe_command,
    reported_image_rows,
    sweep_row,
    sweep_table,
    table,
    tcp_gbps,
    throughput_rows,
)
from fleetbox.image import kernels, matrix
from fleetbox.processes import stops_as_interrupt
from fleetbox.run import backends
from fleetbox.run.backend import Plan
from fleetbox.run.jobfolder import JobFolder
from fleetbox.run.spec import JobSpec, new_job_id


def runtime(b) -> str:
    """What starts the backend's containers (its doctoring's runtime, else the backend's own name)."""
    return b.doctoring.runtime or b.name


def expect(spec: JobSpec, port: int, b) -> Expect:
    """What the job needs of every node, with what the backend says of how it starts containers."""
    v, d = spec.variant, b.doctoring
    return Expect(spec.nodes, spec.shm_size, spec.device, spec.ib_hca, v.min_driver, v.toolkit_driver, spec.gpus_each,
                  spec.procs_per_node, port, runtime(b), d.runtime_args, spec.iface, d.shm_settable,
                  check_paddle=not d.runs_in_image, variant=v.name, kernels=kernels.load(v),
                  instead=tuple((o.name, k) for o in matrix.load().variants.values()
                                if o.name != v.name and (k := kernels.load(o)) is not None),
                  no_driver_fix=d.no_driver_fix)


def _outputs(b, result) -> dict[int, str]:
    """Each node's own output, where its backend's layout keeps it."""
    folder = JobFolder(Path(result.dir), (b.layout,))
    return {n.rank: p.read_text(errors="replace") if (p := folder.output(n.rank)).exists() else ""
            for n in result.nodes}


def run(spec: JobSpec, backend: str = "docker", backend_options: dict | None = None, quick: bool = False,
        wait: float = 30.0, log=print, dry_run: bool = False) -> dict:
    """Check every node for `spec` (the job as `invoke train` would run it); returns the report. `dry_run`: print
    the probe's job (and the sweep's) as the backend would run it, and start nothing."""
    b = backends.get(backend, **(backend_options or {}))
    return check(b, spec, b.plan, quick, wait, log, dry_run)


def preflight(b, spec: JobSpec, log=print) -> tuple[dict, Plan | None]:
    """`train --preflight`: the job planned once, and the quick check run on that plan (its nodes, image and port;
    the backend's probe_plan); returns the report, and the plan the job then runs (None where the engines
    failed their checks before it was made: a missing image is a ✗ with its fix, not a planning error)."""
    job: list[Plan] = []

    def on_the_job(probe: JobSpec) -> Plan:
        job.append(b.plan(spec))
        return b.probe_plan(job[0], probe)
    return check(b, spec, on_the_job, quick=True, log=log), (job[0] if job else None)


def check(b, spec: JobSpec, plan_probe, quick: bool = False, wait: float = 30.0, log=print,
          dry_run: bool = False) -> dict:
    """`run` on a backend: the probe job is `spec`'s with its own id and command, planned by `plan_probe`."""
    caps, d = b.capabilities, b.doctoring
    job_id = new_job_id("doctor")
    facts_here = b.engine_facts(spec)   # what the backend can see from here, before anything starts
    rows = engine_rows(facts_here, spec) if facts_here is not None else []
    rows += confinement_rows(spec.device, d.unconfined)
    base = replace(spec, job_id=job_id, max_restarts=0, resume="auto", checkpoint_dir="")
    facts, master_ip, sweep, job_dir, port = {}, "", None, settings.runs_root() / job_id, None
    if dry_run and not all(r.ok for r in rows):   # what would stop the doctor before its probe
        log(table(rows))
        return {"dry_run": True, "ok": False, "rows": [asdict(r) for r in rows]}
    if all(r.ok for r in rows):
        probe = replace(base, command=probe_command(spec, 0 if quick else BLAST_BYTES, wait, not d.runs_in_image),
                        image_identity=d.reports_image)
        with stops_as_interrupt():
            plan = plan_probe(probe)
        if dry_run:
            return describe(b, plan, base, quick, log)
        log(f"doctor {job_id}: probing {spec.nodes} node(s) in the job's own container ({d.label or b.name}), "
            f"master port {plan.port}")
        port = plan.port
        # bounded: a node stuck on a hung mount must not hold the doctor (Slurm: the queue's --time does)
        result = b.run(plan, log=lambda m: None, timeout=wait * 3 + 120 if caps.timeout else None)
        outputs = _outputs(b, result)
        if d.reports_image:
            rows += reported_image_rows(outputs, spec.nodes, getattr(plan, "image", spec.image_ref),
                                        d.unreported_fix)
            rows += prerequisite_rows(outputs, spec.nodes)
        for k in range(spec.nodes):
            f = parse_probe(outputs.get(k, ""))
            if f is None:
                tail = [ln for ln in outputs.get(k, "").splitlines() if ln.strip()][-1:] or ["no output"]
                rows.append(Row(f"node{k}", "probe", False, tail[0][:100], "reports", f"the probe did not report on "
                                f"node{k}: see {result.nodes[k].logs}"))
            else:
                facts[k] = f
                master_ip = master_ip or f.get("master_ip", "")
        needs = expect(spec, plan.port, b)
        rows += evaluate(facts, needs, master_ip)
        if d.reports_image:
            rows += allocated_gpu_rows(outputs, facts, needs)
        if not quick:
            rows += throughput_rows(facts)
            if facts and all(r.ok for r in rows):
                sweep = run_sweep(b, base, log)
                rows.append(sweep_row(sweep))
    report = {"job_id": job_id, "backend": b.name, "runtime": runtime(b), "nodes": spec.nodes,
              "image": spec.image_ref, "port": port,
              "quick": quick, "ok": all(r.ok for r in rows), "rows": [asdict(r) for r in rows], "facts": facts,
              "sweep": sweep.get("sweep") if sweep else None, "path": str(job_dir / "doctor.json")}
    job_dir.mkdir(parents=True, exist_ok=True)
    files.write_json(job_dir / "doctor.json", report)
    log(table(rows))
    if sweep and sweep.get("sweep"):
        log(sweep_table(sweep["sweep"], tcp_gbps(facts)))
    log(f"{'every check passed' if report['ok'] else str(sum(not r.ok for r in rows)) + ' check(s) failed'}; "
        f"report: {report['path']}")
    return report


def describe(b, plan, base: JobSpec, quick: bool, log) -> dict:
    """--dry-run: the probe job, and (without --quick) the sweep's, as the backend would run them."""
    log(f"# doctor: the probe job ({plan.job_id}), one container per node")
    log(b.describe(plan))
    if not quick:
        sweep = sweep_spec(base)
        with stops_as_interrupt():
            swept = b.plan(sweep)
        log(f"# doctor: then, when every check passes, the all-reduce sweep ({sweep.job_id})")
        log(b.describe(swept))
    return {"dry_run": True, "ok": True, "rows": []}


def sweep_spec(base: JobSpec) -> JobSpec:
    return replace(base, job_id=new_job_id("doctor-sweep"), script=str(settings.HELPERS / "fleetbox_collective.py"),
                   args=("--max-bytes", str(BLAST_BYTES)), command=())


def run_sweep(b, base: JobSpec, log) -> dict:
    """The all-reduce sweep as a real Paddle job (its launcher, pinned ports, Gloo or NCCL)."""
    spec = sweep_spec(base)
    with stops_as_interrupt():
        plan = b.plan(spec)
    log(f"doctor: all-reduce sweep ({spec.job_id}) across {spec.nodes} node(s)")
    result = b.run(plan, log=lambda m: None, timeout=1800 if b.capabilities.timeout else None)
    folder = JobFolder(Path(result.dir), (b.layout,))
    log0 = dict(folder.nodes(folder.path)).get(0, folder.path / "-") / "workerlog.0"   # the last attempt's rank 0
    found = parse_sweep(log0.read_text(errors="replace")) if log0.exists() else None
    return {"ok": result.ok and found is not None, "sweep": found, "why": result.failure(), "dir": result.dir}


