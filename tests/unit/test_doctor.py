"""invoke doctor's judgement on recorded facts: every check has a case that fails it (so none passes by being
lenient), GPU/DCU/InfiniBand on recorded tool outputs and sysfs values (no such device exists here), and the
probe itself run for real on loopback."""
import copy
import re
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fleetbox import settings
from fleetbox.commands import checks, doctor
from fleetbox.image import kernels, matrix
from fleetbox.image.kernels import Kernels
from fleetbox.incontainer import fleetbox_doctor
from fleetbox.run import backends
from fleetbox.run import plan as planner
from fleetbox.run import spec as spec_mod

PORT = 41000

def healthy_node(rank: int) -> dict:
    """What the probe prints on node `rank` of the healthy test rig (trimmed to the fields the checks read):
    its own address on fbn<rank+1>e, its pinned block bound, every other node's block reached."""
    ip, other = f"10.213.77.{11 + rank}", f"10.213.77.{12 - rank}"
    mine, theirs = (list(range(a, b + 1)) for a, b in (planner.trainer_ports(PORT, rank, 1),
                                                       planner.trainer_ports(PORT, 1 - rank, 1)))
    iface = f"fbn{rank + 1}e"
    f = {"rank": rank, "master_ip": "10.213.77.11", "shm": {"total": 8 << 30, "free": 8 << 30},
         "limits": {"memlock": -1, "nofile": 1048576},
         "iface": {"name": iface, "exists": True, "names": ["lo", iface], "address": ip, "mtu": 1500, "speed": 10000},
         "route": {"iface": iface, "local": ip}, "node_ip": ip,
         "disk": {"/fleetbox/logs": {"free": 50 << 30, "total": 100 << 30}},
         "ports": {"bound": ([PORT] if rank == 0 else []) + mine, "busy": {}},
         "reach": {str(1 - rank): {"ip": other, "ports": {str(p): {"ok": True} for p in theirs}}}}
    if rank == 0:
        f.update(joined=[1], missing=[], tcp={"1": {"bytes": 64 << 20, "seconds": 0.5}})
    else:
        f["master"] = {"ok": True, "rtt": 0.0004, "offset": 0.0001}
    return f


HEALTHY = {0: healthy_node(0), 1: healthy_node(1)}   # node0's block 41001-41004, node1's 41005-41008

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
    """What doctor expects of a backend whose runtime is `runtime` (Docker's by default), with its driver's fix."""
    runtime = kw.get("runtime", "docker")
    b = backends.get("docker") if runtime == "docker" else backends.get("slurm", runtime=runtime)
    base = dict(nodes=2, shm="8g", device="cpu", port=PORT, no_driver_fix=b.doctoring.no_driver_fix)
    return checks.Expect(**{**base, **kw})


def rows_of(facts, **kw):
    return checks.evaluate(facts, expect(**kw), "10.213.77.11")


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
    (0, ("reach", "1", "ports", "41006"), {"ok": False, "error": "timed out"}, "ports of node1", "41006"),
    (1, ("ports", "busy"), {"41005": "Address in use: LISTEN"}, "ports free", "already in use on node1: another job"),
    (1, ("ports", "busy"), {"41005": "Address in use: TIME-WAIT"}, "ports free", "(TIME-WAIT), which Paddle's"),
    (1, ("ports", "busy"), {"41005": "Address in use: FIN-WAIT-2, TIME-WAIT", "41006": "Address in use: LAST-ACK"},
     "ports free", "(TIME-WAIT), which Paddle's"),
    (1, ("ports", "busy"), {"41005": "Address in use"}, "ports free", "already in use on node1: another job"),
    (1, ("disk", "/fleetbox/logs", "free"), 100 << 20, "free disk /fleetbox/logs", "only 100 MiB free"),
    (1, ("disk", "/fleetbox/logs"), {"error": "Read-only file system"}, "free disk /fleetbox/logs", "not usable"),
    (0, ("missing",), [1], "nodes joined", "missing nodes"),
    (1, ("master", "after_join"), "node 0 sent no peer list", "master port", "joined, then node 0 sent no peer list"),
    (1, ("crash",), "OSError: boom", "probe", "the probe failed on node1: OSError: boom"),
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


def test_shm_advice_follows_what_the_backend_says_of_its_runtime():
    """--shm-size reaches Docker's and Podman's containers; Apptainer's see the node's own /dev/shm."""
    assert backends.get("docker").doctoring.shm_settable
    assert backends.get("slurm", runtime="podman").doctoring.shm_settable
    assert not backends.get("slurm", runtime="apptainer").doctoring.shm_settable
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2)
    for b, advice in ((backends.get("slurm", runtime="podman"), "raise the engine's limit"),
                      (backends.get("slurm", runtime="apptainer"), "apptainer uses the node's own /dev/shm")):
        e = doctor.expect(spec, PORT, b)
        rows = checks.evaluate(broken(1, ("shm", "total"), 64 << 20), e, "10.213.77.11")
        assert advice in next(r.fix for r in rows if not r.ok)


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
    assert [(m.get(v).min_driver, m.get(v).toolkit_driver) for v in ("cu118", "cu126", "cu129")] == \
        [("450.80.02", "520.61.05"), ("525.60.13", "560.28.03"), ("525.60.13", "575.51.03")]
    ok = gpu_facts({"rc": 0, "out": NVIDIA_SMI, "err": ""})
    cu118 = dict(device="cuda", min_driver="450.80.02", toolkit_driver="520.61.05", gpus=2)
    cu126 = dict(device="cuda", min_driver="525.60.13", toolkit_driver="560.28.03", gpus=2)
    rows = rows_of(ok, **cu118)
    assert failing(rows) == []
    assert next(r.value for r in rows if r.check == "GPUs") == "2 x NVIDIA A100-SXM4-80GB"
    assert next(r.value for r in rows if r.check == "GPU driver") == "535.104.05"
    rows = rows_of(ok, **cu126)   # 535 runs CUDA 12.6 by minor-version compatibility, and says so
    assert failing(rows) == []
    assert next(r.value for r in rows if r.check == "GPU driver") == \
        "535.104.05 (by CUDA minor-version compatibility: no PTX JIT)"
    old = gpu_facts({"rc": 0, "out": NVIDIA_SMI.replace("535.104.05", "470.256.02"), "err": ""})
    rows = rows_of(old, **cu126)
    assert failing(rows) == [("node0", "GPU driver"), ("node1", "GPU driver")]
    assert "470.256.02 is older than 525.60.13" in next(r.fix for r in rows if not r.ok)
    assert failing(rows_of(ok, **{**cu118, "gpus": 4})) == [("node0", "GPUs"), ("node1", "GPUs")]


def test_a_process_per_gpu_needs_as_many_gpus():
    from fleetbox.run import spec as spec_mod
    spec = spec_mod.JobSpec(variant=matrix.load().get("cu126"), nodes=2, procs_per_node=8)
    assert doctor.expect(spec, PORT, backends.get(backends.DEFAULT)).gpus == 8
    # each node's container sees its own block of --devices: 2 of 4 for 2 nodes
    assert doctor.expect(spec_mod.JobSpec(variant=matrix.load().get("cu126"), procs_per_node=2),
                         PORT, backends.get(backends.DEFAULT, devices="0,1,2,3")).gpus == 2


def test_gpu_without_a_driver_or_tool_in_the_container():
    for result in ({"rc": 9, "out": NVIDIA_SMI_NO_DRIVER, "err": ""}, {"missing": "nvidia-smi"}):
        rows = rows_of(gpu_facts(result), device="cuda", min_driver="520.61.05")
        assert failing(rows) == [("node0", "GPU driver"), ("node1", "GPU driver")]
        assert "NVIDIA Container Toolkit" in next(r.fix for r in rows if not r.ok)


@pytest.mark.parametrize("runtime,names", [
    ("docker", "nvidia-ctk runtime configure --runtime=docker"), ("podman", "nvidia-ctk cdi generate"),
    ("charliecloud", "ch-fromhost --nvidia"), ("pyxis", "/etc/enroot/hooks.d/98-nvidia.sh"),
    ("apptainer", "apptainer --nv"), ("none", "check `nvidia-smi` on the node")])
def test_a_container_without_the_driver_is_told_what_its_runtime_needs(runtime, names):
    """Pyxis's prerequisite (enroot's hook) is only seen from inside: the container has no driver without it."""
    rows = rows_of(gpu_facts({"missing": "nvidia-smi"}), device="cuda", min_driver="520.61.05", runtime=runtime)
    assert names in next(r.fix for r in rows if r.node == "node0" and not r.ok)



# Recorded: `nvidia-smi --query-gpu=<every field> --format=csv` on real machines (tests/recorded/nvidia-smi/README.md)
RECORDED = Path(__file__).parents[1] / "recorded" / "nvidia-smi"
# Recorded: nvidia-smi of driver 470.182.03, asked for compute_cap (tests/recorded/nvidia-smi/README.md)
NO_COMPUTE_CAP = RECORDED.joinpath("compute-cap-not-valid__470.182.03.txt").read_text()


def as_queried(card: str, fields) -> str:
    """What `nvidia-smi --query-gpu=FIELDS --format=csv,noheader` prints for the recorded card: its answer to
    every field, reduced to FIELDS by the header's names (units dropped: "memory.total [MiB]")."""
    header, *rows = RECORDED.joinpath(f"query-gpu-all__{card}.csv").read_text().splitlines()
    names = [h.split(" [")[0] for h in header.split(", ")]
    return "".join(", ".join(row.split(", ")[names.index(f)] for f in fields) + "\n" for row in rows)


def card_facts(card):
    fields = fleetbox_doctor.GPU_FIELDS
    return gpu_facts({"rc": 0, "out": as_queried(card, fields), "err": "", "fields": list(fields)})


CU118_PYPI = matrix.load().get("cu118-pypi")


def cu118_pypi(**kw) -> dict:
    """What doctor expects of the cu118-pypi image, as `doctor.expect` gives it: its wheel's measured kernels, and
    every other CUDA variant's, measured or published."""
    spec = spec_mod.JobSpec(variant=CU118_PYPI, procs_per_node=kw.pop("gpus", 1))
    e = doctor.expect(spec, PORT, backends.get("docker"))
    return dict(device="cuda", min_driver=e.min_driver, toolkit_driver=e.toolkit_driver, gpus=e.gpus,
                variant=e.variant, kernels=e.kernels, instead=e.instead, **kw)


def table_card(card: str, compute_cap: str) -> str:
    """A recorded `nvidia-smi` table (its header and the GPU's rows) as the probe's query reads it: the table has
    no uuid (nvidia-smi's [N/A]) and no compute capability (given)."""
    head, row, mem = RECORDED.joinpath(f"table__{card}.txt").read_text().splitlines()
    driver = re.search(r"Driver Version: (\S+)", head).group(1)
    index, name = re.match(r"\|\s+(\d+)\s+(.+?)\s+(On|Off)\s+\|", row).groups()[:2]
    total = re.search(r"/\s+(\d+)MiB \|", mem).group(1)
    return f"{index}, [N/A], {name}, {driver}, {total} MiB, {compute_cap}\n"


B200_CAP = RECORDED.joinpath("query-name-compute-cap__nvidia-b200.csv").read_text().splitlines()[1].split(", ")[1]
CARDS = {  # recorded answers, each as the probe's query gives it
    **{c: lambda c=c: as_queried(c, fleetbox_doctor.GPU_FIELDS) for c in (
        "nvidia-h200__590.48.01", "nvidia-h100-80gb-hbm3__590.48.01", "nvidia-l40s__595.80",
        "nvidia-geforce-rtx-2080-super__595.71.05")},
    "nvidia-a100-sxm4-40gb__580.126.09": lambda: table_card("nvidia-a100-sxm4-40gb__580.126.09", "8.0"),
    "nvidia-b200__580.95.05": lambda: table_card("nvidia-b200__580.95.05", B200_CAP)}


@pytest.mark.parametrize("card,instead", [
    ("nvidia-h200__590.48.01", "use cu126 (published) or cu129 (published), built for 9.0"),
    ("nvidia-h100-80gb-hbm3__590.48.01", "use cu126 (published) or cu129 (published), built for 9.0"),
    ("nvidia-b200__580.95.05", "no variant of the matrix is built for 10.0"),
    ("nvidia-a100-sxm4-40gb__580.126.09", None), ("nvidia-l40s__595.80", None),
    ("nvidia-geforce-rtx-2080-super__595.71.05", None)])
def test_each_gpus_compute_capability_against_the_kernels_measured_from_the_wheel(card, instead):
    """cu118-pypi's kernels, measured from its wheel, are sm_61 to sm_86: an A100 (8.0) runs its own, an L40S (8.9)
    the sm_86 ones, an RTX 2080 SUPER (7.5) its own; Hopper (9.0) and Blackwell (10.0) run none, and doctor says so
    for the node before a rank starts, naming the variants that have kernels for it."""
    out = CARDS[card]()
    rows = rows_of(gpu_facts({"rc": 0, "out": out, "err": "", "fields": list(fleetbox_doctor.GPU_FIELDS)}),
                   **cu118_pypi())
    row = next(r for r in rows if r.node == "node0" and r.check == "compute capability")
    _, _, name, _, _, cap = out.splitlines()[0].split(", ")
    assert (row.ok, row.value, row.threshold) == (instead is None, f"{cap} ({name})",
                                                  "6.1, 7.0, 7.5, 8.0, 8.6 (the wheel's kernels, measured)")
    assert failing(rows) == ([] if instead is None else [("node0", "compute capability"),
                                                         ("node1", "compute capability")])
    if instead:
        assert row.fix == (f"GPU 0 ({name}, compute capability {cap}): the cu118-pypi wheel has no kernels for it "
                           f"(built for 6.1, 7.0, 7.5, 8.0, 8.6); Paddle stops at its first GPU kernel: {instead}")
    # what Paddle publishes (not measured) may leave out what its wheel has: said, not failed
    cu129 = matrix.load().get("cu129")
    rows = rows_of(gpu_facts({"rc": 0, "out": out, "err": "", "fields": list(fleetbox_doctor.GPU_FIELDS)}),
                   **{**cu118_pypi(), "variant": "cu129", "kernels": kernels.load(cu129)})
    row = next(r for r in rows if r.node == "node0" and r.check == "compute capability")
    assert row.ok and row.threshold.endswith(" (the wheel's kernels, published)")
    assert row.value.endswith("; 10.0 is not among the architectures Paddle publishes for cu129 (`invoke wheels` "
                              "measures its wheel)") == (cap == "10.0"), row.value
    # a variant nobody has measured or published: said, not failed
    rows = rows_of(gpu_facts({"rc": 0, "out": out, "err": "", "fields": list(fleetbox_doctor.GPU_FIELDS)}),
                   device="cuda", variant="cu118")
    row = next(r for r in rows if r.node == "node0" and r.check == "compute capability")
    assert row.ok and row.threshold == "the variant's kernels (not known: `invoke wheels` measures them)"


def test_a_gpu_that_runs_some_kernels_only_through_ptx_passes_and_says_its_slow_first_start():
    k = Kernels({"paddle/base/libpaddle.so": Counter({
        frozenset({("sass", "8.0"), ("ptx", "8.0")}): 3, frozenset({("sass", "8.0"), ("sass", "9.0")}): 1})})
    out = as_queried("nvidia-h100-80gb-hbm3__590.48.01", fleetbox_doctor.GPU_FIELDS)
    rows = rows_of(gpu_facts({"rc": 0, "out": out, "err": "", "fields": list(fleetbox_doctor.GPU_FIELDS)}),
                   **{**cu118_pypi(), "kernels": k})
    row = next(r for r in rows if r.node == "node0" and r.check == "compute capability")
    assert row.ok and row.value == "9.0 (NVIDIA H100 80GB HBM3); 9.0 through PTX compiled at first run (a slow first " \
                                   "start)"


def test_a_gpu_that_reports_no_compute_capability_leaves_the_others_checked():
    out = ("0, GPU-0, NVIDIA H200, 590.48.01, 143771 MiB, [N/A]\n"
           "1, GPU-1, NVIDIA H200, 590.48.01, 143771 MiB, 9.0\n")
    facts = gpu_facts({"rc": 0, "out": out, "err": "", "fields": list(fleetbox_doctor.GPU_FIELDS)})
    rows = rows_of(facts, **cu118_pypi(gpus=2))
    row = next(r for r in rows if r.node == "node0" and r.check == "compute capability")
    assert not row.ok and row.value == "9.0 (NVIDIA H200), not reported (NVIDIA H200)"
    assert row.fix.startswith("GPU 1 (NVIDIA H200, compute capability 9.0)")


def test_a_driver_whose_nvidia_smi_has_no_compute_cap_is_asked_the_rest_and_the_row_says_so(tmp_path, monkeypatch):
    """The probe for real, against an nvidia-smi that answers as driver 470's does (recorded): the query with
    compute_cap fails, the one without it is asked; the row says the capability is not reported."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    old = as_queried("nvidia-h100-80gb-hbm3__590.48.01", fleetbox_doctor.GPU_FIELDS[:-1])   # (590's values)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in *compute_cap*) printf '%s' '{NO_COMPUTE_CAP}'; exit 2;; esac\n"
                   f"printf '%s' '{old}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    got = fleetbox_doctor.gpu_facts()
    assert got == {"rc": 0, "out": old, "err": "", "fields": list(fleetbox_doctor.GPU_FIELDS[:-1])}
    rows = rows_of(gpu_facts(got), **cu118_pypi())
    assert failing(rows) == []
    row = next(r for r in rows if r.check == "compute capability")
    assert row.value == "not reported (this driver's nvidia-smi has no compute_cap)"


DCU_RECORDED = Path(__file__).parents[1] / "recorded" / "dcu"


@pytest.mark.parametrize("recorded,value", [
    ("paddle-73087-version-show.txt", "ROCT version mismatch: [ROCT-Thunk-Interface/src/hymgr.c:344, WARNING]: "
                                      "Version mismatch"),
    # the driver's version unreadable comes first there, and is the cause: the mismatch follows from it
    ("paddle-78071-import.txt", "the DCU driver's version is unreadable: get hyhal driver version error"),
    ("paddle-71646-import.txt", "Paddle sees no DCU: Compiled with WITH_GPU, but no GPU found in runtime"),
])
def test_what_paddles_import_prints_on_a_dcu_node_names_what_stops_the_image_there(recorded, value):
    said = DCU_RECORDED.joinpath(recorded).read_text()
    facts = dcu_facts()
    for f in facts.values():
        f["paddle"] = {"rc": 0, "out": "", "err": said}   # each import went on (warnings), as in the issues
    rows = rows_of(facts, device="rocm")
    assert failing(rows) == [("node0", "DTK and driver"), ("node1", "DTK and driver")]
    row = next(r for r in rows if r.check == "DTK and driver")
    assert row.value == value[:120]
    assert row.fix.startswith({"ROCT ": "the image's DTK (its ROCT thunk library) does not match the node's DCU",
                               "Paddl": "Paddle found no device",
                               "the D": "the container cannot read /sys/module/hydcu/version"}[value[:5]])


def test_the_probe_keeps_what_paddles_import_warns_of_first_however_much_follows(tmp_path):
    """The import's first warning (ROCT's mismatch) is followed by pages of glog lines: the probe keeps the head
    of stderr as well as its end, and the row still names the mismatch."""
    said = DCU_RECORDED.joinpath("paddle-73087-version-show.txt").read_text().splitlines()[0]
    script = tmp_path / "noisy.py"
    script.write_text(f"import sys\nprint({said!r}, file=sys.stderr)\n"
                      "for i in range(200):\n"
                      "    print(f'W0604 13:57:12.876377    71 init.cc:{i}] a warning', file=sys.stderr)\n"
                      "print('3.0.0')\n")
    got = fleetbox_doctor._run([sys.executable, str(script)], head=True)
    assert got["rc"] == 0 and len(got["err"]) <= 4005 and said in got["err"]
    facts = dcu_facts()
    for f in facts.values():
        f["paddle"] = got
    row = next(r for r in rows_of(facts, device="rocm") if r.check == "DTK and driver")
    assert not row.ok and row.value.startswith("ROCT version mismatch")
    assert said not in fleetbox_doctor._run([sys.executable, str(script)])["err"]   # what the tail alone kept


def test_an_import_that_prints_nothing_is_said_not_crashed_on():
    facts = dcu_facts()
    for f in facts.values():
        f["paddle"] = {"rc": 0, "out": "", "err": ""}
    row = next(r for r in rows_of(facts, device="rocm") if r.check == "DTK and driver")
    assert row.ok and row.value == "Paddle ? imports"


def test_a_dcu_node_where_paddle_imports_quietly_passes_and_the_probe_is_asked_to_import_it():
    facts = dcu_facts()
    for f in facts.values():
        f["paddle"] = {"rc": 0, "out": "3.0.0\n", "err": ""}
    rows = rows_of(facts, device="rocm")
    assert failing(rows) == []
    assert next(r.value for r in rows if r.check == "DTK and driver") == "Paddle 3.0.0 imports"
    dcu = spec_mod.JobSpec(variant=matrix.load().get("dcu"))
    assert "--import-paddle" in checks.probe_command(dcu, 0, 30)
    assert "--import-paddle" not in checks.probe_command(spec_mod.JobSpec(variant=matrix.load().get("cu126")), 0, 30)

def dcu_facts(**kw):
    facts = copy.deepcopy(HEALTHY)
    d = {"kfd": True, "dri": ["card0", "card1", "renderD128", "renderD129"], "hyhal": True, "groups": [44],
         "video_gid": 44, "smi": {"tool": "hy-smi", "rc": 0, "out": HY_SMI, "err": ""}, **kw}
    for f in facts.values():
        f["dcu"] = d
    return facts


def test_dcu_devices_on_recorded_sysfs_and_smi_outputs():
    assert checks.dcus_from_smi(HY_SMI) == 4 and checks.dcus_from_smi(ROCM_SMI) == 2
    assert checks.dcus_from_smi("GPU[0]\t\t: Card series: ...\nGPU[1]\t\t: Card series: ...\n") == 2
    assert failing(rows_of(dcu_facts(), device="rocm", gpus=4)) == []
    for fault, check in (({"kfd": False}, "/dev/kfd"), ({"dri": ["card0"]}, "/dev/dri"),
                         ({"hyhal": False}, "/opt/hyhal"), ({"groups": [0]}, "video group"),
                         ({"smi": {"tool": "hy-smi", "rc": 0, "out": ROCM_SMI}}, "DCUs"),
                         ({"usable": {"/dev/kfd": True, "/dev/dri/renderD128": False}}, "device access")):
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
    ib_row = next(r.value for r in rows if r.check == "InfiniBand")
    assert ib_row == "mlx5_0 port 1: ACTIVE 200 Gb/sec (4X HDR) InfiniBand"
    assert failing(rows_of(ib(True, "1: DOWN"), ib_hca="mlx5_0")) == [("node0", "InfiniBand"), ("node1", "InfiniBand")]
    assert failing(rows_of(ib(False, ""), ib_hca="mlx5_0")) == [("node0", "InfiniBand"), ("node1", "InfiniBand")]


def test_image_identity_across_nodes():
    same = {0: ("sha256:aa", "c1"), 1: ("sha256:aa", "c1")}
    assert [r.ok for r in checks.same_image(same, 2, "x")] == [True, True]
    assert [r.ok for r in checks.same_image({0: ("sha256:aa", "c1"), 1: ("sha256:bb", "c1")}, 2, "x")] == [True, False]
    assert [r.ok for r in checks.same_image({0: ("sha256:aa", "c1"), 1: ("sha256:aa", "c2")}, 2, "x")] == [True, False]
    out = {0: "fleetbox: node 0 on node1: ...\nfleetbox: image id sha256:aa c1\n",
           1: "fleetbox: image file-sha256 0123 \n"}
    rows = checks.reported_image_rows(out, 2, "img")
    assert [(r.node, r.check, r.ok) for r in rows] == [("node0", "image", True), ("node1", "image", True),
                                                       ("node0", "same image", True), ("node1", "same image", False)]
    rows = checks.reported_image_rows({0: "fleetbox: image missing /x/img.sqfs is not on node2\n", 1: ""}, 2,
                                      "/x/img.sqfs")
    assert [(r.check, r.ok) for r in rows] == [("image", False), ("image", False)]


def test_an_env_on_the_nodes_is_the_same_record_and_interpreter_on_every_node():
    """Runtime none: node.sh says `image env-sha256 <record digest> <interpreter>` (shell/identify_env.sh)."""
    a, b = "a" * 64, "b" * 64
    def rows(one):
        out = {0: f"fleetbox: image env-sha256 {a} /usr/bin/python3.11\n", 1: one}
        return {(r.node, r.check): r for r in checks.reported_image_rows(out, 2, "/shared/envs/cpu-0123")}
    same = rows(f"fleetbox: image env-sha256 {a} /usr/bin/python3.11\n")
    assert same[("node1", "image")].value == f"env-sha256 {a[:12]}, python /usr/bin/python3.11"
    assert same[("node1", "same env")].ok and same[("node0", "same env")].ok
    other_lock = rows(f"fleetbox: image env-sha256 {b} /usr/bin/python3.11\n")[("node1", "same env")]
    assert not other_lock.ok and other_lock.value == f"env-sha256:{b[:12]} (node0: env-sha256:{a[:12]})"
    assert "make the env with invoke venv on a file system every node sees" in other_lock.fix
    other_python = rows(f"fleetbox: image env-sha256 {a} /opt/python3.11/bin/python3.11\n")[("node1", "same env")]
    assert not other_python.ok and other_python.value == "python /opt/python3.11/bin/python3.11 (node0: " \
                                                         "/usr/bin/python3.11)"
    missing = rows("fleetbox: image missing /shared/envs/cpu-0123: its interpreter /usr/bin/python3.11 is not on n2\n")
    assert not missing[("node1", "image")].ok and ("node1", "same env") not in missing


def test_without_an_image_paddle_must_import_on_every_node_with_the_modules_loaded():
    facts = copy.deepcopy(HEALTHY)
    facts[0]["paddle"] = {"rc": 0, "out": "3.3.1\n", "err": ""}
    facts[1]["paddle"] = {"rc": 1, "out": "", "err": "Traceback (most recent call last):\n  ...\n"
                          "ImportError: libgalaxyhip.so.5: cannot open shared object file: No such file or directory\n"}
    rows = {(r.node, r.check): r for r in checks.evaluate(facts, expect(check_paddle=True), "10.213.77.11")}
    assert rows[("node0", "import paddle")].ok and rows[("node0", "import paddle")].value == "3.3.1"
    bad = rows[("node1", "import paddle")]
    assert not bad.ok and bad.value.startswith("ImportError: libgalaxyhip.so.5: cannot open shared object file")
    assert "with the env's Python and the modules loaded" in bad.fix and "--modules" in bad.fix
    assert ("node0", "import paddle") not in {(r.node, r.check) for r in rows_of(facts)}   # an image: not asked


def test_sizes():
    assert checks.size_bytes("8g") == 8 << 30 and checks.size_bytes("512M") == 512 << 20
    assert checks.size_bytes("100") == 100
    assert checks.human(64 << 20) == "64 MiB" and checks.human(-1) == "unlimited"


def test_no_backend_pins_ports_past_65535(monkeypatch, tmp_path):
    from fleetbox.errors import UserError
    from fleetbox.run import hostnet
    from fleetbox.run import spec as spec_mod
    from fleetbox.run.backends import slurm as slurm_backend
    hostnet.check_room(65536 - 9, 9)
    with pytest.raises(UserError, match="--port 65528 leaves no room above it for the trainers' 8 pinned ports"):
        hostnet.check_room(65528, 9)
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=2, port=65530, job_id="train-room-0001")
    with pytest.raises(UserError, match="leaves no room"):
        slurm_backend.SlurmBackend("podman").plan(spec)


def test_each_node_has_its_own_pinned_ports_above_the_master_port():
    blocks = [planner.trainer_ports(PORT, k, 2) for k in range(3)]
    assert blocks == [(41001, 41006), (41007, 41012), (41013, 41018)]   # twice the 1 + 2 the launcher takes
    assert planner.ports_needed(3, 2) == 19


def test_the_slurm_node_script_pins_the_same_ports(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETBOX_RUNS", str(tmp_path))
    from fleetbox.run import spec as spec_mod
    from fleetbox.run.backends import slurm as slurm_backend
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
    kw = {"wait": 3, **kw}
    argv = [sys.executable, str(settings.HELPERS / "fleetbox_doctor.py"), "--rank", str(rank), "--nnodes", str(nnodes),
            "--master", f"127.0.0.1:{port}", "--node-ip", "127.0.0.1", "--iface", "lo",
            "--knock-timeout", "1", *[str(x) for kv in kw.items() for x in (f"--{kv[0]}", kv[1])]]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def block(port, rank, procs=1):
    first, last = planner.trainer_ports(port, rank, procs)
    return list(range(first, last + 1))


def free_block(n):
    from fleetbox.run import hostnet
    return hostnet.free_block("127.0.0.1", n)


def test_the_probe_on_loopback_meets_its_peer_and_knocks_on_every_port():
    port = free_block(planner.ports_needed(2, 1))
    p0, p1 = run_probe(0, port, blast=1 << 20), run_probe(1, port)
    f0, f1 = (checks.parse_probe(p.communicate(timeout=30)[0]) for p in (p0, p1))
    assert f0["ports"]["bound"] == [port, *block(port, 0)] and f1["ports"]["bound"] == block(port, 1)
    assert f1["master"]["ok"] and abs(f1["master"]["offset"]) < 0.5
    assert sorted(f1["reach"]["0"]["ports"], key=int) == [str(p) for p in block(port, 0)]
    assert all(r["ok"] for r in f1["reach"]["0"]["ports"].values())
    assert all(r["ok"] for r in f0["reach"]["1"]["ports"].values()) and f0["joined"] == [1]
    assert f0["tcp"]["1"]["bytes"] == 1 << 20 and f0["tcp"]["1"]["seconds"] > 0
    assert failing(checks.evaluate({0: f0, 1: f1}, checks.Expect(2, "1m", "cpu", port=port), "127.0.0.1")) == []


def test_the_probe_names_a_port_taken_and_a_master_that_never_answers():
    port = free_block(planner.ports_needed(2, 1))
    with socket.socket() as taken:
        taken.bind(("", block(port, 1)[0]))   # node 1's first pinned port
        taken.listen()
        p1 = run_probe(1, port)      # no node 0: nothing listens on the master port
        f1 = checks.parse_probe(p1.communicate(timeout=30)[0])
    assert list(f1["ports"]["busy"]) == [str(block(port, 1)[0])] and f1["ports"]["bound"] == block(port, 1)[1:]
    assert f1["master"] == {"ok": False, "error": "refused"}
    assert {p: r["error"] for p, r in f1["reach"]["0"]["ports"].items()} == \
        {str(p): "refused" for p in block(port, 0)}
    rows = checks.evaluate({1: f1}, checks.Expect(2, "1m", "cpu", port=port), "127.0.0.1")
    assert {r.check for r in rows if not r.ok} >= {"ports free", "master port", "ports of node0"}


def test_the_probe_tells_a_port_held_by_a_closed_connection_from_one_a_process_holds():
    """Right after a job, its pinned ports sit in TIME-WAIT for a minute: Paddle's launcher cannot bind them
    (no SO_REUSEADDR), but they free themselves, unlike a port another process listens on."""
    port = free_block(planner.ports_needed(2, 1))
    waiting, listening = block(port, 1)[:2]
    with socket.socket() as server, socket.socket() as other:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", waiting))
        server.listen()
        with socket.create_connection(("127.0.0.1", waiting)) as client:
            conn, _ = server.accept()
            conn.close()   # the server's side closes first: its port waits
            client.recv(1)
        other.bind(("", listening))
        other.listen()
        server.close()
        f1 = checks.parse_probe(run_probe(1, port).communicate(timeout=30)[0])
    assert f1["ports"]["busy"] == {str(waiting): "Address already in use: TIME-WAIT",
                                   str(listening): "Address already in use: LISTEN"}
    fix = next(r.fix for r in checks.evaluate({1: f1}, checks.Expect(2, "1m", "cpu", port=port), "127.0.0.1")
               if r.check == "ports free")
    assert fix == f"port(s) {waiting}, {listening} already in use on node1: another job? pick another --port"
    assert checks.busy_fix("node1", {str(waiting): f1["ports"]["busy"][str(waiting)]}).startswith(
        f"port(s) {waiting} on node1 are held by connections closed in the last minute (TIME-WAIT)")


def test_sweep_table_is_nccl_tests_shaped():
    sweep = {"backend": "gloo", "world": 2, "nodes": 2, "rows": [
        {"size": 1024, "count": 256, "time_us": 100.0, "algbw": 0.01024, "busbw": 0.01024, "wrong": 0},
        {"size": 67108864, "count": 16777216, "time_us": 600000.0, "algbw": 0.1118, "busbw": 0.1118, "wrong": 0}]}
    text = checks.sweep_table(sweep, 0.125)
    assert "    67108864     16777216   float    sum   600000.0    0.112    0.112      0" in text
    assert "busbw 0.112 GB/s = 0.89 x raw TCP" in text
    assert checks.sweep_row({"ok": True, "sweep": sweep}).ok
    sweep["rows"][0]["wrong"] = 3
    assert not checks.sweep_row({"ok": True, "sweep": sweep}).ok


def test_a_read_only_mount_needs_no_free_space():
    facts = broken(1, ("disk", "/fleetbox/logs"), {"free": 0, "total": 1 << 30, "read_only": True})
    assert failing(rows_of(facts)) == []


def test_a_broken_tcp_stream_is_a_failed_row():
    facts = broken(0, ("tcp", "1"), {"error": "the sender closed the connection"})
    assert [(r.node, r.check, r.ok) for r in checks.throughput_rows(facts)] == [("node1", "TCP to node0", False)]
    assert [(r.ok, r.value) for r in checks.throughput_rows(HEALTHY)] == [(True, "0.134 GB/s (64 MiB in 0.500 s)")]


def test_link_speed_is_read_where_ethtool_puts_it():
    import struct as st

    from fleetbox.incontainer import fleetbox_doctor as probe

    def cmd(speed, speed_hi=0, lp_advertising=0):
        raw = bytearray(44)
        st.pack_into("HxxxxxxxxxxxxxH", raw, 12, speed, speed_hi)     # speed at 12, speed_hi at 28
        st.pack_into("I", raw, 32, lp_advertising)
        return bytes(raw)
    assert probe.decode_speed(cmd(100, 0, lp_advertising=0x2f)) == 100   # a 100 Mb/s link whose peer offers 1G
    assert probe.decode_speed(cmd(200000 & 0xFFFF, 200000 >> 16)) == 200000
    assert probe.decode_speed(cmd(0xFFFF, 0xFFFF)) is None and probe.decode_speed(cmd(0)) is None


def test_three_nodes_two_processes_each_every_port_reached_and_left_bindable_for_paddle():
    port = free_block(planner.ports_needed(3, 2))
    procs = [run_probe(k, port, nnodes=3, width=planner.block_width(2)) for k in range(3)]
    facts = {k: checks.parse_probe(p.communicate(timeout=60)[0]) for k, p in enumerate(procs)}
    assert facts[0]["joined"] == [1, 2] and facts[0]["missing"] == []
    for k in range(3):
        assert facts[k]["ports"]["bound"] == ([port] if k == 0 else []) + block(port, k, 2)
        assert sorted(facts[k]["reach"]) == sorted(str(j) for j in range(3) if j != k)
        assert all(r["ok"] for seen in facts[k]["reach"].values() for r in seen["ports"].values())
    assert failing(checks.evaluate(facts, checks.Expect(3, "1m", "cpu", procs=2, port=port), "127.0.0.1")) == []
    # the launcher binds its pinned ports without SO_REUSEADDR right after: none may be held in TIME_WAIT
    for p in range(port + 1, port + planner.ports_needed(3, 2)):
        with socket.socket() as s:
            s.bind(("", p))


def test_a_node_that_reaches_the_master_after_it_stopped_waiting_is_told_so():
    port = free_block(planner.ports_needed(3, 1))
    early = [run_probe(0, port, nnodes=3, wait=3), run_probe(1, port, nnodes=3, wait=3)]
    import time
    time.sleep(4.5)
    late = run_probe(2, port, nnodes=3, wait=3)
    f0, f1, f2 = (checks.parse_probe(p.communicate(timeout=60)[0]) for p in (*early, late))
    assert f0["joined"] == [1] and f0["missing"] == [2]
    assert f2["master"]["ok"] is False and "after node0 had stopped waiting" in f2["master"]["error"]


def test_engine_rows_from_the_backends_facts():
    """Docker's engine facts (Backend.engine_facts): an engine that cannot be reached, an image missing on a
    --hosts engine, and nodes that hold different images are each one ✗ with its fix."""
    spec = spec_mod.JobSpec(variant=matrix.load().get("cpu"), nodes=3)   # on --hosts ssh://a,ssh://b,ssh://c
    same = ("sha256:" + "a" * 64, "c1")
    facts = [{"host": "ssh://a", "version": "28.2", "error": "", "image": same},
             {"host": "ssh://b", "version": None, "error": "cannot reach the Docker Engine at ssh://b (refused)",
              "image": None},
             {"host": "ssh://c", "version": "28.2", "error": "", "image": None}]
    rows = checks.engine_rows(facts, spec)
    assert [(r.node, r.check, r.ok) for r in rows] == [("node0", "engine", True), ("node0", "image", True),
                                                       ("node1", "engine", False), ("node2", "engine", True),
                                                       ("node2", "image", False)]
    assert rows[2].fix == "cannot reach the Docker Engine at ssh://b: start the Docker Engine on ssh://b or fix the " \
                          "--hosts URL"
    assert rows[4].fix.startswith("fleetbox/paddle:cpu is not on ssh://c: docker save fleetbox/paddle:cpu | docker -H")
    facts = [{**facts[0], "host": h} for h in ("ssh://a", "ssh://b")] + [
        {**facts[0], "host": "ssh://c", "image": ("sha256:" + "b" * 64, "c1")}]
    assert [(r.node, r.ok) for r in checks.engine_rows(facts, spec) if r.check == "same image"] == [
        ("node0", True), ("node1", True), ("node2", False)]


def test_the_sockets_on_a_port_are_read_from_the_kernels_tables_whatever_their_shape(tmp_path):
    """/proc/net/tcp and tcp6 as the kernel writes them (hex addresses and ports, hex states); a line of another
    shape is left aside, never the probe's end."""
    from fleetbox.incontainer import fleetbox_doctor as probe
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    (tmp_path / "tcp").write_text(head +
        "   0: 0100007F:71AD 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 123 1\n"
        "   1: 0B4DD50A:71AD 0C4DD50A:9C40 06 00000000:00000000 03:00000F9A 00000000     0        0 0 3\n"
        "   2: local:zz remote:00 ?? 0\n")
    (tmp_path / "tcp6").write_text(head +
        "   0: 00000000000000000000000000000000:71AD 00000000000000000000000000000000:0000 05 0:0 00:0 0 0 0 0\n")
    tables = (str(tmp_path / "tcp"), str(tmp_path / "tcp6"), str(tmp_path / "absent"))
    assert probe.holders(0x71AD, tables) == ["LISTEN", "TIME-WAIT", "FIN-WAIT-2"]
    assert probe.holders(0x71AE, tables) == []
