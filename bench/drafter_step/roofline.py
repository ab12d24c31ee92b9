"""Where each millisecond of a drafter step goes, against the GPU's roofline.

    PYTHONUNBUFFERED=1 python3 bench/drafter_step/roofline.py run --out DIR [--phases ceilings,step]
    python3 bench/drafter_step/roofline.py run --out /tmp/o --smoke        # the same code on CPU, tiny widths
    python3 bench/drafter_step/roofline.py table DIR/results.json           # the markdown tables, anywhere
    python3 bench/drafter_step/roofline.py table DIR/results.json --what-if 'flex attention backward=561e12'

Phases (one GPU; random bf16 weights made on the GPU, random tokens, no download):

* ``ceilings``: a bf16 8192³ matmul on random data and a 4 GiB device copy (bytes read +
  written), median of 10 after 3 warm-ups: the roofline's two ceilings. Runs with ``step``
  too (the step's table is read against this GPU's ceilings); ``table`` re-reads a run that
  measured none against its GPU's row of ``MEASURED_CEILINGS``.
* ``flex``: flex attention forward and forward + backward at the chunked step's shape (512
  anchors × block 32 = 16,384 queries, 32/8 heads × 128, context 8,192 + the blocks) under the
  DFlash block mask, for several kernel options (block sizes, stages, warps, flags); the best
  forward, backward and flag choices are combined and timed again (a measurement at one chunk:
  the trainer runs torch's defaults, or flash-attn-4 with ``--set attention_kernel=flash``).
* ``flexwindow``: the same under a sliding-window layer's mask (``--flex-window``, 2,048: the
  Qwen3.6-27B drafter's sliding layers), the tiles from the materialised mask.
* ``head``: the head chunk's two elementwise passes, compiled against trainer/gpu/head_kernels.py's
  Triton kernels at several block sizes (:func:`phase_head`).
* ``headgemm``: the head chunk's three GEMMs, and the two logits GEMMs as one (:func:`phase_headgemm`).
* ``step``: trainer/step.py's ChunkedStep at the operators' config (Qwen3-8B widths, 5 layers,
  block 32, 1,024 anchors, 6 × 8,192 tokens, soft labels KL 0.15 at T 2, CAP 0.1, γ 10, clip,
  fused AdamW) for each of ``--archs``, as this tree ships it: the first step's wall time and
  compile seconds, the median of ``--iters`` timed steps (CUDA events), one profiled step
  (trainer/gpu/kernel_profile.py) as a table of kernel classes with FLOPs/bytes and the share
  of its roofline, allocated/reserved peaks beside trainer/plan/memory.py's prediction.

A before/after is two trees, not two switches: ``bench/compare.py --base COMMIT --
python3 bench/drafter_step/roofline.py run --out {out} --phases step`` runs this against a
base commit beside the working tree (bench/drafter_step/README.md).

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
sys.path.insert(0, ROOT)

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

from trainer.plan import flops as fl  # noqa: E402
from trainer.gpu import kernel_profile as kp  # noqa: E402

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
    # TMA for the forward alone (it helped the forward, hurt the backward), Hopper
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
    from bench._timing import timed

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

    from trainer.gpu import fast_drafter as fd
    from trainer.layers import flex_mask

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

    from trainer.layers.flex_mask import flex_attention_fn

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
    trainer/gpu/head_kernels.py's Triton kernels at several (BLOCK, warps); every variant's numbers
    against the reference's (fresh random inputs), the median of 10 (CUDA events) after 3
    warm-ups, bytes = each input read once + the gradient written once; ``torch.topk(16)``
    (DFlash2's candidates) against trainer/head_kernels.topk (the same values; rows whose
    index set differs only on ties counted)."""
    import torch

    from trainer.gpu import chunked_head as ch

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
        from trainer.gpu import head_kernels as hk
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
    trainer/gpu/kernel_profile.py. The MFU's total (``_total_flop``) counts the teacher's logits at
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


# Each GPU model's ceilings as ``phase_ceilings`` measured them. A table of a run that measured
# none takes its own GPU's row: tabling an H100's step against an H200's 4.24 TB/s (the H100
# copies at 2.95) put its memory-bound classes at two thirds of their real share and overstated
# their ms over the floor by half.
MEASURED_CEILINGS = {
    # one H200 (docs/gpu-notes.md); runs on other H200s measured 743-792 TFLOP/s, 4.01-4.23 TB/s
    "NVIDIA H200": {"matmul_flop_s": 787e12, "copy_bytes_s": 4.24e12, "from": "one H200, 2026-11-29"},
    # the mean of two runs' ceilings phase on one H100 (tests/fixtures/h100_ceilings.json)
    "NVIDIA H100 80GB HBM3": {"matmul_flop_s": 781.8e12, "copy_bytes_s": 2.953e12,
                              "from": "the mean of two H100 runs, 2026-12-05"},
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


def phase_step(smoke: bool, iters: int, archs: list[str], ceilings: dict) -> dict:
    """Each architecture's step as this tree ships it (bench/drafter_step/run.py's measurement),
    one step profiled and tabled by kernel class against ``ceilings``."""
    from bench.drafter_step import run as ds

    shape, config, device = (SMOKE_SHAPE, ds.SMOKE, "cpu") if smoke else (fl.QWEN3_8B, ds.OPERATORS, "cuda")
    config = {**config, **CONFIG_SET}
    out = RESULTS["phases"].setdefault("step", {})
    for arch in archs:
        try:
            rec = ds.run(arch, iters, shape, config, device, profile=not smoke)
            if "profile" in rec:
                b = config["token_budget"] // config["max_seq_len"]
                work = work_of(shape, config["num_draft_layers"], b * config["max_anchors"], config["block_size"],
                               b * config["max_seq_len"], rec["pairs"], rec["params"], True, rec["top_k"],
                               rec["teacher_rows"])
                rec["table"] = table(rec["profile"], work, ceilings, rec["median_s"])
        except Exception as exc:  # noqa: BLE001 — recorded; the next architecture still runs
            rec = {"arch": arch, "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                   "trace": traceback.format_exc()[-1500:]}
        out[arch] = rec
        log(arch, json.dumps({k: v for k, v in rec.items() if k not in ("profile", "table", "trace")}))
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
    r.add_argument("--flex-window", type=int, default=2048, help="the flexwindow phase's sliding window")
    r.add_argument("--flex-variants", default=None, help="comma-separated FLEX_VARIANTS names (default: all)")
    r.add_argument("--smoke", action="store_true")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer flag's value over the operators' for every step run, e.g. position_weights=dpace "
                        "or attention_kernel=flash")
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
    if "flex" in phases:
        RESULTS["phases"]["flex"] = phase_flex(a.smoke, a.flex_variants.split(",") if a.flex_variants else None)
        log("flex chosen", json.dumps(RESULTS["phases"]["flex"]["chosen"]))
        save()
    if "flexwindow" in phases:  # the same sweep under a sliding-window layer's mask (the 27B drafter's)
        RESULTS["phases"]["flexwindow"] = phase_flex(a.smoke, a.flex_variants.split(",") if a.flex_variants else None,
                                                     window=a.flex_window)
        log("flex (window) chosen", json.dumps(RESULTS["phases"]["flexwindow"]["chosen"]))
        save()
    if "step" in phases:
        phase_step(a.smoke, a.iters, a.archs.split(","), ceilings)
    steps = RESULTS["phases"].get("step", {})
    d, d2 = steps.get("dflash", {}), steps.get("dflash2", {})
    if "drafted_pos_s" in d and "drafted_pos_s" in d2:
        log(f"DFlash2 / DFlash: {d2['drafted_pos_s'] / d['drafted_pos_s']:.3f}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
