"""τ selects: the τ measured at each save (--eval-prompts) names a `best` checkpoint that
retention never deletes (--keep-checkpoints keeps the newest N plus the best), each
checkpoint's meta.json keeps its τ, τ is reported per category where the prepared data knows
each sample's source, and `python -m trainer export --best` exports the best — which is not
the newest when τ peaked early."""

from __future__ import annotations

import json
import os

import pytest

from _trainer_tiny import base_args, events, make_data, make_target, tiny_setup
from trainer import checkpoint as ckpt_io
from trainer.__main__ import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run whose τ peaks at its first save and falls after it (the peak learning rate,
    reached after one warmup step, overshoots what the drafter learned first): a save and a τ
    measurement every step, keeping 2."""
    root = tmp_path_factory.mktemp("best")
    target, data = tiny_setup(str(root))
    out = str(root / "out")
    assert main(base_args(target, data, out, "--from-scratch", "--max-steps", "6", "--save-interval", "1",
                          "--eval-prompts", "4", "--keep-checkpoints", "2")) == 0
    return {"root": root, "target": target, "data": data, "out": out}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """Data prepared from two sources (chat: 40 rows, code: 8), 2 held-out prompts, one save:
    the last 2 samples would both be code's (samples are written in input order), so τ per
    category needs the hold-out to take from each source."""
    from trainer.chat.prepare import prepare

    root = tmp_path_factory.mktemp("two")
    target = make_target(str(root / "target"))
    make_data(target, str(root / "one"))  # writes root/one.jsonl (48 rows) and prepares it
    rows = open(root / "one.jsonl").read().splitlines(keepends=True)
    (root / "chat.jsonl").write_text("".join(rows[:40]))
    (root / "code.jsonl").write_text("".join(rows[40:]))
    data = str(root / "data")
    prepare([str(root / "chat.jsonl"), str(root / "code.jsonl")], data, log=lambda line: None)
    out = str(root / "out")
    assert main(base_args(target, data, out, "--from-scratch", "--max-steps", "2", "--save-interval", "2",
                          "--eval-prompts", "2")) == 0
    return {"data": data, "out": out}


def test_the_best_tau_checkpoint_outlives_retention_and_export_best_exports_it(run, tmp_path):
    out = run["out"]
    taus = {e["step"]: e["tau"] for e in events(out, "eval")}
    assert sorted(taus) == [1, 2, 3, 4, 5, 6]
    top = max(taus, key=lambda s: (taus[s], -s))  # the first of the highest
    assert top < 5, f"this run's τ should peak before its last two checkpoints: {taus}"  # the premise
    kept = [s for s, _, done in ckpt_io.steps(out) if done]
    assert kept == [top, 5, 6]  # the newest two, and the best
    assert ckpt_io.best(out)["step"] == top and ckpt_io.best(out)["tau"] == pytest.approx(taus[top])
    # every kept checkpoint's meta.json keeps the τ it was measured at
    for s in kept:
        assert ckpt_io.read_meta(os.path.join(out, f"step_{s}"))["eval"]["tau"] == pytest.approx(taus[s])
    # pruned checkpoints' events say so; the best one was never among them
    assert top not in {p for e in events(out, "checkpoint") for p in e["pruned"]}
    last = events(out, "eval")[-1]
    assert last["best_step"] == top and last["best_tau"] == pytest.approx(taus[top])

    from trainer.serve.export import main as export_main

    dest = tmp_path / "best"
    assert export_main(["--checkpoint", out, "--best", "--out", str(dest), "--json"]) == 0
    card = (dest / "README.md").read_text()
    assert f"step {top}" in card and f"{taus[top]:.3f}" in card
    newest = tmp_path / "newest"
    assert export_main(["--checkpoint", out, "--out", str(newest)]) == 0
    assert "# DFlash drafter, step 6" in (newest / "README.md").read_text()
    assert (dest / "model.safetensors").read_bytes() != (newest / "model.safetensors").read_bytes()


def test_export_best_says_which_step_and_its_tau(run, tmp_path, capsys):
    from trainer.serve.export import main as export_main

    assert export_main(["--checkpoint", run["out"], "--best", "--out", str(tmp_path / "b")]) == 0
    top = ckpt_io.best(run["out"])
    assert f"step {top['step']} (the best: τ {top['tau']:.3f} at save)" in capsys.readouterr().out
    assert export_main(["--checkpoint", run["out"], "--best", "--step", "6", "--out", str(tmp_path / "c")]) == 2


def test_tau_is_reported_per_source_of_the_prepared_data(two):
    meta = json.load(open(os.path.join(two["data"], "meta.json")))
    assert [(s["file"], s["samples"]) for s in meta["sources"]] == [("chat.jsonl", 40), ("code.jsonl", 8)]
    assert ckpt_io.read_meta(os.path.join(two["out"], "step_2"))["eval"]["by_category"].keys() == {"chat", "code"}
    for e in events(two["out"], "eval"):
        assert set(e["by_category"]) == {"chat", "code"}
        # pooled τ lies between the categories' τ (a weighted mean of rounds)
        lo, hi = min(e["by_category"].values()), max(e["by_category"].values())
        assert lo - 1e-9 <= e["tau"] <= hi + 1e-9


def test_an_export_best_without_any_measured_tau_is_refused_by_name(tmp_path):
    from trainer.serve.export import main as export_main

    out = tmp_path / "out"
    (out / "step_2").mkdir(parents=True)
    (out / "step_2" / ckpt_io.CHECKPOINT).write_bytes(b"")
    assert export_main(["--checkpoint", str(out), "--best", "--out", str(tmp_path / "x")]) == 2


def test_the_held_out_prompts_come_from_every_source_and_training_never_sees_them(two):
    from argparse import Namespace

    from trainer.data import PreparedData
    from trainer.train import micro_batch_stream

    data = PreparedData(two["data"])
    held = data.held_out(3)
    assert held == [38, 39, 47]  # chat's last two and code's last, taken in turn
    assert {data.category(i) for i in held} == {"chat", "code"}
    args = Namespace(eval_prompts=3, epochs=2, token_budget=4096, max_seq_len=512, max_batch_size=8, seed=0)
    seen = sorted(i for _, ids in micro_batch_stream(data, args) for i in ids)
    assert seen == sorted([i for i in range(len(data)) if i not in held] * 2)  # every other sample, once an epoch
    assert data.held_out(100) == list(range(len(data)))  # no more than there is
