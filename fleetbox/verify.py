"""`invoke verify`: run the in-image checks in a container with the network off, table + JSON report."""

from __future__ import annotations

import json
from importlib import resources

from pathlib import Path

from .datasets import CONTAINER_CACHE, default_dest
from .engine import run_dir
from .errors import UserError
from .images import resolve
from .matrix import Variant

MARK = "FLEETBOX-REPORT "


def probe_source() -> str:
    return resources.files("fleetbox.probes").joinpath("verify_image.py").read_text()


def container_kwargs(variant: Variant, image_labels: dict, data_dir: Path | None = None) -> dict:
    """Pure: how the verify container is run (no network; the variant's devices; the seeded dataset
    cache mounted read-only at Paddle's cache path when there is one)."""
    kw = {"network_mode": "none", "environment": {
        "FLEETBOX_DEVICE": variant.device,
        "FLEETBOX_EXPECT_FREEZE": image_labels.get("io.fleetbox.pip-freeze", "")}}
    if variant.device == "cuda":
        import docker.types
        kw["device_requests"] = [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    rt = variant.runtime
    if rt.get("devices"):
        kw["devices"] = [f"{d}:{d}:rwm" for d in rt["devices"]]
    if rt.get("group_add"):
        kw["group_add"] = rt["group_add"]
    if rt.get("security_opt"):
        kw["security_opt"] = rt["security_opt"]
    if data_dir is not None:
        kw["volumes"] = {str(Path(data_dir).resolve()): {"bind": CONTAINER_CACHE, "mode": "ro"}}
    return kw


def parse_report(output: str) -> dict:
    for line in reversed(output.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise UserError("the verify probe printed no report; the image's Python may be broken")


def table(variant: str, image: str, checks: list[dict]) -> str:
    width = max(len(c["check"]) for c in checks)
    rows = [f"verify {variant} ({image})"]
    for c in checks:
        rows.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['check']:<{width}}  {c['detail']}")
    return "\n".join(rows)


def run(c, variant: Variant, image_ref: str | None = None, log=print, data_dir: Path | None = None) -> dict:
    """Verify the variant's built image, or any image given by reference (e.g. one pulled from a registry)."""
    if image_ref:
        from .engine import image_or_none
        image = image_or_none(c, image_ref)
        if image is None:
            raise UserError(f"image {image_ref} is not here; build or pull it first")
    else:
        image = resolve(c, variant)
    labels = image.labels or {}
    rd = run_dir(f"verify-{variant.name}")
    log(f"verifying {image.tags[0] if image.tags else image.id} with the network off")
    data_dir = data_dir or default_dest()
    mount = data_dir if data_dir.is_dir() and any(data_dir.iterdir()) else None
    if mount:
        log(f"mounting the seeded dataset cache {mount} read-only at {CONTAINER_CACHE}")
    container = c.containers.run(image.id, ["python", "-c", probe_source()], detach=True,
                                 labels={"io.fleetbox.role": "verify"}, **container_kwargs(variant, labels, mount))
    try:
        status = container.wait(timeout=600)
        output = container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)
    (rd / "verify.log").write_text(output)
    report = parse_report(output)
    report.update(variant=variant.name, image=image.id, tags=image.tags, exit_code=status.get("StatusCode"),
                  lock_sha256=labels.get("io.fleetbox.lock-sha256", ""), path=str(rd / "report.json"))
    report["ok"] = report["ok"] and status.get("StatusCode") == 0
    (rd / "report.json").write_text(json.dumps(report, indent=1))
    log(table(variant.name, image.tags[0] if image.tags else image.id, report["checks"]))
    log(f"{'PASSED' if report['ok'] else 'FAILED'}; report: {rd / 'report.json'}")
    return report
