"""The backends, by name: the only place that knows which backends exist (`train --backend NAME`)."""

from __future__ import annotations

from fleetbox.errors import UserError
from fleetbox.run.backend import Backend
from fleetbox.run.backends.docker import DockerBackend
from fleetbox.run.backends.slurm import SlurmBackend

BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (DockerBackend, SlurmBackend)}


def get(name: str, **options) -> Backend:
    if name not in BACKENDS:
        raise UserError(f"unknown backend {name!r}; choose one of: {', '.join(BACKENDS)}")
    return BACKENDS[name](**options)
