"""What of a job's live output reaches the terminal: everything but the launcher's polling and the metrics lines
(`--debug` shows them; the log files always keep them)."""

from __future__ import annotations

import re

# Paddle's launcher logs every poll of its HTTP master (dozens of lines per job: /healthy, /<job>/info...);
# the log files keep them. Other HTTP logging (a user's own) is left alone.
LAUNCHER_POLLING = re.compile(
    r"\[node\d+\] .*HTTP Request: [A-Z]+ http://[\d.:\[\]a-fA-F]+/(healthy|[\w.-]+/info(/\S*)?) \"HTTP/[\d.]+ \d+")


METRICS = re.compile(r"\[node\d+\] FLEETBOX-METRIC ")   # one per step per rank: metrics.jsonl has them


def quiet(log):
    """The live stream without the launcher's polling lines and the metrics lines."""
    return lambda line: None if LAUNCHER_POLLING.match(line) or METRICS.match(line) else log(line)
