"""`invoke cache` against a real HTTP server on loopback serving synthetic MNIST files in the real format."""
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from fleetbox.data import datasets as ds, fetch
from fleetbox.errors import UserError
from tests import mnistgen
from tests.conftest import ROOT
from tests.httpserver import Server
from tests.unit.test_cli import one_line_error


@pytest.fixture
def site(tmp_path):
    srv = tmp_path / "srv"
    md5s = mnistgen.write(srv)
    with Server(srv) as s:
        m = mnistgen.manifest(tmp_path / "datasets.toml", s.url, md5s)
        yield s, ds.load(m), m, tmp_path


def test_manifest_layout_matches_paddles_cache():
    known = ds.load()
    assert {"mnist", "fashion-mnist", "cifar10", "cifar100", "flowers", "voc2012"} <= set(known)
    rel = {f.relpath for d in known.values() for f in d.files}
    assert {"mnist/train-images-idx3-ubyte.gz", "fashion-mnist/t10k-labels-idx1-ubyte.gz",
            "cifar/cifar-10-python.tar.gz", "flowers/102flowers.tgz", "voc2012/VOCtrainval_11-May-2012.tar"} <= rel
    with pytest.raises(UserError, match="unknown data set 'imagenet'; known: mnist, fashion-mnist"):
        ds.select(known, "mnist,imagenet")


def test_fresh_download_then_cached(site):
    server, known, _, tmp = site
    dest = tmp / "cache"
    rows = ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None)
    assert [r["status"] for r in rows] == ["downloaded"] * 4
    assert all(r["status"] == "ok" for r in ds.check(known.values(), dest))
    n = len(server.requests)
    rows = ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None)
    assert [r["status"] for r in rows] == ["cached"] * 4 and len(server.requests) == n


def test_files_of_a_data_set_download_at_the_same_time(site):
    server, known, _, tmp = site
    server.hold_for = 4   # the server holds each body until all four requests are in flight
    rows = ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None, jobs=4)
    assert server.max_in_flight == 4 and [r["status"] for r in rows] == ["downloaded"] * 4


def test_after_a_failure_no_further_file_starts(site):
    server, known, _, tmp = site
    (tmp / "srv" / "mnist" / "train-labels-idx1-ubyte.gz").unlink()   # the second file
    with pytest.raises(UserError, match="HTTP 404.*train-labels"):
        ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None, jobs=1)
    asked = [p for p, _ in server.requests]
    assert asked == ["/mnist/train-images-idx3-ubyte.gz", "/mnist/train-labels-idx1-ubyte.gz"]
    assert (tmp / "cache" / "mnist" / "train-images-idx3-ubyte.gz").exists()   # what finished stays


def test_resume_after_the_server_cuts_mid_file(site):
    server, known, _, tmp = site
    name = "mnist/train-images-idx3-ubyte.gz"
    size = (tmp / "srv" / name).stat().st_size
    server.cut_after[name] = size // 2
    dest = tmp / "cache"
    ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None, backoff=0.01)
    ranges = [r for p, r in server.requests if p == "/" + name]
    on_disk = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert ranges[0] == "" and on_disk > 0
    assert server.bytes_sent[name] == size // 2 + (size - on_disk)   # bytes on disk were not fetched again
    assert ds.check(known.values(), dest)[0]["status"] == "ok"


def test_corrupt_content_retries_then_one_clear_error_and_no_final_file(site):
    server, known, _, tmp = site
    name = "mnist/t10k-labels-idx1-ubyte.gz"
    server.corrupt.add(name)
    dest = tmp / "cache"
    with pytest.raises(UserError, match=r"t10k-labels-idx1-ubyte.gz after 3 attempts: md5 mismatch"):
        ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None, retries=2, backoff=0.01)
    assert sum(p == "/" + name for p, _ in server.requests) == 3
    assert not list((dest / "mnist").glob("t10k-labels*"))


def test_folder_mirror(site):
    _, known, _, tmp = site
    dest = tmp / "cache"
    rows = ds.seed(ds.select(known, "mnist"), dest, mirror=str(tmp / "srv"), log=lambda m: None)
    assert [r["status"] for r in rows] == ["downloaded"] * 4
    assert all(r["status"] == "ok" for r in ds.check(known.values(), dest))


def test_http_mirror_replaces_the_origin(site, tmp_path):
    server, known, _, tmp = site
    # A manifest whose URLs point nowhere reachable: the mirror must be used instead.
    dead = {n: d for n, d in known.items()}
    files = tuple(f.__class__(f.dataset, f.module, "http://127.0.0.1:9/mnist/" + f.url.rsplit("/", 1)[1], f.md5)
                  for f in dead["mnist"].files)
    dead["mnist"] = dead["mnist"].__class__("mnist", "mnist", "", files)
    ds.seed([dead["mnist"]], tmp / "cache", mirror=server.url + "/", log=lambda m: None)
    assert all(r["status"] == "ok" for r in ds.check([dead["mnist"]], tmp / "cache"))


def test_unreachable_mirror_and_404(site):
    server, known, _, tmp = site
    with pytest.raises(UserError, match="mirror http://127.0.0.1:9/ is unreachable"):
        ds.seed(ds.select(known, "mnist"), tmp / "c", mirror="http://127.0.0.1:9/", log=lambda m: None)
    (tmp / "srv" / "mnist" / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(UserError, match="HTTP 404"):
        ds.seed(ds.select(known, "mnist"), tmp / "c", log=lambda m: None)
    assert not (tmp / "c" / "mnist" / "t10k-images-idx3-ubyte.gz").exists()


def test_pack_restore_round_trip(site):
    _, known, _, tmp = site
    ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None)
    archive = ds.pack(ds.select(known, "mnist"), tmp / "cache", tmp / "mnist-cache.tar")
    assert not list(tmp.glob("*.part"))
    rows = ds.restore(archive, tmp / "elsewhere", known)
    assert len(rows) == 4
    for f in known["mnist"].files:
        assert (tmp / "elsewhere" / f.relpath).read_bytes() == (tmp / "cache" / f.relpath).read_bytes()
    assert not [p for p in (tmp / "elsewhere").iterdir() if p.name.startswith(".restore-")]


def _crafted(tmp, member: tarfile.TarInfo, data=b"x"):
    path = tmp / "evil.tar"
    with tarfile.open(path, "w") as tar:
        idx = json.dumps({"format": 1, "files": {}}).encode()
        info = tarfile.TarInfo(ds.PACK_INDEX)
        info.size = len(idx)
        tar.addfile(info, io.BytesIO(idx))
        member.size = len(data) if member.isfile() else 0
        tar.addfile(member, io.BytesIO(data) if member.isfile() else None)
    return path


@pytest.mark.parametrize("make,needle", [
    (lambda: tarfile.TarInfo("dataset/../../etc/evil"), "climbs out with '..'"),
    (lambda: tarfile.TarInfo("/etc/evil"), "absolute path"),
    (lambda: _link("dataset/mnist/x", "/etc/passwd"), "is a link"),
])
def test_unsafe_archives_are_refused_and_nothing_lands(tmp_path, make, needle):
    archive = _crafted(tmp_path, make())
    dest = tmp_path / "dest"
    with pytest.raises(UserError, match=needle):
        ds.restore(archive, dest)
    assert not dest.exists() or not any(dest.rglob("*"))
    assert not (tmp_path.parent / "etc").exists()


def _link(name, target):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = tarfile.SYMTYPE, target
    return info


def test_archive_with_a_bad_checksum_is_refused(site):
    _, known, _, tmp = site
    ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None)
    archive = ds.pack(ds.select(known, "mnist"), tmp / "cache", tmp / "a.tar")
    raw = bytearray(archive.read_bytes())
    blob = (tmp / "cache" / "mnist" / "t10k-labels-idx1-ubyte.gz").read_bytes()
    at = raw.find(blob)
    raw[at + 5] ^= 0xFF   # flip a byte inside one member
    archive.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="does not match its checksum"):
        ds.restore(archive, tmp / "dest", known)
    assert not any((tmp / "dest").rglob("*.gz"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_disk_full_is_one_clear_error_and_leaves_nothing(site):
    server, known, _, tmp = site
    small = tmp / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(UserError, match="No space left on device"):
            ds.seed(ds.select(known, "mnist"), small, log=lambda m: None)
        assert not list(small.rglob("*.part"))   # nothing half-written
        statuses = [r["status"] for r in ds.check(known.values(), small)]
        assert "missing" in statuses and set(statuses) <= {"ok", "missing"}   # what landed is verified
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_cli_summary_verify_and_errors(site, run_invoke):
    server, known, manifest, tmp = site
    dest = tmp / "cache"
    proc = run_invoke("cache", "--datasets", "mnist", "--manifest", str(manifest), "--dest", str(dest))
    assert proc.returncode == 0, proc.stderr
    assert "train-images-idx3-ubyte.gz" in proc.stdout and "downloaded" in proc.stdout
    assert run_invoke("cache", "--datasets", "mnist", "--manifest", str(manifest), "--dest", str(dest),
                      "--verify").returncode == 0
    (dest / "mnist" / "t10k-labels-idx1-ubyte.gz").write_bytes(b"broken")
    bad = run_invoke("cache", "--datasets", "mnist", "--manifest", str(manifest), "--dest", str(dest), "--verify")
    assert bad.returncode == 1 and "bad md5" in bad.stdout
    one_line_error(run_invoke("cache", "--datasets", "nope", "--manifest", str(manifest)), "unknown data set 'nope'")


def test_ctrl_c_stops_at_once_keeping_the_part_to_resume(site):
    server, known, manifest, tmp = site
    name = "mnist/train-images-idx3-ubyte.gz"
    size = 2 << 20   # a file of several chunks, on a slow link: about 2 s
    (tmp / "srv" / name).write_bytes(os.urandom(size))
    md5s = {f.relpath.split("/")[1]: f.md5 for f in known["mnist"].files}
    md5s["train-images-idx3-ubyte.gz"] = fetch.file_digest(tmp / "srv" / name, "md5")
    known = ds.load(mnistgen.manifest(manifest, server.url, md5s))
    server.rate = 1 << 20
    dest = tmp / "cache"
    part = dest / (name + ".part")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "cache", "--datasets", "mnist", "--manifest",
                             str(manifest), "--dest", str(dest)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (part.exists() and part.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    t = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "fleetbox: interrupted"
    assert time.monotonic() - t < 1.5   # within a chunk, not after the whole download
    kept = part.stat().st_size
    assert 0 < kept < size and not (dest / name).exists()
    server.rate = 0
    ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None)
    assert (f"/{name}", f"bytes={kept}-") in server.requests   # resumed where it stopped
    assert ds.check(known.values(), dest)[0]["status"] == "ok"


def test_safe_extract_checks_members_itself_where_tarfile_has_no_filters(tmp_path, monkeypatch):
    import tarfile as tf
    monkeypatch.delattr(tf, "data_filter", raising=False)   # as on Python < 3.11.4 (Debian 12's 3.11.2)
    good = tmp_path / "good.tar"
    with tf.open(good, "w") as tar:
        info = tf.TarInfo("jpg/image_00001.jpg")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"jpg"))
    with tf.open(good) as tar:
        ds.safe_extract(tar, tmp_path / "out")
    assert (tmp_path / "out" / "jpg" / "image_00001.jpg").read_bytes() == b"jpg"
    with tf.open(_crafted(tmp_path, tf.TarInfo("dataset/../../etc/evil"))) as tar:
        with pytest.raises(UserError, match="climbs out"):
            ds.safe_extract(tar, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
