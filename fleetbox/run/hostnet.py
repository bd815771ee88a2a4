"""Network and host facts a plan reads on the launching machine (for remote hosts, the same probe runs in a
container there): the NIC and own address towards the master, free ports, locked-memory limits."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlparse

from fleetbox.errors import UserError
from fleetbox.incontainer import fleetbox_netinfo as netinfo


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


LOW_PORT = 20000   # blocks are drawn from here up to the kernel's ephemeral range, where no outgoing
                   # connection can take a pinned port before the launcher binds it


def ephemeral_start() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def busy_ports(ip: str, port: int, count: int) -> list[int]:
    """The ports of [port, port + count) that cannot be bound the way the job binds them: the master as
    Paddle's HTTP master does (reusing the address), the rest as its launcher does (on every address, not
    reusing it)."""
    return [p for p in range(port, port + count)
            if not (netinfo.port_free(ip, p) if p == port else netinfo.port_free("", p, reuse=False))]


def free_block(ip: str, count: int) -> int:
    """A master port with the `count` - 1 ports above it free too (the nodes' pinned trainer ports)."""
    top = max(LOW_PORT + count + 1, ephemeral_start()) - count
    for _ in range(200):
        port = LOW_PORT + int.from_bytes(os.urandom(2), "big") % (top - LOW_PORT)
        if not busy_ports(ip, port, count):
            return port
    raise UserError(f"found no {count} free ports in a row on {ip}; pass --port")


def random_port() -> int:
    """A master port for machines we cannot ask (Slurm nodes), with room for the pinned ports above it below
    the usual ephemeral range (32768)."""
    return LOW_PORT + int.from_bytes(os.urandom(2), "big") % 10000


def check_room(port: int, count: int) -> None:
    """The master port and the `count` - 1 pinned ports above it fit below 65536 (every backend asks)."""
    if port + count > 65536:
        raise UserError(f"--port {port} leaves no room above it for the trainers' {count - 1} pinned ports; "
                        f"pick a lower one")


def check_port(ip: str, port: int, count: int = 1) -> None:
    """The master port and the `count` - 1 pinned ports above it, free here."""
    check_room(port, count)
    busy = busy_ports(ip, port, count)
    if busy:
        what = f"port {port}" if busy == [port] else f"port(s) {', '.join(map(str, busy))} of {port}-{port + count - 1}"
        raise UserError(f"{what} on {ip} is already in use; pick another with --port")


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
