"""Served acceptance, checked the way a user meets it: an export of a trained tiny drafter is
loaded in a venv that holds only torch, transformers and safetensors (tests/_clean_venv.py,
proven to hold nothing of this project) with ``AutoModel.from_pretrained(DIR,
trust_remote_code=True, dtype="auto")`` beside the target, and decodes held-out prompts
through the export's own modeling file. Its drafts must be the trainer's evaluator's
(trainer/serve/evaluate.py) token for token and round for round — so the same τ — and lossless.

Both architectures: a DFlash export loads the export's ``DFlashDraftModel``, a DFlash2 export
(--drafter-arch dflash2) its ``DFlash2DraftModel`` — convolutions and path selector through
the same modeling file, drafting by the selector's walk (docs/dflash2.md).

Losslessness is asserted in fp32 (the same export loaded with ``dtype=torch.float32``): in
bf16 this random-weight tiny target has logit near-ties that make greedy decoding itself
depend on the sequence length of the forward (the evaluator's own block decoding differs
from its greedy decoding on some prompts there), which no drafter can fix. In bf16 the
export must equal the evaluator exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from _clean_venv import build, clean_env, prove_clean
from _trainer_tiny import base_args, tiny_setup

PROMPTS = 6
MAX_NEW = 32

CLEAN_DECODE = r"""
import json, sys
import torch
from transformers import AutoModel, AutoModelForCausalLM

torch.set_num_threads(1)
export, target_dir, prompts_file, dtype = sys.argv[1:5]
kw = {"dtype": "auto"} if dtype == "auto" else {"dtype": getattr(torch, dtype)}
draft, info = AutoModel.from_pretrained(export, trust_remote_code=True, output_loading_info=True, **kw)
tdtype = torch.bfloat16 if dtype == "auto" else getattr(torch, dtype)
target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=tdtype).eval()
runs = []
for p in json.load(open(prompts_file)):
    r = draft.spec_generate(target=target, input_ids=torch.tensor([p]), max_new_tokens=int(sys.argv[5]), return_stats=True)
    runs.append({"tokens": r.output_ids[0, len(p):].tolist(), "per_forward": r.acceptance_lengths, "tau": r.tau})
print(json.dumps({"class": type(draft).__module__ + "." + type(draft).__name__, "param_dtype": str(draft.dtype),
                  "target_dtype": str(target.dtype), "loading": {k: sorted(map(str, v)) for k, v in info.items()},
                  "runs": runs}))
"""


@pytest.fixture(scope="module", params=["dflash", "dflash2"])
def served(tmp_path_factory, request):
    from trainer.__main__ import main
    from trainer.data import PreparedData
    from trainer.serve.evaluate import prompts_from

    root = tmp_path_factory.mktemp(f"served-{request.param}")
    target, data = tiny_setup(str(root))
    out = str(root / "out")
    assert main(base_args(target, data, out, "--from-scratch", "--max-steps", "40", "--epochs", "6", "--lr", "1e-2",
                          "--block-size", "4", "--eval-prompts", str(PROMPTS), "--save-interval", "40",
                          "--drafter-arch", request.param)) == 0
    export = root / "export"
    assert main(["export", "--checkpoint", out, "--out", str(export)]) == 0  # bf16 by default
    prompts = prompts_from(PreparedData(data), PROMPTS)  # the held-out prompts of the run
    (root / "prompts.json").write_text(json.dumps(prompts))
    python = build(root / "clean-venv")
    proof = prove_clean(python, root)
    script = root / "decode.py"
    script.write_text(CLEAN_DECODE)

    def decode(dtype: str) -> dict:
        p = subprocess.run([str(python), "-I", str(script), str(export), target, str(root / "prompts.json"), dtype,
                            str(MAX_NEW)], cwd=root, env=clean_env(root), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    return {"target": target, "export": export, "prompts": prompts, "proof": proof, "auto": decode("auto"),
            "fp32": decode("float32"), "arch": request.param}


def evaluator(served, dtype):
    """trainer/serve/evaluate.py on the same prompts, with the export's weights and the target in ``dtype``."""
    from trainer.serve.evaluate import greedy, speculative
    from trainer.model import Drafter, FrozenHead
    from trainer.target import Target

    drafter = Drafter.from_pretrained(str(served["export"])).to(dtype).eval()
    target = Target(served["target"], drafter.config.target_layer_ids, "cpu", dtype)
    head = FrozenHead(target.embed, target.lm_head)
    runs = []
    for p in served["prompts"]:
        tokens, per_forward = speculative(target, drafter, head, p, MAX_NEW)
        runs.append({"tokens": tokens, "per_forward": per_forward, "greedy": greedy(target, p, MAX_NEW)})
    return runs


def tau(runs):
    counts = [c for r in runs for c in r["per_forward"]]
    return sum(counts) / len(counts)


def test_the_clean_venv_holds_nothing_of_this_project(served):
    assert served["proof"]["ours"] == {m: False for m in ("trainer", "agent", "controller", "sim", "bench")}
    name = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}[served["arch"]]
    assert served["auto"]["class"].startswith("transformers_modules.") and served["auto"]["class"].endswith(
        f"modeling_dflash.{name}")  # the export's own modeling file, not a built-in Qwen3Model


def test_export_loads_with_dtype_auto_beside_a_bf16_target_with_no_missing_or_unexpected_keys(served):
    doc = served["auto"]
    assert doc["param_dtype"] == "torch.bfloat16" and doc["target_dtype"] == "torch.bfloat16"
    assert doc["loading"]["missing_keys"] == [] and doc["loading"]["unexpected_keys"] == []
    assert doc["loading"]["mismatched_keys"] == [] and doc["loading"]["error_msgs"] == []


def test_served_bf16_drafts_equal_the_evaluators_round_for_round_and_tau(served):
    ours, theirs = served["auto"]["runs"], evaluator(served, torch.bfloat16)
    for mine, ref in zip(ours, theirs):
        assert mine["tokens"] == ref["tokens"]
        assert mine["per_forward"] == ref["per_forward"]
    assert tau(ours) == tau(theirs)
    assert tau(ours) > 1.0  # the trained drafter gets drafts accepted


def test_served_fp32_decode_is_lossless_and_its_tau_equals_the_evaluators(served):
    ours, theirs = served["fp32"]["runs"], evaluator(served, torch.float32)
    for mine, ref in zip(ours, theirs):
        assert mine["tokens"] == ref["greedy"]  # token for token the target's greedy decoding
        assert mine["per_forward"] == ref["per_forward"]
    assert tau(ours) == tau(theirs) > 1.0


def test_the_model_card_shows_the_evaluators_tau_at_save(served):
    card = (served["export"] / "README.md").read_text()
    ev = json.loads((Path(served["export"]).parent / "out" / "step_40" / "eval.json").read_text())
    assert f"| τ block | {ev['block']['tau']:.3f} (prompts {PROMPTS}" in card
    assert "python -m trainer --target-model" in card and "--max-steps 40" in card
