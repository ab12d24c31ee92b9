"""``python -m trainer export``: a checkpoint's drafter as a directory the serving stacks load
as it is (docs/export.md lists every config.json field, who reads it and where):

    python -m trainer export --checkpoint OUTPUT/step_N --out DIR [--dtype bf16|fp32]

``--checkpoint`` takes a step directory (or its checkpoint.pt), an output directory (its
newest complete checkpoint, or ``--step N``) or a run directory (the output directories its
checkpoint events name). DIR gets

* ``config.json``         Qwen3 fields + ``dflash_config``, ``architectures``, ``auto_map``,
                          ``max_position_embeddings``, ``layer_types``, ``sliding_window``,
                          ``dtype``/``torch_dtype`` …
* ``model.safetensors``   the drafter's weights (bf16 by default), z-lab's tensor names
* ``modeling_dflash.py``  trainer/layers/hf_dflash.py as text: ``AutoModel.from_pretrained(DIR,
                          trust_remote_code=True, dtype="auto")`` + ``spec_generate``
* ``README.md``           a model card: target, data fingerprint, steps, block size, τ as the
                          evaluator measured it (``step_N/eval.json``), the training command

Every file 0644 and the directory 0755 whatever the umask (a server often runs as another
user). The directory is written under a temp name beside DIR and renamed into place when
complete, so DIR holds a whole export or nothing; DIR must be absent or empty. The trainer
writes each checkpoint's ``step_N/drafter/`` with the same function (trainer/checkpoint.py),
so the two are byte-identical for the same checkpoint.

Bad input (no complete checkpoint, DIR not empty, an unknown step) is one line on stderr and
exit 2, nothing written. ``--json`` prints the manifest (file sizes and sha256) between the
agent protocol's sentinel lines, for ``ctl export``.
"""

from __future__ import annotations

import os
import sys

from agent.protocol import read_json_lines, wrap_payload
from trainer import flags

from trainer.drafter_dir import DTYPES, ExportError, dtype_problem, read_evals, target_facts, write_drafter_dir

PROG = "python -m trainer export"


# --------------------------------------------------------------------------- finding the checkpoint


def resolve(path: str, step: int | None = None, best: bool = False) -> str:
    """The complete step directory ``path`` names (see the module doc), or ExportError.
    ``best``: the checkpoint with the highest τ at save (its output directory's best.json)."""
    from trainer import checkpoint as ckpt_io

    path = os.path.abspath(path)
    if best:
        if step is not None:
            raise ExportError("--best and --step name different checkpoints; give one of them")
        where = ([os.path.dirname(ckpt_io.resolve(path))] if os.path.basename(path) == ckpt_io.CHECKPOINT
                 or ckpt_io.STEP_DIR.match(os.path.basename(path)) else
                 [path] if ckpt_io.steps(path) else _run_outputs(path))
        found = [b for b in map(ckpt_io.best, where) if b]
        if not found:
            raise ExportError(f"--best: {path} has no best checkpoint (none had its τ measured at save: train with "
                              "--eval-prompts N, or export one by --step)")
        return ckpt_io.resolve(max(found, key=lambda b: b["tau"])["path"])
    if os.path.basename(path) == ckpt_io.CHECKPOINT or ckpt_io.STEP_DIR.match(os.path.basename(path)):
        d = ckpt_io.resolve(path)
        if step is not None and ckpt_io.STEP_DIR.match(os.path.basename(d)).group(1) != str(step):
            raise ExportError(f"--checkpoint {path} is step {os.path.basename(d)[5:]}, not --step {step}")
        try:
            ckpt_io.read_meta(d)
        except ValueError as exc:
            raise ExportError(f"--checkpoint {path}: {exc}") from None
        return d
    if not os.path.isdir(path):
        raise ExportError(f"--checkpoint {path}: no such checkpoint, output directory or run directory")
    outputs = [path] if ckpt_io.steps(path) else _run_outputs(path)
    found = [(s, p) for out in outputs for s, p, done in ckpt_io.steps(out) if done]
    if not found:
        raise ExportError(f"--checkpoint {path}: no complete checkpoint there (no step_N/ with checkpoint.pt"
                          f"{'' if outputs else ', and no checkpoint events in its events.jsonl'}); "
                          "the run has not saved yet — wait for its first save or name a checkpoint")
    if step is None:
        return max(found)[1]
    for s, p in found:
        if s == step:
            return p
    have = ", ".join(str(s) for s, _ in sorted(found)[-8:])
    raise ExportError(f"--step {step}: {path} has no complete checkpoint of that step (it has {have})")


def _run_outputs(run_dir: str) -> list[str]:
    """Output directories a run directory's checkpoint events name, in first-seen order."""
    out: list[str] = []
    for _, rec in read_json_lines(os.path.join(run_dir, "events.jsonl")):
        if rec.get("kind") == "checkpoint" and rec.get("path"):
            d = os.path.dirname(os.path.dirname(rec["path"]))
            if d not in out:
                out.append(d)
    return out


def export(checkpoint: str, out: str, dtype: str = "bf16", step: int | None = None, say=lambda line: None,
           best: bool = False) -> dict:
    """Export the checkpoint ``checkpoint`` names to ``out`` (``best``: the one with the highest
    τ at save); returns the manifest plus its step and τ (None where none was measured)."""
    from trainer import checkpoint as ckpt_io

    if dtype_problem(dtype):  # before anything is read
        raise ExportError(dtype_problem(dtype))
    d = resolve(checkpoint, step, best)
    out = os.path.abspath(out)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ExportError(f"--out {out} is not empty; name a new or empty directory")
    meta = ckpt_io.read_meta(d)
    if not meta.get("target_config"):  # a checkpoint from before the export: read the target if it is here
        meta["target_config"] = target_facts((meta.get("config") or {}).get("target_model"))
    say(f"exporting {d} ({DTYPES[dtype]}) to {out}")
    state = ckpt_io.load(d, mmap=True)["model"]
    result = write_drafter_dir(out, state, meta, dtype=dtype, evals=read_evals(d))
    tau = (meta.get("eval") or {}).get("tau", (read_evals(d).get("block") or {}).get("tau"))
    result.update(step=meta["step"], checkpoint=d, dtype=dtype, tau=tau, best=best)
    say(f"wrote {len(result['files'])} files, {result['bytes'] / 2**20:.1f} MiB")
    return result


def tau_words(result: dict) -> str:
    """" (the best: τ 2.31 at save)" — which checkpoint an export took and how well it drafts."""
    tau = result.get("tau")
    what = "the best" if result.get("best") else "τ"
    return f" ({what}: τ {tau:.3f} at save)" if isinstance(tau, (int, float)) else " (τ not measured at save)"


def main(argv: list[str] | None = None) -> int:
    p = flags.UsageParser(prog=PROG, description="Write a checkpoint's drafter as a directory SGLang, vLLM, "
                          "transformers (trust_remote_code) and MLX load as it is (docs/export.md).")
    p.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="a step directory (OUTPUT/step_N) or its checkpoint.pt, an output directory (its newest "
                        "complete checkpoint) or a run directory (the output directories its checkpoint events name)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="with an output or run directory: that step instead of the newest")
    p.add_argument("--best", action="store_true",
                   help="the checkpoint with the highest τ measured at save (--eval-prompts), not the newest")
    p.add_argument("--out", required=True, metavar="DIR", help="the export directory; must be absent or empty")
    p.add_argument("--dtype", default="bf16", metavar="|".join(DTYPES),
                   help="weight dtype of model.safetensors (default bf16, what the serving stacks run); a "
                        "quantized format is refused with the reason (vllm-project/vllm#51581)")
    p.add_argument("--json", action="store_true", help="print the manifest (files, sizes, sha256) as JSON between "
                                                       "the agent protocol's sentinel lines")
    args = p.parse_args(argv)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    try:
        result = export(args.checkpoint, args.out, args.dtype, args.step, say, args.best)
    except ExportError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        if args.json:
            sys.stdout.write(wrap_payload({"ok": False, "error": str(exc)}))
        return flags.EXIT_USAGE
    except OSError as exc:
        print(f"{PROG}: error: cannot write {args.out}: {exc.strerror or exc}; nothing was written", file=sys.stderr)
        if args.json:
            sys.stdout.write(wrap_payload({"ok": False, "error": f"cannot write {args.out}: {exc}"}))
        return flags.EXIT_FAILURE
    if args.json:
        sys.stdout.write(wrap_payload({"ok": True, **result}))
    else:
        print(f"{result['dir']}: step {result['step']}{tau_words(result)}, " + ", ".join(f["path"] for f in result["files"]))
    return flags.EXIT_OK
