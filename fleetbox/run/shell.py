"""Shell words, typed. A user value is literal text and is always quoted (shlex.quote); only fleetbox's own
fragments are raw shell, and they say so by being a `Raw`. A `Joined` is one shell word made of both, e.g.
the literal `node` followed by the raw `"$SLURM_NODEID"`.
"""

from __future__ import annotations

import shlex


class Raw(str):
    """Shell text written by fleetbox itself (a variable, a command substitution): emitted as is."""


class Joined(tuple):
    """One shell word from parts: `str` parts are quoted, `Raw` parts are emitted as is."""



def word(w) -> str:
    if isinstance(w, Raw):
        return str(w)
    if isinstance(w, Joined):
        return "".join(word(p) for p in w if p != "") or "''"
    return shlex.quote(w)


def line(words) -> str:
    return " ".join(word(w) for w in words)
