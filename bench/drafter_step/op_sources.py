"""Which lines of the trainer launch a drafter step's small kernels?

kernel_profile.py classes a step's kernels (matmuls, attention, elementwise, copies); this says
where the non-matmul ones come from: one step of the operators' shape (roofline.py's, the
shipped code, Qwen3-8B widths) under torch.profiler with Python stacks, its operators grouped
by the innermost frames in trainer/, ranked by the GPU time they launched. What it prints is a
map for the next change, not a figure to report.

    PYTHONUNBUFFERED=1 python3 bench/drafter_step/op_sources.py --out DIR [--arch dflash] [--attention-kernel flash]
    python3 bench/drafter_step/op_sources.py --smoke --out /tmp/os      # the same on CPU, tiny widths

Writes DIR/op_sources.txt (the table) and DIR/op_sources.json.

Known gap: on the H200 (2026-12-05, torch 2.11) the backward's rows named their autograd node
(ToCopyBackward0, AccumulateGrad: enough to find the per-chunk weight casts) but no operator
had its trainer/ frames, which the CPU run has; and that run counted each kernel twice (its
own record and its operator's), since fixed here (CPU-side records only) but not rerun there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

from trainer.gpu import kernel_profile as kp  # noqa: E402

# the step's named regions (record_function ranges): they hold kernels, they launch none
REGIONS = {kp.REGION_TARGET, kp.REGION_HEAD, kp.REGION_OPTIMIZER, kp.REGION_SELECTOR}
# matmuls and attention are the roofline table's own classes; these are what lies between them
AUTOGRAD = "autograd::engine::evaluate_function:"
SKIP = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "flex_attention")


def trainer_frames(stack: list[str], depth: int = 3) -> str:
    """The innermost ``depth`` Python frames (the profiler's "file.py(line): function", innermost
    first) that lie in trainer/, named by their path under trainer/ (two wings may hold files of
    one name): where an operator was asked for."""
    mine = [f for f in stack if "trainer/" in f or "trainer\\" in f]
    return " < ".join(f.split("trainer/")[-1] for f in mine[:depth]) or "(outside trainer/)"


def rank(rows: list[dict], top: int) -> list[dict]:
    """Operator rows ({name, device_us, count, where}) merged by (name, where) and ranked by
    device time; matmuls and attention left out."""
    merged: dict[tuple[str, str], dict] = {}
    for r in rows:
        if any(r["name"].startswith(s) for s in SKIP) or r["device_us"] <= 0:
            continue
        m = merged.setdefault((r["name"], r["where"]), {"name": r["name"], "where": r["where"], "device_us": 0.0,
                                                         "count": 0})
        m["device_us"] += r["device_us"]
        m["count"] += r["count"]
    return sorted(merged.values(), key=lambda m: -m["device_us"])[:top]


def profiled_step(arch: str, attention_kernel: str, smoke: bool):
    """One optimizer step of the operators' shape (roofline.py's, this tree's code; tiny widths
    on CPU with ``smoke``) under torch.profiler with Python stacks, after two unprofiled steps
    (compiled, autotuned, optimizer state held): the profiler object."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.drafter_step import roofline as rl
    from bench.drafter_step import run as ds
    from trainer.plan import flops as fl
    from trainer.step import make_step

    cuda = not smoke
    shape, config, dev = (rl.SMOKE_SHAPE, ds.SMOKE, torch.device("cpu")) if smoke else \
        (fl.QWEN3_8B, ds.OPERATORS, torch.device("cuda"))
    config = {**config, "attention_kernel": attention_kernel}
    values, args, dcfg, drafter, head, dtype = ds.drafter_and_head(arch, shape, config, dev)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda or None)
    step = make_step(args, drafter, head, dcfg)
    b = args.token_budget // args.max_seq_len
    mb = ds.batch(shape, b, args.max_seq_len, args.max_anchors, len(dcfg.target_layer_ids), dev, dtype)

    def one():
        step(mb, mb.taps)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        one()
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts, with_stack=True, record_shapes=False) as prof:
        one()
        if cuda:
            torch.cuda.synchronize()
    return prof


def step_parser(doc: str, top: int) -> argparse.ArgumentParser:
    """The profiled step's command line (this script's and idle_sources.py's)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--arch", default="dflash", choices=["dflash", "dflash2"])
    p.add_argument("--attention-kernel", default="triton", choices=["triton", "flash"],
                   help="the trainer's --attention-kernel (flash needs flash-attn-4)")
    p.add_argument("--top", type=int, default=top)
    p.add_argument("--smoke", action="store_true")
    return p


def profile_for(p: argparse.ArgumentParser, a: argparse.Namespace):
    """profiled_step for parsed arguments ``a``; a GPU run without a GPU is a usage error."""
    if not a.smoke:
        import torch
        if not torch.cuda.is_available():
            p.error("needs a CUDA device (or --smoke)")
    return profiled_step(a.arch, a.attention_kernel, a.smoke)


def main() -> int:
    p = step_parser(__doc__, 60)
    a = p.parse_args()

    from torch.autograd import DeviceType

    cuda = not a.smoke
    prof = profile_for(p, a)
    rows = []
    for e in prof.events():
        if e.device_type != DeviceType.CPU:
            continue  # a kernel's own record: its time is already its launching operator's
        if ".py(" in e.name or e.name.startswith("<built-in") or e.name in REGIONS or e.name.startswith(("_", AUTOGRAD)):
            continue  # Python frames (the "where"), the step's named regions and autograd.Functions: no kernels of their own
        stack, up, grad_fn = [], e.cpu_parent, ""
        while up is not None:
            if ".py(" in up.name:
                stack.append(up.name)
            elif not grad_fn and up.name.startswith(AUTOGRAD):
                grad_fn = up.name[len(AUTOGRAD):].strip() + " in "  # a backward's kernels: which node
            up = up.cpu_parent
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        rows.append({"name": e.name, "device_us": float(us), "count": 1,
                     "where": grad_fn + trainer_frames(stack)})
    ranked = rank(rows, a.top)
    unit = "GPU ms" if cuda else "CPU ms"
    lines = [f"| operator | {unit} | calls | asked for at (innermost trainer/ frames) |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['name']} | {r['device_us'] / 1e3:.1f} | {r['count']} | {r['where']} |" for r in ranked]
    write_outputs(a, "op_sources", {"rows": ranked}, "\n".join(lines))
    return 0


def write_outputs(a: argparse.Namespace, name: str, result: dict, text: str) -> None:
    """DIR/NAME.json (``result`` with the run's arch, attention kernel and smoke flag) and
    DIR/NAME.txt (``text``, also printed)."""
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, name + ".json"), "w") as fh:
        json.dump({"arch": a.arch, "attention_kernel": a.attention_kernel, "smoke": a.smoke, **result}, fh, indent=1)
    with open(os.path.join(a.out, name + ".txt"), "w") as fh:
        fh.write(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    sys.exit(main())
