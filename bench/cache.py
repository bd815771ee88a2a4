#!/usr/bin/env python3
"""Dataset seeding against curl: whole process against whole process, same server, same files (not a test).

Compared, in interleaved rounds (A B C D, then D C B A, ...), medians:
- `python3 -m invoke cache --datasets mnist --manifest M --dest D --mirror URL --jobs 4` (a whole process:
  interpreter, invoke, streaming download with MD5 in the same pass, temp name and rename; 4 is the default),
- `curl --parallel --parallel-max 4` fetching the same four files (no check of their content),
and, for the fuller picture, `invoke cache --jobs 1` (one stream at a time) and `curl --parallel` followed by
`md5sum -c` (curl with the same guarantee as seeding), and `invoke cache` of a data set with no files (what
the whole process costs around the bytes: start-up, imports, the mirror check). All fetch from one HTTP
server in its own process (tests/httpserver.py's, which sends with sendfile): four incompressible files in
MNIST's proportions.

Two settings:
a. a shaped link, as real links are: a veth pair into a network namespace of our own (fbbench<pid>), the
   server inside it, `tc qdisc tbf rate 1gbit` on both ends; one core hashes MD5 several times faster than
   that. Target: invoke cache >= 0.95x curl --parallel's throughput.
b. unshaped loopback: there the largest file's single MD5 stream is the ceiling (it holds 85% of the bytes).
   No target; printed with one core's MD5 speed, measured in the same rounds, and the ceiling it implies
   for this file set (all bytes / time to hash the largest file).

Needs root (ip netns, tc) and curl; no Docker. Usage: python bench/cache.py [--mb 400] [--repeat 3]
[--rate 1gbit] [--setting shaped|loopback|both]
"""
import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import benchlib as bl
from benchlib import ROOT

JOBS = 4   # invoke cache's default --jobs, and curl's --parallel-max
INV, CURL = f"invoke cache --jobs {JOBS}", f"curl --parallel --parallel-max {JOBS}"
INV1, CURL_MD5 = "invoke cache --jobs 1", f"curl --parallel-max {JOBS}, then md5sum -c"
MD5 = "one core's MD5 (hashlib)"
EMPTY = "invoke cache, empty data set (fixed cost)"
MNIST = (9912422, 28881, 1648877, 4542)   # bytes of the four real files, in NAMES order
NAMES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
         "t10k-labels-idx1-ubyte.gz")
MD5_CHUNK = 1 << 18   # fleetbox.data.fetch reads and hashes in 256 KiB pieces


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=400, help="total size of the four files (MB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rate", default="1gbit", help="tc rate of the shaped link")
    ap.add_argument("--setting", choices=("shaped", "loopback", "both"), default="both")
    ap.add_argument("--serve", nargs=2, metavar=("ADDR", "DIR"), help=argparse.SUPPRESS)   # the server process
    args = ap.parse_args()
    if args.serve:
        return serve(*args.serve)
    for tool in ("curl", "md5sum") + (("ip", "tc") if args.setting != "loopback" else ()):
        if not shutil.which(tool):
            sys.exit(f"{tool} is needed")
    if args.setting != "loopback" and os.geteuid() != 0:
        sys.exit("the shaped setting needs root (ip netns, tc); or pass --setting loopback")

    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        tmp = Path(tmp)
        sizes, md5 = make_files(tmp / "srv" / "mnist", args.mb)
        total = sum(sizes)
        manifest = tmp / "datasets.toml"   # the URLs' names matter (--mirror takes <module>/<name>), not hosts
        manifest.write_text('[datasets.mnist]\nmodule = "mnist"\nfiles = [\n' + ",\n".join(
            f'  {{ url = "http://mnist.invalid/{n}", md5 = "{m}" }}' for n, m in md5.items()) + "\n]\n"
                            '[datasets.empty]\nmodule = "mnist"\nfiles = []\n')
        (tmp / "md5sums").write_text("".join(f"{m}  {n}\n" for n, m in md5.items()))
        print(f"{len(NAMES)} files, {total / 1e6:.0f} MB (largest {max(sizes) / total:.0%} of the bytes), "
              f"median of {args.repeat} interleaved rounds, this machine has {os.cpu_count()} cores", flush=True)

        if args.setting in ("shaped", "both"):
            with shaped_link(args.rate) as (ns, server_ip):
                with server(tmp / "srv", server_ip, ns) as url:
                    res = measure(url, tmp, manifest, sizes, args.repeat, [INV, CURL, INV1, CURL_MD5, EMPTY])
            report(f"a. {args.rate} link: tbf on both ends of a veth pair, server in network namespace {ns}",
                   res, total, target=0.95)
        if args.setting in ("loopback", "both"):
            with server(tmp / "srv", "127.0.0.1") as url:
                res = measure(url, tmp, manifest, sizes, args.repeat, [INV, CURL, INV1, CURL_MD5, EMPTY, MD5])
            report("b. unshaped loopback (the largest file's one MD5 stream is the ceiling)", res, total,
                   md5_ceiling=max(sizes))


def make_files(folder: Path, mb: int) -> tuple[list[int], dict[str, str]]:
    """Incompressible files in MNIST's own proportions, written in 1 MB pieces; their sizes and MD5s."""
    rng, md5, sizes = random.Random(0), {}, [int(mb * 1e6 * n / sum(MNIST)) for n in MNIST]
    folder.mkdir(parents=True)
    for name, size in zip(NAMES, sizes):
        h = hashlib.md5()
        with open(folder / name, "wb") as f:
            for piece in [1 << 20] * (size >> 20) + [size % (1 << 20)]:
                b = rng.randbytes(piece)
                h.update(b)
                f.write(b)
        md5[name] = h.hexdigest()
    return sizes, md5


def measure(url: str, tmp: Path, manifest: Path, sizes: list[int], repeat: int, arms: list[str]) -> dict:
    """Every arm once per round, order alternating; returns arm -> list of (wall s, CPU s)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}   # straight to the server
    invoke = [sys.executable, "-m", "invoke", "cache", "--manifest", manifest, "--mirror", url]
    curl = ["curl", "-sSf", "--noproxy", "*", "--parallel", "--parallel-max", str(JOBS), "--create-dirs"]

    def argv(arm: str, out: Path) -> list:
        if arm in (INV, INV1, EMPTY):
            return invoke + ["--datasets", "empty" if arm == EMPTY else "mnist", "--dest", out,
                             "--jobs", str(1 if arm == INV1 else JOBS)]
        cmd = curl + [a for n in NAMES for a in ("-o", out / "mnist" / n, f"{url}/mnist/{n}")]
        if arm == CURL_MD5:   # one whole process: fetch, then check every file as seeding does
            return ["sh", "-c", '"$@" && cd "$0/mnist" && md5sum --quiet -c "$0/../md5sums"', out, *cmd]
        return cmd

    results = {a: [] for a in arms}
    for i, arm in bl.rounds(arms, repeat):
        if arm == MD5:
            results[arm].append((md5_seconds(256 << 20), None))
            continue
        out = tmp / f"out-{i}"
        out.mkdir()
        os.sync()   # the previous arm's dirty pages are written outside the timing
        t = bl.run(argv(arm, out), cwd=ROOT, env=env)
        got = [(out / "mnist" / n).stat().st_size if (out / "mnist" / n).exists() else -1 for n in NAMES]
        if got != (sizes if arm != EMPTY else [-1] * len(NAMES)):
            sys.exit(f"{arm}: got sizes {got}, want {sizes}\n{t.proc.stdout[-2000:]}{t.proc.stderr[-2000:]}")
        results[arm].append((t.wall, t.cpu))
        shutil.rmtree(out)
    return results


def report(title: str, res: dict, total: int, target: float | None = None, md5_ceiling: int | None = None):
    n = len(res[INV])
    wall = {a: bl.med([w for w, _ in r]) for a, r in res.items()}
    rows = [[a, "-" if a == EMPTY else f"{total / wall[a] / 1e6:.1f}", f"{wall[a]:.2f}", bl.spread([w for w, _ in r]),
             f"{bl.med([c for _, c in r]):.2f}"] for a, r in res.items() if a != MD5]
    print(f"\n{title}, median of {n}:")
    print(bl.table(["whole process", "MB/s", "s", "spread of s", "CPU s"], rows))
    ratio = wall[CURL] / wall[INV]
    line = f"  invoke cache / curl --parallel: {ratio:.2f}x throughput"
    if target is not None:
        line += f"  (target >= {target:.2f}x: {'met' if ratio >= target else 'NOT met'})"
    print(line)
    print(f"  of the {wall[INV] - wall[CURL]:.2f} s invoke cache takes longer than curl --parallel, the fixed cost of "
          f"its process (empty data set) is {wall[EMPTY]:.2f} s")
    print(f"  invoke cache --jobs 1 / curl --parallel: {wall[CURL] / wall[INV1]:.2f}x;   "
          f"invoke cache / (curl --parallel + md5sum -c): {wall[CURL_MD5] / wall[INV]:.2f}x")
    if md5_ceiling is not None:
        speed = (256 << 20) / wall[MD5]
        ceiling = speed * total / md5_ceiling
        print(f"  {MD5}, {MD5_CHUNK >> 10} KiB updates: {speed / 1e6:.0f} MB/s "
              f"(median of {n}; seconds per 256 MiB {bl.spread([w for w, _ in res[MD5]], '.3f')})")
        print(f"  ceiling for this file set (all bytes / time to hash the largest file on one core): "
              f"{ceiling / 1e6:.0f} MB/s; invoke cache reaches {total / wall[INV] / ceiling:.2f}x of it")


def md5_seconds(nbytes: int) -> float:
    """Seconds one core takes to MD5 `nbytes` of in-memory data, in fetch's piece size (the ceiling of any one
    verified stream)."""
    data = random.Random(1).randbytes(MD5_CHUNK)
    h, t = hashlib.md5(), time.perf_counter()
    for _ in range(nbytes // MD5_CHUNK):
        h.update(data)
    return time.perf_counter() - t


@contextmanager
def shaped_link(rate: str):
    """A veth pair from here into a network namespace of our own, shaped with tbf at `rate` on both ends.
    Yields (namespace, address inside it). The namespace (and with it both veth ends) goes on every way out."""
    ns = f"fbbench{os.getpid()}"
    outer, inner = f"{ns}h"[-15:], f"{ns}n"[-15:]   # interface names: 15 characters at most
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    x = next(x for x in ((os.getpid() + k) % 256 for k in range(256)) if f" 10.213.{x}." not in used)
    here, there = f"10.213.{x}.1", f"10.213.{x}.2"
    burst = ["burst", "256kb", "latency", "20ms"]   # burst above one 64 KiB GSO packet; ~2.5 MB of queue
    steps = [["ip", "netns", "add", ns],
             ["ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns],
             ["ip", "addr", "add", f"{here}/30", "dev", outer], ["ip", "link", "set", outer, "up"],
             ["ip", "-n", ns, "addr", "add", f"{there}/30", "dev", inner], ["ip", "-n", ns, "link", "set", inner, "up"],
             ["ip", "-n", ns, "link", "set", "lo", "up"],
             ["tc", "qdisc", "add", "dev", outer, "root", "tbf", "rate", rate, *burst],
             ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inner, "root", "tbf", "rate", rate, *burst]]
    try:
        for cmd in steps:
            subprocess.run(cmd, check=True, capture_output=True)
        yield ns, there
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", outer], capture_output=True)   # normally gone with the namespace


@contextmanager
def server(root: Path, addr: str, ns: str | None = None):
    """The test suite's HTTP server (sendfile, Range) in its own process, bound to `addr`; yields its URL."""
    cmd = [sys.executable, __file__, "--serve", addr, str(root)]
    proc = subprocess.Popen((["ip", "netns", "exec", ns] if ns else []) + cmd, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        if not url:
            sys.exit("the HTTP server did not start")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serve(addr: str, root: str) -> None:
    """The server process: tests/httpserver.py's Server, bound to `addr` instead of 127.0.0.1."""
    sys.path.insert(0, str(ROOT))
    from tests import httpserver

    class Bound(httpserver.ThreadingHTTPServer):
        def __init__(self, _address, handler):
            super().__init__((addr, 0), handler)

        def handle_error(self, request, client_address):
            pass   # a client that went away (an interrupted run): nothing to report

    httpserver.ThreadingHTTPServer = Bound
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))   # the benchmark ends us, also after a Ctrl-C
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with httpserver.Server(Path(root)) as s:
        print(f"http://{addr}:{s.httpd.server_address[1]}", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    bl.entry(main)
