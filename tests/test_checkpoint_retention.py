"""Disks: a run keeps the newest --keep-checkpoints checkpoints (and every
--keep-every-th), prunes only after the newer one is complete and never the newest loadable
one, resumes from the newest after pruning; and the torch-free size prediction
(trainer/plan/ckptsize.py) matches what the trainer really writes."""

from __future__ import annotations

import json
import os

import pytest

from _trainer_tiny import base_args, events, tiny_setup
from trainer import checkpoint as ckpt_io
from trainer import flags
from trainer.plan import ckptsize
from trainer.__main__ import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("retention")
    target, data = tiny_setup(str(root))
    return {"root": root, "target": target, "data": data}


def kept(out: str) -> list[int]:
    return [s for s, _, done in ckpt_io.steps(out) if done]


def test_a_long_tiny_run_keeps_exactly_n_checkpoints_and_resumes_from_the_newest(tiny, tmp_path):
    out = str(tmp_path / "out")
    common = ("--epochs", "6", "--save-interval", "2", "--keep-checkpoints", "3")
    assert main(base_args(tiny["target"], tiny["data"], out, "--from-scratch", "--max-steps", "20", *common)) == 0
    assert kept(out) == [16, 18, 20]
    assert sorted(n for n in os.listdir(out) if n.startswith("step_") or n.startswith(".")) == \
        ["step_16", "step_18", "step_20"]  # nothing half-deleted left behind
    ckpts = events(out, "checkpoint")
    assert [e["step"] for e in ckpts] == list(range(2, 21, 2))
    assert ckpts[2]["pruned"] == [] and ckpts[3]["pruned"] == [2] and ckpts[-1]["pruned"] == [14]
    # resume from the newest after pruning: training goes on and pruning with it
    assert main(base_args(tiny["target"], tiny["data"], out, "--resume-from", os.path.join(out, "step_20"),
                          "--max-steps", "26", *common)) == 0
    assert kept(out) == [22, 24, 26]
    steps = [e["step"] for e in events(out, "step")]
    assert steps == list(range(1, 21)) + list(range(21, 27))
    assert ckpt_io.load(os.path.join(out, "step_26"))["step"] == 26


def test_keep_every_keeps_those_steps_too_and_zero_keeps_all(tiny, tmp_path):
    out = str(tmp_path / "every")
    assert main(base_args(tiny["target"], tiny["data"], out, "--from-scratch", "--max-steps", "20", "--epochs", "6",
                          "--save-interval", "2", "--keep-checkpoints", "2", "--keep-every", "8")) == 0
    assert kept(out) == [8, 16, 18, 20]
    out0 = str(tmp_path / "all")
    assert main(base_args(tiny["target"], tiny["data"], out0, "--from-scratch", "--max-steps", "6",
                          "--save-interval", "2", "--keep-checkpoints", "0")) == 0
    assert kept(out0) == [2, 4, 6]


def fake_save(out, step):
    d = os.path.join(out, f"step_{step}")
    os.makedirs(d)
    open(os.path.join(d, ckpt_io.CHECKPOINT), "w").close()


def test_prune_leaves_the_newest_newer_steps_and_never_prunes_after_an_incomplete_save(tmp_path):
    out = str(tmp_path)
    for s in (2, 4, 6, 30):  # step_30: an earlier, longer run in the same output dir
        fake_save(out, s)
    os.makedirs(os.path.join(out, "step_3"))  # a save that died before its checkpoint.pt
    os.makedirs(os.path.join(out, "step_8"))  # the save in progress: not complete
    assert ckpt_io.prune(out, 8, keep=1) == []  # nothing goes before the new one is complete
    open(os.path.join(out, "step_8", ckpt_io.CHECKPOINT), "w").close()
    assert ckpt_io.prune(out, 8, keep=2) == [2, 3, 4]
    assert [s for s, _, _ in ckpt_io.steps(out)] == [6, 8, 30]
    assert ckpt_io.prune(out, 8, keep=0) == []


@pytest.mark.parametrize("total,interval,keep,every", [(20, 2, 3, 0), (20, 2, 2, 8), (21, 4, 1, 0), (9, 2, 0, 0),
                                                       (50, 5, 4, 10), (3, 5, 3, 0)])
def test_retained_peak_is_what_prune_really_leaves_at_most(tmp_path, total, interval, keep, every):
    out = str(tmp_path)
    peak = 0
    for s in ckptsize.saved_steps(total, interval):
        fake_save(out, s)
        peak = max(peak, len(ckpt_io.steps(out)))
        ckpt_io.prune(out, s, keep, every)
    assert ckptsize.retained_peak(total, interval, keep, every) == peak


@pytest.mark.parametrize("total,interval,keep,every", [(20, 2, 3, 0), (20, 2, 2, 8), (21, 4, 1, 0), (50, 5, 4, 10),
                                                       (3, 5, 3, 0), (10, 2, 1, 0)])
def test_retained_peak_with_the_best_kept_covers_every_choice_of_best_and_is_reached(tmp_path, total, interval, keep, every):
    # which save is best depends on τ: prune keeps whichever best.json names, so the disk
    # verdict must hold for any of them; the bound is reached for the worst choice
    saves = ckptsize.saved_steps(total, interval)
    worst = 0
    for top in saves:
        out = str(tmp_path / f"best{top}")
        os.makedirs(out)
        peak = 0
        for s in saves:
            fake_save(out, s)
            if s == top:
                with open(os.path.join(out, ckpt_io.BEST), "w") as fh:
                    json.dump({"step": s, "tau": 9.0}, fh)
            peak = max(peak, len(ckpt_io.steps(out)))
            ckpt_io.prune(out, s, keep, every)
        worst = max(worst, peak)
    assert ckptsize.retained_peak(total, interval, keep, every, keeps_best=True) == worst


def du(path: str) -> int:
    return sum(ckptsize._blocks(os.path.getsize(os.path.join(r, f))) for r, _, fs in os.walk(path) for f in fs)


def test_the_size_prediction_matches_real_checkpoints_within_2_percent(tiny, tmp_path):
    # the tiny run's own checkpoint (the trainer's meta, config and eval records)
    out = str(tmp_path / "out")
    argv = base_args(tiny["target"], tiny["data"], out, "--from-scratch", "--max-steps", "2", "--eval-prompts", "2")
    assert main(argv) == 0
    target = json.load(open(os.path.join(tiny["target"], "config.json")))
    values = vars(flags.parse_args(argv))
    real, pred = du(os.path.join(out, "step_2")), ckptsize.checkpoint_bytes(target, values)
    assert abs(pred - real) / real < 0.02, (pred, real)
    # wider drafters, saved through the same code path after an optimizer step (bench/export/ckpt.py)
    from bench.export.ckpt import save_random_checkpoint

    for shape in [(256, 2, 768, 8, 4, 32), (512, 3, 1536, 8, 4, 64)]:
        d = str(tmp_path / f"w{shape[0]}")
        tcfg, _ = save_random_checkpoint(shape, d, values)
        real, pred = du(os.path.join(d, "step_1")), ckptsize.checkpoint_bytes(tcfg, {"num_draft_layers": shape[1]})
        assert abs(pred - real) / real < 0.02, (shape, pred, real)


def test_a_27b_width_drafter_checkpoint_is_tens_of_gigabytes():
    qwen3_32b = dict(hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, num_hidden_layers=64)
    params, _ = ckptsize.drafter_params(qwen3_32b, 5)
    assert 2.5e9 < params < 2.65e9
    assert 35e9 < ckptsize.checkpoint_bytes(qwen3_32b, {"num_draft_layers": 5}) < 37e9


def test_negative_retention_values_are_refused_by_name():
    values = {**flags.defaults(), "keep_checkpoints": -1, "keep_every": -2}
    problems = flags.check(values)
    assert any(p.startswith("--keep-checkpoints -1 is too small: it must be at least 0") for p in problems)
    assert any(p.startswith("--keep-every -2 is too small: it must be at least 0") for p in problems)
