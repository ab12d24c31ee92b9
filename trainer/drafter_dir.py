"""The drafter directory serving stacks load: config.json with every field they read,
bf16 (or fp32) safetensors, the standalone modeling file (trainer/layers/hf_dflash.py) and a model
card. Written the same way for every checkpoint's ``step_N/drafter/`` (trainer/checkpoint.py)
and for ``python -m trainer export`` (trainer/serve/export.py, which finds the checkpoint); the
fields and their consumers are in docs/export.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tempfile
import uuid

from agent.protocol import atomic_write, atomic_write_json, read_json_doc
from trainer import arch, flags

MODELING_FILE = "modeling_dflash.py"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"
EVAL_FILE = "eval.json"  # beside checkpoint.pt: τ as measured for this checkpoint
# In the export: the checkpoint's τ at save, what it was measured on, and the drafter facts it
# was trained with, so served-check compares a served export with its checkpoint, never with
# itself (a config.json edited after the export drafts badly on both sides alike).
SIDECAR = "dflash_eval.json"
SIDECAR_FORMAT = "dflash-export-eval"
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# Weight formats a user may ask for that the serving loaders cannot take for a drafter: vLLM's
# DFlash loader is not quantization-aware (vllm-project/vllm#51581: a weight-quantized drafter
# fails to load or is silently corrupted), so such an export is refused rather than written.
QUANTIZED = ("fp8", "fp4", "int8", "int4", "nf4", "mxfp4", "nvfp4", "awq", "gptq", "bnb")
FILE_MODE, DIR_MODE = 0o644, 0o755
# Keys of the target's config.json an export needs (kept in the checkpoint's meta.json, so an
# export needs no target directory).
TARGET_FACTS = ("model_type", "architectures", "_name_or_path", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id", "torch_dtype", "dtype")


class ExportError(ValueError):
    """The export cannot be made; the message is one line naming the flag and the fix."""


def dtype_problem(dtype: str) -> str | None:
    """Why ``--dtype dtype`` cannot be exported (one line), or None."""
    if dtype in DTYPES:
        return None
    if dtype.lower() in QUANTIZED:
        return (f"--dtype {dtype}: a quantized drafter export is refused: vLLM's DFlash loader is not "
                "quantization-aware (vllm-project/vllm#51581: a weight-quantized drafter fails to load or is "
                "silently corrupted); export bf16 (the default) and quantize the target only")
    return f"--dtype {dtype}: expected one of {', '.join(DTYPES)}"


def target_facts(target_dir: str | None) -> dict:
    """What the export needs to know about the target, from its config.json ({} if absent)."""
    cfg = read_json_doc(os.path.join(target_dir, "config.json")) if target_dir else None
    return {k: cfg[k] for k in TARGET_FACTS if cfg and k in cfg}


# --------------------------------------------------------------------------- config.json


def hf_config(drafter_config: dict, target: dict, dtype: str = "bf16", max_seq_len: int | None = None) -> dict:
    """config.json of an export: the drafter's own description (trainer/model.py to_hf: z-lab's
    layout) plus every field the serving implementations read (docs/export.md; a DFlash2
    drafter's extra fields: docs/dflash2.md). Generic over the drafter: ``layer_types``/
    ``sliding_window`` come from the drafter config when it has them, else every layer is
    full attention."""
    cfg = dict(drafter_config)
    name_of_arch = arch.ARCHITECTURES[arch.of_config(cfg)]
    n = int(cfg["num_hidden_layers"])
    dflash = dict(cfg.get("dflash_config") or {})
    ids = [int(i) for i in dflash.get("target_layer_ids") or []]
    layer_types = list(cfg.get("layer_types") or ["full_attention"] * n)
    if len(layer_types) != n:
        raise ExportError(f"the drafter config has {len(layer_types)} layer_types for {n} layers")
    sliding = "sliding_attention" in layer_types
    window = cfg.get("sliding_window") if sliding else None
    if sliding and not window:
        raise ExportError("the drafter has sliding_attention layers but no sliding_window in its config")
    theta = float((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    name = DTYPES[dtype]
    cfg.update({
        "architectures": [name_of_arch],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": f"{MODELING_FILE[:-3]}.{name_of_arch}"},
        # block_size in dflash_config too: z-lab's releases moved it there, SGLang reads it there
        # first and MLX's loader followed; older readers take the top-level one (docs/export.md)
        "dflash_config": {**dflash, "block_size": int(cfg["block_size"]),
                          "mask_token_id": int(dflash["mask_token_id"]), "target_layer_ids": ids},
        # vLLM reads the taps as EAGLE-3 aux layers (the input of layer i+1 = the output of
        # layer i); older releases read only this key, newer ones derive it the same way.
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "max_position_embeddings": int(target.get("max_position_embeddings") or max_seq_len or 32768),
        "layer_types": layer_types,
        "sliding_window": int(window) if window else None,
        "use_sliding_window": sliding,
        "max_window_layers": n,
        "rope_theta": theta,  # transformers 4.x, MLX
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},  # transformers 5, vLLM
        "hidden_act": cfg.get("hidden_act", "silu"),
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,  # no embedding of its own: nothing to tie
        "use_cache": False,
        "dtype": name,
        "torch_dtype": name,
    })
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target.get(key) is not None:
            cfg[key] = target[key]
    try:
        import transformers

        cfg["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    return cfg


# --------------------------------------------------------------------------- the model card


def read_evals(step_dir: str) -> dict:
    return read_json_doc(os.path.join(step_dir, EVAL_FILE)) or {}


def _tau_line(rec: dict | None) -> str:
    if not rec or rec.get("tau") is None:
        return "not measured"
    where = ", ".join(f"{k} {rec[k]}" for k in ("prompts", "max_new_tokens", "device", "dtype") if rec.get(k) is not None)
    return f"{rec['tau']:.3f}" + (f" ({where}; {rec.get('by', 'trainer/serve/evaluate.py')})" if where else "")


def model_card(meta: dict, cfg: dict, n_params: int, dtype: str, evals: dict) -> str:
    """README.md of an export: what it is, what it was trained against and on, how well it
    drafts as measured, how to load it, and the command that trained it. Depends only on the
    checkpoint (no clock, no host), so the same checkpoint gives the same card."""
    target = meta.get("target") or {}
    tfacts = meta.get("target_config") or {}
    conf = meta.get("config") or {}
    schedule = meta.get("schedule") or {}
    dfl = cfg["dflash_config"]
    method = "DFlash2" if arch.of_config(cfg) == arch.DFLASH2 else "DFlash"
    rows = [
        ("target", f"`{conf.get('target_model')}` ({target.get('model_type')}, {target.get('num_hidden_layers')} layers, "
                   f"hidden {target.get('hidden_size')}, vocabulary {target.get('vocab_size')})"),
        ("target config sha256", f"`{target.get('config_sha256')}`"),
        ("data", f"`{conf.get('data_dir')}`, fingerprint `{meta.get('data_fingerprint')}`"),
        ("steps", f"{meta.get('step')} of {schedule.get('total_steps', '?')} (epoch {meta.get('epoch', '?')})"),
        ("block size", f"{cfg['block_size']} (the bonus token + {cfg['block_size'] - 1} drafts)"),
        ("draft layers", f"{cfg['num_hidden_layers']} ({', '.join(cfg['layer_types'])})"),
        ("tapped target layers", ", ".join(map(str, dfl["target_layer_ids"]))),
        ("mask token id", str(dfl["mask_token_id"])),
        *([("DFlash2 shape", ", ".join(f"{k} {dfl[k]}" for k in arch.DFLASH2_FIELDS))] if method == "DFlash2" else []),
        ("weights", f"{n_params:,} parameters, {DTYPES[dtype]} safetensors"),
        ("τ block", _tau_line(evals.get("block"))),
    ]
    for budget, rec in sorted((evals.get("tree") or {}).items(), key=lambda kv: int(kv[0])):
        rows.append((f"τ tree (budget {budget})", _tau_line(rec)))
    if not evals.get("tree"):
        rows.append(("τ tree", "not measured"))
    argv = flags.to_argv(conf) if conf else []
    eos = tfacts.get("eos_token_id")
    stop = f", stop_token_ids=[{eos}]" if isinstance(eos, int) else ""
    lines = [
        "---",
        "library_name: transformers",
        f"tags: [{method.lower()}, speculative-decoding, drafter]",
        "---",
        "",
        f"# {method} drafter, step {meta.get('step')}",
        "",
        f"A block-diffusion drafter for speculative decoding ({method}), trained by dflash-ctl's trainer against a "
        "frozen target. It has no embedding or LM head: it uses the target's. Decoding with it is lossless — "
        "the output equals the target's own greedy decoding."
        + (" DFlash2 adds a two-tap dynamic convolution within each block around every sublayer and a "
           "path selector that drafts a coherent path through each slot's top-k candidates." if method == "DFlash2"
           else ""),
        "",
        "| | |",
        "| --- | --- |",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
        "τ = tokens committed per target forward (the bonus token included), greedy, measured by this trainer's "
        "evaluator on held-out prompts.",
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModel, AutoModelForCausalLM",
        "",
        'draft = AutoModel.from_pretrained("DIR", trust_remote_code=True, dtype="auto")',
        'target = AutoModelForCausalLM.from_pretrained("TARGET", dtype="auto")',
        f"out = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256{stop})",
        "```",
        "",
        "SGLang: `python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path DIR --speculative-num-draft-tokens {cfg['block_size']}`.",
        "",
        "vLLM: `vllm serve TARGET --speculative-config '{\"method\": \"dflash\", \"model\": \"DIR\", "
        f"\"num_speculative_tokens\": {cfg['block_size'] - 1}}}'`.",
        "",
        "## How it was trained",
        "",
        "```",
        "python -m trainer " + shlex.join(argv),
        "```",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the τ sidecar


def trained_facts(cfg: dict) -> dict:
    """The fields of an export's config.json that must stay what the drafter trained with
    (served-check names each one that differs as a likely cause of a served τ shortfall)."""
    dfl = cfg.get("dflash_config") or {}
    return {"block_size": cfg.get("block_size"), "mask_token_id": dfl.get("mask_token_id"),
            "target_layer_ids": dfl.get("target_layer_ids"), "rope_theta": cfg.get("rope_theta"),
            "layer_types": cfg.get("layer_types"), "is_causal": cfg.get("is_causal")}


def sidecar(meta: dict, cfg: dict, evals: dict) -> dict:
    """``dflash_eval.json`` of an export: τ at save (None when it was not measured) with what it
    was measured on, and :func:`trained_facts`. Only checkpoint facts, so step_N/drafter/ and
    ``python -m trainer export`` write the same bytes."""
    rec = evals.get("block") or meta.get("eval") or {}
    conf = meta.get("config") or {}
    n = rec.get("prompts")
    measured = None
    if rec.get("tau") is not None:
        measured = {"prompts": n, "max_new_tokens": rec.get("max_new_tokens"), "device": rec.get("device"),
                    "dtype": rec.get("dtype"), "by": rec.get("by", "trainer/serve/evaluate.py"),
                    "prompts_source": f"the last {n} samples of the prepared data (held out by --eval-prompts)",
                    "data_dir": conf.get("data_dir"), "data_fingerprint": meta.get("data_fingerprint"),
                    "target": meta.get("target"), "target_model": conf.get("target_model")}
    return {"format": SIDECAR_FORMAT, "version": 1, "step": meta.get("step"),
            "tau": rec.get("tau"), "measured": measured, "trained": trained_facts(cfg)}


def _sidecar_text(meta: dict, cfg: dict, evals: dict) -> str:
    return json.dumps(sidecar(meta, cfg, evals), indent=1, sort_keys=True) + "\n"


def read_sidecar(export_dir: str) -> dict | None:
    """The export's :func:`sidecar`, or None (absent, unreadable, or not ours: an export of
    another trainer)."""
    doc = read_json_doc(os.path.join(export_dir, SIDECAR))
    return doc if isinstance(doc, dict) and doc.get("format") == SIDECAR_FORMAT else None


# --------------------------------------------------------------------------- writing


def write_drafter_dir(dest: str, state_dict: dict, meta: dict, *, dtype: str = "bf16", replace: bool = False,
                      evals: dict | None = None) -> dict:
    """Write the export of ``state_dict`` (the drafter's, any dtype) to ``dest`` atomically:
    a temp directory beside it, every file fsynced and chmod 0644, the directory 0755, then
    renamed into place. ``replace`` swaps out an existing ``dest`` (a re-save of the same
    step); otherwise ``dest`` must be absent or empty. Returns the manifest."""
    import torch
    from safetensors.torch import save_file

    if dtype_problem(dtype):
        raise ExportError(dtype_problem(dtype))
    dest = os.path.abspath(dest)
    parent, base = os.path.split(dest)
    if not replace and os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise ExportError(f"--out {dest} is not empty; name a new or empty directory")
    tdtype = getattr(torch, DTYPES[dtype])
    tensors = {k: v.detach().to("cpu", tdtype).contiguous() for k, v in state_dict.items()}
    cfg = hf_config(meta["drafter_config"], meta.get("target_config") or {}, dtype,
                    (meta.get("config") or {}).get("max_seq_len"))
    n_params = sum(t.numel() for t in tensors.values())
    from agent.leftovers import writer_tag

    make_public_dir(parent)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-{writer_tag()}-", dir=parent)  # swept once its writer is gone
    try:
        save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
        _write(os.path.join(tmp, CONFIG), json.dumps(cfg, indent=1, sort_keys=True) + "\n")
        _write(os.path.join(tmp, MODELING_FILE), _modeling_source())
        _write(os.path.join(tmp, CARD), model_card(meta, cfg, n_params, dtype, evals or {}))
        _write(os.path.join(tmp, SIDECAR), _sidecar_text(meta, cfg, evals or {}))
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            os.chmod(path, FILE_MODE)
        os.chmod(tmp, DIR_MODE)
        if os.path.isdir(dest) and replace:
            old = os.path.join(parent, f".{base}.old-{writer_tag()}-{uuid.uuid4().hex[:8]}")
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if os.path.isdir(dest):
                os.rmdir(dest)  # empty (checked above)
            os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest(dest)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def _modeling_source() -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "layers", "hf_dflash.py"), encoding="utf-8") as fh:
        return fh.read()


def manifest(directory: str) -> dict:
    """Every file of an export with its size, sha256 and mode (what ``ctl export`` verifies)."""
    files = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        files.append({"path": name, "size": os.path.getsize(path), "sha256": h.hexdigest(),
                      "mode": f"{os.stat(path).st_mode & 0o777:o}"})
    return {"dir": directory, "files": files, "bytes": sum(f["size"] for f in files)}


def record_eval(step_dir: str, *, block: dict | None = None, tree: dict | None = None) -> None:
    """Merge measured τ into ``step_N/eval.json`` (``block``: one record; ``tree``: {budget:
    record}) and refresh the model card and τ sidecar of ``step_N/drafter/`` so they carry them."""
    evals = read_evals(step_dir)
    if block is not None:
        evals["block"] = block
    if tree:
        evals.setdefault("tree", {}).update({str(k): v for k, v in tree.items()})
    atomic_write_json(os.path.join(step_dir, EVAL_FILE), evals, FILE_MODE)
    drafter = os.path.join(step_dir, "drafter")
    meta = read_json_doc(os.path.join(step_dir, "meta.json"))
    cfg = read_json_doc(os.path.join(drafter, CONFIG))
    if meta and cfg and os.path.isfile(os.path.join(drafter, CARD)):
        from safetensors import safe_open

        atomic_write(os.path.join(drafter, SIDECAR), _sidecar_text(meta, cfg, evals), FILE_MODE)

        with safe_open(os.path.join(drafter, WEIGHTS), framework="pt") as f:
            n_params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
        dtype = next((k for k, v in DTYPES.items() if v == cfg.get("dtype")), "bf16")
        atomic_write(os.path.join(drafter, CARD), model_card(meta, cfg, n_params, dtype, evals), FILE_MODE)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def make_public_dir(path: str, mode: int = 0o755) -> None:
    """``path`` and every parent it creates, ``mode`` whatever the umask: under umask 077 a
    plain makedirs gives 0700 and another user (a serving container) cannot reach the 0644
    files inside. Directories that were already there keep their mode."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            continue
        os.chmod(d, mode)
