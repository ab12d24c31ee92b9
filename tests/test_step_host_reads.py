"""The drafter step never reads a tensor's value back on the host.

On a GPU every such read (``.item()``, ``bool(t)``, a data-dependent shape such as
``nonzero``) drains the queue, and the host then launches every later kernel late: one in
CAP's cumprod backward, once per anchor chunk, cost an H100 about 85 ms of idle a DFlash step
(docs/benchmarks.md, 2026-12-05). This runs the chunked step on CPU at a small shape
(the same code up to the CUDA-only kernels) under a dispatch mode that records every operator
whose result the host must see, with the trainer/ lines that asked for it.
"""

from __future__ import annotations

import collections
import os
import sys
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
              torch.ops.aten.masked_select.default, torch.ops.aten.is_nonzero.default}


class HostReads(TorchDispatchMode):
    """Counts host-reading operators, forward and backward, by the trainer/ lines behind them."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            frames = [f for f in traceback.extract_stack() if f"{os.sep}trainer{os.sep}" in f.filename]
            where = " < ".join(f"{os.path.basename(f.filename)}({f.lineno})" for f in frames[::-1][:3])
            self.seen[(str(func), where or "(outside trainer/)")] += 1
        return func(*args, **(kwargs or {}))


def _step(arch: str):
    sys.path.insert(0, ROOT)
    from bench.drafter_step import run as ds

    from trainer.step import make_step

    torch.manual_seed(0)
    dev = torch.device("cpu")
    _, args, dcfg, drafter, head, dtype = ds.drafter_and_head(arch, ds.SMOKE_SHAPE, dict(ds.SMOKE), dev)
    step = make_step(args, drafter, head, dcfg)
    mb = ds.batch(ds.SMOKE_SHAPE, args.token_budget // args.max_seq_len, args.max_seq_len, args.max_anchors,
                  len(dcfg.target_layer_ids), dev, dtype)
    return step, mb, drafter


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_the_chunked_step_reads_nothing_back_on_the_host(arch):
    step, mb, drafter = _step(arch)
    assert type(step).__name__ == "ChunkedStep"
    step(mb, mb.taps)  # first call: lazy set-up may look at values once
    rec = HostReads()
    with rec:
        stats = step(mb, mb.taps)
    assert dict(rec.seen) == {}
    assert torch.isfinite(stats.loss) and any(p.grad is not None for p in drafter.parameters())


def test_the_recorder_sees_a_read_in_a_backward():
    """The mode sees the backward's operators too: a host read inside an autograd Function's
    backward is counted (what cumprod's backward did on torch 2.11)."""

    class Peek(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2 if bool((g != 0).any()) else g

    x = torch.rand(4, requires_grad=True)
    rec = HostReads()
    with rec:
        Peek.apply(x).sum().backward()
    assert sum(n for (op, _), n in rec.seen.items() if "_local_scalar_dense" in op or "is_nonzero" in op) == 1
