"""Target families: what a target directory's config.json says the trainer must build.

Standard library only (the controller's preflight reads it without torch).

Two families are supported:

* ``qwen3`` — Qwen3ForCausalLM: dense decoder layers; the drafter copies the target's
  attention widths (z-lab's released Qwen3 drafters), every drafter layer full attention.
* ``qwen3_5`` — Qwen3.5 / Qwen3.6 (Qwen3-Next lineage): decoder layers in a 3:1 pattern of
  Gated DeltaNet linear attention and gated full attention (``layer_types``). Two layouts
  on disk: text-only (``model_type: qwen3_5_text``, the language model's numbers at the
  top level) and the released vision-language one (``model_type: qwen3_5``,
  ``Qwen3_5ForConditionalGeneration``, the language model under ``text_config`` and its
  weights under ``model.language_model.``). Only the language model is ever loaded.
  The drafter follows the public DFlash configs for this family (SpecForge's
  configs/qwen3.5-4b-dflash.json, qwen3.6-27b-dflash.json): 32 query / 8 KV heads × 128
  whatever the target's attention widths, the target's hidden and MLP sizes and RoPE θ,
  and for Qwen3.6-27B four sliding-window layers (2,048) before one full layer.

Anything else is refused before anything is loaded, naming the config field
(:func:`unsupported`).
"""

from __future__ import annotations

import importlib.util
import json
import os

QWEN3 = "qwen3"
QWEN3_5 = "qwen3_5"
MODEL_TYPES = {"qwen3": QWEN3, "qwen3_5": QWEN3_5, "qwen3_5_text": QWEN3_5}

LINEAR, FULL = "linear_attention", "full_attention"
SLIDING = "sliding_attention"  # drafter layers (the DFlash drafter's own layer_types)
DRAFTER_LAYER_TYPES = (FULL, SLIDING)

# Qwen3: a row the embedding has and the tokenizer never emits (len(tokenizer) = 151669).
QWEN3_MASK_TOKEN_ID = 151669
# Qwen3.5/3.6: the same rule on their tokenizer (248070 tokens, vocabulary 248320); the id
# SpecForge's qwen3.6-27b-dflash.json records.
QWEN3_5_MASK_TOKEN_ID = 248070
QWEN3_5_DRAFTER_ATTENTION = (32, 8, 128)  # query heads, KV heads, head dim
SLIDING_WINDOW = 2048  # SpecForge's qwen3.6-27b-dflash.json


def read_config(target_dir: str) -> dict:
    with open(os.path.join(target_dir, "config.json"), encoding="utf-8") as fh:
        return json.load(fh)


def unsupported(cfg: dict) -> str | None:
    """Why this config.json is not a target the trainer supports (naming the field), or None."""
    mt = cfg.get("model_type")
    if mt not in MODEL_TYPES:
        return (f"model_type {mt!r} in config.json is not a supported target family; supported: qwen3 "
                "(Qwen3ForCausalLM), qwen3_5 (Qwen3.5/3.6, vision-language layout) and qwen3_5_text (text-only)")
    text = text_config(cfg)
    if mt == "qwen3_5" and not isinstance(cfg.get("text_config"), dict):
        return "model_type 'qwen3_5' in config.json has no text_config: the language model's numbers are missing"
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(text.get(key), int):
            where = "text_config." if mt == "qwen3_5" else ""
            return f"{where}{key} in config.json is {text.get(key)!r}: a {mt} target needs an integer there"
    if family_of(cfg) == QWEN3_5:
        types = target_layer_types(text)
        bad = sorted(set(types) - {LINEAR, FULL})
        if bad or len(types) != text["num_hidden_layers"]:
            return (f"layer_types in config.json ({bad or len(types)}) must name linear_attention or full_attention "
                    f"for each of the {text['num_hidden_layers']} layers")
    return None


def family_of(cfg: dict) -> str:
    """The family of a config (one :func:`unsupported` passed; a dict of dense Qwen3 numbers
    without a model_type, as benchmark shapes write, counts as qwen3)."""
    return MODEL_TYPES.get(cfg.get("model_type"), QWEN3)


def text_config(cfg: dict) -> dict:
    """The language model's config: ``text_config`` of the vision-language layout (its
    RoPE θ etc. included), else the config itself."""
    if cfg.get("model_type") == "qwen3_5" and isinstance(cfg.get("text_config"), dict):
        return {"model_type": "qwen3_5_text", **cfg["text_config"]}
    return cfg


def target_layer_types(text: dict) -> list[str]:
    """linear_attention / full_attention per target layer (Qwen3.5: every 4th layer full
    unless layer_types says otherwise; Qwen3: all full)."""
    if text.get("model_type") != "qwen3_5_text":
        return [FULL] * int(text["num_hidden_layers"])
    if text.get("layer_types"):
        return list(text["layer_types"])
    every = int(text.get("full_attention_interval", 4))
    return [FULL if (i + 1) % every == 0 else LINEAR for i in range(int(text["num_hidden_layers"]))]


def is_hybrid(cfg: dict) -> bool:
    return family_of(cfg) == QWEN3_5


def weight_prefix(cfg: dict) -> str:
    """Where the language model's tensors live in the safetensors files."""
    return "model.language_model." if cfg.get("model_type") == "qwen3_5" else "model."


def tokenizer_size(target_dir: str) -> int | None:
    """Ids the tokenizer can emit (its largest id + 1), from tokenizer.json; None without one."""
    path = os.path.join(target_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            tok = json.load(fh)
    except (OSError, json.JSONDecodeError):
        return None
    ids = list((tok.get("model") or {}).get("vocab", {}).values()) if isinstance((tok.get("model") or {}).get("vocab"), dict) else []
    ids += [int(t["id"]) for t in tok.get("added_tokens", []) if "id" in t]
    return max(ids) + 1 if ids else None


def mask_token_id(cfg: dict, target_dir: str | None = None, flag: int | None = None) -> tuple[int, str]:
    """(id, where it came from) of the drafter's mask token: --mask-token-id, else the
    target's config (``mask_token_id``, also under text_config), else the first id past the
    tokenizer (a row the embedding has and the tokenizer never emits, as SpecForge resolves
    it), else the family's default when the vocabulary has it, else the last id. The caller
    checks the id against the vocabulary (a flag may name anything)."""
    if flag is not None:
        return int(flag), "--mask-token-id"
    text = text_config(cfg)
    for where, c in (("config.json", cfg), ("config.json text_config", text)):
        if c.get("mask_token_id") is not None:
            return int(c["mask_token_id"]), where
    vocab = int(text["vocab_size"])
    n = tokenizer_size(target_dir) if target_dir else None
    if n is not None and n < vocab:
        return n, "the tokenizer (first id it never emits)"
    default = QWEN3_5_MASK_TOKEN_ID if family_of(cfg) == QWEN3_5 else QWEN3_MASK_TOKEN_ID
    if vocab > default:
        return default, f"the {family_of(cfg)} default"
    return vocab - 1, "the last vocabulary id"


def drafter_layer_types(cfg: dict, num_draft_layers: int, flag: str | None = None) -> list[str]:
    """The drafter's per-layer attention: --drafter-layer-types (full/sliding per layer, or
    auto), else the public configs' layout for the family: Qwen3 all full; Qwen3.5/3.6 —
    SpecForge's Qwen3.6-27B drafter — sliding-window layers with the last one full."""
    if flag and flag != "auto":
        names = {"full": FULL, FULL: FULL, "sliding": SLIDING, SLIDING: SLIDING}
        items = [t.strip() for t in flag.split(",") if t.strip()]
        bad = [t for t in items if t not in names]
        if bad:
            raise ValueError(f"--drafter-layer-types {flag}: {', '.join(bad)} is not full or sliding")
        if len(items) != num_draft_layers:
            raise ValueError(f"--drafter-layer-types {flag}: {len(items)} entries for --num-draft-layers {num_draft_layers}")
        return [names[t] for t in items]
    if family_of(cfg) == QWEN3_5:
        return [SLIDING] * (num_draft_layers - 1) + [FULL]
    return [FULL] * num_draft_layers


def drafter_attention(cfg: dict, flag: str | None = None) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of the drafter: --drafter-attention Q/KV/D, else the
    target's own for Qwen3, the public drafters' 32/8/128 for Qwen3.5/3.6."""
    if flag and flag != "auto":
        try:
            q, kv, d = (int(x) for x in flag.replace(",", "/").split("/"))
        except ValueError:
            raise ValueError(f"--drafter-attention {flag}: expected Q/KV/HEAD_DIM, e.g. 32/8/128")
        if q <= 0 or kv <= 0 or d <= 0 or q % kv or d % 2:
            raise ValueError(f"--drafter-attention {flag}: query heads must be a multiple of KV heads, the head dim even")
        return q, kv, d
    if family_of(cfg) == QWEN3_5:
        return QWEN3_5_DRAFTER_ATTENTION
    text = text_config(cfg)
    heads = int(text["num_attention_heads"])
    return heads, int(text.get("num_key_value_heads") or heads), int(text.get("head_dim") or text["hidden_size"] // heads)


def fast_forward_kernels() -> bool:
    """Whether flash-linear-attention's Triton kernels (``fla``, the fla-core and
    flash-linear-attention wheels) are importable here."""
    return importlib.util.find_spec("fla") is not None


def kernel_notes(cfg: dict, kernels_present: bool | None = None) -> list[str]:
    """Preflight lines for a target (torch-free): what is missing for its fast forward and
    what that costs. [] when nothing is. ``kernels_present`` is the answer of
    :func:`fast_forward_kernels` inside the container (defaults to this interpreter's)."""
    if unsupported(cfg) is not None or not is_hybrid(cfg):
        return []
    present = fast_forward_kernels() if kernels_present is None else kernels_present
    if present:
        return []
    return ["flash-linear-attention is not importable: the Gated DeltaNet layers of this Qwen3.5/3.6 target run "
            "transformers' PyTorch fallback (--target-forward auto picks hf), 27-30 % MFU on an H200 against 61 % for "
            "the fast forward with the kernels (docs/benchmarks.md); add them to the container venv as a new "
            "generation: ctl env install 'fla-core==0.6.0' 'flash-linear-attention==0.6.0' --container ID"]


# Qwen3.6-27B's language model as its public config.json's text_config gives it (the
# vision tower beside it is never loaded): 64 layers in the 3:1 Gated DeltaNet / gated full
# attention pattern. trainer/synth/synthetic.py's ``--shape qwen3.6-27b`` writes it as a
# text-only target; trainer/plan/memory.py models it.
QWEN3_6_27B_TEXT = {
    "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
    "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 17408, "vocab_size": 248320,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "layer_types": [FULL if (i + 1) % 4 == 0 else LINEAR for i in range(64)],
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "bos_token_id": None, "eos_token_id": 248044, "pad_token_id": None,
}
