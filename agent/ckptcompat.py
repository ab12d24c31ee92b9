"""Can this checkpoint start this launch? One rule, asked twice: by the launch preflight
(agent/preflight.py, from the checkpoint's meta.json, before a run directory exists) and by
the trainer itself when it loads (trainer/checkpoint.py), so both refuse the same inputs with
the same words (trainer/flags.py's promise).

    problems(meta, launch) -> ["--resume-from …: …; use …", …]    # empty: compatible

``meta``: the checkpoint's meta.json (trainer/checkpoint.py writes it beside checkpoint.pt),
or for an inference export ``{"drafter_config": its config.json, "target": None}``.
``launch``: ``flag`` (--resume-from | --init-from), ``path``, ``block_size``,
``num_draft_layers``, ``target`` (:func:`target_identity` of the target's config.json),
``target_layer_ids`` (None: the default taps, :func:`default_target_layer_ids`),
``data_fingerprint`` (None: not compared; a resume compares it), ``drafter`` (this run's
drafter config as DrafterConfig.to_hf writes it; None: its layer layout is not compared —
the preflight has no torch to build it).

Standard library only: the preflight runs before anything is known about the container's
python.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

# Keys of a target's config.json that do not change what the target computes.
IDENTITY_IGNORE = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                             "use_cache", "output_hidden_states", "return_dict", "id2label", "label2id"})
_SHAPE = ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")


def target_identity(config: Mapping[str, Any], text: Mapping[str, Any] | None = None) -> dict:
    """What a checkpoint records about its target: two targets with the same architecture
    numbers and the same config hash are the same target as far as the drafter cares.
    ``text``: the language model's part of ``config`` where it is nested (Qwen3.5's
    vision-language layout; trainer/family.py text_config), else ``config`` itself."""
    text = config if text is None else text
    body = json.dumps({k: v for k, v in sorted(config.items()) if k not in IDENTITY_IGNORE}, sort_keys=True)
    return {"model_type": config.get("model_type"), **{k: text.get(k) for k in _SHAPE[1:]},
            "config_sha256": hashlib.sha256(body.encode()).hexdigest()}


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference drafter's tap choice: [L//2] for one layer, else evenly spaced 1..L-3."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]


def problems(meta: Mapping[str, Any], launch: Mapping[str, Any]) -> list[str]:
    """Why the checkpoint ``meta`` describes cannot start ``launch``: one line each, naming
    the flag to change and how."""
    flag, where = launch["flag"], launch.get("path") or "the checkpoint"
    out: list[str] = []
    cfg = meta.get("drafter_config") or {}
    if launch.get("drafter") is not None and cfg.get("num_hidden_layers") == launch.get("num_draft_layers"):
        out += _layout_problems(cfg, launch["drafter"], flag, where)
    for key, name, dest in (("block_size", "--block-size", "block_size"),
                            ("num_hidden_layers", "--num-draft-layers", "num_draft_layers")):
        have, want = cfg.get(key), launch.get(dest)
        if have is not None and want is not None and int(have) != int(want):
            out.append(f"{flag} {where}: the checkpoint was trained with {name} {have}, this launch says {want}; "
                       f"set {name} {have} or start --from-scratch")
    target = launch.get("target") or {}
    theirs = meta.get("target")
    if theirs is None:  # an export: what its config.json says about the target
        theirs = {"hidden_size": cfg.get("hidden_size"), "num_hidden_layers": cfg.get("num_target_layers"),
                  "vocab_size": cfg.get("vocab_size"), "model_type": target.get("model_type")}
    diff = [k for k in _SHAPE if theirs.get(k) is not None and target.get(k) is not None and theirs[k] != target[k]]
    hashes = theirs.get("config_sha256"), target.get("config_sha256")
    if diff or (all(hashes) and hashes[0] != hashes[1]):
        what = ", ".join(f"{k} {theirs.get(k)} vs {target.get(k)}" for k in diff) or "its config.json differs"
        out.append(f"{flag} {where}: trained against another target ({what}); point --target-model at the "
                   "checkpoint's target or start --from-scratch")
    else:  # the same target: the taps must match too (for another target, the line above says it all)
        ids = (cfg.get("dflash_config") or {}).get("target_layer_ids")
        want = launch.get("target_layer_ids")
        if want is None and target.get("num_hidden_layers") and launch.get("num_draft_layers"):
            want = default_target_layer_ids(int(target["num_hidden_layers"]), int(launch["num_draft_layers"]))
        if ids is not None and want is not None and list(ids) != list(want):
            out.append(f"{flag} {where}: the checkpoint taps target layers {list(ids)}, this launch taps "
                       f"{list(want)}; set --target-layer-ids {','.join(map(str, ids))}")
    have, want = meta.get("data_fingerprint"), launch.get("data_fingerprint")
    if want is not None and have != want:
        out.append(f"{flag} {where}: trained on other data (fingerprint {str(have)[:12]}, --data-dir has "
                   f"{str(want)[:12]}); resuming continues that data's order — use --init-from to keep only the "
                   "weights")
    return out


def _layout_problems(theirs: Mapping[str, Any], ours: Mapping[str, Any], flag: str, where: str) -> list[str]:
    """The drafter's per-layer attention and widths: the same parameter shapes could hide
    another layer layout (a sliding layer trained as full), other widths fail to load."""
    out = []
    n = int(theirs.get("num_hidden_layers") or 0)
    t_types = theirs.get("layer_types") or ["full_attention"] * n  # exports from before layer_types: all full
    t_window = theirs.get("sliding_window") if "sliding_attention" in t_types else None
    o_window = ours.get("sliding_window") if "sliding_attention" in ours.get("layer_types", []) else None
    if list(t_types) != list(ours.get("layer_types", [])) or t_window != o_window:
        short = ",".join("sliding" if t == "sliding_attention" else "full" for t in t_types)
        out.append(f"{flag} {where}: checkpoint's drafter layers are {short} (sliding window {t_window}), this run's "
                   f"{','.join('sliding' if t == 'sliding_attention' else 'full' for t in ours.get('layer_types', []))} "
                   f"(window {o_window}); use --drafter-layer-types {short}"
                   + (f" --sliding-window {t_window}" if t_window else ""))
    widths = ("num_attention_heads", "num_key_value_heads", "head_dim")
    if any(theirs.get(k) != ours.get(k) for k in widths) and all(theirs.get(k) for k in widths):
        q, kv, d = (theirs[k] for k in widths)
        out.append(f"{flag} {where}: checkpoint's drafter attention is {q}/{kv}/{d}, this run's "
                   f"{'/'.join(str(ours.get(k)) for k in widths)}; use --drafter-attention {q}/{kv}/{d}")
    return out
