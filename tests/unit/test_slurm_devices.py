"""The devices each runtime is given under Slurm: the rendered node script, run by bash under recorded Slurm task
environments with stub runtimes that record their argv and environment. Each runtime gets exactly the task's
allocation (SLURM_STEP_GPUS, else SLURM_JOB_GPUS; ROCm render nodes through a recorded KFD topology), and a
task whose allocation does not match the plan's process count stops in one line before any container starts."""

import os

import pytest

from fleetbox import ROOT
from fleetbox.image import matrix
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import slurm, slurm_step
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


# Recorded (tests/recorded/gpu-node/README.md): what a GPU node's tools answer
RECORDED = ROOT / "tests" / "recorded" / "gpu-node"
DRIVER = "575.51.03"   # the driver of the recorded ldconfig line


def gpu_node(stubs, cdi="nvidia-ctk-cdi-list__1.17.8.txt", hook=True, libcuda=True, task_uuids=()):
    """The node's NVIDIA tools as stubs answering what real ones answered: nvidia-ctk's CDI list (its count on
    stderr, the names on stdout, as list.go prints them), the toolkit's hook, the loader's cache, the driver."""
    def tool(name, text):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    if cdi:
        said = RECORDED.joinpath(cdi).read_text().splitlines()
        tool("nvidia-ctk", "#!/bin/sh\n" + f"echo '{said[0].rstrip()}' >&2\n" +
             "".join(f"echo '{ln}'\n" for ln in said[1:]))
    if hook:
        tool("nvidia-container-runtime-hook", "#!/bin/sh\nexit 0\n")
    lines = RECORDED.joinpath("ldconfig-p-libcuda__575.51.03.txt").read_text() if libcuda else ""
    tool("ldconfig", f"#!/bin/sh\nprintf '%s' '{lines}'\n")
    uuids = "".join(f"echo {u}\n" for u in task_uuids)
    tool("nvidia-smi", f"#!/bin/sh\ncase \"$*\" in *uuid*) {uuids};; *) echo {DRIVER};; esac\n")


def prerequisite_said(proc) -> str:
    return next(ln.split(": ", 2)[2] for ln in (proc.stdout + proc.stderr).splitlines()
                if "GPU prerequisite" in ln)



def image_with_driver_libraries(tmp_path, runtime, driver=DRIVER, lib="usr/lib/x86_64-linux-gnu"):
    """A Charliecloud image folder as `ch-fromhost --nvidia` leaves it: the driver's libraries in its library folder
    (/usr/lib/x86_64-linux-gnu on Debian; the folder its ldconfig names), libcuda.so.1 linked to them by ldconfig."""
    if runtime == "charliecloud":
        (tmp_path / "img:tag" / lib).mkdir(parents=True, exist_ok=True)
        (tmp_path / "img:tag" / lib / f"libcuda.so.{driver}").write_bytes(b"")
        (tmp_path / "img:tag" / lib / "libcuda.so.1").symlink_to(f"libcuda.so.{driver}")

def the_call(calls, runtime):
    tool = {"charliecloud": "ch-run", "pyxis": "python"}.get(runtime, runtime)
    (call,) = [c for c in calls if c["tool"] == tool]
    return call["argv"], call["env"]


def values(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.mark.parametrize("runtime", ["docker", "podman", "apptainer", "charliecloud", "pyxis"])
def test_cuda_runtimes_get_exactly_the_allocated_gpus(runtime, stubs, tmp_path, monkeypatch):
    gpu_node(stubs)
    node = node_script("cu126", runtime, tmp_path, monkeypatch)
    image_with_driver_libraries(tmp_path, runtime)
    proc, calls = run_node(node, stubs, tmp_path, TASK)
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
    rows = confinement_rows("cuda", slurm.SlurmBackend(runtime).doctoring.unconfined)
    assert len(rows) == (0 if confined else 1)
    if rows:
        assert rows[0].ok and rows[0].value.startswith(f"none: {runtime} starts the container outside the Slurm task")
    assert confinement_rows("cpu", slurm.SlurmBackend(runtime).doctoring.unconfined) == []


@pytest.mark.parametrize("runtime,said", [
    ("docker", "GPU prerequisite: the NVIDIA Container Toolkit (docker --gpus)"),
    ("podman", "GPU prerequisite: a CDI spec names nvidia.com/gpu=1, nvidia.com/gpu=3 (nvidia-ctk cdi list)"),
    ("apptainer", "GPU prerequisite: the node's driver libraries (apptainer --nv)"),
    ("charliecloud", f"GPU prerequisite: the image's libcuda.so.1 is driver {DRIVER}'s, which this node runs "
                     "(ch-fromhost --nvidia)"),
])
def test_each_cuda_runtimes_prerequisite_is_checked_on_the_node_before_its_container_starts(runtime, said, stubs,
                                                                                          tmp_path, monkeypatch):
    gpu_node(stubs)
    node = node_script("cu126", runtime, tmp_path, monkeypatch)
    image_with_driver_libraries(tmp_path, runtime)
    proc, calls = run_node(node, stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    assert prerequisite_said(proc) == said
    the_call(calls, runtime)   # and the container started


@pytest.mark.parametrize("runtime,setup,said", [
    ("docker", dict(hook=False), "GPU prerequisite missing: Docker here cannot give a container GPUs (no NVIDIA "
     "Container Toolkit: no nvidia-container-runtime-hook or nvidia-cdi-hook on PATH, no nvidia runtime): the admins "
     "install it and run `nvidia-ctk runtime configure --runtime=docker`"),
    ("podman", dict(cdi="nvidia-ctk-cdi-list-empty.txt"), "GPU prerequisite missing: no CDI spec here names "
     "nvidia.com/gpu=1 nvidia.com/gpu=3 (nvidia-ctk cdi list: 0 device(s)): the admins make one with `nvidia-ctk "
     "cdi generate --output=/etc/cdi/nvidia.yaml` (again after each driver update)"),
    ("apptainer", dict(libcuda=False), "GPU prerequisite missing: the node's loader knows no libcuda.so.1 "
     "({stubs}/ldconfig -p), so apptainer --nv gives the container no NVIDIA driver: check the driver install on this "
     "node"),
    ("charliecloud", {}, "GPU prerequisite missing: the image {image} holds no NVIDIA driver libraries (libcuda.so.1): "
     "run `ch-fromhost --nvidia {image}` on a GPU node"),
    ("charliecloud", dict(image_driver="535.104.05"), "GPU prerequisite missing: the image {image} holds the "
     f"libraries of driver 535.104.05, this node runs driver {DRIVER}, and they must match: run `ch-fromhost "
     "--nvidia {image}` on a GPU node"),
])
def test_a_missing_prerequisite_stops_the_node_in_one_line_before_its_container_starts(runtime, setup, said, stubs,
                                                                                     tmp_path, monkeypatch):
    setup = dict(setup)
    image_driver = setup.pop("image_driver", None)
    gpu_node(stubs, **setup)
    node = node_script("cu126", runtime, tmp_path, monkeypatch)
    if image_driver:
        image_with_driver_libraries(tmp_path, runtime, image_driver, "usr/lib64")
    proc, calls = run_node(node, stubs, tmp_path, TASK)
    assert proc.returncode == 5 and [c for c in calls if c["tool"] != "docker" or c["argv"][:1] == ["run"]] == []
    said = said.format(image=tmp_path / "img:tag", stubs=stubs)
    assert prerequisite_said(proc) == said
    assert proc.stderr.strip().splitlines()[-1] == f"fleetbox: node 1 on {os.uname().nodename}: " + \
        said   # the line the job's summary shows (slurm_step.node_said)
    log = tmp_path / "node1.log"
    log.write_text(proc.stderr)
    assert slurm_step.node_said(log) == said and 5 in slurm_step.NODE_EXITS


def test_runtimes_without_a_node_side_prerequisite_check_none(stubs, tmp_path, monkeypatch):
    """Pyxis runs node.sh in the container (enroot's hooks are the node's: doctor sees what they gave); runtime
    none starts no container; a CPU job needs no GPU."""
    assert "GPU prerequisite" not in node_script("cu126", "pyxis", tmp_path, monkeypatch)
    assert "GPU prerequisite" not in node_script("cpu", "podman", tmp_path, monkeypatch)
    assert "GPU prerequisite" not in node_script("dcu", "podman", tmp_path, monkeypatch)


def test_doctor_makes_a_row_per_node_of_what_each_nodes_script_found(stubs, tmp_path, monkeypatch):
    """node0 has a CDI spec naming its GPUs, node1 none (recorded nvidia-ctk answers): node1's row fails, naming the
    command that makes one; the other is said."""
    from fleetbox.commands import checks
    node = node_script("cu126", "podman", tmp_path, monkeypatch)
    outputs = {}
    for k, cdi in ((0, "nvidia-ctk-cdi-list__1.17.8.txt"), (1, "nvidia-ctk-cdi-list-empty.txt")):
        gpu_node(stubs, cdi=cdi)
        proc, _ = run_node(node, stubs, tmp_path, TASK)
        outputs[k] = proc.stdout + proc.stderr
    rows = checks.prerequisite_rows(outputs, 2)
    assert [(r.node, r.check, r.ok) for r in rows] == [("node0", "GPU prerequisite", True),
                                                      ("node1", "GPU prerequisite", False)]
    assert rows[0].value == "a CDI spec names nvidia.com/gpu=1, nvidia.com/gpu=3 (nvidia-ctk cdi list)"
    assert rows[1].fix.startswith("no CDI spec here names nvidia.com/gpu=1 nvidia.com/gpu=3 (nvidia-ctk cdi list: 0 "
                                  "device(s)): the admins make one with `nvidia-ctk cdi generate")
    assert checks.prerequisite_rows({0: "fleetbox: node 0 on n1: eth0 10.0.0.1 -> master"}, 1) == []   # none checked



# Recorded: the two tasks' `nvidia-smi -L` in DeepOps #1102, each task confined to its own GPU
TASK_UUIDS = [ln.split("UUID: ")[1].rstrip(")") for ln in
              RECORDED.joinpath("srun-nvidia-smi-L__deepops-1102.txt").read_text().splitlines() if "UUID: " in ln]


@pytest.mark.parametrize("task,container,ok,value", [
    (TASK_UUIDS[:1], TASK_UUIDS[:1], True, TASK_UUIDS[0][:12]),
    (TASK_UUIDS[:1], TASK_UUIDS[1:], False, TASK_UUIDS[1][:12]),   # the engine gave the other GPU
    (TASK_UUIDS, TASK_UUIDS[:1], True, "not checked: the task sees 2 GPU(s), it was allocated 1 (the node does not "
                                       "confine devices)"),
])
def test_doctor_holds_the_containers_gpus_to_those_the_slurm_task_may_use(task, container, ok, value, stubs, tmp_path,
                                                                         monkeypatch):
    from fleetbox.commands import checks
    from fleetbox.incontainer import fleetbox_doctor
    gpu_node(stubs, task_uuids=task)
    proc, _ = run_node(node_script("cu126", "podman", tmp_path, monkeypatch, procs=1), stubs, tmp_path,
                       {**TASK, "SLURM_STEP_GPUS": "1"})
    assert proc.returncode == 0, proc.stderr
    fields = fleetbox_doctor.GPU_FIELDS
    out = "".join(f"{i}, {u}, Tesla P100-SXM2-16GB, {DRIVER}, 16384 MiB, 6.0\n" for i, u in enumerate(container))
    facts = {0: {"gpu": {"rc": 0, "out": out, "err": "", "fields": list(fields)}}}
    e = checks.Expect(nodes=1, shm="1g", device="cuda", gpus=1)
    (row,) = checks.allocated_gpu_rows({0: proc.stdout}, facts, e)
    assert (row.node, row.check, row.ok, row.value) == ("node0", "allocated GPUs", ok, value)
    if not ok:
        assert row.fix.startswith(f"the container got {TASK_UUIDS[1]}, Slurm allocated {TASK_UUIDS[0]}: the engine "
                                  "took Slurm's GPU ids as the driver's indices")
    assert checks.allocated_gpu_rows({0: ""}, facts, e) == []   # no line: a runtime that checks none (pyxis)



def test_a_long_loader_cache_with_libcuda_first_passes_under_pipefail(stubs, tmp_path, monkeypatch):
    """A node's `ldconfig -p` lists thousands of libraries: a check that stopped reading at the first match would
    cut ldconfig off (SIGPIPE), which pipefail reads as failure, and stop a healthy node."""
    gpu_node(stubs)
    line = RECORDED.joinpath("ldconfig-p-libcuda__575.51.03.txt").read_text()
    (stubs / "ldconfig").write_text(f"#!/bin/sh\nprintf '%s' '{line}'\n"
                                    "i=0; while [ $i -lt 20000 ]; do echo \"\tlibx$i.so (libc6,x86-64) => /x\"; "
                                    "i=$((i+1)); done\n")
    proc, calls = run_node(node_script("cu126", "apptainer", tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    assert prerequisite_said(proc) == "GPU prerequisite: the node's driver libraries (apptainer --nv)"


def test_podman_on_a_node_whose_containers_conf_names_its_own_cdi_folders_is_not_second_guessed(stubs, tmp_path,
                                                                                               monkeypatch):
    gpu_node(stubs, cdi="nvidia-ctk-cdi-list-empty.txt")   # nvidia-ctk looks in the usual folders only
    conf = tmp_path / "containers.conf"
    conf.write_text('[engine]\ncdi_spec_dirs = ["/opt/site/cdi"]\n')
    proc, calls = run_node(node_script("cu126", "podman", tmp_path, monkeypatch), stubs, tmp_path,
                           {**TASK, "CONTAINERS_CONF": str(conf)})
    assert proc.returncode == 0, proc.stderr
    assert prerequisite_said(proc) == f"GPU prerequisite: not checked ({conf} names its own CDI spec folders)"



@pytest.mark.parametrize("driver,code", [(DRIVER, 0), ("535.104.05", 5)])
def test_a_charliecloud_squashfs_image_is_listed_for_the_driver_its_libcuda_points_to(driver, code, stubs, tmp_path,
                                                                                    monkeypatch):
    """A squashfs image is not mounted to be checked: unsquashfs lists where its libcuda.so.1 points."""
    import subprocess
    gpu_node(stubs)
    folder = tmp_path / "made"
    image_with_driver_libraries(folder, "charliecloud", driver)
    sqfs = tmp_path / "img.sqfs"
    subprocess.run(["mksquashfs", folder / "img:tag", sqfs, "-quiet", "-noappend"], check=True, capture_output=True)
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cu126"), nodes=2, procs_per_node=2, job_id="train-gpu-0001",
                            port=29555, image=str(sqfs))
    node = dict(slurm.SlurmBackend("charliecloud").plan(spec).files)["node.sh"]
    proc, calls = run_node(node, stubs, tmp_path, TASK)
    assert proc.returncode == code, proc.stderr
    assert prerequisite_said(proc) == (
        f"GPU prerequisite: the image's libcuda.so.1 is driver {DRIVER}'s, which this node runs (ch-fromhost --nvidia)"
        if code == 0 else f"GPU prerequisite missing: the image {sqfs} holds the libraries of driver {driver}, this "
        f"node runs driver {DRIVER}, and they must match: a squashfs image cannot take them: unpack it to a folder "
        f"(ch-convert), run `ch-fromhost --nvidia` on that folder on a GPU node and give the folder as --image")



def test_where_a_nodes_tools_cannot_tell_the_prerequisite_is_not_checked_rather_than_failed(stubs, tmp_path,
                                                                                          monkeypatch):
    """A check that cannot ask must not stop a node that works: nvidia-ctk older than `cdi list` (1.14), a squashfs
    image where no unsquashfs is installed (Charliecloud needs squashfuse only)."""
    gpu_node(stubs)
    (stubs / "nvidia-ctk").write_text("#!/bin/sh\necho 'Incorrect Usage: flag provided but not defined' >&2; exit 1\n")
    proc, _ = run_node(node_script("cu126", "podman", tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert proc.returncode == 0 and prerequisite_said(proc) == \
        "GPU prerequisite: not checked (no nvidia-ctk here that lists the CDI specs)"
    sqfs = tmp_path / "img.sqfs"
    sqfs.write_bytes(b"hsqs")
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path / "runs"))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cu126"), nodes=2, procs_per_node=2, job_id="train-gpu-0001",
                            port=29555, image=str(sqfs))
    node = dict(slurm.SlurmBackend("charliecloud").plan(spec).files)["node.sh"]
    bare = tmp_path / "bare"   # PATH without /usr/bin's unsquashfs: the tools node.sh needs, linked one by one
    bare.mkdir()
    for tool in ("bash", "cat", "sed", "grep", "hostname", "awk", "mkdir", "xargs", "find", "readlink", "paste", "ip",
                 "id", "sort", "head", "tail", "tr", "wc", "dirname", "basename", "date", "sleep", "env", "true"):
        for d in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
            if os.path.exists(f"{d}/{tool}") and not (bare / tool).exists():
                (bare / tool).symlink_to(f"{d}/{tool}")
    proc, _ = run_node(node, stubs, tmp_path, {**TASK, "PATH": f"{stubs}:{bare}"})
    assert proc.returncode == 0, proc.stderr
    assert prerequisite_said(proc) == "GPU prerequisite: not checked (no unsquashfs here to list the squashfs image)"


def test_apptainers_check_finds_ldconfig_in_sbin_when_the_users_path_lacks_it(stubs, tmp_path, monkeypatch):
    """A user's PATH on Debian has no /sbin: the check asks /sbin/ldconfig, as Apptainer does, and that machine's
    real answer (this one has no NVIDIA driver) is what it says."""
    gpu_node(stubs)
    (stubs / "ldconfig").unlink()
    proc, _ = run_node(node_script("cu126", "apptainer", tmp_path, monkeypatch), stubs, tmp_path,
                       {**TASK, "PATH": f"{stubs}:/usr/bin:/bin"})
    assert proc.returncode == 5
    assert prerequisite_said(proc).startswith("GPU prerequisite missing: the node's loader knows no libcuda.so.1 "
                                              "(/sbin/ldconfig -p)")


@pytest.mark.parametrize("tool,answer", [
    ("nvidia-cdi-hook", ""),   # the toolkit's CDI hook alone (Docker 28's nvidia.cdi driver)
    # `docker info --format '{{json .Runtimes}}'` where `nvidia-ctk runtime configure` named the nvidia runtime
    ("docker", '{"io.containerd.runc.v2":{"path":"runc"},"nvidia":{"path":"nvidia-container-runtime"},'
               '"runc":{"path":"runc"}}'),
])
def test_docker_gives_gpus_through_the_cdi_hook_or_an_nvidia_runtime_too(tool, answer, stubs, tmp_path, monkeypatch):
    gpu_node(stubs, hook=False)
    if tool == "docker":   # answers `docker info`, and records the run as the stub does
        real = (stubs / "docker").read_text()
        (stubs / "docker-run").write_text(real)
        (stubs / "docker-run").chmod(0o755)
        (stubs / "docker").write_text(f"#!/bin/sh\nif [ \"$1\" = info ]; then echo '{answer}'; exit 0; fi\n"
                                      f"exec {stubs}/docker-run \"$@\"\n")
    else:
        (stubs / tool).write_text("#!/bin/sh\nexit 0\n")
    (stubs / tool).chmod(0o755)
    proc, calls = run_node(node_script("cu126", "docker", tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    assert prerequisite_said(proc) == "GPU prerequisite: the NVIDIA Container Toolkit (docker --gpus)"


def test_charliecloud_finds_the_libraries_where_ch_fromhost_put_them_in_a_gpu_image(stubs, tmp_path, monkeypatch):
    """In cu118-pypi the image's ldconfig names its own library folders first, so ch-fromhost puts the driver's
    libraries deep in the venv; a CUDA image's compat copy elsewhere is not the driver's."""
    gpu_node(stubs)
    node = node_script("cu126", "charliecloud", tmp_path, monkeypatch)
    image_with_driver_libraries(tmp_path, "charliecloud", "525.60.13", "usr/local/cuda/compat")
    image_with_driver_libraries(tmp_path, "charliecloud", DRIVER,
                                "opt/venv/lib/python3.11/site-packages/nvidia/cublas/lib")
    proc, _ = run_node(node, stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    assert prerequisite_said(proc).startswith(f"GPU prerequisite: the image's libcuda.so.1 is driver {DRIVER}'s")


def test_a_task_whose_nvidia_smi_fails_reports_no_gpus_rather_than_its_error_words(stubs, tmp_path, monkeypatch):
    """nvidia-smi says its errors on stdout (recorded: tests/unit/test_doctor.py NVIDIA_SMI_NO_DRIVER): they are no
    UUIDs, and no row is made of them."""
    from tests.unit.test_doctor import NVIDIA_SMI_NO_DRIVER
    gpu_node(stubs)
    (stubs / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '%s' \"{NVIDIA_SMI_NO_DRIVER}\"\nexit 9\n")
    proc, _ = run_node(node_script("cu126", "podman", tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert proc.returncode == 0, proc.stderr
    assert "GPUs the task sees" not in proc.stdout and "unmatched" not in proc.stderr
    gpu_node(stubs, task_uuids=("NVIDIA-SMI has failed", *TASK_UUIDS))   # a stray line among the UUIDs
    proc, _ = run_node(node_script("cu126", "podman", tmp_path, monkeypatch), stubs, tmp_path, TASK)
    assert f"GPUs the task sees: {','.join(TASK_UUIDS)}\n" in proc.stdout
