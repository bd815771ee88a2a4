"""`invoke doctor`'s probe: runs in every node's own job container (same image, shm, limits, mounts, network
and environment as the job) in place of Paddle's launcher, and prints what it finds as one line
`FLEETBOX-DOCTOR <json>`. It judges nothing: the host holds every value to its threshold.

    python -m fleetbox_doctor --rank R --nnodes N --width W --master IP:PORT --node-ip IP --iface IF ...

Across nodes it talks over exactly the ports the job will use: node 0 listens on the master port, every node
on its pinned block of W ports (PORT_RANGE: node k's starts at PORT + 1 + k * W). Node k joins node 0 through
the master port (which also measures the clock offset), learns every node's address, then knocks on every
other node's ports; with --blast it streams bytes to node 0, whose receive time gives the raw TCP throughput.
Standard library only.
"""
import argparse
import array
import fcntl
import grp
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

MARK = "FLEETBOX-DOCTOR "
CHUNK = 1 << 20


def interfaces():
    return [name for _, name in socket.if_nameindex()]


def _ifreq(name, request, payload=b""):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        return fcntl.ioctl(s.fileno(), request, struct.pack("16s", name[:15].encode()) + payload.ljust(24, b"\0"))


def iface_address(name):
    try:
        return socket.inet_ntoa(_ifreq(name, 0x8915)[20:24])   # SIOCGIFADDR
    except OSError:
        return None


def iface_mtu(name):
    try:
        return struct.unpack("i", _ifreq(name, 0x8921)[16:20])[0]   # SIOCGIFMTU (works in any network namespace)
    except OSError:
        return None


def iface_speed(name):
    """Link speed in Mb/s from the driver (ETHTOOL_GSET), as `ethtool` reports it; None where it has none (lo)."""
    buf = array.array("B", struct.pack("I", 1) + b"\0" * 40)
    addr, _ = buf.buffer_info()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            fcntl.ioctl(s.fileno(), 0x8946, struct.pack("16sP", name[:15].encode(), addr))   # SIOCETHTOOL
    except OSError:
        return None
    return decode_speed(buf.tobytes())


def decode_speed(raw):
    """struct ethtool_cmd: speed (u16) at byte 12, speed_hi (u16) at byte 28; all ones: unknown."""
    speed = struct.unpack_from("H", raw, 12)[0] | struct.unpack_from("H", raw, 28)[0] << 16
    return None if speed in (0, 0xFFFF, 0xFFFFFFFF) else speed


def route(master_ip):
    """(interface or "", own address) the kernel uses to reach the master; on the master, the NIC holding it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_ip, 9))
        local = s.getsockname()[0]
    return next((n for n in interfaces() if iface_address(n) == local), ""), local


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _run(argv, timeout=30, head=False):
    """`head`: keep the start of stderr too (what Paddle's import warns of first), not only its end."""
    if not shutil.which(argv[0]):
        return {"missing": argv[0]}
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        err = p.stderr[-2000:] if not head or len(p.stderr) <= 4000 else \
            p.stderr[:2000] + "\n...\n" + p.stderr[-2000:]
        return {"rc": p.returncode, "out": p.stdout[-20000:], "err": err}
    except (OSError, subprocess.SubprocessError) as e:
        return {"error": str(e)}


def _listdir(path):
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _limit(kind):
    soft = resource.getrlimit(kind)[0]
    return -1 if soft == resource.RLIM_INFINITY else soft


# What nvidia-smi is asked of each GPU; a driver older than compute_cap (R510) is asked the rest
GPU_FIELDS = ("index", "uuid", "name", "driver_version", "memory.total", "compute_cap")


def gpu_facts():
    for fields in (GPU_FIELDS, GPU_FIELDS[:-1]):
        got = _run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"])
        if fields[-1] not in got.get("out", "") + got.get("err", ""):   # "compute_cap" is not a valid field
            return {**got, "fields": list(fields)}
    return {**got, "fields": list(fields)}


def local_facts(a):
    f = {"rank": a.rank, "hostname": socket.gethostname(), "time": time.time(), "master_ip": a.master_ip}
    try:
        st = os.statvfs("/dev/shm")
        f["shm"] = {"total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}
    except OSError as e:
        f["shm"] = {"error": e.strerror}
    f["limits"] = {"memlock": _limit(resource.RLIMIT_MEMLOCK), "nofile": _limit(resource.RLIMIT_NOFILE)}
    names = interfaces()
    f["iface"] = {"name": a.iface, "exists": a.iface in names, "names": names, "address": iface_address(a.iface),
                  "mtu": iface_mtu(a.iface), "speed": iface_speed(a.iface),
                  "operstate": _read(f"/sys/class/net/{a.iface}/operstate")}
    try:
        via, local = route(a.master_ip)
        f["route"] = {"iface": via, "local": local}
    except OSError as e:
        f["route"] = {"error": e.strerror or str(e)}
    f["node_ip"] = a.node_ip
    if a.ib_hca:
        base = f"/sys/class/infiniband/{a.ib_hca}"
        ports = sorted(os.listdir(f"{base}/ports")) if os.path.isdir(f"{base}/ports") else []
        f["ib"] = {"hca": a.ib_hca, "present": os.path.isdir(base), "ports": {
            p: {k: _read(f"{base}/ports/{p}/{k}") for k in ("state", "phys_state", "rate", "link_layer")}
            for p in ports}}
    if a.device == "cuda":
        f["gpu"] = gpu_facts()
    if a.device == "rocm":
        try:
            video = grp.getgrnam("video").gr_gid
        except KeyError:
            video = None
        smi = "hy-smi" if shutil.which("hy-smi") else "rocm-smi"
        dri = _listdir("/dev/dri")
        f["dcu"] = {"kfd": os.path.exists("/dev/kfd"), "dri": dri, "hyhal": bool(_listdir("/opt/hyhal")),
                    "groups": os.getgroups(), "video_gid": video, "smi": {"tool": smi, **_run([smi])},
                    "usable": {d: os.access(d, os.R_OK | os.W_OK) for d in
                               ["/dev/kfd"] + [f"/dev/dri/{x}" for x in dri if x.startswith("renderD")]
                               if os.path.exists(d)}}
    f["disk"] = {}
    for p in filter(None, a.paths.split(",")):
        p = os.path.expanduser(p)
        at = p
        while not os.path.exists(at) and at != os.path.dirname(at):   # a folder the job would create
            at = os.path.dirname(at)
        try:
            st = os.statvfs(at)
            f["disk"][p] = {"free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize,
                            "read_only": bool(st.f_flag & os.ST_RDONLY), "at": at}
        except OSError as e:
            f["disk"][p] = {"error": e.strerror}
    return f


class Node:
    """This node's listeners and, on node 0, the meeting point of the others."""

    def __init__(self, a):
        self.a = a
        self.joined = {}             # rank -> (address, connection file, socket)  [node 0]
        self.closed = False          # node 0 stopped taking joins
        self.lock = threading.Condition()
        self.probed = set()
        self.listeners = []
        self.bound, self.busy = [], {}

    def listen(self, ports, master=None):
        """Bind as Paddle does, so "in use" means in use for it too: its master (an HTTP server) reuses the
        address; its launcher binds the pinned ports without SO_REUSEADDR."""
        for port in ports:
            s = socket.socket()
            if port == master:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
                s.listen(64)
            except (OSError, OverflowError) as e:
                held = ", ".join(sorted(set(holders(port))))
                self.busy[str(port)] = (getattr(e, "strerror", None) or str(e)) + (f": {held}" if held else "")
                s.close()
                continue
            self.bound.append(port)
            self.listeners.append(s)
            threading.Thread(target=self._accept, args=(s, port), daemon=True).start()

    def _accept(self, s, port):
        while True:
            try:
                conn, _ = s.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, port), daemon=True).start()

    def _serve(self, conn, port):
        conn.settimeout(self.a.wait + 30)
        f = conn.makefile("rwb")
        try:
            line = f.readline().decode().strip()
            if line == "PING":
                f.write(f"PONG {self.a.rank} {port}\n".encode())
                f.flush()
            elif line.startswith("JOIN ") and self.a.rank == 0 and port == self.a.master_port:
                info = json.loads(line[5:])
                with self.lock:
                    if not self.closed:
                        f.write(f"TIME {time.time()!r}\n".encode())
                        f.flush()
                        self.joined[info["rank"]] = (info["ip"], f, conn)
                        self.lock.notify_all()
                        return   # node 0's main thread goes on with this connection
                f.write(b"LATE\n")   # node 0 has stopped waiting: this node is reported missing
                f.flush()
            hang_up(f, conn)
        except (OSError, ValueError, KeyError):
            f.close()
            conn.close()


TCP_STATES = {1: "ESTABLISHED", 2: "SYN-SENT", 3: "SYN-RECV", 4: "FIN-WAIT-1", 5: "FIN-WAIT-2", 6: "TIME-WAIT",
              7: "CLOSE", 8: "CLOSE-WAIT", 9: "LAST-ACK", 10: "LISTEN", 11: "CLOSING"}


def holders(port, tables=("/proc/net/tcp", "/proc/net/tcp6")):
    """The states of this network namespace's TCP sockets on local `port` (TIME-WAIT and the other closing
    states: a connection closed lately, which frees itself; LISTEN or ESTABLISHED: a process holds it)."""
    states = []
    for table in tables:
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            try:
                if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    states.append(TCP_STATES.get(int(fields[3], 16), fields[3]))
            except (ValueError, IndexError):   # a line of another shape: not ours to read
                continue
    return states


def hang_up(f, conn, timeout=5.0):
    """Close after the other side has: whoever closes first keeps the port in TIME_WAIT for a minute, and
    Paddle's launcher binds its pinned ports without SO_REUSEADDR (it would find none free after doctor)."""
    try:
        conn.settimeout(timeout)
        while f.read1(4096) if hasattr(f, "read1") else f.read(4096):
            pass
    except OSError:
        pass
    f.close()
    conn.close()


def knock(ip, port, timeout):
    """What a connection to ip:port meets: ok (a doctor answered), refused, timed out, or another error."""
    t0 = time.monotonic()
    try:
        with socket.create_connection((ip, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\n")
            reply = s.makefile("rb").readline().decode().strip()
        if reply.startswith("PONG ") and reply.split()[2:3] == [str(port)]:
            return {"ok": True, "rtt": time.monotonic() - t0, "rank": reply.split()[1]}
        return {"ok": False, "error": f"answered by something else ({reply[:40]!r})"}
    except socket.timeout:
        return {"ok": False, "error": "timed out (dropped by a firewall?)"}
    except ConnectionRefusedError:
        return {"ok": False, "error": "refused"}
    except (OSError, OverflowError) as e:
        return {"ok": False, "error": getattr(e, "strerror", None) or str(e)}


def ports_of(a, rank):
    width = a.width
    first = a.master_port + 1 + rank * width
    return list(range(first, first + width))


def knock_all(a, peers):
    """Every other node's pinned ports from here (the master port: joining node 0 tried it)."""
    out = {}
    for rank, ip in sorted(peers.items(), key=lambda kv: int(kv[0])):
        if int(rank) == a.rank:
            continue
        out[str(rank)] = {"ip": ip, "ports": {str(p): knock(ip, p, a.knock_timeout) for p in ports_of(a, int(rank))}}
    return out


def as_node0(a, node, facts):
    deadline = time.monotonic() + a.wait
    with node.lock:
        while len(node.joined) < a.nnodes - 1 and time.monotonic() < deadline:
            node.lock.wait(timeout=0.2)
        node.closed = True
        joined = dict(node.joined)
    peers = {"0": a.node_ip, **{str(r): ip for r, (ip, _, _) in joined.items()}}
    for r, (_, f, _) in joined.items():
        try:
            f.write(f"PEERS {json.dumps(peers)}\n".encode())
            f.flush()
        except OSError:
            pass
    facts["reach"] = knock_all(a, peers)
    facts["joined"] = sorted(joined)
    facts["missing"] = [r for r in range(1, a.nnodes) if r not in joined]
    if facts["missing"]:   # a node that cannot join knocks on our pinned ports once it gives up: stay for it
        time.sleep(min(a.wait, 5 + a.knock_timeout * a.width))
    for r, (_, f, _) in sorted(joined.items()):   # wait until each has knocked on every port
        try:
            f.readline()
        except OSError:
            pass
    facts["tcp"] = {}
    for r, (_, f, conn) in sorted(joined.items()):   # one sender at a time: each has the link to itself
        if not a.blast:
            break
        try:
            conn.settimeout(a.wait + 60)
            f.write(f"GO {a.blast}\n".encode())
            f.flush()
            left, t0 = a.blast, None
            while left:
                got = f.read1(min(left, CHUNK)) if hasattr(f, "read1") else f.read(min(left, CHUNK))
                if not got:
                    raise OSError("the sender closed the connection")
                if t0 is None:
                    t0 = time.monotonic()
                left -= len(got)
            secs = time.monotonic() - t0
            facts["tcp"][str(r)] = {"bytes": a.blast, "seconds": secs}
            f.write(f"GOT {secs!r}\n".encode())
            f.flush()
        except OSError as e:
            facts["tcp"][str(r)] = {"error": str(e)}
    for r, (_, f, conn) in joined.items():
        try:
            f.write(b"BYE\n")
            f.flush()
        except OSError:
            pass
        hang_up(f, conn)


def as_peer(a, facts):
    deadline = time.monotonic() + a.wait
    last = "no attempt"
    while True:   # node 0 may not listen yet: try again until the deadline
        try:
            conn = socket.create_connection((a.master_ip, a.master_port), timeout=min(3.0, a.wait))
            break
        except socket.timeout:
            last = "timed out (dropped by a firewall?)"
        except OSError as e:
            last = "refused" if isinstance(e, ConnectionRefusedError) else (e.strerror or str(e))
        if time.monotonic() > deadline:
            facts["master"] = {"ok": False, "error": last}
            # without node 0 no other address is known; node 0's own ports can still be tried
            facts["reach"] = knock_all(a, {"0": a.master_ip})
            return
        time.sleep(0.3)
    conn.settimeout(a.wait + 30)
    f = conn.makefile("rwb")
    try:
        t0 = time.time()
        f.write(f"JOIN {json.dumps({'rank': a.rank, 'ip': a.node_ip})}\n".encode())
        f.flush()
        reply = f.readline().decode().split()
        t2 = time.time()
        if reply[:1] == ["LATE"]:
            facts["master"] = {"ok": False, "error": f"reached after node0 had stopped waiting ({a.wait:g} s): the "
                                                     f"nodes started too far apart; raise --wait"}
            facts["reach"] = knock_all(a, {"0": a.master_ip})
            return
        if reply[:1] != ["TIME"] or len(reply) != 2:
            raise OSError(f"something else answers on the master port ({' '.join(reply)[:40]!r})")
        t1 = float(reply[1])
        facts["master"] = {"ok": True, "rtt": t2 - t0, "offset": t1 - (t0 + t2) / 2}
        line = f.readline().decode()
        if not line.startswith("PEERS "):
            raise OSError("node 0 sent no peer list")
        facts["reach"] = knock_all(a, json.loads(line[6:]))
        f.write(b"PROBED\n")
        f.flush()
        while True:
            line = f.readline().decode().strip()
            if line.startswith("GO "):
                n = int(line.split()[1])
                block = b"\0" * CHUNK
                while n:
                    f.write(block[:min(n, CHUNK)])
                    n -= min(n, CHUNK)
                f.flush()
                facts["tcp"] = {"seconds": float(f.readline().decode().split()[1]), "bytes": int(line.split()[1])}
            else:   # BYE, or node 0 is gone
                break
    except (OSError, ValueError, IndexError) as e:
        facts.setdefault("master", {"ok": False})
        facts["master"]["after_join"] = str(e)
    finally:
        f.close()
        conn.close()


def main(argv=None):
    p = argparse.ArgumentParser(prog="fleetbox_doctor")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--width", type=int, default=4, help="pinned ports per node (fleetbox.run.plan.block_width)")
    p.add_argument("--master", required=True)
    p.add_argument("--node-ip", default="")
    p.add_argument("--iface", default="")
    p.add_argument("--ib-hca", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--paths", default="")
    p.add_argument("--wait", type=float, default=30.0)
    p.add_argument("--knock-timeout", type=float, default=3.0)
    p.add_argument("--blast", type=int, default=0)
    p.add_argument("--import-paddle", action="store_true", help="also import Paddle (an env on the node, no image)")
    a = p.parse_args(argv)
    a.master_ip, _, port = a.master.rpartition(":")
    a.master_port = int(port)
    facts = {"rank": a.rank}
    node = Node(a)
    try:
        facts.update(local_facts(a))
        node.listen(([a.master_port] if a.rank == 0 else []) + ports_of(a, a.rank), master=a.master_port)
        facts["ports"] = {"bound": node.bound, "busy": node.busy}
        if a.nnodes > 1 and a.rank == 0:
            as_node0(a, node, facts)
        elif a.nnodes > 1:
            as_peer(a, facts)
    except Exception as e:   # whatever happened, the host gets a line saying so
        facts["crash"] = f"{type(e).__name__}: {e}"[:300]
    for s in node.listeners:
        s.close()
    if a.import_paddle:   # last: it takes seconds, which the nodes' meeting above must not wait for
        facts["paddle"] = _run([sys.executable, "-c", "import paddle; print(paddle.__version__)"], timeout=300,
                               head=True)
    print(MARK + json.dumps(facts), flush=True)


if __name__ == "__main__":
    main()
