"""The node log protocol: what a node's own script says of its node, in one line shape,

    fleetbox: node K on HOST: TEXT

(its route to the master, a module it loaded, a path it misses, a GPU prerequisite, a rank held after a
collective's timeout). The node scripts write it, their shell getting the line's start rendered in (`says`; in
shell/*.sh as @SAYS@); the backends and doctor read it back (LINE, said, host). Nothing else spells it."""

from __future__ import annotations

import re

SAYS = "fleetbox: node {node} on {host}: "
HELD = "ended waiting in a collective; holding the node for its peers' stacks"   # a rank's, after its timeout
LINE = re.compile(r"^fleetbox: node (\d+) on ([^:\s]+): (.*)$", re.M)


def says(node: str, host: str = "$(hostname)") -> str:
    """The line's start in our own shell (raw): `node` the shell's word for the node's number (a variable), the
    host as `hostname` gives it."""
    return SAYS.format(node=node, host=host)


def lines(text: str) -> list[tuple[int, str, str]]:
    """(node, host, what it said) for every line of the protocol in a node's output."""
    return [(int(m.group(1)), m.group(2), m.group(3)) for m in LINE.finditer(text)]


def about(words: str) -> re.Pattern:
    """The protocol's lines whose words match `words` (a regex, whole; its groups are the match's)."""
    return re.compile(r"^fleetbox: node \d+ on [^:\s]+: (?:" + words + r")$", re.M)


def host(text: str) -> str:
    """The host the node ran on, from the first line its script printed ("?" where it printed none)."""
    found = LINE.search(text)
    return found.group(2) if found else "?"
