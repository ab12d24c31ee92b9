"""served-check's reference without vLLM: the export carries the checkpoint's τ at save and
what it was measured on (``dflash_eval.json``, written by trainer/drafter_dir.py for
step_N/drafter/ and ``python -m trainer export`` alike); the gate reads it from there or from
``--checkpoint``, refuses it where this check measures something else, and names each
config.json field that is no longer what the drafter trained with as the cause it points at
(trainer/serve/reference.py). The served side: tests/test_served_vllm.py."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
from _trainer_tiny import base_args, tiny_setup

from trainer import drafter_dir
from trainer.serve import reference

PROMPTS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from trainer.__main__ import main

    root = tmp_path_factory.mktemp("reference")
    target, data = tiny_setup(str(root))
    out = str(root / "out")
    assert main(base_args(target, data, out, "--from-scratch", "--max-steps", "4", "--save-interval", "2",
                          "--eval-prompts", str(PROMPTS))) == 0
    export = root / "export"
    assert main(["export", "--checkpoint", out, "--out", str(export)]) == 0
    return {"root": root, "target": target, "data": data, "out": out, "export": export}


def test_the_export_carries_the_checkpoints_tau_at_save_and_what_it_was_measured_on(run):
    meta = json.loads((Path(run["out"]) / "step_4" / "meta.json").read_text())
    doc = drafter_dir.read_sidecar(str(run["export"]))
    assert doc["tau"] == meta["eval"]["tau"] and doc["step"] == 4
    m = doc["measured"]
    assert m["prompts"] == PROMPTS and m["max_new_tokens"] == 64 and m["device"] == "cpu"
    assert m["data_fingerprint"] == json.loads((Path(run["data"]) / "meta.json").read_text())["fingerprint"]
    assert m["target"]["config_sha256"] == reference.config_sha256(run["target"]) is not None
    cfg = json.loads((run["export"] / "config.json").read_text())
    assert doc["trained"] == {"block_size": cfg["block_size"], "mask_token_id": cfg["dflash_config"]["mask_token_id"],
                              "target_layer_ids": cfg["dflash_config"]["target_layer_ids"],
                              "rope_theta": cfg["rope_theta"], "layer_types": cfg["layer_types"], "is_causal": None}
    # the checkpoint's own drafter/ got it when τ was measured after the save: the same bytes
    saved = Path(run["out"]) / "step_4" / "drafter" / drafter_dir.SIDECAR
    assert saved.read_bytes() == (run["export"] / drafter_dir.SIDECAR).read_bytes()


def test_the_reference_from_the_export_is_the_one_from_the_checkpoint(run):
    a = reference.find(str(run["export"]), None)
    b = reference.find(str(run["export"]), run["out"])
    assert a["source"] == "the export's dflash_eval.json" and b["source"].startswith("--checkpoint ")
    assert {k: v for k, v in a.items() if k != "source"} == {k: v for k, v in b.items() if k != "source"}


def test_no_tau_at_save_leaves_no_reference_but_keeps_the_trained_facts(run):
    meta = json.loads((Path(run["out"]) / "step_2" / "meta.json").read_text())
    meta.pop("eval", None)
    cfg = json.loads((run["export"] / "config.json").read_text())
    doc = drafter_dir.sidecar(meta, cfg, {})
    assert doc["tau"] is None and doc["measured"] is None and doc["trained"]["block_size"] == cfg["block_size"]
    why = reference.comparable({**doc, "source": "x"}, prompts=PROMPTS, max_new=64, from_data=True,
                               data_fingerprint=None, target_dir=run["target"])
    assert "not measured at save" in why and "--eval-prompts" in why


def test_the_reference_is_refused_where_the_check_measures_something_else(run, tmp_path):
    ref = reference.find(str(run["export"]), None)
    fp = json.loads((Path(run["data"]) / "meta.json").read_text())["fingerprint"]
    same = {"prompts": PROMPTS, "max_new": 64, "from_data": True, "data_fingerprint": fp, "target_dir": run["target"]}
    assert reference.comparable(ref, **same) is None
    other_target = tmp_path / "t"
    other_target.mkdir()
    (other_target / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8}))
    for change, said in [({"max_new": 32}, "--max-new 32"), ({"prompts": 3}, "--eval-prompts 3"),
                         ({"from_data": False}, "--prompts"), ({"data_fingerprint": "0" * 16}, "other data"),
                         ({"target_dir": str(other_target)}, "--target")]:
        why = reference.comparable(ref, **{**same, **change})
        assert why and said in why, (change, why)


def _edit(cfg: dict, how: str) -> dict:
    c = copy.deepcopy(cfg)
    if how == "mask":
        c["dflash_config"]["mask_token_id"] = 7
    elif how == "block":
        c["block_size"] = c["dflash_config"]["block_size"] = c["block_size"] + 2
    elif how == "taps":
        c["dflash_config"]["target_layer_ids"] = [0, 2]
        c["eagle_aux_hidden_state_layer_ids"] = [1, 3]
    elif how == "rope":
        c["rope_theta"] = c["rope_parameters"]["rope_theta"] = 500000.0
    elif how == "causal":
        c["is_causal"] = True
    return c


@pytest.mark.parametrize("how,cause,field", [
    ("mask", "mask id", "dflash_config.mask_token_id 7"),
    ("block", "block size", "block_size"),
    ("taps", "wrong taps", "dflash_config.target_layer_ids [0, 2]"),
    ("rope", "rope", "rope_theta 500000.0"),
    ("causal", "causal vs non-causal in-block attention", "is_causal True"),
])
def test_each_changed_trained_field_is_named_as_the_cause_it_points_at(run, how, cause, field):
    cfg = json.loads((run["export"] / "config.json").read_text())
    trained = reference.find(str(run["export"]), None)["trained"]
    assert reference.drift(cfg, trained) == []  # the export as written: nothing to name
    said = reference.drift(_edit(cfg, how), trained)
    assert said and all(s.startswith(f"{cause}: config.json ") for s in said), said
    assert any(field in s and "is not the checkpoint's" in s for s in said), said


def test_a_block_size_changed_only_where_newer_loaders_read_it_is_named_too(run):
    cfg = json.loads((run["export"] / "config.json").read_text())
    trained = reference.find(str(run["export"]), None)["trained"]
    cfg["dflash_config"]["block_size"] = 9  # SGLang and z-lab's newer releases read this one
    assert reference.drift(cfg, trained) == [
        f"block size: config.json dflash_config.block_size 9 is not the checkpoint's {trained['block_size']}"]


def test_an_export_without_the_sidecar_has_no_reference(run, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(run["export"], bare)
    os.unlink(bare / drafter_dir.SIDECAR)
    assert reference.find(str(bare), None) is None
    from trainer.serve.served import reference_words

    assert reference_words(None, None).startswith("none: no dflash_eval.json")
