"""What each weight GEMM's backward costs the host: the hook path against the GEMM adding into .grad.

On an H100 (docs/benchmarks.md, issue 29, session 2026-12-05d) trainer/master_grad_linear.py
took the 46 ms fp32 += bf16 add out of the DFlash step, but the GPU idled 20 ms more. The
suspect is the host: the backward now runs a Python autograd Function per GEMM (4 per layer,
5 layers, 12 chunks: 240 a step) where autograd's own node and a hook ran before. This times
the host side alone: one layer's four GEMMs (model.StepGemmWeights) on matrices so small that
the arithmetic is nothing, forward + backward, many times, each path in turn (interleaved
rounds), and reports the host µs per GEMM's forward + backward. A difference × 240 is what the
step's host does more per step; whether the GPU waits for it depends on how far ahead the host
runs there.

    .venv/bin/python bench/wgrad_host_cost.py [--rounds 7] [--iters 2000]

Prints one line per path and JSON with the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from trainer import master_grad_linear as mgl  # noqa: E402
from trainer.model import StepLinear  # noqa: E402


def layer(width: int):
    lin = lambda o, i: nn.Linear(i, o, bias=False)  # noqa: E731
    q, k, v, o = lin(width, width), lin(width // 2, width), lin(width // 2, width), lin(width, width)
    gate, up, down = lin(2 * width, width), lin(2 * width, width), lin(width, 2 * width)
    return (q, k, v), (o,), (gate, up), (down,)


def run(groups, into_grad: bool, x: torch.Tensor, iters: int) -> float:
    """Host seconds per GEMM (forward + backward) over ``iters`` chunks of one layer."""
    for ps in groups:
        for m in ps:
            m.weight.grad = None
    t0 = time.perf_counter()
    for _ in range(iters):
        gemm = [StepLinear(g, torch.bfloat16, into_grad) for g in groups]
        h = x.detach().requires_grad_(True)
        qkv = gemm[0](h)
        out = gemm[1](qkv[..., :h.shape[-1]])
        gu = gemm[2](out)
        y = gemm[3](gu[..., :gu.shape[-1] // 2])
        y.sum().backward()
    return (time.perf_counter() - t0) / (iters * len(groups))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--width", type=int, default=8)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    groups = layer(a.width)
    x = torch.randn(1, 4, a.width).to(torch.bfloat16)
    run(groups, False, x, 50)  # warm-up, both paths
    run(groups, True, x, 50)
    times = {"hook": [], "into_grad": []}
    for _ in range(a.rounds):
        times["hook"].append(run(groups, False, x, a.iters))
        times["into_grad"].append(run(groups, True, x, a.iters))
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:10s} {v:7.1f} µs per GEMM (forward + backward, host), median of {a.rounds} × {a.iters} chunks")
    diff = med["into_grad"] - med["hook"]
    print(f"into_grad − hook: {diff:+.1f} µs per GEMM, {diff * 240 / 1e3:+.1f} ms per DFlash step (240 GEMMs)")
    print(json.dumps({"us_per_gemm": med, "diff_us": diff, "rounds": a.rounds, "iters": a.iters,
                      "torch": torch.__version__, "fused_gemm_on_this_device": mgl.fused_gemm_supported(x.device)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
