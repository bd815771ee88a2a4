"""Network and host facts a plan reads on the launching machine (for remote hosts, the same probe runs in a
container there): the NIC and own address towards the master, free ports, locked-memory limits."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlparse

from ..errors import UserError
from ..probes import netinfo


def route(master_ip: str) -> tuple[str, str]:
    """(interface, own address) this machine uses to reach the master (on the master: the one holding it)."""
    try:
        iface, local = netinfo.route(master_ip)
    except OSError as e:
        raise UserError(f"no route to master {master_ip}: {e.strerror}") from None
    if not iface:
        raise UserError(f"no interface holds {local}, the address that routes to {master_ip}; pass --iface")
    return iface, local


def check_iface(name: str) -> None:
    have = netinfo.interfaces()
    if name not in have:
        raise UserError(f"interface {name!r} does not exist here (have: {', '.join(have)})")


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def random_port() -> int:
    """A master port for machines we cannot ask (Slurm nodes)."""
    return 29000 + int.from_bytes(os.urandom(2), "big") % 20000


def check_port(ip: str, port: int) -> None:
    if not netinfo.port_free(ip, port):
        raise UserError(f"port {port} on {ip} is already in use; pick another with --port")


def memlock() -> int:
    """-1 (unlimited) unless this machine's hard limit is lower: dockerd, started here, cannot go above it."""
    return netinfo.memlock_limit()


def host_address(url: str) -> str:
    """Numeric IPv4 of a Docker host URL (ssh://user@h1, tcp://h1:2375): Paddle's master must be an IP."""
    host = urlparse(url).hostname
    if not host:
        raise UserError(f"cannot tell the address of host {url!r}: use ssh://USER@HOST or tcp://HOST:PORT")
    try:
        ipaddress.IPv4Address(host)
        return host
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror:
        raise UserError(f"cannot resolve host {host!r} of {url}") from None
