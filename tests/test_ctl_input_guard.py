"""What an operator types is checked before anything is sent to a node: one run-id grammar for
every `--run`, exact types and finite numbers in run configs, UTF-8 files, and ctl's exit codes
in one home that docs/launch.md follows.

No node is needed: the controller config names a node nobody listens on (port 1), so a
command that got as far as connecting would exit 255, not 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.protocol import RUN_ID_PATTERN, new_run_id, run_id_problem
from controller import runconfig as R
from controller import configfile
from controller.exitcodes import CtlExit, MEANINGS, table_markdown

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]
TINY = (REPO / "examples" / "tiny.toml").read_text()

BAD_RUN_IDS = ["", "../../etc", "..", ".", "runs/x", "/etc", "-x", "-h", "--help", "--yes",
               "tiny", "tiny-20261201-114702", "tiny-20261201-114702-3FA9", "tiny-20261201-114702-3fa9/..",
               "tiny-20261201-114702-3fa9 --yes", "-tiny-20261201-114702-3fa9"]

# every command that takes --run, with what else it needs to get as far as sending
COMMANDS = [
    ["status", "-c", "200"],
    ["status"],  # without --container: a job's record is looked up by the run id first
    ["tail", "-c", "200"],
    ["tail", "-c", "200", "--follow"],
    ["kill-and-rollback", "-c", "200", "--yes"],
    ["kill-and-rollback", "--yes"],
    ["history", "-c", "200"],
    ["export", "-c", "200", "--to", "{tmp}/out"],
]


@pytest.fixture()
def env(tmp_path):
    config = tmp_path / "ctl.toml"
    config.write_text('default_node = "x"\n[nodes.x]\nhost = "127.0.0.1"\nport = 1\nuser = "root"\n')
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_CTL_CONFIG": str(config), "DFLASH_CTL_SSH_CONFIG": "none",
            "COLUMNS": "200"}


def ctl(env, *args) -> subprocess.CompletedProcess:
    return subprocess.run(CTL + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=120)


def one_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ctl: error: "), proc.stderr
    return lines[0]


# --- run ids --------------------------------------------------------------------------------

def test_the_launcher_makes_only_ids_of_the_grammar():
    for name in ("tiny", "a", "my.run_2", "x" * 64):
        run_id = new_run_id(name)
        assert run_id_problem(run_id) is None, run_id
    with pytest.raises(ValueError):
        new_run_id("-x")
    with pytest.raises(ValueError):
        new_run_id("../etc")


@pytest.mark.parametrize("bad", BAD_RUN_IDS)
def test_a_bad_run_id_is_named(bad):
    assert run_id_problem(bad) is not None
    assert repr(bad) in run_id_problem(bad)


def test_run_config_names_follow_the_run_id_grammar():
    for name in ("-x", "..", ".hidden", "a/b", "", "x" * 65):
        with pytest.raises(R.RunConfigError, match="name"):
            R.from_dict({"name": name, "trainer": {"target-model": "/t", "data-dir": "/d"}})


def _app():
    from controller.cli import app
    from controller.commands import register

    register(app)
    return app


def test_every_bad_run_id_on_every_command_is_refused_before_anything_is_sent(env, tmp_path, monkeypatch):
    """Exit 2 and one line naming the id, never 255 (which would mean a connection was tried).
    In-process (typer's runner on the real app): 8 commands × 16 ids × 3 spellings."""
    from typer.testing import CliRunner

    monkeypatch.setenv("DFLASH_CTL_CONFIG", env["DFLASH_CTL_CONFIG"])
    app, runner = _app(), CliRunner()
    for command in COMMANDS:
        command = [c.replace("{tmp}", str(tmp_path)) for c in command]
        for bad in BAD_RUN_IDS:
            for form in (["--run", bad], [f"--run={bad}"], ["-r", bad]):
                result = runner.invoke(app, command + form)
                assert result.exit_code == CtlExit.USAGE, (command, form, result.exit_code, result.output)
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith(f"ctl: error: --run {bad!r}: "), result.stderr
        assert not (tmp_path / "out").exists()


def test_a_bad_run_id_as_the_operator_types_it(env):
    """The same through a real `ctl` process: `--run ""` (an unset $RUN) and a path."""
    for args in (["kill-and-rollback", "-c", "200", "--run", "", "--yes"], ["tail", "--run", "", "--follow"],
                 ["kill-and-rollback", "-c", "200", "--run", "../../etc", "--yes"], ["status", "--run=-x"]):
        proc = ctl(env, *args)
        assert proc.returncode == CtlExit.USAGE, (args, proc.stderr)
        assert "--run '" in one_line(proc)


BAD_CONTAINERS = ["5", "99", "0", "-5", "1000000000", "99999999999999999999"]
# every command that takes one --container, with what else it needs to get as far as sending
CONTAINER_COMMANDS = [
    ["status"], ["tail"], ["tail", "--follow"], ["runs"], ["stop", "--run", "tiny-20261201-114702-3fa9"],
    ["exec", "--", "true"], ["kill-and-rollback", "--yes"], ["history"], ["export", "--to", "{tmp}/out"],
    ["env", "list"], ["launch", "--config", str(REPO / "examples" / "tiny.toml"), "--from-scratch"],
]


def test_every_bad_container_id_on_every_command_is_refused_before_anything_is_sent(env, tmp_path, monkeypatch):
    """A container id outside Proxmox's VMID format went to the node, and pct's parameter
    verification error came back as exit 1 ("gave no readable reply"). Now: exit 2, one line
    naming the value and the rule, never a connection (port 1 would say 255)."""
    from typer.testing import CliRunner

    monkeypatch.setenv("DFLASH_CTL_CONFIG", env["DFLASH_CTL_CONFIG"])
    app, runner = _app(), CliRunner()
    for command in CONTAINER_COMMANDS:
        command = [c.replace("{tmp}", str(tmp_path)) for c in command]
        where = 2 if command[0] == "env" else 1  # `ctl env list -c N`: a subcommand's option
        for bad in BAD_CONTAINERS:
            for form in (["--container", bad], [f"--container={bad}"], ["-c", bad]):
                result = runner.invoke(app, command[:where] + form + command[where:])
                assert result.exit_code == CtlExit.USAGE, (command, form, result.exit_code, result.output)
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith(f"ctl: error: --container {bad}: not a Proxmox VMID"), \
                    (command, form, result.stderr)
        assert not (tmp_path / "out").exists()


def test_a_bad_container_id_as_the_operator_types_it(env):
    """Through a real `ctl` process: the one-shot commands' own parser (controller/front.py)
    and typer's say the same line; a job's NODE:CTID too."""
    said = set()
    for args in (["status", "-c", "5"], ["status", "-c5"], ["exec", "-c", "99", "--", "true"], ["exec", "--container=-5", "--", "true"],
                 ["tail", "--container", "1000000000"]):
        proc = ctl(env, *args)
        assert proc.returncode == CtlExit.USAGE, (args, proc.stderr)
        said.add(one_line(proc).split(": ", 3)[3])
    assert said == {"not a Proxmox VMID: a container id is an integer from 100 to 999999999, e.g. 200 "
                    "(`pct list` on the node lists them)"}
    job = ctl(env, "launch", "-c", "x:200", "-c", "x:5", "--config", REPO / "examples" / "tiny.toml", "--from-scratch")
    assert job.returncode == CtlExit.USAGE and "--container x:5: not a Proxmox VMID" in one_line(job)
    for ids in (["5"], ["0200"]):  # a training run's and a data job's launch
        proc = ctl(env, "launch", "-c", *ids, "--config", REPO / "examples" / "tiny.toml", "--from-scratch")
        assert proc.returncode == CtlExit.USAGE and f"--container {ids[0]}: not a Proxmox VMID" in one_line(proc)
    data = Path(env["DFLASH_CTL_CONFIG"]).parent / "prepare.toml"
    data.write_text('name = "chat"\nkind = "prepare"\n[prepare]\ninput = "/w/chat.jsonl"\nout = "/w/data/x"\n')
    proc = ctl(env, "launch", "-c", "99", "--config", data)
    assert proc.returncode == CtlExit.USAGE and "--container 99: not a Proxmox VMID" in one_line(proc), proc.stderr


@pytest.mark.parametrize("args", [["stop", "-c", "200", "--run", "tiny-20261201-114702-3fa9", "--grace", "nan"],
                                  ["stop", "-c", "200", "--run", "tiny-20261201-114702-3fa9", "--grace=-1"],
                                  ["kill-and-rollback", "-c", "200", "--yes", "--grace", "inf"],
                                  ["tail", "-c", "200", "--follow", "--wait-stopped", "nan"]])
def test_seconds_that_are_not_a_duration_are_refused(env, args):
    """`--grace nan` reached the agent (a SIGKILL-or-never comparison); `--wait-stopped nan`
    passed click's FloatRange(min=0)."""
    proc = ctl(env, *args)
    assert proc.returncode == CtlExit.USAGE, proc.stderr
    assert "is not a number of seconds: give 0 or more" in one_line(proc)


def test_an_empty_export_destination_is_refused_not_taken_for_the_current_directory(env, tmp_path):
    """`ctl export --to "$DEST"` with DEST unset: Path("") is ".", which was then judged as
    the destination ("--to /home/me is not empty")."""
    for to in ("", "  "):
        proc = subprocess.run(CTL + ["export", "-c", "200", "--run", "tiny-20261201-114702-3fa9", "--to", to],
                              env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == CtlExit.USAGE
        assert f"--to {to!r}: the destination is empty" in one_line(proc)
    assert [p.name for p in tmp_path.iterdir()] == ["ctl.toml"]  # the env fixture's; nothing was written
    step = ctl(env, "export", "-c", "200", "--step", "-1", "--to", tmp_path / "out")
    assert step.returncode == CtlExit.USAGE and "--step" in step.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("option", ["--resume-from", "--init-from"])
def test_an_empty_checkpoint_is_named_not_taken_for_no_start_decision(env, option):
    proc = ctl(env, "launch", "-c", "200", "--config", REPO / "examples" / "tiny.toml", option, "")
    assert proc.returncode == CtlExit.USAGE
    assert f"{option} '': the checkpoint path is empty" in one_line(proc)


@pytest.mark.parametrize("field,value", [("host", ""), ("host", "-oProxyCommand=touch /tmp/x"), ("host", "node 1"),
                                         ("host", "node\u00001"), ("user", ""), ("user", "-oProxyCommand=x"),
                                         ("user", "ro ot")])
def test_a_node_host_or_user_ssh_cannot_take_is_refused_in_the_config(env, tmp_path, field, value):
    """host = "" was tried four times as ":22" before the error; an option-like host or user
    never reached ssh's argv (it ends options with "--") but is refused all the same."""
    import json

    node = {"host": "127.0.0.1", "port": 1, "user": "root", field: value}
    config = tmp_path / "bad.toml"
    config.write_text("[nodes.x]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in node.items()))
    proc = ctl({**env, "DFLASH_CTL_CONFIG": str(config)}, "status", "-c", "200")
    assert proc.returncode == CtlExit.USAGE, proc.stderr
    assert f"nodes.x.{field}: must be a " in one_line(proc) and "cannot connect" not in proc.stderr


@pytest.mark.parametrize("spec", ["-e", "--index-url=http://x/simple", "-r/etc/passwd", ""])
def test_a_pip_option_given_as_a_requirement_is_refused_before_connecting(env, spec):
    proc = ctl(env, "env", "install", "-c", "200", "--", spec)
    assert proc.returncode == CtlExit.USAGE, proc.stderr
    assert "not a requirement" in one_line(proc) or "cannot be empty" in one_line(proc)


@pytest.mark.parametrize("to,said", [("snapshot:../x", "a Proxmox snapshot name is a letter"),
                                     ("snapshot:" + "a" * 41, "a Proxmox snapshot name is a letter"),
                                     ("env:../../etc", "a generation is its id"), ("env:zz", "a generation is its id"),
                                     ("bogus", "give last-good, env:GENERATION or snapshot:NAME"),
                                     ("snapshot:", "give last-good")])
def test_a_rollback_target_that_cannot_exist_is_refused_before_connecting(env, to, said):
    """--to was parsed only after connecting and claiming the container."""
    for command in (["kill-and-rollback", "-c", "200", "--yes"], ["kill-and-rollback", "-c", "200", "--dry-run"],
                    ["kill-and-rollback", "--run", "tiny-20261201-114702-3fa9", "--yes"]):
        proc = ctl(env, *command, "--to", to)
        assert proc.returncode == CtlExit.USAGE, (command, proc.stderr)
        assert f"--to {to!r}: {said}" in one_line(proc)


def test_the_rollback_targets_an_operator_names_still_parse():
    from controller.rollback import parse_to

    assert parse_to("last-good") == ("last-good", None) and parse_to("known-good") == ("last-good", None)
    for ref in ("current", "@", "3f2a9c0d1b7e", "3f2a", "gen-3f2a9c0d1b7e"):
        assert parse_to(f"env:{ref}") == ("env", ref)
    for name in ("ctl-tiny-20261201-114702-3fa9", "before_upgrade", "a1"):
        assert parse_to(f"snapshot:{name}") == ("snapshot", name)


@pytest.mark.parametrize("args,said", [
    (["--from-scratch", "--data-dir", "tiny/data"], "[trainer] data-dir = 'tiny/data': must be an absolute path"),
    (["--from-scratch", "--target-model", "./target"], "[trainer] target-model = './target': must be an absolute path"),
    (["--from-scratch", "--set", "output-dir={run_id}/out"], "output-dir = '{run_id}/out': must be an absolute path"),
    (["--resume-from", "output/step_4/checkpoint.pt"], "--resume-from 'output/step_4/checkpoint.pt': the checkpoint "
                                                       "path must be an absolute path"),
    (["--init-from", "ckpt.pt"], "--init-from 'ckpt.pt': the checkpoint path must be an absolute path"),
])
def test_a_relative_container_path_is_refused_before_connecting(env, args, said):
    """A relative path meant the directory of whichever process judged it: the preflight
    refused `--data-dir tiny/data` as missing from its own directory, where the trainer, in
    another, might have found it."""
    proc = ctl(env, "launch", "-c", "200", "--config", REPO / "examples" / "tiny.toml", *args)
    assert proc.returncode == CtlExit.USAGE, proc.stderr
    assert said in one_line(proc)


def test_container_paths_an_operator_writes_still_pass():
    from controller.runconfig import container_path_problem

    for path in ("/workspace/tiny/data", "{run_dir}/output", "{workspace}/data", "/"):
        assert container_path_problem(path) is None, path


def test_a_negative_since_is_refused(env):
    proc = ctl(env, "tail", "-c", "200", "--since", "-3")
    assert proc.returncode == CtlExit.USAGE and "--since" in proc.stderr and "Traceback" not in proc.stderr


def test_the_grammar_is_one_pattern():
    import re

    assert re.fullmatch(RUN_ID_PATTERN, "tiny-20261201-114702-3fa9")


# --- values and encodings ---------------------------------------------------------------------

BAD_SETS = [
    ("lr=nan", "[trainer] lr"), ("lr=inf", "[trainer] lr"), ("warmup-ratio=nan", "[trainer] warmup-ratio"),
    ("weight-decay=nan", "[trainer] weight-decay"), ("grad-clip=nan", "[trainer] grad-clip"),
    ("grad-clip=-inf", "[trainer] grad-clip"),
    ("supervision.kill-grace=inf", "[supervision] kill-grace"),
    ("supervision.startup-timeout=nan", "[supervision] startup-timeout"),
    ("supervision.stall-timeout=1e12", "[supervision] stall-timeout"),
    ("supervision.max-restarts=1.5", "[supervision] max-restarts"),
    ("baseline.throughput-tolerance=nan", "[baseline] throughput-tolerance"),
    ("baseline.steady-steps=true", "[baseline] steady-steps"),
    ("drafter-gpus=0.5", "[trainer] drafter-gpus"),
]

# (TOML line replaced, by what, where the error points)
BAD_FILE_VALUES = [
    ("steady-steps = 5", "steady-steps = true", "[baseline] steady-steps = true: must be a whole number"),
    ("drafter-gpus = [0]", "drafter-gpus = [0.5]", "[trainer] drafter-gpus = [0.5]: 0.5 is not a GPU index"),
    ("drafter-gpus = [0]", "drafter-gpus = [1.0]", "[trainer] drafter-gpus = [1.0]: 1.0 is not a GPU index"),
    ("target-gpus = [0]", "target-gpus = [true]", "[trainer] target-gpus = [true]: true is not a GPU index"),
    ("max-steps = 24", "max-steps = 24.0", "[trainer] max-steps = 24.0: must be a whole number"),
    ("max-steps = 24", "max-steps = true", "[trainer] max-steps = true: must be a whole number"),
    ("lr = 3e-3", "lr = true", "[trainer] lr = true: must be a number"),
    ("lr = 3e-3", "lr = nan", "[trainer] lr"),
    ("token-budget = 1024", "token-budget = true", "[trainer] token-budget = true: must be a whole number"),
    ("epochs = 1", "epochs = 1\nprobe-first = 1", "[trainer] probe-first = 1: must be true or false"),
    ("regression-fraction = 0", "regression-fraction = inf", "[baseline] regression-fraction"),
]


def _tiny(**replace) -> dict:
    import tomllib

    return tomllib.loads(TINY)


@pytest.mark.parametrize("item,where", BAD_SETS)
def test_a_bad_set_value_is_refused_naming_the_key(item, where):
    with pytest.raises(R.RunConfigError) as err:
        R.from_dict(_tiny(), source="tiny.toml", sets=[item])
    assert where in str(err.value), str(err.value)
    assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("old,new,said", BAD_FILE_VALUES)
def test_a_value_of_the_wrong_type_in_the_file_is_refused(tmp_path, old, new, said):
    assert old in TINY
    path = tmp_path / "run.toml"
    path.write_text(TINY.replace(old, new))
    with pytest.raises(R.RunConfigError) as err:
        configfile.load(path)
    assert said in str(err.value), str(err.value)


def test_good_values_still_pass():
    config = R.from_dict(_tiny(), sets=["lr=1e-3", "supervision.kill-grace=30", "baseline.steady-steps=7",
                                        "drafter-gpus=0", "supervision.max-restarts=2"])
    assert config.trainer.lr == 1e-3 and config.baseline.steady_steps == 7
    assert config.supervision.kill_grace == 30 and config.supervision.max_restarts == 2


def test_a_bad_value_on_the_command_line_is_one_line_and_exit_2(env):
    proc = ctl(env, "launch", "-c", "200", "--config", REPO / "examples" / "tiny.toml", "--from-scratch",
               "--set", "lr=nan")
    assert proc.returncode == CtlExit.USAGE
    assert "[trainer] lr = nan: Input should be a finite number" in one_line(proc)  # as in the file


def test_a_run_config_that_is_not_utf8_is_one_line(env, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(TINY.replace('name = "tiny"', 'name = "tiny" # caf\xe9').encode("latin-1"))
    proc = ctl(env, "launch", "-c", "200", "--config", path, "--from-scratch")
    assert proc.returncode == CtlExit.USAGE
    assert f"run config {path}: not UTF-8 text (byte 0xe9" in one_line(proc)


def test_a_wandb_key_file_that_is_not_utf8_is_one_line(env, tmp_path):
    key = tmp_path / "wandb.key"
    key.write_bytes(b"\xff\xfe")
    path = tmp_path / "run.toml"
    path.write_text(TINY.replace('mode = "offline"', f'mode = "offline"\napi-key-file = "{key}"'))
    proc = ctl(env, "launch", "-c", "200", "--config", path, "--from-scratch")
    assert proc.returncode == CtlExit.USAGE
    assert "api-key-file" in one_line(proc) and "not UTF-8" in one_line(proc)


def test_a_controller_config_that_is_not_utf8_is_one_line(env, tmp_path):
    bad = tmp_path / "ctl-latin1.toml"
    bad.write_bytes('default_node = "n\xf6de"\n'.encode("latin-1"))
    for args in (["status", "-c", "200"], ["runs", "-c", "200"], ["exec", "-c", "200", "--", "true"]):
        proc = ctl({**env, "DFLASH_CTL_CONFIG": str(bad)}, *args)
        assert proc.returncode == CtlExit.USAGE, (args, proc.stderr)
        assert f"{bad}: not UTF-8 text (byte 0xf6" in one_line(proc)


# --- exit codes -------------------------------------------------------------------------------

def test_every_exit_code_has_its_meaning_and_the_docs_table_is_generated_from_them():
    assert set(MEANINGS) == set(CtlExit)
    assert CtlExit.CONTAINER_RESTARTED == 5
    docs = (REPO / "docs" / "launch.md").read_text()
    assert table_markdown() in docs, "docs/launch.md: regenerate the table with `python -m controller.exitcodes`"


def test_the_command_modules_use_the_one_home():
    from controller.commands import remote

    assert (remote.EXIT_CONFIG, remote.EXIT_FAILED, remote.EXIT_REFUSED, remote.EXIT_NOT_DONE,
            remote.EXIT_TRANSPORT) == (CtlExit.USAGE, CtlExit.FAILED, CtlExit.REFUSED, CtlExit.NOT_DONE,
                                       CtlExit.TRANSPORT)


def _run_taking_commands() -> dict[str, object]:
    """Every ctl command (subcommands of groups included) with a `--run` option, read from the
    click command typer builds, so a command added later is in the test without anyone listing it."""
    import click
    import typer

    def walk(command, path):
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                yield from walk(sub, path + [name])
        else:
            yield path, command

    return {" ".join(path): command for path, command in walk(typer.main.get_command(_app()), [])
            if any("--run" in getattr(p, "opts", ()) for p in command.params)}


def test_every_command_that_takes_run_refuses_each_bad_id_before_connecting(env, tmp_path, monkeypatch):
    """`ctl stop` had its own `--run` without the check: `--run=` reached the agent (its
    traceback), `../../etc` was resolved in the container and `../runs/<id>` taken for that run.
    The commands come from the app itself; each gets `--run BAD` first (its check runs before any
    other option's) and must say one line naming the id, exit 2, and connect to nothing."""
    from typer.testing import CliRunner

    monkeypatch.setenv("DFLASH_CTL_CONFIG", env["DFLASH_CTL_CONFIG"])
    commands = _run_taking_commands()
    assert "stop" in commands and len(commands) >= 6, sorted(commands)
    app, runner = _app(), CliRunner()
    for name in commands:
        for bad in ("", "../../etc", "../runs/tiny-20261201-114702-3fa9"):
            for form in (["--run", bad], [f"--run={bad}"], ["-r", bad]):
                args = name.split() + form + ["-c", "200"] + (["--to", str(tmp_path / "out")] if name == "export" else [])
                result = runner.invoke(app, args)
                assert result.exit_code == CtlExit.USAGE, (name, form, result.exit_code, result.output)
                lines = [line for line in result.stderr.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith(f"ctl: error: --run {bad!r}: "), (name, result.stderr)
    assert not (tmp_path / "out").exists()


def test_ctl_stop_with_a_bad_run_id_as_the_operator_types_it(env):
    for bad in ("", "../../etc", "../runs/tiny-20261201-114702-3fa9"):
        proc = ctl(env, "stop", "-c", "200", f"--run={bad}")
        assert proc.returncode == CtlExit.USAGE, (bad, proc.stderr)
        assert one_line(proc).startswith(f"ctl: error: --run {bad!r}: ")


@pytest.mark.parametrize("to", ["/proc/nope", "/proc/self/nope", "/sys/nope"])
def test_an_export_destination_nothing_can_be_created_in_is_one_line_before_connecting(env, to):
    """`ctl export --to /proc/nope` passed the parent checks (a directory, and os.access says
    writable to root) and failed after the export in the container, with FileNotFoundError's
    traceback from the temporary directory's mkdir. Now the destination is tried first."""
    proc = ctl(env, "export", "-c", "200", "--run", "tiny-20261201-114702-3fa9", "--to", to)
    assert proc.returncode == CtlExit.USAGE, proc.stderr
    line = one_line(proc)
    assert line.startswith(f"ctl: error: --to {to}: ") and "writable" in line, line


SET_LIKE_THE_FILE = [("max-steps", "24.0"), ("max-steps", "true"), ("lr", "true"), ("token-budget", "true"),
                     ("token-budget", "1024.0"), ("probe-first", "1"), ("baseline.steady-steps", "true"),
                     ("baseline.steady-steps", "5.0"), ("supervision.max-restarts", "2.0")]


@pytest.mark.parametrize("key,text", SET_LIKE_THE_FILE)
def test_a_set_value_is_judged_by_the_rule_of_the_same_value_in_the_file(tmp_path, key, text):
    """`--set max-steps=24.0` was accepted (pydantic's lax reading of the text) while
    `max-steps = 24.0` in the file was refused: a --set value is now read as the TOML value it
    spells, then checked exactly as the file's. Both refusals say the same thing."""
    with pytest.raises(R.RunConfigError) as by_set:
        R.from_dict(_tiny(), source="tiny.toml", sets=[f"{key}={text}"])
    table, _, name = key.rpartition(".")
    data = _tiny()
    data.setdefault(table or "trainer", {})[name] = __import__("tomllib").loads(f"v = {text}")["v"]
    with pytest.raises(R.RunConfigError) as in_file:
        R.from_dict(data, source="tiny.toml")
    assert str(by_set.value) == str(in_file.value), (str(by_set.value), str(in_file.value))


def test_set_values_that_are_text_stay_text():
    config = R.from_dict(_tiny(), sets=["wandb.run-name=2024", "max-steps=24", "lr=3e-4", "token-budget=auto",
                                        "probe-first=true"])
    values = config.values()
    assert config.wandb.run_name == "2024" and values["max_steps"] == 24 and values["lr"] == 3e-4
    assert values["token_budget"] == "auto" and values["probe_first"] is True


@pytest.mark.parametrize("line", ["concurrency = 1000000000", "concurrency = true", "temperature = nan"])
def test_a_regenerate_launch_with_an_unbounded_value_is_refused_before_connecting(env, tmp_path, line):
    """`concurrency = 1000000000` was launched, and the job took its node down."""
    config = tmp_path / "regen.toml"
    config.write_text('name = "regen"\nkind = "regenerate"\n[regenerate]\ninput = "/w/in.jsonl"\nout = "/w/out"\n'
                      f'endpoint = ["http://10.0.0.5:30000"]\n{line}\n')
    proc = ctl(env, "launch", "-c", "200", "--config", config)
    assert proc.returncode == CtlExit.USAGE, proc.stderr
    assert f"[regenerate]" in one_line(proc) and line.split()[0] in one_line(proc)
