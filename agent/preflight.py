"""Launch preflight: everything ``ctl launch`` must know about a container before it commits,
gathered in ONE call and returned as one JSON payload.

    python3 -m agent.preflight check  < request.json     # prints the payload (sentinels)
    python3 -m agent.preflight commit < commit.json      # writes the launch files, starts

``check`` answers: which python/venv will run and what it holds; torch's version and CUDA
build (read from torch's own files — importing torch would cost seconds and could fail in
ways that say nothing about the launch); the GPUs visible against the roles, with free
memory; free disk; the data dir and its meta.json statistics; the target model's config;
the checkpoint to resume/init from and whether it fits; the known-good baseline (updated
first, see agent/knowngood.py). Problems are returned as ``errors`` (refuse) and
``warnings`` (shown), each one line naming the flag or path and the fix. Nothing is written
except the known-good record.

``commit`` is the launch's last step, done in the same call so a launch stays within three
round trips: it writes the secret file (0600) and the start script, records the launch, and
runs the agent's start verb; if that fails, it removes everything it wrote, so a failed
launch leaves the container as it found it.

Standard library only: this runs under the container's python, before anything is known
about what that python holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any, Iterator, Optional

from agent import ckptcompat, compilecache, envfp, gpuhealth, gpuview, knowngood
from agent import gpus as nvml_gpus
from agent.protocol import FINGERPRINT, atomic_write, atomic_write_json, read_json_doc, wrap_payload

GIB = 1 << 30
CHECKPOINT_FILE = "checkpoint.pt"


# --- what runs ---------------------------------------------------------------------------------

def python_info() -> dict:
    in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    return {"executable": sys.executable, "version": ".".join(map(str, sys.version_info[:3])),
            "prefix": sys.prefix, "venv": sys.prefix if in_venv else None}


def gpus() -> dict:
    """Visible GPUs with memory, utilisation and temperature (agent/gpus.py's sample)."""
    return nvml_gpus.sample()


def fingerprint(gpu: Optional[dict] = None) -> dict:
    """What env drift compares: this interpreter's fingerprint (agent/envfp.py) and the driver."""
    return dict(envfp.collect(), driver=(gpu or {}).get("driver"))


# --- paths -------------------------------------------------------------------------------------

_read_json = read_json_doc  # agent/protocol.py


def data_info(data_dir: Optional[str]) -> tuple[dict, list[str]]:
    if not data_dir:
        return {}, ["--data-dir is not set: name the prepared data directory"]
    meta_path = os.path.join(data_dir, "meta.json")
    if not os.path.isdir(data_dir):
        return {"dir": data_dir}, [f"--data-dir {data_dir}: no such directory in this container; prepare the "
                                   "data there (`python -m trainer prepare --out DIR`) or fix the path"]
    meta = _read_json(meta_path)
    if meta is None:
        return {"dir": data_dir}, [f"--data-dir {data_dir}: no readable meta.json, so it is not a prepared data "
                                   "directory; run `python -m trainer prepare --input FILE.jsonl --out DIR`"]
    length = meta.get("length") if isinstance(meta.get("length"), dict) else {}
    stats = {"samples": meta.get("samples"), "tokens": meta.get("tokens"),
             "mean_length": length.get("mean", meta.get("mean_length")),
             "p99_length": length.get("p99"), "max_length": length.get("max"),
             "loss_fraction": meta.get("loss_fraction"), "fingerprint": meta.get("fingerprint")}
    return {"dir": data_dir, "stats": stats}, []


def model_info(target_model: Optional[str]) -> tuple[dict, list[str]]:
    if not target_model:
        return {}, ["--target-model is not set: name the target's Hugging Face directory"]
    cfg = _read_json(os.path.join(target_model, "config.json"))
    if not os.path.isdir(target_model):
        return {"dir": target_model}, [f"--target-model {target_model}: no such directory in this container; "
                                       "fix the path or copy the model there"]
    if cfg is None:
        return {"dir": target_model}, [f"--target-model {target_model}: no readable config.json; it must be a "
                                       "Hugging Face model directory"]
    keep = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "head_dim", "intermediate_size", "tie_word_embeddings")
    return {"dir": target_model, "config": {k: cfg.get(k) for k in keep if k in cfg},
            "identity": ckptcompat.target_identity(cfg)}, []


def _checkpoint_dir(path: str) -> Optional[str]:
    """The step directory of a checkpoint given as the directory or its checkpoint.pt."""
    if os.path.isfile(path):
        return os.path.dirname(path)
    if os.path.isfile(os.path.join(path, CHECKPOINT_FILE)):
        return path
    return None


def checkpoint_info(start: dict, flags: dict, model: dict, data: dict) -> tuple[dict, list[str], list[str]]:
    """Present, complete, and compatible with this launch (agent/ckptcompat.py: the
    drafter's shape, the target and its taps, for a resume the same data).

    Reads the checkpoint's own meta.json (trainer/checkpoint.py writes it beside
    checkpoint.pt for exactly this: no tensors loaded). The trainer asks the same question
    when it loads; this asks it before a run directory exists.
    """
    kind, path = start.get("kind"), start.get("path")
    if kind not in ("resume", "init") or not path:
        return {}, [], []
    flag = "--resume-from" if kind == "resume" else "--init-from"
    step_dir = _checkpoint_dir(path)
    if step_dir is None:
        if os.path.isdir(path):
            found = sorted((n for n in os.listdir(path) if n.startswith("step_")), key=lambda n: int(n[5:]) if n[5:].isdigit() else -1)
            hint = f"; it holds {', '.join(found[-3:])} — name one of those" if found else ""
            return {"path": path}, [f"{flag} {path}: no {CHECKPOINT_FILE} there (not a complete checkpoint){hint}"], []
        return {"path": path}, [f"{flag} {path}: no such checkpoint in this container; `ctl status --run ID` shows "
                                "a run's last checkpoint — or start --from-scratch"], []
    info: dict[str, Any] = {"path": path, "dir": step_dir}
    meta = _read_json(os.path.join(step_dir, "meta.json"))
    if meta is None or meta.get("format") != "dflash-trainer-checkpoint":
        return info, [f"{flag} {path}: no readable meta.json of a dflash trainer checkpoint beside "
                      f"{CHECKPOINT_FILE}; name a complete OUTPUT/step_N directory written by this trainer"], []
    info["step"] = meta.get("step")
    target = model.get("identity") or model.get("config") or {}
    launch = {"flag": flag, "path": path, "block_size": flags.get("block_size"),
              "num_draft_layers": flags.get("num_draft_layers"), "target": target,
              "target_layer_ids": flags.get("target_layer_ids") or None,
              "data_fingerprint": (data.get("stats") or {}).get("fingerprint") if kind == "resume" else None}
    return info, ckptcompat.problems(meta, launch), []


def disk_info(path: Optional[str]) -> dict:
    """Free space where --output-dir will be, measured in this container (its nearest existing
    ancestor: the output dir is usually created by the run). A fact only: whether the run's
    checkpoints fit is the controller's verdict (controller/diskcheck.py), which knows their
    size; this side imports nothing of the trainer."""
    probe = path or "/"
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip("/")) or "/"
    usage = shutil.disk_usage(probe)
    return {"path": path, "measured_at": probe, "free_bytes": usage.free, "total_bytes": usage.total,
            "free_gib": round(usage.free / GIB, 2), "total_gib": round(usage.total / GIB, 2)}


def active_runs(workspace: str) -> list[dict]:
    """Live runs: not ended, and supervised or with their job still running (a run whose agent
    died still holds its GPUs), with their GPU roles from the launch record ctl wrote (a run
    started otherwise shows none)."""
    from agent.protocol import RunStatus
    from agent.rundir import RunDir, agent_alive, agent_live_or_none, read_json

    base = os.path.join(workspace, "runs")
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        rd = RunDir(os.path.join(base, name))
        try:
            st = RunStatus.load(rd.status)
        except ValueError:  # a state this agent does not know
            continue
        if st.state is None or st.terminal or not (agent_alive(rd) or agent_live_or_none(rd.job_pid)):
            continue
        rec = read_json(knowngood.launch_record_path(workspace, name)) or {}
        gpus = rec.get("gpus") or {}
        out.append({"run_id": name, "state": st.state.value, "kind": rec.get("kind") or "train",
                    # every role's: a served check's reserved GPU too (agent/servedcheck.py)
                    "gpus": sorted({g for ids in gpus.values() if isinstance(ids, list) for g in ids}),
                    "paths": rec.get("paths") or {}})
    return out


def _overlap(a: str, b: str) -> bool:
    """One path is the other or lies inside it."""
    a, b = os.path.normpath(a), os.path.normpath(b)
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def path_conflicts(workspace: str, paths: dict) -> list[str]:
    """One line per live run (of any kind) that writes what this launch reads or writes, or
    reads what it writes: a prepare writing the data dir a training run reads, two regenerate
    jobs appending to one output file (each id would no longer be there exactly once)."""
    mine_r, mine_w = list(paths.get("reads") or []), list(paths.get("writes") or [])
    lines = []
    for other in active_runs(workspace):
        theirs = other.get("paths") or {}
        their_r, their_w = list(theirs.get("reads") or []), list(theirs.get("writes") or [])
        clash = [(m, t, "writes") for m in mine_w + mine_r for t in their_w if _overlap(m, t)] + \
                [(m, t, "reads") for m in mine_w for t in their_r if _overlap(m, t)]
        if clash:
            mine, theirs_path, how = clash[0]
            verb = "write" if mine in mine_w else "read"
            lines.append(f"run {other['run_id']} ({other['kind']}, {other['state']}) {how} {theirs_path}, which this "
                         f"launch would {verb} ({mine}): wait for it, stop it (`ctl kill-and-rollback --run "
                         f"{other['run_id']}`), or use another path")
    return lines


def busy(workspace: str, wanted: list[int], use_cuda: bool) -> list[str]:
    """One line per live run holding any of ``wanted`` (GPUs, or rank slots on CPU): two runs
    on one GPU each plan for its whole memory — the shortfall of the story, made on purpose."""
    slot = "GPU" if use_cuda else "rank slot"
    lines = []
    for other in active_runs(workspace):
        shared = sorted(set(other["gpus"]) & set(wanted))
        if shared:
            lines.append(f"run {other['run_id']} is live ({other['state']}) in this container on "
                         f"{slot}{'s' if len(shared) > 1 else ''} {','.join(map(str, shared))}: stop it first "
                         f"(`ctl kill-and-rollback --run {other['run_id']}`), give this run other GPUs, or pass "
                         "--share-gpus to start it anyway")
    return lines


# --- the check ---------------------------------------------------------------------------------

JOB_PREFLIGHT_TIMEOUT_S = 120.0  # a tokenizer to load, endpoints to ask (each with its own timeout)


def job_preflight(argv: list[str], timeout: float) -> list[str]:
    """The data job's own start checks (``python -m trainer SUB FLAGS --preflight``,
    trainer/chat/preflight.py) with this python and bundle: a wrong --target, a target without
    a chat template, an unreadable input, an endpoint that does not answer, an out that cannot
    be written — each refused here, before a run directory exists."""
    try:
        proc = subprocess.run([sys.executable, "-m", "trainer", *argv, "--preflight"], capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"the job's own checks (python -m trainer {argv[0]} --preflight) took over {timeout:g} s; "
                "is an endpoint or the target's disk hanging?"]
    try:
        from agent.protocol import extract_payload

        reply = extract_payload(proc.stdout)
    except ValueError:
        said = [line for line in proc.stderr.splitlines() if line.strip()][-1:] or [f"exit {proc.returncode}"]
        return [f"the job's own checks (python -m trainer {argv[0]} --preflight) failed: {said[0]}"]
    return [str(e) for e in reply.get("errors") or []]


def check_data_job(req: dict) -> dict:
    """The preflight of a data job (trainer/kinds.py): what runs it, its input paths, and no
    live run sharing its paths. No GPU, torch, model or checkpoint checks: it holds no GPU,
    so it never collides with a training run on one (only on paths)."""
    workspace = req.get("workspace") or "/workspace"
    paths = req.get("paths") or {}
    errors: list[str] = []
    for path, option in zip(paths.get("reads") or [], req.get("read_options") or []):
        if not os.path.exists(path):
            errors.append(f"{option} {path}: no such file in this container; copy it there or fix the path")
    errors += path_conflicts(workspace, paths)
    if not errors and req.get("argv"):
        errors += job_preflight(req["argv"], float(req.get("job_preflight_timeout") or JOB_PREFLIGHT_TIMEOUT_S))
    run_id = req.get("run_id")
    if run_id and os.path.exists(knowngood.run_dir(workspace, run_id)):
        errors.append(f"run {run_id} already exists in {workspace}/runs; launch again for a new run id")
    fp = fingerprint(None)
    first = (paths.get("writes") or [None])[0]
    return {"ok": not errors, "errors": errors, "warnings": [], "python": python_info(),
            "packages_count": len(fp["packages"]), "fingerprint": fp, "kind": req.get("kind"),
            "disk": disk_info(first), "workspace": workspace, "ts": time.time()}


def compile_cache_info(workspace: str, gen: str) -> dict:
    """What the run's first step will find compiled (trainer/runtime_env.py's directory for
    this generation): an empty cache means a fresh machine's full compile, which `ctl env
    cache import` can spare it."""
    gen_dir = compilecache.generation_dir(compilecache.root_of(workspace), gen)
    kinds = compilecache.summary(gen_dir) if os.path.isdir(gen_dir) else {}
    return {"generation": gen, "dir": gen_dir, "files": sum(k["files"] for k in kinds.values()),
            "bytes": sum(k["bytes"] for k in kinds.values())}


def check(req: dict) -> dict:
    """The whole preflight. ``req`` keys: workspace, run_id, flags (trainer values by dest),
    start {kind, path}, config (name), share_gpus (start although a live run holds a GPU)."""
    if (req.get("kind") or "train") != "train":
        return check_data_job(req)
    workspace = req.get("workspace") or "/workspace"
    flags = req.get("flags") or {}
    errors: list[str] = []
    warnings: list[str] = []

    gpu = gpus()
    fp = fingerprint(gpu)
    pkgs = fp["packages"]
    py = python_info()
    torch = fp["torch"] or {"version": None, "cuda": None}
    if torch["version"] is None:
        errors.append(f"torch is not installed for {py['executable']}: install it into the container's venv "
                      f"({py['prefix']}) — ctl does not install torch")

    device = flags.get("device") or "auto"
    roles = {"target": list(flags.get("target_gpus") or []), "drafter": list(flags.get("drafter_gpus") or [])}
    visible = {g["index"]: g for g in gpu["gpus"]}
    # A run that names GPUs gets them or is refused, unless it says device = "cpu": a 27B run
    # silently on CPU because the container lost its passthrough (a host driver update, a
    # missing device node or cgroup rule) is the failure, not a fallback.
    use_cuda = device != "cpu"
    named = sorted(set(roles["target"]) | set(roles["drafter"]))
    gpu_shortfall = None
    if use_cuda:
        missing = [i for i in named if i not in visible]
        if missing:
            # The controller names the cause from these facts and the node's own (controller/gpucheck.py).
            gpu_shortfall = {"named": named, "missing": missing, "visible": sorted(visible),
                             "reason": gpu.get("reason"), "view": gpuview.diagnose()}
        elif torch["version"] and not torch["cuda"]:
            errors.append(f"torch {torch['version']} is a CPU-only build but this launch uses GPUs; install a CUDA "
                          "build of torch in the container's venv, or set device = \"cpu\"")

    if flags.get("wandb_project") and flags.get("wandb_mode") != "disabled" and "wandb" not in pkgs:
        errors.append(f"[wandb] project = {flags['wandb_project']!r} but wandb is not installed for "
                      f"{py['executable']}: install it into the container's venv, or drop the project "
                      "(or set mode = \"disabled\") in the run config")

    model, errs = model_info(flags.get("target_model"))
    errors += errs
    data, errs = data_info(flags.get("data_dir"))
    errors += errs
    ckpt, errs, warns = checkpoint_info(req.get("start") or {}, flags, model, data)
    errors += errs
    warnings += warns

    disk = disk_info(flags.get("output_dir"))

    errors += path_conflicts(workspace, req.get("paths") or {})
    held = busy(workspace, roles["target"] + roles["drafter"], use_cuda)
    if req.get("share_gpus"):
        warnings += [line.split(": stop it first")[0] + ": shared, as --share-gpus asks" for line in held]
    else:
        errors += held
    health = None
    if use_cuda and gpu_shortfall is None and named:
        # a GPU with a fault is refused like a busy one (--share-gpus does not change that)
        health = nvml_gpus.health()
        verdict = gpuhealth.check(health, named)
        errors += verdict.faults
        warnings += verdict.warnings
    for g in gpu["gpus"] if use_cuda else []:
        used = g.get("memory_used_mib")
        if g["index"] in roles["target"] + roles["drafter"] and isinstance(used, (int, float)) and used > 1024:
            warnings.append(f"GPU {g['index']} already has {used / 1024:.1f} GiB in use by something else: "
                            "the memory probe's margin assumes an empty GPU")

    run_id = req.get("run_id")
    if run_id and os.path.exists(knowngood.run_dir(workspace, run_id)):
        errors.append(f"run {run_id} already exists in {workspace}/runs; launch again for a new run id")

    try:
        known = knowngood.update(workspace)
    except OSError as exc:  # a read-only or full workspace must not hide the rest of the report
        known = knowngood.load(workspace)
        warnings.append(f"cannot update the known-good record in {workspace}: {exc}")

    return {"ok": not errors and gpu_shortfall is None, "errors": errors, "warnings": warnings, "python": py,
            "torch": torch, "packages_count": len(pkgs), "fingerprint": fp, "gpu": gpu, "roles": roles,
            "device": "cuda" if use_cuda else "cpu", "gpu_shortfall": gpu_shortfall, "gpu_health": health,
            "model": model, "data": data, "checkpoint": ckpt,
            "disk": disk, "known_good": known, "workspace": workspace, "ts": time.time(),
            "compile_cache": compile_cache_info(workspace, fp["id"]) if use_cuda else None}


# --- commit ------------------------------------------------------------------------------------

LAUNCH_LOCK = ".dflash-ctl/launch.lock"  # under the workspace: held by one commit at a time
LAUNCH_LOCK_WAIT_S = 150.0  # longer than one commit can take (the agent's start: 120 s at most)


@contextlib.contextmanager
def launch_lock(workspace: str) -> Iterator[None]:
    """The container's launch lock (agent/rundir.py's flock Lock): the busy-slot check and the
    run's creation happen under it, so of N launches at once exactly one claims a GPU or rank
    slot. The kernel drops it with the process, so a killed commit never leaves it held."""
    from agent.rundir import Lock

    path = os.path.join(workspace, LAUNCH_LOCK)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = Lock(path)
    if not lock.acquire(timeout=LAUNCH_LOCK_WAIT_S):
        raise RuntimeError(f"another launch in {workspace} has held {path} for over {LAUNCH_LOCK_WAIT_S:g} s; "
                           "try again")
    try:
        yield
    finally:
        lock.release()


def commit(req: dict) -> dict:
    """The launch's last step under the container's launch lock: the rank-slot claim (no live
    run holds any of ``req["claim"]["ids"]``, unless it says ``share``), the path claim (no
    live run writes what ``req["paths"]`` reads or writes, or reads what it writes) and the
    run's creation (:func:`create_run`), so two launches at once can never both pass either
    check. The preflight made both checks already, before the lock: they only inform there."""
    claim = req.get("claim") or {}
    workspace = req.get("workspace") or "/workspace"
    try:
        with launch_lock(workspace):
            if claim and not claim.get("share"):
                held = busy(workspace, list(claim.get("ids") or []), bool(claim.get("cuda")))
                if held:
                    return {"ok": False, "run_id": req["run_id"], "busy": held, "error": "; ".join(held)}
            conflicts = path_conflicts(workspace, req.get("paths") or {})
            if conflicts:
                return {"ok": False, "run_id": req["run_id"], "conflicts": conflicts, "error": "; ".join(conflicts)}
            return create_run(req)
    except RuntimeError as exc:
        return {"ok": False, "run_id": req["run_id"], "error": str(exc)}

def create_run(req: dict) -> dict:
    """Create the run directory with its start.sh, the run's secret file (0600), start the
    run with the agent's own start verb, and record the launch for the known-good baseline.

    ``req``: workspace, run_id, run_dir, script, secrets_file, secret (text or None), record,
    start_argv. On any failure before the agent reports a started run, everything created
    here is removed again: a failed launch leaves no run directory and no secret behind.
    """
    import shutil as _shutil

    run_dir, secrets_file = req["run_dir"], req.get("secrets_file")
    created_dir = False
    written: list[str] = []
    try:
        if os.path.exists(run_dir):
            return {"ok": False, "run_id": req["run_id"], "error": f"{run_dir} already exists; launch again for a new run id"}
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        os.mkdir(run_dir, 0o755)
        created_dir = True
        atomic_write(os.path.join(run_dir, "start.sh"), req["script"], 0o644)
        fp = (req.get("record") or {}).get("fingerprint")
        if fp:  # the run's environment, as the preflight saw it (docs/design.md: run directory)
            atomic_write_json(os.path.join(run_dir, FINGERPRINT), fp)
        if req.get("secret"):
            os.makedirs(os.path.dirname(secrets_file), mode=0o700, exist_ok=True)
            os.chmod(os.path.dirname(secrets_file), 0o700)
            atomic_write(secrets_file, req["secret"], 0o600)  # mkstemp: 0600 from the start
            written.append(secrets_file)
        proc = subprocess.run(req["start_argv"], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=req.get("timeout", 120))
        try:
            from agent.protocol import extract_payload

            reply = extract_payload(proc.stdout)
        except ValueError:
            reply = {"ok": False, "error": (proc.stderr.strip() or proc.stdout.strip())[-800:] or
                     f"agent start exited {proc.returncode} without a reply"}
        if proc.returncode != 0 or not reply.get("ok"):
            raise RuntimeError(f"agent start failed: {reply.get('error')}")
        if req.get("record"):
            knowngood.write_launch_record(req["workspace"], req["record"])
        return {"ok": True, "run_id": req["run_id"], "start": reply}
    except BaseException as exc:  # noqa: BLE001 - undo, then report; never a half-done launch
        for path in written:
            try:
                os.unlink(path)
            except OSError:
                pass
        if created_dir:
            _shutil.rmtree(run_dir, ignore_errors=True)
        return {"ok": False, "run_id": req["run_id"], "error": str(exc) or type(exc).__name__}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = "usage: python3 -m agent.preflight check|commit|known-good < request.json"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\nThe launch preflight's container side (the controller sends the request).")
        return 0
    if not argv or argv[0] not in ("check", "commit", "known-good"):
        print(usage, file=sys.stderr)
        return 2
    try:
        req = json.load(sys.stdin) if argv[0] != "known-good" else {"workspace": argv[1] if len(argv) > 1 else "/workspace"}
    except ValueError as exc:
        sys.stdout.write(wrap_payload({"ok": False, "error": f"request is not JSON: {exc}"}))
        return 2
    if argv[0] == "check":
        reply = check(req)
    elif argv[0] == "commit":
        # A dropped connection (SIGHUP) or a Ctrl-C that reaches this far must not cut the
        # commit in half: it finishes (the controller knows the run id and says it) or undoes
        # itself. Handlers, not SIG_IGN, so the run's own processes do not inherit them.
        for sig in (signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        reply = commit(req)
    else:
        reply = {"ok": True, "known_good": knowngood.update(req["workspace"])}
    sys.stdout.write(wrap_payload(reply))
    sys.stdout.flush()
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
