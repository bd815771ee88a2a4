"""What the Kubernetes backend's two clients (kubectl, and `podman kube play`: podman_play.py) share of a job's
pods: the names the controllers give a pod, whose they are (owner_label), what the kubelet does to its words, the
objects as YAML, and the hang watcher's way into a running pod (PodFiles, through the client's exec)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from fleetbox import settings
from fleetbox.run import hang
from fleetbox.run.records import SupervisedHandle

CONTAINER = "paddle"       # the Training Operator finds a PaddleJob's container, and its port, by these names
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"   # the Job controller's env (set here too, as it sets it: from the
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"   # pod's annotation)
# the pod's address (the downward API), by a name of fleetbox's own: Paddle's launcher reads POD_IP over its --host
POD_IP_VAR, POD_IP_REF = "NODE_POD_IP", {"fieldRef": {"fieldPath": "status.podIP"}}


def kubelet_literal(text: str) -> str:
    """`text` as the kubelet gives it back: it expands $(NAME) in an env value, a command and its args, and takes
    $$ for $; every $ doubled, the container gets the text as written (a user's value, the node script's own
    $(...) and $((...)), which the shell is to expand)."""
    return text.replace("$", "$$")


def kubelet_unescape(text: str) -> str:
    """What the kubelet makes of a $$ (a $), for Podman, which expands nothing: every $ kubelet_literal doubled is
    one again (a $( ) is left as written: kubelet_literal leaves none to expand)."""
    return text.replace("$$", "$")


def owner_label(owner: str) -> str:
    """records.owner() (user@<runs folder id>) as a label value can hold it (no '@', at most 63): the user's name
    in the characters a label takes, then the runs folder's id, which alone tells owners apart."""
    user, _, digest = owner.rpartition("@")
    user = re.sub(r"[^A-Za-z0-9_.-]", "_", user)[:50].strip("_.-")
    return f"{user}.{digest}" if user else digest



class PodFiles(hang.NodeFiles):
    """The hang watcher's transport to each node's log folder in its pod, while it runs: `kubectl exec` or
    `podman exec` (`argv(k)`: the words that run a command in node k's container; None: no pod of it yet), and
    `running()`: every node's container runs (the job's deadlines count from then, not from its scheduling)."""

    TIMEOUT_S = 30   # one exec: a busy API server answers late, never forever
    parallel = True

    def __init__(self, argv, running):
        super().__init__("")
        self.argv, self.running = argv, running

    def exec(self, k: int, words: list[str], data: bytes | None = None) -> bytes | None:
        head = self.argv(k)
        if head is None:
            return None
        try:
            proc = subprocess.run([*head, *words], input=data, stdin=None if data is not None else subprocess.DEVNULL,
                                  capture_output=True, timeout=self.TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None
        return proc.stdout if proc.returncode == 0 else None

    def read(self, k: int, name: str, last: int | None = None) -> bytes | None:
        path = f"{settings.LOG_DIR}/{name}"
        return self.exec(k, ["tail", "-c", str(last), path] if last else ["cat", path])

    def read_many(self, k: int, names: list[str]) -> list[bytes | None]:
        """Several small files of node k in one exec (a node's ranks' progress: one call per node, not per rank);
        None for each one that is not there."""
        # ours (raw shell): for each file, "+" and its bytes where it is there (an empty mark is there too), then a
        # NUL (JSON holds none); the paths are its arguments
        out = self.exec(k, ["sh", "-c", 'for f; do [ ! -f "$f" ] || { printf +; cat -- "$f"; }; printf "\\0"; done',
                            "sh", *(f"{settings.LOG_DIR}/{n}" for n in names)])
        parts = out.split(b"\0")[:len(names)] if out is not None else []
        return [p[1:] if p[:1] == b"+" else None for p in parts] + [None] * (len(names) - len(parts))

    def write(self, k: int, name: str, data: bytes) -> None:
        # ours (raw shell): the file whole or not at all, as run/hang.py writes it; the path is its argument
        if self.exec(k, ["sh", "-c", 'cat > "$1.tmp" && mv -f "$1.tmp" "$1"', "sh", f"{settings.LOG_DIR}/{name}"],
                     data) is None:
            raise OSError(f"node{k}: {name} not written")


def hang_watcher(handle: SupervisedHandle, files: PodFiles, log, every: float) -> hang.Watcher:
    """--hang-timeout and --start-timeout, carried out by the command that follows the job (run/hang.py's
    watcher): every `every` seconds, once every node's container runs, through `kubectl exec` or `podman exec`."""
    h = handle
    return hang.Watcher(str(Path(h.dir, f"hang-{h.attempt}")), h.nodes, h.procs_per_node, h.hang_timeout,
                        h.start_timeout, h.attempt, files, log, every)


YAML_BREAKS = ("\x85", "\u2028", "\u2029")   # line breaks to YAML (NEL, LS, PS), where Python's text has none


def to_yaml(docs) -> str:
    """Multi-document YAML, one document per object, keys in the order they were made; a string of several lines
    as a block (a node's script reads as written). A string holding a character YAML reads as a line break
    (U+0085, U+2028, U+2029) is double-quoted, where it is escaped: read back, it is the same string."""
    import yaml  # noqa: PLC0415 (deferred: every task loads the backends, only this backend's objects need YAML)

    class Dumper(yaml.SafeDumper):
        pass

    def style(text: str) -> str | None:
        return '"' if any(c in text for c in YAML_BREAKS) else "|" if "\n" in text else None
    Dumper.add_representer(str, lambda d, text: d.represent_scalar("tag:yaml.org,2002:str", text, style=style(text)))
    return yaml.dump_all(list(docs), Dumper=Dumper, sort_keys=False, explicit_start=True, allow_unicode=True,
                         width=1 << 16)
