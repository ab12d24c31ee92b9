"""The training loop, top to bottom. One process per GPU (topology.py says who does what);
every side effect — events, heartbeats, checkpoints, wandb, the stop decision — happens
visibly in :func:`train`.

Randomness is keyed, never drawn from per-process streams: data order by (seed, epoch)
(data.make_batches), anchors by (seed, epoch, sample id), noise by (seed, micro-batch
index), drafter init by seed. So split and colocated runs, and straight and resumed runs,
see identical data, anchors and noise.
"""

from __future__ import annotations

import collections
import math
import json
import os
import resource
import signal
import sys
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from agent.protocol import ENV_RUN_DIR, EVENTS
from trainer import checkpoint as ckpt_io
from trainer.gpu import kernel_profile
from trainer import runtime_env
from trainer import topology as topo_mod
from trainer.data import PreparedData, make_batches
from trainer.flags import EXIT_OK, EXIT_STOPPED
from trainer.loss import key, sample_anchors
from trainer.model import Drafter, DrafterConfig, FrozenHead
from trainer.step import StepStats, make_step
from trainer.target import Target, read_config, target_identity
from trainer.telemetry import Events, Heartbeat, make_logger
from trainer.topology import MicroBatch, assemble, recv_microbatch, send_microbatch

FINAL_LR_RATIO = 0.1  # cosine decays to 10 % of peak (docs/trainer-spec.md)
# Set by --probe-first for its probe process (the run goes on after it): the file where the
# probe leaves the token budget it measured, which the training run then takes as given.
ENV_PROBE_FIRST = "DFLASH_PROBE_FIRST"

_STOP = {"requested": False}


def _request_stop(signum, frame):
    # SIGTERM: finish the current step, checkpoint, exit EXIT_STOPPED (agent contract).
    _STOP["requested"] = True


def run_dir_of(args) -> str:
    return args.run_dir or os.environ.get(ENV_RUN_DIR) or args.output_dir


# --------------------------------------------------------------------------- schedule


def lr_at(step: int, peak: float, total: int, warmup: int) -> float:
    """Linear warmup over ``warmup`` steps, then cosine from peak to 10 % of peak at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (FINAL_LR_RATIO + (1 - FINAL_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def noise_amplitude(step: int, start: float, end: float, total: int) -> float:
    return start + (end - start) * min(1.0, step / max(1, total - 1))


def add_noise(taps: torch.Tensor, amp: float, kind: str, seed_key: int) -> torch.Tensor:
    """U(-a, a) or N(0, a²) added in place to the tapped target states (the caller's buffer,
    which nothing reads after the drafter step), from a generator keyed by the micro-batch,
    on the tensor's own device (no host round trip). Drawn one sequence at a time, so the
    noise costs one sequence's buffer, not a second copy of the micro-batch's taps (which
    grows with the token budget: 17 GiB at 450,560 tokens for Qwen3-8B)."""
    if amp <= 0:
        return taps
    g = torch.Generator(device=taps.device)
    g.manual_seed(seed_key)
    draw = torch.rand if kind == "uniform" else torch.randn
    for row in taps:
        noise = draw(row.shape, generator=g, device=taps.device, dtype=taps.dtype)
        if kind == "uniform":
            noise.mul_(2).sub_(1)
        row.add_(noise.mul_(amp))
    return taps


# --------------------------------------------------------------------------- data


def micro_batch_stream(data: PreparedData, args) -> list[tuple[int, list[int]]]:
    """(epoch, sample ids) for every micro-batch of every epoch, in training order. The last
    --eval-prompts samples are held out for the acceptance-length evaluation (PreparedData.held_out)."""
    trained = data.trained(args.eval_prompts)
    lengths = data.lengths[trained]
    stream = []
    for epoch in range(args.epochs):
        for ids in make_batches(lengths, args.token_budget, args.max_seq_len, args.max_batch_size, args.seed, epoch):
            stream.append((epoch, [trained[i] for i in ids]))
    return stream


def produce(target: Target, data: PreparedData, stream, m: int, args, device) -> MicroBatch:
    """Target side of micro-batch m: assemble, choose anchors (keyed), run the target."""
    epoch, ids = stream[m]
    input_ids, loss_mask, lengths = assemble(data, ids, args.max_seq_len)
    keys = [key(args.seed, "anchors", epoch, int(s)) for s in ids]
    anchors, keep = sample_anchors(loss_mask, lengths, args.max_anchors, keys)
    t = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    input_ids_t = t(input_ids)
    with kernel_profile.region(kernel_profile.REGION_TARGET):
        taps, final = target.forward(input_ids_t, want_final=args.use_soft_labels)
    return MicroBatch(m, epoch, torch.tensor(ids, dtype=torch.int64, device=device), input_ids_t, t(loss_mask),
                      t(lengths), t(anchors), t(keep), taps, final)


def mem_peak_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def mem_reserved_mib(device) -> float | None:
    """What the caching allocator has held at most (what an OOM is about); None on CPU."""
    return torch.cuda.max_memory_reserved(device) / 2**20 if device.type == "cuda" else None


def compile_stats() -> dict:
    """torch.compile's work in this process so far: seconds in Dynamo/Inductor compiles and
    the Inductor cache's hits and misses (trainer/runtime_env.py keeps the cache across
    launches). Zero when nothing was compiled (CPU runs compile nothing)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {"compile_s": 0.0, "compile_cache_hits": 0, "compile_cache_misses": 0}
    inductor = utils.counters.get("inductor", {})
    return {"compile_s": round(sum(utils.compilation_time_metrics.get("_compile.compile_inner", [])), 2),
            "compile_cache_hits": int(inductor.get("fxgraph_cache_hit", 0)),
            "compile_cache_misses": int(inductor.get("fxgraph_cache_miss", 0))}


def drafter_config(args) -> DrafterConfig:
    """The drafter these flags build for the target of --target-model."""
    return DrafterConfig.from_target(read_config(args.target_model), args.num_draft_layers, args.block_size,
                                     args.mask_token_id, args.target_layer_ids, target_dir=args.target_model,
                                     layer_types=args.drafter_layer_types, attention=args.drafter_attention,
                                     sliding_window=args.sliding_window, drafter_arch=args.drafter_arch)


def build_drafter(args, dcfg: DrafterConfig, target, dev, dtype):
    """The drafter (fp32 master weights, init keyed by --seed), the frozen shared head (the
    target's own tensors when colocated, else read from its safetensors) and AdamW with
    weight decay on matrices only (DFlash2's convolution base kernels are per-channel gains
    around the identity, like norm weights: not decayed). With --drafter-precision fp8 the drafter's
    GEMMs become torchao's FP8 training linears (trainer/gpu/fp8_train.py) over the same fp32
    parameters."""
    torch.manual_seed(args.seed)
    with torch.device(dev):  # made where it trains: a 27B target's drafter is 1.7 B parameters
        drafter = Drafter(dcfg)
    if getattr(args, "drafter_precision", "bf16") == "fp8":
        # before the optimizer and any compile, and before a checkpoint is loaded into it: the
        # conversion keeps the Parameter objects and their names, so loading is unchanged
        from trainer.gpu import fp8_train

        fp8_train.convert(drafter)
    head = FrozenHead(target.embed, target.lm_head) if target else FrozenHead.from_target_dir(args.target_model, dev, dtype)
    if getattr(args, "target_precision", "bf16") == "fp8" and args.use_soft_labels:
        head.quantize_teacher()  # the teacher's logits in FP8 too, as the target's other GEMMs
    decayed = {n: p.dim() >= 2 and not n.endswith("base_kernel") for n, p in drafter.named_parameters()}
    matrices = [p for n, p in drafter.named_parameters() if decayed[n]]
    vectors = [p for n, p in drafter.named_parameters() if not decayed[n]]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], lr=args.lr, fused=dev.type == "cuda" or None)
    return drafter, head, opt


# --------------------------------------------------------------------------- the run


def run(args, topo) -> int:
    """Set up the run directory's outputs, train, and turn any failure into an error event."""
    signal.signal(signal.SIGTERM, _request_stop)
    if topo.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # CPU runs are tests and demos on shared machines: with several threads, tiny matmuls
        # spin-wait for each other (measured 8 ms per 64-wide linear on a loaded 2-core VM).
        torch.set_num_threads(1)
    run_dir = run_dir_of(args)
    ckpt_io.make_public_dir(run_dir)  # often the output dir itself: readable by a server's user
    events = Events(run_dir, topo.rank, topo.role, topo.gpu)
    hb = Heartbeat(run_dir, topo.rank, topo.role, topo.gpu)
    hb.beat(0, "loading")
    try:
        refused = memory_check(args, topo, events)  # before anything is loaded or written
    except BaseException:
        events.close()
        raise
    if refused is not None:
        hb.beat(0, "failed")
        events.close()
        return refused
    ckpt_io.make_public_dir(args.output_dir)
    if topo.is_log_rank and not args.probe_memory:
        for gone in ckpt_io.sweep_leftovers(args.output_dir, run_dir):
            print(f"python -m trainer: removed {gone['path']} ({gone['bytes'] / 2**20:.1f} MiB), left by an "
                  "interrupted save", flush=True)
    try:
        if args.probe_memory:
            return probe(args, topo, events, hb)
        return train(args, topo, run_dir, events, hb)
    except Exception as exc:
        oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        timeout = "timeout" in str(exc).lower() and "nccl" in (type(exc).__name__ + str(exc)).lower()
        events.emit("error", error="cuda_oom" if oom else ("nccl_timeout" if timeout else "exception"),
                    message=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                    traceback=traceback.format_exc())
        hb.beat(None, "failed")
        raise
    finally:
        events.close()


def _gpu_free_mib(dev) -> float:
    """Free memory of this rank's GPU (its own CUDA context already taken). Tests replace it."""
    return torch.cuda.mem_get_info(dev)[0] / 2**20


def _rank_values(args, topo) -> dict:
    """The flag values with the GPU lists narrowed to this rank's GPU in its role, so
    probe.plan_run checks exactly this rank."""
    g = (topo.gpu,)
    if topo.is_target and topo.is_drafter:
        return {**vars(args), "target_gpus": g, "drafter_gpus": g}
    return {**vars(args), "target_gpus": g if topo.is_target else (), "drafter_gpus": () if topo.is_target else g}


def memory_check(args, topo, events: Events) -> int | None:
    """CUDA only, before any model is loaded: resolve --token-budget auto and check this
    rank's predicted reserved peak against its GPU's free memory (trainer/plan/budget.plan_run:
    the memory model of trainer/plan/memory.py for the allocator this process runs with, and a
    2 GiB margin). All ranks agree — the budget is the minimum over ranks, a refusal
    anywhere stops every rank — so nothing trains unless every GPU fits. Returns EXIT_USAGE
    when refused (one line naming GPU, role and shortfall, an error event
    "memory_refused"; an FP8 target whose scaled matmul does not run on this GPU: "fp8_refused"),
    else None."""
    if topo.device.type != "cuda":
        return None
    from trainer.plan.budget import plan_run
    from trainer.flags import EXIT_USAGE

    values = _rank_values(args, topo)
    free = _gpu_free_mib(topo.device)
    cfg = read_config(args.target_model)
    # this process already holds its CUDA context: it is out of the free figure
    kw = dict(context_mib=0, alloc_conf=os.environ.get(runtime_env.ENV_ALLOC, ""))
    p = plan_run(values, {topo.gpu: free}, cfg, **kw)
    if p["auto"]:
        mine = int(p["token_budget"]) if not p["refusals"] else 0
        budget = -int(topo_mod.all_reduce_max(topo, -float(mine)))  # the smallest over ranks
        if budget and not p["refusals"]:
            reason = p["auto_reason"] if budget == mine else f"{budget}: the smallest of the ranks' choices"
            args.token_budget = budget
            p = plan_run({**values, "token_budget": budget}, {topo.gpu: free}, cfg, **kw)
            p["auto"], p["auto_reason"] = True, reason
    row = p["gpus"].get(topo.gpu, {})
    if topo.is_target and args.target_precision == "fp8":
        from trainer.gpu import fp8

        # the capability allowed it (validate); whether this torch build has the kernel is
        # known only by trying it on the GPU
        why = fp8.runs_here(topo.device)
        if why:
            p["refusals"].append(f"--target-precision fp8 on GPU {topo.gpu}: {why}; use --target-precision bf16")
    if topo.is_drafter and getattr(args, "drafter_precision", "bf16") == "fp8":
        from trainer.gpu import fp8_train

        why = fp8_train.runs_here(topo.device)
        if why:
            p["refusals"].append(f"--drafter-precision fp8 on GPU {topo.gpu}: {why}; use --drafter-precision bf16")
    refused = topo_mod.all_reduce_max(topo, 1.0 if p["refusals"] else 0.0) > 0
    if p["auto"] and not refused:
        events.emit("probe", phase="plan", budget=args.token_budget, auto=True, reason=p["auto_reason"],
                    predicted_peak_mib=row.get("peak_mib"), predicted_reserved_mib=row.get("reserved_mib"),
                    need_mib=row.get("need_mib"), free_mib=round(free, 1), margin_mib=p["margin_mib"],
                    allocator=p["allocator"])
        if topo.is_log_rank:
            print(f"token budget auto: {p['auto_reason']}; GPU {topo.gpu} predicted reserved peak "
                  f"{row.get('reserved_mib', 0) / 1024:.1f} GiB of {free / 1024:.1f} GiB free", flush=True)
    from trainer import family

    for note in p["notes"] + (family.kernel_notes(read_config(args.target_model)) if topo.is_target else []):
        print(f"python -m trainer: note: {note}", flush=True)
    if not refused:
        return None
    if args.probe_memory and args.token_budget != "auto":
        # the probe is how a prediction gets checked: measure anyway (a real OOM is reported)
        for line in p["refusals"]:
            print(f"python -m trainer: warning: predicted not to fit, probing anyway: {line}", file=sys.stderr, flush=True)
        return None
    for line in p["refusals"]:
        print(f"python -m trainer: error: {line}", file=sys.stderr, flush=True)
        events.emit("error", error="fp8_refused" if line.startswith(("--target-precision", "--drafter-precision")) else "memory_refused", message=line, gpu_free_mib=round(free, 1),
                    need_mib=row.get("need_mib"), short_mib=row.get("short_mib"), budget=p["token_budget"])
    return EXIT_USAGE


def load_target(args, dcfg, topo, dtype):
    """The frozen target on a target rank (None elsewhere), in ``--target-precision``
    (resolved; memory_check refused an FP8 target whose scaled matmul does not run here)."""
    if not topo.is_target:
        return None
    precision = getattr(args, "target_precision", "bf16") or "bf16"
    return Target(args.target_model, dcfg.target_layer_ids, topo.device, dtype, args.target_forward, precision=precision)


def run_paths(args, dev):
    """The run's kernels and precisions with their reasons (trainer/paths.py), from this
    process's facts: the GPU's capability, whether flash-attn-4 runs, torch's CUDA build."""
    from trainer import family, paths

    cuda = dev.type == "cuda"
    facts = paths.Facts(cuda=cuda)
    hidden = int(family.text_config(read_config(args.target_model))["hidden_size"])
    if cuda:
        from trainer.layers.flex_mask import flash_missing

        cap = torch.cuda.get_device_capability(dev)
        major = int(str(torch.version.cuda).split(".")[0]) if torch.version.cuda else None
        facts = paths.Facts(cuda=True, capability=(int(cap[0]), int(cap[1])), flash_missing=flash_missing(),
                            cuda_major=major, hidden=hidden)
    else:
        facts = paths.Facts(cuda=False, hidden=hidden)
    return paths.decide(vars(args), facts)


@dataclass
class Start:
    """Where this run starts (the explicit start decision) and where it ends."""

    step: int  # optimizer steps already done
    position: int  # index of the next micro-batch in the stream
    schedule: dict  # the learning-rate schedule, fixed by the run that started from scratch
    last_step: int
    total_steps: int
    resume: dict | None  # the loaded checkpoint of --resume-from


def start_point(args, n_micro: int, per_step: int) -> Start:
    resume = ckpt_io.load(args.resume_from) if args.resume_from else None
    if resume is not None:
        step0, mb0, schedule = resume["step"], resume["data_position"], resume["schedule"]
    else:
        total = args.schedule_steps or n_micro // per_step
        step0, mb0 = 0, 0
        schedule = {"kind": "warmup_cosine", "total_steps": total, "peak_lr": args.lr,
                    "warmup_steps": int(math.ceil(args.warmup_ratio * total)), "final_ratio": FINAL_LR_RATIO}
    total_steps = step0 + (n_micro - mb0) // per_step
    last = min(total_steps, args.max_steps) if args.max_steps else total_steps
    return Start(step0, mb0, schedule, last, total_steps, resume)


def restore(args, start: Start, drafter, opt) -> None:
    """--init-from: the weights; --resume-from: weights, optimizer and RNG state."""
    if args.init_from:
        ckpt_io.load_init_weights(drafter, ckpt_io.init_weights(args.init_from), args.init_from)
    if start.resume is not None:
        drafter.load_state_dict(start.resume["model"])
        opt.load_state_dict(start.resume["optimizer"])
        ckpt_io.set_rng_state(start.resume["rng"])


def ship(target, data, stream, base: int, per_step: int, args, topo, ahead: dict, more: bool) -> None:
    """Target rank of a split run: produce this rank's micro-batches of the step at ``base``
    and send each to its drafter rank; then make its first micro-batch of the next step now,
    while the drafters train on this step's last ones. The step-end agreement holds every
    rank until the drafters finish, and without this each step began with the drafters idle
    for a whole target forward (1.9 s of an 18 s step measured for Qwen3-8B on H200s).
    Anchors and noise are keyed by sample and micro-batch, so results do not change."""
    dev = topo.device
    for j in range(per_step):
        if topo.producer(base + j) == topo.rank:
            mb = ahead.pop(base + j, None) or produce(target, data, stream, base + j, args, dev)
            send_microbatch(mb, topo.consumer(j))
            del mb  # the send keeps its buffers until it completes (trainer/plan/memory.py: two resident)
    nxt = [base + per_step + j for j in range(per_step) if topo.producer(base + per_step + j) == topo.rank]
    if more and nxt:
        ahead[nxt[0]] = produce(target, data, stream, nxt[0], args, dev)


def optimizer_step(opt, drafter, step: int, schedule: dict, grad_clip: float):
    """Learning rate of ``step``, global-norm clip, AdamW step; returns (lr, grad norm)."""
    lr = lr_at(step, schedule["peak_lr"], schedule["total_steps"], schedule["warmup_steps"])
    for group in opt.param_groups:
        group["lr"] = lr
    with kernel_profile.region(kernel_profile.REGION_OPTIMIZER):
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), grad_clip if grad_clip > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return lr, grad_norm


def step_line(m: dict) -> str:
    sel = f" sel {m['sel']:.4f}" if "sel" in m else ""
    acc = f"acc@1 {m['acc'][0]}" + (f" sel@1 {m['sel_acc'][0]} recall {m['recall']}" if "sel_acc" in m else "")
    return (f"step {m['step']}/{m['total_steps']} | loss {m['loss']:.4f} ce {m['ce']:.4f} kl {m['kl']:.4f} "
            f"cap {m['cap']:.4f}{sel} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | {m['tokens_per_s']:.0f} tok/s | "
            f"{acc} | wait {m['wait_s']:.2f}s")


def save_checkpoint(args, events, step: int, position: int, stream, drafter, opt, meta: dict) -> str:
    epoch = stream[position][0] if position < len(stream) else args.epochs
    state = {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "data_position": position, "epoch": epoch}
    path = ckpt_io.save(args.output_dir, step, drafter, {**meta, "data_position": position, "epoch": epoch}, state)
    # older checkpoints go only now that this one is complete (--keep-checkpoints)
    pruned = ckpt_io.prune(args.output_dir, step, args.keep_checkpoints, args.keep_every)
    events.emit("checkpoint", step=step, path=path, pruned=pruned)
    return path


def served_check_due(args, step: int, finishing: bool) -> bool:
    """Is this save due a served check (--served-check-every K)? Every K-th save by step, so a
    resumed run keeps the same rhythm, and the last one."""
    every = args.served_check_every
    return every > 0 and (step % (every * args.save_interval) == 0 or finishing)


class ServedRows:
    """The served checks' records (``served_check`` events the served-check job appends to this
    run's events.jsonl) as wandb rows, each once, one per logged step in the order they ended,
    with ``eval/served_step`` naming the checkpoint it measured (wandb's step only grows). One
    per step because wandb merges the rows logged at one step: two checks that ended between
    two logs became one row with the later one's keys over the earlier one's, so a check that
    served nothing showed the earlier check's served τ."""

    def __init__(self, path: str):
        self.path = path
        self.offset = os.path.getsize(path) if os.path.exists(path) else 0
        self.pending: collections.deque[dict] = collections.deque()

    def next(self) -> dict | None:
        """The oldest row not yet logged, after reading what the file gained; None if none."""
        from agent.protocol import read_json_lines

        for self.offset, rec in read_json_lines(self.path, self.offset):
            if rec.get("kind") == "served_check" and isinstance(rec.get("step"), int):
                self.pending.append({
                    "eval/served_step": rec["step"], "eval/served_ok": int(bool(rec.get("ok"))),
                    **({"eval/served_tau": rec["tau_served"]} if rec.get("tau_served") is not None else {}),
                    **({"eval/served_tau_at_save": rec["tau_at_save"]} if rec.get("tau_at_save") is not None else {})})
        return self.pending.popleft() if self.pending else None


def evaluate_at_save(args, events, wandb, step: int, path: str, target, drafter, head, data, dev) -> dict:
    """τ of the checkpoint just saved on the held-out prompts (per category where the data
    knows each sample's source): into its eval.json (the model card) and its meta.json, the
    ``best`` checkpoint moved when it beats it (retention keeps that one), an eval event and a
    wandb row. τ, not the loss, is what selects: it is what serving buys."""
    from trainer.drafter_dir import record_eval
    from trainer.serve.evaluate import EVAL_MAX_NEW, evaluate

    got = evaluate(target, drafter, head, data, args.eval_prompts, dev)
    rec = {"tau": got["tau"], "prompts": args.eval_prompts, "max_new_tokens": EVAL_MAX_NEW, "device": dev.type,
           "dtype": str(next(drafter.parameters()).dtype).replace("torch.", ""),
           "by": "trainer/serve/evaluate.py at save", **({"by_category": got["by_category"]} if got["by_category"] else {})}
    step_path = os.path.dirname(path)
    record_eval(step_path, block=rec)  # the export's model card shows it
    best = ckpt_io.record_tau(step_path, rec)
    events.emit("eval", step=step, tau=got["tau"], by_category=got["by_category"], best_step=best["step"],
                best_tau=best["tau"])
    wandb.log({"eval/tau": got["tau"], "eval/best_tau": best["tau"], "eval/best_step": best["step"],
               **{f"eval/tau_{k}": v for k, v in got["by_category"].items()}}, step=step)
    cats = "".join(f", {k} {v:.3f}" for k, v in got["by_category"].items())
    print(f"eval step {step}: tau {got['tau']:.3f}{cats} (best: step {best['step']}, tau {best['tau']:.3f})", flush=True)
    return rec


def train(args, topo, run_dir: str, events: Events, hb: Heartbeat) -> int:
    dev, log = topo.device, topo.is_log_rank
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # target + shipped states; drafter weights fp32
    if log:
        events.emit("phase", phase="loading")
    dcfg = drafter_config(args)
    data = PreparedData(args.data_dir)
    stream = micro_batch_stream(data, args)
    per_step = args.grad_accum * topo.n_drafter  # micro-batches per optimizer step (topology.py)
    start = start_point(args, len(stream), per_step)

    # -- models: the frozen target on target ranks; the drafter, its step and AdamW on drafter ranks
    target = load_target(args, dcfg, topo, dtype)
    drafter = head = opt = drafter_step = None
    if topo.is_drafter:
        drafter, head, opt = build_drafter(args, dcfg, target, dev, dtype)
        restore(args, start, drafter, opt)
        topo_mod.broadcast_parameters(topo, drafter)
        drafter_step = make_step(args, drafter, head, dcfg)
    wandb = make_logger(log, args.wandb_project, args.wandb_run_name, args.wandb_mode, run_dir, vars(args))
    served_rows = ServedRows(os.path.join(run_dir, EVENTS))
    meta = {"config": vars(args), "drafter_config": dcfg.to_hf(), "target": target_identity(args.target_model),
            "data_fingerprint": data.fingerprint, "schedule": start.schedule,
            "world": {"drafter_ranks": topo.n_drafter, "grad_accum": args.grad_accum}}
    if log:
        chosen = run_paths(args, dev)
        for line in chosen.lines():
            print(f"python -m trainer: {line}", flush=True)
        events.emit("phase", phase="training", paths=chosen.event())
        print(f"training: {topo.world} rank(s) ({topo.role}), steps {start.step}→{start.last_step} of "
              f"{start.total_steps}, {per_step} micro-batches/step, schedule {start.schedule['total_steps']} steps",
              flush=True)
    hb.beat(start.step)
    step, stopped, ahead = start.step, False, {}
    while step < start.last_step:
        t0 = time.time()
        # DFLASH_PROFILE_STEP=N: this step's kernels by class (trainer/gpu/kernel_profile.py)
        with kernel_profile.maybe_profile(step + 1) if dev.type == "cuda" else nullcontext():
            base = start.position + (step - start.step) * per_step
            # -- target role (split): make this step's micro-batches and ship them
            if topo.is_target and not topo.colocated:
                ship(target, data, stream, base, per_step, args, topo, ahead, more=step + 1 < start.last_step)
            # -- drafter role: the step on each micro-batch, gradients averaged over ranks, one optimizer step
            if topo.is_drafter:
                amp = noise_amplitude(step, args.noise_start, args.noise_end, start.schedule["total_steps"])
                stats = StepStats.zero(args.block_size, dev, selector=drafter.selector is not None)
                for j in topo.consumed_here(per_step):
                    tw = time.time()
                    mb = produce(target, data, stream, base + j, args, dev) if topo.colocated else recv_microbatch(topo.producer(base + j), dev)
                    stats.wait_s += time.time() - tw
                    stats += drafter_step(mb, add_noise(mb.taps, amp, args.noise_type, key(args.seed, "noise", mb.index)))
                    # its taps and final state go before the next micro-batch's are made: held
                    # over, they sat beside the next target forward (trainer/plan/memory.py counts one)
                    del mb
                topo_mod.average_gradients(topo, drafter)
                lr, grad_norm = optimizer_step(opt, drafter, step, start.schedule, args.grad_clip)
        step += 1

        # -- all ranks agree whether to stop after this step (SIGTERM may reach them apart)
        stopped = topo_mod.all_reduce_max(topo, 1.0 if _STOP["requested"] else 0.0) > 0
        finishing = stopped or step == start.last_step

        # -- log: one step event, one wandb row, one human line
        if topo.is_drafter and (step % args.log_interval == 0 or finishing):
            metrics = {"step": step, "total_steps": start.last_step, "epoch": stream[min(base, len(stream) - 1)][0],
                       **stats.reduce(topo).to_metrics(time.time() - t0), "lr": lr, "grad_norm": float(grad_norm),
                       "mem_peak_mib": mem_peak_mib(dev), "mem_reserved_mib": mem_reserved_mib(dev),
                       **compile_stats()}  # compile_s: cumulative, so the first step event holds the launch's compiles
            if step == start.step + 1:  # what this launch runs with (trainer/runtime_env.py)
                metrics["compile_cache"] = os.environ.get(runtime_env.ENV_INDUCTOR)
                metrics["alloc_conf"] = os.environ.get(runtime_env.ENV_ALLOC)
            if log:
                events.emit("step", **metrics)
                wandb.log({k: v for k, v in metrics.items() if k not in ("step", "total_steps")}, step=step)
                served = served_rows.next()  # a served check that ended since (agent/servedcheck.py)
                if served:
                    wandb.log(served, step=step)
                print(step_line(metrics), flush=True)
                if "compile_cache" in metrics:
                    print(f"compile: {metrics['compile_s']:.1f} s in the first step ({metrics['compile_cache_hits']} "
                          f"cache hits, {metrics['compile_cache_misses']} misses; cache {metrics['compile_cache']})",
                          flush=True)
                    if os.environ.get("DFLASH_COMPILE_REPORT") == "1":  # where the seconds went, per function
                        print(torch._dynamo.utils.compile_times(repr="str"), flush=True)
        hb.beat(step)

        # -- checkpoint and evaluation (the log rank; everyone waits so nobody exits mid-save)
        if step % args.save_interval == 0 or finishing:
            if log:
                events.emit("phase", phase="saving")
                path = save_checkpoint(args, events, step, start.position + (step - start.step) * per_step, stream,
                                       drafter, opt, meta)
                if args.eval_prompts > 0 and target is not None:
                    events.emit("phase", phase="evaluating")
                    evaluate_at_save(args, events, wandb, step, path, target, drafter, head, data, dev)
                    if served_check_due(args, step, finishing):  # the agent starts it; we never wait for it
                        events.emit("served_check_due", step=step, checkpoint=os.path.dirname(path),
                                    gpu=args.served_check_gpu, threads=args.served_check_threads,
                                    vllm_python=args.vllm_python)
                events.emit("phase", phase="training")
            topo_mod.barrier(topo)
        if stopped:
            break

    wandb.finish()
    if stopped and step < start.last_step:
        if log:
            events.emit("phase", phase="stopping")
        hb.beat(step, "stopped")
        return EXIT_STOPPED
    if log:
        events.emit("phase", phase="done")
    hb.beat(step, "done")
    return EXIT_OK


def _probe_capacity_mib(args, dev) -> float | None:
    """What the probe's measured need must fit: --probe-capacity-mib, else the GPU's free
    memory now (this process's context already out of it); None on CPU without the flag."""
    if args.probe_capacity_mib is not None:
        return float(args.probe_capacity_mib)
    return _gpu_free_mib(dev) if dev.type == "cuda" else None


def probe(args, topo, events: Events, hb: Heartbeat) -> int:
    """--probe-memory: this run's worst case, measured. Every rank builds what training
    builds (target, drafter, AdamW) and runs two optimizer steps — AdamW's state exists only
    from the first one's end, so the second is the steady state the model predicts — of
    full-length sequences at the resolved --token-budget with --max-anchors each, the way
    train() runs them: colocated ranks the target forward then the drafter step; split
    drafter ranks random states of the received shape; split target ranks two micro-batches
    resident, as while one is still being sent. One probe event per rank (allocated and
    reserved peaks beside the prediction); exit 2 on every rank when any rank's reserved
    peak + margin exceeds its capacity (budget.probe_refusal), else 0. Nothing is trained
    or saved."""
    from trainer.plan.budget import MARGIN_MIB, largest_fitting_batch, plan_run, probe_refusal
    from trainer.flags import EXIT_USAGE

    dev = topo.device
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    capacity = _probe_capacity_mib(args, dev)
    dcfg = drafter_config(args)
    b, S = max(1, min(args.max_batch_size, args.token_budget // args.max_seq_len)), args.max_seq_len
    n = min(args.max_anchors, S - 1)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, dcfg.mask_token_id, (b, S), generator=g).to(dev)
    loss_mask = torch.ones(b, S, dtype=torch.int64, device=dev)
    lengths = torch.full((b,), S, dtype=torch.int64, device=dev)
    anchors = torch.linspace(0, S - 2, n).long().expand(b, n).contiguous().to(dev)
    keep = torch.ones(b, n, dtype=torch.bool, device=dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    target = load_target(args, dcfg, topo, dtype)
    drafter = head = opt = drafter_step = None
    if topo.is_drafter:
        drafter, head, opt = build_drafter(args, dcfg, target, dev, dtype)
        drafter_step = make_step(args, drafter, head, dcfg)  # the step the run would take
    schedule = {"peak_lr": args.lr, "total_steps": 2, "warmup_steps": 0}
    F = len(dcfg.target_layer_ids) * dcfg.hidden_size
    held = None  # split target: the micro-batch still being sent while the next is made
    for step in range(2):
        if target is not None:
            taps, final = target.forward(ids, want_final=args.use_soft_labels)
        else:
            taps = torch.randn(b, S, F, device=dev, dtype=dtype)
            final = torch.randn(b, S, dcfg.hidden_size, device=dev, dtype=dtype) if args.use_soft_labels else None
        if drafter is None:
            held = (taps, final)
            continue
        mb = MicroBatch(step, 0, torch.arange(b, device=dev), ids, loss_mask, lengths, anchors, keep, taps, final)
        del taps, final
        amp = max(args.noise_start, args.noise_end)
        drafter_step(mb, add_noise(mb.taps, amp, args.noise_type, key(args.seed, "noise", step)))
        del mb
        topo_mod.average_gradients(topo, drafter)
        optimizer_step(opt, drafter, step, schedule, args.grad_clip)
    if cuda:
        torch.cuda.synchronize(dev)
    del held
    peak = mem_peak_mib(dev)
    reserved = mem_reserved_mib(dev)
    measured = reserved if cuda else peak  # CPU: the process's peak RSS
    values = _rank_values(args, topo)
    cfg = read_config(args.target_model)
    predicted = reserved_pred = exact = None
    alloc_conf = os.environ.get(runtime_env.ENV_ALLOC, "")
    if cuda:  # the memory model describes the CUDA paths (bf16; none on CPU)
        row = plan_run(values, None, cfg, alloc_conf=alloc_conf)["gpus"][topo.gpu]
        predicted, reserved_pred, exact = row["peak_mib"], row["reserved_mib"], row["exact"]
    fits_b = 0
    if capacity is not None and cuda:
        role = {"both": "colocated"}.get(topo.role, topo.role)
        fits_b = largest_fitting_batch(values, cfg, role, capacity * 2**20, context_mib=0, alloc_conf=alloc_conf)
    verdict = probe_refusal(topo.gpu, {"both": "colocated"}.get(topo.role, topo.role), measured, capacity,
                            fits_budget=fits_b * S if fits_b else None)
    refused = topo_mod.all_reduce_max(topo, 1.0 if verdict["line"] else 0.0) > 0
    events.emit("probe", peak_mib=round(peak, 1), reserved_mib=None if reserved is None else round(reserved, 1),
                capacity_mib=capacity, need_mib=verdict["need_mib"], short_mib=verdict["short_mib"],
                fits=verdict["line"] is None, budget=args.token_budget, batch=[b, S], anchors=n, steps=2,
                drafter_step=args.drafter_step, predicted_peak_mib=predicted, predicted_reserved_mib=reserved_pred,
                predicted_exact=exact, margin_mib=MARGIN_MIB)
    pred = "" if reserved_pred is None else (
        f", predicted {'at least ' if not exact else ''}{reserved_pred:.0f} MiB reserved "
        f"({100 * (reserved_pred - reserved) / reserved:+.1f} %)")
    what = f"reserved {reserved:.0f} MiB (allocated {peak:.0f})" if cuda else f"peak RSS {peak:.0f} MiB"
    verdict_text = ("fits" if verdict["line"] is None else "does NOT fit") if capacity is not None else "not checked"
    print(f"probe rank {topo.rank} ({topo.role}, gpu {topo.gpu}): two optimizer steps of {b}×{S} tokens, {n} anchors/seq: "
          f"{what}{pred}; needs {verdict['need_mib']:.0f} MiB with the margin"
          + (f" of {capacity:.0f} MiB: {verdict_text}" if capacity is not None else ": not checked (no capacity)"),
          flush=True)
    if verdict["line"]:
        print(f"python -m trainer: error: {verdict['line']}", file=sys.stderr, flush=True)
        events.emit("error", error="memory_refused", message=verdict["line"], phase="probe",
                    need_mib=verdict["need_mib"], short_mib=verdict["short_mib"], budget=args.token_budget)
    answer = os.environ.get(ENV_PROBE_FIRST)
    if answer and not refused and topo.is_log_rank:
        tmp = f"{answer}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"token_budget": int(args.token_budget)}, fh)
        os.replace(tmp, answer)
    hb.beat(0, "failed" if refused else ("loading" if answer else "done"))
    topo_mod.barrier(topo)
    return EXIT_USAGE if refused else EXIT_OK
