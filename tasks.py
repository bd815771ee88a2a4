"""`invoke` in the checkout finds its tasks here: they are the `fleetbox` command's (fleetbox/tasks.py)."""
from fleetbox.tasks import ns  # noqa: F401  (invoke loads a module's `ns` collection)
