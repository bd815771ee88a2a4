"""A real headless Chromium for tests, driven over the DevTools Protocol with the standard library only.

Some pages (VisualDL's scalar charts, for one) draw on canvases, so their DOM says nothing about the data
shown. What a test can check is the page's own data requests: `load` opens a URL and hands back every
response whose URL matches, with status and body, once the page has gone quiet.

Chromium runs with --remote-debugging-pipe: it reads commands on fd 3 and writes replies and events on fd 4,
each message one JSON object ended by a NUL byte. No websocket, no port, nothing to install.

    with Browser() as b:
        got = b.load(url, want=re.compile(r"/api/scalar/list"), settle=3.0, timeout=60)
        b.screenshot(path)
"""

import base64
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections import deque


class BrowserError(RuntimeError):
    pass


def _high(fd):
    # Keep our pipe ends off 3 and 4, so the dup2s onto 3 and 4 in the child cannot clobber each other.
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5)
    os.close(fd)
    return new


class Browser:
    def __init__(self, binary=None, size=(1600, 2400)):
        self.binary = binary or shutil.which("chromium") or shutil.which("chromium-browser") or "google-chrome"
        self.size, self.proc, self.tmp, self.session, self._err = size, None, None, None, None
        self._fds, self._buf, self._id, self._events = [], b"", 0, deque()   # events seen while awaiting a reply

    def __enter__(self):
        try:
            self.tmp = tempfile.mkdtemp(prefix="browser-")
            cmd_r, self._w = map(_high, os.pipe())
            self._r, out_w = map(_high, os.pipe())
            self._fds = [cmd_r, self._w, self._r, out_w]
            self._err = open(os.path.join(self.tmp, "stderr"), "wb")   # a file, not a pipe: it never fills and blocks
            # close_fds=False: Python opens everything close-on-exec, so only the dup2'd 3 and 4 reach chromium.
            self.proc = subprocess.Popen(
                [self.binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-extensions", "--disable-background-networking",
                 "--remote-debugging-pipe", f"--user-data-dir={self.tmp}/profile",
                 "--window-size={},{}".format(*self.size), "about:blank"],
                stdin=subprocess.DEVNULL, stdout=self._err, stderr=self._err, close_fds=False,
                start_new_session=True, preexec_fn=lambda: (os.dup2(cmd_r, 3), os.dup2(out_w, 4)))
            for fd in (cmd_r, out_w):   # the child's ends: holding them here would hide chromium's exit (EOF) from us
                os.close(fd)
                self._fds.remove(fd)
            target = self.call("Target.createTarget", session=False, url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", session=False, targetId=target, flatten=True)["sessionId"]
            # --window-size counts the window's frame too; make the page's own viewport exactly `size`.
            self.call("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self.proc:
            try:   # ask first: chromium then reaps its own helpers instead of leaving them to init
                os.write(self._w, b'{"id": 0, "method": "Browser.close"}\0')
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)   # whatever is left of its group: renderers, zygotes
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self._err:
            self._err.close()
            self._err = None
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def _read(self, timeout):
        """The next message from chromium, or None if none came within `timeout` seconds."""
        end = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                return None
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                try:
                    code = self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    code = "none yet"
                with open(os.path.join(self.tmp, "stderr"), errors="replace") as f:
                    # Without a session bus chromium logs a dbus error every few ms; they would hide the cause.
                    tail = [line for line in f.read().splitlines() if "ERROR:dbus/" not in line][-30:]
                raise BrowserError(f"chromium closed its pipe (exit code {code}); stderr tail:\n" + "\n".join(tail))
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, session=True, timeout=30, **params):
        """Send one command and return its result; events that come meanwhile are kept for load()."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params, **({"sessionId": self.session} if session else {})}
        os.write(self._w, json.dumps(msg).encode() + b"\0")   # a blocking pipe write takes the whole message
        end = time.monotonic() + timeout
        while (got := self._read(end - time.monotonic())) is not None:
            if got.get("id") == self._id:
                if "error" in got:
                    raise BrowserError(f"{method}: {got['error']}")
                return got["result"]
            if "method" in got:
                self._events.append(got)
        raise TimeoutError(f"no reply to {method} within {timeout} s")

    def load(self, url, want, settle=3.0, timeout=60, at_least=1):
        """Open `url`; return [{"url", "status", "body" (bytes)}] for each response whose URL matches `want`.

        Returns once the page has loaded, `at_least` matched, and no new match came for `settle` seconds.
        """
        want = re.compile(want)
        self.call("Network.enable")
        self.call("Page.enable")
        self._events.clear()
        if err := self.call("Page.navigate", url=url).get("errorText"):
            raise BrowserError(f"cannot open {url}: {err}")
        got, pending, seen = [], {}, deque(maxlen=20)
        loaded, quiet_since = False, time.monotonic()
        end = quiet_since + timeout
        while not (loaded and not pending and len(got) >= at_least and time.monotonic() - quiet_since >= settle):
            if time.monotonic() > end:
                raise TimeoutError(f"{url}: after {timeout} s page loaded={loaded}; matched {want.pattern!r}: "
                                   f"{[g['url'] for g in got]}; still pending: {list(pending.values())}; "
                                   f"last responses: {list(seen)}")
            ev = self._events.popleft() if self._events else self._read(0.2)
            if ev is None or ev.get("sessionId") != self.session:
                continue
            kind, p = ev["method"], ev.get("params", {})
            if kind == "Page.loadEventFired":
                loaded, quiet_since = True, time.monotonic()
            elif kind == "Network.responseReceived":
                seen.append(f"{p['response']['status']} {p['response']['url']}")
                if want.search(p["response"]["url"]):
                    pending[p["requestId"]] = {"url": p["response"]["url"], "status": p["response"]["status"]}
            elif kind in ("Network.loadingFinished", "Network.loadingFailed") and p["requestId"] in pending:
                entry, body = pending.pop(p["requestId"]), None
                if kind == "Network.loadingFinished":   # a body can be asked for only once it has all arrived
                    r = self.call("Network.getResponseBody", requestId=p["requestId"])
                    body = base64.b64decode(r["body"]) if r["base64Encoded"] else r["body"].encode()
                got.append({**entry, "body": body, "error": p.get("errorText")})
                quiet_since = time.monotonic()
        return got

    def evaluate(self, expression):
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression!r}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def screenshot(self, path):
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
