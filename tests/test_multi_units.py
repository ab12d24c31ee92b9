"""Pure pieces of a job across containers: forming the job (target-first node ranks), the
agent's peer/network classification of gloo errors, the job verdict's root cause, and the
global rank a merged tail puts on a container's line."""

import pytest

from agent.classify import classify_event
from controller import job as J
from controller.jobview import label_record, rank_bases

GLOO_RESET = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.77.0.45]:63108: "
              "Connection reset by peer. This is typically caused by a remote worker hanging")
GLOO_TIMEOUT = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "20000ms for recv operation to complete")


def test_containers_are_ordered_target_first_whatever_order_they_are_named_in():
    members = J.plan(["sim2:301", "sim:200", "sim:201"], "sim:200=0,1", "sim2:301=0;sim:201=0", None)
    assert [m.label for m in members] == ["sim:200", "sim2:301", "sim:201"]
    assert J.layout(members) == "2+0,0+1,0+1"
    mixed = J.plan(["sim:201", "sim:200"], "sim:200=0", "sim:200=1;sim:201=0", None)
    assert [m.label for m in mixed] == ["sim:200", "sim:201"] and J.layout(mixed) == "1+1,0+1"


@pytest.mark.parametrize("containers,targets,drafters,message", [
    (["sim:200", "sim:201"], "sim:200=0", None, "sim:201 has no GPU role"),
    (["sim:200", "sim:201"], "sim:200=0;sim:202=0", "sim:201=0", "not a --container of the job"),
    (["sim:200", "sim:201"], "sim:200=0;sim:201=0", "sim:200=0;sim:201=1", "either colocated"),
    (["sim:200", "sim:201"], "sim:200=0;sim:201=0", "sim:200=1;sim:201=1", "at most one container"),
    (["200x"], "sim:200=0", None, "--container 200x: not a Proxmox VMID"),
    (["sim:200", "sim:5"], "sim:200=0", None, "--container sim:5: not a Proxmox VMID"),  # before sim:5's roles
    (["x:"], "sim:200=0", None, "not a Proxmox VMID"),
])
def test_a_job_that_cannot_keep_target_first_rank_order_is_refused(containers, targets, drafters, message):
    with pytest.raises(J.JobError, match=message):
        J.plan(containers, targets, drafters, "sim")


def test_the_agent_names_a_lost_peer_and_a_silent_network_apart():
    peer = classify_event({"kind": "error", "error": "exception", "rank": 0, "gpu": 0, "message": GLOO_RESET})
    assert peer.kind == "peer_failure" and peer.details["peer"] == "10.77.0.45" and "peer failure" in peer.reason
    net = classify_event({"kind": "error", "error": "exception", "rank": 1, "gpu": 0, "message": GLOO_TIMEOUT})
    assert net.kind == "network_failure" and net.details == {"timeout_ms": 20000, "op": "recv"}
    other = classify_event({"kind": "error", "error": "exception", "rank": 1, "message": "ValueError: bad shape"})
    assert other.kind == "rank_exit"


def _reply(state, kind=None, rank=None, ts=0.0):
    cause = {"kind": kind, "rank": rank, "reason": f"{kind} reason", "ts": ts} if kind else None
    return {"status": {"state": state}, "result": {"root_cause": cause} if cause else None}


def test_the_job_root_cause_is_the_real_failure_not_the_peers_that_lost_it():
    a, b, c = J.Member("sim", "200", (0,)), J.Member("sim", "201", (), (0,)), J.Member("sim2", "300", (), (0,))
    # the peer failure in 200 was seen first, but the root cause is the killed rank in 201
    v = J.job_verdict([(a, _reply("failed", "peer_failure", 0, ts=1.0)), (b, _reply("failed", "host_oom", 1, ts=2.0)),
                       (c, _reply("running"))])
    assert v["state"] == "failed" and (v["root_cause"]["container"], v["root_cause"]["rank"]) == ("sim:201", 1)
    # only communication failures: a network failure outranks a peer failure
    v = J.job_verdict([(a, _reply("failed", "peer_failure", 0, ts=1.0)), (b, _reply("failed", "network_failure", 1, 5.0))])
    assert v["root_cause"]["kind"] == "network_failure"
    assert J.job_verdict([(a, _reply("completed")), (b, _reply("completed"))])["state"] == "completed"


def test_a_merged_line_carries_its_global_rank():
    members = [J.Member("sim", "200", (0, 1)), J.Member("sim2", "300", (), (0,))]
    bases = rank_bases(members)
    assert bases == {"sim:200": 0, "sim2:300": 2}
    rec = label_record({"kind": "log", "ts": 1.0, "payload": {"line": "[local1]:step 3", "rank": 1}},
                       members[0], bases["sim:200"])
    assert (rec["node"], rec["container"], rec["payload"]["rank"], rec["payload"]["line"]) == ("sim", "200", 1, "step 3")
    rec = label_record({"kind": "log", "ts": 1.0, "payload": {"line": "[local0]:step 3", "rank": 0}},
                       members[1], bases["sim2:300"])
    assert rec["payload"]["rank"] == 2
