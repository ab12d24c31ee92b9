"""What a job's controller needs to know about a container's network, in one call:

    python3 -m agent.netinfo      # {"addresses": [{"ifname", "address"}], "free_port": N}

``addresses``: the container's IPv4 addresses other than loopback (SIOCGIFADDR per
interface: the minimal rootfs has no `ip`); ``free_port``: a TCP port free right now on all
interfaces, for the job's rendezvous store when this container is node rank 0 (torchrun
binds it moments later; a race with another binder fails the rendezvous loudly, not
silently). Standard library only.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import sys

from agent.protocol import wrap_payload

SIOCGIFADDR = 0x8915


def ipv4_addresses() -> list[dict]:
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            if name == "lo":
                continue
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            out.append({"ifname": name, "address": socket.inet_ntoa(raw[20:24])})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def main() -> int:
    sys.stdout.write(wrap_payload({"ok": True, "addresses": ipv4_addresses(), "free_port": free_port(),
                                   "hostname": socket.gethostname()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
