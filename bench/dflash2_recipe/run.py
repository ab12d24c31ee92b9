"""At SpecForge's published DFlash2 recipe shape, how fast are our drafter rank and our FP8
target capture on one GPU, and what would a 5 + 3 split of one 8-GPU node make of them?

    PYTHONUNBUFFERED=1 python3 bench/dflash2_recipe/run.py --out DIR [--sections drafter,capture,predict]
    python3 bench/dflash2_recipe/run.py --out DIR --smoke          # the same code on CPU, tiny widths

The recipe (docs/research/dflash2-recipe.md has every fact with its source):
``SpecForge:docs/recipes/qwen3.8-27b-dflash2-disaggregated.md`` — five capture servers (an FP8
27B hybrid target each) and three DFlash2 trainer ranks on 8 H200: 10.65 samples/s; 2.25
prompts/s per capture server, 3.7 samples/s per trainer rank (8 samples per 2.15 s step).

Sections (each adds its record to DIR/results.json as it ends, so a cut run keeps the rest):

* ``drafter`` — the trainer's own step (trainer/step.py ``make_step``, the chunked step, fused
  AdamW, the global-norm clip), as bench/drafter_step/run.py builds it, at the recipe's shape:
  a DFlash2 drafter of 5 sliding-window (2,048) layers at Qwen3.6-27B's widths (32/8 × 128
  attention, 17,408 MLP, vocabulary 248,320), taps 5/19/33/47/61, block 8, up to 512 anchors
  per sequence (trainer/loss.py ``sample_anchors``: SpecForge's rule), hard-label CE with
  decay γ 7 and the selector term (weight 1), 2 sequences per micro-batch padded to the longer
  (trainer/topology.py ``assemble``), 4 micro-batches per optimizer step. Random weights and
  tokens made on the GPU, random bf16 taps. Samples/s = samples ÷ time of whole passes over
  the micro-batches (CUDA events), after one untimed pass that compiles every shape.
* ``capture`` — the target side of our split on the same micro-batches: trainer/target.py's
  ``Target`` over a synthetic Qwen3.6-27B (64 layers, random weights made on the GPU) with
  ``--target-precision fp8`` (default) and the fast hybrid forward (trainer/gpu/fast_hybrid.py;
  needs flash-linear-attention), the taps only (the final state only with soft labels, as
  trainer/train.py ``produce`` asks). Prompts/s likewise.
* ``predict`` — the 5 + 3 node from the two rates: min(5 × capture, 3 × trainer), each side's
  time per sample lengthened by the transfer of its tensors (our split sends every
  micro-batch with blocking ``dist.send``/``dist.recv``, trainer/topology.py) over an assumed
  link; beside SpecForge's 10.65 and their own rates through the same rule.

Sample lengths are drawn deterministically: quantile midpoints of a log-normal whose 90th
percentile is 8,192 and whose mean after truncation to 8,192 is 4,500 tokens (the recipe's
corpus: mean 4.5k, 90th percentile at ``max_length`` 8,192), paired by a seeded shuffle.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

GIB = 1024 ** 3

# SpecForge's published figures (docs/research/dflash2-recipe.md: recipe doc @ 2f1961cd / d23761c5)
THEIRS = {"trainer_samples_s": 3.7, "capture_prompts_s": 2.25, "node_5p3_samples_s": 10.65,
          "trainer_step_s": 2.15, "samples_per_step": 8, "servers": 5, "trainers": 3}
GOAL_TRAINER_RATIO = 1.3  # the goal: our rank ≥ 1.3 × their 3.7 samples/s

# Links the transfer is priced over (bytes/s, one direction). NVLink 4 on an HGX H100/H200 board
# is 900 GB/s bidirectional per GPU (NVIDIA's H200 specification), 450 GB/s each way; PCIe 5.0
# x16 is 64 GB/s each way (the seed's RTX PRO 6000 cards have no NVLink). Nominal rates: NCCL's
# point-to-point achieves less, which only matters where the transfer is a visible share.
LINKS = {"nvlink4": 450e9, "pcie5_x16": 64e9}

RECIPE = dict(
    block_size=8, max_anchors=512, max_seq_len=8192, num_draft_layers=5, micro_batch=2, grad_accum=4,
    target_layer_ids=(5, 19, 33, 47, 61), layer_types="sliding,sliding,sliding,sliding,sliding", sliding_window=2048,
    mask_token_id=248070, gamma=7.0, position_weights="decay", use_soft_labels=False, kl_weight=0.15,
    cap_lambda=0.0, selector_loss_weight=1.0, mean_len=4500, p_at_max=0.10, samples=16, seed=0,
)
# --smoke: tiny widths on CPU (trainer/synth/synthetic.py's small-hybrid target)
SMOKE = {**RECIPE, "max_anchors": 16, "max_seq_len": 128, "num_draft_layers": 2, "target_layer_ids": (1, 5),
         "layer_types": "sliding,sliding", "sliding_window": 64, "mask_token_id": 1023, "mean_len": 72,
         "samples": 8}


# ----------------------------------------------------------------------------- lengths (stdlib)
def lognormal_fit(mean_len: float, max_len: int, p_at_max: float) -> tuple[float, float]:
    """(μ, σ) of a log-normal with P(L ≥ max_len) = p_at_max whose mean after truncation to
    max_len is mean_len. Raises ValueError when no σ gives that mean."""
    from statistics import NormalDist

    nd = NormalDist()
    z = nd.inv_cdf(1 - p_at_max)
    lc = math.log(max_len)

    def trunc_mean(s: float) -> float:
        mu = lc - z * s
        return math.exp(mu + s * s / 2) * nd.cdf(z - s) + max_len * p_at_max

    lo, hi = 1e-4, 5.0  # trunc_mean falls from ~max_len as σ grows
    if not trunc_mean(hi) <= mean_len <= trunc_mean(lo):
        raise ValueError(f"mean length {mean_len}: no log-normal with {p_at_max:.0%} at {max_len} has it "
                         f"(possible: {trunc_mean(hi):.0f}..{trunc_mean(lo):.0f})")
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if trunc_mean(mid) > mean_len else (lo, mid)
    s = (lo + hi) / 2
    return lc - z * s, s


def draw_lengths(n: int, mean_len: float, max_len: int, p_at_max: float, min_len: int = 16) -> list[int]:
    """n sample lengths, deterministic: the fitted log-normal's quantiles at (i + ½)/n, truncated
    to max_len, at least min_len."""
    from statistics import NormalDist

    if n < 1:
        raise ValueError(f"samples {n}: need at least 1")
    mu, s = lognormal_fit(mean_len, max_len, p_at_max)
    nd = NormalDist()
    return [max(min_len, min(max_len, round(math.exp(mu + s * nd.inv_cdf((i + 0.5) / n))))) for i in range(n)]


def pair_up(lengths: list[int], micro_batch: int, seed: int) -> list[list[int]]:
    """Sample indices in micro-batches of ``micro_batch``, in a seeded random order (SpecForge's
    loader draws samples at random; nothing groups them by length)."""
    import random

    if len(lengths) % micro_batch:
        raise ValueError(f"samples {len(lengths)}: not a multiple of the micro-batch {micro_batch}")
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    return [order[i:i + micro_batch] for i in range(0, len(order), micro_batch)]


# ----------------------------------------------------------------------------- prediction (stdlib)
def bytes_per_sample(padded_tokens: float, hidden: int, n_tensors: int, real_tokens: float = 0.0,
                     anchors: float = 0.0, dtype_bytes: int = 2) -> float:
    """Bytes one sample costs on the link in our split (trainer/topology.py send_microbatch):
    its hidden-state tensors [padded tokens, hidden] in bf16, plus its int64 ids and loss
    mask (padded), length and anchors/keep."""
    return n_tensors * padded_tokens * hidden * dtype_bytes + 8 * (2 * padded_tokens + 1 + 2 * anchors)


@dataclass
class Prediction:
    """The 5 + 3 node's rate from one capture server's and one trainer rank's rates."""

    samples_s: float  # with the transfer
    without_transfer: float
    bound: str  # "capture" or "trainer": the side that limits
    capture_side: float  # servers ÷ (capture time + transfer) per sample
    trainer_side: float
    transfer_s_per_sample: float
    servers: int
    trainers: int


def predict(capture_prompts_s: float, trainer_samples_s: float, transfer_bytes: float = 0.0,
            link_bytes_s: float = math.inf, servers: int = 5, trainers: int = 3) -> Prediction:
    """min(servers × capture, trainers × trainer), each side's time per sample lengthened by the
    transfer (blocking send on the server, blocking receive on the rank: nothing overlaps it)."""
    if capture_prompts_s <= 0 or trainer_samples_s <= 0 or servers < 1 or trainers < 1:
        raise ValueError("rates must be > 0 and servers, trainers >= 1")
    xfer = transfer_bytes / link_bytes_s
    cap = servers / (1 / capture_prompts_s + xfer)
    tr = trainers / (1 / trainer_samples_s + xfer)
    return Prediction(min(cap, tr), min(servers * capture_prompts_s, trainers * trainer_samples_s),
                      "capture" if cap <= tr else "trainer", cap, tr, xfer, servers, trainers)


# ----------------------------------------------------------------------------- GPU / CPU sections
def _target_text(smoke: bool) -> dict:
    from trainer import family
    from trainer.synth import synthetic

    return synthetic.HYBRID_SHAPES["small-hybrid"] if smoke else family.QWEN3_6_27B_TEXT


def _batches(cfg: dict, text: dict, dev):
    """The micro-batches both sections use: (input_ids, loss_mask, lengths, anchors, keep) on
    ``dev``, built by the trainer's own assemble and anchor rule."""
    import numpy as np
    import torch

    from trainer.loss import key, sample_anchors
    from trainer.topology import assemble

    lengths = draw_lengths(cfg["samples"], cfg["mean_len"], cfg["max_seq_len"], cfg["p_at_max"])
    rng = np.random.default_rng(cfg["seed"])
    samples = [(rng.integers(0, text["vocab_size"] - 2, n), np.ones(n, np.int64)) for n in lengths]
    data = SimpleNamespace(sample=lambda i: samples[i])  # every token a loss token
    out = []
    for ids in pair_up(lengths, cfg["micro_batch"], cfg["seed"]):
        input_ids, loss_mask, lens = assemble(data, ids, cfg["max_seq_len"])
        anchors, keep = sample_anchors(loss_mask, lens, cfg["max_anchors"], [key(cfg["seed"], "anchors", 0, i) for i in ids])
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        out.append((t(input_ids), t(loss_mask), t(lens), t(anchors), t(keep)))
    return lengths, out


def _shape_stats(lengths, batches) -> dict:
    padded = sum(b[0].numel() for b in batches)
    return {"samples": len(lengths), "mean_len": statistics.mean(lengths), "max_len": max(lengths),
            "min_len": min(lengths), "real_tokens": sum(lengths), "padded_tokens": padded,
            "padding_frac": 1 - sum(lengths) / padded, "micro_batches": len(batches),
            "anchors_per_sample": sum(int(b[4].sum()) for b in batches) / len(lengths),
            "distinct_seq_lens": len({b[0].shape[1] for b in batches})}


def _timed_passes(one_pass, passes: int, cuda: bool, deadline: float) -> list[float]:
    """Seconds of each timed pass (CUDA events on a GPU), stopping before a pass that would end
    past ``deadline`` (judged by the last pass)."""
    from bench._timing import timed

    times = []
    for _ in range(passes):
        if times and time.time() + times[-1] > deadline:
            break
        times.append(timed(one_pass, 0, 1, cuda)[0])
    return times


def section_drafter(cfg: dict, smoke: bool, attention_kernel: str, passes: int, deadline: float) -> dict:
    import torch

    from trainer import flags
    from trainer.model import Drafter, DrafterConfig, FrozenHead
    from trainer.step import make_step
    from trainer.topology import MicroBatch
    from trainer.train import compile_stats

    dev = torch.device("cpu" if smoke else "cuda")
    cuda = dev.type == "cuda"
    text = _target_text(smoke)
    dtype = torch.bfloat16 if cuda else torch.float32  # the trainer's: taps and head in bf16 on GPU
    values = {**flags.defaults(), **{k: v for k, v in cfg.items() if k in flags.defaults()},
              "drafter_arch": "dflash2", "drafter_step": "chunked", "attention_kernel": attention_kernel,
              "target_layer_ids": list(cfg["target_layer_ids"])}
    args = SimpleNamespace(**values)
    dcfg = DrafterConfig.from_target(text, cfg["num_draft_layers"], cfg["block_size"], cfg["mask_token_id"],
                                     list(cfg["target_layer_ids"]), layer_types=cfg["layer_types"],
                                     attention="4/2/16" if smoke else None, sliding_window=cfg["sliding_window"],
                                     drafter_arch="dflash2")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    with torch.device(dev):
        drafter = Drafter(dcfg)
    g = torch.Generator(device=dev).manual_seed(1)
    V, H = dcfg.vocab_size, dcfg.hidden_size
    head = FrozenHead(torch.randn(V, H, device=dev, dtype=dtype, generator=g) * 0.02,
                      torch.randn(V, H, device=dev, dtype=dtype, generator=g) * 0.02)
    decayed = {n: p.dim() >= 2 and not n.endswith("base_kernel") for n, p in drafter.named_parameters()}
    opt = torch.optim.AdamW([{"params": [p for n, p in drafter.named_parameters() if decayed[n]], "weight_decay": 0.01},
                             {"params": [p for n, p in drafter.named_parameters() if not decayed[n]], "weight_decay": 0.0}],
                            lr=5e-4, fused=cuda or None)
    step = make_step(args, drafter, head, dcfg)
    lengths, raw = _batches(cfg, text, dev)
    n_taps = len(dcfg.target_layer_ids)
    mbs = []
    for m, (ids, lm, lens, anc, keep) in enumerate(raw):
        b, S = ids.shape
        taps = torch.randn(b, S, n_taps * H, device=dev, dtype=dtype, generator=g)
        final = torch.randn(b, S, H, device=dev, dtype=dtype, generator=g) if args.use_soft_labels else None
        mbs.append(MicroBatch(m, 0, torch.arange(b, device=dev), ids, lm, lens, anc, keep, taps, final))
    accum = cfg["grad_accum"]
    losses = []

    def one_pass():
        for i in range(0, len(mbs), accum):
            for mb in mbs[i:i + accum]:
                stats = step(mb, mb.taps)
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(stats.loss)

    c0 = compile_stats()["compile_s"]
    t0 = time.perf_counter()
    one_pass()  # every micro-batch shape once: the compiles
    if cuda:
        torch.cuda.synchronize()
    first_s, first_compile = time.perf_counter() - t0, compile_stats()["compile_s"] - c0
    first_loss = float(losses[0])
    c1 = compile_stats()["compile_s"]
    times = _timed_passes(one_pass, passes, cuda, deadline)
    timed_compile = compile_stats()["compile_s"] - c1
    t = statistics.median(times)
    rec = {"section": "drafter", "arch": "dflash2", "attention_kernel": attention_kernel, **_shape_stats(lengths, raw),
           "layer_types": dcfg.layer_types, "sliding_window": dcfg.sliding_window, "taps": list(dcfg.target_layer_ids),
           "block": cfg["block_size"], "max_anchors": cfg["max_anchors"], "micro_batch": cfg["micro_batch"],
           "grad_accum": accum, "optimizer_steps_per_pass": len(mbs) // accum, "soft_labels": bool(args.use_soft_labels),
           "params": sum(p.numel() for p in drafter.parameters()), "first_pass_s": first_s,
           "first_pass_compile_s": first_compile, "timed_passes_compile_s": timed_compile, "pass_s": t, "pass_times": times,
           "step_s": t / (len(mbs) // accum), "samples_s": len(lengths) / t, "tokens_s": sum(lengths) / t,
           "vs_theirs": len(lengths) / t / THEIRS["trainer_samples_s"], "loss_first_step": first_loss,
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None}
    rec["goal_met"] = rec["vs_theirs"] >= GOAL_TRAINER_RATIO
    return rec


def section_capture(cfg: dict, smoke: bool, precision: str, passes: int, deadline: float, scratch: str) -> dict:
    import torch

    from trainer import family
    from trainer.synth import synthetic
    from trainer.target import Target
    from trainer.train import compile_stats

    dev = torch.device("cpu" if smoke else "cuda")
    cuda = dev.type == "cuda"
    text = _target_text(smoke)
    tdir = os.path.join(scratch, "target")
    os.makedirs(tdir, exist_ok=True)
    with open(os.path.join(tdir, "config.json"), "w") as fh:
        json.dump(synthetic.hf_config(text), fh)
    with open(os.path.join(tdir, synthetic.MARKER), "w") as fh:
        json.dump({"seed": 0, "shape": "bench"}, fh)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    target = Target(tdir, list(cfg["target_layer_ids"]), dev, torch.bfloat16 if cuda else torch.float32,
                    forward="fast", precision=precision)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    weights_gib = torch.cuda.memory_allocated() / GIB if cuda else None
    lengths, raw = _batches(cfg, text, dev)
    want_final = bool(cfg["use_soft_labels"])
    shapes = []

    def one_pass():
        for ids, *_ in raw:
            taps, final = target.forward(ids, want_final=want_final)
        shapes.append((tuple(taps.shape), None if final is None else tuple(final.shape)))

    c0 = compile_stats()["compile_s"]
    t0 = time.perf_counter()
    one_pass()  # every micro-batch shape once: the compiles (and fla's first launches)
    if cuda:
        torch.cuda.synchronize()
    first_s, first_compile = time.perf_counter() - t0, compile_stats()["compile_s"] - c0
    c1 = compile_stats()["compile_s"]
    times = _timed_passes(one_pass, passes, cuda, deadline)
    timed_compile = compile_stats()["compile_s"] - c1
    t = statistics.median(times)
    n_tensors = len(cfg["target_layer_ids"]) + int(want_final)
    rec = {"section": "capture", "precision": target.fast.precision if target.fast is not None else precision,
           "fast_forward": target.fast is not None, "fla": family.fast_forward_kernels(),
           "layers_run": (text["num_hidden_layers"] if want_final else max(cfg["target_layer_ids"]) + 1),
           "want_final": want_final, "tensors_per_sample": n_tensors, "taps_shape_last": shapes[-1][0],
           **_shape_stats(lengths, raw), "load_s": load_s, "weights_gib": weights_gib, "first_pass_s": first_s,
           "first_pass_compile_s": first_compile, "timed_passes_compile_s": timed_compile,
           "pass_s": t, "pass_times": times, "prompts_s": len(lengths) / t, "tokens_s": sum(lengths) / t,
           "vs_theirs": len(lengths) / t / THEIRS["capture_prompts_s"],
           "peak_alloc_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
           "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None}
    return rec  # the target goes with this frame


def section_predict(runs: dict, hidden: int) -> dict:
    """The 5 + 3 node from the drafter and capture records, per link; their own figures
    through the same rule beside."""
    d, c = runs.get("drafter"), runs.get("capture")
    theirs = predict(THEIRS["capture_prompts_s"], THEIRS["trainer_samples_s"])
    rec = {"section": "predict", "theirs_measured": THEIRS["node_5p3_samples_s"],
           "theirs_by_the_rule": asdict(theirs),
           "theirs_measured_over_rule": THEIRS["node_5p3_samples_s"] / theirs.samples_s}
    if not d or not c or "error" in d or "error" in c:
        rec["error"] = "needs both the drafter and the capture sections' records (run them first)"
        return rec
    per_sample = c["padded_tokens"] / c["samples"]
    xfer = bytes_per_sample(per_sample, hidden, c["tensors_per_sample"], anchors=d["anchors_per_sample"])
    rec["transfer_bytes_per_sample"] = xfer
    rec["links_bytes_s"] = LINKS
    rec["ours"] = {name: asdict(predict(c["prompts_s"], d["samples_s"], xfer, bw)) for name, bw in LINKS.items()}
    head = rec["ours"]["nvlink4"]["samples_s"]
    rec["ours_nvlink4_samples_s"] = head
    rec["vs_theirs"] = head / THEIRS["node_5p3_samples_s"]
    rec["goal_met"] = head > THEIRS["node_5p3_samples_s"]
    return rec


def _write(out: str, results: dict) -> None:
    tmp = os.path.join(out, "results.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    os.replace(tmp, os.path.join(out, "results.json"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--sections", default="drafter,capture,predict")
    p.add_argument("--passes", type=int, default=3, help="timed passes over the micro-batches per section (after one untimed)")
    p.add_argument("--samples", type=int, default=None, help="samples per pass (default 16: 8 micro-batches, 2 optimizer steps)")
    p.add_argument("--target-precision", default="fp8", choices=["bf16", "fp8"])
    p.add_argument("--attention-kernel", default="triton", choices=["triton", "flash"],
                   help="the trainer's --attention-kernel (flash needs flash-attn-4 importable)")
    p.add_argument("--soft-labels", action="store_true",
                   help="our operators' soft labels (the final state captured and sent too) instead of the recipe's hard CE")
    p.add_argument("--deadline-s", type=float, default=230.0,
                   help="start no timed pass that would end later than this many seconds after launch")
    p.add_argument("--smoke", action="store_true", help="tiny widths on CPU: the script's own check, no figures")
    a = p.parse_args(argv)
    start = time.time()
    import torch

    if not a.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    cfg = dict(SMOKE if a.smoke else RECIPE)
    if a.samples:
        cfg["samples"] = a.samples
    cfg["use_soft_labels"] = a.soft_labels
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "results.json")
    results = {"runs": {}}
    if os.path.exists(path):  # a section run alone joins the others' records (predict reads them)
        with open(path) as fh:
            results = json.load(fh)
    results.update({"gpu": torch.cuda.get_device_name(0) if not a.smoke else "cpu", "torch": torch.__version__,
                    "date": time.strftime("%F %T %Z"), "config": cfg, "theirs": THEIRS,
                    "smoke": a.smoke})  # smoke: tiny widths, so every ratio to theirs means nothing
    ok = True
    deadline = start + a.deadline_s
    for name in a.sections.split(","):
        t0 = time.time()
        try:
            if name == "drafter":
                rec = section_drafter(cfg, a.smoke, a.attention_kernel, a.passes, deadline)
            elif name == "capture":
                rec = section_capture(cfg, a.smoke, a.target_precision, a.passes, deadline, os.path.join(a.out, "scratch"))
            elif name == "predict":
                rec = section_predict(results["runs"], _target_text(a.smoke)["hidden_size"])
            else:
                p.error(f"--sections: unknown section {name!r} (drafter, capture, predict)")
        except Exception as exc:  # noqa: BLE001 — recorded; the next section still runs
            import traceback

            rec = {"section": name, "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                   "traceback": traceback.format_exc()[-2000:]}
        rec["wall_s"] = time.time() - t0
        ok = ok and "error" not in rec
        results["runs"][name] = rec
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}, default=str), flush=True)
        _write(a.out, results)
        gc.collect()
        if not a.smoke:
            torch.cuda.empty_cache()
    print(f"total {time.time() - start:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
