"""1 target rank + 2 drafter ranks (gloo, point-to-point micro-batches, DDP) follow the same
loss trajectory as one colocated process.

--grad-accum counts micro-batches per drafter rank (topology.py): one step consumes
grad_accum × drafter ranks micro-batches of the same global stream, so the colocated run
uses --grad-accum 2 and the split run --grad-accum 1. Anchors and noise are keyed by
sample and micro-batch, so both runs see identical inputs; the only difference is float
summation order (DDP's all-reduce vs local accumulation). Tolerance: 1e-5 absolute on
every step's loss, 1e-5 on the final weights.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from _trainer_tiny import base_args, replace, sigterm_once_training, step_events, tiny_setup
from trainer import checkpoint as ckpt_io
from trainer.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4


@pytest.mark.parametrize("tgpus,dgpus,split_accum,colo_accum", [("0", "1,2", "1", "2"), ("0,1", "2", "3", "3")],
                         ids=["1-target-2-drafters", "2-targets-1-drafter"])
def test_split_ranks_follow_the_colocated_trajectory(tmp_path, tgpus, dgpus, split_accum, colo_accum):
    target, data = tiny_setup(str(tmp_path))
    extra = ("--from-scratch", "--max-steps", str(STEPS), "--use-soft-labels", "--noise-start", "0.05", "--noise-end", "0.01",
             "--epochs", "4")
    colo = str(tmp_path / "colocated")
    assert main(replace(base_args(target, data, colo, *extra), "--grad-accum", colo_accum)) == 0

    split = str(tmp_path / "split")
    argv = replace(replace(replace(base_args(target, data, split, *extra), "--target-gpus", tgpus), "--drafter-gpus", dgpus),
                   "--grad-accum", split_accum)
    # started like an operator would: no torchrun env → the trainer re-launches itself under torchrun
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

    a, b = step_events(colo), step_events(split)
    assert [e["step"] for e in b] == list(range(1, STEPS + 1))
    first_drafter = len(tgpus.split(","))
    assert {e["rank"] for e in b} == {first_drafter} and b[0]["role"] == "drafter"  # the first drafter rank logs
    assert [e["tokens"] for e in a] == [e["tokens"] for e in b]
    for key in ("loss", "ce", "kl", "grad_norm"):
        assert [e[key] for e in a] == pytest.approx([e[key] for e in b], abs=1e-5), key
    wa = ckpt_io.load(os.path.join(colo, f"step_{STEPS}"))["model"]
    wb = ckpt_io.load(os.path.join(split, f"step_{STEPS}"))["model"]
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4)
    beats = sorted(os.listdir(os.path.join(split, "heartbeat")))
    assert beats == ["rank-0", "rank-1", "rank-2"]
    roles = [json.load(open(os.path.join(split, "heartbeat", r)))["role"] for r in beats]
    assert roles == ["target"] * first_drafter + ["drafter"] * (3 - first_drafter)


def test_two_colocated_ranks_follow_the_single_process_trajectory(tmp_path):
    """2 colocated ranks (each target + drafter, gradients averaged once per step) with
    --grad-accum 2 == 1 process with --grad-accum 4."""
    target, data = tiny_setup(str(tmp_path))
    extra = ("--from-scratch", "--max-steps", "3", "--epochs", "4", "--noise-start", "0.05")
    one = str(tmp_path / "one")
    assert main(replace(base_args(target, data, one, *extra), "--grad-accum", "4")) == 0
    two = str(tmp_path / "two")
    argv = replace(replace(replace(base_args(target, data, two, *extra), "--grad-accum", "2"),
                           "--target-gpus", "0,1"), "--drafter-gpus", "0,1")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = step_events(one), step_events(two)
    assert [e["tokens"] for e in a] == [e["tokens"] for e in b]
    assert [e["loss"] for e in a] == pytest.approx([e["loss"] for e in b], abs=1e-5)
    wa = ckpt_io.load(os.path.join(one, "step_3"))["model"]
    wb = ckpt_io.load(os.path.join(two, "step_3"))["model"]
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4)


def test_sigterm_to_a_relaunched_run_stops_every_rank_after_a_checkpoint(tmp_path):
    """The agent signals the process it started (the thin parent); every rank must stop after
    the same step, the checkpoint must be written, and the exit code must be EXIT_STOPPED."""
    from trainer import flags

    target, data = tiny_setup(str(tmp_path))
    out = str(tmp_path / "out")
    argv = replace(replace(base_args(target, data, out, "--from-scratch", "--epochs", "20"), "--target-gpus", "0"),
                   "--drafter-gpus", "1")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sigterm_once_training(proc, out)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == flags.EXIT_STOPPED, err[-3000:]
    k = step_events(out)[-1]["step"]
    beats = [json.load(open(os.path.join(out, "heartbeat", f"rank-{r}"))) for r in (0, 1)]
    assert [(b["state"], b["step"]) for b in beats] == [("stopped", k), ("stopped", k)]
    assert ckpt_io.load(os.path.join(out, f"step_{k}"))["step"] == k


def test_chunked_drafter_step_matches_the_reference_and_averages_over_ranks(tmp_path):
    """--drafter-step chunked (trainer/gpu/fast_drafter.py) follows the reference step's
    trajectory (fp32 on CPU; 1e-4), and split over 2 drafter ranks, where it averages
    gradients itself instead of DDP, follows its colocated run (1e-5)."""
    target, data = tiny_setup(str(tmp_path))
    extra = ("--from-scratch", "--max-steps", "3", "--epochs", "4", "--use-soft-labels", "--kl-weight", "0.3",
             "--cap-lambda", "0.2", "--noise-start", "0.05")
    runs = {}
    for name, step_kind in (("reference", "reference"), ("chunked", "chunked")):
        out = str(tmp_path / name)
        assert main(replace(base_args(target, data, out, *extra, "--drafter-step", step_kind), "--grad-accum", "2")) == 0
        runs[name] = step_events(out)
    assert [e["loss"] for e in runs["chunked"]] == pytest.approx([e["loss"] for e in runs["reference"]], abs=1e-4)
    # the chunked step reports the same terms and per-slot accuracy as the reference (StepStats)
    for name in ("ce", "kl", "cap"):
        assert [e[name] for e in runs["chunked"]] == pytest.approx([e[name] for e in runs["reference"]], abs=1e-4), name
    assert [e["acc"] for e in runs["chunked"]] == [e["acc"] for e in runs["reference"]]

    split = str(tmp_path / "split")
    argv = replace(replace(replace(base_args(target, data, split, *extra, "--drafter-step", "chunked"), "--target-gpus", "0"),
                           "--drafter-gpus", "1,2"), "--grad-accum", "1")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["loss"] for e in step_events(split)] == pytest.approx([e["loss"] for e in runs["chunked"]], abs=1e-5)
    wa = ckpt_io.load(os.path.join(str(tmp_path / "chunked"), "step_3"))["model"]
    wb = ckpt_io.load(os.path.join(split, "step_3"))["model"]
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-5, rtol=1e-4)
