"""Metrics found in the training itself, for a script with no fleetbox line: each rank's loss, learning rate and
samples/s at every optimizer step, in the metrics protocol's lines (fleetbox_metrics), so that the report and
`invoke board` show them as they show a Meter's. sitecustomize calls these functions from its wrappers:

- the loss: the scalar tensor `backward()` was called on since the last step (dynamic graph; a GradScaler's scaled
  loss counts as the loss it scaled), or, in a static graph, the value Executor.run fetched of the variable the
  program's optimizer minimised; paddle.Model's fit is either;
- the learning rate: the stepping optimizer's get_lr(), as the step begins;
- samples/s: the data loader's batches trained on since the previous step (a batch counts when a backward()
  follows it; in a static graph, the training program's run), over that time.

A step is the outermost optimizer step (or dynamic-mode minimize, or GradScaler step or minimize, which an
overflow makes skip the optimizer's own); with several optimizers, the first one's steps, said once.

A step whose loss is not one scalar (backward() called twice, on a tensor of several values, or with a
grad_tensor: several losses, gradient accumulation, a penalty) gets no loss, and the log says why, once: fleetbox
never guesses. A script that imports fleetbox_metrics reports its own metrics, and nothing is found from then on.
FLEETBOX_FIND_METRICS=0 turns finding off (bench/found.py measures its cost with it).

Each step's record is queued; fleetbox_progress's background writer appends them to the node's log folder
(FILE) once a second: the training thread never waits on the file system. A loss on a device is read there too,
and only the newest of those queued (a read waits for the device's queue: once per write, never per step); a loss
on the CPU is read for every step.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import sys
import threading
import time

try:   # in a container the helpers' folder is on PYTHONPATH; on the host this is fleetbox.incontainer
    import fleetbox_progress
except ImportError:
    from . import fleetbox_progress

PREFIX = "FLEETBOX-METRIC "   # the metrics protocol's lines: these, and fleetbox_metrics' (never imported here)
ENV = "FLEETBOX_FIND_METRICS"
FILE = "found-metrics-rank{rank}.log"   # in the node's log folder, beside the worker logs: lines of the protocol

_local = threading.local()   # depth: an optimizer's step inside another's (a wrapper's, a subclass's) is one step
_lock = threading.Lock()     # the queue
_writing = threading.Lock()  # the file: the writer thread and the exit handler may both write
_queue = []                  # records not written yet; "loss" may still be a tensor
_said = set()                # the kinds of reason already logged
_first = []                  # the first optimizer that stepped: with several, the steps found are its own
# the step in progress; "batch": the size of the loader's last batch, counted into "samples" by a backward() (a batch
# that none follows, an evaluation's, counts nothing)
_now = {"loss": None, "backwards": 0, "odd": None, "batch": None, "samples": None, "scaled": None}
_last = {"step": 0, "at": None, "mode": "w"}   # "w": this process's first write starts the file, as the launcher
                                                 # starts each rank's worker log
_minimised = {}              # id(static program) -> (its loss variable, its name, the optimizer, program)
_broken = []                 # an error of ours: finding stops, the training goes on


def on() -> bool:
    """Finding runs: in a rank, not turned off, and the script logs no metrics of its own."""
    return (not _broken and fleetbox_progress.path() is not None and os.environ.get(ENV, "1") != "0"
            and "fleetbox_metrics" not in sys.modules)


def _never_raises(f):
    """These run inside the script's own calls: an error of ours is said once, and ends finding, never training."""
    import functools

    @functools.wraps(f)
    def safe(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except Exception as e:
            if not _broken:
                _broken.append(e)
                print(f"fleetbox: no more metrics are found in this rank's training: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
    return safe


def _say(kind: str, text: str) -> None:
    """Said once per kind (a shape or a count may differ from step to step)."""
    if kind not in _said:
        _said.add(kind)
        print(f"fleetbox: {text}; log your own with fleetbox_metrics.Meter", file=sys.stderr, flush=True)


@_never_raises
def scaled(out, loss) -> None:
    """A GradScaler scaled `loss` into `out`: backward() on `out` is a backward() on `loss`."""
    _now["scaled"] = (out, loss)


@_never_raises
def backward(tensor, grad_tensor) -> None:
    """backward() was called on `tensor`: the batch it was computed on is trained on."""
    _now["backwards"] += 1
    if _now["batch"]:
        _now["samples"] = (_now["samples"] or 0) + _now["batch"]
        _now["batch"] = None
    pair = _now["scaled"]
    if pair is not None and pair[0] is tensor:
        tensor = pair[1]
    shape = list(getattr(tensor, "shape", None) or [])
    if grad_tensor is not None:
        _now["odd"] = ("grad_tensor", "no loss is found for steps where backward() is given a grad_tensor")
    elif math.prod(shape) != 1:
        _now["odd"] = ("vector", f"no loss is found for steps where backward() is called on a tensor of several "
                                 f"values (shape {shape}), not on one loss")
    _now["loss"] = tensor


def batch(out) -> None:
    """The data loader gave `out`: its first tensor's first dimension is the batch size, counted into the step's by
    the backward() that follows it (gradient accumulation's micro-batches each; an evaluation's, none). A batch of
    another shape counts none."""
    try:
        while isinstance(out, (list, tuple)) and out:
            out = out[0]
        if isinstance(out, dict) and out:
            out = next(iter(out.values()))
        shape = getattr(out, "shape", None)
        shape = shape() if callable(shape) else shape   # a static loader's LoDTensor has it as a method
        n = int(shape[0])
    except Exception:
        n = None
    _now["batch"] = n


@_never_raises
def minimised(optimizer, loss) -> None:
    """In a static graph, `optimizer` minimised `loss` in the program being built: running it is a training step."""
    program = getattr(getattr(loss, "block", None), "program", None)   # a legacy Variable's
    if program is None:   # PIR's value: the program being built
        import paddle
        program = paddle.static.default_main_program()
    try:   # a legacy Variable's name; PIR's values have none here, and are fetched as themselves
        name = loss.name
    except Exception:
        name = None
    _minimised[id(program)] = (loss, name if type(name) is str else None, optimizer, program)   # held: its id stays its


def _lr(optimizer):
    try:
        return float(optimizer.get_lr())
    except Exception:   # a scheduler of a kind get_lr cannot read: the loss still counts
        return None


def _enter() -> bool:
    """True for the outermost of nested steps."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    return depth == 0


def _leave() -> None:
    _local.depth -= 1


class step:
    """A context around an optimizer's step (a dynamic-mode minimize, a GradScaler's step or minimize, which may
    skip the optimizer's step on an overflow): the outermost is one training step. With several optimizers, the
    first one's steps are the steps."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __enter__(self):
        self.outer = _enter()
        self._begin()

    @_never_raises
    def _begin(self):
        if not self.outer:
            return
        if not _first:
            _first.append(self.optimizer)
        if self.optimizer is not _first[0]:
            names = f"{type(_first[0]).__name__}, {type(self.optimizer).__name__}"
            _say("optimizers", f"several optimizers step ({names}): the steps, loss and learning rate found are "
                               f"the first one's")
        elif on():
            loss, backwards, odd = _now["loss"], _now["backwards"], _now["odd"]
            if backwards > 1 and odd is None:
                odd = ("twice", "no loss is found for steps where backward() is called more than once (several "
                                "losses, gradient accumulation)")
            if odd is not None:
                _say(*odd)
                loss = None
            _record(loss.detach() if hasattr(loss, "detach") else loss, _lr(self.optimizer))
        _now.update(loss=None, backwards=0, odd=None, samples=None, scaled=None)

    def __exit__(self, *exc):
        _leave()


@_never_raises
def ran(program, fetch_list, out) -> None:
    """Executor.run(program, fetch_list=...) returned `out`: a training step where `program` is one whose optimizer
    minimised a loss, with that loss where it was fetched."""
    if not on():
        return
    if program is None:
        import paddle
        program = paddle.static.default_main_program()
    entry = _minimised.get(id(program)) or _minimised.get(id(getattr(program, "_program", None)))
    if entry is None:
        return
    loss_var, name, optimizer, _ = entry
    loss = None
    for i, f in enumerate(fetch_list or []):
        if f is loss_var or name is not None and isinstance(f, str) and f == name:
            try:
                import numpy
                value = numpy.asarray(out[i])
                loss = float(value.reshape(-1)[0]) if value.size == 1 else None
            except Exception:
                loss = None
            break
    _now["samples"] = _now["batch"]   # a static program has no backward() of the script's: its batch is trained on
    _record(loss, _lr(optimizer))
    _now.update(batch=None, samples=None)


def _record(loss, lr) -> None:
    now = time.perf_counter()
    _last["step"] += 1
    rec = {"rank": fleetbox_progress.rank(), "step": _last["step"], "time": time.time()}
    if loss is not None:
        rec["loss"] = loss
    if lr is not None:
        rec["lr"] = lr
    samples, since = _now["samples"], _last["at"]
    if samples and since is not None and now > since:
        rec.update(samples=samples, seconds=now - since, samples_per_s=samples / (now - since))
    _last["at"] = now
    with _lock:
        _queue.append(rec)
    if _last["step"] == 1:
        # the last records are written at exit, before Paddle's own exit handlers (registered earlier, so run
        # later) free the tensors: a tensor read after them is no number
        atexit.register(write)
        fleetbox_progress.also(write)


def _on_device(t) -> bool:
    try:
        return not t.place.is_cpu_place()
    except Exception:
        return False


def _value(loss):
    if isinstance(loss, float):
        return loss
    try:
        return float(loss)
    except Exception:   # freed, or not a number after all
        return None


def write() -> None:
    """Append the queued records to this rank's file (fleetbox_progress's writer calls it once a second, and the
    exit handler last), one writer at a time."""
    if fleetbox_progress.path() is None:   # a forked child, with a copy of its parent's queue
        return
    with _writing:
        with _lock:
            recs = _queue[:]
            del _queue[:]
        if recs:
            _append(recs)


def _append(recs: list[dict]) -> None:
    device = [_on_device(r.get("loss")) for r in recs]
    newest_on_device = max((i for i, on in enumerate(device) if on), default=None)
    lines = []
    for i, r in enumerate(recs):
        loss = r.get("loss")
        if loss is not None:
            value = None if device[i] and i != newest_on_device else _value(loss)
            if value is None:
                del r["loss"]
            else:
                r["loss"] = value
        lines.append(PREFIX + json.dumps(r) + "\n")
    d = os.environ.get(fleetbox_progress.DIR_ENV)
    try:
        with open(os.path.join(d, FILE.format(rank=fleetbox_progress.rank())), _last["mode"]) as f:
            f.write("".join(lines))
        _last["mode"] = "a"
    except (OSError, TypeError):   # a full or vanished log folder: the metrics are lost, training goes on
        pass
