"""Code that runs inside the containers, standard library only at import (import-linter holds it to that).

The folder is mounted read-only at /fleetbox/helpers, on the containers' PYTHONPATH, so training scripts
import fleetbox_checkpoint and fleetbox_metrics; the probes (fleetbox_netinfo, fleetbox_verify_image) are also
passed whole as `python -c`, so they need nothing mounted or baked.
"""
from importlib import resources


def source(name: str) -> str:
    """The text of <name>.py, to run as `python -c` in an image."""
    return resources.files(__name__).joinpath(f"{name}.py").read_text()
