"""The tail loop's contract on a scripted stream source: exactly-once across drops, and the
run's state is asked when the stream ends (the end-to-end version with real SSH drops is in
test_launch_sim.py)."""

from __future__ import annotations

import json

from controller.tail import Printer, tail
from controller.transport import TransportError


class Scripted:
    """A stream of N records; each follow call delivers a few, re-sends the last one (as a
    record in flight at a drop would be), then drops the connection, until the end."""

    def __init__(self, n: int, per_call: int, terminal_state="completed"):
        self.records = [{"seq": i, "ts": i, "kind": "log", "payload": {"line": f"line {i}"}} for i in range(1, n + 1)]
        self.per_call = per_call
        self.calls = []
        self.state_asked = 0
        self.terminal_state = terminal_state

    def follow(self, run_id, after, on_line, *, once):
        self.calls.append(after)
        start = max(0, after - 1)  # re-send one already-seen record
        chunk = self.records[start:after + self.per_call]
        for rec in chunk:
            on_line(json.dumps(rec))
        if after + self.per_call < len(self.records):
            raise TransportError("connection lost")
        return 0

    def state(self, run_id):
        self.state_asked += 1
        return {"state": self.terminal_state}


def test_drops_give_no_gap_and_no_duplicate():
    src = Scripted(50, per_call=4)
    seen = []
    result = tail(src, "r1", seen.append, sleep=lambda s: None)
    assert [r["seq"] for r in seen] == list(range(1, 51))
    assert result.reconnects == 12 and result.gaps == [] and result.state == "completed"
    assert src.calls[:3] == [0, 4, 8]  # each reconnect resumes from the last seq seen


def test_stream_end_asks_the_state_instead_of_assuming_success():
    src = Scripted(3, per_call=10, terminal_state="failed")
    result = tail(src, "r1", lambda r: None, sleep=lambda s: None)
    assert src.state_asked == 1 and result.state == "failed"


def test_since_skips_what_the_operator_already_has():
    src = Scripted(10, per_call=100)
    seen = []
    tail(src, "r1", seen.append, since=7, sleep=lambda s: None)
    assert [r["seq"] for r in seen] == [8, 9, 10]


def test_ctrl_c_detaches():
    class Interrupting(Scripted):
        def follow(self, run_id, after, on_line, *, once):
            raise KeyboardInterrupt

    result = tail(Interrupting(3, 1), "r1", lambda r: None)
    assert result.detached and result.state is None


def test_printer_shows_logs_failures_and_a_periodic_status_line():
    lines = []
    clock = iter(range(0, 1000, 4))
    p = Printer(lines.append, status_every=10, clock=lambda: next(clock))
    p({"seq": 1, "kind": "log", "payload": {"line": "hello", "rank": None}})
    for step in range(1, 6):
        p({"seq": 1 + step, "kind": "event", "payload": {"kind": "step", "step": step, "total_steps": 5,
                                                          "loss": 1.0 / step, "tokens_per_s": 1500.0}})
    p({"seq": 9, "kind": "event", "payload": {"kind": "agent.failure", "failure": "rank_exit",
                                               "reason": "rank 1 (GPU 6) exited with SIGKILL"}})
    assert lines[0] == "hello"
    status = [l for l in lines if l.startswith("-- ")]
    assert status and "step 1/5" in status[0] and "1.5K tok/s" in status[0]
    assert 1 < len(status) < 5  # periodic, not one per step
    assert "!! FAILURE rank_exit: rank 1 (GPU 6) exited with SIGKILL" in lines


def test_a_follow_that_ends_because_the_agent_is_gone_revives_it_and_goes_on():
    from controller.tail import FOLLOW_AGENT_GONE

    class AgentDiesOnce(Scripted):
        revived = 0

        def follow(self, run_id, after, on_line, *, once):
            if after < 5:
                for rec in self.records[after:5]:
                    on_line(json.dumps(rec))
                return FOLLOW_AGENT_GONE  # the agent died; the run goes on without one
            for rec in self.records[after:]:
                on_line(json.dumps(rec))
            return 0

        def state(self, run_id):
            return {"state": "running" if self.revived == 0 else "completed"}

        def revive(self, run_id):
            self.revived += 1
            return True

    src = AgentDiesOnce(9, per_call=0)
    seen = []
    result = tail(src, "r1", seen.append, sleep=lambda s: None)
    assert src.revived == 1 and [r["seq"] for r in seen] == list(range(1, 10)) and result.state == "completed"


def test_without_a_way_to_revive_the_tail_ends_and_says_the_state():
    from controller.tail import FOLLOW_AGENT_GONE

    class AgentGone(Scripted):
        def follow(self, run_id, after, on_line, *, once):
            return FOLLOW_AGENT_GONE

    result = tail(AgentGone(3, 1, terminal_state="running"), "r1", lambda r: None, sleep=lambda s: None)
    assert result.state == "running"
