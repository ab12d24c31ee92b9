"""Bad input is refused before anything is written: one line per problem on stderr, exit
code 2 (flags.EXIT_USAGE), no directory created."""

import os
import subprocess
import sys

import pytest
import torch

from _trainer_tiny import base_args, make_target, replace, tiny_setup
from trainer import flags
from trainer.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target, data = tiny_setup(str(root))
    other = make_target(str(root / "other-target"), num_hidden_layers=8)
    out = str(root / "trained")
    assert main(base_args(target, data, out, "--from-scratch", "--max-steps", "1")) == 0
    return {"root": root, "target": target, "data": data, "other": other, "ckpt": os.path.join(out, "step_1")}


def snapshot(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, ds, fs in os.walk(root) for f in fs + ds)


def without(argv, name, n=1):
    i = argv.index(name)
    return argv[:i] + argv[i + 1 + n:]


CASES = {
    "missing drafter gpus": (lambda e: without(base_args(e["target"], e["data"], e["new"], "--from-scratch"), "--drafter-gpus"),
                             "--drafter-gpus is required"),
    "overlapping gpu sets": (lambda e: replace(replace(base_args(e["target"], e["data"], e["new"], "--from-scratch"),
                                                       "--target-gpus", "0,1"), "--drafter-gpus", "1,2"), "overlap on 1"),
    "token budget below max seq len": (lambda e: replace(base_args(e["target"], e["data"], e["new"], "--from-scratch"),
                                                         "--token-budget", "32"), "--token-budget 32 is below --max-seq-len 48"),
    "missing data dir": (lambda e: base_args(e["target"], str(e["root"] / "nope"), e["new"], "--from-scratch"),
                         "no meta.json there"),
    "missing target": (lambda e: base_args(str(e["root"] / "nope"), e["data"], e["new"], "--from-scratch"),
                       "no config.json there"),
    "no start decision": (lambda e: base_args(e["target"], e["data"], e["new"]), "no start decision"),
    "checkpoint with another block size": (lambda e: replace(base_args(e["target"], e["data"], e["new"], "--resume-from", e["ckpt"]),
                                                             "--block-size", "4"), "the checkpoint was trained with --block-size 8, this launch says 4"),
    "checkpoint of another target": (lambda e: base_args(e["other"], e["data"], e["new"], "--init-from", e["ckpt"]),
                                     "trained against another target (num_hidden_layers 6 vs 8"),
    "resume holding out other samples": (lambda e: base_args(e["target"], e["data"], e["new"], "--resume-from", e["ckpt"],
                                                             "--eval-prompts", "2"), "held out 0 samples for evaluation"),
    # Hostile numbers (issue "Real machines"): once accepted, and the run started.
    "anchors beyond any index": (lambda e: replace(base_args(e["target"], e["data"], e["new"], "--from-scratch"),
                                                   "--max-anchors", "100000000000000000000"),
                                 "--max-anchors 100000000000000000000 is too large: it must be at most --max-seq-len (48)"),
    "anchors beyond the sequence": (lambda e: replace(base_args(e["target"], e["data"], e["new"], "--from-scratch"),
                                                      "--max-anchors", "49"), "it must be at most --max-seq-len (48)"),
    "block of one token": (lambda e: replace(base_args(e["target"], e["data"], e["new"], "--from-scratch"),
                                             "--block-size", "1"), "--block-size 1 is too small: it must be at least 2"),
    "infinite learning rate": (lambda e: base_args(e["target"], e["data"], e["new"], "--from-scratch", "--lr", "inf"),
                               "--lr: expected a finite number, got 'inf'"),
    "negative seed": (lambda e: base_args(e["target"], e["data"], e["new"], "--from-scratch", "--seed", "-1"),
                      "--seed -1 is too small: it must be at least 0"),
    "not a checkpoint": (lambda e: base_args(e["target"], e["data"], e["new"], "--resume-from", e["data"]),
                         "holds no checkpoint.pt"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_one_line_exit_2_nothing_written(env, case, capsys):
    argv_of, expected = CASES[case]
    env = {**env, "new": str(env["root"] / "new-output")}
    argv = argv_of(env)
    before = snapshot(env["root"])
    rc = _rc(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == flags.EXIT_USAGE
    assert len(err) == 1, err
    assert expected in err[0] and err[0].startswith("python -m trainer: error: ")
    assert snapshot(env["root"]) == before


def test_bad_input_through_the_real_command(env, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "trainer", *base_args(env["target"], env["data"], str(tmp_path / "out"))],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, "DFLASH_RUN_DIR": str(run_dir)})
    assert proc.returncode == flags.EXIT_USAGE
    assert proc.stderr.strip().splitlines() == [f"python -m trainer: error: no start decision: {flags.START_DECISION_HELP}"]
    assert not (tmp_path / "out").exists() and not run_dir.exists()


def test_flags_markdown(capsys):
    assert main(["flags", "--markdown"]) == 0
    assert capsys.readouterr().out == flags.markdown()


def _rc(argv):
    try:
        return main(argv)
    except SystemExit as exc:  # argparse errors exit directly (also one line, code 2)
        return exc.code


def test_tiny_subcommand_feeds_the_trainer(tmp_path):
    """`python -m trainer tiny` (the data side's tiny target + data) trains end to end, and
    the target's reserved mask id (config.json mask_token_id) becomes the drafter's."""
    import json

    assert main(["tiny", "--out", str(tmp_path / "tiny"), "--samples", "24"]) == 0
    target, data, out = str(tmp_path / "tiny" / "target"), str(tmp_path / "tiny" / "data"), str(tmp_path / "out")
    assert main(base_args(target, data, out, "--from-scratch", "--max-steps", "2", "--max-seq-len", "256",
                          "--token-budget", "1024")) == 0
    cfg = json.load(open(os.path.join(out, "step_2", "drafter", "config.json")))
    assert cfg["dflash_config"]["mask_token_id"] == json.load(open(os.path.join(target, "config.json")))["mask_token_id"]


def test_a_failure_is_an_error_event_naming_rank_and_gpu(env, tmp_path):
    """Token ids beyond the target's vocabulary pass launch validation and fail in the
    target forward: the run directory gets an error event with rank, GPU, message and
    traceback, the heartbeat says failed, and the exception propagates (exit code 1)."""
    import json
    import shutil

    import numpy as np

    data = str(tmp_path / "data")
    shutil.copytree(env["data"], data)
    shard = next(f for f in os.listdir(data) if f.endswith(".ids.int32"))
    ids = np.fromfile(os.path.join(data, shard), dtype="<i4")
    ids[:] = 10**6  # same size, so the shards still open
    ids.tofile(os.path.join(data, shard))
    run_dir = str(tmp_path / "run")
    with pytest.raises(IndexError):
        main(base_args(env["target"], data, str(tmp_path / "out"), "--from-scratch", "--run-dir", run_dir))
    events = [json.loads(line) for line in open(os.path.join(run_dir, "events.jsonl"))]
    err = [e for e in events if e["kind"] == "error"]
    assert len(err) == 1 and err[0]["rank"] == 0 and err[0]["gpu"] == 0 and err[0]["error"] == "exception"
    assert err[0]["message"].startswith("IndexError: ") and "Traceback" in err[0]["traceback"]
    assert json.load(open(os.path.join(run_dir, "heartbeat", "rank-0")))["state"] == "failed"


def test_too_little_data_for_one_step_is_bad_input(env, tmp_path, capsys):
    argv = base_args(env["target"], env["data"], str(tmp_path / "out"), "--from-scratch")
    i = argv.index("--grad-accum")
    argv[i + 1] = "1000"
    assert main(argv) == flags.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "less than one optimizer step" in err[0]
    assert not (tmp_path / "out").exists()


def test_init_from_an_exported_drafter_equals_init_from_its_checkpoint(env, tmp_path):
    """--init-from takes a checkpoint or an exported drafter directory (this trainer's or
    z-lab's layout). An fp32 export (`python -m trainer export --dtype fp32`) holds the
    master weights: same first steps as the checkpoint. The bf16 step_N/drafter/ the trainer
    writes loads the masters rounded to bf16, exactly."""
    import json

    from trainer import checkpoint as ckpt_io
    from trainer.serve.export import export

    fp32 = str(tmp_path / "fp32-export")
    export(env["ckpt"], fp32, dtype="fp32")
    runs = {}
    for name, path in (("ckpt", env["ckpt"]), ("export", fp32)):
        out = str(tmp_path / name)
        assert main(base_args(env["target"], env["data"], out, "--init-from", path, "--max-steps", "2")) == 0
        events = [json.loads(line) for line in open(os.path.join(out, "events.jsonl"))]
        runs[name] = [e["loss"] for e in events if e["kind"] == "step"]
    assert runs["ckpt"] == runs["export"] and len(runs["ckpt"]) == 2
    masters = ckpt_io.load(env["ckpt"])["model"]
    rounded = ckpt_io.init_weights(os.path.join(env["ckpt"], "drafter"))
    assert all(torch.equal(rounded[k].float(), v.to(torch.bfloat16).float()) for k, v in masters.items())


def test_init_from_an_export_for_another_target_is_refused(env, capsys):
    argv = base_args(env["other"], env["data"], str(env["root"] / "x"), "--init-from", os.path.join(env["ckpt"], "drafter"))
    assert main(argv) == flags.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another target (num_hidden_layers 6 vs 8)" in err[0]
