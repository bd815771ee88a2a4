"""Fixtures the unit tests share."""
import json
import subprocess
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


def run_node(text, stubs, tmp_path, env=None):
    """Run a rendered node script with the stub runtimes as node 1 of 2 (Slurm job 7), `env` added: (the finished
    process, the calls the stubs recorded). It runs in an empty folder, tmp_path/cwd."""
    script = tmp_path / "node.sh"
    script.write_text(text)
    out = tmp_path / "calls.jsonl"
    out.unlink(missing_ok=True)
    env = {"PATH": f"{stubs}:/usr/sbin:/usr/bin:/bin", "STUB_OUT": str(out), "HOME": str(tmp_path), "USER": "u",
           "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost",
           "MASTER_IP": "127.0.0.1", "MASTER_PORT": "29555", **(env or {})}
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, cwd=cwd)
    return proc, [json.loads(ln) for ln in out.read_text().splitlines()] if out.exists() else []


def fake_env(folder, variant: str = "cpu", python=sys.executable):
    """What a node script checks of an env made by `invoke venv` (runtime none): its record and bin/python."""
    from pathlib import Path
    folder = Path(folder)
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    (folder / "bin" / "python").unlink(missing_ok=True)
    (folder / "bin" / "python").symlink_to(python)
    (folder / "fleetbox-env.json").write_text(json.dumps({"variant": variant}))
    return folder
