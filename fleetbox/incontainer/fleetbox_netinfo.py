"""Network facts of the machine this runs on, towards a training master: the NIC and own address that
reach it, whether the master port is free there, and the locked-memory limit.

Standard library only: fleetbox.jobs imports it on the launching machine, and the Docker backend and the
Slurm/pyxis wrapper run this file inside the image as `python -c SOURCE MASTER [PORT] [--plain]`.
"""
import fcntl
import json
import resource
import socket
import struct
import sys


def interfaces():
    return [name for _, name in socket.if_nameindex()]


def iface_address(name):
    """IPv4 address of an interface (SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def route(master_ip):
    """(interface or "", own address) used to reach the master; on the master itself, the NIC holding it.
    Raises OSError when there is no route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_ip, 9))
        local = s.getsockname()[0]
    return next((n for n in interfaces() if iface_address(n) == local), ""), local


def port_free(ip, port, reuse=True):
    """Whether `port` can be bound: with reuse, as Paddle's master (an HTTP server) binds it; without, as its
    launcher binds the trainers' ports (a connection in TIME_WAIT holds those for a minute)."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False


def memlock_limit():
    """-1 (unlimited) or the hard limit: containers started from here cannot get more."""
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    return -1 if hard == resource.RLIM_INFINITY else hard


if __name__ == "__main__":
    master = sys.argv[1]
    iface, local = route(master)
    if "--plain" in sys.argv:
        print(iface, local)
    else:
        port = int(sys.argv[2])
        print(json.dumps({"iface": iface, "local": local, "names": interfaces(), "memlock": memlock_limit(),
                          "port_free": port_free(master, port) if local == master else True}))
