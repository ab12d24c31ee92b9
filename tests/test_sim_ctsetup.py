"""The sim's containers start as a Proxmox container does (sim/ctsetup.py): /etc/hostname and
a PVE section of /etc/hosts written at every start, so `localhost` and the container's own
name resolve; a PID 1 that reaps orphans; a tmpfs on /dev/shm.

Without them, in a sim container without /etc/hosts, torchrun's --standalone rendezvous hung on
`localhost` and then on the hostname, and the zombies of killed processes piled up under
PID 1 (`sleep infinity`)."""

from __future__ import annotations

import time

import pytest

from test_sim_pct import pct

pytestmark = pytest.mark.sim

SECTION = ("# --- BEGIN PVE ---\n127.0.0.1 localhost.localnet localhost\n::1 localhost.localnet localhost\n"
           "10.77.0.{octet} sim-ct{ct}\n# --- END PVE ---\n")


def _exec(node, ct: int, *argv: str):
    return pct(node, "exec", str(ct), "--", *argv)


def test_a_container_has_its_hostname_and_the_pve_hosts_section_and_both_names_resolve(sim_node):
    assert _exec(sim_node, 200, "cat", "/etc/hostname").out == "sim-ct200"
    assert _exec(sim_node, 200, "cat", "/etc/hosts").out + "\n" == SECTION.format(octet=200, ct=200)
    got = _exec(sim_node, 200, "python3", "-c", "import socket; print(socket.gethostbyname('localhost'), "
                                               "socket.gethostbyname(socket.gethostname()))")
    assert got.out == "127.0.0.1 10.77.0.200"


def test_a_restart_replaces_the_section_in_place_and_keeps_the_operators_lines(sim_node):
    ct = 201
    before = _exec(sim_node, ct, "cat", "/etc/hosts").out + "\n"
    try:
        _exec(sim_node, ct, "sh", "-c", "printf '10.9.9.9 mine\\n' >> /etc/hosts")
        assert pct(sim_node, "stop", str(ct)).rc == 0 and pct(sim_node, "start", str(ct)).rc == 0
        after = _exec(sim_node, ct, "cat", "/etc/hosts").out + "\n"
        assert after == before + "10.9.9.9 mine\n"  # our line kept, one PVE section, unchanged
        # an operator's own file, marked as theirs: left alone (ct_is_file_ignored)
        _exec(sim_node, ct, "sh", "-c", "printf '127.0.0.1 localhost\\n' > /etc/hosts && touch /etc/.pve-ignore.hosts")
        assert pct(sim_node, "stop", str(ct)).rc == 0 and pct(sim_node, "start", str(ct)).rc == 0
        assert _exec(sim_node, ct, "cat", "/etc/hosts").out == "127.0.0.1 localhost"
    finally:
        _exec(sim_node, ct, "rm", "-f", "/etc/.pve-ignore.hosts", "/etc/hosts")
        pct(sim_node, "stop", str(ct))
        pct(sim_node, "start", str(ct))
    assert _exec(sim_node, ct, "cat", "/etc/hosts").out + "\n" == SECTION.format(octet=201, ct=201)


def test_orphans_of_killed_processes_are_reaped_by_the_containers_init(sim_node):
    # A parent that leaves a child behind, which then dies: the child is re-parented to PID 1
    # and must not stay a zombie there (its /proc entry goes only once it is reaped).
    orphan = _exec(sim_node, 200, "python3", "-c",
                   "import os, time\n"
                   "r = os.fork()\n"
                   "if r == 0:\n"
                   "    g = os.fork()\n"
                   "    if g == 0:\n"
                   "        os.close(1); os.close(2); time.sleep(0.5); os._exit(0)\n"
                   "    print(g, flush=True); os._exit(0)\n"
                   "os.waitpid(r, 0)\n").out
    assert orphan.isdigit()
    deadline = time.monotonic() + 30
    while _exec(sim_node, 200, "test", "-e", f"/proc/{orphan}").rc == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _exec(sim_node, 200, "test", "-e", f"/proc/{orphan}").rc != 0, "the orphan stayed a zombie"
    assert "dflash-sim-init" in _exec(sim_node, 200, "cat", "/proc/1/cmdline").out


def test_posix_shared_memory_works_in_a_container(sim_node):
    # Without a tmpfs on /dev/shm (a Proxmox template's init mounts one), shm_open failed and
    # vLLM's engine core could not start in a container.
    assert _exec(sim_node, 201, "findmnt", "-n", "-o", "FSTYPE", "/dev/shm").out == "tmpfs"
    got = _exec(sim_node, 201, "python3", "-c",
                "from multiprocessing import shared_memory as s\n"
                "m = s.SharedMemory(create=True, size=1 << 20); m.buf[0] = 7\n"
                "o = s.SharedMemory(m.name); print(o.buf[0]); o.close(); m.close(); m.unlink()\n")
    assert got.rc == 0 and got.out == "7", (got.out, got.err)
