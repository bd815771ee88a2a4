"""Verified downloads: stream, hash in the same pass, resume with HTTP Range, retry, then rename.

A file only ever appears under its final name after its digest matched; partial data lives in
`<name>.part` so an interrupted run resumes instead of starting over.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import queue
import re
import socket
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import requests
import urllib3
from tqdm import tqdm

from fleetbox.errors import UserError

CHUNK = 1 << 18   # one read: large enough that per-read overhead vanishes, small enough to stay in L2 for MD5
BUFFERS = 16      # in flight between the reader and the hashing thread
URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")   # scheme://...; anything else is a local path



def shown(url: str) -> str:
    """A URL as messages and logs may show it: user info (`user:secret@`) masked, up to the last `@`."""
    return re.sub(r"^([A-Za-z][\w+.-]*://)[^/]*(?:/.*)?@", r"\1***@", url) if "@" in url else url

def file_digest(path: Path, algo: str = "sha256") -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algo).hexdigest()


def session() -> requests.Session:
    s = requests.Session()
    s.headers["User-Agent"] = "fleetbox"
    # The bytes as stored: what the digest is over, and what Range offsets count (no on-the-fly gzip).
    s.headers["Accept-Encoding"] = "identity"
    return s


class _Broken(Exception):
    """The connection failed mid-body: retry, resuming from what is on disk."""


class Stopped(Exception):
    """The caller asked to stop (Ctrl-C during a parallel seed): the `.part` is kept, to resume later."""


class Stop:
    """Tells downloads running in other threads to stop. Each checks it after every read; and its
    connection is shut down, so a read blocked on a stalled server ends at once instead of at the timeout."""

    def __init__(self):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._fds: set[int] = set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def set(self) -> None:
        with self._lock:
            self._event.set()
            for fd in self._fds:
                _shutdown(fd)

    @contextmanager
    def watching(self, fd: int):
        """While inside, `set()` also shuts down socket `fd`."""
        with self._lock:
            if self._event.is_set():
                raise Stopped()
            self._fds.add(fd)
        try:
            yield
        finally:
            with self._lock:
                self._fds.discard(fd)


def _shutdown(fd: int) -> None:
    """Shut down the socket behind `fd` (through a duplicate: the owner closes `fd` itself)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _pump(readinto, fd: int, h, bar, stop: Stop) -> int:
    """Copy from `readinto` to `fd` through reused buffers, hashing in a second thread.

    MD5 is the costliest step (one core hashes ~730 MB/s here), so it overlaps the next read and
    write: hashlib releases the GIL on large buffers. Reused buffers avoid allocating (and
    page-faulting) a fresh buffer per read. Every byte written is hashed, also when a read fails,
    so a later resume starts from a `.part` whose digest state is exact. Returns the bytes copied."""
    free: queue.SimpleQueue = queue.SimpleQueue()
    full: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(BUFFERS):
        free.put(memoryview(bytearray(CHUNK)))

    def hash_loop():
        while (item := full.get()) is not None:
            buf, n = item
            h.update(buf[:n])
            free.put(buf)

    t = threading.Thread(target=hash_loop, daemon=True)
    t.start()
    copied = 0
    try:
        while n := readinto(buf := free.get()):
            done = 0
            while done < n:
                done += os.write(fd, buf[done:n])
            full.put((buf, n))
            copied += n
            bar.update(n)
            if stop.is_set():
                raise Stopped()
        if stop.is_set():   # the read was cut short by stop
            raise Stopped()
    finally:
        full.put(None)
        t.join()
    return copied


def _bar(name: str, total: int | None, initial: int):
    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=name,
                leave=True, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
                disable=None)  # None: no bar when stderr is not a terminal


def _copy_local(src: Path, part: Path, h, stop: Stop) -> None:
    if not src.is_file():
        raise UserError(f"not found in mirror folder: {src}")
    with open(src, "rb", buffering=0) as fi, open(part, "wb", buffering=0) as fo, \
            _bar(part.name.removesuffix(".part"), src.stat().st_size, 0) as bar:
        _pump(fi.readinto, fo.fileno(), h, bar, stop)


def _body_reader(r: requests.Response):
    """(`readinto` for the raw body, its socket's fd or -1). http.client's own response fills our buffer
    in one call; urllib3's readinto would read into a new bytes object and copy it. Read errors become
    `_Broken`."""
    raw = r.raw
    body = getattr(raw, "_fp", None)
    if isinstance(body, http.client.HTTPResponse):
        fd = body.fileno()
    else:   # some other transport adapter: its own readinto
        raw.decode_content = False
        body, fd = raw, -1

    def readinto(b):
        try:
            return body.readinto(b)
        except (OSError, http.client.HTTPException, urllib3.exceptions.HTTPError) as e:
            raise _Broken(type(e).__name__) from None
    return readinto, fd


def _stream(sess: requests.Session, url: str, part: Path, h, timeout: float, stop: Stop) -> None:
    """Append to `part` from where it stops (Range), feeding every byte on disk through `h`."""
    have = part.stat().st_size if part.exists() else 0
    if have:
        with open(part, "rb") as f:
            while chunk := f.read(CHUNK):
                h.update(chunk)
    headers = {"Range": f"bytes={have}-"} if have else {}
    with sess.get(url, stream=True, timeout=timeout, headers=headers) as r:
        if r.status_code == 416:          # we already hold every byte
            return
        if r.status_code == 404:
            raise UserError(f"not found (HTTP 404): {shown(url)}")
        r.raise_for_status()
        if have and r.status_code != 206:  # server ignored Range: start over
            raise _Restart()
        expected = int(r.headers.get("Content-Length") or 0)
        readinto, fd = _body_reader(r)
        with open(part, "ab" if have else "wb", buffering=0) as f, \
                _bar(part.name.removesuffix(".part"), expected + have or None, have) as bar, \
                stop.watching(fd):
            got = _pump(readinto, f.fileno(), h, bar, stop)
        if expected and got < expected:   # a cut connection can look like a clean end of the body
            raise _Broken(f"connection closed after {got} of {expected} bytes")


class _Restart(Exception):
    """The server does not honour Range: drop the partial file and fetch from the start."""


def _local_file(src: str) -> Path | None:
    """The file a local source names: a path, taken as is (so '#' and '?' stay part of a folder's name), or
    a file:// URL. None for any other URL."""
    if src.lower().startswith("file://"):
        return Path(url2pathname(urlsplit(src).path))
    return None if URL.match(src) else Path(src)


def download(url: str, dest: Path, digest: str, algo: str = "sha256", *, sess: requests.Session | None = None,
             retries: int = 4, backoff: float = 1.0, timeout: float = 60,
             stop: Stop | None = None) -> Path:
    """Fetch `url` (http(s) URL or local path) to `dest`, verifying `digest`; the file is made 0644, readable
    by the non-root users of containers that mount it. Returns `dest`.
    After transient failures (connection, timeout, 5xx) the `.part` is kept, so a later run resumes; it is
    deleted only when its bytes are wrong (digest mismatch) or the server refused the file (4xx but 408/429).
    A local error (a full disk) deletes it as well, giving the space back.
    Setting `stop` (from another thread) ends the download with `Stopped`, keeping what is on disk."""
    if dest.exists() and file_digest(dest, algo) == digest:
        return dest
    local = _local_file(url)
    if local is None and URL.match(url)[1].lower() not in ("http", "https"):
        raise UserError(f"cannot download {shown(url)}: not an http(s) URL or a local path")
    sess = sess or session()
    stop = stop or Stop()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot make folder {dest.parent}: {e.strerror}") from None
    part = dest.with_name(dest.name + ".part")
    last = "no attempt"
    for attempt in range(retries + 1):
        h = hashlib.new(algo)
        try:
            if local:
                _copy_local(local, part, h, stop)
            else:
                _stream(sess, url, part, h, timeout, stop)
        except UserError:
            part.unlink(missing_ok=True)
            raise
        except _Restart:
            part.unlink(missing_ok=True)
            last = "server ignored Range"
            continue
        except (requests.ConnectionError, requests.Timeout) as e:
            last = type(e).__name__
        except _Broken as e:
            if stop.is_set():   # broken by stop itself
                raise Stopped() from None
            last = f"connection broken ({e})"
        except requests.HTTPError as e:
            last = f"HTTP {e.response.status_code}"
            if e.response.status_code < 500 and e.response.status_code not in (408, 429):   # not "try later"
                part.unlink(missing_ok=True)
                raise UserError(f"download failed ({last}): {shown(url)}") from None
        except requests.TooManyRedirects:
            loop = f"redirect loop (more than {sess.max_redirects} redirects)"
            raise UserError(f"cannot download {shown(url)}: {loop}") from None
        except requests.RequestException as e:   # a malformed URL and the like: another try cannot help
            raise UserError(f"cannot download {shown(url)}: {' '.join(str(e).split())}") from None
        except OSError as e:
            part.unlink(missing_ok=True)
            raise UserError(f"cannot download {shown(url)} to {part}: {e.strerror}") from None
        else:
            if h.hexdigest() == digest:
                part.chmod(0o644)
                part.replace(dest)
                return dest
            last = f"{algo} mismatch (got {h.hexdigest()[:16]}…, want {digest[:16]}…)"
            part.unlink(missing_ok=True)   # corrupt bytes cannot be resumed
        if attempt < retries and stop.wait(backoff * 2 ** attempt):
            raise Stopped()
    kept = f"; {part} keeps the bytes received, to resume from next time" if part.exists() else ""
    raise UserError(f"giving up on {shown(url)} after {retries + 1} attempts: {last}{kept}")
