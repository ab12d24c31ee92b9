"""The trainer's fast target forward (trainer/gpu/fast_target.py inside trainer/target.py), the
auto choice of the fast paths, and synthetic random-weight targets of real shapes
(trainer/synth/synthetic.py) — all on CPU at the "small" shape."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from trainer import flags

from trainer.synth import synthetic
from trainer.model import FrozenHead, build_target_layer_ids
from trainer.target import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic") / "small"
    synthetic.write_synthetic(str(out), "small", samples=48, max_len=160, min_len=40, seed=3)
    return out


def layer_ids(target_dir):
    cfg = json.loads((target_dir / "config.json").read_text())
    return build_target_layer_ids(cfg["num_hidden_layers"], 2)


def test_fast_forward_gives_the_transformers_taps_and_final_state(small):
    tdir = small / "target"
    hf = Target(str(tdir), layer_ids(tdir), "cpu", torch.float32, forward="hf")
    fast = Target(str(tdir), layer_ids(tdir), "cpu", torch.float32, forward="fast")
    ids = torch.randint(0, 1000, (3, 57), generator=torch.Generator().manual_seed(0))
    for want_final in (False, True):
        t_hf, f_hf = hf.forward(ids, want_final)
        t_fast, f_fast = fast.forward(ids, want_final)
        assert t_fast.shape == t_hf.shape == (3, 57, 2 * 128)
        torch.testing.assert_close(t_fast, t_hf, rtol=1e-4, atol=1e-5)
        if want_final:
            torch.testing.assert_close(f_fast, f_hf, rtol=1e-4, atol=1e-5)
        else:
            assert f_fast is None and f_hf is None
    # the transformers layers now view the fused weights (memory not doubled) and still compute the same
    attn, fused = fast.model.model.layers[0].self_attn, fast.fast.layers[0].wqkv
    assert attn.q_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert attn.v_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    torch.testing.assert_close(fast.forward_logits(ids[:1])[1], hf.forward_logits(ids[:1])[1])


def test_synthetic_target_ranks_and_drafter_ranks_make_the_same_head(small):
    tdir = small / "target"
    target = Target(str(tdir), layer_ids(tdir), "cpu", torch.float32)
    head = FrozenHead.from_target_dir(str(tdir), "cpu", torch.float32)
    assert torch.equal(target.embed, head.embed) and torch.equal(target.lm_head, head.lm_head)
    assert not torch.equal(head.embed, head.lm_head)  # two tensors, untied as in config.json
    other = synthetic.write_synthetic(str(small.parent / "seed4"), "small", samples=4, max_len=40, seed=4)
    assert not torch.equal(FrozenHead.from_target_dir(other["target"]).embed, head.embed)


def test_synthetic_data_never_holds_the_drafters_mask_token(small):
    from trainer.data import PreparedData
    from trainer.model import DrafterConfig
    from trainer.target import read_config

    cfg = read_config(str(small / "target"))
    mask = DrafterConfig.from_target(cfg, 2, 8).mask_token_id
    data = PreparedData(str(small / "data"))
    ids = [int(t) for i in range(len(data)) for t in data.sample(i)[0]]
    assert mask == cfg["vocab_size"] - 1 and mask not in ids and max(ids) < mask
    # at the real shapes too, where the Qwen3 default (151669) would sit inside the data's range
    big = synthetic.hf_config(synthetic.SHAPES["qwen3-8b"])
    assert DrafterConfig.from_target(big, 5, 32).mask_token_id == big["vocab_size"] - 1 == 151935


def test_auto_picks_the_fast_paths_on_cuda_only():
    v = flags.defaults()
    assert (v["drafter_step"], v["target_forward"]) == ("auto", "auto")
    assert flags.drafter_step_for(v, cuda=True) == "chunked" and flags.target_forward_for(v, cuda=True) == "fast"
    assert flags.drafter_step_for(v, cuda=False) == "reference" and flags.target_forward_for(v, cuda=False) == "hf"
    # the chunked step has D-PACE weights too (a no-gradient pre-pass): no exception for them
    assert flags.drafter_step_for({**v, "position_weights": "dpace"}, cuda=True) == "chunked"
    assert flags.drafter_step_for({**v, "drafter_step": "reference"}, cuda=True) == "reference"
    assert flags.target_forward_for({**v, "target_forward": "hf"}, cuda=True) == "hf"


def test_split_run_on_a_synthetic_target_with_both_fast_paths(small, tmp_path):
    """1 target + 1 drafter rank (gloo): the drafter rank builds the head from the seed alone,
    the target rank runs the fast forward, the chunked step trains; a checkpoint results."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "trainer", "--target-model", str(small / "target"), "--data-dir", str(small / "data"),
            "--output-dir", str(out), "--device", "cpu", "--target-gpus", "0", "--drafter-gpus", "1",
            "--from-scratch", "--max-steps", "3", "--block-size", "8", "--max-anchors", "8", "--num-draft-layers", "2",
            "--token-budget", "480", "--max-seq-len", "160", "--grad-accum", "2", "--use-soft-labels",
            "--target-forward", "fast", "--drafter-step", "chunked", "--lr", "3e-3"]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(e["loss"])) and e["tokens"] > 0 for e in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] + 0.5  # training, not diverging
    assert (out / "step_3" / "checkpoint.pt").is_file()


def test_chunked_step_trains_dpace_with_the_reference_steps_loss(small, tmp_path):
    """D-PACE on the chunked step (once refused at validation): the same seed, data and
    objective as the reference step give the same losses, step after step — so the weights
    reach the chunked step and train the same drafter."""
    losses = {}
    for step in ("reference", "chunked"):
        out = tmp_path / step
        argv = [sys.executable, "-m", "trainer", "--target-model", str(small / "target"), "--data-dir",
                str(small / "data"), "--output-dir", str(out), "--device", "cpu", "--target-gpus", "0",
                "--drafter-gpus", "0", "--from-scratch", "--max-steps", "2", "--block-size", "8", "--max-anchors", "8",
                "--num-draft-layers", "2", "--token-budget", "480", "--max-seq-len", "160", "--lr", "3e-3",
                "--position-weights", "dpace", "--dpace-alpha", "0.5", "--cap-lambda", "0.1",
                "--target-forward", "hf", "--drafter-step", step, "--log-interval", "1"]
        r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-2000:]
        events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
        losses[step] = [e["loss"] for e in events if e["kind"] == "step"]
        assert len(losses[step]) == 2 and all(math.isfinite(x) for x in losses[step]), losses
    # equal to fp32 rounding (measured: identical to all printed digits at both steps)
    assert losses["chunked"] == pytest.approx(losses["reference"], rel=1e-5), losses


def test_synthetic_refuses_bad_input_and_writes_nothing(tmp_path):
    for args, words in ((["--shape", "qwen3-999b"], "invalid choice"),
                        (["--shape", "small", "--min-len", "300", "--max-len", "200"], "--min-len 300"),
                        (["--shape", "small", "--samples", "0"], "--samples 0")):
        r = subprocess.run([sys.executable, "-m", "trainer", "synthetic", "--out", str(tmp_path / "s"), *args],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert words in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "s").exists()


def test_the_chunked_forward_is_the_unchunked_one_and_writes_every_output(small):
    """The target forward runs in chunks of whole sequences (bounded memory: unchunked, 450,560
    tokens ran an H200 out of memory); any chunking gives the transformers forward's taps and
    final state, a layer named twice included, and every element of the outputs is written
    (poisoned buffers first)."""
    tdir = small / "target"
    ids_ = layer_ids(tdir)
    hf = Target(str(tdir), ids_ + ids_[:1], "cpu", torch.float32, forward="hf")
    fast = Target(str(tdir), ids_ + ids_[:1], "cpu", torch.float32, forward="fast")
    ids = torch.randint(0, 1000, (5, 41), generator=torch.Generator().manual_seed(2))
    want_taps, want_final = hf.forward(ids, True)
    real_empty = torch.empty
    try:
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))  # poison the output buffers
        for chunk_tokens in (1, 41, 2 * 41, 3 * 41 + 5, 10_000):
            taps, final = fast.fast.forward(ids, want_final=True, chunk_tokens=chunk_tokens)
            assert not taps.isnan().any() and not final.isnan().any()
            torch.testing.assert_close(taps, want_taps, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(final, want_final, rtol=1e-4, atol=1e-5)
    finally:
        torch.empty = real_empty


def test_noise_is_added_in_place_keyed_and_as_one_draw_would_give_it():
    """The noise costs no second copy of the taps (17 GiB at 450,560 Qwen3-8B tokens): added
    in place, one sequence at a time, from the micro-batch's key — on CPU the same numbers
    as one draw over the whole tensor, so trajectories did not change."""
    from trainer.train import add_noise

    taps = torch.randn(3, 40, 96)
    keep = taps.clone()
    out = add_noise(taps, 0.05, "uniform", 11)
    assert out is taps and not torch.equal(taps, keep)
    g = torch.Generator().manual_seed(11)
    torch.testing.assert_close(taps, keep + torch.rand(keep.shape, generator=g).mul_(2).sub_(1).mul_(0.05))
    again = add_noise(keep.clone(), 0.05, "uniform", 11)
    assert torch.equal(again, taps) and (taps - keep).abs().max() <= 0.05
    assert add_noise(keep, 0.0, "gaussian", 1) is keep
