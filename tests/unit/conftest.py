"""Fixtures the unit tests share."""
import sys

import pytest

# Records argv and environment as JSON; for pyxis the node script itself runs inside the container, so the
# same stub stands in for `python` (the route probe answers "lo 127.0.0.1", the launcher records).
STUB = r'''#!{py}
import json, os, sys
if sys.argv[1:2] == ["-c"]:
    print("lo 127.0.0.1")
    sys.exit(0)
with open(os.environ["STUB_OUT"], "a") as f:
    f.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:], "env": dict(os.environ)}}) + "\n")
'''


@pytest.fixture
def stubs(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    for tool in ("docker", "podman", "ch-run", "apptainer", "python", "srun"):
        (d / tool).write_text(STUB.format(py=sys.executable))
        (d / tool).chmod(0o755)
    (d / "scontrol").write_text('#!/bin/sh\n'
                                'case "$2" in hostnames) echo localhost;; *) echo "NodeAddr=127.0.0.1";; esac\n')
    (d / "scontrol").chmod(0o755)
    return d
