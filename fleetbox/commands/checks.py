"""The doctor's checks, pure: the probe's raw facts (and the backend's) held to thresholds, one Row each, and
the tables that show them. `invoke doctor` (commands/doctor.py) gathers the facts and calls these."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fleetbox import settings
from fleetbox.errors import UserError
from fleetbox.image.kernels import capability
from fleetbox.run import node_log
from fleetbox.run import plan as planner
from fleetbox.run.spec import JobSpec

PROBE_MARK = "FLEETBOX-DOCTOR "
SWEEP_MARK = "FLEETBOX-COLLECTIVE "
MIN_NOFILE = 4096              # DataLoader workers, NCCL and Gloo each hold many descriptors
MIN_SPEED_MBPS = 1000          # below 1 Gb/s a gradient all-reduce dominates every step
MIN_MTU = 1280
MAX_CLOCK_SKEW_S = 1.0         # logs, checkpoints and Slurm (munge) compare clocks across nodes
MIN_FREE_BYTES = 1 << 30       # logs and checkpoints
BLAST_BYTES = 64 << 20         # the raw TCP probe, the size of the sweep's largest all-reduce


@dataclass
class Row:
    node: str         # node<k>, or "cluster"
    check: str
    ok: bool
    value: str        # what was measured
    threshold: str    # what it was held to
    fix: str = ""     # one line, for a ✗


def size_bytes(text: str) -> int:
    """Docker's size spelling (8g, 512m, 65536) in bytes."""
    m = re.fullmatch(r"([0-9]+)([bkmg]?)", text.strip(), re.I)
    if not m:
        raise UserError(f"{text!r} is not a size such as 8g or 512m")
    return int(m.group(1)) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]


def human(n: float | int | None) -> str:
    if n is None:
        return "?"
    if n < 0:
        return "unlimited"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


# -- the probe's command: the job's container, with this instead of Paddle's launcher --

def probe_command(spec: JobSpec, blast: int, wait: float, import_paddle: bool = False) -> tuple[str, ...]:
    paths = [settings.LOG_DIR, settings.CHECKPOINT_DIR, "~/" + settings.HOME_CACHE]   # ~: Paddle's DATA_HOME
    return ("python", "-m", "fleetbox_doctor", "--rank", "{rank}", "--nnodes", "{nnodes}",
            "--width", str(planner.block_width(spec.procs_per_node)), "--master", "{master_ip}:{master_port}",
            "--node-ip", "{node_ip}",
            "--iface", "{iface}", "--ib-hca", spec.ib_hca, "--device", spec.device,
            "--paths", ",".join(paths), "--wait", f"{wait:g}", "--blast", str(blast),
            # a DCU node: Paddle's import says whether the image's DTK and the node's driver go together
            *(["--import-paddle"] if import_paddle or spec.device == "rocm" else []))


def parse_probe(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        if line.startswith(PROBE_MARK):
            try:
                return json.loads(line[len(PROBE_MARK):])
            except ValueError:
                return None
    return None


# -- holding the facts to thresholds (pure) --

@dataclass(frozen=True)
class Expect:
    """What the job needs, from its spec and backend."""
    nodes: int
    shm: str                        # the job's --shm-size
    device: str                     # cpu | cuda | rocm
    ib_hca: str = ""
    min_driver: str = ""            # CUDA variants: the matrix's minimum driver (minor-version compatibility) ...
    toolkit_driver: str = ""        # ... and its CUDA release's own driver
    gpus: int = 1                   # devices each node needs
    procs: int = 1
    port: int = 0
    runtime: str = "docker"         # what starts the containers (Doctoring.runtime)
    runtime_args: tuple = ()
    forced_iface: str = ""
    shm_settable: bool = True       # --shm-size reaches the container (Doctoring.shm_settable)
    check_paddle: bool = False      # no image (an env on the nodes): `import paddle` is checked on every node
    variant: str = ""
    kernels: object = None          # CUDA variants: the GPUs its wheel has kernels for (image/kernels.Kernels)
    instead: tuple = ()             # ... and every other CUDA variant's, (name, Kernels): which one a GPU could use
    no_driver_fix: str = ""         # what gives the containers the node's NVIDIA driver (Doctoring.no_driver_fix)


def check_shm(node: str, f: dict, e: Expect) -> Row:
    want = size_bytes(e.shm)
    shm = f.get("shm", {})
    if "error" in shm:
        return Row(node, "/dev/shm", False, f"missing ({shm['error']})", f">= {e.shm}",
                   "the container has no /dev/shm; NCCL and DataLoader workers need it")
    got = shm["total"]
    ok = got >= want * 0.99   # tmpfs rounds to pages
    fix = ""
    if not ok:
        args = " ".join(e.runtime_args)
        if "shm" in args:
            fix = f"shm is {human(got)}: the job would use --shm-size {e.shm}; your --runtime-args override it ({args})"
        elif e.shm_settable:
            fix = f"shm is {human(got)}: lower --shm-size only if the job needs less, or raise the engine's limit"
        else:
            fix = f"shm is {human(got)}: {e.runtime} uses the node's own /dev/shm; ask the admins to enlarge it"
    return Row(node, "/dev/shm", ok, human(got), f">= {e.shm} (--shm-size)", fix)


def check_limits(node: str, f: dict, e: Expect) -> list[Row]:
    lim = f.get("limits", {})
    memlock, nofile = lim.get("memlock"), lim.get("nofile")
    nccl = e.device != "cpu" or bool(e.ib_hca)
    if nccl:
        mrow = Row(node, "memlock", memlock == -1, human(memlock), "unlimited (NCCL/RDMA pin memory)",
                   "" if memlock == -1 else f"memlock is {human(memlock)}: raise the node's limit (limits.conf, "
                   f"slurmd's LimitMEMLOCK=infinity, dockerd's LimitMEMLOCK); a container gets no more than that")
    else:
        mrow = Row(node, "memlock", True, human(memlock), "none (Gloo over TCP pins no memory)")
    ok = nofile is not None and (nofile == -1 or nofile >= MIN_NOFILE)
    return [mrow, Row(node, "open files", ok, "unlimited" if nofile == -1 else str(nofile), f">= {MIN_NOFILE}",
                      "" if ok else f"open files are limited to {nofile}: raise nofile (e.g. --ulimit "
                      f"nofile=65536:65536 for the engine, or the node's limits)")]


def check_network(node: str, f: dict, e: Expect, master_ip: str) -> list[Row]:
    i, r = f.get("iface", {}), f.get("route", {})
    name = i.get("name", "")
    rows = []
    if not i.get("exists"):
        rows.append(Row(node, "interface", False, f"{name or '(none)'} not found", "exists, with an IPv4 address",
                        f"interface {name!r} is not on this node (has: {', '.join(i.get('names', []))}); "
                        f"drop --iface or name one of these"))
        return rows
    rows.append(Row(node, "interface", bool(i.get("address")), f"{name} {i.get('address') or 'no IPv4 address'}",
                    "exists, with an IPv4 address", "" if i.get("address") else
                    f"{name} has no IPv4 address: Gloo/NCCL cannot use it; pick another with --iface"))
    if not i.get("address"):
        pass   # the interface row says it
    elif "error" in r:
        rows.append(Row(node, "route to master", False, f"none ({r['error']})", f"via {name}",
                        f"this node has no route to the master {master_ip}: fix the node's routing or --hosts"))
    else:
        ok = r.get("iface") == name and r.get("local") == i.get("address")
        rows.append(Row(node, "route to master", ok, f"{master_ip} via {r.get('iface') or '?'} {r.get('local')}",
                        f"via {name} {i.get('address') or ''}".rstrip(), "" if ok else
                        f"interface {name} does not route to the master {master_ip} (the route goes via "
                        f"{r.get('iface') or '?'} {r.get('local')}): " + (
                            f"drop --iface {e.forced_iface} or use --iface {r.get('iface')}" if e.forced_iface
                            else f"give --iface {r.get('iface')}")))
    mtu = i.get("mtu")
    rows.append(Row(node, "MTU", mtu is not None and mtu >= MIN_MTU, str(mtu), f">= {MIN_MTU}",
                    "" if mtu and mtu >= MIN_MTU else f"MTU {mtu} on {name} is too small for TCP to work well"))
    speed = i.get("speed")
    if speed is None:
        rows.append(Row(node, "link speed", True, "not reported (loopback or a virtual link)",
                        f">= {MIN_SPEED_MBPS} Mb/s where reported; see the TCP throughput"))
    else:
        ok = speed >= MIN_SPEED_MBPS
        rows.append(Row(node, "link speed", ok, f"{speed} Mb/s", f">= {MIN_SPEED_MBPS} Mb/s", "" if ok else
                        f"{name} links at {speed} Mb/s: gradients would crawl; use the cluster's fast network "
                        f"(--iface) or InfiniBand (--ib-hca)"))
    return rows


def check_ib(node: str, f: dict, e: Expect) -> list[Row]:
    if not e.ib_hca:
        return []
    ib = f.get("ib", {})
    if not ib.get("present"):
        return [Row(node, "InfiniBand", False, f"{e.ib_hca} not found", f"{e.ib_hca} present, a port ACTIVE",
                    f"no HCA {e.ib_hca} in the container (/sys/class/infiniband): check the name (ibstat) and that "
                    f"the runtime passes the device through")]
    active = {p: v for p, v in ib.get("ports", {}).items() if "ACTIVE" in (v.get("state") or "")}
    ports = ", ".join(f"port {p}: {(v.get('state') or '?').split(': ')[-1]} {v.get('rate') or ''} "
                      f"{v.get('link_layer') or ''}".strip() for p, v in sorted(ib.get("ports", {}).items()))
    return [Row(node, "InfiniBand", bool(active), f"{e.ib_hca} {ports or 'no ports'}",
                f"{e.ib_hca} present, a port ACTIVE", "" if active else
                f"{e.ib_hca} has no ACTIVE port: check the cable and the subnet manager (ibstat)")]


OLD_GPU_FIELDS = ("index", "name", "driver_version", "memory.total")   # what a probe before uuid and compute_cap asked


def gpus_from_nvidia_smi(out: str, fields=OLD_GPU_FIELDS) -> list[dict]:
    """`nvidia-smi --query-gpu=FIELDS --format=csv,noheader` lines, each GPU's fields by name ("index": int)."""
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(", ")]
        if len(parts) == len(fields) and parts[0].isdigit():
            gpu = dict(zip(fields, parts))
            gpus.append({**gpu, "index": int(gpu["index"])})
    return gpus


def check_capability(node: str, gpus: list[dict], e: Expect) -> list[Row]:
    """Each GPU's compute capability against the kernels the variant's wheel has (measured, or published); a GPU it
    has none for names the variants that have them."""
    if not gpus:
        return []
    k = e.kernels
    want = (f"{', '.join(k.architectures)} (the wheel's kernels, {'measured' if k.measured else 'published'})" if k
            else "the variant's kernels (not known: `invoke wheels` measures them)")
    caps = {(g["index"], g["name"], g.get("compute_cap", "")) for g in gpus}
    if not any(capability(c) for _, _, c in caps):
        return [Row(node, "compute capability", True, "not reported (this driver's nvidia-smi has no compute_cap)",
                    want)]
    seen = ", ".join(sorted({f"{c if capability(c) else 'not reported'} ({n})" for _, n, c in caps}))
    how = {(i, n, c): k.how(c) for i, n, c in caps if k and capability(c)}
    bad = sorted(g for g, h in how.items() if not h)
    if slow := sorted({c for (_, _, c), h in how.items() if h == "ptx"}):
        seen += f"; {', '.join(slow)} through PTX compiled at first run (a slow first start)"
    if not bad:
        return [Row(node, "compute capability", True, seen, want)]
    cc = bad[0][2]
    if not k.measured:   # what Paddle publishes may leave out what its wheel has: said, not failed
        return [Row(node, "compute capability", True, f"{seen}; {cc} is not among the architectures Paddle publishes "
                    f"for {e.variant} (`invoke wheels` measures its wheel)", want)]
    others = [name + ("" if o.measured else " (published)") for name, o in e.instead if o.how(cc) == "native"]
    return [Row(node, "compute capability", False, seen, want,
                f"GPU {', '.join(str(i) for i, _, _ in bad)} ({bad[0][1]}, compute capability {cc}): the "
                f"{e.variant} wheel has no kernels for it (built for {', '.join(k.architectures)}); Paddle stops at "
                f"its first GPU kernel: " + (f"use {' or '.join(others)}, built for {cc}" if others else
                                             f"no variant of the matrix is built for {cc}"))]


def confinement_rows(device: str, unconfined: str) -> list[Row]:
    """Said, not failed: a GPU job whose runtime the scheduler cannot confine runs, but outside its accounting."""
    if device == "cpu" or not unconfined:
        return []
    return [Row("cluster", "device confinement", True, f"none: {unconfined}", "the task's cgroup")]


def check_gpu(node: str, f: dict, e: Expect) -> list[Row]:
    if e.device != "cuda":
        return []
    g = f.get("gpu", {})
    if "missing" in g or g.get("rc") not in (0, None) or "error" in g:
        why = "nvidia-smi is not in the container" if "missing" in g else \
            (g.get("err") or g.get("out") or g.get("error") or "").strip().splitlines()[-1:] or ["failed"]
        why = why if isinstance(why, str) else why[0]
        return [Row(node, "GPU driver", False, why[:120], f">= {e.min_driver}",
                    "the container sees no NVIDIA driver: "
                    + (e.no_driver_fix or "check how the runtime gives a container the node's driver"))]
    gpus = gpus_from_nvidia_smi(g.get("out", ""), tuple(g.get("fields", OLD_GPU_FIELDS)))
    drivers = sorted({x["driver_version"] for x in gpus})
    driver = drivers[0] if drivers else "?"
    ok = bool(gpus) and (not e.min_driver or version_tuple(driver) >= version_tuple(e.min_driver))
    compat = ok and e.toolkit_driver and version_tuple(driver) < version_tuple(e.toolkit_driver)
    shown = driver + (" (by CUDA minor-version compatibility: no PTX JIT)" if compat else "")
    rows = [Row(node, "GPU driver", ok, shown,
                f">= {e.min_driver} (the variant's CUDA; {e.toolkit_driver} for PTX JIT)", "" if ok else
                f"driver {driver} is older than {e.min_driver}, the oldest this image's CUDA runs on: upgrade the "
                f"node's driver or use a variant built for an older CUDA (e.g. cu118)")]
    count_ok = len(gpus) >= e.gpus
    rows.append(Row(node, "GPUs", count_ok, f"{len(gpus)}" + (f" x {gpus[0]['name']}" if gpus else ""),
                    f">= {e.gpus}", "" if count_ok else f"the container sees {len(gpus)} GPU(s), the job needs "
                    f"{e.gpus}: check --devices/--gpus-per-node and CUDA_VISIBLE_DEVICES"))
    return rows + check_capability(node, gpus, e)


SMI_DEVICE = re.compile(r"^\s*(?:GPU|DCU|HCU)\[?(\d+)\]?\s*[:|]?", re.M)


def dcus_from_smi(out: str) -> int:
    """Device count from rocm-smi / hy-smi output (each device's rows start with GPU[i], DCU[i] or a table
    row number)."""
    ids = set(SMI_DEVICE.findall(out))
    if ids:
        return len(ids)
    return len(re.findall(r"^\s*(\d+)\s+\d+(?:\.\d+)?°?C\b", out, re.M | re.I))   # a table row: "0   45.0C ..."


# What Paddle's import prints on a DCU node whose image cannot use the DCUs there, first match wins: (what it
# prints, what it means, what to do). Recorded: tests/recorded/dcu/README.md.
DCU_IMPORT_RULES = (
    (re.compile(r"get hyhal driver version error"), "the DCU driver's version is unreadable",
     "the container cannot read /sys/module/hydcu/version: the DCU driver is not loaded on the node, or the "
     "container does not see the host's /sys"),
    (re.compile(r"\[ROCT-Thunk-Interface/src/hymgr\.c:\d+, WARNING\]: Version mismatch"), "ROCT version mismatch",
     "the image's DTK (its ROCT thunk library) does not match the node's DCU driver (hydcu): use the image built "
     "for the DTK the node's driver pairs with (Paddle #73087)"),
    (re.compile(r"no ROCm-capable device is detected|Compiled with WITH_GPU, but no GPU found in runtime"),
     "Paddle sees no DCU", "Paddle found no device: check /dev/kfd and the render nodes (rows above) and hy-smi"),
)


def check_dtk(node: str, got: dict) -> Row:
    """The image's DTK against the node's DCU driver, from what `import paddle` printed there."""
    said = got.get("err", "") + got.get("out", "")
    for pattern, what, fix in DCU_IMPORT_RULES:
        m = pattern.search(said)
        if m:
            return Row(node, "DTK and driver", False, f"{what}: {m.group(0)}"[:120], "Paddle imports and sees the DCUs",
                       fix)
    if got.get("rc") != 0:
        lines = [ln for ln in said.splitlines() if ln.strip()] or [got.get("error") or got.get("missing") or "?"]
        return Row(node, "DTK and driver", False, f"import paddle failed: {lines[-1]}"[:120],
                   "Paddle imports and sees the DCUs", f"`import paddle` fails on {node}: {lines[-1]}")
    version = (got.get("out", "").strip().splitlines() or ["?"])[-1]
    return Row(node, "DTK and driver", True, f"Paddle {version[:40]} imports", "Paddle imports and sees the DCUs")


def check_dcu(node: str, f: dict, e: Expect) -> list[Row]:
    if e.device != "rocm":
        return []
    d = f.get("dcu", {})
    render = [x for x in d.get("dri", []) if x.startswith("renderD")]
    in_video = d.get("video_gid") is not None and d["video_gid"] in d.get("groups", [])
    denied = sorted(p for p, ok in d.get("usable", {}).items() if not ok)
    rows = [
        Row(node, "/dev/kfd", bool(d.get("kfd")), "present" if d.get("kfd") else "missing", "present",
            "" if d.get("kfd") else "the container has no /dev/kfd: pass --device /dev/kfd (fleetbox does; check "
            "--runtime-args) and that the DCU driver is loaded on the node (lsmod | grep hydcu)"),
        Row(node, "/dev/dri", bool(render), " ".join(d.get("dri", [])) or "missing", "renderD* devices",
            "" if render else "the container has no /dev/dri/renderD*: pass --device /dev/dri"),
        Row(node, "/opt/hyhal", bool(d.get("hyhal")), "mounted" if d.get("hyhal") else "missing or empty",
            "mounted, not empty", "" if d.get("hyhal") else
            "/opt/hyhal is not in the container: it must exist on the node (DTK installs it) and be mounted"),
        Row(node, "video group", in_video, f"groups {d.get('groups', [])}, video = {d.get('video_gid')}",
            "the process is in video", "" if in_video else "the process is not in the video group: --group-add video"),
        Row(node, "device access", not denied, "read-write" if not denied else f"denied: {' '.join(denied)}",
            "/dev/kfd and renderD* read-write", "" if not denied else f"no read-write access to {' '.join(denied)}: "
            "add the group that owns them (often render) with --group-add, or ask the admins"),
    ]
    if "paddle" in f:
        rows.append(check_dtk(node, f["paddle"]))
    smi = d.get("smi", {})
    n = dcus_from_smi(smi.get("out", "")) if smi.get("rc") == 0 else 0
    ok = n >= e.gpus
    rows.append(Row(node, "DCUs", ok, f"{n} ({smi.get('tool', 'smi')})", f">= {e.gpus}", "" if ok else
                    f"{smi.get('tool', 'hy-smi')} sees {n} device(s): " + (
                        (smi.get("err") or smi.get("missing") or "").strip()[:100] or "check the driver (hy-smi)")))
    return rows


def check_disk(node: str, f: dict) -> list[Row]:
    rows = []
    for path, d in sorted(f.get("disk", {}).items()):
        if "error" in d:
            rows.append(Row(node, f"free disk {path}", False, d["error"], f">= {human(MIN_FREE_BYTES)}",
                            f"{path} is not usable in the container: {d['error']}"))
            continue
        if d.get("read_only"):   # a read-only mount (a seeded cache): nothing is written there
            rows.append(Row(node, f"free disk {path}", True, "read-only mount", "none (nothing written)"))
            continue
        ok = d["free"] >= MIN_FREE_BYTES
        rows.append(Row(node, f"free disk {path}", ok, human(d["free"]), f">= {human(MIN_FREE_BYTES)}", "" if ok
                        else f"only {human(d['free'])} free for {path}: free space or point the job elsewhere"))
    return rows


CLOSING = {"TIME-WAIT", "FIN-WAIT-1", "FIN-WAIT-2", "LAST-ACK", "CLOSING"}   # free themselves within a minute


def busy_fix(node: str, busy: dict[str, str]) -> str:
    ports = ", ".join(sorted(busy))
    held = [set(why.partition(": ")[2].split(", ")) for why in busy.values()]   # the probe names the sockets' states
    if all(states and states <= CLOSING for states in held):
        return (f"port(s) {ports} on {node} are held by connections closed in the last minute (TIME-WAIT), "
                f"which Paddle's launcher cannot bind over: run again in a minute, or pick another --port")
    return f"port(s) {ports} already in use on {node}: another job? pick another --port"


def check_ports(node: str, rank: int, f: dict, facts: dict[int, dict], e: Expect, master_ip: str) -> list[Row]:
    rows = []
    busy = f.get("ports", {}).get("busy", {})
    first, last = planner.trainer_ports(e.port, rank, e.procs)
    mine = f"{e.port}, {first}-{last}" if rank == 0 else f"{first}-{last}"
    rows.append(Row(node, "ports free", not busy, "all bound" if not busy else
                    ", ".join(f"{p} ({why})" for p, why in sorted(busy.items())), f"{mine} free on the node",
                    "" if not busy else busy_fix(node, busy)))
    if e.nodes < 2:
        return rows
    if rank != 0:
        m = f.get("master", {})
        ok = bool(m.get("ok")) and not m.get("after_join")
        if m.get("after_join"):
            m = {**m, "error": f"joined, then {m['after_join']}"}
        rows.append(Row(node, "master port", ok, f"{master_ip}:{e.port} " + (
            f"reached ({m['rtt'] * 1000:.1f} ms)" if ok else m.get("error", "not tried")), "TCP connect",
            "" if ok else f"{node} cannot reach the master {master_ip}:{e.port} ({m.get('error')}): open TCP port "
            f"{e.port} on node0's firewall for the other nodes, or pick another --port"))
        off = m.get("offset")
        if ok and off is not None:
            skew_ok = abs(off) <= MAX_CLOCK_SKEW_S
            rows.append(Row(node, "clock skew", skew_ok, f"{off * 1000:+.1f} ms vs node0 (± {m['rtt'] * 500:.1f})",
                            f"<= {MAX_CLOCK_SKEW_S:g} s", "" if skew_ok else
                            f"this node's clock is {off:+.1f} s off node0's: run chrony/ntpd on every node"))
    for peer, seen in sorted(f.get("reach", {}).items(), key=lambda kv: int(kv[0])):
        bad = {p: r.get("error") for p, r in seen["ports"].items() if not r.get("ok")}
        ports = sorted(seen["ports"], key=int)
        shown = f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else ports[0]
        rows.append(Row(node, f"ports of node{peer}", not bad, "reached" if not bad else
                        "; ".join(f"{p}: {why}" for p, why in sorted(bad.items())), f"{seen['ip']}:{shown} TCP",
                        "" if not bad else f"{node} cannot reach node{peer}'s port(s) {', '.join(sorted(bad))} "
                        f"(the job's pinned PORT_RANGE): open them in node{peer}'s firewall, or pick another --port"))
    if rank == 0 and f.get("missing"):
        rows.append(Row(node, "nodes joined", False, f"missing node(s) {', '.join(map(str, f['missing']))}",
                        f"all {e.nodes - 1} others", "the missing nodes could not reach the master port "
                        "(see their rows)"))
    return rows


def check_consistency(facts: dict[int, dict]) -> list[Row]:
    """What must match across nodes: the MTU (a mismatch makes large messages hang)."""
    mtus = {k: m for k, f in facts.items() if (m := f.get("iface", {}).get("mtu")) and m >= MIN_MTU}
    rows = []
    if len(set(mtus.values())) > 1:
        for k, m in sorted(mtus.items()):
            if m != mtus[min(mtus)]:
                rows.append(Row(f"node{k}", "same MTU", False, f"{m} (node0: {mtus[min(mtus)]})", "= node0's",
                                f"MTU {m} here, {mtus[min(mtus)]} on node0: large messages would hang; "
                                f"set one MTU on every node"))
    return rows


def evaluate(facts: dict[int, dict], e: Expect, master_ip: str) -> list[Row]:
    """Pure: every node's facts against the job's needs."""
    rows = []
    for k in range(e.nodes):
        node = f"node{k}"
        f = facts.get(k)
        if f is None:
            continue
        if f.get("crash"):
            rows.append(Row(node, "probe", False, f["crash"][:100], "runs to the end",
                            f"the probe failed on {node}: {f['crash']}"))
            if "shm" not in f:
                continue
        rows.append(check_shm(node, f, e))
        rows += check_limits(node, f, e)
        rows += check_network(node, f, e, master_ip)
        rows += check_ib(node, f, e)
        rows += check_gpu(node, f, e)
        rows += check_dcu(node, f, e)
        rows += check_disk(node, f)
        rows += check_ports(node, k, f, facts, e, master_ip)
        if e.check_paddle:
            rows.append(check_paddle(node, f))
    return rows + check_consistency(facts)


def check_paddle(node: str, f: dict) -> Row:
    """Paddle imports with the env's Python and the modules loaded (no image was verified for this node)."""
    got = f.get("paddle") or {}
    if got.get("rc") == 0:
        return Row(node, "import paddle", True, got["out"].strip().splitlines()[-1][:40], "imports")
    said = [ln for ln in (got.get("err", "") + got.get("out", "")).splitlines() if ln.strip()]
    why = said[-1][:200] if said else got.get("error") or got.get("missing") or "not probed"
    return Row(node, "import paddle", False, why[:100], "imports",
               f"`import paddle` fails on {node} with the env's Python and the modules loaded: {why}; load what it "
               f"needs with --modules (e.g. the site's DTK or CUDA module) or make the env again (invoke venv)")


def throughput_rows(facts: dict[int, dict]) -> list[Row]:
    rows = []
    for k, t in sorted(facts.get(0, {}).get("tcp", {}).items(), key=lambda kv: int(kv[0])):
        if "error" in t:
            rows.append(Row(f"node{k}", "TCP to node0", False, t["error"], "a stream completes",
                            "the raw TCP stream to node0 broke: check the link"))
        else:
            rate = t["bytes"] / max(t["seconds"], 1e-9)
            rows.append(Row(f"node{k}", "TCP to node0", True, f"{rate / 1e9:.3f} GB/s ({human(t['bytes'])} in "
                                                               f"{t['seconds']:.3f} s)", "a stream completes"))
    return rows


def node_order(node: str) -> tuple:
    return (1, 0) if node == "cluster" else (0, int(node[4:]) if node[4:].isdigit() else 0)


def table(rows: list[Row]) -> str:
    rows = sorted(rows, key=lambda r: node_order(r.node))   # stable: each node's checks in the order made
    out = []
    width = max((len(r.check) for r in rows), default=10)
    vwidth = min(48, max((len(r.value) for r in rows), default=10))
    node = None
    for r in rows:
        if r.node != node:
            node = r.node
            out.append(node)
        out.append(f"  {'✓' if r.ok else '✗'} {r.check:<{width}}  {r.value:<{vwidth}}  {r.threshold}")
    fixes = [f"✗ {r.node} {r.check}: {r.fix}" for r in rows if not r.ok and r.fix]
    if fixes:
        out += ["", "to fix:"] + [f"  {x}" for x in fixes]
    return "\n".join(out)


# -- the sweep's report --

def parse_sweep(output: str) -> dict | None:
    for line in reversed(output.splitlines()):
        if SWEEP_MARK in line:
            try:
                return json.loads(line.split(SWEEP_MARK, 1)[1])
            except ValueError:
                return None
    return None


def sweep_table(sweep: dict, tcp_gbps: float | None) -> str:
    """nccl-tests' all_reduce_perf layout (in place), with the raw TCP floor beside it."""
    lines = [f"# all_reduce ({sweep['backend']}), {sweep['world']} ranks on {sweep['nodes']} nodes; "
             f"busbw = algbw * 2(n-1)/n",
             f"#{'size':>12} {'count':>12} {'type':>7} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8} "
             f"{'#wrong':>6}",
             f"#{'(B)':>12} {'(elements)':>12} {'':>7} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>6}"]
    for r in sweep["rows"]:
        lines.append(f" {r['size']:>12} {r['count']:>12} {'float':>7} {'sum':>6} {r['time_us']:>10.1f} "
                     f"{r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>6}")
    avg = sum(r["busbw"] for r in sweep["rows"]) / max(1, len(sweep["rows"]))
    lines.append(f"# Avg bus bandwidth    : {avg:.3f} GB/s")
    if tcp_gbps:
        top = sweep["rows"][-1]
        lines.append(f"# raw TCP (probe)      : {tcp_gbps:.3f} GB/s; all-reduce at {human(top['size'])}: "
                     f"busbw {top['busbw']:.3f} GB/s = {top['busbw'] / tcp_gbps:.2f} x raw TCP")
    return "\n".join(lines)


# -- the image on every node --

def engine_rows(facts: list[dict], spec: JobSpec) -> list[Row]:
    """Each node's engine reachable and holding the image, and the same image everywhere (ID and content tag),
    from the backend's engine facts (Backend.engine_facts)."""
    ref, rows, ids = spec.image_ref, [], {}
    for k, f in enumerate(facts):
        node, host = f"node{k}", f["host"]
        where = host or "this machine"
        if f["version"] is None:
            rows.append(Row(node, "engine", False, f"unreachable: {host or 'the local socket'}", "reachable",
                            f["error"].split(" (")[0] + f": start the Docker Engine on {where} or fix the --hosts URL"))
            continue
        rows.append(Row(node, "engine", True, f"Docker {f['version']} at {where}", "reachable"))
        if f["image"] is None:
            rows.append(Row(node, "image", False, f"{ref} not found", "present", f"{ref} is not on {where}: " + (
                f"docker save {ref} | docker -H {host} load (or push it and pull it there)" if host
                else f"invoke build --variant {spec.variant.name}")))
            continue
        image_id, tag = f["image"]
        ids[k] = (image_id, tag)
        rows.append(Row(node, "image", True, f"{image_id[7:19]}, content {tag[:12] or 'unknown'}", "present"))
    rows += same_image(ids, spec.nodes, ref)
    return rows


def same_image(ids: dict[int, tuple[str, str]], nodes: int, ref: str) -> list[Row]:
    """(identity, content tag) per node against node0's."""
    if len(ids) < nodes or 0 not in ids:
        return []
    rows = []
    for k, (ident, tag) in sorted(ids.items()):
        ok = (ident, tag) == ids[0]
        if ident.startswith("env-sha256:"):   # an env on the nodes: its record, and the interpreter it links to
            what = f"{ident[:23]} (node0: {ids[0][0][:23]})" if ident != ids[0][0] else \
                f"python {tag} (node0: {ids[0][1]})"
            rows.append(Row(f"node{k}", "same env", ok, "as node0" if ok else what,
                            "= node0's env record and interpreter", "" if ok else
                            f"node{k} runs another env than node0 (made from another lock, or linked to another "
                            f"interpreter): make the env with invoke venv on a file system every node sees, or from "
                            f"the same lock with the same interpreter path on each node"))
            continue
        rows.append(Row(f"node{k}", "same image", ok, "as node0" if ok else f"{ident[:19]} (node0: {ids[0][0][:19]})",
                        "= node0's ID and content tag", "" if ok else
                        f"node{k} has a different {ref} than node0: different Paddle/NCCL builds hang or fail; "
                        f"load the same image on every node (one digest)"))
    return rows


# env-sha256: an env on the nodes (runtime none): its record's digest, then the interpreter it links to
REPORTED_IMAGE = re.compile(r"^fleetbox: image (id|file-sha256|tree-sha256|env-sha256|ref|missing) ?(\S*) ?(.*)$",
                            re.M)


def reported_image_rows(outputs: dict[int, str], nodes: int, ref: str, unreported: str = "") -> list[Row]:
    """What each node's script said of the image there (a backend that reports_image: Slurm's node.sh, with the
    lines of runtimes.Runtime.identify); `unreported`: where to look when a node said nothing, in its backend's
    words (Doctoring.unreported_fix)."""
    rows, ids = [], {}
    for k in range(nodes):
        m = REPORTED_IMAGE.search(outputs.get(k, ""))
        node = f"node{k}"
        if not m:
            said = node_log.lines(outputs.get(k, ""))[-1:]
            rows.append(Row(node, "image", False, "not reported", "present", said[0][2] if said
                            else unreported or "the node's script did not run: see its output"))
        elif m.group(1) == "missing":
            env = "invoke venv" in m.group(3) or "interpreter" in m.group(3)   # runtime none: an env, not an image
            rows.append(Row(node, "image", False, f"not found: {(m.group(2) + ' ' + m.group(3)).strip()[:80]}",
                            "present", "make the env with invoke venv on a file system every node sees, its "
                                       "interpreter at the same path on every node" if env else
                            f"{ref} is not on this node: put it on the shared file system or pull it "
                            f"there (invoke export / pull)"))
        elif m.group(1) == "ref":
            rows.append(Row(node, "image", True, f"{m.group(2)} (a registry reference, pulled by each node)",
                            "present; identity not checked"))
        else:
            ids[k] = (f"{m.group(1)}:{m.group(2)}", m.group(3).strip())
            extra = m.group(3).strip()
            rows.append(Row(node, "image", True, f"{m.group(1)} {m.group(2)[:12]}" + (
                "" if not extra else f", python {extra[-40:]}" if m.group(1) == "env-sha256" else
                f", content {extra[:12]}"), "present"))
    return rows + same_image(ids, nodes, ref)


GPU_PREREQUISITE = node_log.about(r"GPU prerequisite( missing)?: (.+)")


def prerequisite_rows(outputs: dict[int, str], nodes: int) -> list[Row]:
    """What each node's script found of its runtime's GPU prerequisite (runtimes.Runtime.gpu_prerequisite), where
    it checked one."""
    rows = []
    for k in range(nodes):
        m = GPU_PREREQUISITE.search(outputs.get(k, ""))
        if m:
            missing = bool(m.group(1))
            rows.append(Row(f"node{k}", "GPU prerequisite", not missing, "missing" if missing else m.group(2)[:120],
                            "what the runtime needs to give GPUs", m.group(2) if missing else ""))
    return rows


TASK_GPUS = node_log.about(r"GPUs the task sees: (.*)")


def allocated_gpu_rows(outputs: dict[int, str], facts: dict[int, dict], e: Expect) -> list[Row]:
    """The GPUs each node's container got against those its Slurm task may use (what the task's nvidia-smi lists
    in its cgroup), by UUID; where the task sees more than it was allocated (no ConstrainDevices), not checked."""
    rows = []
    for k in sorted(facts):
        m = TASK_GPUS.search(outputs.get(k, ""))
        g = facts[k].get("gpu", {})
        if not m or e.device != "cuda" or "uuid" not in g.get("fields", ()):
            continue
        task = [u for u in m.group(1).split(",") if u]
        got = [x["uuid"] for x in gpus_from_nvidia_smi(g.get("out", ""), tuple(g["fields"]))]
        node = f"node{k}"
        if len(task) != e.gpus:
            rows.append(Row(node, "allocated GPUs", True, f"not checked: the task sees {len(task)} GPU(s), it was "
                            f"allocated {e.gpus} (the node does not confine devices)", "the container's = Slurm's"))
            continue
        ok = sorted(got) == sorted(task)
        rows.append(Row(node, "allocated GPUs", ok, ", ".join(u[:12] for u in got) or "none",
                        "the container's = Slurm's", "" if ok else
                        f"the container got {', '.join(got) or 'no GPU'}, Slurm allocated {', '.join(task)}: the "
                        f"engine took Slurm's GPU ids as the driver's indices, which this node's gres.conf numbers "
                        f"otherwise: set AutoDetect=nvml there, or list its File= lines in nvidia-smi's order"))
    return rows


# -- throughput and the sweep --

def tcp_gbps(facts: dict[int, dict]) -> float | None:
    rates = [t["bytes"] / t["seconds"] / 1e9 for t in facts.get(0, {}).get("tcp", {}).values() if "seconds" in t]
    return min(rates) if rates else None


def sweep_row(s: dict) -> Row:
    sw = s.get("sweep")
    if not s["ok"] or not sw:
        return Row("cluster", "all-reduce sweep", False, (s.get("why") or "no report")[:100], "runs, results exact",
                   f"the collective job failed: see {s.get('dir')}")
    wrong = sum(r["wrong"] for r in sw["rows"])
    top = sw["rows"][-1]
    return Row("cluster", "all-reduce sweep", wrong == 0, f"busbw {top['busbw']:.3f} GB/s at {human(top['size'])}"
               + (f"; {wrong} wrong result(s)" if wrong else ""), "runs, results exact",
               "" if not wrong else "all-reduce returned wrong sums: a broken link or library mismatch")
