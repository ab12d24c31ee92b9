"""The one timer of the GPU benchmarks: the median of several calls after warm-up."""

from __future__ import annotations

import statistics
import time


def timed(fn, warmup: int = 2, iters: int = 5, cuda: bool = True) -> tuple[float, list[float]]:
    """(median s, every s) of ``fn`` after ``warmup`` calls: CUDA events on a GPU, the wall
    clock on CPU (the CPU smoke runs of the benches)."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            continue
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return statistics.median(ts), ts
