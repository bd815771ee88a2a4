"""LeNet on MNIST with fleet (distributed optimizer and model, DistributedBatchSampler), offline.

Checkpoints with fleetbox_checkpoint (every `--checkpoint-every` steps, and when told to stop) and resumes
mid-epoch where it stopped. Reads MNIST from Paddle's cache (~/.cache/paddle/dataset/mnist/, seeded with
`invoke cache --datasets mnist`);
`--train-images` etc. point at other copies of the same idx.gz files instead (Paddle skips its MD5 check then).
"""
import argparse
import hashlib
import json
import time

import fleetbox_checkpoint  # on every fleetbox container's PYTHONPATH
import fleetbox_metrics
import paddle
import paddle.distributed.fleet as fleet
import paddle.nn.functional as F
from paddle.io import DataLoader, DistributedBatchSampler
from paddle.vision.datasets import MNIST
from paddle.vision.models import LeNet
from paddle.vision.transforms import Normalize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=64, help="per process")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)")
    ap.add_argument("--seed", type=int, default=1234, help="initial parameters (the same for every run)")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    for split in ("train", "test"):
        ap.add_argument(f"--{split}-images", default=None)
        ap.add_argument(f"--{split}-labels", default=None)
    args = ap.parse_args()

    fleet.init(is_collective=True)
    rank, world = fleet.worker_index(), fleet.worker_num()
    paddle.seed(args.seed)
    transform = Normalize(mean=[127.5], std=[127.5], data_format="CHW")
    train = MNIST(image_path=args.train_images, label_path=args.train_labels, mode="train", transform=transform,
                  backend="cv2")
    test = MNIST(image_path=args.test_images, label_path=args.test_labels, mode="test", transform=transform,
                 backend="cv2")
    sampler = DistributedBatchSampler(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    loader = DataLoader(train, batch_sampler=sampler)

    model = fleet.distributed_model(LeNet())
    momentum = paddle.optimizer.Momentum(learning_rate=args.lr, momentum=0.9, parameters=model.parameters())
    opt = fleet.distributed_optimizer(momentum)
    per_epoch = min(len(sampler), args.max_steps) if args.max_steps else len(sampler)
    ckpt = fleetbox_checkpoint.Checkpoint(every=args.checkpoint_every, keep=2)
    done = ckpt.restore(model, momentum)   # steps already trained, over all epochs
    mine = ckpt.rank_state or {}
    seen, losses, start = mine.get("seen", 0), mine.get("losses", []), time.perf_counter()
    meter = fleetbox_metrics.Meter()
    for epoch in range(done // per_epoch, args.epochs):
        sampler.set_epoch(epoch)
        skip = max(0, done - epoch * per_epoch)   # resuming mid-epoch: the same batches, from where it stopped
        model.train()
        loader = DataLoader(train, batch_sampler=fleetbox_checkpoint.skip_batches(sampler, skip))
        for step, (img, label) in enumerate(loader, start=skip):
            if step >= per_epoch:
                break
            img = img.reshape([-1, 1, 28, 28]).astype("float32")
            loss = F.cross_entropy(model(img), label.astype("int64"))
            loss.backward()
            opt.step()
            opt.clear_grad()
            seen += img.shape[0]
            losses.append(float(loss))
            meter.step(epoch * per_epoch + step, loss=losses[-1], samples=img.shape[0])
            if rank == 0 and step % 50 == 0:
                print(f"epoch {epoch} step {step:5d} loss {losses[-1]:.4f}", flush=True)
            ckpt.step(epoch * per_epoch + step + 1, model, momentum,
                      rank_state=lambda: {"seen": seen, "losses": losses})
    elapsed = time.perf_counter() - start
    ckpt.done()

    model.eval()
    correct = total = 0
    with paddle.no_grad():
        for img, label in DataLoader(test, batch_size=256):
            pred = model(img.reshape([-1, 1, 28, 28]).astype("float32")).argmax(axis=1)
            correct += int((pred == label.reshape([-1]).astype("int64")).sum())
            total += label.shape[0]
    print("FLEETBOX-TRAIN " + json.dumps({"script": "lenet_mnist", "rank": rank, "world": world,
                                          "steps": len(losses), "resumed_from": done, "params_sha256": hashlib.sha256(
                                              b"".join(p.numpy().tobytes() for p in model.parameters())).hexdigest(),
                                          "last_loss": losses[-1] if losses else None,
                                          "test_accuracy": correct / max(total, 1),
                                          "samples_per_s": seen / max(elapsed, 1e-9)}), flush=True)


if __name__ == "__main__":
    main()
