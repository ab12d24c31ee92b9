"""`python -m trainer served-check` without vLLM: bad input is one line and exit 2, and the
parts of the gate that need no engine (τ from vLLM's counters, the config causes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainer.serve import served

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", "served-check", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_bad_input_is_one_line_exit_2_naming_the_field(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps({"block_size": 4, "dflash_config": {}}))
    (tmp_path / "ok.json").write_text("[[1, 2, 3]]")
    for args, said in [((str(tmp_path / "none"), "--target", str(tmp_path / "e")), "EXPORT"),
                       ((str(tmp_path / "e"), "--target", str(tmp_path / "e")), "give the prompts"),
                       ((str(tmp_path / "e"), "--target", str(tmp_path / "e"), "--prompts", str(tmp_path / "p.json")),
                        "--prompts"),
                       ((str(tmp_path / "e"), "--target", str(tmp_path / "e"), "--prompts", str(tmp_path / "ok.json"),
                         "--vllm-python", "/nonexistent/python"), "--vllm-python")]:
        p = run(*args)
        assert p.returncode == 2 and p.stdout == "", p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0] and "Traceback" not in p.stderr


def test_tau_from_vllms_counters_counts_the_bonus_once_per_verify_step():
    c = {"vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_accepted_tokens": 6}
    assert served.tau_vllm(c) == 2.5  # (0+1 + 1+1 + 2+1 + 3+1) / 4 rounds: ours counts j + 1 per round too
    assert served.tau_ours([{"per_forward": [1, 2]}, {"per_forward": [3, 4]}]) == 2.5


def test_config_causes_name_the_fields_vllm_reads_differently():
    cfg = {"block_size": 8, "dflash_config": {"target_layer_ids": [1, 1]}, "eagle_aux_hidden_state_layer_ids": [2, 3]}
    said = served.config_causes(cfg, 7)
    assert any("names a layer twice" in c for c in said)
    assert any("eagle_aux_hidden_state_layer_ids [2, 3] is not dflash_config.target_layer_ids [1, 1] + 1" in c
               for c in said)
    assert served.config_causes({"block_size": 8, "dflash_config": {"target_layer_ids": [1, 2]},
                                 "eagle_aux_hidden_state_layer_ids": [2, 3]}, 7) == []


def test_engine_length_leaves_two_blocks_past_the_budget():
    # The bench drafter (24-token prompts, vLLM max_tokens 33, block 8): with one block of room
    # (65, what served.py gave) vLLM 0.32 cut the drafts of each prompt's last rounds and served
    # τ 2.936 against 3.701; with two blocks (73) exactly 3.701 (docs/export.md, "Engine length").
    prompts = [[1] * 24, [2] * 20]
    assert served.engine_max_model_len(prompts, 33, 7, 1024) == 24 + 33 + 2 * 8
    assert served.engine_max_model_len([[1] * 5], 9, 3, 1024) == 64  # vLLM's smallest here, as before
    try:
        served.engine_max_model_len(prompts, 33, 7, 72)
    except served.ServedError as exc:
        assert "--max-new 32" in str(exc) and "max_position_embeddings 72" in str(exc)
    else:
        raise AssertionError("a budget past the target's positions must be refused")


def test_a_directory_that_is_not_a_dflash_export_is_one_line(tmp_path):
    """served-check on a target's own directory (no block_size) gave KeyError: 'block_size'."""
    (tmp_path / "ok.json").write_text("[[1, 2, 3]]")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1]")
    for export, said in ((plain, "not a DFlash export"), (broken, "config.json is not JSON"),
                         (listed, "not a DFlash export")):
        p = run(str(export), "--target", str(plain), "--prompts", str(tmp_path / "ok.json"))
        assert p.returncode == 2 and p.stdout == "", p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and f"EXPORT {export}: " in lines[0] and said in lines[0], p.stderr
