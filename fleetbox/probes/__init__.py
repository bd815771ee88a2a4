"""Scripts that run inside containers (passed as `python -c`, so nothing needs to be baked or mounted)."""
from importlib import resources


def source(name: str) -> str:
    """The text of probes/<name>.py, to run as `python -c` in an image."""
    return resources.files(__name__).joinpath(f"{name}.py").read_text()
