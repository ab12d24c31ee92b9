"""served-check's reference: the τ the checkpoint was measured at when it was saved, never τ
re-measured on the export under test (an export whose config.json was edited drafts as badly
under our evaluator as it serves, so comparing it with itself passes it).

Where it comes from, first found: ``--checkpoint``'s meta.json (``eval``, with its step's
eval.json and drafter config), else the export's ``dflash_eval.json`` (trainer/drafter_dir.py
writes it into every export). :func:`comparable` says whether this check measures what the
reference measured (the same prompts, budget and target); :func:`drift` names each field of
the export's config.json that is not what the drafter trained with, as the cause it points at.
"""

from __future__ import annotations

from trainer import drafter_dir

# the likely cause each trained field points at when config.json no longer holds it
CAUSE = {"target_layer_ids": "wrong taps", "mask_token_id": "mask id", "block_size": "block size",
         "rope_theta": "rope", "layer_types": "causal vs non-causal in-block attention",
         "is_causal": "causal vs non-causal in-block attention"}


def from_checkpoint(checkpoint: str) -> dict:
    """The reference a checkpoint records (its τ may be None: not measured at save); raises
    ExportError for a path that is not a complete checkpoint."""
    from trainer import checkpoint as ckpt_io
    from trainer.serve.export import resolve

    d = resolve(checkpoint)
    meta = ckpt_io.read_meta(d)
    cfg = drafter_dir.hf_config(meta["drafter_config"], meta.get("target_config") or {})
    doc = drafter_dir.sidecar(meta, cfg, drafter_dir.read_evals(d))
    return {**doc, "source": f"--checkpoint {d} (its meta.json)"}


def from_export(export: str) -> dict | None:
    doc = drafter_dir.read_sidecar(export)
    return {**doc, "source": f"the export's {drafter_dir.SIDECAR}"} if doc else None


def find(export: str, checkpoint: str | None) -> dict | None:
    return from_checkpoint(checkpoint) if checkpoint else from_export(export)


def config_sha256(target_dir: str) -> str | None:
    """The target's identity hash as the checkpoint recorded it (agent/ckptcompat.py's rule)."""
    from trainer.target import target_identity

    try:
        return target_identity(target_dir).get("config_sha256")
    except (OSError, ValueError):
        return None


def comparable(ref: dict, *, prompts: int, max_new: int, from_data: bool, data_fingerprint: str | None,
               target_dir: str) -> str | None:
    """Why this check does not measure what the reference τ measured (one line), or None."""
    m = ref.get("measured") or {}
    if ref.get("tau") is None or not m:
        return "the checkpoint's τ was not measured at save (train with --eval-prompts N)"
    if not from_data:
        return f"--prompts: the reference τ was measured on {m.get('prompts_source')}; give --data DIR instead"
    if m.get("data_fingerprint") and data_fingerprint and m["data_fingerprint"] != data_fingerprint:
        return (f"--data holds other data (fingerprint {data_fingerprint}) than the reference was measured on "
                f"({m['data_fingerprint']})")
    if m.get("prompts") is not None and prompts != m["prompts"]:
        return f"--eval-prompts {prompts}: the reference τ was measured on {m['prompts']} prompts; omit it"
    if m.get("max_new_tokens") is not None and max_new != m["max_new_tokens"]:
        return f"--max-new {max_new}: the reference τ was measured with {m['max_new_tokens']} new tokens; omit it"
    want = (m.get("target") or {}).get("config_sha256")
    have = config_sha256(target_dir)
    if want and have and want != have:
        return f"--target {target_dir}: its config.json (sha256 {have[:12]}) is not the measured target's ({want[:12]})"
    return None


def drift(cfg: dict, trained: dict | None) -> list[str]:
    """One line per field of config.json (``cfg``) that is not what the drafter trained with,
    each led by the cause it points at. The nested copies loaders read instead of the
    top-level field (``dflash_config.block_size``, ``rope_parameters.rope_theta``) count too."""
    if not trained:
        return []
    now = drafter_dir.trained_facts(cfg)
    dfl, rope = cfg.get("dflash_config") or {}, cfg.get("rope_parameters") or {}
    nested = {"block_size": ("dflash_config.block_size", dfl.get("block_size")),
              "rope_theta": ("rope_parameters.rope_theta", rope.get("rope_theta"))}
    where = {"mask_token_id": "dflash_config.mask_token_id", "target_layer_ids": "dflash_config.target_layer_ids"}
    out = []
    for key, cause in CAUSE.items():
        want = trained.get(key)
        seen = [(where.get(key, key), now.get(key))]
        if key in nested and nested[key][0].split(".")[0] in cfg:
            seen.append(nested[key])
        for name, have in seen:
            if _norm(have) != _norm(want):
                out.append(f"{cause}: config.json {name} {have!r} is not the checkpoint's {want!r}")
    return out


def _norm(v):
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    return v
