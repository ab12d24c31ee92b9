"""DFlash2 through vLLM's own DFlash2 classes, at loader level (vLLM 0.32 serves DFlash2 only on
its Triton model runner, which the CPU build lacks): a DFlash2 drafter trained on CPU on the
tiny target of ``python -m trainer tiny`` and exported is built as
``qwen3_dflash2.DFlash2Qwen3ForCausalLM`` and loaded by its ``load_weights``
(trainer/serve/vllm_dflash2_check.py, under .venv-vllm's interpreter). One drafter forward on the
block after a held-out prompt — vLLM's model forward, its context K/V path, only the
attention kernel replaced — must give our evaluator's final hidden states, its top-k
candidates ours, and the walk through its selector's scores our drafted block.

One draft layer: vLLM's grouped context k_norm uses layer 0's weight for every layer
(docs/export.md), so a 1-layer drafter is the one it computes exactly.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from _trainer_tiny import base_args

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    from trainer.serve import served
    from trainer.__main__ import main
    from trainer.data import PreparedData
    from trainer.serve.evaluate import prompts_from
    from trainer.layers.hf_dflash import propose
    from trainer.model import Drafter, FrozenHead
    from trainer.target import Target

    if not os.access(served.DEFAULT_VLLM_PYTHON, os.X_OK):
        pytest.fail(f"{served.DEFAULT_VLLM_PYTHON} missing: run scripts/setup.sh (it builds .venv-vllm/)")
    root = tmp_path_factory.mktemp("served-dflash2")
    assert main(["tiny", "--out", str(root), "--samples", "96"]) == 0
    target, data, out = str(root / "target"), str(root / "data"), str(root / "out")
    args = base_args(target, data, out, "--target-layer-ids", "1,2", "--from-scratch", "--max-steps", "20",
                     "--epochs", "50", "--lr", "1e-2", "--block-size", "4", "--eval-prompts", "4",
                     "--save-interval", "20", "--drafter-arch", "dflash2", "--num-draft-layers", "1")
    args[args.index("--max-seq-len") + 1], args[args.index("--token-budget") + 1] = "200", "800"
    assert main(args) == 0
    export = str(root / "export")
    assert main(["export", "--checkpoint", out, "--out", export]) == 0

    # ours: the evaluator's draft of the block after a held-out prompt (fp32)
    drafter = Drafter.from_pretrained(export).to(torch.float32).eval()
    tgt = Target(target, drafter.config.target_layer_ids, "cpu", torch.float32)
    head = FrozenHead(tgt.embed, tgt.lm_head)
    prompt = prompts_from(PreparedData(data), 4)[0]
    B, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    with torch.no_grad():
        taps, logits, _ = tgt.forward_cached(torch.tensor([prompt]), None)
        bonus, n = int(logits[0, -1].argmax()), len(prompt)
        anchors = torch.tensor([[n]])
        h = drafter(taps, head.embed_blocks(torch.full((1, n + 1), bonus), anchors, B, mask_id), anchors,
                    torch.ones(1, 1, dtype=torch.bool))[0]
        mine = {"hidden": h, "drafts": propose(h[1:], head.lm_head, bonus, drafter.selector),
                "candidates": torch.nn.functional.linear(h[1:], head.lm_head).topk(drafter.selector.top_k, -1)}
    torch.save({"taps": taps[0], "bonus": bonus, "target": target, "export": export}, root / "in.pt")
    p = subprocess.run([served.DEFAULT_VLLM_PYTHON, os.path.join(served.HERE, "vllm_dflash2_check.py"),
                        str(root / "in.pt"), str(root / "out.pt")], capture_output=True, text=True, timeout=600,
                       cwd=root, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert p.returncode == 0, p.stderr[-3000:]
    return mine, torch.load(root / "out.pt"), drafter


def test_vllms_dflash2_classes_load_every_tensor_of_the_export(checked):
    _, theirs, _ = checked
    names = set(theirs["params"])
    for part in ("attention_conv.base_kernel", "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel",
                 "mlp_conv.kernel_projection.weight", "self_attn.qkv_proj.weight"):
        assert f"model.layers.0.{part}" in names
    assert {"model.candidate_selector.predecessor_codebook", "model.candidate_selector.successor_codebook",
            "model.candidate_selector.hidden_projection.weight", "model.fc.weight"} <= names


def test_one_vllm_dflash2_forward_and_its_drafted_block_equal_ours(checked):
    mine, theirs, drafter = checked
    torch.testing.assert_close(theirs["hidden"], mine["hidden"], rtol=1e-4, atol=1e-4)
    unary, cand = mine["candidates"]
    assert theirs["candidates"].tolist() == cand.tolist()  # the same top-k per slot, in the same order
    torch.testing.assert_close(theirs["unary"], unary, rtol=1e-4, atol=1e-4)
    assert theirs["drafts"] == mine["drafts"]  # the selector's walk: the block our evaluator drafts
    assert len(mine["drafts"]) == drafter.config.block_size - 1
