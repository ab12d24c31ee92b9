"""The pct argv builder: one shape for every container command, nothing left to a shell."""

from __future__ import annotations

import pytest

from controller.config import ContainerConfig, NodeConfig
from controller.pct import PctUsageError, argv, exec_argv, pct_exec_argv


def test_exec_argv_scrubs_with_keep_env_0_and_env_i():
    node = NodeConfig(host="pve", pct="/usr/sbin/pct", containers={"200": ContainerConfig(venv="/opt/v", home="/home/t")})
    built = pct_exec_argv(node, 200, ["python3", "-c", "print(1)"], env={"PYTHONPATH": "/b"})
    assert built == ["/usr/sbin/pct", "exec", "200", "--keep-env", "0", "--", "env", "-i", "--",
                    "PATH=/opt/v/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME=/home/t", "LANG=C.UTF-8", "PYTHONPATH=/b", "python3", "-c", "print(1)"]


def test_hostile_arguments_stay_single_arguments():
    node = NodeConfig(host="pve")
    weird = ["echo", "$(id)", "`id`", "*", "a b", "", "new\nline", "-n", "ünï"]
    assert pct_exec_argv(node, 201, weird)[-len(weird):] == weird


@pytest.mark.parametrize("argv, env, words", [
    (["A=b", "x"], None, "contains '='"),
    ([], None, "no command"),
    (["echo", "nul\0"], None, "NUL"),
    (["true"], {"BAD NAME": "x"}, "not a valid shell name"),
])
def test_commands_that_cannot_be_built_safely_are_refused(argv, env, words):
    with pytest.raises(PctUsageError, match=words):
        exec_argv(NodeConfig(host="pve"), 200, argv, env=env)


def test_pct_before_keep_env_gets_no_such_option_and_the_same_env_i():
    """pve-container < 5.0.9 (PVE 8.1 and older) refuses --keep-env: the option is left out,
    and env -i still gives the same clean environment."""
    node = NodeConfig(host="pve")
    old = pct_exec_argv(node, 200, ["true"], keep_env=False)
    new = pct_exec_argv(node, 200, ["true"])
    assert "--keep-env" not in old
    assert old[old.index("--"):] == new[new.index("--"):]


def test_sudo_prefixes_every_pct_command():
    node = NodeConfig(host="pve", user="ops", sudo=True, pct="/usr/sbin/pct")
    assert argv(node, "status", "200") == ["sudo", "-n", "--", "/usr/sbin/pct", "status", "200"]
    assert pct_exec_argv(node, 200, ["true"])[:5] == ["sudo", "-n", "--", "/usr/sbin/pct", "exec"]


def test_the_node_decides_keep_env_and_the_argv_arrives_whole(tmp_path):
    """exec_argv: a fixed script on the node asks dpkg for pve-container and
    drops `--keep-env 0` where it predates the option or is unknown, as on this machine (no
    Proxmox here); every other argument reaches pct byte for byte, hostile ones included."""
    import json
    import subprocess

    known = subprocess.run(["dpkg-query", "-W", "pve-container"], capture_output=True)
    if known.returncode == 0:
        pytest.skip("this machine's dpkg has pve-container: the option would be kept")
    echo = tmp_path / "pct"  # prints the argv it got, as hex: byte-exact
    echo.write_text("#!/usr/bin/python3\nimport json, os, sys\n"
                    "print(json.dumps([os.fsencode(a).hex() for a in sys.argv[1:]]))\n")
    echo.chmod(0o755)
    node = NodeConfig(host="pve", pct=str(echo))
    weird = ["echo", "$(id)", "`id`", "*", "a b", "", "new\nline", "-n", "ünï", "--keep-env", "0", "--"]
    from controller.transport import LocalRunner

    result = LocalRunner().run(exec_argv(node, 200, weird), check=True)
    got = [bytes.fromhex(h).decode() for h in json.loads(result.stdout)]
    assert got == pct_exec_argv(node, 200, weird, keep_env=False)[1:]
