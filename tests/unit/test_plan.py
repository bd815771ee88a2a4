"""The job planner: the node template, its placeholders filled per node, docker argv and SDK arguments,
for cpu / CUDA / DCU, 1 and several nodes; spec validation; network facts."""

import re
from dataclasses import replace

import pytest

from fleetbox import ROOT, settings
from fleetbox.errors import UserError
from fleetbox.image import matrix
from fleetbox.run import backends, hostnet, result
from fleetbox.run import plan as planner
from fleetbox.run import spec as spec_mod
from fleetbox.run.backends import docker as docker_mod
from fleetbox.run.backends.docker import DockerBackend
from fleetbox.run.spec import Mount


def spec(variant="cpu", **kw):
    kw.setdefault("job_id", "train-test-0001")
    return spec_mod.JobSpec(variant=matrix.load().get(variant), **kw)


def docker(**options) -> DockerBackend:
    """Docker's backend with its own options (--hosts, --devices), read as the command line gives them."""
    return DockerBackend(**backends.configure("docker", options))


def split(kw: dict) -> tuple[dict, DockerBackend]:
    """A case's job options, and Docker's backend made with its own among them."""
    own = {k: kw[k] for k in ("hosts", "devices") if k in kw}
    return {k: v for k, v in kw.items() if k not in own}, docker(**{k: v if isinstance(v, str) else ",".join(v)
                                                                   for k, v in own.items()})


def plan(s, master="10.0.0.1", port=29500, iface="eth0", hyhal=True, node_ips=None, b=None):
    b = b or DockerBackend()
    t = planner.template(s, s.job_id, "/logs/{node}", workspace=not b.hosts, hyhal_present=hyhal)
    return [planner.replace(t, host=(list(b.hosts) or [""] * s.nodes)[k]).fill(planner.node_values(
        k, s.nodes, s.job_id, master, port, (node_ips or [master] * s.nodes)[k],
        iface[k] if isinstance(iface, list) else iface, "/home/u", "u",
        gpus=docker_mod.node_gpus(s, k, b.devices, b.sharing))) for k in range(s.nodes)]


def flag_values(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_cpu_two_nodes_same_command_but_rank():
    n0, n1 = plan(spec(nodes=2))
    a0, a1 = docker_mod.argv(n0), docker_mod.argv(n1)
    for a in (a0, a1):
        assert a[:2] == ["docker", "run"] and "--network" in a and a[a.index("--network") + 1] == "host"
        assert flag_values(a, "--shm-size") == ["8g"] and "memlock=-1:-1" in flag_values(a, "--ulimit")
        assert "--gpus" not in a and "--device" not in a
    cmd0 = list(n0.command)
    assert cmd0[:3] == ["python", "-m", "paddle.distributed.launch"]
    assert cmd0[cmd0.index("--master") + 1] == "10.0.0.1:29500" and cmd0[cmd0.index("--nnodes") + 1] == "2"
    assert cmd0[cmd0.index("--host") + 1] == "10.0.0.1"   # the node's own address, never left to its hostname
    assert cmd0[cmd0.index("--rank") + 1] == "0" and list(n1.command)[cmd0.index("--rank") + 1] == "1"
    assert cmd0[cmd0.index("--log_dir") + 1] == settings.LOG_DIR and cmd0[-1] == "/workspace/smoke.py"
    assert n0.env["GLOO_SOCKET_IFNAME"] == n0.env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert n0.env["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in n0.env and "NCCL_DEBUG" not in n0.env
    assert n0.labels == {"io.fleetbox.job": "train-test-0001", "io.fleetbox.node": "node0", "io.fleetbox.rank": "0",
                         "io.fleetbox.variant": "cpu"}
    assert f"{ROOT / 'train'}:/workspace:ro" in flag_values(a0, "-v")
    assert "/logs/node0:/fleetbox/logs" in flag_values(a0, "-v")
    assert "/logs/node1:/fleetbox/logs" in flag_values(a1, "-v")


def test_single_node_and_procs_per_node():
    (n,) = plan(spec(nodes=1, procs_per_node=4))
    c = list(n.command)
    assert c[c.index("--nnodes") + 1] == "1" and c[c.index("--nproc_per_node") + 1] == "4"


def test_ib_hca_and_debug():
    (n,) = plan(spec(nodes=1, ib_hca="mlx5_0", debug=True))
    assert n.env["NCCL_IB_HCA"] == "mlx5_0" and n.env["NCCL_IB_DISABLE"] == "0" and n.env["NCCL_DEBUG"] == "INFO"


@pytest.mark.parametrize("kw,gpus", [({}, ["device=0"]), ({"procs_per_node": 4}, ["device=0,1,2,3"]),
                                     ({"gpus_per_node": 4, "procs_per_node": 4}, ["device=0,1,2,3"]),
                                     ({"devices": "2,3", "procs_per_node": 2}, ["device=2,3"])])
def test_cuda_on_one_node_gets_one_gpu_per_process(kw, gpus):
    kw, b = split(kw)
    (n,) = plan(spec("cu126", nodes=1, **kw), b=b)
    assert n.gpus == gpus[0]
    want = gpus[0].removeprefix("device=").split(",")
    # the CLI reads --gpus as CSV: a list of ids is one quoted field
    assert flag_values(docker_mod.argv(n), "--gpus") == [f'"{gpus[0]}"' if len(want) > 1 else gpus[0]]
    req = docker_mod.sdk_kwargs(n)["device_requests"][0]
    assert req["Capabilities"] == [["gpu"]] and req["DeviceIDs"] == want


@pytest.mark.parametrize("kw,per_node", [
    ({"nodes": 2}, ["0", "1"]),
    ({"nodes": 2, "procs_per_node": 2}, ["0,1", "2,3"]),
    ({"nodes": 3, "gpus_per_node": 2, "procs_per_node": 2}, ["0,1", "2,3", "4,5"]),
    ({"nodes": 2, "devices": "4,5,6,7", "procs_per_node": 2}, ["4,5", "6,7"]),
    ({"nodes": 2, "devices": "7,3"}, ["7", "3"]),
    ({"nodes": 2, "hosts": ("ssh://a", "ssh://b")}, ["0", "0"]),                  # each host has its own GPUs
    ({"nodes": 2, "hosts": ("ssh://a", "ssh://b"), "devices": "1"}, ["1", "1"]),
])
def test_nodes_on_one_machine_get_their_own_gpus(kw, per_node):
    """Locally every node shares the machine's GPUs: node k takes the k-th block, never every node GPU 0."""
    kw, b = split(kw)
    s = spec("cu126", **kw)
    spec_mod.validate(s)
    b.check(s)
    got = [docker_mod.node_gpus(s, k, b.devices, b.sharing) for k in range(s.nodes)]
    assert got == per_node
    if not b.hosts:
        nodes = plan(s, b=b)
        assert [n.gpus for n in nodes] == [f"device={g}" for g in per_node]
        dcu = plan(spec("dcu", **kw), b=b)
        assert [n.env["HIP_VISIBLE_DEVICES"] for n in dcu] == per_node


@pytest.mark.parametrize("kw,needle", [
    ({"nodes": 2, "devices": "0,0"}, "--devices 0,0 names a device twice"),
    ({"nodes": 2, "devices": "0,1,2"}, "--devices 0,1,2: 3 device(s) cannot be split evenly among 2 nodes"),
    ({"nodes": 2, "devices": "0,1", "procs_per_node": 2},
     "--devices 0,1: 2 device(s) for 2 node(s) of 2 process(es) each"),
    ({"nodes": 1, "gpus_per_node": 2}, "--gpus-per-node 2 with --procs-per-node 1"),
    ({"nodes": 1, "devices": "a;b"}, "--devices 'a;b'"),
])
def test_gpus_that_overlap_or_do_not_cover_the_processes_are_refused(kw, needle):
    kw, b = split(kw)
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        s = spec("cu126", **kw)
        spec_mod.validate(s)
        b.check(s)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw,procs", [({"devices": "0,1,2,3"}, 2), ({"gpus_per_node": "4"}, 4),
                                      ({"devices": "0,1", "hosts": "ssh://a,ssh://b"}, 2), ({}, 1)])
def test_without_procs_per_node_each_device_gets_a_process(kw, procs):
    kw, b = split(kw)
    s = spec_mod.from_options(matrix.load().get("cu126"), b, nodes=2, **kw)
    assert s.procs_per_node == procs


def test_dcu_gets_kfd_dri_video_and_hyhal_when_present():
    (n,) = plan(spec("dcu", nodes=1, procs_per_node=2), b=docker(devices="0,1"))
    a = docker_mod.argv(n)
    assert flag_values(a, "--device") == ["/dev/kfd", "/dev/dri"] and flag_values(a, "--group-add") == ["video"]
    assert "/opt/hyhal:/opt/hyhal:ro" in flag_values(a, "-v") and n.env["HIP_VISIBLE_DEVICES"] == "0,1"
    (no_hyhal,) = plan(spec("dcu", nodes=1), hyhal=False)
    assert not any("hyhal" in v for v in flag_values(docker_mod.argv(no_hyhal), "-v"))
    assert docker_mod.sdk_kwargs(n)["devices"] == ["/dev/kfd:/dev/kfd:rwm", "/dev/dri:/dev/dri:rwm"]


def test_hosts_put_each_node_on_its_engine_and_copy_the_workspace():
    s, b = spec(nodes=2), docker(hosts="ssh://u@10.0.0.1,ssh://u@10.0.0.2")
    n0, n1 = plan(s, iface=["eth0", "eth1"], node_ips=["10.0.0.1", "10.0.0.2"], b=b)
    assert list(n1.command)[list(n1.command).index("--host") + 1] == "10.0.0.2"
    assert n1.env["GLOO_SOCKET_IFNAME"] == "eth1"
    assert docker_mod.argv(n0)[:3] == ["docker", "-H", "ssh://u@10.0.0.1"] and n1.host == "ssh://u@10.0.0.2"
    assert not any(v.endswith(":/workspace:ro") for v in flag_values(docker_mod.argv(n0), "-v"))
    assert hostnet.host_address("ssh://u@10.0.0.1") == "10.0.0.1"
    assert hostnet.host_address("tcp://127.0.0.1:2375") == "127.0.0.1"
    with pytest.raises(UserError, match="cannot tell the address"):
        hostnet.host_address("unix:///var/run/docker.sock")


def test_data_dir_and_extra_mounts_and_env(tmp_path):
    (n,) = plan(spec(nodes=1, data_dir=str(tmp_path), mounts=(Mount(str(tmp_path), "/data", True),), env={"A": "1"}))
    vols = flag_values(docker_mod.argv(n), "-v")
    assert f"{tmp_path}:/root/.cache/paddle/dataset:ro" in vols and f"{tmp_path}:/data:ro" in vols
    assert n.env["A"] == "1"


def test_sdk_kwargs_match_the_argv():
    (n,) = plan(spec(nodes=1))
    kw = docker_mod.sdk_kwargs(n)
    assert kw["network_mode"] == "host" and kw["shm_size"] == "8g" and kw["name"] == n.name
    assert kw["ulimits"][0]["Name"] == "memlock" and kw["ulimits"][0]["Hard"] == -1
    assert f"{ROOT / 'train'}:/workspace:ro" in kw["volumes"] and "/logs/node0:/fleetbox/logs:rw" in kw["volumes"]
    assert kw["environment"] == n.env and kw["labels"] == n.labels


@pytest.mark.parametrize("kw,needle", [
    ({"nodes": 0}, "--nodes must be at least 1"),
    ({"procs_per_node": 0}, "--procs-per-node must be at least 1"),
    ({"script": "/nonexistent/train.py"}, "training script not found"),
    ({"gpus_per_node": 1}, "variant cpu is CPU-only"),
    ({"hosts": ("ssh://a",)}, "names 1 hosts for 2 nodes"),
    ({"port": 80}, "--port must be between"),
    ({"job_id": "a b"}, "--job-id 'a b': use letters"),
    ({"job_id": "x\n#SBATCH --uid=0"}, "--job-id"),
    ({"shm_size": "8g; rm -rf /"}, "--shm-size"),
])
def test_bad_input_is_one_clear_error(kw, needle):
    kw, b = split(kw)
    with pytest.raises(UserError, match=needle):
        s = spec(**kw)
        spec_mod.validate(s)
        b.check(s)


def test_culprit_is_the_earliest_last_words_else_the_first_seen():
    assert result.culprit([0, 1], {0: 10.5, 1: 10.2}) == 1   # rank 0 ended first, rank 1's worker spoke last first
    assert result.culprit([1, 0], {0: 10.1, 1: 10.2}) == 0
    assert result.culprit([0, 1], {1: 10.2}) == 0           # rank 0 has no log to go by: the order seen
    assert result.culprit([], {}) is None


def test_last_words_reads_the_worker_the_launcher_named(tmp_path):
    import os
    for name, t in (("workerlog.0", 100), ("workerlog.1", 50)):
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, ns=(t * 10**9, t * 10**9))
    launcher = tmp_path / "container.log"   # the node's output, wherever its backend keeps it
    assert result.last_words(tmp_path, launcher) is None     # two workers, none named: cannot tell
    (tmp_path / "container.log").write_text(
        "Container rank 1 status failed cmd ['python', 'x.py'] code 3 log /fleetbox/logs/workerlog.1\n")
    assert result.last_words(tmp_path, launcher) == 50
    (tmp_path / "workerlog.1").unlink()
    assert result.last_words(tmp_path, launcher) is None


def test_last_words_reads_the_launcher_log_its_backend_names_and_assumes_none(tmp_path):
    """Where a node's launcher wrote is its backend's (Docker: node<k>/container.log, Slurm: node<k>.log, another:
    its layout's output): the one given is read, another file is not, and there is no default to fall back on."""
    import inspect
    import os
    for name, t in (("workerlog.0", 100), ("workerlog.1", 50)):
        (tmp_path / name).write_text("x")
        os.utime(tmp_path / name, ns=(t * 10**9, t * 10**9))
    said = "Container rank {} status failed cmd ['python', 'x.py'] code 3 log /fleetbox/logs/workerlog.{}\n"
    (tmp_path / "container.log").write_text(said.format(1, 1))
    (tmp_path / "out.log").write_text(said.format(0, 0))
    assert result.last_words(tmp_path, tmp_path / "out.log") == 100
    assert result.last_words(tmp_path, tmp_path / "nowhere.log") is None   # none named: two workers, cannot tell
    assert inspect.signature(result.last_words).parameters["launcher_log"].default is inspect.Parameter.empty


def test_network_facts_of_this_machine():
    assert hostnet.route("127.0.0.1") == ("lo", "127.0.0.1")
    with pytest.raises(UserError, match="interface 'nope0' does not exist here"):
        hostnet.check_iface("nope0")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(UserError, match=f"port {s.getsockname()[1]} on 127.0.0.1 is already in use"):
            hostnet.check_port("127.0.0.1", s.getsockname()[1])


def test_launcher_polling_stays_out_of_the_live_stream_unless_debug():
    from fleetbox.run import output
    shown = []
    log = output.quiet(shown.append)
    poll = ('[node0] [2026-11-22 07:16:55,479] [    INFO] _client.py:1025 - HTTP Request: POST '
            'http://127.0.0.1:39605/default/info/yehgad/0 "HTTP/1.0 200 OK"')
    healthy = ('[node0] [2026-11-22 07:16:55,454] [    INFO] _client.py:1025 - '
               'HTTP Request: GET http://127.0.0.1:39605/healthy "HTTP/1.0 200 OK"')
    users = ["[node0] step    0  loss 4.39", "[node0] my script says HTTP Request: hello",
             '[node0] INFO httpx - HTTP Request: POST https://api.wandb.ai/graphql '
             '"HTTP/1.1 500 Internal Server Error"',
             '[node0] INFO httpx - HTTP Request: GET http://10.0.0.5:8080/metrics "HTTP/1.1 200 OK"']
    for line in (poll, healthy, *users):
        log(line)
    assert shown == users   # only the launcher's own polling of its master is held back


def test_the_launchers_configuration_dump_stays_out_of_the_live_stream():
    """Paddle's launcher prints ~30 settings between two dashed lines on every node: half of a 2-node job's live
    output (recorded from a real run); the lines around it, and another node's, still show."""
    from fleetbox.run import output
    ts = "LAUNCH INFO 2026-11-24 02:15:39,021 "
    dump = [f"{ts}-----------  Configuration  ----------------------", f"{ts}auto_cluster_config: 0",
            f"{ts}master: 10.213.77.11:20916", f"{ts}servers: ", f"{ts}with_gloo: 1",
            f"{ts}--------------------------------------------------"]
    kept = ["LAUNCH WARNING 2026-11-24 02:15:39,014 Host ip reset to 10.213.77.11",
            f"{ts}Job: default, mode collective, replicas 2[2:2], elastic False", "step    0  loss 4.39",
            f"{ts}--------------------------------------------------"]   # a dashed line outside a dump shows
    shown = []
    log = output.quiet(shown.append)
    for line in [f"[node0] {kept[0]}", f"[node0] {dump[0]}", f"[node1] {dump[0]}", *(f"[node0] {d}" for d in dump[1:]),
                 "[node1] step    0  loss 4.39", *(f"[node1] {d}" for d in dump[1:]), f"[node0] {kept[1]}",
                 f"[node0] {kept[2]}", f"[node0] {kept[3]}"]:
        log(line)
    assert shown == [f"[node0] {kept[0]}", "[node1] step    0  loss 4.39", f"[node0] {kept[1]}",
                     f"[node0] {kept[2]}", f"[node0] {kept[3]}"]


# -- the checkpoint contract --

def test_every_node_gets_the_checkpoint_folder_the_helpers_and_their_environment(tmp_path):
    s = spec(nodes=2, env={"PYTHONPATH": "/opt/mine"})
    t = planner.template(s, s.job_id, "/logs/{node}", checkpoints=str(tmp_path / "ck"))
    assert Mount(str(tmp_path / "ck"), settings.CHECKPOINT_DIR, ro=False) in t.mounts
    assert Mount(str(settings.HELPERS), settings.HELPERS_DIR, ro=True) in t.mounts
    assert (settings.HELPERS / "fleetbox_checkpoint.py").is_file()
    assert t.env["FLEETBOX_CHECKPOINT_DIR"] == settings.CHECKPOINT_DIR and t.env["FLEETBOX_RESUME"] == "auto"
    assert t.env["PYTHONPATH"] == f"{settings.HELPERS_DIR}:/opt/mine"   # the user's path kept, after ours
    assert "FLEETBOX_CHECKPOINT_SCOPE" not in t.env and t.env["FLEETBOX_ATTEMPT"] == "{attempt}"


def test_resume_from_a_folder_mounts_it_read_only(tmp_path):
    s = spec(nodes=1, resume=str(tmp_path))
    t = planner.template(s, s.job_id, "/logs/{node}", checkpoints="/ck")
    assert Mount(str(tmp_path), settings.RESUME_DIR, ro=True) in t.mounts
    assert t.env["FLEETBOX_RESUME"] == settings.RESUME_DIR


def test_remote_engines_keep_checkpoints_per_node_unless_a_shared_folder_is_given():
    s = spec(nodes=2)   # on two --hosts engines
    t = planner.template(s, s.job_id, None, workspace=False, checkpoints="fleetbox-j-checkpoints",
                         shared_checkpoints=False)
    assert t.env["FLEETBOX_CHECKPOINT_SCOPE"] == "node"
    assert Mount("fleetbox-j-checkpoints", settings.CHECKPOINT_DIR, ro=False) in t.mounts
    assert not any(m.dst == settings.HELPERS_DIR for m in t.mounts)   # copied in with the workspace


def test_a_gpu_variant_given_no_gpu_runs_its_ranks_on_cpu_and_asks_for_no_device():
    v = matrix.load().get("cu118-pypi")
    s = spec_mod.from_options(v, nodes=2, gpus_per_node="0")   # as the command line gives it
    assert s.on_cpu and s.device == "cpu" and s.procs_per_node == 1
    for n in plan(s):
        assert n.gpus == "" and n.accelerator == "" and "device_requests" not in docker_mod.sdk_kwargs(n)
        assert "--gpus" not in docker_mod.argv(n) and "PADDLE_PG_TIMEOUT" not in n.env
        # not even empty: Paddle's launcher reads CUDA_VISIBLE_DEVICES being set as GPU mode (its parse_device)
        assert "CUDA_VISIBLE_DEVICES" not in n.env
    given = spec_mod.from_options(v, nodes=2)   # not given: one GPU per process, as every GPU variant
    assert not given.on_cpu and [n.gpus for n in plan(given)] == ["device=0", "device=1"]
    assert not spec_mod.from_options(matrix.load().get("cpu"), nodes=2, gpus_per_node=0).on_cpu
    with pytest.raises(UserError, match="--gpus-per-node 0 runs on CPU: drop --devices"):
        spec_mod.from_options(v, docker(devices="0"), nodes=1, gpus_per_node=0)
    with pytest.raises(UserError, match="--gpus-per-node 0 runs a CUDA image on CPU; variant dcu's containers"):
        spec_mod.from_options(matrix.load().get("dcu"), nodes=1, gpus_per_node="0")


def test_a_gpu_image_run_on_cpu_asks_slurm_for_no_gpu():
    from fleetbox.run.backends import slurm
    v = matrix.load().get("cu118-pypi")
    for gpus, want in (("0", False), (None, True)):
        s = spec_mod.from_options(v, nodes=2, gpus_per_node=gpus, job_id="train-test-0001")
        batch = dict(slurm.SlurmBackend("podman").plan(replace(s, image="fleetbox/paddle:cu118-pypi")).files)
        assert ("#SBATCH --gpus-per-node=1" in batch["job.sbatch"]) is want
