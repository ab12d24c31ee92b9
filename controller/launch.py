"""`ctl launch`: validate → preflight → drift → start, over one SSH connection.

Round trips once this version's bundle is in the container: (1) the preflight (one agent
call that answers everything, agent/preflight.py), (2) the commit (secret file, start
script, launch record and the agent's start, in one call that undoes itself on failure).
The bundle check rides on the preflight: it runs from the bundle's path and only when that
fails with "no such module" is the bundle uploaded (then one more round trip).

Everything that can be refused is refused before anything is written: config and start
decision locally, before a connection; paths, GPUs, checkpoint, env and data drift in the
preflight, which writes nothing but the known-good record. A failed launch leaves no run
directory and no process.
"""

from __future__ import annotations

import posixpath
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from agent.protocol import new_run_id  # noqa: F401  (the launcher's id maker; callers import it here)
from controller import drift
from controller.agentcall import AgentCallError, AgentCaller
from controller import render
from controller.container import Container
from controller.runconfig import RunConfig, RunConfigError
from trainer import flags

SECRETS_DIR = ".dflash-ctl/secrets"  # under the workspace; one 0600 file per run


def compile_cache_lines(cache: Optional[dict], ctid: str) -> list[str]:
    """What the first step will find compiled (a CUDA launch's preflight reports it)."""
    if not cache:
        return []
    if cache.get("files"):
        return [f"compile  {cache['files']:,} cached entries ({cache['bytes'] / 2**20:.0f} MiB) for generation "
                f"{cache['generation']}: the first step loads what it finds"]
    return [f"compile  nothing cached for generation {cache['generation']}: the first step compiles (34-89 s on an "
            f"H200); from a node that ran this generation on these GPUs: `ctl env cache export` there, then "
            f"`ctl env cache import FILE --container {ctid}`"]


class LaunchRefused(Exception):
    """The launch was refused before anything was started; ``lines`` is the full report.
    ``certain`` False: the commit was sent and its reply lost (a Ctrl-C that also reached
    ssh, a dropped link), so the run may have started after all."""

    def __init__(self, message: str, lines: Optional[list[str]] = None, certain: bool = True):
        super().__init__(message)
        self.lines = lines or []
        self.certain = certain


@dataclass
class LaunchResult:
    run_id: str
    run_dir: str
    report: list[str]
    start_reply: dict
    preflight: dict
    round_trips: int
    timings: dict = field(default_factory=dict)


def start_kind(start: dict) -> dict:
    if start.get("resume_from"):
        return {"kind": "resume", "path": start["resume_from"]}
    if start.get("init_from"):
        return {"kind": "init", "path": start["init_from"]}
    return {"kind": "scratch", "path": None}


class Launcher:
    """One launch into one container. ``say`` prints progress lines for the operator."""

    def __init__(self, container: Container, config: RunConfig, start: dict, *, accept_drift: bool = False,
                 say: Callable[[str], None] = print, wandb_key: Optional[str] = None,
                 run_id: Optional[str] = None, agent_options: Optional[dict] = None, share_gpus: bool = False):
        self.ct = container
        self.config = config
        self.start = start
        self.accept_drift = accept_drift
        self.drifted = False  # assess() sets it: drift that refuses without --accept-drift
        self.say = say
        self.wandb_key = wandb_key
        self.workspace = container.config.workspace
        self.run_id = run_id or new_run_id(config.name)
        self.run_dir = posixpath.join(self.workspace, "runs", self.run_id)
        self.values = config.resolve(start, run_id=self.run_id, run_dir=self.run_dir, workspace=self.workspace)
        problems = flags.check(self.values)
        if problems:
            raise RunConfigError("\n  ".join(problems))
        self.caller = AgentCaller(container, say)
        self.bundle_path = self.caller.bundle_path
        self.agent_options = {**config.supervision.agent_options(), **(agent_options or {})}
        self.share_gpus = share_gpus  # start although a live run in the container holds these GPUs
        self.auto_budget: Optional[int] = None  # --token-budget auto as the memory model decided it here

    def _call(self, module_argv: list[str], request: dict, what: str, commit: bool = False) -> dict:
        try:
            return self.caller.call(module_argv[0], module_argv[1:], request, what)
        except AgentCallError as exc:
            # no readable reply to the commit: the container may have finished it regardless
            raise LaunchRefused(str(exc), certain=not commit) from None

    @property
    def round_trips(self) -> int:
        return self.caller.round_trips

    def paths(self) -> dict:
        """What this run reads and writes (trainer/kinds.py), so no live job of any kind shares them."""
        from trainer.kinds import KINDS, TRAIN

        kind = KINDS[TRAIN]
        return {key: [str(self.values[d]) for d in dests if self.values.get(d)]
                for key, dests in (("reads", kind.reads), ("writes", kind.writes))}

    # -- the steps -----------------------------------------------------------------------------
    def preflight(self) -> dict:
        request = {"workspace": self.workspace, "run_id": self.run_id, "config": self.config.name,
                   "flags": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.values.items()},
                   "start": start_kind(self.start), "share_gpus": self.share_gpus, "paths": self.paths()}
        return self._call(["agent.preflight", "check"], request, "the launch preflight")

    def report(self, pf: dict) -> tuple[list[str], list[drift.Finding]]:
        """The operator's view of the preflight: what will run, then drift against known good."""
        lines = []
        py, torch, gpu = pf.get("python", {}), pf.get("torch", {}), pf.get("gpu", {})
        lines.append(f"python   {py.get('executable')} {py.get('version')} (venv {py.get('venv') or 'none'}, "
                     f"{pf.get('packages_count')} packages)")
        lines.append(f"torch    {torch.get('version') or 'NOT INSTALLED'}" +
                     (f", CUDA build {torch['cuda']}" if torch.get("cuda") else ", CPU build"))
        if gpu.get("gpus"):
            for g in gpu["gpus"]:
                roles = [r for r, ids in (pf.get("roles") or {}).items() if g["index"] in ids]
                free = g.get("memory_free_mib")
                lines.append(f"GPU {g['index']}    {g.get('name')} free {free / 1024:.1f} GiB" if free is not None
                             else f"GPU {g['index']}    {g.get('name')}")
                if roles:
                    lines[-1] += f"  [{'+'.join(roles)}]"
        else:
            lines.append(f"GPUs     none visible ({gpu.get('reason')}); device {pf.get('device')}, "
                         f"ranks: target {self.values['target_gpus']}, drafter {self.values['drafter_gpus']}")
        disk = pf.get("disk") or {}
        lines.append(f"disk     {disk.get('free_gib')} GiB free at {disk.get('measured_at')}")
        stats = (pf.get("data") or {}).get("stats") or {}
        if stats:
            lines.append(f"data     {pf['data']['dir']}: {stats.get('samples'):,} samples, mean length "
                         f"{stats.get('mean_length') or 0:,.1f}, loss tokens {(stats.get('loss_fraction') or 0) * 100:.1f} %")
        ck = pf.get("checkpoint") or {}
        if ck.get("dir"):
            lines.append(f"ckpt     {ck['dir']}")
        lines += compile_cache_lines(pf.get("compile_cache"), self.ct.ctid)
        for w in pf.get("warnings") or []:
            lines.append(f"warning: {w}")

        known = pf.get("known_good") or {}
        findings: list[drift.Finding] = []
        env_base = known.get("env") or {}
        if env_base.get("fingerprint"):
            env_f = drift.env_drift(env_base["fingerprint"], pf.get("fingerprint") or {})
            label = f"known-good run {env_base.get('run_id')}"
            lines += drift.render("env drift", env_f, label) or [f"env      same as known-good run {env_base.get('run_id')}"]
            findings += env_f
        else:
            lines.append("env      no known-good run in this container yet: nothing to compare")
        data_base = (known.get("configs") or {}).get(self.config.name) or {}
        if data_base.get("data") and stats:
            b = self.config.baseline
            data_f = drift.data_drift(data_base["data"], stats, length_tolerance=b.length_tolerance,
                                  loss_fraction_tolerance=b.loss_fraction_tolerance,
                                  samples_tolerance=b.samples_tolerance)
            lines += drift.render("data", data_f, f"the data config {self.config.name!r} last ran well on "
                                               f"({data_base.get('data_dir')}, run {data_base.get('run_id')})")
            findings += data_f
        return lines, findings

    def commit(self, pf: dict) -> dict:
        container = self.ct.config
        secrets_file = posixpath.join(self.workspace, SECRETS_DIR, f"{self.run_id}.env")
        script = render.render_start_script(self.values, container=container, bundle=self.bundle_path,
                                            run_id=self.run_id, run_dir=self.run_dir,
                                            env={"WANDB_DIR": self.run_dir, "WANDB_MODE": self.values["wandb_mode"]},
                                            secrets_file=secrets_file)
        known = pf.get("known_good") or {}
        base = ((known.get("configs") or {}).get(self.config.name) or {}).get("steady") or {}
        options = dict(self.agent_options)
        b = self.config.baseline
        if base.get("tokens_per_s") and b.regression_fraction > 0 and "baseline_tokens_per_s" not in options:
            options["baseline_tokens_per_s"] = base["tokens_per_s"]
            options["regression_fraction"] = b.regression_fraction
        record = {"run_id": self.run_id, "ts": time.time(), "config": self.config.name, "kind": "train",
                  "paths": self.paths(),
                  "config_file": self.config._source_file,
                  "sets": list(self.config._command_line_sets),
                  # drift that would have refused it, overridden: known good only once it completes
                  "accepted_drift": self.accept_drift and self.drifted,
                  "start": start_kind(self.start),
                  "data_dir": self.values["data_dir"], "data": (pf.get("data") or {}).get("stats"),
                  "fingerprint": pf.get("fingerprint"),
                  "gpus": {"target": list(self.values["target_gpus"]), "drafter": list(self.values["drafter_gpus"])},
                  "baseline": {"steady_steps": b.steady_steps, "throughput_tolerance": b.throughput_tolerance}}
        # The key travels only inside this request's stdin and lands in a 0600 file; never
        # argv, never the script (which reads it at run time), never the stream.
        request = {"workspace": self.workspace, "run_id": self.run_id, "record": record,
                   "run_dir": self.run_dir, "script": script, "secrets_file": secrets_file,
                   "secret": f"WANDB_API_KEY={self.wandb_key}\n" if self.wandb_key else None,
                   "start_argv": start_argv(self.ct, self.run_dir, self.run_id, options),
                   # the GPUs (or CPU rank slots) this run claims, checked again under the container's
                   # launch lock as the run is created (agent/preflight.py: commit)
                   "claim": {"ids": sorted(set(self.values["target_gpus"]) | set(self.values["drafter_gpus"])),
                             "cuda": pf.get("device") == "cuda", "share": self.share_gpus},
                   # and the paths it reads and writes, checked there too against every live run
                   "paths": self.paths()}
        reply = self._call(["agent.preflight", "commit"], request, "starting the run", commit=True)
        if reply.get("busy") or reply.get("conflicts"):
            raise LaunchRefused(f"refused in {self.ct} as the run was being created:\n  "
                                + "\n  ".join(reply.get("busy") or reply["conflicts"]))
        if not reply.get("ok"):
            raise LaunchRefused(f"the run did not start in {self.ct}: {reply.get('error')}; nothing was left behind")
        return reply

    def assess(self, pf: dict) -> "Assessment":
        """Everything the preflight found, as the operator sees it, and what refuses the
        launch: the preflight's errors, GPUs the container cannot see (with the cause),
        the disk the kept checkpoints need, the memory verdict per GPU, and drift. The one verdict of a single-container launch
        and of every container of a job."""
        from controller.diskcheck import disk_refusal

        lines, findings = self.report(pf)
        refusals = list(pf.get("errors") or [])
        # the container reports free disk; whether the kept checkpoints fit is decided here
        disk = disk_refusal(self.values, pf)
        if disk:
            refusals.append(disk)
        target_lines, target_refusals = target_report(self.values, pf)
        lines += target_lines
        refusals += target_refusals
        if pf.get("gpu_shortfall"):
            from controller.gpucheck import shortfall_line

            refusals.append(shortfall_line(self.ct, pf["gpu_shortfall"]))
        else:
            from controller.gpucheck import kernel_log_lines

            lines += kernel_log_lines(self.ct, pf)
            mem_lines, mem_refusals, self.auto_budget = memory_report(self.values, pf)
            lines += mem_lines
            refusals += mem_refusals
        self.drifted = bool(drift.blocking(findings, False))
        return Assessment(lines, refusals, drift.blocking(findings, self.accept_drift))

    def run(self) -> LaunchResult:
        """preflight → assess → commit, for a launcher used on its own (a job of one container
        goes through controller/job.py's launch like any job)."""
        t0 = time.monotonic()
        pf = self.preflight()
        t_pf = time.monotonic()
        verdict = self.assess(pf)
        for line in verdict.lines:
            self.say(line)
        verdict.raise_if_refused(str(self.ct))
        reply = self.commit(pf)
        start = reply.get("start") or {}
        return LaunchResult(self.run_id, self.run_dir, verdict.lines, start, pf, self.round_trips,
                            {"preflight_s": t_pf - t0, "total_s": time.monotonic() - t0})


@dataclass
class Assessment:
    """A container's preflight as a verdict: the report lines, the refusals (one line each)
    and the drift findings that block without --accept-drift."""

    lines: list[str]
    refusals: list[str]
    blocking: list

    def raise_if_refused(self, where: str) -> None:
        if self.refusals:
            raise LaunchRefused(f"preflight refused the launch in {where}:\n  " + "\n  ".join(self.refusals),
                                self.lines)
        if self.blocking:
            what = "; ".join(f.line() for f in self.blocking)
            raise LaunchRefused(f"drift against the known-good baseline in {where}: {what}. "
                                "Check that this is intended, then rerun with --accept-drift", self.lines)


def target_report(values: dict, pf: dict) -> tuple[list[str], list[str]]:
    """(lines, refusals) for the target the preflight read: a family the trainer cannot load
    refuses, naming the field; on GPUs, a Qwen3.5/3.6 target whose fast forward's kernels are
    not in the container venv gets a line saying what that costs and how to add them."""
    target_cfg = (pf.get("model") or {}).get("config")
    if not target_cfg:
        return [], []
    from trainer import family

    why = family.unsupported(target_cfg)
    if why:
        return [], [f"--target-model {values['target_model']}: {why}"]
    if pf.get("device") != "cuda":
        return [], []
    packages = {n.lower().replace("_", "-") for n in ((pf.get("fingerprint") or {}).get("packages") or {})}
    return [f"kernels  {note}" for note in
            family.kernel_notes(target_cfg, kernels_present="flash-linear-attention" in packages)], []


def memory_report(values: dict, pf: dict) -> tuple[list[str], list[str], Optional[int]]:
    """The memory model's verdict per GPU before anything starts (the story: a ~200 MB
    shortfall surfaced as an OOM on GPU 6 during ramp-up, not at launch).

    Uses the container's free memory per GPU from the preflight and the target's config.json
    figures; stdlib only (trainer.plan.budget), so the controller still needs no torch. Nothing to
    say on CPU. The trainer repeats the fit check on each rank before it loads anything.

    The third value: ``--token-budget auto`` decided (None when the run names its budget, or
    nothing fits). The launch carries that number into the start script, so the budget shown
    here is the one every rank trains with; the trainer decides ``auto`` itself only when run
    by hand."""
    if pf.get("device") != "cuda":
        return [], [], None
    from trainer.plan.budget import plan_run

    free = {g["index"]: g["memory_free_mib"] for g in (pf.get("gpu") or {}).get("gpus") or []
            if g.get("memory_free_mib") is not None}
    model_cfg = (pf.get("model") or {}).get("config")
    if not free or not model_cfg:
        return ["memory   not checked here: no free-memory figure or no target config.json from the preflight"], [], None
    # --target-forward auto follows the kernels the container has, not this machine's
    packages = {n.lower().replace("_", "-") for n in ((pf.get("fingerprint") or {}).get("packages") or {})}
    values = {**values, "target_forward": flags.target_forward_for(
        values, cuda=True, target_config=model_cfg, kernels="flash-linear-attention" in packages)}
    plan = plan_run(values, free, target_config=model_cfg)
    lines = []
    for g, row in sorted(plan["gpus"].items()):
        verdict = f"short by {row['short_mib']} MiB" if row.get("short_mib") else "fits"
        bound = "" if row.get("exact") else " (at least)"
        lines.append(f"memory   GPU {g} ({row['role']}): needs{bound} {row['need_mib'] / 1024:.1f} GiB "
                     f"(predicted peak {row['peak_mib'] / 1024:.1f} + margin), free "
                     f"{(row.get('free_mib') or 0) / 1024:.1f} GiB: {verdict}")
    lines += [f"memory   note: {n}" for n in plan["notes"]]
    budget = None
    if plan.get("auto") and not plan["refusals"]:
        budget = int(plan["token_budget"])
        lines.append(f"memory   --token-budget auto → {budget} ({plan['auto_reason']}): the run trains with it")
    return lines, list(plan["refusals"]), budget


def start_argv(ct: Container, run_dir: str, run_id: str, options: dict) -> list[str]:
    """The agent's start command, run by the commit step inside the container. The job is
    ``bash start.sh`` in the run directory (docs/design.md: run directory), written there by the
    commit step just before."""
    from agent.options import Options

    argv = [ct.config.python, "-m", "agent", "start", "--run-dir", run_dir, "--run-id", run_id, "--cwd", run_dir]
    return argv + Options.argv(options) + ["--", "bash", posixpath.join(run_dir, "start.sh")]
