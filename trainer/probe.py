"""Memory known before launch: predict each role's peak from the configuration, check it
against the free memory of the GPUs the roles will use, optionally run the worst-case step
(max token budget, max length, max anchors) to measure it, and pick ``--token-budget auto``.

    python -m trainer.probe --model qwen3-8b --block-size 32 --max-anchors 1024 \\
        --max-seq-len 8192 --token-budget 49152 --num-draft-layers 5 --role drafter --gpu 0 [--run]

Prints one JSON object last (between ``--- probe json ---`` lines) and a line per GPU;
exit 0 when every role fits, 2 when a launch would be refused (one line per problem on
stderr, naming the GPU, its role, what is needed, what is free and the shortfall), 3 when
``--run`` hit a real CUDA OOM (reported the same way).

Prediction: trainer/memory.py (stdlib; the controller can call ``plan_run`` — the trainer's
own run, from its resolved flag values — and ``plan``/``refusals`` without torch). The run uses random weights of the configured shape through the fast GPU
paths (trainer/fast_target.py, trainer/fast_drafter.py), so its peak is that of the real
step for the same shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from trainer import flags
from trainer import memory as mm
from trainer.flops import QWEN3_8B, QWEN3_27B_LIKE, ModelShape

GIB = mm.GIB
MIB = 1024 ** 2
SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3-27b-like": QWEN3_27B_LIKE}


def shape_of(name: str) -> ModelShape:
    if name in SHAPES:
        return SHAPES[name]
    with open(name if name.endswith(".json") else name.rstrip("/") + "/config.json") as fh:
        return ModelShape.from_hf_config(json.load(fh))


def tapped_ids(n_target_layers: int, n: int) -> list[int]:
    if n == 1:
        return [n_target_layers // 2]
    return [int(round(1 + i * (n_target_layers - 4) / (n - 1))) for i in range(n)]


def plan(shape: ModelShape, *, block_size: int, max_anchors: int, max_seq_len: int, token_budget: int,
         num_draft_layers: int = 5, max_batch_size: int = 64, chunk_positions: int = 16384,
         head_chunk_rows: int = 4096, soft_labels: bool = False, colocated: bool = False,
         drafter_shape: ModelShape | None = None) -> dict:
    """Predicted peaks per role (bytes): allocated peak and what the GPU needs free."""
    taps = tapped_ids(shape.n_layers, num_draft_layers)
    d = mm.drafter_peak_bytes(drafter_shape or shape, n_layers=num_draft_layers, block_size=block_size,
                              max_anchors=max_anchors, max_seq_len=max_seq_len, token_budget=token_budget,
                              max_batch_size=max_batch_size, chunk_positions=chunk_positions,
                              head_chunk_rows=head_chunk_rows, soft_labels=soft_labels,
                              double_buffer=not colocated)
    t = mm.target_peak_bytes(shape, token_budget=token_budget, max_seq_len=max_seq_len,
                             last_layer=shape.n_layers - 1 if soft_labels else max(taps), n_tapped=len(taps),
                             max_batch_size=max_batch_size, soft_labels=soft_labels,
                             send_buffers=0 if colocated else 1)
    out = {"drafter": {"peak": d["total"], "need": mm.device_bytes_needed(d["total"], role="drafter"), "terms": d},
           "target": {"peak": t["total"], "need": mm.device_bytes_needed(t["total"], role="target"), "terms": t}}
    if colocated:
        both = d["total"] + t["total"] - (2 * 2 * shape.vocab * shape.hidden)  # embed/head shared
        out["colocated"] = {"peak": both, "need": mm.device_bytes_needed(both, role="colocated")}
    return out


def refusals(p: dict, roles_by_gpu: dict[int, str], free_by_gpu: dict[int, float], margin_bytes: float) -> list[str]:
    """One line per GPU that would not fit: GPU, role, needed, free, shortfall and a fix."""
    lines = []
    for gpu, role in sorted(roles_by_gpu.items()):
        need = p[role]["need"] + margin_bytes
        free = free_by_gpu.get(gpu)
        if free is None:
            continue
        if need > free:
            short = need - free
            lines.append(f"GPU {gpu} ({role}): the worst-case step needs {need / GIB:.2f} GiB "
                         f"(peak {p[role]['peak'] / GIB:.2f} GiB + allocator/context {(p[role]['need'] - p[role]['peak']) / GIB:.2f}"
                         f" + margin {margin_bytes / GIB:.2f}) but {free / GIB:.2f} GiB is free: short by "
                         f"{math.ceil(short / MIB)} MiB; lower --token-budget (or use --token-budget auto), "
                         "--max-anchors or --max-seq-len, or give the role more GPUs")
    return lines


def auto_budget(shape: ModelShape, free_bytes: float, margin_bytes: float, role: str = "drafter", **kw) -> int:
    """Largest token budget (multiple of 1024, ≥ max_seq_len) whose predicted need fits."""
    lo, hi, best = kw["max_seq_len"], 1 << 20, 0
    step = 1024

    def fits(budget):
        return plan(shape, token_budget=budget, **kw)[role]["need"] + margin_bytes <= free_bytes

    a, z = lo // step, hi // step
    if not fits(lo):
        return 0
    while a <= z:
        m = (a + z) // 2
        if fits(m * step):
            best, a = m * step, m + 1
        else:
            z = m - 1
    return max(best, lo)


# ------------------------------------------------------------------ the trainer's own run (stdlib)
# What ``python -m trainer`` runs differs from the benchmark shapes ``plan`` describes: the
# target is the whole Hugging Face CausalLM (every layer, the LM head loaded, hooks on the
# tapped layers), and the chunked drafter step uses fast_drafter.step_backward's default of
# 512 anchors per chunk whatever the block size. ``plan_run`` models that run; the trainer
# (train.memory_check) and the controller's preflight both call it.

MARGIN_MIB = 2048  # on top of the model's allocator reserve (6 %/12 %) and the CUDA context:
                   # the largest under-prediction measured was 0.7 % of a 40 GiB peak, and the
                   # trainer's HF target forward was never measured against the model
CONTEXT_MIB = 768  # memory.device_bytes_needed's CUDA-context allowance
TRAINER_CHUNK_ANCHORS = 512  # fast_drafter.step_backward's default; train.py passes none
ROLE_NAMES = {"drafter": "drafter", "target": "target", "colocated": "target+drafter"}


def _cfg_of(values, target_config):
    if target_config is None:
        import os

        with open(os.path.join(values["target_model"], "config.json")) as fh:
            target_config = json.load(fh)
    return target_config


def _gpus(v):
    if v in (None, ""):
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(g) for g in v)
    return tuple(int(g) for g in str(v).replace(" ", "").split(",") if g != "")


def roles_by_gpu(values) -> dict[int, str]:
    """GPU index → "target", "drafter" or "colocated" (both roles in one process)."""
    t, d = _gpus(values.get("target_gpus")), _gpus(values.get("drafter_gpus"))
    if t and set(t) == set(d):
        return {g: "colocated" for g in t}
    return {**{g: "target" for g in t}, **{g: "drafter" for g in d}}


def run_peaks(values, target_config=None, token_budget: int | None = None) -> dict:
    """Predicted allocated peak (bytes) per role for the trainer run these resolved flag
    values describe. ``exact`` is False for the drafter on --drafter-step reference: the
    model describes the chunked step, so for the reference step (≈ 2 MB per drafted
    position measured, ~10× the chunked step) the number is a lower bound only."""
    cfg = _cfg_of(values, target_config)
    shape = ModelShape.from_hf_config(cfg)
    budget = int(values["token_budget"] if token_budget is None else token_budget)
    L, block = int(values["max_seq_len"]), int(values["block_size"])
    n_draft = int(values["num_draft_layers"])
    layer_ids = values.get("target_layer_ids")
    n_tapped = len(_gpus(layer_ids)) if layer_ids not in (None, "", "auto") else n_draft
    soft = bool(values.get("use_soft_labels"))
    noise = float(values.get("noise_start") or 0) > 0 or float(values.get("noise_end") or 0) > 0
    colocated = set(roles_by_gpu(values).values()) == {"colocated"}
    chunked = flags.drafter_step_for(values, cuda=True) == "chunked"  # a memory plan is for GPUs
    tied = bool(cfg.get("tie_word_embeddings", False))
    d = mm.drafter_peak_bytes(shape, n_layers=n_draft, n_tapped=n_tapped, block_size=block,
                              max_anchors=int(values["max_anchors"]), max_seq_len=L, token_budget=budget,
                              max_batch_size=int(values["max_batch_size"]),
                              chunk_positions=TRAINER_CHUNK_ANCHORS * block, soft_labels=soft,
                              # split: the received taps + their noisy copy; colocated: the copy
                              double_buffer=(not colocated) or noise)
    tokens = d["batch"] * d["seq_len"]
    teacher = tokens * shape.hidden * 2 if soft else 0  # the target's final hidden state, bf16
    d_total = d["total"] + teacher
    # the HF CausalLM loads its LM head whatever the loss (soft_labels=True counts it)
    t = mm.target_peak_bytes(shape, token_budget=budget, max_seq_len=L, last_layer=shape.n_layers - 1,
                             n_tapped=n_tapped, max_batch_size=int(values["max_batch_size"]),
                             soft_labels=not tied, send_buffers=1)  # hook outputs + their concatenation
    t_total = t["total"] + teacher
    out = {"drafter": {"peak": d_total, "exact": chunked, "terms": {**d, "teacher": teacher}},
           "target": {"peak": t_total, "exact": True, "terms": {**t, "teacher": teacher}}}
    # colocated: one process runs the target forward, then the drafter step, so the peak is
    # the larger of two phases. Target phase: the target's own peak beside the drafter's
    # resident state (fp32 weights, accumulated gradients, AdamW). Drafter phase: the
    # drafter's peak (its taps are the target's; embedding and head are the target's own)
    # beside the target's weights. The sum of both peaks, used before, over-read the
    # measured peak by 43 % at a 221,184-token budget (H200, Qwen3-8B shape): the target's
    # forward transients are gone by the drafter step. Measured against this: -0.8 % at
    # 8,192 tokens, -0.5 % at 221,184 (docs/benchmarks.md), inside the reserve and margin.
    target_phase = t_total + d["params"] + d["grads"] + d["optimizer"]
    drafter_phase = d_total - d["frozen"] + t["params"]
    out["colocated"] = {"peak": max(target_phase, drafter_phase), "exact": chunked}
    return out


def _need(peak: float, role: str, context_mib: float) -> float:
    return mm.device_bytes_needed(peak, role=role, context_bytes=context_mib * MIB)


def _largest_budget(values, cfg, role: str, free_bytes: float, margin_mib: float, context_mib: float) -> int:
    """Largest b × --max-seq-len (b ≤ --max-batch-size) whose need + margin fits; 0 if none.
    Whole sequences: the model's worst case is full-length sequences, which a budget that is
    a multiple of --max-seq-len makes exact (tokens = budget)."""
    L = int(values["max_seq_len"])

    def fits(b):
        return _need(run_peaks(values, cfg, b * L)[role]["peak"], role, context_mib) + margin_mib * MIB <= free_bytes

    lo, hi, best = 1, int(values["max_batch_size"]), 0
    while lo <= hi:  # the need grows with b
        m = (lo + hi) // 2
        if fits(m):
            best, lo = m, m + 1
        else:
            hi = m - 1
    return best * L


def plan_run(values, gpu_free_mib: dict | None, target_config=None, *, margin_mib: float = MARGIN_MIB,
             context_mib: float = CONTEXT_MIB) -> dict:
    """Preflight for one trainer process group (one container): resolve ``--token-budget
    auto`` and check every role's predicted need against its GPU's free memory.

    values: resolved flag values (flags.py dests); gpu_free_mib: {GPU index: free MiB} for
    the GPUs named in --target-gpus/--drafter-gpus (a GPU left out is not checked; None or
    {} = no device memory known, e.g. CPU); target_config: the target's config.json as a
    dict (read from --target-model when None). context_mib: the CUDA context not yet in the
    free figure (0 when measured inside a process that already holds its context).

    Returns {"token_budget", "auto", "drafter_step", "margin_mib", "gpus": {gpu: {role,
    peak_mib, need_mib, free_mib, short_mib, exact}}, "refusals": [line, ...], "notes":
    [...]}. A launch must be refused when "refusals" is non-empty. Standard library only."""
    cfg = _cfg_of(values, target_config)
    free = {int(g): float(v) for g, v in (gpu_free_mib or {}).items()}
    by_gpu = roles_by_gpu(values)
    step = flags.drafter_step_for(values, cuda=True)  # a memory plan is for GPUs
    chunked = step == "chunked"
    L = int(values["max_seq_len"])
    out = {"token_budget": values.get("token_budget"), "auto": False, "drafter_step": step,
           "margin_mib": margin_mib, "gpus": {}, "refusals": [], "notes": []}
    if values.get("token_budget") == "auto":
        out["auto"] = True
        if not chunked:
            out["refusals"].append("--token-budget auto needs --drafter-step chunked: the memory model "
                                   "(trainer/memory.py) describes the chunked drafter step; the reference step holds "
                                   "~2 MB per drafted position and is not modelled — give a number or use chunked")
            return out
        known = {g: r for g, r in by_gpu.items() if g in free}
        if not known:
            out["refusals"].append("--token-budget auto fits the budget to free GPU memory and none is known here "
                                   "(CPU run, or no GPU of --target-gpus/--drafter-gpus measured): give a number, "
                                   f"e.g. --token-budget {L}")
            return out
        fits = {g: _largest_budget(values, cfg, r, free[g] * MIB, margin_mib, context_mib) for g, r in known.items()}
        budget = min(fits.values())
        out["token_budget"] = budget if budget else L  # 0: report the one-sequence shortfall below
        out["auto_per_gpu"] = fits
    budget = int(out["token_budget"])
    peaks = run_peaks(values, cfg, budget)
    for g, role in sorted(by_gpu.items()):
        p = peaks[role]
        need = _need(p["peak"], role, context_mib) + margin_mib * MIB
        row = {"role": role, "peak_mib": round(p["peak"] / MIB, 1), "need_mib": round(need / MIB, 1),
               "exact": p["exact"], "free_mib": free.get(g), "short_mib": None}
        out["gpus"][g] = row
        if g not in free:
            continue
        short = need - free[g] * MIB
        if short > 0:
            row["short_mib"] = math.ceil(short / MIB)
            fit = _largest_budget(values, cfg, role, free[g] * MIB, margin_mib, context_mib)
            fix = (f"lower --token-budget to {fit}" if fit else f"not even one --max-seq-len {L} sequence fits: lower "
                   "--max-seq-len") + " or --max-anchors, or use a GPU with more free memory"
            at_least = "" if p["exact"] else " at least"
            out["refusals"].append(
                f"GPU {g} ({ROLE_NAMES[role]}) needs{at_least} {need / GIB:.1f} GiB (predicted peak {p['peak'] / GIB:.1f} "
                f"+ allocator/context {(need - p['peak']) / GIB - margin_mib / 1024:.1f} + margin {margin_mib / 1024:.1f}), "
                f"has {free[g] / 1024:.1f} GiB free: short by {row['short_mib']} MiB; {fix}")
        elif not p["exact"]:
            out["notes"].append(
                f"GPU {g} ({ROLE_NAMES[role]}): --drafter-step reference is not modelled; the chunked step's "
                f"{need / GIB:.1f} GiB is a lower bound (the reference step holds ~2 MB per drafted position): "
                "measure with --probe-memory, or use --drafter-step chunked")
    return out


# ------------------------------------------------------------------ measured probe (torch)
def run_worst_case(role: str, shape: ModelShape, *, gpu: int, block_size: int, max_anchors: int, max_seq_len: int,
                   token_budget: int, num_draft_layers: int = 5, max_batch_size: int = 64,
                   chunk_positions: int = 16384, head_chunk_rows: int = 4096, steps: int = 2) -> dict:
    """Run the worst-case step on one GPU and return the measured peaks, or the OOM. Two
    steps by default: AdamW's state exists only from the first optimizer step on, so the
    steady-state peak is the second step's (a one-step probe under-reads by 8 B/param)."""
    import torch

    from trainer import fast_drafter as fd
    from trainer.fast_target import FastTarget
    from trainer.model import Drafter, DrafterConfig

    dev = torch.device("cuda", gpu)
    torch.cuda.set_device(dev)
    b, L = mm.worst_case_batch(token_budget, max_seq_len, max_batch_size)
    N = min(max_anchors, L - 1)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    t0 = time.time()
    try:
        if role == "target":
            taps = tapped_ids(shape.n_layers, num_draft_layers)
            ft = FastTarget.random(shape, taps, device=dev)
            ids = torch.randint(0, shape.vocab - 1, (b, L), device=dev)
            for _ in range(steps):
                out, _ = ft.forward(ids)
                del out
        else:
            d = Drafter(DrafterConfig.for_shape(shape, num_draft_layers, block_size)).to(dev)
            embed = torch.randn(shape.vocab, shape.hidden, device=dev, dtype=torch.bfloat16) * 0.02
            head = torch.randn(shape.vocab, shape.hidden, device=dev, dtype=torch.bfloat16) * 0.02
            opt = torch.optim.AdamW(d.parameters(), lr=1e-4, fused=True)
            ids = torch.randint(0, shape.vocab - 2, (b, L), device=dev)
            taps = torch.randn(b, L, num_draft_layers * shape.hidden, device=dev, dtype=torch.bfloat16)
            lm = torch.ones(b, L, dtype=torch.long, device=dev)
            lengths = torch.full((b,), L, device=dev)
            anchors = torch.stack([torch.randperm(L - 1, device=dev)[:N] for _ in range(b)]).sort(-1).values
            keep = torch.ones(b, N, dtype=torch.bool, device=dev)
            for _ in range(steps):
                fd.step_backward(d, embed, head, ids, taps, lm, lengths, anchors, keep, block_size=block_size,
                                 mask_token_id=shape.vocab - 1, chunk_anchors=max(1, chunk_positions // block_size),
                                 head_chunk_rows=head_chunk_rows)
                opt.step()
                opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
    except torch.cuda.OutOfMemoryError as exc:
        from agent.classify import parse_cuda_oom

        info = parse_cuda_oom(str(exc)) or {}
        return {"role": role, "gpu": gpu, "oom": True, "message": str(exc).splitlines()[0][:400], **info}
    return {"role": role, "gpu": gpu, "oom": False, "peak_alloc": torch.cuda.max_memory_allocated(dev) - base,
            "peak_reserved": torch.cuda.max_memory_reserved(dev), "seconds": time.time() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", help="qwen3-8b | qwen3-27b-like | a config.json / model dir")
    ap.add_argument("--drafter-model", help="drafter widths if not the target's (same choices)")
    ap.add_argument("--role", choices=("drafter", "target", "both"), default="drafter")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--token-budget", default="49152")
    ap.add_argument("--max-seq-len", type=int, default=8192)
    ap.add_argument("--max-anchors", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-draft-layers", type=int, default=5)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--chunk-positions", type=int, default=16384)
    ap.add_argument("--head-chunk-rows", type=int, default=4096)
    ap.add_argument("--margin-gib", type=float, default=1.0)
    ap.add_argument("--capacity-gib", type=float, help="plan for a GPU of this size instead of reading free memory")
    ap.add_argument("--ballast-short-mib", type=float,
                    help="demonstration: first occupy GPU memory so that exactly this many MiB are missing")
    ap.add_argument("--run", action="store_true", help="also run the worst-case step and measure (even if refused)")
    a = ap.parse_args(argv)
    shape = shape_of(a.model)
    dshape = shape_of(a.drafter_model) if a.drafter_model else None
    kw = dict(block_size=a.block_size, max_anchors=a.max_anchors, max_seq_len=a.max_seq_len,
              num_draft_layers=a.num_draft_layers, max_batch_size=a.max_batch_size,
              chunk_positions=a.chunk_positions, head_chunk_rows=a.head_chunk_rows)
    roles = ["drafter", "target"] if a.role == "both" else [a.role]
    check_role = "colocated" if a.role == "both" else a.role
    kw["colocated"] = a.role == "both"
    margin = a.margin_gib * GIB
    ballast = None
    free = None
    if a.capacity_gib:
        free = a.capacity_gib * GIB
    else:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.set_device(a.gpu)
                free = float(torch.cuda.mem_get_info(a.gpu)[0])
        except Exception:  # noqa: BLE001
            free = None
    budget = a.token_budget
    if str(budget).lower() == "auto":
        if free is None:
            print("--token-budget auto needs --capacity-gib or a visible GPU", file=sys.stderr)
            return 2
        budget = auto_budget(shape, free, margin, role=check_role, drafter_shape=dshape, **kw)
        print(f"token budget auto: {budget} (largest multiple of 1024 whose predicted need + {a.margin_gib} GiB "
              f"margin fits {free / GIB:.2f} GiB on GPU {a.gpu})")
        if budget == 0:
            print(f"GPU {a.gpu}: not even one {a.max_seq_len}-token sequence fits", file=sys.stderr)
            return 2
    budget = int(budget)
    p = plan(shape, token_budget=budget, drafter_shape=dshape, **kw)
    if a.ballast_short_mib is not None and free is not None and not a.capacity_gib:
        import torch

        need = p[check_role]["need"] + margin
        size = int(free - need + a.ballast_short_mib * MIB)
        ballast = torch.empty(max(0, size), dtype=torch.uint8, device=f"cuda:{a.gpu}")
        free = float(torch.cuda.mem_get_info(a.gpu)[0])
        print(f"ballast: occupied {size / GIB:.2f} GiB on GPU {a.gpu}; free now {free / GIB:.2f} GiB")
    report = {"model": shape.name, "token_budget": budget, **kw, "gpu": a.gpu,
              "free_gib": None if free is None else free / GIB, "margin_gib": a.margin_gib,
              "predicted": {r: {"peak_gib": p[r]["peak"] / GIB, "need_gib": p[r]["need"] / GIB} for r in roles}}
    problems = refusals(p, {a.gpu: check_role}, {a.gpu: free} if free else {}, margin)
    for r in roles:
        print(f"GPU {a.gpu} {r}: predicted peak {p[r]['peak'] / GIB:.2f} GiB, needs {p[r]['need'] / GIB:.2f} GiB free"
              + ("" if free is None else f" (+{a.margin_gib} margin) of {free / GIB:.2f} GiB free"))
    rc = 0
    if problems:
        for line in problems:
            print("refused: " + line, file=sys.stderr)
        report["refused"] = problems
        rc = 2
    if a.run:
        for r in roles:
            m = run_worst_case(r, dshape if (dshape and r == "drafter") else shape, gpu=a.gpu, token_budget=budget,
                               **{k: v for k, v in kw.items() if k != "colocated"})
            if m.get("oom"):
                line = (f"GPU {a.gpu} ({r}): CUDA OOM in the worst-case step"
                        + (f", short by {m['short_mib']} MiB" if m.get("short_mib") is not None else ""))
                print(line, file=sys.stderr)
                rc = 3
            else:
                err = (p[r]["peak"] - m["peak_alloc"]) / m["peak_alloc"]
                m["model_error"] = err
                print(f"GPU {a.gpu} {r}: measured peak {m['peak_alloc'] / GIB:.2f} GiB allocated, "
                      f"{m['peak_reserved'] / GIB:.2f} GiB reserved; model error {100 * err:+.1f} %")
            report.setdefault("measured", {})[r] = {k: (v / GIB if k.startswith("peak") else v) for k, v in m.items()}
    print("--- probe json ---")
    print(json.dumps(report, default=str))
    print("--- probe json ---")
    del ballast
    return rc


if __name__ == "__main__":
    sys.exit(main())
