"""Acceptance length, wall-clock speedup and losslessness of a drafter on evaluation prompts.

Three decoders share one target (fp32, no KV cache: each forward recomputes the prefix):
plain greedy (trainer.evaluate.greedy, the reference output and the baseline time), block
verification (trainer.evaluate.speculative) and tree verification (trainer.ddtree). τ is
pooled over all rounds of all prompts: committed tokens per target forward, bonus included.
Every speculative output is compared with the greedy one, token for token, on every prompt.
"""

from __future__ import annotations

import os
import time

import torch

from trainer.serve.ddtree import speculative_tree
from trainer.serve.evaluate import greedy, speculative


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def reference(target, prompts, max_new: int, device) -> dict:
    """Greedy outputs (the lossless reference) and their total time."""
    greedy(target, prompts[0], 4, device)  # warm-up: kernels chosen before timing
    outs, times = [], []
    for p in prompts:
        o, dt = _timed(lambda: greedy(target, p, max_new, device), device)
        outs.append(o)
        times.append(dt)
    return {"outputs": outs, "seconds": sum(times), "per_prompt_seconds": times, "tokens": len(prompts) * max_new}


def decode_all(kind: str, target, drafter, head, prompts, refs: dict, max_new: int, device,
               budget: int | None = None) -> dict:
    """One decoder over ``prompts`` (the first len(prompts) of the reference's): τ, per-prompt
    losslessness, time, speedup vs greedy on the same prompts."""
    if kind == "block":
        run = lambda p, n: speculative(target, drafter, head, p, n, device)  # noqa: E731
    else:
        run = lambda p, n: speculative_tree(target, drafter, head, p, n, budget, device)  # noqa: E731
    run(prompts[0], 4)  # warm-up
    counts: list[int] = []
    per_prompt: list[list[int]] = []  # [committed tokens, target forwards]: for intervals over prompts
    mismatches: list[dict] = []
    total = 0.0
    for i, p in enumerate(prompts):
        (out, per_forward), dt = _timed(lambda: run(p, max_new), device)
        total += dt
        counts += per_forward
        per_prompt.append([sum(per_forward), len(per_forward)])
        ref = refs["outputs"][i]
        if out != ref:
            first = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            mismatches.append({"prompt": i, "first_diff": first})
    return {"tau": sum(counts) / max(1, len(counts)), "forwards": len(counts), "seconds": total,
            "speedup": sum(refs["per_prompt_seconds"][:len(prompts)]) / total if total > 0 else None,
            "lossless": not mismatches, "prompts": len(prompts), "mismatches": mismatches,
            "per_prompt": per_prompt}


def load_target(target_dir: str, d: dict, device, dtype=torch.float32, precision: str = "bf16"):
    """The evaluation target (fp32 unless ``dtype`` says otherwise; ``precision`` "fp8": its
    decoder's linear layers in e4m3 as ``--target-precision fp8`` loads them, trainer/gpu/fp8.py;
    taps for a drafter of budget ``d``) and the frozen head the drafters share: (drafter
    config, target, head)."""
    from trainer.model import DrafterConfig, FrozenHead
    from trainer.target import Target, read_config

    ids = [int(x) for x in d["target_layer_ids"].split(",")] if d.get("target_layer_ids") else None
    dcfg = DrafterConfig.from_target(read_config(target_dir), d["layers"], d["block_size"], None, ids)
    target = Target(target_dir, dcfg.target_layer_ids, device, dtype, precision=precision)
    return dcfg, target, FrozenHead(target.embed, target.lm_head)


def trainer_dtype(device) -> torch.dtype:
    """The dtype the trainer loads its target in on ``device`` (trainer/train.py): what a
    drafter's taps were made in, and what it is verified against as the trainer would."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def by_category(per_prompt: list[list[int]], categories: list[str]) -> dict[str, float]:
    """τ pooled per category from per-prompt [committed, forwards] counts (decode_all's
    ``per_prompt``; ``categories`` gives each prompt's, in the same order)."""
    sums: dict[str, list[int]] = {}
    for (tokens, forwards), cat in zip(per_prompt, categories):
        acc = sums.setdefault(cat, [0, 0])
        acc[0] += tokens
        acc[1] += forwards
    return {cat: tokens / max(1, forwards) for cat, (tokens, forwards) in sums.items()}


def _errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (got.double() - ref.double())
    return {"rel_l2": float(d.norm() / ref.double().norm().clamp(min=1e-30)), "max_abs": float(d.abs().max())}


@torch.no_grad()
def tap_error(target_dir: str, layer_ids: list[int], windows: dict[str, list[list[int]]], device) -> dict:
    """The taps of ``--target-precision fp8`` against bf16's, per tapped layer, on ``windows``
    (held-out text per category, equal-length rows): relative L2 (‖fp8 − bf16‖ / ‖bf16‖ over
    every position and channel) and max |fp8 − bf16|; beside them bf16's own error against fp32
    (how large the rounding the drafters always trained with is) and the largest |tap|. Both
    precisions in bf16, as the GPU trainer loads the target (on CPU the FP8 GEMMs are emulated
    with the same arithmetic). {"layers": [{layer, fp8_vs_bf16, bf16_vs_fp32, max_abs_tap,
    by_category: {cat: fp8_vs_bf16}}], "all": fp8_vs_bf16 pooled over layers, "positions"}."""
    from trainer.target import Target

    def taps(dtype, precision):
        t = Target(target_dir, layer_ids, device, dtype, precision=precision)
        out = {}
        for cat, rows in windows.items():
            x, _ = t.forward(torch.tensor(rows, device=device), want_final=False)
            out[cat] = x.float().view(*x.shape[:-1], len(layer_ids), -1).cpu()
        del t
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        return out

    ref, fp8, full = taps(torch.bfloat16, "bf16"), taps(torch.bfloat16, "fp8"), taps(torch.float32, "bf16")
    cats = list(windows)

    def flat(t: dict, j: int | None = None) -> torch.Tensor:  # every category's positions, one layer or all
        return torch.cat([(t[c] if j is None else t[c][..., j, :]).reshape(-1) for c in cats])

    layers = []
    for j, layer in enumerate(layer_ids):
        layers.append({"layer": layer, "fp8_vs_bf16": _errors(flat(fp8, j), flat(ref, j)),
                       "bf16_vs_fp32": _errors(flat(ref, j), flat(full, j)), "max_abs_tap": float(flat(ref, j).abs().max()),
                       "by_category": {c: _errors(fp8[c][..., j, :], ref[c][..., j, :]) for c in cats}})
    return {"layers": layers, "all": _errors(flat(fp8), flat(ref)),
            "positions": int(sum(len(r) * len(r[0]) for r in windows.values())), "dtype": "bfloat16"}


def block_tau(target, drafter, head, prompts, max_new: int, device) -> float:
    """τ only (the τ-vs-steps curve): block verification, no reference, no timing."""
    counts: list[int] = []
    for p in prompts:
        counts += speculative(target, drafter, head, p, max_new, device)[1]
    return sum(counts) / max(1, len(counts))


@torch.no_grad()
def tree_pass_error(target, prompt: list[int], vocab: int, device, budget: int = 8) -> float:
    """Largest |logit| difference between one tree pass (random tree) and plain causal passes
    along each of its paths: float noise when this transformers build honours the custom 4D
    mask and positions, large when it does not (then tree τ would be meaningless)."""
    from trainer.serve.ddtree import build_tree, target_tree_forward, tree_mask

    g = torch.Generator().manual_seed(0)
    tokens, parents, depths = build_tree(torch.randn(3, vocab, generator=g).log_softmax(-1), budget)
    n, bonus = len(prompt), prompt[-1]
    mask = tree_mask(n, parents, target.model.dtype, device)
    _, logits = target_tree_forward(target, prompt + [bonus] + tokens, list(range(n + 1)) + [n + d for d in depths],
                                    mask, device)
    worst = 0.0
    for i in range(1, len(tokens) + 1):
        path, j = [], i
        while j:
            path.append(tokens[j - 1])
            j = parents[j - 1]
        _, ref = target.forward_logits(torch.tensor([prompt + [bonus] + path[::-1]], device=device))
        worst = max(worst, float((logits[0, n + i] - ref[0, -1]).abs().max()))
    return worst


@torch.no_grad()
def served(export_dir: str, target, prompts, refs: dict, max_new: int, device, block: dict | None = None) -> dict:
    """τ and losslessness through the export's own modeling file: ``AutoModel.from_pretrained(
    export_dir, trust_remote_code=True, dtype="auto")`` and its ``spec_generate`` against the
    evaluation target's transformers model, on the same prompts. ``equal_to_block``: the same
    committed tokens and target forwards per prompt as block verification (``block``)."""
    from transformers import AutoModel

    dr = AutoModel.from_pretrained(export_dir, trust_remote_code=True, dtype="auto").to(device).eval()
    counts: list[int] = []
    per_prompt: list[list[int]] = []
    mismatches: list[dict] = []
    for i, p in enumerate(prompts):
        r = dr.spec_generate(target.model, torch.tensor([p], device=device), max_new, return_stats=True)
        out, ref = r.output_ids[0, len(p):].tolist(), refs["outputs"][i]
        counts += r.acceptance_lengths
        per_prompt.append([sum(r.acceptance_lengths), len(r.acceptance_lengths)])
        if out != ref:
            first = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            mismatches.append({"prompt": i, "first_diff": first})
    return {"tau": sum(counts) / max(1, len(counts)), "lossless": not mismatches, "mismatches": mismatches,
            "prompts": len(prompts), "per_prompt": per_prompt, "dtype": str(dr.dtype).replace("torch.", ""),
            "equal_to_block": None if block is None else per_prompt == block.get("per_prompt")}


def served_all(step_dir: str, work: str, target, prompts, refs: dict, max_new: int, device, block: dict) -> dict:
    """The final checkpoint exported twice — fp32 (the evaluator's numbers: on CPU its τ must
    equal block verification's) and bf16 (the default export, what a server runs) — and each
    decoded by ``served``."""
    import shutil

    from trainer.serve.export import export

    out = {}
    for dtype in ("fp32", "bf16"):
        d = os.path.join(work, dtype)
        shutil.rmtree(d, ignore_errors=True)
        export(step_dir, d, dtype=dtype)
        out[dtype] = served(d, target, prompts, refs, max_new, device, block)
    return out
