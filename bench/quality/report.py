"""The results table (markdown) and the τ-vs-steps plot (PNG), from results.json."""

from __future__ import annotations

import json
import sys


def _f(v, fmt="{:.2f}"):
    return "—" if v is None else fmt.format(v)


def table(results: dict) -> str:
    budgets = results["config"]["tree_budgets"]
    head = ["variant", "steps", "τ block"] + [f"τ tree {b}" for b in budgets] + \
           ["speedup block"] + [f"speedup tree {b}" for b in budgets] + ["lossless", "final loss"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, v in results["variants"].items():
        fin = v.get("final") or {}
        blk = fin.get("block") or {}
        trees = fin.get("tree") or {}
        checked = [blk] + [trees.get(str(b)) for b in budgets]
        checked = [c for c in checked if c]
        lossless = "—"
        if checked:  # "yes (4×12)": 4 decoders (block + 3 tree budgets) × 12 prompts, all equal to greedy
            verdict = "yes" if all(c["lossless"] for c in checked) else "NO"
            lossless = f"{verdict} ({len(checked)}×{blk.get('prompts', 0)})"
        if v.get("error") or fin.get("tree_errors"):
            lossless = ("" if lossless == "—" else lossless + "; ") + "FAILED (see results.json)"
        elif v.get("skipped"):
            lossless = f"skipped ({v['skipped']})"
        row = [name, str(v.get("steps", "—")), _f(blk.get("tau"))]
        row += [_f((trees.get(str(b)) or {}).get("tau")) for b in budgets]
        row += [_f(blk.get("speedup"), "{:.2f}×")]
        row += [_f((trees.get(str(b)) or {}).get("speedup"), "{:.2f}×") for b in budgets]
        row += [lossless, _f(v.get("final_loss"), "{:.3f}")]
        lines.append("| " + " | ".join(row) + " |")
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
    with open(sys.argv[1]) as fh:
        print(table(json.load(fh)))
