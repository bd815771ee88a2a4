"""ResNet-18 on Flowers-102 with fleet as a static graph, in Paddle's documented static style: the network built
under program_guard, fleet.distributed_optimizer(...).minimize(loss), an Executor running the startup program and
then every step. Momentum with L2 weight decay and the data as in resnet_flowers.py (its dynamic twin): labels
shifted from 1..102 to 0..101, the seeded cache read offline, `--data-file` etc. for other copies.

Checkpoints with fleetbox_checkpoint, given the main program where a dynamic script gives its Layer, and resumes
mid-epoch where it stopped. Several ranks need a GPU build: on CPU, Paddle's static collective startup cannot make
its communicator (c_gen_nccl_id: "comm_id must be generated in paddlepaddle-xpu or paddlepaddle-gpu").
"""
import argparse
import hashlib
import json
import os
import time

import fleetbox_checkpoint  # on every fleetbox container's PYTHONPATH
import fleetbox_metrics
import numpy as np

# fleet's static minimize() is written for the older program, not PIR's (it calls Program.clone(for_test=...),
# which PIR's lacks); Paddle 3 takes this flag as it is imported. Paddle 2.x builds the older one anyway.
os.environ["FLAGS_enable_pir_api"] = "0"
import paddle
import paddle.distributed.fleet as fleet
import paddle.nn.functional as F
from paddle.io import DataLoader, DistributedBatchSampler
from paddle.vision.datasets import Flowers
from paddle.vision.models import resnet18
from paddle.vision.transforms import Compose, Normalize, Resize, Transpose


class ZeroBased(paddle.io.Dataset):
    """Flowers' labels are 1-based (1..102); cross-entropy wants 0..101."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, label = self.ds[i]
        return img.astype("float32"), np.asarray(label, dtype="int64").reshape([1]) - 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    ap.add_argument("--seed", type=int, default=1234, help="initial parameters (the same for every run)")
    ap.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    ap.add_argument("--data-file", default=None)
    ap.add_argument("--label-file", default=None)
    ap.add_argument("--setid-file", default=None)
    args = ap.parse_args()

    paddle.enable_static()
    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    paddle.seed(args.seed)   # the startup program's initializers draw from the global generator
    transform = Compose([Resize((args.image_size, args.image_size)), Transpose(),
                         Normalize(mean=[127.5] * 3, std=[127.5] * 3, data_format="CHW")])
    train = ZeroBased(Flowers(data_file=args.data_file, label_file=args.label_file, setid_file=args.setid_file,
                              mode="train", transform=transform, backend="cv2"))
    sampler = DistributedBatchSampler(train, batch_size=args.batch_size, shuffle=True, drop_last=True)

    main_program, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main_program, startup):
        img = paddle.static.data("img", [None, 3, args.image_size, args.image_size], "float32")
        label = paddle.static.data("label", [None, 1], "int64")
        loss = F.cross_entropy(resnet18(num_classes=102)(img), label)
        momentum = paddle.optimizer.Momentum(learning_rate=args.lr, momentum=0.9,
                                             weight_decay=paddle.regularizer.L2Decay(1e-4))
        fleet.distributed_optimizer(momentum, fleet.DistributedStrategy()).minimize(loss)
    exe = paddle.static.Executor()   # the rank's own device (FLAGS_selected_gpus), or the CPU
    exe.run(startup)

    per_epoch = min(len(sampler), args.max_steps) if args.max_steps else len(sampler)
    ckpt = fleetbox_checkpoint.Checkpoint(every=args.checkpoint_every, keep=2)
    done = ckpt.restore(main_program, momentum)   # after the startup program: it sets what that initialized
    mine = ckpt.rank_state or {}
    seen, losses, classes = mine.get("seen", 0), mine.get("losses", []), set(mine.get("classes", []))
    start = time.perf_counter()
    meter = fleetbox_metrics.Meter()
    for epoch in range(done // per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = max(0, done - epoch * per_epoch)   # resuming mid-epoch: the same batches, from where it stopped
        loader = DataLoader(train, batch_sampler=fleetbox_checkpoint.skip_batches(sampler, skip), return_list=True)
        for step, (x, y) in enumerate(loader, start=skip):
            if step >= per_epoch:
                break
            x, y = np.asarray(x), np.asarray(y)
            assert int(y.min()) >= 0 and int(y.max()) <= 101, "labels must be 0-based"
            (value,) = exe.run(main_program, feed={"img": x, "label": y}, fetch_list=[loss])
            losses.append(float(value))
            meter.step(epoch * per_epoch + step, loss=losses[-1], samples=x.shape[0])
            classes.update(int(c) for c in y.ravel())
            seen += x.shape[0]
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step:4d} loss {losses[-1]:.4f}", flush=True)
            ckpt.step(epoch * per_epoch + step + 1, main_program, momentum,
                      rank_state=lambda: {"seen": seen, "losses": losses, "classes": sorted(classes)})
    ckpt.done()
    scope = paddle.static.global_scope()
    params = sorted(v.name for v in main_program.list_vars() if v.persistable and v.is_parameter)
    print("FLEETBOX-TRAIN " + json.dumps({"script": "resnet_static_flowers", "rank": rank, "world": world,
                                          "steps": len(losses), "resumed_from": done, "params_sha256": hashlib.sha256(
                                              b"".join(np.array(scope.find_var(n).get_tensor()).tobytes()
                                                       for n in params)).hexdigest(),
                                          "last_loss": losses[-1] if losses else None,
                                          "classes": sorted(classes),
                                          "samples_per_s": seen / (time.perf_counter() - start)}), flush=True)


if __name__ == "__main__":
    main()
