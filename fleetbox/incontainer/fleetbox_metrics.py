"""fleetbox's metrics protocol, for any training script: one line per step per rank, the protocol's prefix
(fleetbox_found.PREFIX, shared with the metrics found in a script's training) and then

    {"rank": 0, "step": 12, "time": 1795356000.12, "loss": 0.41, "samples_per_s": 5120.0, ...}

(`time` is the wall clock, so lines from every node line up with the job's start.) fleetbox collects the
lines of every rank from every node's logs into runs/<job>/metrics.jsonl, on every backend.

    import fleetbox_metrics                      # on PYTHONPATH in every fleetbox job container
    meter = fleetbox_metrics.Meter()
    for step, batch in ...:
        ...
        meter.step(step, loss=float(loss), samples=len(batch), lr=0.01)   # any more scalars by name

Every line is progress for hang detection too (fleetbox_progress).

Two scalars have a meaning fleetbox reads: `comm_seconds`, the part of the step spent communicating (say, the
gradients' all-reduce timed by the script, as train/smoke.py does), whose share reports and `invoke scale` show;
and `own_seconds`, the part a rank spent on its own work, not waiting for its peers (the Meter gives it as the
step's time less `comm_seconds`). Collective training moves in lock step, so every rank's step takes as long
as the slowest one's: only a rank's own time tells a straggler from the ranks waiting for it.
"""
import json
import os
import time

# in a container the helpers' folder is on PYTHONPATH; on the host this is fleetbox.incontainer.fleetbox_metrics
try:
    import fleetbox_found
    import fleetbox_progress
except ImportError:
    from . import fleetbox_found, fleetbox_progress

fleetbox_progress.reporting()   # a script that logs metrics reports progress: hang detection counts on it

FIXED = ("rank", "step", "time", "node", "attempt")   # node and attempt: fleetbox adds them from where the log is


def rank():
    return int(os.environ.get("PADDLE_TRAINER_ID") or os.environ.get("PADDLE_GLOBAL_RANK") or 0)


def log(step, loss=None, samples_per_s=None, **scalars):
    """Print one metrics line for this rank."""
    clash = [k for k in scalars if k in FIXED]
    if clash:
        raise ValueError(f"fleetbox_metrics: {', '.join(clash)} are set by the protocol itself")
    rec = {"rank": rank(), "step": int(step), "time": time.time()}
    if loss is not None:
        rec["loss"] = float(loss)
    if samples_per_s is not None:
        rec["samples_per_s"] = float(samples_per_s)
    rec.update({k: float(v) for k, v in scalars.items()})
    print(fleetbox_found.PREFIX + json.dumps(rec), flush=True)
    fleetbox_progress.step(step, own=rec.get("own_seconds"))


class Meter:
    """Times steps: each `step()` logs samples/s over the time since the previous one (or since the Meter
    was made), with the samples and seconds it counted, so a report adds them up exactly as `rate()` does."""

    def __init__(self):
        self.last = time.perf_counter()
        self.samples, self.seconds = 0, 0.0

    def step(self, step, loss=None, samples=None, **scalars):
        now = time.perf_counter()
        took, self.last = now - self.last, now
        if samples:
            self.samples += samples
            self.seconds += took
            scalars.update(samples=samples, seconds=took)
        if "own_seconds" not in scalars and scalars.get("comm_seconds") is not None:
            scalars["own_seconds"] = max(0.0, took - float(scalars["comm_seconds"]))
        log(step, loss, samples / took if samples and took > 0 else None, **scalars)

    def rate(self):
        """This rank's samples/s over every step so far."""
        return self.samples / self.seconds if self.seconds else 0.0
