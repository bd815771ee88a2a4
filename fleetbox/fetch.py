"""Verified downloads: stream, hash in the same pass, resume with HTTP Range, retry, then rename.

A file only ever appears under its final name after its digest matched; partial data lives in
`<name>.part` so an interrupted run resumes instead of starting over.
"""

from __future__ import annotations

import hashlib
import queue
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import requests
from tqdm import tqdm

from .errors import UserError

CHUNK = 1 << 20        # reading local files
NET_CHUNK = 1 << 16    # network reads: small, so a cut connection loses little


def file_digest(path: Path, algo: str = "sha256") -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algo).hexdigest()


def session() -> requests.Session:
    s = requests.Session()
    s.headers["User-Agent"] = "fleetbox"
    return s


class _Hasher:
    """Hash in a second thread, overlapped with the network read: hashlib releases the GIL on large
    buffers, so download and MD5/SHA run on two cores instead of one after the other."""

    def __init__(self, h):
        self.h = h
        self.q: queue.Queue = queue.Queue(maxsize=64)
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while (chunk := self.q.get()) is not None:
            self.h.update(chunk)

    def update(self, chunk: bytes) -> None:
        self.q.put(chunk)

    def close(self) -> None:
        self.q.put(None)
        self.t.join()


def _bar(name: str, total: int | None, initial: int):
    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=name,
                leave=True, file=sys.stderr, mininterval=0.5, dynamic_ncols=True,
                disable=None)  # None: no bar when stderr is not a terminal


def _copy_local(src: Path, part: Path, h) -> None:
    if not src.is_file():
        raise UserError(f"not found in mirror folder: {src}")
    with open(src, "rb") as fi, open(part, "wb") as fo:
        while chunk := fi.read(CHUNK):
            h.update(chunk)
            fo.write(chunk)


def _stream(sess: requests.Session, url: str, part: Path, h, timeout: float) -> None:
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
            raise UserError(f"not found (HTTP 404): {url}")
        r.raise_for_status()
        if have and r.status_code != 206:  # server ignored Range: start over
            raise _Restart()
        mode = "ab" if have else "wb"
        expected = int(r.headers.get("Content-Length", 0)) if "gzip" not in r.headers.get("Content-Encoding", "") else 0
        total = expected + have or None
        got = 0
        hasher = _Hasher(h)
        try:
            with open(part, mode) as f, _bar(part.name.removesuffix(".part"), total, have) as bar:
                for chunk in r.iter_content(NET_CHUNK):
                    f.write(chunk)
                    hasher.update(chunk)
                    bar.update(len(chunk))
                    got += len(chunk)
        finally:
            hasher.close()   # every byte written is hashed, also when the connection broke
        if expected and got < expected:   # urllib3 1.x does not raise on a short body: resume it ourselves
            raise requests.ConnectionError(f"connection closed after {got} of {expected} bytes")


class _Restart(Exception):
    """The server does not honour Range: drop the partial file and fetch from the start."""


def download(url: str, dest: Path, digest: str, algo: str = "sha256", *, sess: requests.Session | None = None,
             retries: int = 4, backoff: float = 1.0, timeout: float = 60) -> Path:
    """Fetch `url` (http(s) URL or local path) to `dest`, verifying `digest`. Returns `dest`."""
    if dest.exists() and file_digest(dest, algo) == digest:
        return dest
    sess = sess or session()
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    local = urlparse(url).scheme in ("", "file")
    last = "no attempt"
    for attempt in range(retries + 1):
        h = hashlib.new(algo)
        try:
            if local:
                _copy_local(Path(urlparse(url).path), part, h)
            else:
                _stream(sess, url, part, h, timeout)
        except UserError:
            part.unlink(missing_ok=True)
            raise
        except _Restart:
            part.unlink(missing_ok=True)
            last = "server ignored Range"
            continue
        except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as e:
            last = f"{type(e).__name__}"
        except requests.HTTPError as e:
            last = f"HTTP {e.response.status_code}"
            if e.response.status_code < 500 and e.response.status_code != 429:
                part.unlink(missing_ok=True)
                raise UserError(f"download failed ({last}): {url}") from None
        except OSError as e:
            part.unlink(missing_ok=True)
            raise UserError(f"cannot write {part}: {e.strerror}") from None
        else:
            if h.hexdigest() == digest:
                part.replace(dest)
                return dest
            last = f"{algo} mismatch (got {h.hexdigest()[:16]}…, want {digest[:16]}…)"
            part.unlink(missing_ok=True)   # corrupt bytes cannot be resumed
        if attempt < retries:
            time.sleep(backoff * 2 ** attempt)
    part.unlink(missing_ok=True)
    raise UserError(f"giving up on {url} after {retries + 1} attempts: {last}")
