"""Drafter quality on a real (small) target, end to end, in one command:

    python3 bench/quality/run.py --scale gpu --out $OUT      # one H200, < 10 minutes
    python3 bench/quality/run.py --scale gpu-short --out $OUT  # one H200, about 5 minutes
    python3 bench/quality/run.py --scale cpu-mid --out DIR   # no GPU: 2 cores, about 25 minutes
    python3 bench/quality/run.py --scale cpu --out DIR       # the same pipeline, tiny (tests)
    python3 bench/quality/run.py --scale gpu-fp8 --out $OUT  # FP8 taps against bf16 taps, two seeds, < 8 min

1. a byte-level Qwen3 target trained on a chat mix made of what every Python install has
   (corpus.py: code and documentation from the stdlib sources, generated arithmetic;
   held-out conversations kept apart);
2. self-distillation data: its greedy completions of training-split prompts, loss on the
   completion, through ``python -m trainer prepare``, one input file per category;
3. one drafter per variant (variants.py), trained by ``python -m trainer`` on the same budget;
4. τ by block verification at every checkpoint (the curve) and, for the final checkpoint,
   τ by block and by tree verification (budgets 16/32/64), wall-clock speedup over plain
   greedy decoding, and a token-for-token losslessness check on every held-out prompt; every
   τ also per category (code, prose, math);
5. where the scale asks (eval.verify, eval.tap_error): τ with the verifying target in bf16 and
   in FP8 (``--target-precision``'s two loads), and the FP8 taps' error against bf16 per
   tapped layer on held-out text.

Writes OUT/results.json (after every phase, so a cut-off run still leaves data),
OUT/summary.json (the figures a README quotes), OUT/table.md, OUT/tau_vs_steps.png and OUT/events/VARIANT.jsonl (the trainer's events), and
prints the table last. Exit code 0 when every check passed; 1 when a speculative output
differed from greedy or a variant failed. On the GPU scales a deadline (--deadline-s) skips
the remaining variants or tree budgets rather than overrunning the device call.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time

T0 = time.time()  # the time budget counts from here: torch's import is part of the device call
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, ROOT]

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

import torch  # noqa: E402

import corpus  # noqa: E402
import distill  # noqa: E402
import measure  # noqa: E402
import report  # noqa: E402
import target as target_mod  # noqa: E402
import variants  # noqa: E402
from agent.protocol import atomic_write_json  # noqa: E402
from trainer.flags import EXIT_STOPPED  # noqa: E402

SCALES = {
    # 2-core CPU, about a minute and a half: just enough that the drafter learns (τ > 1).
    "cpu": {
        "threads": 1, "device": "cpu", "corpus_bytes": 1_000_000, "deadline_s": None,
        "target": {"shape": {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 192},
                   "steps": 80, "seconds": 120, "batch": 16, "seq_len": 128, "lr": 3e-3},
        "distill": {"samples": 96, "prompt_len": 24, "completion_len": 48, "chunk": 96},
        "drafter": {"steps": 40, "save_interval": 20, "log_interval": 20, "lr": 3e-3, "token_budget": 1152,
                    "max_batch_size": 16, "block_size": 8, "max_anchors": 12, "layers": 2,
                    "target_layer_ids": "1,2"},
        # served: also decode the final checkpoint's export through its own modeling file
        "eval": {"prompts": 6, "max_new": 32, "curve_prompts": 3, "curve_max_new": 24, "tree_budgets": [16, 32, 64],
                 "served": True, "served_vllm": False,
                 # τ with the verifying target loaded as --target-precision loads it (bf16, fp8),
                 # and the FP8 taps' error per layer: see the gpu-fp8 scale
                 "verify": [], "tap_error": False, "tap_rows": 8},
        "variants": None, "seeds": [0],  # None: every variant; --variants / --seeds override
    },
    # One H200: ~26M-parameter target (8 layers, hidden 512), block 16, 3-layer drafters.
    "gpu": {
        # 10 MB: all the stdlib's docstrings (2.5 MB) are then prose's share of the mix
        "threads": None, "device": "cuda", "corpus_bytes": 10_000_000, "deadline_s": 560,
        "target": {"shape": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 4, "intermediate": 1536},
                   "steps": 4000, "seconds": 90, "batch": 64, "seq_len": 512, "lr": 1.5e-3},
        "distill": {"samples": 3072, "prompt_len": 128, "completion_len": 256, "chunk": 1024},
        "drafter": {"steps": 300, "save_interval": 75, "log_interval": 25, "lr": 1e-3, "token_budget": 24576,
                    "max_batch_size": 64, "block_size": 16, "max_anchors": 48, "layers": 3},
        "eval": {"prompts": 12, "max_new": 128, "curve_prompts": 6, "curve_max_new": 64, "tree_budgets": [16, 32, 64],
                 "served": True, "served_vllm": False,
                 # 6 of the 12: all three budgets for all six variants fit one 10-minute GPU call
                 # (on 12, only budget 16 of three variants did)
                 "tree_prompts": 6, "verify": [], "tap_error": False, "tap_rows": 8},
        "variants": None, "seeds": [0],
    },
}
# Between the two, for a machine without a GPU (2 cores, about 25 minutes): a target that learns
# the stdlib well enough not to fall into the loops the tiny one does, so the variants can
# differ; every variant gets the curve and all three tree budgets.
SCALES["cpu-mid"] = json.loads(json.dumps(SCALES["cpu"]))
SCALES["cpu-mid"].update(threads=2, corpus_bytes=6_000_000)
SCALES["cpu-mid"]["target"].update(shape={"hidden": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 384},
                                   steps=100_000, seconds=600, seq_len=256, lr=2e-3)
SCALES["cpu-mid"]["distill"].update(samples=512, prompt_len=64, completion_len=96, chunk=128)
SCALES["cpu-mid"]["drafter"].update(steps=240, save_interval=40, lr=2e-3, token_budget=4800, max_batch_size=32,
                                    max_anchors=24)
SCALES["cpu-mid"]["eval"].update(prompts=9, max_new=64, curve_prompts=4, curve_max_new=48)
# The same on a tighter device budget (about 5 minutes): shorter target and drafter training,
# fewer evaluation prompts.
SCALES["gpu-short"] = json.loads(json.dumps(SCALES["gpu"]))
SCALES["gpu-short"].update(deadline_s=300)
SCALES["gpu-short"]["target"].update(seconds=60)
SCALES["gpu-short"]["drafter"].update(steps=200, save_interval=50)
SCALES["gpu-short"]["eval"].update(prompts=9, curve_prompts=3, tree_prompts=3)
# FP8 taps against bf16 taps (one device call, under 8 minutes with the target's training):
# the reference objective trained on each, two seeds, verified by the target in bf16 and in
# FP8, and the taps' error per layer. Each drafter is decoded three times (fp32, bf16 and FP8
# targets, each with its greedy reference), so to fit it leaves out tree verification, the
# served path and the τ-vs-steps curve between step 0 and the last (one checkpoint per
# drafter), and trains 150 drafter steps (gpu-short: 200) on a target of 50 s (60), decoding
# 96 new bytes per prompt (128). Estimated from gpu-short's timings on an H200 (a variant's
# training and evaluation ~100 s the first, less after; the target and its data ~95 s): about
# 7.5 minutes.
SCALES["gpu-fp8"] = json.loads(json.dumps(SCALES["gpu-short"]))
SCALES["gpu-fp8"].update(deadline_s=470, variants=["decay", "fp8-taps"], seeds=[0, 1])
SCALES["gpu-fp8"]["target"].update(seconds=50)
SCALES["gpu-fp8"]["drafter"].update(steps=150, save_interval=150)
SCALES["gpu-fp8"]["eval"].update(max_new=96, tree_budgets=[], served=False, verify=["bf16", "fp8"], tap_error=True)


class Clock:
    """The run's time budget. SIGTERM (e.g. from ``timeout``) spends it at once, so the
    remaining variants and tree budgets are skipped and the table of what is done is printed."""

    def __init__(self, deadline_s):
        self.t0 = T0
        self.deadline_s = deadline_s
        self.stopped = False
        self.listen()

    def listen(self) -> None:
        # The trainer installs its own SIGTERM handler while it trains (finish the step, save,
        # exit 75); call this again after each trainer run to take the signal back.
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, signum, frame) -> None:
        self.stopped = True

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        if self.stopped:
            return 0.0
        return math.inf if self.deadline_s is None else self.deadline_s - self.elapsed()


def log(msg: str) -> None:
    print(f"[quality] {msg}", flush=True)


def drafter_budget(s: dict) -> dict:
    d = dict(s["drafter"])
    length = s["distill"]["prompt_len"] + s["distill"]["completion_len"]
    d["max_seq_len"] = length
    per_batch = min(d["max_batch_size"], d["token_budget"] // length)
    per_epoch = math.ceil(s["distill"]["samples"] / per_batch)
    d["epochs"] = math.ceil(d["steps"] / per_epoch) + 1
    return d


def override(scale: dict, sets: list[str]) -> dict:
    """A deep copy of ``scale`` with KEY=VALUE overrides (dotted keys into nested dicts)."""
    s = json.loads(json.dumps(scale))
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. drafter.steps=200")
        *path, last = key.split(".")
        node = s
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            raise ValueError(f"--set {key}: no such setting")
        try:
            node[last] = json.loads(raw)
        except json.JSONDecodeError:
            node[last] = raw
    return s


def final_loss(out_dir: str) -> tuple[float | None, float | None]:
    """(loss, ce) of the trainer's last step event; (None, None) if it wrote none (a trainer
    that refused its flags writes nothing)."""
    last = None
    path = os.path.join(out_dir, "events.jsonl")
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                e = json.loads(line)
                if e.get("kind") == "step":
                    last = e
    return (last["loss"], last["ce"]) if last else (None, None)


def train_and_evaluate(name: str, argv: list[str], v_out: str, v: dict, c: dict):
    """Train one variant with the trainer, then: τ at every checkpoint (the curve, on the curve
    prompts) and, for the final checkpoint, block τ, speedup and losslessness on all prompts.
    Fills ``v``; returns the final drafter (for the tree phase)."""
    from trainer.checkpoint import load_drafter

    target, head, device, ev = c["target"], c["head"], c["device"], c["ev"]
    log(f"{name}: {v['command']}")
    t0 = time.time()
    v["rc"] = variants.train(argv)
    v["final_loss"], v["final_ce"] = final_loss(v_out)
    v["train_s"] = round(time.time() - t0, 1)
    events = os.path.join(v_out, "events.jsonl")
    if c.get("events_dir") and os.path.exists(events):  # step events travel back with $OUT; checkpoints do not
        os.makedirs(c["events_dir"], exist_ok=True)
        shutil.copyfile(events, os.path.join(c["events_dir"], f"{name}.jsonl"))
    if v["rc"] != 0:
        raise RuntimeError(f"the trainer exited {v['rc']}")
    v["curve"] = [[0, c["tau0"](v["seed"])]]
    ckpts = variants.checkpoints(v_out)
    for step, path in ckpts[:-1]:
        dr = load_drafter(path, device).eval()
        v["curve"].append([step, measure.block_tau(target, dr, head, c["curve_prompts"], ev["curve_max_new"], device)])
    final_step, final_path = ckpts[-1]
    dr = load_drafter(final_path, device).eval()
    blk = measure.decode_all("block", target, dr, head, c["prompts"], c["refs"], ev["max_new"], device)
    blk["by_category"] = measure.by_category(blk["per_prompt"], c["categories"])
    v["curve"].append([final_step, measure.block_tau(target, dr, head, c["curve_prompts"], ev["curve_max_new"], device)])
    v["final"] = {"step": final_step, "block": blk, "tree": {}, "path": final_path}
    said = ""
    # the same drafter verified by the target as --target-precision loads it (eval.verify): τ
    # against the bf16 target and against the FP8 one, each checked against its own greedy
    for prec, (vt, vhead, vrefs) in c["verify"].items():
        r = blk if vt is target else measure.decode_all("block", vt, dr, vhead, c["prompts"], vrefs, ev["max_new"],
                                                         device)
        r = {**r, "by_category": measure.by_category(r["per_prompt"], c["categories"]),
             "dtype": str(vt.model.dtype).replace("torch.", "")}
        v["final"].setdefault("verify", {})[prec] = r
        said += f"; τ verified by the {prec} target {r['tau']:.2f} (equal to its greedy: {r['lossless']})"
    # the served path: the final checkpoint exported (python -m trainer export) and decoded by
    # the export's own modeling file through AutoModel + trust_remote_code (docs/export.md)
    # (eval.served false: skipped, when a device call has time for the comparison between
    # variants only — the served path has its own runs and tests, docs/export.md)
    if ev.get("served", True):
        v["final"]["served"] = measure.served_all(final_path, os.path.join(v_out, "served"), target, c["prompts"],
                                                  c["refs"], ev["max_new"], device, blk)
        served = v["final"]["served"]
        for r in served.values():
            r["by_category"] = measure.by_category(r["per_prompt"], c["categories"])
        said += (f"; served τ fp32 {served['fp32']['tau']:.2f} (= block: {served['fp32']['equal_to_block']}), "
                f"bf16 {served['bf16']['tau']:.2f}")
        if ev.get("served_vllm"):  # --set eval.served_vllm=true: the bf16 export served by vLLM (trainer/serve/served.py)
            from trainer.serve import served as served_mod

            r = served_mod.check(os.path.join(v_out, "served", "bf16"), c["target_dir"], c["prompts"], ev["max_new"])
            served["vllm"] = {k: r[k] for k in ("ok", "causes", "tau_served", "tau_trained", "counters", "prompts",
                                                "max_new", "vllm_max_tokens", "tolerance")}
            served["vllm"]["lossless"] = not any(why.startswith("not lossless") for why in r["causes"])
            said += (f"; vLLM τ {r['tau_served']:.3f} vs our evaluator's {r['tau_trained']:.3f} on the bf16 export "
                     f"({'pass' if r['ok'] else 'FAIL: ' + '; '.join(r['causes'])})")
    cats = ", ".join(f"{k} {t:.2f}" for k, t in blk["by_category"].items())
    log(f"{name}: loss {v['final_loss']:.3f}, τ block {blk['tau']:.2f} ({cats}), speedup {blk['speedup']:.2f}×, "
        f"lossless {blk['lossless']}{said}, {time.time() - t0:.0f} s")
    return dr


def make_target_and_data(s: dict, split: dict, tgt_dir: str, work: str, device, results: dict, clock, save) -> None:
    """Steps 1 and 2: train the target, then write its self-distillation data."""
    t = s["target"]
    results["target"] = target_mod.train_target(tgt_dir, split["train"], t["shape"], steps=t["steps"],
                                                seconds=t["seconds"], batch=t["batch"], seq_len=t["seq_len"],
                                                lr=t["lr"], device=device, log=log)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tgt_dir, dtype=torch.float32).to(device).eval()
    ho = target_mod.held_out_loss(hf, split["held_out"], t["seq_len"], 32, device)
    results["target"]["held_out_bits_per_byte"] = round(ho / math.log(2), 3)
    results["target"]["held_out_bits_per_byte_by_category"] = {
        cat: round(target_mod.held_out_loss(hf, docs, t["seq_len"], 32, device) / math.log(2), 3)
        for cat, docs in corpus.by_category(split["held_out"], split["categories"]["held_out"]).items()}
    results["timings"]["target_s"] = round(clock.elapsed(), 1)
    log(f"target: {results['target']}")
    save()

    ds = s["distill"]  # step 2: the target's own completions, prepared by the trainer
    results["data"] = distill.make_distill_data(hf, split, work, samples=ds["samples"],
                                                prompt_len=ds["prompt_len"], completion_len=ds["completion_len"],
                                                chunk=ds["chunk"], device=device, log=log)
    del hf
    results["timings"]["distill_s"] = round(clock.elapsed(), 1)
    save()


def stage_key(s: dict) -> dict:
    """What the target and its data depend on: reuse them only when these are equal."""
    return {"corpus_bytes": s["corpus_bytes"], "target": s["target"], "distill": s["distill"], "device": s["device"]}


def drafters_dir(seed: int) -> str:
    """Where one seed's drafters go under --work (seed 0's where they always went)."""
    return "drafters" if seed == 0 else f"drafters-seed{seed}"


def variant_key(name: str, seed: int, seeds: list[int]) -> str:
    """results.json's name for a variant: the variant itself with one seed, NAME@seedN with several."""
    return name if len(seeds) == 1 else f"{name}@seed{seed}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SCALES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default=None,
                   help="target, data and checkpoints (default: a fresh directory under /tmp, so $OUT stays small)")
    p.add_argument("--variants", default=None,
                   help="comma list (default: the scale's, e.g. gpu-fp8's decay,fp8-taps; else all)")
    p.add_argument("--deadline-s", type=float, default=None, help="override the scale's time budget")
    p.add_argument("--seed", default=None, metavar="N[,N…]",
                   help="the drafters' seed (init, data order), passed to the trainer; a comma list trains "
                        "every variant once per seed on the same target and data (default: the scale's, 0)")
    p.add_argument("--reuse-target", action="store_true",
                   help="take the target and the distilled data from a previous run in --work (same "
                        "scale settings) and train only the drafters: another --seed costs no target training")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one scale setting, e.g. --set target.seconds=60 --set drafter.steps=200 "
                        "(VALUE is JSON; a bare word is a string)")
    args = p.parse_args(argv)
    try:
        s = override(SCALES[args.scale], args.set)
    except ValueError as exc:
        p.error(str(exc))
    names = [v for v in args.variants.split(",") if v] if args.variants else (s["variants"] or list(variants.VARIANTS))
    try:
        seeds = [int(x) for x in args.seed.split(",") if x.strip()] if args.seed else list(s["seeds"])
    except ValueError:
        p.error(f"--seed {args.seed!r}: expected integers, e.g. --seed 1 or --seed 0,1")
    if not seeds or len(set(seeds)) != len(seeds):
        p.error(f"--seed {args.seed!r}: give each seed once, e.g. --seed 0,1")
    unknown = [v for v in names if v not in variants.VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(variants.VARIANTS)}")
    if args.reuse_target and not args.work:
        p.error("--reuse-target needs --work: the directory of the run whose target to reuse")
    reused = None
    if args.reuse_target:
        try:
            with open(os.path.join(args.work, "stages.json")) as fh:
                reused = json.load(fh)
        except (OSError, ValueError) as exc:
            p.error(f"--reuse-target: no finished target and data in {args.work} ({exc}); run once without it")
        if reused.get("key") != stage_key(s):
            p.error(f"--reuse-target: the target in {args.work} was made with other corpus/target/distill "
                    f"settings; run without --reuse-target, or with the same --scale and --set values")
    clock = Clock(args.deadline_s if args.deadline_s is not None else s["deadline_s"])
    if s["threads"]:
        torch.set_num_threads(s["threads"])  # tiny matrices on a busy 2-core VM: 1 thread is far faster
    if s["device"] == "cuda" and not torch.cuda.is_available():
        p.error(f"--scale {args.scale} needs a CUDA device")
    device = torch.device(s["device"])
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 evaluation: no near-ties flipped by TF32
    torch.backends.cudnn.allow_tf32 = False
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix="dflash-quality-")
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    ev = s["eval"]
    d = drafter_budget(s)
    gpu_name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    results = {"config": {"scale": args.scale, "block_size": d["block_size"], "tree_budgets": ev["tree_budgets"],
                          "curve_prompts": ev["curve_prompts"], "scale_config": s, "drafter_budget": d,
                          "torch": torch.__version__, "work": work, "device": gpu_name, "seed": seeds[0],
                          "seeds": seeds, "drafters_dir": drafters_dir(seeds[0]), "reused_target": bool(reused),
                          "categories": list(corpus.CATEGORIES)},
               "timings": {}, "variants": {}}

    def save():
        with open(os.path.join(out, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1)

    # -- 1 + 2. the target and its self-distillation data
    split = corpus.load_split(s["corpus_bytes"])
    results["corpus"] = {k: {"conversations": len(split[k]), "bytes": int(sum(len(x) for x in split[k])),
                             "by_category": {cat: {"conversations": len(docs), "bytes": int(sum(len(x) for x in docs))}
                                             for cat, docs in corpus.by_category(split[k], split["categories"][k]).items()}}
                         for k in ("train", "held_out")}
    log(f"corpus: {results['corpus']}")
    tgt_dir = os.path.join(work, "target")
    if reused:
        results["target"], results["data"] = reused["target"], reused["data"]
        log(f"target and data reused from {work}: {results['target']}")
    else:
        make_target_and_data(s, split, tgt_dir, work, device, results, clock, save)
        atomic_write_json(os.path.join(work, "stages.json"),
                          {"key": stage_key(s), "target": results["target"], "data": results["data"]})

    # -- 3 + 4. evaluation setup: the target (fp32), held-out prompts, greedy references
    from trainer.model import Drafter

    dcfg, target, head = measure.load_target(tgt_dir, d, device)
    prompts, categories = distill.eval_prompts(split, ev["prompts"], s["distill"]["prompt_len"])
    results["config"]["prompt_categories"] = categories
    curve_prompts = prompts[:ev["curve_prompts"]]
    refs = measure.reference(target, prompts, ev["max_new"], device)
    results["greedy"] = {"seconds": round(refs["seconds"], 3), "tokens": refs["tokens"],
                         "tokens_per_s": round(refs["tokens"] / refs["seconds"], 1)}
    results["tree_pass_max_logit_error"] = measure.tree_pass_error(target, prompts[0], dcfg.vocab_size, device)
    log(f"tree pass vs causal passes: max |Δlogit| {results['tree_pass_max_logit_error']:.2e}")
    verify = {}  # eval.verify: the target as --target-precision loads it on this device, and its greedy
    for prec in ev["verify"]:
        dtype = measure.trainer_dtype(device)
        if dtype == torch.float32 and prec == "bf16":
            verify[prec] = (target, head, refs)  # on CPU the trainer's bf16 target is the fp32 one above
            continue
        _, vt, vhead = measure.load_target(tgt_dir, d, device, dtype, prec)
        verify[prec] = (vt, vhead, measure.reference(vt, prompts, ev["max_new"], device))
        log(f"verifying target {prec} ({dtype}): greedy {verify[prec][2]['tokens'] / verify[prec][2]['seconds']:.0f} tok/s")
    if ev["tap_error"]:  # the FP8 taps against bf16's, per tapped layer, on held-out text of every category
        windows = {cat: corpus.prompt_windows(docs, ev["tap_rows"], s["target"]["seq_len"], 5).tolist()
                   for cat, docs in corpus.by_category(split["held_out"], split["categories"]["held_out"]).items()}
        results["tap_error"] = measure.tap_error(tgt_dir, dcfg.target_layer_ids, windows, device)
        log("FP8 taps against bf16: " + "; ".join(
            f"layer {r['layer']} rel L2 {r['fp8_vs_bf16']['rel_l2']:.2e} max abs {r['fp8_vs_bf16']['max_abs']:.3g} "
            f"(bf16 vs fp32 {r['bf16_vs_fp32']['rel_l2']:.2e})" for r in results["tap_error"]["layers"]))
    results["timings"]["eval_setup_s"] = round(clock.elapsed(), 1)
    untrained_tau: dict[int, float] = {}

    def tau0(seed: int) -> float:
        """τ of the untrained drafter (the trainer's --seed init): the step-0 point of every curve."""
        if seed not in untrained_tau:
            torch.manual_seed(seed)
            untrained = Drafter(dcfg).to(device).eval()
            untrained_tau[seed] = measure.block_tau(target, untrained, head, curve_prompts, ev["curve_max_new"], device)
        return untrained_tau[seed]

    save()

    ctx = {"target": target, "target_dir": tgt_dir, "head": head, "prompts": prompts, "curve_prompts": curve_prompts, "refs": refs,
           "categories": categories, "verify": verify, "ev": ev, "device": device, "tau0": tau0,
           "events_dir": os.path.join(out, "events")}
    drafters = {}
    longest = 60.0  # a variant (train + evaluate) is assumed to take this long until one has
    runs = [(seed, name) for seed in seeds for name in names]  # seed by seed: a cut run keeps whole comparisons
    for seed, name in runs:
        key = variant_key(name, seed, seeds)
        if clock.left() < 1.2 * longest:
            why = "SIGTERM" if clock.stopped else "time budget"
            log(f"{key}: skipped ({why}), {clock.left():.0f} s left")
            results["variants"][key] = {"skipped": why, "variant": name, "seed": seed}
            continue
        started = clock.elapsed()
        v_out = os.path.join(work, drafters_dir(seed), name)
        argv = variants.trainer_argv(name, tgt_dir, results["data"]["data_dir"], v_out, d, seed=seed)
        v = results["variants"][key] = {"variant": name, "seed": seed, "taps": variants.target_precision(name),
                                        "flags": variants.VARIANTS[name], "steps": d["steps"], "dir": v_out,
                                        "command": variants.command_line(argv)}
        try:  # one variant failing (or its evaluation) must not cost the others their results
            drafters[key] = train_and_evaluate(key, argv, v_out, v, ctx)
        except Exception as exc:  # noqa: BLE001 — recorded, printed, and fails the run's exit code
            v["error"] = f"{type(exc).__name__}: {exc}"
            log(f"{key}: FAILED {v['error']}")
        clock.listen()
        if v.get("rc") == EXIT_STOPPED:  # SIGTERM reached the trainer: stop here, report what is done
            clock.stopped = True
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results["timings"][f"{key}_s"] = round(clock.elapsed(), 1)
        longest = max(longest if (seed, name) != runs[0] else 0.0, clock.elapsed() - started)
        save()

    # -- tree verification last: the block results above are the must-haves
    slowest = 10.0
    n_tree = ev.get("tree_prompts", len(prompts))
    for budget in ev["tree_budgets"]:
        for name, dr in drafters.items():
            if clock.left() < 1.5 * slowest + 10:
                log(f"tree {budget} {name}: skipped, {clock.left():.0f} s left")
                continue
            fin = results["variants"][name]["final"]
            try:
                tr = measure.decode_all("tree", target, dr, head, prompts[:n_tree], refs, ev["max_new"], device, budget)
            except Exception as exc:  # noqa: BLE001
                fin.setdefault("tree_errors", {})[str(budget)] = f"{type(exc).__name__}: {exc}"
                log(f"{name}: tree {budget} FAILED {fin['tree_errors'][str(budget)]}")
                continue
            tr["by_category"] = measure.by_category(tr["per_prompt"], categories[:n_tree])
            fin["tree"][str(budget)] = tr
            slowest = max(slowest, tr["seconds"])  # larger budgets cost more: keep the worst seen
            log(f"{name}: tree {budget}: τ {tr['tau']:.2f}, speedup {tr['speedup']:.2f}×, lossless {tr['lossless']}")
            save()
    from trainer.drafter_dir import record_eval

    for name, v in results["variants"].items():  # the model card of each final checkpoint shows what was measured
        fin = v.get("final")
        if fin and fin.get("path"):
            rec = lambda d: {"tau": d["tau"], "prompts": d["prompts"], "max_new_tokens": ev["max_new"],  # noqa: E731
                             "device": device.type, "dtype": "float32", "by": "bench/quality"}
            record_eval(fin["path"], block=rec(fin["block"]), tree={b: rec(t) for b, t in fin["tree"].items()})
    results["timings"]["total_s"] = round(clock.elapsed(), 1)
    save()
    atomic_write_json(os.path.join(out, "summary.json"), report.summary(results))

    md = report.table(results)
    extra = report.fp8_tables(results)
    with open(os.path.join(out, "table.md"), "w") as fh:
        fh.write((extra + "\n\n" if extra else "") + md + "\n")
    plotted = report.plot(results, os.path.join(out, "tau_vs_steps.png"))
    ok = all(c["lossless"] for v in results["variants"].values() if v.get("final")
             for c in [v["final"]["block"], *v["final"]["tree"].values(), *(v["final"].get("served") or {}).values()])
    failed = [n for n, v in results["variants"].items() if v.get("error") or (v.get("final") or {}).get("tree_errors")]
    skipped = [n for n, v in results["variants"].items() if v.get("skipped")]
    log(f"target {results['target']['params'] / 1e6:.1f}M params, {results['target']['steps']} steps, held-out "
        f"{results['target']['held_out_bits_per_byte']} bits/byte; data {results['data']['samples']} samples; "
        f"greedy {results['greedy']['tokens_per_s']} tok/s; total {results['timings']['total_s']} s; "
        f"plot {'written' if plotted else 'skipped (no matplotlib)'}; lossless on every prompt: {ok}; "
        f"failed: {', '.join(failed) or 'none'}; skipped: {', '.join(skipped) or 'none'}")
    if extra:  # before the main table: the main table stays the last lines printed
        print(extra + "\n", flush=True)
    print(md, flush=True)
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
