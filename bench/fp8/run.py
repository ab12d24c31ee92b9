"""The frozen target in FP8 against bf16, on one GPU, in one process (bench/fp8/README.md).

(a) the target's GEMMs of Qwen3-8B at M = 8,192 tokens — fused q|k|v, o, fused gate|up, down,
    and the 151,936-column LM head — each with the op that produces its input, compiled:
    bf16 = producer + ``a @ wᵀ``; fp8 = producer-with-per-row-quantization (trainer/gpu/fp8.py)
    + ``torch._scaled_mm``; and each GEMM alone (input made beforehand) to show where time goes;
    plus the relative error of each GEMM's fp8 output against bf16 on inputs with outlier channels;
(b) the fast target forward (trainer/gpu/fast_target.py) of a random-weight Qwen3-8B (the
    layers the trainer runs for 5 taps), bf16 against fp8 on the same weights, 8 × 8,192 tokens;
(c) the taps' error per tapped layer of (b)'s two forwards on the same input (relative L2, max
    abs, fp8 against bf16);
(d) ``teacher_head`` (opt-in): the teacher's logits of one head chunk (4,096 rows of final
    states through the 151,936-column head), bf16 against the FP8 head of --target-precision fp8
    (rows from a sequence's states quantized once: that pass timed apart), and their error;
(e) ``drafter_step`` (opt-in): bench/drafter_step/run.py's step at the operators' shape (DFlash,
    Qwen3-8B widths, 6 × 8,192 tokens, soft labels) with --drafter-precision bf16 and fp8, and
    with the teacher's head in FP8 (--target-precision fp8's), each in this process after the
    other; step seconds, drafted positions/s, first step, peaks and first-step loss.

Median of ``--reps`` timed repetitions after warm-up (CUDA events); the first call of each
compiled piece is timed apart as its compile. Every section writes ``summary.json`` in
``--out`` again when it ends, so a run cut short keeps what it measured; a section that would
start after ``--deadline-s`` is recorded as skipped.

    python bench/fp8/run.py --out OUT                 # one H100/H200, about 4-6 minutes
    python bench/fp8/run.py --out OUT --smoke         # tiny shapes on CPU: the harness itself
    python bench/fp8/run.py --out OUT --sections teacher_head,drafter_step --deadline-s 420
                                                      # (d) and (e): about 5-6 minutes, needs torchao
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from trainer.gpu import fp8  # noqa: E402
from trainer.gpu.fast_target import FastTarget  # noqa: E402
from trainer.layers import fused_ops as fo  # noqa: E402
from trainer.model import build_target_layer_ids  # noqa: E402
from trainer.plan.flops import QWEN3_8B, ModelShape  # noqa: E402

SMOKE_SHAPE = ModelShape(8, 128, 4, 2, 32, 256, 1000, "smoke")


class Clock:
    """Median milliseconds of a callable: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, device: torch.device, reps: int, warmup: int = 2):
        self.device, self.reps, self.warmup = device, reps, warmup

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def first(self, fn) -> float:
        """The first call alone (compiles on CUDA), in ms."""
        self._sync()
        t = time.perf_counter()
        fn()
        self._sync()
        return (time.perf_counter() - t) * 1e3

    def median(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        self._sync()
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


# ------------------------------------------------------------------ (a) the GEMMs
def gemm_cases(s: ModelShape, M: int, device, dtype, gen):
    """Per GEMM: (name, N, K, bf16 producer → input, fp8 producer → (x8, scale), producer's raw input)."""
    H, I, q, kv = s.hidden, s.intermediate, s.q_dim, s.kv_dim

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    def outliers(t):
        t[..., :4] *= 40  # a few channels far above the rest, as a real target's residual has
        return t

    ln = torch.ones(H, device=device, dtype=dtype)
    x, y = outliers(rnd(1, M, H)), rnd(1, M, H)
    heads = rnd(1, s.n_heads, M, s.head_dim)
    gu = rnd(1, M, 2 * I)
    cases = [
        ("qkv", q + 2 * kv, H, lambda: fo.norm(x, ln), lambda: fp8.FP8.norm(x, ln)),
        ("o", H, q, lambda: fp8.BF16.heads(heads), lambda: fp8.FP8.heads(heads)),
        ("gate_up", 2 * I, H, lambda: fo.add_norm(x, y, ln)[1], lambda: fp8.FP8.add_norm(x, y, ln)[1]),
        ("down", H, I, lambda: fo.silu_mul(gu), lambda: fp8.FP8.silu_mul(gu)),
        ("head", s.vocab, H, lambda: fo.norm(x, ln), lambda: fp8.FP8.norm(x, ln)),
    ]
    return cases


def section_gemms(s: ModelShape, M: int, device, dtype, clock: Clock) -> dict:
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    out = {}
    for name, N, K, bf16_in, fp8_in in gemm_cases(s, M, device, dtype, gen):
        w = torch.randn(N, K, device=device, dtype=dtype, generator=gen) * 0.02
        w8 = fp8.Fp8Weight.of(w)
        flop = 2 * M * N * K
        row = {"M": M, "N": N, "K": K, "flop": flop}
        row["compile_ms"] = {"bf16": clock.first(bf16_in), "fp8": clock.first(fp8_in)}
        a, q = bf16_in(), fp8_in()
        row["ms"] = {
            "bf16": clock.median(lambda: bf16_in() @ w.t()),
            "fp8": clock.median(lambda: fp8.mm(fp8_in(), w8)),
            "bf16_gemm_only": clock.median(lambda: a @ w.t()),
            "fp8_gemm_only": clock.median(lambda: fp8.mm(q, w8)),
            "producer_bf16": clock.median(bf16_in),
            "producer_fp8": clock.median(fp8_in),
        }
        row["tflops"] = {k: flop / (v * 1e-3) / 1e12 for k, v in row["ms"].items() if k.startswith(("bf16", "fp8"))}
        row["speedup"] = row["ms"]["bf16"] / row["ms"]["fp8"]
        row["speedup_gemm_only"] = row["ms"]["bf16_gemm_only"] / row["ms"]["fp8_gemm_only"]
        ref = a.double() @ w.double().t()
        row["rel_err"] = {"fp8": rel(fp8.mm(q, w8), ref), "bf16": rel(a @ w.t(), ref)}
        out[name] = row
        print(json.dumps({"gemm": name, "speedup": round(row["speedup"], 3), "ms": row["ms"],
                          "rel_err": row["rel_err"]}), flush=True)
        del w, w8, a, q, ref
    return out


# ------------------------------------------------------------------ (b) + (c) the forward and its taps
def section_forward(s: ModelShape, batch: int, seq: int, device, dtype, clock: Clock, attn: str) -> dict:
    taps = build_target_layer_ids(s.n_layers, 5)
    ids = torch.randint(0, s.vocab, (batch, seq), device=device, generator=torch.Generator(device=device).manual_seed(1))
    out = {"layer_ids": taps, "batch": batch, "seq": seq, "tokens": batch * seq, "layers_run": max(taps) + 1}
    res = {}
    for precision in ("bf16", "fp8"):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(device)
        t = FastTarget.random(s, taps, device=device, dtype=dtype, attn_backend=attn, seed=7, precision=precision)
        row = {}
        if device.type == "cuda":
            row["weights_gib"] = (torch.cuda.memory_allocated(device) - before) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        row["first_ms"] = clock.first(lambda: t.forward(ids))
        row["ms"] = clock.median(lambda: t.forward(ids))
        row["tokens_per_s"] = batch * seq / (row["ms"] * 1e-3)
        if device.type == "cuda":
            row["peak_gib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**30
        res[precision] = (t.forward(ids)[0], row)
        out[precision] = row
        print(json.dumps({"forward": precision, **row}), flush=True)
        del t
    out["speedup"] = out["bf16"]["ms"] / out["fp8"]["ms"]
    a, b = res["bf16"][0], res["fp8"][0]
    H = s.hidden
    per = []
    for j, layer in enumerate(taps):
        x, y = a[..., j * H:(j + 1) * H].float(), b[..., j * H:(j + 1) * H].float()
        per.append({"layer": layer, "rel_l2": rel(y, x), "max_abs": float((y - x).abs().max()),
                    "ref_rms": float(x.pow(2).mean().sqrt()), "ref_max_abs": float(x.abs().max())})
    out["taps_error"] = per
    print(json.dumps({"taps_error": per}), flush=True)
    return out


# ------------------------------------------------------------------ (d) the teacher's head
def section_teacher_head(s: ModelShape, seq: int, rows: int, device, dtype, clock: Clock) -> dict:
    gen = torch.Generator(device=device)
    gen.manual_seed(2)
    states = torch.randn(seq, s.hidden, device=device, dtype=dtype, generator=gen)
    states[:, :4] *= 40  # a final state's outlier channels
    w = torch.randn(s.vocab, s.hidden, device=device, dtype=dtype, generator=gen) * 0.02
    w8 = fp8.Fp8Weight.of(w)
    rows = min(rows, seq)
    x = states[:rows]
    table = fp8.quantize_table(states)
    flop = 2 * rows * s.vocab * s.hidden
    row = {"rows": rows, "seq": seq, "N": s.vocab, "K": s.hidden, "flop": flop,
           "compile_ms": {"quantize_table": clock.first(lambda: fp8.quantize_table(states))}}
    row["ms"] = {"bf16": clock.median(lambda: x @ w.t()),
                 "fp8": clock.median(lambda: fp8.mm((table[0][:rows], table[1][:rows]), w8)),
                 "quantize_table": clock.median(lambda: fp8.quantize_table(states))}
    # the quantization is once per sequence; a sequence's head chunks read ~seq teacher rows
    per_seq = row["ms"]["quantize_table"] * rows / seq
    row["tflops"] = {k: flop / (row["ms"][k] * 1e-3) / 1e12 for k in ("bf16", "fp8")}
    row["speedup"] = row["ms"]["bf16"] / (row["ms"]["fp8"] + per_seq)
    row["speedup_gemm_only"] = row["ms"]["bf16"] / row["ms"]["fp8"]
    ref = x.double() @ w.double().t()
    row["rel_err"] = {"fp8": rel(fp8.mm((table[0][:rows], table[1][:rows]), w8), ref), "bf16": rel(x @ w.t(), ref)}
    print(json.dumps({"teacher_head": row}), flush=True)
    return row


# ------------------------------------------------------------------ (e) the drafter step
DRAFTER_VARIANTS = {"bf16": {}, "fp8": {"drafter_precision": "fp8"}, "teacher_fp8": {"target_precision": "fp8"}}


def section_drafter_step(smoke: bool, iters: int, variants: tuple[str, ...] = tuple(DRAFTER_VARIANTS)) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "bench", "drafter_step"))
    import importlib.util

    spec = importlib.util.spec_from_file_location("drafter_step_run", os.path.join(ROOT, "bench", "drafter_step", "run.py"))
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    from trainer.plan import flops as fl

    shape, config, device = (ds.SMOKE_SHAPE, ds.SMOKE, "cpu") if smoke else (fl.QWEN3_8B, ds.OPERATORS, "cuda")
    out = {"shape": shape.name, "config": {k: v for k, v in config.items() if not isinstance(v, tuple)}}
    keep = ("median_s", "drafted_pos_s", "first_step_s", "first_step_compile_s", "peak_alloc_gib",
            "peak_reserved_gib", "model_reserved_gib", "loss_first_step", "mfu")
    for name, extra in ((v, DRAFTER_VARIANTS[v]) for v in variants):
        try:
            rec = ds.run("dflash", iters, shape, {**config, **extra}, device)
            out[name] = {k: rec.get(k) for k in keep}
        except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}", "traceback": traceback.format_exc()}
        print(json.dumps({"drafter_step": name, **out[name]}), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    for name in ("fp8", "teacher_fp8"):
        if "median_s" in out.get(name, {}) and "median_s" in out.get("bf16", {}):
            out[f"speedup_{name}"] = out["bf16"]["median_s"] / out[name]["median_s"]
            out[f"loss_diff_{name}"] = out[name]["loss_first_step"] - out["bf16"]["loss_first_step"]
    if any("error" in v for v in out.values() if isinstance(v, dict)):
        out["error"] = "a variant failed (see its traceback)"
    return out


def environment(device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                   scaled_mm=fp8.runs_here(device) or "runs", compiled=fo._COMPILE)
    return env


def write(out_dir: str, summary: dict) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "summary.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(summary, fh, indent=1)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for summary.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: the harness, not a measurement")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10 for GEMMs, 5 for forwards)")
    ap.add_argument("--sections", default="gemms,forward",
                    help="comma list of gemms, forward, teacher_head, drafter_step")
    ap.add_argument("--iters", type=int, default=5, help="timed drafter steps per variant (drafter_step)")
    ap.add_argument("--variants", default=",".join(DRAFTER_VARIANTS),
                    help=f"drafter_step's variants, of {','.join(DRAFTER_VARIANTS)} (bf16 is the baseline of the ratios)")
    ap.add_argument("--deadline-s", type=float, default=330.0, help="start no section after this many seconds")
    ap.add_argument("--batch", type=int, default=8, help="sequences in the forward (default 8)")
    args = ap.parse_args(argv)
    started = time.time()
    if args.smoke:
        device, dtype, shape, M, seq, attn = torch.device("cpu"), torch.float32, SMOKE_SHAPE, 256, 64, "math"
        batch = min(args.batch, 2)
    else:
        if not torch.cuda.is_available():
            print("bench/fp8/run.py: error: no CUDA device; use --smoke on CPU", file=sys.stderr)
            return 2
        device, dtype, shape, M, seq, attn = torch.device("cuda"), torch.bfloat16, QWEN3_8B, 8192, 8192, "cudnn"
        batch = args.batch
    reps_gemm = args.reps or (10 if not args.smoke else 2)
    reps_fwd = args.reps or (5 if not args.smoke else 2)
    summary = {"question": "the frozen target in FP8 (e4m3, per-channel weights, per-row activations quantized "
                           "in their producers) against bf16: GEMM time, forward time, taps' error",
               "shape": shape.name, "smoke": args.smoke, "env": environment(device), "sections": {}}
    write(args.out, summary)
    for name in [s for s in args.sections.split(",") if s]:
        if time.time() - started > args.deadline_s:
            summary["sections"][name] = {"skipped": f"deadline {args.deadline_s:.0f} s reached"}
            continue
        t0 = time.time()
        try:
            if name == "gemms":
                res = section_gemms(shape, M, device, dtype, Clock(device, reps_gemm))
            elif name == "forward":
                res = section_forward(shape, batch, seq, device, dtype, Clock(device, reps_fwd, warmup=1), attn)
            elif name == "teacher_head":
                res = section_teacher_head(shape, seq, 4096, device, dtype, Clock(device, reps_gemm))
            elif name == "drafter_step":
                variants = tuple(v for v in args.variants.split(",") if v)
                bad = [v for v in variants if v not in DRAFTER_VARIANTS]
                if bad:
                    ap.error(f"--variants {','.join(bad)}: not a variant; use some of {','.join(DRAFTER_VARIANTS)}")
                res = section_drafter_step(args.smoke, 1 if args.smoke else args.iters, variants)
            else:
                raise ValueError(f"unknown section {name!r}")
        except Exception as exc:  # noqa: BLE001 - one section's failure is its result, the rest still run
            res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(res["traceback"], file=sys.stderr, flush=True)
        res["wall_s"] = round(time.time() - t0, 1)
        summary["sections"][name] = res
        summary["wall_s"] = round(time.time() - started, 1)
        write(args.out, summary)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps({"summary": os.path.join(args.out, "summary.json"), "wall_s": summary["wall_s"]}), flush=True)
    return 0 if not any("error" in v for v in summary["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
