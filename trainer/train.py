"""The training loop, top to bottom. One process per GPU (topology.py says who does what);
every side effect — events, heartbeats, checkpoints, wandb, the stop decision — happens
visibly in :func:`train`.

Randomness is keyed, never drawn from per-process streams: data order by (seed, epoch)
(data.make_batches), anchors by (seed, epoch, sample id), noise by (seed, micro-batch
index), drafter init by seed. So split and colocated runs, and straight and resumed runs,
see identical data, anchors and noise.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import sys
import time
import traceback
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from agent.protocol import ENV_RUN_DIR
from trainer import checkpoint as ckpt_io
from trainer import fast_drafter
from trainer.data import PreparedData, make_batches
from trainer.flags import EXIT_OK, EXIT_STOPPED
from trainer.loss import LossConfig, dflash_loss, key, sample_anchors
from trainer.model import Drafter, DrafterConfig, FrozenHead
from trainer.target import Target, read_config, target_identity
from trainer.telemetry import Events, Heartbeat, make_logger
from trainer import topology as topo_mod
from trainer.topology import MicroBatch, assemble, recv_microbatch, send_microbatch

FINAL_LR_RATIO = 0.1  # cosine decays to 10 % of peak (TRAINER_SPEC.md)

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
    """U(-a, a) or N(0, a²) on the tapped target states, from a generator keyed by the
    micro-batch, on the tensor's own device (no host round trip)."""
    if amp <= 0:
        return taps
    g = torch.Generator(device=taps.device)
    g.manual_seed(seed_key)
    if kind == "uniform":
        noise = torch.rand(taps.shape, generator=g, device=taps.device, dtype=taps.dtype).mul_(2).sub_(1)
    else:
        noise = torch.randn(taps.shape, generator=g, device=taps.device, dtype=taps.dtype)
    return taps + noise.mul_(amp)


# --------------------------------------------------------------------------- data


def micro_batch_stream(data: PreparedData, args) -> list[tuple[int, list[int]]]:
    """(epoch, sample ids) for every micro-batch of every epoch, in training order. The last
    --eval-prompts samples are held out for the acceptance-length evaluation."""
    lengths = data.lengths[:len(data) - args.eval_prompts]
    stream = []
    for epoch in range(args.epochs):
        for ids in make_batches(lengths, args.token_budget, args.max_seq_len, args.max_batch_size, args.seed, epoch):
            stream.append((epoch, ids))
    return stream


def produce(target: Target, data: PreparedData, stream, m: int, args, device) -> MicroBatch:
    """Target side of micro-batch m: assemble, choose anchors (keyed), run the target."""
    epoch, ids = stream[m]
    input_ids, loss_mask, lengths = assemble(data, ids, args.max_seq_len)
    keys = [key(args.seed, "anchors", epoch, int(s)) for s in ids]
    anchors, keep = sample_anchors(loss_mask, lengths, args.max_anchors, keys)
    t = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    input_ids_t = t(input_ids)
    taps, final = target.forward(input_ids_t, want_final=args.use_soft_labels)
    return MicroBatch(m, epoch, torch.tensor(ids, dtype=torch.int64, device=device), input_ids_t, t(loss_mask),
                      t(lengths), t(anchors), t(keep), taps, final)


def mem_peak_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build_drafter(args, dcfg: DrafterConfig, target, dev, dtype):
    """The drafter (fp32 master weights, init keyed by --seed), the frozen shared head (the
    target's own tensors when colocated, else read from its safetensors) and AdamW with
    weight decay on matrices only."""
    torch.manual_seed(args.seed)
    drafter = Drafter(dcfg).to(dev)
    head = FrozenHead(target.embed, target.lm_head) if target else FrozenHead.from_target_dir(args.target_model, dev, dtype)
    matrices = [p for p in drafter.parameters() if p.dim() >= 2]
    vectors = [p for p in drafter.parameters() if p.dim() < 2]
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
    os.makedirs(run_dir, exist_ok=True)
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
    os.makedirs(args.output_dir, exist_ok=True)
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
        hb.beat(-1, "failed")
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
    rank's predicted peak against its GPU's free memory (trainer/probe.plan_run: the memory
    model plus allocator reserve and a 2 GiB margin). All ranks agree — the budget is the
    minimum over ranks, a refusal anywhere stops every rank — so nothing trains unless every
    GPU fits. Returns EXIT_USAGE when refused (one line naming GPU, role and shortfall, an
    error event "memory_refused"), else None."""
    if topo.device.type != "cuda":
        return None
    from trainer import probe as plan_mod
    from trainer.flags import EXIT_USAGE

    values = _rank_values(args, topo)
    free = _gpu_free_mib(topo.device)
    # this process already holds its CUDA context: it is out of the free figure
    p = plan_mod.plan_run(values, {topo.gpu: free}, read_config(args.target_model), context_mib=0)
    if p["auto"]:
        mine = int(p["token_budget"]) if not p["refusals"] else 0
        budget = -int(topo_mod.all_reduce_max(topo, -float(mine)))  # the smallest over ranks
        if budget and not p["refusals"]:
            args.token_budget = budget
            p = plan_mod.plan_run({**values, "token_budget": budget}, {topo.gpu: free},
                                  read_config(args.target_model), context_mib=0)
            p["auto"] = True
    row = p["gpus"].get(topo.gpu, {})
    refused = topo_mod.all_reduce_max(topo, 1.0 if p["refusals"] else 0.0) > 0
    if p["auto"] and not refused:
        events.emit("probe", phase="plan", budget=args.token_budget, auto=True, predicted_peak_mib=row.get("peak_mib"),
                    need_mib=row.get("need_mib"), free_mib=round(free, 1), margin_mib=p["margin_mib"],
                    per_rank_budget=p.get("auto_per_gpu", {}).get(topo.gpu))
        if topo.is_log_rank:
            print(f"token budget auto: {args.token_budget} (largest multiple of --max-seq-len whose predicted need "
                  f"+ {p['margin_mib'] / 1024:.0f} GiB margin fits every rank's GPU; GPU {topo.gpu} "
                  f"predicted peak {row.get('peak_mib', 0) / 1024:.1f} GiB)", flush=True)
    for note in p["notes"]:
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
        events.emit("error", error="memory_refused", message=line, gpu_free_mib=round(free, 1),
                    need_mib=row.get("need_mib"), short_mib=row.get("short_mib"), budget=p["token_budget"])
    return EXIT_USAGE


def train(args, topo, run_dir: str, events: Events, hb: Heartbeat) -> int:
    dev = topo.device
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32  # target + shipped states; drafter master weights fp32
    log = topo.is_log_rank
    if log:
        events.emit("phase", phase="loading")

    tcfg = read_config(args.target_model)
    dcfg = DrafterConfig.from_target(tcfg, args.num_draft_layers, args.block_size, args.mask_token_id, args.target_layer_ids)
    data = PreparedData(args.data_dir)
    stream = micro_batch_stream(data, args)
    per_step = args.grad_accum * topo.n_drafter  # micro-batches per optimizer step (topology.py)

    # -- where this run starts: the explicit start decision
    resume = ckpt_io.load(args.resume_from) if args.resume_from else None
    if resume is not None:
        step0, mb0, schedule = resume["step"], resume["data_position"], resume["schedule"]
    else:
        total = args.schedule_steps or len(stream) // per_step
        step0, mb0 = 0, 0
        schedule = {"kind": "warmup_cosine", "total_steps": total, "peak_lr": args.lr,
                    "warmup_steps": int(math.ceil(args.warmup_ratio * total)), "final_ratio": FINAL_LR_RATIO}
    total_steps = step0 + (len(stream) - mb0) // per_step
    last_step = min(total_steps, args.max_steps) if args.max_steps else total_steps

    # -- models: the frozen target on target ranks, the drafter + optimizer on drafter ranks
    target = Target(args.target_model, dcfg.target_layer_ids, dev, dtype, args.target_forward) if topo.is_target else None
    drafter = model = opt = head = None
    if topo.is_drafter:
        drafter, head, opt = build_drafter(args, dcfg, target, dev, dtype)
        if args.init_from:
            drafter.load_state_dict(ckpt_io.init_weights(args.init_from))
        if resume is not None:
            drafter.load_state_dict(resume["model"])
            opt.load_state_dict(resume["optimizer"])
            ckpt_io.set_rng_state(resume["rng"])
        if args.drafter_step == "chunked" or topo.n_drafter == 1:
            model = drafter  # the chunked step averages gradients itself (topology.average_gradients)
            topo_mod.broadcast_parameters(topo, drafter)
        else:
            model = DDP(drafter, process_group=topo.drafter_group, device_ids=[dev] if cuda else None,
                        broadcast_buffers=False)
    lcfg = LossConfig(block_size=args.block_size, gamma=args.gamma, position_weights=args.position_weights,
                      dpace_alpha=args.dpace_alpha, use_soft_labels=args.use_soft_labels, kl_weight=args.kl_weight,
                      kl_temperature=args.kl_temperature, cap_lambda=args.cap_lambda)
    attn_impl = "flex" if cuda else "sdpa"
    chunked = args.drafter_step == "chunked"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
    wandb = make_logger(log, args.wandb_project, args.wandb_run_name, args.wandb_mode, run_dir, vars(args))
    meta = {"config": vars(args), "drafter_config": dcfg.to_hf(), "target": target_identity(args.target_model),
            "data_fingerprint": data.fingerprint, "schedule": schedule,
            "world": {"drafter_ranks": topo.n_drafter, "grad_accum": args.grad_accum}}

    if log:
        events.emit("phase", phase="training")
        print(f"training: {topo.world} rank(s) ({topo.role}), steps {step0}→{last_step} of {total_steps}, "
              f"{per_step} micro-batches/step, schedule {schedule['total_steps']} steps", flush=True)
    hb.beat(step0)
    stopped = False
    step = step0
    ahead: dict[int, MicroBatch] = {}  # target ranks: micro-batches made before their step
    while step < last_step:
        t0 = time.time()
        base = mb0 + (step - step0) * per_step
        # -- target role (split): produce this step's micro-batches and ship them
        if topo.is_target and not topo.colocated:
            for j in range(per_step):
                if topo.producer(base + j) == topo.rank:
                    mb = ahead.pop(base + j, None) or produce(target, data, stream, base + j, args, dev)
                    send_microbatch(mb, topo.consumer(j))
            # This rank's first micro-batch of the next step, made now, while the drafters train
            # on this step's last ones: the step-end agreement below holds every rank until the
            # drafters finish, and without this each step began with the drafters idle for a
            # whole target forward (1.9 s of an 18 s step measured for Qwen3-8B on H200s).
            # Anchors and noise are keyed by sample and micro-batch, so results do not change.
            if step + 1 < last_step:
                nxt = [base + per_step + j for j in range(per_step) if topo.producer(base + per_step + j) == topo.rank]
                if nxt:
                    ahead[nxt[0]] = produce(target, data, stream, nxt[0], args, dev)
        # -- drafter role: forward/backward each micro-batch, then one optimizer step
        if topo.is_drafter:
            mine = [j for j in range(per_step) if topo.consumer(j) == topo.rank]
            amp = noise_amplitude(step, args.noise_start, args.noise_end, schedule["total_steps"])
            K = args.block_size - 1
            sums = torch.zeros(6 + 2 * K, device=dev)  # loss ce kl cap tokens wait | acc·count[K] count[K]
            wait = 0.0  # host-side; metrics stay on the device until a log step (no host syncs in the step)
            for i, j in enumerate(mine):
                tw = time.time()
                mb = produce(target, data, stream, base + j, args, dev) if topo.colocated else recv_microbatch(topo.producer(base + j), dev)
                wait += time.time() - tw
                taps = add_noise(mb.taps, amp, args.noise_type, key(args.seed, "noise", mb.index))
                sums[4] += mb.lengths.sum()
                if chunked:
                    # anchor chunks through the drafter and the head, backward per chunk: bounded
                    # activation memory; casts per chunk itself (no autocast)
                    r = fast_drafter.step_backward(
                        drafter, head.embed, head.lm_head, mb.input_ids, taps, mb.loss_mask, mb.lengths, mb.anchors,
                        mb.keep, block_size=args.block_size, mask_token_id=dcfg.mask_token_id, gamma=args.gamma,
                        position_weights=args.position_weights, dpace_alpha=args.dpace_alpha,
                        kl_weight=args.kl_weight if args.use_soft_labels else 0.0, temperature=args.kl_temperature,
                        cap_lambda=args.cap_lambda, teacher_final=mb.final, loss_scale=1.0 / len(mine), attn=attn_impl,
                        dtype=torch.bfloat16 if cuda else torch.float32)
                    sums[0] += r["loss"] / len(mine)
                    sums[6] += r["correct"]  # all slots together: the chunked step has no per-slot split
                    sums[6 + K] += r["valid"]
                    continue
                sync = nullcontext() if (i == len(mine) - 1 or model is drafter) else model.no_sync()
                with sync:
                    with autocast:
                        blocks = head.embed_blocks(mb.input_ids, mb.anchors, args.block_size, dcfg.mask_token_id)
                        out = model(taps, blocks, mb.anchors, mb.keep, attn_impl)
                        lo = dflash_loss(lcfg, out, head.lm_head, mb.input_ids, mb.loss_mask, mb.lengths,
                                         mb.anchors, mb.keep, mb.final)
                    (lo.loss / len(mine)).backward()
                sums[:4] += torch.stack([lo.loss.detach(), lo.ce, lo.kl, lo.cap]) / len(mine)
                sums[6:6 + K] += lo.acc * lo.acc_count
                sums[6 + K:] += lo.acc_count
            if chunked:
                topo_mod.average_gradients(topo, drafter)
            lr = lr_at(step, schedule["peak_lr"], schedule["total_steps"], schedule["warmup_steps"])
            for group in opt.param_groups:
                group["lr"] = lr
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.grad_clip if args.grad_clip > 0 else float("inf"))
            opt.step()
            opt.zero_grad(set_to_none=True)
        step += 1

        # -- all ranks agree whether to stop after this step (SIGTERM may reach them apart)
        stopped = topo_mod.all_reduce_max(topo, 1.0 if _STOP["requested"] else 0.0) > 0
        finishing = stopped or step == last_step

        # -- log: one step event, one wandb row, one human line
        if topo.is_drafter and (step % args.log_interval == 0 or finishing):
            sums[5] = wait
            topo_mod.drafter_sum(topo, sums)
            s = sums.tolist()
            D = topo.n_drafter
            dt = time.time() - t0
            counts = s[6 + K:]
            acc = [round(a / c, 4) if c else None for a, c in zip(s[6:6 + K], counts)]
            split = (lambda v: None) if chunked else (lambda v: v / D)  # noqa: E731  (chunked: total loss only)
            if chunked:
                acc = acc[:1]  # one accuracy over all slots
            metrics = {"step": step, "total_steps": last_step, "epoch": stream[min(base, len(stream) - 1)][0],
                       "loss": s[0] / D, "ce": split(s[1]), "kl": split(s[2]), "cap": split(s[3]), "lr": lr,
                       "grad_norm": float(grad_norm), "tokens": int(s[4]), "tokens_per_s": s[4] / dt,
                       "drafted_per_s": sum(counts) / dt, "acc": acc, "mem_peak_mib": mem_peak_mib(dev), "wait_s": s[5] / D}
            if log:
                events.emit("step", **metrics)
                wandb.log({k: v for k, v in metrics.items() if k not in ("step", "total_steps")}, step=step)
                terms = "" if chunked else f" ce {metrics['ce']:.4f} kl {metrics['kl']:.4f} cap {metrics['cap']:.4f}"
                print(f"step {step}/{last_step} | loss {metrics['loss']:.4f}{terms} | lr {lr:.2e} | gnorm {metrics['grad_norm']:.3f} | "
                      f"{metrics['tokens_per_s']:.0f} tok/s | acc@1 {acc[0]} | wait {metrics['wait_s']:.2f}s", flush=True)
        hb.beat(step)

        # -- checkpoint (the log rank writes; everyone waits so nobody exits mid-save)
        if step % args.save_interval == 0 or finishing:
            if log:
                events.emit("phase", phase="saving")
                nxt = mb0 + (step - step0) * per_step
                state = {"model": drafter.state_dict(), "optimizer": opt.state_dict(), "data_position": nxt,
                         "epoch": stream[nxt][0] if nxt < len(stream) else args.epochs}
                path = ckpt_io.save(args.output_dir, step, drafter,
                                    {**meta, "data_position": nxt, "epoch": state["epoch"]}, state)
                # older checkpoints go only now that this one is complete (--keep-checkpoints)
                pruned = ckpt_io.prune(args.output_dir, step, args.keep_checkpoints, args.keep_every)
                events.emit("checkpoint", step=step, path=path, pruned=pruned)
                if args.eval_prompts > 0 and target is not None:
                    from trainer.evaluate import EVAL_MAX_NEW, acceptance_length
                    from trainer.export import record_eval

                    events.emit("phase", phase="evaluating")
                    tau = acceptance_length(target, drafter, head, data, args.eval_prompts, dev)
                    record_eval(os.path.dirname(path), block={  # the export's model card shows it
                        "tau": tau, "prompts": args.eval_prompts, "max_new_tokens": EVAL_MAX_NEW, "device": dev.type,
                        "dtype": str(next(drafter.parameters()).dtype).replace("torch.", ""),
                        "by": "trainer/evaluate.py at save"})
                    events.emit("eval", step=step, tau=tau)
                    print(f"eval step {step}: tau {tau:.3f}", flush=True)
                events.emit("phase", phase="training")
            topo_mod.barrier(topo)
        if stopped:
            break

    wandb.finish()
    if stopped and step < last_step:
        if log:
            events.emit("phase", phase="stopping")
        hb.beat(step, "stopped")
        return EXIT_STOPPED
    if log:
        events.emit("phase", phase="done")
    hb.beat(step, "done")
    return EXIT_OK


def probe(args, topo, events: Events, hb: Heartbeat) -> int:
    """--probe-memory: run the worst-case micro-batch on each role's device — the full token
    budget at --max-seq-len, --max-anchors per sequence, soft labels if on — through the
    target forward (target ranks) and two forward + backward + optimizer steps (drafter ranks;
    split ranks use random states of the right shape, nothing is sent). One probe event per
    rank with its peak; nothing is trained or saved."""
    dev = topo.device
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    dcfg = DrafterConfig.from_target(read_config(args.target_model), args.num_draft_layers, args.block_size,
                                     args.mask_token_id, args.target_layer_ids)
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
    target = Target(args.target_model, dcfg.target_layer_ids, dev, dtype, args.target_forward) if topo.is_target else None
    taps = final = None
    if target is not None:
        taps, final = target.forward(ids, want_final=args.use_soft_labels)
    if topo.is_drafter:
        if taps is None:
            taps = torch.randn(b, S, len(dcfg.target_layer_ids) * dcfg.hidden_size, device=dev, dtype=dtype)
            final = torch.randn(b, S, dcfg.hidden_size, device=dev, dtype=dtype) if args.use_soft_labels else None
        drafter, head, opt = build_drafter(args, dcfg, target, dev, dtype)
        lcfg = LossConfig(block_size=args.block_size, gamma=args.gamma, position_weights=args.position_weights,
                          dpace_alpha=args.dpace_alpha, use_soft_labels=args.use_soft_labels, kl_weight=args.kl_weight,
                          kl_temperature=args.kl_temperature, cap_lambda=args.cap_lambda)
        for _ in range(2):  # AdamW creates its state in the first step, after that step's peak
            if args.drafter_step == "chunked":  # the step the run would take, so its peak is the one predicted
                fast_drafter.step_backward(
                    drafter, head.embed, head.lm_head, ids, taps, loss_mask, lengths, anchors, keep,
                    block_size=args.block_size, mask_token_id=dcfg.mask_token_id, gamma=args.gamma,
                    position_weights=args.position_weights, dpace_alpha=args.dpace_alpha,
                    kl_weight=args.kl_weight if args.use_soft_labels else 0.0, temperature=args.kl_temperature,
                    cap_lambda=args.cap_lambda, teacher_final=final, attn="flex" if cuda else "sdpa",
                    dtype=torch.bfloat16 if cuda else torch.float32)
                opt.step()
                opt.zero_grad(set_to_none=True)
                continue
            with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext():
                out = drafter(taps, head.embed_blocks(ids, anchors, args.block_size, dcfg.mask_token_id), anchors, keep,
                              "flex" if cuda else "sdpa")
                lo = dflash_loss(lcfg, out, head.lm_head, ids, loss_mask, lengths, anchors, keep, final)
            lo.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    peak = mem_peak_mib(dev)
    total = torch.cuda.get_device_properties(dev).total_memory / 2**20 if cuda else None
    fits = peak < 0.9 * total if total else True  # 10 % margin for fragmentation and the allocator
    # The memory model's prediction for this rank (CUDA, bf16): exact for the chunked drafter
    # step and the target, a lower bound for the reference drafter step. None on CPU (fp32,
    # and the peak there is the process's RSS).
    predicted = exact = None
    if cuda:
        from trainer import probe as plan_mod

        row = plan_mod.plan_run(_rank_values(args, topo), None, read_config(args.target_model))["gpus"][topo.gpu]
        predicted, exact = row["peak_mib"], row["exact"]
    events.emit("probe", peak_mib=round(peak, 1), total_mib=total, fits=fits, budget=args.token_budget,
                batch=[b, S], anchors=n, drafter_step=args.drafter_step, predicted_peak_mib=predicted,
                predicted_exact=exact)
    pred = "" if predicted is None else (f", predicted {'at least ' if not exact else ''}{predicted:.0f} MiB "
                                         f"({100 * (predicted - peak) / peak:+.1f} %)")
    print(f"probe rank {topo.rank} ({topo.role}, gpu {topo.gpu}): peak {peak:.0f} MiB"
          + (f" of {total:.0f} MiB" if total else "") + pred + f" for {b}×{S} tokens, {n} anchors/seq: "
          + ("fits" if fits else "does NOT fit"), flush=True)
    hb.beat(0, "done")
    topo_mod.barrier(topo)
    return EXIT_OK
