"""`invoke cache` against a real HTTP server on loopback serving synthetic MNIST files in the real format."""
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import time

import pytest

from fleetbox import archives
from fleetbox.data import datasets as ds
from fleetbox.data import fetch
from fleetbox.errors import UserError
from tests import mnistgen
from tests.conftest import ROOT, ctrl_c_reaches_it
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
                            stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_reaches_it)
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
        archives.safe_extract(tar, tmp_path / "out")
    assert (tmp_path / "out" / "jpg" / "image_00001.jpg").read_bytes() == b"jpg"
    with tf.open(_crafted(tmp_path, tf.TarInfo("dataset/../../etc/evil"))) as tar:
        with pytest.raises(UserError, match="climbs out"):
            archives.safe_extract(tar, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def _tree(root):
    """{relative path: bytes, or None for a folder} of everything under root: to see that nothing changed."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _modes(root):
    """{relative path: permission bits} of root and everything under it."""
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def _pack(path, files, index=None, gz=False):
    """A pack as `invoke cache --pack` writes one: its index, then dataset/<rel> for each of `files`."""
    if index is None:
        index = {"format": 1, "files": {rel: {"md5": hashlib.md5(b).hexdigest(), "bytes": len(b),
                                              "sha256": hashlib.sha256(b).hexdigest()} for rel, b in files.items()}}
    blob = index if isinstance(index, bytes) else json.dumps(index).encode()
    with tarfile.open(path, "w:gz" if gz else "w") as tar:
        for name, data in [(ds.PACK_INDEX, blob), *((f"dataset/{r}", b) for r, b in files.items())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _flowers_tgz():
    """A small 102flowers.tgz: jpg/ with two images, stored with private modes (0700 folder, 0600 files)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        d = tarfile.TarInfo("jpg")
        d.type, d.mode = tarfile.DIRTYPE, 0o700
        tar.addfile(d)
        for n in (1, 2):
            info = tarfile.TarInfo(f"jpg/image_{n:05}.jpg")
            info.size, info.mode = 3, 0o600
            tar.addfile(info, io.BytesIO(b"jp%d" % n))
    return buf.getvalue()


FLOWERS = {"jpg/image_00001.jpg": b"jp1", "jpg/image_00002.jpg": b"jp2"}


@pytest.fixture
def flowers(site):
    """The MNIST site plus a flowers data set that is unpacked after seeding, as the real manifest has it."""
    server, _, manifest, tmp = site
    blobs = {"102flowers.tgz": _flowers_tgz(), "imagelabels.mat": b"labels", "setid.mat": b"setid"}
    for name, data in blobs.items():
        (tmp / "srv" / "flowers").mkdir(exist_ok=True)
        (tmp / "srv" / "flowers" / name).write_bytes(data)
    files = ",\n".join(f'  {{ url = "{server.url}/flowers/{n}", md5 = "{hashlib.md5(b).hexdigest()}" }}'
                       for n, b in blobs.items())
    manifest.write_text(manifest.read_text() + f'\n[datasets.flowers]\nmodule = "flowers"\n'
                        f'unpack = [{{ file = "102flowers.tgz", into = "102flowers", marker = "jpg" }}]\n'
                        f'files = [\n{files}\n]\n')
    yield server, ds.load(manifest), manifest, tmp


def _unpacked(cache):
    folder = cache / "flowers" / "102flowers"
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_giving_up_keeps_the_part_and_a_rerun_resumes_it(site):
    server, known, _, tmp = site
    name = "mnist/train-images-idx3-ubyte.gz"
    server.break_after[name] = 50_000   # the connection breaks mid-body every time
    dest = tmp / "cache"
    with pytest.raises(UserError, match="giving up .* after 3 attempts: connection broken"):
        ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None, retries=2, backoff=0.01)
    part = dest / (name + ".part")
    kept = part.stat().st_size
    assert kept == server.bytes_sent[name] == 150_000
    assert part.read_bytes() == (tmp / "srv" / name).read_bytes()[:kept]
    server.break_after.clear()
    rows = ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None)
    assert (f"/{name}", f"bytes={kept}-") in server.requests
    assert rows[0]["status"] == "resumed" and all(r["status"] == "ok" for r in ds.check(known.values(), dest))


def test_restore_refuses_a_file_that_is_not_in_the_manifest(site):
    _, known, _, tmp = site
    ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None)
    files = {f.relpath: (tmp / "cache" / f.relpath).read_bytes() for f in known["mnist"].files}
    archive = _pack(tmp / "extra.tar", {**files, "mnist/extra.bin": b"not paddle's"})   # its own checksums match
    dest = tmp / "dest"
    dest.mkdir()
    (dest / "keep.txt").write_bytes(b"mine")
    with pytest.raises(UserError, match=r"member 'dataset/mnist/extra.bin' is no data set's file in the manifest"):
        ds.restore(archive, dest, known)
    assert _tree(dest) == {"keep.txt": b"mine"}


def test_restore_refuses_an_unpacked_folder_in_the_pack(flowers):
    _, known, _, tmp = flowers
    cache = tmp / "cache"
    ds.seed(ds.select(known, "flowers"), cache, log=lambda m: None)
    files = {f.relpath: (cache / f.relpath).read_bytes() for f in known["flowers"].files}
    evil = {"flowers/102flowers/jpg/image_00001.jpg": b"evil"}   # the marker is there: unpacking was skipped
    with pytest.raises(UserError, match=r"'dataset/flowers/102flowers/jpg/image_00001.jpg' is no data set's file"):
        ds.restore(_pack(tmp / "evil.tar", {**files, **evil}), tmp / "dest", known)
    assert not (tmp / "dest").exists()


def test_restore_unpacks_afresh_from_the_verified_archive(flowers):
    _, known, _, tmp = flowers
    cache = tmp / "cache"
    ds.seed(ds.select(known, "mnist,flowers"), cache, log=lambda m: None)
    assert _unpacked(cache) == FLOWERS
    archive = ds.pack(ds.select(known, "mnist,flowers"), cache, tmp / "all.tgz")
    with tarfile.open(archive) as tar:   # what a pack holds: its index and the manifest's files, nothing unpacked
        assert sorted(tar.getnames()) == sorted([ds.PACK_INDEX] + [f"dataset/{f.relpath}" for d in known.values()
                                                                    for f in d.files])
    dest = tmp / "dest"
    stale = dest / "flowers" / "102flowers" / "jpg"
    stale.mkdir(parents=True)
    (stale / "image_00001.jpg").write_bytes(b"old")
    (stale / "planted.jpg").write_bytes(b"planted")
    rows = ds.restore(archive, dest, known, log=lambda m: None)
    assert len(rows) == 7 and _unpacked(dest) == FLOWERS
    assert [p.name for p in (dest / "flowers").iterdir() if p.name.startswith(".")] == []
    assert all(r["status"] == "ok" for r in ds.check(known.values(), dest))


def test_a_pack_holds_the_contents_of_linked_files(site):
    _, known, _, tmp = site
    ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None)
    linked = tmp / "linked" / "mnist"
    linked.mkdir(parents=True)
    for f in known["mnist"].files:
        (tmp / "linked" / f.relpath).symlink_to(tmp / "cache" / f.relpath)
    archive = ds.pack(ds.select(known, "mnist"), tmp / "linked", tmp / "linked.tar")
    with tarfile.open(archive) as tar:
        assert all(m.isfile() for m in tar.getmembers())
    ds.restore(archive, tmp / "dest", known)
    for f in known["mnist"].files:
        p = tmp / "dest" / f.relpath
        assert not p.is_symlink() and p.read_bytes() == (tmp / "cache" / f.relpath).read_bytes()


def test_packing_an_empty_cache_is_refused_and_writes_nothing(site):
    _, known, manifest, tmp = site
    (tmp / "empty").mkdir()
    for dest in (tmp / "empty", tmp / "absent"):
        with pytest.raises(UserError, match=f"nothing to pack: no data set is seeded in {dest}"):
            ds.cache_command(pack_to=str(tmp / "p.tar"), dest=str(dest), manifest=manifest, log=lambda m: None)
    assert not list(tmp.glob("p.tar*")) and not (tmp / "absent").exists() and _tree(tmp / "empty") == {}


def test_ctrl_c_while_packing_leaves_no_part(site, monkeypatch):
    server, known, manifest, tmp = site
    ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None)
    import tarfile

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(tarfile.TarFile, "add", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ds.pack(ds.select(known, "mnist"), tmp / "cache", tmp / "p.tar")
    assert not list(tmp.glob("p.tar*"))


def test_seeding_again_makes_an_older_private_cache_readable(site):
    _, known, _, tmp = site
    dest = tmp / "cache"
    ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None)
    files = [p for p in dest.rglob("*") if p.is_file()]
    for p in files:
        p.chmod(0o600)          # as an older fleetbox (or a private umask) left them
    ds.seed(ds.select(known, "mnist"), dest, log=lambda m: None)
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o644"}


@pytest.fixture
def private_umask():
    old = os.umask(0o077)   # as on a hardened host: files 0600, folders 0700 unless made otherwise
    yield
    os.umask(old)


def test_seeded_and_restored_caches_are_readable_by_all(flowers, private_umask):
    _, known, _, tmp = flowers
    chosen = ds.select(known, "mnist,flowers")
    ds.seed(chosen, tmp / "cache", log=lambda m: None)
    archive = ds.pack(chosen, tmp / "cache", tmp / "all.tar")
    ds.restore(archive, tmp / "dest", known, log=lambda m: None)
    for cache in (tmp / "cache", tmp / "dest"):
        modes = _modes(cache)
        assert len(modes) == 14   # the cache, mnist/ + 4 files, flowers/ + 3 files, 102flowers/, jpg/, 2 images
        assert {p: m for p, m in modes.items() if m != (0o755 if (cache / p).is_dir() else 0o644)} == {}


@pytest.mark.parametrize("op", ["seed", "restore", "verify", "pack"])
def test_a_dest_that_is_a_file_is_one_line_and_left_alone(site, op):
    _, known, _, tmp = site
    ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None)
    archive = ds.pack(ds.select(known, "mnist"), tmp / "cache", tmp / "a.tar")
    (tmp / "afile").write_bytes(b"mine")
    run = {"seed": lambda d: ds.seed(ds.select(known, "mnist"), d, log=lambda m: None),
           "restore": lambda d: ds.restore(archive, d, known),
           "verify": lambda d: ds.check(ds.select(known, "mnist"), d),
           "pack": lambda d: ds.pack(ds.select(known, "mnist"), d, tmp / "b.tar")}[op]
    for dest, needle in [(tmp / "afile", "exists and is not a folder"),
                         (tmp / "afile" / "sub", f"cannot be made: {tmp / 'afile'} is not a folder")]:
        with pytest.raises(UserError, match=needle):
            run(dest)
    assert (tmp / "afile").read_bytes() == b"mine" and not list(tmp.glob("b.tar*"))


def _bad_packs(tmp, files):
    good = _pack(tmp / "good.tar", files).read_bytes()
    good_gz = _pack(tmp / "good.tgz", files, gz=True).read_bytes()
    mid = len(good_gz) // 2
    return {
        "truncated": good[:len(good) * 6 // 10],
        "truncated-gz": good_gz[:mid],
        "index-not-json": _pack(tmp / "x.tar", files, index=b"{not json").read_bytes(),
        "index-a-list": _pack(tmp / "x.tar", files, index=[]).read_bytes(),
        "index-files-a-list": _pack(tmp / "x.tar", files, index={"files": []}).read_bytes(),
        "index-entry-a-string": _pack(tmp / "x.tar", files, index={"files": {r: "abc" for r in files}}).read_bytes(),
        "random-bytes": random.Random(1).randbytes(100_000),
        # zeros across more than a deflate block (<= 64 KiB): a block header breaks, not only content
        "gzip-corrupt-midway": good_gz[:mid] + bytes(70_000) + good_gz[mid + 70_000:],
        # a member larger than its index says (a bomb's way): refused before it is written
        "bigger-than-its-index": _pack(tmp / "x.tar", files, index={"format": 1, "files": {
            r: {"md5": hashlib.md5(b).hexdigest(), "bytes": len(b) - 1, "sha256": hashlib.sha256(b).hexdigest()}
            for r, b in files.items()}}).read_bytes(),
        "index-without-sizes": _pack(tmp / "x.tar", files, index={"format": 1, "files": {
            r: {"md5": hashlib.md5(b).hexdigest(), "sha256": hashlib.sha256(b).hexdigest()}
            for r, b in files.items()}}).read_bytes(),
    }


@pytest.mark.parametrize("kind", ["truncated", "truncated-gz", "index-not-json", "index-a-list", "index-files-a-list",
                                  "index-entry-a-string", "random-bytes", "gzip-corrupt-midway",
                                  "bigger-than-its-index", "index-without-sizes"])
def test_a_bad_pack_is_one_line_and_dest_is_unchanged(site, kind):
    _, known, _, tmp = site
    ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None)
    files = {f.relpath: (tmp / "cache" / f.relpath).read_bytes() for f in known["mnist"].files}
    archive = tmp / "bad.pack"
    archive.write_bytes(_bad_packs(tmp, files)[kind])
    dest = tmp / "dest"
    (dest / "mnist").mkdir(parents=True)
    (dest / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(b"older")
    before = _tree(dest)
    for target in (dest, tmp / "new" / "cache"):
        with pytest.raises(UserError) as e:
            ds.restore(archive, target, known)
        assert "\n" not in str(e.value) and "None" not in str(e.value) and archive.name in str(e.value)
    assert _tree(dest) == before and not (tmp / "new").exists()


def test_a_gzip_bomb_pack_is_refused_before_anything_is_written(site, monkeypatch):
    """A gzipped pack of a few KiB whose member unpacks to 64 MiB, with an index and MD5 that agree with the
    manifest (both are public): refused before a byte is written."""
    _, known, _, tmp = site
    f = known["mnist"].files[0]
    zeros = bytes(64 << 20)
    index = {"format": 1, "files": {f.relpath: {"md5": f.md5, "bytes": len(zeros), "sha256": "0" * 64}}}
    archive = _pack(tmp / "bomb.tgz", {f.relpath: zeros}, index=index, gz=True)
    assert archive.stat().st_size < 100_000
    written = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, mode="r", *a, **kw: (
        written.append(str(p)) if "w" in mode else None, real_open(p, mode, *a, **kw))[1])
    with pytest.raises(UserError, match=r"refusing archive: bomb.tgz \(\d+ bytes\) would unpack to 6710\d{4} bytes"):
        ds.restore(archive, tmp / "dest", known)
    assert written == [] and not list((tmp / "dest").rglob("*.gz"))


@pytest.mark.parametrize("pad", [64 << 20, 2 << 20])
def test_a_packs_index_is_bounded_before_it_is_read(site, pad):
    """A gzipped pack of a few KiB whose index unpacks to 64 MiB (a bomb: refused on the pack's size), or to 2 MiB
    (within the pack's bound, not an index's): refused with no more than a little memory taken."""
    import tracemalloc
    _, known, _, tmp = site
    f = known["mnist"].files[0]
    body = json.dumps({"format": 1, "files": {f.relpath: {"md5": f.md5, "bytes": 1, "sha256": "0" * 64}}})
    archive = _pack(tmp / "index.tgz", {f.relpath: b"x"}, index=b" " * pad + body.encode(), gz=True)
    assert archive.stat().st_size < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"refusing archive: (index.tgz \(\d+ bytes\) would unpack to|its "
                                            r"fleetbox-cache.json is \d+ bytes)"):
            ds.restore(archive, tmp / "dest", known)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_folder_mirror_with_hash_and_question_mark_in_its_name(site):
    _, known, _, tmp = site
    mirror = tmp / "mirror#1?x"
    shutil.copytree(tmp / "srv", mirror)
    rows = ds.seed(ds.select(known, "mnist"), tmp / "cache", mirror=str(mirror), log=lambda m: None)
    assert [r["status"] for r in rows] == ["downloaded"] * 4
    assert all(r["status"] == "ok" for r in ds.check(known.values(), tmp / "cache"))


@pytest.mark.parametrize("mirror,needle", [
    ("http://", "mirror http:// is not a valid URL (no host)"),
    ("http://[::1", "mirror http://[::1 is not a valid URL (Invalid IPv6 URL)"),
    ("http://127.0.0.1:abc/", "mirror http://127.0.0.1:abc/ is not a valid URL (Port could not be cast"),
    ("ftp://x", "mirror ftp://x: a mirror is an http(s) URL or a folder, not ftp://"),
])
def test_a_malformed_mirror_is_one_line_naming_it(site, mirror, needle):
    server, known, _, tmp = site
    with pytest.raises(UserError) as e:
        ds.seed(ds.select(known, "mnist"), tmp / "cache", mirror=mirror, log=lambda m: None)
    assert str(e.value).startswith(needle) and "\n" not in str(e.value)
    assert server.requests == [] and not (tmp / "cache").exists()


def test_a_redirect_loop_is_one_line_naming_the_url(site):
    server, known, _, tmp = site
    name = "mnist/t10k-images-idx3-ubyte.gz"
    server.redirects[name] = "/" + name
    with pytest.raises(UserError) as e:
        ds.seed(ds.select(known, "mnist"), tmp / "cache", log=lambda m: None, backoff=0.01)
    assert str(e.value) == f"cannot download {server.url}/{name}: redirect loop (more than 30 redirects)"
    assert sum(p == "/" + name for p, _ in server.requests) == 31   # followed once, not retried


@pytest.mark.parametrize("entry,said", [
    ('module = "../x"\nfiles = [{ url = "http://h/a.gz", md5 = "' + "0" * 32 + '" }]', "module '../x' is not a single"),
    ('module = "m/n"\nfiles = [{ url = "http://h/a.gz", md5 = "' + "0" * 32 + '" }]', "module 'm/n' is not a single"),
    ('module = "m"\nfiles = [{ url = "http://h/..", md5 = "' + "0" * 32 + '" }]',
     "url 'http://h/..' does not end in a file name"),
    ('module = "m"\nfiles = [{ url = "http://h/a.gz", md5 = "../x" }]', "md5 '../x' is not 32 hex digits"),
    ('module = "m"\nfiles = [{ url = "http://h/a.gz" }]', "data set 'evil' lacks 'md5'"),
    ('module = "m"\nfiles = [{ url = "http://h/a.tgz", md5 = "' + "0" * 32 + '" }]\n'
     'unpack = [{ file = "a.tgz", into = "../../etc" }]', "unpack into '../../etc' is not a single"),
    ('module = "m"\nfiles = [{ url = "http://h/a.tgz", md5 = "' + "0" * 32 + '" }]\n'
     'unpack = [{ file = "a.tgz", into = "x", marker = "/etc/passwd" }]', "unpack marker '/etc/passwd'"),
])
def test_a_manifest_whose_names_would_leave_the_cache_is_refused_in_one_line(tmp_path, entry, said):
    """Each name becomes a path under <cache>/<module>/: `module = "../x"` downloaded outside the cache."""
    manifest = tmp_path / "datasets.toml"
    manifest.write_text(f"[datasets.evil]\n{entry}\n")
    with pytest.raises(UserError, match=re.escape(said)) as e:
        ds.load(manifest)
    assert "\n" not in str(e.value) and str(manifest) in str(e.value)


def test_a_sparse_member_of_a_pack_is_refused_before_anything_is_written(tmp_path):
    from tests.unit.test_kit import sparse_tar
    pack = sparse_tar(tmp_path, tmp_path / "pack.tar")
    (tmp_path / "out").mkdir()
    with tarfile.open(pack) as tar, pytest.raises(UserError, match="member 'big' is a sparse file"):
        archives.safe_extract(tar, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []
