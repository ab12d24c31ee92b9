"""controller/front.py: `ctl exec`, `ctl status` and `ctl tail` (no --follow) parsed without
typer, as typer parses them, and everything else left to typer's app — so --help and every
option error stay typer's own words.

No node is needed: the commands here stop at the controller config (a node name that is not
in it) or at the run-id check, before anything connects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

from controller import front
from controller.commands import plain

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]
RUN = "tiny-20261201-114702-3fa9"


def click_command(name: str) -> click.Command:
    from controller.app import _register, app

    _register(name)
    return typer.main.get_command(app).commands[name]


SAMPLES = ["200", "100", "999999999", "1000000000", "99", "5", "0", "-5", "0200", " 200", "2_00", "abc", "3", "0.5",
           "30", "1e3", "nan", "inf", "-1", ""]


# what the front's bodies check before anything connects, as typer's callbacks do
BODY_CHECKS = {"container": plain.container_checked, "run": plain.run_id_checked}


def _with(spec, opt, value: str) -> list[str]:
    """A command line of ``spec`` giving ``opt`` the value (and whatever it requires)."""
    args = [f"{opt.flags[0]}={value}"]
    for other in spec.options:
        if other.required and other is not opt:
            args += [other.flags[0], "200"]
    return args + (["--", "true"] if spec.rest else [])


@pytest.mark.parametrize("name", sorted(front.COMMANDS))
def test_every_table_names_what_typer_declares(name):
    """Same flags, same parameters, flag or value, type, required, default."""
    spec = front.COMMANDS[name][0]
    cmd = click_command(name)
    options = {p.name: p for p in cmd.params if isinstance(p, click.Option)}
    assert {o.name for o in spec.options} == set(options)
    for opt in spec.options:
        p = options[opt.name]
        assert set(opt.flags) == set(p.opts) and not p.secondary_opts, opt
        assert (opt.convert is None) == p.is_flag, opt
        if opt.convert is str:
            assert p.type == click.STRING, opt
        elif opt.convert is not None:
            # What the front converts, typer reads the same, or refuses where the front's body
            # refuses it too (the checks typer's callbacks make); the rest the front leaves to typer
            for sample in SAMPLES:
                try:
                    mine = opt.convert(sample)
                except ValueError:
                    continue
                try:
                    with cmd.make_context(name, _with(spec, opt, sample)) as ctx:
                        assert ctx.params[opt.name] == mine, (opt, sample)
                except SystemExit as refused:
                    assert refused.code == 2 and opt.name in BODY_CHECKS, (opt, sample)
                    with pytest.raises(SystemExit):
                        BODY_CHECKS[opt.name](mine)
        assert opt.required == p.required, opt
        assert (False if opt.convert is None else opt.default) == p.default, opt
        assert not p.multiple and p.envvar is None, opt
    arguments = [p for p in cmd.params if isinstance(p, click.Argument)]
    assert [a.name for a in arguments] == ([spec.rest] if spec.rest else [])
    if spec.rest:
        assert arguments[0].nargs == -1 and arguments[0].required
        assert cmd.context_settings.get("allow_interspersed_args") is False  # options stop at the command


READ_ALIKE = [
    ["exec", "-c", "200", "--", "true"],
    ["exec", "--container", "200", "true"],
    ["exec", "--container=200", "ls", "-l", "--", "x"],
    ["exec", "-c", "200", "-i", "--node", "sim", "--config", "/tmp/c.toml", "--", "sh", "-c", "exit 3"],
    ["exec", "-c", "200", "--trust-new-host-key", "-n", "sim", "--", "-weird"],
    ["exec", "-c", "200", "-c", "201", "--", "true"],  # the last one wins, as in click
    ["exec", "-c", " 200", "--node=", "--", "true"],
    ["exec", "-c", "200", "--", "--"],
    ["status"],
    ["status", "-c", "200", "--run", RUN, "--json"],
    ["status", "--node", "sim", "--ctl-config", "/tmp/c.toml", "-r", RUN, "--trust-new-host-key"],
    ["tail", "-c", "200"],
    ["tail", "--container=200", f"--run={RUN}", "--since", "12", "--json", "-n", "sim"],
    ["tail", "--since=0", "--ctl-config=/x"],
    ["tail", "-c", "200", "--wait-stopped", "5", "--since", "3"],
]


@pytest.mark.parametrize("argv", READ_ALIKE, ids=" ".join)
def test_the_front_reads_what_typer_reads(argv):
    name, args = argv[0], argv[1:]
    params = front.parse(front.COMMANDS[name][0], args)
    assert params is not None, argv
    with click_command(name).make_context(name, list(args)) as ctx:
        expected = dict(ctx.params)
    if "argv" in expected:
        expected["argv"] = list(expected["argv"])
    assert params == expected
    assert front.plain_call(argv) is not None


LEFT_TO_TYPER = [
    [], ["--help"], ["exec", "--help"], ["status", "--help"], ["tail", "-h"],
    ["exec", "-c200", "--", "true"],  # one word for option and value
    ["exec", "-ic", "200", "--", "true"],  # short flags combined
    ["exec", "-c", "200"],  # no command
    ["exec", "-c", "200", "--"],
    ["exec", "--", "true"],  # no --container
    ["exec", "-c", "x", "--", "true"],  # not an int
    ["exec", "-c"],  # no value
    ["exec", "--stdin=1", "-c", "200", "--", "true"],  # a flag given a value
    ["exec", "--contain", "200", "--", "true"],  # not an option
    ["status", "--run", "-x"], ["status", "--run=--help"],  # option-like values: click decides
    ["status", "200"],  # an argument where none is taken
    ["tail", "--follow"], ["tail", "-c", "200", "-f"],  # a long session
    ["launch", "tiny.toml"], ["env", "-c", "200"], ["runs"], ["version"],
]


@pytest.mark.parametrize("argv", LEFT_TO_TYPER, ids=lambda a: " ".join(a) or "(none)")
def test_what_the_front_does_not_read_goes_to_typer(argv):
    assert front.plain_call(argv) is None


@pytest.fixture()
def env(tmp_path):
    config = tmp_path / "ctl.toml"
    config.write_text('default_node = "x"\n[nodes.x]\nhost = "127.0.0.1"\nport = 1\nuser = "root"\n')
    return {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_CTL_CONFIG": str(config), "DFLASH_CTL_SSH_CONFIG": "none",
            "XDG_CONFIG_HOME": str(tmp_path), "COLUMNS": "200"}


def ctl(env, *args):
    return subprocess.run([*CTL, *args], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=120)


@pytest.mark.parametrize("plain,typer_form", [
    (["exec", "-c", "200", "--node", "nosuch", "--", "true"], ["exec", "-c200", "--node", "nosuch", "--", "true"]),
    (["status", "-c", "200", "--node", "nosuch"], ["status", "-c200", "--node", "nosuch"]),
    (["tail", "-c", "200", "--node", "nosuch"], ["tail", "-c200", "--node", "nosuch"]),
    (["status", "-c", "200", "--run", "tiny"], ["status", "-c200", "--run", "tiny"]),  # the run-id check
    (["tail", "-c", "200", "--run=../x"], ["tail", "-c200", "--run=../x"]),
])
def test_both_paths_end_a_command_alike(env, plain, typer_form):
    """The same error line and exit code whether the front or typer parsed the command line."""
    assert front.plain_call(plain) is not None and front.plain_call(typer_form) is None
    a, b = ctl(env, *plain), ctl(env, *typer_form)
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)
    assert a.returncode == 2 and a.stderr.startswith("ctl: error: ") and len(a.stderr.splitlines()) == 1, a.stderr


def test_the_front_loads_no_typer_click_or_rich(env, tmp_path):
    listing = tmp_path / "modules.json"
    code = ("import atexit, json, sys\n"
            f"atexit.register(lambda: open({str(listing)!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
            "from controller.cli import main\nmain()\n")
    for argv in (["exec", "-c", "200", "--node", "nosuch", "--", "true"], ["status", "--node", "nosuch", "-c", "200"],
                 ["tail", "--node", "nosuch", "-c", "200"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stderr
        loaded = {m.split(".")[0] for m in json.loads(listing.read_text())}
        assert loaded & {"typer", "click", "rich", "pydantic", "paramiko"} == set(), argv


def test_help_and_usage_errors_are_typers(env):
    """--help and a missing option through the real entry point: typer's usage text."""
    helped = ctl(env, "exec", "--help")
    assert helped.returncode == 0 and "Usage:" in helped.stdout and "--container" in helped.stdout
    missing = ctl(env, "exec", "--", "true")
    assert missing.returncode == 2 and "Missing option '--container'" in missing.stderr


def test_a_reader_that_went_away_ends_the_command_quietly_with_1_as_under_typer():
    """`ctl status | head -1`: click's standalone mode exits 1 without a traceback; so does
    the front. (A command that writes into a closed pipe, both ways.)"""
    body = "lambda: [print('line ' * 1000) for _ in range(1000)] and 0"
    front_code = f"from controller import front\nfront.run({body})\n"
    typer_code = ("import typer\napp = typer.Typer()\n@app.command()\ndef c() -> None:\n"
                  f"    raise typer.Exit(({body})())\napp()\n")
    results = []
    for code in (front_code, typer_code):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        proc.stdout.close()  # the reader is gone before the first line
        err = proc.stderr.read().decode()
        results.append((proc.wait(timeout=60), err))
    assert results[0] == results[1] == (1, ""), results


@pytest.mark.parametrize("line", ["plain", "\x1b[31mred\x1b[0m and \x1b[1;32mbold green\x1b[0m", "\x1b]0;title\x07x",
                                  "ünïcode \x1b[?25l"])
def test_echo_writes_what_typer_echo_writes_into_a_pipe(line):
    """`ctl tail > log`: a trainer's coloured line reaches a file as typer.echo wrote it."""
    outs = []
    for code in ("from controller.commands.plain import echo\necho(LINE)\necho(LINE, err=True)\n",
                 "import typer\ntyper.echo(LINE)\ntyper.echo(LINE, err=True)\n"):
        proc = subprocess.run([sys.executable, "-c", f"LINE = {line!r}\n" + code], capture_output=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
        outs.append((proc.returncode, proc.stdout, proc.stderr))
    assert outs[0] == outs[1]
