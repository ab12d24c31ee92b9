"""`ctl tail --follow` as a person sees it on a terminal — the log scrolling above one live
status line (step/total, tokens/s against the baseline, loss, ETA) — and as a pipe gets it:
plain lines, no terminal control codes (issue "The demo tells the story")."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sim]

REPO = Path(__file__).resolve().parent.parent
CTL = [sys.executable, "-c", "from controller.cli import main; main()"]
CT = "200"
ANSI = re.compile(r"\x1b\[")
CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def screen_lines(out: str) -> list[str]:
    """The lines a terminal is left showing, for the two moves a live display makes here:
    a carriage return, then erase-line and redraw. What follows a line's last \\r is what
    stays on it; its control sequences are dropped."""
    lines = []
    for raw in out.split("\n"):
        kept = [seg for seg in raw.split("\r") if CSI.sub("", seg)]
        lines.append(CSI.sub("", kept[-1]) if kept else "")
    return lines


def _env(ctl_config) -> dict:
    return dict(os.environ, DFLASH_CTL_CONFIG=str(ctl_config), DFLASH_CTL_SSH_CONFIG="none", COLUMNS="160")


@pytest.fixture(scope="module")
def finished_run(sim_node, ctl_config, tmp_path_factory):
    """A 12-step tiny run, followed to its end through a pipe: the plain form."""
    config = tmp_path_factory.mktemp("live") / "tiny.toml"
    config.write_text((REPO / "examples/tiny.toml").read_text().replace("max-steps = 24", "max-steps = 12"))
    proc = subprocess.run([*CTL, "launch", "--container", CT, "--config", str(config), "--from-scratch",
                           "--accept-drift", "--follow"], capture_output=True, text=True, env=_env(ctl_config),
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = re.search(r"^run (\S+) started in ", proc.stdout, re.M).group(1)
    return run_id, proc.stdout


def test_a_pipe_gets_plain_lines_and_a_closing_status_line(finished_run):
    _, out = finished_run
    assert not ANSI.search(out)
    assert re.search(r"^step 12/12 \|", out, re.M)  # the trainer's own log line, as it printed it
    assert re.search(r"^-- step 12/12 \| loss \d", out, re.M)


def test_a_terminal_gets_a_live_status_line_that_follows_the_steps(finished_run, sim_node, ctl_config):
    run_id, _ = finished_run
    before = _pct_execs(sim_node)
    pid, fd = pty.fork()
    if pid == 0:  # the child: ctl on the terminal's slave side, no --run: the latest is finished_run
        os.chdir(REPO)
        os.execvpe(CTL[0], [*CTL, "tail", "--container", CT, "--follow"], _env(ctl_config))
    chunks, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    out = b"".join(chunks).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, out[-2000:]
    assert ANSI.search(out), "no live display on a terminal"
    shown = re.findall(r"step (\d+)/12 +\S+ tok/s.*?loss [\d.]+ +ETA", out)
    assert len(set(shown)) >= 3 and "12" in shown, out[-2000:]  # redrawn as the steps came
    screen = screen_lines(out)
    assert any(line.startswith("step 12/12 |") for line in screen), screen[-20:]  # the log, whole
    while screen and not screen[-1]:
        screen.pop()
    assert screen[-1].startswith("ctl: run ") and "completed" in screen[-1], screen[-3:]
    assert screen[-2].startswith("step 12/12  "), screen[-3:]  # the status line stays, above it
    assert "-- step" not in out  # no status lines mixed into the log on a terminal
    assert run_id in screen[-1]
    # One status call gives both the latest run and the live line's baseline, then the
    # stream, whose own terminal status record is the state it ended in (controller/tail.py):
    # two calls into the container.
    assert _pct_execs(sim_node) - before == 2


def _pct_execs(sim_node) -> int:
    log = Path(sim_node.paths.log) / "pct-calls.log"
    return sum(1 for line in log.read_text().splitlines() if '"exec"' in line) if log.exists() else 0


def test_tail_without_follow_is_one_call_into_the_container(finished_run, sim_node, ctl_config):
    """No --run, no --follow: the latest run's log as it is now, in one `pct exec` (the stream
    call finds the latest run itself; nothing is asked of the run's state)."""
    run_id, _ = finished_run
    before = _pct_execs(sim_node)
    proc = subprocess.run([*CTL, "tail", "--container", CT], capture_output=True, text=True, env=_env(ctl_config),
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^step 12/12 \|", proc.stdout, re.M) and run_id in proc.stdout
    assert _pct_execs(sim_node) - before == 1
