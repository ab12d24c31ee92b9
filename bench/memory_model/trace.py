"""What is live at the drafter step's allocated peak, tensor by tensor (CUDA allocator trace).

    PYTHONUNBUFFERED=1 python3 bench/memory_model/trace.py --out $OUT [--seqs 2]

A split drafter rank's step (trainer/gpu/fast_drafter.py through the trainer's Drafter, the
operators' objective: soft labels, KL 0.15 at T 2, CAP 0.1, block 32, 1,024 anchors, 5
layers; Qwen3-8B widths, ``--seqs`` full 8,192-token sequences) runs once to compile and
create AdamW's state, then once under ``torch.cuda.memory._record_memory_history``. The
trace is replayed to the moment the most bytes were allocated and every block live then is
listed with its size and the innermost trainer/ frames that allocated it — how
trainer/plan/memory.py's per-token terms were checked. Writes trace_report.txt (and the raw
snapshot, gzip'd, when it is small enough to come back).
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved


def frames_of(ev) -> str:
    fr = [f for f in ev.get("frames", []) if "/trainer/" in f.get("filename", "")]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in fr[:4]) or "(no trainer frame)"


def peak_live(trace: list[dict]) -> tuple[int, list[dict]]:
    live, cur, best, best_set = {}, 0, 0, {}
    for ev in trace:
        a = ev.get("action")
        if a == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > best:
                best, best_set = cur, dict(live)
        elif a in ("free_requested",):
            e = live.pop(ev["addr"], None)
            if e is not None:
                cur -= e["size"]
    return best, list(best_set.values())


def report(snapshot: dict, tokens: int, base_alloc: int) -> str:
    trace = snapshot["device_traces"][0]
    peak, blocks = peak_live(trace)
    groups: dict[str, list[int]] = {}
    for b in blocks:
        groups.setdefault(frames_of(b), []).append(b["size"])
    lines = [f"allocations traced in the step: {sum(1 for e in trace if e.get('action') == 'alloc')}; "
             f"allocated before it: {base_alloc / 2**20:,.0f} MiB; peak within it: +{peak / 2**20:,.0f} MiB "
             f"({peak / tokens:,.0f} B per micro-batch token over {tokens} tokens)", "",
             "MiB | blocks | B/token | where (innermost trainer frames)"]
    for where, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        s = sum(sizes)
        if s < 8 * 2**20:
            continue
        lines.append(f"{s / 2**20:,.1f} | {len(sizes)} | {s / tokens:,.0f} | {where}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--cpu-shape", action="store_true", help="a tiny shape on CPU: checks the script, traces nothing")
    a = ap.parse_args(argv)
    from trainer import runtime_env

    runtime_env.apply()
    import torch

    from trainer.gpu import fast_drafter
    from trainer.plan.flops import QWEN3_8B, ModelShape
    from trainer.model import Drafter, DrafterConfig

    cuda = torch.cuda.is_available() and not a.cpu_shape
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dt = torch.bfloat16 if cuda else torch.float32
    shape = QWEN3_8B if cuda else ModelShape(8, 64, 4, 2, 16, 96, 500, "tiny")
    B, n_anchor, S = (32, 1024, a.seq_len) if cuda else (8, 10, 96)
    cfg = DrafterConfig.for_shape(shape, 5, B)
    t0 = time.time()
    with torch.device(dev):
        d = Drafter(cfg)
        embed = torch.randn(shape.vocab, shape.hidden, dtype=dt) * 0.02
        head = torch.randn(shape.vocab, shape.hidden, dtype=dt) * 0.02
    opt = torch.optim.AdamW(d.parameters(), lr=1e-4, fused=cuda or None)
    b, F = a.seqs, len(cfg.target_layer_ids) * shape.hidden
    ids = torch.randint(0, shape.vocab - 2, (b, S), device=dev)
    lm = torch.ones(b, S, dtype=torch.long, device=dev)
    lens = torch.full((b,), S, device=dev)
    anc = torch.linspace(0, S - 2, n_anchor).long().expand(b, n_anchor).contiguous().to(dev)
    keep = torch.ones(b, n_anchor, dtype=torch.bool, device=dev)
    taps = torch.randn(b, S, F, device=dev, dtype=dt)
    final = torch.randn(b, S, shape.hidden, device=dev, dtype=dt)
    kw = dict(block_size=B, mask_token_id=shape.vocab - 1, gamma=10.0, kl_weight=0.15, temperature=2.0,
              cap_lambda=0.1, teacher_final=final, attn="flex" if cuda else "sdpa", dtype=dt)

    def step():
        fast_drafter.step_backward(d, embed, head, ids, taps, lm, lens, anc, keep, **kw)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # compiles, creates AdamW's state
    print(f"warm step done at {time.time() - t0:.0f} s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    if not cuda:
        step()
        print("cpu: nothing traced")
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    text = (f"seqs {b} × {S}; max_memory_allocated {peak / 2**20:,.0f} MiB (before the step "
            f"{base / 2**20:,.0f}); reserved {torch.cuda.max_memory_reserved() / 2**20:,.0f} MiB\n" + report(snap, b * S, base))
    with open(os.path.join(a.out, "trace_report.txt"), "w") as fh:
        fh.write(text)
    print(text, flush=True)
    raw = gzip.compress(pickle.dumps(snap))
    if len(raw) < 15 * 2**20:
        with open(os.path.join(a.out, "trace_snapshot.pickle.gz"), "wb") as fh:
            fh.write(raw)
    print(f"done at {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
