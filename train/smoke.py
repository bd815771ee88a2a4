"""Default fleetbox smoke job: a small model on synthetic data, a few seconds on CPU, any number of ranks.

Checks that the loss falls and that every rank ends with identical parameters (an all-gather of a
parameter checksum); prints samples/s; exits non-zero otherwise. To test failure handling:
`--fail-rank R --fail-step S --fail-code C` makes rank R exit with code C at step S (S = -1: before joining
the group; `--fail-attempt A`: only in the job's attempt A, see FLEETBOX_ATTEMPT), and `--hang-rank R` makes
rank R sleep for `--hang-seconds` before joining, like a stuck node that never notices a peer died, or with
`--hang-step S` at step S, in a data loader that never returns (`--hang-attempt A`: only in attempt A). For hang
detection's other cases: `--slow-save S` makes every checkpoint write take S seconds longer, and `--phase-step
S --phase-seconds X` runs a declared long phase (fleetbox_progress.phase, "evaluation") of X seconds at step S.
`--slow-rank R --slow-ms X` makes rank R a straggler: X ms more of its own work every step, before the
all-reduce its peers then wait in.

It checkpoints with fleetbox_checkpoint (every `--checkpoint-every` steps, and when told to stop) and resumes
from the newest checkpoint, its per-rank data RNG and loss history included, so a resumed run is judged as a
whole and ends with the same parameters, bit for bit, as one that never stopped (`params_sha256`).

It all-reduces its gradients itself (DataParallel's automatic all-reduce, which overlaps the backward pass and
so cannot be timed apart, is turned off with `no_sync`) and reports the time each step spent in it as the
metric `comm_seconds`, waiting for slower ranks included: the communication share of `invoke scale`.
"""
import argparse
import hashlib
import json
import os
import sys
import time

import fleetbox_checkpoint  # on every fleetbox container's PYTHONPATH
import fleetbox_metrics
import fleetbox_progress
import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.fleet.utils.hybrid_parallel_util import fused_allreduce_gradients


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-step", type=int, default=10)
    ap.add_argument("--fail-code", type=int, default=3)
    ap.add_argument("--fail-attempt", type=int, default=-1, help="fail only in this attempt (-1: in every one)")
    ap.add_argument("--checkpoint-every", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=20, help="rank 0 prints the loss every this many steps")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="slow each step down (for interrupt tests)")
    ap.add_argument("--hang-rank", type=int, default=-1)
    ap.add_argument("--hang-seconds", type=float, default=300)
    ap.add_argument("--hang-step", type=int, default=-1, help="hang at this step (-1: before joining the group)")
    ap.add_argument("--hang-attempt", type=int, default=-1, help="hang only in this attempt (-1: in every one)")
    ap.add_argument("--slow-save", type=float, default=0.0, help="seconds added to every checkpoint write")
    ap.add_argument("--phase-step", type=int, default=-1, help="run a declared long phase at this step")
    ap.add_argument("--phase-seconds", type=float, default=0.0)
    ap.add_argument("--slow-rank", type=int, default=-1, help="a straggler: this rank works longer every step")
    ap.add_argument("--slow-ms", type=float, default=50.0)
    ap.add_argument("--tag", nargs="*", default=[], help="words echoed back in the report (to check what arrived)")
    ap.add_argument("--require-env", default="", help="stop at once unless this variable is set (e.g. by a module)")
    args = ap.parse_args()

    rank = int(os.environ.get("PADDLE_TRAINER_ID", "0"))   # set by paddle.distributed.launch
    if args.require_env and args.require_env not in os.environ:
        print(f"rank {rank}: {args.require_env} is not set (the module that sets it was not loaded)", flush=True)
        sys.exit(3)
    attempt = int(os.environ.get("FLEETBOX_ATTEMPT", "0"))
    if args.fail_attempt >= 0 and attempt != args.fail_attempt:
        args.fail_rank = -1
    if args.hang_attempt >= 0 and attempt != args.hang_attempt:
        args.hang_rank = -1
    if rank == args.fail_rank and args.fail_step < 0:
        print(f"rank {rank}: failing on purpose before joining with exit code {args.fail_code}", flush=True)
        sys.exit(args.fail_code)
    if rank == args.hang_rank and args.hang_step < 0:
        print(f"rank {rank}: hanging on purpose for {args.hang_seconds:.0f} s", flush=True)
        time.sleep(args.hang_seconds)
    if args.slow_save:   # a slow file system under the checkpoint helper's own writes
        real_save = paddle.save
        paddle.save = lambda *a, **kw: (time.sleep(args.slow_save), real_save(*a, **kw))[1]

    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    paddle.seed(1234)                        # same initial parameters on every rank
    rng = np.random.default_rng(100 + rank)  # a different data shard on every rank
    w_true = np.linspace(-1, 1, 16).astype("float32")[:, None]

    model = paddle.DataParallel(paddle.nn.Sequential(
        paddle.nn.Linear(16, 64), paddle.nn.ReLU(), paddle.nn.Linear(64, 1)))
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    ckpt = fleetbox_checkpoint.Checkpoint(every=args.checkpoint_every, keep=3, total=args.steps)
    first = ckpt.restore(model, opt)
    losses = []
    if ckpt.rank_state:   # this rank's data stream and loss history, where they were
        rng.bit_generator.state = ckpt.rank_state["rng"]
        losses = ckpt.rank_state["losses"]
    start = time.perf_counter()
    meter = fleetbox_metrics.Meter()
    for step in range(first, args.steps):
        if rank == args.hang_rank and step == args.hang_step:
            print(f"rank {rank}: hanging on purpose at step {step} for {args.hang_seconds:.0f} s", flush=True)
            load_batch_that_never_returns(args.hang_seconds)
        if step == args.phase_step:
            with fleetbox_progress.phase("evaluation"):
                time.sleep(args.phase_seconds)
        if rank == args.fail_rank and step >= args.fail_step:   # >=: an attempt may resume past it
            print(f"rank {rank}: failing on purpose at step {step} with exit code {args.fail_code}", flush=True)
            sys.exit(args.fail_code)
        x = rng.normal(size=(args.batch, 16)).astype("float32")
        y = x @ w_true + 0.01 * rng.normal(size=(args.batch, 1)).astype("float32")
        with model.no_sync():   # the gradients' all-reduce is ours, below, so that it can be timed
            loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
            loss.backward()
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1000)   # its own work: the others wait for it in the all-reduce below
        comm = allreduce_gradients(model, world)
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        meter.step(step, loss=losses[-1], samples=args.batch, comm_seconds=comm)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if rank == 0 and (step % args.log_every == 0 or step == first):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
        ckpt.step(step + 1, model, opt, rank_state=lambda: {"rng": rng.bit_generator.state, "losses": losses})
    elapsed = time.perf_counter() - start
    ckpt.done()

    checksum = paddle.to_tensor([float(sum(p.sum() for p in model.parameters()))], dtype="float64")
    total = paddle.to_tensor([meter.rate()], dtype="float64")   # each rank's, as its metrics lines add up
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in model.parameters())).hexdigest()
    gathered, digests = [], []
    if world > 1:   # with one rank there is no global group to gather over
        dist.all_gather(gathered, checksum)
        dist.all_gather_object(digests, digest)
        dist.all_reduce(total)
    else:
        gathered, digests = [checksum], [digest]
    sums = [float(t) for t in gathered]
    report = {"rank": rank, "world": world, "first_loss": np.mean(losses[:5]), "last_loss": np.mean(losses[-5:]),
              "checksums": sums, "params_sha256": digest, "resumed_from": first, "steps": len(losses),
              "samples_per_s": float(total), "seconds": elapsed, "tag": args.tag,
              "env_tag": os.environ.get("FLEETBOX_TAG"), "prefix": sys.prefix}
    ok_loss = report["last_loss"] < 0.5 * report["first_loss"]
    ok_sync = max(sums) - min(sums) <= 1e-6 * max(1.0, abs(sums[0])) and len(set(digests)) == 1
    report.update(loss_falls=bool(ok_loss), params_identical=bool(ok_sync), world_ok=len(sums) == world)
    ok_steps = len(losses) == args.steps   # the whole run's history, every attempt's steps once
    report.update(whole_run=ok_steps)
    print("FLEETBOX-SMOKE " + json.dumps(report), flush=True)
    sys.exit(0 if ok_loss and ok_sync and ok_steps and len(sums) == world else 1)


def load_batch_that_never_returns(seconds: float) -> None:
    """A stuck data loader (a dead file system, a worker that never answers): what hang detection must name."""
    time.sleep(seconds)


def allreduce_gradients(model, world) -> float:
    """Average the gradients over every rank, as DataParallel would (one fused all-reduce); the seconds it took."""
    if world == 1:
        return 0.0
    sync = paddle.device.synchronize if paddle.device.get_device().startswith(("gpu", "xpu")) else lambda: None
    sync()   # the backward pass has finished, so only the all-reduce is timed
    start = time.perf_counter()
    try:
        fused_allreduce_gradients(list(model.parameters()), None)
    except Exception as e:   # a peer is gone: end as DataParallel's own all-reduce does (an abort), so that
        print(f"gradient all-reduce failed: {e}"[:500], flush=True)   # a peer is not taken for the culprit
        os.abort()
    sync()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
