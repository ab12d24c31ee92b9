"""agent/preflight.py on this machine: the commit step undoes itself, the checks name the flag."""

from __future__ import annotations

import json
import os
import sys

from agent import knowngood, preflight
from agent.protocol import atomic_write


def test_a_commit_whose_agent_start_fails_leaves_no_run_dir_and_no_secret(tmp_path):
    ws = tmp_path / "ws"
    run_dir = ws / "runs" / "r1"
    secret = ws / ".dflash-ctl" / "secrets" / "r1.env"
    reply = preflight.commit({
        "workspace": str(ws), "run_id": "r1", "run_dir": str(run_dir), "script": "exit 0\n",
        "secrets_file": str(secret), "secret": "WANDB_API_KEY=abc\n", "record": {"run_id": "r1"},
        "start_argv": [sys.executable, "-c", "import sys; print('agent start failed', file=sys.stderr); sys.exit(1)"],
    })
    assert not reply["ok"] and "agent start failed" in reply["error"]
    assert not run_dir.exists() and not secret.exists()
    assert not os.path.exists(knowngood.launch_record_path(str(ws), "r1"))


def test_a_commit_refuses_an_existing_run_dir_and_leaves_it_alone(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "keep").write_text("x")
    reply = preflight.commit({"workspace": str(tmp_path), "run_id": "r1", "run_dir": str(run_dir), "script": "",
                              "start_argv": ["true"]})
    assert not reply["ok"] and "already exists" in reply["error"]
    assert (run_dir / "keep").exists()


def test_the_secret_file_is_created_root_only(tmp_path):
    path = tmp_path / "s.env"
    atomic_write(str(path), "K=V\n", 0o600)  # what preflight.commit writes the secret with
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    # the temp name is made by mkstemp, 0600 before a byte is written: never readable by others
    assert [p.name for p in tmp_path.iterdir()] == ["s.env"]


def _checkpoint(tmp_path, **meta):
    step = tmp_path / "out" / "step_12"
    step.mkdir(parents=True)
    (step / "checkpoint.pt").write_bytes(b"")
    doc = {"format": "dflash-trainer-checkpoint", "step": 12, "data_fingerprint": "aaaa",
           "drafter_config": {"block_size": 8, "num_hidden_layers": 1},
           "target": {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 4}}
    doc.update(meta)
    (step / "meta.json").write_text(json.dumps(doc))
    return str(step)


MODEL = {"dir": "/t", "config": {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 4}}
DATA = {"stats": {"fingerprint": "aaaa"}}


def test_checkpoint_checks_name_the_flag_and_the_fix(tmp_path):
    ckpt = _checkpoint(tmp_path)
    flags = {"block_size": 8, "num_draft_layers": 1}
    assert preflight.checkpoint_info({"kind": "resume", "path": ckpt}, flags, MODEL, DATA)[1] == []
    errs = preflight.checkpoint_info({"kind": "resume", "path": ckpt}, {**flags, "num_draft_layers": 2}, MODEL, DATA)[1]
    assert errs == [f"--resume-from {ckpt}: the checkpoint was trained with --num-draft-layers 1, this launch says 2; "
                    "set --num-draft-layers 1 or start --from-scratch"]
    other_target = {"dir": "/t2", "config": {**MODEL["config"], "hidden_size": 128}}
    errs = preflight.checkpoint_info({"kind": "init", "path": ckpt}, flags, other_target, DATA)[1]
    assert "--init-from" in errs[0] and "hidden_size 64 vs 128" in errs[0]
    errs = preflight.checkpoint_info({"kind": "resume", "path": ckpt}, flags, MODEL, {"stats": {"fingerprint": "bbbb"}})[1]
    assert "use --init-from to keep only the weights" in errs[0]
    # --init-from does not care about the data
    assert preflight.checkpoint_info({"kind": "init", "path": ckpt}, flags, MODEL, {"stats": {"fingerprint": "bbbb"}})[1] == []


def test_an_output_dir_instead_of_a_step_dir_lists_the_checkpoints_it_holds(tmp_path):
    _checkpoint(tmp_path)
    errs = preflight.checkpoint_info({"kind": "resume", "path": str(tmp_path / "out")}, {}, MODEL, DATA)[1]
    assert "no checkpoint.pt there" in errs[0] and "step_12" in errs[0]


def test_check_reports_what_runs_and_refuses_missing_paths(tmp_path):
    reply = preflight.check({"workspace": str(tmp_path), "run_id": "r9",
                             "flags": {"target_model": str(tmp_path / "m"), "data_dir": str(tmp_path / "d"),
                                       "device": "cpu", "target_gpus": [0], "drafter_gpus": [0],
                                       "output_dir": str(tmp_path / "runs/r9/output")},
                             "start": {"kind": "scratch"}})
    assert not reply["ok"]
    assert any(e.startswith(f"--data-dir {tmp_path / 'd'}: no such directory") for e in reply["errors"])
    assert reply["python"]["executable"] == sys.executable
    assert reply["fingerprint"]["packages"]  # what the venv holds, by name and version


def test_a_gpu_launch_is_told_what_its_first_step_will_find_compiled(tmp_path):
    """A fresh machine's first step compiles for a minute; the preflight says so, and names
    the command that spares it (ctl env cache import)."""
    from agent import compilecache
    from controller.launch import compile_cache_lines

    request = {"workspace": str(tmp_path), "run_id": "r9", "start": {"kind": "scratch"},
               "flags": {"device": "auto", "target_gpus": [0], "drafter_gpus": [0],
                         "output_dir": str(tmp_path / "runs/r9/output")}}
    cold = preflight.check(request)["compile_cache"]
    gen = preflight.fingerprint(None)["id"]
    assert cold == {"generation": gen, "dir": compilecache.generation_dir(compilecache.root_of(str(tmp_path)), gen),
                    "files": 0, "bytes": 0}
    (line,) = compile_cache_lines(cold, "200")
    assert f"nothing cached for generation {gen}" in line and "ctl env cache import FILE --container 200" in line
    entry = os.path.join(cold["dir"], "inductor", "fxgraph", "ab", "graph")
    os.makedirs(os.path.dirname(entry))
    with open(entry, "wb") as fh:
        fh.write(b"x" * 3 * 2**20)
    warm = preflight.check(request)["compile_cache"]
    assert warm["files"] == 1 and warm["bytes"] == 3 * 2**20
    assert compile_cache_lines(warm, "200") == [f"compile  1 cached entries (3 MiB) for generation {gen}: the first "
                                                f"step loads what it finds"]
    assert preflight.check({**request, "flags": {**request["flags"], "device": "cpu"}})["compile_cache"] is None
    assert compile_cache_lines(None, "200") == []  # a CPU launch compiles nothing: no line
