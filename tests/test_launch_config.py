"""Run config: generated from trainer/flags.py, errors that name field, value and fix."""

from __future__ import annotations

import pytest

from controller import runconfig as R
from controller import configfile
from trainer import flags as F

BASE = {"trainer": {"target-model": "/m", "data-dir": "/d", "target-gpus": [0], "drafter-gpus": "0",
                    "max-seq-len": 64, "token-budget": 256, "max-anchors": 16}}


def test_every_trainer_flag_is_a_config_field_except_the_ones_it_must_not_hold():
    fields = set(R.TrainerSection.model_fields)
    for flag in F.FLAGS:
        if flag.dest in R.NOT_IN_CONFIG or flag.dest in R.WANDB_FLAGS:
            assert flag.dest not in fields
        else:
            assert flag.dest in fields, flag.name
            assert R.TrainerSection.model_fields[flag.dest].alias == flag.name[2:]


def test_resolved_values_render_to_the_trainers_own_argv_and_parse_back():
    config = R.from_dict(BASE, overrides={"lr": "1e-3"}, sets=["wandb.run-name={run_id}", "epochs=2"])
    values = config.resolve({"from_scratch": True, "resume_from": None, "init_from": None},
                            run_id="r1", run_dir="/w/runs/r1", workspace="/w")
    argv = F.to_argv(values)
    parsed = vars(F.parse_args(argv))
    assert parsed["lr"] == 1e-3 and parsed["epochs"] == 2
    assert parsed["output_dir"] == "/w/runs/r1/output"  # default: inside the run directory
    assert parsed["wandb_run_name"] == "r1" and parsed["from_scratch"] is True
    assert F.check(parsed) == []


def test_a_bad_value_names_the_table_the_key_the_value_and_what_it_means():
    with pytest.raises(R.RunConfigError) as err:
        R.from_dict({**BASE, "trainer": {**BASE["trainer"], "lr": "fast"}}, source="run.toml")
    text = str(err.value)
    assert "run.toml" in text and "[trainer] lr = 'fast'" in text and "learning rate" in text


def test_a_misspelt_key_is_refused_with_the_closest_name():
    with pytest.raises(R.RunConfigError, match=r"\[trainer\] epocs: unknown setting; did you mean 'epochs'"):
        R.from_dict({**BASE, "trainer": {**BASE["trainer"], "epocs": 3}})


def test_overlapping_gpu_roles_are_refused_with_the_overlap_and_the_fix():
    with pytest.raises(R.RunConfigError, match="overlap on 1: make them disjoint, or equal"):
        R.from_dict({"trainer": {**BASE["trainer"], "target-gpus": "0,1", "drafter-gpus": [1, 2]}})


def test_a_start_decision_in_the_file_is_refused_because_it_would_be_an_implicit_resume():
    with pytest.raises(R.RunConfigError, match="resume-from: not a run-config setting.*--from-scratch"):
        R.from_dict({"trainer": {**BASE["trainer"], "resume-from": "/ckpt"}})


def test_missing_required_flags_say_where_to_set_them():
    with pytest.raises(R.RunConfigError) as err:
        R.from_dict({"trainer": {}})
    assert "[trainer] target-model: missing" in str(err.value)
    assert "pass --target-model to ctl launch" in str(err.value)


def test_no_start_decision_explains_the_three_choices():
    with pytest.raises(R.RunConfigError) as err:
        R.start_decision(False, None, None)
    assert F.START_DECISION_HELP in str(err.value)
    with pytest.raises(R.RunConfigError, match="conflict"):
        R.start_decision(True, "/c", None)
    assert R.start_decision(False, None, "/c")["init_from"] == "/c"


def test_a_literal_api_key_is_refused_and_a_key_file_is_read(tmp_path):
    with pytest.raises(R.RunConfigError, match=r"\[wandb\] api-key: an API key is never stored"):
        R.from_dict({**BASE, "wandb": {"api-key": "abc"}})
    key = tmp_path / "wandb.key"
    key.write_text("secret-123\n")
    config = R.from_dict({**BASE, "wandb": {"api-key-file": str(key)}})
    assert config.wandb.read_key() == "secret-123"
    missing = R.from_dict({**BASE, "wandb": {"api-key-file": str(tmp_path / "nope")}})
    with pytest.raises(R.RunConfigError, match="api-key-file.*cannot read it"):
        missing.wandb.read_key()
    env = R.from_dict({**BASE, "wandb": {"api-key-env": "MY_KEY"}})
    assert env.wandb.read_key({"MY_KEY": "k"}) == "k"
    with pytest.raises(R.RunConfigError, match="MY_KEY"):
        env.wandb.read_key({})


def test_unknown_placeholder_is_named():
    config = R.from_dict({**BASE, "trainer": {**BASE["trainer"], "output-dir": "/o/{runid}"}})
    with pytest.raises(R.RunConfigError, match=r"--output-dir = '/o/\{runid\}': unknown placeholder"):
        config.resolve({"from_scratch": True}, run_id="r", run_dir="/r", workspace="/w")


def test_the_shipped_tiny_example_validates():
    from pathlib import Path

    config = configfile.load(Path(__file__).resolve().parent.parent / "examples" / "tiny.toml")
    assert config.trainer.device == "cpu"


def test_the_printed_resume_line_names_the_config_file_the_run_was_launched_with(tmp_path):
    # kill-and-rollback printed `--config tiny.toml` (a guess from the config's name) for a
    # run launched with examples/tiny.toml, so the line failed from any other directory.
    from controller.resume import resume_line

    config = configfile.load("examples/tiny.toml")
    assert config._source_file and config._source_file.endswith("/examples/tiny.toml")
    line = resume_line("200", "sim", {"config": config.name, "config_file": config._source_file},
                       {"path": "/workspace/runs/r/output/step_8/checkpoint.pt"})
    assert f"--config {config._source_file}" in line
    assert line.endswith("--resume-from /workspace/runs/r/output/step_8/checkpoint.pt")


@pytest.mark.parametrize("setting, expected", [
    ("max-anchors = 100000000000000000000",
     "--max-anchors 100000000000000000000 is too large: it must be at most --max-seq-len (64)"),
    ("block-size = 1", "--block-size 1 is too small: it must be at least 2"),
    ("lr = inf", "lr"),
])
def test_ctl_launch_refuses_a_hostile_value_with_one_line_before_connecting(tmp_path, setting, expected):
    """As typed: `ctl launch` with the value in the run config exits 2 with one line and never
    reaches the node (configured on a port where nothing listens: a connection attempt would
    end in a transport error, exit 255, after retries)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    lines = [f"{k} = {v!r}".replace("'", '"') for k, v in BASE["trainer"].items() if k != "max-anchors"]
    if not setting.startswith("max-anchors"):
        lines.append("max-anchors = 16")
    run = tmp_path / "run.toml"
    run.write_text("[trainer]\n" + "\n".join(lines + [setting]) + "\n")
    ctl_config = tmp_path / "ctl.toml"
    ctl_config.write_text('default_node = "nowhere"\n[nodes.nowhere]\nhost = "127.0.0.1"\nport = 9\n')
    ctl = Path(sys.executable).with_name("ctl")
    proc = subprocess.run([str(ctl), "launch", "--container", "200", "--config", str(run), "--from-scratch"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "DFLASH_CTL_CONFIG": str(ctl_config)})
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(err) == 1 and expected in err[0], err
    assert "Traceback" not in proc.stderr
