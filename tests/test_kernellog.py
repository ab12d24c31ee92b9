"""The node's kernel log as the controller reads it (controller/kernellog.py): journalctl's
JSON and short-iso lines and dmesg's iso lines, in the formats real nodes print, and what is
(and is not) named from them."""

from __future__ import annotations

import json
from datetime import datetime

from controller import kernellog
from controller.kernellog import XID, findings, parse_journal_json, parse_text

# The kernel's own OOM report for a process of container 200 (mm/oom_kill.c, cgroup v2 on
# Proxmox VE 8: the container's processes under /lxc/200/ns/…), as `journalctl -k -o short-iso`
# (systemd 252) prints it.
OOM_SHORT_ISO = """\
2026-12-05T19:41:04+0000 pve1 kernel: python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0
2026-12-05T19:41:04+0000 pve1 kernel: memory: usage 4194304kB, limit 4194304kB, failcnt 2771
2026-12-05T19:41:04+0000 pve1 kernel: swap: usage 524288kB, limit 524288kB, failcnt 0
2026-12-05T19:41:04+0000 pve1 kernel: Memory cgroup stats for /lxc/200:
2026-12-05T19:41:04+0000 pve1 kernel: oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=ns,mems_allowed=0,oom_memcg=/lxc/200,task_memcg=/lxc/200/ns/system.slice/dflash.service,task=python3,pid=48121,uid=100000
2026-12-05T19:41:04+0000 pve1 kernel: Memory cgroup out of memory: Killed process 48121 (python3) total-vm:9876543kB, anon-rss:4000000kB, file-rss:0kB, shmem-rss:0kB, UID:100000 pgtables:8000kB oom_score_adj:0
"""

# The NVIDIA driver's Xid lines as `dmesg --time-format iso` prints them (the format checked
# on an H200 node: "2026-12-05T19:41:04,842881+00:00 NVRM: …").
XID_DMESG = """\
2026-12-05T19:42:10,120001+00:00 NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
2026-12-05T19:42:10,120200+00:00 NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.
2026-12-05T19:43:00,000000+00:00 NVRM: Xid (PCI:0000:86:00): 48, pid=5512, name=python3, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.
2026-12-05T19:43:30,500000+00:00 NVRM: Xid (PCI:0000:86:00): 13, pid=5512, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address
"""


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_a_host_oom_kill_of_container_200_is_named_with_its_limit_and_the_lines_it_rests_on():
    records = parse_text(OOM_SHORT_ISO)
    assert records[0].ts == _ts("2026-12-05T19:41:04+00:00")
    [f] = findings(records, ctid="200")
    assert f.kind == "host_oom"
    assert "killed pid 48121 (python3) in container 200" in f.summary
    assert "the container's memory limit was reached (4.0 GiB used of 4.0 GiB)" in f.summary
    assert f.details["constraint"] == "CONSTRAINT_MEMCG" and f.details["cgroup_limit_kib"] == 4194304
    assert any(r.startswith("oom-kill:constraint=CONSTRAINT_MEMCG") for r in f.records)
    assert any("Killed process 48121" in r for r in f.records)


def test_an_oom_kill_of_another_container_or_with_no_cgroup_in_the_log_is_not_claimed():
    assert findings(parse_text(OOM_SHORT_ISO), ctid="201") == []
    bare = "2026-12-05T19:41:04+0000 pve1 kernel: Out of memory: Killed process 7 (python3) total-vm:1kB, anon-rss:1kB"
    assert findings(parse_text(bare), ctid="200") == []  # which container? the line does not say


def test_the_node_running_out_of_memory_is_told_apart_from_the_containers_limit():
    text = ("2026-12-05T19:41:04+00:00 pve1 kernel: oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,"
            "mems_allowed=0-1,global_oom,task_memcg=/lxc/200/ns/user.slice,task=python3,pid=9,uid=100000\n"
            "2026-12-05T19:41:04+00:00 pve1 kernel: Out of memory: Killed process 9 (python3) total-vm:1kB, "
            "anon-rss:2097152kB, file-rss:0kB\n")
    [f] = findings(parse_text(text), ctid="200")  # systemd >= 254's "+00:00" offset too
    assert "the node itself ran out of memory" in f.summary and "2.0 GiB resident" in f.summary


def test_xid_lines_are_named_by_code_with_their_meaning_and_a_fallen_off_gpu_once():
    found = findings(parse_text(XID_DMESG))
    assert [(f.kind, f.details.get("code")) for f in found] == [("xid", 79), ("xid", 48), ("xid", 13)]
    assert found[0].records == ("NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen "
                                "off the bus.",)
    assert "Xid 79 on GPU PCI:0000:3b:00" in found[0].summary and "fallen off the bus" in found[0].summary
    assert "needs a reset" in found[0].summary
    assert "(pid 5512 python3)" in found[1].summary and "double-bit ECC" in found[1].summary
    assert "usually the program" in found[2].summary and "needs a reset" not in found[2].summary
    assert found[0].ts == _ts("2026-12-05T19:42:10.120001+00:00")


def test_the_xid_table_is_the_one_home_of_every_code_the_issue_names():
    for code in (13, 31, 43, 48, 63, 64, 79, 92, 94, 95, 119, 120):
        assert XID[code].code == code and XID[code].meaning
    assert {c for c, x in XID.items() if x.cause == "application"} == {13, 31, 43}
    assert "not in dflash-ctl's table" in kernellog.xid_meaning(999)


def test_journalctl_json_records_with_a_byte_array_message_are_read():
    lines = [json.dumps({"__REALTIME_TIMESTAMP": "1764963730120001", "_TRANSPORT": "kernel",
                         "MESSAGE": "NVRM: Xid (PCI:0000:3b:00): 95, pid=77, name=python3, Uncontained: FBHUB."}),
             json.dumps({"__REALTIME_TIMESTAMP": "1764963731000000", "MESSAGE": list(b"NVRM: GPU0 nvCheckOkFailedNoLog: "
                                                                                   b"Check failed: Reset required "
                                                                                   b"[NV_ERR_RESET_REQUIRED] \xff")}),
             "-- No entries --"]
    records = parse_journal_json("\n".join(lines))
    assert [r.ts for r in records] == [1764963730.120001, 1764963731.0]
    kinds = [(f.kind, f.details.get("code")) for f in findings(records)]
    assert kinds == [("xid", 95), ("gpu_reset", None)]


def test_a_kernel_log_without_a_record_of_the_kind_claims_nothing():
    text = ("2026-12-05T19:41:04,000000+00:00 NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04\n"
            "2026-12-05T19:41:05,000000+00:00 NVRM: Persistence mode is deprecated and will be removed in a future "
            "release. Please use nvidia-persistenced instead.\n"
            "2026-12-05T19:41:06,000000+00:00 eth0: link up\n")
    assert findings(parse_text(text), ctid="200") == []
    reading = kernellog.Reading(0.0, 60.0, "journalctl -k", [])
    assert reading.lines()[0].endswith("no OOM kill, Xid or GPU reset")


def test_the_window_spans_the_ranks_last_sign_of_life_to_just_after_the_failure():
    cause = {"kind": "rank_stall", "ts": 1000.0, "details": {"last_heartbeat": 400.0}}
    assert kernellog.window(cause) == (400.0 - kernellog.BEFORE_S, 1000.0 + kernellog.AFTER_S)
    assert kernellog.window({"kind": "throughput_regression", "ts": 1000.0}) is None
