"""One GPU call: what the caching allocator holds against what
trainer/plan/memory.py predicts, --token-budget auto against the operators' 49,152, and the
compile cache across a relaunch.

    PYTHONUNBUFFERED=1 python3 bench/memory_model/campaign.py run --out $OUT          # one H200
    python3 bench/memory_model/campaign.py run --out /tmp/o --cpu                     # the same plumbing on CPU
    python3 bench/memory_model/campaign.py summary RESULTS_DIR                        # the table, from raw files
    # cut to the two launches that hold the model (≈ 160 s on an H200): 49,152 and auto, 3 steps each
    PYTHONUNBUFFERED=1 python3 bench/memory_model/campaign.py run --out $OUT --phases cold49k,auto --steps 3 \
        --no-sweep --deadline-s 280

``run`` makes a synthetic Qwen3-8B target and random full-length data (``python -m trainer
synthetic``), then runs ``python -m trainer`` itself, colocated on GPU 0 with the operators'
objective flags (soft labels, KL 0.15 at T 2, CAP 0.1, noise 0.05 → 0.01, block 32, 1,024
anchors, 5 layers; --grad-accum 1 so that 20 steps fit the call):

  cold49k   --token-budget 49152, an empty compile cache: the cold compile
  warm49k   the same config relaunched on the cache cold49k filled: the relaunch's compile
            and the 49,152 budget's tokens/s
  auto      --token-budget auto, 21 steps: no OOM, its reserved peak, its tokens/s
  probe     --probe-memory --token-budget auto: two optimizer steps of the worst case, measured
  sweep     one process, the trainer's own pieces: a split drafter rank and a split target
            rank at 49,152 and 131,072 tokens, colocated at 196,608 (per-phase peaks)

Each launch is killed (SIGKILL) once it has logged its steps, so no checkpoint is written.
nvidia-smi is sampled every 0.5 s throughout. Everything lands in a work folder whose
``out/`` is packed into ``$OUT/results.tgz`` after every phase (the device tool returns at
most 8 files), and ``summary`` prints the table from it anywhere, with the model's
predictions computed then — so a model change can be checked against the same measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from bench import _layout  # noqa: E402
_layout.ensure()  # the trainer's module names, also in a base tree from before they moved

OPS = ["--epochs", "6", "--lr", "6e-4", "--warmup-ratio", "0.04", "--weight-decay", "0.01", "--grad-accum", "1",
       "--grad-clip", "1.0", "--max-batch-size", "64", "--gamma", "10.0", "--noise-start", "0.05",
       "--noise-end", "0.01", "--noise-type", "uniform", "--use-soft-labels", "--kl-weight", "0.15",
       "--kl-temperature", "2.0", "--cap-lambda", "0.1", "--save-interval", "100000", "--log-interval", "1",
       "--target-gpus", "0", "--drafter-gpus", "0", "--from-scratch"]
SCALES = {
    # shape, samples, max len, block, anchors, layers, device; phases (name, budget, steps, timeout s);
    # sweep points (role, budget, steps)
    "gpu": dict(shape="qwen3-8b", samples=256, L=8192, block=32, anchors=1024, layers=5, device="cuda",
                phases=[("cold49k", "49152", 3, 210), ("warm49k", "49152", 7, 150), ("auto", "auto", 21, 270),
                        ("probe", "auto", 0, 120)],
                sweep=[("drafter", 49152, 2), ("drafter", 131072, 1), ("target", 49152, 2), ("target", 131072, 2),
                       ("colocated", 196608, 2)]),
    # the seed's Qwen3.6-27B shape colocated (bench/colocated/run.py --scale gpu27; needs
    # flash-linear-attention on the device, carried as wheels)
    "gpu27": dict(shape="qwen3.6-27b", samples=128, L=8192, block=32, anchors=1024, layers=5, device="cuda",
                  phases=[], sweep=[]),
    "cpu": dict(shape="small", samples=48, L=128, block=8, anchors=16, layers=2, device="cpu",
                phases=[("cold49k", "256", 2, 240), ("warm49k", "256", 3, 240), ("auto", "512", 4, 240),
                        ("probe", "512", 0, 240)],
                sweep=[("drafter", 256, 2), ("drafter", 512, 1), ("target", 256, 2), ("target", 512, 2),
                       ("colocated", 512, 2)]),
}


def trainer_flags(sc: dict, data: str) -> list[str]:
    return [*OPS, "--target-model", f"{data}/target", "--data-dir", f"{data}/data", "--device", sc["device"],
            "--max-seq-len", str(sc["L"]), "--block-size", str(sc["block"]), "--max-anchors", str(sc["anchors"]),
            "--num-draft-layers", str(sc["layers"]), *sc.get("extra", ())]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_events(path: str) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    except OSError:
        pass
    return out


def launch(name: str, argv: list[str], steps: int, timeout: float, work: str, out: str) -> dict:
    """python -m trainer until it has logged ``steps`` step events (then SIGKILL: no save;
    0: until it exits), it exits, or ``timeout``; returns when it started and its exit."""
    run_dir = os.path.join(work, name, "run")
    os.makedirs(run_dir, exist_ok=True)
    events = os.path.join(run_dir, "events.jsonl")
    cmd = [sys.executable, "-m", "trainer", *argv, "--output-dir", os.path.join(work, name, "output"),
           "--run-dir", run_dir]
    rec = {"name": name, "argv": cmd[3:], "t_start": time.time(), "steps_wanted": steps}
    with open(os.path.join(out, f"{name}.log"), "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        while proc.poll() is None:
            n = sum(1 for e in read_events(events) if e.get("kind") == "step")
            if (steps and n >= steps) or time.time() - rec["t_start"] > timeout:
                rec["killed_after_steps"] = n
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.5)
    rec["rc"] = proc.returncode
    rec["t_end"] = time.time()
    shutil.copy(events, os.path.join(out, f"{name}-events.jsonl")) if os.path.exists(events) else None
    with open(os.path.join(out, f"{name}.json"), "w") as fh:
        json.dump(rec, fh, indent=1)
    steps_seen = [e for e in read_events(events) if e.get("kind") == "step"]
    log(f"{name}: rc {rec['rc']}, {len(steps_seen)} steps in {rec['t_end'] - rec['t_start']:.0f} s"
        + (f", first step compile {steps_seen[0].get('compile_s')} s" if steps_seen else ""))
    return rec


def pack(work_out: str, final: str) -> None:
    tmp = os.path.join(final, "results.tgz.part")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(work_out, arcname="out")
    os.replace(tmp, os.path.join(final, "results.tgz"))


def scale_of(a) -> dict:
    """The scale's plan, cut to ``--phases`` (their own step counts unless ``--steps``) and
    without the sweep under ``--no-sweep``."""
    sc = dict(SCALES["cpu" if a.cpu else "gpu"])
    if a.phases:
        names = a.phases.split(",")
        unknown = set(names) - {p[0] for p in sc["phases"]}
        if unknown:
            raise SystemExit(f"--phases: unknown {', '.join(sorted(unknown))}; choose from "
                             + ", ".join(p[0] for p in sc["phases"]))
        sc["phases"] = [p for p in sc["phases"] if p[0] in names]
    if a.steps:
        sc["phases"] = [(n, b, a.steps if steps else 0, t) for n, b, steps, t in sc["phases"]]
    if a.no_sweep:
        sc["sweep"] = []
    return sc


def cmd_run(a) -> int:
    sc = scale_of(a)
    t0 = time.time()
    final = os.path.abspath(a.out)
    work = os.path.abspath(a.work)
    shutil.rmtree(work, ignore_errors=True)
    out = os.path.join(work, "out")
    os.makedirs(out)
    os.makedirs(final, exist_ok=True)
    os.environ["DFLASH_COMPILE_CACHE"] = os.path.join(work, "compile-cache")  # as the start script sets it
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    smi = None
    if not a.cpu:
        with open(os.path.join(out, "gpu.txt"), "w") as fh:
            subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,power.limit,driver_version",
                            "--format=csv"], stdout=fh, stderr=subprocess.STDOUT)
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,memory.used", "--format=csv,noheader,nounits",
                                "-lms", "500"], stdout=open(os.path.join(out, "smi.csv"), "w"),
                               stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "meta.json"), "w") as fh:
        json.dump({"scale": "cpu" if a.cpu else "gpu", "phases": [p[0] for p in sc["phases"]], "t0": t0,
                   "host": os.uname().nodename}, fh)
    try:
        data = os.path.join(work, "synthetic")
        log("synthetic target and data")
        subprocess.run([sys.executable, "-m", "trainer", "synthetic", "--shape", sc["shape"], "--out", data,
                        "--samples", str(sc["samples"]), "--max-len", str(sc["L"])], cwd=ROOT, check=True)
        flags_ = trainer_flags(sc, data)
        for name, budget, steps, timeout in sc["phases"]:
            left = a.deadline_s - (time.time() - t0)
            extra = ["--probe-memory"] if name == "probe" else []
            rec = launch(name, [*flags_, "--token-budget", budget, *extra], steps, min(timeout, left - 40), work, out)
            pack(out, final)
            ev = read_events(os.path.join(out, f"{name}-events.jsonl"))
            if steps and not any(e.get("kind") == "step" for e in ev):
                log(f"{name} logged no step (rc {rec['rc']}): the rest would fail the same way; stopping")
                print(open(os.path.join(out, f"{name}.log")).read()[-4000:])
                return 1
        left = a.deadline_s - (time.time() - t0) - 25
        if sc["sweep"] and left > 30:
            log(f"sweep ({left:.0f} s left)")
            with open(os.path.join(out, "sweep.log"), "w") as fh:
                try:
                    subprocess.run([sys.executable, os.path.abspath(__file__), "sweep", "--data", data, "--out", out,
                                    "--scale", "cpu" if a.cpu else "gpu"], cwd=ROOT, stdout=fh,
                                   stderr=subprocess.STDOUT, timeout=left)
                except subprocess.TimeoutExpired:
                    log("sweep: timed out")
    finally:
        if smi is not None:
            smi.terminate()
        with open(os.path.join(out, "summary.txt"), "w") as fh:
            fh.write(summary(out))
        pack(out, final)
        shutil.copy(os.path.join(out, "summary.txt"), os.path.join(final, "summary.txt"))
    print(open(os.path.join(out, "summary.txt")).read())
    log(f"done in {time.time() - t0:.0f} s")
    return 0


# ------------------------------------------------------------------ the sweep (one process)
def cmd_sweep(a) -> int:
    """Split drafter, split target and colocated points through the trainer's own pieces
    (train.build_drafter, Target, the chunked step, add_noise, optimizer_step), as
    train.probe runs them; per point the allocated and reserved peaks, per phase."""
    from trainer import runtime_env

    runtime_env.apply()
    import torch

    from trainer import flags, train
    from trainer.step import make_step
    from trainer.target import Target
    from trainer.topology import MicroBatch

    sc = SCALES[a.scale]
    cuda = sc["device"] == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    L = sc["L"]
    args = flags.parse_args([*trainer_flags(sc, a.data), "--token-budget", str(L), "--output-dir", "/nonexistent"])
    args.drafter_step = flags.drafter_step_for(vars(args), cuda)
    args.target_forward = flags.target_forward_for(vars(args), cuda)
    dcfg = train.drafter_config(args)
    F = len(dcfg.target_layer_ids) * dcfg.hidden_size
    results = []

    def stats():
        if not cuda:
            return {"alloc": train.mem_peak_mib(dev), "reserved": None}
        s = torch.cuda.memory_stats(dev)
        return {"alloc": s["allocated_bytes.all.peak"] / 2**20, "reserved": s["reserved_bytes.all.peak"] / 2**20,
                "retries": s.get("num_alloc_retries", 0)}

    def fresh():
        import gc

        gc.collect()
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)

    def inputs(b):
        g = torch.Generator().manual_seed(0)
        n = min(args.max_anchors, L - 1)
        return (torch.randint(0, dcfg.mask_token_id, (b, L), generator=g).to(dev),
                torch.ones(b, L, dtype=torch.int64, device=dev), torch.full((b,), L, dtype=torch.int64, device=dev),
                torch.linspace(0, L - 2, n).long().expand(b, n).contiguous().to(dev),
                torch.ones(b, n, dtype=torch.bool, device=dev))

    def record(role, budget, steps, t0, phases):
        r = {"role": role, "budget": budget, "steps": steps, "t0": t0, "t1": time.time(), "phases": phases,
             **stats()}
        results.append(r)
        log(f"sweep {role} {budget}: " + json.dumps({k: (round(v) if isinstance(v, float) else v)
                                                    for k, v in r.items() if k not in ("t0", "t1")}))
        with open(os.path.join(a.out, "sweep.json"), "w") as fh:
            json.dump(results, fh, indent=1)

    def drafter_steps(drafter_step, opt, drafter, ids, lm, lens, anc, keep, target, steps, phases):
        schedule = {"peak_lr": args.lr, "total_steps": steps, "warmup_steps": 0}
        b = ids.shape[0]
        for k in range(steps):
            if target is not None:
                taps, final = target.forward(ids, want_final=args.use_soft_labels)
                phases.append(("target", stats()["alloc"]))
            else:
                taps = torch.randn(b, L, F, device=dev, dtype=dtype)
                final = torch.randn(b, L, dcfg.hidden_size, device=dev, dtype=dtype)
            mb = MicroBatch(k, 0, torch.arange(b, device=dev), ids, lm, lens, anc, keep, taps, final)
            del taps, final
            drafter_step(mb, train.add_noise(mb.taps, 0.05, "uniform", k))
            del mb
            phases.append(("drafter", stats()["alloc"]))
            train.optimizer_step(opt, drafter, k, schedule, args.grad_clip)
            phases.append(("optimizer", stats()["alloc"]))

    by_role = {}
    for role, budget, steps in sc["sweep"]:
        by_role.setdefault(role, []).append((budget, steps))

    def drafter_points(role, target):
        """A drafter (split: its own head, random states of the received shape; colocated:
        the target's head and forward) through every budget of ``role``."""
        fresh()
        drafter, head, opt = train.build_drafter(args, dcfg, target, dev, dtype)
        step = make_step(args, drafter, head, dcfg)
        for budget, steps in by_role[role]:
            fresh()
            t0 = time.time()
            phases = []
            drafter_steps(step, opt, drafter, *inputs(budget // L), target, steps, phases)
            record(role, budget, steps, t0, phases)

    if "drafter" in by_role:
        drafter_points("drafter", None)
    target = None
    if "target" in by_role or "colocated" in by_role:
        fresh()
        target = Target(args.target_model, dcfg.target_layer_ids, dev, dtype, args.target_forward)
    for budget, steps in by_role.get("target", []):
        fresh()
        t0 = time.time()
        ids = inputs(budget // L)[0]
        held, phases = None, []
        for _ in range(steps):  # the last one held while the next is made, as while it is sent
            out = target.forward(ids, want_final=args.use_soft_labels)
            held = out
            del out
            phases.append(("target", stats()["alloc"]))
        del held
        record("target", budget, steps, t0, phases)
    if "colocated" in by_role:
        drafter_points("colocated", target)
    return 0


# ------------------------------------------------------------------ the table
def _smi_max(out: str, t0: float, t1: float) -> float | None:
    """Largest nvidia-smi memory.used (MiB) sampled between t0 and t1 (host clock)."""
    from datetime import datetime

    best = None
    try:
        with open(os.path.join(out, "smi.csv")) as fh:
            for line in fh:
                parts = [p.strip() for p in line.split(",")]
                if len(parts) < 2:
                    continue
                try:
                    ts = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    used = float(parts[1])
                except ValueError:
                    continue
                if t0 <= ts <= t1:
                    best = used if best is None else max(best, used)
    except OSError:
        return None
    return best


def _values(sc: dict, budget, role: str) -> dict:
    from trainer import flags

    v = flags.defaults()
    args = flags.parse_args([*trainer_flags(sc, "/x"), "--token-budget", str(budget), "--output-dir", "/x"])
    v.update(vars(args))
    v["target_gpus"], v["drafter_gpus"] = {"colocated": ((0,), (0,)), "drafter": ((1,), (0,)),
                                           "target": ((0,), (1,))}[role]
    v["drafter_step"], v["target_forward"] = "chunked", "fast"
    return v


LEAK = {"on": False}  # summary --leaky-build: the data came from the build before the chunked step's leak fix


def leak_bytes_of(spec) -> int:
    """What the chunked step of the builds before its fix (P2 merge to 6fcfb8f, 2026-12-01)
    also held at its peak, for one GPU of ``spec`` (a trainer.memory.RunSpec): the context
    k/v leaves' gradients of every earlier anchor chunk of the micro-batch, 2 × layers ×
    [1, nkv, S, hd] bf16 each (bench/memory_model/trace.py). Zero on a target rank."""
    if spec.role == "target":
        return 0
    chunks = spec.batch * -(-min(spec.max_anchors, spec.seq_len - 1) // spec.chunk_anchors)
    return (chunks - 1) * 2 * spec.n_draft_layers * spec.seq_len * spec.dshape.kv_dim * 2


def noisy_copy_bytes(spec) -> int:
    """What ``python -m trainer`` of the builds before the memory fixes also held during the drafter
    step: the noisy copy of the micro-batch's taps beside the taps (the noise is added in
    place since)."""
    return 0 if spec.role == "target" else spec.tokens * spec.taps_count * spec.target.hidden * 2


def as_measured_build(p, *, noisy_copy: bool = False):
    """The prediction ``p`` (trainer.memory.Prediction) for such an older build: its drafter
    phases (the anchor chunks and the context backward, during which both were alive) hold
    the leak, and with ``noisy_copy`` the copy, besides; reserved follows from the allocator
    as for any prediction."""
    from trainer.plan import memory as mm

    extra = leak_bytes_of(p.spec) + (noisy_copy_bytes(p.spec) if noisy_copy else 0)
    phases = {k: v + (extra if k in ("chunk", "ctx_bwd") else 0) for k, v in p.phases.items()}
    return mm.Prediction(p.spec, {**p.terms, "older_build": extra}, phases, p.persistent)


def _pred(sc: dict, budget: int, role: str) -> dict:
    from trainer.plan import budget as B
    from trainer.synth.synthetic import HYBRID_SHAPES, SHAPES, hf_config

    cfg = hf_config({**SHAPES, **HYBRID_SHAPES}[sc["shape"]])
    p = B.predictions(_values(sc, budget, role), cfg, budget, "expandable_segments:True")[role]
    if LEAK["on"]:
        p = as_measured_build(p)
    return {"alloc": p.allocated / 2**20, "reserved": p.reserved / 2**20, "phase": p.peak_phase}


def _err(pred, meas):
    return f"{100 * (pred - meas) / meas:+.1f} %" if pred and meas else "—"


def summary(out: str) -> str:
    meta = json.load(open(os.path.join(out, "meta.json")))
    sc = {**SCALES[meta["scale"]], "extra": meta.get("extra", [])}  # the launches' own flags: the prediction's too
    lines = [f"scale {meta['scale']}; predictions: trainer/plan/memory.py of this checkout (expandable segments)"
             + ("; + the measured build's chunked-step leak (memory_campaign.leak_bytes)" if LEAK["on"] else ""), "",
             "launch | budget | steps | first-step compile s | first step s | time to first step s | median tok/s "
             "(steps 2+) | allocated peak MiB (pred, err) | reserved peak MiB (pred, err) | nvidia-smi MiB (pred) | rc"]
    for name in meta.get("phases") or [p[0] for p in sc["phases"]]:
        try:
            rec = json.load(open(os.path.join(out, f"{name}.json")))
        except OSError:
            lines.append(f"{name} | not run")
            continue
        ev = read_events(os.path.join(out, f"{name}-events.jsonl"))
        steps = [e for e in ev if e.get("kind") == "step"]
        plan = next((e for e in ev if e.get("kind") == "probe" and e.get("phase") == "plan"), None)
        errors = [e.get("message", "")[:160] for e in ev if e.get("kind") == "error"]
        probes = [e for e in ev if e.get("kind") == "probe" and "peak_mib" in e]
        if probes:
            for e in probes:
                p = _pred(sc, int(e["budget"]), "colocated") if sc["device"] == "cuda" else None
                pa, pr = (p["alloc"], p["reserved"]) if p else (None, None)
                lines.append(f"{name} (--probe-memory) | {e['budget']} | 2 optimizer steps | allocated {e['peak_mib']:,.0f}"
                             f" (pred {pa or 0:,.0f}, {_err(pa, e['peak_mib'])}) | reserved {e.get('reserved_mib')} "
                             f"(pred {pr or 0:,.0f}, {_err(pr, e.get('reserved_mib'))}) | need {e['need_mib']:,.0f} of "
                             f"{e.get('capacity_mib')} MiB | fits {e['fits']} | rc {rec['rc']}")
            if plan is not None:
                lines.append(f"  auto: {plan.get('reason')}")
            continue
        if not steps:
            lines.append(f"{name} | no step | rc {rec['rc']} | {'; '.join(errors)}")
            continue
        budget = int(steps[0]["tokens"]) if plan is None else int(plan["budget"])
        tok = [e["tokens_per_s"] for e in steps[1:]]
        p = _pred(sc, budget, "colocated") if sc["device"] == "cuda" else None
        first = steps[0]
        t_first = first["ts"] - rec["t_start"]
        prev_ts = next((e["ts"] for e in ev if e.get("kind") == "phase" and e.get("phase") == "training"), None)
        alloc, res = steps[-1].get("mem_peak_mib"), steps[-1].get("mem_reserved_mib")
        smi = _smi_max(out, steps[0]["ts"], steps[-1]["ts"] + 1) if len(steps) > 1 else None
        tok_s = f"{statistics.median(tok):,.0f} (min {min(tok):,.0f}, max {max(tok):,.0f})" if tok else "—"
        row = [name, str(budget), str(len(steps)), str(first.get("compile_s")),
               f"{first['ts'] - prev_ts:.1f}" if prev_ts else "—", f"{t_first:.1f}", tok_s]
        if p and res:
            row += [f"{alloc:,.0f} ({p['alloc']:,.0f}, {_err(p['alloc'], alloc)})",
                    f"{res:,.0f} ({p['reserved']:,.0f}, {_err(p['reserved'], res)})",
                    f"{smi if smi is not None else '—'} ({p['reserved'] + 768:,.0f})"]
        else:
            row += [f"{alloc:,.0f}", "—", "—"]
        lines.append(" | ".join(row + [str(rec["rc"])]))
        if plan is not None:
            lines.append(f"  auto: {plan.get('reason')}")
        if errors:
            lines.append(f"  errors: {'; '.join(errors)}")
    lines += ["", "sweep role | budget | steps | allocated MiB (pred, err) | reserved MiB (pred, err) | "
                  "nvidia-smi MiB | alloc retries | phase peaks MiB"]
    try:
        sweep = json.load(open(os.path.join(out, "sweep.json")))
    except OSError:
        sweep = []
    for r in sweep:
        p = _pred(sc, r["budget"], r["role"]) if sc["device"] == "cuda" else None
        ph = ", ".join(f"{k} {v:,.0f}" for k, v in r["phases"])
        if p and r.get("reserved"):
            lines.append(f"{r['role']} | {r['budget']} | {r['steps']} | {r['alloc']:,.0f} ({p['alloc']:,.0f}, "
                         f"{_err(p['alloc'], r['alloc'])}; {p['phase']}) | {r['reserved']:,.0f} ({p['reserved']:,.0f}, "
                         f"{_err(p['reserved'], r['reserved'])}) | {_smi_max(out, r['t0'], r['t1'])} | "
                         f"{r.get('retries')} | {ph}")
        else:
            lines.append(f"{r['role']} | {r['budget']} | {r['steps']} | {r['alloc']:,.0f} | — | — | — | {ph}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="memory_campaign.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "memory-campaign"))
    r.add_argument("--cpu", action="store_true", help="the plumbing at a tiny shape on CPU")
    r.add_argument("--deadline-s", type=float, default=540)
    r.add_argument("--phases", help="comma list of the scale's launches to run (default: all), e.g. cold49k,auto")
    r.add_argument("--steps", type=int, help="steps per launch instead of each phase's own (the probe keeps its two)")
    r.add_argument("--no-sweep", action="store_true", help="leave out the one-process sweep")
    s = sub.add_parser("sweep")
    s.add_argument("--data", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--scale", default="gpu")
    m = sub.add_parser("summary")
    m.add_argument("dir")
    m.add_argument("--leaky-build", action="store_true",
                   help="the data came from the build before the chunked step's leak fix: add what it held")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        return cmd_run(a)
    if a.cmd == "sweep":
        return cmd_sweep(a)
    LEAK["on"] = a.leaky_build
    print(summary(a.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
