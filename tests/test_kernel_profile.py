"""The step's profile table (trainer/gpu/kernel_profile.py, bench/drafter_step/roofline.py) and the step
changes it called for, on CPU: kernels land in the class their name and region say, the
table's idle time is the span minus the kernels' union, balanced head chunks change no number,
and the flex options switch reads its environment."""

import importlib
import json
import os
import sys

import pytest
import torch

from trainer.gpu import chunked_head as ch
from trainer.gpu import kernel_profile as kp
from trainer.loss import dflash_loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name,region,want", [
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", None, kp.MATMUL_DRAFTER),
    ("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT", kp.REGION_HEAD, kp.MATMUL_HEAD),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", kp.REGION_TARGET, kp.MATMUL_TARGET),
    ("triton_tem_fused_flex_attention_0", None, kp.FLEX_FWD),
    ("triton_tem_fused_flex_attention_backward_1", None, kp.FLEX_BWD),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", kp.REGION_TARGET, kp.ATTN_TARGET),
    # --attention-kernel flash: flash-attn-4's CuTe kernels as an H200's trace named them;
    # "cutlass" in the name made them drafter matmuls before
    ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__tensor0000o4", None,
     kp.FLEX_FWD),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object_at__tensor0000o1", None,
     kp.FLEX_BWD),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_preprocessFlashAttentionBackwardPreprocess_object_at", None,
     kp.FLEX_BWD),
    ("kernel_cutlass_kernel_flash_attncuteflash_bwd_postprocessFlashAttentionBackwardPostprocess_object", None,
     kp.FLEX_BWD),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", kp.REGION_TARGET,
     kp.ATTN_TARGET),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", kp.REGION_TARGET, kp.ATTN_TARGET),
    ("merge_16x16_to_64x64_inverse_kernel", kp.REGION_TARGET, kp.ATTN_TARGET),
    ("triton_poi_fused_chunk_0", kp.REGION_TARGET, kp.ELEMENTWISE_TARGET),
    ("triton_red_fused__to_copy_exp_logsumexp_sub_0", kp.REGION_HEAD, kp.HEAD_ELEMENTWISE),
    ("void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>", kp.REGION_HEAD, kp.HEAD_ELEMENTWISE),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdam>", kp.REGION_OPTIMIZER, kp.OPTIMIZER),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", None, kp.ELEMENTWISE),
    ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", kp.REGION_TARGET, kp.ELEMENTWISE_TARGET),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", None, kp.COPIES),
    ("Memset (Device)", None, kp.COPIES),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", kp.REGION_SELECTOR, kp.SELECTOR),
])
def test_each_kernel_lands_in_the_class_its_name_and_region_say(name, region, want):
    assert kp.kernel_class(name, region) == want


def _trace(kernels, notes):
    ev = [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for t, d, n in kernels]
    ev += [{"ph": "X", "cat": "gpu_user_annotation", "name": n, "ts": t, "dur": d} for t, d, n in notes]
    ev += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000}]  # host side: not counted
    return {"traceEvents": ev}


def test_the_summary_attributes_kernels_to_their_innermost_region_and_counts_the_gaps():
    kernels = [(0, 10, "nvjet_a"),  # drafter layers
               (10, 5, "triton_tem_fused_flex_attention_0"),
               (20, 30, "nvjet_a"),  # inside the head region: the head's GEMM
               (50, 10, "triton_red_fused_logsumexp_0"),
               (55, 10, "triton_poi_fused_mul_1"),  # overlaps the one before by 5 (another stream)
               (80, 20, "void multi_tensor_apply_kernel<FusedAdam>")]
    notes = [(18, 50, kp.REGION_HEAD), (75, 30, kp.REGION_OPTIMIZER)]
    s = kp.summarize_trace(_trace(kernels, notes), wall_us=120)
    c = s["classes"]
    assert c[kp.MATMUL_DRAFTER] == {"us": 10, "n": 1} and c[kp.MATMUL_HEAD] == {"us": 30, "n": 1}
    assert c[kp.FLEX_FWD]["us"] == 5 and c[kp.HEAD_ELEMENTWISE] == {"us": 20, "n": 2}
    assert c[kp.OPTIMIZER]["us"] == 20
    # busy = union of intervals: 0-15, 20-65, 80-100 = 15 + 45 + 20 = 80 of a 120 µs span
    assert s["busy_us"] == 80 and c[kp.IDLE]["us"] == 40
    assert s["top"][0]["name"] == "nvjet_a" and s["top"][0]["us"] == 40


def test_the_trainer_hook_profiles_only_the_step_it_is_asked_for(monkeypatch):
    monkeypatch.delenv("DFLASH_PROFILE_STEP", raising=False)
    assert type(kp.maybe_profile(3)).__name__ == "nullcontext"
    monkeypatch.setenv("DFLASH_PROFILE_STEP", "3")
    assert type(kp.maybe_profile(2)).__name__ == "nullcontext"
    assert type(kp.maybe_profile(3)).__name__ != "nullcontext"


def test_balanced_head_chunks_have_one_size_and_give_the_unchunked_numbers():
    assert ch.balanced_chunk_blocks(512, 4096, 31) == 128  # 4 × 128, not 3 × 132 + 116
    assert ch.balanced_chunk_blocks(1024, 4096, 15) == 256
    assert ch.balanced_chunk_blocks(3, 4096, 31) == 3
    g = torch.Generator().manual_seed(0)
    nb, K = 12, 7  # 35 rows = 5 blocks a chunk: 5 + 5 + 2 before, 4 + 4 + 4 balanced
    h = torch.randn(nb, K, 16, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(50, 16, dtype=torch.float64, generator=g)
    t = torch.randint(0, 50, (nb, K), generator=g)
    teacher = torch.randn(nb, K, 16, dtype=torch.float64, generator=g)
    fn = dflash_loss_fn(torch.rand(nb, K, dtype=torch.float64, generator=g), kl_weight=0.15, temperature=2.0,
                        cap_lambda=0.1, block_valid=torch.ones(nb, dtype=torch.bool), denom=torch.tensor(30.0),
                        n_valid_blocks=torch.tensor(nb))
    assert ch.balanced_chunk_blocks(nb, 35, K) == 4  # 4 + 4 + 4, not 5 + 5 + 2
    loss, ce, kl, _ = ch.chunked_head_loss(h, W, t, fn, teacher=teacher, temperature=2.0, chunk_rows=35)
    (grad,) = torch.autograd.grad(loss, h)
    ref = ch.naive_head_loss(h, W, t, fn, teacher=teacher, temperature=2.0)
    (ref_grad,) = torch.autograd.grad(ref, h)
    assert torch.allclose(loss, ref, rtol=1e-10)
    assert torch.allclose(grad, ref_grad, rtol=1e-10, atol=1e-12)


def _overlapping_blocks(g, nb: int, K: int, S: int, spacing: int):
    """Sorted anchors ``spacing`` apart on average (overlapping blocks when < K) and each slot's
    teacher row a+k−1, clamped to the sequence like fast_drafter's."""
    a = torch.sort(torch.randperm(S - 1, generator=g)[:nb]).values if spacing else torch.zeros(nb, dtype=torch.long)
    rows = (a[:, None] + torch.arange(1, K + 1)).clamp(max=S - 1) - 1
    return a, rows


@pytest.mark.parametrize("spacing", [2, 40])
def test_teacher_logits_once_per_distinct_position_give_the_gathered_numbers(monkeypatch, spacing):
    """Overlapping blocks (spacing 2 < K) take the span path in every chunk, sparse ones
    (spacing 40 > K) fall back to a row per slot; both equal gathering the teacher first."""
    g = torch.Generator().manual_seed(1)
    nb, K, H, S = 12, 7, 16, 24 if spacing == 2 else 480
    _, rows = _overlapping_blocks(g, nb, K, S, spacing)
    valid = torch.ones(nb, dtype=torch.bool)
    valid[-2:] = False  # padding blocks (weight 0): their rows fall outside the spans, clamped in
    rows[-2:] = 0
    h = torch.randn(nb, K, H, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(50, H, dtype=torch.float64, generator=g)
    t = torch.randint(0, 50, (nb, K), generator=g)
    table = torch.randn(S, H, dtype=torch.float64, generator=g)
    fn = dflash_loss_fn(torch.rand(nb, K, dtype=torch.float64, generator=g) * valid[:, None], kl_weight=0.15,
                        temperature=2.0, cap_lambda=0.1, block_valid=valid, denom=torch.tensor(30.0),
                        n_valid_blocks=valid.sum())
    spans = ch.span_plan(ch.chunk_spans(rows, valid, 21).tolist(), nb, 21, K)
    assert len(spans) == 4  # 12 blocks of 7 slots, 21 rows a chunk: 4 chunks of 3 blocks
    if spacing == 2:
        assert all(sp is not None and sp[1] - sp[0] < 21 for sp in spans[:3])
    else:
        assert spans[:3] == [None] * 3
    assert spans[3] is not None and spans[3][1] - spans[3][0] <= K  # one valid block left in it

    def run(**kw):
        loss, ce, kl, correct = ch.chunked_head_loss(h, W, t, fn, temperature=2.0, chunk_rows=21, **kw)
        (grad,) = torch.autograd.grad(loss, h)
        return loss.detach(), ce, kl, correct, grad

    gathered = run(teacher=table[rows])
    spanned = run(teacher=table, teacher_rows=rows, teacher_spans=spans)
    (l0, ce0, kl0, ok0, g0), (l1, ce1, kl1, ok1, g1) = gathered, spanned
    assert torch.allclose(l0, l1, rtol=1e-12) and torch.equal(ce0, ce1) and torch.equal(ok0, ok1)
    assert torch.allclose(kl0[valid], kl1[valid], rtol=1e-12, atol=1e-14)  # padding's teacher: any row
    assert torch.allclose(g0, g1, rtol=1e-12, atol=1e-14)
    ref = ch.naive_head_loss(h, W, t, fn, teacher=table[rows], temperature=2.0)
    assert torch.allclose(spanned[0], ref, rtol=1e-10)


def test_teacher_spans_are_the_least_and_one_past_the_largest_valid_row():
    rows = torch.tensor([[[3, 4], [4, 5], [0, 1]], [[9, 10], [2, 3], [7, 8]]])  # [2 groups, 3 blocks, K 2]
    valid = torch.tensor([[True, True, False], [True, True, False]])
    sp = ch.chunk_spans(rows, valid, 4)  # 2 blocks a chunk: chunks {0, 1}, {2}
    assert sp.tolist()[0][0] == [3, 6] and sp.tolist()[1][0] == [2, 11]
    assert sp[0, 1, 0] >= sp[0, 1, 1]  # no valid block: lo ≥ hi
    assert ch.span_plan(sp.tolist()[0], 3, 4, 2) == [(3, 6), None]  # 3 positions for 4 rows
    assert ch.span_plan(sp.tolist()[1], 3, 4, 2) == [None, None]  # 9 positions span 4 rows: the rows
    with pytest.raises(ValueError, match="teacher_spans has 1 chunks"):
        ch.chunked_head_loss(torch.zeros(3, 2, 4), torch.zeros(5, 4), torch.zeros(3, 2, dtype=torch.long),
                             lambda ce, kl, sl: ce.sum(), teacher=torch.zeros(9, 4), teacher_rows=rows[0],
                             teacher_spans=[None], chunk_rows=4)


def test_the_roofline_table_names_the_three_largest_losses():
    sys.path.insert(0, ROOT)
    rl = importlib.import_module("bench.drafter_step.roofline")
    summary = {"span_us": 1_000_000, "classes": {
        kp.MATMUL_DRAFTER: {"us": 500_000, "n": 10}, kp.FLEX_FWD: {"us": 200_000, "n": 5},
        kp.HEAD_ELEMENTWISE: {"us": 100_000, "n": 4}, kp.OPTIMIZER: {"us": 20_000, "n": 1},
        kp.IDLE: {"us": 180_000, "n": 0}}}
    work = {kp.MATMUL_DRAFTER: {"flop": 350e12}, kp.FLEX_FWD: {"flop": 70e12},
            kp.HEAD_ELEMENTWISE: {"bytes": 212e9}, kp.OPTIMIZER: {"bytes": 42.4e9}}
    t = rl.table(summary, work, {"matmul_flop_s": 700e12, "copy_bytes_s": 4.24e12})
    rows = {r["class"]: r for r in t["rows"]}
    assert rows[kp.MATMUL_DRAFTER]["roofline_share"] == pytest.approx(1.0)
    assert rows[kp.FLEX_FWD]["roofline_share"] == pytest.approx(0.5) and rows[kp.FLEX_FWD]["lost_ms"] == pytest.approx(100)
    assert rows[kp.HEAD_ELEMENTWISE]["roofline_share"] == pytest.approx(0.5)
    assert rows[kp.IDLE]["roofline_share"] == 0 and rows[kp.IDLE]["lost_ms"] == pytest.approx(180)
    assert t["largest_losses"] == [kp.IDLE, kp.FLEX_FWD, kp.HEAD_ELEMENTWISE]
    assert "| flex attention forward | 200.0 |" in rl.markdown(t)


def _h100_call(tmp_path, with_ceilings: bool):
    """A results.json as an H100 call of ``--phases step`` wrote it before the fix: its table
    made against the H200's default ceilings, no ceilings phase of its own."""
    sys.path.insert(0, ROOT)
    rl = importlib.import_module("bench.drafter_step.roofline")
    summary = {"span_us": 1_000_000, "classes": {kp.MATMUL_DRAFTER: {"us": 600_000, "n": 10},
                                                 kp.ELEMENTWISE: {"us": 400_000, "n": 40}}}
    work = {kp.MATMUL_DRAFTER: {"flop": 390.9e12}, kp.ELEMENTWISE: {"bytes": 0.4725e12}}
    rec = {"median_s": 1.0, "drafted_pos_s": 1000.0, "mfu": 0.4,
           "table": rl.table(summary, work, {"matmul_flop_s": 787e12, "copy_bytes_s": 4.24e12})}
    res = {"gpu": "NVIDIA H100 80GB HBM3", "phases": {"step": {"dflash": rec}}}
    if with_ceilings:
        res["phases"]["ceilings"] = {"matmul_flop_s": 390.9e12 / 0.6, "copy_bytes_s": 0.4725e12 / 0.2}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    return rl, path


def test_an_h100_calls_table_reads_against_the_h100s_ceilings_not_the_h200s(tmp_path, capsys):
    """An H100's step tabled against an H200's 4.24 TB/s read the drafter's elementwise class
    145 ms over its floor where the H100's 2.95 TB/s makes it 96. ``roofline.py table`` reads
    a run without its own ceilings against its GPU's row, and a run of the step measures them."""
    rl, path = _h100_call(tmp_path, with_ceilings=False)
    h100 = rl.MEASURED_CEILINGS["NVIDIA H100 80GB HBM3"]
    with open(os.path.join(ROOT, "tests", "fixtures", "h100_ceilings.json")) as fh:
        recorded = json.load(fh)["calls"]
    assert {r["gpu"] for r in recorded} == {"NVIDIA H100 80GB HBM3"}
    for k in ("matmul_flop_s", "copy_bytes_s"):  # the row is those runs' measurement, not a guess
        assert h100[k] == pytest.approx(sum(r["ceilings"][k] for r in recorded) / 2, rel=1e-3)
    t = rl.retable(json.loads(path.read_text())["phases"]["step"]["dflash"]["table"], h100)
    rows = {r["class"]: r for r in t["rows"]}
    assert rows[kp.ELEMENTWISE]["roofline_share"] == pytest.approx(0.4725e12 / 2.953e12 / 0.4)
    assert rows[kp.ELEMENTWISE]["lost_ms"] == pytest.approx(400 - 0.4725e12 / 2.953e12 * 1e3)
    assert t["floor_s"] == pytest.approx(sum(r["ms"] - r["lost_ms"] for r in t["rows"]) / 1e3)
    sys.argv = ["roofline.py", "table", str(path)]
    assert rl.main() == 0
    out = capsys.readouterr().out
    assert "2.95 TB/s" in out and h100["from"] in out  # the table says where its ceilings come from
    row = next(x for x in out.splitlines() if x.startswith(f"| {kp.ELEMENTWISE} | 400.0 |"))
    assert row.split(" | ")[-2:] == ["40 %", "240.0 |"]  # a 160 ms floor of 400 (the H200's: 111 ms, 28 %)


def test_a_calls_own_ceilings_win_and_an_unknown_gpu_is_refused_with_the_fix(tmp_path):
    rl, path = _h100_call(tmp_path, with_ceilings=True)
    res = json.loads(path.read_text())
    assert rl.ceilings_of(res) == res["phases"]["ceilings"]
    t = rl.retable(res["phases"]["step"]["dflash"]["table"], rl.ceilings_of(res))
    assert [r["roofline_share"] for r in t["rows"]] == [pytest.approx(1.0), pytest.approx(0.5)]
    with pytest.raises(SystemExit, match="no ceilings on record for 'NVIDIA B200'.*--phases ceilings"):
        rl.ceilings_of({"gpu": "NVIDIA B200", "phases": {}})


def test_what_if_gives_the_step_with_classes_at_other_rates_and_refuses_what_it_cannot_use(tmp_path, capsys):
    """``roofline.py table --what-if CLASS=RATE``: the step's time had a class run at a rate
    shown elsewhere (docs/benchmarks.md: what 70 % MFU would take)."""
    rl, path = _h100_call(tmp_path, with_ceilings=False)
    t = json.loads(path.read_text())["phases"]["step"]["dflash"]["table"]
    w = rl.what_if(t, {kp.MATMUL_DRAFTER: 390.9e12 / 0.5, kp.ELEMENTWISE: 0.4725e12 / 0.8})
    assert w["saved_ms"] == pytest.approx(100 + 0) and w["step_s"] == pytest.approx(0.9)  # a slower rate: no change
    assert rl.what_if(t, {kp.ELEMENTWISE: 0})["step_s"] == pytest.approx(0.6)
    sys.argv = ["roofline.py", "table", str(path), "--what-if", f"{kp.MATMUL_DRAFTER}=781.8e12"]
    assert rl.main() == 0
    assert "What if: 900 ms a step (100 ms less), MFU 44.4 %." in capsys.readouterr().out
    for bad, msg in [(["flex attention forward=1e12"], "not a class of this table"),
                     (["idle=x"], "expected CLASS=RATE"), (["=5"], "expected CLASS=RATE"),
                     ([f"{kp.ELEMENTWISE}=-1"], "expected CLASS=RATE")]:
        with pytest.raises(SystemExit, match=msg):
            rl.what_if(t, rl.parse_what_if(bad))
    t["rows"].append({"class": kp.IDLE, "ms": 10.0, "flop": None, "bytes": None})
    with pytest.raises(SystemExit, match="no FLOPs or bytes"):
        rl.what_if(t, {kp.IDLE: 1e12})


def test_the_colocated_table_finds_its_gpu_in_the_calls_gpu_csv(tmp_path):
    sys.path.insert(0, ROOT)
    co = importlib.import_module("bench.colocated.run")
    (tmp_path / "colocated").mkdir()
    with pytest.raises(SystemExit, match="no gpu.csv"):
        co.gpu_of(str(tmp_path / "colocated"))
    (tmp_path / "gpu.csv").write_text("index, name, memory.total [MiB]\n0, NVIDIA H100 80GB HBM3, 81559 MiB\n")
    assert co.gpu_of(str(tmp_path / "colocated")) == "NVIDIA H100 80GB HBM3"


def test_the_colocated_table_of_a_recorded_call_answers_what_if(capsys):
    """``colocated/run.py table DIR --what-if`` on a recorded H200 profile (tests/fixtures/colocated_h200:
    Qwen3-8B at 65,536 tokens, flash-attn-4): the GPU from its gpu.csv, and the tokens/s of the
    step without its idle time."""
    sys.path.insert(0, ROOT)
    co = importlib.import_module("bench.colocated.run")
    d = os.path.join(ROOT, "tests", "fixtures", "colocated_h200")
    sys.argv = ["colocated.py", "table", d, "--what-if", f"{kp.IDLE}=0"]
    assert co.main() == 0
    out = capsys.readouterr().out
    assert "10,246 tokens/s" in out and f"| {kp.IDLE} | 161.7 | 0.0 |" in out
    assert "What if: 6235 ms a step (162 ms less), 10,511 tokens/s." in out  # 65,536 / 6.235


def test_the_colocated_step_counts_the_target_forward_beside_the_drafter_step():
    sys.path.insert(0, ROOT)
    co = importlib.import_module("bench.colocated.run")
    from trainer.plan import flops as fl

    w = co.colocated_work({"tokens": 65536})
    drafter_only = importlib.import_module("bench.drafter_step.roofline").work_of(fl.QWEN3_8B, 5, 8 * 1024, 32, 65536,
                                                               8 * 1024 * 32 * 8192 // 2, 1_048_626_432, True)
    target = fl.target_forward_flops(fl.QWEN3_8B, [8192] * 8)
    assert w[kp.MATMUL_TARGET]["flop"] + w[kp.ATTN_TARGET]["flop"] == target
    assert w["_total_flop"] == drafter_only["_total_flop"] + target
    assert w[kp.MATMUL_DRAFTER] == drafter_only[kp.MATMUL_DRAFTER]


@pytest.mark.parametrize("S,B,n,drop", [(256, 32, 8, 0), (256, 32, 8, 3), (384, 16, 16, 5), (256, 128, 2, 0),
                                        (256, 128, 2, 1), (128, 32, 4, 4)])
def test_the_direct_block_mask_has_create_block_masks_tiles(S, B, n, drop):
    """The chunk's BlockMask from the anchors (no compile) against create_block_mask's, tile by
    tile: which tiles are full, which partial (evaluated with the mask_mod), none missing."""
    from torch.nn.attention.flex_attention import create_block_mask

    from trainer.layers.flex_mask import dflash_mask_mod, direct_block_mask

    g = torch.Generator().manual_seed(S + B + n + drop)
    a = torch.randperm(S - 1, generator=g)[:n].sort().values
    keep = torch.ones(n, dtype=torch.bool)
    if drop:
        keep[-drop:] = False
        a[-drop:] = 0  # padding blocks, as the chunked step pads them
    mod = dflash_mask_mod(a[None], S, B, keep[None])
    want = create_block_mask(mod, 1, None, n * B, S + n * B, device="cpu", _compile=False)
    got = direct_block_mask(a, keep, S, B, mod)
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.to_dense(), want.to_dense())
    for nm, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        for t in range(want.kv_num_blocks.shape[-1]):
            k = int(getattr(want, nm)[0, 0, t])
            assert sorted(getattr(got, idx)[0, 0, t, :k].tolist()) == sorted(getattr(want, idx)[0, 0, t, :k].tolist())


def test_the_27b_colocated_step_counts_the_hybrid_target_and_its_drafter():
    """The Qwen3.6-27B shape's table (bench/colocated/run.py --scale gpu27): the target's FLOPs
    are trainer/gpu/fast_hybrid.py's forward count, split into matmuls and attention/recurrence;
    the drafter's head runs over the 248,320-token vocabulary."""
    sys.path.insert(0, ROOT)
    co = importlib.import_module("bench.colocated.run")
    from trainer import family
    from trainer.gpu import fast_hybrid as fh

    w = co.colocated_work_27b({"tokens": 40960})
    target = fh.forward_flops(family.QWEN3_6_27B_TEXT, 8192, 5)
    assert w[kp.MATMUL_TARGET]["flop"] + w[kp.ATTN_TARGET]["flop"] == pytest.approx(target)
    assert 0 < w[kp.ATTN_TARGET]["flop"] < 0.1 * target
    assert w[kp.HEAD_ELEMENTWISE]["bytes"] == 5 * 1024 * 31 * 248320 * 2 * 5


def test_the_colocated_head_counts_the_teacher_rows_the_launch_computed():
    """The head class counts one teacher row per distinct target position of a head chunk,
    fewer than one per drafted slot where blocks overlap; the MFU total counts every slot."""
    sys.path.insert(0, ROOT)
    co = importlib.import_module("bench.colocated.run")
    from trainer.plan import flops as fl

    step = {"tokens": 2 * 8192}
    w = co.colocated_work(step)
    hp = 2 * 1024 * 31
    rows = co.teacher_rows(2, 8192, 1024, 32)
    assert 0.2 * hp < rows < 0.35 * hp  # blocks of 32 at 1,024 anchors cover each position ~4 times
    per_slot = fl.drafter_step_flops(fl.QWEN3_8B, n_layers=5, block_size=32, n_blocks=2 * 1024, ctx_tokens=2 * 8192,
                                     visible_ctx_pairs=2 * 1024 * 32 * 8192 // 2, teacher_positions=hp)
    assert per_slot["head"] - w[kp.MATMUL_HEAD]["flop"] == 2 * fl.QWEN3_8B.hidden * fl.QWEN3_8B.vocab * (hp - rows)


def test_roofline_set_takes_flag_values_as_json_or_text_and_refuses_a_pair_without_a_value():
    """``roofline.py run --set``: the step runs' flag values over the operators' (how dpace's
    extra forward was measured); numbers stay numbers, and a malformed pair stops the run
    before any device work with what was expected."""
    sys.path.insert(0, ROOT)
    rl = importlib.import_module("bench.drafter_step.roofline")
    assert rl.config_set(["position_weights=dpace", "dpace_alpha=0.5", "use_soft_labels=false"]) == {
        "position_weights": "dpace", "dpace_alpha": 0.5, "use_soft_labels": False}
    for bad in ("position_weights", "=dpace"):
        with pytest.raises(SystemExit, match="expected KEY=VALUE"):
            rl.config_set([bad])


def test_idle_sources_charges_each_gpu_gap_to_a_late_launch_a_sync_or_the_queue():
    """bench/drafter_step/idle_sources.py on a hand-made trace: a gap whose next kernel was launched
    after the GPU went idle goes to the op and trainer/ frames that launched it, with what the
    host ran meanwhile; a gap the host spent in a synchronize goes to what asked for it; a gap
    with the kernel already queued is the queue's; gaps under the threshold are not counted."""
    sys.path.insert(0, ROOT)
    isrc = importlib.import_module("bench.drafter_step.idle_sources")

    def rows_of(result):
        return {(g["kind"], g["where"]): g for g in result["rows"]}
    host = {"pid": 1, "tid": 1}

    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **({"args": args} if args else {}),
                **(host if cat in ("cpu_op", "python_function", "cuda_runtime") else {"pid": 0, "tid": 7})}

    trace = {"traceEvents": [
        x("python_function", "/r/trainer/gpu/fast_drafter.py(300): step_backward", 0, 200),
        x("python_function", "/r/trainer/model.py(280): block_attention", 12, 20),
        x("cpu_op", "aten::cat", 14, 3),
        x("cpu_op", "aten::mul", 24, 3),
        x("cuda_runtime", "cudaLaunchKernel", 1, 1, correlation=1),
        x("cuda_runtime", "cudaLaunchKernel", 25, 1, correlation=2),
        x("cuda_runtime", "cudaLaunchKernel", 26, 1, correlation=3),
        x("cuda_runtime", "cudaLaunchKernel", 28, 1, correlation=4),
        x("cpu_op", "aten::item", 50, 50),
        x("cuda_runtime", "cudaStreamSynchronize", 51, 48),
        x("cuda_runtime", "cudaLaunchKernel", 101, 1, correlation=5),
        x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 110, 20),
        x("cpu_op", "aten::mm", 112, 5),
        x("cuda_runtime", "cudaLaunchKernel", 114, 1, correlation=6),
        x("kernel", "k1", 2, 8, correlation=1),      # [2, 10]
        x("kernel", "k2", 30, 10, correlation=2),    # gap 20: launched at 25, after the GPU went idle
        x("kernel", "k3", 43, 2, correlation=3),     # gap 3: under the threshold
        x("kernel", "k4", 55, 5, correlation=4),     # gap 10, launched at 28: queued
        x("kernel", "k5", 102, 4, correlation=5),    # gap 42, the host in a synchronize
        x("kernel", "k6", 116, 2, correlation=6),    # gap 10, launched late in a backward node
    ]}
    r = isrc.analyze(trace, min_gap_us=5)
    assert r["gaps"] == 4 and r["gap_us"] == 82 and r["span_us"] == 116
    assert rows_of(r)[("late launch", "aten::mm in MmBackward0 @ gpu/fast_drafter.py(300): step_backward")]["us"] == 10
    rows = rows_of(r)
    late = rows[("late launch", "aten::mul @ model.py(280): block_attention < gpu/fast_drafter.py(300): step_backward")]
    assert late["us"] == 20 and late["gaps"] == 1 and late["host"] == ["aten::cat", "aten::mul"]
    assert rows[("sync", "aten::item @ gpu/fast_drafter.py(300): step_backward")]["us"] == 42
    assert rows[("queued", "k4")]["us"] == 10
    assert [g["kind"] for g in r["rows"]] == ["sync", "late launch", "queued", "late launch"]
    assert "| sync | aten::item @ gpu/fast_drafter.py(300): step_backward | 0.04 | 1 |" in isrc.table(r, 10)


def test_op_sources_ranks_the_operators_between_the_matmuls_by_where_they_were_asked_for():
    """bench/drafter_step/op_sources.py's table: rows of one operator at one place merged, matmuls and
    attention left to the roofline table, the innermost trainer/ frames named innermost first, by their path under trainer/."""
    sys.path.insert(0, ROOT)
    os_ = importlib.import_module("bench.drafter_step.op_sources")
    stack = ["/x/trainer/model.py(324): block_forward", "/usr/lib/torch/nn.py(1): f",
             "/x/trainer/gpu/fast_drafter.py(200): chunk_hidden", "/x/trainer/step.py(155): __call__",
             "/x/trainer/train.py(9): run"]
    assert os_.trainer_frames(stack) == "model.py(324): block_forward < gpu/fast_drafter.py(200): chunk_hidden < step.py(155): __call__"
    assert os_.trainer_frames(["/usr/lib/torch/autograd.py(3): backward"]) == "(outside trainer/)"
    rows = [{"name": "aten::copy_", "device_us": 10.0, "count": 1, "where": "ToCopyBackward0 in a"},
            {"name": "aten::copy_", "device_us": 15.0, "count": 1, "where": "ToCopyBackward0 in a"},
            {"name": "aten::add_", "device_us": 20.0, "count": 1, "where": "b"},
            {"name": "aten::mm", "device_us": 900.0, "count": 1, "where": "c"},
            {"name": "aten::fill_", "device_us": 0.0, "count": 1, "where": "d"}]
    ranked = os_.rank(rows, top=10)
    assert [(r["name"], r["device_us"], r["count"]) for r in ranked] == [("aten::copy_", 25.0, 2), ("aten::add_", 20.0, 1)]
    assert os_.rank(rows, top=1)[0]["where"] == "ToCopyBackward0 in a"
