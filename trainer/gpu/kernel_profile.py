"""Where a step's GPU time goes, by kernel class: the step's profile table.

A step runs under ``torch.profiler`` (CUDA activity); its Chrome trace is read back here and
every GPU kernel is put in one class by its name and by the innermost *region* it ran in.
Regions are ``torch.profiler.record_function`` ranges the code opens around its parts —
:data:`REGION_TARGET` (the target's forward), :data:`REGION_HEAD` (the drafter's LM head and
loss, forward and the input-gradient GEMM it forms there), :data:`REGION_OPTIMIZER` (clip and
AdamW) — which the profiler mirrors onto the GPU timeline as ``gpu_user_annotation`` events, so
a kernel's region is read from GPU timestamps (kernels of the autograd thread included).

Classes (:data:`CLASSES`, in table order): matrix products by region (drafter layers and
context path / LM head and teacher logits / the target's), flex attention forward and backward,
the target's fused attention, the LM head's elementwise passes (softmax, CE, KL, their
gradient, top-k), the optimizer, other elementwise kernels and norms, copies and fills, and the
idle time: the step's wall time on the GPU clock minus the union of its kernels' intervals
(host gaps, launches, synchronisations).

Standard library only at import (the bench's summary reads traces anywhere); ``profile_step``
imports torch.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re

REGION_TARGET = "dflash:target_forward"
REGION_HEAD = "dflash:lm_head_loss"
REGION_OPTIMIZER = "dflash:optimizer"
REGION_SELECTOR = "dflash:selector"
REGIONS = (REGION_TARGET, REGION_HEAD, REGION_OPTIMIZER, REGION_SELECTOR)

MATMUL_DRAFTER = "matmul: drafter layers + context path"
MATMUL_HEAD = "matmul: LM head + teacher logits"
MATMUL_TARGET = "matmul: target forward"
FLEX_FWD = "flex attention forward"
FLEX_BWD = "flex attention backward"
ATTN_TARGET = "attention: target (SDPA; Gated DeltaNet kernels)"
HEAD_ELEMENTWISE = "LM head elementwise (softmax, CE/KL, gradient, top-k)"
SELECTOR = "DFlash2 selector (gathered head rows, scores; forward)"
OPTIMIZER = "optimizer (clip + AdamW)"
ELEMENTWISE_TARGET = "elementwise + norms: target"
ELEMENTWISE = "elementwise + norms: drafter"
COPIES = "copies, casts, fills"
IDLE = "idle / host gaps"
CLASSES = (MATMUL_DRAFTER, MATMUL_HEAD, MATMUL_TARGET, FLEX_FWD, FLEX_BWD, ATTN_TARGET, HEAD_ELEMENTWISE,
           SELECTOR, OPTIMIZER, ELEMENTWISE_TARGET, ELEMENTWISE, COPIES, IDLE)

# cuBLAS/cuBLASLt on Hopper names its kernels nvjet_* or sm90_xmma_gemm_*; CUTLASS and older
# builds ..gemm..; Inductor's matmul templates triton_tem_fused_mm/addmm/bmm.
_MATMUL = re.compile(r"nvjet|gemm|cutlass|xmma|wgmma|triton_tem_fused_(?:add)?b?mm|splitKreduce", re.I)
_FLEX = re.compile(r"flex_attention|flex_decoding", re.I)
# flex attention's FLASH backend (--attention-kernel flash): flash-attn-4's CuTe DSL kernels,
# named after their module and class (kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90
# FlashAttentionBackwardSm90…, and the backward's pre/postprocess kernels); checked before
# the matmul names, which "cutlass" would match
_FLEX_CUTE = re.compile(r"flash_attn_?cute|FlashAttention(?:Forward|Backward)", re.I)
_FLEX_BWD = re.compile(r"backward|bwd", re.I)
_SDPA = re.compile(r"flash|fmha|sdpa|attention|cudnn_generated", re.I)
# flash-linear-attention's Triton kernels of a hybrid target's Gated DeltaNet layers (fla 0.6:
# chunk_gated_delta_rule_fwd_kernel_h…, chunk_fwd_kernel_o, chunk_scaled_dot_kkt…,
# recompute_w_u…, solve_tril / merge_16x16_to_64x64_inverse…, chunk_local_cumsum…)
_LINEAR_ATTN = re.compile(r"^(?!triton_)\w*(chunk_|delta_rule|kkt|recompute_w_u|solve_tril|merge_16x16|"
                          r"inverse_kernel|local_cumsum)", re.I)
_COPY = re.compile(r"copy|memcpy|memset|fill|cat_|catarray|CatArray|index_elementwise|gather|scatter", re.I)
_OPT = re.compile(r"multi_tensor_apply|adam|foreach", re.I)


def kernel_class(name: str, region: str | None) -> str:
    """The class of one GPU kernel (``name`` as the trace spells it) that ran inside
    ``region`` (the innermost of :data:`REGIONS` around it on the GPU clock, or None)."""
    if region == REGION_SELECTOR:
        return SELECTOR
    if _FLEX.search(name) or region != REGION_TARGET and _FLEX_CUTE.search(name):
        return FLEX_BWD if _FLEX_BWD.search(name) else FLEX_FWD
    if region == REGION_TARGET and (_SDPA.search(name) or _LINEAR_ATTN.search(name)):
        return ATTN_TARGET
    if _MATMUL.search(name):
        return MATMUL_TARGET if region == REGION_TARGET else MATMUL_HEAD if region == REGION_HEAD else MATMUL_DRAFTER
    if region == REGION_OPTIMIZER or _OPT.search(name):
        return OPTIMIZER
    if region == REGION_HEAD:  # everything else the head's Function launches: its passes, top-k, copies
        return HEAD_ELEMENTWISE
    if name.lower().startswith(("memcpy", "memset")) or _COPY.search(name) and not name.startswith("triton_"):
        return COPIES
    if region == REGION_TARGET:
        return ELEMENTWISE_TARGET
    return ELEMENTWISE


def _gpu_events(trace: dict):
    """(kernels [(ts, dur, name)], annotations [(ts, dur, name)]) of a Chrome trace, GPU side."""
    kernels, notes = [], []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = str(e.get("cat", "")).lower()
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append((float(e["ts"]), float(e["dur"]), str(e.get("name", ""))))
        elif cat == "gpu_user_annotation" and e.get("name") in REGIONS:
            notes.append((float(e["ts"]), float(e["dur"]), str(e["name"])))
    return kernels, notes


def _region_of(ts: float, dur: float, notes) -> str | None:
    best = None
    for s, d, name in notes:  # innermost = the shortest annotation that holds the kernel's midpoint
        mid = ts + dur / 2
        if s <= mid <= s + d and (best is None or d < best[0]):
            best = (d, name)
    return None if best is None else best[1]


def summarize_trace(trace: dict, wall_us: float | None = None) -> dict:
    """Per class: GPU microseconds and kernel count, from a Chrome trace of one or more steps.
    ``wall_us``: the span the profile covers on the GPU clock (CUDA events); without it the
    span from the first kernel's start to the last one's end. Adds ``idle`` = span − the union
    of the kernels' intervals, and ``top`` kernels by time."""
    kernels, notes = _gpu_events(trace)
    out = {c: {"us": 0.0, "n": 0} for c in CLASSES}
    by_name: dict[str, list] = {}
    for ts, dur, name in kernels:
        c = kernel_class(name, _region_of(ts, dur, notes))
        out[c]["us"] += dur
        out[c]["n"] += 1
        rec = by_name.setdefault(name, [0.0, 0, c])
        rec[0] += dur
        rec[1] += 1
    busy, end = 0.0, None
    for ts, dur, _ in sorted(kernels):
        stop = ts + dur
        if end is None or ts >= end:
            busy += dur
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    span = (max(t + d for t, d, _ in kernels) - min(t for t, _, _ in kernels)) if kernels else 0.0
    span = float(wall_us) if wall_us else span
    out[IDLE] = {"us": max(0.0, span - busy), "n": 0}
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {"classes": out, "span_us": span, "busy_us": busy, "kernels": len(kernels),
            "annotations": len(notes),
            "top": [{"name": n[:160], "us": round(v[0], 1), "n": v[1], "class": v[2]} for n, v in top]}


def read_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        return json.load(fh)


@contextlib.contextmanager
def profile_step(out_path: str | None = None):
    """Profile the GPU work of the ``with`` body; yields a dict that holds, after the body,
    ``summary`` (:func:`summarize_trace` over the body's span on the GPU clock) and, where
    ``out_path`` is given, the gzipped Chrome trace written there."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    res: dict = {}
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start.record()
        yield res
        stop.record()
        torch.cuda.synchronize()
    wall_us = start.elapsed_time(stop) * 1e3
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw) as fh:
            trace = json.load(fh)
        if out_path:
            with gzip.open(out_path, "wt") as fh:
                json.dump(trace, fh)
    res["summary"] = summarize_trace(trace, wall_us)
    res["wall_s"] = wall_us / 1e6


def region(name: str):
    """A named region for the profile (``record_function``); free when no profiler runs."""
    import torch

    return torch.profiler.record_function(name)


def maybe_profile(step: int, out_dir: str | None = None):
    """The trainer's hook: ``DFLASH_PROFILE_STEP=N`` profiles optimizer step N (1-based) of a
    CUDA run and writes ``kernel_profile_step<N>.json`` (the summary) beside the trace in
    ``DFLASH_PROFILE_DIR`` (default: the current directory); ``DFLASH_PROFILE_TRACE=1`` keeps
    the gzipped Chrome trace too. Otherwise a no-op context."""
    want = os.environ.get("DFLASH_PROFILE_STEP", "").strip()
    if not want.isdigit() or int(want) != step:
        return contextlib.nullcontext()
    return _trainer_profile(step, out_dir or os.environ.get("DFLASH_PROFILE_DIR") or ".")


@contextlib.contextmanager
def _trainer_profile(step: int, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    # the raw trace of a whole step is tens of MB: kept only when asked for
    trace = os.path.join(out_dir, f"kernel_profile_step{step}.trace.json.gz") if os.environ.get("DFLASH_PROFILE_TRACE") == "1" else None
    with profile_step(trace) as res:
        yield res
    with open(os.path.join(out_dir, f"kernel_profile_step{step}.json"), "w") as fh:
        json.dump({"step": step, "wall_s": res["wall_s"], **res["summary"]}, fh, indent=1)
