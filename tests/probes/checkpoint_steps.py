"""Drives fleetbox_checkpoint in one process (world 1), as a script would: restore, then `--steps` steps of a
tiny model saved every `--every`; prints one JSON line with the step it resumed from and a digest of the
parameters, optimizer and RNG draws, so a resumed run can be compared with an uninterrupted one."""
import argparse
import hashlib
import json

import fleetbox_checkpoint
import numpy as np
import paddle

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--every", type=int, default=2)
ap.add_argument("--keep", type=int, default=3)
ap.add_argument("--total", type=int, default=None)
ap.add_argument("--draw-from", type=int, default=0, help="Paddle's RNG drawn from this step on (dropout after warm-up)")
args = ap.parse_args()

paddle.seed(7)
np.random.seed(7)
model = paddle.nn.Linear(4, 2)
opt = paddle.optimizer.Adam(learning_rate=0.1, parameters=model.parameters())
ckpt = fleetbox_checkpoint.Checkpoint(every=args.every, keep=args.keep, total=args.total)
first = ckpt.restore(model, opt)
draws = (ckpt.rank_state or {}).get("draws", [])
for step in range(first, args.steps):
    x = paddle.to_tensor(np.random.normal(size=(8, 4)).astype("float32"))
    if step >= args.draw_from:
        draws.append(float(paddle.rand([1])))   # Paddle's own RNG: restored too
    loss = (model(x) ** 2).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    ckpt.step(step + 1, model, opt, rank_state={"draws": draws})
ckpt.done()
digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in model.parameters()) + json.dumps(draws).encode())
print("RESULT " + json.dumps({"first": first, "sha256": digest.hexdigest(), "draws": len(draws)}), flush=True)
