"""The frozen target in FP8 (trainer/gpu/fp8.py, --target-precision): the arithmetic against an
fp64 reference within its documented error, the producers equal to their parts, both target
forwards in FP8 computing the same model, the flag's resolution, the memory it saves, and the
run's first lines naming each kernel and precision with the reason — all on CPU (the scaled
matmul emulated; torch's own CPU op checked where this torch has it)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from trainer import flags, paths
from trainer.gpu import fp8
from trainer.layers import fused_ops as fo
from trainer.plan import memory as mm
from trainer.plan.flops import ModelShape

G = torch.Generator().manual_seed(0)


def _x(m, k, outliers=False, dtype=torch.float32):
    x = torch.randn(m, k, generator=G)
    if outliers:  # a few channels 50x the rest, as real activations have
        x[:, :3] *= 50
    return x.to(dtype)


# ------------------------------------------------------------------ the arithmetic
def test_scales_map_each_rows_largest_magnitude_onto_448_and_nothing_leaves_the_e4m3_range():
    x = _x(64, 96, outliers=True)
    x[5] = 0  # a zero row (padding): scale floored, values stay 0, no NaN
    x8, s = fp8.quantize_rows(x)
    assert x8.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (64, 1)
    amax = x.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s[amax > 0], (amax / 448)[amax > 0])
    assert s[5].item() == pytest.approx(fp8.AMAX_FLOOR / 448) and torch.all(x8[5].float() == 0)
    v = x8.float()
    assert torch.isfinite(v).all() and v.abs().max() <= 448
    rows = torch.arange(64) != 5
    assert torch.all(v[rows].abs().amax(-1) == 448)  # each row's largest lands exactly on the top value


def test_values_beyond_the_scale_are_clamped_to_448_not_overflowed():
    x = torch.tensor([[1.0, -3.0, 1e9, -1e9]])
    x8 = fp8.to_e4m3(x, torch.tensor([[1.0]]))
    assert x8.float().tolist() == [[1.0, -3.0, 448.0, -448.0]]


def test_per_channel_weight_scale_and_each_element_within_e4m3_rounding():
    w = _x(48, 80) * 0.02
    q = fp8.Fp8Weight.of(w)
    assert q.scale.shape == (48, 1)
    torch.testing.assert_close(q.scale, w.abs().amax(-1, keepdim=True) / 448)
    err = (q.dequantized() - w.double()).abs()
    bound = torch.maximum(fp8.REL_ROUNDING * w.double().abs(), fp8.SUBNORMAL_HALF_ULP * q.scale.double())
    assert torch.all(err <= bound * (1 + 1e-9))
    # stacking per-channel quantized parts is quantizing the stack (the fused q|k|v, gate|up)
    a, b = w[:20], w[20:]
    whole = fp8.cat([fp8.Fp8Weight.of(a), fp8.Fp8Weight.of(b)])
    assert torch.equal(whole.w8.view(torch.uint8), q.w8.view(torch.uint8)) and torch.equal(whole.scale, q.scale)


@pytest.mark.parametrize("outliers", [False, True])
def test_the_scaled_matmul_is_the_fp64_dequantized_product_and_within_the_documented_bound_of_the_exact_one(outliers):
    x, w = _x(64, 128, outliers), _x(96, 128) * 0.02
    x8, sx = fp8.quantize_rows(x)
    W = fp8.Fp8Weight.of(w)
    y = fp8.scaled_mm(x8, sx, W.w8, W.scale, torch.float32)
    deq = fp8.dequantize(x8, sx) @ W.dequantized().t()  # the reference: fp64 of the quantized operands
    # the emulation is that product up to fp32 accumulation (products of e4m3 values are exact in fp32)
    assert ((y.double() - deq).abs() <= 1e-5 * deq.abs() + 1e-6 * (x.abs().max() * w.abs().max())).all()
    exact = x.double() @ w.double().t()
    assert torch.all((deq - exact).abs() <= fp8.error_bound(x, w, sx, W.scale) * (1 + 1e-9))
    rel = ((y.double() - exact).norm() / exact.norm()).item()
    assert 0 < rel < 0.05  # documented: a few percent (3.7 % typical) for one GEMM
    # bf16 output: the same product rounded once
    yb = fp8.scaled_mm(x8, sx, W.w8, W.scale, torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.double(), deq, rtol=2 ** -8, atol=1e-6)


def test_torchs_own_cpu_scaled_mm_agrees_with_the_emulation_where_this_torch_has_it():
    x, w = _x(32, 64), _x(48, 64) * 0.02
    x8, sx = fp8.quantize_rows(x)
    W = fp8.Fp8Weight.of(w)
    try:
        real = torch._scaled_mm(x8, W.w8.t(), scale_a=sx, scale_b=W.scale.view(1, -1), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm has no CPU kernel in this torch: {exc}")
    torch.testing.assert_close(real, fp8.scaled_mm(x8, sx, W.w8, W.scale, torch.float32), rtol=1e-5, atol=1e-6)


def test_each_producer_is_its_bf16_op_then_the_row_quantization():
    x, y = _x(2 * 9, 64).view(2, 9, 64), _x(2 * 9, 64).view(2, 9, 64)
    w = torch.rand(64, generator=G) + 0.5

    def same(a, b):
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])

    same(fp8.FP8.norm(x, w, 1e-6), fp8.quantize_rows(fo.norm(x, w, 1e-6)))
    r, h = fp8.FP8.add_norm(x, y, w, 1e-6)
    r0, h0 = fo.add_norm(x, y, w, 1e-6)
    assert torch.equal(r, r0)
    same(h, fp8.quantize_rows(h0))
    gu = _x(18, 128).view(2, 9, 128)
    same(fp8.FP8.silu_mul(gu), fp8.quantize_rows(fo.silu_mul(gu)))
    o = _x(2 * 4 * 9, 16).view(2, 4, 9, 16)
    same(fp8.FP8.heads(o), fp8.quantize_rows(o.transpose(1, 2).reshape(2, 9, 64)))


def test_quantize_linears_replaces_every_bias_free_linear_and_the_module_computes_the_fp8_product():
    net = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 16, bias=True),
                              torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False)))
    x = _x(5, 32)
    w0 = net[0].weight.detach().clone()
    assert fp8.quantize_linears(net) == 2
    assert isinstance(net[0], fp8.Fp8Linear) and isinstance(net[1], torch.nn.Linear) and isinstance(net[2][0], fp8.Fp8Linear)
    x8, sx = fp8.quantize_rows(x)
    W = fp8.Fp8Weight.of(w0)
    torch.testing.assert_close(net[0](x), fp8.scaled_mm(x8, sx, W.w8, W.scale, torch.float32))


# ------------------------------------------------------------------ the targets in FP8
@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    from _trainer_tiny import make_target

    return make_target(str(tmp_path_factory.mktemp("fp8") / "t"))


def test_both_forwards_of_an_fp8_target_compute_the_same_model_and_keep_taps_in_the_model_dtype(dense):
    from trainer.target import Target

    ids = torch.randint(0, 255, (3, 40), generator=torch.Generator().manual_seed(0))
    ref = Target(dense, [1, 2], "cpu", torch.float32, "hf")
    hf = Target(dense, [1, 2], "cpu", torch.float32, "hf", precision="fp8")
    fast = Target(dense, [1, 2], "cpu", torch.float32, "fast", precision="fp8")
    assert fast.fast.precision == "fp8" and isinstance(fast.fast.layers[0].wqkv, fp8.Fp8Weight)
    layer = hf.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, fp8.Fp8Linear) and isinstance(layer.mlp.down_proj, fp8.Fp8Linear)
    assert not any(isinstance(m, torch.nn.Linear) for m in hf.model.model.layers.modules())  # no bf16 copy kept
    # the fused weight's parts are the transformers layers' own (shared, not copied)
    fused, q = fast.fast.layers[0].wqkv, fast.model.model.layers[0].self_attn.q_proj.weight8
    assert q.w8.untyped_storage().data_ptr() == fused.w8.untyped_storage().data_ptr()
    (t_ref, f_ref), (t_hf, f_hf), (t_fast, f_fast) = (m.forward(ids, True) for m in (ref, hf, fast))
    assert t_fast.dtype == f_fast.dtype == torch.float32
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(t_fast, t_hf) < 1e-3  # the same quantization points, the same scales
    assert 1e-4 < rel(t_fast, t_ref) < 0.3  # quantized (not the fp32 model), and still that model
    # deeper, an fp32 rounding difference between the two forwards now and then puts an element
    # on the neighbouring e4m3 value (a 2⁻³ step): still the same model to well under a percent
    assert rel(f_fast, f_hf) < 2e-2


def test_random_fast_targets_of_one_seed_share_their_weights_whatever_the_precision():
    from trainer.gpu.fast_target import FastTarget

    shape = ModelShape(3, 64, 4, 2, 16, 128, vocab=300)
    a = FastTarget.random(shape, [0, 2], device="cpu", dtype=torch.float32, attn_backend="math", seed=3)
    b = FastTarget.random(shape, [0, 2], device="cpu", dtype=torch.float32, attn_backend="math", seed=3,
                          precision="fp8")
    assert a.precision == "bf16" and b.precision == "fp8"
    assert torch.equal(fp8.Fp8Weight.of(a.layers[1].wd).w8.view(torch.uint8), b.layers[1].wd.w8.view(torch.uint8))
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    ta, _ = a.forward(ids)
    tb, _ = b.forward(ids)
    assert 0 < ((ta - tb).norm() / ta.norm()).item() < 0.2


# ------------------------------------------------------------------ the flag
@pytest.mark.parametrize("choice,cuda,cap,hidden,want", [
    ("auto", True, (9, 0), 4096, "fp8"),
    ("auto", True, (8, 9), 5120, "fp8"),
    ("auto", True, (8, 0), 4096, "bf16"),  # Ampere: no FP8 tensor cores
    ("auto", True, (9, 0), 2048, "bf16"),  # too small to gain, as measured
    ("auto", True, "NVMLError: no driver", 4096, "bf16"),  # unknown GPU: the safe choice
    ("auto", False, None, 4096, "bf16"),  # CPU
    ("bf16", True, (9, 0), 4096, "bf16"),
    ("fp8", False, None, 64, "fp8"),  # emulated on CPU
    (None, True, (9, 0), 4096, "bf16"),  # a run config written before the flag: its default
])
def test_auto_takes_fp8_only_on_an_fp8_gpu_for_a_target_large_enough(choice, cuda, cap, hidden, want):
    got, why = flags.target_precision_for({"target_precision": choice}, cuda, cap, hidden)
    assert got == want and why.startswith("--target-precision")


def test_the_reasons_name_the_capability_and_the_size():
    assert "8.0" in flags.target_precision_for({"target_precision": "auto"}, True, (8, 0), 4096)[1]
    assert "Ampere" in flags.fp8_missing(True, (8, 6))
    assert "2048 is below 4,096" in flags.target_precision_for({"target_precision": "auto"}, True, (9, 0), 2048)[1]
    assert flags.fp8_missing(True, (12, 0)) is None  # Blackwell workstation cards (the seed's RTX PRO 6000)


QWEN3_BIG = {"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 12288, "num_hidden_layers": 36, "vocab_size": 151936,
             "tie_word_embeddings": False, "rope_theta": 1e6}


def test_an_explicit_fp8_on_a_gpu_without_it_is_refused_up_front_with_the_fix(tmp_path, capsys, monkeypatch):
    from _trainer_tiny import base_args
    from trainer import __main__ as cli

    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(cli, "_cuda_count", lambda: 1)
    monkeypatch.setattr(paths, "gpu_capability", lambda index=0: (8, 0))
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(QWEN3_BIG))
    argv = base_args(str(tmp_path / "t"), str(tmp_path / "d"), str(tmp_path / "out"), "--from-scratch",
                     "--target-precision", "fp8", "--attention-kernel", "triton")
    argv[argv.index("--device") + 1] = "auto"
    assert cli.main(argv) == flags.EXIT_USAGE
    err = capsys.readouterr().err
    assert ("--target-precision fp8: the GPU's compute capability is 8.0: FP8 tensor cores need 8.9 (Ada) or newer"
            in err) and "use --target-precision bf16" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the run's first lines
def test_a_missing_flash_attn_dependency_is_said_with_its_install_command_not_silently_taken():
    cutlass = "flash-attn-4 does not import (ModuleNotFoundError: No module named 'cutlass')"
    p = paths.decide({"attention_kernel": "triton", "target_forward": "fast", "target_precision": "bf16",
                      paths.REQUESTED: {"attention_kernel": "auto"}},
                     paths.Facts(cuda=True, capability=(9, 0), flash_missing=cutlass, cuda_major=13, hidden=4096))
    lines = p.lines()
    assert lines[0] == ("attention kernel: triton (auto: flex attention's Triton kernels, flash-attn-4 cannot run "
                        f"here: {cutlass})")
    assert lines[-1] == ("faster path missing: flash-attn-4 (" + cutlass + "): the drafter's attention about 1.35x "
                         "faster; install: ctl env install 'flash-attn-4[cu13]' --container ID")
    assert "fp8 would run on this GPU" in lines[2]  # bf16 by default, and what auto would take
    assert p.event()["missing"] == [lines[-1][len("faster path missing: "):]]
    cu12 = paths.decide({"attention_kernel": "triton"}, paths.Facts(cuda=True, capability=(9, 0),
                                                                    flash_missing="flash-attn-4 is not installed",
                                                                    cuda_major=12))
    assert cu12.missing[0].endswith("install: ctl env install flash-attn-4 --container ID")


def test_an_old_gpu_gets_no_install_line_for_what_no_package_can_give_but_is_told_fp8_is_missing():
    too_old = "the GPU's compute capability is 8.0: flash-attn-4's kernels need 9.0 (Hopper) or newer"
    p = paths.decide({"attention_kernel": "triton", "target_forward": "fast", "target_precision": "bf16",
                      paths.REQUESTED: {"target_precision": "auto"}},
                     paths.Facts(cuda=True, capability=(8, 0), flash_missing=too_old, cuda_major=12, hidden=5120))
    assert p.target_precision == "bf16" and "compute capability is 8.0" in p.target_precision_why
    assert len(p.missing) == 1 and p.missing[0].startswith("FP8 for the target (the GPU's compute capability is 8.0")
    assert "no package adds it" in p.missing[0]


def test_the_lines_say_what_was_chosen_and_why_when_everything_is_there():
    p = paths.decide({"attention_kernel": "flash", "target_forward": "fast", "target_precision": "fp8",
                      paths.REQUESTED: {"attention_kernel": "auto", "target_forward": "auto", "target_precision": "auto"}},
                     paths.Facts(cuda=True, capability=(9, 0), flash_missing=None, cuda_major=13, hidden=4096))
    kernel, forward, precision, drafter = p.lines()
    assert kernel.startswith("attention kernel: flash (auto: flash-attn-4's CuTe kernels")
    assert forward.startswith("target forward: fast (auto: fused q|k|v")
    assert precision.startswith("target precision: fp8 (--target-precision auto: compute capability 9.0 has FP8 "
                                "tensor cores and the target's hidden size 4,096")
    assert "activations quantized per row in their producers" in precision
    assert drafter.startswith("drafter precision: bf16 (bf16 compute, fp32 master weights")
    assert p.missing == ()
    explicit = paths.decide({"attention_kernel": "triton", paths.REQUESTED: {"attention_kernel": "triton"}},
                            paths.Facts(cuda=True, capability=(9, 0)))
    assert "--attention-kernel triton: flex attention's Triton kernels; flash-attn-4's would run here" in explicit.lines()[0]


def test_a_cpu_run_starts_with_its_lines_and_the_event_carries_them(tmp_path, capsys):
    from _trainer_tiny import base_args, events, make_data, make_target
    from trainer.__main__ import main

    t = make_target(str(tmp_path / "t"))
    d = make_data(t, str(tmp_path / "d"), samples=16)
    out = str(tmp_path / "out")
    assert main(base_args(t, d, out, "--from-scratch", "--max-steps", "1", "--target-precision", "fp8")) == 0
    said = [l for l in capsys.readouterr().out.splitlines() if l.startswith("python -m trainer: ")]
    assert [l.split(":")[1].strip() for l in said[:4]] == ["attention kernel", "target forward", "target precision",
                                                           "drafter precision"]
    assert "target precision: fp8 (--target-precision fp8, emulated on CPU" in said[2]
    phase = [e for e in events(out, "phase") if e.get("phase") == "training"][0]
    assert phase["paths"]["target_precision"] == "fp8" and phase["paths"]["attention_kernel"] == "sdpa"


# ------------------------------------------------------------------ memory
def test_fp8_weights_take_about_half_and_auto_can_choose_a_larger_budget():
    from trainer import family
    from trainer.plan import budget

    for shape in (mm.QWEN3_8B, ModelShape.from_hf_config(family.QWEN3_6_27B_TEXT)):
        fam = mm.family_of(shape)
        bf16, f8 = (fam.weight_bytes(shape, shape.n_layers, False, p) for p in ("bf16", "fp8"))
        layers = bf16 - 2 * (2 * shape.vocab * shape.hidden + shape.hidden)  # what is quantized, and the norms
        assert 0.49 < (layers - (bf16 - f8)) / layers < 0.51  # the layers in about half
        spec = mm.RunSpec(shape, "colocated", 49152, 8192, soft_labels=True, target_precision="fp8")
        p = mm.predict(spec)
        assert p.phases["load"] == bf16 and p.terms["target_weights"] == f8
    # exactly what an FP8 Target holds: every fp8 value, scale and remaining bf16 tensor
    values = {"target_model": "x", "target_gpus": (0,), "drafter_gpus": (0,), "num_draft_layers": 5,
              "max_seq_len": 8192, "max_batch_size": 64, "block_size": 16, "max_anchors": 512,
              "use_soft_labels": True, "grad_accum": 1, "target_precision": "bf16"}
    free = {0: 70 * 1024}
    b16 = budget.plan_run({**values, "token_budget": "auto"}, free, QWEN3_BIG, alloc_conf="expandable_segments:True")
    f8 = budget.plan_run({**values, "token_budget": "auto", "target_precision": "fp8"}, free, QWEN3_BIG,
                         alloc_conf="expandable_segments:True")
    assert f8["gpus"][0]["reserved_mib"] < b16["gpus"][0]["reserved_mib"] or f8["token_budget"] > b16["token_budget"]
    # 44 GiB: with soft labels an FP8 run also holds the head's e4m3 copy for the teacher (0.58 GiB)
    assert budget.largest_fitting_batch({**values, "target_precision": "fp8"}, QWEN3_BIG, "colocated", 44 * 2**30) > \
        budget.largest_fitting_batch(values, QWEN3_BIG, "colocated", 44 * 2**30)


def test_the_memory_model_counts_an_fp8_targets_bytes_exactly(dense):
    from trainer.target import Target

    t = Target(dense, [1, 2], "cpu", torch.float32, "fast", precision="fp8")
    seen, total = set(), 0

    def add(x):
        nonlocal total
        key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape))
        if key not in seen:
            seen.add(key)
            total += x.numel() * (1 if x.dtype == torch.float8_e4m3fn else 4 if x.dtype == torch.float32 else 2)

    for m in t.model.modules():
        if isinstance(m, fp8.Fp8Linear):
            add(m.weight8.w8)
            add(m.weight8.scale)
    float_params = sum(p.numel() for p in t.model.parameters())  # embedding, norms, head: bf16 on a GPU
    total += 2 * float_params
    shape = ModelShape.from_hf_config(json.loads(open(os.path.join(dense, "config.json")).read()))
    cfg = json.loads(open(os.path.join(dense, "config.json")).read())
    assert total == mm.family_of(shape).weight_bytes(shape, shape.n_layers, bool(cfg.get("tie_word_embeddings")), "fp8")


def test_the_fp8_bench_runs_every_section_on_cpu_and_writes_its_summary(tmp_path):
    """bench/fp8/run.py --smoke: the harness the GPU run uses, on tiny shapes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fp8_bench", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "bench", "fp8", "run.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--out", str(tmp_path), "--smoke", "--reps", "1"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert set(s["sections"]["gemms"]) >= {"qkv", "o", "gate_up", "down", "head"}
    g = s["sections"]["gemms"]["gate_up"]
    assert g["ms"]["bf16"] > 0 and g["ms"]["fp8"] > 0 and 0 < g["rel_err"]["fp8"] < 0.05
    f = s["sections"]["forward"]
    assert f["bf16"]["ms"] > 0 and f["fp8"]["ms"] > 0 and len(f["taps_error"]) == 5
    assert all(0 < t["rel_l2"] < 0.3 and t["max_abs"] > 0 for t in f["taps_error"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_on_the_gpu_the_scaled_matmul_and_the_compiled_producers_match_the_emulation():
    dev = torch.device("cuda")
    why = fp8.runs_here(dev)
    if why:
        pytest.skip(why)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 512, 1024, generator=gen)
    x[..., :4] *= 40
    w = torch.randn(768, 1024, generator=gen) * 0.02
    xb, wb = x.to(dev, torch.bfloat16), w.to(dev, torch.bfloat16)
    ln = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    W = fp8.Fp8Weight.of(wb)
    # the producer compiled with its quantization against the eager quantization of the bf16 op
    x8, sx = fp8.FP8.norm(xb, ln)
    e8, es = fp8.quantize_rows(fo._rms(xb, ln, fo.EPS))
    torch.testing.assert_close(sx, es, rtol=1e-2, atol=0)
    # The compiled producer quantizes the norm's fp32 result; the eager reference rounds it to
    # bf16 first, so where that rounding crosses an e4m3 boundary the codes are one step apart
    # (measured on an H200: 97.8 % of codes equal). Never more than one step.
    same = (x8.view(torch.uint8) == e8.view(torch.uint8)).float().mean().item()
    assert same > 0.95, same
    v = torch.maximum(x8.float().abs(), e8.float().abs()).clamp_min(2.0 ** -6)  # in e4m3 units
    step = torch.exp2(torch.floor(torch.log2(v)) - 3)  # one e4m3 step at that magnitude
    apart = (x8.float() * sx - e8.float() * es).abs()
    assert (apart <= step * sx + v * (sx - es).abs() + 1e-6).all()
    # torch._scaled_mm against the emulation on the same operands
    y = fp8.mm((x8, sx), W)
    ref = fp8.scaled_mm(x8.reshape(-1, 1024).cpu(), sx.reshape(-1, 1).cpu(), W.w8.cpu(), W.scale.cpu(), torch.float64)
    assert y.dtype == torch.bfloat16
    assert rel_err(y.reshape(-1, 768).cpu(), ref) < 2 ** -7


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
