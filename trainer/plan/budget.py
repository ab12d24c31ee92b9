"""The memory plan of a trainer run before anything is loaded: each GPU's predicted reserved
peak (trainer/plan/memory.py) against its free memory, and ``--token-budget auto``.

Standard library only: the controller's launch preflight (controller/launch.py), the trainer
on every rank before it loads anything (train.memory_check) and the probe all call
:func:`plan_run` (re-exported as ``trainer.gpu.probe.plan_run``).

Need of a GPU = the predicted reserved peak of its role (allocated peak + the allocator's
fragmentation, steady state with AdamW state) + the CUDA context when the caller's free
figure still holds it + a margin (``MARGIN_MIB``) for the model's own error.

``auto`` takes whole ``--max-seq-len`` sequences (the model's worst case is full-length
sequences) and, among the budgets that fit every GPU with the margin, the one with the best
modelled throughput (trainer/plan/flops.py ``step_tok_s``: both roles at their measured MFU plus
the per-step optimizer cost). Throughput rises with the budget only while the per-step cost
is a noticeable share of a step, so beyond a point a larger budget buys nothing measurable
and costs headroom and optimizer steps per epoch: the choice is the smallest budget within
``AUTO_TOLERANCE`` of the best that fits (the largest that fits, 450,560 tokens, ran *slower*
than 49,152 on an H200, and died at step 2 under the default allocator).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

from trainer import family, flags
from trainer.plan import memory as mm
from trainer import runtime_env
from trainer.plan.flops import ModelShape, step_tok_s

GIB, MIB = mm.GIB, mm.MIB
MARGIN_MIB = 2048  # beyond the modelled reserve: the model's own error (≤ 5 % measured, docs/benchmarks.md)
CONTEXT_MIB = mm.CONTEXT_MIB
AUTO_TOLERANCE = 0.002  # a budget must buy more than 0.2 % modelled tok/s to be worth its memory
ROLE_NAMES = {"drafter": "drafter", "target": "target", "colocated": "target+drafter"}


def _cfg_of(values, target_config):
    if target_config is None:
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


def shapes(values, cfg: dict) -> tuple[ModelShape, ModelShape]:
    """(target, drafter) as the trainer builds them from this config.json (either layout of
    its family): the language model's numbers, and the drafter with the target's hidden,
    MLP and vocabulary widths and the attention widths trainer/model.py gives it
    (--drafter-attention, else the family's: a Qwen3.5/3.6 target's public drafters have
    32/8 × 128 whatever the target's own). Every drafter layer is dense attention."""
    target = ModelShape.from_hf_config(cfg)
    heads, kv_heads, head_dim = family.drafter_attention(cfg, values.get("drafter_attention"))
    drafter = replace(target, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, layer_types=(), linear=None)
    return target, drafter


def run_spec(values, cfg: dict, role: str, token_budget: int, alloc_conf: str | None = None) -> mm.RunSpec:
    """What the trainer these resolved flag values describe runs on one GPU of ``role``."""
    shape, drafter = shapes(values, cfg)
    text = family.text_config(cfg)
    layer_ids = values.get("target_layer_ids")
    n_draft = int(values["num_draft_layers"])
    n_tapped = len(_gpus(layer_ids)) if layer_ids not in (None, "", "auto") else n_draft
    return mm.RunSpec(
        shape, role, int(token_budget), int(values["max_seq_len"]), int(values["max_batch_size"]), n_draft, n_tapped,
        int(values["block_size"]), int(values["max_anchors"]), soft_labels=bool(values.get("use_soft_labels")),
        tied=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))), drafter=drafter,
        # a memory plan is for GPUs; a hybrid target's auto picks by the kernels importable here
        target_forward=flags.target_forward_for(values, cuda=True, target_config=cfg),
        n_drafter_ranks=len(_gpus(values.get("drafter_gpus"))) or 1,
        # a split target rank makes its next micro-batch while the last one is still being sent
        resident_microbatches=2 if role == "target" else 1,
        allocator=mm.allocator_of(runtime_env.ALLOC_CONF if alloc_conf is None else alloc_conf),
        drafter_arch=values.get("drafter_arch") or "dflash",
        # auto unresolved (the controller's preflight cannot see the GPU's FP8): planned as bf16, the larger
        target_precision="fp8" if values.get("target_precision") == "fp8" else "bf16",
        drafter_precision="fp8" if values.get("drafter_precision") == "fp8" else "bf16")


def predictions(values, cfg: dict, token_budget: int, alloc_conf: str | None = None) -> dict[str, mm.Prediction]:
    """Prediction per role present in the run (a role's GPUs all hold the same)."""
    roles = set(roles_by_gpu(values).values())
    return {r: mm.predict(run_spec(values, cfg, r, token_budget, alloc_conf)) for r in sorted(roles)}


def modelled_tok_s(values, cfg: dict, batch: int) -> float:
    s = run_spec(values, cfg, "drafter", batch * int(values["max_seq_len"]))
    by_gpu = roles_by_gpu(values)
    colocated = set(by_gpu.values()) == {"colocated"}
    n_t = len(_gpus(values.get("target_gpus"))) or 1
    n_d = len(_gpus(values.get("drafter_gpus"))) or 1
    return step_tok_s(s.target, s.dshape, seq_len=s.seq_len, batch=batch, anchors_per_seq=s.max_anchors,
                      block_size=s.block_size, n_layers=s.n_draft_layers, drafter_params=mm.drafter_params(s),
                      grad_accum=int(values.get("grad_accum") or 1), n_target=n_t, n_drafter=n_d,
                      colocated=colocated, soft_labels=s.soft_labels)


def _need(p: mm.Prediction, context_mib: float, margin_mib: float) -> float:
    return p.reserved + (context_mib + margin_mib) * MIB


def largest_fitting_batch(values, cfg: dict, role: str, free_bytes: float, *, margin_mib: float = MARGIN_MIB,
                          context_mib: float = CONTEXT_MIB, alloc_conf: str | None = None) -> int:
    """Most full-length sequences per micro-batch (≤ --max-batch-size) whose need fits; 0 if none."""
    L = int(values["max_seq_len"])

    def fits(b):
        return _need(mm.predict(run_spec(values, cfg, role, b * L, alloc_conf)), context_mib, margin_mib) <= free_bytes

    lo, hi, best = 1, int(values["max_batch_size"]), 0
    while lo <= hi:  # the need grows with b
        m = (lo + hi) // 2
        if fits(m):
            best, lo = m, m + 1
        else:
            hi = m - 1
    return best


def choose_batch(values, cfg: dict, cap: int) -> tuple[int, float, float]:
    """(sequences per micro-batch, its modelled tok/s, the best modelled tok/s ≤ cap): the
    smallest b ≤ cap within AUTO_TOLERANCE of the best. Monotone in ``cap``, so the minimum
    over ranks of each rank's choice is the choice for the smallest rank's cap."""
    rates = [modelled_tok_s(values, cfg, b) for b in range(1, cap + 1)]
    best = max(rates)
    b = next(i + 1 for i, r in enumerate(rates) if r >= (1 - AUTO_TOLERANCE) * best)
    return b, rates[b - 1], best


def plan_run(values, gpu_free_mib: dict | None, target_config=None, *, margin_mib: float = MARGIN_MIB,
             context_mib: float = CONTEXT_MIB, alloc_conf: str | None = None) -> dict:
    """Preflight for one trainer process group (one container): resolve ``--token-budget
    auto`` and check every role's predicted need against its GPU's free memory.

    values: resolved flag values (flags.py dests); gpu_free_mib: {GPU index: free MiB} for
    the GPUs named in --target-gpus/--drafter-gpus (a GPU left out is not checked; None or
    {} = no device memory known, e.g. CPU); target_config: the target's config.json as a
    dict (read from --target-model when None). context_mib: the CUDA context not yet in the
    free figure (0 when measured inside a process that already holds its context).
    alloc_conf: PYTORCH_CUDA_ALLOC_CONF of the run (None: what the trainer sets when unset).

    Returns {"token_budget", "auto", "auto_reason", "drafter_step", "margin_mib", "allocator",
    "gpus": {gpu: {role, peak_mib (allocated), reserved_mib, need_mib, free_mib, short_mib,
    exact, phase}}, "refusals": [line, ...], "notes": [...]}. A launch must be refused when
    "refusals" is non-empty."""
    cfg = _cfg_of(values, target_config)
    free = {int(g): float(v) for g, v in (gpu_free_mib or {}).items()}
    by_gpu = roles_by_gpu(values)
    step = flags.drafter_step_for(values, cuda=True)  # a memory plan is for GPUs
    chunked = step == "chunked"
    L = int(values["max_seq_len"])
    allocator = mm.allocator_of(runtime_env.ALLOC_CONF if alloc_conf is None else alloc_conf)
    out = {"token_budget": values.get("token_budget"), "auto": False, "auto_reason": None, "drafter_step": step,
           "margin_mib": margin_mib, "allocator": allocator.name, "gpus": {}, "refusals": [], "notes": []}
    kw = dict(margin_mib=margin_mib, context_mib=context_mib, alloc_conf=alloc_conf)
    # the numbers the model reads, checked as the trainer checks its target (a dict of dense
    # numbers without a model_type, as benchmark shapes write it, is Qwen3's)
    why = family.unsupported(cfg if cfg.get("model_type") is not None else {**cfg, "model_type": family.QWEN3})
    if why:
        out["refusals"].append(f"no memory plan for this target: {why}")
        return out
    try:
        shapes(values, cfg)
    except ValueError as exc:  # a --drafter-attention that does not parse names itself
        out["refusals"].append(str(exc))
        return out
    if values.get("token_budget") == "auto":
        out["auto"] = True
        if not chunked:
            out["refusals"].append("--token-budget auto needs --drafter-step chunked: the memory model "
                                   "(trainer/plan/memory.py) describes the chunked drafter step; the reference step holds "
                                   "~2 MB per drafted position and is not modelled — give a number or use chunked")
            return out
        known = {g: r for g, r in by_gpu.items() if g in free}
        if not known:
            out["refusals"].append("--token-budget auto fits the budget to free GPU memory and none is known here "
                                   "(CPU run, or no GPU of --target-gpus/--drafter-gpus measured): give a number, "
                                   f"e.g. --token-budget {L}")
            return out
        caps = {g: largest_fitting_batch(values, cfg, r, free[g] * MIB, **kw) for g, r in known.items()}
        cap = min(caps.values())
        out["auto_per_gpu"] = {g: c * L for g, c in caps.items()}
        if cap == 0:
            out["token_budget"] = L  # report the one-sequence shortfall below
        else:
            b, rate, best = choose_batch(values, cfg, cap)
            out["token_budget"] = b * L
            out["auto_tok_s"] = round(rate, 1)
            tight = min(caps, key=caps.get)
            out["auto_reason"] = (
                f"{b * L} ({b} × {L} tokens): modelled {rate:,.0f} tok/s, within {100 * AUTO_TOLERANCE:.1f} % of the "
                f"best that fits ({cap * L}: {best:,.0f} tok/s; larger budgets buy less and cost memory headroom); "
                f"GPU {tight} ({ROLE_NAMES[known[tight]]}) fits at most {cap} sequences with a "
                f"{margin_mib / 1024:.0f} GiB margin")
    budget = int(out["token_budget"])
    preds = predictions(values, cfg, budget, alloc_conf)
    for g, role in sorted(by_gpu.items()):
        p = preds[role]
        exact = chunked or role == "target"
        need = _need(p, context_mib, margin_mib)
        row = {"role": role, "peak_mib": round(p.allocated / MIB, 1), "reserved_mib": round(p.reserved / MIB, 1),
               "need_mib": round(need / MIB, 1), "exact": exact, "phase": p.peak_phase, "free_mib": free.get(g),
               "short_mib": None}
        out["gpus"][g] = row
        if g not in free:
            continue
        short = need - free[g] * MIB
        if short > 0:
            row["short_mib"] = math.ceil(short / MIB)
            fit = largest_fitting_batch(values, cfg, role, free[g] * MIB, **kw) * L
            fix = (f"lower --token-budget to {fit}" if fit else f"not even one --max-seq-len {L} sequence fits: lower "
                   "--max-seq-len") + " or --max-anchors, or use a GPU with more free memory"
            at_least = "" if exact else " at least"
            out["refusals"].append(
                f"GPU {g} ({ROLE_NAMES[role]}) needs{at_least} {need / GIB:.1f} GiB (predicted reserved peak "
                f"{p.reserved / GIB:.1f} + CUDA context {context_mib / 1024:.1f} + margin {margin_mib / 1024:.1f}), "
                f"has {free[g] / 1024:.1f} GiB free: short by {row['short_mib']} MiB; {fix}")
        elif not exact:
            out["notes"].append(
                f"GPU {g} ({ROLE_NAMES[role]}): --drafter-step reference is not modelled; the chunked step's "
                f"{need / GIB:.1f} GiB is a lower bound (the reference step holds ~2 MB per drafted position): "
                "measure with --probe-memory, or use --drafter-step chunked")
    return out


def probe_refusal(gpu, role: str, measured_reserved_mib: float, capacity_mib: float | None, *,
                  margin_mib: float = MARGIN_MIB, fits_budget: int | None = None) -> dict:
    """The measured probe's verdict for one GPU: the worst case's reserved peak over two
    optimizer steps + the margin against ``capacity_mib`` (the GPU's free memory when the
    probe started, or --probe-capacity-mib). {"need_mib", "short_mib", "line"}; no check
    (short_mib and line None) without a capacity. ``fits_budget``: a budget to suggest."""
    need = measured_reserved_mib + margin_mib
    out = {"need_mib": round(need, 1), "short_mib": None, "line": None}
    if capacity_mib is None or need <= capacity_mib:
        return out
    out["short_mib"] = math.ceil(need - capacity_mib)
    fix = (f"lower --token-budget to {fits_budget} (the model's largest that fits) or use --token-budget auto"
           if fits_budget else "lower --token-budget or --max-anchors, or use a GPU with more free memory")
    out["line"] = (f"GPU {gpu} ({ROLE_NAMES.get(role, role)}): the worst case measured over two optimizer steps needs "
                   f"{need / 1024:.1f} GiB (reserved peak {measured_reserved_mib / 1024:.1f} + margin "
                   f"{margin_mib / 1024:.1f}), has {capacity_mib / 1024:.1f} GiB: short by {out['short_mib']} MiB; {fix}")
    return out
