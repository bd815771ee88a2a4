"""Checkpoints for fleetbox jobs: import this in a training script (every fleetbox container has it on its
PYTHONPATH, nothing to copy) and a job that dies, is restarted or reaches its queue's time limit goes on
from where it was.

    import fleetbox_checkpoint
    ckpt = fleetbox_checkpoint.Checkpoint(every=100, keep=3, total=total_steps)   # after fleet.init(); total:
                                                                  # told to stop at the last step, it finishes
    start = ckpt.restore(model, opt)                              # 0 on a fresh start
    mine = ckpt.rank_state or {}                                  # this rank's own state, as it was saved
    # ckpt.saved_world: the ranks that saved it (None on a fresh start); a job that went on without a failed
    # node (--min-nodes) has fewer now: rank r resumes with what rank r saved, and the state of the ranks
    # beyond the new world is left out (the replicated model and optimizer are whole; samplers re-shard).
    # A script whose own state cannot move to another world says so: Checkpoint(..., world_change="refuse")
    # stops it at restore, in one line, rather than resume it on another world
    for step in range(start, total_steps):
        ...                                                       # one training step
        ckpt.step(step + 1, model, opt, rank_state={"losses": losses})   # saves every `every` steps, and
    ckpt.done()                                                   # when the job is told to stop (then exits)

A static-graph script passes its main program where a dynamic one passes its Layer, after running the startup
program (restore sets the values the startup program gave); everything else is as above:

    exe.run(startup)
    start = ckpt.restore(main, opt)                               # main: the paddle.static.Program it trains
    for step in range(start, total_steps):
        exe.run(main, feed=..., fetch_list=[loss])
        ckpt.step(step + 1, main, opt)

A program's state is its persistable variables' values in paddle.static.global_scope(): its trained parameters and
the rest (the optimizer's accumulators, the learning rate, AMP's loss scaling), the same on every rank, so
replicated; its parameters that are not trained (BatchNorm's statistics) are each rank's own, as a Layer's buffers.
`opt` (None works too) lends its LRScheduler, if it has one.

Layout of FLEETBOX_CHECKPOINT_DIR (the job's checkpoint folder, the same for every attempt):
    step-00000120/  model.pdparams (the model: a Layer's state_dict, or a program's trained parameters by name),
                    optimizer.pdopt (the optimizer: its state_dict, or a program's other persistables by name and
                    "LR_Scheduler"), both replicated and written once; rank-<r>.pkl (each rank's own:
                    Python/NumPy/Paddle RNG states, a Layer's buffers or a program's untrained parameters, such as
                    BatchNorm statistics, and the
                    script's rank_state), COMPLETE (sizes and sha256 of every file; a folder without it is never
                    loaded)
    STATE           {"state": "running" | "continue" | "done", "step": N}: what fleetbox reads to decide
                    whether a job that stopped should go on in a new allocation
    STOP            written by fleetbox when Slurm warns that the time limit is near: save and stop now

A save goes to `.step-N.partial/`: every rank writes its own file (to a temporary name, then renamed), the
writer (rank 0, or each node's first rank where nodes do not share the folder) writes the replicated state;
each file's size and sha256 are taken from the bytes as they are written (the replicated state is serialized
in memory first) and reach the writer in one all-gather (nothing is read back from the file system), then the
writer checks their sizes, adds COMPLETE and renames the folder. Only complete folders count. On restore,
ranks agree on the newest step every one of them has complete and intact: each rank checks its own file, the
writer also the replicated state (once per folder, not once per rank); a step damaged for any rank is given up
by all (its writer moves the folder aside), with a line that says so.

Environment (set by fleetbox): FLEETBOX_CHECKPOINT_DIR (no checkpoints without it), FLEETBOX_RESUME
(auto: the newest complete step; never: start fresh; a path: a step folder or a checkpoint folder to start
from, until the job has checkpoints of its own; `never` holds for FLEETBOX_ATTEMPT 0 only),
FLEETBOX_CHECKPOINT_SCOPE (shared: one folder for all nodes; node: one per node, FLEETBOX_NODE telling which),
FLEETBOX_CHECKPOINT_EVERY / FLEETBOX_CHECKPOINT_KEEP (override the script's values).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import time

# in a container the helpers' folder is on PYTHONPATH; on the host this is fleetbox.incontainer.fleetbox_checkpoint
try:
    import fleetbox_checkpoint_folder as folder_layout
    import fleetbox_progress
except ImportError:
    from . import fleetbox_checkpoint_folder as folder_layout
    from . import fleetbox_progress

COMPLETE, STATE, STOP, complete_steps = (folder_layout.COMPLETE, folder_layout.STATE, folder_layout.STOP,
                                         folder_layout.complete_steps)

fleetbox_progress.reporting()   # every step() is progress for hang detection, a save a declared phase

MODEL, OPTIMIZER = "model.pdparams", "optimizer.pdopt"


def _say(msg: str) -> None:
    print(f"fleetbox-checkpoint: {msg}", flush=True)


def _fail(msg: str) -> None:
    print(f"fleetbox-checkpoint: error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _eager():
    """Where the script builds a static graph, the helper's own tensors (its collectives, the RNG check) are made
    in dynamic mode for the while: in static mode they would be ops added to the script's default program."""
    import paddle
    return contextlib.nullcontext() if paddle.in_dynamic_mode() else paddle.base.dygraph.guard()


_PICKLES = []   # whether Paddle's RNG state survives pickling here, once asked


def _rng_pickles() -> bool:
    """Whether Paddle's own RNG state survives pickling here. Paddle 2.6's CPU generator pickles its seed and
    offset only, not its engine's state: one restored from a pickle starts its stream over (and a CPU-only 2.x
    build cannot pickle it at all). Asked one draw past where the stream is, so that a stream just seeded (which a
    seed alone replays) does not pass; without moving the stream: the state object itself restores whole."""
    import numpy as np
    import paddle
    if not _PICKLES:
        with _eager():   # the generators are the same in both modes
            outer = paddle.get_rng_state()
            try:
                paddle.rand([1], dtype="float32")
                state = paddle.get_rng_state()
                want = paddle.rand([4], dtype="float32").numpy()
                paddle.set_rng_state(pickle.loads(pickle.dumps(state)))
                _PICKLES.append(bool(np.array_equal(want, paddle.rand([4], dtype="float32").numpy())))
            except (TypeError, pickle.PicklingError):
                _PICKLES.append(False)
            finally:
                paddle.set_rng_state(outer)
    return _PICKLES[0]


def _reseed(step: int) -> int:
    """Where the RNG state does not pickle: a seed for Paddle's generator from its seed so far and the step, set
    after every step and again at a resume from one, so a run resumed from any step (a stop, a signal, a save of
    the script's own) draws what an uninterrupted one does; the stream is not the one Paddle draws unseeded."""
    import paddle
    base = paddle.framework.core.default_cpu_generator().initial_seed()
    seed = int.from_bytes(hashlib.sha256(f"{base}:{step}".encode()).digest()[:4], "big")
    paddle.seed(seed)
    return seed


def _static(model) -> bool:
    """A static-graph program (PIR's or the older paddle.static.Program), not a Layer."""
    return callable(getattr(model, "list_vars", None)) and callable(getattr(model, "global_block", None))


PARAMETER, BUFFER, OTHER = "parameter", "buffer", "other"   # a program's persistables, by how a checkpoint keeps them


def _persistables(program, kinds=(PARAMETER, BUFFER, OTHER)) -> dict:
    """{name: (tensor, kind)} of the program's persistable variables of those kinds that hold an initialized
    dense tensor in the global scope: a trained parameter, an untrained one (BatchNorm's statistics: each rank's
    own, as DataParallel keeps them) or another (the optimizer's). A PIR value has a name only where it is
    persistable: asked in that order."""
    import paddle
    scope = paddle.static.global_scope()
    found = {}
    for v in program.list_vars():
        if not v.persistable:
            continue
        var = scope.find_var(v.name)
        try:
            tensor = var.get_tensor() if var is not None else None
        except ValueError:   # not a dense tensor: a feed or fetch list, SelectedRows
            continue
        kind = OTHER if not getattr(v, "is_parameter", False) else PARAMETER if getattr(v, "trainable", True) \
            else BUFFER
        if tensor is not None and tensor._is_initialized() and kind in kinds:
            found[v.name] = (tensor, kind)
    return found


def _lr_scheduler(program, optimizer):
    """The LRScheduler the optimizer was given, if any (the program names it too once minimize() ran): in static
    mode the executor sets the learning rate from it before every run, so it is what a resume must restore."""
    lr = getattr(optimizer, "_learning_rate", None) if optimizer is not None else None
    lr = lr if lr is not None else getattr(program, "lr_scheduler", None)
    return lr if callable(getattr(lr, "state_dict", None)) else None


def _program_state(program, optimizer) -> tuple[dict, dict]:
    """(trained parameters, the optimizer's and other persistables) as NumPy arrays by name, the replicated
    state; the LRScheduler's state goes with the rest."""
    import numpy as np
    params, rest = {}, {}
    for name, (tensor, kind) in _persistables(program, (PARAMETER, OTHER)).items():
        (params if kind == PARAMETER else rest)[name] = np.array(tensor)
    lr = _lr_scheduler(program, optimizer)
    if lr is not None:
        rest["LR_Scheduler"] = lr.state_dict()
    return params, rest


def _place(tensor):
    """The tensor's own place as the type DenseTensor.set() takes (it refuses the generic Place _place() gives):
    a parameter stays on its device, a CPU-kept one (a learning rate, a beta power) on the CPU."""
    import paddle
    core, at = paddle.base.core, tensor._place()
    if at.is_gpu_place():
        return core.CUDAPlace(at.gpu_device_id())
    if at.is_cuda_pinned_place():
        return core.CUDAPinnedPlace()
    if at.is_xpu_place():
        return core.XPUPlace(at.xpu_device_id())
    if at.is_custom_place():
        return core.CustomPlace(at.custom_device_type(), at.custom_device_id())
    return core.CPUPlace()


def _check_program(program, saved: dict) -> None:
    """The replicated state fits the program: its startup program ran, and they share variables."""
    if not _persistables(program):
        _fail("restore(program): no variable of the program has a value yet: run its startup program first "
              "(exe.run(startup)), then restore")
    if saved and not set(saved) & set(_persistables(program, (PARAMETER, OTHER))):
        _fail(f"restore(program): none of the checkpoint's {len(saved)} variables is in the program (saved "
              f"from another network, or from a Layer?)")


def _set_program_state(program, saved: dict, kinds=(PARAMETER, OTHER)) -> list[str]:
    """Each saved value into the program's variable of that name and of those kinds, where it has it (the startup
    program made them); returns the names of those it lacks and of its own the checkpoint lacks (left as they
    are)."""
    import numpy as np
    have = _persistables(program, kinds)
    for name, value in saved.items():
        if name in have:
            tensor, value = have[name][0], np.array(value)   # paddle.load gives a DenseTensor in static mode
            if tuple(value.shape) != tuple(tensor.shape()):
                _fail(f"restore(program): {name} is {list(value.shape)} in the checkpoint, "
                      f"{list(tensor.shape())} in the program: is it the same network?")
            tensor.set(value, _place(tensor))
    return sorted(set(saved) ^ set(have))


def _write(path: str, data: bytes | memoryview) -> tuple[int, str]:
    """Complete or absent: written to a temporary name, flushed to disk, then renamed. Returns the size and
    sha256 of what was written, taken from the bytes themselves (never read back from a shared file system)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(data), hashlib.sha256(data).hexdigest()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def intact(step_dir: str, names=None) -> str:
    """"" when the step folder is complete and the files it lists (or those of them in `names`) have their size
    and sha256; else why not."""
    try:
        with open(os.path.join(step_dir, COMPLETE)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"no readable {COMPLETE} ({e})"
    for name, (size, digest) in files.items():
        if names is not None and name not in names:
            continue
        p = os.path.join(step_dir, name)
        if not os.path.exists(p):
            return f"{name} is missing"
        if os.path.getsize(p) != size or _sha256(p) != digest:
            return f"{name} is damaged (size or sha256 differs from {COMPLETE})"
    return ""


def _positive(name: str, default: int) -> int:
    """A whole number >= 1 from the environment (else the script's own value); anything else ends the rank with
    one line, not a traceback."""
    text = os.environ.get(name) or str(default)
    if not text.strip().isdigit() or int(text) < 1:
        raise SystemExit(f"fleetbox-checkpoint: {name}={text!r} must be a whole number >= 1")
    return int(text)


class Checkpoint:
    def __init__(self, every: int = 100, keep: int = 3, folder: str | None = None, total: int | None = None,
                 world_change: str = "carry"):
        import paddle.distributed as dist
        self.dist = dist
        self.folder = folder if folder is not None else os.environ.get("FLEETBOX_CHECKPOINT_DIR", "")
        self.every = _positive("FLEETBOX_CHECKPOINT_EVERY", every)
        self.keep = _positive("FLEETBOX_CHECKPOINT_KEEP", keep)
        self.resume = os.environ.get("FLEETBOX_RESUME", "auto") or "auto"
        if int(os.environ.get("FLEETBOX_ATTEMPT") or 0) > 0:   # a restart or continuation: from its own
            self.resume = "auto" if self.resume == "never" else self.resume
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("PADDLE_LOCAL_RANK", os.environ.get("PADDLE_RANK_IN_NODE", "0")) or 0)
        self.shared = os.environ.get("FLEETBOX_CHECKPOINT_SCOPE", "shared") != "node"
        self.writer = self.rank == 0 if self.shared else local == 0    # writes the replicated state and COMPLETE
        # which folder this rank writes to: one for all (shared), else its node's; the path is the same on every
        # node, so the node is told by FLEETBOX_NODE (set by fleetbox), else by the host's name
        self.place = "shared" if self.shared else os.environ.get("FLEETBOX_NODE") or socket.gethostname()
        self.rank_state: dict | None = None
        self.saved_world: int | None = None   # the ranks that saved the checkpoint restored (the world then)
        self.total = total   # the script's last step, where given: told to stop there, it finishes instead
        if world_change not in ("carry", "refuse"):
            raise ValueError(f"world_change={world_change!r}: give carry or refuse")
        self.world_change = world_change   # a checkpoint of another world: its rank states carried, or refused
        self.saved_step = self.last_step = 0
        self._stop = False
        self._seed = (None, 0)   # (step, seed) step() last set, where the RNG state does not pickle (_reseed)
        self._looked = 0.0
        if not self.folder:
            _say("FLEETBOX_CHECKPOINT_DIR is not set: no checkpoints")
            return
        try:
            os.makedirs(self.folder, exist_ok=True)
            probe = os.path.join(self.folder, f".writable-{self.rank}-{os.getpid()}")
            _write(probe, b"")
            os.remove(probe)
        except OSError as e:
            _fail(f"cannot write checkpoints to {self.folder}: {e.strerror or e}")
        for sig in (signal.SIGTERM, signal.SIGUSR1):   # "stop soon": save, mark "continue", exit
            signal.signal(sig, self._asked_to_stop)

    def _asked_to_stop(self, signum, frame):
        self._stop = True

    # -- collectives (none with one rank) --

    @contextlib.contextmanager
    def _eagerly(self):
        """Collectives in dynamic mode, also in a static-graph script. There fleet.init(is_collective=True) makes
        no process group for them (the program's communicators are ops of its own): the first makes one."""
        import paddle
        static = not paddle.in_dynamic_mode()
        with _eager():
            if static and not self.dist.is_initialized():
                self.dist.init_parallel_env()
            yield

    def _barrier(self):
        if self.world > 1:
            with self._eagerly():
                self.dist.barrier()

    def _all(self, flag: bool, op) -> bool:
        if self.world == 1:
            return flag
        import paddle
        with self._eagerly():
            t = paddle.to_tensor([1 if flag else 0], dtype="int32")
            self.dist.all_reduce(t, op=op)
            return bool(int(t.numpy()[0]))

    def _any_rank(self, flag: bool) -> bool:
        return self._all(flag, self.dist.ReduceOp.MAX)

    def _gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = []
        with self._eagerly():
            self.dist.all_gather_object(out, obj)
        return out

    # -- restore --

    def restore(self, model, optimizer=None) -> int:
        """Load the newest complete, intact checkpoint every rank has (or the one FLEETBOX_RESUME names);
        return the step to go on from (0: fresh)."""
        if not self.folder:
            return 0
        if self.writer:   # saves an earlier attempt did not finish
            for name in os.listdir(self.folder):
                if name.endswith(".partial"):
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        found = self._candidates()
        common = set(found)
        for theirs in self._gather(sorted(found)):
            common &= set(theirs)
        step = 0
        for candidate in sorted(common, reverse=True):
            # each rank checks its own file; the writer also the replicated state, once for its folder
            mine = [f"rank-{self.rank}.pkl"] + ([MODEL, OPTIMIZER] if self.writer else [])
            why = intact(found[candidate], mine)
            # every rank's verdict, with its folder's place: all agree, and a writer learns whether its folder is hurt
            seen = self._gather((self.place, why))
            if not any(w for _, w in seen):
                step = self._load(found[candidate], model, optimizer)
                break
            if why:
                _say(f"rank {self.rank}: step {candidate} ({found[candidate]}) is unusable: {why}")
            if self.writer and any(w for place, w in seen if place == self.place) \
                    and os.path.dirname(found[candidate]) == self.folder.rstrip("/"):
                # damaged in its own folder (not a given one, e.g. ck-old beside ck): out of the way, kept to look at
                os.rename(found[candidate], f"{found[candidate]}.damaged-{int(time.time())}")
            if self.rank == 0:
                _say(f"step {candidate} is unusable on some rank; falling back to the one before")
        if self.resume not in ("auto", "never") and not step:
            _fail(f"FLEETBOX_RESUME={self.resume}: no intact checkpoint there")
        if self.rank == 0:
            _say(f"resumed from step {step}" if step else "starting from step 0 (no checkpoint to resume)")
            self._mark("running", step)
        self.saved_step = self.last_step = step
        return step

    def _candidates(self) -> dict[int, str]:
        """{step: folder} this rank could resume from."""
        if self.resume == "never":
            return {}
        if self.resume == "auto":
            return {s: os.path.join(self.folder, f"step-{s:08d}") for s in complete_steps(self.folder)}
        own = complete_steps(self.folder)
        if own:   # a restart of a job that began from the given checkpoint: its own are newer
            return {s: os.path.join(self.folder, f"step-{s:08d}") for s in own}
        given = self.resume.rstrip("/") or "/"
        if not os.path.isdir(given):
            _fail(f"FLEETBOX_RESUME={self.resume}: no such folder")
        if os.path.exists(os.path.join(given, COMPLETE)):   # one step folder
            try:
                with open(os.path.join(given, COMPLETE)) as f:
                    return {int(json.load(f)["step"]): given}
            except (OSError, ValueError, KeyError) as e:
                _fail(f"FLEETBOX_RESUME={self.resume}: unreadable {COMPLETE} ({e})")
        found = {s: os.path.join(given, f"step-{s:08d}") for s in complete_steps(given)}
        if not found:
            _fail(f"FLEETBOX_RESUME={self.resume}: no complete checkpoint there")
        return found

    def _load(self, d: str, model, optimizer) -> int:
        import numpy as np
        import paddle
        with open(os.path.join(d, COMPLETE)) as f:
            meta = json.load(f)
        if self.world_change == "refuse" and int(meta["world"]) != self.world:
            _fail(f"the checkpoint at step {meta['step']} was saved by {meta['world']} ranks, and this job has "
                  f"{self.world}: the script's own state does not move to another world (world_change=\"refuse\"); "
                  f"run it on {meta['world']} ranks again, or start over with --resume never")
        if _static(model):
            saved = {**paddle.load(os.path.join(d, MODEL)),
                     **(paddle.load(os.path.join(d, OPTIMIZER)) if os.path.exists(os.path.join(d, OPTIMIZER)) else {})}
            lr, lr_state = _lr_scheduler(model, optimizer), saved.pop("LR_Scheduler", None)
            if lr is not None and lr_state is not None:
                lr.set_state_dict(lr_state)
            _check_program(model, saved)
            odd = _set_program_state(model, saved)
            if odd and self.rank == 0:
                _say(f"{len(odd)} variables the program or the checkpoint lacks, left as they are: "
                     f"{', '.join(odd[:8])}{', ...' if len(odd) > 8 else ''}")
        else:
            model.set_state_dict(paddle.load(os.path.join(d, MODEL)))
            if optimizer is not None and os.path.exists(os.path.join(d, OPTIMIZER)):
                optimizer.set_state_dict(paddle.load(os.path.join(d, OPTIMIZER)))
        mine = os.path.join(d, f"rank-{self.rank}.pkl")
        if os.path.exists(mine):
            with open(mine, "rb") as f:
                saved = pickle.load(f)
            random.setstate(saved["python_rng"])
            np.random.set_state(saved["numpy_rng"])
            if "paddle_seed" in saved:   # saved where the state does not pickle (_reseed)
                paddle.seed(saved["paddle_seed"])
            else:
                paddle.set_rng_state(saved["paddle_rng"])
            if _static(model):
                _set_program_state(model, saved.get("buffers", {}), (BUFFER,))
            else:
                for n, b in model.named_buffers():
                    if n in saved.get("buffers", {}):
                        b.set_value(saved["buffers"][n])
            self.rank_state = saved["rank_state"]
        else:   # the job now has more ranks than when it saved
            _say(f"rank {self.rank}: no state of its own in {d} (saved by {meta['world']} ranks); starting it fresh")
        self.saved_world = int(meta["world"])
        return int(meta["step"])

    # -- save --

    def step(self, step: int, model, optimizer=None, rank_state=None) -> None:
        """Call after every training step: saves every `every` steps, and when the job is told to stop (SIGTERM or
        SIGUSR1 on any rank, or a STOP file in the folder), saves, records "continue" and exits."""
        fleetbox_progress.step(step)
        if not self.folder:
            return
        self.last_step = step
        if not _rng_pickles():
            self._seed = (step, _reseed(step))
        now = time.monotonic()
        if now - self._looked >= 1.0:   # a stat a second, not one per step, on a shared file system
            self._looked = now
            self._stop = self._stop or os.path.exists(os.path.join(self.folder, STOP))
        stop = self._any_rank(self._stop)
        if stop or step % self.every == 0:
            self.save(step, model, optimizer, rank_state)
        if stop and self.total and step >= self.total:   # the work is done: a next allocation would do nothing
            _say(f"told to stop at the last step ({step}): saved it; finishing")
        elif stop:
            if self.rank == 0:
                self._mark("continue", step)
                _say(f"told to stop: saved step {step}; the job continues from there")
            self._barrier()
            raise SystemExit(0)

    def save(self, step: int, model, optimizer=None, rank_state=None) -> None:
        with fleetbox_progress.phase("checkpoint save"):   # a long save on a slow file system is not a hang
            self._save(step, model, optimizer, rank_state)

    def _save(self, step: int, model, optimizer=None, rank_state=None) -> None:
        import numpy as np
        import paddle
        if not self.folder or step == self.saved_step:
            return
        final = os.path.join(self.folder, f"step-{step:08d}")
        part = os.path.join(self.folder, f".step-{step:08d}.partial")
        os.makedirs(part, exist_ok=True)
        state = rank_state() if callable(rank_state) else rank_state
        if _rng_pickles():
            paddle_rng = {"paddle_rng": paddle.get_rng_state()}
        else:   # the seed step() set after this step, or one set now for a save of the script's own
            seen, seed = self._seed
            paddle_rng = {"paddle_seed": seed if seen == step else _reseed(step)}
        mine = {"python_rng": random.getstate(), "numpy_rng": np.random.get_state(), **paddle_rng, "rank_state": state,
                # buffers are each rank's own (DataParallel does not all-reduce BatchNorm statistics): a Layer's,
                # or a program's untrained parameters
                "buffers": {n: np.array(t) for n, (t, _) in _persistables(model, (BUFFER,)).items()}
                if _static(model) else {n: b.numpy() for n, b in model.named_buffers()}}
        written = {f"rank-{self.rank}.pkl": _write(os.path.join(part, f"rank-{self.rank}.pkl"), pickle.dumps(mine))}
        if self.writer:
            # a program's optimizer state is its persistables (optimizer.state_dict() is for dynamic mode only)
            replicated = zip((MODEL, OPTIMIZER), _program_state(model, optimizer)) if _static(model) else (
                (MODEL, model.state_dict()), (OPTIMIZER, optimizer.state_dict() if optimizer else None))
            for name, obj in replicated:
                if obj is not None:
                    # paddle.save takes a path or an io.BytesIO (it checks isinstance), no other file object: to
                    # hash what is written without reading the file back, it is serialized in memory, then
                    # written and hashed from that buffer (getbuffer: no second copy of a large state)
                    buf = io.BytesIO()
                    paddle.save(obj, buf)
                    with buf.getbuffer() as data:
                        written[name] = _write(os.path.join(part, name), data)
        # every rank's file is in place, and the writer learns each one's size and sha256 (no re-reading)
        seen = self._gather((self.place, written))
        if self.writer:
            # the files of the ranks that write to this folder (all, or this node's), as their ranks wrote them
            files = {n: list(v) for place, w in seen if place == self.place for n, v in w.items()}
            self._wait_for(part, sorted(files))   # by name: a cached listing on NFS may not show them yet
            for n, (size, _) in files.items():   # a stat, not a read
                if os.path.getsize(os.path.join(part, n)) != size:
                    _fail(f"{n} in {part} is not the size its rank wrote: is FLEETBOX_CHECKPOINT_DIR one folder "
                          f"shared by every node, or one per node with FLEETBOX_CHECKPOINT_SCOPE=node?")
            files = dict(sorted(files.items()))
            _write(os.path.join(part, COMPLETE), json.dumps(
                {"step": step, "world": self.world, "time": time.time(), "files": files}).encode())
            shutil.rmtree(final, ignore_errors=True)   # the same step saved by an earlier attempt
            os.rename(part, final)
            _fsync_dir(self.folder)
            for old in [s for s in complete_steps(self.folder) if s <= step][self.keep:]:   # never a newer one
                shutil.rmtree(os.path.join(self.folder, f"step-{old:08d}"), ignore_errors=True)
            if self.rank == 0:
                _say(f"saved step {step}")
        self._barrier()   # nobody goes on (or exits) before the checkpoint is complete
        self.saved_step = step

    def _wait_for(self, part: str, names: list[str], within: float = 30.0) -> None:
        end = time.monotonic() + within
        while missing := [n for n in names if not os.path.exists(os.path.join(part, n))]:
            if time.monotonic() > end:
                _fail(f"{', '.join(missing)} did not appear in {part} within {within:.0f} s: " + (
                      "is FLEETBOX_CHECKPOINT_DIR one folder shared by every node?" if self.shared else
                      "does FLEETBOX_NODE tell the nodes apart (each node's ranks alike, the nodes different)?"))
            time.sleep(0.2)

    def done(self) -> None:
        """The script finished its work: fleetbox will not continue it."""
        if self.folder and self.rank == 0:
            self._mark("done", self.last_step)

    def _mark(self, state: str, step: int) -> None:
        _write(os.path.join(self.folder, STATE), json.dumps(
            {"state": state, "step": step, "time": time.time()}).encode())


def skip_batches(batch_sampler, n: int):
    """The batch sampler without its first n batches, for resuming mid-epoch: the indices are skipped, no data
    is loaded for them. Call the sampler's set_epoch() first, as for any epoch."""
    from paddle.io import BatchSampler

    class Skipped(BatchSampler):
        def __init__(self):
            pass

        def __iter__(self):
            return itertools.islice(iter(batch_sampler), n, None)

        def __len__(self):
            return max(0, len(batch_sampler) - n)

    return Skipped() if n else batch_sampler
