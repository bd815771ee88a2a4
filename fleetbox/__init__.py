"""fleetbox: reproducible PaddlePaddle container images and multi-node training."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent   # the checkout: images/, train/, offline_cache/ live here
