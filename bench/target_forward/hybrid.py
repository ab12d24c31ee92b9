"""The Qwen3.6-27B (hybrid) target and its drafter on one GPU: how fast is each, and how much memory?

    python bench/target_forward/hybrid.py forward   OUT   # fast hybrid forward vs transformers', real widths
    python bench/target_forward/hybrid.py drafter   OUT   # the drafter step at the operators' flags
    python bench/target_forward/hybrid.py colocated OUT   # python -m trainer, 64-layer synthetic target + drafter
    python bench/target_forward/hybrid.py model     OUT   # the memory model's predictions (no GPU)

Each phase appends one JSON object to OUT/results.jsonl (and writes its logs beside it), so a
phase that dies or times out still leaves the others' figures. bench/target_forward/README.md has
the command that runs all four.

Method. forward: Qwen3.6-27B's language model at its real widths, 8 layers in its 3:1 Gated
DeltaNet / gated attention pattern (2 full-attention layers), random bf16 weights, one
8,192-token sequence; the transformers forward (hooks on every layer, flash-linear-attention
importable, so transformers uses its Gated DeltaNet kernels) and trainer/gpu/fast_hybrid.py over
the same weights, interleaved, 2 warm-ups then 7 timed calls each (CUDA events), median;
FLOP from trainer/fast_hybrid.forward_flops (projections, MLP, attention scores/values, the
recurrence's state products); MFU against 989 TFLOP/s. Equality: relative Frobenius error of
every layer's output and of the final normed state, and the share of positions whose
argmax token through a random head agrees; then (phases forward-kernels, forward-graph,
forward-fp32) the kernels' own time from the profiler, the same forward replayed as one CUDA
graph beside a plain eager timing (is it host-bound?), and both bf16 forwards against
transformers' forward of the same weights cast to fp32 with TF32 off. drafter: trainer/step.py's ChunkedStep on the
drafter trainer/model.py builds for the public Qwen3.6-27B config (5 layers, 4 sliding-window
2,048 + 1 full, 32/8×128, vocabulary 248,320), six 8,192-token sequences (49,152 tokens),
1,024 anchors each, block 32, soft labels (KL 0.15, T 2), CAP 0.1, clip, fused AdamW; 3
steps, the last 2 timed; torch.cuda.max_memory_reserved after them. colocated: ``python -m
trainer`` on ``trainer synthetic --shape qwen3.6-27b`` (64 layers), target and drafter on
GPU 0, the operators' flags at --token-budget 16384, 10 steps.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved
GIB = 2 ** 30
PEAK = 989e12
# HYBRID_DRYRUN=1: the same code on CPU at toy sizes (to check the script before a device call)
DRY = os.environ.get("HYBRID_DRYRUN") == "1"
DEV = "cpu" if DRY else "cuda"


def record(out: str, **row) -> None:
    print(json.dumps(row, default=str), flush=True)
    with open(os.path.join(out, "results.jsonl"), "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")


def timed(fn, warmup: int, iters: int) -> list[float]:
    """Seconds per call after ``warmup`` calls: CUDA events (bench/target_forward/run.py's timer),
    a host clock in a dry run."""
    if not DRY:
        from bench._timing import timed as cuda_timed

        return cuda_timed(fn, warmup, iters)[1]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.time()
        fn()
        times.append(time.time() - t)
    return times


def write_target(directory: str, text: dict) -> str:
    from trainer.synth import synthetic

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(synthetic.hf_config(text), fh)
    with open(os.path.join(directory, synthetic.MARKER), "w") as fh:
        json.dump({"seed": 0, "shape": "bench"}, fh)
    return directory


def phase_forward(out: str) -> None:
    import torch

    from trainer import family
    from trainer.gpu.fast_hybrid import FastHybridTarget, forward_flops
    from trainer.target import Target

    from trainer.synth import synthetic

    n = 8
    real = synthetic.HYBRID_SHAPES["small-hybrid"] if DRY else family.QWEN3_6_27B_TEXT
    text = {**real, "num_hidden_layers": n, "layer_types": real["layer_types"][:n]}
    taps = list(range(n))
    t0 = time.time()
    target = Target(write_target(os.path.join(out, "fwd-target"), text), taps, DEV, torch.float32 if DRY else torch.bfloat16, "hf")
    with torch.no_grad():  # Qwen3.5's norms start at 0 (x̂·(1+w)): give them values so a wrong norm shows
        for name, p in target.model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    fast = FastHybridTarget.from_hf(target.model.model, taps, keep_all_layers=True, share_weights=True)
    if not DRY:
        torch.cuda.empty_cache()
    load_s = time.time() - t0
    L = 256 if DRY else 8192
    ids = torch.randint(0, text["vocab_size"] - 1, (1, L), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    hf_fn = lambda: target.forward(ids, want_final=True)  # noqa: E731  (target.fast is None: transformers)
    fast_fn = lambda: fast.forward(ids, want_final=True)  # noqa: E731
    t_c = time.time()
    (a, fa), (b, fb) = hf_fn(), fast_fn()
    if not DRY:
        torch.cuda.synchronize()
    first_s = time.time() - t_c
    H = text["hidden_size"]
    err = [float((a[..., i * H:(i + 1) * H].float() - b[..., i * H:(i + 1) * H].float()).norm()
                 / a[..., i * H:(i + 1) * H].float().norm()) for i in range(n)]
    err_final = float((fa.float() - fb.float()).norm() / fa.float().norm())
    agree = float((fa @ target.lm_head.t()).argmax(-1).eq((fb @ target.lm_head.t()).argmax(-1)).float().mean())
    del a, b, fa, fb
    hf_t, fast_t = [], []
    for _ in range(2):
        hf_t += timed(hf_fn, 1, 3)
        fast_t += timed(fast_fn, 1, 4)
    flop = forward_flops(text, L)
    hf_s, fast_s = statistics.median(hf_t), statistics.median(fast_t)
    row = dict(phase="forward", layers=n, tokens=L, load_s=round(load_s, 1), first_call_s=round(first_s, 1),
               fla=family.fast_forward_kernels(), flop=flop,
               hf_s=hf_s, hf_tok_s=L / hf_s, hf_mfu=flop / hf_s / PEAK, hf_times=hf_t,
               fast_s=fast_s, fast_tok_s=L / fast_s, fast_mfu=flop / fast_s / PEAK, fast_times=fast_t,
               speedup=hf_s / fast_s, tok_s_64_layers=L / fast_s * n / 64, hf_tok_s_64_layers=L / hf_s * n / 64,
               rel_err_per_layer=err, rel_err_final=err_final, argmax_agree=agree,
               peak_alloc_gib=None if DRY else torch.cuda.max_memory_allocated() / GIB)
    record(out, **row)
    if not DRY:
        diagnostics(out, fast_fn, flop, L)
    fp32_reference(out, target, ids, hf_fn, fast_fn, n, H)


def diagnostics(out: str, fast_fn, flop: float, L: int) -> None:
    """Where the fast forward's time goes: the kernels' own time (profiler) against the CUDA
    events' time of the same call, and the same forward replayed as one CUDA graph (no host
    work between kernels), so the host-bound share is measured rather than guessed."""
    import torch

    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fast_fn()
            torch.cuda.synchronize()
        with open(os.path.join(out, "forward_profile.txt"), "w") as fh:
            fh.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        kernel_s = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
        record(out, phase="forward-kernels", kernel_s=kernel_s, kernel_mfu=flop / kernel_s / PEAK)
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        print("profile failed:", exc)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fast_fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fast_fn()
        g_t = timed(graph.replay, 2, 5) + timed(graph.replay, 0, 5)
        eager_t = timed(fast_fn, 1, 5)
        g_s, e_s = statistics.median(g_t), statistics.median(eager_t)
        record(out, phase="forward-graph", graph_s=g_s, graph_mfu=flop / g_s / PEAK, graph_times=g_t,
               eager_s=e_s, eager_mfu=flop / e_s / PEAK, eager_times=eager_t, tokens=L)
        del graph
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        print("graph capture failed:", repr(exc)[:500])


def fp32_reference(out: str, target, ids, hf_fn, fast_fn, n: int, H: int) -> None:
    """Both bf16 forwards against transformers' forward of the same weights in fp32 (TF32 off;
    its gated delta rule through whichever kernel transformers picks, fla's where importable): if the fast forward is as close to it as
    transformers' own bf16 forward is, the two differ by bf16 rounding, not by a term."""
    import torch

    try:
        (a, fa), (b, fb) = hf_fn(), fast_fn()
        a, fa, b, fb = a.float().cpu(), fa.float().cpu(), b.float().cpu(), fb.float().cpu()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        target.model.float()
        torch.cuda.empty_cache()
        r, fr = hf_fn()
        r, fr = r.float().cpu(), fr.float().cpu()

        def rel(x, y):
            return float((x - y).norm() / y.norm())

        sl = [slice(i * H, (i + 1) * H) for i in range(n)]
        record(out, phase="forward-fp32", hf_bf16_vs_fp32=[rel(a[..., s], r[..., s]) for s in sl],
               fast_bf16_vs_fp32=[rel(b[..., s], r[..., s]) for s in sl],
               hf_final_vs_fp32=rel(fa, fr), fast_final_vs_fp32=rel(fb, fr))
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        print("fp32 reference failed:", repr(exc)[:500])


def drafter_args(**kw):
    base = dict(block_size=32, gamma=10.0, position_weights="decay", dpace_alpha=0.5, use_soft_labels=True,
                kl_weight=0.15, kl_temperature=2.0, cap_lambda=0.1, grad_accum=1, drafter_step="chunked")
    return SimpleNamespace(**{**base, **kw})


def phase_drafter(out: str, batches=(6, 5, 4)) -> None:
    import torch

    from trainer import family
    from trainer.layers import flex_mask
    from trainer.plan import flops
    from trainer.model import Drafter, DrafterConfig, FrozenHead
    from trainer.step import make_step
    from trainer.topology import MicroBatch

    if DRY:
        from trainer.synth import synthetic

        dcfg = DrafterConfig.from_target(synthetic.HYBRID_SHAPES["small-hybrid"], 2, 8, attention="4/2/16",
                                         sliding_window=64)
        L, N, B = 256, 16, 8
    else:
        dcfg = DrafterConfig.from_target(family.QWEN3_6_27B_TEXT, 5, 32)
        L, N, B = 8192, 1024, 32
    nd = dcfg.num_hidden_layers
    V, H = dcfg.vocab_size, dcfg.hidden_size
    for b in batches:
        if not DRY:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        dt = torch.float32 if DRY else torch.bfloat16
        with torch.device(DEV):
            drafter = Drafter(dcfg)
        head = FrozenHead(torch.randn(V, H, device=DEV, dtype=dt) * 0.02, torch.randn(V, H, device=DEV, dtype=dt) * 0.02)
        mats = [p for p in drafter.parameters() if p.dim() >= 2]
        vecs = [p for p in drafter.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": mats, "weight_decay": 0.01}, {"params": vecs, "weight_decay": 0.0}],
                                lr=1e-4, fused=not DRY)
        step = make_step(drafter_args(block_size=B), drafter, head, dcfg)
        g = torch.Generator(DEV).manual_seed(1)
        ids = torch.randint(0, V - 2, (b, L), device=DEV, generator=g)
        anchors = torch.stack([torch.randperm(L - 1, device=DEV, generator=g)[:N] for _ in range(b)]).sort(-1).values
        keep = torch.ones(b, N, dtype=torch.bool, device=DEV)
        taps = torch.randn(b, L, nd * H, device=DEV, dtype=dt, generator=g)
        final = torch.randn(b, L, H, device=DEV, dtype=dt, generator=g)
        mb = MicroBatch(0, 0, torch.arange(b, device=DEV), ids, torch.ones_like(ids), torch.full((b,), L, device=DEV),
                        anchors, keep, taps, final)

        def one():
            step(mb, taps)
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        t0 = time.time()
        try:
            times = timed(one, 1, 2)  # 3 optimizer steps: AdamW's state exists from the first
        except torch.cuda.OutOfMemoryError as exc:
            record(out, phase="drafter", budget=b * L, oom=True, message=str(exc).splitlines()[0][:300])
            del drafter, head, opt, step, mb, taps, final
            continue
        reserved, alloc = (0, 0) if DRY else (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
        shape = flops.ModelShape(64, H, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim,
                                 dcfg.intermediate_size, V)
        full_pairs = flex_mask.visible_pairs(anchors, L, B, keep)
        slide_pairs = flex_mask.visible_pairs(anchors, L, B, keep, window=dcfg.sliding_window)
        f = flops.drafter_step_flops(shape, n_layers=nd, block_size=B, n_blocks=b * N, ctx_tokens=b * L,
                                     visible_ctx_pairs=full_pairs - b * N * B * B, teacher_positions=b * N * (B - 1))
        per_layer_attn = lambda pairs: int(3.5 * 4 * shape.q_dim * pairs)  # noqa: E731
        n_slide = dcfg.layer_types.count("sliding_attention")
        total = f["total"] - f["attention"] + (nd - n_slide) * per_layer_attn(full_pairs) + n_slide * per_layer_attn(slide_pairs)
        s = statistics.median(times)
        context = 768 * 2 ** 20  # the CUDA context, outside the allocator's figures
        record(out, phase="drafter", budget=b * L, anchors=N, block=B, layer_types=dcfg.layer_types,
               window=dcfg.sliding_window, step_s=s, times=times, first_step_s=round(time.time() - t0 - sum(times), 1),
               positions_per_s=b * N * B / s, flop=total, mfu=total / s / PEAK, reserved_gib=reserved / GIB,
               alloc_gib=alloc / GIB, fits_96gb=reserved + context <= 96e9, trainable_params=sum(p.numel() for p in mats + vecs))
        del drafter, head, opt, step, mb, taps, final
        if DRY or reserved + context <= 96e9:
            break  # the largest budget that fits a 96 GB card is found


def phase_colocated(out: str, budget: int = 16384, steps: int = 10, limit_s: float = 300) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    syn = os.path.join(out, "syn")
    shape, L = ("small-hybrid", 160) if DRY else ("qwen3.6-27b", 8192)
    r = subprocess.run([sys.executable, "-m", "trainer", "synthetic", "--shape", shape, "--out", syn,
                        "--samples", "48", "--max-len", str(L)], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        record(out, phase="colocated", error="synthetic", stderr=r.stderr[-2000:])
        return
    run = os.path.join(out, "run")
    argv = [sys.executable, "-m", "trainer", "--target-model", os.path.join(syn, "target"), "--data-dir",
            os.path.join(syn, "data"), "--output-dir", run, "--target-gpus", "0", "--drafter-gpus", "0", "--from-scratch",
            "--max-steps", str(steps), "--epochs", "6", "--token-budget", str(budget), "--max-seq-len", "8192",
            "--block-size", "32", "--max-anchors", "1024", "--num-draft-layers", "5", "--grad-accum", "1",
            "--gamma", "10", "--use-soft-labels", "--kl-weight", "0.15", "--kl-temperature", "2.0", "--cap-lambda", "0.1",
            "--noise-start", "0.05", "--noise-end", "0.01", "--save-interval", "100000"]
    if DRY:
        budget = 2 * L
        argv = [{"8192": str(L), str(16384): str(budget), "1024": "16", "32": "8", "5": "2"}.get(a, a) for a in argv]
        argv += ["--device", "cpu", "--drafter-attention", "4/2/16", "--drafter-step", "chunked", "--target-forward", "fast"]
    t0 = time.time()
    log = open(os.path.join(out, "colocated.log"), "w")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used,utilization.gpu", "--format=csv", "-l", "2"]
                           if not DRY else ["sleep", "1000"],
                           stdout=open(os.path.join(out, "nvidia_smi.csv"), "w"), stderr=subprocess.DEVNULL)
    events = os.path.join(run, "events.jsonl")
    done = False
    while proc.poll() is None and time.time() - t0 < limit_s:
        if os.path.exists(events):
            with open(events) as fh:
                rows = [json.loads(x) for x in fh if x.strip()]
            if sum(e["kind"] == "step" for e in rows) >= steps:
                done = True
                break  # the final checkpoint of a 1.7 B-parameter drafter is not what is measured here
        time.sleep(1)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    smi.terminate()
    rows = []
    if os.path.exists(events):
        with open(events) as fh:
            rows = [json.loads(x) for x in fh if x.strip()]
    st = [e for e in rows if e["kind"] == "step"]
    steady = st[2:] or st
    record(out, phase="colocated", steps=len(st), done=done, wall_s=round(time.time() - t0, 1), budget=budget,
           tokens_per_s_median=statistics.median([e["tokens_per_s"] for e in steady]) if steady else None,
           step_s=[round(e["tokens"] / e["tokens_per_s"], 2) for e in st], wait_s=[round(e["wait_s"], 2) for e in st],
           drafted_per_s_median=statistics.median([e["drafted_per_s"] for e in steady]) if steady else None,
           mem_peak_mib=max((e["mem_peak_mib"] for e in st), default=None), losses=[round(e["loss"], 4) for e in st],
           errors=[e for e in rows if e["kind"] == "error"][:2])


def phase_model(out: str) -> None:
    """The memory model for the runs above (stdlib): trainer/plan/budget.py's predictions, for the
    allocator this process would give the trainer."""
    from trainer import family, flags
    from trainer.plan import budget

    cfg = family.QWEN3_6_27B_TEXT
    base = {**flags.defaults(), "block_size": 32, "max_anchors": 1024, "max_seq_len": 8192, "num_draft_layers": 5,
            "use_soft_labels": True, "noise_start": 0.05, "noise_end": 0.01, "drafter_step": "chunked",
            "target_forward": "fast"}
    for budget_ in (49152, 40960, 32768):
        p = budget.predictions({**base, "target_gpus": (0,), "drafter_gpus": (1,), "token_budget": budget_}, cfg, budget_)
        record(out, phase="model", role="drafter (split)", budget=budget_, peak_gib=p["drafter"].allocated / GIB,
               reserved_gib=p["drafter"].reserved / GIB, target_peak_gib=p["target"].allocated / GIB,
               target_reserved_gib=p["target"].reserved / GIB)
    p = budget.predictions({**base, "target_gpus": (0,), "drafter_gpus": (0,), "token_budget": 16384}, cfg, 16384)
    record(out, phase="model", role="colocated", budget=16384, peak_gib=p["colocated"].allocated / GIB,
           reserved_gib=p["colocated"].reserved / GIB)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1].startswith("-"):
        print(__doc__.split("\n\n")[1])  # the usage lines
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    phase, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    t = time.time()
    try:
        {"forward": phase_forward, "drafter": phase_drafter, "colocated": phase_colocated, "model": phase_model}[phase](out)
    except Exception as exc:  # noqa: BLE001 - recorded, the next phase still runs
        import traceback

        record(out, phase=phase, error=repr(exc)[:500], traceback=traceback.format_exc()[-3000:])
    print(f"{phase}: {time.time() - t:.0f} s", flush=True)
