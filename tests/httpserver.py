"""A real HTTP server on loopback for tests: serves a folder, honours Range, can misbehave on purpose."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Server:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.cut_after: dict[str, int] = {}     # path -> bytes to send before dropping the connection (once)
        self.break_after: dict[str, int] = {}   # path -> bytes of every body to send before dropping it
        self.status: dict[str, int] = {}        # path -> an error status to answer with instead
        self.redirects: dict[str, str] = {}     # path -> where a 302 sends the client
        self.corrupt: set[str] = set()          # paths always served with a flipped byte
        self.requests: list[tuple[str, str]] = []   # (path, Range header)
        self.bytes_sent: dict[str, int] = {}
        self.headers_seen: list[dict[str, str]] = []   # each GET's request headers
        self.extra_headers: dict[str, dict[str, str]] = {}   # path -> response headers to add
        self.chunked: set[str] = set()          # paths sent with Transfer-Encoding: chunked (no length)
        self.rate = 0            # bytes per second for each body (0: as fast as it goes)
        self.hold_for = 0        # hold each body until this many GETs are in flight (or 10 s passed)
        self.in_flight = 0
        self.max_in_flight = 0
        self._cond = threading.Condition()
        self._held = True
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self.do_GET(head=True)

            def do_GET(self, head=False):
                rel = self.path.split("?")[0].lstrip("/")
                server.requests.append((self.path, self.headers.get("Range", "")))
                server.headers_seen.append(dict(self.headers))
                if rel in server.status:
                    self.send_error(server.status[rel])
                    return
                if rel in server.redirects:
                    self.send_response(302)
                    self.send_header("Location", server.redirects[rel])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = server.root / rel
                if path.is_dir():
                    path = path / "index.html"
                if not path.is_file():
                    self.send_error(404)
                    return
                size = path.stat().st_size
                corrupt = "/" + rel in server.corrupt or rel in server.corrupt
                start, status = 0, 200
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    if start >= size:
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{size}")
                        self.end_headers()
                        return
                    status = 206
                self.send_response(status)
                if rel in server.chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(size - start))
                self.send_header("Content-Type", "text/html" if path.suffix == ".html" else "application/octet-stream")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                for k, v in server.extra_headers.get(rel, {}).items():
                    self.send_header(k, v)
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if head:
                    return
                with server._cond:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    if server.in_flight >= server.hold_for:
                        server._held = False   # released for good, also for those still waking up
                        server._cond.notify_all()
                    server._cond.wait_for(lambda: not server._held, timeout=10)
                try:
                    if rel in server.chunked:   # as a dynamic server would: 64 KiB chunks, then the last one
                        with open(path, "rb") as f:
                            f.seek(start)
                            while piece := f.read(1 << 16):
                                self.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    self._send_body(rel, path, size, start, corrupt)
                finally:
                    with server._cond:
                        server.in_flight -= 1

            def _send_body(self, rel, path, size, start, corrupt):
                cut = server.cut_after.pop(rel, server.break_after.get(rel))
                rate = server.rate   # read once: a test may set it back to 0 while this body is still being sent
                count = size - start if cut is None else min(cut, size - start)
                self.wfile.flush()
                with open(path, "rb") as f:   # from the file with sendfile, as nginx or Apache would
                    if corrupt and start == 0 and count:
                        self.connection.sendall(bytes([f.read(1)[0] ^ 0xFF]))
                        sent = 1 + self.connection.sendfile(f, 1, count - 1)
                    elif rate:   # a slow link: 64 KiB pieces, paced
                        sent, t0 = 0, time.monotonic()
                        while sent < count:
                            sent += self.connection.sendfile(f, start + sent, min(1 << 16, count - sent))
                            time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
                    else:
                        sent = self.connection.sendfile(f, start, count)
                with server._cond:
                    server.bytes_sent[rel] = server.bytes_sent.get(rel, 0) + sent
                if cut is not None:
                    self.close_connection = True
                    self.connection.shutdown(2)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":   # a standalone server process: python -m tests.httpserver FOLDER
    import sys
    with Server(Path(sys.argv[1])) as s:
        print(s.url, flush=True)
        while True:
            time.sleep(3600)
