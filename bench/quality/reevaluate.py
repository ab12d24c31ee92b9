"""Evaluate the drafters of a finished ``run.py`` run again, on more held-out prompts, and
say which differences between variants the prompts support:

    python3 bench/quality/reevaluate.py --results OUT/results.json --prompts 48 --out DIR

Training is the expensive part of run.py; its evaluation (8–12 prompts on the GPU and CPU-mid
scales) is what limits the comparison. This reloads the target and each variant's final
checkpoint from run.py's ``--work`` directory (recorded in results.json), decodes ``--prompts``
held-out prompts (the first ones are run.py's own: the same seeded draw) with block and tree
verification, checks every output against plain greedy, and adds to the table a second one:
each variant's τ minus the reference variant's, with a 95 % paired bootstrap interval over
prompts (report.paired_deltas).

Writes DIR/results.json (after every variant) and DIR/table.md, prints both tables last.
Exit 0 when every speculative output equalled greedy, 1 when one did not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]

import torch  # noqa: E402

import corpus  # noqa: E402
import distill  # noqa: E402
import measure  # noqa: E402
import report  # noqa: E402
import variants  # noqa: E402


def log(msg: str) -> None:
    print(f"[reevaluate] {msg}", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="results.json written by run.py")
    p.add_argument("--out", required=True, help="directory for this evaluation's results.json and table.md")
    p.add_argument("--work", default=None, help="run.py's --work directory (default: the one results.json names)")
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts to decode (default 48)")
    p.add_argument("--max-new", type=int, default=None, help="bytes per prompt (default: run.py's)")
    p.add_argument("--tree-budgets", default=None, help="comma list, e.g. 16,64 (default: run.py's; empty: none)")
    p.add_argument("--base", default="decay", help="variant the intervals compare against (default decay)")
    args = p.parse_args(argv)
    try:
        with open(args.results) as fh:
            source = json.load(fh)
        cfg = source["config"]
        s, d = cfg["scale_config"], cfg["drafter_budget"]
    except (OSError, ValueError, KeyError) as exc:
        p.error(f"--results {args.results}: not a results.json from run.py ({exc})")
    work = os.path.abspath(args.work or cfg["work"])
    target_dir = os.path.join(work, "target")
    if not os.path.isfile(os.path.join(target_dir, "config.json")):
        p.error(f"no target under {target_dir}: pass run.py's --work directory with --work")
    trained = {name: v.get("dir") or os.path.join(work, cfg.get("drafters_dir", "drafters"), name)
               for name, v in source["variants"].items()
               if v.get("final")}
    missing = [n for n, path in trained.items() if not variants.checkpoints(path)]
    if missing:
        p.error(f"no checkpoint for variant(s) {', '.join(missing)} under {work}/drafters")
    if not trained:
        p.error(f"{args.results} has no trained variant to evaluate")
    if args.base not in trained:
        p.error(f"--base {args.base} is not a trained variant of that run; trained: {', '.join(trained)}")
    if args.prompts < 2:
        p.error(f"--prompts {args.prompts}: intervals over prompts need at least 2")
    budgets = cfg["tree_budgets"] if args.tree_budgets is None else \
        [int(b) for b in args.tree_budgets.split(",") if b.strip()]
    if s["device"] == "cuda" and not torch.cuda.is_available():
        p.error("that run was on CUDA and this machine has no CUDA device")
    if s.get("threads"):
        torch.set_num_threads(s["threads"])
    device = torch.device(s["device"])
    torch.backends.cuda.matmul.allow_tf32 = False  # as run.py: no near-ties flipped by TF32
    max_new = args.max_new or s["eval"]["max_new"]
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()

    from trainer.checkpoint import load_drafter

    split = corpus.load_split(s["corpus_bytes"])
    prompts, categories = distill.eval_prompts(split, args.prompts, s["distill"]["prompt_len"])
    _, target, head = measure.load_target(target_dir, d, device)
    refs = measure.reference(target, prompts, max_new, device)
    results = {"config": dict(cfg, tree_budgets=budgets, prompts=args.prompts, max_new=max_new, prompt_categories=categories,
                              source=os.path.abspath(args.results), work=work, base=args.base),
               "greedy": {"seconds": round(refs["seconds"], 3), "tokens": refs["tokens"]},
               "variants": {}}
    log(f"{args.prompts} held-out prompts × {max_new} bytes, greedy {refs['tokens'] / refs['seconds']:.0f} tok/s")

    def save():
        with open(os.path.join(out, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1)

    for name, v_out in trained.items():
        step, path = variants.checkpoints(v_out)[-1]
        dr = load_drafter(path, device).eval()
        orig = source["variants"][name]
        fin = {"step": step, "block": measure.decode_all("block", target, dr, head, prompts, refs, max_new, device),
               "tree": {}}
        for b in budgets:
            fin["tree"][str(b)] = measure.decode_all("tree", target, dr, head, prompts, refs, max_new, device, b)
        for r in [fin["block"], *fin["tree"].values()]:
            r["by_category"] = measure.by_category(r["per_prompt"], categories)
        results["variants"][name] = {"steps": orig.get("steps"), "final_loss": orig.get("final_loss"), "final": fin}
        taus = " / ".join(f"{c['tau']:.2f}" for c in [fin["block"], *fin["tree"].values()])
        ok = all(c["lossless"] for c in [fin["block"], *fin["tree"].values()])
        log(f"{name}: τ block{''.join(f' / tree {b}' for b in budgets)}: {taus}; lossless {ok}; "
            f"{time.time() - t0:.0f} s")
        save()

    ok = all(c["lossless"] for v in results["variants"].values()
             for c in [v["final"]["block"], *v["final"]["tree"].values()])
    md = report.table(results) + "\n\n" + report.delta_table(results, args.base)
    with open(os.path.join(out, "table.md"), "w") as fh:
        fh.write(md + "\n")
    log(f"lossless on every prompt: {ok}; {time.time() - t0:.0f} s; Δτ against {args.base}, "
        "95 % paired bootstrap interval over prompts:")
    print(md, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
