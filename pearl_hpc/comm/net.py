"""The address a rank's sockets bind (engine RPC, the trainer's weight store): the
interface the run config names, never every interface.

    "hostname"      what this node's name resolves to (the default on Slurm)
    "ib0", "eth0"   that interface's IPv4 address
    "10.1.2.3"      that address
"""

from __future__ import annotations

import fcntl
import socket
import struct

from pearl_hpc.config.slurm import is_ipv4
from pearl_hpc.errors import ConfigError

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def bind_address(spec: str, *, reachable: bool = False) -> str:
    """The IPv4 address ``spec`` names on this node; one clear error if it names none, or
    (``reachable``: other nodes must reach it) if 'hostname' resolves to loopback, as
    Debian-style hosts map their name to 127.0.1.1. Loopback named outright (``lo``,
    ``127.0.0.1``) is taken: a cluster whose nodes are all one host."""
    if spec == "hostname":
        name = socket.gethostname()
        try:
            address = socket.gethostbyname(name)
        except OSError as exc:
            raise ConfigError(
                f"slurm.engine_interface hostname: {name!r} does not resolve ({exc}); "
                "name an interface (e.g. eth0) or an address"
            ) from None
        if reachable and address.startswith("127."):
            raise ConfigError(
                f"slurm.engine_interface hostname: {name!r} resolves to {address}, a "
                "loopback address the run's other nodes cannot reach; name the interface "
                "they share (e.g. ib0, eth0) or its address"
            )
        return address
    if is_ipv4(spec):
        return spec
    names = sorted(name for _, name in socket.if_nameindex())
    if spec not in names:
        raise ConfigError(
            f"slurm.engine_interface {spec!r}: no such interface on {socket.gethostname()} "
            f"(there: {', '.join(names)}); name one of them, an IPv4 address or 'hostname'"
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), _SIOCGIFADDR, struct.pack("256s", spec[:15].encode())
            )
        except OSError:
            raise ConfigError(
                f"slurm.engine_interface {spec!r}: the interface has no IPv4 address"
            ) from None
    return socket.inet_ntoa(packed[20:24])
