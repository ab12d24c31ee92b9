"""The pct argv builder: one shape for every container command, nothing left to a shell."""

from __future__ import annotations

import pytest

from controller.config import ContainerConfig, NodeConfig
from controller.pct import PctUsageError, exec_argv, status_argv


def test_exec_argv_scrubs_with_keep_env_0_and_env_i():
    node = NodeConfig(host="pve", pct="/usr/sbin/pct", containers={"200": ContainerConfig(venv="/opt/v", home="/home/t")})
    argv = exec_argv(node, 200, ["python3", "-c", "print(1)"], env={"PYTHONPATH": "/b"})
    assert argv == ["/usr/sbin/pct", "exec", "200", "--keep-env", "0", "--", "env", "-i", "--",
                    "PATH=/opt/v/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "HOME=/home/t", "LANG=C.UTF-8", "PYTHONPATH=/b", "python3", "-c", "print(1)"]


def test_hostile_arguments_stay_single_arguments():
    node = NodeConfig(host="pve")
    weird = ["echo", "$(id)", "`id`", "*", "a b", "", "new\nline", "-n", "ünï"]
    assert exec_argv(node, 201, weird)[-len(weird):] == weird


@pytest.mark.parametrize("argv, env, words", [
    (["A=b", "x"], None, "contains '='"),
    ([], None, "no command"),
    (["echo", "nul\0"], None, "NUL"),
    (["true"], {"BAD NAME": "x"}, "not a valid shell name"),
])
def test_commands_that_cannot_be_built_safely_are_refused(argv, env, words):
    with pytest.raises(PctUsageError, match=words):
        exec_argv(NodeConfig(host="pve"), 200, argv, env=env)


def test_status_argv():
    assert status_argv(NodeConfig(host="pve"), 200) == ["pct", "status", "200"]
