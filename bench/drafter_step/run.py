"""How fast is the drafter step at the operators' shape? One GPU, both architectures:

    PYTHONUNBUFFERED=1 python3 bench/drafter_step/run.py --out DIR [--iters 5] [--archs dflash,dflash2]
    python3 bench/drafter_step/run.py --out /tmp/ds --smoke      # the same code on CPU, tiny widths

The trainer's own step (trainer/step.py ``make_step``: ChunkedStep, bf16 compute, fp32
masters) on Qwen3-8B widths with random weights made on the GPU and random tokens (no
download): 5 layers, block 32, 1,024 anchors per sequence, token budget 49,152 (6 × 8,192),
soft labels (kl_weight 0.15, T 2), CAP 0.1, γ 10 — the operators' command line — plus
fused AdamW and the global-norm clip, as one optimizer step with --grad-accum 1. The
architectures get the same batch. Every timing is the median of ``--iters`` steps after the
first step (the compiles) and one warm-up (CUDA events). Written to DIR/results.json after
each architecture, and DIR/metrics.json (what bench/compare.py reads):

* drafted positions/s (kept blocks × block size / step time) and tokens/s;
* MFU against 989 TFLOP/s (dense bf16), counting DFlash's FLOPs (trainer/plan/flops.py
  drafter_step_flops with the teacher logits) for both, and for DFlash2 also with its own
  additions (``dflash2_extra_flops``: the convolutions' projections, the selector's unary
  rows, projection and pair scores; forward + backward, no recompute counted);
* allocated and reserved peaks beside the memory model's prediction (trainer/plan/memory.py via
  trainer/plan/budget.py, the same plan the trainer checks before it starts);
* the first step's loss (the same weights and batch give the same loss in two trees whose
  arithmetic is the same).

Before/after against a base commit: bench/compare.py (bench/drafter_step/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

import torch  # noqa: E402

from trainer import arch as archs  # noqa: E402
from trainer.plan import budget  # noqa: E402
from trainer import flags  # noqa: E402
from trainer.plan import flops as fl  # noqa: E402
from trainer.plan import memory as mm  # noqa: E402

GIB = 1024 ** 3
OPERATORS = dict(block_size=32, max_anchors=1024, token_budget=49152, max_seq_len=8192, max_batch_size=64,
                 num_draft_layers=5, gamma=10.0, position_weights="decay", use_soft_labels=True, kl_weight=0.15,
                 kl_temperature=2.0, cap_lambda=0.1, grad_accum=1, drafter_step="chunked",
                 target_gpus=(0,), drafter_gpus=(0,),
                 # named, not auto: what is measured must not depend on what the machine has
                 # installed (--attention-kernel flash for flash-attn-4)
                 attention_kernel="triton")
# --smoke: the same code on CPU at tiny widths (the step is then the chunked step's CPU path)
SMOKE_SHAPE = fl.ModelShape(6, 64, 4, 2, 16, 128, 512, "tiny")
SMOKE = {**OPERATORS, "block_size": 8, "max_anchors": 16, "token_budget": 256, "max_seq_len": 128, "num_draft_layers": 2}


def config_of(shape) -> dict:
    """A Qwen3 config.json of these widths (what the memory plan reads)."""
    return {"model_type": "qwen3", "hidden_size": shape.hidden, "num_attention_heads": shape.n_heads,
            "num_key_value_heads": shape.n_kv_heads, "head_dim": shape.head_dim, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.n_layers, "vocab_size": shape.vocab, "tie_word_embeddings": False,
            "rope_theta": 1e6}


def dflash2_extra_flops(shape, n_layers: int, positions: int, head_positions: int) -> int:
    """Forward + backward (3×) FLOPs DFlash2 adds: per position and layer two projections
    H → 2·taps·H/16; per drafting slot the k candidates' unary rows (k·H), the selector's
    projection H → rank and the pair scores (k·rank)."""
    s = archs.DFLASH2_SHAPE
    conv = 2 * 2 * shape.hidden * 2 * s["conv_kernel_size"] * (shape.hidden // s["conv_group_size"])
    k, r = s["selector_top_k"], s["selector_rank"]
    selector = 2 * (k * shape.hidden + shape.hidden * r + k * r)
    return 3 * (conv * n_layers * positions + selector * head_positions)


def batch(shape, b: int, L: int, n_anchors: int, n_tapped: int, dev, dtype):
    from trainer.topology import MicroBatch

    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, shape.vocab - 2, (b, L), device=dev, generator=g)
    anchors = torch.stack([torch.randperm(L - 1, device=dev, generator=g)[:n_anchors] for _ in range(b)]).sort(-1).values
    return MicroBatch(index=0, epoch=0, sample_ids=torch.arange(b, device=dev), input_ids=ids,
                      loss_mask=torch.ones(b, L, dtype=torch.long, device=dev), lengths=torch.full((b,), L, device=dev),
                      anchors=anchors, keep=torch.ones(b, n_anchors, dtype=torch.bool, device=dev),
                      taps=torch.randn(b, L, n_tapped * shape.hidden, device=dev, dtype=dtype, generator=g),
                      final=torch.randn(b, L, shape.hidden, device=dev, dtype=dtype, generator=g))


def drafter_and_head(arch: str, shape, config: dict, dev):
    """A fresh drafter at ``shape`` (seeded) and a random frozen head, peak stats reset: what
    every step bench here starts from. Returns (flag values, args, drafter config, drafter,
    head, dtype)."""
    from trainer.model import Drafter, DrafterConfig, FrozenHead

    cuda = dev.type == "cuda"
    values = {**flags.defaults(), **config, "drafter_arch": arch}
    args = SimpleNamespace(**values)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    dcfg = DrafterConfig.for_shape(shape, args.num_draft_layers, args.block_size, drafter_arch=arch)
    with torch.device(dev):
        drafter = Drafter(dcfg)
    g = torch.Generator(device=dev).manual_seed(1)
    dtype = torch.bfloat16 if cuda else torch.float32  # the trainer's: target states and head in bf16 on GPU
    head = FrozenHead(torch.randn(shape.vocab, shape.hidden, device=dev, dtype=dtype, generator=g) * 0.02,
                      torch.randn(shape.vocab, shape.hidden, device=dev, dtype=dtype, generator=g) * 0.02)
    # the precisions as train.build_drafter sets them (absent in a base tree from before them)
    if values.get("drafter_precision") == "fp8":
        from trainer.gpu import fp8_train

        fp8_train.convert(drafter)
    if values.get("target_precision") == "fp8" and values.get("use_soft_labels"):
        head.quantize_teacher()
    return values, args, dcfg, drafter, head, dtype


def run(arch: str, iters: int, shape=fl.QWEN3_8B, config: dict = OPERATORS, device: str = "cuda",
        profile: bool = False) -> dict:
    """One architecture's step: first step (compiles), one warm-up, the median of ``iters``;
    with ``profile``, one more step under torch.profiler (its kernel-class summary in
    ``profile``, for bench/drafter_step/roofline.py's table)."""
    from bench._timing import timed
    from trainer.gpu import kernel_profile as kp
    from trainer.gpu.fast_drafter import teacher_rows_computed
    from trainer.step import make_step
    from trainer.train import compile_stats

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    values, args, dcfg, drafter, head, dtype = drafter_and_head(arch, shape, config, dev)
    decayed = {n: p.dim() >= 2 and not n.endswith("base_kernel") for n, p in drafter.named_parameters()}
    opt = torch.optim.AdamW([{"params": [p for n, p in drafter.named_parameters() if decayed[n]], "weight_decay": 0.01},
                             {"params": [p for n, p in drafter.named_parameters() if not decayed[n]], "weight_decay": 0.0}],
                            lr=1e-4, fused=cuda or None)
    step = make_step(args, drafter, head, dcfg)
    b = args.token_budget // args.max_seq_len
    mb = batch(shape, b, args.max_seq_len, args.max_anchors, len(dcfg.target_layer_ids), dev, dtype)

    def one():
        stats = step(mb, mb.taps)
        with kp.region(kp.REGION_OPTIMIZER):
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return stats

    c0 = compile_stats()["compile_s"]
    t0 = time.perf_counter()
    stats = one()
    if cuda:
        torch.cuda.synchronize()
    first_s, first_compile = time.perf_counter() - t0, compile_stats()["compile_s"] - c0
    loss = float(stats.loss)
    t, times = timed(one, 1, iters, cuda)
    positions = b * args.max_anchors * args.block_size
    head_positions = b * args.max_anchors * (args.block_size - 1)
    pairs = int(mb.anchors.sum()) * args.block_size
    f = fl.drafter_step_flops(shape, n_layers=args.num_draft_layers, block_size=args.block_size,
                              n_blocks=b * args.max_anchors, ctx_tokens=b * args.max_seq_len, visible_ctx_pairs=pairs,
                              teacher_positions=head_positions)["total"]
    extra = dflash2_extra_flops(shape, args.num_draft_layers, positions, head_positions) if arch == "dflash2" else 0
    pred = mm.predict(budget.run_spec(values, config_of(shape), "drafter", args.token_budget))
    rec = {"arch": arch, "batch": b, "block": args.block_size, "anchors": args.max_anchors,
           "budget": args.token_budget, "layers": args.num_draft_layers, "first_step_s": first_s,
           "first_step_compile_s": first_compile, "median_s": t, "times": times,
           "drafted_pos_s": positions / t, "tokens_s": b * args.max_seq_len / t,
           "mfu": fl.mfu(f, t), "mfu_own": fl.mfu(f + extra, t), "extra_flops_frac": extra / f,
           "params": sum(p.numel() for p in drafter.parameters()), "pairs": pairs,
           "top_k": dcfg.selector_top_k if drafter.selector is not None else 0,
           "teacher_rows": teacher_rows_computed(mb.anchors, mb.keep, args.max_seq_len, args.block_size),
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
           "model_allocated_gib": pred.allocated / GIB, "model_reserved_gib": pred.reserved / GIB,
           "loss_first_step": loss}
    if profile:
        with kp.profile_step() as res:
            one()
        rec["profile"], rec["profile_wall_s"] = res["summary"], res["wall_s"]
    return rec


def metrics(runs: list[dict]) -> dict:
    """The figures bench/compare.py sets side by side: name -> {value, better}."""
    out = {}
    for r in runs:
        if "error" in r:
            continue
        a = r["arch"]
        out[f"{a}.drafted_pos_s"] = {"value": r["drafted_pos_s"], "better": "higher"}
        out[f"{a}.step_s"] = {"value": r["median_s"], "better": "lower"}
        out[f"{a}.first_step_s"] = {"value": r["first_step_s"], "better": "lower"}
        out[f"{a}.loss_first_step"] = {"value": r["loss_first_step"], "better": "same"}
        if r.get("peak_reserved_gib") is not None:
            out[f"{a}.peak_reserved_gib"] = {"value": r["peak_reserved_gib"], "better": "lower"}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--archs", default="dflash,dflash2")
    p.add_argument("--attention-kernel", default="triton", choices=["triton", "flash"],
                   help="the trainer's --attention-kernel (flash needs flash-attn-4 importable)")
    p.add_argument("--smoke", action="store_true", help="tiny widths on CPU: the script's own check, no figures")
    a = p.parse_args()
    if not a.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    os.makedirs(a.out, exist_ok=True)
    shape, config, device = (SMOKE_SHAPE, SMOKE, "cpu") if a.smoke else (fl.QWEN3_8B, OPERATORS, "cuda")
    config = {**config, "attention_kernel": a.attention_kernel}
    results = {"gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
               "date": time.strftime("%F %T %Z"), "config": config, "shape": shape.name, "runs": []}
    for arch in a.archs.split(","):
        try:
            rec = run(arch, a.iters, shape, config, device)
        except Exception as exc:  # noqa: BLE001 — recorded; the other architecture still runs
            rec = {"arch": arch, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        results["runs"].append(rec)
        print(json.dumps(rec), flush=True)
        with open(os.path.join(a.out, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1)
        with open(os.path.join(a.out, "metrics.json"), "w") as fh:
            json.dump(metrics(results["runs"]), fh, indent=1)
    ok = {r["arch"]: r for r in results["runs"] if "error" not in r}
    if {"dflash", "dflash2"} <= set(ok):
        print(f"DFlash2 / DFlash drafted positions/s: {ok['dflash2']['drafted_pos_s'] / ok['dflash']['drafted_pos_s']:.3f}",
              flush=True)
    return 0 if len(ok) == len(results["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
