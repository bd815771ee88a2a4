"""Every command the README and the guides show runs as written: each `invoke` or `fleetbox` line of their code
blocks, a task that starts a job or a build with --dry-run added, run in this process from a user's folder (a home
with ~/work/my_train.py, and every variant's image shipped: tests/unit/conftest.py). A command that needs what this
machine lacks is listed below with the reason, and its task and options are still held to the CLI's. `invoke` runs
in the checkout, `fleetbox` in the user's folder."""
import re
import shlex
import shutil

import pytest

from fleetbox import ROOT
from tests.conftest import invoke_here

DRY = {"train", "doctor", "scale", "build", "base"}   # tasks that start a job or a build: shown, never started
# what a command needs that this machine lacks, by the command's start
NOT_RUN = {
    "lock": "resolves against Paddle's own index, which this machine cannot reach",
    "wheels": "downloads a variant's wheels (the integration tests make the CPU one)",
    "export": "writes an image file from a built image (integration tests)",
    "push": "pushes to a registry (integration tests, a registry on loopback)",
    "kit": "writes an air-gap kit of built images (integration tests)",
    "venv": "makes an env on a shared file system (integration tests)",
    "board JOB": "serves a job's board (a real browser's test); JOB stands for a job's id",
    "logs": "JOB stands for a job's id",
    "cancel": "JOB stands for a job's id",
    "doctor --nodes 2 --hosts tcp://h1:2375,tcp://h2:2375": "engines at h1 and h2, which this machine lacks",
    "train --backend slurm --runtime none --venv /shared/envs/": "an env made by `invoke venv` on /shared",
    "doctor --backend slurm --runtime none --venv /shared/envs/": "an env made by `invoke venv` on /shared",
    "scale --nodes 1,2,4 --procs-per-node 1,2 --image fleetbox/paddle:cpu,my/paddle:next": "an image my/paddle:next",
    "train --backend kubernetes ... (the same, without --dry-run)": "prose: the command above, run",
    "verify --variant cpu --trusted-keys site-keys.pub": "a site's SSH keys (an integration test signs and checks)",
}


def commands() -> list[tuple[str, str]]:
    """(file, command) for each `invoke` or `fleetbox` command in a fenced code block, continuation lines joined,
    commands after `&&` or `;` apart, comments dropped."""
    out = []
    for path in [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.parts)]:
        inside, block = False, []
        for ln in path.read_text().splitlines():
            if ln.strip().startswith("```"):
                inside = not inside
            elif inside:
                block.append(ln)
        for ln in re.sub(r"\\\n\s*", " ", "\n".join(block)).splitlines():
            for part in re.split(r"\s*(?:&&|;)\s+", ln.strip().removeprefix("$ ")):
                if re.match(r"(\S*/)?(invoke|fleetbox)\s", part):
                    out.append((str(path.relative_to(ROOT)), re.split(r"\s+#\s", part)[0].strip()))
    return out


def task_of(words: list[str]) -> str:
    return next(w for w in words[1:] if not w.startswith("-"))


def listed(command: str) -> str:
    rest = command.split(None, 1)[1]
    return next((why for start, why in NOT_RUN.items() if rest.startswith(start)), "")


@pytest.mark.parametrize("where,command", commands())
def test_each_command_the_docs_show_runs_as_written(where, command, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "work").mkdir(parents=True)
    shutil.copy(ROOT / "train" / "smoke.py", home / "work" / "my_train.py")
    shutil.copy(ROOT / "train" / "smoke.py", home / "work" / "train.py")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    words = [w.replace("~/", f"{home}/") for w in shlex.split(command)]
    task = task_of(words) if len(words) > 1 and words[1] != "--list" else "--list"
    if why := listed(command):
        from fleetbox.tasks import ns
        if task in ns.tasks and "..." not in command:   # not run: its task and options are still the CLI's
            flags = {n for a in ns.tasks[task].get_arguments() for n in a.names}
            assert [w for w in words[2:] if w.startswith("--") and w[2:].split("=")[0] not in flags] == [], why
        return
    if task in DRY and "--dry-run" not in words:   # before a `--`: after it, the script's
        words.insert(words.index("--") if "--" in words else len(words), "--dry-run")
    fleetbox = words[0].endswith("fleetbox")   # from the user's folder; invoke from the checkout, as the docs say
    p = invoke_here(*words[1:], cwd=home / "work" if fleetbox else ROOT, command="fleetbox" if fleetbox else "invoke")
    assert p.returncode == 0, f"{where}: {command}\n{p.stderr}"
    assert not (tmp_path / "runs").exists() or task not in DRY   # shown, nothing started


def test_every_command_not_run_is_one_the_docs_still_show():
    """A reason left for a command the docs no longer show is dead: it would let a new command of that start
    go unrun."""
    shown = [c.split(None, 1)[1] for _, c in commands()]
    assert [start for start in NOT_RUN if not any(c.startswith(start) for c in shown)] == []
