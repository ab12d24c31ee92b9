"""Every data-job setting goes through typed bounds as training's flags do (trainer/flags.py
Bounded): exact type, finite, a range that fits the machine; a run config's file values and
its `--set` values are judged by one rule; the job's own command line refuses the same. A
regenerate `concurrency = 1000000000` was accepted and took the node down (23.9 GB RSS in
15 minutes, the host's OOM killer); prepare `workers = 32` forked 34 processes on 2 cores."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest

from controller import jobconfig, runconfig
from trainer.regen.job import MAX_CONCURRENCY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT}
REGEN = {"name": "regen", "kind": "regenerate",
         "regenerate": {"input": "/w/in.jsonl", "out": "/w/out", "endpoint": ["http://10.0.0.5:30000"]}}
PREP = {"name": "chat", "kind": "prepare", "prepare": {"input": ["/w/chat.jsonl"], "out": "/w/data/chat"}}

BAD_REGEN = [("concurrency", 10**9), ("concurrency", True), ("concurrency", "8"), ("concurrency", 8.0),
             ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -5.0),
             ("temperature", True), ("top-p", float("inf")), ("top-p", 0.0), ("top-p", 1.5),
             ("request-timeout", float("inf")), ("request-timeout", 0.0), ("max-tokens", 24.0),
             ("max-tokens", 0), ("max-attempts", 10**9), ("retry-max-wait", float("nan")), ("seed", 1.5)]
BAD_PREP = [("workers", True), ("workers", -1), ("workers", 10**6), ("workers", 2.0), ("shard-tokens", 0),
            ("shard-tokens", True), ("max-seq-len", 1), ("progress-every", -1)]


def _refused(base: dict, table: str, key: str, value) -> str:
    data = copy.deepcopy(base)
    data[table][key] = value
    with pytest.raises(runconfig.RunConfigError) as exc:
        jobconfig.from_dict(data, source="job.toml", default_name=base["name"])
    return str(exc.value)


@pytest.mark.parametrize("key,value", BAD_REGEN)
def test_each_bad_regenerate_value_in_the_file_is_refused_naming_it(key, value):
    said = _refused(REGEN, "regenerate", key, value)
    assert said.startswith("job.toml: [regenerate]") and key in said and len(said.splitlines()) == 1, said


@pytest.mark.parametrize("key,value", BAD_PREP)
def test_each_bad_prepare_value_in_the_file_is_refused_naming_it(key, value):
    said = _refused(PREP, "prepare", key, value)
    assert said.startswith("job.toml: [prepare]") and key in said and len(said.splitlines()) == 1, said


@pytest.mark.parametrize("key,text", [("concurrency", "1000000000"), ("concurrency", "true"),
                                      ("temperature", "nan"), ("max-tokens", "24.0"), ("top-p", "inf")])
def test_a_set_value_of_a_data_job_is_refused_as_the_same_value_in_the_file(key, text):
    import tomllib

    with pytest.raises(runconfig.RunConfigError) as by_set:
        jobconfig.from_dict(copy.deepcopy(REGEN), source="job.toml", default_name="regen", sets=[f"{key}={text}"])
    assert str(by_set.value) == _refused(REGEN, "regenerate", key, tomllib.loads(f"v = {text}")["v"])


def test_the_concurrency_ceiling_is_allowed_and_one_more_is_not():
    data = copy.deepcopy(REGEN)
    data["regenerate"]["concurrency"] = MAX_CONCURRENCY
    jobconfig.from_dict(data, source="job.toml", default_name="regen")
    said = _refused(REGEN, "regenerate", "concurrency", MAX_CONCURRENCY + 1)
    assert f"to {MAX_CONCURRENCY}" in said, said


@pytest.mark.parametrize("flag,text", [("--concurrency", "1000000000"), ("--temperature", "nan"),
                                       ("--temperature", "-5"), ("--top-p", "inf"), ("--request-timeout", "inf"),
                                       ("--concurrency", "8.0")])
def test_the_regenerate_command_refuses_the_same_in_one_line_and_writes_nothing(tmp_path, flag, text):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "trainer", "regenerate", "--input", str(tmp_path / "in.jsonl"),
                        "--out", str(out), "--endpoint", "http://127.0.0.1:1", flag, text],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and flag in p.stderr, p.stderr
    assert not out.exists()


def test_prepare_refuses_more_workers_than_the_cores_it_may_use_before_forking(tmp_path):
    cores = len(os.sched_getaffinity(0))
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n')
    p = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--input", str(inp), "--out",
                        str(tmp_path / "out"), "--workers", str(cores + 1)],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert f"--workers {cores + 1}: this machine lets the job use {cores} CPU" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
