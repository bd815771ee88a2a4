"""A real HTTP server on loopback for tests: serves a folder, honours Range, can misbehave on purpose."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Server:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.cut_after: dict[str, int] = {}     # path -> bytes to send before dropping the connection (once)
        self.corrupt: set[str] = set()          # paths always served with a flipped byte
        self.requests: list[tuple[str, str]] = []   # (path, Range header)
        self.bytes_sent: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self.do_GET(head=True)

            def do_GET(self, head=False):
                rel = self.path.split("?")[0].lstrip("/")
                server.requests.append((self.path, self.headers.get("Range", "")))
                path = server.root / rel
                if path.is_dir():
                    path = path / "index.html"
                if not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                if "/" + rel in server.corrupt or rel in server.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start, status = 0, 200
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.end_headers()
                        return
                    status = 206
                body = data[start:]
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Content-Type", "text/html" if path.suffix == ".html" else "application/octet-stream")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Accept-Ranges", "bytes")
                self.end_headers()
                if head:
                    return
                cut = server.cut_after.pop(rel, None)
                if cut is not None:
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    server.bytes_sent[rel] = server.bytes_sent.get(rel, 0) + cut
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)
                server.bytes_sent[rel] = server.bytes_sent.get(rel, 0) + len(body)

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
    import time
    with Server(Path(sys.argv[1])) as s:
        print(s.url, flush=True)
        while True:
            time.sleep(3600)
