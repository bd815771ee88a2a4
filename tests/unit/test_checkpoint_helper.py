"""fleetbox_checkpoint with several ranks for real: each rank is its own process (forked), running the helper
against one folder (or one per node), with a stand-in `paddle` whose collectives really go between the
processes (a shared dict and a barrier: no rank sees a result before every rank contributed). What is checked:
the ranks agree on one step, a step damaged on some ranks only is given up by all, the replicated state is read
for checking by its writer only and nothing is read back at a save, node scope, the environment's overrides,
a stop asked of one rank, and a static-graph program's state (its persistables in the global scope). Real Paddle
with real ranks: tests/integration (test_checkpoints, test_train); a real static program: tests/probes."""
import builtins
import contextlib
import hashlib
import io
import itertools
import json
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import time
import types
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fleetbox.incontainer import fleetbox_checkpoint as fc

CTX = multiprocessing.get_context("fork")
REAL_OPEN, REAL_OS_OPEN = builtins.open, os.open
DEADLINE = 60   # seconds for every rank of one run to end; a collective gives up after half of it


def fake_paddle(world: int, rank: int, barrier, box, static: bool = False) -> dict:
    """`paddle` and `paddle.distributed` as the helper uses them, for this rank, in sys.modules. `static`: the
    script runs a static graph, where a collective made in static mode would be an op of its program, and
    fleet.init makes no process group for the helper's. Returns the global scope's values (static mode)."""
    paddle, dist = types.ModuleType("paddle"), types.ModuleType("paddle.distributed")
    calls = itertools.count()
    mode = {"dynamic": not static, "group": not static}
    scope_values = {}

    def gather(obj) -> list:
        assert mode["dynamic"] and mode["group"], "a collective in static mode, or before its process group"
        n = next(calls)   # every rank makes the same collectives in the same order
        box[(n, rank)] = obj
        barrier.wait(timeout=DEADLINE / 2)   # every rank's contribution is in before anyone reads
        return [box[(n, r)] for r in range(world)]

    class Tensor:
        def __init__(self, values):
            self.values = list(values)

        def numpy(self):
            return np.array(self.values)

    def all_reduce(t, op):
        t.values = [{"min": min, "max": max}[op](gather(t.values[0]))]

    def all_gather_object(out, obj):
        out.extend(gather(obj))   # Paddle's appends to the list it is given

    def save(obj, where):   # as Paddle's: a path or an io.BytesIO, nothing else
        if isinstance(where, io.BytesIO):
            pickle.dump(obj, where)
        elif isinstance(where, str):
            with REAL_OPEN(where, "wb") as f:
                pickle.dump(obj, f)
        else:
            raise ValueError(f"only supports saving objects to file and `BytesIO`, but got {type(where)}")

    def load(path):   # loading is every rank's; only the helper's own reads (its checks) are counted
        with REAL_OPEN(path, "rb") as f:
            return pickle.load(f)

    @contextlib.contextmanager
    def dygraph_guard():
        was, mode["dynamic"] = mode["dynamic"], True
        try:
            yield
        finally:
            mode["dynamic"] = was

    class Place:   # what DenseTensor._place() gives: CPU here
        def __getattr__(self, name):
            return (lambda: name == "is_cpu_place") if name.startswith("is_") else super().__getattribute__(name)

    class DenseTensor:
        def __init__(self, name):
            self.name = name

        def _is_initialized(self):
            return self.name in scope_values

        def shape(self):
            return list(scope_values[self.name].shape)

        def _place(self):
            return Place()

        def __array__(self, dtype=None, copy=None):
            return np.array(scope_values[self.name], dtype=dtype)

        def set(self, value, place):
            assert isinstance(place, CPUPlace), f"set() takes a typed place, not {place!r}"
            scope_values[self.name] = np.array(value)

    class CPUPlace:
        pass

    def not_dense():
        raise ValueError("(InvalidArgument) The Variable type must be N3phi11DenseTensorE, but the type it holds ...")

    class Scope:
        def find_var(self, name):
            return types.SimpleNamespace(get_tensor=not_dense if name == "fetch" else lambda: DenseTensor(name))

    dist.get_rank, dist.get_world_size = (lambda: rank), (lambda: world)
    dist.is_initialized = lambda: mode["group"]
    dist.init_parallel_env = lambda: mode.update(group=True)
    paddle.in_dynamic_mode = lambda: mode["dynamic"]
    paddle.base = types.SimpleNamespace(dygraph=types.SimpleNamespace(guard=dygraph_guard),
                                        core=types.SimpleNamespace(CPUPlace=CPUPlace))
    paddle.static = types.SimpleNamespace(global_scope=Scope)
    dist.barrier = lambda: gather(None) and None
    dist.ReduceOp = types.SimpleNamespace(MIN="min", MAX="max")
    dist.all_reduce, dist.all_gather_object = all_reduce, all_gather_object
    paddle.distributed, paddle.to_tensor = dist, (lambda values, dtype=None: Tensor(values))
    paddle.save, paddle.load = save, load
    paddle.get_rng_state, paddle.set_rng_state = (lambda: [rank]), (lambda state: None)
    paddle.rand = lambda shape, dtype=None: Tensor([0.5] * shape[0])   # as if its state pickled whole
    sys.modules["paddle"], sys.modules["paddle.distributed"] = paddle, dist
    return scope_values


def record_reads(root: str, reads: list) -> None:
    """Every file under `root` this process opens for reading (open, io.open, os.open) goes to `reads`."""
    def note(path):
        p = os.path.abspath(os.fspath(path))
        if p.startswith(root + os.sep) and not os.path.isdir(p):
            reads.append(os.path.relpath(p, root))

    def opened(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and ("r" in mode or "+" in mode):
            note(file)
        return REAL_OPEN(file, mode, *args, **kwargs)

    def os_opened(path, flags, *args, **kwargs):
        if flags & os.O_ACCMODE != os.O_WRONLY:
            note(path)
        return REAL_OS_OPEN(path, flags, *args, **kwargs)

    builtins.open = io.open = opened
    os.open = os_opened


class Buffer:
    def __init__(self, value):
        self.value = np.array(value, dtype=float)

    def numpy(self):
        return self.value

    def set_value(self, v):
        self.value = np.array(v)


class Model:
    def __init__(self, rank):
        self.w = np.zeros(3)
        self.buffer = Buffer([rank, rank])     # each rank's own (BatchNorm statistics, say)

    def state_dict(self):
        return {"w": self.w.copy()}

    def set_state_dict(self, d):
        self.w = d["w"].copy()

    def named_buffers(self):
        return [("bn", self.buffer)]


class Optimizer:
    def __init__(self):
        self.moments = np.zeros(3)

    def state_dict(self):
        return {"moments": self.moments.copy()}

    def set_state_dict(self, d):
        self.moments = d["moments"].copy()


class Var:
    """A program's variable as list_vars() gives it; as PIR's, one not persistable has no name to ask."""
    def __init__(self, name, persistable=True, is_parameter=False):
        self._name, self.persistable, self.is_parameter = name, persistable, is_parameter

    @property
    def name(self):
        if not self.persistable:
            raise ValueError("we can only get name of Value from DataOp/ParameterOp/...")
        return self._name


class Program:
    """A static program: a parameter, BatchNorm's statistics (a parameter too), the optimizer's velocity and
    learning rate, an input (not persistable) and a persistable fetch list that holds no tensor."""
    def list_vars(self):
        return [Var("x", persistable=False), Var("fc.w", is_parameter=True), Var("bn.mean", is_parameter=True),
                Var("fc.w_velocity"), Var("learning_rate_0"), Var("fetch")]

    def global_block(self):
        return self


class Scheduler:
    def __init__(self):
        self.last_epoch = 0

    def state_dict(self):
        return {"last_epoch": self.last_epoch}

    def set_state_dict(self, d):
        self.last_epoch = d["last_epoch"]


def static_rank_main(world, rank, barrier, box, env, steps, every, keep, out, data, signal_at):
    """One rank of a static-graph script: its state is the program's persistables in the global scope."""
    sys.stdout = sys.stderr = open(f"{out}.log", "w", buffering=1)
    try:
        os.environ.update(env)
        scope = fake_paddle(world, rank, barrier, box, static=True)
        start_up = {"fc.w": np.zeros(3), "bn.mean": np.zeros(2), "fc.w_velocity": np.zeros(3),
                    "learning_rate_0": np.array(0.1)}
        if env.get("STARTUP") != "skip":
            scope.update(start_up)
        main, opt = Program(), types.SimpleNamespace(_learning_rate=Scheduler())
        ckpt = fc.Checkpoint(every=every, keep=keep)
        start = ckpt.restore(main, opt)
        for step in range(start, steps):
            scope["fc.w"] = scope["fc.w"] + 1
            scope["bn.mean"] = scope["bn.mean"] + 2
            scope["fc.w_velocity"] = scope["fc.w_velocity"] + 0.5
            opt._learning_rate.last_epoch += 1
            ckpt.step(step + 1, main, opt, rank_state={"rank": rank, "step": step + 1})
        Path(out).write_text(json.dumps({"start": start, "rank_state": ckpt.rank_state, "last_epoch":
                                         opt._learning_rate.last_epoch, **{k: v.tolist() for k, v in scope.items()}}))
    except BaseException:
        barrier.abort()
        raise


def rank_main(world, rank, barrier, box, env, steps, every, keep, out, data, signal_at):
    """One rank: restore, train up to `steps` steps saving every `every`; what it saw goes to `out` as JSON."""
    sys.stdout = sys.stderr = open(f"{out}.log", "w", buffering=1)
    try:
        os.environ.update(env)
        fake_paddle(world, rank, barrier, box)
        at_restore, at_save = [], []
        record_reads(data, at_restore)
        model, opt = Model(rank), Optimizer()
        ckpt = fc.Checkpoint(every=every, keep=keep, world_change=os.environ.get("WORLD_CHANGE", "carry"))
        start = ckpt.restore(model, opt)
        record_reads(data, at_save)   # from here on: steps and saves
        stopped = None
        try:
            for step in range(start, steps):
                model.w += 1
                opt.moments += 0.5
                model.buffer.value += 1
                if step + 1 == signal_at:   # "stop soon", to this rank only: its handler runs before step()
                    os.kill(os.getpid(), signal.SIGUSR1)
                ckpt.step(step + 1, model, opt, rank_state={"rank": rank, "step": step + 1})
        except SystemExit as e:
            if e.code not in (0, None):
                raise
            stopped = ckpt.last_step
        Path(out).write_text(json.dumps({
            "start": start, "rank_state": ckpt.rank_state, "w": model.w.tolist(), "moments": opt.moments.tolist(),
            "buffer": model.buffer.value.tolist(), "stopped": stopped,
            "read_at_restore": at_restore, "read_at_save": at_save}))
    except BaseException as e:
        # the other ranks fail at once, not after the collective's timeout; but an end the test expects of every
        # rank (EXPECTED_EXIT) leaves the barrier as it is: a peer still leaving the last collective would find it
        # broken and end otherwise
        if not (isinstance(e, SystemExit) and str(e.code) == os.environ.get("EXPECTED_EXIT")):
            barrier.abort()
        raise


def run_ranks(tmp_path, world, env_of, steps, every=4, keep=3, name="run", signal_at=None, target=rank_main,
              exits=0) -> list[dict]:
    """Every rank's process, to the end; a rank that fails or hangs fails the test (every process ended), or with
    `exits` every rank must end so. The checkpoint folders are to be under tmp_path/data (reads there are
    recorded), the records go to tmp_path."""
    manager = CTX.Manager()
    barrier, box = CTX.Barrier(world), manager.dict()
    outs = [tmp_path / f"{name}-rank{r}.json" for r in range(world)]
    procs = [CTX.Process(target=target, args=(world, r, barrier, box, env_of(r), steps, every, keep, str(outs[r]),
                                                 str(tmp_path / "data"), (signal_at or {}).get(r)))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        end = time.monotonic() + DEADLINE
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
        assert not stuck, f"ranks {stuck} of run {name!r} did not end within {DEADLINE} s"
        failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != exits}
        assert not failed, f"ranks of run {name!r} failed {failed}: " + " | ".join(
            said(tmp_path, name, r)[-800:] for r in failed)
        if exits:
            return []
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        manager.shutdown()
    return [json.loads(o.read_text()) for o in outs]


def said(tmp_path, name, rank) -> str:
    return (tmp_path / f"{name}-rank{rank}.json.log").read_text()


def steps_in(folder: Path) -> list[str]:
    """The step folders (not those moved aside)."""
    return sorted(p.name for p in folder.iterdir() if fc.folder_layout.STEP_DIR.fullmatch(p.name))


def reads_of(result: dict, when: str) -> Counter:
    return Counter(os.path.basename(p) for p in result[f"read_at_{when}"])


def shared(folder, **extra):
    return lambda r: {"FLEETBOX_CHECKPOINT_DIR": str(folder), "PADDLE_LOCAL_RANK": "0", "FLEETBOX_NODE": str(r),
                      **extra}


def node_scope(tmp_path, ppn=2):
    """Two ranks a node, each node with its own folder (the same path on real nodes; here two folders)."""
    return lambda r: {"FLEETBOX_CHECKPOINT_DIR": str(tmp_path / "data" / f"node{r // ppn}"),
                      "FLEETBOX_CHECKPOINT_SCOPE": "node", "FLEETBOX_NODE": str(r // ppn),
                      "PADDLE_LOCAL_RANK": str(r % ppn)}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_save_once_and_resume_together_each_with_its_own_state(tmp_path, world):
    ck = tmp_path / "data" / "ck"
    first = run_ranks(tmp_path, world, shared(ck), steps=10, name="a")
    assert steps_in(ck) == ["step-00000004", "step-00000008"]
    listed = json.loads((ck / "step-00000008" / "COMPLETE").read_text())["files"]
    assert sorted(listed) == ["model.pdparams", "optimizer.pdopt"] + [f"rank-{r}.pkl" for r in range(world)]
    assert sorted(p.name for p in (ck / "step-00000008").iterdir()) == sorted([*listed, "COMPLETE"])
    for name, (size, digest) in listed.items():   # what each rank wrote, as it wrote it
        data = (ck / "step-00000008" / name).read_bytes()
        assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    assert [r["read_at_save"] for r in first] == [[]] * world   # a save reads back nothing it wrote
    again = run_ranks(tmp_path, world, shared(ck), steps=12, name="b")
    assert [r["start"] for r in again] == [8] * world
    assert [r["rank_state"] for r in again] == [{"rank": r, "step": 8} for r in range(world)]
    assert all(r["w"] == [12.0] * 3 and r["moments"] == [6.0] * 3 for r in again)   # 8 restored + 4
    assert [r["buffer"] for r in again] == [[r + 12.0] * 2 for r in range(world)]   # each rank's own, restored
    # the replicated state is read to be checked once, by its writer; each rank reads its own file, no other's
    replicated = [[reads_of(r, "restore")[n] for n in ("model.pdparams", "optimizer.pdopt")] for r in again]
    assert replicated == [[1, 1]] + [[0, 0]] * (world - 1)
    for rank, r in enumerate(again):
        assert {n for n in reads_of(r, "restore") if n.startswith("rank-")} == {f"rank-{rank}.pkl"}
    assert [r["read_at_save"] for r in again] == [[]] * world


@pytest.mark.parametrize("damage", ["flipped", "missing"])
def test_a_step_damaged_on_one_rank_only_is_given_up_by_every_rank(tmp_path, damage):
    ck = tmp_path / "data" / "ck"
    run_ranks(tmp_path, 2, shared(ck), steps=10, name="a")
    victim = ck / "step-00000008" / "rank-1.pkl"
    if damage == "missing":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF   # the same size, one byte changed
        victim.write_bytes(bytes(data))
    again = run_ranks(tmp_path, 2, shared(ck), steps=5, name="b")   # no save of its own
    assert [r["start"] for r in again] == [4, 4] and [r["rank_state"]["step"] for r in again] == [4, 4]
    assert steps_in(ck) == ["step-00000004"] and len(list(ck.glob("step-00000008.damaged-*"))) == 1
    why = "is missing" if damage == "missing" else "is damaged (size or sha256 differs from COMPLETE)"
    assert f"rank 1: step 8 ({ck}/step-00000008) is unusable: rank-1.pkl {why}" in said(tmp_path, "b", 1)
    assert "unusable:" not in said(tmp_path, "b", 0)   # rank 0's own files were fine: it followed the agreement


def test_damaged_replicated_state_is_found_by_its_writer_and_every_rank_falls_back(tmp_path):
    ck = tmp_path / "data" / "ck"
    run_ranks(tmp_path, 3, shared(ck), steps=10, name="a")
    model = ck / "step-00000008" / "model.pdparams"
    model.write_bytes(model.read_bytes()[:-1] + b"\0")
    again = run_ranks(tmp_path, 3, shared(ck), steps=5, name="b")
    assert [r["start"] for r in again] == [4, 4, 4] and [r["w"] for r in again] == [[5.0] * 3] * 3
    assert len(list(ck.glob("step-00000008.damaged-*"))) == 1
    assert "rank 0: step 8" in said(tmp_path, "b", 0) and "model.pdparams is damaged" in said(tmp_path, "b", 0)
    assert [reads_of(r, "restore")["model.pdparams"] for r in again] == [2, 0, 0]   # step 8, then step 4


def test_a_damaged_step_of_a_given_folder_beside_its_own_is_left_where_it_is(tmp_path):
    """--resume ck-old (real paths, as with --runtime none): its name starts as the job's own folder's does,
    but it is the user's; a damaged step there is given up, never moved."""
    old, ck = tmp_path / "data" / "ck-old", tmp_path / "data" / "ck"
    run_ranks(tmp_path, 2, shared(old), steps=10, name="a")
    model = old / "step-00000008" / "model.pdparams"
    model.write_bytes(model.read_bytes()[:-1] + b"\0")
    again = run_ranks(tmp_path, 2, shared(ck, FLEETBOX_RESUME=str(old)), steps=5, name="b")
    assert [r["start"] for r in again] == [4, 4]
    assert steps_in(old) == ["step-00000004", "step-00000008"] and not list(old.glob("*.damaged-*"))


def test_a_rank_the_checkpoint_has_no_file_of_starts_its_own_state_fresh(tmp_path):
    ck = tmp_path / "data" / "ck"
    run_ranks(tmp_path, 2, shared(ck), steps=8, name="a")
    again = run_ranks(tmp_path, 3, shared(ck), steps=9, name="b")   # one rank more than saved
    assert [r["start"] for r in again] == [8] * 3 and [r["w"] for r in again] == [[9.0] * 3] * 3
    assert [r["rank_state"] for r in again] == [{"rank": 0, "step": 8}, {"rank": 1, "step": 8}, None]
    assert "rank 2: no state of its own" in said(tmp_path, "b", 2) and not list(ck.glob("*.damaged-*"))


def test_a_script_whose_own_state_cannot_move_to_another_world_is_stopped_at_restore_in_one_line(tmp_path):
    """world_change="refuse": resuming on fewer ranks (a job that went on without a node) ends every rank with one
    line, before any state is read; on as many ranks as saved it resumes as always."""
    ck = tmp_path / "data" / "ck"
    run_ranks(tmp_path, 3, shared(ck, WORLD_CHANGE="refuse"), steps=8, name="a")
    run_ranks(tmp_path, 2, shared(ck, WORLD_CHANGE="refuse", EXPECTED_EXIT="2"), steps=9, name="b", exits=2)
    for r in (0, 1):
        lines = [ln for ln in said(tmp_path, "b", r).splitlines() if "error" in ln]
        assert lines == ["fleetbox-checkpoint: error: the checkpoint at step 8 was saved by 3 ranks, and this job "
                         "has 2: the script's own state does not move to another world (world_change=\"refuse\"); "
                         "run it on 3 ranks again, or start over with --resume never"], said(tmp_path, "b", r)
    again = run_ranks(tmp_path, 3, shared(ck, WORLD_CHANGE="refuse"), steps=9, name="c")
    assert [r["start"] for r in again] == [8] * 3


def test_node_scope_gives_each_node_its_own_writer_and_the_ranks_agree_on_a_step_every_node_has(tmp_path):
    first = run_ranks(tmp_path, 4, node_scope(tmp_path), steps=10, name="a")
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        step8 = tmp_path / "data" / f"node{node}" / "step-00000008"
        listed = json.loads((step8 / "COMPLETE").read_text())["files"]
        assert sorted(listed) == ["model.pdparams", "optimizer.pdopt"] + [f"rank-{r}.pkl" for r in ranks]
        assert sorted(p.name for p in step8.iterdir()) == sorted([*listed, "COMPLETE"])
        assert all(listed[n][0] == (step8 / n).stat().st_size for n in listed)
    assert [r["read_at_save"] for r in first] == [[]] * 4
    shutil.rmtree(tmp_path / "data" / "node1" / "step-00000008")   # node 1 (ranks 2 and 3) lacks the newest step
    again = run_ranks(tmp_path, 4, node_scope(tmp_path), steps=5, name="b")
    assert [r["start"] for r in again] == [4] * 4 and [r["rank_state"]["rank"] for r in again] == [0, 1, 2, 3]
    # each node's writer (its first rank) checks its own folder's replicated state
    assert [reads_of(r, "restore")["model.pdparams"] for r in again] == [1, 0, 1, 0]
    # node 0's step 8 is intact, only not everywhere: kept as it is
    assert steps_in(tmp_path / "data" / "node0") == ["step-00000004", "step-00000008"]


def test_node_scope_a_step_damaged_on_one_node_is_given_up_by_all_and_moved_aside_there_only(tmp_path):
    run_ranks(tmp_path, 4, node_scope(tmp_path), steps=10, name="a")
    victim = tmp_path / "data" / "node1" / "step-00000008" / "rank-3.pkl"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    again = run_ranks(tmp_path, 4, node_scope(tmp_path), steps=5, name="b")
    assert [r["start"] for r in again] == [4] * 4
    assert len(list((tmp_path / "data" / "node1").glob("step-00000008.damaged-*"))) == 1
    assert steps_in(tmp_path / "data" / "node0") == ["step-00000004", "step-00000008"]   # intact there


def test_the_environment_overrides_the_scripts_values(tmp_path):
    ck = tmp_path / "data" / "ck"
    run_ranks(tmp_path, 2, shared(ck, FLEETBOX_CHECKPOINT_EVERY="3", FLEETBOX_CHECKPOINT_KEEP="2"), steps=10,
              every=100, keep=5, name="a")
    assert steps_in(ck) == ["step-00000006", "step-00000009"]   # saved at 3, 6, 9; the newest 2 kept
    fresh = run_ranks(tmp_path, 2, shared(ck, FLEETBOX_RESUME="never", FLEETBOX_ATTEMPT="0"), steps=3, name="b")
    assert [(r["start"], r["rank_state"]) for r in fresh] == [(0, None)] * 2
    later = run_ranks(tmp_path, 2, shared(ck, FLEETBOX_RESUME="never", FLEETBOX_ATTEMPT="1"), steps=10, name="c")
    assert [r["start"] for r in later] == [9, 9]   # `never` holds for the first attempt only
    other = tmp_path / "data" / "other"
    given = run_ranks(tmp_path, 2, shared(other, FLEETBOX_RESUME=str(ck / "step-00000006")), steps=8, name="d")
    assert [r["start"] for r in given] == [6, 6] and [r["rank_state"]["step"] for r in given] == [6, 6]
    assert steps_in(other) == ["step-00000008"] and steps_in(ck) == ["step-00000006", "step-00000009"]
    own = run_ranks(tmp_path, 2, shared(other, FLEETBOX_RESUME=str(ck / "step-00000006")), steps=8, name="e")
    assert [r["start"] for r in own] == [8, 8]   # its own checkpoints come first once it has them
    newest = run_ranks(tmp_path, 2, shared(tmp_path / "data" / "third", FLEETBOX_RESUME=str(ck)), steps=9, name="f")
    assert [r["start"] for r in newest] == [9, 9]   # a checkpoint folder: its newest step


def test_a_stop_asked_of_one_rank_saves_on_every_rank_and_records_continue(tmp_path):
    ck = tmp_path / "data" / "ck"
    stopped = run_ranks(tmp_path, 3, shared(ck), steps=20, every=100, name="a", signal_at={1: 6})
    assert [r["stopped"] for r in stopped] == [6] * 3 and steps_in(ck) == ["step-00000006"]
    assert json.loads((ck / "STATE").read_text())["state"] == "continue"
    again = run_ranks(tmp_path, 3, shared(ck), steps=7, every=100, name="b")
    assert [r["start"] for r in again] == [6] * 3 and [r["stopped"] for r in again] == [None] * 3


def test_a_static_program_saves_its_persistables_and_resumes_with_collectives_made_in_dynamic_mode(tmp_path):
    """The fake's collectives fail if made in static mode or before the helper made its process group."""
    ck = tmp_path / "data" / "ck"
    first = run_ranks(tmp_path, 2, shared(ck), steps=10, name="a", target=static_rank_main)
    assert [r["fc.w"] for r in first] == [[10.0] * 3] * 2
    step8 = ck / "step-00000008"
    model, optimizer = (pickle.loads((step8 / n).read_bytes()) for n in ("model.pdparams", "optimizer.pdopt"))
    assert sorted(model) == ["bn.mean", "fc.w"]   # parameters; BatchNorm's statistics are parameters of a program
    assert sorted(optimizer) == ["LR_Scheduler", "fc.w_velocity", "learning_rate_0"]
    assert optimizer["LR_Scheduler"] == {"last_epoch": 8} and model["fc.w"].tolist() == [8.0] * 3
    assert pickle.loads((step8 / "rank-1.pkl").read_bytes())["buffers"] == {}
    again = run_ranks(tmp_path, 2, shared(ck), steps=12, name="b", target=static_rank_main)
    assert [r["start"] for r in again] == [8, 8] and [r["rank_state"]["rank"] for r in again] == [0, 1]
    assert all((r["fc.w"], r["bn.mean"], r["fc.w_velocity"], r["last_epoch"]) == ([12.0] * 3, [24.0] * 2,
               [6.0] * 3, 12) for r in again)


def test_a_static_program_restored_before_its_startup_program_ran_is_one_line(tmp_path):
    ck = tmp_path / "data" / "ck"
    run_ranks(tmp_path, 1, shared(ck), steps=4, name="a", target=static_rank_main)
    run_ranks(tmp_path, 1, shared(ck, STARTUP="skip"), steps=4, name="b", target=static_rank_main, exits=2)
    assert "run its startup program first (exe.run(startup)), then restore" in said(tmp_path, "b", 0)
