import gzip
import hashlib
import os
import stat
import threading
import time

import pytest

from fleetbox.data import fetch
from fleetbox.errors import UserError
from tests.httpserver import Server

DATA = bytes(range(256)) * 4096   # 1 MiB


@pytest.fixture
def server(tmp_path):
    (tmp_path / "srv").mkdir()
    (tmp_path / "srv" / "blob.bin").write_bytes(DATA)
    with Server(tmp_path / "srv") as s:
        yield s


def test_fresh_download_verifies_and_renames(server, tmp_path):
    dest = tmp_path / "out" / "blob.bin"
    fetch.download(f"{server.url}/blob.bin", dest, hashlib.sha256(DATA).hexdigest())
    assert dest.read_bytes() == DATA and not dest.with_name("blob.bin.part").exists()


def test_resume_after_cut_fetches_only_the_rest(server, tmp_path):
    server.cut_after["blob.bin"] = 300_000
    dest = tmp_path / "blob.bin"
    fetch.download(f"{server.url}/blob.bin", dest, hashlib.sha256(DATA).hexdigest(), backoff=0.01)
    assert dest.read_bytes() == DATA
    ranges = [r for p, r in server.requests if p == "/blob.bin"]
    assert len(ranges) == 2 and ranges[0] == ""
    on_disk = int(ranges[1].removeprefix("bytes=").rstrip("-"))   # what the .part held when it resumed
    assert 0 < on_disk <= 300_000   # what arrived before the cut (whole chunks, or all of it with urllib3 1.x)
    # the second request fetched exactly the bytes not on disk: nothing already written came again
    assert server.bytes_sent["blob.bin"] == 300_000 + (len(DATA) - on_disk)


def test_corrupt_content_retries_then_fails_leaving_nothing(server, tmp_path):
    server.corrupt.add("blob.bin")
    dest = tmp_path / "blob.bin"
    with pytest.raises(UserError, match=r"giving up on .*blob.bin after 3 attempts: sha256 mismatch"):
        fetch.download(f"{server.url}/blob.bin", dest, hashlib.sha256(DATA).hexdigest(), retries=2, backoff=0.01)
    assert len([p for p, _ in server.requests if p == "/blob.bin"]) == 3
    assert list(tmp_path.glob("blob.bin*")) == []


def test_404_is_one_clear_error(server, tmp_path):
    with pytest.raises(UserError, match="HTTP 404"):
        fetch.download(f"{server.url}/nope.bin", tmp_path / "nope.bin", "0" * 64)
    assert not (tmp_path / "nope.bin").exists()


def test_unreachable_server_gives_up_with_the_reason(tmp_path):
    with pytest.raises(UserError, match="ConnectionError"):
        fetch.download("http://127.0.0.1:9/x", tmp_path / "x", "0" * 64, retries=1, backoff=0.01)


def test_stored_bytes_are_kept_even_when_the_server_says_gzip(server, tmp_path):
    # Apache's `AddEncoding x-gzip .gz` labels a .gz file gzip-encoded; the digest is over the stored bytes.
    stored = gzip.compress(DATA)
    (server.root / "idx.gz").write_bytes(stored)
    server.extra_headers["idx.gz"] = {"Content-Encoding": "gzip"}
    dest = tmp_path / "idx.gz"
    fetch.download(f"{server.url}/idx.gz", dest, hashlib.md5(stored).hexdigest(), "md5")
    assert dest.read_bytes() == stored
    assert server.headers_seen[-1]["Accept-Encoding"] == "identity"   # and no on-the-fly compression asked for


def test_stop_ends_a_read_blocked_on_a_stalled_server_at_once(server, tmp_path):
    server.hold_for = 99   # headers, then the body stalls (for 10 s)
    dest, stop = tmp_path / "blob.bin", fetch.Stop()
    threading.Timer(0.5, stop.set).start()
    t = time.monotonic()
    with pytest.raises(fetch.Stopped):
        fetch.download(f"{server.url}/blob.bin", dest, hashlib.sha256(DATA).hexdigest(), stop=stop)
    assert time.monotonic() - t < 3 and not dest.exists()   # not after the stall, nor the 60 s read timeout
    server.hold_for = 0
    fetch.download(f"{server.url}/blob.bin", dest, hashlib.sha256(DATA).hexdigest())
    assert dest.read_bytes() == DATA


def test_a_chunked_body_without_length(server, tmp_path):
    big = DATA * 2 + b"tail"
    (server.root / "dyn.bin").write_bytes(big)
    server.chunked.add("dyn.bin")
    dest = tmp_path / "dyn.bin"
    fetch.download(f"{server.url}/dyn.bin", dest, hashlib.sha256(big).hexdigest())
    assert dest.read_bytes() == big


def test_a_connection_that_keeps_breaking_keeps_the_part_to_resume(server, tmp_path):
    server.break_after["blob.bin"] = 100_000   # every body is cut after 100 kB
    dest = tmp_path / "blob.bin"
    part = tmp_path / "blob.bin.part"
    digest = hashlib.sha256(DATA).hexdigest()
    with pytest.raises(UserError, match="giving up .* after 3 attempts: connection broken"):
        fetch.download(f"{server.url}/blob.bin", dest, digest, retries=2, backoff=0.01)
    kept = part.stat().st_size
    assert kept == server.bytes_sent["blob.bin"] == 300_000 and part.read_bytes() == DATA[:kept]
    assert not dest.exists()
    server.break_after.clear()
    fetch.download(f"{server.url}/blob.bin", dest, digest)
    assert server.requests[-1] == ("/blob.bin", f"bytes={kept}-") and dest.read_bytes() == DATA
    assert not part.exists()


def test_5xx_and_an_unreachable_server_keep_the_part_404_and_a_mismatch_remove_it(server, tmp_path):
    dest, part = tmp_path / "blob.bin", tmp_path / "blob.bin.part"
    digest = hashlib.sha256(DATA).hexdigest()
    part.write_bytes(DATA[:200_000])
    server.status["blob.bin"] = 503
    with pytest.raises(UserError, match="after 2 attempts: HTTP 503"):
        fetch.download(f"{server.url}/blob.bin", dest, digest, retries=1, backoff=0.01)
    assert part.read_bytes() == DATA[:200_000]
    for later in (408, 429):   # "try again later", not a refusal
        server.status["blob.bin"] = later
        with pytest.raises(UserError, match=f"after 1 attempts: HTTP {later}"):
            fetch.download(f"{server.url}/blob.bin", dest, digest, retries=0)
        assert part.read_bytes() == DATA[:200_000]
    with pytest.raises(UserError, match="ConnectionError"):
        fetch.download("http://127.0.0.1:9/blob.bin", dest, digest, retries=0)
    assert part.read_bytes() == DATA[:200_000]
    server.status["blob.bin"] = 404
    with pytest.raises(UserError, match="HTTP 404"):
        fetch.download(f"{server.url}/blob.bin", dest, digest, retries=1, backoff=0.01)
    assert not part.exists()
    del server.status["blob.bin"]
    part.write_bytes(b"x" * 200_000)   # wrong bytes: the rest arrives, the digest cannot match
    with pytest.raises(UserError, match="sha256 mismatch"):
        fetch.download(f"{server.url}/blob.bin", dest, digest, retries=0)
    assert server.requests[-1] == ("/blob.bin", "bytes=200000-")
    assert not part.exists() and not dest.exists()


def test_a_redirect_loop_is_one_clear_line(server, tmp_path):
    server.redirects["loop.bin"] = "/loop.bin"
    url = f"{server.url}/loop.bin"
    with pytest.raises(UserError) as e:
        fetch.download(url, tmp_path / "loop.bin", "0" * 64, backoff=0.01)
    assert str(e.value) == f"cannot download {url}: redirect loop (more than 30 redirects)"
    assert len(server.requests) == 31 and list(tmp_path.iterdir()) == [tmp_path / "srv"]   # one try, no file


@pytest.mark.parametrize("url,problem", [
    ("http://", "Invalid URL 'http://': No host supplied"),
    ("http://[::1/blob.bin", "Failed to parse: http://[::1/blob.bin"),
    ("http://127.0.0.1:abc/blob.bin", "Failed to parse: http://127.0.0.1:abc/blob.bin"),
    ("ftp://example.org/blob.bin", "not an http(s) URL or a local path"),
])
def test_a_malformed_url_is_one_clear_line(tmp_path, url, problem):
    with pytest.raises(UserError) as e:
        fetch.download(url, tmp_path / "out" / "blob.bin", "0" * 64, backoff=0.01)
    assert str(e.value) == f"cannot download {url}: {problem}"
    assert not list(tmp_path.rglob("blob.bin*"))


def test_a_local_path_with_hash_and_question_mark_is_a_path(tmp_path):
    src = tmp_path / "a#b?c" / "blob.bin"
    src.parent.mkdir()
    src.write_bytes(DATA)
    dest = tmp_path / "blob.bin"
    fetch.download(str(src), dest, hashlib.sha256(DATA).hexdigest())
    assert dest.read_bytes() == DATA


def test_a_download_is_readable_by_all_whatever_the_umask(server, tmp_path):
    old = os.umask(0o077)
    try:
        fetch.download(f"{server.url}/blob.bin", tmp_path / "blob.bin", hashlib.sha256(DATA).hexdigest())
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "blob.bin").stat().st_mode) == 0o644


@pytest.mark.parametrize("url,want", [
    ("http://user:secret@host/debian", "http://***@host/debian"),
    ("http://user:se/cret@host/debian", "http://***@host/debian"),   # a '/' in the password
    ("https://u:p@ss@h:8080/x", "https://***@h:8080/x"),
    ("http://host/plain", "http://host/plain"),
    ("/srv/mirror@2", "/srv/mirror@2"),                               # a folder, not a URL
])
def test_urls_are_shown_without_credentials(url, want):
    assert fetch.shown(url) == want


def test_a_data_set_mirror_never_shows_its_credentials(tmp_path):
    from fleetbox.data import datasets as ds
    with pytest.raises(UserError) as e:
        ds.cache_command(datasets="mnist", mirror="http://user:secret@127.0.0.1:9/", dest=str(tmp_path / "c"),
                         log=lambda m: None)
    assert "secret" not in str(e.value) and "***@127.0.0.1:9" in str(e.value)
