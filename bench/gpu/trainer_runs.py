"""Figures of the `python -m trainer` runs on H200s (device calls 4 and 5) from their raw
outputs in bench/results/trainer_and_quality/ and bench/results/operators_layouts/: tokens/s, drafted positions/s, drafter wait, MFU per role
(trainer/flops.py's count, against 989 TFLOP/s), peaks, and the split of 8 GPUs between the
roles that the measured per-GPU rates imply (flops.gpus_per_role).

    python3 bench/gpu/trainer_runs.py            # prints the markdown for docs/benchmarks.md

Steps after the first are "steady" (the first holds the compiles). Every run used the
operators' objective flags (soft labels → the target runs all its layers and the drafter side
recomputes teacher logits at every drafted position); synthetic data is all 8,192-token
sequences with the loss mask from 10 % on, so anchors average position ≈ 0.55 × 8,192.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from trainer import flops as fl  # noqa: E402

RESULTS = os.path.join(os.path.dirname(HERE), "results")  # bench/results/<topic>/
L, ANCHORS, BLOCK, LAYERS = 8192, 1024, 32, 5
MEAN_ANCHOR = int(0.55 * L)


def steps_from_jsonl(path: str) -> list[dict]:
    return [e for e in map(json.loads, open(path)) if e.get("kind") == "step"]


def steps_from_log(path: str, run: str) -> list[dict]:
    """Step events printed by bench/gpu/agent_run.sh as `[run] {json}` lines (cut at 420 chars)."""
    out = []
    for line in open(path):
        m = re.match(r"\[(\w+)\] (\{.*)", line.strip())
        if not m or m.group(1) != run or '"kind": "step"' not in m.group(2):
            continue
        body = m.group(2)
        ev = {}
        for key in ("step", "tokens", "tokens_per_s", "drafted_per_s", "mem_peak_mib", "wait_s"):
            km = re.search(rf'"{key}": ([0-9.eE+-]+)', body)
            if km:
                ev[key] = float(km.group(1))
        out.append(ev)
    return out


def per_sequence_flops(shape) -> tuple[float, float]:
    """(target forward, drafter step incl. teacher logits) FLOP for one 8,192-token sequence."""
    t = fl.target_forward_flops(shape, [L], last_layer=shape.n_layers - 1)
    d = fl.drafter_step_flops(shape, n_layers=LAYERS, block_size=BLOCK, n_blocks=ANCHORS, ctx_tokens=L,
                              visible_ctx_pairs=ANCHORS * BLOCK * MEAN_ANCHOR,
                              teacher_positions=ANCHORS * (BLOCK - 1))["total"]
    return t, d


def summarize(name: str, steps: list[dict], shape, target_gpus: int, drafter_gpus: int, colocated: bool) -> dict:
    steady = [s for s in steps if s["step"] >= 2]
    tok = statistics.median(s["tokens_per_s"] for s in steady)
    wait = statistics.median(s["wait_s"] for s in steady)
    tokens = steady[0]["tokens"]
    step_s = tokens / tok
    seqs = tokens / L
    t_f, d_f = per_sequence_flops(shape)
    row = {"run": name, "steps": len(steady), "tok_s": tok, "drafted_s": statistics.median(s["drafted_per_s"] for s in steady),
           "wait_s": wait, "step_s": step_s, "peak_mib": max(s["mem_peak_mib"] for s in steady)}
    if colocated:  # wait = the target forward, measured on the host around it
        row["target_mfu"] = fl.mfu(t_f * seqs, wait)
        row["drafter_mfu"] = fl.mfu(d_f * seqs, step_s - wait)
        row["overall_mfu"] = fl.mfu((t_f + d_f) * seqs, step_s)
    else:  # each drafter rank trains its share of the step's sequences while not waiting
        row["drafter_mfu"] = fl.mfu(d_f * seqs / drafter_gpus, step_s - wait)
        row["overall_mfu"] = fl.mfu((t_f + d_f) * seqs / (target_gpus + drafter_gpus), step_s)
    return row


def main() -> int:
    S8, S27 = fl.QWEN3_8B, fl.QWEN3_27B_LIKE
    rows = [
        summarize("8B colocated, transformers forward + reference step, 1 × 8,192", _ref8b(), S8, 1, 1, True),
        summarize("8B colocated, fast forward + chunked step (defaults on CUDA), 1 × 8,192",
                  steps_from_jsonl(os.path.join(RESULTS, "trainer_and_quality", "call4_fast8b-events.jsonl")), S8, 1, 1, True),
        summarize("8B colocated, --token-budget auto (chose 27 × 8,192)",
                  steps_from_jsonl(os.path.join(RESULTS, "trainer_and_quality", "call4_auto8b-events.jsonl")), S8, 1, 1, True),
        summarize("8B split 1 + 1, operators' flags (grad-accum 4 × 49,152)",
                  steps_from_jsonl(os.path.join(RESULTS, "trainer_and_quality", "call4_events.jsonl")), S8, 1, 1, False),
        summarize("27B-like 3 + 1, operators' flags", steps_from_log(os.path.join(RESULTS, "operators_layouts", "call5_log.txt"), "l3p1"),
                  S27, 3, 1, False),
        summarize("27B-like 2 + 2, operators' flags", steps_from_log(os.path.join(RESULTS, "operators_layouts", "call5_log.txt"), "l2p2"),
                  S27, 2, 2, False),
    ]
    print("| run | steady steps | tokens/s | drafted pos/s | drafter wait / step | step | drafter peak (allocated) "
          "| target fwd MFU | drafter MFU | MFU over all GPUs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        tm = f"{100 * r['target_mfu']:.1f} %" if "target_mfu" in r else "—"
        peak = "—" if r["peak_mib"] != r["peak_mib"] else f"{r['peak_mib']:,.0f} MiB"  # NaN: not recorded
        print(f"| {r['run']} | {r['steps']} | {r['tok_s']:,.0f} | {r['drafted_s']:,.0f} | {r['wait_s']:.2f} s | "
              f"{r['step_s']:.2f} s | {peak} | {tm} | {100 * r['drafter_mfu']:.1f} % | "
              f"{100 * r['overall_mfu']:.1f} % |")

    # 8 GPUs for the 27B-like shape: drafter rate measured (2 + 2), target rate from the
    # fast target's measured MFU on that shape (63.6 %, call 2) with all layers (soft labels)
    two = rows[-1]
    drafter_tok_per_gpu = two["tok_s"] / 2 * two["step_s"] / (two["step_s"] - two["wait_s"])
    t_f, _ = per_sequence_flops(S27)
    target_tok_per_gpu = 0.636 * fl.H200_BF16_PEAK / (t_f / L)
    print()
    print(f"27B-like per GPU: drafter {drafter_tok_per_gpu:,.0f} tok/s (measured, 2 + 2, wait removed), "
          f"target {target_tok_per_gpu:,.0f} tok/s (63.6 % MFU measured for its forward, call 2)")
    print("| target + drafter GPUs of 8 | tokens/s (min of the two roles) | bound by |")
    print("| --- | --- | --- |")
    for n_t in range(1, 8):
        n_d = 8 - n_t
        t, d = n_t * target_tok_per_gpu, n_d * drafter_tok_per_gpu
        print(f"| {n_t} + {n_d} | {min(t, d):,.0f} | {'target' if t < d else 'drafter'} |")
    best = fl.gpus_per_role(8, target_tok_per_gpu, drafter_tok_per_gpu)
    print(f"\nbest: {best[0]} target + {best[1]} drafter GPUs, {best[2]:,.0f} tok/s")
    return 0


def _ref8b() -> list[dict]:
    """The reference run's step lines (its events file did not come back: the device tool
    returns 8 files); tokens/s and wait from the printed log in bench/results/trainer_and_quality/call4_tail.txt."""
    out = []
    for line in open(os.path.join(RESULTS, "trainer_and_quality", "call4_tail.txt")):
        m = re.match(r"step (\d+)/8 \| .* \| (\d+) tok/s \| acc@1 \S+ \| wait ([0-9.]+)s", line.strip())
        if m and "ce" in line:
            out.append({"step": int(m.group(1)), "tokens": 8192, "tokens_per_s": float(m.group(2)),
                        "drafted_per_s": float(m.group(2)) * ANCHORS * BLOCK / L, "wait_s": float(m.group(3)),
                        "mem_peak_mib": float("nan")})
    return out


if __name__ == "__main__":
    sys.exit(main())
