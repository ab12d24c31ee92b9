"""The kinds of job the agent supervises in a container, defined once (docs/design.md: "The whole
life cycle"): what runs, where its options come from, which paths it reads and writes, and
how a stopped one resumes.

One agent supervises every kind the same way (run directory, stream, status record, failure
kinds, stop); a kind adds its command, its options and its progress fields, not a second
supervisor. A kind's options have one source of truth: its own command-line parser, named
here as ``module:function`` and imported only when a run config of that kind is validated
(controller/jobconfig.py builds the run config's table from it and checks a config by parsing
the argv the start script will carry).

Standard library only, like trainer/flags.py: the controller imports it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

TRAIN = "train"
SERVED_CHECK = "served-check"


@dataclass(frozen=True)
class Kind:
    name: str
    table: str  # the run config's table that holds its options
    subcommand: tuple[str, ...]  # after `python -m trainer`
    parser: str  # "module:function" returning the kind's argparse parser
    reads: tuple[str, ...]  # option dests naming paths the job reads
    writes: tuple[str, ...]  # option dests naming paths the job writes
    resumes_by: str  # how a relaunch after a stop continues (docs/jobs.md)
    gpus: bool  # holds GPUs (or rank slots on CPU): the GPU checks of a launch apply
    # options a run config does not hold, and why (the agent sets them for each run)
    not_in_config: tuple[tuple[str, str], ...] = ()
    # options whose value names an environment variable holding a secret: the launch reads
    # it on the operator's machine into the run's root-only secret file, and start.sh passes
    # that one variable through to the job (controller/datalaunch.py job_secret)
    secret_envs: tuple[str, ...] = ()

    def build_parser(self):
        module, _, func = self.parser.partition(":")
        factory: Callable = getattr(importlib.import_module(module), func)
        return factory()


# Every data kind's command takes --preflight: its start checks, nothing written, run by the
# launch's preflight in the container before anything starts (agent/preflight.py).
PREFLIGHT = "preflight"
PREFLIGHT_WHY = "the launch runs the job's own checks with it before anything starts"

KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind(TRAIN, "trainer", (), "trainer.flags:build_parser", ("data_dir", "target_model"), ("output_dir",),
         "its checkpoint: `ctl launch … --resume-from CKPT`", True),
    Kind("prepare", "prepare", ("prepare",), "trainer.chat.prepare:build_parser", ("input",), ("out",),
         "a rerun of the same config: the output directory appears only when complete", False,
         ((PREFLIGHT, PREFLIGHT_WHY),)),
    Kind("regenerate", "regenerate", ("regenerate",), "trainer.regen.job:build_parser", ("input",), ("out",),
         "a rerun of the same config: ids already in the output are skipped (each id exactly once)", False,
         (("run_dir", "the agent gives every job its run directory ($DFLASH_RUN_DIR)"), (PREFLIGHT, PREFLIGHT_WHY)),
         ("api_key_env",)),
    # reads nothing a launch's path rule should guard: it only reads a checkpoint, and a
    # training run resuming into that output directory must not be refused for it
    Kind(SERVED_CHECK, "served-check", ("served-check-job",), "trainer.serve.served_job:build_parser", (), (),
         "run it again: a check writes its record only when it ends (agent/servedcheck.py starts one every "
         "--served-check-every saves; ctl served-check on demand)", False, ((PREFLIGHT, PREFLIGHT_WHY),)),
)}
DATA_KINDS = tuple(k for k in KINDS if not KINDS[k].gpus)


def get(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"kind = {name!r}: not a job kind; use one of {', '.join(KINDS)}") from None
