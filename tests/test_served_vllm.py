"""Served τ = trained τ in a real serving engine: vLLM (the CPU build, in .venv-vllm/ made by
scripts/setup.sh) serves the tiny target of ``python -m trainer tiny`` (head_dim 32: vLLM's CPU
attention refuses 16) with a drafter trained on CPU and exported, greedily, through
``python -m trainer served-check`` (trainer/serve/served.py). Its output must be the target's greedy
output token for token and τ from vLLM's own counters within the gate's tolerance of the τ the
checkpoint was measured at when it was saved (the export's dflash_eval.json: the same 10
held-out prompts and budget, which the gate takes as its defaults); an export one of whose
layers was zeroed must fail the gate against its checkpoint, and one whose mask token id was
changed in config.json must fail it with no option at all, the cause named.

One vLLM engine start per export, about a minute each on 2 cores; marked ``vllm`` so
``pytest -m vllm`` selects them, and ``sim_side``: scripts/test.sh runs them in the sim process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from _trainer_tiny import base_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.sim_side]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = 10
MAX_NEW = 64  # the evaluator's budget at save: the reference τ's, served-check's default with it


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from trainer.serve import served
    from trainer.__main__ import main

    if not os.access(served.DEFAULT_VLLM_PYTHON, os.X_OK) and not os.environ.get("DFLASH_VLLM_PYTHON"):
        pytest.fail(f"{served.DEFAULT_VLLM_PYTHON} missing: run scripts/setup.sh (it builds .venv-vllm/)")
    root = tmp_path_factory.mktemp("served-vllm")
    assert main(["tiny", "--out", str(root), "--samples", "160"]) == 0
    target, data, out = str(root / "target"), str(root / "data"), str(root / "out")
    args = base_args(target, data, out, "--target-layer-ids", "1,2", "--from-scratch", "--max-steps", "200",
                     "--epochs", "50", "--lr", "1e-2", "--block-size", "4", "--eval-prompts", str(PROMPTS),
                     "--save-interval", "200")
    args[args.index("--max-seq-len") + 1], args[args.index("--token-budget") + 1] = "200", "800"
    assert main(args) == 0
    export = root / "export"
    assert main(["export", "--checkpoint", out, "--out", str(export)]) == 0
    return {"root": root, "target": target, "data": data, "export": export}


def served_check(pair, export, *extra) -> tuple[int, dict, str]:
    p = subprocess.run([sys.executable, "-m", "trainer", "served-check", str(export), "--target", pair["target"],
                        "--data", pair["data"], "--json", *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert p.stdout.strip(), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def test_vllm_serves_the_export_losslessly_with_the_trained_tau(pair):
    from trainer.serve.served import TOLERANCE

    rc, r, err = served_check(pair, pair["export"])
    assert rc == 0 and r["ok"] and r["causes"] == [], (r.get("causes"), err[-2000:])
    assert r["prompts"] == PROMPTS and r["max_new"] == MAX_NEW and len(r["vllm"]["runs"]) == PROMPTS
    at_save = json.loads((pair["export"] / "dflash_eval.json").read_text())["tau"]
    assert r["tau_trained"] == at_save and r["reference_used"]  # held to the checkpoint, not to itself
    assert r["reference"].startswith(f"τ {at_save:.3f} at save of step 200, from the export's dflash_eval.json")
    same_rounds = 0
    for mine, served in zip(r["ours"], r["vllm"]["runs"]):
        assert served["tokens"][:MAX_NEW] == mine["greedy"]  # vLLM's output is the target's greedy output
        assert mine["tokens"] == mine["greedy"]
        steps = [j + 1 for j in served["spec"]["per_step_accepted"]]
        # the convention: vLLM's prefill token is output token 1, so it stops at the step that
        # brings 1 + Σ(j + 1) to max_tokens = MAX_NEW + 1; ours at the round that brings Σ to MAX_NEW
        assert 1 + sum(steps) >= MAX_NEW + 1 > 1 + sum(steps[:-1])
        assert sum(mine["per_forward"]) >= MAX_NEW > sum(mine["per_forward"][:-1])
        same_rounds += steps == mine["per_forward"]  # then the correction gives both the same rounds
    # most prompts round for round; the others differ where vLLM's k_norm differs (docs/export.md)
    assert same_rounds >= PROMPTS // 2, same_rounds
    c = r["counters"]
    assert c["vllm:spec_decode_num_drafts"] == sum(len(s["spec"]["per_step_accepted"]) for s in r["vllm"]["runs"])
    assert r["tau_served"] == 1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"]
    assert r["tau_trained"] > 1.1  # a drafter that drafts: the comparison means something
    assert abs(r["tau_served"] - r["tau_trained"]) <= TOLERANCE * r["tau_trained"]
    assert abs(r["tau_export"] - r["tau_trained"]) <= TOLERANCE * r["tau_trained"]  # bf16 export ≈ checkpoint


def test_the_gate_fails_an_export_with_a_zeroed_layer_against_its_checkpoint_and_names_why(pair):
    from safetensors.torch import load_file, save_file

    bad = pair["root"] / "export-zeroed-layer"
    shutil.copytree(pair["export"], bad)
    w = load_file(str(bad / "model.safetensors"))
    save_file({k: (v * 0 if k.startswith("layers.0.") else v) for k, v in w.items()}, str(bad / "model.safetensors"),
              metadata={"format": "pt"})
    rc, r, _ = served_check(pair, bad, "--checkpoint", str(pair["root"] / "out"))
    assert rc == 1 and not r["ok"]
    assert r["tau_served"] < r["tau_trained"] * (1 - r["tolerance"])
    said = "\n".join(r["causes"])
    assert not any(c.startswith("not lossless") for c in r["causes"])  # verification keeps it lossless
    assert "the export is not the checkpoint: model.safetensors: layers.0.mlp.down_proj.weight is not the checkpoint's" in said
    assert "below τ at save" in said


def test_an_export_whose_mask_id_was_changed_fails_with_no_option_and_names_the_mask_id(pair):
    """The gate compared an export with itself: a config.json whose mask_token_id was changed
    drafted as badly under our evaluator as in vLLM, and passed."""
    from trainer.serve.served import summary

    bad = pair["root"] / "export-mask-id"
    shutil.copytree(pair["export"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    trained = cfg["dflash_config"]["mask_token_id"]
    # 100: a token our evaluator drafts 7 % worse with on this pair (7, the id of the demo's
    # report, costs this tiny drafter only 2 %: the gate fails it on the field alone)
    wrong = 100 if trained != 100 else 101
    cfg["dflash_config"]["mask_token_id"] = wrong
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, r, _ = served_check(pair, bad)
    assert rc == 1 and not r["ok"] and r["reference_used"]
    assert r["tau_served"] < r["tau_trained"] * (1 - r["tolerance"])  # served below its checkpoint's τ at save
    assert r["causes"][0] == (f"likely cause: mask id: config.json dflash_config.mask_token_id {wrong} is not the "
                              f"checkpoint's {trained}")
    assert any(c.startswith("served τ") and "below τ at save" in c for c in r["causes"])
    head = summary(r).splitlines()[0]
    assert head.startswith("served-check: FAIL: likely cause: mask id") and "the export's dflash_eval.json" in head


def test_duplicate_taps_are_refused_with_the_cause_before_any_engine_starts(pair, tmp_path):
    bad = tmp_path / "export-dup"
    shutil.copytree(pair["export"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [1, 1]  # z-lab's default taps of a 4-layer target, 2 draft layers
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 2]
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, r, _ = served_check(pair, bad)
    assert rc == 1 and r["tau_served"] is None
    assert "names a layer twice" in r["causes"][0]


@pytest.mark.parametrize("field", ["block_size", "target_layer_ids"])
def test_an_export_whose_block_size_or_taps_were_changed_fails_with_no_option_and_names_the_cause(pair, field):
    """On this tiny drafter neither costs served τ (measured: 1.363 and 1.331 against 1.323 at
    save): the gate fails them on the changed field itself, which no τ can excuse."""
    bad = pair["root"] / f"export-{field}"
    shutil.copytree(pair["export"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    if field == "block_size":  # trained with 4: vLLM then drafts 5 per round
        cfg["block_size"] = cfg["dflash_config"]["block_size"] = 6
        cause = "likely cause: block size: config.json block_size 6 is not the checkpoint's 4"
    else:  # trained on layers 1 and 2 of the target; consistent aux ids, so vLLM takes them
        cfg["dflash_config"]["target_layer_ids"], cfg["eagle_aux_hidden_state_layer_ids"] = [0, 2], [1, 3]
        cause = "likely cause: wrong taps: config.json dflash_config.target_layer_ids [0, 2] is not the checkpoint's [1, 2]"
    (bad / "config.json").write_text(json.dumps(cfg))
    rc, r, err = served_check(pair, bad)
    assert rc == 1 and not r["ok"] and r["reference_used"], err[-2000:]
    assert r["causes"][0] == cause, r["causes"]
