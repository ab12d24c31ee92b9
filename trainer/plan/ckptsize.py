"""How much disk a run's checkpoints take, predicted from the drafter's shape without torch
(the controller's launch preflight imports this; so does the trainer's test of it).

One ``OUTPUT/step_N/`` holds (trainer/checkpoint.py):

* ``checkpoint.pt``: the fp32 master weights (4 bytes a parameter) and AdamW's two fp32
  moments (8 bytes), plus per tensor a zip record and AdamW's step scalar, plus the pickled
  meta, RNG states and schedule (a few tens of KiB);
* ``drafter/``: the bf16 export (2 bytes a parameter) with its config, modeling file and card;
* ``meta.json``, ``eval.json``.

So about 14 bytes per drafter parameter. A 5-layer drafter of a 27B-class target (hidden
5120, 64 heads × 128, 8 KV heads, intermediate 25600) has 2.57 G parameters: ~36 GB a
checkpoint. tests/test_checkpoint_retention.py checks the prediction against checkpoints
the trainer really writes (within 2 %).

:func:`retained_peak` is how many step directories exist at once under ``--keep-checkpoints``
and ``--keep-every``: pruning runs only after a save completed, so while the newest is being
written the ``keep`` older ones are still there.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

# Fitted to checkpoints of this trainer (torch 2.13 zip format, 14 to 36 tensors): per
# parameter tensor, its three zip records (weight, two moments: header, name, 64-byte
# alignment, central directory) and AdamW's step scalar; then ~13 KiB of pickled meta and
# RNG states in checkpoint.pt, ~17 KiB of config, modeling file and card in drafter/, and
# meta.json. tests/test_checkpoint_retention.py holds the prediction to 2 % of real sizes.
PER_TENSOR_BYTES = 1200
FIXED_BYTES = 40 * 1024
BLOCK = 4096  # file sizes are rounded up to the file system block


def drafter_params(target: Mapping[str, Any], num_draft_layers: int, n_taps: Optional[int] = None,
                   attention: Optional[str] = None, drafter_arch: str = "dflash") -> tuple[int, int]:
    """(parameters, tensors) of the drafter trainer/model.py builds for ``target`` (its
    config.json as a dict): the language model's widths, the family's drafter attention
    (Qwen3.5/3.6: 32/8 × 128, not the target's; ``attention`` is --drafter-attention), and
    DFlash2's convolutions and selector (``drafter_arch``, trainer/arch.py)."""
    from trainer import arch, family

    text = family.text_config(dict(target))
    H = int(text["hidden_size"])
    nh, nkv, hd = family.drafter_attention(dict(target), attention)
    inter = int(text["intermediate_size"])
    target = text
    n_taps = int(n_taps or num_draft_layers)
    bias = bool(target.get("attention_bias", False))
    per_layer = H * nh * hd + 2 * H * nkv * hd + nh * hd * H + 2 * hd + 3 * H * inter + 2 * H
    tensors_per_layer = 11
    if bias:
        per_layer += nh * hd + 2 * nkv * hd + H
        tensors_per_layer += 4
    params = n_taps * H * H + 2 * H + num_draft_layers * per_layer
    tensors = 3 + num_draft_layers * tensors_per_layer
    if drafter_arch == arch.DFLASH2:
        more, more_tensors = arch.extra_params(H, int(text["vocab_size"]), num_draft_layers)
        params, tensors = params + more, tensors + more_tensors
    return params, tensors


def checkpoint_bytes(target: Mapping[str, Any], values: Mapping[str, Any]) -> int:
    """Predicted size of one ``step_N/`` for the flag values ``values`` (flags.py dests)."""
    layers = int(values.get("num_draft_layers") or 5)
    ids = values.get("target_layer_ids")
    params, tensors = drafter_params(target, layers, len(ids) if ids else None, values.get("drafter_attention"),
                                     values.get("drafter_arch") or "dflash")
    pt = 12 * params + tensors * PER_TENSOR_BYTES  # weights + 2 moments, and the records
    export = 2 * params + tensors * 128  # bf16 + the safetensors header's entry per tensor
    return _blocks(pt) + _blocks(export) + FIXED_BYTES


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def saved_steps(total_steps: int, save_interval: int) -> list[int]:
    """The steps a run of ``total_steps`` saves at: every ``save_interval`` and the last."""
    steps = list(range(save_interval, total_steps + 1, save_interval))
    if total_steps and (not steps or steps[-1] != total_steps):
        steps.append(total_steps)
    return steps


def retained_peak(total_steps: int, save_interval: int, keep: int, keep_every: int = 0,
                  keeps_best: bool = False) -> int:
    """The most step directories that exist at once (trainer/checkpoint.prune's rule: after
    each save the newest ``keep`` stay, plus every multiple of ``keep_every``; 0 keeps all).
    ``keeps_best``: the run measures τ at each save (--eval-prompts), and prune also keeps the
    best of them; which one that is depends on τ, so this is the worst case — one directory
    more whenever an earlier save was already pruned (it may be the best)."""
    steps = saved_steps(total_steps, save_interval)
    if keep <= 0:
        return len(steps)
    if len(steps) > 200_000:  # a bound instead of the walk: newest keep + 1 being written + every K-th + best
        every = total_steps // (save_interval * keep_every // math.gcd(save_interval, keep_every)) if keep_every else 0
        return keep + 1 + every + int(keeps_best)
    kept: list[int] = []
    peak = 0
    pruned = False
    for s in steps:
        kept.append(s)
        peak = max(peak, len(kept) + int(keeps_best and pruned))  # written, nothing pruned yet
        newest = set(sorted(kept)[-keep:])
        left = [k for k in kept if k in newest or (keep_every and k % keep_every == 0)]
        pruned = pruned or len(left) < len(kept)
        kept = left
    return peak


def steps_at_least(values: Mapping[str, Any], data: Mapping[str, Any], drafter_ranks: int) -> Optional[int]:
    """A lower bound on the optimizer steps a run takes: --max-steps, else from the data's
    sample and token counts (a micro-batch holds at most --token-budget padded tokens and
    --max-batch-size sequences, so there are at least that many). None without data figures."""
    if int(values.get("max_steps") or 0) > 0:
        return int(values["max_steps"])
    samples, tokens = data.get("samples"), data.get("tokens")
    if not samples:
        return None
    samples = max(0, int(samples) - int(values.get("eval_prompts") or 0))
    max_len = int(values.get("max_seq_len") or 8192)
    max_batch = int(values.get("max_batch_size") or 64)
    budget = values.get("token_budget")
    if not isinstance(budget, int):  # auto: at most max_batch_size full-length sequences
        budget = max_batch * max_len
    mean = (tokens / samples) if tokens and samples else float(data.get("mean_length") or max_len)
    per_epoch = max(math.ceil(samples * min(mean, max_len) / budget), math.ceil(samples / max_batch))
    per_step = int(values.get("grad_accum") or 1) * max(1, drafter_ranks)
    return max(1, int(values.get("epochs") or 1) * per_epoch // per_step)
