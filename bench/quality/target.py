"""A small real target: a byte-level Qwen3ForCausalLM trained on the stdlib sources.

Trained from scratch on random windows of the training split (next-byte cross-entropy,
AdamW, warmup + cosine), for a step cap or a wall-clock budget, whichever comes first, so
the GPU pipeline fits one device call whatever the machine's speed; the steps actually run
are recorded. ``mask_token_id`` goes into config.json, where the trainer reads it.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from corpus import MASK, VOCAB


def qwen3_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, max_pos: int):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=hidden // heads, max_position_embeddings=max_pos, rope_theta=10000.0,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.mask_token_id = MASK  # read by trainer.model.DrafterConfig.from_target
    return cfg


def lr_at(step: int, peak: float, warmup: int, progress: float) -> float:
    """Linear warmup, then cosine to 10 % of peak as ``progress`` goes 0 → 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_target(out_dir: str, docs: list[np.ndarray], shape: dict, *, steps: int, seconds: float, batch: int,
                 seq_len: int, lr: float, device: torch.device, seed: int = 0, log=print) -> dict:
    """Train and save to ``out_dir``; returns a summary (params, steps run, final loss)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = qwen3_config(max_pos=max(1024, 4 * seq_len), **shape)
    model = Qwen3ForCausalLM(cfg).to(device)
    params = sum(p.numel() for p in model.parameters())
    stream = np.concatenate(docs)  # BOS separates files
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda" or None)
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    warmup = max(1, steps // 20)
    t0 = time.time()
    step = 0
    model.train()
    while step < steps and time.time() - t0 < seconds:
        starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
        x = torch.from_numpy(np.stack([stream[s:s + seq_len + 1] for s in starts])).to(device, non_blocking=True)
        for g in opt.param_groups:
            # progress by steps or by the clock, whichever is further: the cosine completes
            # even when the time budget, not the step cap, ends training (a slower GPU)
            g["lr"] = lr_at(step, lr, warmup, max(step / steps, (time.time() - t0) / seconds))
        with autocast:
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step % 50 == 0 or step == 1:
            v = float(loss.detach())
            log(f"target step {step}: loss {v:.3f} ({v / math.log(2):.2f} bits/byte), {time.time() - t0:.0f} s")
    final = float(loss.detach())
    model.eval()
    _save(model, out_dir)
    return {"params": params, "steps": step, "step_cap": steps, "seconds": round(time.time() - t0, 1),
            "final_loss": round(final, 4), "bits_per_byte": round(final / math.log(2), 3),
            "tokens_seen": step * batch * seq_len, "shape": shape, "seq_len": seq_len, "batch": batch}


def _save(model, path: str) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(path)
    for name in os.listdir(path):
        os.chmod(os.path.join(path, name), 0o644)


@torch.no_grad()
def held_out_loss(model, docs: list[np.ndarray], seq_len: int, n: int, device, seed: int = 1) -> float:
    """Mean next-byte CE on ``n`` random windows of held-out files (bits/byte = this / ln 2)."""
    stream = np.concatenate(docs)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(stream) - seq_len - 1, size=n)
    x = torch.from_numpy(np.stack([stream[s:s + seq_len + 1] for s in starts])).to(device)
    logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))


def greedy_batch(model, prompts: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts with the KV cache; the mask id is never
    chosen. [n, steps] int64. For the distillation data (batched: one decode per chunk)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
    toks = []
    with torch.no_grad():
        out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        for _ in range(steps):
            logits = out.logits[:, -1].float()
            logits[:, MASK] = float("-inf")
            nxt = logits.argmax(-1, keepdim=True)
            toks.append(nxt)
            cache = getattr(out, "cache", None)
            if cache is None:
                cache = getattr(out, "past_key_values", None)
            out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{kw: cache})
    return torch.cat(toks, 1)
