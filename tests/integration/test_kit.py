"""invoke kit for real: a kit made here, made again with nothing changed (every part reused, no file
rewritten), tampered copies refused with one line each and nothing changed, and a "site" with no network at
all (a network namespace with loopback only, and its own Docker Engine on a fresh, empty data root) where
the loader, the venv install, build, verify and a 2-node train all run and pass."""
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from fleetbox.image import matrix, receipts
from fleetbox.ship import kit_load
from tests import fabric
from tests.conftest import invoke
from tests.integration.conftest import MD5_ATTRS, layer_digests, without_pushed
from tests.unit.test_cli import one_line_error

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace and a second dockerd)")

NS = "fbkit"
RUN = Path("/run/fleetbox-kit")


@pytest.fixture(scope="module")
def kit(tmp_path_factory, cpu_image, seeded_mnist):
    d = tmp_path_factory.mktemp("kit")
    proc = invoke("kit", *KIT_ARGS(seeded_mnist), "--out", str(d / "cpu.kit"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    sha = proc.stdout.split("kit sha256 ")[1].split()[0]
    return {"path": d / "cpu.kit", "sha": sha, "stdout": proc.stdout, "mnist": seeded_mnist}


def KIT_ARGS(mnist):
    return ["--variant", "cpu", "--datasets", "mnist", "--data-dir", str(mnist["dest"]),
            "--manifest", str(mnist["manifest"])]


def files_under(*paths):
    out = {}
    for p in paths:
        for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file())):
            st = f.stat()
            out[str(f)] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


def test_a_kit_says_what_it_holds_and_a_second_one_reuses_every_part(kit):
    path = kit["path"]
    parts = ["loader", "source", "lock", "host-wheels", "board-wheels", "wheelhouse", "base", "datasets"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == kit["sha"]   # the printed digest is the file's
    assert (path.parent / "cpu.kit.sha256").read_text() == f"{kit['sha']}  cpu.kit\n"
    with tarfile.open(path) as tar:
        names = tar.getnames()
    assert names[:3] == ["kit-load.py", "MANIFEST.sha256", "kit.json"]   # the manifest early: damage shows early
    assert {n.split("/")[0] for n in names} == {"kit-load.py", "source", "lock", "host-wheels", "board-wheels",
                                                "wheelhouse", "base", "datasets", "kit.json", "MANIFEST.sha256"}
    assert any(n.startswith("host-wheels/matplotlib-") for n in names)   # fleetbox's own dependencies
    assert any(n.startswith("board-wheels/visualdl-2.5.3-") for n in names)   # the board's
    # a site without fleetbox checks the unpacked kit with the standard tool
    out = path.parent / "unpacked"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    subprocess.run(["tar", "-xf", str(path), "-C", str(out)], check=True)
    checked = subprocess.run(["sha256sum", "--strict", "-c", "MANIFEST.sha256"], cwd=out, capture_output=True,
                             text=True)
    ok = {ln.removesuffix(": OK") for ln in checked.stdout.splitlines()}
    every_file = {str(f.relative_to(out)) for f in out.rglob("*") if f.is_file()}
    assert checked.returncode == 0 and ok == every_file - {"MANIFEST.sha256"}, checked.stdout[-2000:]
    shutil.rmtree(out)
    before = files_under(path, path.with_name("cpu.kit.parts"))
    proc = invoke("kit", *KIT_ARGS(kit["mnist"]), "--out", str(path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    said = {ln.split()[0]: ln.split()[-1] for ln in proc.stdout.splitlines() if ln.startswith("  ") and "file(s)" in ln}
    assert said == {p: "reused" for p in parts}, proc.stdout
    assert "(unchanged; not rewritten)" in proc.stdout and f"kit sha256 {kit['sha']}" in proc.stdout
    assert files_under(path, path.with_name("cpu.kit.parts")) == before   # no file rewritten


def rewrite(src: Path, dst: Path, change=None, drop=None, add=None):
    """A copy of the kit with one member changed (change(name, bytes) -> bytes), dropped, or one added."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tout:
        for m in tin.getmembers():
            if m.name == drop:
                continue
            data = tin.extractfile(m).read()
            if change:
                data = change(m.name, data)
            m.size = len(data)
            tout.addfile(m, io.BytesIO(data))
        if add:
            info = tarfile.TarInfo(add)
            info.size = 5
            tout.addfile(info, io.BytesIO(b"extra"))
    return dst


def without_host_wheel(src: Path, dst: Path) -> str:
    """A kit without one of fleetbox's host wheels, its kit.json and manifest rewritten to match (as a kit made
    wrong would be): it passes every check, and its venv install fails part-way."""
    import json
    with tarfile.open(src) as tar:
        gone = next(n for n in tar.getnames() if n.startswith("host-wheels/tqdm-"))
        info = json.loads(tar.extractfile("kit.json").read())
    info["parts"]["host-wheels"]["files"].remove(gone)
    del info["sizes"][gone]
    blob = json.dumps(info, indent=1, sort_keys=True).encode()

    def change(name, data):
        if name == "kit.json":
            return blob
        if name == kit_load.MANIFEST:
            lines = [ln for ln in data.decode().splitlines() if not ln.endswith(f"  {gone}")]
            return "".join((f"{hashlib.sha256(blob).hexdigest()}  kit.json" if ln.endswith("  kit.json") else ln)
                           + "\n" for ln in lines).encode()
        return data
    rewrite(src, dst, change=change, drop=gone)
    return gone


def first_wheel(kit_path):
    with tarfile.open(kit_path) as tar:
        return next(n for n in tar.getnames() if n.startswith("wheelhouse/") and n.endswith(".whl"))


def flip(target):
    def change(name, data):
        return data[:100] + bytes([data[100] ^ 1]) + data[101:] if name == target else data
    return change


def engine_images():
    return sorted(without_pushed(subprocess.run(["docker", "images", "-a", "--no-trunc",
                                                 "--format", "{{.ID}} {{.Repository}}:{{.Tag}}"],
                                                capture_output=True, text=True).stdout.splitlines()))


def test_a_hang_up_during_a_load_undoes_it(kit, tmp_path):
    """The SSH connection drops while the kit loads (SIGHUP): what the load placed is undone, as on Ctrl-C."""
    dest, before = tmp_path / "site", engine_images()
    p = subprocess.Popen([sys.executable, "-m", "fleetbox.ship.kit_load", str(kit["path"]), "--dest", str(dest),
                          "--expect", kit["sha"]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = []
    for ln in p.stdout:   # verified, and placing things now
        said.append(ln)
        if ln.startswith("loading the "):
            break
    assert dest.is_dir(), said
    p.send_signal(signal.SIGHUP)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "kit-load: interrupted; what it had loaded was undone" in err, "".join(said) + err
    assert not dest.exists() and not (tmp_path / ".site.kit-load").exists()
    assert engine_images() == before


@pytest.mark.parametrize("how", ["wheel byte", "base truncated", "extra file", "missing file", "kit cut short",
                                 "manifest rewritten"])
def test_a_tampered_kit_is_refused_in_one_line_and_changes_nothing(kit, tmp_path, how):
    wheel = first_wheel(kit["path"])
    bad, expect = tmp_path / "bad.kit", None
    if how == "wheel byte":
        rewrite(kit["path"], bad, change=flip(wheel))
        said = f"kit part {wheel} does not match the kit's manifest"
    elif how == "base truncated":
        rewrite(kit["path"], bad, change=lambda n, d: d[:len(d) // 2] if n == "base/base.tar" else d)
        said = "the kit's base/base.tar says it holds"   # refused by its size in kit.json, before it is written
    elif how == "extra file":
        rewrite(kit["path"], bad, add="wheelhouse/extra.whl")
        said = "holds wheelhouse/extra.whl, which its manifest does not list"
    elif how == "missing file":
        rewrite(kit["path"], bad, drop=wheel)
        said = f"lacks {wheel}, which its manifest lists"
    elif how == "kit cut short":
        with open(kit["path"], "rb") as f, open(bad, "wb") as out:
            out.write(f.read(kit["path"].stat().st_size // 3))
        said = "is not a complete archive"
    else:   # the wheel changed and the manifest rewritten to match: only the digest sent apart catches it
        def change(name, data):
            if name == wheel:
                return flip(wheel)(name, data)
            if name == kit_load.MANIFEST:
                wheel_bytes = tarfile.open(kit["path"]).extractfile(wheel).read()
                new = hashlib.sha256(flip(wheel)(wheel, wheel_bytes)).hexdigest()
                return b"".join((f"{new}  {wheel}\n".encode() if ln.endswith(f"  {wheel}".encode()) else ln + b"\n")
                                for ln in data.splitlines())
            return data
        rewrite(kit["path"], bad, change=change)
        staging = tmp_path / "check"
        staging.mkdir()
        kit_load.verify(bad, staging, None, log=lambda m: None)   # its own manifest alone passes it
        expect, said = kit["sha"], f"not the expected {kit['sha']}: it was changed or damaged"
    check = ["--expect", expect] if expect else ["--no-expect"]   # the manifest alone, in the other cases
    before = engine_images()
    dest = tmp_path / "site"
    proc = invoke("kit", "--load", str(bad), "--dest", str(dest), *check)
    one_line_error(proc, said)
    assert not dest.exists() and not (tmp_path / ".site.kit-load").exists()
    assert engine_images() == before
    # the loader in the tampered kit says the same, before fleetbox is installed
    if how != "kit cut short":
        assert subprocess.run(["tar", "-xf", str(bad), "-C", str(tmp_path), "kit-load.py"]).returncode == 0
        proc = subprocess.run([sys.executable, str(tmp_path / "kit-load.py"), str(bad), "--dest", str(dest), *check],
                              capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.strip().startswith("kit-load: refused: ") and said in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not dest.exists()
    # and the first check README asks for, coreutils against the digest sent apart, fails before any of it
    (tmp_path / "bad.kit.sha256").write_text(f"{kit['sha']}  bad.kit\n")
    assert subprocess.run(["sha256sum", "-c", "bad.kit.sha256"], cwd=tmp_path, capture_output=True).returncode != 0


@pytest.fixture
def site(tmp_path):
    """A network namespace with loopback only, and a Docker Engine in it with a fresh, empty data root."""
    def stop():
        fabric.stop_daemon(RUN / "dockerd.pid", seconds=30)
        subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    stop()
    subprocess.run(["ip", "netns", "add", NS], check=True)
    subprocess.run(["ip", "-n", NS, "link", "set", "lo", "up"], check=True)
    RUN.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "engine"
    root.mkdir()
    sock = RUN / "docker.sock"
    log = open(tmp_path / "dockerd.log", "w")
    subprocess.Popen(["nsenter", f"--net=/run/netns/{NS}", "dockerd", "-H", f"unix://{sock}", "--data-root",
                      str(root), "--exec-root", str(RUN / "exec"), "--pidfile", str(RUN / "dockerd.pid"),
                      "--bridge", "none", "--iptables=false", "--ip-masq=false"],
                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETBOX_")}   # nothing from this machine
    env["DOCKER_HOST"] = f"unix://{sock}"
    deadline = time.monotonic() + 90
    while subprocess.run(["docker", "info"], env=env, capture_output=True).returncode != 0:
        assert time.monotonic() < deadline, (tmp_path / "dockerd.log").read_text()[-2000:]
        time.sleep(0.5)
    try:
        yield env
    finally:
        subprocess.run(["docker", "rm", "-f", *subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True,
                                                               text=True).stdout.split()], env=env, capture_output=True)
        stop()
        shutil.rmtree(root, ignore_errors=True)


def in_site(env, *argv, cwd=None, timeout=900):
    return subprocess.run(["nsenter", f"--net=/run/netns/{NS}", *map(str, argv)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_the_site_loads_the_kit_then_builds_verifies_and_trains_with_no_network(kit, site, tmp_path, cpu_image):
    links = in_site(site, "ip", "-o", "link").stdout
    assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"]   # no way out of the namespace
    assert in_site(site, "ip", "route").stdout.strip() == ""
    assert in_site(site, "docker", "images", "-q").stdout.strip() == ""      # a fresh engine
    # a load that fails part-way (a kit made without one host wheel) is undone: no folder, no image
    broken = tmp_path / "broken.kit"
    gone = without_host_wheel(kit["path"], broken)
    assert in_site(site, "tar", "-xf", broken, "-C", tmp_path, "kit-load.py").returncode == 0
    proc = in_site(site, sys.executable, tmp_path / "kit-load.py", broken, "--no-expect", "--dest", tmp_path / "bad",
                   cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "pip" in proc.stderr and gone.split("/")[1].split("-")[0] in proc.stderr, proc.stderr
    assert "loading the base" in proc.stdout   # the base had been loaded, then taken away again
    assert in_site(site, "docker", "images", "-aq").stdout.strip() == "" and not (tmp_path / "bad").exists()
    # the kit as made: checked against the digest sent apart, then loaded
    (tmp_path / "cpu.kit.sha256").write_text(f"{kit['sha']}  {kit['path']}\n")
    assert in_site(site, "sha256sum", "-c", tmp_path / "cpu.kit.sha256").returncode == 0
    assert in_site(site, "tar", "-xf", kit["path"], "-C", tmp_path, "kit-load.py").returncode == 0
    dest = tmp_path / "site"
    proc = in_site(site, sys.executable, tmp_path / "kit-load.py", kit["path"], "--expect", kit["sha"],
                   "--dest", dest, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"kit sha256 {kit['sha']} as expected" in proc.stdout
    base = matrix.load().get("cpu").base_ref
    tags = in_site(site, "docker", "images", "--format", "{{.Repository}}:{{.Tag}}").stdout.split()
    assert tags == [base], tags
    py, src = dest / "venv" / "bin" / "python", dest / "fleetbox"
    for name, attr in MD5_ATTRS.items():   # the dataset cache, restored and checked
        md5 = kit["mnist"]["md5"][attr]
        got = hashlib.md5((src / "offline_cache" / "dataset" / "mnist" / name).read_bytes()).hexdigest()
        assert got == md5, name
    # fleetbox runs from the venv, its dependencies from the kit's wheels, its source from the kit
    where = in_site(site, py, "-c", "import fleetbox, matplotlib; print(fleetbox.ROOT)", cwd=tmp_path)
    assert where.stdout.strip() == str(src), where.stderr
    for step in (["build", "--variant", "cpu"], ["verify", "--variant", "cpu"], ["train", "--nodes", "2"]):
        proc = in_site(site, py, "-m", "invoke", *step, cwd=src)
        assert proc.returncode == 0, (step, proc.stdout[-3000:] + proc.stderr[-3000:])
    assert "job " in proc.stdout and ": PASSED" in proc.stdout
    # the site built the very image built here: same inputs, same content tag
    here = subprocess.run(["docker", "images", "--format", "{{.Tag}}", "fleetbox/paddle"], capture_output=True,
                          text=True).stdout.split()
    there = in_site(site, "docker", "images", "--format", "{{.Tag}}", "fleetbox/paddle").stdout.split()
    content = [t for t in there if t.startswith("cpu-")]
    assert len(content) == 1 and content[0] in here, (there, here)
    # ... byte for byte: every layer's digest, on an engine that had none of them (its data root was empty), and
    # the SBOM; the statements differ as the builds did (engine, times), each of its own image
    ref = f"fleetbox/paddle:{content[0]}"
    theirs = json.loads(in_site(site, "docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", ref).stdout)
    assert theirs == layer_digests(ref), (theirs, layer_digests(ref))
    (sbom,) = (src / "receipts").glob("inputs-*.sbom.json")
    assert sbom.read_bytes() == (receipts.folder() / sbom.name).read_bytes()
    # the board: its environment made from the kit's wheels, every package index a closed port, and it serves
    job = re.search(r"^job (\S+): PASSED$", proc.stdout, re.M).group(1)
    closed = "http://127.0.0.1:9/simple"
    env = {**site, "FLEETBOX_BOARD_ENVS": str(tmp_path / "board-envs"), **dict.fromkeys(
        ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"), closed)}
    board = subprocess.Popen(["nsenter", f"--net=/run/netns/{NS}", py, "-m", "invoke", "board", job], cwd=src, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = [board.stdout.readline() for _ in range(2)]
        assert lines[0].startswith(f"board: making VisualDL's environment in {tmp_path / 'board-envs'}/board-") and \
            lines[0].rstrip().endswith(f"from {src / 'wheelhouse' / 'board'}, no index)"), lines + [board.stderr.read()]
        while not lines[-1].startswith("board: http://"):
            lines.append(board.stdout.readline())
            assert lines[-1], "".join(lines) + board.stderr.read()
        runs = in_site(site, py, "-c", "import urllib.request; print(urllib.request.urlopen("
                       "'http://127.0.0.1:8040/app/api/runs', timeout=30).read().decode())")
        assert f"{job}/attempt0/rank0" in runs.stdout and f"{job}/attempt0/rank1" in runs.stdout, runs
    finally:
        board.send_signal(signal.SIGINT)
        out, err = board.communicate(timeout=60)
    assert board.returncode == 0 and "board: stopped" in out, out + err


def test_a_site_with_no_container_engine_loads_the_kit_and_makes_the_env_from_it(kit, tmp_path):
    """No docker command at all (PATH holds every tool of this machine but docker): the loader refuses in one line
    saying what to do, loads with --skip-images, and the loaded fleetbox makes the variant's env from the kit's
    own wheelhouse (invoke venv), offline; Paddle imports in it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in ("/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for tool in Path(d).iterdir() if Path(d).is_dir() else ():
            if not tool.name.startswith("docker") and not (bin_dir / tool.name).exists():
                (bin_dir / tool.name).symlink_to(tool)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEETBOX_", "DOCKER_"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{bin_dir}"
    assert subprocess.run(["sh", "-c", "command -v docker"], env=env, capture_output=True).returncode != 0
    assert subprocess.run(["tar", "-xf", str(kit["path"]), "-C", str(tmp_path), "kit-load.py"]).returncode == 0
    load = [sys.executable, str(tmp_path / "kit-load.py"), str(kit["path"]), "--expect", kit["sha"], "--dest"]
    proc = subprocess.run([*load, str(tmp_path / "refused")], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "refused").exists()
    assert proc.stderr.strip() == ("kit-load: refused: cannot run docker: No such file or directory (a site with no "
                                   "container engine: load with --skip-images, then make the env with `invoke venv`)")
    dest = tmp_path / "site"
    proc = subprocess.run([*load, str(dest), "--skip-images"], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not loading the base (--skip-images): no container engine is asked" in proc.stdout
    py, src = dest / "venv" / "bin" / "python", dest / "fleetbox"
    assert f"{py} -m invoke venv --variant cpu --dest DIR" in proc.stdout
    proc = subprocess.run([str(py), "-m", "invoke", "venv", "--variant", "cpu", "--dest", str(tmp_path / "envs")],
                          env=env, capture_output=True, text=True, cwd=src, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    made = Path(proc.stdout.strip().splitlines()[-1])
    assert made.parent == tmp_path / "envs" and made.name.startswith("cpu-")
    got = subprocess.run([str(made / "bin" / "python"), "-c", "import paddle, cv2, scipy; print(paddle.__version__)"],
                         env=env, capture_output=True, text=True)
    assert got.stdout.strip() == matrix.load().get("cpu").paddle_version, got.stderr[-2000:]
