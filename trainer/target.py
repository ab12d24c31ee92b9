"""The frozen target: load a supported model (trainer/family.py: Qwen3, or Qwen3.5/3.6 in
either layout — only its language model) from a local directory and run the forward
that produces what the drafter needs — the tapped decoder-layer outputs and, for soft
labels, the final (normed) hidden state. Never the full sequence × vocab logits: the
teacher logits are formed from the final hidden state through the shared lm_head, only at
drafted positions (loss.py).
"""

from __future__ import annotations

import importlib.util
import json
import os

import torch

from agent import ckptcompat
from trainer import family
from trainer.layers.hf_dflash import cache_kwarg


read_config = family.read_config


def target_identity(target_dir: str) -> dict:
    """What a checkpoint records about its target (agent/ckptcompat.py's rule), with the
    language model's numbers (Qwen3.5's VL layout nests them)."""
    cfg = read_config(target_dir)
    return ckptcompat.target_identity(cfg, family.text_config(cfg))


class Target:
    """The frozen target on one device.

    A Qwen3.5/3.6 target in the vision-language layout loads as its language model only
    (transformers maps ``model.language_model.*`` onto Qwen3_5ForCausalLM and skips the
    vision tower), so the vision weights never reach the device.

    ``forward="hf"`` runs the transformers model with forward hooks on the tapped layers;
    ``forward="fast"`` runs trainer/gpu/fast_target.py's forward (Qwen3) or
    trainer/gpu/fast_hybrid.py's (Qwen3.5/3.6) over the same weights (fused
    q|k|v and gate|up GEMMs whose tensors the transformers layers then view, so memory is not
    doubled; stops after the last tapped layer unless the final state is wanted). The
    transformers model stays for ``forward_logits`` (evaluation).

    A synthetic target (trainer/synth/synthetic.py: config.json + random-weights.json) gets its
    weights made on the device instead of read from safetensors.

    ``precision="fp8"`` (``--target-precision``, trainer/gpu/fp8.py): every linear layer of the
    decoder (not the embedding, not the LM head) becomes e4m3 with a scale per output
    channel, one layer at a time right after loading, and the bf16 weights go; both forwards
    then run FP8 — the fast one with the activations quantized inside their producers, the
    transformers one (evaluation) through ``fp8.Fp8Linear``. The taps and the final state stay
    in ``dtype``."""

    def __init__(self, target_dir: str, layer_ids: list[int], device, dtype, forward: str = "hf",
                 precision: str = "bf16"):
        from transformers import AutoModelForCausalLM

        from trainer.synth import synthetic

        kw = {}
        device = torch.device(device)
        if synthetic.random_marker(target_dir) is not None:
            self.model = synthetic.build_random_model(target_dir, device, dtype).eval()
        else:
            if device.type == "cuda" and importlib.util.find_spec("accelerate") is not None:
                # load shards straight onto the GPU: without it, T target ranks each hold a full
                # host copy of the target at once (5 × 54 GB for a 27B model)
                kw["device_map"] = {"": device.index if device.index is not None else torch.cuda.current_device()}
            self.model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, **kw).to(device).eval()
        self.model.requires_grad_(False)
        if precision not in ("bf16", "fp8"):
            raise ValueError(f"--target-precision {precision!r}: expected bf16 or fp8 (auto is resolved before loading)")
        self.precision = precision
        if precision == "fp8":
            from trainer.gpu import fp8

            fp8.quantize_linears(self.model.model.layers)
        self.layer_ids = list(layer_ids)
        self._taps: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:  # the transformers forward (evaluation, tree verification) taps through these
            self.model.model.layers[i].register_forward_hook(self._hook(i))
        self.fast = None
        self.hybrid = family.is_hybrid(read_config(target_dir))
        if forward == "fast" and self.hybrid:
            from trainer.gpu.fast_hybrid import FastHybridTarget

            self.fast = FastHybridTarget.from_hf(self.model.model, self.layer_ids, keep_all_layers=True, share_weights=True)
        elif forward == "fast":
            from trainer.gpu.fast_target import FastTarget

            self.fast = FastTarget.from_hf(self.model.model, self.layer_ids, keep_all_layers=True, share_weights=True,
                                           attn_backend="cudnn" if device.type == "cuda" else "math")
        if (self.fast is not None or precision == "fp8") and device.type == "cuda":
            # the unfused q/k/v and gate/up tensors (and with fp8 the bf16 weights) just freed
            # stay in the caching allocator otherwise: 34 GB of a 27B target, shown as used by
            # nvidia-smi and the agent (103 GB per target GPU measured where ~70 GB was allocated)
            torch.cuda.empty_cache()

    def _hook(self, i):
        def fn(module, inputs, output):
            # transformers 5 decoder layers return a tensor; 4.x returned a tuple.
            self._taps[i] = output[0] if isinstance(output, (tuple, list)) else output
        return fn

    @property
    def embed(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, want_final: bool):
        """input_ids [b, S], right-padded: causal attention means padding never reaches a
        real position, so no attention mask is needed. Returns (taps [b, S, n·H], final
        [b, S, H] or None)."""
        if self.fast is not None:
            return self.fast.forward(input_ids, want_final=want_final)
        self._taps.clear()
        out = self.model.model(input_ids=input_ids, use_cache=False)
        taps = torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
        self._taps.clear()
        return taps, (out.last_hidden_state if want_final else None)

    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, cache):
        """(taps [b, n, n·H], logits [b, n, V], cache) of ``input_ids`` after the prefix held
        by ``cache`` (None: an empty prefix) — the transformers forward with its cache, which
        it updates in place (evaluation: block verification)."""
        self._taps.clear()
        out = self.model(input_ids=input_ids, use_cache=True, **({cache_kwarg(self.model): cache} if cache is not None else {}))
        taps = torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
        self._taps.clear()
        new = getattr(out, "cache", None)  # not `or`: a cache object may define __len__
        return taps, out.logits, new if new is not None else out.past_key_values

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor):
        """(taps [b, S, n·H], full logits [b, S, V]) — evaluation on short sequences only.
        Always the transformers forward: evaluation compares it with trainer/serve/ddtree.py's tree
        verification, which runs that forward too, so both see the same numerics."""
        self._taps.clear()
        logits = self.model(input_ids=input_ids, use_cache=False).logits
        taps = torch.cat([self._taps[i] for i in self.layer_ids], dim=-1)
        self._taps.clear()
        return taps, logits
