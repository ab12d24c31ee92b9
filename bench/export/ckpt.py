"""Checkpoint size: trainer/plan/ckptsize.py's torch-free prediction against checkpoints the trainer
really writes, and what `python -m trainer export` costs next to the save it exports.

    python3 bench/export/ckpt.py [--repeats 3]

For drafters of several widths (after one AdamW step, so the optimizer state is there) it
saves a checkpoint through trainer.checkpoint.save (drafter/ export + meta + checkpoint.pt),
measures the step directory's size on disk (file sizes rounded up to 4 KiB blocks) against
the prediction, then times `trainer.export.export` (bf16, checkpoint.pt memory-mapped)
against the save. Median of ``--repeats``. CPU only; seconds.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

SHAPES = [  # hidden, draft layers, intermediate, heads, kv heads, head_dim
    (64, 2, 128, 4, 2, 16),
    (512, 3, 1536, 8, 4, 64),
    (1024, 2, 2816, 16, 8, 64),
    (2048, 1, 5632, 16, 8, 128),
]


def du(path: str) -> int:
    from trainer.plan.ckptsize import _blocks

    return sum(_blocks(os.path.getsize(os.path.join(r, f))) for r, _, fs in os.walk(path) for f in fs)


def save_random_checkpoint(shape, out: str, config: dict | None = None) -> tuple[dict, float]:
    """A drafter of ``shape`` after one AdamW step (so the optimizer state exists), saved as
    OUTPUT/step_1 by trainer.checkpoint.save; returns (the target config.json it implies,
    seconds the save took)."""
    import torch

    from trainer import checkpoint as ckpt_io
    from trainer.model import Drafter, DrafterConfig

    H, L, inter, nh, nkv, hd = shape
    tcfg = dict(hidden_size=H, intermediate_size=inter, num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
                vocab_size=1000, num_hidden_layers=16, max_position_embeddings=4096)
    dcfg = DrafterConfig.from_target(tcfg, L, 16)
    drafter = Drafter(dcfg)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    drafter(torch.randn(1, 32, L * H), torch.randn(1, 16, H), torch.tensor([[32]]),
            torch.ones(1, 1, dtype=torch.bool)).sum().backward()
    opt.step()
    meta = {"config": {**(config or {}), "num_draft_layers": L, "max_seq_len": 4096}, "drafter_config": dcfg.to_hf(),
            "target": {}, "data_fingerprint": "0" * 64, "schedule": {"total_steps": 1}}
    t0 = time.perf_counter()
    ckpt_io.save(out, 1, drafter, meta, {"model": drafter.state_dict(), "optimizer": opt.state_dict()})
    return tcfg, time.perf_counter() - t0


def one(shape, work: str) -> dict:
    from trainer.plan import ckptsize
    from trainer.serve.export import export

    H, L = shape[:2]
    out = os.path.join(work, f"w{H}")
    tcfg, save_s = save_random_checkpoint(shape, out)
    params = ckptsize.drafter_params(tcfg, L)[0]
    t0 = time.perf_counter()
    export(out, os.path.join(work, f"e{H}"))
    export_s = time.perf_counter() - t0
    real = du(os.path.join(out, "step_1"))
    pred = ckptsize.checkpoint_bytes(tcfg, {"num_draft_layers": L})
    shutil.rmtree(out)
    shutil.rmtree(os.path.join(work, f"e{H}"))
    return {"params": params, "real": real, "pred": pred, "save_s": save_s, "export_s": export_s}


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="dflash-ckpt-bench-")
    rows = []
    try:
        for shape in SHAPES:
            runs = [one(shape, work) for _ in range(args.repeats)]
            r = runs[0]
            rows.append((shape, r["params"], r["real"], r["pred"], statistics.median(x["save_s"] for x in runs),
                         statistics.median(x["export_s"] for x in runs)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = ["| hidden × layers | parameters | step_N on disk | predicted | error | save (median) | export (median) | export / save |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (H, L, *_), params, real, pred, save_s, export_s in rows:
        lines.append(f"| {H} × {L} | {params:,} | {real / 2**20:.2f} MiB | {pred / 2**20:.2f} MiB | "
                     f"{100 * (pred - real) / real:+.2f} % | {save_s:.3f} s | {export_s:.3f} s | {export_s / save_s:.2f} |")
    table = "\n".join(lines)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
