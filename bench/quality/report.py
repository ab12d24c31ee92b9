"""The results table (markdown) and the τ-vs-steps plot (PNG), from results.json."""

from __future__ import annotations

import json
import sys


def _f(v, fmt="{:.2f}"):
    return "—" if v is None else fmt.format(v)


def table(results: dict) -> str:
    budgets = results["config"]["tree_budgets"]
    head = ["variant", "steps", "τ block", "τ served fp32", "τ served bf16"] + [f"τ tree {b}" for b in budgets] + \
           ["speedup block"] + [f"speedup tree {b}" for b in budgets] + ["lossless", "final loss"]
    # eval.served_vllm: vLLM's τ (its counters) on the bf16 export, beside the trained τ
    vllm = any(((v.get("final") or {}).get("served") or {}).get("vllm") for v in results["variants"].values())
    if vllm:
        head[5:5] = ["τ served vLLM (gate)"]
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
