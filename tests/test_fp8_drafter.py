"""The drafter's GEMMs in FP8 training (--drafter-precision fp8, trainer/gpu/fp8_train.py: torchao's
float8 training, row-wise scales) and the teacher's logits through an FP8 head under
--target-precision fp8 (trainer/gpu/fp8.py) — on CPU, where torch's own scaled matmul runs
torchao's arithmetic (torch 2.13), and the teacher's emulated like the target's other GEMMs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from _trainer_tiny import base_args, events, step_events, tiny_setup
from trainer import checkpoint as ckpt_io
from trainer import flags
from trainer.gpu import fp8
from trainer.model import Drafter, DrafterConfig, FrozenHead, StepGemmWeights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchao():
    pytest.importorskip("torchao.float8", reason="torchao is not installed (the fp8 extra)")
    from trainer.gpu import fp8_train

    return fp8_train


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8d")
    target, data = tiny_setup(str(root))
    return {"root": root, "target": target, "data": data}


def _cfg(**kw):
    base = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=256, num_hidden_layers=2, num_target_layers=6,
                target_layer_ids=[1, 4], block_size=8, mask_token_id=255)
    return DrafterConfig(**{**base, **kw})


# ------------------------------------------------------------------ the conversion
def test_the_drafters_gemms_are_converted_and_nothing_else_with_the_same_parameters():
    t = torchao()
    torch.manual_seed(0)
    d = Drafter(_cfg(intermediate_size=120, arch="dflash2"))  # gate/up/down: 120 is no multiple of 16
    before = {n: p for n, p in d.named_parameters()}
    names = t.convert(d)
    per_layer = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert names == sorted(["fc"] + [f"layers.{i}.self_attn.{p}" for i in range(2) for p in per_layer])
    assert set(t.converted(d)) == set(names)
    assert not t.is_fp8(d.layers[0].mlp.gate_proj)  # skipped: 120 columns
    assert not t.is_fp8(d.candidate_selector.hidden_projection)  # DFlash2's small projections stay
    assert not t.is_fp8(d.layers[0].attention_conv.kernel_projection)
    # the same Parameter objects under the same names: optimizer, checkpoints and loading unchanged
    assert {n: p for n, p in d.named_parameters()} == before
    assert all(p.dtype == torch.float32 for p in d.parameters())


def test_the_frozen_target_is_never_converted(tiny):
    t = torchao()
    from trainer.target import Target

    target = Target(tiny["target"], [1, 4], "cpu", torch.float32)
    torch.manual_seed(0)
    d = Drafter(_cfg())
    t.convert(d)
    assert t.converted(target.model) == [] and len(t.converted(d)) == 1 + 2 * 7


def test_a_fused_fp8_gemm_computes_its_parts_side_by_side_and_its_gradient_reaches_the_masters():
    t = torchao()
    torch.manual_seed(0)
    d = Drafter(_cfg())
    t.convert(d)
    a = d.layers[0].self_attn
    x = torch.randn(1, 24, 64)
    gemm = StepGemmWeights(d, torch.float32).layers[0]
    fused = gemm["qkv"](x)
    parts = torch.cat([m(x) for m in (a.q_proj, a.k_proj, a.v_proj)], -1)  # each Float8Linear alone
    assert torch.equal(fused, parts)  # per-output-channel weight scales: fusing changes no number
    exact = x @ torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).t()
    assert 0 < ((fused - exact).norm() / exact.norm()).item() < 0.06  # e4m3: a few percent
    fused.pow(2).sum().backward()
    g = a.q_proj.weight.grad
    ref_x = x.detach().requires_grad_(False)
    want = 2 * (ref_x @ a.q_proj.weight.t()).reshape(-1, 64).t() @ ref_x.reshape(-1, 64)
    assert g is not None and g.dtype == torch.float32 and ((g - want).norm() / want.norm()).item() < 0.1


def test_fcs_backward_forms_no_gradient_for_the_frozen_taps():
    t = torchao()
    torch.manual_seed(0)
    d = Drafter(_cfg())
    t.convert(d)
    taps = torch.randn(2, 16, 128)  # the target's states: no gradient wanted
    w = d.fc.weight.detach().clone().requires_grad_(True)
    y = t.mm(taps, w, d.fc)
    y.pow(2).sum().backward()
    x = taps.clone().requires_grad_(True)
    w2 = d.fc.weight.detach().clone().requires_grad_(True)
    t.mm(x, w2, d.fc).pow(2).sum().backward()
    assert torch.equal(w.grad, w2.grad) and x.grad is not None  # the weight's gradient as torchao's own


# ------------------------------------------------------------------ training
def _run(tiny, name, *extra, steps=12):
    out = str(tiny["root"] / name)
    argv = base_args(tiny["target"], tiny["data"], out, "--max-steps", str(steps), "--use-soft-labels",
                     "--save-interval", str(steps), *extra)
    assert __import__("trainer.__main__", fromlist=["main"]).main(argv) == 0
    return out


@pytest.mark.parametrize("step", ["reference", "chunked"])
def test_fp8_training_learns_and_stays_close_to_bf16(tiny, step):
    torchao()
    bf16 = [e["loss"] for e in step_events(_run(tiny, f"b-{step}", "--from-scratch", "--drafter-step", step))]
    out = _run(tiny, f"f-{step}", "--from-scratch", "--drafter-step", step, "--drafter-precision", "fp8")
    f8 = [e["loss"] for e in step_events(out)]
    assert len(f8) == 12 and all(map(lambda v: v == v, f8))
    assert sum(f8[-3:]) / 3 < f8[0] - 0.2  # it learns
    # the same weights, data and anchors: each step's loss within 0.05 of bf16's (measured ≤ 0.015)
    assert max(abs(a - b) for a, b in zip(f8, bf16)) < 0.05 and f8 != bf16
    said = [e for e in events(out, "phase") if e.get("phase") == "training"][0]["paths"]
    assert said["drafter_precision"] == "fp8" and "torchao's float8 training" in said["drafter_precision_why"]


def test_an_fp8_drafters_checkpoint_is_plain_fp32_resumes_in_bf16_and_exports(tiny, tmp_path):
    torchao()
    out = _run(tiny, "ck-fp8", "--from-scratch", "--drafter-precision", "fp8", steps=3)
    ref = _run(tiny, "ck-bf16", "--from-scratch", steps=3)
    state, plain = ckpt_io.load(os.path.join(out, "step_3"))["model"], ckpt_io.load(os.path.join(ref, "step_3"))["model"]
    assert set(state) == set(plain) and all(v.dtype == torch.float32 for v in state.values())
    # a bf16 run takes it, whole (--resume-from) and as weights (--init-from)
    resumed = _run(tiny, "ck-resume", "--resume-from", os.path.join(out, "step_3"), steps=5)
    assert [e["step"] for e in step_events(resumed)] == [4, 5]
    _run(tiny, "ck-init", "--init-from", os.path.join(out, "step_3"), steps=1)
    # the export: the z-lab layout, loadable by our loader, equal to the masters in bf16
    code = "import sys; from trainer.__main__ import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, "export", "--checkpoint", out, "--out", str(tmp_path / "x")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    d = Drafter.from_pretrained(str(tmp_path / "x"))
    for k, v in d.state_dict().items():
        assert torch.equal(v, state[k].to(torch.bfloat16).float()), k


def test_without_torchao_fp8_is_refused_up_front_with_the_install_command(tiny, tmp_path):
    out = str(tmp_path / "out")
    argv = base_args(tiny["target"], tiny["data"], out, "--from-scratch", "--drafter-precision", "fp8")
    # torchao made unimportable in that process (None in sys.modules: what a venv without it gives)
    code = ("import sys; sys.modules['torchao'] = None; sys.modules['torchao.float8'] = None; "
            "from trainer.__main__ import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == flags.EXIT_USAGE
    assert ("--drafter-precision fp8: torchao's float8 training does not import" in p.stderr
            and "install it: ctl env install torchao --container ID" in p.stderr
            and "or use --drafter-precision bf16" in p.stderr and "Traceback" not in p.stderr)
    assert not os.path.exists(out)


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused_with_the_reason(tiny, tmp_path, capsys, monkeypatch):
    torchao()
    from trainer import __main__ as cli
    from trainer import paths

    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(cli, "_cuda_count", lambda: 1)
    monkeypatch.setattr(paths, "gpu_capability", lambda index=0: (8, 0))
    argv = base_args(tiny["target"], tiny["data"], str(tmp_path / "out"), "--from-scratch", "--drafter-precision",
                     "fp8", "--attention-kernel", "triton")
    argv[argv.index("--device") + 1] = "auto"
    assert cli.main(argv) == flags.EXIT_USAGE
    err = capsys.readouterr().err
    assert ("--drafter-precision fp8: the GPU's compute capability is 8.0: FP8 tensor cores need 8.9 (Ada) or newer"
            in err and "use --drafter-precision bf16" in err)
    assert not (tmp_path / "out").exists()


def test_a_bf16_run_needs_no_torchao(tiny, tmp_path):
    """The import is lazy: only --drafter-precision fp8 reaches torchao (transformers may import
    it on its own where it is installed, so the test makes it unimportable instead)."""
    argv = base_args(tiny["target"], tiny["data"], str(tmp_path / "out"), "--from-scratch", "--max-steps", "1")
    code = ("import sys; sys.modules['torchao'] = None; sys.modules['torchao.float8'] = None; "
            "from trainer.__main__ import main; sys.exit(main(sys.argv[1:]))")
    p = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "drafter precision: fp32 (CPU run: fp32 throughout (--drafter-precision bf16))" in p.stdout


# ------------------------------------------------------------------ the teacher's logits in FP8
def test_fp8_teacher_logits_are_the_emulated_scaled_matmul_within_the_documented_bound():
    g = torch.Generator().manual_seed(3)
    V, H, S = 300, 64, 40
    head = torch.randn(V, H, generator=g) * 0.02
    states = torch.randn(S, H, generator=g)
    states[:, :3] *= 30  # outlier channels, as a final state has
    w8 = fp8.Fp8Weight.of(head)
    table = fp8.quantize_table(states)
    rows = torch.tensor([5, 0, 39, 5, 17])
    got = fp8.mm(fp8.take_rows(*table, rows), w8)
    x8, sx = fp8.quantize_rows(states[rows])
    assert torch.equal(got, fp8.scaled_mm(x8, sx, w8.w8, w8.scale, torch.float32))  # one table, any rows
    exact = states[rows].double() @ head.double().t()
    assert torch.all((got.double() - exact).abs() <= fp8.error_bound(states[rows], head, sx, w8.scale) * (1 + 1e-6)
                     + 1e-6 * exact.abs())
    assert 0 < ((got.double() - exact).norm() / exact.norm()).item() < 0.05
    assert torch.equal(fp8.teacher_logits(states[rows], w8), got)  # the reference loss's path: the same numbers


def test_the_chunked_heads_fp8_teacher_equals_the_reference_losss_and_stays_near_bf16():
    from trainer.gpu.chunked_head import chunked_head_loss, chunk_spans, span_plan
    from trainer.loss import dflash_loss_fn

    g = torch.Generator().manual_seed(4)
    nb, K, H, V, R = 6, 7, 64, 200, 30
    hidden = torch.randn(nb, K, H, generator=g)
    W = torch.randn(V, H, generator=g) * 0.05
    table = torch.randn(R, H, generator=g)
    rows = torch.randint(0, R, (nb, K), generator=g)
    targets = torch.randint(0, V, (nb, K), generator=g)
    fn = dflash_loss_fn(torch.rand(nb, K, generator=g), kl_weight=0.3, temperature=2.0)
    spans = span_plan(chunk_spans(rows, torch.ones(nb, dtype=torch.bool), 14).tolist(), nb, 14, K)
    w8 = fp8.Fp8Weight.of(W)
    kw = dict(teacher_rows=rows, temperature=2.0, chunk_rows=14)
    f8 = chunked_head_loss(hidden, W, targets, fn, teacher=fp8.quantize_table(table), teacher_fp8=w8,
                           teacher_spans=spans, **kw)
    f8_nospan = chunked_head_loss(hidden, W, targets, fn, teacher=fp8.quantize_table(table), teacher_fp8=w8, **kw)
    bf = chunked_head_loss(hidden, W, targets, fn, teacher=table, **kw)
    # the KL against the teacher's FP8 logits, formed here, equals it formed the reference loss's way
    zt = fp8.teacher_logits(table[rows.reshape(-1)], w8).double() / 2.0
    z = (hidden.reshape(-1, H) @ W.t()).double() / 2.0
    pt = zt.log_softmax(-1)
    kl = (pt.exp() * (pt - z.log_softmax(-1))).sum(-1).view(nb, K)
    torch.testing.assert_close(f8[2].double(), kl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f8_nospan[2], f8[2], rtol=1e-6, atol=1e-7)  # spans or rows: the same logits
    assert torch.equal(f8[1], bf[1])  # the drafter's own CE never touches the teacher
    assert ((f8[2] - bf[2]).abs().max() / bf[2].abs().max()).item() < 0.1 and not torch.equal(f8[2], bf[2])


def test_target_fp8_with_soft_labels_trains_its_teacher_through_the_fp8_head_and_bf16_is_unchanged(tiny):
    golden_first = 5.00478  # this file's soft-label run in bf16 (fp32 on CPU), first step
    out = _run(tiny, "t8", "--from-scratch", "--target-precision", "fp8", "--drafter-step", "chunked", steps=3)
    ref = _run(tiny, "t8-ref", "--from-scratch", "--target-precision", "fp8", "--drafter-step", "reference", steps=3)
    a, b = step_events(out), step_events(ref)
    # both steps form the teacher's logits through the same FP8 head: the same KL
    assert [e["kl"] for e in a] == pytest.approx([e["kl"] for e in b], abs=1e-4)
    plain = step_events(_run(tiny, "t16", "--from-scratch", "--drafter-step", "chunked", steps=1))
    assert plain[0]["loss"] == pytest.approx(golden_first, abs=1e-4)
    head = FrozenHead(torch.zeros(4, 64), torch.randn(32, 64))
    assert head.lm_head8 is None and head.teacher_head() is None
    head.quantize_teacher()
    assert head.lm_head8.w8.dtype == torch.float8_e4m3fn and head.lm_head8.scale.shape == (32, 1)
    assert head.lm_head.dtype == torch.float32  # the drafter's logits keep the bf16 (here fp32) head


# ------------------------------------------------------------------ memory
def test_the_memory_model_counts_the_fp8_teacher_head_exactly_and_the_fp8_drafters_casts():
    from trainer.plan import memory as mm

    head = FrozenHead(torch.zeros(4, 64), torch.randn(256, 64))
    head.quantize_teacher()
    held = head.lm_head8.w8.numel() + 4 * head.lm_head8.scale.numel()
    tiny = mm.ModelShape(6, 64, 4, 2, 16, 128, 256, "tiny")
    spec = dict(target=tiny, role="colocated", token_budget=192, seq_len=48, soft_labels=True)
    assert mm.predict(mm.RunSpec(**spec, target_precision="fp8")).terms["teacher_head8"] == held
    assert mm.predict(mm.RunSpec(**{**spec, "soft_labels": False}, target_precision="fp8")).terms["teacher_head8"] == 0
    b16, f8 = (mm.predict(mm.RunSpec(mm.QWEN3_8B, "colocated", 49152, 8192, soft_labels=True, drafter_precision=p))
               for p in ("bf16", "fp8"))
    # what the backward keeps is torchao's bf16 input and weight, as the bf16 GEMM's: only transient casts grow
    assert f8.terms["activations"] == b16.terms["activations"] and f8.terms["fp8_casts"] > 0
    assert 0 < f8.allocated - b16.allocated < 2 * 2**30


def test_the_fp8_bench_runs_the_teacher_head_and_drafter_step_sections_on_cpu(tmp_path):
    """bench/fp8/run.py --smoke --sections teacher_head,drafter_step: the harness the GPU run uses."""
    torchao()
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_bench_d", os.path.join(ROOT, "bench", "fp8", "run.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--out", str(tmp_path), "--smoke", "--reps", "1", "--sections", "teacher_head,drafter_step"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())["sections"]
    assert s["teacher_head"]["ms"]["fp8"] > 0 and 0 < s["teacher_head"]["rel_err"]["fp8"] < 0.05
    d = s["drafter_step"]
    assert {"bf16", "fp8", "teacher_fp8"} <= set(d) and abs(d["loss_diff_fp8"]) < 0.05 and d["speedup_fp8"] > 0
