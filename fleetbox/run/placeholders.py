"""Per-node values that users and fleetbox's own templates write as placeholders, filled per node by every
backend (TorchX's macros, in our spelling). `$` in a value is literal everywhere; these are the only
substitutions fleetbox makes:

  {rank}         the node's rank (0 .. nnodes-1)       {node}         node<rank>, fleetbox's name for the node
  {nnodes}       the number of nodes                    {job_id}       the fleetbox job id
  {home}, {user} the home folder and name of the user the job runs as, on the node
  {master_ip}    the master's numeric IP                {master_port}  the master's port
  {node_ip}      the node's own address towards the master
  {iface}        the node's network interface towards the master
  {port_range}   the node's pinned launcher and trainer ports, FIRST:LAST (the job's PORT_RANGE)
  {attempt}      0 for the job's first run, then 1, 2, ... for each restart or continuation in a new allocation
  {gpus}         the accelerator ids the node is given, as its host numbers them ("0,1"; Slurm: its allocation);
                 empty on CPU

Anything else in braces (JSON, say) is left alone.
"""

from __future__ import annotations

import re

from fleetbox.run.shell import Joined, Raw

NAMES = ("rank", "node", "nnodes", "job_id", "home", "user", "master_ip", "master_port", "node_ip", "iface", "attempt",
         "port_range", "gpus")
PATTERN = re.compile(r"\{(" + "|".join(NAMES) + r")\}")


def used(text: str) -> set[str]:
    return set(PATTERN.findall(text))


def fill(text: str, values: dict[str, str]) -> str:
    """Every placeholder replaced by its value (a placeholder without a value is left as it is)."""
    return PATTERN.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def to_shell(text, values: dict[str, str | Raw]):
    """A shell word for `text` whose placeholders become the given values: literal text stays quoted,
    a `Raw` value (e.g. '"$SLURM_NODEID"') is expanded by the shell on the node. Non-str words pass as is."""
    if not isinstance(text, str) or isinstance(text, Raw):
        return text
    parts, at = [], 0
    for m in PATTERN.finditer(text):
        parts.append(text[at:m.start()])
        parts.append(values.get(m.group(1), m.group(0)))
        at = m.end()
    parts.append(text[at:])
    if not any(isinstance(p, Raw) for p in parts):
        return "".join(parts)
    return Joined(p for p in parts if p != "")
