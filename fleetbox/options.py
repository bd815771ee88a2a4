"""Command-line values, parsed in one place: every task's numbers, lists and pairs end here, and a bad one
is one clear line (a UserError), never a traceback."""

from __future__ import annotations

import math
import re

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
