"""One device call: ceilings, target forward, drafter step, memory model check.

    PYTHONUNBUFFERED=1 python3 bench/target_forward/run.py --out $OUT [--sections a,b,...]

Random weights made on the GPU (no download). Every timing is the median of several
iterations after warm-up, with CUDA events. Results go to OUT/results.json (appended per
section, so a timeout keeps what finished) and a table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved
from bench._timing import timed  # noqa: E402

import torch  # noqa: E402

from trainer.plan import flops as fl  # noqa: E402
from trainer.plan import memory as mm  # noqa: E402

GIB = 1024 ** 3
RESULTS: list[dict] = []
OUT = "."


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def save():
    with open(os.path.join(OUT, "results.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


def record(**kw):
    RESULTS.append(kw)
    save()
    log(json.dumps(kw))


def reset_peak():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def peaks():
    return torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB


# ------------------------------------------------------------------ a: ceilings
def sec_ceilings(args):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t, ts = timed(lambda: a @ b, warmup=3, iters=20)
    record(section="ceiling", what="bf16 matmul 8192^3 (random data)", tflops=2 * n ** 3 / t / 1e12, median_s=t)
    x = torch.empty(2 * GIB // 2, device="cuda", dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    t, _ = timed(lambda: y.copy_(x), warmup=3, iters=20)
    record(section="ceiling", what="device copy 2 GiB (read+write)", tbps=2 * x.numel() * 2 / t / 1e12, median_s=t)
    # the drafter's GEMM shapes (8B): M = 16384 positions
    for (m_, k_, n_) in [(16384, 4096, 12288 * 2), (16384, 12288, 4096), (4096, 4096, 151936)]:
        A = torch.randn(m_, k_, device="cuda", dtype=torch.bfloat16)
        W = torch.randn(n_, k_, device="cuda", dtype=torch.bfloat16)
        t, _ = timed(lambda: A @ W.t(), warmup=3, iters=10)
        record(section="ceiling", what=f"bf16 GEMM {m_}x{k_}x{n_}", tflops=2 * m_ * k_ * n_ / t / 1e12, median_s=t)
    del a, b, x, y, A, W


# ------------------------------------------------------------------ b: target forward
def _target_flops(shape, b, L, last):
    return fl.target_forward_flops(shape, [L] * b, last_layer=last)


def sec_target(args):
    from trainer.gpu.fast_target import FastTarget

    shape = fl.QWEN3_8B
    taps = [1, 9, 17, 25, 33]
    L = 8192
    reset_peak()
    ft = FastTarget.random(shape, taps, attn_backend="cudnn")
    base = torch.cuda.memory_allocated() / GIB
    for backend in ["cudnn", "flash"]:
        ft.attn = __import__("trainer.gpu.fast_target", fromlist=["x"]).sdpa_causal(backend)
        budgets = args.target_budgets if backend == "cudnn" else [49152]
        for budget in budgets:
            b = budget // L
            ids = torch.randint(0, shape.vocab - 1, (b, L), device="cuda")
            reset_peak()
            try:
                t, ts = timed(lambda: ft.forward(ids), warmup=2, iters=5)
            except Exception as e:  # noqa: BLE001
                record(section="target", impl=f"fast-{backend}", budget=budget, error=repr(e)[:300])
                continue
            f = _target_flops(shape, b, L, max(taps))
            pa, pr = peaks()
            pred = mm.target_peak_bytes(shape, token_budget=budget, max_seq_len=L, last_layer=max(taps))["total"] / GIB
            record(section="target", model="Qwen3-8B", impl=f"fast-{backend}", budget=budget, batch=b, seq=L,
                   median_s=t, times=ts, tok_s=b * L / t, mfu=fl.mfu(f, t), tflops=f / t / 1e12,
                   peak_alloc_gib=pa, peak_reserved_gib=pr, weights_gib=base, model_pred_gib=pred, padding_eff=1.0)
    # profile one forward at budget 49152 (cuDNN)
    try:
        from torch.profiler import ProfilerActivity, profile as prof
        ft.attn = __import__("trainer.gpu.fast_target", fromlist=["x"]).sdpa_causal("cudnn")
        ids = torch.randint(0, shape.vocab - 1, (6, L), device="cuda")
        ft.forward(ids)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            ft.forward(ids)
            torch.cuda.synchronize()
        with open(os.path.join(OUT, "target_profile.txt"), "w") as fh:
            fh.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
        del ids
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    # mixed lengths, length-sorted padded batches under the budget (real tokens counted)
    import random
    rng = random.Random(0)
    lens = sorted(min(8192, max(256, int(rng.lognormvariate(math.log(2200), 0.8)))) for _ in range(160))
    batches, cur = [], []
    for n in lens:
        if cur and (len(cur) + 1) * max(cur + [n]) > 49152:
            batches.append(cur)
            cur = []
        cur.append(n)
    if cur:
        batches.append(cur)
    ft.attn = __import__("trainer.gpu.fast_target", fromlist=["x"]).sdpa_causal("cudnn")
    real = sum(lens)
    padded = sum(len(bt) * max(bt) for bt in batches)
    inputs = [torch.randint(0, shape.vocab - 1, (len(bt), max(bt)), device="cuda") for bt in batches]
    for x in inputs:  # first pass: every shape seen once (cuDNN plans, compiled ops)
        ft.forward(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x in inputs:
        ft.forward(x)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    f = sum(fl.target_forward_flops(shape, bt, last_layer=max(taps)) for bt in batches)
    record(section="target", model="Qwen3-8B", impl="fast-cudnn mixed lengths", budget=49152, batches=len(batches),
           seqs=len(lens), mean_len=real / len(lens), wall_s=dt, tok_s=real / dt, mfu=fl.mfu(f, dt),
           padding_eff=real / padded)
    del ft, inputs
    torch.cuda.empty_cache()

    # HF reference: Qwen3Model with the layers up to the last tap, sdpa, hidden states out
    from transformers import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                      num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
                      num_key_value_heads=shape.n_kv_heads, head_dim=shape.head_dim, max_position_embeddings=40960,
                      attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = Qwen3Model(cfg).eval()
    torch.set_default_dtype(torch.float32)
    for budget in [16384]:
        b = budget // L
        ids = torch.randint(0, shape.vocab - 1, (b, L), device="cuda")
        reset_peak()

        def run():
            with torch.no_grad():
                o = hf(input_ids=ids, output_hidden_states=True, use_cache=False)
                return torch.cat([o.hidden_states[i + 1] for i in taps], -1)
        t, ts = timed(run, warmup=2, iters=4)
        f = _target_flops(shape, b, L, shape.n_layers - 1)
        pa, pr = peaks()
        record(section="target", model="Qwen3-8B", impl="hf-sdpa all 36 layers", budget=budget, batch=b, seq=L,
               median_s=t, times=ts, tok_s=b * L / t, mfu=fl.mfu(f, t), mfu_34layer_count=fl.mfu(_target_flops(shape, b, L, max(taps)), t),
               peak_alloc_gib=pa, peak_reserved_gib=pr)
    del hf
    torch.cuda.empty_cache()


def sec_target27(args):
    from trainer.gpu.fast_target import FastTarget

    shape = fl.QWEN3_27B_LIKE
    taps = [int(round(1 + i * (shape.n_layers - 4) / 4)) for i in range(5)]
    reset_peak()
    ft = FastTarget.random(shape, taps, attn_backend="cudnn")
    w = torch.cuda.memory_allocated() / GIB
    L = 8192
    for budget in [32768]:
        b = budget // L
        ids = torch.randint(0, shape.vocab - 1, (b, L), device="cuda")
        reset_peak()
        t, ts = timed(lambda: ft.forward(ids), warmup=1, iters=3)
        f = _target_flops(shape, b, L, max(taps))
        pa, pr = peaks()
        pred = mm.target_peak_bytes(shape, token_budget=budget, max_seq_len=L, last_layer=max(taps))["total"] / GIB
        record(section="target", model="Qwen3-27B-like", impl="fast-cudnn", budget=budget, batch=b, seq=L, taps=taps,
               median_s=t, times=ts, tok_s=b * L / t, mfu=fl.mfu(f, t), peak_alloc_gib=pa, peak_reserved_gib=pr,
               weights_gib=w, model_pred_gib=pred)
    del ft
    torch.cuda.empty_cache()


# ------------------------------------------------------------------ c: drafter step
def make_drafter_batch(shape, b, L, n_anchors, block, n_tapped, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, shape.vocab - 2, (b, L), device="cuda", generator=g)
    taps = torch.randn(b, L, n_tapped * shape.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    lm = torch.ones(b, L, dtype=torch.long, device="cuda")
    lengths = torch.full((b,), L, device="cuda")
    anchors = torch.stack([torch.randperm(L - 1, device="cuda", generator=g)[:n_anchors] for _ in range(b)]).sort(-1).values
    keep = torch.ones(b, n_anchors, dtype=torch.bool, device="cuda")
    return ids, taps, lm, lengths, anchors, keep


def drafter_run(shape, *, budget, block, n_anchors, chunk_anchors, head_rows, n_layers=5, warmup=2, iters=3,
                label="", profile=None, model_kind="mini"):
    from trainer.gpu import fast_drafter as fd

    L = 8192
    b = budget // L
    reset_peak()
    from trainer.model import Drafter, DrafterConfig

    d = Drafter(DrafterConfig.for_shape(shape, n_layers, block)).to("cuda")
    embed = torch.randn(shape.vocab, shape.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    head = torch.randn(shape.vocab, shape.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    decay = [p for n, p in d.named_parameters() if p.dim() >= 2]
    nodecay = [p for n, p in d.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=1e-4, fused=True)
    batch = make_drafter_batch(shape, b, L, n_anchors, block, n_layers)
    static = torch.cuda.memory_allocated() / GIB

    def step():
        out = fd.step_backward(d, embed, head, *batch, block_size=block, mask_token_id=shape.vocab - 1, gamma=7.0,
                               chunk_anchors=chunk_anchors, head_chunk_rows=head_rows)
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out

    t, ts = timed(step, warmup=warmup, iters=iters)
    pa, pr = peaks()
    anchors = batch[4]
    pairs = int(anchors.clamp(max=L).sum()) * block
    f = fl.drafter_step_flops(shape, n_layers=n_layers, block_size=block, n_blocks=b * n_anchors, ctx_tokens=b * L,
                              visible_ctx_pairs=pairs)
    pred = mm.drafter_peak_bytes(shape, n_layers=n_layers, block_size=block, max_anchors=n_anchors, max_seq_len=L,
                                 token_budget=budget, chunk_positions=chunk_anchors * block, head_chunk_rows=head_rows,
                                 double_buffer=False)
    positions = b * n_anchors * block
    rec = dict(section="drafter", model=shape.name, label=label, budget=budget, batch=b, block=block, anchors=n_anchors,
               chunk_anchors=chunk_anchors, head_rows=head_rows, median_s=t, times=ts, positions=positions,
               pos_s=positions / t, tok_s=b * L / t, mfu=fl.mfu(f["total"], t), tflops=f["total"] / t / 1e12,
               flops_split={k: f[k] / f["total"] for k in ("layers", "attention", "head", "context")},
               peak_alloc_gib=pa, peak_reserved_gib=pr, static_gib=static, model_pred_gib=pred["total"] / GIB,
               model_terms={k: pred[k] / GIB for k in ("params", "grads", "optimizer", "weights16", "frozen", "context",
                                                       "activations", "logit_chunk", "head_grad")},
               mb_per_position=pa * GIB / positions / 1e6, padding_eff=1.0)
    record(**rec)
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            step()
            torch.cuda.synchronize()
        tab = p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        with open(os.path.join(OUT, profile), "w") as fh:
            fh.write(tab)
        cats = {"gemm": 0.0, "flex": 0.0, "other": 0.0}
        for ev in p.key_averages():
            tt = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            nm = ev.key.lower()
            if any(s in nm for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul")):
                cats["gemm"] += tt
            elif "flex" in nm or "triton_tem" in nm:
                cats["flex"] += tt
            else:
                cats["other"] += tt
        tot = sum(cats.values()) or 1
        record(section="drafter-profile", label=label, split={k: v / tot for k, v in cats.items()},
               gpu_ms=tot / 1e3)
    del d, opt, batch, embed, head
    torch.cuda.empty_cache()
    return rec


def sec_drafter(args):
    shape = fl.QWEN3_8B
    first = True
    for budget, block, anchors in args.drafter_configs:
        try:
            drafter_run(shape, budget=budget, block=block, n_anchors=anchors, chunk_anchors=args.chunk_positions // block,
                        head_rows=4096, label=f"8B b{block} a{anchors}",
                        profile="drafter_profile.txt" if first else None, warmup=2 if first else 1)
            first = False
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(section="drafter", budget=budget, block=block, anchors=anchors, error=repr(e)[:400])


def sec_core(args):
    """The core engineer's Drafter (trainer/model.py): through fast_drafter.step_backward, and
    through its own forward + trainer/loss.py (unchunked; budget 8192)."""
    from trainer.gpu import fast_drafter as fd
    from trainer.loss import LossConfig, dflash_loss
    from trainer.model import Drafter, DrafterConfig

    shape = fl.QWEN3_8B
    tcfg = dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6)
    L = 8192
    def one(path, budget, block, n_anchors):
        b = budget // L
        reset_peak()
        try:
            d = Drafter(DrafterConfig.from_target(tcfg, 5, block)).cuda()
            embed = torch.randn(shape.vocab, shape.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
            head = torch.randn(shape.vocab, shape.hidden, device="cuda", dtype=torch.bfloat16) * 0.02
            opt = torch.optim.AdamW(d.parameters(), lr=1e-4, fused=True)
            ids, taps, lm, lengths, anchors, keep = make_drafter_batch(shape, b, L, n_anchors, block, 5)
            lcfg = LossConfig(block_size=block, gamma=7.0)

            def step():
                if path == "fast":
                    fd.step_backward(d, embed, head, ids, taps, lm, lengths, anchors, keep, block_size=block,
                                     mask_token_id=shape.vocab - 1, gamma=7.0, chunk_anchors=16384 // block)
                else:
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        bl = torch.full((b, n_anchors, block), shape.vocab - 1, device="cuda", dtype=torch.long)
                        bl[:, :, 0] = ids.gather(1, anchors)
                        blocks = torch.nn.functional.embedding(bl.view(b, -1), embed)
                        out = d(taps, blocks, anchors, keep, "flex")
                        lo = dflash_loss(lcfg, out, head, ids, lm, lengths, anchors, keep)
                    lo.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            t, ts = timed(step, warmup=2, iters=3)
            pa, pr = peaks()
            pairs = int(anchors.sum()) * block
            f = fl.drafter_step_flops(shape, n_layers=5, block_size=block, n_blocks=b * n_anchors, ctx_tokens=b * L,
                                      visible_ctx_pairs=pairs)["total"]
            pos = b * n_anchors * block
            record(section="drafter", model="Qwen3-8B", label=f"core Drafter {path} b{block} a{n_anchors}", budget=budget,
                   block=block, anchors=n_anchors, median_s=t, times=ts, positions=pos, pos_s=pos / t, tok_s=b * L / t,
                   mfu=fl.mfu(f, t), peak_alloc_gib=pa, peak_reserved_gib=pr, model_pred_gib=0.0,
                   mb_per_position=pa * GIB / pos / 1e6)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(section="drafter", label=f"core Drafter {path} b{block} a{n_anchors}", budget=budget,
                   error=repr(e)[:300], peak_alloc_gib=peaks()[0])
        torch.cuda.empty_cache()

    for cfg in [("fast", 49152, 32, 1024), ("own", 8192, 32, 1024), ("own", 8192, 16, 512)]:
        one(*cfg)
        torch.cuda.empty_cache()


def sec_drafter27(args):
    shape = fl.QWEN3_27B_LIKE
    try:
        drafter_run(shape, budget=49152, block=32, n_anchors=1024, chunk_anchors=256, head_rows=2048,
                    label="27B-like memory target", warmup=1, iters=2)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        record(section="drafter", model="27B", error=repr(e)[:400])


def table():
    lines = ["", "=" * 100]
    for r in RESULTS:
        s = r.get("section")
        if "error" in r:
            lines.append(f"{s:9} ERROR {r.get('impl', r.get('label', ''))} {r.get('budget', '')}: {r['error'][:120]}")
        elif s == "ceiling":
            v = r.get("tflops") or r.get("tbps")
            lines.append(f"ceiling   {r['what']:40} {v:8.1f} {'TFLOP/s' if 'tflops' in r else 'TB/s'}")
        elif s == "target":
            lines.append(f"target    {r['model']:15} {r['impl']:28} budget {r['budget']:6} {r['tok_s'] / 1e3:7.1f} Ktok/s "
                         f"MFU {100 * r['mfu']:5.1f}% peak {r.get('peak_alloc_gib', 0):6.1f} GiB pred {r.get('model_pred_gib', 0):6.1f} pad {r.get('padding_eff', 1):.3f}")
        elif s == "drafter":
            lines.append(f"drafter   {r['label']:24} budget {r['budget']:6} {r['pos_s'] / 1e3:7.1f} Kpos/s {r['tok_s'] / 1e3:6.1f} Ktok/s "
                         f"MFU {100 * r['mfu']:5.1f}% peak {r['peak_alloc_gib']:6.1f}/{r['peak_reserved_gib']:6.1f} GiB pred {r['model_pred_gib']:6.1f} "
                         f"{r['mb_per_position']:.3f} MB/pos")
        elif s == "drafter-profile":
            lines.append(f"profile   {r['label']:24} " + " ".join(f"{k} {100 * v:.0f}%" for k, v in r["split"].items()) + f" ({r['gpu_ms']:.0f} ms)")
    print("\n".join(lines), flush=True)


def main():
    global OUT
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="ceilings,target,drafter,drafter27,target27")
    ap.add_argument("--target-budgets", default="8192,16384,32768,49152")
    ap.add_argument("--drafter", default="49152:32:1024,24576:32:1024,8192:32:1024,49152:16:512")
    ap.add_argument("--chunk-positions", type=int, default=16384)
    args = ap.parse_args()
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    args.target_budgets = [int(x) for x in args.target_budgets.split(",")]
    args.drafter_configs = [tuple(int(v) for v in c.split(":")) for c in args.drafter.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = True
    p = torch.cuda.get_device_properties(0)
    log(f"torch {torch.__version__} device {p.name} SMs {p.multi_processor_count} mem {p.total_memory / GIB:.1f} GiB")
    record(section="env", torch=torch.__version__, device=p.name, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    fns = {"core": sec_core, "ceilings": sec_ceilings, "target": sec_target, "drafter": sec_drafter, "drafter27": sec_drafter27,
           "target27": sec_target27}
    for name in args.sections.split(","):
        t0 = time.time()
        log(f"--- section {name}")
        try:
            fns[name](args)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record(section=name, error=repr(e)[:400])
        log(f"--- section {name} done in {time.time() - t0:.0f}s")
        torch.cuda.empty_cache()
    table()


if __name__ == "__main__":
    main()
