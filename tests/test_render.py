"""The start script: every flag from trainer/flags.py, an explicit environment, secrets read
at run time, and hostile values that stay inert. Scripts are really run by bash, with a fake
python that dumps what it received."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from controller.config import ContainerConfig
from controller.render import TEMPLATES, START_TEMPLATE, RenderError, environment, render_start_script, start_env
from trainer import flags as F

FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys
with open(os.path.join(os.getcwd(), "dump.json"), "w") as fh:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, fh)
"""


def make_container(tmp_path: Path) -> ContainerConfig:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python3"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return ContainerConfig(venv=str(venv), workspace=str(tmp_path / "ws"), home="/root")


def base_values(**kw):
    values = F.defaults()
    values.update(target_model="/models/t", data_dir="/data", output_dir="/out",
                  target_gpus=(0,), drafter_gpus=(0,), from_scratch=True)
    values.update(kw)
    return values


def run_script(script: str, tmp_path: Path, run_dir: Path,
               extra_env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    path = tmp_path / "start.sh"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    # Started from a polluted environment: none of it may reach the trainer.
    polluted = dict(os.environ, PATH="/opt/homebrew/opt/openjdk/bin:/root/perl5/bin:" + os.environ["PATH"],
                    PERL5LIB="/root/perl5/lib/perl5", SSH_CONNECTION="1.2.3.4 5 6.7.8.9 22", **(extra_env or {}))
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=polluted, cwd=str(tmp_path))
    dump = json.loads((run_dir / "dump.json").read_text()) if (run_dir / "dump.json").exists() else {}
    return proc, dump


def test_template_lists_no_trainer_flag_by_hand():
    source = (TEMPLATES / START_TEMPLATE).read_text()
    assert [f.name for f in F.FLAGS if f.name in source] == []


def test_undefined_template_variable_is_an_error_not_an_empty_string():
    with pytest.raises(jinja2.UndefinedError):
        environment().from_string("run_dir={{ run_dirr | sh }}").render(run_dir="/x")


def test_hostile_values_pass_bash_n_and_are_passed_literally(tmp_path):
    pwned = tmp_path / "PWNED"
    hostile = {
        "target_model": f"/models/with space/$(touch {pwned})",
        "data_dir": f"`touch {pwned}`/data",
        "output_dir": "/out/* ?[a] ~root $HOME ${PATH}",
        "wandb_project": "proj'\"; touch " + str(pwned) + " #",
        "wandb_run_name": f"run name\nwith a newline $(touch {pwned}) 'single' \"double\" \\ ; & | > x",
    }
    run_dir = tmp_path / f"run dir 'q\" $(touch {pwned.name})\nline2"
    run_dir.mkdir()
    container = make_container(tmp_path)
    values = base_values(**hostile)
    extra = {"NCCL_DEBUG": f"$(touch {pwned})", "ODD": "a\nb 'c'"}
    run_id = f"id $(touch {pwned}) `x` \"\n"
    bundle = f"/bundles/sp ace/$(touch {pwned})"
    script = render_start_script(values, container=container, bundle=bundle, run_id=run_id,
                                 run_dir=str(run_dir), env=extra, secrets_file=str(tmp_path / "none.env"))
    proc, dump = run_script(script, tmp_path, run_dir)
    assert proc.returncode == 0, proc.stderr
    assert not pwned.exists()
    assert dump["argv"] == ["-m", "trainer", *F.to_argv(values)]
    assert dump["env"] == start_env(container, bundle=bundle, run_id=run_id, run_dir=str(run_dir), extra=extra)


def test_an_agent_restart_resumes_from_the_checkpoint_it_names_in_place_of_the_start_decision(tmp_path):
    # agent --max-restarts sets DFLASH_RESUME_FROM for a `bash start.sh` job; before this the
    # script ignored it and a restart began from scratch again.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    container = make_container(tmp_path)
    values = base_values(wandb_run_name="--from-scratch")  # a value that only looks like a flag
    script = render_start_script(values, container=container, bundle="/b", run_id="r", run_dir=str(run_dir),
                                 secrets_file=str(tmp_path / "none.env"))
    ckpt = str(tmp_path / "out dir" / "step_40" / "checkpoint.pt")
    proc, dump = run_script(script, tmp_path, run_dir, extra_env={"DFLASH_RESUME_FROM": ckpt})
    assert proc.returncode == 0, proc.stderr
    expected = F.to_argv(dict(values, from_scratch=False, resume_from=ckpt))
    assert dump["argv"] == ["-m", "trainer", *expected]
    proc, dump = run_script(script, tmp_path, run_dir)  # a first start keeps its own decision
    assert dump["argv"] == ["-m", "trainer", *F.to_argv(values)]


def test_secrets_are_read_at_run_time_from_a_root_only_file_and_never_embedded(tmp_path):
    pwned = tmp_path / "PWNED"
    secrets = tmp_path / "secrets.env"
    secret = f"s3cr3t-$(touch {pwned})-'x'"
    secrets.write_text(f"# wandb\nWANDB_API_KEY={secret}\nNOT_ALLOWED=leak-me\n")
    secrets.chmod(0o600)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    container = make_container(tmp_path)
    script = render_start_script(base_values(), container=container, bundle="/b", run_id="r", run_dir=str(run_dir),
                                 secrets_file=str(secrets))
    assert "s3cr3t" not in script
    proc, dump = run_script(script, tmp_path, run_dir)
    assert proc.returncode == 0, proc.stderr
    assert dump["env"]["WANDB_API_KEY"] == secret
    assert "NOT_ALLOWED" not in dump["env"]
    assert "line 3 is not an allowed secret" in proc.stderr and "leak-me" not in proc.stderr
    assert not pwned.exists()


def test_a_secrets_file_others_can_read_is_refused(tmp_path):
    secrets = tmp_path / "secrets.env"
    secrets.write_text("WANDB_API_KEY=k\n")
    secrets.chmod(0o644)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = render_start_script(base_values(), container=make_container(tmp_path), bundle="/b", run_id="r",
                                 run_dir=str(run_dir), secrets_file=str(secrets))
    proc, dump = run_script(script, tmp_path, run_dir)
    assert proc.returncode == 2 and "chmod 600" in proc.stderr and dump == {}


def test_values_the_trainer_would_refuse_are_not_rendered(tmp_path):
    with pytest.raises(RenderError, match="start decision"):
        render_start_script(base_values(from_scratch=False), container=make_container(tmp_path), bundle="/b",
                            run_id="r", run_dir="/r", secrets_file="/r/s.env")
    with pytest.raises(RenderError, match="not a valid shell name"):
        render_start_script(base_values(), container=make_container(tmp_path), bundle="/b", run_id="r",
                            run_dir="/r", env={"BAD NAME": "x"}, secrets_file="/r/s.env")


def test_operators_example_renders_their_exact_flag_set(tmp_path):
    from controller import configfile, runconfig

    config = configfile.load(Path(__file__).resolve().parent.parent / "examples" / "operators.toml")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    values = config.resolve(runconfig.start_decision(True, None, None), run_id="r1", run_dir=str(run_dir),
                            workspace="/workspace")
    script = render_start_script(values, container=make_container(tmp_path), bundle="/b", run_id="r1",
                                 run_dir=str(run_dir), secrets_file=str(tmp_path / "none"))
    proc, dump = run_script(script, tmp_path, run_dir)
    assert proc.returncode == 0, proc.stderr
    args = F.parse_args(dump["argv"][2:])
    # docs/trainer-spec.md "Command line", value for value.
    expected = dict(target_gpus=(0, 1, 2, 3, 4), drafter_gpus=(5, 6, 7), from_scratch=True, epochs=6, lr=6e-4,
                    warmup_ratio=0.04, weight_decay=0.01, grad_accum=4, grad_clip=1.0, token_budget=49152,
                    max_seq_len=8192, max_batch_size=64, block_size=32, max_anchors=1024, num_draft_layers=5,
                    gamma=10.0, noise_start=0.05, noise_end=0.01, noise_type="uniform", use_soft_labels=True,
                    kl_weight=0.15, kl_temperature=2.0, cap_lambda=0.1, save_interval=2000,
                    wandb_project="dflash-27b", wandb_run_name="drafter-1.1m")
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.target_model and args.data_dir and args.output_dir == "/workspace/out/r1"


def test_the_trainer_gets_the_allocator_and_a_compile_cache_of_its_venv_generation(tmp_path):
    """Expandable segments and a compile cache under the workspace, per venv
    generation — resolved when the script runs, so a rollback (the venv link switched to
    another generation, agent/envgen.py) names the other generation's cache."""
    from trainer import runtime_env

    plain = make_container(tmp_path)
    gens = tmp_path / ".venv-generations"
    for gid in ("3f2a9c0d1b7e", "91be04d2aa51"):
        (gens / f"gen-{gid}").mkdir(parents=True)
    os.rename(plain.venv, gens / "gen-3f2a9c0d1b7e")
    os.symlink(".venv-generations/gen-3f2a9c0d1b7e", plain.venv)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = render_start_script(base_values(), container=plain, bundle="/b", run_id="r1", run_dir=str(run_dir),
                                 secrets_file=str(tmp_path / "none.env"))
    proc, dump = run_script(script, tmp_path, run_dir)
    assert proc.returncode == 0, proc.stderr
    env = dump["env"]
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["DFLASH_COMPILE_CACHE"] == str(tmp_path / "ws" / ".dflash-ctl" / "compile-cache")
    assert env["DFLASH_ENV_GENERATION"] == "3f2a9c0d1b7e"
    # what the trainer makes of it (runtime_env.apply, before torch is imported)
    applied = dict(env)
    runtime_env.apply(applied)
    assert applied["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ws/.dflash-ctl/compile-cache/gen-3f2a9c0d1b7e/inductor")
    # the rollback: same script, the link now points at the other generation
    (gens / "gen-91be04d2aa51" / "bin").mkdir()
    os.rename(gens / "gen-3f2a9c0d1b7e" / "bin" / "python3", gens / "gen-91be04d2aa51" / "bin" / "python3")
    os.unlink(plain.venv)
    os.symlink(".venv-generations/gen-91be04d2aa51", plain.venv)
    proc, dump = run_script(script, tmp_path, run_dir)
    assert proc.returncode == 0, proc.stderr
    assert dump["env"]["DFLASH_ENV_GENERATION"] == "91be04d2aa51"
