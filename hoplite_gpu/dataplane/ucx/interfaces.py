"""The local network interface that holds an address: the one a node's UCX is limited to (UCX's
``NET_DEVICES``), since ucxx's listener takes no bind address."""

from __future__ import annotations

import socket

from ...config import WILDCARD_HOSTS, is_loopback


def interface_of(host: str) -> str:
    """The name of the local network interface that holds the address ``host`` ("lo" for a
    loopback address, "" when no interface holds it or it is a wildcard or a name).

    IPv4 addresses are read with the ``SIOCGIFADDR`` ioctl (an interface's primary address),
    IPv6 ones from ``/proc/net/if_inet6``; on systems without either it returns "".
    """
    if host in WILDCARD_HOSTS or not host:
        return ""
    if is_loopback(host):
        return _loopback_interface()
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
    except OSError:
        packed = b""
    if packed:
        return _ipv4_interface(packed)
    try:
        wanted = socket.inet_pton(socket.AF_INET6, host).hex()
    except OSError:
        return ""  # a name, not an address
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                cols = line.split()
                if len(cols) >= 6 and cols[0] == wanted:
                    return cols[5]
    except OSError:
        pass
    return ""


def _interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _loopback_interface() -> str:
    names = _interfaces()
    return "lo" if "lo" in names or not names else _ipv4_interface(socket.inet_aton("127.0.0.1"))


def _ipv4_interface(packed: bytes) -> str:
    try:
        import fcntl
        import struct
    except ImportError:  # pragma: no cover - not a POSIX system
        return ""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in _interfaces():
            try:
                reply = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # down, or no IPv4 address
            if reply[20:24] == packed:
                return name
    return ""


__all__ = ["interface_of"]
