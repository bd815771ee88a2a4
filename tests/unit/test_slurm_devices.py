"""The devices each runtime is given under Slurm: the rendered node script, run by bash under recorded Slurm task
environments with stub runtimes that record their argv and environment. Each runtime gets exactly the task's
allocation (SLURM_STEP_GPUS, else SLURM_JOB_GPUS; ROCm render nodes through a recorded KFD topology), and a
task whose allocation does not match the plan's process count stops in one line before any container starts."""

import pytest

from fleetbox import ROOT
from fleetbox.image import matrix
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import slurm
from tests.unit.conftest import given_image, run_node

TOPOLOGY = ROOT / "tests" / "probes" / "kfd-topology"   # GPUs 0..5 are renderD130, 128, 131, 129, 133, 132

# node 1 of a 2-node job, 2 GPUs per node, as slurmd sets up its srun task: the step's own global GPU ids; the
# batch step's SLURM_JOB_GPUS (node 0's) inherited; the vendor variables renumbered by ConstrainDevices
TASK = {"SLURM_STEP_GPUS": "1,3", "SLURM_JOB_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "0,1",
        "ROCR_VISIBLE_DEVICES": "0,1", "GPU_DEVICE_ORDINAL": "0,1", "FLEETBOX_KFD_TOPOLOGY": str(TOPOLOGY)}


def node_script(variant, runtime, tmp_path, monkeypatch, procs=2):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    spec = spec_mod.JobSpec(variant=matrix.load().get(variant), nodes=2, procs_per_node=procs,
                            job_id="train-gpu-0001", port=29555, image=given_image(runtime, tmp_path))
    return dict(slurm.SlurmBackend(runtime).plan(spec).files)["node.sh"]


def the_call(calls, runtime):
    tool = {"charliecloud": "ch-run", "pyxis": "python"}.get(runtime, runtime)
    (call,) = [c for c in calls if c["tool"] == tool]
    return call["argv"], call["env"]


def values(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer", "charliecloud", "pyxis"])
def test_cuda_runtimes_get_exactly_the_allocated_gpus(runtime, stubs, tmp_path, monkeypatch):
    proc, calls = run_node(node_script("cu126", runtime, tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    argv, env = the_call(calls, runtime)
    given = {
        "docker": lambda: values(argv, "--gpus") == ['"device=1,3"'],   # CSV: one quoted field reaches docker
        "podman": lambda: values(argv, "--device") == ["nvidia.com/gpu=1", "nvidia.com/gpu=3"],
        # --cleanenv drops what is not passed by name; the task's cgroup holds the devices
        "apptainer": lambda: "--nv" in argv and env["APPTAINERENV_CUDA_VISIBLE_DEVICES"] == "0,1",
        "charliecloud": lambda: "--set-env=CUDA_VISIBLE_DEVICES=0,1" in argv[:argv.index(str(tmp_path / "img:tag"))],
        "pyxis": lambda: env["CUDA_VISIBLE_DEVICES"] == "0,1" and "--gpus" not in argv,   # Slurm's own binding
    }[runtime]
    assert given(), argv
    assert not any("gpu=all" in a or a == "all" for a in argv)
    unconfined = "starts the container outside the Slurm task's cgroup" in proc.stdout
    assert unconfined == (runtime in ("docker", "podman")), proc.stdout


@pytest.mark.parametrize("runtime", ["docker", "podman"])
def test_rocm_engines_get_the_allocated_render_nodes_through_the_kfd_topology(runtime, stubs, tmp_path,
                                                                             monkeypatch):
    proc, calls = run_node(node_script("dcu", runtime, tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    argv, _ = the_call(calls, runtime)
    # GPUs 1 and 3 are KFD nodes 3 and 5: renderD128 and renderD129 (never renderD129/131 by index)
    assert values(argv, "--device") == ["/dev/kfd", "/dev/dri/renderD128", "/dev/dri/renderD129"]
    assert not any(a.startswith("HIP_VISIBLE_DEVICES=") for a in values(argv, "-e"))   # ROCr sees only these


def test_rocm_apptainer_passes_the_visibility_variables_by_name(stubs, tmp_path, monkeypatch):
    proc, calls = run_node(node_script("dcu", "apptainer", tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    argv, env = the_call(calls, "apptainer")
    assert "--rocm" in argv and env["APPTAINERENV_ROCR_VISIBLE_DEVICES"] == "0,1"
    assert "APPTAINERENV_HIP_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize("node,given", [("0", ["/dev/kfd", "/dev/dri/renderD131", "/dev/dri/renderD132"]),
                                        ("1", None)])
def test_without_a_step_allocation_only_the_batch_node_reads_the_jobs(node, given, stubs, tmp_path, monkeypatch):
    """SLURM_JOB_GPUS is the batch node's (node 0's) allocation, inherited by every task: another node that has no
    step allocation of its own stops rather than take node 0's ids."""
    task = {k: v for k, v in TASK.items() if k != "SLURM_STEP_GPUS"} | {"SLURM_JOB_GPUS": "2,5", "SLURM_NODEID": node}
    proc, calls = run_node(node_script("dcu", "docker", tmp_path, monkeypatch), stubs, tmp_path, task)
    if given is None:
        assert proc.returncode == 2 and calls == [] and "Slurm allocated 0 device(s) (none)" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert values(the_call(calls, "docker")[0], "--device") == given   # GPUs 2, 5: KFD nodes 4, 11


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer", "charliecloud", "pyxis"])
@pytest.mark.parametrize("variant", ["cu126", "dcu"])
@pytest.mark.parametrize("gpus,count", [("1", 1), ("", 0), ("0,1,2", 3)])
def test_an_allocation_that_does_not_match_the_processes_stops_the_node_in_one_line(variant, runtime, gpus, count,
                                                                                     stubs, tmp_path,
                                                                                     monkeypatch):
    task = {**TASK, "SLURM_STEP_GPUS": gpus, "SLURM_JOB_GPUS": ""}
    proc, calls = run_node(node_script(variant, runtime, tmp_path, monkeypatch), stubs, tmp_path, task)
    assert proc.returncode == 2 and calls == []   # no container started
    (said,) = proc.stderr.splitlines()
    assert said.startswith("fleetbox: node 1 on ") and said.endswith(
        f"Slurm allocated {count} device(s) ({gpus or 'none'}), but the job runs 2 process(es) per node, one per "
        f"device: submit with --gpus-per-node 2")


def test_a_render_node_the_topology_lacks_is_named(stubs, tmp_path, monkeypatch):
    proc, calls = run_node(node_script("dcu", "podman", tmp_path, monkeypatch), stubs, tmp_path,
                      {**TASK, "SLURM_STEP_GPUS": "1,7"})
    assert proc.returncode != 0 and calls == []
    assert f"the KFD topology ({TOPOLOGY}) has 6 GPU(s); Slurm allocated 1,7" in proc.stderr


def test_cpu_jobs_read_no_allocation(stubs, tmp_path, monkeypatch):
    text = node_script("cpu", "docker", tmp_path, monkeypatch, procs=1)
    assert "GPUS" not in text and "ACCEL" not in text
    proc, calls = run_node(text, stubs, tmp_path, {})
    assert proc.returncode == 0 and "--gpus" not in the_call(calls, "docker")[0]


@pytest.mark.parametrize("runtime,confined", [("docker", False), ("podman", False), ("apptainer", True),
                                              ("charliecloud", True), ("pyxis", True)])
def test_doctor_says_which_runtimes_slurm_cannot_confine(runtime, confined):
    from fleetbox.commands.checks import confinement_rows
    rows = confinement_rows("cuda", slurm.SlurmBackend(runtime).unconfined)
    assert len(rows) == (0 if confined else 1)
    if rows:
        assert rows[0].ok and rows[0].value.startswith(f"none: {runtime} starts the container outside the Slurm task")
    assert confinement_rows("cpu", slurm.SlurmBackend(runtime).unconfined) == []
