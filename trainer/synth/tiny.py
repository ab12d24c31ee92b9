"""A tiny Qwen3 target and a dataset of its own greedy continuations, for tests and demos.

``python -m trainer tiny --out DIR [--seed S] [--samples N] [--head-dim D]`` writes

- ``DIR/target``: a random-weight ``Qwen3ForCausalLM`` (vocab 512, hidden 64, 4 layers,
  4 heads / 2 KV heads, head_dim 32 unless ``--head-dim``), saved with ``save_pretrained`` (safetensors). The last
  vocabulary id is reserved as the drafter's mask token: its LM-head row is zeroed and it is
  suppressed during generation, so it never appears in the data. ``mask_token_id`` is in
  ``config.json`` and in ``dflash_tiny.json`` beside it.
- ``DIR/data``: a prepared dataset (through :func:`trainer.chat.prepare.prepare`) of random prompts
  (loss_mask 0) followed by the target's greedy continuation (loss_mask 1 from a random
  start of 8–32 tokens on; total 48–200 tokens) — the tiny analogue of target-regenerated
  training data, so a drafter has something to learn.

No download; CPU only; deterministic for a seed on a given torch/transformers build.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Sequence

import numpy as np

from trainer import data as data_mod
from trainer.chat.prepare import prepare
from trainer.flags import EXIT_OK, EXIT_USAGE, UsageParser


VOCAB = 512
MASK_TOKEN_ID = VOCAB - 1
MIN_LEN, MAX_LEN = 48, 200  # total tokens per sample, prompt included
PROMPT_LEN = 8  # random prompt tokens; equal for all, so generation batches without padding
MAX_LOSS_START = 32  # the loss starts at a random position in [PROMPT_LEN, MAX_LOSS_START]
CHUNK = 128  # samples decoded together; 40-320 measured within noise of each other on the loaded 2-core VM
INFO = "dflash_tiny.json"
# 32: the smallest head_dim vLLM's CPU attention serves ("Unsupported CPU attention
# configuration: head_dim=16"), so the demo's and the tests' tiny pair can be served
# (trainer/serve/served.py). The projections are wider than hidden (4 × 32 = 128), which Qwen3 allows.
HEAD_DIM = 32


def tiny_config(head_dim: int = HEAD_DIM):
    from transformers import Qwen3Config

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    cfg.mask_token_id = MASK_TOKEN_ID  # extra attribute: saved in config.json for the trainer
    return cfg


def build_target(seed: int, head_dim: int = HEAD_DIM):
    """Random-weight tiny Qwen3 from ``seed``; the global torch RNG is left untouched."""
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(tiny_config(head_dim))
    with torch.no_grad():
        # A zero LM-head row gives the mask token logit 0 while the other 511 logits are
        # random around 0: plain greedy decoding practically never picks it either.
        model.lm_head.weight[MASK_TOKEN_ID].zero_()
    model.generation_config.suppress_tokens = [MASK_TOKEN_ID]
    return model.eval()


def greedy_continue(model, prompts: np.ndarray, steps: int) -> np.ndarray:
    """Greedy continuation (KV cache, mask token suppressed) of equal-length prompts."""
    import torch

    from trainer.layers.hf_dflash import cache_kwarg

    kw = cache_kwarg(model)
    out_tokens = []
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(prompts.astype(np.int64)), use_cache=True, logits_to_keep=1)
        for _ in range(steps):
            logits = out.logits[:, -1].float()
            logits[:, MASK_TOKEN_ID] = float("-inf")
            nxt = logits.argmax(-1, keepdim=True)
            out_tokens.append(nxt)
            cache = getattr(out, "cache", None)  # not `or`: a cache object may define __len__
            if cache is None:
                cache = getattr(out, "past_key_values", None)
            out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{kw: cache})
    return torch.cat(out_tokens, 1).numpy().astype(np.int32) if out_tokens else np.zeros((len(prompts), 0), np.int32)


def generate_samples(model, seed: int, samples: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random ``PROMPT_LEN``-token prompts, greedily continued to a random total length.

    Every sample in a chunk shares the prompt length, so a chunk is one batched, cached
    decode with no padding (which would perturb the logits, and the data must be exactly the
    target's greedy continuation). Where the loss starts still varies per sample: the first
    few greedy tokens may be left out of the loss, like a longer prompt.
    """
    rng = np.random.default_rng([seed, 1])
    totals = rng.integers(MIN_LEN, MAX_LEN + 1, size=samples)
    loss_start = rng.integers(PROMPT_LEN, MAX_LOSS_START + 1, size=samples)
    prompts = rng.integers(0, MASK_TOKEN_ID, size=(samples, PROMPT_LEN), dtype=np.int64)
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * samples
    # Chunks of similar total length, so a chunk of short samples stops decoding early: the
    # growing KV cache makes each step cost O(batch × length) (torch.cat dominated a profile).
    by_length = np.argsort(totals, kind="stable")
    for start in range(0, samples, CHUNK):
        part = by_length[start:start + CHUNK]
        cont = greedy_continue(model, prompts[part], int(totals[part].max()) - PROMPT_LEN)
        for row, i in enumerate(part.tolist()):
            ids = np.concatenate([prompts[i], cont[row, : int(totals[i]) - PROMPT_LEN]]).astype(np.int32)
            mask = np.zeros(len(ids), np.uint8)
            mask[int(loss_start[i]):] = 1
            out[i] = (ids, mask)
    return out  # type: ignore[return-value]


def write_tiny(out_dir: str, seed: int = 0, samples: int = 320, log=None, head_dim: int = HEAD_DIM) -> dict:
    """Write DIR/target and DIR/data; return a summary. Raises DataError on a bad --out."""
    import torch

    out_dir = os.path.abspath(out_dir)
    target_dir, data_dir = os.path.join(out_dir, "target"), os.path.join(out_dir, "data")
    for path in (target_dir, data_dir):
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise data_mod.DataError(f"{path}: already exists; remove it or choose another --out")
    if samples < 1:
        raise data_mod.DataError(f"--samples {samples} must be >= 1")
    if head_dim < 2 or head_dim % 2:
        raise data_mod.DataError(f"--head-dim {head_dim}: give an even number >= 2 (RoPE rotates pairs); "
                                 f"{HEAD_DIM} or more for a target vLLM's CPU attention serves")
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny.partial-", dir=out_dir)
    try:
        threads = torch.get_num_threads()
        # Tiny matrices: extra threads only add sync overhead, and on a busy machine OpenMP
        # spin-waiting made generation 3-5× slower (measured on the 2-core dev VM).
        torch.set_num_threads(1)
        try:
            model = build_target(seed, head_dim)
            rows = generate_samples(model, seed, samples)
        finally:
            torch.set_num_threads(threads)
        _save_quietly(model, os.path.join(tmp, "target"))
        info = {"mask_token_id": MASK_TOKEN_ID, "vocab_size": VOCAB, "seed": seed, "samples": samples,
                "head_dim": head_dim,
                "note": "random-weight tiny Qwen3 from `python -m trainer tiny`; mask token never generated"}
        with open(os.path.join(tmp, "target", INFO), "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=1, sort_keys=True)
            fh.write("\n")
        jsonl = os.path.join(tmp, "tiny.jsonl")  # fixed name: meta.json's sources stay identical per seed
        with open(jsonl, "w", encoding="utf-8") as fh:
            for ids, mask in rows:
                fh.write(json.dumps({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}) + "\n")
        meta = prepare([jsonl], os.path.join(tmp, "data"), progress_every=0,
                                extra_meta={"generated_by": {"tool": "trainer.synth.tiny", "seed": seed,
                                                             "mask_token_id": MASK_TOKEN_ID}})
        for name, dest in (("target", target_dir), ("data", data_dir)):
            os.rename(os.path.join(tmp, name), dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"target": target_dir, "data": data_dir, "samples": meta["samples"], "tokens": meta["tokens"],
            "fingerprint": meta["fingerprint"], "mask_token_id": MASK_TOKEN_ID}


def _save_quietly(model, path: str) -> None:
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in test and demo output
    try:
        model.save_pretrained(path)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
    for name in os.listdir(path):  # safetensors lands 0600; containers may read as another user
        os.chmod(os.path.join(path, name), 0o644)


def main(argv: Sequence[str] | None = None) -> int:
    p = UsageParser(prog="python -m trainer tiny",
                description="Write a tiny random Qwen3 target (DIR/target) and a prepared dataset of its "
                            "greedy continuations (DIR/data), for tests and demos.")
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=320)
    p.add_argument("--head-dim", type=int, default=HEAD_DIM,
                   help=f"attention head size (default {HEAD_DIM}: the smallest vLLM's CPU attention serves)")
    args = p.parse_args(list(argv) if argv is not None else None)
    try:
        s = write_tiny(args.out, seed=args.seed, samples=args.samples, head_dim=args.head_dim)
    except data_mod.DataError as exc:
        print(f"tiny: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print(f"tiny: wrote {s['target']} (Qwen3, vocab {VOCAB}, mask_token_id {s['mask_token_id']}) and "
          f"{s['data']} ({s['samples']} samples, {s['tokens']} tokens)", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
