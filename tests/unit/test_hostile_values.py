"""Hostile values in every user-controlled field, rendered for every runtime and executed by bash with stub
runtime commands that record what they were given: the payload never runs, and each value reaches the
container (and the training script's argv and environment) unchanged, or the runtime refuses it in one line."""
import json
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest

from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import runtimes, slurm
from fleetbox.run.spec import Mount
from tests.unit.conftest import given_image, run_node

PAYLOADS = ["$(touch {m})", "`touch {m}`", "a'b\"c", "two words", "new\nline", ";touch {m};", "$HOME", "{{x}}"]

def hostile_spec(tmp_path, payload, **kw):
    src = tmp_path / ("data " + payload.replace("/", "_").replace("\n", "_"))
    src.mkdir(exist_ok=True)
    return spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, job_id="train-evil-0001", port=29555,
                            args=("--x", payload, "{rank}"), env={"EVIL": payload, "WHERE": "{node}"},
                            mounts=(Mount(str(src), "/data/" + payload.replace("\n", "_"), True),), **kw)


def run_node_script(text, stubs, tmp_path):
    proc, calls = run_node(text, stubs, tmp_path)
    assert list((tmp_path / "cwd").iterdir()) == []   # a payload that ran would leave a file here (or at its marker)
    assert proc.returncode == 0, proc.stderr
    return calls


def carried(call, runtime):
    """(argv after the image, {env}, [mount specs]) as the runtime was told them."""
    argv = call["argv"]
    if runtime == "pyxis":   # the stub is `python` itself, run inside the container
        return argv, call["env"], None
    env, mounts = {}, []
    flags = {"docker": ("-e", "-v"), "podman": ("-e", "-v"), "apptainer": (None, "--bind"),
             "singularity": (None, "--bind"), "charliecloud": (None, "-b")}
    e_flag, v_flag = flags[runtime]
    for i, a in enumerate(argv):
        if a == e_flag:
            k, _, v = argv[i + 1].partition("=")
            env[k] = v
        if a.startswith("--set-env="):
            k, _, v = a[len("--set-env="):].partition("=")
            env[k] = v
        if a == v_flag:
            mounts.append(argv[i + 1])
    if runtime in ("apptainer", "singularity"):
        prefix = f"{runtime.upper()}ENV_"   # what each takes off on the way in
        env = {k[len(prefix):]: v for k, v in call["env"].items() if k.startswith(prefix)}
    cmd = argv[argv.index("python"):]
    return cmd, env, mounts


@pytest.mark.parametrize("runtime", [r for r in runtimes.RUNTIMES if runtimes.RUNTIMES[r].has_image])
@pytest.mark.parametrize("raw", PAYLOADS)
def test_a_hostile_value_never_runs_and_arrives_unchanged(runtime, raw, stubs, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    marker = tmp_path / "pwned"
    payload = raw.format(m=marker)
    image = given_image(runtime, tmp_path)
    spec = hostile_spec(tmp_path, payload, iface="eth0", image=image)
    backend = slurm.SlurmBackend(runtime, runtime_args="--opt 'x y'")
    try:
        plan = backend.plan(spec)
    except UserError as e:   # refused for this runtime: one line that names the field
        assert "\n" not in str(e) and ("--env EVIL" in str(e) or "mount" in str(e)), e
        assert runtime in ("apptainer", "singularity", "charliecloud", "pyxis") or "\n" in payload
        return
    files = dict(plan.files)
    calls = run_node_script(files["node.sh"], stubs, tmp_path)
    assert not marker.exists(), "the payload ran"
    (call,) = [c for c in calls if c["tool"] == {"charliecloud": "ch-run", "pyxis": "python"}.get(runtime, runtime)]
    cmd, env, mounts = carried(call, runtime)
    assert cmd[cmd.index("--rank") + 1] == "1" and cmd[-3:] == ["--x", payload, "1"]   # {rank} filled per node
    assert env["EVIL"] == payload and env["WHERE"] == "node1" and env["GLOO_SOCKET_IFNAME"] == "eth0"
    if mounts is not None:
        assert any(m.startswith(str(tmp_path / "data ")) for m in mounts)
    if runtime != "pyxis":
        argv = call["argv"]
        assert argv[argv.index(image) - 2:argv.index(image)] == ["--opt", "x y"]   # --runtime-args words
    # the batch script: srun's own arguments (pyxis mounts) arrive whole, nothing runs
    plan.dir.mkdir(parents=True, exist_ok=True)   # submit makes it
    calls = run_node_script(files["job.sbatch"], stubs, tmp_path)
    assert not marker.exists()
    srun = calls[0]["argv"]
    if runtime == "pyxis":
        mounts = next(a for a in srun if a.startswith("--container-mounts="))
        assert f"{tmp_path}/data " in mounts and "/fleetbox/job" in mounts


@pytest.mark.parametrize("raw", PAYLOADS)
def test_with_no_container_a_hostile_value_never_runs_and_arrives_unchanged(raw, stubs, tmp_path, monkeypatch):
    """Runtime none: the env's path (with a placeholder), the modules, the arguments and the environment reach the
    env's Python and `module load` unchanged; the container paths become the real ones."""
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    marker = tmp_path / "pwned"
    payload = raw.format(m=marker)
    envs = tmp_path / ("envs " + payload.replace("/", "_").replace("\n", "_"))
    for k in (0, 1):   # what `invoke venv` makes, as far as the node script looks: the record, bin/python
        (envs / f"node{k}" / "bin").mkdir(parents=True)
        (envs / f"node{k}" / "bin" / "python").symlink_to(stubs / "python")
        (envs / f"node{k}" / "fleetbox-env.json").write_text(json.dumps({"variant": "cpu"}))
    (stubs / "module").symlink_to(stubs / "python")
    spec = replace(hostile_spec(tmp_path, payload, iface="eth0"), mounts=())
    backend = slurm.SlurmBackend("none", venv=f"{envs}/{{node}}", modules=f"{shlex.quote(payload)} dtk/24.04")
    plan = backend.plan(spec)
    # a stub `module` cannot change the shell's environment: the loaded list is the one a module system keeps
    proc, calls = run_node(dict(plan.files)["node.sh"], stubs, tmp_path, {"LOADEDMODULES": f"{payload}:dtk/24.04"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not marker.exists() and list((tmp_path / "cwd").iterdir()) == [], "the payload ran"
    assert [c["argv"] for c in calls if c["tool"] == "module"] == [["load", payload], ["load", "dtk/24.04"]]
    (call,) = [c for c in calls if c["tool"] == "python"]
    cmd, env = call["argv"], call["env"]
    assert cmd[:2] == ["-m", "paddle.distributed.launch"] and cmd[-3:] == ["--x", payload, "1"]
    assert cmd[cmd.index("--rank") + 1] == "1" and cmd[cmd.index("--log_dir") + 1] == f"{plan.dir}/node1"
    assert cmd[-4] == str(spec.script_path)   # /workspace/<script> is the script's own path
    assert env["EVIL"] == payload and env["WHERE"] == "node1" and env["FLEETBOX_VENV"] == f"{envs}/node1"
    assert env["PYTHONPATH"].split(":")[0] == f"{plan.dir}/{slurm.HELPERS}"   # the job folder's copy
    assert env["FLEETBOX_CHECKPOINT_DIR"] == plan.checkpoints and env["FLEETBOX_PROGRESS_DIR"] == f"{plan.dir}/node1"
    assert env["FLEETBOX_VISUALDL_DIR"] == f"{plan.dir}/node1/visualdl"   # a script's own VisualDL logs
    assert env["VIRTUAL_ENV"] == f"{envs}/node1" and env["PATH"].startswith(f"{envs}/node1/bin:")


@pytest.mark.parametrize("field,value,needle", [
    ("partition", "gpu\nrm -rf ~", "--partition"), ("partition", "gpu;id", "--partition"),
    ("time", "1:00:00\n#SBATCH --uid=0", "--time"), ("time", "soon", "--time"),
    ("account", "proj 42", "--account"), ("account", "$(id)", "--account"),
    ("qos", "high\n#SBATCH --uid=0", "--qos"), ("constraint", "a100 && id", "--constraint"),
    ("reservation", "res;id", "--reservation"), ("mem", "64 G", "--mem"), ("mem", "lots", "--mem"),
    ("cpus_per_node", "4;id", "--cpus-per-node takes a whole number"), ("cpus_per_node", "0", "at least 1"),
    ("sbatch_args", "--comment=a\n#SBATCH --uid=0", "--sbatch-args"),
    ("sbatch_args", "--comment='$(id)'", "--sbatch-args"), ("sbatch_args", "--mail-user=a`id`", "--sbatch-args"),
])
def test_bad_sbatch_values_are_refused_in_one_line(field, value, needle):
    with pytest.raises(UserError, match=needle) as e:
        slurm.SlurmBackend("podman", **{field: value})
    assert "\n" not in str(e.value)


def test_good_sbatch_values_pass(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    b = slurm.SlurmBackend("podman", partition="gpu,debug", time="2-00:30:00", account="proj_42.x")
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555)
    text = dict(b.plan(spec).files)["job.sbatch"]
    assert "#SBATCH --partition=gpu,debug\n#SBATCH --time=2-00:30:00\n#SBATCH --account=proj_42.x\n" in text
    b = slurm.SlurmBackend("podman", qos="high", constraint="[a100|h100]&ib", reservation="maint_1", mem="64G",
                           sbatch_args="--mail-type=END,FAIL --mail-user=me@example.org --nodelist=gpu[01-04] "
                                       "--hint=nomultithread")
    text = dict(b.plan(spec).files)["job.sbatch"]
    assert ("#SBATCH --qos=high\n#SBATCH --constraint=[a100|h100]&ib\n#SBATCH --reservation=maint_1\n"
            "#SBATCH --mem=64G\n#SBATCH --cpus-per-task=2\n#SBATCH --mail-type=END,FAIL\n"
            "#SBATCH --mail-user=me@example.org\n#SBATCH --nodelist=gpu[01-04]\n#SBATCH --hint=nomultithread\n") in text


def test_a_runs_folder_that_cannot_be_an_sbatch_line_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "my runs"))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), job_id="train-t-1", port=29555)
    with pytest.raises(UserError, match="cannot be written in an #SBATCH line"):
        slurm.SlurmBackend("podman").plan(spec)


def test_planner_modules_do_not_load_requests_docker_or_tqdm():
    code = ("import sys; import fleetbox.run.spec, fleetbox.run.plan, fleetbox.run.placeholders, "
            "fleetbox.run.backends.runtimes, fleetbox.run.backends.slurm, fleetbox.run.result, fleetbox.run.backend, "
            "fleetbox.image.matrix; print(sorted({'requests', 'docker', 'tqdm'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
