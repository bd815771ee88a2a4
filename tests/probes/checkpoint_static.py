"""Drives fleetbox_checkpoint with a static-graph program, as a static script would: build the program, run its
startup program, restore, then `--steps` steps saved every `--every`; prints one JSON line with the step it
resumed from and a digest of every persistable's final value (parameters, the optimizer's accumulators, the
learning rate) and the losses, so a resumed run can be compared with an uninterrupted one.
FLAGS_enable_pir_api=0 in the environment builds the older (non-PIR) program.

With several ranks (under Paddle's launcher), each trains on its own data and `--average` makes them one model:
after every step the parameters are averaged over the ranks (an all-reduce in dynamic mode, over Gloo), which
with plain SGD is data parallelism. Paddle's own static collective (fleet's minimize) cannot make its
communicator on CPU, so this is how several static ranks run here; every rank's state stays the same, as the
checkpoint's replicated state assumes, but BatchNorm's statistics (`--batchnorm`), which are each rank's own.
`--kill-rank R --kill-at N` kills rank R after step N, in attempt 0 only."""
import argparse
import hashlib
import json
import os
import signal

import fleetbox_checkpoint
import numpy as np
import paddle

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--every", type=int, default=2)
ap.add_argument("--keep", type=int, default=3)
ap.add_argument("--optimizer", choices=["adam", "momentum", "sgd"], default="adam")
ap.add_argument("--average", action="store_true", help="average the parameters over the ranks after every step")
ap.add_argument("--kill-rank", type=int, default=0)
ap.add_argument("--dropout", type=float, default=0.0, help="drawn from Paddle's generator at every step")
ap.add_argument("--batchnorm", action="store_true", help="BatchNorm: statistics of each rank's own data")
ap.add_argument("--program-seed", type=int, default=0, help="main.random_seed (0: the global generator's draws)")
ap.add_argument("--kill-at", type=int, default=0, help="SIGKILL itself right after this step (a node lost)")
args = ap.parse_args()

rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))
if int(os.environ.get("FLEETBOX_ATTEMPT", "0")) > 0 or rank != args.kill_rank:
    args.kill_at = 0
paddle.enable_static()
paddle.seed(7)
np.random.seed(7 + rank)   # each rank its own data
main, startup = paddle.static.Program(), paddle.static.Program()
main.random_seed = startup.random_seed = args.program_seed
with paddle.static.program_guard(main, startup):
    x = paddle.static.data("x", [None, 4], "float32")
    h = paddle.nn.functional.relu(paddle.static.nn.fc(x, 8))
    if args.batchnorm:
        h = paddle.nn.BatchNorm1D(8)(h)
    if args.dropout:
        h = paddle.nn.functional.dropout(h, args.dropout)
    loss = (paddle.static.nn.fc(h, 2) ** 2).mean()
    lr = paddle.optimizer.lr.StepDecay(0.1, step_size=3, gamma=0.5)   # the learning rate changes mid-run
    opt = (paddle.optimizer.Adam(learning_rate=lr) if args.optimizer == "adam" else
           paddle.optimizer.Momentum(learning_rate=lr, momentum=0.9) if args.optimizer == "momentum" else
           paddle.optimizer.SGD(learning_rate=lr))
    opt.minimize(loss)
exe = paddle.static.Executor(paddle.CPUPlace())
exe.run(startup)
scope = paddle.static.global_scope()
params = sorted(v.name for v in main.list_vars()   # trained: BatchNorm's statistics stay each rank's
                if v.persistable and getattr(v, "is_parameter", False) and getattr(v, "trainable", True))


def average() -> None:
    """Every parameter's mean over the ranks, set back in the scope (the helper made the process group)."""
    import paddle.distributed as dist
    with paddle.base.dygraph.guard():
        world = dist.get_world_size()
        if world == 1:   # the mean of one (a job gone on alone, --min-nodes): no process group was made
            return
        for name in params:
            t = scope.find_var(name).get_tensor()
            v = paddle.to_tensor(np.array(t))
            dist.all_reduce(v)
            t.set((v.numpy() / world).astype("float32"), paddle.CPUPlace())


ckpt = fleetbox_checkpoint.Checkpoint(every=args.every, keep=args.keep)
first = ckpt.restore(main, opt)
losses = (ckpt.rank_state or {}).get("losses", [])
for step in range(first, args.steps):
    (value,) = exe.run(main, feed={"x": np.random.normal(size=(8, 4)).astype("float32")}, fetch_list=[loss])
    losses.append(float(value))
    if args.average:
        average()
    lr.step()
    ckpt.step(step + 1, main, opt, rank_state={"losses": losses})
    if step + 1 == args.kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
ckpt.done()
names = sorted(v.name for v in main.list_vars() if v.persistable)
digest = hashlib.sha256(b"".join(name.encode() + np.array(scope.find_var(name).get_tensor()).tobytes()
                                 for name in names) + json.dumps(losses).encode())
same = hashlib.sha256(b"".join(np.array(scope.find_var(n).get_tensor()).tobytes() for n in params))   # all ranks'
print("RESULT " + json.dumps({"rank": rank, "first": first, "sha256": digest.hexdigest(), "params": same.hexdigest(),
                              "persistables": len(names), "lr": lr(), "losses": len(losses)}), flush=True)
