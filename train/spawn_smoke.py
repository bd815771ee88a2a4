"""The smoke job (smoke.py) started the way Paddle recommends on one machine: its training function wrapped in
`paddle.distributed.spawn`, nothing else changed. fleetbox sees the call and runs this script without Paddle's
launcher, on one node, with its two ranks' logs, metrics, checkpoints and hang detection as a launched job's:
`invoke train --script train/spawn_smoke.py` (smoke.py's options pass through, e.g. --args "--steps 40")."""
import paddle.distributed as dist
from smoke import main

if __name__ == "__main__":
    dist.spawn(main, nprocs=2)
