"""A 2-node job across two hosts made by the test: network namespaces, each with its own Docker Engine."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from fleetbox import settings
from fleetbox.run import plan as planner
from fleetbox.run import records
from fleetbox.run.backends.docker import checkpoint_volume
from tests import fabric
from tests.conftest import ROOT, invoke
from tests.fabric import RIG

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and extra engines need root")


@pytest.fixture(scope="module")
def rig_engines(cpu_image):
    """Three hosts: two nodes and a spare."""
    urls = RIG.setup(3)
    try:
        fabric.load_image(urls, "fleetbox/paddle:cpu")
        yield urls
    finally:
        RIG.teardown(3)


@pytest.fixture(scope="module")
def hosts(rig_engines):
    return rig_engines[:2]


@pytest.fixture(scope="module")
def uninterrupted(hosts) -> dict:
    """The summary of a 2-node run across the engines that never fails (checkpoints every 5 steps)."""
    ref = invoke("train", "--nodes", "2", "--hosts", ",".join(hosts), "--args", "--checkpoint-every 5")
    assert ref.returncode == 0, ref.stderr
    return json.loads(open(os.path.join(ref.stdout.split("logs in ")[1].split()[0], "summary.json")).read())


def test_two_node_job_across_two_engines_with_hosts(hosts):
    proc = invoke("train", "--nodes", "2", "--hosts", ",".join(hosts))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert f"master {RIG.addr(1)}:" in proc.stdout
    job_dir = proc.stdout.split("logs in ")[1].split()[0]
    summary = json.loads(open(os.path.join(job_dir, "summary.json")).read())
    assert summary["ok"] and [r["host"] for r in summary["nodes"]] == hosts
    assert summary["smoke"]["world"] == 2 and summary["smoke"]["params_identical"]
    job = json.loads(open(os.path.join(job_dir, "job.json")).read())
    # each node found its own NIC towards the master, inside its own namespace
    assert f"GLOO_SOCKET_IFNAME={RIG.iface(1)}" in job["commands"][0] and \
        f"GLOO_SOCKET_IFNAME={RIG.iface(2)}" in job["commands"][1]
    for k in (0, 1):   # logs gathered back from each engine
        assert os.path.exists(os.path.join(job_dir, f"node{k}", "workerlog.0"))
    for url in hosts:
        left = fabric.sh("docker", "-H", url, "ps", "-aq", "--filter", "label=io.fleetbox.job").stdout.split()
        assert left == []
    # nothing of the job stays on the hosts (their engines share this machine's file system here)
    assert not os.path.exists(f"/tmp/fleetbox-runs/{summary['job_id']}")


def test_verify_across_two_hosts(hosts):
    """`invoke verify --nodes 2`: the image checks in each node's engine (here, the rig's: verify's containers on
    the default engine are test_cpu_image's to count), then the smoke job across them."""
    proc = invoke("verify", "--nodes", "2", "--hosts", ",".join(hosts))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    report = json.loads(open(proc.stdout.split("report: ")[-1].strip()).read())
    assert report["ok"] and [(r["what"], r["host"]) for r in report["rows"]] == \
        [("node0", hosts[0]), ("node1", hosts[1]), ("smoke", "2 nodes")]
    for row in report["rows"][:2]:   # each node's own measured facts
        # 10 in the image, then its receipts: the SBOM's Python (in the image), the SBOM and the statement
        assert row["detail"].startswith("13/13 image checks pass; paddle 3.3.1 (commit ")
        assert "device cpu" in row["detail"]
    # the smoke row prints the parameter checksums the ranks measured, and they agree
    summary = json.loads(open(report["rows"][2]["report"]).read())
    sums = summary["smoke"]["checksums"]
    assert len(sums) == 2 and abs(sums[0] - sums[1]) <= 1e-6 * max(1.0, abs(sums[0]))
    assert f"parameter checksums on 2 ranks: {sums[0]:.6f}, {sums[1]:.6f}" in report["rows"][2]["detail"]
    assert f"{sums[0]:.6f}" in proc.stdout
    for url in hosts:
        assert fabric.sh("docker", "-H", url, "ps", "-aq").stdout.split() == []   # nor verify's, nor the job's


def test_the_whole_workspace_reaches_remote_hosts(hosts, tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "helpers").mkdir(parents=True)
    (ws / "store").mkdir()
    outside.mkdir()
    (ws / "helpers" / "__init__.py").write_text("")
    (ws / "helpers" / "util.py").write_text("WORD = 'from-a-sub-folder'\n")
    (ws / "store" / "data.txt").write_text("through-an-absolute-link\n")
    (ws / "data.txt").symlink_to(ws / "store" / "data.txt")   # absolute: would dangle on another host
    (outside / ".npmrc").write_text("token\n")
    (ws / "npmrc").symlink_to(outside / ".npmrc")              # leaves the folder: not shipped
    (ws / "main.py").write_text("import os, sys\nhere = os.path.dirname(__file__)\nsys.path.insert(0, here)\n"
                                "from helpers.util import WORD\n"
                                "print('FLEETBOX-WS', WORD, open(os.path.join(here, 'data.txt')).read().strip(), "
                                "os.path.exists(os.path.join(here, 'npmrc')))\n")
    proc = invoke("train", "--nodes", "2", "--hosts", ",".join(hosts), "--script", str(ws / "main.py"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    assert f"warning: not copied to the remote engines: npmrc -> {outside / '.npmrc'} leaves {ws}" in proc.stdout
    job_dir = proc.stdout.split("logs in ")[1].split()[0]
    for k in (0, 1):
        log = open(os.path.join(job_dir, f"node{k}", "workerlog.0")).read()
        assert "FLEETBOX-WS from-a-sub-folder through-an-absolute-link False" in log, log[-2000:]


def test_a_stuck_rank_on_a_remote_engine_is_noticed_and_named_from_its_stacks(hosts):
    """No shared folder: the progress files and the stacks come out of each container through its engine, and
    the request for stacks goes in the same way."""
    proc = invoke("train", "--nodes", "2", "--hosts", ",".join(hosts), "--hang-timeout", "10", "--args",
                  "--steps 100 --step-sleep 0.05 --hang-rank 1 --hang-step 20")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    assert "fleetbox: train failed: node1 (rank 1) hung: no progress since step 20 (" in proc.stderr and \
        "in `load_batch_that_never_returns` (smoke.py:" in proc.stderr and \
        "rank 0 waiting in `fused_allreduce_gradients`" in proc.stderr, proc.stderr
    job_dir = proc.stdout.split("logs in ")[1].split()[0]
    for k in (0, 1):
        kept = open(os.path.join(job_dir, "hang-0", f"rank{k}.txt")).read()
        assert ("in load_batch_that_never_returns" if k else "in fused_allreduce_gradients") in kept
    for url in hosts:
        assert fabric.sh("docker", "-H", url, "ps", "-aq", "--filter", "label=io.fleetbox.job").stdout.split() == []


def test_unreachable_host_is_one_clear_error(hosts):
    proc = invoke("train", "--nodes", "2", "--hosts", f"{hosts[0]},tcp://{RIG.subnet}.99:2375")
    assert proc.returncode == 2 and f"cannot reach the Docker Engine at tcp://{RIG.subnet}.99:2375" in proc.stderr


def test_a_job_across_engines_restarts_from_each_engines_own_checkpoints(hosts, uninterrupted):
    """No folder is shared between the hosts: each engine keeps the job's checkpoints in a volume, each node's
    first rank writes the replicated state there, and the restarted job resumes from the newest step every
    node has, ending bit for bit where a run that never failed ends."""
    reference = uninterrupted
    job_id = f"hosts-restart-{os.getpid()}"
    proc = invoke("train", "--nodes", "2", "--hosts", ",".join(hosts), "--job-id", job_id, "--max-restarts", "1",
                  "--args", "--checkpoint-every 5 --fail-rank 1 --fail-step 20 --fail-attempt 0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    job_dir = proc.stdout.split("logs in ")[1].split()[0]
    s = json.loads(open(os.path.join(job_dir, "summary.json")).read())
    # which node is blamed for attempt 0 is not this test's point: across engines there are no exact last words,
    # and node 0's abort (250) may end first (README: blame)
    assert [a["ok"] for a in s["attempts"]] == [False, True] and s["attempts"][0]["ended"] in (
        "node1 (rank 1) exited with exit code 3", "node0 (rank 0) exited with exit code 250")
    assert s["smoke"]["resumed_from"] == 20 and s["smoke"]["whole_run"]
    assert s["smoke"]["params_sha256"] == reference["smoke"]["params_sha256"]
    for k, url in enumerate(hosts):   # each node's own copy: replicated state and that node's rank state
        volume = checkpoint_volume(job_id, records.owner()).replace("{node}", f"node{k}")
        ls = fabric.sh("docker", "-H", url, "run", "--rm", "--network", "none", "-v", f"{volume}:/c:ro",
                       "fleetbox/paddle:cpu", "ls", "/c/step-00000060").stdout.split()
        assert "model.pdparams" in ls and "COMPLETE" in ls and [f for f in ls if f.startswith("rank-")] == \
            [f"rank-{k}.pkl"]
    proc = invoke("clean", "--hosts", ",".join(hosts), "--job", job_id)   # the volumes go with the job
    assert proc.returncode == 0 and proc.stdout.count("removed volume fleetbox-") == 2, proc.stdout + proc.stderr
    for url in hosts:
        assert fabric.sh("docker", "-H", url, "volume", "ls", "-q", "--filter", f"name=fleetbox-{job_id}").stdout == ""


def test_spares_take_the_place_of_a_host_that_fails_its_check_at_start_and_of_a_node_whose_engine_is_lost(
        rig_engines, uninterrupted, tmp_path):
    """--nodes 2 --spare-nodes 2: node1's engine cannot be reached, so the first spare takes its place before the
    job starts. After the checkpoint at step 20, that host's engine stops answering (its port rejects, as a
    machine cut off its network): its node is lost and blamed, the second spare takes its place in the same job,
    and the job ends bit for bit where the run that never failed ends. The hosts left out are named in the
    summary; the lost node's container, left behind, is removed by `invoke clean` once the engine answers."""
    h1, h2, h3 = rig_engines
    gone, ck, job_id = f"tcp://{RIG.subnet}.99:2375", tmp_path / "ck", f"spares-{os.getpid()}"
    cut = ("INPUT", "-p", "tcp", "--dport", "2375", "-j", "REJECT", "--reject-with", "tcp-reset")
    p = subprocess.Popen([sys.executable, "-m", "invoke", "train", "--nodes", "2", "--spare-nodes", "2", "--hosts",
                          ",".join((h1, gone, h2, h3)), "--job-id", job_id, "--max-restarts", "1", "--checkpoint-dir",
                          str(ck), "--args", "--checkpoint-every 5 --hang-rank 1 --hang-step 20 --hang-attempt 0"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (ck / "step-00000020" / "COMPLETE").exists():   # rank 1 then waits at step 20 (a stuck loader)
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.2)
        _iptables(RIG.ns(2), "-I", *cut)
        out, err = p.communicate(timeout=600)
    finally:
        _iptables(RIG.ns(2), "-D", *cut)
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out[-3000:] + err
    assert f"note: node1's host {gone} failed its check at start (cannot reach the Docker Engine at {gone}" in out \
        and f"the spare {h2} takes its place" in out
    s = json.loads((ROOT / "runs" / job_id / "summary.json").read_text())
    first, then = s["replaced"]
    assert (first["attempt"], first["node"], first["host"], first["by"]) == (0, 1, gone, h2)
    assert (then["attempt"], then["node"], then["host"], then["by"]) == (1, 1, h2, h3)
    assert then["why"].startswith(f"node1 (rank 1) was lost: its engine ({h2}) stopped answering")
    assert [n["host"] for n in s["nodes"]] == [h1, h3]
    assert f"the spare {h3} takes node1's place ({h2} is left out for the rest of the job)" in out
    assert s["smoke"]["resumed_from"] == 20 and s["smoke"]["whole_run"]
    assert s["smoke"]["params_sha256"] == uninterrupted["smoke"]["params_sha256"]
    for url in (h1, h3):
        assert fabric.sh("docker", "-H", url, "ps", "-aq", "--filter", "label=io.fleetbox.job").stdout.split() == []
    proc = invoke("clean", "--hosts", h2, "--job", job_id)
    assert proc.returncode == 0 and f"removed fleetbox-{job_id}-node1" in proc.stdout, proc.stdout + proc.stderr
    assert fabric.sh("docker", "-H", h2, "ps", "-aq", "--filter", "label=io.fleetbox.job").stdout.split() == []


def test_a_checkpoint_folder_the_engines_share_is_taken_where_it_is_and_never_sets_earlier_steps_aside(
        hosts, tmp_path):
    """--hosts with a shared --checkpoint-dir: the folder is not read from here but in a container on the first
    host. A live job's folder is refused before anything in it moves; an ended one's is taken, and --resume never
    sets its steps aside there (before, nothing was moved, and the new run resumed the old run's newest step)."""
    from fleetbox.processes import process_start, this_host
    from fleetbox.run.records import Handle
    ck = tmp_path / "shared-ck"
    (ck / "step-00000010").mkdir(parents=True)
    (ck / "step-00000010" / "COMPLETE").write_text("{}")
    live = ROOT / "runs" / f"live-owner-{os.getpid()}"   # a job whose supervisor (this process) runs
    live.mkdir(parents=True)
    Handle("docker", live.name, str(live), 1, [""], supervisor=os.getpid(), supervisor_start=process_start(os.getpid()),
           supervisor_host=this_host()).save()
    (ck / "OWNER").write_text(json.dumps({"job": live.name, "runs": str((ROOT / "runs").resolve()), "user": "ann",
                                          "host": "login2"}))
    args = ["train", "--nodes", "2", "--hosts", ",".join(hosts), "--checkpoint-dir", str(ck), "--resume", "never"]
    try:
        refused = invoke(*args)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(
            f"fleetbox: error: checkpoint folder {ck} belongs to job {live.name} of ann on login2 "), refused.stderr
        assert "which is STARTING" in refused.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["shared-ck"]
        Handle("docker", live.name, str(live), 1, [""], supervisor=0).save()   # it ended
        (live / "summary.json").write_text(json.dumps({"ok": False}))
        proc = invoke(*args)
    finally:
        shutil.rmtree(live)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("shared-ck.before-")]
    assert f"--resume never: moved the earlier checkpoints to {aside}" in proc.stdout
    assert (aside / "step-00000010" / "COMPLETE").exists()
    s = json.loads(open(os.path.join(proc.stdout.split("logs in ")[1].split()[0], "summary.json")).read())
    assert s["ok"] and s["smoke"]["resumed_from"] == 0 and s["smoke"]["whole_run"], s["smoke"]
    assert not (ck / "OWNER").exists()   # given up, there too, when the job ended


# -- invoke doctor on the rig: all ✓ when healthy, and each fault named by its own ✗ --

def below_ephemeral(port: int, nodes: int) -> int:
    """A doctor's master port and every node's pinned ports, all below the kernel's ephemeral range: a port in
    it may be held by any connection made there in the last minute (TIME_WAIT; slurmd and the engines make
    many), and the doctor binds as Paddle does, without SO_REUSEADDR, so it would say "in use" (one CI run
    failed so, on 43301). Fails loudly where the range starts lower."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    last = port + 8 * nodes   # room for 8 pinned ports per node, more than the tests' jobs use
    assert last < low, f"ports {port}-{last} reach the ephemeral range (from {low}): pick lower ones"
    return port


def held_ports(ns: str) -> set[int]:
    """The local ports of every TCP socket in a node's namespace, whatever its state (a job's or a doctor's
    port in TIME-WAIT for a minute after it closed, a leftover listener)."""
    lines = fabric.sh("nsenter", f"--net=/run/netns/{ns}", "ss", "-Htan").stdout.splitlines()
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in lines if line.strip()}


@pytest.fixture
def doctor_port(hosts) -> int:
    """A master port whose block no socket holds on either node now: known before the doctor runs, so a test
    can block it in a node's firewall, and clear of whatever the tests before left in TIME-WAIT (one CI run
    found 29101 so)."""
    held = held_ports(RIG.ns(1)) | held_ports(RIG.ns(2))
    for port in range(below_ephemeral(29100, 3), 31000, 10):
        if not held & set(range(port, port + 8 * 3)):
            return port
    raise AssertionError(f"no clear block of ports from 29100 on the nodes: {sorted(held)}")


def doctor_report(proc) -> dict:
    path = (proc.stdout + proc.stderr).split("report: ")[-1].split()[0].rstrip(")")
    return json.loads(open(path).read())


def failing(report) -> set:
    return {(r["node"], r["check"]) for r in report["rows"] if not r["ok"]}


def test_doctor_passes_every_check_on_a_healthy_rig(hosts):
    proc = invoke("doctor", "--nodes", "2", "--hosts", ",".join(hosts))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr
    rep = doctor_report(proc)
    rows = {(r["node"], r["check"]): r for r in rep["rows"]}
    assert rep["ok"] and failing(rep) == set()
    # measured, in each node's own namespace and container
    assert rows[("node1", "route to master")]["value"] == f"{RIG.addr(1)} via {RIG.iface(2)} {RIG.addr(2)}"
    assert rows[("node0", "route to master")]["value"] == f"{RIG.addr(1)} via {RIG.iface(1)} {RIG.addr(1)}"
    assert rep["facts"]["1"]["iface"]["speed"] == 10000 and rep["facts"]["1"]["iface"]["mtu"] == 1500
    assert rep["facts"]["0"]["reach"]["1"]["ip"] == RIG.addr(2)
    assert rows[("node1", "same image")]["ok"] and rows[("node1", "master port")]["ok"]
    assert rep["facts"]["0"]["tcp"]["1"]["bytes"] == 64 << 20
    sweep = rep["sweep"]
    assert sweep["backend"] == "gloo" and sweep["world"] == 2 and sweep["rows"][-1]["size"] == 64 << 20
    assert [r["size"] for r in sweep["rows"]] == [1024 << k for k in range(17)]
    assert all(r["wrong"] == 0 and r["busbw"] > 0 for r in sweep["rows"])
    assert "# raw TCP (probe)" in proc.stdout and "    67108864     16777216   float    sum" in proc.stdout


def _iptables(ns, *rule):
    return fabric.sh("nsenter", f"--net=/run/netns/{ns}", "iptables", *rule)


FAULTS = {
    # name: (extra args, setup, undo, the ✗ rows it must produce: exactly these)
    "node without the image": (["--image", "fleetbox/paddle:doctor-only-one"],
                               lambda h, port: fabric.sh("docker", "-H", h[0], "tag", "fleetbox/paddle:cpu",
                                                         "fleetbox/paddle:doctor-only-one"),
                               lambda h, port: fabric.sh("docker", "-H", h[0], "rmi",
                                                         "fleetbox/paddle:doctor-only-one"),
                               {("node1", "image")}),
    "node with a different image": (["--image", "fleetbox/paddle:doctor-diff"],
                                    lambda h, port: _different_image(h),
                                    lambda h, port: [fabric.sh("docker", "-H", u, "rmi", "fleetbox/paddle:doctor-diff",
                                                               check=False) for u in h],
                                    {("node1", "same image")}),
    "master port blocked": ([],
                            lambda h, port: _iptables(RIG.ns(1), "-I", "INPUT", "-p", "tcp", "--dport", str(port),
                                                            "-j", "DROP"),
                            lambda h, port: _iptables(RIG.ns(1), "-D", "INPUT", "-p", "tcp", "--dport", str(port),
                                                            "-j", "DROP"),
                            {("node1", "master port"), ("node0", "nodes joined")}),
    "trainer port blocked": ([],   # node0's first pinned port: its launcher's candidate, the trainers' TCP store
                             lambda h, port: _iptables(RIG.ns(1), "-I", "INPUT", "-p", "tcp", "--dport", str(port + 1),
                                                             "-j", "DROP"),
                             lambda h, port: _iptables(RIG.ns(1), "-D", "INPUT", "-p", "tcp", "--dport", str(port + 1),
                                                             "-j", "DROP"),
                             {("node1", "ports of node0")}),
    "interface that does not route to the master": (["--iface", "lo"], lambda h, port: None,
                                                    lambda h, port: None,
                                                    {("node0", "route to master"), ("node1", "route to master")}),
}


def _different_image(h):
    fabric.sh("docker", "-H", h[0], "tag", "fleetbox/paddle:cpu", "fleetbox/paddle:doctor-diff")
    fabric.sh("docker", "-H", h[1], "run", "--name", "doctor-diff", "--network", "none", "fleetbox/paddle:cpu",
              "touch", "/a-change")
    fabric.sh("docker", "-H", h[1], "commit", "doctor-diff", "fleetbox/paddle:doctor-diff")
    fabric.sh("docker", "-H", h[1], "rm", "doctor-diff")


@pytest.mark.parametrize("fault", list(FAULTS))
def test_doctor_names_each_fault_and_preflight_refuses_the_job(hosts, doctor_port, fault):
    extra, setup, undo, want = FAULTS[fault]
    args = ["--nodes", "2", "--hosts", ",".join(hosts), "--port", str(doctor_port), *extra]
    setup(hosts, doctor_port)
    try:
        proc = invoke("doctor", *args, "--quick", "--wait", "5")
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
        rep = doctor_report(proc)
        assert failing(rep) == want, proc.stdout[-3000:]
        for node, check in want:   # each ✗ printed with its fix
            assert any(ln.startswith(f"  ✗ {node} {check}: ") for ln in proc.stdout.splitlines()), proc.stdout
        job_id = f"preflight-{fault.split()[0]}-{os.getpid()}"
        proc = invoke("train", *args, "--preflight", "--job-id", job_id)
        assert proc.returncode == 1 and "the job was not started" in proc.stderr, proc.stdout[-3000:] + proc.stderr
        assert failing(doctor_report(proc)) == want
        assert not (settings.runs_root() / job_id).exists()   # nothing of the job ran
        for url in hosts:
            assert fabric.sh("docker", "-H", url, "ps", "-aq", "--filter", "label=io.fleetbox.job").stdout == ""
    finally:
        undo(hosts, doctor_port)


def test_doctor_names_an_engine_it_cannot_reach(hosts):
    proc = invoke("doctor", "--nodes", "2", "--hosts", f"{hosts[0]},tcp://{RIG.subnet}.99:2375", "--quick")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr
    assert failing(doctor_report(proc)) == {("node1", "engine")}
    assert f"  ✗ node1 engine: cannot reach the Docker Engine at tcp://{RIG.subnet}.99:2375" in proc.stdout


def test_preflight_on_a_healthy_rig_starts_the_job_on_the_ports_it_checked(hosts):
    proc = invoke("train", "--nodes", "2", "--hosts", ",".join(hosts), "--preflight")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    checked = doctor_report_in(proc.stdout)["port"]
    assert f"master {RIG.addr(1)}:{checked}" in proc.stdout
    # the job's launchers took exactly the pinned ports doctor probed: node k's block above the master port
    job_dir = proc.stdout.split("logs in ")[1].split()[0]
    peers = open(glob.glob(os.path.join(job_dir, "node0", "default.*.log"))[0]).read()
    for k, ip in enumerate((RIG.addr(1), RIG.addr(2))):
        used = {int(p) for p in re.findall(rf"'(?:candidate|endpoints)': '{re.escape(ip)}:(\d+)'", peers)}
        first, last = planner.trainer_ports(checked, k, 1)
        assert len(used) == 2 and all(first <= p <= last for p in used), (k, used, peers[-2000:])


def doctor_report_in(text) -> dict:
    path = text.split("every check passed; report: ")[1].split()[0]
    return json.loads(open(path).read())
