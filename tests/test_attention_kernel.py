"""--attention-kernel: flex attention's Triton kernels or flash-attn-4's CuTe kernels (flex's
FLASH backend), auto resolved once before the run; an explicit flash that cannot run here is
refused up front with the reason and the fix, and nothing is written."""

import json

import pytest

from trainer import fast_drafter as fd
from trainer import flags, flex_mask

QWEN3_TINY = {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, "num_hidden_layers": 6, "vocab_size": 512,
              "tie_word_embeddings": False, "rope_theta": 1e6}


@pytest.mark.parametrize("choice,cuda,missing,want", [
    ("auto", True, None, "flash"),
    ("auto", True, "flash-attn-4 is not installed", "triton"),
    ("auto", False, None, "triton"),  # CPU: no flex kernels at all
    (None, True, None, "flash"),  # a run config written before the flag: its default, auto
    ("triton", True, None, "triton"),
    ("flash", True, "flash-attn-4 is not installed", "flash"),  # refused by validate, never resolved away
])
def test_auto_resolves_to_flash_only_where_it_can_run(choice, cuda, missing, want):
    assert flags.attention_kernel_for({"attention_kernel": choice}, cuda, missing) == want


def test_the_flash_kernel_is_flex_attentions_flash_backend_and_the_environment_still_wins(monkeypatch):
    monkeypatch.delenv("DFLASH_FLEX_OPTIONS", raising=False)
    monkeypatch.setattr(fd, "FLEX_OPTIONS", {"fwd_USE_TMA": True})
    assert fd.flex_options("flash") == {"BACKEND": "FLASH"}  # the Triton knobs are not passed to CuTe
    assert fd.flex_options("triton") == {"fwd_USE_TMA": True}
    monkeypatch.setattr(fd, "FLEX_OPTIONS", {})
    assert fd.flex_options("triton") is None
    monkeypatch.setenv("DFLASH_FLEX_OPTIONS", json.dumps({"BACKEND": "TRITON"}))
    assert fd.flex_options("flash") == {"BACKEND": "TRITON"}


def test_flash_missing_names_why_on_a_machine_without_a_hopper_gpu():
    why = flex_mask.flash_missing()
    assert isinstance(why, str) and why  # CI and this machine: no GPU (NVML answers, or is absent)


def test_a_step_built_without_the_cli_resolves_auto_itself():
    # imported here, not at collection: trainer.step imports triton, and tests/test_head_kernels.py
    # must be the first to import it (under TRITON_INTERPRET=1 on a machine without a GPU)
    from trainer.step import attention_kernel

    class Args:
        attention_kernel = "auto"

    assert attention_kernel(Args(), cuda=False) == "triton"
    Args.attention_kernel = "flash"
    assert attention_kernel(Args(), cuda=True) == "flash"
    assert attention_kernel(object(), cuda=False) == "triton"  # args from before the flag


def test_an_explicit_flash_that_cannot_run_is_refused_up_front_with_the_fix(tmp_path, capsys):
    from trainer.__main__ import main

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(QWEN3_TINY))
    base = ["--target-model", str(tmp_path / "t"), "--data-dir", str(tmp_path / "d"), "--output-dir",
            str(tmp_path / "out"), "--target-gpus", "0", "--drafter-gpus", "0", "--from-scratch",
            "--device", "cpu", "--token-budget", "192"]
    assert main(base + ["--attention-kernel", "flash"]) == flags.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--attention-kernel flash: this run is on CPU; install flash-attn-4" in err
    assert "or use --attention-kernel triton" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_docs_flags_md_is_the_flag_table_as_generated():
    """docs/flags.md follows trainer/flags.py (``python -m trainer flags --markdown``): the new
    flag reaches the docs, and no later flag can be added without them."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "flags.md")) as fh:
        assert fh.read() == flags.markdown(), "regenerate: python -m trainer flags --markdown > docs/flags.md"


def test_the_flash_bench_runs_its_triton_half_on_cpu():
    """bench/gpu/flex_flash.py's CPU path: the harness, the reference comparison and the
    record of a backend that does not run here."""
    import importlib
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.join(root, "bench", "gpu")]
    res = importlib.import_module("flex_flash").run(smoke=True)
    assert res["backends"]["triton"]["rel_err"]["out"] < 1e-6  # fp32 against its own fp32 reference
    assert res["backends"]["triton"]["fwd_s"] > 0
    assert res["backends"]["flash"] == {"skipped": "CPU"} and "speedup" not in res
