"""ResNet-50 on Flowers-102 with fleet, as in Paddle's own example: Momentum with L2 weight decay.

Checkpoints with fleetbox_checkpoint and resumes mid-epoch where it stopped.
Flowers labels are 1..102, so they are shifted to 0..101 for the classifier. Reads the seeded cache
(~/.cache/paddle/dataset/flowers/, from `invoke cache --datasets flowers`, which also unpacks the images so
a read-only cache works); `--data-file` etc. point at other copies (Paddle skips its MD5 check then).
"""
import argparse
import hashlib
import json
import time

import fleetbox_checkpoint  # on every fleetbox container's PYTHONPATH
import fleetbox_metrics
import numpy as np
import paddle
import paddle.distributed.fleet as fleet
import paddle.nn.functional as F
from paddle.io import DataLoader, DistributedBatchSampler
from paddle.vision.datasets import Flowers
from paddle.vision.models import resnet50
from paddle.vision.transforms import Compose, Normalize, Resize, Transpose


class ZeroBased(paddle.io.Dataset):
    """Flowers' labels are 1-based (1..102); cross-entropy wants 0..101."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        img, label = self.ds[i]
        return img, np.asarray(label, dtype="int64") - 1


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

    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    paddle.seed(args.seed)
    transform = Compose([Resize((args.image_size, args.image_size)), Transpose(),
                         Normalize(mean=[127.5] * 3, std=[127.5] * 3, data_format="CHW")])
    train = ZeroBased(Flowers(data_file=args.data_file, label_file=args.label_file, setid_file=args.setid_file,
                              mode="train", transform=transform, backend="cv2"))
    sampler = DistributedBatchSampler(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_sampler=sampler)

    model = fleet.distributed_model(resnet50(num_classes=102))
    momentum = paddle.optimizer.Momentum(learning_rate=args.lr, momentum=0.9, parameters=model.parameters(),
                                         weight_decay=paddle.regularizer.L2Decay(1e-4))
    opt = fleet.distributed_optimizer(momentum)
    per_epoch = min(len(sampler), args.max_steps) if args.max_steps else len(sampler)
    ckpt = fleetbox_checkpoint.Checkpoint(every=args.checkpoint_every, keep=2)
    done = ckpt.restore(model, momentum)   # steps already trained, over all epochs
    mine = ckpt.rank_state or {}
    seen, losses, classes = mine.get("seen", 0), mine.get("losses", []), set(mine.get("classes", []))
    start = time.perf_counter()
    meter = fleetbox_metrics.Meter()
    for epoch in range(done // per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = max(0, done - epoch * per_epoch)   # resuming mid-epoch: the same batches, from where it stopped
        loader = DataLoader(train, batch_sampler=fleetbox_checkpoint.skip_batches(sampler, skip))
        for step, (img, label) in enumerate(loader, start=skip):
            if step >= per_epoch:
                break
            assert int(label.min()) >= 0 and int(label.max()) <= 101, "labels must be 0-based"
            loss = F.cross_entropy(model(img.astype("float32")), label.reshape([-1, 1]))
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(float(loss))
            meter.step(epoch * per_epoch + step, loss=losses[-1], samples=img.shape[0])
            classes.update(int(c) for c in label.numpy().ravel())
            seen += img.shape[0]
            if rank == 0 and step % 10 == 0:
                print(f"epoch {epoch} step {step:4d} loss {losses[-1]:.4f}", flush=True)
            ckpt.step(epoch * per_epoch + step + 1, model, momentum,
                      rank_state=lambda: {"seen": seen, "losses": losses, "classes": sorted(classes)})
    ckpt.done()
    print("FLEETBOX-TRAIN " + json.dumps({"script": "resnet_flowers", "rank": rank, "world": world,
                                          "steps": len(losses), "resumed_from": done, "params_sha256": hashlib.sha256(
                                              b"".join(p.numpy().tobytes() for p in model.parameters())).hexdigest(),
                                          "last_loss": losses[-1] if losses else None,
                                          "classes": sorted(classes),
                                          "samples_per_s": seen / (time.perf_counter() - start)}), flush=True)


if __name__ == "__main__":
    main()
