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

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Optional

from agent import gpuview, knowngood
from agent.protocol import read_json_doc, atomic_write, wrap_payload

GIB = 1 << 30
CHECKPOINT_FILE = "checkpoint.pt"


# --- what runs ---------------------------------------------------------------------------------

def python_info() -> dict:
    in_venv = sys.prefix != getattr(sys, "base_prefix", sys.prefix)
    return {"executable": sys.executable, "version": ".".join(map(str, sys.version_info[:3])),
            "prefix": sys.prefix, "venv": sys.prefix if in_venv else None}


def packages() -> dict[str, str]:
    """{canonical name: version} of every distribution this python can import."""
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            out.setdefault(re.sub(r"[-_.]+", "-", name).lower(), dist.version)
    return dict(sorted(out.items()))


def torch_info(pkgs: dict[str, str]) -> dict:
    """torch's version and CUDA build without importing it (torch/version.py is plain)."""
    import importlib.util

    info: dict[str, Any] = {"version": pkgs.get("torch"), "cuda": None, "location": None}
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return info
    info["location"] = os.path.dirname(spec.origin)
    try:
        with open(os.path.join(info["location"], "version.py"), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id in ("__version__", "cuda", "hip") and node.value is not None:
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue
                info["version" if target.id == "__version__" else target.id] = value
    except (OSError, SyntaxError):
        pass
    return info


def gpus() -> dict:
    """Visible GPUs with memory, utilisation and temperature: the agent's NVML sampler
    (agent/gpus.py) when it sees GPUs, else nvidia-smi, else none with the reason."""
    reason = None
    try:
        from agent import gpus as nvml

        sample = nvml.sample()
        if sample.get("gpus"):
            rows = []
            for g in sample["gpus"]:
                g = dict(g)
                g.pop("processes", None)
                if g.get("memory_total_mib") is not None and g.get("memory_used_mib") is not None:
                    g["memory_free_mib"] = g["memory_total_mib"] - g["memory_used_mib"]
                rows.append(g)
            return {"gpus": rows, "driver": sample.get("driver"), "source": "nvml"}
        reason = sample.get("reason")
    except ImportError:
        pass
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"gpus": [], "driver": None,
                "reason": reason or "no nvidia-smi in this container: no GPU is visible"}
    fields = "index,name,uuid,memory.total,memory.used,memory.free,utilization.gpu,temperature.gpu,driver_version"
    try:
        out = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"gpus": [], "driver": None, "reason": f"nvidia-smi failed: {exc}"}
    if out.returncode != 0:
        return {"gpus": [], "driver": None, "reason": f"nvidia-smi failed: {out.stderr.strip()[-300:]}"}
    rows, driver = [], None
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 9:
            continue
        num = lambda v: float(v) if re.fullmatch(r"[0-9.]+", v) else None  # noqa: E731 ("[N/A]")
        rows.append({"index": int(parts[0]), "name": parts[1], "uuid": parts[2], "state": "ok",
                     "memory_total_mib": num(parts[3]), "memory_used_mib": num(parts[4]),
                     "memory_free_mib": num(parts[5]), "utilization_gpu_pct": num(parts[6]),
                     "temperature_gpu_c": num(parts[7])})
        driver = parts[8]
    return {"gpus": rows, "driver": driver, "source": "nvidia-smi"}


def fingerprint(pkgs: Optional[dict] = None, gpu: Optional[dict] = None) -> dict:
    """What env drift compares: interpreter, torch + CUDA build, driver, every package."""
    pkgs = packages() if pkgs is None else pkgs
    t = torch_info(pkgs)
    py = python_info()
    return {"python": py["version"], "executable": py["executable"], "venv": py["venv"],
            "torch": {"version": t["version"], "cuda": t["cuda"]},
            "driver": (gpu or {}).get("driver"), "packages": pkgs}


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
    return {"dir": target_model, "config": {k: cfg.get(k) for k in keep if k in cfg}}, []


def _checkpoint_dir(path: str) -> Optional[str]:
    """The step directory of a checkpoint given as the directory or its checkpoint.pt."""
    if os.path.isfile(path):
        return os.path.dirname(path)
    if os.path.isfile(os.path.join(path, CHECKPOINT_FILE)):
        return path
    return None


def checkpoint_info(start: dict, flags: dict, model: dict, data: dict) -> tuple[dict, list[str], list[str]]:
    """Present, complete, and compatible with this launch: the drafter's shape (block size,
    draft layers), the target it was trained against, and for a resume the same data.

    Reads the checkpoint's own meta.json (trainer/checkpoint.py writes it beside
    checkpoint.pt for exactly this: no tensors loaded). The trainer checks again when it
    loads; this catches the same mistakes before a run directory exists.
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
    errors: list[str] = []
    cfg = meta.get("drafter_config") or {}
    for key, dest, name in (("block_size", "block_size", "--block-size"),
                            ("num_hidden_layers", "num_draft_layers", "--num-draft-layers")):
        have, want = cfg.get(key), flags.get(dest)
        if have is not None and want is not None and int(have) != int(want):
            errors.append(f"{flag} {path}: the checkpoint was trained with {name} {have}, this launch says "
                          f"{want}; set {name} {have} or start --from-scratch")
    theirs, ours = meta.get("target") or {}, model.get("config") or {}
    diff = [k for k in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
            if theirs.get(k) is not None and ours.get(k) is not None and theirs.get(k) != ours.get(k)]
    if diff:
        what = ", ".join(f"{k} {theirs.get(k)} vs {ours.get(k)}" for k in diff)
        errors.append(f"{flag} {path}: trained against another target ({what}); point --target-model at the "
                      "checkpoint's target or start --from-scratch")
    if kind == "resume":
        have, want = meta.get("data_fingerprint"), (data.get("stats") or {}).get("fingerprint")
        if have and want and have != want:
            errors.append(f"--resume-from {path}: trained on other data (fingerprint {str(have)[:12]}, --data-dir "
                          f"has {str(want)[:12]}); resuming continues that data's order — use --init-from to keep "
                          "only the weights")
    return info, errors, []


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
    """Runs whose agent is alive and whose state is not terminal, with their GPU roles (from
    the launch record ctl wrote; a run started otherwise shows no roles)."""
    from agent.protocol import RunState
    from agent.rundir import RunDir, agent_alive, read_json

    base = os.path.join(workspace, "runs")
    out = []
    for name in os.listdir(base) if os.path.isdir(base) else []:
        rd = RunDir(os.path.join(base, name))
        state = (read_json(rd.status) or {}).get("state")
        try:
            if state is None or RunState(state).is_terminal() or not agent_alive(rd):
                continue
        except ValueError:
            continue
        rec = read_json(knowngood.launch_record_path(workspace, name)) or {}
        gpus = rec.get("gpus") or {}
        out.append({"run_id": name, "state": state, "gpus": list(gpus.get("target", [])) + list(gpus.get("drafter", []))})
    return out


# --- the check ---------------------------------------------------------------------------------

def check(req: dict) -> dict:
    """The whole preflight. ``req`` keys: workspace, run_id, flags (trainer values by dest),
    start {kind, path}, config (name)."""
    workspace = req.get("workspace") or "/workspace"
    flags = req.get("flags") or {}
    errors: list[str] = []
    warnings: list[str] = []

    pkgs = packages()
    gpu = gpus()
    fp = fingerprint(pkgs, gpu)
    py = python_info()
    torch = torch_info(pkgs)
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

    for other in active_runs(workspace):
        shared = sorted(set(other.get("gpus") or []) & set(roles["target"] + roles["drafter"]))
        if not shared:
            continue
        where = f"GPU {','.join(map(str, shared))}" if use_cuda else f"rank slot {','.join(map(str, shared))}"
        message = (f"run {other['run_id']} is still {other['state']} on {where} in this container: stop it first "
                   "(`ctl kill-and-rollback`) or give this run other GPUs")
        # Two runs on one GPU is the OOM of the story; on CPU slots they only compete for cores.
        (errors if use_cuda else warnings).append(message)
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
            "device": "cuda" if use_cuda else "cpu", "gpu_shortfall": gpu_shortfall, "model": model, "data": data, "checkpoint": ckpt,
            "disk": disk, "known_good": known, "workspace": workspace, "ts": time.time()}


# --- commit ------------------------------------------------------------------------------------

def commit(req: dict) -> dict:
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
        reply = commit(req)
    else:
        reply = {"ok": True, "known_good": knowngood.update(req["workspace"])}
    sys.stdout.write(wrap_payload(reply))
    sys.stdout.flush()
    return 0 if reply.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
