"""Self-distillation data as operators make it: prompts, the target's own greedy completions,
loss on the completion only, written through ``python -m trainer prepare``.

Prompts are windows of the target's training conversations ending where an answer is to be
written (corpus.prompt_windows), the same number from each category, one JSONL file per
category (code.jsonl, prose.jsonl, math.jsonl), so the prepared data keeps each sample's
category (its source file's name: trainer/data.py ``category``). Evaluation prompts come from
the held-out conversations, so no evaluation prompt (nor its file) is ever in the drafter's
data. All prompts of a run have the same length, so a chunk decodes as one batch
without padding (padding would perturb the logits, and the data must be exactly the
target's greedy output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from corpus import by_category, prompt_windows
from target import greedy_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_distill_data(model, split: dict, work_dir: str, *, samples: int, prompt_len: int, completion_len: int,
                      chunk: int, device, seed: int = 2, log=print) -> dict:
    """Write work_dir/CATEGORY.jsonl and prepare them into work_dir/data; return prepare's summary
    with the samples per category."""
    cats = by_category(split["train"], split["categories"]["train"])
    per = share(samples, list(cats))
    inputs = []
    for c, (cat, docs) in enumerate(cats.items()):
        prompts = prompt_windows(docs, per[cat], prompt_len, seed + 100 * c)
        jsonl = os.path.join(work_dir, f"{cat}.jsonl")
        inputs.append(jsonl)
        with open(jsonl, "w") as fh:
            for s in range(0, len(prompts), chunk):
                p = torch.from_numpy(prompts[s:s + chunk]).to(device)
                cont = greedy_batch(model, p, completion_len).cpu().numpy()
                for row in range(len(p)):
                    ids = prompts[s + row].tolist() + cont[row].tolist()
                    mask = [0] * prompt_len + [1] * completion_len
                    fh.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
                log(f"distill {cat}: {min(s + chunk, len(prompts))}/{len(prompts)} completions")
    data_dir = os.path.join(work_dir, "data")
    proc = subprocess.run([sys.executable, "-m", "trainer", "prepare", "--input", *inputs, "--out", data_dir,
                           "--progress-every", "0"], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"python -m trainer prepare failed ({proc.returncode}): {proc.stderr.strip()}")
    log(proc.stdout.strip())
    with open(os.path.join(data_dir, "meta.json")) as fh:
        meta = json.load(fh)
    return {"data_dir": data_dir, "samples": meta["samples"], "tokens": meta["tokens"],
            "loss_fraction": round(meta["loss_fraction"], 4), "prompt_len": prompt_len,
            "completion_len": completion_len,
            "by_category": {os.path.splitext(src["file"])[0]: src["samples"] for src in meta["sources"]},
            "distinct_completions": sum(_distinct(f, prompt_len) for f in inputs)}


def _distinct(jsonl: str, prompt_len: int) -> int:
    """How many different completions (a small target can collapse onto a few loops)."""
    seen = set()
    with open(jsonl) as fh:
        for line in fh:
            seen.add(tuple(json.loads(line)["input_ids"][prompt_len:]))
    return len(seen)


def share(n: int, cats: list[str]) -> dict[str, int]:
    """``n`` split as evenly as it goes, the first categories taking the remainder."""
    return {c: n // len(cats) + (i < n % len(cats)) for i, c in enumerate(cats)}


def eval_prompts(split: dict, n: int, prompt_len: int, seed: int = 3) -> tuple[list[list[int]], list[str]]:
    """``n`` held-out prompts, categories taking turns (code, prose, math, code, …: the first
    k prompts, e.g. the curve's, cover every category from k = 3), and each prompt's category.
    The draw of each category is seeded on its own, so a larger ``n`` extends the same prompts."""
    cats = by_category(split["held_out"], split["categories"]["held_out"])
    per = share(n, list(cats))
    drawn = {cat: prompt_windows(docs, max(1, per[cat]), prompt_len, seed + 100 * c).tolist()
             for c, (cat, docs) in enumerate(cats.items())}
    order = [cat for i in range(max(per.values())) for cat in cats if i < per[cat]]
    taken = {cat: 0 for cat in cats}
    prompts = []
    for cat in order:
        prompts.append(drawn[cat][taken[cat]])
        taken[cat] += 1
    return prompts, order
