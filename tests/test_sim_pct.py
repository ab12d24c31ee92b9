"""The simulated Proxmox node behaves like the real one where the product touches it: a
polluted root login over real SSH, and `pct` with Proxmox's output, messages and exit codes
over real LXC containers (docs/sim.md lists each behaviour and its source).

Read-only checks use the shared ``sim_node`` (containers 200/201). Anything that stops,
rolls back or tears down uses a node of this module's own (``simtest``, containers 290 on
btrfs and 291 on dir storage), so that other test sessions on the machine, which share
``sim``, are never disturbed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from sim.node import SimNode
from sim.sshd import NOISE_PREFIX, POLLUTED_PATH_PREFIX

pytestmark = pytest.mark.sim

OWN_NODE = "simtest"
OWN_CTIDS = (290, 291)  # 290: btrfs (snapshots), 291: dir (no snapshots)
PERL_VARS = ("PERL5LIB", "PERL_MB_OPT", "PERL_MM_OPT", "JAVA_HOME")


class Reply:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.rc = proc.returncode
        lines = proc.stdout.splitlines()
        self.noise = [line for line in lines if line.startswith(NOISE_PREFIX)]
        self.out = "\n".join(line for line in lines if not line.startswith(NOISE_PREFIX))
        self.err = proc.stderr.strip()

    def env(self) -> dict[str, str]:
        return dict(line.split("=", 1) for line in self.out.splitlines() if "=" in line)


def ssh(node: SimNode, argv: list[str]) -> Reply:
    """One command on the node through the real sshd; argv is quoted for the login shell."""
    c = node.node_config()
    cmd = ["ssh", "-F", "/dev/null", "-p", str(c["port"]), "-i", c["identity_file"],
           "-o", f"UserKnownHostsFile={c['known_hosts']}", "-o", "StrictHostKeyChecking=yes",
           "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR",
           f"{c['user']}@{c['host']}", shlex.join(argv)]
    return Reply(subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL))


def pct(node: SimNode, *args: str) -> Reply:
    return ssh(node, ["pct", *args])


@pytest.fixture(scope="module")
def own_node():
    if os.geteuid() != 0:
        pytest.skip("the simulated node needs root")
    node = SimNode(OWN_NODE, ctids=OWN_CTIDS)
    node.up()
    yield node
    node.down()


@pytest.fixture
def snap_ct(own_node):
    """The btrfs container, running; every snapshot a test made is deleted afterwards."""
    ct = str(OWN_CTIDS[0])
    if pct(own_node, "status", ct).out != "status: running":
        assert pct(own_node, "start", ct).rc == 0
    yield ct
    conf = own_node.paths.pve_conf(OWN_CTIDS[0]).read_text()
    for line in conf.splitlines():
        if line.startswith("["):
            pct(own_node, "delsnapshot", ct, line.strip("[]"))
    if pct(own_node, "status", ct).out != "status: running":
        pct(own_node, "start", ct)


def snapname() -> str:
    return "t" + uuid.uuid4().hex[:8]


# --- the login ----------------------------------------------------------------------------
def test_login_is_polluted_like_the_incident_host_and_pct_is_on_path(sim_node):
    r = ssh(sim_node, ["sh", "-c", 'echo "PATH=$PATH"; env; command -v pct'])
    assert r.rc == 0
    assert r.noise, ".bashrc must print a line of noise to stdout"
    env = r.env()
    assert env["PATH"].startswith(POLLUTED_PATH_PREFIX + ":")
    for var in PERL_VARS:
        assert var in env
    pct_path = r.out.splitlines()[-1]
    assert pct_path == str(sim_node.paths.pct)
    entries = env["PATH"].split(":")
    assert entries.index(str(sim_node.paths.bin)) > entries.index("/root/perl5/bin")


# --- list / status / unknown ids ------------------------------------------------------------
def test_pct_list_prints_proxmox_table_of_both_containers(sim_node):
    r = pct(sim_node, "list")
    assert r.rc == 0
    lines = r.out.splitlines()
    assert lines[0].split() == ["VMID", "Status", "Lock", "Name"]
    assert lines[0] == "%-10s %-10s %-12s %-20s" % ("VMID", "Status", "Lock", "Name")
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["200"] == ["200", "running", "sim-ct200"]
    assert rows["201"] == ["201", "running", "sim-ct201"]


def test_pct_status_prints_status_line_and_verbose_keys_sorted(sim_node):
    r = pct(sim_node, "status", "200")
    assert (r.rc, r.out) == (0, "status: running")
    verbose = pct(sim_node, "status", "200", "--verbose")
    keys = [line.split(":", 1)[0] for line in verbose.out.splitlines()]
    assert keys == sorted(keys)
    fields = dict(line.split(": ", 1) for line in verbose.out.splitlines())
    assert fields["status"] == "running" and fields["vmid"] == "200" and int(fields["pid"]) > 1


def test_unknown_container_is_refused_with_proxmox_message_and_exit_255(sim_node):
    for args in (["status", "999"], ["exec", "999", "--", "true"], ["snapshot", "999", "x1"], ["config", "999"]):
        r = pct(sim_node, *args)
        assert r.rc == 255, args
        assert r.err == "Configuration file 'nodes/sim/lxc/999.conf' does not exist", args


def test_bad_arguments_exit_255_with_usage(sim_node):
    r = pct(sim_node, "status")
    assert r.rc == 255 and "400 not enough arguments" in r.err and "USAGE: pct status" in r.err
    r = pct(sim_node, "frobnicate")
    assert r.rc == 255 and "unknown command 'pct frobnicate'" in r.err


def test_a_vmid_is_checked_as_pve_common_checks_it(sim_node):
    """PVE/JSONSchema.pm: the integer type check, then the pve-vmid format [1-9][0-9]{2,8} —
    before the schema's minimum 100 and maximum 999999999 are ever reached (the sim said
    "value must have a minimum value of 100" for 5, and took -5 for a type error)."""
    for vmid in ("5", "-5", "0200", "+200", "1000000000", "99"):
        r = pct(sim_node, "exec", vmid, "--", "true")
        assert r.rc == 255 and "400 Parameter verification failed." in r.err, vmid
        assert "vmid: invalid format - value does not look like a valid VM ID" in r.err, (vmid, r.err)
    r = pct(sim_node, "status", "abc")
    assert r.rc == 255 and "vmid: type check ('integer') failed - got 'abc'" in r.err, r.err
    r = pct(sim_node, "status", "999999999")  # the largest id there can be: well formed, absent
    assert r.rc == 255 and r.err == "Configuration file 'nodes/sim/lxc/999999999.conf' does not exist"


# --- exec ------------------------------------------------------------------------------------
def test_exec_keeps_the_callers_environment_by_default(sim_node):
    r = pct(sim_node, "exec", "200", "--", "env")
    assert r.rc == 0
    env = r.env()
    assert "SSH_CONNECTION" in env and "SSH_CLIENT" in env
    for var in PERL_VARS:
        assert var in env, var
    assert env["container"] == "lxc"
    # Real pct resets PATH in its CLI handler (taint mode), so only PATH does not leak.
    assert env["PATH"] == "/sbin:/bin:/usr/sbin:/usr/bin"


def test_exec_keep_env_0_gives_lxc_clean_environment(sim_node):
    r = pct(sim_node, "exec", "200", "--keep-env", "0", "--", "env")
    assert r.rc == 0
    env = r.env()
    assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert not any(k.startswith("SSH_") for k in env)
    assert not any(k in env for k in PERL_VARS)
    assert env["container"] == "lxc" and env["TERM"] == "linux"


def test_exec_passes_argv_without_a_shell_and_returns_the_exit_code(sim_node):
    tricky = "a b $HOME 'q' \"d\" ;|&"
    r = pct(sim_node, "exec", "200", "--", "python3", "-c", "import sys; print(sys.argv[1])", tricky)
    assert (r.rc, r.out) == (0, tricky)
    r = pct(sim_node, "exec", "200", "--", "sh", "-c", "exit 7")
    assert r.rc == 7


def test_exec_runs_inside_the_container_with_the_venv(sim_node):
    r = pct(sim_node, "exec", "201", "--keep-env", "0", "--", "/root/venv/bin/python", "-c",
            "import socket, safetensors, numpy, transformers; print(socket.gethostname())")
    assert (r.rc, r.out) == (0, "sim-ct201")
    assert pct(sim_node, "exec", "201", "--", "test", "-d", "/workspace").rc == 0


def test_exec_on_stopped_container_is_refused_with_proxmox_message(own_node):
    ct = str(OWN_CTIDS[1])
    assert pct(own_node, "stop", ct).rc == 0
    try:
        assert pct(own_node, "status", ct).out == "status: stopped"
        r = pct(own_node, "exec", ct, "--", "true")
        assert r.rc == 255
        assert r.err == f"container '{ct}' not running!"
        r = pct(own_node, "stop", ct)
        assert (r.rc, r.err) == (255, f"CT {ct} not running")
    finally:
        assert pct(own_node, "start", ct).rc == 0
    r = pct(own_node, "start", ct)
    assert (r.rc, r.err) == (255, f"CT {ct} already running")


# --- snapshots ---------------------------------------------------------------------------------
def test_snapshot_on_snapshot_storage_then_duplicate_name_is_refused(own_node, snap_ct):
    name = snapname()
    r = pct(own_node, "snapshot", snap_ct, name, "--description", "before the upgrade")
    assert r.rc == 0, r.err
    r = pct(own_node, "snapshot", snap_ct, name)
    assert (r.rc, r.err) == (255, f"snapshot name '{name}' already used")
    conf = pct(own_node, "config", snap_ct).out
    assert f"parent: {name}" in conf.splitlines()


def test_snapshot_on_directory_storage_is_refused_like_proxmox(own_node):
    r = pct(own_node, "snapshot", str(OWN_CTIDS[1]), snapname())
    assert (r.rc, r.err) == (255, "snapshot feature is not available")
    assert pct(own_node, "listsnapshot", str(OWN_CTIDS[1])).out.split() == ["`->", "current", "You", "are", "here!"]


def test_rollback_restores_files_and_hard_stops_a_running_container(own_node, snap_ct):
    name = snapname()
    # /root/new is removed first: the node outlives sessions, and one cut off mid-test may have left it.
    assert pct(own_node, "exec", snap_ct, "--", "sh", "-c", "echo before > /root/marker; rm -f /root/new").rc == 0
    assert pct(own_node, "snapshot", snap_ct, name).rc == 0
    assert pct(own_node, "exec", snap_ct, "--", "sh", "-c", "echo after > /root/marker; touch /root/new").rc == 0
    # A process that would survive a graceful stop must not matter: rollback kills.
    pct(own_node, "exec", snap_ct, "--", "sh", "-c", "trap '' TERM; sleep 600 >/dev/null 2>&1 & exit 0")
    r = pct(own_node, "rollback", snap_ct, name)
    assert r.rc == 0, r.err
    assert pct(own_node, "status", snap_ct).out == "status: stopped"
    assert pct(own_node, "start", snap_ct).rc == 0
    assert pct(own_node, "exec", snap_ct, "--", "cat", "/root/marker").out == "before"
    assert pct(own_node, "exec", snap_ct, "--", "test", "-e", "/root/new").rc == 1


def test_rollback_with_start_1_restarts_the_container(own_node, snap_ct):
    name = snapname()
    assert pct(own_node, "snapshot", snap_ct, name).rc == 0
    assert pct(own_node, "rollback", snap_ct, name, "--start", "1").rc == 0
    assert pct(own_node, "status", snap_ct).out == "status: running"
    r = pct(own_node, "rollback", snap_ct, "nosuchsnap")
    assert (r.rc, r.err) == (255, "snapshot 'nosuchsnap' does not exist")


def test_listsnapshot_prints_the_tree_with_current_last(own_node, snap_ct):
    first, second = snapname(), snapname()
    assert pct(own_node, "snapshot", snap_ct, first, "--description", "first one").rc == 0
    assert pct(own_node, "snapshot", snap_ct, second).rc == 0
    lines = pct(own_node, "listsnapshot", snap_ct).out.splitlines()
    assert [line.split()[:2] for line in lines] == [["`->", first], ["`->", second], ["`->", "current"]]
    assert lines[0].startswith("`-> ") and lines[1].startswith(" `-> ") and lines[2].startswith("  `-> ")
    assert lines[0].endswith("first one") and lines[1].endswith("no-description")
    assert lines[2].endswith("You are here!")
    # print_snapshot_tree's columns: name padded to 30 - len(prefix), time to 23.
    assert lines[0][4:4 + 30 - 3].rstrip() == first


def test_delsnapshot_removes_it_and_reparents_the_children(own_node, snap_ct):
    first, second = snapname(), snapname()
    assert pct(own_node, "snapshot", snap_ct, first).rc == 0
    assert pct(own_node, "snapshot", snap_ct, second).rc == 0
    assert pct(own_node, "delsnapshot", snap_ct, first).rc == 0
    lines = pct(own_node, "listsnapshot", snap_ct).out.splitlines()
    assert [line.split()[1] for line in lines] == [second, "current"]
    snap_dirs = [p.name for p in own_node.paths.rootfs(OWN_CTIDS[0], "local-btrfs").parent.iterdir()]
    assert not any(d.endswith("@" + first) for d in snap_dirs)
    r = pct(own_node, "delsnapshot", snap_ct, first)
    assert (r.rc, r.err) == (255, f"snapshot '{first}' does not exist")


# --- push / pull ------------------------------------------------------------------------------
def test_push_then_pull_round_trips_bytes_and_perms(sim_node, tmp_path):
    src = tmp_path / "payload.bin"
    src.write_bytes(bytes(range(256)) * 64)
    dest_in_ct = f"/tmp/sim-push-{uuid.uuid4().hex[:8]}"
    back = tmp_path / "back.bin"
    try:
        assert pct(sim_node, "push", "200", str(src), dest_in_ct, "--perms", "0640").rc == 0
        assert pct(sim_node, "exec", "200", "--", "stat", "-c", "%a", dest_in_ct).out == "640"
        assert pct(sim_node, "pull", "200", dest_in_ct, str(back)).rc == 0
        assert back.read_bytes() == src.read_bytes()
    finally:
        pct(sim_node, "exec", "200", "--", "rm", "-f", dest_in_ct)
    r = pct(sim_node, "pull", "200", "/nonexistent/file", str(tmp_path / "x"))
    assert r.rc == 255 and "failed to open /nonexistent/file" in r.err


# --- lifecycle ---------------------------------------------------------------------------------
def test_up_twice_is_harmless(sim_node):
    before = sim_node.status()
    info = sim_node.up()
    after = sim_node.status()
    assert info["cold"] is False
    assert after["sshd"] == before["sshd"]
    assert all(c["state"] == "running" for c in after["containers"].values())
    assert pct(sim_node, "status", "200").out == "status: running"


def _leftovers(node: SimNode) -> dict:
    root = str(node.paths.root)
    mounts = [line for line in Path("/proc/mounts").read_text().splitlines() if root in line]
    loops = [line for line in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines()
             if root in line]
    procs = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if root in cmdline:
            procs.append(f"{pid}: {cmdline}")
    return {"mounts": mounts, "loop devices": loops, "processes": procs}


def test_down_leaves_nothing_running_mounted_or_attached_and_up_again_reuses_the_cache(own_node):
    assert own_node.is_up()
    assert any(_leftovers(own_node).values())  # the scan does see a live node
    own_node.down()
    assert _leftovers(own_node) == {"mounts": [], "loop devices": [], "processes": []}
    assert not own_node.status()["sshd"]["running"]
    own_node.down()  # twice is harmless too
    info = own_node.up()
    assert info["cold"] is False
    assert own_node.is_up()
    assert pct(own_node, "list").rc == 0


# --- ctl sim ---------------------------------------------------------------------------------
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]


def test_ctl_sim_up_writes_the_node_into_the_controller_config_and_status_reports_it(sim_node, tmp_path):
    import tomllib

    conf_file = tmp_path / "config.toml"
    up = subprocess.run([*CTL, "sim", "up", "--config", str(conf_file)], capture_output=True, text=True, timeout=600)
    assert up.returncode == 0, up.stderr
    conf = tomllib.loads(conf_file.read_text())
    assert conf["default_node"] == "sim"
    entry = conf["nodes"]["sim"]
    expected = sim_node.node_config()
    for key in ("host", "port", "user", "identity_file", "known_hosts"):
        assert entry[key] == expected[key], key
    assert {k: (v["venv"], v["workspace"]) for k, v in entry["containers"].items()} == {
        "200": ("/root/venv", "/workspace"), "201": ("/root/venv", "/workspace")}
    status = subprocess.run([*CTL, "sim", "status"], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    assert "sshd: running" in status.stdout
    assert "CT 200: running (local-btrfs" in status.stdout and "CT 201: running (local)" in status.stdout
