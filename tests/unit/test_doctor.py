"""invoke doctor's judgement on recorded facts: every check has a case that fails it (so none passes by being
lenient), GPU/DCU/InfiniBand on recorded tool outputs and sysfs values (no such device exists here), and the
probe itself run for real on loopback."""
import copy
import json
import socket
import subprocess
import sys

import pytest

from fleetbox import doctor, settings
from fleetbox.build import matrix
from fleetbox.run import plan as planner

PORT = 41000

# what the probe printed on two healthy nodes of the test rig (trimmed to the fields the checks read)
HEALTHY = {
    0: {"rank": 0, "master_ip": "10.213.77.11", "shm": {"total": 8 << 30, "free": 8 << 30},
        "limits": {"memlock": -1, "nofile": 1048576},
        "iface": {"name": "fbn1e", "exists": True, "names": ["lo", "fbn1e"], "address": "10.213.77.11", "mtu": 1500,
                  "speed": 10000},
        "route": {"iface": "fbn1e", "local": "10.213.77.11"}, "node_ip": "10.213.77.11",
        "disk": {"/fleetbox/logs": {"free": 50 << 30, "total": 100 << 30}},
        "ports": {"bound": [41000, 41001, 41002], "busy": {}},
        "reach": {"1": {"ip": "10.213.77.12", "ports": {"41003": {"ok": True}, "41004": {"ok": True}}}},
        "joined": [1], "missing": [], "tcp": {"1": {"bytes": 64 << 20, "seconds": 0.5}}},
    1: {"rank": 1, "master_ip": "10.213.77.11", "shm": {"total": 8 << 30, "free": 8 << 30},
        "limits": {"memlock": -1, "nofile": 1048576},
        "iface": {"name": "fbn2e", "exists": True, "names": ["lo", "fbn2e"], "address": "10.213.77.12", "mtu": 1500,
                  "speed": 10000},
        "route": {"iface": "fbn2e", "local": "10.213.77.12"}, "node_ip": "10.213.77.12",
        "disk": {"/fleetbox/logs": {"free": 50 << 30, "total": 100 << 30}},
        "ports": {"bound": [41003, 41004], "busy": {}},
        "master": {"ok": True, "rtt": 0.0004, "offset": 0.0001},
        "reach": {"0": {"ip": "10.213.77.11", "ports": {"41001": {"ok": True}, "41002": {"ok": True}}}}},
}

NVIDIA_SMI = """0, NVIDIA A100-SXM4-80GB, 535.104.05, 81920 MiB
1, NVIDIA A100-SXM4-80GB, 535.104.05, 81920 MiB
"""
NVIDIA_SMI_NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure "
                        "that the latest NVIDIA driver is installed and running.\n")
ROCM_SMI = """======================= ROCm System Management Interface =======================
================================= Concise Info =================================
GPU  Temp (DieEdge)  AvgPwr  SCLK     MCLK     Fan  Perf  PwrCap  VRAM%  GPU%
0    45.0c           39.0W   800Mhz   1600Mhz  0%   auto  300.0W    0%   0%
1    44.0c           40.0W   800Mhz   1600Mhz  0%   auto  300.0W    0%   0%
================================================================================
============================= End of ROCm SMI Log ==============================
"""
HY_SMI = """============================ System Management Interface =============================
======================================================================================
DCU     Temp     AvgPwr     Perf     PwrCap     VRAM%      DCU%      Mode
0       49.0C    29.0W      auto     300.0W     0%         0%        Normal
1       47.0C    28.0W      auto     300.0W     0%         0%        Normal
2       48.0C    29.0W      auto     300.0W     0%         0%        Normal
3       47.0C    27.0W      auto     300.0W     0%         0%        Normal
======================================================================================
=================================== End of SMI Log ===================================
"""


def expect(**kw):
    base = dict(nodes=2, shm="8g", device="cpu", port=PORT)
    return doctor.Expect(**{**base, **kw})


def rows_of(facts, **kw):
    return doctor.evaluate(facts, expect(**kw), "10.213.77.11")


def failing(rows):
    return [(r.node, r.check) for r in rows if not r.ok]


def broken(rank, path, value):
    facts = copy.deepcopy(HEALTHY)
    d = facts[rank]
    for key in path[:-1]:
        d = d[key]
    d[path[-1]] = value
    return facts


def test_healthy_facts_pass_every_check():
    rows = rows_of(HEALTHY)
    assert failing(rows) == []
    checks = {r.check for r in rows if r.node == "node1"}
    assert {"/dev/shm", "memlock", "open files", "interface", "route to master", "MTU", "link speed", "master port",
            "clock skew", "ports of node0", "ports free", "free disk /fleetbox/logs"} <= checks


@pytest.mark.parametrize("rank, path, value, check, words", [
    (1, ("shm", "total"), 64 << 20, "/dev/shm", "shm is 64 MiB"),
    (1, ("shm",), {"error": "No such file or directory"}, "/dev/shm", "no /dev/shm"),
    (1, ("limits", "nofile"), 1024, "open files", "limited to 1024"),
    (1, ("iface", "exists"), False, "interface", "is not on this node"),
    (1, ("iface", "address"), None, "interface", "no IPv4 address"),
    (1, ("route",), {"iface": "fbn2e", "local": "10.213.77.12"} | {"iface": "eth9"}, "route to master",
     "does not route to the master"),
    (1, ("route",), {"error": "Network is unreachable"}, "route to master", "no route to the master"),
    (1, ("iface", "mtu"), 576, "MTU", "too small"),
    (1, ("iface", "speed"), 100, "link speed", "100 Mb/s"),
    (1, ("master",), {"ok": False, "error": "timed out (dropped by a firewall?)"}, "master port",
     "cannot reach the master 10.213.77.11:41000"),
    (1, ("master", "offset"), 2.5, "clock skew", "+2.5 s off node0"),
    (1, ("reach", "0", "ports", "41001"), {"ok": False, "error": "refused"}, "ports of node0", "41001"),
    (0, ("reach", "1", "ports", "41004"), {"ok": False, "error": "timed out"}, "ports of node1", "41004"),
    (1, ("ports", "busy"), {"41003": "Address in use"}, "ports free", "already in use"),
    (1, ("disk", "/fleetbox/logs", "free"), 100 << 20, "free disk /fleetbox/logs", "only 100 MiB free"),
    (1, ("disk", "/fleetbox/logs"), {"error": "Read-only file system"}, "free disk /fleetbox/logs", "not usable"),
    (0, ("missing",), [1], "nodes joined", "missing nodes"),
])
def test_each_check_fails_on_its_own_fault(rank, path, value, check, words):
    rows = rows_of(broken(rank, path, value))
    bad = [r for r in rows if not r.ok]
    assert [(r.node, r.check) for r in bad] == [(f"node{rank}", check)]
    assert words in bad[0].fix


def test_shm_fix_names_the_runtime_args_that_override_it():
    rows = rows_of(broken(1, ("shm", "total"), 64 << 20), runtime="podman", runtime_args=("--shm-size", "64m"))
    fix = next(r.fix for r in rows if not r.ok)
    assert fix == "shm is 64 MiB: the job would use --shm-size 8g; your --runtime-args override it (--shm-size 64m)"


def test_a_forced_interface_that_does_not_route_says_which_one_does():
    facts = copy.deepcopy(HEALTHY)   # --iface lo: on every node
    for f in facts.values():
        f["iface"] = {"name": "lo", "exists": True, "names": ["lo", "fbn2e"], "address": "127.0.0.1", "mtu": 65536,
                      "speed": None}
    rows = rows_of(facts, forced_iface="lo")
    bad = [r for r in rows if not r.ok]
    assert [(r.node, r.check) for r in bad] == [("node0", "route to master"), ("node1", "route to master")]
    assert bad[1].fix == ("interface lo does not route to the master 10.213.77.11 (the route goes via fbn2e "
                          "10.213.77.12): drop --iface lo or use --iface fbn2e")


def test_mtu_must_match_across_nodes():
    rows = rows_of(broken(1, ("iface", "mtu"), 9000))
    assert failing(rows) == [("node1", "same MTU")]


def test_memlock_is_held_to_unlimited_only_where_nccl_or_rdma_pin_memory():
    capped = broken(1, ("limits", "memlock"), 8 << 20)
    assert failing(rows_of(capped)) == []                                       # Gloo over TCP
    rows = rows_of(capped, device="rocm")
    assert ("node1", "memlock") in failing(rows) and ("node0", "memlock") not in failing(rows)


def gpu_facts(result):
    facts = copy.deepcopy(HEALTHY)
    for f in facts.values():
        f["gpu"] = result
    return facts


def test_gpu_driver_against_the_matrix_minimum_on_recorded_nvidia_smi():
    m = matrix.load()
    assert (m.get("cu118").min_driver, m.get("cu126").min_driver, m.get("cu129").min_driver) == \
        ("520.61.05", "560.28.03", "575.51.03")
    ok = gpu_facts({"rc": 0, "out": NVIDIA_SMI, "err": ""})
    rows = rows_of(ok, device="cuda", min_driver=m.get("cu118").min_driver, gpus=2)
    assert failing(rows) == []
    assert next(r.value for r in rows if r.check == "GPUs") == "2 x NVIDIA A100-SXM4-80GB"
    rows = rows_of(ok, device="cuda", min_driver=m.get("cu126").min_driver, gpus=2)
    assert failing(rows) == [("node0", "GPU driver"), ("node1", "GPU driver")]
    assert "535.104.05 is older than 560.28.03" in rows[[r.check for r in rows].index("GPU driver")].fix
    assert failing(rows_of(ok, device="cuda", min_driver="520.61.05", gpus=4)) == [("node0", "GPUs"), ("node1", "GPUs")]


def test_gpu_without_a_driver_or_tool_in_the_container():
    for result in ({"rc": 9, "out": NVIDIA_SMI_NO_DRIVER, "err": ""}, {"missing": "nvidia-smi"}):
        rows = rows_of(gpu_facts(result), device="cuda", min_driver="520.61.05")
        assert failing(rows) == [("node0", "GPU driver"), ("node1", "GPU driver")]
        assert "NVIDIA Container Toolkit" in next(r.fix for r in rows if not r.ok)


def dcu_facts(**kw):
    facts = copy.deepcopy(HEALTHY)
    d = {"kfd": True, "dri": ["card0", "card1", "renderD128", "renderD129"], "hyhal": True, "groups": [44],
         "video_gid": 44, "smi": {"tool": "hy-smi", "rc": 0, "out": HY_SMI, "err": ""}, **kw}
    for f in facts.values():
        f["dcu"] = d
    return facts


def test_dcu_devices_on_recorded_sysfs_and_smi_outputs():
    assert doctor.dcus_from_smi(HY_SMI) == 4 and doctor.dcus_from_smi(ROCM_SMI) == 2
    assert doctor.dcus_from_smi("GPU[0]\t\t: Card series: ...\nGPU[1]\t\t: Card series: ...\n") == 2
    assert failing(rows_of(dcu_facts(), device="rocm", gpus=4)) == []
    for fault, check in (({"kfd": False}, "/dev/kfd"), ({"dri": ["card0"]}, "/dev/dri"),
                         ({"hyhal": False}, "/opt/hyhal"), ({"groups": [0]}, "video group"),
                         ({"smi": {"tool": "hy-smi", "rc": 0, "out": ROCM_SMI}}, "DCUs")):
        assert failing(rows_of(dcu_facts(**fault), device="rocm", gpus=4)) == [("node0", check), ("node1", check)]


def test_infiniband_on_recorded_sysfs():
    def ib(present, state):
        facts = copy.deepcopy(HEALTHY)
        for f in facts.values():
            f["ib"] = {"hca": "mlx5_0", "present": present, "ports": {"1": {
                "state": state, "phys_state": "5: LinkUp", "rate": "200 Gb/sec (4X HDR)", "link_layer": "InfiniBand"}}}
        return facts
    rows = rows_of(ib(True, "4: ACTIVE"), ib_hca="mlx5_0")
    assert failing(rows) == []
    assert next(r.value for r in rows if r.check == "InfiniBand") == "mlx5_0 port 1: ACTIVE 200 Gb/sec (4X HDR) InfiniBand"
    assert failing(rows_of(ib(True, "1: DOWN"), ib_hca="mlx5_0")) == [("node0", "InfiniBand"), ("node1", "InfiniBand")]
    assert failing(rows_of(ib(False, ""), ib_hca="mlx5_0")) == [("node0", "InfiniBand"), ("node1", "InfiniBand")]


def test_image_identity_across_nodes():
    same = {0: ("sha256:aa", "c1"), 1: ("sha256:aa", "c1")}
    assert [r.ok for r in doctor.same_image(same, 2, "x")] == [True, True]
    assert [r.ok for r in doctor.same_image({0: ("sha256:aa", "c1"), 1: ("sha256:bb", "c1")}, 2, "x")] == [True, False]
    assert [r.ok for r in doctor.same_image({0: ("sha256:aa", "c1"), 1: ("sha256:aa", "c2")}, 2, "x")] == [True, False]
    out = {0: "fleetbox: node 0 on node1: ...\nfleetbox: image id sha256:aa c1\n",
           1: "fleetbox: image file-sha256 0123 \n"}
    rows = doctor.slurm_identity(out, 2, "img")
    assert [(r.node, r.check, r.ok) for r in rows] == [("node0", "image", True), ("node1", "image", True),
                                                       ("node0", "same image", True), ("node1", "same image", False)]
    rows = doctor.slurm_identity({0: "fleetbox: image missing /x/img.sqfs is not on node2\n", 1: ""}, 2, "/x/img.sqfs")
    assert [(r.check, r.ok) for r in rows] == [("image", False), ("image", False)]


def test_sizes():
    assert doctor.size_bytes("8g") == 8 << 30 and doctor.size_bytes("512M") == 512 << 20 and doctor.size_bytes("100") == 100
    assert doctor.human(64 << 20) == "64 MiB" and doctor.human(-1) == "unlimited"


def test_each_node_has_its_own_pinned_ports_above_the_master_port():
    blocks = [planner.trainer_ports(PORT, k, 2) for k in range(3)]
    assert blocks == [(41001, 41003), (41004, 41006), (41007, 41009)]
    assert planner.ports_needed(3, 2) == 10


def test_the_slurm_node_script_pins_the_same_ports(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    from fleetbox.run import slurm_backend, spec as spec_mod
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=3, procs_per_node=2, port=PORT,
                            job_id="train-ports-0001")
    node_sh = dict(slurm_backend.SlurmBackend("podman").plan(spec).files)["node.sh"]
    line = next(ln for ln in node_sh.splitlines() if ln.startswith("PORT_RANGE="))
    assert '-e PORT_RANGE="$PORT_RANGE"' in node_sh   # the container gets it
    for k in range(3):
        got = subprocess.run(["bash", "-c", f"MASTER_PORT={PORT} SLURM_NODEID={k}; {line}; echo $PORT_RANGE"],
                             capture_output=True, text=True).stdout.strip()
        assert got == "%d:%d" % planner.trainer_ports(PORT, k, 2)


def run_probe(rank, port, nnodes=2, **kw):
    argv = [sys.executable, str(settings.HELPERS / "fleetbox_doctor.py"), "--rank", str(rank), "--nnodes", str(nnodes),
            "--master", f"127.0.0.1:{port}", "--node-ip", "127.0.0.1", "--iface", "lo", "--wait", "3",
            "--knock-timeout", "1", *[str(x) for kv in kw.items() for x in (f"--{kv[0]}", kv[1])]]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def free_block(n):
    from fleetbox.run import hostnet
    return hostnet.free_block("127.0.0.1", n)


def test_the_probe_on_loopback_meets_its_peer_and_knocks_on_every_port():
    port = free_block(5)
    p0, p1 = run_probe(0, port, blast=1 << 20), run_probe(1, port)
    f0, f1 = (doctor.parse_probe(p.communicate(timeout=30)[0]) for p in (p0, p1))
    assert f0["ports"]["bound"] == [port, port + 1, port + 2] and f1["ports"]["bound"] == [port + 3, port + 4]
    assert f1["master"]["ok"] and abs(f1["master"]["offset"]) < 0.5
    assert sorted(f1["reach"]["0"]["ports"], key=int) == [str(port + 1), str(port + 2)]
    assert all(r["ok"] for r in f1["reach"]["0"]["ports"].values())
    assert all(r["ok"] for r in f0["reach"]["1"]["ports"].values()) and f0["joined"] == [1]
    assert f0["tcp"]["1"]["bytes"] == 1 << 20 and f0["tcp"]["1"]["seconds"] > 0
    assert failing(doctor.evaluate({0: f0, 1: f1}, doctor.Expect(2, "1m", "cpu", port=port), "127.0.0.1")) == []


def test_the_probe_names_a_port_taken_and_a_master_that_never_answers():
    port = free_block(5)
    with socket.socket() as taken:
        taken.bind(("", port + 3))   # node 1's first pinned port
        taken.listen()
        p1 = run_probe(1, port)      # no node 0: nothing listens on the master port
        f1 = doctor.parse_probe(p1.communicate(timeout=30)[0])
    assert list(f1["ports"]["busy"]) == [str(port + 3)] and f1["ports"]["bound"] == [port + 4]
    assert f1["master"] == {"ok": False, "error": "refused"}
    assert {p: r["error"] for p, r in f1["reach"]["0"]["ports"].items()} == \
        {str(port + 1): "refused", str(port + 2): "refused"}
    rows = doctor.evaluate({1: f1}, doctor.Expect(2, "1m", "cpu", port=port), "127.0.0.1")
    assert {r.check for r in rows if not r.ok} >= {"ports free", "master port", "ports of node0"}


def test_sweep_table_is_nccl_tests_shaped():
    sweep = {"backend": "gloo", "world": 2, "nodes": 2, "rows": [
        {"size": 1024, "count": 256, "time_us": 100.0, "algbw": 0.01024, "busbw": 0.01024, "wrong": 0},
        {"size": 67108864, "count": 16777216, "time_us": 600000.0, "algbw": 0.1118, "busbw": 0.1118, "wrong": 0}]}
    text = doctor.sweep_table(sweep, 0.125)
    assert "    67108864     16777216   float    sum   600000.0    0.112    0.112      0" in text
    assert "busbw 0.112 GB/s = 0.89 x raw TCP" in text
    assert doctor.sweep_row({"ok": True, "sweep": sweep}).ok
    sweep["rows"][0]["wrong"] = 3
    assert not doctor.sweep_row({"ok": True, "sweep": sweep}).ok
