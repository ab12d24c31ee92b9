"""The results tables (markdown), the τ-vs-steps plot (PNG) and summary.json's figures, from
results.json."""

from __future__ import annotations

import json
import sys


def _f(v, fmt="{:.2f}"):
    return "—" if v is None else fmt.format(v)


def categories(results: dict) -> list[str]:
    """The categories any final block decode was measured by, in the corpus's order."""
    seen = {c for v in results["variants"].values()
            for c in (((v.get("final") or {}).get("block") or {}).get("by_category") or {})}
    return [c for c in results["config"].get("categories") or sorted(seen) if c in seen]


def table(results: dict) -> str:
    budgets = results["config"]["tree_budgets"]
    cats = categories(results)
    head = ["variant", "steps", "τ block"] + [f"τ block {c}" for c in cats] + ["τ served fp32", "τ served bf16"] + \
           [f"τ tree {b}" for b in budgets] + ["speedup block"] + [f"speedup tree {b}" for b in budgets] + \
           ["lossless", "final loss"]
    # eval.served_vllm: vLLM's τ (its counters) on the bf16 export, beside the trained τ
    vllm = any(((v.get("final") or {}).get("served") or {}).get("vllm") for v in results["variants"].values())
    if vllm:
        head[5 + len(cats):5 + len(cats)] = ["τ served vLLM (gate)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, v in results["variants"].items():
        fin = v.get("final") or {}
        blk = fin.get("block") or {}
        trees = fin.get("tree") or {}
        served = fin.get("served") or {}
        checked = [blk] + [trees.get(str(b)) for b in budgets] + list(served.values())
        checked = [c for c in checked if c]
        lossless = "—"
        if checked:  # "yes (6×12)": 6 decoders (block, 3 tree budgets, 2 served) × 12 prompts, all equal to greedy
            verdict = "yes" if all(c["lossless"] for c in checked) else "NO"
            lossless = f"{verdict} ({len(checked)}×{blk.get('prompts', 0)})"
        if v.get("error") or fin.get("tree_errors"):
            lossless = ("" if lossless == "—" else lossless + "; ") + "FAILED (see results.json)"
        elif v.get("skipped"):
            lossless = f"skipped ({v['skipped']})"
        row = [name, str(v.get("steps", "—")), _f(blk.get("tau"))]
        row += [_f((blk.get("by_category") or {}).get(c)) for c in cats]
        row += [_f((served.get(k) or {}).get("tau")) + ("" if k == "bf16" or (served.get(k) or {}).get("equal_to_block") in (None, True)
                                                          else " (≠ block)") for k in ("fp32", "bf16")]
        if vllm:
            g = served.get("vllm") or {}
            row += [_f(g.get("tau_served"), "{:.3f}") + ("" if not g else " (pass)" if g.get("ok") else " (FAIL)")]
        row += [_f((trees.get(str(b)) or {}).get("tau")) for b in budgets]
        row += [_f(blk.get("speedup"), "{:.2f}×")]
        row += [_f((trees.get(str(b)) or {}).get("speedup"), "{:.2f}×") for b in budgets]
        row += [lossless, _f(v.get("final_loss"), "{:.3f}")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _verified(v: dict, prec: str) -> dict:
    return ((v.get("final") or {}).get("verify") or {}).get(prec) or {}


def fp8_tables(results: dict) -> str:
    """FP8 taps against bf16 taps (markdown, "" when the run measured neither): each drafter's
    τ with the verifying target in bf16 and in FP8, overall and per category, by the precision
    of the taps it trained on and its seed; then the taps' error per tapped layer."""
    precs = sorted({p for v in results["variants"].values() for p in ((v.get("final") or {}).get("verify") or {})},
                   key=lambda p: (p != "bf16", p))
    cats = categories(results)
    parts = []
    if precs:
        head = ["variant", "taps", "seed"] + [f"τ {p} target" for p in precs] + \
               [f"τ {p} target: {c}" for p in precs for c in cats] + ["equal to that target's greedy"]
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for name, v in results["variants"].items():
            if not v.get("final"):
                continue
            row = [v.get("variant", name), v.get("taps", "bf16"), str(v.get("seed", results["config"].get("seed", 0)))]
            row += [_f(_verified(v, p).get("tau")) for p in precs]
            row += [_f((_verified(v, p).get("by_category") or {}).get(c)) for p in precs for c in cats]
            row += [" / ".join(f"{p} {'yes' if _verified(v, p).get('lossless') else 'NO'}" for p in precs)]
            lines.append("| " + " | ".join(row) + " |")
        parts.append("\n".join(lines))
        spread = fp8_spread(results, "bf16")
        if spread:
            parts.append("τ on the bf16 target, mean over seeds [min, max]: " + "; ".join(
                f"{taps} taps {m:.2f} [{lo:.2f}, {hi:.2f}] ({n} seed{'s' * (n > 1)})"
                for taps, (m, lo, hi, n) in spread.items()))
    te = results.get("tap_error")
    if te:
        head = ["tapped layer", "FP8 vs bf16: rel L2", "max abs", "bf16 vs fp32: rel L2", "max abs", "max |tap|"] + \
               [f"rel L2 {c}" for c in te["layers"][0]["by_category"]]
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for r in te["layers"]:
            row = [str(r["layer"]), f"{r['fp8_vs_bf16']['rel_l2']:.2e}", f"{r['fp8_vs_bf16']['max_abs']:.3g}",
                   f"{r['bf16_vs_fp32']['rel_l2']:.2e}", f"{r['bf16_vs_fp32']['max_abs']:.3g}",
                   f"{r['max_abs_tap']:.3g}"] + [f"{e['rel_l2']:.2e}" for e in r["by_category"].values()]
            lines.append("| " + " | ".join(row) + " |")
        parts.append("\n".join(lines) + f"\n\n({te['positions']} held-out positions, target in {te['dtype']})")
    return "\n\n".join(parts)


def fp8_spread(results: dict, prec: str = "bf16") -> dict:
    """{taps precision: (mean τ, min, max, seeds)} of the drafters verified by the ``prec`` target."""
    by: dict[str, list[float]] = {}
    for v in results["variants"].values():
        t = _verified(v, prec).get("tau")
        if t is not None:
            by.setdefault(v.get("taps", "bf16"), []).append(t)
    return {k: (sum(x) / len(x), min(x), max(x), len(x)) for k, x in sorted(by.items())}


def summary(results: dict) -> dict:
    """The figures a README quotes (summary.json): τ block overall and per category for every
    variant, and where measured the FP8 comparison — τ per taps precision and seed on each
    verifying target, the two-seed spread on the bf16 target and whether FP8 taps' mean lies
    within bf16 taps' spread (|mean fp8 − mean bf16| ≤ max − min of bf16's seeds), and the
    taps' error per layer."""
    c = results["config"]
    out = {"question": "How many tokens does a drafter get accepted (tau), per objective, architecture, "
                       "category and taps precision?",
           "readme": "bench/quality/README.md", "scale": c.get("scale"), "device": c.get("device"),
           "torch": c.get("torch"), "categories": categories(results), "tau_block": {}}
    for name, v in results["variants"].items():
        blk = (v.get("final") or {}).get("block")
        if blk:
            out["tau_block"][name] = {"all": round(blk["tau"], 3), "lossless": blk["lossless"],
                                      **{k: round(t, 3) for k, t in (blk.get("by_category") or {}).items()}}
    verified = {name: {p: {"all": round(r["tau"], 3), "lossless": r["lossless"],
                           **{k: round(t, 3) for k, t in (r.get("by_category") or {}).items()}}
                       for p, r in ((v.get("final") or {}).get("verify") or {}).items()}
                for name, v in results["variants"].items() if (v.get("final") or {}).get("verify")}
    if verified:
        spread = fp8_spread(results, "bf16")
        fp8 = {"tau_by_verifying_target": verified,
               "bf16_target_spread": {k: {"mean": round(m, 3), "min": round(lo, 3), "max": round(hi, 3), "seeds": n}
                                      for k, (m, lo, hi, n) in spread.items()}}
        if "bf16" in spread and "fp8" in spread and spread["bf16"][3] >= 2:
            fp8["fp8_taps_within_bf16_spread"] = abs(spread["fp8"][0] - spread["bf16"][0]) <= \
                spread["bf16"][2] - spread["bf16"][1]
        out["fp8"] = fp8
    if results.get("tap_error"):
        out.setdefault("fp8", {})["tap_error"] = [
            {"layer": r["layer"], "rel_l2": round(r["fp8_vs_bf16"]["rel_l2"], 5),
             "max_abs": round(r["fp8_vs_bf16"]["max_abs"], 4), "bf16_vs_fp32_rel_l2": round(r["bf16_vs_fp32"]["rel_l2"], 5)}
            for r in results["tap_error"]["layers"]]
    return out


def _decoder(v: dict, kind: str):
    fin = v.get("final") or {}
    return fin.get("block") if kind == "block" else (fin.get("tree") or {}).get(kind)


def paired_deltas(results: dict, kind: str = "block", base: str = "decay", n_boot: int = 2000,
                  seed: int = 0) -> dict:
    """τ of each variant minus the ``base`` variant's, with a 95 % paired bootstrap interval
    over prompts (every variant decoded the same prompts, so resampling them together removes
    what prompt choice moves in all variants alike). τ is pooled as in measure.decode_all:
    committed tokens over target forwards. ``kind``: "block" or a tree budget ("16").
    {variant: (Δτ, low, high)}; variants without per-prompt counts are left out."""
    import numpy as np

    ref = _decoder(results["variants"].get(base) or {}, kind)
    if not ref or "per_prompt" not in ref:
        return {}
    b = np.array(ref["per_prompt"], dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(b), size=(n_boot, len(b)))

    def tau(counts, rows=None):
        c = counts if rows is None else counts[rows]
        return c[..., 0].sum(-1) / c[..., 1].sum(-1)

    out = {}
    for name, v in results["variants"].items():
        dec = _decoder(v, kind)
        if not dec or "per_prompt" not in dec or len(dec["per_prompt"]) != len(b):
            continue
        a = np.array(dec["per_prompt"], dtype=np.float64)
        boots = tau(a, idx) - tau(b, idx)
        lo, hi = np.percentile(boots, [2.5, 97.5])
        out[name] = (float(tau(a) - tau(b)), float(lo), float(hi))
    return out


def delta_table(results: dict, base: str = "decay") -> str:
    """Markdown: Δτ against ``base`` [95 % interval] for block and every tree budget."""
    kinds = ["block"] + [str(b) for b in results["config"]["tree_budgets"]]
    cols = {k: paired_deltas(results, k, base) for k in kinds}
    head = ["variant"] + [("Δτ block" if k == "block" else f"Δτ tree {k}") for k in kinds]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in results["variants"]:
        if name == base or not any(name in c for c in cols.values()):
            continue
        cells = [name]
        for k in kinds:
            d = cols[k].get(name)
            cells.append("—" if d is None else f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: str) -> bool:
    """τ (block verification) against training steps, one line per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for name, v in results["variants"].items():
        curve = v.get("curve") or []
        if curve:
            ax.plot([c[0] for c in curve], [c[1] for c in curve], marker="o", label=name)
    c = results["config"]
    ax.set_xlabel("drafter optimizer steps")
    ax.set_ylabel("τ (tokens per target forward, block)")
    ax.set_title(f"acceptance length vs training — {c['scale']} scale, block {c['block_size']}, "
                 f"{c['curve_prompts']} held-out prompts", fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


if __name__ == "__main__":  # python3 bench/quality/report.py results.json → the table
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        print("usage: python3 bench/quality/report.py RESULTS.json   (run.py's results: the table)")
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    with open(sys.argv[1]) as fh:
        print(table(json.load(fh)))
