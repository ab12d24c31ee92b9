"""Leaks and modes (the agent and trainer side): the temp files of an
interrupted checkpoint save and temp drafter directories are removed at the next start of a
run in that output root and by `agent list --prune` (`ctl runs --prune`) — only those of
writers that are gone, never a save in progress —, and the output directories are
world-readable like their files even under umask 077."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from _trainer_tiny import base_args, tiny_setup
from agent import leftovers
from agent.protocol import extract_payload
from tests._agent_util import PY, REPO, env

MiB = 1 << 20


def _dead_tag() -> str:
    """The tag of a writer that has exited (a real process, now gone)."""
    return subprocess.run([sys.executable, "-c", "from agent.leftovers import writer_tag; print(writer_tag())"],
                          capture_output=True, text=True, check=True, cwd=REPO, env=env()).stdout.strip()


def _plant(step_dir, tag: str) -> list[str]:
    """A torn checkpoint temp (1 MiB) and a temp drafter directory, as a save killed mid-way leaves them."""
    os.makedirs(step_dir, exist_ok=True)
    pt = os.path.join(step_dir, f".checkpoint-{tag}-k3j9.tmp")
    with open(pt, "wb") as fh:
        fh.write(b"\0" * MiB)
    drafter = os.path.join(step_dir, f".drafter.tmp-{tag}-x1y2")
    os.makedirs(drafter)
    with open(os.path.join(drafter, "model.safetensors"), "wb") as fh:
        fh.write(b"\0" * 1000)
    return [pt, drafter]


def test_prune_removes_the_temp_files_of_dead_writers_only(tmp_path):
    ws = tmp_path / "ws"
    dead = _plant(ws / "runs" / "old" / "output" / "step_4", _dead_tag())
    live = _plant(ws / "runs" / "busy" / "output" / "step_6", leftovers.writer_tag())  # a save in progress: ours
    outside = _plant(ws / "out" / "old2" / "step_2", _dead_tag())  # an output root named in the run's start.sh
    for run in ("old", "busy", "other"):
        (ws / "runs" / run).mkdir(parents=True, exist_ok=True)
        (ws / "runs" / run / "spec.json").write_text('{"run_id": "%s", "argv": ["bash", "start.sh"]}' % run)
    (ws / "runs" / "other" / "start.sh").write_text(f"exec python3 -m trainer \\\n  --output-dir {ws}/out/new\n")
    p = subprocess.run([PY, "-m", "agent", "list", "--workspace", str(ws), "--prune"], capture_output=True, text=True,
                       env=env(), cwd=REPO)
    reply = extract_payload(p.stdout)
    assert sorted(g["path"] for g in reply["pruned"]) == sorted(dead + outside)
    assert sum(g["bytes"] for g in reply["pruned"]) == 2 * (MiB + 1000)
    assert not any(os.path.exists(x) for x in dead + outside)
    assert all(os.path.exists(x) for x in live)
    assert os.path.isdir(ws / "runs" / "old" / "output" / "step_4")  # only the temp files went


def test_untagged_and_unrelated_hidden_names_are_never_touched(tmp_path):
    keep = [tmp_path / ".checkpoint-abc.tmp", tmp_path / ".hidden", tmp_path / "step_1.tmp-w1.2.abc-x"]
    for k in keep:
        k.write_text("x")
    assert leftovers.sweep([(str(tmp_path), 2)]) == []
    assert all(k.exists() for k in keep)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target, data = tiny_setup(str(tmp_path_factory.mktemp("leftovers")))
    return target, data


def test_a_run_start_removes_an_earlier_runs_torn_save_and_makes_its_dirs_world_readable_under_umask_077(
        tiny, tmp_path, capsys):
    from trainer.__main__ import main

    root = tmp_path / "out"
    dead = _plant(root / "failed-run" / "step_12", _dead_tag())
    old = os.umask(0o077)
    try:
        assert main(base_args(*tiny, str(root / "new-run"), "--from-scratch", "--max-steps", "1",
                              "--save-interval", "1")) == 0
        from trainer.drafter_dir import make_public_dir

        make_public_dir(str(tmp_path / "a" / "b" / "c"))  # every parent it creates, too
    finally:
        os.umask(old)
    assert not any(os.path.exists(x) for x in dead)
    assert "left by an interrupted save" in capsys.readouterr().out
    out = root / "new-run"
    for d in (out, out / "step_1", out / "step_1" / "drafter", tmp_path / "a", tmp_path / "a" / "b",
              tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o755, d
    for f in (out / "step_1" / "checkpoint.pt", *(out / "step_1" / "drafter").iterdir()):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o644, f
    assert not [n for n in os.listdir(out / "step_1") if n.startswith(".")]
