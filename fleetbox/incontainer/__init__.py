"""Code that runs inside the containers: the standard library only, Paddle and NumPy imported inside the
functions that need them (the host imports fleetbox_checkpoint and fleetbox_netinfo too), but in the all-reduce
sweep, a script that runs only in the image. tests/unit/test_layout.py holds it to that, and import-linter to
importing nothing of fleetbox.

The folder is mounted read-only at /fleetbox/helpers, on the containers' PYTHONPATH, so training scripts
import fleetbox_checkpoint and fleetbox_metrics; the probes (fleetbox_netinfo, fleetbox_verify_image) are also
passed whole as `python -c`, so they need nothing mounted or baked.
"""
from importlib import resources


def source(name: str) -> str:
    """The text of <name>.py, to run as `python -c` in an image."""
    return resources.files(__name__).joinpath(f"{name}.py").read_text()
