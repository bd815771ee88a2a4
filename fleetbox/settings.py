"""Facts in one place: where fleetbox keeps things on this machine (every FLEETBOX_* variable with its
default, the site files that may set them) and the fixed paths and labels inside job containers.

Paths are functions, not constants: a variable set after import (a test, a wrapper script) still counts.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from fleetbox import ROOT
from fleetbox.errors import UserError

PROJECT_FILE = "fleetbox.toml"   # a project's defaults: in the current folder or the nearest one above it


@dataclass(frozen=True)
class SiteFile:
    """A file of defaults: what it holds, and where each key is in it (for the one line that names it)."""
    path: Path
    data: dict
    text: str

    def line(self, section: str, key: str = "") -> int:
        """The line of `key` in `[section]`, or of the section's header (0 where it is written some other way: an
        inline table)."""
        current = ""
        for n, ln in enumerate(self.text.splitlines(), 1):
            if m := re.match(r"\s*\[\s*([^\]]+?)\s*\]\s*(#.*)?$", ln):
                current = re.sub(r"\s*\.\s*", ".", m[1]).replace('"', "")
                if current == section and not key:
                    return n
            elif current == section and key and re.match(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=", ln):
                return n
        return 0

    def where(self, section: str, key: str = "") -> str:
        n = self.line(section, key)
        return f"{self.path}:{n}" if n else str(self.path)


def user_file() -> Path:
    """The user's defaults: FLEETBOX_CONFIG, else under XDG's config folder: $XDG_CONFIG_HOME/fleetbox/config.toml."""
    return Path(os.environ.get("FLEETBOX_CONFIG") or
                Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "fleetbox" / "config.toml")


def project_file() -> Path | None:
    """fleetbox.toml in the current folder or the nearest folder above it that has one, yours or root's (as git
    trusts a repository: another user's /tmp/fleetbox.toml must not choose your engines, mounts or image)."""
    here = Path.cwd()
    for d in (here, *here.parents):
        f = d / PROJECT_FILE
        if f.is_file() and f.stat().st_uid in (os.getuid(), 0):
            return f
    return None


_read: dict[tuple[Path, int], SiteFile] = {}


def site_files() -> list[SiteFile]:
    """The files of defaults that exist, the first one winning: the project's, then the user's. A file TOML cannot
    read is one line naming it."""
    out = []
    for path in (project_file(), user_file()):
        if path is None or not path.is_file():
            continue
        key = (path.resolve(), path.stat().st_mtime_ns)
        if key not in _read:
            text = path.read_text()
            try:
                f = SiteFile(path.resolve(), tomllib.loads(text), text)
            except tomllib.TOMLDecodeError as e:
                raise UserError(f"{path}: not TOML that fleetbox can read: {e}") from None
            if not isinstance(f.data.get("paths", {}), dict):
                raise UserError(f"{f.where('paths') if f.line('paths') else f.where('', 'paths')}: [paths] must be "
                                f"a section of keys")
            for k, value in (f.data.get("paths") or {}).items():
                if k in PATHS and not (isinstance(value, str) and value):
                    raise UserError(f"{f.where('paths', k)}: [paths] {k} must be a folder's path, as a string")
            _read[key] = f
        out.append(_read[key])
    return out


# where fleetbox keeps things: the variable, the [paths] key of a site file, the default
PATHS = {
    "runs": ("FLEETBOX_RUNS", ROOT / "runs"),
    "wheelhouse": ("FLEETBOX_WHEELHOUSE", ROOT / "wheelhouse"),
    "data": ("FLEETBOX_DATA", ROOT / "offline_cache" / "dataset"),
    "datasets-manifest": ("FLEETBOX_DATASETS_MANIFEST", ROOT / "offline_cache" / "datasets.toml"),
    "exports": ("FLEETBOX_EXPORTS", ROOT / "exports"),
    "receipts": ("FLEETBOX_RECEIPTS", ROOT / "receipts"),   # images' SBOMs and provenance (image/receipts.py)
}


_pinned: dict[str, tuple[str, str]] = {}   # variable: (the path a site file gave, where)


def pin_paths() -> None:
    """What the site files say of the paths, set in this process's environment: read once, so an edit to a file
    or another current folder does not move the runs folder (and the owner it makes) under a running command, and
    every process it starts (a supervisor runs from the checkout) keeps the same."""
    for key, (var, _) in PATHS.items():
        path, where = path_of(key)
        if where not in (var, "default"):
            os.environ[var] = str(path)
            _pinned[var] = (str(path), where)


def path_of(key: str) -> tuple[Path, str]:
    """Where fleetbox keeps `key` (PATHS), and what said so: its FLEETBOX_* variable, else a site file's [paths]
    (relative to the file's folder), else fleetbox's default (in the checkout)."""
    var, default = PATHS[key]
    if os.environ.get(var):
        said = _pinned.get(var, ("", ""))
        return Path(os.environ[var]), said[1] if said[0] == os.environ[var] else var
    for f in site_files():
        if value := f.data.get("paths", {}).get(key):
            return f.path.parent / Path(value).expanduser(), f.where("paths", key)
    return default, "default"


def runs_root() -> Path:
    """Every run's logs and reports: runs/<task>-<variant>-<time>/ and runs/<job-id>/."""
    return path_of("runs")[0]


def wheelhouse_root() -> Path:
    """Offline wheelhouses, one folder per variant."""
    return path_of("wheelhouse")[0]


def data_dir() -> Path:
    """The seeded dataset cache (Paddle's ~/.cache/paddle/dataset layout)."""
    return path_of("data")[0]


def datasets_manifest() -> Path:
    return path_of("datasets-manifest")[0]


def exports_dir() -> Path:
    return path_of("exports")[0]


def _path(var: str, default: Path) -> Path:
    return Path(os.environ.get(var) or default)


def slurm_patience() -> float:
    """Seconds a command that follows a Slurm job waits for a controller that does not answer (FLEETBOX_SLURM_PATIENCE,
    default 900) before it stops following the job, which goes on."""
    try:
        return max(0.0, float(os.environ.get("FLEETBOX_SLURM_PATIENCE") or 900))
    except ValueError:
        return 900.0


def user_cache() -> Path:
    """fleetbox's folder of the user's cache (XDG's): what this user's tools taught it, no root needed."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fleetbox"


def board_envs() -> Path:
    """Where `invoke board` makes VisualDL's environment, one folder per lock (the user's cache: no root)."""
    return _path("FLEETBOX_BOARD_ENVS", user_cache())


BOARD_LOCK = ROOT / "fleetbox" / "commands" / "board.lock"   # VisualDL's server and what it needs, hashed


def board_wheels() -> Path:
    """The board's own wheelhouse (BOARD_LOCK's wheels, which `invoke kit` carries): with it, the board's
    environment is made with no package index."""
    return wheelhouse_root() / "board"


DEFAULT_SCRIPT = ROOT / "train" / "smoke.py"
HELPERS = ROOT / "fleetbox" / "incontainer"   # what runs in the containers, mounted at HELPERS_DIR

# Inside job containers.
CONTAINER_CACHE = "/root/.cache/paddle/dataset"   # Paddle's DATA_HOME for the images' user (root)
HOME_CACHE = ".cache/paddle/dataset"              # the same, under the home of a runtime that runs as the user
LOG_DIR = "/fleetbox/logs"                        # --log_dir of paddle.distributed.launch
WORKDIR = "/workspace"                            # the training script's folder
VENV = "/opt/venv"                                 # the images' Python environment
FREEZE = f"{VENV}/fleetbox-freeze.txt"             # pip's freeze of it, written by the last layer
SBOM = f"{VENV}/fleetbox-sbom.cdx.json"            # the image's SBOM (image/receipts.py), copied in by the last layer
SBOM_IN_WHEELHOUSE = "fleetbox-sbom.cdx.json"      # ... from the wheelhouse, where `invoke build` puts it first
WORKSPACE_MAX = 1 << 30   # what a --hosts job copies to each engine: the script's folder, not the data
HELPERS_DIR = "/fleetbox/helpers"                 # HELPERS, on the containers' PYTHONPATH
CHECKPOINT_DIR = "/fleetbox/checkpoints"          # the job's checkpoint folder (FLEETBOX_CHECKPOINT_DIR), read-write
RESUME_DIR = "/fleetbox/resume"                   # --resume PATH, read-only
SCRIPT_VISUALDL = "visualdl"   # in a node's log folder: the script's own VisualDL logs (FLEETBOX_VISUALDL_DIR)

# Folders every image has, for runtimes that cannot create a bind mount's target (Charliecloud, Apptainer).
BIND_TARGETS = (WORKDIR, LOG_DIR, HELPERS_DIR, CHECKPOINT_DIR, RESUME_DIR, CONTAINER_CACHE)

# Labels: job containers carry the first four; the images fleetbox builds carry the variant and the rest.
LABEL_JOB, LABEL_NODE, LABEL_RANK = "io.fleetbox.job", "io.fleetbox.node", "io.fleetbox.rank"
LABEL_VARIANT = "io.fleetbox.variant"
LABEL_OWNER = "io.fleetbox.owner"   # user@<runs folder id> (run/records.py owner): whose job a container is
LABEL_INPUTS = "io.fleetbox.inputs-sha256"   # the digest of everything the image is made from (its content tag)
LABEL_LOCK = "io.fleetbox.lock-sha256"
LABEL_FREEZE = "io.fleetbox.pip-freeze"      # `pip freeze` of the image's environment
LABEL_SBOM = "io.fleetbox.sbom"              # where the image holds its SBOM (SBOM)
LABEL_ROLE = "io.fleetbox.role"              # a container fleetbox runs that is not a job's (verify)

# An env made by `invoke venv` (image/venvs.py): its record, written last; the Slurm runtime none reads it.
ENV_RECORD = "fleetbox-env.json"
# An env of a variant with GPU libraries: the sh that puts their folders first on LD_LIBRARY_PATH (VIRTUAL_ENV set
# to the env); its activate and the Slurm runtime none source it.
ENV_LIBRARIES = "fleetbox-libraries.sh"

# Every FLEETBOX_* variable fleetbox reads or sets: (who sets it, what it means). The docs' environment page is
# made from this, and a test holds it to the names the code uses.
ENVIRONMENT_KINDS = {
    "you": "Set by you, read by fleetbox on this machine",
    "job": "Set by fleetbox in every job's containers (your script may read them)",
    "script": "Set by you with --env, read by fleetbox's helpers in the containers",
    "image": "Set in the images fleetbox builds",
    "internal": "Between fleetbox's own parts (named here so none is a surprise)",
}
ENVIRONMENT = {
    "FLEETBOX_CONFIG": ("you", "the user's file of defaults (default $XDG_CONFIG_HOME/fleetbox/config.toml, "
                               "~/.config/fleetbox/config.toml); `fleetbox config` says what is in effect"),
    "FLEETBOX_RUNS": ("you", "where runs keep their logs, records and reports (default runs/)"),
    "FLEETBOX_WHEELHOUSE": ("you", "where offline wheelhouses are kept, one folder per variant (default wheelhouse/)"),
    "FLEETBOX_DATA": ("you", "the seeded dataset cache (default offline_cache/dataset/)"),
    "FLEETBOX_DATASETS_MANIFEST": ("you", "the dataset manifest (default offline_cache/datasets.toml)"),
    "FLEETBOX_EXPORTS": ("you", "where exports and their records go (default exports/)"),
    "FLEETBOX_RECEIPTS": ("you", "where `invoke build` keeps each image's SBOM and provenance statement (default "
                                 "receipts/)"),
    "FLEETBOX_BOARD_ENVS": ("you", "where `invoke board` makes VisualDL's environment, board-<lock hash>/ "
                                   "(default ~/.cache/fleetbox/)"),
    "FLEETBOX_SLURM_PATIENCE": ("you", "seconds `invoke train` and `invoke logs --follow` wait for a Slurm controller "
                                       "that does not answer before they stop following the job, which goes on "
                                       "(default 900)"),
    "FLEETBOX_JOB": ("job", "the job's id"),
    "FLEETBOX_NODE": ("job", "the node's rank (0 .. nodes - 1)"),
    "FLEETBOX_ATTEMPT": ("job", "0, then one more per restart or Slurm allocation"),
    "FLEETBOX_CHECKPOINT_DIR": ("job", "the job's checkpoint folder, read-write"),
    "FLEETBOX_RESUME": ("job", "auto, never or the folder of --resume PATH (the checkpoint helper reads it)"),
    "FLEETBOX_CHECKPOINT_SCOPE": ("job", "node where every node has its own checkpoint folder (--hosts volumes)"),
    "FLEETBOX_PROGRESS_DIR": ("job", "where each rank's progress goes, for hang detection, and the metrics found in "
                                     "its training (set when detection is on)"),
    "FLEETBOX_STYLE": ("job", "spawn where the script starts its own ranks (paddle.distributed.spawn); unset "
                              "where Paddle's launcher starts them"),
    "FLEETBOX_LOG_DIR": ("job", "where a script's spawned ranks write their logs (workerlog.<rank>), as the "
                                "launcher's do (set with FLEETBOX_STYLE)"),
    "FLEETBOX_VISUALDL_DIR": ("job", "where a VisualDL LogWriter of the script (paddle.callbacks.VisualDL) with a "
                                     "relative logdir writes: <this>/rank<r>/<logdir>, in the node's log folder"),
    "FLEETBOX_CHECKPOINT_EVERY": ("script", "save every N steps, overriding the script's value"),
    "FLEETBOX_CHECKPOINT_KEEP": ("script", "keep the newest N checkpoints, overriding the script's value"),
    "FLEETBOX_FIND_METRICS": ("script", "0: no loss, learning rate or samples/s is found in the training itself "
                                        "(a script with no fleetbox line then logs none)"),
    "FLEETBOX_VARIANT": ("image", "the image's matrix variant"),
    "FLEETBOX_DEVICE": ("image", "the device the image's Paddle is compiled for (cpu, cuda, rocm); verify checks it"),
    "FLEETBOX_VENV": ("internal", "the env a job without a container runs in (--runtime none)"),
    "FLEETBOX_ALLOCATION": ("internal", "a Slurm chain's allocation number, for its next allocation"),
    "FLEETBOX_RESTARTS": ("internal", "a Slurm chain's restarts so far, for its next allocation"),
    "FLEETBOX_CHAIN": ("internal", "a Slurm chain's first Slurm job id, for its next allocation"),
    "FLEETBOX_PROGRESS_PID": ("internal", "the rank's own process, so its children report no progress of their own"),
    "FLEETBOX_EXPECT_FREEZE": ("internal", "the package list verify expects in the image"),
    "FLEETBOX_EXPECT_SBOM": ("internal", "the Python packages of the image's SBOM, which verify holds it to"),
    "FLEETBOX_NO_GPU": ("internal", "why verify's container got no GPU (the engine has none to give)"),
    "FLEETBOX_KFD_TOPOLOGY": ("internal", "where a DCU node's devices are read from (a test points it at a recording)"),
}
