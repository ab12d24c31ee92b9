"""Checkpoints and exports written before the trainer moved into wings (commit 2761340: one flat
trainer/ folder) still work: the new code resumes such a checkpoint, exports the same weights,
and transformers loads the old export. Skipped where the clone lacks that commit."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BEFORE_THE_MOVE = "2761340"
FLAGS = ["--device", "cpu", "--target-gpus", "0", "--drafter-gpus", "0", "--block-size", "8", "--max-anchors", "6",
         "--num-draft-layers", "2", "--token-budget", "192", "--max-seq-len", "48", "--max-batch-size", "4",
         "--grad-accum", "1", "--lr", "3e-3", "--warmup-ratio", "0.1", "--gamma", "4", "--save-interval", "2",
         "--epochs", "2"]


def _trainer(tree: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=str(tree), env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory) -> Path:
    archive = subprocess.run(["git", "archive", BEFORE_THE_MOVE, "trainer", "agent"], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {BEFORE_THE_MOVE} is not in this clone's history")
    tree = tmp_path_factory.mktemp("before-the-move")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def test_a_checkpoint_from_before_the_move_resumes_exports_the_same_weights_and_its_export_loads(old_tree, tmp_path):
    tiny, old_out = tmp_path / "tiny", tmp_path / "old-out"
    assert _trainer(old_tree, "tiny", "--out", str(tiny), "--samples", "24").returncode == 0
    data = ["--target-model", str(tiny / "target"), "--data-dir", str(tiny / "data"), *FLAGS]
    made = _trainer(old_tree, *data, "--output-dir", str(old_out), "--from-scratch", "--max-steps", "2")
    assert made.returncode == 0, made.stderr[-2000:]
    step = old_out / "step_2"
    old_export = tmp_path / "export-old"
    assert _trainer(old_tree, "export", "--checkpoint", str(step), "--out", str(old_export)).returncode == 0

    # the code of this commit: resume, export, load
    resumed = _trainer(ROOT, *data, "--output-dir", str(tmp_path / "new-out"), "--resume-from", str(step),
                       "--max-steps", "4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (tmp_path / "new-out" / "step_4" / "checkpoint.pt").exists()
    new_export = tmp_path / "export-new"
    done = _trainer(ROOT, "export", "--checkpoint", str(step), "--out", str(new_export))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (new_export / "model.safetensors").read_bytes() == (old_export / "model.safetensors").read_bytes()
    old_cfg, new_cfg = (json.loads((d / "config.json").read_text()) for d in (old_export, new_export))
    assert {k: v for k, v in new_cfg.items() if k != "dflash_config"} == {k: v for k, v in old_cfg.items()
                                                                          if k != "dflash_config"}
    assert new_cfg["dflash_config"] == {**old_cfg["dflash_config"], "block_size": old_cfg["block_size"]}

    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(old_export), trust_remote_code=True, dtype="auto")
    assert sum(p.numel() for p in model.parameters()) > 0
