"""`invoke verify`: run the in-image checks in a container with the network off, table + JSON report."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from fleetbox import engine, files, incontainer, settings
from fleetbox.engine import device_kwargs, image_or_none, run_dir
from fleetbox.errors import UserError
from fleetbox.image import kernels, receipts
from fleetbox.image.built import resolve
from fleetbox.image.images import LABEL_GPUS
from fleetbox.image.matrix import Variant
from fleetbox.processes import signals_held, stops_as_interrupt
from fleetbox.run.plan import device_options
from fleetbox.run.result import smoke_line
from fleetbox.run.spec import JobSpec
from fleetbox.settings import CONTAINER_CACHE

MARK = "FLEETBOX-REPORT "


def container_kwargs(variant: Variant, image_labels: dict, data_dir: Path | None = None, no_gpu: str = "",
                     expect_sbom: str = "") -> dict:
    """Pure: how the verify container is run: no network; the variant's devices, every GPU of the machine (none
    where `no_gpu` says why the engine cannot give one); the seeded dataset cache mounted read-only at Paddle's
    cache path when there is one."""
    dev = device_options(JobSpec(variant=variant, on_cpu=bool(no_gpu)))
    kw = {"network_mode": "none", "environment": {
        "FLEETBOX_DEVICE": variant.device, "FLEETBOX_NO_GPU": no_gpu,
        "FLEETBOX_EXPECT_FREEZE": image_labels.get(settings.LABEL_FREEZE, ""), "FLEETBOX_EXPECT_SBOM": expect_sbom},
          **device_kwargs(dev.get("devices", ()), dev.get("group_add", ()), dev.get("security_opt", ()),
                          "all" if dev.get("gpus") else "")}
    if data_dir is not None:
        kw["volumes"] = {str(Path(data_dir).resolve()): {"bind": CONTAINER_CACHE, "mode": "ro"}}
    return kw


def parse_report(output: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise UserError("the verify probe printed no report; the image's Python may be broken")


# Docker's answer where it has no GPU to give: no NVIDIA runtime or hook; a hook that finds no driver; no CDI spec.
# Any other refusal (a driver error on a GPU machine) is the error it is.
NO_GPU_ANSWERS = ("could not select device driver", "nvml error: driver not loaded", "unresolvable CDI devices")


def no_gpu_reason(error: str) -> str:
    """Pure: why the engine gave no GPU, from its refusal of a GPU request; "" for any other error."""
    if not any(a in error for a in NO_GPU_ANSWERS):
        return ""
    return "the engine has no GPU to give (" + " ".join(error.split())[:160] + ")"


def status(check: dict) -> str:
    return "FAIL" if not check["ok"] else "NO GPU" if check.get("no_gpu") else "PASS"


def table(variant: str, image: str, checks: list[dict]) -> str:
    width, says = max(len(c["check"]) for c in checks), max(len(status(c)) for c in checks)
    rows = [f"verify {variant} ({image})"]
    for c in checks:
        rows.append(f"  {status(c):<{says}}  {c['check']:<{width}}  {c['detail']}")
    return "\n".join(rows)


def verdict(report: dict) -> str:
    """PASSED, FAILED, or PASSED as far as a machine without a GPU can check (saying which checks)."""
    if not report["ok"]:
        return "FAILED"
    rendered = [c["check"] for c in report["checks"] if c.get("no_gpu")]
    return f"PASSED without a GPU (not run on one: {', '.join(rendered)})" if rendered else "PASSED"


def run(c, variant: Variant, image_ref: str | None = None, log=print, data_dir: Path | None = None,
        trusted: Path | None = None) -> dict:
    """Verify the variant's built image, or any image given by reference (e.g. one pulled from a registry)."""
    if image_ref:
        image = image_or_none(c, image_ref)
        if image is None:
            raise UserError(f"image {image_ref} is not here; build or pull it first")
    else:
        image = resolve(c, variant)
    labels = image.labels or {}
    rd = run_dir(f"verify-{variant.name}")
    log(f"verifying {image.tags[0] if image.tags else image.id} with the network off")
    data_dir = data_dir or settings.data_dir()
    mount = data_dir if data_dir.is_dir() and any(data_dir.iterdir()) else None
    if mount:
        log(f"mounting the seeded dataset cache {mount} read-only at {CONTAINER_CACHE}")
    with stops_as_interrupt():   # a `kill` or a hang-up removes the probe container as Ctrl-C does
        held, expect = receipt_checks(c, image, variant, trusted)
        container, no_gpu = _start(c, image.id, variant, labels, mount, log, expect)
        try:
            ended = container.wait(timeout=600)
            output = container.logs().decode(errors="replace")
        finally:
            with signals_held():
                container.remove(force=True)
    files.write_atomic(rd / "verify.log", output)
    report = parse_report(output)
    report.update(variant=variant.name, image=image.id, tags=image.tags, exit_code=ended.get("StatusCode"),
                  lock_sha256=labels.get(settings.LABEL_LOCK, ""), path=str(rd / "report.json"), no_gpu=no_gpu,
                  gpu_architectures=labels.get(LABEL_GPUS, ""))
    report["checks"] += held
    report["ok"] = report["ok"] and ended.get("StatusCode") == 0 and all(r["ok"] for r in held)
    files.write_json(rd / "report.json", report)
    log(table(variant.name, image.tags[0] if image.tags else image.id, report["checks"]))
    if labels.get(LABEL_GPUS) and (k := kernels.load(variant)) and k.label() == labels[LABEL_GPUS]:
        log(f"GPUs: {k.said()}")
    log(f"{verdict(report)}; report: {rd / 'report.json'}")
    return report


def receipt_checks(c, image, variant: Variant, trusted: Path | None = None) -> tuple[list[dict], str]:
    """The image held to its receipts (image/receipts.py), as report rows: its SBOM valid CycloneDX naming the
    Debian packages the image has (its dpkg database, read here), and its provenance statement valid and of this
    image (with --trusted-keys, signed by one of them, and naming that very SBOM); and what the probe holds its
    Python packages to (the SBOM's, as JSON). An image fleetbox did not build (no inputs label) has none to be
    held to, but where the site trusts only signed ones."""
    labels = image.labels or {}
    inputs = labels.get(settings.LABEL_INPUTS)
    if not inputs:
        return [{"check": "signature", "ok": False, "detail": "the image is not one fleetbox built (no "
                 f"{settings.LABEL_INPUTS} label): no statement to check"}] if trusted is not None else [], ""
    # its own (where its label says), else the one its build kept here
    path = labels.get(settings.LABEL_SBOM)
    held = receipts.image_file(c, image.id, path) if path else None
    if held is None:
        path = receipts.sbom_path(inputs)
        if not path.exists():
            return [{"check": "SBOM", "ok": False, "detail": f"none in the image, nor of its inputs "
                     f"{inputs[:12]} in {receipts.folder()}; `invoke build --variant {variant.name}` makes one"}], ""
        held = path.read_bytes()
    try:
        want = receipts.expected(receipts.check_sbom(held.decode()))
    except UserError as e:
        return [{"check": "SBOM", "ok": False, "detail": f"{path}: {e}"}], ""
    have = {d.name: d.version for d in receipts.base_packages(c, image.id)}
    wrong = [f"{n} {v} is not installed" + (f" ({have[n]} is)" if n in have else "")
             for n, v in sorted(want["deb"].items()) if have.get(n) != v]
    wrong += [f"{n} {v} is installed and not in it" for n, v in sorted(have.items()) if n not in want["deb"]]
    rows = [{"check": "SBOM", "ok": not wrong, "detail": f"{len(wrong)} Debian packages differ from it: "
             + "; ".join(wrong[:5]) if wrong else f"CycloneDX 1.6, {len(want['deb'])} Debian packages as it says "
             f"({path})"}]
    # none for an image built elsewhere (its Dockerfile, another machine): said, and held to with --trusted-keys
    statement = {}
    try:
        statement = receipts.statement_of(image.id)
        ok, detail = True, (f"in-toto statement (SLSA provenance v1) of {image.id[:19]}" if statement else
                            f"none of {image.id[:19]} here (it was built elsewhere)")
    except UserError as e:
        ok, detail = False, str(e)
    rows.append({"check": "provenance", "ok": ok, "detail": detail})
    if trusted is not None:   # --trusted-keys: the statement signed by one of them, and of this very SBOM
        try:
            who = receipts.signer(receipts.provenance_path(image.id), trusted)
            named = {d.get("name"): d.get("digest", {}).get("sha256") for d in
                     statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
            if named.get("sbom") != receipts.sha256(held):
                raise UserError(f"the SBOM checked ({path}) is not the one the signed statement names")
            rows.append({"check": "signature", "ok": True, "detail": f"signed by {who}, naming this SBOM"})
        except UserError as e:
            rows.append({"check": "signature", "ok": False, "detail": str(e)})
    return rows, json.dumps({"python": want["python"]})


def _start(c, image_id: str, variant: Variant, labels: dict, mount, log, expect_sbom: str = ""):
    """The probe container, given every GPU; where the engine has none to give, without: (container, why not).
    A container the engine made but could not start is removed."""
    import docker.errors  # noqa: PLC0415 (deferred, as in engine.device_kwargs)
    source = ["python", "-c", incontainer.source("fleetbox_verify_image")]
    no_gpu = ""
    while True:
        with signals_held():   # made and known, or not made: a Ctrl-C while it is made is ignored
            container = c.containers.create(image_id, source, labels={settings.LABEL_ROLE: "verify"},
                                            **container_kwargs(variant, labels, mount, no_gpu, expect_sbom))
        try:
            container.start()
            return container, no_gpu
        except BaseException as e:
            with signals_held(), contextlib.suppress(Exception):   # an engine gone too: never hides why
                container.remove(force=True)
            if not isinstance(e, docker.errors.APIError) or no_gpu or variant.device != "cuda":
                raise
            answer = " ".join(str(e.explanation or e).split())
            no_gpu = no_gpu_reason(answer)
            if not no_gpu:
                raise
        log(f"{no_gpu}: checking the image without one (a machine that has NVIDIA GPUs fails the device count)")


def run_nodes(spec, backend, log=print) -> dict:
    """`verify --nodes N`: the image checks (run_check() included) in every node's container, then the
    smoke job across all nodes, by `backend` (Docker's: the nodes are Docker Engines, this machine's or its
    --hosts); one table, one JSON report."""
    hosts = list(backend.hosts) or [""] * spec.nodes
    rows = []
    for k, host in enumerate(hosts):
        c = engine.client(host or None)
        rep = run(c, spec.variant, spec.image or None, log=lambda m: None,
                  data_dir=Path(spec.data_dir) if spec.data_dir and not host else None)
        passed = sum(ch["ok"] for ch in rep["checks"])
        failed = [ch["check"] for ch in rep["checks"] if not ch["ok"]]
        found = {ch["check"]: ch["detail"] for ch in rep["checks"]}
        unrun = [ch["check"] for ch in rep["checks"] if ch.get("no_gpu")]
        rows.append({"what": f"node{k}", "host": host or "local", "ok": rep["ok"],
                     "detail": f"{passed}/{len(rep['checks'])} image checks pass; {found.get('import paddle', '?')}, "
                               f"device {found.get('compiled device', '?')}"
                               + (f"; failed: {', '.join(failed)}" if failed else "")
                               + (f"; no GPU here, not run on one: {', '.join(unrun)}" if unrun else ""),
                     "report": rep["path"]})
        log(f"node{k} ({host or 'local'}): {'PASS' if rep['ok'] else 'FAIL'}")
    log(f"running the smoke job across {spec.nodes} nodes")
    job = backend.run(backend.plan(spec), log=lambda m: None)
    smoke = job.smoke or {}
    detail = smoke_line(smoke) if smoke else job.failure()
    rows.append({"what": "smoke", "host": f"{spec.nodes} nodes", "ok": job.ok, "detail": detail,
                 "report": str(Path(job.dir) / "summary.json")})
    rd = run_dir(f"verify-{spec.variant.name}-{spec.nodes}nodes")
    report = {"variant": spec.variant.name, "nodes": spec.nodes, "rows": rows, "ok": all(r["ok"] for r in rows),
              "path": str(rd / "report.json")}
    files.write_json(rd / "report.json", report)
    log(f"verify {spec.variant.name} across {spec.nodes} nodes")
    for r in rows:
        log(f"  {'PASS' if r['ok'] else 'FAIL'}  {r['what']:<6} {r['host']:<24} {r['detail']}")
    log(f"{'PASSED' if report['ok'] else 'FAILED'}; report: {report['path']}")
    return report
