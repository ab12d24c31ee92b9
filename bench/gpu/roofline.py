"""Issue 29: where each millisecond of a drafter step goes, against the H200's roofline, and
the changes that table calls for, each measured before and after in one process.

    PYTHONUNBUFFERED=1 python3 bench/gpu/roofline.py run --out DIR [--phases ceilings,flex,step]
    python3 bench/gpu/roofline.py run --out /tmp/o --smoke         # the same code on CPU, tiny widths
    python3 bench/gpu/roofline.py table DIR/results.json            # the markdown tables, anywhere
    python3 bench/gpu/roofline.py colocated DIR/kernel_profile_step3.json --events DIR/events.jsonl \
        --ceilings DIR/results.json                                 # a trainer step's table

Phases (one H200; random bf16 weights made on the GPU, random tokens, no download):

* ``ceilings``: a bf16 8192³ matmul on random data and a 4 GiB device copy (bytes read +
  written), median of 10 after 3 warm-ups: the roofline's two ceilings. Runs with ``step``
  too (the step's table is read against this GPU's ceilings); ``table`` re-reads an old call
  that measured none against its GPU's row of ``MEASURED_CEILINGS``.
* ``flex``: flex attention forward and forward + backward at the chunked step's shape (512
  anchors × block 32 = 16,384 queries, 32/8 heads × 128, context 8,192 + the blocks) under the
  DFlash block mask, for several kernel options (block sizes, stages, warps, flags); the best
  forward, backward and flag choices are combined and timed again; the combination is what
  the step's "after" runs.
* ``flexwindow``: the same under a sliding-window layer's mask (``--flex-window``, 2,048: the
  Qwen3.6-27B drafter's sliding layers), the tiles from the materialised mask.
* ``head``: the head chunk's two elementwise passes, compiled against trainer/head_kernels.py's
  Triton kernels at several block sizes (:func:`phase_head`).
* ``headgemm``: the head chunk's three GEMMs, and the two logits GEMMs as one (:func:`phase_headgemm`).
* ``silu``: the MLP's SiLU(gate)·up forward and backward, compiled against
  trainer/silu_mul_kernel.py's kernels at several tiles (:func:`phase_silu`).
* ``accumulate``: the chunks' fp32 += bf16 weight-gradient adds, PyTorch's against
  trainer/grad_accumulate.py's kernel at several block sizes (:func:`phase_accumulate`).
* ``step``: trainer/step.py's ChunkedStep at the operators' config (Qwen3-8B widths, 5 layers,
  block 32, 1,024 anchors, 6 × 8,192 tokens, soft labels KL 0.15 at T 2, CAP 0.1, γ 10, clip,
  fused AdamW) for DFlash and DFlash2, each "before" and "after" in the same process (``--before
  main``, the default: the head's passes compiled, then trainer/head_kernels.py's Triton
  kernels; ``--before s1``, session 1's pair: torch's flex defaults, head chunks of 4,096 // 31
  blocks, DFlash2's block convolution eager, block masks by a compiled create_block_mask,
  against the combined flex options, balanced head chunks, the convolution compiled, block
  masks from the anchors directly; ``--before selector``: DFlash2's selector checkpointed as in
  trainer/loss.py, then trainer/selector_fused.py's; ``--before teacher``: the teacher's logits
  at every drafted slot, then once per distinct position of a head chunk; ``--before castonce``:
  the GEMM weights cast in every chunk, then once per step; ``--before addkernel``: the
  gradient adds by PyTorch, then by trainer/grad_accumulate.py's kernel; ``--before
  silukernel``: the MLP's SiLU·up compiled, then by trainer/silu_mul_kernel.py's kernels;
  ``--before wgrad``: the weight gradients added into ``.grad`` by a hook, then by the GEMM;
  ``--before qtile``: the block masks' 128-row query tiles, then ``--q-tile`` rows;
  ``--before cumprod``: CAP's run products by cumprod, then by a cumulative sum; ``--runs`` picks
  arch:variant runs): the
  first step's wall time and compile seconds, the median of 3 timed steps (CUDA events), one profiled step
  (trainer/kernel_profile.py) as a table of kernel classes with FLOPs/bytes and the share of
  its roofline, allocated/reserved peaks beside trainer/memory.py's prediction.

Everything lands in DIR/results.json after every phase (a cut-off call keeps what finished).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench", "gpu")]

from trainer import flops as fl  # noqa: E402
from trainer import kernel_profile as kp  # noqa: E402

GIB = 1024 ** 3
RESULTS: dict = {"phases": {}}
OUT = "."

FLEX_VARIANTS = {
    "default": {},
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "tma": {"USE_TMA": True},
    "fwd_128x128_s2_w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},
    "fwd_64x128_s3_w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4},
    "bwd_64_128_s2_w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                         "bwd_num_stages": 2, "bwd_num_warps": 8},
    "bwd_64_64_s3_w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                        "bwd_num_stages": 3, "bwd_num_warps": 4},
    "bwd_32_128_s3_w4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                         "bwd_num_stages": 3, "bwd_num_warps": 4},
    # session 3: TMA for the forward alone (it helped the forward, hurt the backward), Hopper
    # warp specialisation of the forward, and the backward's remaining stage/warp choices
    "fwd_tma": {"fwd_USE_TMA": True},
    "fwd_ws2": {"fwd_num_consumer_groups": 2, "fwd_num_buffers_warp_spec": 3},
    "bwd_64_128_s4_w8": {"bwd_num_stages": 4},
    "bwd_64_128_s3_w4": {"bwd_num_warps": 4},
    "bwd_128_128_s2_w8": {"bwd_BLOCK_M1": 128, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 128,
                          "bwd_num_stages": 2, "bwd_num_warps": 8},
}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def save():
    with open(os.path.join(OUT, "results.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


def _timed(fn, warmup: int = 2, iters: int = 5, cuda: bool = True):
    from run_all import timed  # bench/gpu is on the path (this script's folder); it imports torch

    return timed(fn, warmup, iters, cuda)


# ---------------------------------------------------------------------------------------------
def phase_ceilings(smoke: bool) -> dict:
    import torch

    dev, n = ("cpu", 256) if smoke else ("cuda", 8192)
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t, _ = _timed(lambda: a @ b, 3, 10, not smoke)
    x = torch.randn((64 if smoke else 1024) * 2 ** 20, device=dev, dtype=torch.float32)  # 4 GiB on GPU
    y = torch.empty_like(x)
    tc, _ = _timed(lambda: y.copy_(x), 3, 10, not smoke)
    return {"matmul_flop_s": 2 * n ** 3 / t, "copy_bytes_s": 2 * x.numel() * 4 / tc, "matmul_n": n}


def _flex_inputs(shape, n_anchors: int, B: int, S: int, dev, dtype, window: int | None = None,
                 kv_block: int = 128):
    import torch

    from trainer import fast_drafter as fd
    from trainer import flex_mask

    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randperm(S - 1, device=dev, generator=g)[:n_anchors].sort().values
    kp_ = torch.ones(n_anchors, dtype=torch.bool, device=dev)
    if window is None and kv_block == 128:
        bm = fd._chunk_block_mask(a, kp_, S, B)
    else:  # a sliding-window layer's mask or finer kv tiles: from the materialised mask (no mask compile)
        from torch.nn.attention.flex_attention import create_block_mask

        mod = flex_mask.dflash_mask_mod(a[None], S, B, kp_[None], window)
        bm = create_block_mask(mod, 1, None, n_anchors * B, S + n_anchors * B, device=dev, _compile=False,
                               BLOCK_SIZE=(128, kv_block))
        pairs = flex_mask.visible_pairs(a[None], S, B, kp_[None], window)
    Q = n_anchors * B
    q = torch.randn(1, shape.n_heads, Q, shape.head_dim, device=dev, dtype=dtype, generator=g, requires_grad=True)
    k = torch.randn(1, shape.n_kv_heads, S + Q, shape.head_dim, device=dev, dtype=dtype, generator=g, requires_grad=True)
    v = torch.randn(1, shape.n_kv_heads, S + Q, shape.head_dim, device=dev, dtype=dtype, generator=g, requires_grad=True)
    if window is None:
        pairs = int(a.sum()) * B + n_anchors * B * B
    return q, k, v, bm, pairs


def flex_timing(flex, q, k, v, bm, go, fwd_flop: float, opts: dict | None, smoke: bool) -> dict:
    """Forward and forward + backward of one flex call under ``opts`` (kernel options): the
    first call (compile included), then medians (CUDA events); on CPU the forward only."""
    import torch

    kw = {"kernel_options": opts or None} if not smoke else {}

    def fwd():
        with torch.no_grad():
            return flex(q, k, v, block_mask=bm, enable_gqa=True, **kw)

    def fwdbwd():
        o = flex(q, k, v, block_mask=bm, enable_gqa=True, **kw)
        if not smoke:
            o.backward(go)
            q.grad = k.grad = v.grad = None
    t0 = time.perf_counter()
    fwd()
    if not smoke:
        fwdbwd()
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    tf, _ = _timed(fwd, 2, 7, not smoke)
    tb, _ = _timed(fwdbwd, 1, 5, not smoke) if not smoke else (tf, [])
    return {"fwd_s": tf, "fwdbwd_s": tb, "bwd_s": tb - tf, "compile_and_first_s": first,
            "fwd_tflop_s": fwd_flop / tf / 1e12, "bwd_tflop_s": 2.5 * fwd_flop / max(1e-9, tb - tf) / 1e12}


def phase_flex(smoke: bool, only: list[str] | None = None, window: int | None = None) -> dict:
    import torch

    from trainer.flex_mask import flex_attention_fn

    shape, n_anchors, B, S = (SMOKE_SHAPE, 16, 8, 128) if smoke else (fl.QWEN3_8B, 512, 32, 8192)
    dev = torch.device("cpu" if smoke else "cuda")
    if smoke and window:
        window = min(window, S // 2)
    q, k, v, bm, pairs = _flex_inputs(shape, n_anchors, B, S, dev, torch.float32 if smoke else torch.bfloat16, window)
    if smoke:  # flex attention on CPU runs forward only, on inputs that need no gradient
        q, k, v = q.detach(), k.detach(), v.detach()
    flex = flex_attention_fn(dev.type)
    fwd_flop = 4 * shape.q_dim * pairs
    go = torch.randn_like(q)
    out = {"pairs": pairs, "fwd_flop": fwd_flop, "window": window, "variants": {}}

    def measure(opts):
        return flex_timing(flex, q, k, v, bm, go, fwd_flop, opts, smoke)

    if not only or "kv_tiles_64" in only:  # the ragged edges (staircase, window, own block) in finer kv
        # tiles: less of each partial tile is masked-out work
        q64, k64, v64, bm64, _ = _flex_inputs(shape, n_anchors, B, S, dev, q.dtype, window, kv_block=64)
        if smoke:
            q64, k64, v64 = q64.detach(), k64.detach(), v64.detach()
        saved = q, k, v, bm
        q, k, v, bm = q64, k64, v64, bm64
        try:
            opts = {} if smoke else {"bwd_BLOCK_N1": 64}
            out["variants"]["kv_tiles_64"] = {"options": opts, "mask_block": [128, 64], **measure(opts)}
        except Exception as exc:  # noqa: BLE001
            out["variants"]["kv_tiles_64"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        log("flex", "kv_tiles_64", json.dumps(out["variants"]["kv_tiles_64"]))
        q, k, v, bm = saved
    names = list(FLEX_VARIANTS)[:2] if smoke else list(FLEX_VARIANTS)
    if only:  # "default" always: the variants are judged against it in the same process
        names = ["default"] + [n for n in only if n in FLEX_VARIANTS and n != "default"]
    for name in names:
        try:
            out["variants"][name] = {"options": FLEX_VARIANTS[name], **measure(FLEX_VARIANTS[name])}
        except Exception as exc:  # noqa: BLE001 — a config the kernel refuses is a result too
            out["variants"][name] = {"options": FLEX_VARIANTS[name], "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        log("flex", name, json.dumps(out["variants"][name]))
        RESULTS["phases"]["flex"] = out
        save()
    ok = {n: r for n, r in out["variants"].items() if "error" not in r}
    base = ok.get("default")
    combined: dict = {}
    if base:
        fw = min((n for n in ok if n.startswith("fwd_") or n == "default"), key=lambda n: ok[n]["fwd_s"])
        bw = min((n for n in ok if n.startswith("bwd_") or n == "default"), key=lambda n: ok[n]["bwd_s"])
        combined = {**FLEX_VARIANTS[fw], **FLEX_VARIANTS[bw]}
        for flag in ("rows_safe", "tma"):
            if flag in ok and ok[flag]["fwdbwd_s"] < 0.98 * base["fwdbwd_s"]:
                combined.update(FLEX_VARIANTS[flag])
        try:
            out["variants"]["combined"] = {"options": combined, **measure(combined)}
            if out["variants"]["combined"]["fwdbwd_s"] > base["fwdbwd_s"]:
                combined = {}  # the parts did not add up: keep torch's defaults
        except Exception as exc:  # noqa: BLE001
            out["variants"]["combined"] = {"options": combined, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            combined = {}
    out["chosen"] = combined
    return out


HEAD_STATS_CONFIGS = [(512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8)]
HEAD_GRAD_CONFIGS = [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8)]


def phase_head(smoke: bool) -> dict:
    """The head chunk's two elementwise passes at the operators' chunk (128 blocks × 31 slots
    = 3,968 rows × 151,936, bf16 logits and teacher logits, T 2): the compiled reference
    (chunked_head's ``_stats_soft`` / ``_grad_soft`` under torch.compile, the "before") against
    trainer/head_kernels.py's Triton kernels at several (BLOCK, warps); every variant's numbers
    against the reference's (fresh random inputs), the median of 10 (CUDA events) after 3
    warm-ups, bytes = each input read once + the gradient written once; ``torch.topk(16)``
    (DFlash2's candidates) against trainer/head_kernels.topk (the same values; rows whose
    index set differs only on ties counted)."""
    import torch

    from trainer import chunked_head as ch

    dev = torch.device("cpu" if smoke else "cuda")
    R, V, T = (62, 2048, 2.0) if smoke else (128 * 31, 151936, 2.0)
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.float32 if smoke else torch.bfloat16
    z = (torch.randn(R, V, device=dev, generator=g) * 3).to(dt)
    zt = (torch.randn(R, V, device=dev, generator=g) * 3).to(dt)
    t = torch.randint(0, V, (R,), device=dev, generator=g)
    g_ce, g_kl = torch.rand(R, device=dev, generator=g), torch.rand(R, device=dev, generator=g)
    comp = (lambda f: torch.compile(f, dynamic=False)) if not smoke else (lambda f: f)  # noqa: E731
    stats_ref, grad_ref = comp(ch._stats_soft), comp(ch._grad_soft)
    ref = stats_ref(z, zt, t, T)
    gref = grad_ref(z, zt, ref[0], ref[3], ref[4], t, g_ce, g_kl, T, dt)
    cuda = not smoke
    stat_bytes, grad_bytes = 2 * R * V * z.element_size(), 3 * R * V * z.element_size()
    out = {"rows": R, "vocab": V, "stats": {}, "grad": {}}
    tr, _ = _timed(lambda: stats_ref(z, zt, t, T), 3, 10, cuda)
    out["stats"]["compiled"] = {"s": tr, "tb_s": stat_bytes / tr / 1e12}
    tg, _ = _timed(lambda: grad_ref(z, zt, ref[0], ref[3], ref[4], t, g_ce, g_kl, T, dt), 3, 10, cuda)
    out["grad"]["compiled"] = {"s": tg, "tb_s": grad_bytes / tg / 1e12}
    if not smoke:
        tk, _ = _timed(lambda: z.topk(16, dim=-1), 2, 5, cuda)
        out["topk16_s"] = tk
    try:
        from trainer import head_kernels as hk
    except Exception as exc:  # noqa: BLE001 — no triton: the reference alone
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30)) if torch.isfinite(a).all() else float("inf")
    base_s, base_g = hk.STATS_CONFIG, hk.GRAD_CONFIG
    try:
        for cfg in (HEAD_STATS_CONFIGS if not smoke else [(256, 4)]):
            name = f"triton_{cfg[0]}x{cfg[1]}"
            hk.STATS_CONFIG = cfg
            try:
                got = hk.stats_soft(z, zt, t, T)
                errs = {k: rel(a, b) for k, a, b in zip(("lse", "ce", "lse_s", "lse_t", "kl"),
                                                         (got[0], got[1], got[3], got[4], got[5]),
                                                         (ref[0], ref[1], ref[3], ref[4], ref[5]))}
                errs["correct_mismatch"] = int((got[2] != ref[2]).sum())
                ts, _ = _timed(lambda: hk.stats_soft(z, zt, t, T), 3, 10, cuda)
                out["stats"][name] = {"s": ts, "tb_s": stat_bytes / ts / 1e12, "err": errs, "config": cfg}
            except Exception as exc:  # noqa: BLE001
                out["stats"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            log("head stats", name, json.dumps(out["stats"][name]))
        for cfg in (HEAD_GRAD_CONFIGS if not smoke else [(256, 4)]):
            name = f"triton_{cfg[0]}x{cfg[1]}"
            hk.GRAD_CONFIG = cfg
            try:
                got = hk.grad_soft(z, zt, ref[0], ref[3], ref[4], t, g_ce, g_kl, T, dt)
                err = rel(got, gref)
                tgk, _ = _timed(lambda: hk.grad_soft(z, zt, ref[0], ref[3], ref[4], t, g_ce, g_kl, T, dt), 3, 10, cuda)
                out["grad"][name] = {"s": tgk, "tb_s": grad_bytes / tgk / 1e12, "err": err, "config": cfg}
            except Exception as exc:  # noqa: BLE001
                out["grad"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            log("head grad", name, json.dumps(out["grad"][name]))
        if not smoke:  # DFlash2's top-16: trainer/head_kernels.topk against torch.topk
            try:
                got = hk.topk(z, 16)
                want = z.topk(16, dim=-1)
                tt, _ = _timed(lambda: hk.topk(z, 16), 3, 10, cuda)
                same = (got.sort(-1).values == want.indices.sort(-1).values).all(-1)
                out["topk"] = {"torch_s": out["topk16_s"], "triton_s": tt, "speedup": out["topk16_s"] / tt,
                               "values_equal": bool(torch.equal(z.gather(-1, got), want.values)),
                               "rows_other_index_on_ties": int((~same).sum()), "rows": R}
            except Exception as exc:  # noqa: BLE001
                out["topk"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            log("head topk", json.dumps(out["topk"]))
    finally:
        hk.STATS_CONFIG, hk.GRAD_CONFIG = base_s, base_g
    out["shipped"] = {"stats": list(base_s), "grad": list(base_g)}
    for k in ("stats", "grad"):
        ok = {n: r for n, r in out[k].items() if "s" in r and n != "compiled"}
        if ok:
            best = min(ok, key=lambda n: ok[n]["s"])
            out[f"{k}_best"] = best
            out[f"{k}_speedup"] = out[k]["compiled"]["s"] / ok[best]["s"]
            # the step's "after" in this process runs the fastest configuration measured here
            setattr(hk, "STATS_CONFIG" if k == "stats" else "GRAD_CONFIG", tuple(ok[best]["config"]))
    return out


def phase_headgemm(smoke: bool) -> dict:
    """The head chunk's three GEMMs at the operators' chunk (3,968 rows × 4,096 × 151,936, bf16):
    the drafter's logits, the teacher's logits, ∂L/∂z @ W; the two logits GEMMs as one of twice
    the rows (they share W); and 4,096-row chunks for the tile quantisation. TFLOP/s each, the
    median of 10 after 3 warm-ups (CUDA events)."""
    import torch

    dev = torch.device("cpu" if smoke else "cuda")
    R, H, V = (62, 64, 2048) if smoke else (128 * 31, 4096, 151936)
    dt = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    W = torch.randn(V, H, device=dev, dtype=dt, generator=g) * 0.02
    h, th = (torch.randn(R, H, device=dev, dtype=dt, generator=g) for _ in range(2))
    gz = torch.randn(R, V, device=dev, dtype=dt, generator=g) * 1e-3
    hh = torch.cat([h, th])
    h4 = torch.randn(4096, H, device=dev, dtype=dt, generator=g)
    gz4 = torch.randn(4096, V, device=dev, dtype=dt, generator=g) * 1e-3
    cuda = not smoke
    cases = {"logits": (lambda: h @ W.t(), R), "teacher_logits": (lambda: th @ W.t(), R),
             "both_logits_one_gemm": (lambda: hh @ W.t(), 2 * R), "grad_hidden": (lambda: gz @ W, R),
             "logits_4096_rows": (lambda: h4 @ W.t(), 4096), "grad_hidden_4096_rows": (lambda: gz4 @ W, 4096)}
    out = {"rows": R, "hidden": H, "vocab": V}
    for name, (fn, rows) in cases.items():
        t, _ = _timed(fn, 3, 10, cuda)
        out[name] = {"s": t, "tflop_s": 2 * rows * H * V / t / 1e12}
        log("headgemm", name, json.dumps(out[name]))
    out["two_gemms_s"] = out["logits"]["s"] + out["teacher_logits"]["s"]
    out["one_gemm_speedup"] = out["two_gemms_s"] / out["both_logits_one_gemm"]["s"]
    return out


# ---------------------------------------------------------------------------------------------
SMOKE_SHAPE = fl.ModelShape(6, 64, 4, 2, 16, 128, 512, "tiny")


def work_of(shape, layers: int, n_blocks: int, B: int, ctx_tokens: int, pairs: int, params: int,
            soft: bool, top_k: int = 0, teacher_rows: int | None = None) -> dict:
    """FLOPs (matrix classes) and the fewest bytes (memory-bound classes, an estimate: each
    pass reads its inputs once and writes its outputs once) of one drafter step, per class of
    trainer/kernel_profile.py. The MFU's total (``_total_flop``) counts the teacher's logits at
    every drafted slot, as before and as for SpecForge; the head class counts the rows the
    step computes (``teacher_rows``: fewer where blocks overlap), so its roofline share is the
    GEMMs' own."""
    hp = n_blocks * (B - 1)
    f = fl.drafter_step_flops(shape, n_layers=layers, block_size=B, n_blocks=n_blocks, ctx_tokens=ctx_tokens,
                              visible_ctx_pairs=pairs, teacher_positions=hp if soft else 0)
    head_flop = f["head"] if not soft or teacher_rows is None else \
        f["head"] - 2 * shape.hidden * shape.vocab * (hp - teacher_rows)
    P = n_blocks * B
    V, H, I = shape.vocab, shape.hidden, shape.intermediate
    qkv = shape.q_dim + 2 * shape.kv_dim
    # per position and layer, forward: two residual add + norm (4H each), q/k norm + RoPE
    # (2·qkv), SiLU·up (3I); backward ≈ twice that; bf16
    elem = 3 * (8 * H + 2 * qkv + 3 * I) * 2 * P * layers
    # head passes: statistics read the logits (and teacher logits), the gradient pass reads them
    # again and writes ∂L/∂z (bf16); top-k reads the logits once more
    head_b = hp * V * 2 * ((2 + 3) if soft else (1 + 2) + (1 if top_k else 0))
    return {kp.MATMUL_DRAFTER: {"flop": f["layers"] + f["context"]},
            kp.MATMUL_HEAD: {"flop": head_flop},
            kp.FLEX_FWD: {"flop": f["attention"] / 3.5},
            kp.FLEX_BWD: {"flop": f["attention"] * 2.5 / 3.5},
            kp.HEAD_ELEMENTWISE: {"bytes": head_b},
            kp.OPTIMIZER: {"bytes": fl.OPTIMIZER_BYTES_PER_PARAM * params},
            kp.ELEMENTWISE: {"bytes": elem},
            # fp32 → bf16 weight casts per anchor chunk and the bf16 → fp32 gradient adds: 16 B/param/chunk
            kp.COPIES: {"bytes": 16 * params * max(1, P // (512 * B))},
            "_total_flop": f["total"]}


# Each GPU model's ceilings as its calls measured them (``phase_ceilings``). A table of a call
# that measured none takes its own GPU's row: the H100 calls of sessions 2026-12-05c and e
# (``--phases step``) were tabled against the H200's copy rate, 4.24 TB/s against the H100's
# 2.95, which put the memory-bound classes at about two thirds of their real share and
# overstated their ms over the floor by half.
MEASURED_CEILINGS = {
    # the first H200 call's (docs/gpu-notes.md), every H200 table's default before; the issue 29
    # calls measured 743-792 TFLOP/s and 4.01-4.23 TB/s
    "NVIDIA H200": {"matmul_flop_s": 787e12, "copy_bytes_s": 4.24e12, "from": "docs/gpu-notes.md, call 1"},
    # bench/results/roofline/issue29_s7_call{2,3}_*/results.json, the mean of the two
    "NVIDIA H100 80GB HBM3": {"matmul_flop_s": 781.8e12, "copy_bytes_s": 2.953e12,
                              "from": "issue29_s7_call2, issue29_s7_call3"},
}


def ceilings_for(gpu: str) -> dict:
    """The ceilings on record for ``gpu`` (a device name as torch reports it)."""
    if gpu not in MEASURED_CEILINGS:
        raise SystemExit(f"no ceilings on record for {gpu!r} (known: {', '.join(MEASURED_CEILINGS)}); "
                         f"run the call with --phases ceilings,... or give --ceilings RESULTS.json")
    return MEASURED_CEILINGS[gpu]


def ceilings_of(results: dict) -> dict:
    """A results.json's own ceilings (its ceilings phase), else those on record for its GPU."""
    return results.get("phases", {}).get("ceilings") or ceilings_for(str(results.get("gpu")))


def retable(t: dict, ceilings: dict) -> dict:
    """A table's rows (their ms, FLOPs and bytes) read against ``ceilings``: each row's share of
    its roofline and ms over its floor, the three largest losses, the step's floor. :func:`table`
    ends here; ``table`` re-reads a recorded one with it."""
    mm_peak, bw = ceilings["matmul_flop_s"], ceilings["copy_bytes_s"]
    rows = []
    for r in t["rows"]:
        ms = r["ms"]
        floor_ms = max((r.get("flop") or 0) / mm_peak, (r.get("bytes") or 0) / bw) * 1e3
        rows.append({**r, "roofline_share": (floor_ms / ms) if ms > 0 else None, "lost_ms": max(0.0, ms - floor_ms)})
    losses = sorted(rows, key=lambda r: -r["lost_ms"])[:3]
    return {**t, "rows": rows, "largest_losses": [r["class"] for r in losses],
            "floor_s": sum(r["ms"] - r["lost_ms"] for r in rows) / 1e3}


def what_if(t: dict, rates: dict) -> dict:
    """The step's time were some classes to run at other rates: ``rates`` maps a class of the
    table to FLOP/s (a matrix class), bytes/s (a memory-bound class) or 0 (idle: none). Every
    other class keeps its measured ms. → {"step_s", "saved_ms", "rows": [(class, ms, ms then)]}."""
    by_class = {r["class"]: r for r in t["rows"]}
    unknown = sorted(set(rates) - set(by_class))
    if unknown:
        raise SystemExit(f"--what-if: {', '.join(map(repr, unknown))} not a class of this table "
                         f"(its classes: {', '.join(by_class)})")
    rows, saved = [], 0.0
    for c, rate in rates.items():
        r = by_class[c]
        work = r.get("flop") or r.get("bytes")
        if rate and not work:
            raise SystemExit(f"--what-if: {c!r} has no FLOPs or bytes to run at a rate; give it 0")
        then = work / rate * 1e3 if rate else 0.0
        then = min(then, r["ms"])  # a rate below the measured one changes nothing
        rows.append((c, r["ms"], then))
        saved += r["ms"] - then
    return {"step_s": t["step_s"] - saved / 1e3, "saved_ms": saved, "rows": rows}


def what_if_markdown(w: dict) -> str:
    """:func:`what_if`'s rows as a table and its step time, as an unfinished sentence."""
    out = ["\n| class | ms | ms at the rate given |", "| --- | --- | --- |"]
    out += [f"| {c} | {ms:.1f} | {then:.1f} |" for c, ms, then in w["rows"]]
    return "\n".join(out) + f"\n\nWhat if: {w['step_s'] * 1e3:.0f} ms a step ({w['saved_ms']:.0f} ms less)"


def parse_what_if(items: list) -> dict:
    """``--what-if 'CLASS=RATE'`` items (RATE in FLOP/s or bytes/s, e.g. 561e12; 0 for none)."""
    out = {}
    for item in items:
        cls, sep, val = item.rpartition("=")
        try:
            rate = float(val)
        except ValueError:
            rate = -1.0
        if not sep or not cls.strip() or rate < 0:
            raise SystemExit(f"--what-if {item!r}: expected CLASS=RATE, a class of the table and a rate in "
                             f"FLOP/s or bytes/s, e.g. 'flex attention backward=561e12'")
        out[cls.strip()] = rate
    return out


def table(summary: dict, work: dict, ceilings: dict, step_s: float | None = None) -> dict:
    """Rows (class, ms, share of the step, FLOPs or bytes, achieved rate, share of its roofline,
    ms lost to it) and the three largest losses."""
    span = summary["span_us"] / 1e6
    scale = (step_s / span) if step_s else 1.0  # the profiled step runs slower (profiler): shares stay
    rows = []
    for c in kp.CLASSES:
        rec = summary["classes"].get(c, {"us": 0.0, "n": 0})
        t = rec["us"] / 1e6 * scale
        w = work.get(c, {})
        if t <= 0 and not (w.get("flop") or w.get("bytes")):
            continue
        rate = (f"{w['flop'] / t / 1e12:.0f} TFLOP/s" if "flop" in w and t > 0 else
                f"{w['bytes'] / t / 1e12:.2f} TB/s" if "bytes" in w and t > 0 else "")
        rows.append({"class": c, "ms": t * 1e3, "share": t / (span * scale) if span else 0, "kernels": rec["n"],
                     "flop": w.get("flop"), "bytes": w.get("bytes"), "rate": rate})
    return retable({"rows": rows, "step_s": span * scale}, ceilings)


def markdown(t: dict) -> str:
    out = ["| kernel class | ms | share of step | kernels | FLOP / bytes | achieved | share of its roofline | ms over its floor |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in t["rows"]:
        amount = (f"{r['flop'] / 1e12:.1f} TFLOP" if r["flop"] else f"{r['bytes'] / 1e9:.1f} GB" if r["bytes"] else "—")
        share = "—" if r["roofline_share"] is None else f"{100 * r['roofline_share']:.0f} %"
        out.append(f"| {r['class']} | {r['ms']:.1f} | {100 * r['share']:.1f} % | {r['kernels']} | {amount} | "
                   f"{r['rate'] or '—'} | {share} | {r['lost_ms']:.1f} |")
    out.append(f"\nLargest losses: {', '.join(t['largest_losses'])}; the floor of the whole step "
               f"{t['floor_s'] * 1e3:.0f} ms of {t['step_s'] * 1e3:.0f}.")
    return "\n".join(out)


BEFORE = {"choice": "main"}  # --before: what "before" turns off
SHIPPED: dict = {}  # switches as the trainer ships them, for the runs a --before leaves alone
Q_TILE_AFTER = {"rows": 640}  # --q-tile: the query tile "after" uses under --before qtile
RUNS: set = set()  # --runs: only these arch:variant runs of the step phase (empty: all)
CONFIG_SET: dict = {}  # --set: trainer flag values over the operators' (e.g. position_weights=dpace)


def config_set(pairs: list[str]) -> dict:
    """--set KEY=VALUE pairs: the value as JSON where it parses (numbers, booleans), else text."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE, e.g. position_weights=dpace")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _set_variant(after: bool, flex_opts: dict) -> None:
    """``--before main`` (session 2): "before" is the shipped step with the head's compiled
    passes, "after" the same with trainer/head_kernels.py's Triton passes. ``--before s3``
    (session 3): "before" is the step as session 3 found it, "after" with the flex options
    chosen and DFlash2's fused selector (the one-GEMM logits it also measured lost: removed).
    ``--before teacher`` (session 4): "before" computes a head chunk's teacher logits once per
    drafted slot, "after" once per distinct target position (chunked_head.TEACHER_SPANS). ``--before s1``
    (session 1's changes): "before" without the balanced head chunks, the compiled
    convolution, the direct block masks and the flex options (and the fused selector).
    ``--before selector`` (session 3, that change alone): "before" is the shipped step with
    DFlash2's selector the checkpointed reference (trainer/loss.py), "after" with
    trainer/selector_fused.py's (DFlash's step is the same both ways). ``--before castonce``
    (session 5): "before" casts the layers' GEMM weights in every chunk, "after" once per step
    (model.StepGemmWeights). ``--before addkernel``: "before" adds the chunks' bf16 gradients
    into the fp32 accumulators with PyTorch's mixed-dtype add, "after" with
    trainer/grad_accumulate.py's kernel. ``--before silukernel``: "before" runs the MLP's
    SiLU·up compiled, "after" through trainer/silu_mul_kernel.py's kernels. ``--before wgrad``:
    "before" hands the GEMM weights' bf16 gradients to a hook that adds them into the fp32
    ``.grad``, "after" the backward's GEMM adds into ``.grad`` itself
    (trainer/master_grad_linear.py). All three are off in the trainer until measured: every
    other choice runs them as shipped. ``--before qtile``: "before" builds the block masks with
    128-row query tiles, "after" with ``--q-tile`` rows (flex_mask.Q_TILE; 640 lets
    flash-attn-4's Hopper backward take its 80-row tile). ``--before cumprod``: "before" takes
    CAP's run products by torch's cumprod (its backward synchronises once per anchor chunk),
    "after" by a cumulative sum (loss.run_products)."""
    from trainer import (block_conv, chunked_head, fast_drafter, flex_mask, grad_accumulate, loss, master_grad_linear,
                         selector_fused, silu_mul_kernel)

    choice = BEFORE["choice"]
    old = choice == "s1" and not after
    fast_drafter.FLEX_OPTIONS = dict(flex_opts) if not old and (after or choice != "s3") else {}
    os.environ.pop("DFLASH_FLEX_OPTIONS", None)
    chunked_head.BALANCED = not old
    block_conv.COMPILE = not old
    fast_drafter.DIRECT_MASKS = not old
    # the head's Triton passes: only ``main`` (and session 4's ``teacher``, measured before they
    # shipped) runs "before" without them; every later choice keeps them on both sides
    chunked_head.TRITON = after or choice not in ("main", "teacher")
    fast_drafter.CAST_ONCE = after or choice != "castonce"
    loss.RUN_CUMSUM = after or choice != "cumprod"
    # the trainer's own settings, before any run changed them: the runs a --before leaves alone
    SHIPPED.setdefault("add", grad_accumulate.KERNEL)
    SHIPPED.setdefault("silu", silu_mul_kernel.KERNEL)
    SHIPPED.setdefault("wgrad", master_grad_linear.ENABLED)
    SHIPPED.setdefault("qtile", flex_mask.Q_TILE)
    grad_accumulate.KERNEL = after if choice == "addkernel" else SHIPPED["add"]
    silu_mul_kernel.KERNEL = after if choice == "silukernel" else SHIPPED["silu"]
    master_grad_linear.ENABLED = after if choice == "wgrad" else SHIPPED["wgrad"]
    flex_mask.Q_TILE = (Q_TILE_AFTER["rows"] if after else 128) if choice == "qtile" else SHIPPED["qtile"]
    # session 3 (``--before s3``): "before" is main at the session's start, "after" adds its changes
    chunked_head.TEACHER_SPANS = after or choice != "teacher"
    selector_fused.FUSED = after or choice not in ("s1", "s3", "selector")
    selector_fused.COMPILE = True


def phase_accumulate(smoke: bool) -> dict:
    """The chunked step's fp32 += bf16 weight-gradient adds (model.StepGemmWeights' hook) at
    Qwen3-8B's layer widths: one layer's seven weights (q, k, v, o, gate, up, down) per chunk,
    PyTorch's mixed-dtype add (the "before") and the fp32 + fp32 add it replaced, against
    trainer/grad_accumulate.py's kernel at several (BLOCK, warps); each checked bit for bit
    against PyTorch's, the median of 10 (CUDA events) after 3 warm-ups; bytes = fp32 read +
    bf16 read + fp32 written; ms per step = per layer × 5 layers × 12 chunks. On CPU (smoke)
    the two PyTorch adds only."""
    import torch

    from trainer import grad_accumulate as ga

    dev = torch.device("cpu" if smoke else "cuda")
    H, kv, I = (64, 16, 192) if smoke else (4096, 1024, 12288)
    shapes = [(H, H), (kv, H), (kv, H), (H, H), (I, H), (I, H), (H, I)]
    g = torch.Generator(device=dev).manual_seed(0)
    dst = [torch.randn(s, device=dev, generator=g) for s in shapes]
    src = [torch.randn(s, device=dev, generator=g).to(torch.bfloat16) for s in shapes]
    src32 = [x.float() for x in src]
    n = sum(x.numel() for x in dst)
    per_step = 5 * 12

    def row(t, nbytes):
        return {"ms_per_layer": 1e3 * t, "ms_per_step": 1e3 * t * per_step, "bytes_s": nbytes / t}

    out = {"elements_per_layer": n, "variants": {}}
    t, _ = _timed(lambda: [d.add_(x) for d, x in zip(dst, src32)], 3, 10, not smoke)
    out["variants"]["torch fp32 + fp32"] = row(t, 12 * n)
    t, _ = _timed(lambda: [d.add_(x) for d, x in zip(dst, src)], 3, 10, not smoke)
    out["variants"]["torch fp32 + bf16"] = row(t, 10 * n)
    if not smoke:
        shipped_config = ga.BLOCK, ga.WARPS
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                ga.BLOCK, ga.WARPS = block, warps
                # from dst as it is now: the timed adds below change it in place
                want = [d.clone().add_(x) for d, x in zip(dst, src)]
                got = [ga.kernel_add_(d.clone(), x) for d, x in zip(dst, src)]
                t, _ = _timed(lambda: [ga.kernel_add_(d, x) for d, x in zip(dst, src)], 3, 10, True)
                out["variants"][f"kernel {block}/{warps}"] = dict(
                    row(t, 10 * n), bit_equal=all(torch.equal(a, b) for a, b in zip(got, want)))
        ga.BLOCK, ga.WARPS = shipped_config
    return out


def phase_silu(smoke: bool) -> dict:
    """The drafter MLP's SiLU(gate)·up at the chunk's shape (512 anchors × 32 = 16,384 rows,
    Qwen3-8B's intermediate 12,288, bf16): forward and backward compiled (trainer/fused_ops.py,
    the "before") against trainer/silu_mul_kernel.py's kernels at several (rows, columns,
    warps) tiles; each kernel's numbers against the compiled ones (max difference in units of
    bf16's last place), the median of 10 (CUDA events) after 3 warm-ups; bytes = gu read +
    y written (forward), gu and dy read + dgu written (backward). On CPU (smoke) the eager
    function only."""
    import torch

    from trainer import fused_ops as fo
    from trainer import silu_mul_kernel as sk

    dev = torch.device("cpu" if smoke else "cuda")
    M, I = (64, 96) if smoke else (16384, 12288)
    dt = torch.float32 if smoke else torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gu = (torch.randn(M, 2 * I, device=dev, generator=g) * 3).to(dt)
    dy = torch.randn(M, I, device=dev, generator=g).to(dt)
    size = gu.element_size()
    fwd_bytes, bwd_bytes = size * (2 * M * I + M * I), size * (2 * M * I + M * I + 2 * M * I)

    def compiled_bwd():
        x = gu.detach().requires_grad_(True)
        fo._silu_mul_compiled(x).backward(dy)
        return x.grad

    def fwd_bwd_rows(fwd, bwd):
        tf, _ = _timed(fwd, 3, 10, not smoke)
        tb, _ = _timed(bwd, 3, 10, not smoke)
        return {"fwd_ms": 1e3 * tf, "fwd_bytes_s": fwd_bytes / tf, "bwd_ms": 1e3 * tb, "bwd_bytes_s": bwd_bytes / tb}

    out = {"rows": M, "intermediate": I, "variants": {}}
    shipped_config = sk.CONFIG
    # the compiled backward's time includes its forward (autograd needs it): subtract it
    comp = fwd_bwd_rows(lambda: fo._silu_mul_compiled(gu), compiled_bwd)
    comp["bwd_ms"] -= comp["fwd_ms"]
    comp["bwd_bytes_s"] = bwd_bytes / (1e-3 * comp["bwd_ms"])
    out["variants"]["compiled"] = comp
    if not smoke:
        y_ref, d_ref = fo._silu_mul_compiled(gu), compiled_bwd()

        def ulps(a, b):
            scale = torch.exp2(torch.floor(torch.log2(b.float().abs().clamp_min(1e-30))) - 7)
            return float(((a.float() - b.float()).abs() / scale).max())
        for bm in (4, 8, 16):
            for bn in (256, 512, 1024):
                for warps in (4, 8):
                    sk.CONFIG = (bm, bn, warps)
                    rec = fwd_bwd_rows(lambda: sk.forward(gu), lambda: sk.backward(gu, dy))
                    rec.update(fwd_max_ulps=ulps(sk.forward(gu), y_ref), bwd_max_ulps=ulps(sk.backward(gu, dy), d_ref))
                    out["variants"][f"kernel {bm}x{bn}/{warps}"] = rec
        sk.CONFIG = shipped_config
    return out


def phase_step(smoke: bool, iters: int, archs: list[str], flex_opts: dict, ceilings: dict) -> dict:
    import torch

    import dflash2_step as ds
    from trainer import budget
    from trainer import memory as mm
    from trainer.step import make_step
    from trainer.train import compile_stats

    shape, config, device = (SMOKE_SHAPE, ds.SMOKE, "cpu") if smoke else (fl.QWEN3_8B, ds.OPERATORS, "cuda")
    config = {**config, **CONFIG_SET}
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    out = RESULTS["phases"].setdefault("step", {})
    for arch in archs:
        for variant in ("before", "after"):
            name = f"{arch}:{variant}"
            if RUNS and name not in RUNS:
                continue
            try:
                _set_variant(variant == "after", flex_opts)
                values, args, dcfg, drafter, head, dtype = ds.drafter_and_head(arch, shape, config, dev)
                opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda or None)
                step = make_step(args, drafter, head, dcfg)
                b = args.token_budget // args.max_seq_len
                mb = ds.batch(shape, b, args.max_seq_len, args.max_anchors, len(dcfg.target_layer_ids), dev, dtype)

                def one():
                    stats = step(mb, mb.taps)
                    with kp.region(kp.REGION_OPTIMIZER):
                        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0, foreach=True)
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    return stats
                c0 = compile_stats()["compile_s"]
                t0 = time.perf_counter()
                stats = one()
                if cuda:
                    torch.cuda.synchronize()
                first_s, first_compile = time.perf_counter() - t0, compile_stats()["compile_s"] - c0
                med, times = _timed(one, 1, iters, cuda)
                loss = float(stats.loss)
                rec = {"arch": arch, "variant": variant, "first_step_s": first_s, "first_step_compile_s": first_compile,
                       "median_s": med, "times": times, "loss_first_step": loss,
                       "params": sum(p.numel() for p in drafter.parameters())}
                positions = b * args.max_anchors * args.block_size
                pairs = int(mb.anchors.sum()) * args.block_size
                top_k = dcfg.selector_top_k if drafter.selector is not None else 0
                from trainer.fast_drafter import teacher_rows_computed

                rec["teacher_rows"] = teacher_rows_computed(mb.anchors, mb.keep, args.max_seq_len, args.block_size)
                work = work_of(shape, args.num_draft_layers, b * args.max_anchors, args.block_size,
                               b * args.max_seq_len, pairs, rec["params"], True, top_k, rec["teacher_rows"])
                extra = ds.dflash2_extra_flops(shape, args.num_draft_layers, positions,
                                               b * args.max_anchors * (args.block_size - 1)) if arch == "dflash2" else 0
                rec.update(drafted_pos_s=positions / med, tokens_s=b * args.max_seq_len / med,
                           mfu=fl.mfu(work["_total_flop"], med), mfu_own=fl.mfu(work["_total_flop"] + extra, med))
                pred = mm.predict(budget.run_spec(values, ds.config_of(shape), "drafter", args.token_budget))
                if cuda:
                    rec.update(peak_alloc_gib=torch.cuda.max_memory_allocated() / GIB,
                               peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB)
                    with kp.profile_step() as res:
                        one()
                    rec["profile"] = res["summary"]
                    rec["profile_wall_s"] = res["wall_s"]
                    rec["table"] = table(res["summary"], work, ceilings, med)
                rec.update(model_allocated_gib=pred.allocated / GIB, model_reserved_gib=pred.reserved / GIB)
                del step, opt, drafter, head, mb
            except Exception as exc:  # noqa: BLE001 — recorded; the next variant still runs
                rec = {"arch": arch, "variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                       "trace": traceback.format_exc()[-1500:]}
            out[name] = rec
            log(name, json.dumps({k: v for k, v in rec.items() if k not in ("profile", "table", "trace")}))
            if "table" in rec:
                print(markdown(rec["table"]), flush=True)
            save()
    return out


def main() -> int:
    global OUT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--phases", default="ceilings,flex,step")
    r.add_argument("--archs", default="dflash,dflash2")
    r.add_argument("--iters", type=int, default=3)
    r.add_argument("--flex-options", default=None, help="JSON: skip the choice, use these for 'after'")
    r.add_argument("--flex-window", type=int, default=2048, help="the flexwindow phase's sliding window")
    r.add_argument("--flex-variants", default=None, help="comma-separated FLEX_VARIANTS names (default: all)")
    r.add_argument("--smoke", action="store_true")
    r.add_argument("--before", default="main", choices=["main", "s1", "s3", "selector", "teacher", "castonce", "addkernel",
                                                      "silukernel", "wgrad", "qtile", "cumprod"],
                   help="what the step's 'before' turns off")
    r.add_argument("--q-tile", type=int, default=640,
                   help="with --before qtile: the block masks' query tile rows 'after' uses (a multiple of 64)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer flag's value over the operators' for every step run, e.g. position_weights=dpace")
    r.add_argument("--runs", default="", help="only these of the step phase, e.g. dflash:after,dflash2:before,"
                   "dflash2:after (a before that equals its after for one architecture need not run)")
    t = sub.add_parser("table", help="a results.json's step tables, against its own ceilings or those on record "
                                     "for its GPU (MEASURED_CEILINGS)")
    t.add_argument("results")
    t.add_argument("--ceilings", default=None, help="another results.json whose ceilings phase to table against")
    t.add_argument("--what-if", action="append", default=[], metavar="CLASS=RATE",
                   help="the step's time and MFU were CLASS to run at RATE (FLOP/s or bytes/s; 0: none), "
                        "e.g. 'flex attention backward=561e12'; repeatable")
    a = p.parse_args()
    if a.cmd == "table":
        res = json.load(open(a.results))
        ceilings = ceilings_of(json.load(open(a.ceilings)) if a.ceilings else res)
        print(f"ceilings: {ceilings['matmul_flop_s'] / 1e12:.0f} TFLOP/s, {ceilings['copy_bytes_s'] / 1e12:.2f} TB/s"
              f" ({ceilings.get('from', a.ceilings or 'measured in this call')})")
        for name, rec in res["phases"].get("step", {}).items():
            if "table" in rec:
                print(f"\n### {name}: {rec['median_s']:.3f} s, {rec['drafted_pos_s']:.0f} drafted positions/s, "
                      f"MFU {100 * rec['mfu']:.1f} %\n")
                print(markdown(retable(rec["table"], ceilings)))
                if a.what_if:
                    w = what_if(rec["table"], parse_what_if(a.what_if))
                    print(what_if_markdown(w) + f", MFU {100 * rec['mfu'] * rec['table']['step_s'] / w['step_s']:.1f} %.")
        return 0
    import torch

    if not a.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    OUT = a.out
    BEFORE["choice"] = a.before
    if a.q_tile <= 0 or a.q_tile % 64:
        raise SystemExit(f"--q-tile {a.q_tile}: expected a positive multiple of 64, e.g. 640")
    Q_TILE_AFTER["rows"] = a.q_tile
    RUNS.update(x for x in a.runs.split(",") if x)
    CONFIG_SET.update(config_set(a.set))
    RESULTS["config_set"] = CONFIG_SET
    os.makedirs(OUT, exist_ok=True)
    RESULTS.update(gpu=torch.cuda.get_device_name(0) if not a.smoke else "cpu", torch=torch.__version__,
                   date=time.strftime("%F %T %Z"))
    phases = a.phases.split(",")
    # the step's table needs this GPU's ceilings: measured in the call (seconds), never another GPU's
    if "ceilings" in phases or "step" in phases:
        ceilings = RESULTS["phases"]["ceilings"] = phase_ceilings(a.smoke)
        log("ceilings", json.dumps(ceilings))
        save()
    if "head" in phases:
        RESULTS["phases"]["head"] = phase_head(a.smoke)
        log("head", json.dumps({k: v for k, v in RESULTS["phases"]["head"].items() if k not in ("stats", "grad")}))
        save()
    if "headgemm" in phases:
        RESULTS["phases"]["headgemm"] = phase_headgemm(a.smoke)
        log("headgemm speedup of one GEMM for both logits", RESULTS["phases"]["headgemm"]["one_gemm_speedup"])
        save()
    flex_opts = json.loads(a.flex_options) if a.flex_options else {}
    if "flex" in phases and a.flex_options is None:
        RESULTS["phases"]["flex"] = phase_flex(a.smoke, a.flex_variants.split(",") if a.flex_variants else None)
        flex_opts = RESULTS["phases"]["flex"]["chosen"]
        log("flex chosen", json.dumps(flex_opts))
        save()
    if "flexwindow" in phases:  # the same sweep under a sliding-window layer's mask (the 27B drafter's)
        RESULTS["phases"]["flexwindow"] = phase_flex(a.smoke, a.flex_variants.split(",") if a.flex_variants else None,
                                                     window=a.flex_window)
        log("flex (window) chosen", json.dumps(RESULTS["phases"]["flexwindow"]["chosen"]))
        save()
    if "silu" in phases:
        RESULTS["phases"]["silu"] = phase_silu(a.smoke)
        log("silu", json.dumps(RESULTS["phases"]["silu"]))
        save()
    if "accumulate" in phases:
        RESULTS["phases"]["accumulate"] = phase_accumulate(a.smoke)
        log("accumulate", json.dumps(RESULTS["phases"]["accumulate"]))
        save()
    if "step" in phases:
        RESULTS["flex_after"] = flex_opts
        phase_step(a.smoke, a.iters, a.archs.split(","), flex_opts, ceilings)
    steps = RESULTS["phases"].get("step", {})
    for arch in a.archs.split(","):
        b, f = steps.get(f"{arch}:before", {}), steps.get(f"{arch}:after", {})
        if "median_s" in b and "median_s" in f:
            log(f"{arch}: before {b['median_s']:.3f} s, after {f['median_s']:.3f} s: {b['median_s'] / f['median_s']:.3f}×")
    d, d2 = steps.get("dflash:after", {}), steps.get("dflash2:after", {})
    if "drafted_pos_s" in d and "drafted_pos_s" in d2:
        log(f"DFlash2 / DFlash (after): {d2['drafted_pos_s'] / d['drafted_pos_s']:.3f}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
