"""A training script in Paddle's high-level style (paddle.Model, prepare, fit), as users write them, with
fleetbox's callback: the one line fleetbox asks of such a script is `callbacks=[fleetbox_fit.Callback()]`.

A small classifier on synthetic data (points in 32 dimensions, 10 classes by a fixed random rule: it learns to
over 90% accuracy in a few epochs), any number of ranks; fit shards the data over them. It ends with the test
accuracy of rank 0: `FLEETBOX-FIT {"accuracy": ..., "epochs": ...}`.

To test failure handling, in attempt A only (`--attempt`, default 0; FLEETBOX_ATTEMPT): `--kill-rank R
--kill-epoch E --kill-batch B` kills rank R (SIGKILL, as the kernel's OOM killer would) when it loads that
batch (`--kill-epoch` equal to `--epochs`: once fit has returned); `--hang-rank R --hang-epoch E --hang-batch B`
makes its data loading stop for `--hang-seconds`.

`--visualdl LOGDIR` adds Paddle's own `paddle.callbacks.VisualDL(log_dir=LOGDIR)`, as Paddle's docs show it: in a
fleetbox job a relative LOGDIR lands in the node's log folder, and `invoke board` shows it.
"""
import argparse
import json
import os
import signal
import time

import fleetbox_fit  # on every fleetbox container's PYTHONPATH
import numpy as np
import paddle

DIM, CLASSES = 32, 10


class Points(paddle.io.Dataset):
    """Points whose class is the nearest of 10 fixed centres; the same rule for every seed."""

    def __init__(self, n, seed, trouble=None):
        centres = np.random.default_rng(0).normal(size=(CLASSES, DIM)).astype("float32")
        self.x = np.random.default_rng(seed).normal(size=(n, DIM)).astype("float32")
        self.y = np.argmin(((self.x[:, None, :] - centres[None]) ** 2).sum(-1), axis=1).astype("int64")[:, None]
        self.trouble = trouble or (lambda i: None)

    def __getitem__(self, i):
        self.trouble(i)
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--attempt", type=int, default=0, help="the attempt the failures below happen in")
    for what in ("kill", "hang"):
        ap.add_argument(f"--{what}-rank", type=int, default=-1)
        ap.add_argument(f"--{what}-epoch", type=int, default=0)
        ap.add_argument(f"--{what}-batch", type=int, default=5)
    ap.add_argument("--hang-seconds", type=float, default=600)
    ap.add_argument("--visualdl", default="", help="also log with paddle.callbacks.VisualDL into this folder")
    args = ap.parse_args()

    paddle.seed(1234)
    rank = paddle.distributed.get_rank()
    ranks = max(1, paddle.distributed.get_world_size())
    ours = int(os.environ.get("FLEETBOX_ATTEMPT", "0")) == args.attempt
    per_epoch = args.samples // ranks // args.batch
    loads = {"n": 0}

    def trouble(i):   # counted in samples loaded by this rank: the batch and epoch are where it is
        at = loads["n"] // args.batch
        loads["n"] += 1
        epoch, batch = divmod(at, per_epoch)
        if ours and rank == args.kill_rank and (epoch, batch) == (args.kill_epoch, args.kill_batch):
            print(f"rank {rank}: killed on purpose at epoch {epoch}, batch {batch}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if ours and rank == args.hang_rank and (epoch, batch) == (args.hang_epoch, args.hang_batch) \
                and loads["n"] % args.batch == 1:
            print(f"rank {rank}: data loading stuck on purpose at epoch {epoch}, batch {batch}", flush=True)
            time.sleep(args.hang_seconds)

    net = paddle.nn.Sequential(paddle.nn.Linear(DIM, 64), paddle.nn.ReLU(), paddle.nn.Linear(64, CLASSES))
    model = paddle.Model(net)
    model.prepare(paddle.optimizer.Adam(learning_rate=0.01, parameters=net.parameters()),
                  paddle.nn.CrossEntropyLoss(), paddle.metric.Accuracy())
    model.fit(Points(args.samples, seed=1, trouble=trouble), epochs=args.epochs, batch_size=args.batch,
              shuffle=True, drop_last=True, verbose=0, callbacks=[fleetbox_fit.Callback()] + (
                  [paddle.callbacks.VisualDL(log_dir=args.visualdl)] if args.visualdl else []))
    if ours and rank == args.kill_rank and args.kill_epoch == args.epochs:
        print(f"rank {rank}: killed on purpose after fit", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    result = model.evaluate(Points(1024, seed=2), batch_size=256, verbose=0)
    if rank == 0:
        print("FLEETBOX-FIT " + json.dumps({"accuracy": float(result["acc"]), "epochs": args.epochs}), flush=True)


if __name__ == "__main__":
    main()
