"""The node's own evidence for a death: a rank of a run in container 200 is killed, the
simulated node's kernel log holds (or does not hold) what a real kernel prints about it, and
`ctl status` and the alert `ctl watch` delivers name exactly what the log says — through the
node's own journalctl, also as a sudo user behind a bastion."""

from __future__ import annotations

import json
import os
import posixpath
import subprocess
import sys
from pathlib import Path

import pytest
from _agent_util import wait_for

from agent.protocol import new_run_id
from controller import config as cfg
from controller import kernellog
from controller.agentcall import AgentCaller
from controller.container import Container
from controller.ssh import SSHRunner
from tests._alert_receiver import Receiver, sim_notify_config

pytestmark = pytest.mark.sim

REPO = Path(__file__).resolve().parent.parent
FAKE = REPO / "tests" / "jobs" / "fake_trainer.py"
CT = 200


def oom_lines(pid: int, ctid: int = CT) -> list[str]:
    """The kernel's OOM report for a process of a Proxmox container (mm/oom_kill.c, cgroup v2)."""
    return [f"python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
            "memory: usage 4194304kB, limit 4194304kB, failcnt 2771",
            f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=ns,mems_allowed=0,oom_memcg=/lxc/{ctid},"
            f"task_memcg=/lxc/{ctid}/ns/system.slice,task=python3,pid={pid},uid=100000",
            f"Memory cgroup out of memory: Killed process {pid} (python3) total-vm:9876543kB, anon-rss:4000000kB, "
            "file-rss:0kB, shmem-rss:0kB, UID:100000 pgtables:8000kB oom_score_adj:0"]


XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_48 = ("NVRM: Xid (PCI:0000:86:00): 48, pid=5512, name=python3, An uncorrectable double bit error (DBE) has "
          "been detected on GPU in the framebuffer at partition 0, subpartition 0.")


@pytest.fixture
def receiver():
    r = Receiver(path="/hook/evidence")
    yield r
    r.down()


@pytest.fixture
def config(sim_node, tmp_path):
    path = sim_notify_config(sim_node, tmp_path / "config.toml", CT)
    sim_node.clear_kernel_log()
    yield path
    sim_node.clear_kernel_log()
    name, node = cfg.load(path).node("sim")
    with SSHRunner.for_node(name, node) as runner:
        Container(runner, name, node, CT).exec(["sh", "-c", "rm -rf /workspace/runs/evidence-* /workspace/evidence-jobs"])


def _ctl(*argv, config, env_extra=None):
    env = dict(os.environ, DFLASH_CTL_CONFIG=str(config), DFLASH_CTL_SSH_CONFIG="none", PYTHONPATH=str(REPO),
               **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", "from controller.cli import main; main()", *argv],
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=180)


def _wait(predicate, timeout, what):
    return wait_for(predicate, timeout, interval=0.3, what=what)


def _kill_a_rank(config, inject) -> str:
    """A two-rank run in container 200 whose rank 1 is killed (kill -9); ``inject(pid)`` first
    writes the node's kernel log as that moment's kernel would have. Returns the run id."""
    from controller.alertsetup import configure_run

    conf = cfg.load(config)
    name, node = conf.node("sim")
    run_id = new_run_id("evidence")
    with SSHRunner.for_node(name, node) as runner:
        ct = Container(runner, name, node, CT)
        caller = AgentCaller(ct)
        bundle = caller.ensure_bundle()
        run_dir = posixpath.join(ct.config.workspace, "runs", run_id)
        job = posixpath.join(ct.config.workspace, "evidence-jobs", "fake_trainer.py")
        ct.exec(["mkdir", "-p", posixpath.dirname(job)], check=True)
        ct.write_file(job, FAKE.read_bytes())
        ct.exec(["env", f"PYTHONPATH={bundle}", ct.config.python, "-m", "agent", "start", "--run-dir", run_dir,
                 "--", "python3", job, "--ranks", "2", "--step-time", "0.1"], check=True)
        assert configure_run(caller, ct, run_id, run_dir, say=lambda line: None)

        def rank1():
            got = ct.exec(["cat", posixpath.join(run_dir, "heartbeat", "rank-1")])
            try:
                return json.loads(got.stdout)["pid"] if got.ok else None
            except (ValueError, KeyError):
                return None
        pid = _wait(rank1, 60, "rank 1's heartbeat")
        inject(pid)
        ct.exec(["kill", "-9", str(pid)], check=True)

        def failed():
            got = ct.exec(["cat", posixpath.join(run_dir, "result.json")])
            return got.ok and '"failed"' in got.stdout
        _wait(failed, 60, "the run to fail")
    return run_id


def test_a_host_oom_kill_and_xid_79_and_48_in_the_nodes_kernel_log_are_named_in_ctl_status_and_the_alert(
        sim_node, config, receiver):
    run_id = _kill_a_rank(config, lambda pid: sim_node.kernel_log(*oom_lines(pid), XID_79, XID_48))

    status = _ctl("status", "--container", str(CT), "--run", run_id, config=config)
    assert status.returncode == 1, status.stderr  # a failed run
    out = status.stdout
    node_lines = [l for l in out.splitlines() if l.startswith("node     kernel (journalctl -k): ")]
    assert len(node_lines) == 3, out
    assert "the node's OOM killer killed pid" in node_lines[0] and f"in container {CT}" in node_lines[0]
    assert "the container's memory limit was reached (4.0 GiB used of 4.0 GiB)" in node_lines[0]
    assert f"its limit: memory 4096 MiB + swap 512 MiB (pct config {CT})" in node_lines[0]
    assert "Xid 79 on GPU PCI:0000:3b:00" in node_lines[1] and "fallen off the bus" in node_lines[1]
    assert "Xid 48 on GPU PCI:0000:86:00" in node_lines[2] and "double-bit ECC" in node_lines[2]
    assert "         | " + XID_79 in out  # the record each claim rests on

    watched = _ctl("watch", "--rounds", "1", config=config, env_extra={"ALERT_WEBHOOK_URL": receiver.url})
    assert watched.returncode == 0, watched.stderr
    # `ctl watch` follows every run of the node: earlier tests' runs may still owe alerts, and
    # it delivers them here too; this run's are the ones under test
    def of_this_run(kind):
        return [a for a in receiver.of_kind(kind) if a["run"] == run_id]

    [evidence] = of_this_run("node_evidence")
    assert evidence["run"] == run_id and evidence["container"] == str(CT)
    assert "rank_exit" in evidence["cause"] and "rank 1" in evidence["cause"]  # the failure it explains
    for named in ("OOM killer killed pid", "Xid 79", "Xid 48", "double-bit ECC"):
        assert named in evidence["cause"], evidence["cause"]
    [failed] = of_this_run("failed")
    assert evidence["details"]["refers_to"] == failed["id"] and evidence["next"] == failed["next"]
    again = _ctl("watch", "--rounds", "1", config=config, env_extra={"ALERT_WEBHOOK_URL": receiver.url})
    assert again.returncode == 0 and len(of_this_run("node_evidence")) == 1  # looked up and sent once


def test_without_a_kernel_record_neither_ctl_status_nor_the_alert_claims_an_oom_kill_or_an_xid(
        sim_node, config, receiver):
    # another container's OOM kill, at the same moment, is that container's
    run_id = _kill_a_rank(config, lambda pid: sim_node.kernel_log(*oom_lines(pid, ctid=201)))

    status = _ctl("status", "--container", str(CT), "--run", run_id, config=config)
    node_lines = [l for l in status.stdout.splitlines() if l.startswith("node ")]
    assert len(node_lines) == 1 and node_lines[0].endswith("no OOM kill, Xid or GPU reset"), status.stdout
    assert "OOM killer" not in status.stdout and "Xid" not in status.stdout.replace("no OOM kill, Xid or", "")

    watched = _ctl("watch", "--rounds", "1", config=config, env_extra={"ALERT_WEBHOOK_URL": receiver.url})
    assert watched.returncode == 0, watched.stderr
    assert [a["kind"] for a in receiver.alerts().values() if a["run"] == run_id] == ["failed"]
    assert all("OOM killer" not in a["cause"] for a in receiver.of_kind("failed") if a["run"] == run_id)


def test_a_sudo_operator_behind_a_bastion_reads_the_kernel_log_through_sudo_and_one_without_is_told_why(
        sim_node, config):
    at = sim_node.kernel_log(XID_48)
    entry = sim_node.node_config("bastion")
    entry.pop("containers")
    node = cfg.NodeConfig(**entry)
    with SSHRunner.for_node("sim", node) as runner:
        reading = kernellog.read(runner, node, at - 5, at + 5)
        assert reading.error is None and reading.source == "journalctl -k", reading
        assert [f.details["code"] for f in reading.findings] == [48]
        plain = cfg.NodeConfig(**dict(entry, sudo=False))
        refused = kernellog.read(runner, plain, at - 5, at + 5)
    assert refused.findings == [] and "shows this user no kernel messages: set sudo = true" in refused.error
    assert "dmesg: exit 1: dmesg: read kernel buffer failed: Operation not permitted" in refused.error


def test_a_launch_warns_of_an_xid_since_boot_on_a_gpu_it_names_and_not_of_one_on_another_gpu(sim_node, config):
    from controller.gpucheck import kernel_log_lines

    sim_node.kernel_log("NVRM: Xid (PCI:0000:28:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
                        "NVRM: Xid (PCI:0000:38:00): 13, pid=77, name=python3, Graphics SM Warp Exception")
    # the preflight's facts: GPU 1 of the run is the sim's second H200, bus 0x28 (sim/gpu.py)
    pf = {"device": "cuda", "roles": {"target": [0], "drafter": [1]},
          "gpu_health": {"gpus": [{"index": 0, "pci_bus_id": "00000000:18:00.0"},
                                  {"index": 1, "pci_bus_id": "00000000:28:00.0"}]}}
    name, node = cfg.load(config).node("sim")
    with SSHRunner.for_node(name, node) as runner:
        lines = kernel_log_lines(Container(runner, name, node, CT), pf)
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: GPU 1 since node sim booted: Xid 79 on GPU PCI:0000:28:00")
    assert lines[0].endswith("shows it: `journalctl -k -b | grep -i -e xid -e 'fallen off'` on node sim")
