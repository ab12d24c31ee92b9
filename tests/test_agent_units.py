"""The agent's pure parts: OOM arithmetic, rank prefixes, the state store, argv rewriting,
stream recovery after a torn append, line tailing."""

from __future__ import annotations

import json
import os

import pytest

from agent.capture import LineTail
from agent.classify import (Failure, LineClassifier, StallMonitor, ThroughputMonitor, classify_event,
                            exit_failure, parse_cuda_oom, root_cause, split_rank)
from agent.protocol import RunState
from agent.state import StateStore, TerminalStateError
from agent.stream import StreamWriter, follow
from agent.supervisor import resume_argv

NEW_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 6 has a total capacity "
           "of 79.19 GiB of which 1.09 GiB is free. Including non-PyTorch memory, this process has 78.09 GiB memory in use.")
OLD_OOM = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 7.93 GiB total capacity; "
           "6.98 GiB already allocated; 4.56 MiB free; 7.21 GiB reserved in total by PyTorch)")


def test_cuda_oom_shortfall_from_torch_2_message():
    info = parse_cuda_oom(NEW_OOM)
    assert info["gpu"] == 6 and info["tried_mib"] == 1536.0
    assert info["short_mib"] == 420  # 1536 − 1116.16 = 419.84 → 420
    assert round(info["total_mib"]) == 81091


def test_cuda_oom_shortfall_from_torch_1_message():
    info = parse_cuda_oom(OLD_OOM)
    assert info["gpu"] == 0 and info["tried_mib"] == 20.0 and info["free_mib"] == 4.56
    assert info["short_mib"] == 16


def test_classifier_names_rank_gpu_and_shortfall_from_a_prefixed_line():
    c = LineClassifier()
    c.feed("[rank3]: Traceback (most recent call last):")
    f = c.feed("[rank3]: " + NEW_OOM.replace("GPU 6", "GPU 3"))
    assert f.kind == "cuda_oom" and f.rank == 3 and f.gpu == 3
    assert f.reason == "CUDA OOM on GPU 3, short by 420 MiB (rank 3)"
    assert c.had_traceback(3) and not c.had_traceback(2)


def test_split_rank_understands_torch_and_torchrun_prefixes():
    assert split_rank("[rank3]: hello") == (3, "hello")
    assert split_rank("[default12]:x") == (12, "x")
    assert split_rank("plain line") == (None, "plain line")


def test_torchrun_failure_line_gives_the_signal_of_a_worker():
    c = LineClassifier()
    c.feed("torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 2 "
           "(pid: 4242) of binary: /usr/bin/python3")
    assert c.exit_by_rank[2]["signal"] == 9 and c.exit_by_pid[4242]["signal_name"] == "SIGKILL"


def test_sigkill_is_host_oom_only_with_the_cgroups_evidence():
    f = exit_failure(1, 10, 1, {"signal": 9, "signal_name": "SIGKILL"}, False, [])
    assert f.kind == "rank_exit" and f.reason == "rank 1 (pid 10, GPU 1) killed by signal 9 (not by us)"
    assert exit_failure(1, 10, 1, {"signal": 9, "signal_name": "SIGKILL"}, True, []).kind == "rank_exit"
    f = exit_failure(1, 10, 1, {"exit_code": 1}, True, [], oom={"cgroup_oom_kills": 1, "host_oom_kills": 1})
    assert f.kind == "host_oom" and "oom_kill counter +1" in f.reason
    # the kernel's counter alone (no cgroup visible): only a SIGKILL, and only "possibly"
    host = {"cgroup_oom_kills": None, "host_oom_kills": 1}
    assert exit_failure(1, 10, 1, {"exit_code": 1}, True, [], oom=host).kind == "rank_exit"
    f = exit_failure(1, 10, 1, {"signal": 9}, False, [], oom=host)
    assert f.kind == "host_oom" and "possibly the host's OOM killer" in f.reason and f.details["suspected"]


def test_root_cause_is_the_earliest_and_collateral_deaths_count_later():
    first = Failure("cuda_oom", "a", ts=100.0)
    later = Failure("nccl_timeout", "b", ts=101.0)
    assert root_cause([later, first]) is first
    known = exit_failure(2, 1, 2, {"signal": 9}, False, [])
    unknown = exit_failure(1, 2, 1, None, False, [])
    known.ts = unknown.ts = 50.0
    assert root_cause([unknown, known]) is known


def test_ranks_told_to_stop_are_never_the_root_cause_even_when_noticed_first():
    # Seen under load: the survivors' "stopped on request" exit (75) and a SIGTERMed rank
    # were polled seconds before the SIGKILLed rank whose death made them stop.
    stopped = exit_failure(1, 11, 1, {"exit_code": 75}, False, [])
    termed = exit_failure(3, 13, 3, {"signal": 15, "signal_name": "SIGTERM"}, False, [])
    killed = exit_failure(2, 12, 2, {"signal": 9, "signal_name": "SIGKILL"}, False, [])
    stopped.ts, termed.ts, killed.ts = 10.0, 10.5, 13.0
    assert root_cause([stopped, termed, killed]) is killed
    assert root_cause([stopped, termed]) is stopped  # alone, the earliest still names itself


def test_trainer_error_event_is_classified():
    f = classify_event({"kind": "error", "error": "cuda_oom", "rank": 5, "gpu": 5, "message": NEW_OOM, "ts": 1.0})
    assert f.kind == "cuda_oom" and f.gpu == 6 and f.details["short_mib"] == 420


def test_stall_needs_another_rank_moving_or_training():
    m = StallMonitor(timeout=5)
    m.update({0: {"step": 1, "ts": 1}, 1: {"step": 1, "ts": 1}}, now=0)
    m.update({0: {"step": 9, "ts": 9}, 1: {"step": 1, "ts": 1}}, now=6)
    out = m.check({0: {"step": 9}, 1: {"step": 1, "gpu": 1}}, now=6, training=False)
    assert [f.rank for f in out] == [1] and out[0].gpu == 1
    m2 = StallMonitor(timeout=5)
    m2.update({0: {"step": 1, "ts": 1}}, now=0)
    assert m2.check({0: {}}, now=6, training=False) == []
    assert [f.rank for f in m2.check({0: {}}, now=6, training=True)] == [0]


def test_throughput_judged_on_steady_state_median_only():
    t = ThroughputMonitor(baseline=20000, fraction=0.3, warmup=3, window=5)
    for v in [1000, 1000, 1000]:  # warm-up steps are slow and ignored
        assert t.feed({"rank": 0, "tokens_per_s": v}) is None
    for v in [19000, 19500, 3000, 19800, 20100]:  # one dip is not a regression
        assert t.feed({"rank": 0, "tokens_per_s": v}) is None
    fails = [t.feed({"rank": 0, "tokens_per_s": 5400}) for _ in range(3)]
    assert fails[-1] is not None and fails[-1].kind == "throughput_regression"


def test_state_store_refuses_to_leave_a_terminal_state():
    seen = []
    s = StateStore(on_change=lambda a, b: seen.append((a.value, b.value)))
    s.set(RunState.RUNNING)
    s.set(RunState.FAILED)
    with pytest.raises(TerminalStateError):
        s.set(RunState.RUNNING)
    with pytest.raises(ValueError):
        StateStore().set(RunState.RESTARTING)
    assert seen == [("starting", "running"), ("running", "failed")]


def test_resume_argv_replaces_the_start_flag_in_place():
    assert resume_argv(["t", "--from-scratch", "--lr", "1"], "C") == ["t", "--resume-from", "C", "--lr", "1"]
    assert resume_argv(["t", "--init-from", "W", "--x"], "C") == ["t", "--resume-from", "C", "--x"]
    assert resume_argv(["t", "--resume-from=OLD"], "C") == ["t", "--resume-from", "C"]
    assert resume_argv(["bash", "start.sh"], "C") == ["bash", "start.sh"]  # uses $DFLASH_RESUME_FROM


def test_stream_writer_recovers_seq_and_offsets_after_a_torn_append(tmp_path):
    w = StreamWriter(str(tmp_path))
    w.append([("log", {"line": "a"}, ("stdout", 2)), ("log", {"line": "b"}, ("stdout", 4))])
    w.append([("gpu", {"gpus": []}, None)])
    w.sync(force=True)
    w.append([("log", {"line": "c"}, ("stdout", 6))])
    os.close(w.fd)
    with open(tmp_path / "stream.jsonl", "ab") as fh:
        fh.write(b'{"seq":5,"ts":1,"kind":"log","payload":{"li')  # killed mid-append
    w2 = StreamWriter(str(tmp_path))
    assert w2.seq == 4 and w2.offsets == {"stdout": 6}
    w2.append([("log", {"line": "d"}, ("stdout", 8))])
    os.close(w2.fd)
    import io

    out = io.BytesIO()
    assert follow(str(tmp_path), 0, out, lambda: False, once=True) == 0
    recs = [json.loads(l) for l in out.getvalue().splitlines()]
    assert [r["seq"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[-1]["payload"] == {"line": "d"}


def test_line_tail_hands_out_complete_lines_only(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"one\ntw")
    t = LineTail(str(p))
    assert t.read() == [("one", 4)]
    with open(p, "ab") as fh:
        fh.write(b"o\nthree")
    assert t.read() == [("two", 8)]
    assert t.read(final=True) == [("three", 13)]
    t2 = LineTail(str(p), offset=4)
    assert [l for l, _ in t2.read(final=True)] == ["two", "three"]


def test_the_run_state_diagram_lists_every_allowed_transition_and_no_other():
    import re

    from agent.state import TRANSITIONS

    drawn = set()
    for line in RunState.__doc__.splitlines():
        m = re.match(r"^\s*([A-Z]+)\s*→\s*([A-Z |]+)$", line)
        if m:
            drawn |= {(m.group(1), to.strip()) for to in m.group(2).split("|")}
    allowed = {(a.name, b.name) for a, targets in TRANSITIONS.items() for b in targets}
    assert drawn == allowed
    assert all(not TRANSITIONS[s] for s in RunState if s.is_terminal())


def test_status_and_result_round_trip_through_their_types_with_one_checkpoint_shape(tmp_path):
    from agent.protocol import Checkpoint, RankHealth, RunResult, RunStatus

    st = RunStatus(run_id="r", state=RunState.RUNNING, step=3, ranks={2: RankHealth(step=3, gpu=2)},
                   checkpoint=Checkpoint(3, "/o/step_3/checkpoint.pt"))
    st.save(str(tmp_path / "status.json"))
    doc = json.loads((tmp_path / "status.json").read_text())
    assert doc["state"] == "running" and doc["ranks"]["2"]["gpu"] == 2
    assert RunStatus.load(str(tmp_path / "status.json")) == st
    res = RunResult(run_id="r", state=RunState.COMPLETED, checkpoint=st.checkpoint)
    assert res.to_json()["checkpoint"] == doc["checkpoint"] == {"step": 3, "path": "/o/step_3/checkpoint.pt"}
    assert RunResult.from_json(res.to_json()) == res
    # a reader of another agent version's file: unknown keys ignored, missing ones defaulted
    assert RunStatus.from_json({"state": "failed", "added_later": 1}).terminal
    assert RunStatus.load(str(tmp_path / "none.json")) == RunStatus()


def test_a_failure_kind_outside_the_protocol_is_refused():
    with pytest.raises(ValueError):
        Failure("cuda_oomm", "misspelt")
    assert Failure("cuda_oom", "x").to_json()["kind"] == "cuda_oom"


def test_agent_start_flags_come_from_the_options_table():
    from dataclasses import fields

    from agent.cli import build_parser
    from agent.options import Options

    start = build_parser()._subparsers._group_actions[0].choices["start"]
    args = start.parse_args(["--run-dir", "d"])
    assert Options.from_args(args) == Options()  # every default from one place
    assert {f.name for f in fields(Options)} <= set(vars(args))
    argv = Options.argv({"settle": 3.0, "baseline_tokens_per_s": None, "max_restarts": 2})
    assert argv == ["--max-restarts", "2", "--settle", "3.0"]
    assert Options.from_args(start.parse_args(["--run-dir", "d", *argv])) == Options(settle=3.0, max_restarts=2)
    with pytest.raises(ValueError, match="settle_s"):
        Options.argv({"settle_s": 1})


def test_follow_waits_for_the_records_an_agent_appends_after_the_final_status(tmp_path):
    """Seen in CI: the agent's shutdown stops a run's leftover processes after the final
    status and appends that report and the status again; a follower that ended at the first
    terminal status lost those two records (the tail had 737 of 739)."""
    import io

    w = StreamWriter(str(tmp_path))
    w.append([("log", {"line": "a"}, None), ("status", {"state": "completed"}, None)])
    asked = []

    def writer_alive() -> bool:
        """The follower has read the final status and found nothing after it: the agent,
        still holding the stream, appends its shutdown's records, then lets go."""
        asked.append(1)
        if len(asked) == 1:
            w.append([("event", {"kind": "agent.stop"}, None), ("status", {"state": "completed"}, None)])
            return True
        if len(asked) == 2:
            os.close(w.fd)
        return False

    out = io.BytesIO()
    assert follow(str(tmp_path), 0, out, lambda: False, poll=0.01, writer_alive=writer_alive) == 0
    assert [json.loads(l)["seq"] for l in out.getvalue().splitlines()] == [1, 2, 3, 4]


def test_follow_prints_the_last_records_of_an_agent_that_died_between_two_reads(tmp_path):
    """The agent-gone check's last read went into a buffer the loop never parsed: records
    written just before the agent exited were dropped and the tail said the agent was gone."""
    import io

    w = StreamWriter(str(tmp_path))
    w.append([("log", {"line": "a"}, None)])
    calls = []

    def alive() -> bool:
        calls.append(1)
        if len(calls) == 1:  # the agent writes its final status, then exits, between two reads
            w.append([("status", {"state": "failed"}, None)])
            os.close(w.fd)
        return False

    out = io.BytesIO()
    rc = follow(str(tmp_path), 0, out, alive, poll=0.01, dead_check=0.0)
    assert [json.loads(l)["seq"] for l in out.getvalue().splitlines()] == [1, 2]
    assert rc == 0
