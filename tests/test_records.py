"""agent/records.py behaves as dataclasses did for the agent's records, and the container's
side of `ctl status` / `ctl tail` (agent/runview.py) loads neither dataclasses nor argparse
for the command line the controller sends (docs/benchmarks.md says what that saves)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent import records
from agent.protocol import Checkpoint, RankHealth, RunResult, RunState, RunStatus
from agent import runview

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class DMutable:
    a: int
    b: str | None = None
    c: list = dataclasses.field(default_factory=list)
    d: dict = dataclasses.field(default_factory=dict)


@records.record
class RMutable:
    a: int
    b: str | None = None
    c: list = records.Factory(list)
    d: dict = records.Factory(dict)


@dataclasses.dataclass(frozen=True)
class DFrozen:
    x: int
    y: str = ""


@records.record(frozen=True)
class RFrozen:
    x: int
    y: str = ""


def shown(obj) -> str:
    return repr(obj).split("(", 1)[1]


@pytest.mark.parametrize("args,kwargs", [((1,), {}), ((1, "b"), {}), ((), {"a": 2, "c": [1]}),
                                         ((3,), {"d": {"k": 1}, "b": None}), ((float("nan"),), {})])
def test_construction_defaults_repr_equality_and_asdict_as_dataclasses(args, kwargs):
    d, r = DMutable(*args, **kwargs), RMutable(*args, **kwargs)
    assert shown(d) == shown(r)
    assert dataclasses.asdict(d) == records.asdict(r) or math.isnan(d.a)
    assert (r == RMutable(*args, **kwargs)) == (d == DMutable(*args, **kwargs))
    assert r == r and (r != RMutable(99)) and r != d
    assert [f.name for f in dataclasses.fields(d)] == [f.name for f in records.fields(r)]
    assert [str(f.type) for f in dataclasses.fields(d)] == [str(f.type) for f in records.fields(RMutable)]


def test_a_factory_default_is_fresh_per_record():
    one, two = RMutable(1), RMutable(2)
    one.c.append("x")
    one.d["k"] = 1
    assert two.c == [] and two.d == {}
    assert "c" not in RMutable.__dict__  # no shared class-level list left behind


@pytest.mark.parametrize("call", [lambda cls: cls(), lambda cls: cls(1, "b", [], {}, 5),
                                  lambda cls: cls(1, a=2), lambda cls: cls(1, nope=2)])
def test_wrong_arguments_are_refused_as_by_dataclasses(call):
    with pytest.raises(TypeError):
        call(DMutable)
    with pytest.raises(TypeError):
        call(RMutable)


def test_frozen_records_refuse_assignment_and_hash_by_value_mutable_ones_do_not_hash():
    f = RFrozen(1, "y")
    with pytest.raises(AttributeError):
        f.x = 2
    with pytest.raises(AttributeError):
        del f.y
    assert hash(f) == hash(RFrozen(1, "y")) and {f, RFrozen(1, "y")} == {f}
    assert shown(f) == shown(DFrozen(1, "y"))
    with pytest.raises(TypeError):
        hash(RMutable(1))
    with pytest.raises(TypeError):
        hash(DMutable(1))


def test_the_agents_records_round_trip_through_their_json():
    status = RunStatus(run_id="r", state=RunState.RUNNING, step=3, ranks={0: RankHealth(step=3, pid=9)},
                       checkpoint=Checkpoint(3, "/ck"), failures_history=[{"a": 1}])
    doc = status.to_json()
    assert doc["ranks"] == {"0": {"step": 3, "pid": 9, "gpu": None, "role": None, "heartbeat_age_s": None,
                                  "health": "ok"}}
    assert RunStatus.from_json(json.loads(json.dumps(doc))) == status
    assert RunStatus().failures_history is not RunStatus().failures_history
    result = RunResult(run_id="r", state=RunState.COMPLETED, checkpoint=Checkpoint(3, "/ck"))
    assert RunResult.from_json(result.to_json()) == result


PLAIN = [["status", "--workspace", "/w"], ["status", "--workspace", "/w", "--run", "tiny-20261201-114702-3fa9"],
         ["stream", "--workspace", "/w", "--run", "r", "--from", "12"], ["stream"], ["status", "--from", "0"],
         ["stream", "--run", "a", "--run", "b"]]
NOT_PLAIN = [[], ["--help"], ["status", "--help"], ["status", "--workspace"], ["status", "--workspace=/w"],
             ["status", "--run", "-x"], ["stream", "--from", "x"], ["stream", "--from", "-1"], ["list"],
             ["status", "extra", "words"]]


@pytest.mark.parametrize("argv", PLAIN, ids=" ".join)
def test_runview_reads_the_controllers_command_line_as_argparse_does(argv, monkeypatch):
    monkeypatch.setattr(runview, "_plain_args", lambda argv: None)
    expected = runview.parse_args(argv)  # argparse's reading
    monkeypatch.undo()
    assert runview._plain_args(argv) == expected


@pytest.mark.parametrize("argv", NOT_PLAIN, ids=lambda a: " ".join(a) or "(none)")
def test_anything_else_goes_to_argparse(argv):
    assert runview._plain_args(argv) is None


def test_the_container_side_of_status_and_tail_loads_neither_dataclasses_nor_argparse(tmp_path):
    """As the controller starts it: `python -S -m agent.runview …` with the bundle on PYTHONPATH."""
    for argv in (["status", "--workspace", str(tmp_path)], ["stream", "--workspace", str(tmp_path)]):
        code = ("import atexit, json, sys, runpy\n"
                "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.__stderr__))\n"
                f"sys.argv = ['runview', *{argv!r}]\nrunpy.run_module('agent.runview', run_name='__main__')\n")
        proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                              env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]}, timeout=60)
        loaded = set(json.loads(proc.stderr.strip().splitlines()[-1]))
        assert loaded & {"dataclasses", "argparse", "inspect", "ast"} == set(), (argv, proc.stderr[-500:])
