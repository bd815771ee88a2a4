"""What of a job's live output reaches the terminal: everything but the launcher's polling, its configuration dump
and the metrics lines (`--debug` shows them; the log files always keep them). A failed job's summary shows the
failed node's configuration dump again (`config_dump`): that is when its settings matter."""

from __future__ import annotations

import re

from fleetbox.incontainer.fleetbox_found import PREFIX

# Paddle's launcher logs every poll of its HTTP master (dozens of lines per job: /healthy, /<job>/info...);
# the log files keep them. Other HTTP logging (a user's own) is left alone.
LAUNCHER_POLLING = re.compile(
    r"\[node\d+\] .*HTTP Request: [A-Z]+ http://[\d.:\[\]a-fA-F]+/(healthy|[\w.-]+/info(/\S*)?) \"HTTP/[\d.]+ \d+")


METRICS = re.compile(r"\[node\d+\] " + re.escape(PREFIX))   # one per step per rank: metrics.jsonl has them


# The launcher's dump of its ~30 settings, between two dashed lines: half of a 2-node job's live output.
# A node's log file has the lines without the live stream's "[nodeN] ".
LOGGED_INFO = r"LAUNCH INFO [\d-]+ [\d:,]+ "
START, END = r"-+\s+Configuration\s+-+$", r"-+$"
LAUNCH_INFO = r"\[(node\d+)\] " + LOGGED_INFO
CONFIG_START, CONFIG_END = re.compile(LAUNCH_INFO + START), re.compile(LAUNCH_INFO + END)
LOGGED_START, LOGGED_LINE, LOGGED_END = (re.compile(LOGGED_INFO + x) for x in (START, "", END))


def quiet(log):
    """The live stream without the launcher's polling lines, its configuration dump and the metrics lines."""
    in_config: set[str] = set()   # the nodes whose dump is being printed now

    def show(line: str) -> None:
        if m := CONFIG_START.match(line):
            in_config.add(m.group(1))
            return
        if in_config and (m := re.match(LAUNCH_INFO, line)) and m.group(1) in in_config:   # the dump's own lines
            if CONFIG_END.match(line):
                in_config.discard(m.group(1))
            return
        if not (LAUNCHER_POLLING.match(line) or METRICS.match(line)):
            log(line)
    return show


def config_dump(lines: list[str]) -> list[str]:
    """The launcher's first configuration dump in a node's log lines, its settings without the time stamps
    ([] when there is none)."""
    begun = next((i for i, ln in enumerate(lines) if LOGGED_START.match(ln)), None)
    if begun is None:
        return []
    out = []
    for ln in lines[begun + 1:]:
        m = LOGGED_LINE.match(ln)
        if not m or LOGGED_END.match(ln):
            break
        out.append(ln[m.end():])
    return out
