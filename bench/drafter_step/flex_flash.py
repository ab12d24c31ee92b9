"""Flex attention's FlashAttention-4 backend (``kernel_options={"BACKEND": "FLASH"}``,
CuTe DSL kernels from the ``flash-attn-4`` package) against its Triton kernels, on one chunk of
the DFlash mask at the operators' shape (Qwen3-8B widths: 32 query / 8 KV heads of 128; 512
anchors × block 32 over 8,192 context positions; the block mask built from the anchors as the
step builds it). Both backends' output and gradients are held to the Triton kernels run on
fp32 copies of the inputs (‖x − ref‖ / ‖ref‖); then forward and forward + backward are timed
(CUDA events, median). One JSON line per backend, a summary last.

    PYTHONUNBUFFERED=1 python3 bench/drafter_step/flex_flash.py [--out results.json]
    python3 bench/drafter_step/flex_flash.py --smoke      # the harness on CPU: Triton's eager path only

The FLASH backend needs ``flash-attn-4`` and ``nvidia-cutlass-dsl`` importable (carried as
wheels: bench/gpu_setup/README.md); a failure to build or run is
recorded as that backend's error, not raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

from bench.drafter_step import roofline as rl  # noqa: E402
from trainer.plan import flops as fl  # noqa: E402

BACKENDS = {"triton": {}, "flash": {"BACKEND": "FLASH"}}


def rel(x, ref) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def run(smoke: bool) -> dict:
    import torch

    from trainer.layers.flex_mask import flex_attention_fn

    shape, n_anchors, B, S = (rl.SMOKE_SHAPE, 16, 8, 128) if smoke else (fl.QWEN3_8B, 512, 32, 8192)
    dev = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    q, k, v, bm, pairs = rl._flex_inputs(shape, n_anchors, B, S, dev, dtype)
    if smoke:  # flex attention on CPU runs forward only, on inputs that need no gradient
        q, k, v = q.detach(), k.detach(), v.detach()
    flex = flex_attention_fn(dev.type)
    go = torch.randn_like(q)
    fwd_flop = 4 * shape.q_dim * pairs
    out = {"pairs": pairs, "fwd_flop": fwd_flop, "backends": {}}

    def grads(qq, kk, vv, opts):
        qq, kk, vv = (t.detach().clone().requires_grad_(not smoke) for t in (qq, kk, vv))
        kw = {"kernel_options": opts} if opts else {}
        o = flex(qq, kk, vv, block_mask=bm, enable_gqa=True, **kw)
        if smoke:
            return o.detach(), None, None, None
        o.backward(go.to(o.dtype))
        return o.detach(), qq.grad, kk.grad, vv.grad

    ref = grads(q.float(), k.float(), v.float(), {})
    for name, opts in BACKENDS.items():
        if smoke and opts:
            out["backends"][name] = {"skipped": "CPU"}
            continue
        rec: dict = {"options": opts}
        try:
            t0 = time.perf_counter()
            got = grads(q, k, v, opts)
            if not smoke:
                torch.cuda.synchronize()
            rec["compile_and_first_s"] = time.perf_counter() - t0
            rec["rel_err"] = {n: rel(g, r) for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref) if g is not None}
            rec.update({key: x for key, x in rl.flex_timing(flex, q, k, v, bm, go, fwd_flop, opts, smoke).items()
                        if key != "compile_and_first_s"})  # the first call above compiled
        except Exception as exc:  # noqa: BLE001 - a backend that cannot build is a result
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            rec["trace_tail"] = traceback.format_exc()[-2000:]
        out["backends"][name] = rec
        print(json.dumps({name: rec}), flush=True)
    t, f = out["backends"].get("triton", {}), out["backends"].get("flash", {})
    if "fwdbwd_s" in t and "fwdbwd_s" in f:
        out["speedup"] = {"fwd": t["fwd_s"] / f["fwd_s"], "bwd": t["bwd_s"] / f["bwd_s"],
                          "fwdbwd": t["fwdbwd_s"] / f["fwdbwd_s"]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    res = run(a.smoke)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    print("summary", json.dumps({"speedup": res.get("speedup"),
                                 **{n: r.get("rel_err", r.get("error", r.get("skipped")))
                                    for n, r in res["backends"].items()}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
