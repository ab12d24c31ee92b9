"""Every entry point as a user types it: `--help` of `ctl` and each of its subcommands, of
`python -m trainer` and each of its subcommands, and of the agent's modules, run as real
processes. `python -m trainer --help` once died with a traceback (`%o format: an integer is
required`: the help of --warmup-ratio said "10 % of peak"), and nothing typed it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
CTL = str(Path(PYTHON).with_name("ctl"))


def _ctl_paths() -> list[list[str]]:
    """Every command path of the `ctl` app, groups included (`[]` is `ctl` itself)."""
    import typer

    from controller.cli import _register, app

    _register()
    root = typer.main.get_command(app)
    paths: list[list[str]] = []

    def walk(cmd, path: list[str]) -> None:
        paths.append(path)
        if hasattr(cmd, "commands"):  # a group (typer carries its own click classes)
            for name, sub in sorted(cmd.commands.items()):
                if not sub.hidden:
                    walk(sub, [*path, name])

    walk(root, [])
    return paths


def _trainer_paths() -> list[list[str]]:
    from trainer.__main__ import SUBCOMMANDS

    return [[]] + [[name] for name in SUBCOMMANDS]


def _agent_paths() -> list[list[str]]:
    from agent.cli import build_parser

    verbs = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse has no public walk
    return [["agent"]] + [["agent", v] for v in verbs if not v.startswith("_")] + [
        ["agent.envgen"], ["agent.recovery"], ["agent.preflight"]]


def _help_ok(argv: list[str]) -> None:
    proc = subprocess.run([*argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(argv)} --help exited {proc.returncode}:\n{out[-2000:]}"
    assert "Traceback" not in out, f"{' '.join(argv)} --help printed a traceback:\n{out[-2000:]}"
    assert "usage" in out.lower(), f"{' '.join(argv)} --help printed no usage:\n{out[-1000:]}"


@pytest.mark.parametrize("path", _ctl_paths(), ids=lambda p: " ".join(["ctl", *p]))
def test_ctl_help_exits_0(path):
    _help_ok([CTL, *path])


@pytest.mark.parametrize("path", _trainer_paths(), ids=lambda p: " ".join(["trainer", *p]))
def test_trainer_help_exits_0(path):
    _help_ok([PYTHON, "-m", "trainer", *path])


@pytest.mark.parametrize("path", _agent_paths(), ids=lambda p: " ".join(p))
def test_agent_help_exits_0(path):
    _help_ok([PYTHON, "-m", *path])


def test_trainer_help_shows_a_percent_sign_literally():
    proc = subprocess.run([PYTHON, "-m", "trainer", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "10 % of peak" in " ".join(proc.stdout.split())


def test_every_ctl_command_is_in_the_table_that_imports_only_its_module():
    """`ctl X` imports only X's module (controller/commands/__init__.py: COMMANDS); a command
    missing there still works, but pays for importing every command at start."""
    from controller.commands import COMMANDS

    assert {p[0] for p in _ctl_paths() if len(p) == 1} - {"version"} == set(COMMANDS)
