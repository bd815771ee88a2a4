"""fleetbox_checkpoint with several ranks for real: each rank is its own process (forked), running the helper
against one folder (or one per node), with a stand-in `paddle` whose collectives really go between the
processes (a barrier and a shared dict: no rank sees a result before every rank contributed). What is
checked: the ranks agree on one step, a step damaged on some ranks only is given up by all, the replicated
state is hashed by its writer only and nothing is read back at a save, node scope, and the environment's
overrides. Real Paddle with real ranks: tests/integration (test_checkpoints, test_train)."""
import io
import itertools
import json
import multiprocessing
import os
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fleetbox.incontainer import fleetbox_checkpoint as fc

CTX = multiprocessing.get_context("fork")


def fake_paddle(world: int, rank: int, barrier, box) -> None:
    """`paddle` and `paddle.distributed` as the helper uses them, for this rank, in sys.modules."""
    paddle, dist = types.ModuleType("paddle"), types.ModuleType("paddle.distributed")
    calls = itertools.count()

    def gather(obj) -> list:
        n = next(calls)   # every rank makes the same collectives in the same order
        box[(n, rank)] = obj
        barrier.wait(timeout=30)
        return [box[(n, r)] for r in range(world)]

    class Tensor:
        def __init__(self, values):
            self.values = list(values)

        def numpy(self):
            return np.array(self.values)

    def all_reduce(t, op):
        t.values = [(min if op == "min" else max)(gather(t.values[0]))]

    def save(obj, where):
        if isinstance(where, io.BytesIO):
            pickle.dump(obj, where)
        else:
            with open(where, "wb") as f:
                pickle.dump(obj, f)

    def load(path):
        with open(path, "rb") as f:
            return pickle.load(f)

    dist.get_rank, dist.get_world_size = (lambda: rank), (lambda: world)
    dist.barrier = lambda: gather(None) and None
    dist.ReduceOp = types.SimpleNamespace(MIN="min", MAX="max")
    dist.all_reduce = all_reduce
    dist.all_gather_object = lambda out, obj: out.extend(gather(obj))
    paddle.distributed, paddle.to_tensor = dist, (lambda values, dtype=None: Tensor(values))
    paddle.save, paddle.load = save, load
    paddle.get_rng_state, paddle.set_rng_state = (lambda: [rank]), (lambda state: None)
    sys.modules["paddle"], sys.modules["paddle.distributed"] = paddle, dist


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


def rank_main(world, rank, barrier, box, env, steps, every, keep, out):
    """One rank: restore, train `steps` steps saving every `every`; what it saw goes to `out` as JSON."""
    sys.stdout = open(f"{out}.log", "w", buffering=1)
    os.environ.update(env)
    fake_paddle(world, rank, barrier, box)
    hashed = []
    real_sha = fc._sha256
    fc._sha256 = lambda path: (hashed.append(os.path.basename(path)), real_sha(path))[1]
    model, opt = Model(rank), Optimizer()
    ckpt = fc.Checkpoint(every=every, keep=keep)
    start = ckpt.restore(model, opt)
    at_restore, hashed[:] = list(hashed), []
    for step in range(start, steps):
        model.w += 1
        opt.moments += 0.5
        model.buffer.value += 1
        ckpt.step(step + 1, model, opt, rank_state={"rank": rank, "step": step + 1})
    Path(out).write_text(json.dumps({"start": start, "rank_state": ckpt.rank_state, "w": model.w.tolist(),
                                     "moments": opt.moments.tolist(), "buffer": model.buffer.value.tolist(),
                                     "hashed_at_restore": at_restore, "hashed_at_save": hashed}))


def run_ranks(tmp_path, world, env_of, steps, every=4, keep=3, name="run") -> list[dict]:
    """Every rank's process, to the end; a rank that fails or hangs fails the test (every process ended)."""
    manager = CTX.Manager()
    barrier, box = CTX.Barrier(world), manager.dict()
    outs = [tmp_path / f"{name}-rank{r}.json" for r in range(world)]
    procs = [CTX.Process(target=rank_main, args=(world, r, barrier, box, env_of(r), steps, every, keep, str(outs[r])))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        stuck = [r for r, p in enumerate(procs) if p.exitcode is None]
        assert not stuck, f"ranks {stuck} did not end within 60 s"
        failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        assert not failed, f"ranks failed {failed}: " + " | ".join(
            Path(f"{outs[r]}.log").read_text()[-500:] for r in failed)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        manager.shutdown()
    return [json.loads(o.read_text()) for o in outs]


def said(tmp_path, name, rank) -> str:
    return (tmp_path / f"{name}-rank{rank}.json.log").read_text()


def shared(folder, **extra):
    return lambda r: {"FLEETBOX_CHECKPOINT_DIR": str(folder), "PADDLE_LOCAL_RANK": "0", "FLEETBOX_NODE": str(r),
                      **extra}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_save_once_and_resume_together_each_with_its_own_state(tmp_path, world):
    ck = tmp_path / "ck"
    first = run_ranks(tmp_path, world, shared(ck), steps=10, name="a")
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-00000004", "step-00000008"]
    listed = json.loads((ck / "step-00000008" / "COMPLETE").read_text())["files"]
    assert sorted(listed) == ["model.pdparams", "optimizer.pdopt"] + [f"rank-{r}.pkl" for r in range(world)]
    for name, (size, digest) in listed.items():   # what each rank wrote, as it wrote it
        data = (ck / "step-00000008" / name).read_bytes()
        assert size == len(data) and digest == __import__("hashlib").sha256(data).hexdigest()
    assert all(r["hashed_at_save"] == [] for r in first)   # nothing read back at a save
    again = run_ranks(tmp_path, world, shared(ck), steps=12, name="b")
    assert [r["start"] for r in again] == [8] * world
    assert [r["rank_state"] for r in again] == [{"rank": r, "step": 8} for r in range(world)]
    assert all(r["w"] == [12.0] * 3 and r["moments"] == [6.0] * 3 for r in again)   # 8 restored + 4
    assert [r["buffer"] for r in again] == [[r + 12.0] * 2 for r in range(world)]   # each rank's own, restored
    # the replicated state is checked once, by its writer; each rank checks its own file only
    assert sorted(again[0]["hashed_at_restore"]) == ["model.pdparams", "optimizer.pdopt", "rank-0.pkl"]
    assert [r["hashed_at_restore"] for r in again[1:]] == [[f"rank-{r}.pkl"] for r in range(1, world)]


@pytest.mark.parametrize("damage", ["flipped", "missing"])
def test_a_step_damaged_on_one_rank_only_is_given_up_by_every_rank(tmp_path, damage):
    ck = tmp_path / "ck"
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
    assert not (ck / "step-00000008").exists() and len(list(ck.glob("step-00000008.damaged-*"))) == 1
    why = "is missing" if damage == "missing" else "is damaged (size or sha256 differs from COMPLETE)"
    assert f"rank 1: step 8 ({ck}/step-00000008) is unusable: rank-1.pkl {why}" in said(tmp_path, "b", 1)
    assert "unusable:" not in said(tmp_path, "b", 0)   # rank 0's own files were fine: it followed the agreement


def test_damaged_replicated_state_is_found_by_its_writer_and_every_rank_falls_back(tmp_path):
    ck = tmp_path / "ck"
    run_ranks(tmp_path, 3, shared(ck), steps=10, name="a")
    model = ck / "step-00000008" / "model.pdparams"
    model.write_bytes(model.read_bytes()[:-1] + b"\0")
    again = run_ranks(tmp_path, 3, shared(ck), steps=5, name="b")
    assert [r["start"] for r in again] == [4, 4, 4] and len(list(ck.glob("step-00000008.damaged-*"))) == 1
    assert "model.pdparams is damaged" in said(tmp_path, "b", 0)
    assert [r["hashed_at_restore"].count("model.pdparams") for r in again] == [2, 0, 0]   # step 8, then step 4


def node_scope(tmp_path, ppn=2):
    return lambda r: {"FLEETBOX_CHECKPOINT_DIR": str(tmp_path / f"node{r // ppn}"), "FLEETBOX_CHECKPOINT_SCOPE":
                      "node", "FLEETBOX_NODE": str(r // ppn), "PADDLE_LOCAL_RANK": str(r % ppn)}


def test_node_scope_gives_each_node_its_own_writer_and_the_ranks_agree_on_a_step_every_node_has(tmp_path):
    run_ranks(tmp_path, 4, node_scope(tmp_path), steps=10, name="a")
    for node, ranks in ((0, [0, 1]), (1, [2, 3])):
        listed = json.loads((tmp_path / f"node{node}" / "step-00000008" / "COMPLETE").read_text())["files"]
        assert sorted(listed) == ["model.pdparams", "optimizer.pdopt"] + [f"rank-{r}.pkl" for r in ranks]
    import shutil
    shutil.rmtree(tmp_path / "node1" / "step-00000008")   # node 1 lacks the newest step
    again = run_ranks(tmp_path, 4, node_scope(tmp_path), steps=5, name="b")
    assert [r["start"] for r in again] == [4] * 4 and [r["rank_state"]["rank"] for r in again] == [0, 1, 2, 3]
    # each node's writer (its first rank) checks its own folder's replicated state
    assert [r["hashed_at_restore"].count("model.pdparams") for r in again] == [1, 0, 1, 0]


def test_the_environment_overrides_the_scripts_values(tmp_path):
    ck = tmp_path / "ck"
    run_ranks(tmp_path, 2, shared(ck, FLEETBOX_CHECKPOINT_EVERY="3", FLEETBOX_CHECKPOINT_KEEP="2"), steps=10,
              every=100, keep=5, name="a")
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) == ["step-00000006", "step-00000009"]
    fresh = run_ranks(tmp_path, 2, shared(ck, FLEETBOX_RESUME="never", FLEETBOX_ATTEMPT="0"), steps=2, name="b")
    assert [r["start"] for r in fresh] == [0, 0]
    (ck / "step-00000002").exists() and __import__("shutil").rmtree(ck / "step-00000002")   # b's own save
    later = run_ranks(tmp_path, 2, shared(ck, FLEETBOX_RESUME="never", FLEETBOX_ATTEMPT="1"), steps=10, name="c")
    assert [r["start"] for r in later] == [9, 9]   # `never` holds for the first attempt only
    other = tmp_path / "other"
    given = run_ranks(tmp_path, 2, shared(other, FLEETBOX_RESUME=str(ck / "step-00000006")), steps=8, name="d")
    assert [r["start"] for r in given] == [6, 6] and [r["rank_state"]["step"] for r in given] == [6, 6]
