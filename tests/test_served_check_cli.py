"""`python -m trainer served-check` without vLLM: bad input is one line and exit 2, and the
parts of the gate that need no engine (τ from vLLM's counters, the config causes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainer import served

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", "served-check", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_bad_input_is_one_line_exit_2_naming_the_field(tmp_path):
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "config.json").write_text(json.dumps({"block_size": 4}))
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
