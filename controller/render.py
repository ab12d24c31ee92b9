"""Rendering files for the container from templates/ (Jinja2).

StrictUndefined: a name the template uses but the caller did not pass is an error, not an
empty string in a shell script. ``sh`` (shlex.quote) is the only way a value enters a
script; nothing is autoescaped or interpolated raw. The start script's trainer flags come
from trainer/flags.py's FLAGS (the one definition), so the template never lists a flag.
"""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import jinja2

from controller.bundle import agent_env
from controller.config import ContainerConfig
from controller.pct import VAR_NAME, PctUsageError, container_env
from trainer import flags, runtime_env

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
START_TEMPLATE = "start.sh.j2"
DEFAULT_SECRET_KEYS = ("WANDB_API_KEY", "HF_TOKEN")


class RenderError(ValueError):
    """Values that cannot make a valid file; the message names the flag or variable."""


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=False,
    )
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    env.filters["shjoin"] = lambda values: shlex.join(str(v) for v in values)
    return env


def flag_lines(values: Mapping[str, Any]) -> list[list[str]]:
    """argv tokens per flag, in FLAGS order; flattened they equal ``flags.to_argv(values)``."""
    lines = []
    for flag in flags.FLAGS:
        tokens = flag.render(values.get(flag.dest, flag.default))
        if tokens:
            lines.append(tokens)
    return lines


def start_env(container: ContainerConfig, *, bundle: str, run_id: str, run_dir: str,
              extra: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """Every variable the trainer's environment holds (secrets aside), in order: the clean
    container environment every command gets (controller/pct.py), the bundle, the run."""
    # The agent finds and stops a run's processes by these (agent/protocol.py).
    run = {**agent_env(bundle), "DFLASH_RUN_ID": run_id, "DFLASH_RUN_DIR": run_dir,
           # Set before CUDA starts (trainer/runtime_env.py): the allocator configuration the
           # memory model describes, and a compile cache that outlives /tmp and the container's
           # restarts; start.sh adds the venv generation it belongs to.
           runtime_env.ENV_ALLOC: runtime_env.ALLOC_CONF,
           runtime_env.ENV_CACHE_ROOT: posixpath.join(container.workspace, runtime_env.WORKSPACE_CACHE)}
    try:
        return container_env(container, {**run, **(extra or {})})
    except PctUsageError as exc:
        raise RenderError(str(exc)) from None


def render_start_script(values: Mapping[str, Any], *, container: ContainerConfig, bundle: str, run_id: str,
                        run_dir: str, env: Optional[Mapping[str, str]] = None,
                        secrets_file: str,
                        secret_keys: Iterable[str] = DEFAULT_SECRET_KEYS) -> str:
    """The run's start.sh: an explicit environment, then ``python -m trainer <all flags>``.

    ``values`` are resolved trainer values by dest name (e.g. RunConfig.resolve()); they
    are checked with ``flags.check`` so the script never carries a config the trainer would
    refuse.
    """
    problems = flags.check(values)
    if problems:
        raise RenderError("cannot render the start script:\n  " + "\n  ".join(problems))
    unknown = sorted(set(values) - set(flags.BY_DEST))
    if unknown:
        raise RenderError(f"not trainer flags: {', '.join(unknown)} (see trainer/flags.py)")
    for tokens in flag_lines(values):
        if any("\0" in t for t in tokens):
            raise RenderError(f"{tokens[0]} contains a NUL byte")
    secret_keys = tuple(secret_keys)
    for key in secret_keys:
        if not VAR_NAME.match(key):
            raise RenderError(f"secret name {key!r} is not a valid shell name")
    if not run_dir.startswith("/"):
        raise RenderError(f"run directory {run_dir!r} must be an absolute path in the container")
    lines = flag_lines(values)
    start_at = start_len = 0
    for tokens in lines:  # where the start decision sits in the flattened argv
        if tokens[0] in {f.name for f in flags.START_FLAGS}:
            start_len = len(tokens)
            break
        start_at += len(tokens)
    return environment().get_template(START_TEMPLATE).render(
        subcommand=(),
        start_at=start_at,
        start_len=start_len,
        resume_flag=flags.BY_DEST["resume_from"].name,
        run_dir=run_dir,
        secrets_file=secrets_file,
        secret_keys=secret_keys,
        flag_lines=lines,
        env=start_env(container, bundle=bundle, run_id=run_id, run_dir=run_dir, extra=env),
        python=container.python,
        venv=container.venv,
        generation_var=runtime_env.ENV_GENERATION,
    )


def render_job_script(argv: list[str], *, container: ContainerConfig, bundle: str, run_id: str, run_dir: str,
                      secrets_file: str, secret_keys: Iterable[str] = DEFAULT_SECRET_KEYS) -> str:
    """The start.sh of a data job (trainer/kinds.py): the same clean environment and secrets
    as a training run's, then ``python -m trainer SUBCOMMAND FLAGS``. ``argv`` is the
    subcommand and its flags, already checked by the kind's own parser (controller/jobconfig.py).
    No start decision, so nothing for an agent restart to replace: a restart reruns it."""
    if any("\0" in t for t in argv):
        raise RenderError("a job argument contains a NUL byte")
    if not run_dir.startswith("/"):
        raise RenderError(f"run directory {run_dir!r} must be an absolute path in the container")
    sub = [t for t in argv[:1] if not t.startswith("-")]
    lines: list[list[str]] = []
    for token in argv[len(sub):]:
        if token.startswith("--") or not lines:
            lines.append([token])
        else:
            lines[-1].append(token)
    return environment().get_template(START_TEMPLATE).render(
        subcommand=sub, start_at=0, start_len=0, resume_flag=None, run_dir=run_dir, secrets_file=secrets_file,
        secret_keys=tuple(secret_keys), flag_lines=lines,
        env=start_env(container, bundle=bundle, run_id=run_id, run_dir=run_dir),
        python=container.python, venv=container.venv, generation_var=runtime_env.ENV_GENERATION)
