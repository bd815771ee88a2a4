"""Command-line values, parsed in one place: every task's numbers, lists and pairs end here, and a bad one
is one clear line (a UserError), never a traceback. An Option is one option declared once: its flag, its help,
its default and how its value is read (a job's: run/spec.py; a backend's own: Backend.options)."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from fleetbox.errors import UserError

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def integer(option: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise UserError(f"{option} takes a whole number (got {value!r})") from None
    if minimum is not None and n < minimum or maximum is not None and n > maximum:
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise UserError(f"{option} must be {bounds} (got {n})")
    return n


DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*")
DURATION_FORMS = "seconds, or minutes or hours like 90, 90s, 20m, 1h"


def _duration(option: str, value, off: str = "") -> float:
    m = DURATION.fullmatch(str(value))
    s = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)] if m else math.nan
    if not math.isfinite(s):
        raise UserError(f"{option} takes {DURATION_FORMS}{off} (got {value!r})")
    return s


def seconds(option: str, value) -> float | None:
    """A positive duration (every duration option takes one syntax: 90, 90s, 20m, 1h); None or '' for none."""
    if value in (None, ""):
        return None
    s = _duration(option, value)
    if s <= 0:
        raise UserError(f"{option} must be positive: {DURATION_FORMS} (got {value!r})")
    return s


def duration(option: str, value, default: float) -> float:
    """A duration as seconds (default where not given); 0 turns off what it bounds."""
    if value in (None, ""):
        return default
    return _duration(option, value, "; 0 turns it off")


# Other tools' words for fleetbox's options (Slurm's, torchrun's, paddle.distributed.launch's)
MEANT = {"--gres": "--gpus-per-node", "--gpus": "--gpus-per-node", "--ntasks-per-node": "--procs-per-node",
         "--nproc-per-node": "--procs-per-node", "--nproc_per_node": "--procs-per-node", "--nnodes": "--nodes",
         "--ntasks": "--nodes", "--time-limit": "--time"}


def nearest(word: str, known) -> str:
    """The one a mistyped option or task most likely meant: another tool's word for it, the only one it begins
    (`--gpus`: --gpus-per-node), else the closest spelling; "" where none is close."""
    known = sorted(known)
    if MEANT.get(word) in known:
        return MEANT[word]
    begun = [k for k in known if k.startswith(word)]
    if len(begun) == 1:
        return begun[0]
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.75)
    return close[0] if close else ""


def spelled(name: str) -> str:
    """A parameter's name as the command line (and a site file) spells it: `procs_per_node` procs-per-node, and
    `from_` (a Python keyword's stand-in) from."""
    return name.rstrip("_").replace("_", "-")


def items(value) -> list[str]:
    """A comma-separated list, blanks dropped."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def pairs(option: str, value) -> dict[str, str]:
    """KEY=VALUE,KEY=VALUE (environment): every item needs a valid name and an `=`."""
    out = {}
    for item in (value or "").split(","):
        if not item:
            continue
        key, eq, val = item.partition("=")
        if not eq or not ENV_NAME.fullmatch(key):
            raise UserError(f"{option} {item!r} must be NAME=VALUE with a name of letters, digits and _")
        out[key] = val
    return out


@dataclass(frozen=True)
class Option:
    """A command-line option, declared once: the front door (tasks.py) makes a task's `--name-with-dashes` and its
    help from it, and `read` makes the value the job or the backend gets. The job's options are run/spec.py's
    JOB_OPTIONS and TASK_OPTIONS; a backend's own (TorchX's run_opts) are its Backend.options, which the front
    door adds to `invoke train`, `doctor` and `scale`."""
    name: str                  # the task's parameter (a backend's: its constructor's keyword); flag: --<name, - for _>
    help: str                  # what `invoke --help TASK` and the reference page say of it
    default: object = None     # a backend's: what the backend gets where it is not given (its task parameter is
                               # None, so the backend's options given can be told); a job's or a task's: its task
                               # parameter's default (None: not given, the job's own default applies; False: a flag)
    kind: type = str           # what its value becomes: str (as given), int (a whole number, held to low..high),
                               # bool (a flag), float (a duration in seconds: 90, 90s, 20m, 1h; 0 turns off what it
                               # bounds), tuple (a comma-separated list, each item read by `item`), dict
                               # (comma-separated KEY=VALUE pairs)
    low: int | None = None
    high: int | None = None
    train_only: bool = False   # a backend's, about long runs: `invoke train` only
    item: Callable[[str], object] | None = None   # tuple: what each item becomes (default: the word itself)

    @property
    def flag(self) -> str:
        return "--" + spelled(self.name)

    def parse(self, value):
        """A value given on the command line, as its kind; a bad one is one line (a UserError)."""
        if self.kind is int:
            return integer(self.flag, value, self.low, self.high)
        if self.kind is bool:
            return bool(value)
        if self.kind is float:
            return _duration(self.flag, value, "; 0 turns it off")
        if self.kind is tuple:
            return tuple(map(self.item, items(value)) if self.item else items(value))
        if self.kind is dict:
            return pairs(self.flag, value)
        return value

    def read(self, value, default):
        """The value, or `default` where the option was not given: left out or empty (None, ""), or for all but a
        duration (whose 0 turns off what it bounds) any false value (a Python caller's 0 or False)."""
        unset = value is None or value == "" if self.kind is float else not value
        return default if unset else self.parse(value)
