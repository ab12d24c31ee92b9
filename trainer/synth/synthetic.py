"""A random-weight target of a real shape and a dataset of random tokens, for benchmarks.

``python -m trainer synthetic --shape qwen3.6-27b --out DIR [--samples N] [--max-len L]``
writes

- ``DIR/target``: ``config.json`` with the shape's numbers (a Qwen3 model, or for
  ``qwen3.6-27b`` the public Qwen3.6-27B language model as a text-only ``qwen3_5_text``
  target: hybrid Gated DeltaNet + gated attention, vocabulary 248,320) and a marker,
  ``random-weights.json``. No weight files: the trainer makes the weights on the GPU when it
  loads such a target (seconds for 27B parameters, where writing and reading 54 GB of
  safetensors would take minutes). The embedding and LM head come from a seeded generator on
  the device (:func:`random_head`), so a drafter-only rank builds the same two tensors as the
  target ranks without loading the layers.
- ``DIR/data``: a prepared dataset (``trainer.chat.prepare.prepare``) of uniformly random token ids,
  lengths uniform in [--min-len, --max-len] (default: all --max-len, the batcher's worst
  case), the loss mask on everything after the first 10 % ("prompt") of each sample.

Throughput and memory of the trainer depend on shapes only, so these stand in for a real
target and its regenerated data without a download; acceptance lengths mean nothing here.
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
from trainer import family
from trainer.flags import EXIT_OK, EXIT_USAGE, UsageParser
from trainer.plan.flops import QWEN3_8B, QWEN3_27B_LIKE, ModelShape

MARKER = "random-weights.json"
SHAPES = {
    "qwen3-8b": QWEN3_8B,
    # Qwen3-32B's dense widths at 54 layers: a stand-in used before the real 27B target
    # (Qwen3.6-27B, below) could be loaded; kept for the figures measured on it
    "qwen3-27b-like": QWEN3_27B_LIKE,
    # CPU tests: the same code path at a size a 2-core machine trains in seconds
    "small": ModelShape(4, 128, 4, 2, 32, 256, 1024, "small"),
}
HYBRID_SHAPES = {
    "qwen3.6-27b": family.QWEN3_6_27B_TEXT,
    # CPU tests: the hybrid pattern (3 Gated DeltaNet layers, then full attention) tiny
    "small-hybrid": {**family.QWEN3_6_27B_TEXT, "num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 256,
                     "vocab_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                     "linear_value_head_dim": 32, "layer_types": family.QWEN3_6_27B_TEXT["layer_types"][:8]},
}
INIT_STD = 0.02


def hf_config(shape) -> dict:
    """config.json of a Qwen3ForCausalLM with these numbers, or of a hybrid shape (a
    text-only Qwen3.5 config), as the trainer reads any target."""
    if isinstance(shape, dict):
        # the drafter's mask token: the last id, which the random data never contains
        return {**shape, "initializer_range": INIT_STD, "mask_token_id": shape["vocab_size"] - 1}
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "num_hidden_layers": shape.n_layers, "hidden_size": shape.hidden,
        "num_attention_heads": shape.n_heads, "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim, "intermediate_size": shape.intermediate, "vocab_size": shape.vocab,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "use_sliding_window": False, "initializer_range": INIT_STD,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        # the drafter's mask token: the last id, which the random data never contains
        "mask_token_id": shape.vocab - 1,
    }


def random_marker(target_dir: str) -> dict | None:
    """The marker's content when ``target_dir`` is a synthetic random-weight target, else None."""
    path = os.path.join(target_dir, MARKER)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def random_head(cfg: dict, seed: int, device, dtype):
    """(embed [V, H], lm_head [V, H]) from generators seeded by ``seed``: the same tensors on
    every rank of one device type, whatever else that rank made before."""
    import torch

    V, H = int(cfg["vocab_size"]), int(cfg["hidden_size"])
    out = []
    for offset in (0, 1):
        g = torch.Generator(device=device).manual_seed(seed * 2 + offset)
        out.append((torch.randn(V, H, generator=g, device=device, dtype=torch.float32) * INIT_STD).to(dtype))
    return out[0], out[1]


def build_random_model(target_dir: str, device, dtype):
    """The synthetic target as a transformers CausalLM, its weights made on ``device``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    marker = random_marker(target_dir) or {}
    seed = int(marker.get("seed", 0))
    config = AutoConfig.from_pretrained(target_dir)
    dev = torch.device(device)
    cuda_ids = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_ids):
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    embed, lm_head = random_head(family.text_config(config.to_dict()), seed, device, dtype)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embed)
        model.get_output_embeddings().weight.copy_(lm_head)
    return model


def write_synthetic(out_dir: str, shape_name: str, samples: int, max_len: int, min_len: int | None = None,
                    seed: int = 0) -> dict:
    """Write DIR/target and DIR/data; return a summary. Raises DataError on bad input."""
    if shape_name not in SHAPES and shape_name not in HYBRID_SHAPES:
        raise data_mod.DataError(f"--shape {shape_name}: unknown; choose one of {', '.join({**SHAPES, **HYBRID_SHAPES})}")
    min_len = max_len if min_len is None else min_len
    if samples < 1:
        raise data_mod.DataError(f"--samples {samples} must be >= 1")
    if not 2 <= min_len <= max_len:
        raise data_mod.DataError(f"--min-len {min_len} and --max-len {max_len}: need 2 <= min-len <= max-len")
    config = hf_config(SHAPES.get(shape_name) or HYBRID_SHAPES[shape_name])
    vocab = int(config["vocab_size"])
    out_dir = os.path.abspath(out_dir)
    target_dir, data_dir = os.path.join(out_dir, "target"), os.path.join(out_dir, "data")
    for path in (target_dir, data_dir):
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise data_mod.DataError(f"{path}: already exists; remove it or choose another --out")
    os.makedirs(out_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".synthetic.partial-", dir=out_dir)
    try:
        os.makedirs(os.path.join(tmp, "target"))
        for name, body in (("config.json", config),
                           (MARKER, {"seed": seed, "shape": shape_name,
                                     "note": "random weights made on load by the trainer (trainer/synth/synthetic.py); "
                                             "for throughput and memory benchmarks only"})):
            with open(os.path.join(tmp, "target", name), "w", encoding="utf-8") as fh:
                json.dump(body, fh, indent=1)
                fh.write("\n")
        rng = np.random.default_rng(seed)
        jsonl = os.path.join(tmp, "synthetic.jsonl")
        with open(jsonl, "w", encoding="utf-8") as fh:
            for _ in range(samples):
                n = int(rng.integers(min_len, max_len + 1))
                ids = rng.integers(0, vocab - 1, size=n)  # the last id stays free for the mask token
                mask = np.ones(n, dtype=np.int64)
                mask[: max(1, n // 10)] = 0
                fh.write(json.dumps({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}) + "\n")
        meta = prepare([jsonl], os.path.join(tmp, "data"), progress_every=0,
                                extra_meta={"generated_by": {"tool": "trainer.synth.synthetic", "seed": seed,
                                                             "shape": shape_name}})
        for name, dest in (("target", target_dir), ("data", data_dir)):
            os.rename(os.path.join(tmp, name), dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"target": target_dir, "data": data_dir, "samples": meta["samples"], "tokens": meta["tokens"],
            "shape": shape_name}


def main(argv: Sequence[str] | None = None) -> int:
    p = UsageParser(prog="python -m trainer synthetic",
                description="Write a random-weight target of a real shape (weights made on load) and a "
                            "prepared dataset of random tokens, for throughput and memory benchmarks.")
    p.add_argument("--shape", required=True, choices=sorted({**SHAPES, **HYBRID_SHAPES}))
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--min-len", type=int, default=None, help="default: --max-len (every sample full length)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(list(argv) if argv is not None else None)
    try:
        s = write_synthetic(args.out, args.shape, args.samples, args.max_len, args.min_len, args.seed)
    except data_mod.DataError as exc:
        print(f"synthetic: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    print(f"synthetic: wrote {s['target']} ({s['shape']}, random weights made on load) and {s['data']} "
          f"({s['samples']} samples, {s['tokens']} tokens)", flush=True)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
