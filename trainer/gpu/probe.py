"""Memory known before launch: predict each role's peak from the configuration, check it
against the free memory of the GPUs the roles will use, optionally run the worst-case step
(max token budget, max length, max anchors) to measure it, and pick ``--token-budget auto``.

    python -m trainer.gpu.probe --model qwen3-8b --block-size 32 --max-anchors 1024 \\
        --max-seq-len 8192 --token-budget 49152 --num-draft-layers 5 --role drafter --gpu 0 [--run]

Prints one JSON object last (between ``--- probe json ---`` lines) and a line per GPU;
exit 0 when every role fits, 2 when a launch would be refused (one line per problem on
stderr, naming the GPU, its role, what is needed, what is free and the shortfall), 3 when
``--run`` hit a real CUDA OOM (reported the same way).

Prediction: trainer/plan/memory.py (stdlib; the controller can call ``plan_run`` — the trainer's
own run, from its resolved flag values, trainer/plan/budget.py — and ``plan``/``refusals`` without torch). The run uses random weights of the configured shape through the fast GPU
paths (trainer/gpu/fast_target.py, trainer/gpu/fast_drafter.py), so its peak is that of the real
step for the same shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from trainer.plan import memory as mm
from trainer import runtime_env
# the trainer's own run (train.memory_check, the controller's preflight): trainer/plan/budget.py,
# re-exported here where callers have always found it
from trainer.plan.budget import CONTEXT_MIB, MARGIN_MIB, ROLE_NAMES, plan_run, predictions, roles_by_gpu, shapes  # noqa: F401
from trainer.plan.flops import QWEN3_8B, QWEN3_27B_LIKE, ModelShape

GIB = mm.GIB
MIB = 1024 ** 2
SHAPES = {"qwen3-8b": QWEN3_8B, "qwen3-27b-like": QWEN3_27B_LIKE}


def _config(name: str) -> dict:
    with open(name if name.endswith(".json") else name.rstrip("/") + "/config.json") as fh:
        return json.load(fh)


def shape_of(name: str) -> ModelShape:
    """A benchmark shape by name, or the language model of a config.json / model dir."""
    return SHAPES[name] if name in SHAPES else ModelShape.from_hf_config(_config(name))


def drafter_shape_of(name: str) -> ModelShape | None:
    """The drafter widths trainer/model.py builds for the target ``name`` when they are not
    the target's own (a Qwen3.5/3.6 config: its family's 32/8 × 128), else None."""
    if name in SHAPES:
        return None
    target, drafter = shapes({}, _config(name))
    return None if drafter == target else drafter


def tapped_ids(n_target_layers: int, n: int) -> list[int]:
    if n == 1:
        return [n_target_layers // 2]
    return [int(round(1 + i * (n_target_layers - 4) / (n - 1))) for i in range(n)]


def plan(shape: ModelShape, *, block_size: int, max_anchors: int, max_seq_len: int, token_budget: int,
         num_draft_layers: int = 5, max_batch_size: int = 64, chunk_positions: int = 16384,
         head_chunk_rows: int = 4096, soft_labels: bool = False, colocated: bool = False,
         drafter_shape: ModelShape | None = None) -> dict:
    """Predicted peaks per role of a benchmark shape (bytes): allocated and reserved peak, and
    what the GPU needs free (reserved + CUDA context). The harness loads the target's layers
    up to the last tap (all of them with soft labels) and no LM head."""
    taps = tapped_ids(shape.n_layers, num_draft_layers)
    common = dict(n_draft_layers=num_draft_layers, n_tapped=len(taps), block_size=block_size, max_anchors=max_anchors,
                  soft_labels=soft_labels, drafter=drafter_shape, tied=True, max_batch_size=max_batch_size,
                  chunk_anchors=max(1, chunk_positions // block_size), head_chunk_rows=head_chunk_rows,
                  target_layers=shape.n_layers if soft_labels else max(taps) + 1)
    out = {}
    for role in ("drafter", "target") + (("colocated",) if colocated else ()):
        p = mm.predict(mm.RunSpec(shape, role, token_budget, max_seq_len, **common))
        out[role] = {"peak": p.allocated, "reserved": p.reserved, "need": p.reserved + CONTEXT_MIB * MIB,
                     "terms": p.terms}
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
                         f"(reserved peak {p[role]['reserved'] / GIB:.2f} GiB + CUDA context {CONTEXT_MIB / 1024:.2f}"
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


# ------------------------------------------------------------------ measured probe (torch)
def run_worst_case(role: str, shape: ModelShape, *, gpu: int, block_size: int, max_anchors: int, max_seq_len: int,
                   token_budget: int, num_draft_layers: int = 5, max_batch_size: int = 64,
                   chunk_positions: int = 16384, head_chunk_rows: int = 4096, steps: int = 2) -> dict:
    """Run the worst-case step on one GPU and return the measured peaks, or the OOM. Two
    steps by default: AdamW's state exists only from the first optimizer step on, so the
    steady-state peak is the second step's (a one-step probe under-reads by 8 B/param)."""
    import torch

    from trainer.gpu import fast_drafter as fd
    from trainer.gpu.fast_target import FastTarget
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
    runtime_env.apply()  # before torch: allocator and compile cache as the trainer has them
    ap = argparse.ArgumentParser(prog="python -m trainer.gpu.probe", description=__doc__.split("\n\n")[0])
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
    dshape = shape_of(a.drafter_model) if a.drafter_model else drafter_shape_of(a.model)
    if a.run and a.role != "drafter" and shape.layer_types:
        print(f"--run --role {a.role}: the random-weight target here is dense (FastTarget.random); measure a "
              "Qwen3.5/3.6 target with python -m trainer --probe-memory", file=sys.stderr)
        return 2
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
