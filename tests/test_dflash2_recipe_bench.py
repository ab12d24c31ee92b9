"""bench/dflash2_recipe/run.py: the 5 + 3 prediction's arithmetic, the deterministic length draw
and the pairing, and the whole harness on CPU at tiny widths (the code the GPU run uses)."""

from __future__ import annotations

import importlib
import json
import math

import pytest

bench = importlib.import_module("bench.dflash2_recipe.run")


def test_their_own_rates_through_the_rule_give_11_1_trainer_bound():
    p = bench.predict(2.25, 3.7)
    assert p.samples_s == pytest.approx(11.1)  # min(5 × 2.25 = 11.25, 3 × 3.7 = 11.1)
    assert p.bound == "trainer" and p.without_transfer == pytest.approx(11.1)
    assert p.capture_side == pytest.approx(11.25) and p.transfer_s_per_sample == 0


def test_the_transfer_lengthens_each_sides_time_per_sample_and_can_move_the_bound():
    # 1 GB a sample over 1 GB/s: 1 s added on both sides (blocking send and receive)
    p = bench.predict(2.0, 4.0, transfer_bytes=1e9, link_bytes_s=1e9, servers=5, trainers=3)
    assert p.transfer_s_per_sample == pytest.approx(1.0)
    assert p.capture_side == pytest.approx(5 / 1.5) and p.trainer_side == pytest.approx(3 / 1.25)
    assert p.samples_s == pytest.approx(2.4) and p.bound == "trainer"
    assert p.without_transfer == pytest.approx(10.0)  # capture-bound before the transfer


def test_a_free_link_changes_nothing_and_bad_rates_are_refused():
    assert bench.predict(3.0, 5.0, transfer_bytes=5e8).samples_s == pytest.approx(15.0)
    with pytest.raises(ValueError):
        bench.predict(0.0, 3.7)
    with pytest.raises(ValueError):
        bench.predict(2.25, 3.7, servers=0)


def test_bytes_per_sample_match_the_recipes_payload_at_the_corpus_mean():
    # the recipe: six bf16 tensors of tokens × 5120, "about 277 MB at the corpus mean" (4.5k)
    # and 500 MB at 8192 tokens
    assert bench.bytes_per_sample(4508, 5120, 6) == pytest.approx(277e6, rel=0.01)
    assert bench.bytes_per_sample(8192, 5120, 6) == pytest.approx(503e6, rel=0.01)
    # the ids, loss mask, length and anchors ride along in int64
    assert bench.bytes_per_sample(100, 8, 1, anchors=10) == 100 * 8 * 2 + 8 * (200 + 1 + 20)


def test_lengths_are_deterministic_with_the_recipes_mean_and_cap():
    a = bench.draw_lengths(16, 4500, 8192, 0.10)
    assert a == bench.draw_lengths(16, 4500, 8192, 0.10)
    assert max(a) == 8192 and min(a) >= 16 and a == sorted(a)
    assert sum(a) / len(a) == pytest.approx(4500, rel=0.01)
    many = bench.draw_lengths(1000, 4500, 8192, 0.10)
    assert sum(x == 8192 for x in many) == 100  # the 90th percentile sits at the cap
    assert sum(many) / len(many) == pytest.approx(4500, rel=0.005)
    mu, s = bench.lognormal_fit(4500, 8192, 0.10)
    assert math.exp(mu + 1.2815515655 * s) == pytest.approx(8192, rel=1e-6)


def test_an_impossible_mean_length_is_refused_with_the_possible_range():
    with pytest.raises(ValueError, match="mean length 9000"):
        bench.draw_lengths(16, 9000, 8192, 0.10)
    with pytest.raises(ValueError, match="samples 0"):
        bench.draw_lengths(0, 4500, 8192, 0.10)


def test_pairs_are_seeded_and_cover_every_sample_once():
    lengths = bench.draw_lengths(16, 4500, 8192, 0.10)
    pairs = bench.pair_up(lengths, 2, 0)
    assert pairs == bench.pair_up(lengths, 2, 0) and pairs != bench.pair_up(lengths, 2, 1)
    assert sorted(i for p in pairs for i in p) == list(range(16)) and all(len(p) == 2 for p in pairs)
    with pytest.raises(ValueError, match="not a multiple"):
        bench.pair_up(lengths[:15], 2, 0)


def test_the_bench_runs_every_section_on_cpu_and_predicts_from_its_own_records(tmp_path):
    assert bench.main(["--out", str(tmp_path), "--smoke", "--passes", "1"]) == 0
    r = json.loads((tmp_path / "results.json").read_text())["runs"]
    d, c, p = r["drafter"], r["capture"], r["predict"]
    assert d["samples_s"] > 0 and d["optimizer_steps_per_pass"] == 1 and d["micro_batch"] == 2
    assert d["layer_types"] == ["sliding_attention"] * 2 and math.isfinite(d["loss_first_step"])
    assert c["prompts_s"] > 0 and c["precision"] == "fp8" and c["tensors_per_sample"] == 2
    assert c["taps_shape_last"][-1] == 2 * 128  # two taps of the small target's width
    want = bench.predict(c["prompts_s"], d["samples_s"], p["transfer_bytes_per_sample"], bench.LINKS["nvlink4"])
    assert p["ours_nvlink4_samples_s"] == pytest.approx(want.samples_s)
    # a section run alone keeps the others' records: predict again from the file
    assert bench.main(["--out", str(tmp_path), "--smoke", "--sections", "predict"]) == 0
    again = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert again["drafter"] == d and again["predict"]["ours_nvlink4_samples_s"] == pytest.approx(want.samples_s)
