"""Hold GPU memory in a separate process so that a trainer started next finds its config
short by about --short-mib: the story's "an upgrade ate ~200 MB per GPU", made on purpose.

The need is the trainer's own (trainer.probe.plan_run over the same flags, this GPU only, the
same call train.memory_check makes); the ballast leaves ``need - short`` MiB free as the
trainer will see it, i.e. also minus the trainer's CUDA context (--trainer-context-mib, the
context a fresh torch process takes on this GPU, measured here first). Prints one JSON line
and holds the memory until killed.

    python3 bench/memory_model/ballast.py --gpu 2 --short-mib 200 -- TRAINER FLAGS...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

import torch  # noqa: E402

from trainer import flags  # noqa: E402
from trainer.gpu import probe  # noqa: E402
from trainer.target import read_config  # noqa: E402

MIB = 2 ** 20


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, required=True)
    ap.add_argument("--short-mib", type=float, default=200)
    ap.add_argument("--trainer-context-mib", type=float, default=None,
                    help="default: measured, the context this process took on the GPU")
    ap.add_argument("--without-margin", action="store_true",
                    help="short relative to the predicted need alone (peak + allocator reserve + context), the "
                         "trainer's safety margin left out: the config really is ~--short-mib over by the model")
    ap.add_argument("--ready", default=None, help="file written once the memory is held")
    ap.add_argument("trainer_argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = a.trainer_argv[1:] if a.trainer_argv[:1] == ["--"] else a.trainer_argv
    v = vars(flags.parse_args(argv))
    v["drafter_step"] = flags.drafter_step_for(v, cuda=True)
    v["target_forward"] = flags.target_forward_for(v, cuda=True)
    g = (a.gpu,)
    colocated = set(v["target_gpus"]) == set(v["drafter_gpus"])
    role = "colocated" if colocated else ("target" if a.gpu in v["target_gpus"] else "drafter")
    v.update(target_gpus=g if role != "drafter" else (), drafter_gpus=g if role != "target" else ())
    plan = probe.plan_run(v, {a.gpu: 1e9}, read_config(v["target_model"]), context_mib=0)
    need = plan["gpus"][a.gpu]["need_mib"] - (plan["margin_mib"] if a.without_margin else 0)

    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(a.gpu)
    before = pynvml.nvmlDeviceGetMemoryInfo(h).free / MIB
    torch.cuda.set_device(a.gpu)
    torch.zeros(1, device="cuda")
    ctx = before - pynvml.nvmlDeviceGetMemoryInfo(h).free / MIB
    trainer_ctx = ctx if a.trainer_context_mib is None else a.trainer_context_mib
    leave = need - a.short_mib + trainer_ctx  # free as this process sees it, before the trainer's context
    free = torch.cuda.mem_get_info(a.gpu)[0] / MIB
    take = int(free - leave)
    held = torch.empty(max(take, 0) * MIB, dtype=torch.uint8, device="cuda") if take > 0 else None
    torch.cuda.synchronize()
    out = {"gpu": a.gpu, "role": role, "need_mib": round(need, 1), "short_mib": a.short_mib,
           "margin_included": not a.without_margin, "margin_mib": plan["margin_mib"],
           "context_mib": round(ctx, 1), "held_mib": take, "free_after_mib": round(torch.cuda.mem_get_info(a.gpu)[0] / MIB, 1),
           "expected_trainer_free_mib": round(need - a.short_mib, 1)}
    print(json.dumps(out), flush=True)
    if a.ready:
        with open(a.ready, "w") as fh:
            json.dump(out, fh)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:  # `held` stays referenced by this frame until the process is killed
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
