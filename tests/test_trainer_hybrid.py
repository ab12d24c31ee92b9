"""Qwen3.5/3.6 targets: the hybrid Gated DeltaNet + gated attention family in both
layouts it ships in — text-only (qwen3_5_text) and the released vision-language one
(Qwen3_5ForConditionalGeneration, the language model under text_config) — on tiny random
targets on CPU: loading, the fast forward against transformers', training with either drafter
step and its sliding-window layers, resume, lossless evaluation with the recurrent state rolled
back, the refusal of tree verification and of unsupported families, and the public drafter
config the family builds."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from _trainer_tiny import make_qwen35_target, make_target, qwen35_args, qwen35_setup, step_events
from test_trainer_memory import NONE_IMPORTED, WITHOUT_TORCH
from trainer import checkpoint as ckpt_io
from trainer.plan import budget as budget_mod
from trainer import family, flags
from trainer.plan import memory
from trainer.__main__ import main
from trainer.layers.flex_mask import dense_dflash_mask, dflash_mask_mod, visible_pairs
from trainer.plan.flops import ModelShape
from trainer.model import Drafter, DrafterConfig, FrozenHead
from trainer.target import Target, read_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ["text", "vl"]


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {layout: qwen35_setup(str(root), layout) for layout in LAYOUTS}


# ---------------------------------------------------------------- loading and the fast forward

@pytest.mark.parametrize("layout", LAYOUTS)
def test_fast_hybrid_forward_gives_the_transformers_taps_and_final_state(setups, layout):
    target_dir = setups[layout][0]
    ids = torch.randint(0, 255, (3, 70), generator=torch.Generator().manual_seed(0))  # > one 64-token chunk
    taps = [1, 3, 6, 3]  # linear, full, linear layers; one named twice, as the hooks give it
    hf = Target(target_dir, taps, "cpu", torch.float32, "hf")
    fast = Target(target_dir, taps, "cpu", torch.float32, "fast")
    for want_final in (False, True):
        t_hf, f_hf = hf.forward(ids, want_final)
        t_fast, f_fast = fast.forward(ids, want_final)
        assert t_fast.shape == t_hf.shape == (3, 70, 4 * 64)
        assert (t_fast - t_hf).norm() / t_hf.norm() < 1e-5
        if want_final:
            assert (f_fast - f_hf).norm() / f_hf.norm() < 1e-5
    # the transformers layers now view the fused weights and still compute the same
    la = fast.model.model.layers[0].linear_attn
    assert la.in_proj_z.weight.untyped_storage().data_ptr() == fast.fast.layers[0].w_in.untyped_storage().data_ptr()
    torch.testing.assert_close(fast.forward_logits(ids[:1])[1], hf.forward_logits(ids[:1])[1])


def test_the_released_layout_loads_only_the_language_model(setups):
    """Qwen3_5ForConditionalGeneration on disk: the trainer's target is the language model
    (the vision tower's weights are never loaded), with the same numbers as the text layout's
    loader reads, and the drafter-only head comes from model.language_model.*."""
    vl_dir = setups["vl"][0]
    cfg = read_config(vl_dir)
    assert cfg["model_type"] == "qwen3_5" and "text_config" in cfg and "vision_config" in cfg
    t = Target(vl_dir, [1], "cpu", torch.float32)
    names = [n for n, _ in t.model.named_parameters()]
    assert type(t.model).__name__ == "Qwen3_5ForCausalLM" and not any("visual" in n for n in names)
    shape = ModelShape.from_hf_config(cfg)  # the language model under text_config
    assert shape.family == "qwen3_5_text" and shape.layer_types == tuple(family.target_layer_types(family.text_config(cfg)))
    weights = memory.TARGET_FAMILIES[shape.family].weight_bytes(shape, shape.n_layers, False)
    assert 2 * sum(p.numel() for p in t.model.parameters()) == weights  # memory.py's structural count, exactly
    head = FrozenHead.from_target_dir(vl_dir)
    assert torch.equal(head.embed, t.embed) and torch.equal(head.lm_head, t.lm_head)


# ---------------------------------------------------------------- the drafter of this family

def test_the_public_qwen36_27b_drafter_is_what_the_family_builds():
    """SpecForge's configs/qwen3.6-27b-dflash.json, from the public Qwen3.6-27B text config."""
    d = DrafterConfig.from_target(family.QWEN3_6_27B_TEXT, 5, 16)
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (32, 8, 128)
    assert (d.hidden_size, d.intermediate_size, d.vocab_size, d.num_target_layers) == (5120, 17408, 248320, 64)
    assert d.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and d.sliding_window == 2048
    assert d.target_layer_ids == [1, 16, 31, 46, 61] and d.mask_token_id == 248070 and d.rope_theta == 1e7
    hf = d.to_hf()
    assert hf["layer_types"] == d.layer_types and hf["sliding_window"] == 2048 and hf["use_sliding_window"] is True
    assert DrafterConfig.from_hf(hf) == d
    # the vision-language layout gives the same drafter
    vl = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
          "text_config": family.QWEN3_6_27B_TEXT, "vision_config": {}}
    assert DrafterConfig.from_target(vl, 5, 16) == d
    # and Qwen3 keeps its own attention widths, every layer full
    q3 = DrafterConfig.from_target({"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096,
                                    "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "head_dim": 128, "vocab_size": 151936, "rope_theta": 1e6}, 5, 16)
    assert q3.layer_types == ["full_attention"] * 5 and q3.sliding_window is None and q3.mask_token_id == 151669


def test_mask_token_comes_from_the_flag_the_config_or_the_tokenizer(tmp_path):
    cfg = {**family.QWEN3_6_27B_TEXT}
    assert family.mask_token_id(cfg, None, 7) == (7, "--mask-token-id")
    assert family.mask_token_id({**cfg, "mask_token_id": 11})[0] == 11
    vl = {"model_type": "qwen3_5", "text_config": {**cfg, "mask_token_id": 12}}
    assert family.mask_token_id(vl)[0] == 12
    tok = {"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 248069, "content": "<|x|>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert family.mask_token_id(cfg, str(tmp_path)) == (248070, "the tokenizer (first id it never emits)")
    assert family.mask_token_id(cfg)[0] == 248070  # no tokenizer: the family's default


def test_a_mask_token_outside_the_vocabulary_is_refused(setups, tmp_path):
    target, data = setups["text"]
    r = subprocess.run([sys.executable, "-m", "trainer", *qwen35_args(target, data, str(tmp_path / "o"), "--from-scratch",
                                                                      "--mask-token-id", "256")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--mask-token-id 256 is outside the target's vocabulary 0..255" in r.stderr
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------- the sliding-window mask

def _sliding_rule(a, keep, q_off, kv, S, B, i, W):
    if kv < S:
        return keep and a + q_off - (W - 1) <= kv < a
    return (kv - S) // B == i and (kv - S) % B <= q_off


def test_sliding_mask_follows_the_rule_in_every_form():
    from torch.nn.attention.flex_attention import create_mask

    S, B, W = 30, 4, 6
    anchors = torch.tensor([[0, 3, 7, 15, 29], [2, 2, 9, 19, 25]])
    keep = torch.tensor([[True, True, True, True, True], [True, True, False, True, True]])
    dense = dense_dflash_mask(anchors, S, B, keep, window=W)
    for b in range(2):
        for q in range(anchors.shape[1] * B):
            i, o = q // B, q % B
            for kv in range(S + anchors.shape[1] * B):
                assert bool(dense[b, q, kv]) == _sliding_rule(int(anchors[b, i]), bool(keep[b, i]), o, kv, S, B, i, W)
    got = create_mask(dflash_mask_mod(anchors, S, B, keep, W), 2, 1, anchors.shape[1] * B, S + anchors.shape[1] * B,
                      device="cpu")[:, 0]
    assert torch.equal(got, dense) and int(dense.sum()) == visible_pairs(anchors, S, B, keep, window=W)
    # a window wider than any context is the full mask made causal inside the block
    full = dense_dflash_mask(anchors, S, B, keep)
    wide = dense_dflash_mask(anchors, S, B, keep, window=10 * S)
    assert torch.equal(wide[:, :, :S], full[:, :, :S]) and not torch.equal(wide, full)


def test_sliding_layers_of_the_drafter_see_only_their_window():
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=64, num_hidden_layers=1, num_target_layers=6,
                        target_layer_ids=[1, 3], block_size=4, mask_token_id=63,
                        layer_types=["sliding_attention"], sliding_window=5)
    d = Drafter(cfg).double().eval()
    head = FrozenHead(torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64))
    taps = torch.randn(1, 24, 64, dtype=torch.float64)
    ids = torch.randint(0, 63, (1, 24))
    anchors, keep = torch.tensor([[12]]), torch.ones(1, 1, dtype=torch.bool)

    def run(t, i):
        with torch.no_grad():
            return d(t, head.embed_blocks(i, anchors, 4, 63), anchors, keep).view(4, -1)

    base = run(taps, ids)
    far = taps.clone()
    far[0, :8] += 1.0  # slot 0 sees context 8..11 (window 5 with itself), slot 3 sees 11 only
    assert torch.allclose(run(far, ids), base, atol=1e-12)
    near = taps.clone()
    near[0, 8] += 1.0  # in slot 0's window only (one layer: the later slots read slot 0's input, not its output)
    moved = (run(near, ids) - base).abs().amax(-1)
    assert moved[0] > 1e-6 and torch.all(moved[1:] < 1e-12)


# ---------------------------------------------------------------- training, resume, export

@pytest.mark.parametrize("layout", LAYOUTS)
def test_training_on_a_qwen35_target_with_either_step_and_its_export(setups, layout, tmp_path):
    """Both drafter steps train the same drafter (sliding + full layers) on the hybrid target
    (transformers forward for the reference, the fast one for the chunked step); the exported
    drafter/ carries the per-layer attention and loads back."""
    target, data = setups[layout]
    losses = {}
    for step, forward in (("reference", "hf"), ("chunked", "fast")):
        out = str(tmp_path / step)
        assert main(qwen35_args(target, data, out, "--from-scratch", "--max-steps", "3", "--use-soft-labels",
                                "--cap-lambda", "0.1", "--drafter-step", step, "--target-forward", forward)) == 0
        losses[step] = [e["loss"] for e in step_events(out)]
        assert all(math.isfinite(x) for x in losses[step])
    assert losses["chunked"] == pytest.approx(losses["reference"], abs=1e-4)
    exported = os.path.join(str(tmp_path / "chunked"), "step_3", "drafter")
    cfg = json.load(open(os.path.join(exported, "config.json")))
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 12
    assert cfg["use_sliding_window"] is True and cfg["vocab_size"] == 256 and cfg["num_target_layers"] == 8
    back = Drafter.from_pretrained(exported)
    assert back.config.layer_types == cfg["layer_types"] and back.config.sliding_window == 12


def test_resume_on_the_released_layout_equals_a_straight_run(setups, tmp_path):
    target, data = setups["vl"]
    common = ("--epochs", "4", "--noise-start", "0.05", "--use-soft-labels")
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    assert main(qwen35_args(target, data, straight, "--from-scratch", "--max-steps", "4", *common)) == 0
    assert main(qwen35_args(target, data, split, "--from-scratch", "--max-steps", "2", *common)) == 0
    assert main(qwen35_args(target, data, split, "--resume-from", os.path.join(split, "step_2"), "--max-steps", "4",
                            *common)) == 0
    a, b = step_events(straight), step_events(split)
    assert [e["step"] for e in b] == [1, 2, 3, 4]
    assert [e["loss"] for e in a] == pytest.approx([e["loss"] for e in b], abs=1e-5)
    wa, wb = ckpt_io.load(os.path.join(straight, "step_4"))["model"], ckpt_io.load(os.path.join(split, "step_4"))["model"]
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=1e-6, rtol=1e-5)


def test_a_checkpoint_with_other_drafter_layers_is_refused(setups, tmp_path):
    target, data = setups["text"]
    out = str(tmp_path / "o")
    assert main(qwen35_args(target, data, out, "--from-scratch", "--max-steps", "1")) == 0
    argv = qwen35_args(target, data, out, "--resume-from", os.path.join(out, "step_1"), "--max-steps", "2",
                       "--drafter-layer-types", "full,full")
    r = subprocess.run([sys.executable, "-m", "trainer", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--drafter-layer-types" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------- evaluation

class OracleDrafter:
    """Drafts the target's own greedy continuation for the first k slots of round r
    (k = r mod B) and a wrong token after them, as one-hot rows for an identity head: every
    acceptance length 0..B-1 occurs, so the roll-back path runs for each."""

    def __init__(self, config, truth: list[int], prompt_len: int, vocab: int):
        self.config, self.truth, self.p, self.V, self.round = config, truth, prompt_len, vocab, 0
        self.training = False

    def __call__(self, taps, blocks, anchors, keep, *_):
        n = int(anchors[0, 0])
        assert taps.shape[1] == n  # the tapped states of exactly the committed prefix
        B = self.config.block_size
        k = self.round % B
        self.round += 1
        want = [self.truth[n + 1 - self.p + i] if i < k else (self.truth[n + 1 - self.p + i] + 1) % self.V
                for i in range(B - 1)]
        rows = torch.zeros(B, self.V, dtype=taps.dtype)
        rows[1:, :] = torch.nn.functional.one_hot(torch.tensor(want), self.V).to(taps.dtype)
        return rows[None]


@pytest.mark.parametrize("kind", ["qwen3", "text", "vl"])
def test_block_verification_is_lossless_with_the_state_rolled_back(setups, tmp_path, kind):
    from trainer.serve.evaluate import greedy, speculative

    target_dir = make_target(str(tmp_path / "q3")) if kind == "qwen3" else setups[kind][0]
    V = read_config(target_dir).get("vocab_size") or family.text_config(read_config(target_dir))["vocab_size"]
    tgt = Target(target_dir, [1, 3], "cpu", torch.float32)
    prompt = [5, 17, 3, 99, 42, 8]
    truth = greedy(tgt, prompt, 80)
    cfg = DrafterConfig.from_target(read_config(target_dir), 2, 4, attention="4/2/16")
    oracle = OracleDrafter(cfg, truth, len(prompt), V)
    identity = FrozenHead(torch.eye(V), torch.eye(V))
    tokens, per_forward = speculative(tgt, oracle, identity, prompt, 40)
    assert tokens == truth[:40]  # token for token
    assert per_forward[:8] == [1, 2, 3, 4, 1, 2, 3, 4]  # every acceptance length, the roll-back each time


def test_tree_verification_refuses_a_hybrid_target_with_the_reason(setups):
    from trainer.serve.ddtree import speculative_tree

    tgt = Target(setups["vl"][0], [1, 3], "cpu", torch.float32)
    cfg = DrafterConfig.from_target(read_config(setups["vl"][0]), 2, 4, attention="4/2/16")
    with pytest.raises(ValueError, match="tree verification is not exact for a Qwen3.5/3.6 target.*Gated DeltaNet"):
        speculative_tree(tgt, Drafter(cfg).eval(), FrozenHead(tgt.embed, tgt.lm_head), [1, 2, 3], 4, 4)


# ---------------------------------------------------------------- refusals and choices

@pytest.mark.parametrize("config,field", [({"model_type": "llama", "num_hidden_layers": 2}, "model_type 'llama'"),
                                          ({"model_type": "qwen3_5_moe", "text_config": {}}, "model_type 'qwen3_5_moe'"),
                                          ({"model_type": "qwen3_5"}, "has no text_config"),
                                          ({"model_type": "qwen3_5_text", "num_hidden_layers": 2, "hidden_size": 8,
                                            "intermediate_size": 8, "num_attention_heads": 2, "vocab_size": "many"},
                                           "vocab_size in config.json is 'many'")])
def test_an_unsupported_target_is_refused_in_one_line(tmp_path, config, field):
    from _trainer_tiny import base_args

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(config))
    data = _any_data(tmp_path)
    r = subprocess.run([sys.executable, "-m", "trainer", *base_args(str(target), data, str(tmp_path / "o"), "--from-scratch")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"python -m trainer: error: --target-model {target}: ") and field in lines[0]
    assert not (tmp_path / "o").exists()


def _any_data(tmp_path) -> str:
    from trainer.chat.prepare import prepare

    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"input_ids": list(range(40)), "loss_mask": [1] * 40}) + "\n" for _ in range(8)))
    prepare([str(jsonl)], str(tmp_path / "data"), log=lambda line: None)
    return str(tmp_path / "data")


def test_auto_picks_the_hybrid_fast_forward_only_with_its_kernels():
    v, cfg = flags.defaults(), {**family.QWEN3_6_27B_TEXT}
    assert flags.target_forward_for(v, cuda=True, target_config=cfg, kernels=True) == "fast"
    assert flags.target_forward_for(v, cuda=True, target_config=cfg, kernels=False) == "hf"
    assert flags.target_forward_for(v, cuda=False, target_config=cfg, kernels=True) == "hf"
    assert flags.target_forward_for(v, cuda=True, target_config={"model_type": "qwen3"}) == "fast"
    notes = family.kernel_notes(cfg, kernels_present=False)
    assert len(notes) == 1 and "flash-linear-attention" in notes[0] and "fla-core" in notes[0]
    assert family.kernel_notes(cfg, kernels_present=True) == [] and family.kernel_notes({"model_type": "qwen3"}) == []


# ---------------------------------------------------------------- the memory model of this family

QWEN36_27B_VL = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                 "tie_word_embeddings": False, "text_config": family.QWEN3_6_27B_TEXT,
                 # the released vision tower's numbers: never loaded, never counted
                 "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
                                   "out_hidden_size": 5120, "patch_size": 16}}


def _plan_without_torch(values: dict, config: dict, free: dict | None) -> dict:
    """budget.plan_run and the RunSpec's terms in a process where torch cannot be imported
    (the controller's preflight has none)."""
    code = WITHOUT_TORCH + """
import json
from trainer.plan import budget
from trainer.plan import memory
values, cfg, free = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
plan = budget.plan_run(values, free, cfg)
preds = budget.predictions(values, cfg, int(plan["token_budget"] or 8192)) if not plan["refusals"] else {}
terms = {r: {**p.terms, "trainable_params": memory.drafter_params(p.spec)} for r, p in preds.items()}
""" + NONE_IMPORTED + 'print(json.dumps({"plan": plan, "terms": terms}))\n'
    r = subprocess.run([sys.executable, "-c", code, json.dumps(values), json.dumps(config), json.dumps(free)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _param_count_of_the_real_architecture(text: dict) -> int:
    """Parameters of transformers' own Qwen3_5ForCausalLM at these widths (meta device: no
    memory), the count memory.py's must equal."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{k: v for k, v in text.items()
                                                        if k not in ("model_type", "architectures")}))
    return sum(p.numel() for p in model.parameters())


def test_the_preflight_plans_a_qwen36_27b_run_without_torch():
    """plan_run on the released Qwen3.6-27B config (vision-language layout), torch blocked:
    the drafter's widths are the public drafter's (32/8 × 128, not the target's 24/4 × 256),
    its frozen head the target's embedding and LM head, and the target's weights exactly
    those of transformers' Qwen3.6-27B language model — no vision tower."""
    values = {**flags.defaults(), "target_gpus": [0], "drafter_gpus": [1], "token_budget": 49152}
    out = _plan_without_torch(values, QWEN36_27B_VL, None)
    d, t = out["terms"]["drafter"], out["terms"]["target"]
    assert not out["plan"]["refusals"] and set(out["plan"]["gpus"]) == {"0", "1"}
    assert d["trainable_params"] == 5 * (2 * 5120 * 4096 + 2 * 5120 * 1024 + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128) \
        + 5 * 5120 * 5120 + 2 * 5120 == 1_730_213_120  # what the H200 run's drafter counted (docs/benchmarks.md)
    assert d["frozen_head"] == 2 * 2 * 248320 * 5120 and d["target_weights"] == 0
    params = _param_count_of_the_real_architecture(family.QWEN3_6_27B_TEXT)
    assert 26.8e9 < params < 27e9 and t["target_weights"] == 2 * params


def test_plan_run_takes_both_qwen36_layouts_and_refuses_only_what_does_not_fit():
    """The released layout (text_config) and the text-only one plan the same run to the byte,
    in every topology; on an H200 (142,629 MiB free) the operators' split run and the colocated
    run at 16,384 fit and auto picks a budget; what is refused is what does not fit — the
    colocated run at 49,152 on a 96 GB card, naming GPU, role and a budget that fits — or a
    config the model cannot read, in one line, never a traceback."""
    base = {**flags.defaults(), "use_soft_labels": True, "target_forward": "fast"}
    h200 = 142_629
    runs = [({"target_gpus": [0], "drafter_gpus": [1], "token_budget": 49152}, {0: h200, 1: h200}),
            ({"target_gpus": [0], "drafter_gpus": [0], "token_budget": 16384}, {0: h200}),
            ({"target_gpus": [0], "drafter_gpus": [0], "token_budget": "auto"}, {0: h200}),
            ({"target_gpus": [0, 1, 2], "drafter_gpus": [3, 4], "token_budget": "auto"}, {g: h200 for g in range(5)})]
    for run, free in runs:
        vl = _plan_without_torch({**base, **run}, QWEN36_27B_VL, free)["plan"]
        text = budget_mod.plan_run({**base, **run}, free, family.QWEN3_6_27B_TEXT)
        assert not vl["refusals"] and not text["refusals"], (run, vl["refusals"])
        assert vl["token_budget"] == text["token_budget"] and int(vl["token_budget"]) % 8192 == 0
        assert {int(g): r for g, r in vl["gpus"].items()} == text["gpus"]
        if run["token_budget"] == "auto":
            assert text["auto_reason"].startswith(f"{text['token_budget']} (")
    card_96gb = 96e9 / 2 ** 20 - 768  # a 96 GB card's free memory with the CUDA context out
    split = {**base, "target_gpus": [0], "drafter_gpus": [1]}
    assert not budget_mod.plan_run({**split, "token_budget": 49152}, {0: card_96gb, 1: card_96gb}, QWEN36_27B_VL)["refusals"]
    # the hybrid forward takes a micro-batch at once: a split target rank grows with the budget
    (line,) = budget_mod.plan_run({**split, "token_budget": 196608}, {0: card_96gb, 1: card_96gb}, QWEN36_27B_VL)["refusals"]
    assert line.startswith("GPU 0 (target) needs ") and "short by" in line and "lower --token-budget to 114688" in line
    # 50 GiB of target weights and 26 GiB of drafter state leave no room for a sequence
    (line,) = budget_mod.plan_run({**base, "target_gpus": [0], "drafter_gpus": [0], "token_budget": 16384},
                                  {0: card_96gb}, QWEN36_27B_VL)["refusals"]
    assert line.startswith("GPU 0 (target+drafter) needs ") and "not even one --max-seq-len 8192 sequence fits" in line
    no_text = budget_mod.plan_run({**base, "target_gpus": [0], "drafter_gpus": [1], "token_budget": 8192}, {0: h200},
                                  {"model_type": "qwen3_5", "vision_config": {}})
    assert no_text["refusals"] == ["no memory plan for this target: model_type 'qwen3_5' in config.json has no "
                                   "text_config: the language model's numbers are missing"]
    odd = budget_mod.plan_run({**base, "target_gpus": [0], "drafter_gpus": [1], "token_budget": 8192,
                               "drafter_attention": "32/7/128"}, {0: h200, 1: h200}, QWEN36_27B_VL)
    assert odd["refusals"] == ["--drafter-attention 32/7/128: query heads must be a multiple of KV heads, the head "
                               "dim even"]
    # the drafter's own widths reach the plan: the released drafter's 32/8 × 128 or the flag's
    wide = budget_mod.plan_run({**base, "target_gpus": [0], "drafter_gpus": [1], "token_budget": 49152,
                                "drafter_attention": "64/8/128"}, {0: h200, 1: h200}, QWEN36_27B_VL)
    default = budget_mod.plan_run({**base, "target_gpus": [0], "drafter_gpus": [1], "token_budget": 49152},
                                  {0: h200, 1: h200}, QWEN36_27B_VL)
    assert wide["gpus"][1]["peak_mib"] > default["gpus"][1]["peak_mib"] and wide["gpus"][0] == default["gpus"][0]


# The Qwen3.6-27B runs on an H200 (bench/target_forward/hybrid.py's drafter and colocated
# phases, 2026-12-01; docs/benchmarks.md), made with the build of
# b6e60f8: torch's default allocator (nothing set PYTORCH_CUDA_ALLOC_CONF then: reserved ran
# 2.6 GiB above allocated, where expandable segments hold 0.3-0.4 GiB), the chunked step's
# context-gradient leak fixed since (bench/memory_model/campaign.leak_bytes_of), and in
# `python -m trainer` the noisy copy of the taps beside the taps (noise in place since:
# memory_campaign.noisy_copy_bytes). The prediction adds what that build held
# (memory_campaign.as_measured_build).
MEASURED_H200_HYBRID = [
    # (what, role, budget, figure, MiB measured, kwargs)
    ("drafter step alone (hybrid.py drafter): torch.cuda.max_memory_reserved after 3 optimizer steps",
     "drafter", 49152, "reserved", 64.6796875 * 1024, {}),
    ("drafter step alone (hybrid.py drafter): torch.cuda.max_memory_allocated after 3 optimizer steps",
     "drafter", 49152, "allocated", 62.11313247680664 * 1024, {}),
    ("python -m trainer colocated, 64-layer synthetic target, 10 steps: largest nvidia-smi memory.used (2 s samples)",
     "colocated", 16384, "nvidia-smi", 107_487, {"noisy_copy": True}),
    ("python -m trainer colocated, 64-layer synthetic target, 10 steps: mem_peak_mib (max_memory_allocated)",
     "colocated", 16384, "allocated", 104_765.2, {"noisy_copy": True}),
]


@pytest.mark.parametrize("what, role, budget, figure, measured, kw", MEASURED_H200_HYBRID,
                         ids=[f"{r[1]}-{r[2]}-{r[3]}" for r in MEASURED_H200_HYBRID])
def test_the_model_holds_to_the_qwen3_6_27b_h200_measurements_within_5_percent(what, role, budget, figure, measured, kw):
    """Rows: the drafter step at the operators' flags (budget 49,152, 1,024 anchors, block 32,
    5 layers of which 4 sliding-window, soft labels, CAP) — its reserved peak (64.68 GiB) and
    allocated peak (62.11 GiB), bench/target_forward/hybrid.py's drafter phase; the colocated
    `python -m trainer` on the full 64-layer synthetic Qwen3.6-27B target + drafter at budget
    16,384 — nvidia-smi's largest reading (107,487 MiB) and the allocated peak (104,765 MiB)
    of its step events, hybrid.py's colocated phase. Both in one run of hybrid.py's phases,
    2026-12-01, one H200."""
    sys.path.insert(0, ROOT)
    from bench.memory_model import campaign as mc

    gpus = {"drafter": ([1], [0]), "colocated": ([0], [0])}[role]
    values = {**flags.defaults(), "target_gpus": gpus[0], "drafter_gpus": gpus[1], "token_budget": budget,
              "use_soft_labels": True, "kl_weight": 0.15, "cap_lambda": 0.1, "noise_start": 0.05, "noise_end": 0.01,
              "drafter_step": "chunked", "target_forward": "fast"}
    p = mc.as_measured_build(budget_mod.predictions(values, family.QWEN3_6_27B_TEXT, budget, alloc_conf="")[role], **kw)
    predicted = {"allocated": p.allocated, "reserved": p.reserved, "nvidia-smi": p.nvidia_smi()}[figure]
    assert p.spec.allocator.name == "default" and p.spec.dshape.n_heads == 32 and p.spec.target.family == "qwen3_5_text"
    assert abs(predicted / memory.MIB - measured) / measured < 0.05, (what, predicted / memory.MIB, measured, p.describe())
