"""Self-distillation data as operators make it: prompts, the target's own greedy completions,
loss on the completion only, written through ``python -m trainer prepare``.

Prompts are windows of the target's training split starting at a line start; evaluation
prompts come from the held-out files, so no evaluation prompt (nor its file) is ever in the
drafter's data. All prompts of a run have the same length, so a chunk decodes as one batch
without padding (padding would perturb the logits, and the data must be exactly the
target's greedy output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import torch

from corpus import line_start_windows
from target import greedy_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_distill_data(model, docs, work_dir: str, *, samples: int, prompt_len: int, completion_len: int,
                      chunk: int, device, seed: int = 2, log=print) -> dict:
    """Write work_dir/distill.jsonl and prepare it into work_dir/data; return prepare's summary."""
    prompts = line_start_windows(docs, samples, prompt_len, seed)
    jsonl = os.path.join(work_dir, "distill.jsonl")
    with open(jsonl, "w") as fh:
        for s in range(0, samples, chunk):
            p = torch.from_numpy(prompts[s:s + chunk]).to(device)
            cont = greedy_batch(model, p, completion_len).cpu().numpy()
            for row in range(len(p)):
                ids = prompts[s + row].tolist() + cont[row].tolist()
                mask = [0] * prompt_len + [1] * completion_len
                fh.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            log(f"distill: {min(s + chunk, samples)}/{samples} completions")
    data_dir = os.path.join(work_dir, "data")
    proc = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--input", jsonl, "--out", data_dir,
                           "--progress-every", "0"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m trainer prepare failed ({proc.returncode}): {proc.stderr.strip()}")
    log(proc.stdout.strip())
    with open(os.path.join(data_dir, "meta.json")) as fh:
        meta = json.load(fh)
    return {"data_dir": data_dir, "samples": meta["samples"], "tokens": meta["tokens"],
            "loss_fraction": round(meta["loss_fraction"], 4), "prompt_len": prompt_len,
            "completion_len": completion_len, "distinct_completions": _distinct(jsonl, prompt_len)}


def _distinct(jsonl: str, prompt_len: int) -> int:
    """How many different completions (a small target can collapse onto a few loops)."""
    seen = set()
    with open(jsonl) as fh:
        for line in fh:
            seen.add(tuple(json.loads(line)["input_ids"][prompt_len:]))
    return len(seen)


def eval_prompts(held_out_docs, n: int, prompt_len: int, seed: int = 3) -> list[list[int]]:
    return [w.tolist() for w in line_start_windows(held_out_docs, n, prompt_len, seed)]
