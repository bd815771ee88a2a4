"""The Docker Engine: connecting with a clear error, streaming build output, run folders for logs."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from fleetbox import settings
from fleetbox.errors import UserError


class Unreachable(UserError):
    """No Docker Engine answers at `where`: `why`, as the SDK said it."""

    def __init__(self, where: str, why: str):
        super().__init__(f"cannot reach the Docker Engine at {where} ({why}); start it (`dockerd &` or `systemctl "
                         f"start docker`) or set DOCKER_HOST")
        self.where, self.why = where, why


def client(base_url: str | None = None):
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)

    try:
        c = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
        c.ping()
        return c
    except docker.errors.DockerException as e:
        where = base_url or os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise Unreachable(where, str(e).splitlines()[0][:120]) from None


def device_kwargs(devices=(), group_add=(), security_opt=(), gpus: str = "") -> dict:
    """Devices in the Docker SDK's spelling (the Docker backend's nodes and `invoke verify` share it)."""
    import docker.types  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used)
    kw = {}
    if devices:
        kw["devices"] = [f"{d}:{d}:rwm" for d in devices]
    if group_add:
        kw["group_add"] = list(group_add)
    if security_opt:
        kw["security_opt"] = list(security_opt)
    if gpus:
        if gpus == "all":
            req = docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
        elif gpus.startswith("device="):
            req = docker.types.DeviceRequest(device_ids=gpus[7:].split(","), capabilities=[["gpu"]])
        else:
            req = docker.types.DeviceRequest(count=int(gpus), capabilities=[["gpu"]])
        kw["device_requests"] = [req]
    return kw


def image_or_none(c, ref: str):
    import docker  # noqa: PLC0415 (deferred: the Docker SDK loads where an engine is used, so planners stay light)

    try:
        return c.images.get(ref)
    except docker.errors.ImageNotFound:
        return None


def run_dir(kind: str) -> Path:
    """A fresh folder under runs/ that keeps this run's logs and reports."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = settings.runs_root()
    d = base / f"{kind}-{stamp}"
    n = 1
    while d.exists():
        n += 1
        d = base / f"{kind}-{stamp}-{n}"
    d.mkdir(parents=True)
    return d


def build(c, log_file: Path, echo=print, **kwargs) -> str:
    """`docker build` through the engine API (never pulling, intermediate containers always removed),
    its output printed as it comes and kept in `log_file`; returns the image ID."""
    return stream_build(c.api.build(decode=True, rm=True, forcerm=True, pull=False, **kwargs), log_file, echo)


def stream_build(chunks, log_file: Path, echo=print) -> str:
    """Print a `docker build` JSON stream as it comes, keep it in `log_file`; return the image ID."""
    image_id = ""
    with open(log_file, "a") as log:
        for chunk in chunks:
            if "error" in chunk:
                log.write(chunk["error"] + "\n")
                raise UserError(f"build failed: {chunk['error'].strip()} (full log: {log_file})")
            text = chunk.get("stream", "")
            if "aux" in chunk and "ID" in chunk["aux"]:
                image_id = chunk["aux"]["ID"]
            if text:
                log.write(text)
                for line in text.rstrip("\n").splitlines():
                    echo(f"  | {line}")
    if not image_id:
        raise UserError(f"build ended without an image (full log: {log_file})")
    return image_id
