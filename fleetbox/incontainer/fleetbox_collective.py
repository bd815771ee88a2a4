"""`invoke doctor`'s collective benchmark: all-reduce from 1 KB up to --max-bytes, doubling, run by Paddle's own
launcher like any job (Gloo on CPU, NCCL/RCCL on GPU/DCU), measured the way nccl-tests' all_reduce_perf does:
in place, float32 sum, time per operation averaged over timed iterations after warm-up, the slowest rank's
time counted; algbw = size / time, busbw = algbw * 2(n-1)/n. Every result is checked (#wrong counts
elements of one more all-reduce that are not the exact sum). Rank 0 prints one line `FLEETBOX-COLLECTIVE <json>`.
"""
import argparse
import json
import os
import time

import numpy as np
import paddle
import paddle.distributed as dist

MARK = "FLEETBOX-COLLECTIVE "


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-bytes", type=int, default=512 << 20, help="bytes all-reduced per size, at most")
    a = p.parse_args()
    dist.init_parallel_env()
    world, rank = dist.get_world_size(), dist.get_rank()
    # from the devices this rank sees, not from how Paddle was built: a GPU build given no GPU runs on Gloo
    backend = "nccl" if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 else "gloo"
    if backend != "gloo":
        paddle.set_device(f"gpu:{dist.ParallelEnv().device_id}")
    rows, size = [], a.min_bytes
    while size <= a.max_bytes:
        count = size // 4
        iters = max(5, min(50, a.budget_bytes // size))
        x = paddle.full([count], float(rank + 1), dtype="float32")
        for _ in range(a.warmup):
            dist.all_reduce(x)
        x = paddle.full([count], float(rank + 1), dtype="float32")
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if backend != "gloo":
            paddle.device.synchronize()
        took = paddle.to_tensor([(time.perf_counter() - t0) / iters], dtype="float64")
        dist.all_reduce(took, op=dist.ReduceOp.MAX)   # the slowest rank's time is the operation's time
        y = paddle.full([count], float(rank + 1), dtype="float32")   # one more, checked: 1 + 2 + ... + world
        dist.all_reduce(y)
        wrong = int(np.count_nonzero(y.numpy() != float(world * (world + 1) // 2)))
        secs = float(took.numpy()[0])
        algbw = size / secs / 1e9
        rows.append({"size": size, "count": count, "iters": iters, "time_us": secs * 1e6, "algbw": algbw,
                     "busbw": algbw * 2 * (world - 1) / world, "wrong": wrong})
        size *= 2
    if rank == 0:
        print(MARK + json.dumps({"backend": backend, "world": world, "nodes": int(os.environ.get("PADDLE_NNODES", 1)),
                                 "rows": rows}), flush=True)


if __name__ == "__main__":
    main()
