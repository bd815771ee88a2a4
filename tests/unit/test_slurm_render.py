"""The sbatch renderer for every runtime and variant family, the export commands and the pull commands."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import node_script as fragments
from fleetbox.run.backends import runtimes, slurm, slurm_step
from fleetbox.ship import exports as hpc
from tests.unit.conftest import REGISTRY, SHIPPED_HASH, fake_env, given_image


def job(variant="cpu", runtime="podman", runtime_args="", **kw):
    own = {}
    if runtime == runtimes.Host.name:   # no container: an env (a stand-in, as far as plan looks) and a module
        kw.pop("mounts", None)
        own = {"venv": str(fake_env(Path(tempfile.gettempdir()) / "fleetbox-test-envs" / variant, variant)),
               "modules": "dtk/24.04"}
    spec = spec_mod.JobSpec(variant=matrix.load().get(variant), nodes=kw.pop("nodes", 2), job_id="train-t-0001",
                            port=29555, **kw)
    backend = slurm.SlurmBackend(runtime, partition="gpu", time="01:00:00", account="proj42",
                                 runtime_args=runtime_args, **own)
    return dict(backend.plan(spec).files)


def sbatch(files):
    return files["job.sbatch"]


def node_script(files):
    return files["node.sh"]


def bash_ok(text):
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# shellcheck findings we keep, each on purpose: SC2317 (stop_soon and cleanup run from a trap, shellcheck sees no
# call), SC2209 (`ended=continue` assigns the word), SC2026 (shlex.quote writes a quote inside a value as '"'"',
# which is right), SC2016 (a `$` single-quoted on purpose: a user's value kept literal, pyxis's probe source).
SHELLCHECK_KEPT = "SC2317,SC2209,SC2026,SC2016"


@pytest.mark.parametrize("runtime", list(runtimes.RUNTIMES))
@pytest.mark.parametrize("variant", ["cpu", "cu126", "dcu"])
def test_shellcheck_passes_the_scripts_as_rendered(runtime, variant, tmp_path):
    """Every rendered script (with the parts that only some jobs have: an interface, the image's identity, user
    values with quotes and $), exactly as submitted, through shellcheck (Debian's package)."""
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (scripts/setup-host.sh installs it)")
    files = job(variant, runtime, iface="eth0", image_identity=True, max_restarts=1, env={"A": "a b {rank}"},
                spare_nodes=1, min_nodes=1,
                args=("--tag", "it's $(id) {node}"), mounts=(spec_mod.Mount("{home}/data", "/data"),))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = subprocess.run(["shellcheck", "--shell=bash", "--severity=info", "--exclude", SHELLCHECK_KEPT,
                           "--format=gcc", *(str(tmp_path / n) for n in files)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("runtime", list(runtimes.RUNTIMES))
@pytest.mark.parametrize("variant", ["cpu", "cu126", "dcu"])
def test_every_runtime_and_variant_renders_valid_bash(runtime, variant):
    sj = job(variant, runtime)
    sb, node = sbatch(sj), node_script(sj)
    bash_ok(sb)
    bash_ok(node)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --time=01:00:00", "#SBATCH --account=proj42", "MASTER_PORT=29555",
                 'MASTER_HOST=${STEP%%,*}'):
        assert line in sb, line
    assert "srun --kill-on-bad-exit=1 --wait=60" in sb
    for piece in ('--master "$MASTER_IP":"$MASTER_PORT"', '--host "$NODE_IP"', '--nnodes "$SLURM_NNODES"',
                  '--rank "$SLURM_NODEID"', "paddle.distributed.launch"):
        assert piece in node, piece
    for piece in ("GLOO_SOCKET_IFNAME=$IFACE", "NCCL_SOCKET_IFNAME=$IFACE", "NCCL_IB_DISABLE=1"):
        assert piece in node.replace('"', ""), piece
    assert "'" not in node.split("paddle.distributed.launch")[1].splitlines()[0]   # the launch: nothing quoted


def test_runtime_specifics():
    podman = node_script(job(runtime="podman"))
    assert "\npodman run --rm" in podman and "--network host" in podman
    assert '--ulimit "memlock=$(hard_limit l)"' in podman and "hard_limit() {" in podman
    assert 'cleanup() { podman rm -f --time 0 fleetbox-train-t-0001-node"$SLURM_NODEID" ' in podman
    assert "trap cleanup TERM INT" in podman and '\nrc=0; wait "$LAUNCHER" || rc=$?\n' in podman and \
        podman.endswith('exit "$rc"\n')
    docker = node_script(job(runtime="docker"))
    assert "\ndocker run --rm" in docker and " -d " not in docker
    sb = sbatch(job(runtime="podman"))
    from fleetbox.run import records  # the sweep takes this job's containers only, not another user's
    assert (f"podman ps -aq --filter label=io.fleetbox.job=train-t-0001 --filter label=io.fleetbox.owner="
            f"{records.owner()} | xargs -r podman rm -f") in sb
    assert sb.rstrip().endswith('exit "$rc"')
    ch = node_script(job(runtime="charliecloud"))
    assert "\nch-run --env-no-expand --set-env" in ch and " -c /workspace " in ch and " -- python -m paddle" in ch
    app = node_script(job(runtime="apptainer"))
    assert "\napptainer exec --cleanenv" in app and "--bind /" in app
    cuda_app = node_script(job("cu126", "apptainer"))
    assert " --nv " in cuda_app
    dcu_app = node_script(job("dcu", "apptainer"))
    assert " --rocm " in dcu_app and "/opt/hyhal:/opt/hyhal:ro" in dcu_app
    pyxis_sj = job(runtime="pyxis")
    sb = sbatch(pyxis_sj)
    sqsh = hpc.export_path(matrix.load().get("cpu"), "sqsh", image_tag=SHIPPED_HASH)   # what the unit tests shipped
    assert f"--container-image={sqsh}" in sb and "--container-mounts=" in sb
    assert "\npython -m paddle.distributed.launch" in node_script(pyxis_sj)
    assert "export GLOO_SOCKET_IFNAME=" in node_script(pyxis_sj)


def test_cuda_asks_slurm_for_gpus_and_docker_runtime_for_them():
    sj = job("cu126", "docker", gpus_per_node=4, procs_per_node=4)
    assert "#SBATCH --gpus-per-node=4" in sbatch(sj)
    run = next(ln for ln in node_script(sj).splitlines() if ln.startswith("docker run"))
    assert '"${ACCEL[@]}"' in run and "--gpus" not in run   # only the allocation's, from ACCEL
    dcu = job("dcu", "podman")
    assert "#SBATCH --gpus-per-node=1" in sbatch(dcu)   # one per process: node.sh reads which
    dcu = node_script(dcu)
    assert "--device /dev/kfd" in dcu and "--device /dev/dri " not in dcu and "--group-add keep-groups" in dcu


def test_ib_and_iface_overrides_reach_the_node_script():
    node = node_script(job(ib_hca="mlx5_0", iface="ib0", debug=True))
    assert "NCCL_IB_HCA=mlx5_0" in node and "NCCL_IB_DISABLE=0" in node and "IFACE=ib0" in node
    assert "NCCL_DEBUG=INFO" in node


def test_runtime_args_go_before_the_image():
    node = node_script(job(runtime_args="--ulimit nproc=32768:32768"))   # podman: the push unit tests made
    assert f"--ulimit nproc=32768:32768 {REGISTRY}/paddle:cpu-{SHIPPED_HASH} python -m paddle" in node


def test_unknown_runtime():
    with pytest.raises(UserError, match="unknown runtime 'singularty'; choose one of: apptainer, singularity, "):
        job(runtime="singularty")


def test_failures_are_read_from_sruns_messages():
    out = ("srun: error: node1: task 0: Exited with exit code 250\n"
           "srun: error: node2: task 1: Exited with exit code 3\n"
           "srun: error: node3: task 2: Killed\n"
           "srun: error: node4: task 3: Out Of Memory\n")
    assert slurm_step.failures(out) == [(0, 250, "node1", False, False), (1, 3, "node2", False, False),
                                   (2, 137, "node3", False, True), (3, 137, "node4", True, False)]


def _recorded_job(tmp_path, batch_out: str, last_words: dict[int, int]):
    """A finished Slurm job's folder as node.sh leaves it: srun's messages, node logs, worker logs."""
    import os

    from fleetbox.run.records import Handle
    (tmp_path / "slurm-77.out").write_text(batch_out)
    for rank, t in last_words.items():
        (tmp_path / f"node{rank}.log").write_text(
            f"fleetbox: node {rank} on node{rank + 1}:10.0.0.{rank + 1}\n"
            "Container rank 0 status failed cmd ['python'] code 1 log /fleetbox/logs/workerlog.0\n")
        w = tmp_path / f"node{rank}" / "workerlog.0"
        w.parent.mkdir()
        w.write_text("...")
        os.utime(w, ns=(t, t))
    return Handle("slurm", "train-x", str(tmp_path), nodes=2, scheduler_job="77")


def test_slurm_blames_by_last_words_not_by_srun_order(tmp_path):
    # srun reported node1's task first (its launcher noticed first), but node2's worker spoke last first
    out = ("srun: error: node1: task 0: Exited with exit code 250\n"
           "srun: error: node2: task 1: Exited with exit code 1\n")
    h = _recorded_job(tmp_path, out, {0: 2_000_000_000, 1: 1_000_000_000})
    r = slurm.SlurmBackend(runtime="podman").result(h, "FAILED")
    assert r.culprit == 1 and [n.state for n in r.nodes] == ["aborted", "FAILED"]
    assert r.failure().startswith("node1 (rank 1) on node2 exited with exit code 1 (logs: ")


def test_slurm_never_blames_a_task_srun_killed_after_the_first_failure(tmp_path):
    # node2's task exits 1; srun then kills node1's task, which was blocked in a collective and wrote nothing
    # since long before: its old last words must not make it the culprit
    out = ("srun: error: node2: task 1: Exited with exit code 1\n"
           "srun: error: node1: task 0: Terminated\n")
    h = _recorded_job(tmp_path, out, {0: 1_000_000_000, 1: 2_000_000_000})
    r = slurm.SlurmBackend(runtime="podman").result(h, "FAILED")
    assert r.culprit == 1 and r.failure().startswith("node1 (rank 1) on node2 exited with exit code 1 (logs")


def test_slurm_never_blames_a_task_stopped_after_srun_began_terminating_the_step(tmp_path):
    # recorded from the test cluster: node1's task hung (its log last written early), node2's task exited 3,
    # srun terminated the step, node.sh's TERM trap made node1's task exit 143
    out = ("srun: error: node2: task 1: Exited with exit code 3\n"
           "srun: launch/slurm: _step_signal: Terminating StepId=3.0\n"
           "srun: error: node1: task 0: Exited with exit code 143\n")
    h = _recorded_job(tmp_path, out, {0: 1_000_000_000, 1: 2_000_000_000})
    r = slurm.SlurmBackend(runtime="podman").result(h, "FAILED")
    assert r.culprit == 1 and [n.state for n in r.nodes] == ["stopped", "FAILED"]


def test_slurm_with_several_workers_per_node_goes_by_srun_order(tmp_path):
    out = ("srun: error: node1: task 0: Exited with exit code 250\n"
           "srun: error: node2: task 1: Exited with exit code 1\n")
    h = _recorded_job(tmp_path, out, {0: 2_000_000_000, 1: 1_000_000_000})
    h.procs_per_node = 2   # the launcher's named worker may be a sibling that died of the same error
    assert slurm.SlurmBackend(runtime="podman").result(h, "FAILED").culprit == 0


def test_slurm_names_a_kill_and_an_oom(tmp_path):
    out = "srun: error: node2: task 1: Out Of Memory\n"
    h = _recorded_job(tmp_path, out, {1: 1_000_000_000})
    r = slurm.SlurmBackend(runtime="podman").result(h, "OUT_OF_MEMORY")
    assert r.failure().startswith("node1 (rank 1) on node2 exited with exit code 137 "
                                  "(killed by SIGKILL: out of memory)")
    (tmp_path / "slurm-77.out").write_text("srun: error: node2: task 1: Killed\n")
    r = slurm.SlurmBackend(runtime="podman").result(h, "FAILED")
    assert r.failure().startswith("node1 (rank 1) on node2 exited with exit code 137 (killed by SIGKILL) (logs")


def test_export_commands_and_paths(tmp_path):
    v = matrix.load().get("cpu")
    assert hpc.export_argv("charliecloud", "fleetbox/paddle:cpu", tmp_path / "x.ch") == [
        "ch-convert", "-i", "docker", "fleetbox/paddle:cpu", str(tmp_path / "x.ch")]
    assert hpc.export_argv("sif", "img", tmp_path / "x.sif")[:3] == ["apptainer", "build", str(tmp_path / "x.sif")]
    assert hpc.export_argv("sqsh", "img", tmp_path / "x")[-1] == "dockerd://img"
    assert hpc.export_path(v, "charliecloud", squash=True, dest=tmp_path, image_tag="0123456789ab").name == \
        "fleetbox-paddle-cpu-0123456789ab.sqfs"
    assert hpc.export_path(v, "docker-archive", dest=tmp_path, image_tag="0123456789ab").name == \
        "fleetbox-paddle-cpu-0123456789ab.tar"
    with pytest.raises(UserError, match="unknown export format 'zip'"):
        hpc.export_argv("zip", "img", tmp_path)


def test_registry_refs_and_pull_commands():
    v = matrix.load().get("cpu")
    refs = hpc.registry_refs(v, "reg.example:5000/team", "fleetbox/paddle:cpu-0123456789ab")
    assert refs == ["reg.example:5000/team/paddle:cpu-0123456789ab", "reg.example:5000/team/paddle:cpu",
                    "reg.example:5000/team/paddle:3.3.1-cpu-py311"]
    with pytest.raises(UserError, match="HOST\\[:PORT\\]/NAMESPACE"):
        hpc.registry_refs(v, "reg.example", "x:y")
    with pytest.raises(UserError, match="^--registry is missing: give the HOST"):   # as a guide once left it out
        hpc.registry_refs(v, "", "x:y")
    ref = refs[0]
    def pull(rt, **kw):   # the content tag's commands
        lines = runtimes.pull_commands(rt, refs[0], refs[1], "p", **kw)
        return lines[1:lines.index("# alias")]
    assert pull("apptainer") == [f"apptainer pull p.sif docker://{ref}"]
    assert pull("apptainer", insecure=True) == [f"env APPTAINER_NOHTTPS=1 apptainer pull p.sif docker://{ref}"]
    assert pull("singularity", insecure=True) == [f"env SINGULARITY_NOHTTPS=1 singularity pull p.sif docker://{ref}"]
    assert pull("pyxis")[0] == "enroot import -o p.sqsh 'docker://reg.example:5000#team/paddle:cpu-0123456789ab'"
    assert pull("charliecloud", insecure=True)[0] == f"ch-image pull --tls-no-verify {ref}"
    assert pull("podman", insecure=True) == [f"podman pull --tls-verify=false {ref}"]
    assert pull("docker") == [f"docker pull {ref}"]
    # a hostile registry value is quoted, never run
    evil = hpc.registry_refs(v, "reg.example/$(touch x);y", "fleetbox/paddle:cpu-0")
    with pytest.raises(UserError, match="runtime none runs no image: make the env on the cluster with `invoke venv`"):
        runtimes.pull_commands("none", refs[0], refs[1], "p")
    for rt in (r for r, it in runtimes.RUNTIMES.items() if it.has_image):
        for ln in runtimes.pull_commands(rt, evil[0], evil[1], "p"):
            if "docker://" in ln or " pull " in ln:
                assert "'" in ln and "$(touch x)" in ln, ln
                words = subprocess.run(["bash", "-c", "printf '%s\\n' " + ln], capture_output=True, text=True).stdout
                assert "$(touch x);y" in words


def test_pull_commands_without_a_content_tag_never_call_the_alias_immutable():
    v = matrix.load().get("cu126")
    refs = hpc.registry_refs(v, "reg.example:5000/team", None)
    assert refs == ["reg.example:5000/team/paddle:cu126", "reg.example:5000/team/paddle:3.3.1-cu126-py311"]
    lines = runtimes.pull_commands("apptainer", None, refs[0], "p")
    assert lines == ["# alias (mutable: the image is not built here, so its immutable content tag is unknown)",
                     f"apptainer pull p.sif docker://{refs[0]}"]


@pytest.mark.parametrize("runtime,dst", [
    ("apptainer", "$HOME/.cache/paddle/dataset"), ("pyxis", "$HOME/.cache/paddle/dataset"),
    ("charliecloud", "/home/$USER/.cache/paddle/dataset"),
    ("podman", "/root/.cache/paddle/dataset"), ("docker", "/root/.cache/paddle/dataset")])
def test_dataset_cache_is_mounted_where_paddle_looks_as_the_runtimes_user(runtime, dst, tmp_path):
    sj = job(runtime=runtime, data_dir=str(tmp_path))
    sb, node = sbatch(sj), node_script(sj)
    dst = dst.replace("$HOME", '"$HOME"').replace("$USER", '"$USER"')
    assert f"{tmp_path}:{dst}" in sb + node
    made = [ln for ln in (sb + node).splitlines() if ln.startswith("mkdir -p")]
    if runtimes.get(runtime).runs_as_user:   # the mount point in the user's home exists before the container starts
        assert "/root/.cache" not in sb + node
        assert any('"$HOME"/.cache/paddle/dataset' in ln for ln in made)
        assert ("--home" in node) if runtime == "charliecloud" else True
        assert ("--container-mount-home" in sb) if runtime == "pyxis" else True
    else:
        assert not any(".cache" in ln for ln in made)


# -- the chain of allocations (job.sbatch's own shell, run here with bash; sbatch is a stand-in that records) --

def _allocation(tmp_path, *, state, rc, from_step=10, to_step=20, allocation=1, restarts=0, max_alloc=3,
                max_restarts=0, cancelled=False, stale="", requeues=0, exit_code=0, hung_in=""):
    import json as _json
    import subprocess
    job, ck, bin_ = tmp_path / "job", tmp_path / "ck", tmp_path / "bin"
    for d in (job, ck, bin_, job / "node0"):
        d.mkdir(parents=True, exist_ok=True)
    if hung_in:   # what the watcher of Slurm job `hung_in` kept (run/hang.py keep())
        (job / f"hang-{allocation - 1}").mkdir()
        (job / f"hang-{allocation - 1}" / "hang.json").write_text(_json.dumps({"slurm_job": hung_in}, indent=1))
    (job / "node0.log").write_text("node 0 said\n")
    (job / "node.sh").write_text("# the node script stays\n")
    (bin_ / "sbatch").write_text('#!/bin/bash\necho "$@" > "$(dirname "$0")/sbatch.args"\necho "99;cluster"\n')
    (bin_ / "sbatch").chmod(0o755)
    for s in (from_step, to_step):
        (ck / f"step-{s:08d}").mkdir(exist_ok=True)
        (ck / f"step-{s:08d}" / "COMPLETE").write_text("{}")
    (ck / "step-00000099").mkdir(exist_ok=True)   # no COMPLETE: never counts
    if stale and stale != "started":   # what the previous allocation's script recorded
        (ck / "STATE").write_text(f'{{"state": "{stale}", "step": {from_step}}}')
    script = "\n".join([
        "set -euo pipefail", f"JOB_DIR={job}", f"CHECKPOINTS={ck}", "SLURM_JOB_ID=7",
        f"MAX_ALLOCATIONS={max_alloc} MAX_RESTARTS={max_restarts} NODES=2", f"SLURM_RESTART_COUNT={requeues}",
        f"FLEETBOX_ALLOCATION={allocation}", f"FLEETBOX_RESTARTS={restarts}", "FLEETBOX_CHAIN=7",
        # the allocation starts at from_step; the script then ran, checkpointed up to to_step and recorded its state
        f"mv {ck}/step-{to_step:08d} {tmp_path}/later" if to_step != from_step else ":",
        str(slurm.CHAIN_SH),
        f"mv {tmp_path}/later {ck}/step-{to_step:08d}" if to_step != from_step else ":",
        f"touch {job}/CANCELLED.7" if cancelled else ":",   # `invoke cancel` while the allocation ran
        f"echo '{{\"state\": \"{state}\", \"step\": {to_step}}}' > {ck}/STATE" if state else ":",
        'echo "attempt=$FLEETBOX_ATTEMPT"', f"rc={rc}", "next_allocation", 'echo "exit=$rc"'])
    if requeues and stale != "started":   # the run Slurm cut short (run `requeues` of job 7) began at step 5
        # as allocation (its step) and restart number the requeue's count makes, on 2 nodes
        (job / "started.7").write_text(f"7 {requeues} 5 {allocation + requeues - 1} {restarts + requeues - 1} 2\n")
    elif requeues:   # it never got as far: what is there is the previous job's
        (job / "started.7").write_text("6 1 0\n")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={"PATH": f"{bin_}:/usr/bin:/bin"})
    assert proc.returncode == exit_code, proc.stderr
    recs = [_json.loads(ln) for ln in (job / "allocations.jsonl").read_text().splitlines()]
    if requeues:
        return recs, proc.stdout + proc.stderr, job
    rec = recs[-1]
    sbatch = (bin_ / "sbatch.args").read_text() if (bin_ / "sbatch.args").exists() else ""
    return rec, sbatch, job, proc.stdout


def test_a_requeued_allocation_is_a_restart_from_the_newest_checkpoint(tmp_path):
    """Slurm runs job 7's script again (SLURM_RESTART_COUNT=1): the cut run is recorded as allocation 1 with its
    logs kept apart, and this run is allocation 2, attempt 1, from the newest checkpoint, one restart spent."""
    recs, out, job = _allocation(tmp_path, state="done", rc=0, requeues=1, max_restarts=1)
    cut, this = recs
    assert cut == {"chain": "7", "allocation": 1, "max_allocations": 3, "slurm_job": "7", "from_step": 5,
                   "to_step": 10, "state": "", "exit": -1, "ended": "requeued", "next": "", "nodes": 2,
                   "left_out": ""}
    assert this["allocation"] == 2 and this["from_step"] == 10 and this["ended"] == "finished"
    assert "attempt=1" in out and (job / "alloc1" / "node0.log").read_text() == "node 0 said\n"
    assert slurm_step.chain_end(cut).startswith("requeued by Slurm (a node failure, preemption or scontrol requeue) at "
                                           "checkpoint step 10")


def test_a_run_cut_before_it_started_is_recorded_without_steps(tmp_path):
    recs, out, job = _allocation(tmp_path, state="done", rc=0, requeues=1, max_restarts=1, stale="started")
    assert (recs[0]["ended"], recs[0]["from_step"], recs[0]["to_step"]) == ("requeued", 10, 10)


def test_a_requeue_spends_a_restart_and_the_next_allocation_knows(tmp_path):
    """Requeued once, then failing with one more restart allowed: the next allocation is 3 with both spent."""
    recs, out, job = _allocation(tmp_path, state="running", rc=3, requeues=1, max_restarts=2)
    assert [r["ended"] for r in recs] == ["requeued", "restart"]
    # a count of its own is not handed on: Slurm sets one only when the next job is itself requeued
    sbatch = (tmp_path / "bin" / "sbatch.args").read_text()
    assert "SLURM_RESTART_COUNT=0,FLEETBOX_ALLOCATION=3,FLEETBOX_RESTARTS=2," in sbatch


def test_a_requeue_with_no_restart_left_is_not_run_again(tmp_path):
    recs, out, job = _allocation(tmp_path, state="running", rc=0, requeues=2, max_restarts=1, exit_code=1)
    assert [(r["allocation"], r["ended"]) for r in recs] == [(2, "requeued"), (3, "requeue-refused")]
    assert "--max-restarts 1 is spent: not running it again" in out and "attempt=" not in out


def test_an_allocation_that_checkpointed_and_stopped_is_continued(tmp_path):
    rec, sbatch, job, out = _allocation(tmp_path, state="continue", rc=0)
    assert rec == {"chain": "7", "allocation": 1, "max_allocations": 3, "slurm_job": "7", "from_step": 10,
                   "to_step": 20, "state": "continue", "exit": 0, "ended": "continue", "next": "99", "nodes": 2,
                   "left_out": ""}
    assert "--dependency=afterany:7" in sbatch
    assert "FLEETBOX_ALLOCATION=2,FLEETBOX_RESTARTS=0,FLEETBOX_CHAIN=7" in sbatch
    assert sorted(p.name for p in (job / "alloc1").iterdir()) == ["node0", "node0.log"]   # its logs kept apart
    assert (job / "node.sh").exists() and "exit=0" in out
    assert slurm_step.chain_end(rec) == ("stopped at the time limit with a checkpoint at step 20; continued in Slurm "
                                         "job 99")


@pytest.mark.parametrize("case,kw,ended,submits", [
    ("no-progress", dict(state="continue", rc=0, to_step=10), "no-progress", False),
    ("last-allowed", dict(state="continue", rc=0, allocation=3), "max-allocations", False),
    ("done", dict(state="done", rc=0), "finished", False),
    ("no-helper", dict(state="", rc=0), "finished", False),
    ("failed", dict(state="running", rc=3), "failed", False),
    ("failed-restart-left", dict(state="running", rc=3, max_restarts=1), "restart", True),
    ("restarts-used", dict(state="running", rc=3, restarts=1, max_restarts=1), "failed", False),
    ("cancelled", dict(state="continue", rc=0, cancelled=True), "cancelled", False),
    # the last allocation's "continue" is gone once this one starts: a failure before the script records its
    # own state is a failure (restarted while restarts remain), not "no progress"
    ("failed-before-the-script-ran", dict(state="", rc=3, to_step=10, stale="continue", max_restarts=1),
     "restart", True),
])
def test_how_an_allocation_ends_is_read_from_the_checkpoint_folder(tmp_path, case, kw, ended, submits):
    rec, sbatch, job, out = _allocation(tmp_path, **kw)
    assert rec["ended"] == ended and bool(sbatch) == submits and bool(rec["next"]) == submits
    if ended == "restart":
        assert "FLEETBOX_RESTARTS=1" in sbatch and rec["exit"] == 3
    if ended == "no-progress":
        assert slurm_step.chain_end(rec) == ("allocation 1 made no progress (its newest checkpoint is still step 10): "
                                        "not continuing")
    if ended == "max-allocations":
        assert slurm_step.chain_end(rec) == "stopped at step 20 to continue, but --max-allocations 3 was reached"


def test_an_allocation_of_a_cancelled_chain_ends_at_once(tmp_path):
    import subprocess
    (tmp_path / "CANCELLED.7").touch()
    script = "\n".join(["set -euo pipefail", f"JOB_DIR={tmp_path}", f"CHECKPOINTS={tmp_path}", "SLURM_JOB_ID=8",
                        "FLEETBOX_CHAIN=7", "NODES=2", str(slurm.CHAIN_SH), "echo started"])
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "fleetbox: run 1 of Slurm job 8\nfleetbox: the job was cancelled\n"


def test_slurm_is_asked_to_warn_before_the_time_limit_and_the_chain_is_bounded(tmp_path):
    b = slurm.SlurmBackend("podman", time="4m", signal_grace=90, max_allocations=4)
    p = b.plan(spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, job_id="train-x", max_restarts=2))
    sbatch = dict(p.files)["job.sbatch"]
    assert "#SBATCH --signal=B:USR1@90\n" in sbatch and "#SBATCH --time=00:04:00\n" in sbatch
    assert "MAX_ALLOCATIONS=4 MAX_RESTARTS=2 NODES=2\n" in sbatch
    assert sbatch.rstrip().endswith('next_allocation\nexit "$rc"')
    assert "#SBATCH --requeue\n" in sbatch   # a node failure or preemption is a restart
    assert f"CHECKPOINTS={p.checkpoints}" in sbatch and p.checkpoints == str(p.dir / "checkpoints")
    node = dict(p.files)["node.sh"]
    assert "FLEETBOX_ATTEMPT=\"$FLEETBOX_ATTEMPT\"" in node   # filled per allocation, on the node


@pytest.mark.parametrize("value,seconds", [("2", 120), ("2:30", 150), ("1:00:00", 3600), ("1-0", 86400),
                                           ("1-2:03", 93780), ("0-0:0:45", 45), ("unlimited", None), ("", None)])
def test_slurm_time_limits_in_seconds(value, seconds):
    assert slurm.time_seconds(value) == seconds


@pytest.mark.parametrize("value,slurms", [("48h", "2-00:00:00"), ("90m", "01:30:00"), ("1.5h", "01:30:00"),
                                          ("90s", "00:01:30"), ("100.5s", "00:01:41"), ("2-12", "2-12"),
                                          ("4:00:00", "4:00:00"), ("unlimited", "unlimited"), ("", "")])
def test_time_takes_fleetboxs_durations_in_slurms_form_and_slurms_own_as_they_are(value, slurms):
    assert slurm.slurm_time(value) == slurms


@pytest.mark.parametrize("time,grace,work", [("2m", 120, 0), ("2m", 90, 0), ("3m", 90, 30), ("2:59", 60, 59)])
def test_a_time_limit_that_leaves_under_a_minute_of_work_is_refused(time, grace, work):
    """Slurm may warn up to a minute before the grace: --time - grace - 60 s is what an allocation keeps."""
    with pytest.raises(UserError, match=rf"leaves {work} s of work per allocation, under the 60 s") as e:
        slurm.SlurmBackend("podman", time=time, signal_grace=grace)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("time,grace,notes", [("3m", 60, 1), ("6m", 60, 1), ("7m", 60, 0), ("1:00:00", 120, 0),
                                              ("", 120, 0)])
def test_a_time_limit_that_leaves_under_five_minutes_is_warned_about(time, grace, notes):
    plan = slurm.SlurmBackend("podman", time=time, signal_grace=grace).plan(spec_mod.JobSpec(
        variant=matrix.load().get("cpu"), nodes=2, job_id="train-x", image="localhost/fleetbox/paddle:cpu"))
    assert len(plan.notes) == notes and all("of work per allocation" in n for n in plan.notes)


def test_the_warning_is_shown_before_the_plan(tmp_path, monkeypatch):
    from fleetbox.commands import train
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    said = []
    train.train(spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, job_id="train-x"), "slurm",
                {"runtime": "podman", "time": "3m", "signal_grace": 60}, dry_run=True, log=said.append)
    warning = ("warning: --time 3m (180 s) less --signal-grace 60 s and the minute Slurm may warn early leaves 60 s of "
               "work per allocation: start-up and the checkpoint take part of it")
    assert said[1] == warning and "#SBATCH" in said[2]   # after the deadlines, before the batch script


def test_a_runs_folder_with_a_percent_is_refused(tmp_path, monkeypatch):
    """Slurm expands % in --output (%j, %n): the job's own logs would go elsewhere."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs%j"))
    with pytest.raises(UserError, match="cannot be written in an #SBATCH line"):
        slurm.SlurmBackend("podman").plan(spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-x"))


def test_a_followed_log_loses_no_line_when_an_allocation_moves_it_aside(tmp_path):
    """Allocation 1 writes, the reader reads, allocation 1 writes its last lines and its file is moved to
    alloc1/, allocation 2 writes a new file: every line, once, in order."""
    log = tmp_path / "node0.log"
    (tmp_path / "alloc1").mkdir()
    log.write_text("a1\n")
    script = iter([
        lambda: log.open("a").write("a2 after the first read\n"),
        lambda: log.rename(tmp_path / "alloc1" / "node0.log"),
        lambda: None,                                        # between allocations: no file at all
        lambda: log.write_text("b1\n"),
        lambda: log.open("a").write("b2\n"),
    ])
    seen = []

    def running():
        step = next(script, None)
        if step is None:
            return False
        step()
        return True
    slurm.tail_file(log, running, seen.append, poll=0)
    assert seen == ["a1", "a2 after the first read", "b1", "b2"]


def test_the_batch_script_runs_the_hang_watcher_beside_srun_only_with_a_deadline(tmp_path):
    on = sbatch(job(hang_timeout=20.0))
    assert ('[ -z "$PYTHON" ] || { python3 -I /x/runs/train-t-0001/hang.py /x/runs/train-t-0001 "$STEP_NODES" 1 20 '
            '900 "$FLEETBOX_ATTEMPT" "$SRUN" & WATCH=$!; }').replace("/x/runs", str(slurm.settings.runs_root())) in on
    assert "sys.version_info < (3, 8)" in on   # RHEL 8's python3 is 3.6: detection off, said in the batch output
    assert 'rm -f "$JOB_DIR"/node[0-9]*/progress-rank*.json "$JOB_DIR"/node[0-9]*/stacks-rank*.txt ' \
        '"$JOB_DIR"/node[0-9]*/found-metrics-rank*.log "$JOB_DIR"/node[0-9]*/STACKS-REQUEST' in on
    bash_ok(on)
    off = sbatch(job(hang_timeout=0.0, start_timeout=0.0))
    assert "hang.py" not in off and 'WATCH=""' in off
    bash_ok(off)


def test_an_allocation_that_hung_ends_hung_or_restarts(tmp_path):
    rec, _, _, _ = _allocation(tmp_path / "a", state="", rc=143, hung_in="7")
    assert rec["ended"] == "hung"
    rec, sbatch_args, _, _ = _allocation(tmp_path / "b", state="", rc=143, hung_in="7", max_restarts=1)
    assert rec["ended"] == "restart" and "FLEETBOX_RESTARTS=1" in sbatch_args
    rec, _, _, _ = _allocation(tmp_path / "c", state="", rc=143, hung_in="6")   # an earlier job's record
    assert rec["ended"] == "failed"


def _none(tmp_path, venv=None, **kw):
    env = fake_env(tmp_path / "env")
    return slurm.SlurmBackend("none", venv=str(env) if venv is None else venv, **kw)


@pytest.mark.parametrize("given,said", [
    ({"image": "fleetbox/paddle:cpu"}, "--image means a container; with --runtime none the job runs the env given "
                                       "with --venv"),
    ({"mounts": (spec_mod.Mount("/data", "/data"),)}, "--mount means a container; with --runtime none the job "
                                                      "sees the nodes' own file systems"),
    ({"data_dir": "/somewhere"}, "--data-dir means a container; with --runtime none Paddle reads each node's "
                                 "~/.cache/paddle/dataset: seed it with `invoke cache --dest ~/.cache/paddle/dataset`"),
])
def test_with_no_container_the_options_that_mean_one_are_refused_in_one_line(given, said, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555, **given)
    with pytest.raises(UserError) as e:
        _none(tmp_path).plan(spec)
    assert str(e.value) == said


def test_with_no_container_the_default_dataset_cache_is_not_mounted_and_runtime_args_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("FLEETBOX_DATA", str(tmp_path / "cache"))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555,
                            data_dir=str(tmp_path / "cache"))   # what from_options gives when the default exists
    node = dict(_none(tmp_path).plan(spec).files)["node.sh"]
    assert str(tmp_path / "cache") not in node and ".cache" not in node   # no mount, no mount point made
    assert not re.search(r"[ =:]/(fleetbox|workspace)/", node)   # no container path is left
    with pytest.raises(UserError, match="^--runtime-args means a container; with --runtime none no runtime is "
                                        "started$"):
        _none(tmp_path, runtime_args="--ulimit x").plan(spec)


def test_the_env_is_checked_for_every_node_before_anything_is_submitted(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555)
    fake_env(tmp_path / "envs" / "node0")
    with pytest.raises(UserError) as e:   # node1's is missing
        _none(tmp_path, venv=str(tmp_path / "envs" / "{node}")).plan(spec)
    assert str(e.value) == (f"--venv {tmp_path}/envs/node1 is not an env made by `invoke venv` (no fleetbox-env.json): "
                            "make one with `invoke venv --variant cpu --dest DIR`")
    fake_env(tmp_path / "envs" / "node1", variant="cu126")
    with pytest.raises(UserError, match=r"was made for variant 'cu126', not cpu: give --variant cu126"):
        _none(tmp_path, venv=str(tmp_path / "envs" / "{node}")).plan(spec)
    fake_env(tmp_path / "envs" / "node1", python="/nonexistent/python3.11")
    with pytest.raises(UserError, match=r"envs/node1: its interpreter /nonexistent/python3.11 is not here \(a venv "
                                        r"needs it at the same path on every node\)"):
        _none(tmp_path, venv=str(tmp_path / "envs" / "{node}")).plan(spec)
    with pytest.raises(UserError, match="^--runtime none needs --venv PATH"):
        _none(tmp_path, venv="").plan(spec)
    # a placeholder only the node knows: checked there (node.sh), not here
    assert _none(tmp_path, venv=str(tmp_path / "envs" / "{node_ip}")).plan(spec)


def test_venv_is_for_runtime_none_and_modules_for_every_runtime_srun_does_not_start():
    with pytest.raises(UserError, match=r"^--venv is for --runtime none \(no container\); runtime podman runs an "
                                        r"image$"):
        slurm.SlurmBackend("podman", venv="/x")
    with pytest.raises(UserError, match=r"^--modules: pyxis starts the container from srun itself"):
        slurm.SlurmBackend("pyxis", modules="enroot")


@pytest.mark.parametrize("runtime", ["apptainer", "singularity", "podman", "charliecloud"])
def test_a_runtime_from_a_module_is_loaded_before_the_node_looks_for_it(runtime, tmp_path, stubs, monkeypatch):
    """node.sh run as node 1 with the runtime only where its module puts it (a module system whose `module load`
    adds that folder to PATH, as Lmod's does): it starts the container. Without the module system it stops first,
    in one line of the node's log."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    from tests.unit.conftest import run_node
    tool = {"charliecloud": "ch-run"}.get(runtime, runtime)
    site, home = tmp_path / "site", tmp_path / "modules"
    site.mkdir()
    (stubs / tool).rename(site / tool)
    (home / "init").mkdir(parents=True)
    (home / "init" / "bash").write_text(f'module() {{ [ "$1" = load ] && export PATH="{site}:$PATH" '
                                        'LOADEDMODULES="${LOADEDMODULES:+$LOADEDMODULES:}$2"; }\n')
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555,
                            image=given_image(runtime, tmp_path))
    node = dict(slurm.SlurmBackend(runtime, modules=f"{runtime}/1.3").plan(spec).files)["node.sh"]
    node = node.replace("/usr/share/lmod/lmod/init/bash /usr/share/modules/init/bash", "").replace(
        "/etc/profile.d/lmod.sh /etc/profile.d/modules.sh", "")   # this host's own module system, if any: hidden
    proc, calls = run_node(node, stubs, tmp_path, {"MODULESHOME": str(home)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"modules loaded: {runtime}/1.3" in proc.stdout and [c["tool"] for c in calls][-1:] == [tool]
    proc, calls = run_node(node, stubs, tmp_path, {"MODULESHOME": str(tmp_path / "nowhere")})
    assert proc.returncode == 4 and calls == []
    assert proc.stdout.splitlines()[-1] == (f"fleetbox: node 1 on {os.uname().nodename}: no `module` command "
                                            f"(neither Lmod nor Environment Modules is set up here) to load: "
                                            f"{runtime}/1.3")


def test_with_no_container_a_missing_env_or_module_system_is_one_line_in_the_nodes_log(tmp_path, stubs, monkeypatch):
    """Run node.sh as node 1: an env that is not there, then a module with no module system on the node."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    from tests.unit.conftest import run_node
    env = fake_env(tmp_path / "env", python=stubs / "python")
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555)
    node = dict(_none(tmp_path, venv=str(env), modules="dtk/24.04").plan(spec).files)["node.sh"]
    (env / "fleetbox-env.json").unlink()
    (tmp_path / "modules" / "init").mkdir(parents=True)   # a module system that loads it
    (tmp_path / "modules" / "init" / "bash").write_text('module() { export LOADEDMODULES="$2"; }\n')
    proc, calls = run_node(node.replace("/usr/share/lmod/lmod/init/bash /usr/share/modules/init/bash", ""),
                           stubs, tmp_path, {"MODULESHOME": str(tmp_path / "modules")})
    assert proc.returncode == 3 and calls == [], proc.stdout
    assert proc.stdout.splitlines()[-1] == (f"fleetbox: image missing {env} is not an env made by invoke venv on "
                                            f"{os.uname().nodename} (no fleetbox-env.json)")
    fake_env(env, python=stubs / "python")
    # no module command, no init script where the node looks (MODULESHOME points nowhere; the usual paths are
    # checked only when they exist: this host may have one, so the test hides them behind MODULESHOME's own)
    proc, calls = run_node(node.replace("/usr/share/lmod/lmod/init/bash /usr/share/modules/init/bash", "")
                           .replace("/etc/profile.d/lmod.sh /etc/profile.d/modules.sh", ""), stubs, tmp_path,
                           {"MODULESHOME": str(tmp_path / "nowhere")})
    assert proc.returncode == 4 and calls == []
    assert proc.stdout.splitlines()[-1] == (f"fleetbox: node 1 on {os.uname().nodename}: no `module` command "
                                            "(neither Lmod nor Environment Modules is set up here) to load: dtk/24.04")


def test_a_node_that_node_sh_stopped_says_why_in_the_summary(tmp_path):
    log = tmp_path / "node1.log"
    log.write_text("fleetbox: node 1 on n2: eth0 10.0.0.2 -> master 10.0.0.1:29555\n"
                   "ERROR: Unable to locate a modulefile for 'dtk/9'\n"
                   "fleetbox: node 1 on n2: `module load dtk/9` failed: ERROR: Unable to locate a modulefile for "
                   "'dtk/9'\n")
    assert slurm_step.node_said(log) == "`module load dtk/9` failed: ERROR: Unable to locate a modulefile for 'dtk/9'"
    log.write_text("fleetbox: image missing /s/envs/cpu-0 is not an env made by invoke venv on n2 (no x)\n")
    assert slurm_step.node_said(log) == "image missing /s/envs/cpu-0 is not an env made by invoke venv on n2 (no x)"
    log.write_text("fleetbox: node 1 on n2: eth0 10.0.0.2 -> master 10.0.0.1:29555\nTraceback ...\nValueError: x\n")
    assert slurm_step.node_said(log) == ""   # the training ran: its own words are the log's tail
    assert slurm_step.node_said(tmp_path / "missing.log") == ""


def test_with_no_container_a_module_that_did_not_load_stops_the_node_and_the_sites_pythonpath_is_kept(
        tmp_path, stubs, monkeypatch):
    """A `module` that returns 0 without loading (Environment Modules 3.2 for an unknown name) stops the node; a
    loaded one's PYTHONPATH follows the helpers; a relative --venv is made absolute (node.sh runs elsewhere)."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    monkeypatch.chdir(tmp_path)
    from tests.unit.conftest import run_node
    fake_env(tmp_path / "mine", python=stubs / "python")
    (stubs / "module").symlink_to(stubs / "python")   # records its arguments, returns 0, changes nothing
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555)
    node = dict(_none(tmp_path, venv="mine", modules="dtk/24.04").plan(spec).files)["node.sh"]
    assert f"export FLEETBOX_VENV={tmp_path}/mine\n" in node
    proc, calls = run_node(node, stubs, tmp_path, {"LOADEDMODULES": "gcc/12"})
    assert proc.returncode == 4 and [c["tool"] for c in calls] == ["module"]
    assert proc.stdout.splitlines()[-1] == (f"fleetbox: node 1 on {os.uname().nodename}: `module load dtk/24.04` "
                                            "failed: it is not among the loaded modules (gcc/12)")
    proc, calls = run_node(node, stubs, tmp_path, {"LOADEDMODULES": "gcc/12:dtk/24.04", "PYTHONPATH": "/site/py"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (launch,) = [c for c in calls if c["tool"] == "python"]
    assert launch["env"]["PYTHONPATH"] == f"{tmp_path}/runs/train-t-1/{slurm.HELPERS}:/site/py"


def test_two_envs_from_one_lock_report_one_identity(tmp_path, stubs):
    """shell/identify_env.sh as node.sh runs it: the lock's sha256 and the interpreter, not when the env was made."""
    script = runtimes.template("identify_env.sh", RECORD=runtimes.ENV_RECORD)
    said = []
    for k, made in enumerate((1000, 2000)):
        env = fake_env(tmp_path / f"env{k}", python=stubs / "python")
        (env / "fleetbox-env.json").write_text(json.dumps({"variant": "cpu", "lock_sha256": "ab" * 32, "made": made,
                                                           "fleetbox_revision": str(k)}, indent=k))
        out = subprocess.run(["bash", "-c", script], env={"FLEETBOX_VENV": str(env), "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True)
        said.append(out.stdout.strip())
    assert said == [f"fleetbox: image env-sha256 {'ab' * 32} {stubs / 'python'}"] * 2



def cpus_asked(files) -> tuple[list[str], list[str]]:
    """What job.sbatch asks for each node's task, and what its srun asks for the step."""
    text = sbatch(files)
    head = [ln for ln in text.splitlines() if ln.startswith(("#SBATCH --cpus", "#SBATCH --excl", "#SBATCH --mem"))]
    srun = next(ln for ln in text.splitlines() if ln.startswith("srun --kill-on-bad-exit"))
    return head, [w for w in srun.split() if w.startswith(("--cpus", "--excl", "--mem"))]


@pytest.mark.parametrize("variant,procs,given,head,step", [
    ("cpu", 1, {}, ["#SBATCH --cpus-per-task=2"], ["--cpus-per-task=2"]),   # 2 a rank
    ("cpu", 3, {}, ["#SBATCH --cpus-per-task=6"], ["--cpus-per-task=6"]),
    ("cu126", 2, {}, ["#SBATCH --cpus-per-task=8"], ["--cpus-per-task=8"]),   # 4 a rank with a GPU
    ("dcu", 4, {"cpus_per_node": "6"}, ["#SBATCH --cpus-per-task=6"], ["--cpus-per-task=6"]),
    ("cpu", 2, {"cpus_per_node": "all"}, ["#SBATCH --mem=0", "#SBATCH --exclusive"],
     ['--cpus-per-task="$SLURM_CPUS_ON_NODE"']),
    ("cpu", 2, {"cpus_per_node": "ALL", "mem": "64G"}, ["#SBATCH --mem=64G", "#SBATCH --exclusive"],
     ['--cpus-per-task="$SLURM_CPUS_ON_NODE"']),
    ("cpu", 1, {"mem": "0"}, ["#SBATCH --mem=0", "#SBATCH --cpus-per-task=2"], ["--cpus-per-task=2"]),
])
def test_each_nodes_task_asks_for_cpus_for_its_ranks_and_srun_asks_again(variant, procs, given, head, step, tmp_path,
                                                                          monkeypatch):
    """Slurm gives a task one CPU unless asked; srun of Slurm 22.05 to 23.02 does not take sbatch's
    --cpus-per-task, and a step of an --exclusive job gets one CPU unless it asks for the node's."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    spec = spec_mod.JobSpec(variant=matrix.load().get(variant), nodes=2, procs_per_node=procs, job_id="train-t-0001",
                            port=29555)
    files = dict(slurm.SlurmBackend("apptainer", **given).plan(spec).files)
    assert cpus_asked(files) == (head, step)
    bash_ok(sbatch(files))


def test_fewer_cpus_than_ranks_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), procs_per_node=4, job_id="train-t-0001", port=29555)
    with pytest.raises(UserError, match=r"^--cpus-per-node 3 is fewer than the 4 ranks on each node"):
        slurm.SlurmBackend("apptainer", cpus_per_node="3").plan(spec)


@pytest.mark.parametrize("words,said", [
    ("--exclusive", "--exclusive is set by fleetbox: give --cpus-per-node all instead"),
    ("--excl", "--excl is set by fleetbox: give --cpus-per-node all instead"),   # sbatch reads it as --exclusive
    ("--cpus-per-task=8", "give --cpus-per-node instead"), ("--mem=4G", "give --mem instead"),
    ("--partition=gpu", "give --partition instead"), ("--gpus=4", "give --gpus-per-node instead"),
    ("--requeue", "give --max-restarts instead"), ("--job-name=x", "give --job-id instead"),
    ("--output=/tmp/x", "--output is not among the sbatch options fleetbox passes on"),
    ("--ntasks=8", "--ntasks is not among"), ("--array=1-4", "--array is not among"),
    ("--export=NONE", "--export is not among"), ("--test-only", "--test-only is not among"),
    ("--tasks-per-node=4", "--tasks-per-node is not among"),   # sbatch's alias of --ntasks-per-node
    ("--mem-per-cpu=1G", "--mem-per-cpu is not among"), ("--gres=gpu:8", "--gres is not among"),
    ("--clusters=other", "--clusters is not among"), ("--mail-t=END", "--mail-t is not among"),   # whole names
    ("--comment", "--comment takes a value: write --comment=VALUE"),   # else it takes the next line's word
    ("--comment=", "is not an sbatch long"),
    ("--contiguous=yes", "--contiguous takes no value: write --contiguous"),
    ("-w node1", "'-w' is not an sbatch long option"), ("mail-type=END", "is not an sbatch long option"),
    ("--mail-type END", "--mail-type takes a value: write --mail-type=VALUE"), ("--comment=a b", "'b' is not"),
    ("--begin=now+1hour --x='a\"b'", "is not an sbatch long option"), ("--a=\"unclosed", "cannot be split"),
])
def test_sbatch_args_are_long_options_that_fleetbox_does_not_set(words, said):
    with pytest.raises(UserError, match=re.escape(said)) as e:
        slurm.SlurmBackend("podman", sbatch_args=words)
    assert "\n" not in str(e.value)


def checked_paths(node: str) -> list[str]:
    """The paths node.sh checks before the runtime starts."""
    m = re.search(r"^for p in (.*); do \[ -e \"\$p\" \]", node, re.M)
    return shlex.split(m.group(1)) if m else []


@pytest.mark.parametrize("runtime", list(runtimes.RUNTIMES))
def test_each_node_checks_the_paths_it_needs_from_the_shared_file_system(runtime, tmp_path, monkeypatch):
    """Every path the node takes from here (script, helpers, logs, checkpoints, dataset cache, a file image or
    env), none of a device's own (/opt/hyhal), and none where node.sh runs inside the container (pyxis)."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    cache = tmp_path / "cache"
    cache.mkdir()
    own = {"venv": str(fake_env(tmp_path / "env", "dcu"))} if runtime == runtimes.Host.name else {}
    spec = spec_mod.JobSpec(variant=matrix.load().get("dcu"), job_id="train-t-0001", port=29555,
                            data_dir="" if own else str(cache))
    plan = slurm.SlurmBackend(runtime, **own).plan(spec)
    paths = checked_paths(dict(plan.files)["node.sh"])
    if runtime == "pyxis":
        assert paths == []
        return
    assert {str(settings.ROOT / "train"), str(settings.ROOT / "train" / "smoke.py"), f"{plan.dir}/helpers",
            f"{plan.dir}/node$SLURM_NODEID", f"{plan.dir}/checkpoints", *([] if own else [str(cache)])} <= set(paths)
    assert "/opt/hyhal" not in paths and str(settings.HELPERS) not in paths
    assert (plan.image in paths) == plan.image.startswith("/"), (plan.image, paths)   # a file image or an env


def test_submit_warns_in_one_line_of_paths_the_nodes_may_not_see(tmp_path, monkeypatch, stubs):
    """Read from the machine's mount table (here a recorded login node's, where /tmp is a tmpfs and /home NFS)."""
    from tests.unit.test_filesystems import LOGIN_NODE
    table = tmp_path / "mountinfo"
    table.write_text(LOGIN_NODE.replace(" /tmp ", f" {tmp_path} "))   # this test's folder stands for /tmp
    monkeypatch.setattr(slurm.filesystems, "MOUNTINFO", table)
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    (stubs / "sbatch").write_text("#!/bin/sh\necho 42\n")
    (stubs / "sbatch").chmod(0o755)
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-0001", port=29555,
                            image=given_image("podman", tmp_path))
    b = slurm.SlurmBackend("podman")
    said = []
    b.submit(b.plan(spec), log=said.append)
    warned = [s for s in said if s.startswith("warning: ")]
    assert warned == [f"warning: the runs folder {tmp_path}/runs is on tmpfs ({tmp_path}); the script "
                      f"{settings.ROOT}/train/smoke.py is on a local ext4 disk (/dev/sda2 at /), while /home is on "
                      f"nfs4; the checkpoint folder {tmp_path}/runs/train-t-0001/checkpoints is on tmpfs ({tmp_path}): "
                      "Slurm's nodes see only file systems they mount too (NFS, Lustre, GPFS, BeeGFS, CephFS, ...); "
                      "a node that cannot see one stops, naming it"]
    assert sorted(p.name for p in (tmp_path / "runs" / "train-t-0001" / slurm.HELPERS).iterdir()) == \
        sorted(p.name for p in settings.HELPERS.glob("*.py"))   # the nodes get the helpers from the job folder


@pytest.mark.parametrize("runtime", ["apptainer", "charliecloud", "podman", "none"])
def test_a_node_that_cannot_see_the_script_stops_naming_it_before_its_runtime_starts(runtime, tmp_path, stubs,
                                                                                     monkeypatch):
    """node.sh run as node 1 after the script's folder went away (as on a node that does not mount it): exit 3,
    one line naming the script, no runtime started (runtime none: before it changes into the script's folder).
    A user's --mount is not checked: Docker and Podman make a node-local source."""
    from tests.unit.conftest import run_node
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "train.py").write_text("")
    own = {"venv": str(fake_env(tmp_path / "env", python=stubs / "python"))} if runtime == "none" else {}
    mounts = () if own else (spec_mod.Mount(str(tmp_path / "scratch-on-each-node"), "/scratch", False),)
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555,
                            script=str(ws / "train.py"), mounts=mounts,
                            image="" if own else given_image(runtime, tmp_path))
    node = dict(slurm.SlurmBackend(runtime, **own).plan(spec).files)["node.sh"]
    (ws / "train.py").unlink()
    ws.rmdir()
    proc, calls = run_node(node, stubs, tmp_path)
    assert proc.returncode == 3 and calls == [], proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == (f"fleetbox: node 1 on {os.uname().nodename}: {ws} is not on this node: it "
                                            "must be on a file system every node mounts")
    assert str(tmp_path / "scratch-on-each-node") not in checked_paths(node)


@pytest.mark.parametrize("runtime", list(runtimes.RUNTIMES))
def test_where_each_runtimes_ranks_write_progress_is_where_the_hang_watcher_reads(runtime, tmp_path, monkeypatch):
    """run/hang.py reads the job folder's node<rank>/ on the batch node (progress files, stacks, the stack request);
    the ranks write where FLEETBOX_PROGRESS_DIR and the launcher's --log_dir say, inside their container. Each
    runtime's own mounts must take one to the other (Pyxis mounts the job folder elsewhere)."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    own = {"venv": str(fake_env(tmp_path / "env"))} if runtime == runtimes.Host.name else {}
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-0001", port=29555)
    b = slurm.SlurmBackend(runtime, **own)
    job_dir = tmp_path / "runs" / "train-t-0001"
    t = b.node_run(spec, "train-t-0001", job_dir, job_dir / "checkpoints")
    rt = b.runtime
    rank_env = rt.exports(t) if runtime == runtimes.Host.name else t.env   # no container: node.sh exports them
    command = [str(w) for w in rt.launch(t, "img")] if runtime == runtimes.Host.name else list(t.command)
    watched = f"{job_dir}/{{node}}"   # hang.py's node<k>, before the placeholder is filled
    assert rt.on_host(t, rank_env["FLEETBOX_PROGRESS_DIR"]) == watched
    assert rt.on_host(t, command[command.index("--log_dir") + 1]) == watched
    assert rt.on_host(t, rank_env["FLEETBOX_CHECKPOINT_DIR"]) == str(job_dir / "checkpoints")


@pytest.mark.parametrize("runtime", list(runtimes.RUNTIMES))
def test_a_node_whose_rank_a_collective_timeout_ended_is_held_for_its_peers_stacks_and_marked(runtime, tmp_path,
                                                                                             monkeypatch):
    """srun --kill-on-bad-exit would stop the stuck rank's node at once: the ended rank's node.sh marks its log
    folder (where run/hang.py looks) and waits; any other end is passed on at once, and a node being stopped is
    never held. Run in bash as rendered from the launch on, a stand-in launcher and log folder in their place."""
    monkeypatch.setattr(fragments, "HOLD_S", 1)
    (tmp_path / "image.sqsh").touch()
    image = {"pyxis": str(tmp_path / "image.sqsh"), runtimes.Host.name: None}.get(runtime, "/dev/null")
    text = node_script(job(runtime=runtime, **({"image": image} if image else {})))
    lines = text.splitlines()
    launch = next(i for i, ln in enumerate(lines) if ln == "LAUNCHER=$!") - 1
    logs = next(i for i, ln in enumerate(lines) if ln.startswith("LOGS="))
    job_dir = str(slurm.settings.runs_root() / "train-t-0001")
    seen_at = "/fleetbox/job" if runtime == "pyxis" else job_dir   # where node.sh runs: in its container, or not
    assert lines[logs] == f'LOGS={seen_at}/node"$SLURM_NODEID"', lines[logs]
    assert lines[launch].endswith(" &") and lines[-1] == 'exit "$rc"'
    assert not any(ln.startswith("exec ") for ln in lines)
    rest = [f"LOGS={tmp_path}/node0" if ln.startswith("LOGS=") else ln for ln in lines[launch + 1:]]
    gloo = (Path(__file__).parent.parent / "probes" / "collective-timeout" / "gloo-plain-rank0.log").read_text()
    peer = "what():  [/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [10.1.1.1]:7\n"

    def run(launcher, log, stop_after=None):
        (tmp_path / "node0").mkdir(exist_ok=True)
        (tmp_path / "node0" / "workerlog.0").write_text(log)
        (tmp_path / "node0" / "COLLECTIVE-TIMEOUT").unlink(missing_ok=True)
        stand_in = f"bash -c {shlex.quote(launcher)} 2>/dev/null &"
        script = "\n".join(["set -euo pipefail; SLURM_NODEID=0", stand_in, *rest])
        t0 = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        if stop_after is not None:   # Slurm signals every process of the step
            time.sleep(stop_after)
            os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        return proc.returncode, err, time.monotonic() - t0, (tmp_path / "node0" / "COLLECTIVE-TIMEOUT").exists()
    aborted = (Path(__file__).parent.parent / "probes" / "collective-timeout" / "gloo-loop-abort-rank0.log").read_text()
    for log in ("x" * 100_000 + "\n" + gloo, peer, aborted):   # the line in the log's last 64 KiB
        rc, err, took, marked = run("exit 250", log)
        assert (rc, marked) == (250, True) and 1 <= took < 8, (err, took)
        assert err == f"fleetbox: node 0 on {os.uname().nodename}: workerlog.0 ended waiting in a collective; " \
                      "holding the node for its peers' stacks\n"
    for code, log in ((1, "Traceback: ValueError\n"), (0, gloo)):   # another failure, or none: not held
        rc, err, took, marked = run(f"exit {code}", log)
        assert (rc, marked, err) == (code, False, "") and took < 2
    if not runtimes.RUNTIMES[runtime].kills_client_only:   # (else its own trap removes its container at once)
        saved = tmp_path / "saved"
        rc, err, took, marked = run(f'trap "sleep 1; touch {saved}; exit 250" TERM; while :; do sleep 0.1; done',
                                    gloo, stop_after=0.5)
        assert (rc, marked, saved.exists(), err) == (250, False, True, "") and took < 3, (err, took)


def test_without_hang_detection_node_sh_hands_the_node_to_the_launcher():
    text = node_script(job(runtime="apptainer", image="/dev/null", hang_timeout=0.0, start_timeout=0.0))
    assert "LOGS=" not in text and text.splitlines()[-1].startswith("exec apptainer exec ")


@pytest.mark.parametrize("fails,want", [(0, "10.1.2.3"), (2, "10.1.2.3"), (9, "")])
def test_the_batch_script_asks_a_busy_controller_again_for_the_masters_address(fails, want, tmp_path,
                                                                              monkeypatch):
    """Run as rendered with a stand-in scontrol that times out `fails` times: the address once it answers; with
    no answer the script goes on with the host name (set -euo pipefail would have ended it at once)."""
    monkeypatch.setattr(slurm, "START_WAITS", (0, 0, 0))
    asked = next(ln.strip() for ln in sbatch(job()).splitlines() if ln.strip().startswith("MASTER_ADDR="))
    stub = tmp_path / "scontrol"
    stub.write_text(f'#!/bin/bash\nn=$(cat {tmp_path}/n 2>/dev/null || echo 0); echo $((n + 1)) > {tmp_path}/n\n'
                    f'if [ "$n" -lt {fails} ]; then echo "slurm_load_node error: Socket timed out on send/recv '
                    f'operation" >&2; exit 1; fi\necho "NodeName=$3 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=$3"\n')
    stub.chmod(0o755)
    proc = subprocess.run(["bash", "-c", f'set -euo pipefail; MASTER_HOST=n1\n{asked}\necho "addr=$MASTER_ADDR"'],
                          capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"addr={want}\n", "")
    assert int((tmp_path / "n").read_text()) == min(fails + 1, 3)


def test_slurm_words_its_own_job_id_and_state_and_its_summary_keeps_them(tmp_path):
    """The table's `(Slurm job 77, ...)` and `job ended <state>` are Slurm's words (SlurmResult), not JobResult's;
    summary.json keeps scheduler_job and scheduler_state, which scripts read."""
    import json
    h = _recorded_job(tmp_path, "", {})
    r = slurm.SlurmBackend(runtime="podman").result(h, "NODE_FAIL")
    assert r.table().splitlines()[0] == "job train-x: FAILED (Slurm job 77, NODE_FAIL)"
    assert r.reason() == "job ended NODE_FAIL"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["scheduler_job"], summary["scheduler_state"]) == ("77", "NODE_FAIL")


def test_the_shells_sbatch_and_srun_variables_never_steer_the_job_fleetbox_planned(tmp_path, monkeypatch, stubs):
    """Slurm takes SBATCH_* over the script's #SBATCH lines, and srun in the job reads SLURM_*: a site's module set
    them silently. Those that would change what fleetbox planned are left out of sbatch's (and so the job's)
    environment and named in one line; a site's default the script does not set is taken, and said."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    (stubs / "sbatch").write_text('#!/bin/sh\nenv > "$(dirname "$0")/sbatch.env"\necho 42\n')
    (stubs / "sbatch").chmod(0o755)
    steering = {"SBATCH_PARTITION": "debug", "SBATCH_OPEN_MODE": "truncate", "SBATCH_ARRAY_INX": "0-3",
                "SBATCH_EXPORT": "NONE", "SLURM_CPU_BIND": "none", "SLURM_NTASKS": "64"}
    kept = {"SBATCH_ACCOUNT": "proj42", "SBATCH_QOS": "long", "SLURM_CONF": "/etc/slurm/slurm.conf",
            "SLURM_TIME_FORMAT": "relative"}
    for k, v in {**steering, **kept}.items():
        monkeypatch.setenv(k, v)
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-0001", port=29555,
                            image=given_image("podman", tmp_path))
    b = slurm.SlurmBackend("podman", partition="gpu")
    plan = b.plan(spec)
    said = []
    b.submit(plan, log=said.append)
    env = dict(ln.split("=", 1) for ln in (stubs / "sbatch.env").read_text().splitlines() if "=" in ln)
    assert [k for k in steering if k in env] == [] and all(env.get(k) == v for k, v in kept.items())
    line = ("ignored from the environment: SBATCH_ARRAY_INX=0-3 (--array would change the job fleetbox planned), "
            "SBATCH_EXPORT=NONE (--export would change the job fleetbox planned), SBATCH_OPEN_MODE=truncate "
            "(fleetbox passes --open-mode), SBATCH_PARTITION=debug (fleetbox passes --partition), "
            "SLURM_CPU_BIND=none (the job's srun would read it), SLURM_NTASKS=64 (the job's srun would read it); "
            "taken from the environment: SBATCH_ACCOUNT=proj42, SBATCH_QOS=long")
    assert line in said and b.describe(plan).splitlines()[1] == f"# {line}"
    monkeypatch.setenv("SBATCH_QOS", "long\n#SBATCH --partition=evil")   # still one line, in the log and dry-run
    assert slurm.environment_line(b.plan(spec).environment).endswith(
        "taken from the environment: SBATCH_ACCOUNT=proj42, SBATCH_QOS=long #SBATCH --partition=evil")


# -- the next step in the allocation (slurm_step.py, run from the job folder's pack as job.sbatch runs it) --

KILLED = ("srun: error: node2: task 1: Exited with exit code 137\nsrun: Job step aborted: Waiting up to 62 seconds "
          "for job step to finish.\nsrun: error: node1: task 0: Terminated\n")
START = "fleetbox: allocation 1 (Slurm job 7) starts from checkpoint step 0\n"


def _next_step(tmp_path, batch: str, *, spares="node3", min_nodes=0, restarts=0, max_restarts=1, said=None):
    """A failed step's job folder (node k ran on node<k+1>, `said`: what node.sh printed last on a node), and the
    pack's answer: (stdout, the line it said, what it recorded of a spare)."""
    job = tmp_path / "train-s"
    job.mkdir(exist_ok=True)
    (job / "slurm-7.out").write_text("fleetbox: run 1 of Slurm job 7\n" + batch)
    for k in (0, 1):
        (job / f"node{k}.log").write_text(f"fleetbox: node {k} on node{k + 1}: eth0 10.0.0.{k} -> master\n"
                                          + (said or {}).get(k, "training...\n"))
    slurm_step.pack(job / slurm_step.ALLOCATION_PYZ)
    proc = subprocess.run(["python3", "-I", "-S", str(job / slurm_step.ALLOCATION_PYZ), str(job), "7", "1", "1",
                           str(min_nodes), str(restarts), str(max_restarts), "node1,node2", spares or "-"],
                          capture_output=True, text=True, env={"SLURM_JOB_ID": "7", "PATH": os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr, slurm_step.replaced(job, "7")


def test_after_a_killed_node_the_next_step_puts_the_spare_in_its_place_spending_a_restart(tmp_path):
    out, said, replaced = _next_step(tmp_path, START + KILLED)
    assert out == "node2 2 1\n"
    assert said.startswith("fleetbox: attempt 0 failed: node1 (rank 1) on node2 exited with exit code 137") and \
        said.rstrip().endswith("the spare node3 takes node1's place (node2 is left out for the rest of the job): "
                               "restarting from the newest checkpoint on 2 nodes (restart 1 of 1)")
    assert [{k: r[k] for k in ("attempt", "node", "host", "by", "ran")} for r in replaced] == \
        [{"attempt": 1, "node": 1, "host": "node2", "by": "node3", "ran": True}]


def test_with_no_spare_min_nodes_goes_on_with_one_node_fewer(tmp_path):
    out, said, replaced = _next_step(tmp_path, START + KILLED, spares="", min_nodes=1)
    assert (out, replaced) == ("node2 1 1\n", [])
    assert "going on without node1 (node2) from the newest checkpoint, on 1 nodes (restart 1 of 1): the world is " \
           "1 ranks, was 2" in said


@pytest.mark.parametrize("why,kw", [
    ("no restart left", dict(restarts=1)),
    ("no spare and no --min-nodes", dict(spares="")),
    ("the failure is an earlier step's", dict(batch=KILLED + START)),
    ("every node stopped alike before the training", dict(said={k: f"fleetbox: node {k} on node{k + 1}: /s is not on "
                                                                f"this node\n" for k in (0, 1)},
                                                          batch=START + "srun: error: node1: task 0: Exited with exit "
                                                                "code 3\nsrun: error: node2: task 1: Exited with exit "
                                                                "code 3\n")),
])
def test_the_next_step_is_not_this_allocations(tmp_path, why, kw):
    out, said, replaced = _next_step(tmp_path, kw.pop("batch", START + KILLED), **kw)
    assert (out, said, replaced) == ("", "", []), why


@pytest.mark.parametrize("other_trained", [True, False])
def test_a_node_that_stopped_before_the_training_is_replaced_spending_no_restart_where_another_one_trained(
        tmp_path, other_trained):
    """Node 1 stopped in node.sh's checks; node 0 was stopped by srun: where node 0's workers had started, node 1
    alone is at fault and a spare takes its place without a restart; where they had not (the same checks may
    fail everywhere), the spare spends one."""
    if other_trained:
        (tmp_path / "train-s" / "node0").mkdir(parents=True)
        (tmp_path / "train-s" / "node0" / "workerlog.0").write_text("step 0\n")
    out, said, replaced = _next_step(
        tmp_path, START + "srun: error: node2: task 1: Exited with exit code 3\nsrun: error: node1: task 0: "
        "Terminated\n", max_restarts=1,
        said={1: "fleetbox: node 1 on node2: /s is not on this node: it must be on a file system every node mounts\n"})
    if other_trained:
        assert out == "node2 2 0\n" and said.rstrip().endswith("(no restart spent: it never started)"), said
    else:
        assert out == "node2 2 1\n" and said.rstrip().endswith("(restart 1 of 1)"), said
    assert [(r["host"], r["by"], r["ran"]) for r in replaced] == [("node2", "node3", False)]


def test_a_step_after_one_node_fewer_that_the_time_limit_ended_is_an_attempt_of_its_own_on_its_nodes(tmp_path):
    """Slurm job 77 went on with one node fewer (recorded), and its time limit then killed the batch script during
    the next step (no record): that step is the last attempt, on 1 node, timed out, and no node is blamed."""
    h = _recorded_job(tmp_path, "fleetbox: run 1 of Slurm job 77\n" + START.replace("7)", "77)") +
                      "srun: error: node1: task 0: Terminated\n", {0: 1_000_000_000})
    rec = {"chain": "77", "allocation": 1, "max_allocations": 1, "slurm_job": "77", "from_step": 0, "to_step": 4,
           "state": "running", "exit": 1, "ended": "fewer", "next": "", "nodes": 2, "left_out": "node2"}
    r = slurm.SlurmBackend(runtime="podman").result(h, "TIMEOUT", "77", [rec])
    assert (r.timed_out, r.culprit, [n.node for n in r.nodes]) == (True, None, ["node0"])
    assert [(a["attempt"], a["nodes"], a["ok"]) for a in r.attempts] == [(0, 2, False), (1, 1, False)]
    assert r.attempts[0]["ended"] == ("failed (exit 1); node2 left out, one node fewer: restarted from step 4 in the "
                                      "same Slurm job 77")
    assert r.attempts[1]["ended"] == "ended with no record of its own (Slurm: TIMEOUT)"


def test_after_a_hang_the_spare_takes_the_place_of_the_node_its_stacks_blame(tmp_path):
    """The watcher stopped the step (every task Terminated) and kept hang-0/hang.json naming node 0: node1 is left
    out, whatever srun's order."""
    (tmp_path / "train-s" / "hang-0").mkdir(parents=True)
    (tmp_path / "train-s" / "hang-0" / "hang.json").write_text(json.dumps(
        {"node": 0, "slurm_job": "7", "kind": "hang", "ranks": [0], "text": "node0 (rank 0) hung: no progress"}))
    out, said, replaced = _next_step(tmp_path, START + "srun: error: node2: task 1: Terminated\n"
                                     "srun: error: node1: task 0: Terminated\n")
    assert out == "node1 2 1\n" and "attempt 0 failed: node0 (rank 0) hung: no progress" in said, said
    assert [(r["node"], r["host"], r["by"]) for r in replaced] == [(0, "node1", "node3")]
