"""The sim network (sim/net.py): containers of both sim nodes reach each other on a bridge in
a namespace of its own, nothing routes off the machine, a cut link drops packets silently,
and a container restarted by `pct start` over SSH gets its link back (the LXC start hook)."""

from __future__ import annotations

import subprocess
import time

import pytest

from _multi_sim import address, attach, over_ssh, sim2_node  # noqa: F401 (fixture)
from sim import net

pytestmark = [pytest.mark.sim]

# A one-connection TCP echo in the container: prints READY, answers one line, exits.
SERVER = ("import socket,sys;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
          "s.bind(('0.0.0.0',int(sys.argv[1])));s.listen();print('READY',flush=True);"
          "c,_=s.accept();c.sendall(c.recv(100).upper());c.close()")
CLIENT = ("import socket,sys;c=socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=float(sys.argv[3]));"
          "c.sendall(b'ping');print(c.recv(100).decode())")


def serve(node, ctid: int, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(["lxc-attach", "-P", str(node.paths.lxcpath), "-n", str(ctid), "--clear-env", "--",
                             "python3", "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    return proc


def test_containers_of_two_nodes_talk_over_the_sim_bridge(sim_node, sim2_node):
    server = serve(sim2_node, 300, 29511)
    try:
        out = attach(sim_node, 200, "python3", "-c", CLIENT, address(sim2_node, 300), "29511", "10").stdout
        assert out.strip() == "PING"
    finally:
        server.kill()
        server.wait()
    addrs = {address(n, c) for n in (sim_node, sim2_node) for c in n.ctids}
    assert len(addrs) == 4 and all(a.startswith("10.77.0.") for a in addrs)


def test_nothing_routes_off_the_machine(sim_node):
    # The bridge's namespace has no address and no route; the container has only its /24.
    routes = subprocess.run(["ip", "-n", net.NETNS, "-4", "route", "show"], capture_output=True, text=True).stdout
    assert routes.strip() == ""
    addrs = subprocess.run(["ip", "-n", net.NETNS, "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    assert "inet " not in addrs.replace("inet 127.0.0.1", "")
    table = attach(sim_node, 200, "cat", "/proc/net/route").stdout.splitlines()[1:]
    # /proc/net/route destinations are little-endian hex: 10.77.0.0 is 00004D0A; no default (00000000).
    assert [line.split()[1] for line in table] == ["00004D0A"]


def arp_cache(node, ctid: int, flush: bool, peer: str) -> None:
    """Empty the container's neighbour table, or put the peer's address in it (a refused
    connect to a closed port resolves it and leaves it REACHABLE)."""
    pid = subprocess.run(["lxc-info", "-P", str(node.paths.lxcpath), "-n", str(ctid), "-p", "-H"],
                         capture_output=True, text=True, check=True).stdout.strip()
    if flush:
        subprocess.run(["nsenter", "-t", pid, "-n", "ip", "neigh", "flush", "all"], check=True)
    else:
        primed = attach(node, ctid, "python3", "-c", CLIENT, peer, "29599", "5", check=False)
        assert "Connection refused" in primed.stderr, primed.stderr


@pytest.mark.parametrize("cached, timeout", [(True, "3"), (False, "10")])
def test_a_cut_link_drops_packets_silently_until_restored(sim_node, cached, timeout):
    """No RST reaches anyone ("Connection refused" would be one): with 201's address in 200's
    ARP cache the SYN is dropped and the connect times out; without it, 200's ARP probes go
    unanswered and the connect ends after them (about 3 s) with EHOSTUNREACH, as on a pulled
    cable. CI under load met the second with the cache in whatever state earlier tests left."""
    a200, a201 = address(sim_node, 200), address(sim_node, 201)
    server = serve(sim_node, 201, 29512)
    try:
        arp_cache(sim_node, 200, flush=not cached, peer=a201)
        net.set_link(a201, up=False)
        assert net.link_state(a201) == "down"
        t0 = time.monotonic()
        cut = attach(sim_node, 200, "python3", "-c", CLIENT, a201, "29512", timeout, check=False)
        assert cut.returncode != 0, cut.stdout
        assert ("timed out" if cached else "No route to host") in cut.stderr, cut.stderr
        assert time.monotonic() - t0 >= 2.5  # nothing answered at once
    finally:
        net.set_link(a201, up=True)
    try:
        # The cut left a FAILED neighbour entry: until ARP resolves again a connect may end at
        # once with EHOSTUNREACH, so "restored" means it answers within a deadline.
        deadline = time.monotonic() + 60
        while True:
            back = attach(sim_node, 200, "python3", "-c", CLIENT, a201, "29512", "5", check=False)
            if back.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert back.returncode == 0, back.stderr
        assert back.stdout.strip() == "PING"
    finally:
        server.kill()
        server.wait()
    assert a200 != a201


def test_pct_start_over_ssh_gives_a_restarted_container_its_link(sim2_node):
    over_ssh(sim2_node, ["pct", "stop", "301"], ["pct", "start", "301"])
    out = attach(sim2_node, 301, "cat", "/proc/net/dev").stdout
    assert "eth0" in out
    pid = int(subprocess.run(["lxc-info", "-P", str(sim2_node.paths.lxcpath), "-n", "301", "-p", "-H"],
                             capture_output=True, text=True).stdout)
    assert net.has_link(pid)


def test_a_container_reaches_itself_on_loopback_and_its_own_address(sim2_node):
    # torchrun's store on node rank 0 connects to its own address (through lo): a container
    # whose init never brought lo up would time out there (seen before the hook set lo up).
    for host in ("127.0.0.1", address(sim2_node, 300)):
        server = serve(sim2_node, 300, 29513)
        try:
            out = attach(sim2_node, 300, "python3", "-c", CLIENT, host, "29513", "5").stdout
            assert out.strip() == "PING", host
        finally:
            server.kill()
            server.wait()
