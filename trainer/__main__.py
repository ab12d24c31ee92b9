"""``python -m trainer``: train a DFlash drafter; ``prepare``, ``regenerate``, ``tiny``, ``synthetic``, ``export``, ``served-check``, ``served-check-job`` and ``flags``
subcommands.

Bad input (flags, paths, an incompatible checkpoint, a missing start decision) is refused
before anything is created: one line per problem on stderr, exit code 2 (EXIT_USAGE).

Started without torchrun's environment (no RANK) and needing more than one process, the
trainer re-launches itself under ``python -m torch.distributed.run`` (static rendezvous on
127.0.0.1 and a free port, never a name: trainer/topology.py) and stays as a thin parent: it
forwards SIGTERM to its own worker processes and exits EXIT_STOPPED when every rank stopped
after its checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import sys
import time

from trainer import flags, multinode

PROG = "python -m trainer"


def validate(args) -> list[str]:
    """Every reason this run cannot start, one line each; touches nothing on disk."""
    problems = flags.check(vars(args))
    if args.probe_capacity_mib is not None and not args.probe_capacity_mib > 0:
        problems.append(f"--probe-capacity-mib {args.probe_capacity_mib:g}: give the memory to check against in MiB, "
                        "a positive number (e.g. 91000 for a 96 GB GPU)")
    cuda = args.device == "cuda" or (args.device == "auto" and _cuda_available())
    # auto paths are fixed here, once, so every later reader (memory check, probe, events) sees one value
    args.drafter_step = flags.drafter_step_for(vars(args), cuda)
    target_cfg = None
    if args.target_model and os.path.isfile(os.path.join(args.target_model, "config.json")):
        try:
            with open(os.path.join(args.target_model, "config.json")) as fh:
                target_cfg = json.load(fh)
        except (OSError, ValueError):
            target_cfg = None  # refused below with the reason
    from trainer import paths

    # what was asked, before auto is resolved: the run's first lines give the reasons (trainer/paths.py)
    setattr(args, paths.REQUESTED, paths.requested(vars(args)))
    args.target_forward = flags.target_forward_for(vars(args), cuda, target_cfg)
    if args.target_precision in ("fp8", "auto"):
        capability = paths.gpu_capability() if cuda else None
        missing = flags.fp8_missing(cuda, capability)
        # an unknown capability (no NVML here) is left to the GPU itself: the memory check tries
        # the scaled matmul there (train.memory_check) and refuses it with the reason if it fails
        if args.target_precision == "fp8" and cuda and missing and not isinstance(capability, str):
            problems.append(f"--target-precision fp8: {missing}; use --target-precision bf16 (or auto: fp8 only "
                            "where it runs)")
        args.target_precision = flags.target_precision_for(vars(args), cuda, capability, _hidden(target_cfg))[0]
    if getattr(args, "drafter_precision", "bf16") == "fp8":
        problems += drafter_fp8_problems(cuda)
    if args.attention_kernel in ("auto", "flash"):
        from trainer.layers.flex_mask import flash_missing

        missing = flash_missing() if cuda else "this run is on CPU"
        if args.attention_kernel == "flash" and missing:
            problems.append(f"--attention-kernel flash: {missing}; install flash-attn-4 into the container's venv "
                            "(ctl env install flash-attn-4) on a Hopper or newer GPU, or use --attention-kernel triton")
        args.attention_kernel = flags.attention_kernel_for(vars(args), cuda, missing)
    if args.token_budget == "auto":
        # Resolved on the GPUs themselves (train.memory_check), from the memory model of the
        # chunked drafter step. CPU: refused rather than guessed — host RAM is shared with
        # whatever else runs there, and the model describes neither fp32 nor the dense CPU mask.
        if not cuda:
            problems.append("--token-budget auto fits the budget to free GPU memory, and this run is on CPU: "
                            f"give a number, e.g. --token-budget {4 * args.max_seq_len}")
        elif args.drafter_step != "chunked":
            problems.append("--token-budget auto needs --drafter-step chunked: the memory model (trainer/plan/memory.py) "
                            "describes the chunked drafter step only; give a number, e.g. --token-budget 49152")
    if args.target_model and not os.path.isfile(os.path.join(args.target_model, "config.json")):
        problems.append(f"--target-model {args.target_model}: no config.json there; "
                        "point it at a local Hugging Face model directory")
    if args.data_dir and not os.path.isfile(os.path.join(args.data_dir, "meta.json")):
        problems.append(f"--data-dir {args.data_dir}: no meta.json there; prepare the data with "
                        f"`{PROG} prepare --input FILE.jsonl --out {args.data_dir}`")
    if args.device == "cuda" or (args.device == "auto" and _cuda_available()):
        n = _cuda_count()
        if n == 0:
            problems.append("--device cuda: no CUDA device is visible; use --device cpu or check the driver")
        bad = sorted(g for g in set(args.target_gpus or ()) | set(args.drafter_gpus or ()) if g >= n)
        if n and bad:
            problems.append(f"GPU {','.join(map(str, bad))} named in --target-gpus/--drafter-gpus does not exist "
                            f"(this machine shows {n} GPU(s): 0..{n - 1})")
    if problems:
        return problems
    # -- the start decision's checkpoint must fit this target, block size and (resume) data
    from trainer import checkpoint as ckpt_io
    from trainer import family
    from trainer.target import target_identity
    from trainer.train import drafter_config

    try:
        why = family.unsupported(family.read_config(args.target_model))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        why = f"config.json is unreadable ({exc})"
    if why:
        return [f"--target-model {args.target_model}: {why}"]
    try:
        dcfg = drafter_config(args)
    except ValueError as exc:  # a drafter flag that does not fit (it names itself), or the target's RoPE
        return [str(exc) if str(exc).startswith("--") else f"--target-model {args.target_model}: {exc}"]
    L = dcfg.num_target_layers
    if any(not 0 <= i < L for i in dcfg.target_layer_ids):
        problems.append(f"--target-layer-ids {','.join(map(str, dcfg.target_layer_ids))}: the target has layers 0..{L - 1}")
    if not 0 <= dcfg.mask_token_id < dcfg.vocab_size:
        problems.append(f"--mask-token-id {dcfg.mask_token_id} is outside the target's vocabulary 0..{dcfg.vocab_size - 1}")
    # -- the data must open and give at least one optimizer step
    from trainer.data import DataError, PreparedData, make_batches

    try:
        data = PreparedData(args.data_dir)
    except DataError as exc:
        problems.append(f"--data-dir {args.data_dir}: {exc}")
    else:
        if args.eval_prompts >= len(data):
            problems.append(f"--eval-prompts {args.eval_prompts} holds out every sample of --data-dir ({len(data)}); "
                            "hold out fewer")
            return problems
        n_drafter = len(args.drafter_gpus)
        if multinode.is_job(vars(args)):
            n_drafter = multinode.totals(vars(args))[1]  # every container's drafter ranks
        per_step = args.grad_accum * n_drafter
        # auto is resolved later, on the GPUs; it is at least one --max-seq-len sequence
        budget = args.max_seq_len if args.token_budget == "auto" else args.token_budget
        per_epoch = len(make_batches(data.lengths[data.trained(args.eval_prompts)], budget, args.max_seq_len,
                                     args.max_batch_size, args.seed, 0))
        if per_epoch * args.epochs < per_step:
            problems.append(f"--data-dir {args.data_dir}: {per_epoch} micro-batches per epoch × --epochs {args.epochs} "
                            f"is less than one optimizer step (--grad-accum {args.grad_accum} × {n_drafter} "
                            "drafter ranks); add data or epochs, or lower --grad-accum or --token-budget")
    for flag, path in (("--resume-from", args.resume_from), ("--init-from", args.init_from)):
        if not path:
            continue
        try:
            meta = ckpt_io.read_meta(path) if flag == "--resume-from" else ckpt_io.read_init_meta(path)
        except ValueError as exc:
            problems.append(f"{flag} {path}: {exc}")
            continue
        meta["path"] = path
        fingerprint = None
        if flag == "--resume-from":
            with open(os.path.join(args.data_dir, "meta.json")) as fh:
                fingerprint = json.load(fh).get("fingerprint")
            held = (meta.get("config") or {}).get("eval_prompts", 0)
            if held != args.eval_prompts:
                problems.append(f"--resume-from {path}: the run held out {held} samples for evaluation, this one "
                                f"--eval-prompts {args.eval_prompts}; that changes the data order — use --eval-prompts {held}")
        problems += ckpt_io.compatibility_problems(
            meta, block_size=args.block_size, num_draft_layers=args.num_draft_layers,
            target=target_identity(args.target_model), target_layer_ids=dcfg.target_layer_ids, flag=flag,
            data_fingerprint=fingerprint, drafter=dcfg.to_hf())
    return problems


def drafter_fp8_problems(cuda: bool) -> list[str]:
    """Why --drafter-precision fp8 cannot run here: a GPU without FP8 tensor cores (the same rule
    as the target's), or torchao missing (the command that installs it). An unknown capability
    is left to the GPU itself (train.memory_check tries one FP8 training GEMM there)."""
    from trainer import paths
    from trainer.gpu import fp8_train

    problems = []
    capability = paths.gpu_capability() if cuda else None
    no_fp8 = flags.fp8_missing(cuda, capability)
    if cuda and no_fp8 and not isinstance(capability, str):
        problems.append(f"--drafter-precision fp8: {no_fp8}; use --drafter-precision bf16")
    why = fp8_train.missing()
    if why:
        problems.append(f"--drafter-precision fp8: {why}; install it: {fp8_train.INSTALL} (torchao 0.18 needs torch "
                        "2.11 or newer), or use --drafter-precision bf16")
    return problems


def _hidden(target_cfg) -> int | None:
    from trainer import family

    try:
        return int(family.text_config(target_cfg)["hidden_size"]) if target_cfg else None
    except (KeyError, TypeError, ValueError):
        return None  # refused below with the reason


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _flags_main(argv: list[str]) -> int:
    usage = f"usage: {PROG} flags --markdown\n\nPrint docs/flags.md, generated from the flag table (trainer/flags.py)."
    if argv in (["-h"], ["--help"]):
        print(usage)
        return flags.EXIT_OK
    if argv != ["--markdown"]:
        print(f"{PROG} flags: {usage.splitlines()[0]}", file=sys.stderr)
        return flags.EXIT_USAGE
    sys.stdout.write(flags.markdown())
    return flags.EXIT_OK


def _subcommand(module: str):
    def run(argv: list[str]) -> int:
        import importlib

        return importlib.import_module(module).main(argv)
    return run


# ``python -m trainer <name> …``; anything else is a training run. Imported on use, so
# `python -m trainer --help` pays for none of them.
SUBCOMMANDS = {
    "prepare": _subcommand("trainer.chat.prepare"),
    "regenerate": _subcommand("trainer.regen.job"),
    "tiny": _subcommand("trainer.synth.tiny"),
    "synthetic": _subcommand("trainer.synth.synthetic"),
    "export": _subcommand("trainer.serve.export"),
    "served-check": _subcommand("trainer.serve.served"),
    "served-check-job": _subcommand("trainer.serve.served_job"),
    "flags": _flags_main,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])

    # exits EXIT_USAGE with one line on a parse error
    args = flags.parse_args(argv, epilog=f"other commands: {', '.join(SUBCOMMANDS)} (`{PROG} NAME --help`)")
    # before anything imports torch: the allocator reads its configuration when CUDA starts,
    # and the compile cache's place must be known before the first compile
    from trainer import runtime_env

    runtime_env.apply()
    problems = validate(args)
    if problems:
        for p in problems:
            print(f"{PROG}: error: {p}", file=sys.stderr)
        return flags.EXIT_USAGE
    if args.probe_first and not args.probe_memory and "RANK" not in os.environ:
        rc, argv = probe_first(argv, args)
        if rc != flags.EXIT_OK:
            return rc

    from trainer.topology import world_size_for

    job = multinode.is_job(vars(args))
    world = multinode.world_size(vars(args)) if job else world_size_for(args.target_gpus, args.drafter_gpus)
    if job and "RANK" not in os.environ:
        # A job's containers always meet through torchrun's rendezvous, even with one local rank.
        return relaunch(argv, multinode.local_nproc(vars(args)), args, multinode.torchrun_args(vars(args)))
    if world > 1 and "RANK" not in os.environ:
        return relaunch(argv, world, args)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) != world:
        print(f"{PROG}: error: started with WORLD_SIZE {os.environ['WORLD_SIZE']} but --target-gpus/--drafter-gpus "
              f"need {world} processes; start with --nproc-per-node {world} or without torchrun", file=sys.stderr)
        return flags.EXIT_USAGE

    import torch

    from trainer import topology
    from trainer.train import run

    device_type = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    if job:
        topo = multinode.init(args, device_type)
    else:
        topo = topology.init(args.target_gpus, args.drafter_gpus, device_type, args.dist_timeout)
    try:
        return run(args, topo)
    finally:
        topology.shutdown(topo)


def probe_first(argv: list[str], args) -> tuple[int, list[str]]:
    """--probe-first: run this command's --probe-memory (its own process, so what it held is
    given back before training loads) and, when it fits, return the argv to train with —
    --token-budget auto replaced by the budget the probe measured, so the run trains exactly
    what was probed: the probe decides ``auto`` and leaves its answer in a file, the run takes
    it as given and decides nothing again. (exit code, argv)."""
    from trainer.train import ENV_PROBE_FIRST

    argv = [a for a in argv if a != "--probe-first"]
    print(f"{PROG}: --probe-first: measuring this run's worst case for two optimizer steps before training", flush=True)
    with tempfile.TemporaryDirectory(prefix="dflash-probe-") as tmp:
        answer = os.path.join(tmp, "answer.json")
        rc = subprocess.run([sys.executable, "-m", "trainer", *argv, "--probe-memory"],
                            env={**os.environ, ENV_PROBE_FIRST: answer}).returncode
        decided = _read_answer(answer) if rc == flags.EXIT_OK else None
    if rc != flags.EXIT_OK:
        print(f"{PROG}: error: --probe-first: the memory probe exited {rc}"
              + (" (it does not fit: see the line above)" if rc == flags.EXIT_USAGE else "") + "; not training",
              file=sys.stderr, flush=True)
        return rc, argv
    if args.token_budget == "auto" and decided is not None:
        argv = _with_budget(argv, decided)
    return flags.EXIT_OK, argv


def _read_answer(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return int(json.load(fh)["token_budget"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # a probe on CPU decides nothing: the run keeps its own flags


def _with_budget(argv: list[str], budget: int) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--token-budget":
            skip = True
        elif not a.startswith("--token-budget="):
            out.append(a)
    return out + ["--token-budget", str(budget)]


def relaunch(argv: list[str], world: int, args, launcher: list[str] | None = None) -> int:
    """Run ``world`` workers under torchrun (static rendezvous on 127.0.0.1 and a free port:
    trainer/topology.py) and wait. For a job across containers, ``launcher`` holds torchrun's
    multi-node arguments (trainer/multinode.py) and ``world`` is this container's share of
    the ranks. First a ``launch`` event names the ranks and the rendezvous, so the agent can
    say which ranks never started (agent/observe.py: the start-up deadline).

    torchrun runs in its own session, so a signal meant for this trainer does not make
    torchrun's agent tear the workers down mid-save; on SIGTERM we signal our workers
    (the pids in their heartbeats, checked to be torchrun's children) and they stop together
    after a checkpoint."""
    from trainer import topology
    from trainer.telemetry import Events
    from trainer.train import run_dir_of
    from agent.protocol import ENV_RUN_ID, HEARTBEAT_DIR

    run_id = os.environ.get(ENV_RUN_ID) or "dflash"
    launcher = launcher or topology.torchrun_args(world, run_id)
    job = multinode.is_job(vars(args))
    plan = topology.rank_plan(args.target_gpus, args.drafter_gpus, multinode.rank_base(vars(args)) if job else 0)
    run_dir = run_dir_of(args)
    from trainer.drafter_dir import make_public_dir

    make_public_dir(run_dir)  # often the output dir itself: readable by a server's user
    events = Events(run_dir, None, "launcher", None)
    events.emit("launch", rdzv_endpoint=launcher[launcher.index("--rdzv-endpoint") + 1], nproc=world,
                device="cuda" if args.device == "cuda" or (args.device == "auto" and _cuda_available()) else "cpu",
                ranks=plan)
    events.close()
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "trainer", *argv]
    print(f"{PROG}: starting {world} rank{'s' if world > 1 else ''} under torch.distributed.run, rendezvous "
          f"{launcher[launcher.index('--rdzv-endpoint') + 1]}", flush=True)
    started = time.time()
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("requested", True))
    proc = subprocess.Popen(cmd, start_new_session=True)
    hb_dir = os.path.join(run_dir, HEARTBEAT_DIR)
    signalled: set[int] = set()
    while proc.poll() is None:
        if stop["requested"]:
            for hb in _heartbeats(hb_dir, started):
                pid = hb.get("pid")
                if pid not in signalled and _parent_of(pid) in (proc.pid, *_children(proc.pid)):
                    try:
                        os.kill(pid, signal.SIGTERM)
                        signalled.add(pid)
                    except ProcessLookupError:
                        pass
        time.sleep(0.2)
    rc = proc.returncode
    states = [hb.get("state") for hb in _heartbeats(hb_dir, started)]
    if rc != 0 and len(states) == world and all(s == "stopped" for s in states):
        return flags.EXIT_STOPPED
    return rc


def _heartbeats(directory: str, since: float) -> list[dict]:
    out = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("rank-"):
            try:
                with open(os.path.join(directory, name)) as fh:
                    hb = json.load(fh)
            except (OSError, json.JSONDecodeError):
                continue
            if hb.get("ts", 0) >= since:
                out.append(hb)
    return out


def _parent_of(pid) -> int | None:
    try:
        with open(f"/proc/{int(pid)}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError, TypeError):
        return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(x) for x in fh.read().split()]
    except OSError:
        return []


if __name__ == "__main__":
    code = main()
    # The command is over: a Ctrl-C from here on could only interrupt the interpreter's
    # teardown (a KeyboardInterrupt traceback from an atexit hook, or death by SIGINT after a
    # prepare that wrote its data).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)
