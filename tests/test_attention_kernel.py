"""--attention-kernel: flex attention's Triton kernels or flash-attn-4's CuTe kernels (flex's
FLASH backend), auto resolved once before the run; an explicit flash that cannot run here is
refused up front with the reason and the fix, and nothing is written."""

import json

import pytest

from trainer.gpu import fast_drafter as fd
from trainer import flags
from trainer.layers import flex_mask

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


def test_the_flash_kernel_is_flex_attentions_flash_backend(monkeypatch):
    assert fd.flex_options("flash") == {"BACKEND": "FLASH"}
    assert fd.flex_options("triton") is None  # torch's own Triton defaults
    monkeypatch.setenv("DFLASH_FLEX_OPTIONS", json.dumps({"BACKEND": "TRITON"}))  # no longer read
    assert fd.flex_options("flash") == {"BACKEND": "FLASH"}


class _FakeNvml:
    """pynvml for one GPU of a given compute capability (the reason is the thing under test)."""

    def __init__(self, capability):
        self.capability = capability

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self.capability


def test_flash_missing_names_each_reason_and_none_only_when_everything_is_there(monkeypatch):
    import importlib.util
    import sys
    import types

    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml((8, 0)))
    assert flex_mask.flash_missing() == ("the GPU's compute capability is 8.0: flash-attn-4's kernels need 9.0 "
                                         "(Hopper) or newer")
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml((9, 0)))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a))
    assert flex_mask.flash_missing() == "flash-attn-4 is not installed"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setitem(sys.modules, "cutlass", None)  # installed but broken: the import fails
    assert flex_mask.flash_missing().startswith("flash-attn-4 does not import (")
    flash_attn = types.ModuleType("flash_attn")
    flash_attn.cute = types.ModuleType("flash_attn.cute")
    monkeypatch.setitem(sys.modules, "cutlass", types.ModuleType("cutlass"))
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", flash_attn.cute)
    assert flex_mask.flash_missing() is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML at all: unknown, so auto keeps triton
    assert flex_mask.flash_missing().startswith("the GPU's compute capability is unknown (")


def test_a_step_built_without_the_cli_resolves_auto_itself():
    # imported here, not at collection: trainer.step imports triton (tests/test_head_kernels.py
    # copes with triton imported before it sets TRITON_INTERPRET, but need not have to)
    from trainer.step import attention_kernel

    class Args:
        attention_kernel = "auto"

    assert attention_kernel(Args(), cuda=False) == "triton"
    Args.attention_kernel = "flash"
    assert attention_kernel(Args(), cuda=True) == "flash"
    assert attention_kernel(object(), cuda=False) == "triton"  # args from before the flag


def test_an_explicit_flash_that_cannot_run_is_refused_up_front_with_the_fix(tmp_path, capsys):
    from _trainer_tiny import base_args
    from trainer.__main__ import main

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(QWEN3_TINY))
    args = base_args(str(tmp_path / "t"), str(tmp_path / "d"), str(tmp_path / "out"), "--from-scratch",
                     "--attention-kernel", "flash")
    assert main(args) == flags.EXIT_USAGE
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
    """bench/drafter_step/flex_flash.py's CPU path: the harness, the reference comparison and the
    record of a backend that does not run here."""
    import importlib
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    res = importlib.import_module("bench.drafter_step.flex_flash").run(smoke=True)
    assert res["backends"]["triton"]["rel_err"]["out"] < 1e-6  # fp32 against its own fp32 reference
    assert res["backends"]["triton"]["fwd_s"] > 0
    assert res["backends"]["flash"] == {"skipped": "CPU"} and "speedup" not in res
