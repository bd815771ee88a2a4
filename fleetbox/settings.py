"""Facts in one place: where fleetbox keeps things on this machine (every FLEETBOX_* variable with its
default) and the fixed paths and labels inside job containers.

Paths are functions, not constants: a variable set after import (a test, a wrapper script) still counts.
"""

from __future__ import annotations

import os
from pathlib import Path

from fleetbox import ROOT


def _path(var: str, default: Path) -> Path:
    return Path(os.environ.get(var) or default)


def runs_root() -> Path:
    """Every run's logs and reports: runs/<task>-<variant>-<time>/ and runs/<job-id>/."""
    return _path("FLEETBOX_RUNS", ROOT / "runs")


def wheelhouse_root() -> Path:
    """Offline wheelhouses, one folder per variant."""
    return _path("FLEETBOX_WHEELHOUSE", ROOT / "wheelhouse")


def data_dir() -> Path:
    """The seeded dataset cache (Paddle's ~/.cache/paddle/dataset layout)."""
    return _path("FLEETBOX_DATA", ROOT / "offline_cache" / "dataset")


def datasets_manifest() -> Path:
    return _path("FLEETBOX_DATASETS_MANIFEST", ROOT / "offline_cache" / "datasets.toml")


def exports_dir() -> Path:
    return _path("FLEETBOX_EXPORTS", ROOT / "exports")


DEFAULT_SCRIPT = ROOT / "train" / "smoke.py"
HELPERS = ROOT / "fleetbox" / "incontainer"   # what runs in the containers, mounted at HELPERS_DIR

# Inside job containers.
CONTAINER_CACHE = "/root/.cache/paddle/dataset"   # Paddle's DATA_HOME for the images' user (root)
HOME_CACHE = ".cache/paddle/dataset"              # the same, under the home of a runtime that runs as the user
LOG_DIR = "/fleetbox/logs"                        # --log_dir of paddle.distributed.launch
WORKDIR = "/workspace"                            # the training script's folder
WORKSPACE_MAX = 1 << 30   # what a --hosts job copies to each engine: the script's folder, not the data
HELPERS_DIR = "/fleetbox/helpers"                 # HELPERS, on the containers' PYTHONPATH
CHECKPOINT_DIR = "/fleetbox/checkpoints"          # the job's checkpoint folder (FLEETBOX_CHECKPOINT_DIR), read-write
RESUME_DIR = "/fleetbox/resume"                   # --resume PATH, read-only

# Folders every image has, for runtimes that cannot create a bind mount's target (Charliecloud, Apptainer).
BIND_TARGETS = (WORKDIR, LOG_DIR, HELPERS_DIR, CHECKPOINT_DIR, RESUME_DIR, CONTAINER_CACHE)

# Labels: job containers carry the first four; the images fleetbox builds carry the variant and the rest.
LABEL_JOB, LABEL_NODE, LABEL_RANK = "io.fleetbox.job", "io.fleetbox.node", "io.fleetbox.rank"
LABEL_VARIANT = "io.fleetbox.variant"
LABEL_OWNER = "io.fleetbox.owner"   # user@<runs folder id> (run/records.py owner): whose job a container is
LABEL_INPUTS = "io.fleetbox.inputs-sha256"   # the digest of everything the image is made from (its content tag)
LABEL_LOCK = "io.fleetbox.lock-sha256"
LABEL_FREEZE = "io.fleetbox.pip-freeze"      # `pip freeze` of the image's environment
LABEL_ROLE = "io.fleetbox.role"              # a container fleetbox runs that is not a job's (verify)

# An env made by `invoke venv` (image/venvs.py): its record, written last; the Slurm runtime none reads it.
ENV_RECORD = "fleetbox-env.json"
