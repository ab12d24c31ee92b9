"""One checkpoint-compatibility rule (agent/ckptcompat.py), asked by the launch preflight and
by the trainer: the same checkpoint and launch get the same words from both."""

from __future__ import annotations

import json

from agent import ckptcompat, preflight

TARGET_CFG = {"model_type": "qwen3", "hidden_size": 64, "vocab_size": 512, "num_hidden_layers": 8}


def _checkpoint(tmp_path, layer_ids):
    step = tmp_path / "out" / "step_12"
    step.mkdir(parents=True)
    (step / "checkpoint.pt").write_bytes(b"")
    meta = {"format": "dflash-trainer-checkpoint", "step": 12, "data_fingerprint": "aaaa",
            "drafter_config": {"block_size": 8, "num_hidden_layers": 2,
                               "dflash_config": {"target_layer_ids": layer_ids}},
            "target": ckptcompat.target_identity(TARGET_CFG)}
    (step / "meta.json").write_text(json.dumps(meta))
    return str(step), meta


def test_preflight_refuses_a_checkpoint_that_taps_other_target_layers(tmp_path):
    # the preflight once lacked the trainer's target_layer_ids check, so such a launch
    # started and the trainer refused it only inside the run
    ckpt, meta = _checkpoint(tmp_path, [1, 5])
    model = {"dir": "/t", "config": TARGET_CFG, "identity": ckptcompat.target_identity(TARGET_CFG)}
    flags = {"block_size": 8, "num_draft_layers": 2, "target_layer_ids": [2, 6]}
    errors = preflight.checkpoint_info({"kind": "init", "path": ckpt}, flags, model, {})[1]
    assert errors == [f"--init-from {ckpt}: the checkpoint taps target layers [1, 5], this launch taps [2, 6]; "
                      "set --target-layer-ids 1,5"]
    # the default taps (no --target-layer-ids) are resolved by the trainer's own rule
    assert ckptcompat.default_target_layer_ids(8, 2) == [1, 5]
    assert preflight.checkpoint_info({"kind": "init", "path": ckpt}, {**flags, "target_layer_ids": None},
                                     model, {})[1] == []


def test_the_trainer_and_the_preflight_say_the_same_words(tmp_path):
    from trainer.checkpoint import compatibility_problems

    ckpt, meta = _checkpoint(tmp_path, [1, 5])
    other = dict(TARGET_CFG, rope_theta=1e6)  # same shape, another config: another target
    model = {"dir": "/t", "config": other, "identity": ckptcompat.target_identity(other)}
    flags = {"block_size": 4, "num_draft_layers": 2}
    from_preflight = preflight.checkpoint_info({"kind": "resume", "path": ckpt}, flags, model,
                                               {"stats": {"fingerprint": "bbbb"}})[1]
    from_trainer = compatibility_problems(dict(meta, path=ckpt), block_size=4, num_draft_layers=2,
                                          target=ckptcompat.target_identity(other), target_layer_ids=[1, 5],
                                          flag="--resume-from", data_fingerprint="bbbb")
    assert from_preflight == from_trainer
    assert [line.split(": ", 1)[1][:30] for line in from_trainer] == [
        "the checkpoint was trained wit", "trained against another target", "trained on other data (fingerp"]
    assert "its config.json differs" in from_trainer[1]
