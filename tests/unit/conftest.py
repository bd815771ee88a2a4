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
    for tool in ("docker", "podman", "ch-run", "apptainer", "singularity", "python", "srun"):
        (d / tool).write_text(STUB.format(py=sys.executable))
        (d / tool).chmod(0o755)
    (d / "scontrol").write_text('#!/bin/sh\n'
                                'case "$2" in hostnames) echo localhost;; *) echo "NodeAddr=127.0.0.1";; esac\n')
    (d / "scontrol").chmod(0o755)
    return d


def made_by_the_job(text, node="1"):
    """The folders of the job folder that submit and job.sbatch make before node.sh runs (its helpers, the nodes'
    log folders, the checkpoint folder), among the paths node.sh checks: node.sh needs them on the node."""
    import re
    import shlex
    from pathlib import Path

    from fleetbox import settings
    m = re.search(r"^for p in (.*); do \[ -e", text, re.M)
    for p in shlex.split(m.group(1)) if m else []:
        if p.startswith(str(settings.runs_root()) + "/"):
            Path(p.replace("$SLURM_NODEID", node)).mkdir(parents=True, exist_ok=True)


def run_node(text, stubs, tmp_path, env=None):
    """Run a rendered node script with the stub runtimes as node 1 of 2 (Slurm job 7), `env` added: (the finished
    process, the calls the stubs recorded). It runs in an empty folder, tmp_path/cwd, once the job has made its
    folders."""
    made_by_the_job(text, (env or {}).get("SLURM_NODEID", "1"))
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


SHIPPED_HASH = "5417bed0c0de"   # the content hash of what the unit tests ship of every variant
REGISTRY = "registry.example.org:5000/fleetbox"


@pytest.fixture(autouse=True)
def shipped_here(tmp_path_factory, monkeypatch):
    """Unit tests plan against what they ship themselves, in an exports folder of their own: every variant exported
    in each kind a runtime runs (empty stand-ins: a plan only names them) and pushed to REGISTRY, and no image built
    here unless a test says which (`shipped_here.built = TAG`), whatever this machine's engine holds. A test that
    needs nothing shipped clears it (`shipped_here.clear()`)."""
    import shutil
    from types import SimpleNamespace

    from fleetbox.image import matrix
    from fleetbox.ship import exports, shipped
    monkeypatch.setenv("FLEETBOX_EXPORTS", str(tmp_path_factory.mktemp("exports")))   # beside the test's tmp_path
    state = SimpleNamespace(built=None, clear=lambda: shutil.rmtree(shipped.records_dir(), ignore_errors=True))
    monkeypatch.setattr(shipped, "built_here", lambda variant: state.built)
    for v in matrix.load().variants.values():
        tag = f"{v.image}:{v.name}-{SHIPPED_HASH}"
        for kind, (fmt, squash) in exports.KINDS.items():
            path = exports.export_path(v, fmt, squash, image_tag=SHIPPED_HASH)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.mkdir() if kind == "charliecloud" else path.touch()
            shipped.record(v, kind, tag, str(path))
        shipped.record(v, shipped.REGISTRY, tag, f"{REGISTRY}/paddle:{v.name}-{SHIPPED_HASH}")
    return state


def given_image(runtime: str, folder) -> str:
    """An --image as each runtime takes it: a name local to the engines' nodes, an image folder for Charliecloud, an
    image file for the others (empty stand-ins made in `folder`: a plan only names them)."""
    if runtime in ("docker", "podman"):
        return "img:tag"
    path = folder / "img:tag"
    if not path.exists():
        path.mkdir() if runtime == "charliecloud" else path.touch()
    return str(path)
