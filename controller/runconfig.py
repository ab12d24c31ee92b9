"""Run config: the TOML file an operator launches from, validated by pydantic.

The ``[trainer]`` table's model is generated from ``trainer/flags.py``'s FLAGS (one field
per flag, the flag's own parser as validator), so a flag added there is accepted here
without anyone keeping a copy. Layout::

    name = "tiny"                 # data drift compares against the data this name last ran on
    [trainer]                     # trainer flags, named as on the command line without "--"
    target-model = "/workspace/tiny/target"
    target-gpus = [0]             # or "0,1"
    ...
    [wandb]                       # project, run-name, mode; the key only by reference
    api-key-file = "~/.config/dflash-ctl/wandb.key"   # or api-key-env = "WANDB_API_KEY"
    [baseline]                    # when a run counts as known good (steady state)

Path values may use ``{run_id}``, ``{run_dir}`` and ``{workspace}``; they are filled in at
launch. A path in the container is absolute (or starts with ``{run_dir}`` or ``{workspace}``).
The start decision is *not* part of a config: a file is reused across launches, so a stored
``resume-from`` would be exactly the implicit resume this product exists to prevent.
"""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError,
                      create_model, field_validator, model_validator)
from typing_extensions import Annotated

from agent.options import Options as AgentOptions
from agent.protocol import RUN_NAME_PATTERN
from trainer import flags


class RunConfigError(Exception):
    """Bad run config or override; the message names the file, field, value and fix."""


# Flags the run config does not hold, and why (the message tells the operator where they go).
NOT_IN_CONFIG: dict[str, str] = {
    "run_dir": "the agent sets the run directory for each run",
    "probe_memory": "the memory probe is a separate step, not a training launch",
    **{f.dest: "the start decision is never stored in a config (it would make a later launch an "
               "implicit resume): pass --from-scratch, --resume-from CKPT or --init-from CKPT to "
               "`ctl launch`" for f in flags.START_FLAGS},
    # A job's place of each container is decided at launch (controller/job.py).
    **{dest: "the controller sets it for each container of a job: name the containers in [[job.containers]] "
             "or with repeated `ctl launch --container NODE:CTID`"
       for dest in ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "job_layout")},
}
WANDB_FLAGS = {"wandb_project": "project", "wandb_run_name": "run_name", "wandb_mode": "mode"}

# Where a run's checkpoints go unless the config says otherwise: inside the run directory,
# so two launches of one config never write into each other's step_N/ folders.
DEFAULT_OUTPUT_DIR = "{run_dir}/output"
PLACEHOLDERS = ("run_id", "run_dir", "workspace")


def exact(kind: str, value: Any) -> Any:
    """``value`` unchanged when its type is the one ``kind`` names, else ValueError: TOML's
    true is not 1, 1.0 is not 1, and 0.5 is no GPU index (pydantic's lax mode would take
    all three). Text (--set KEY=VALUE) is left to the field's own parsing."""
    if isinstance(value, str) or value is None:
        return value
    if kind in ("int", "budget") and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"must be a whole number, not {_toml_text(value)}")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"must be a number, not {_toml_text(value)}")
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"must be true or false, not {_toml_text(value)}")
    if kind in ("gpus", "layers") and isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise ValueError(f"{_toml_text(item)} is not a GPU index: give whole numbers, e.g. [0, 1]")
    return value


def _shown(value: Any) -> str:
    """A value as the operator wrote it: TOML's spelling for true and lists ([true, 0.5])."""
    import json

    if isinstance(value, str):
        return repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # TOML's nan and inf (JSON would say NaN, Infinity)
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _toml_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def container_path_problem(value: str, example: str = "/workspace/data") -> Optional[str]:
    """Why ``value`` cannot name a path in the container, or None. A relative path meant
    whatever directory the process judging it ran in: the preflight and the trainer do not
    share one, so `--data-dir tiny/data` was refused or accepted by accident."""
    if value.startswith(("/", "{run_dir}", "{workspace}")):
        return None
    return f"must be an absolute path inside the container, or start with {{run_dir}} or {{workspace}}, e.g. {example}"


def _parser(flag: flags.Flag):
    def parse(value: Any) -> Any:
        if value is None:
            return None
        value = exact(flag.kind, value)
        why = container_path_problem(value) if flag.kind == "path" and isinstance(value, str) else None
        if why:
            raise ValueError(why)
        if flag.kind in ("gpus", "layers") and isinstance(value, (list, tuple)):
            return flags.parse_gpus(list(value))
        if flag.kind in ("gpus", "layers", "budget"):
            return flag.parse(value)
        return value  # pydantic's own coercion for scalars gives the better message

    return parse


def _exact(kind: str):
    return BeforeValidator(lambda value: exact(kind, value))


# Finite numbers only, everywhere: `lr = nan` or `kill-grace = inf` compare false against
# every bound, so a bound alone never refused them.
_MODEL_CONFIG = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, allow_inf_nan=False)


def _field_type(flag: flags.Flag) -> Any:
    base: Any = {
        "str": str, "path": str, "int": int, "float": float, "bool": bool,
        "gpus": tuple[int, ...], "layers": tuple[int, ...],
        "budget": Union[int, Literal["auto"]],
    }.get(flag.kind)
    if flag.kind == "choice":
        base = Literal[flag.choices]  # type: ignore[valid-type]
    if flag.default is None:
        base = Optional[base]
    return Annotated[base, BeforeValidator(_parser(flag))]


def _trainer_model() -> type[BaseModel]:
    fields: dict[str, Any] = {}
    for flag in flags.FLAGS:
        if flag.dest in NOT_IN_CONFIG or flag.dest in WANDB_FLAGS:
            continue
        default: Any = ... if flag.required else flag.default
        if flag.dest == "output_dir":
            default = DEFAULT_OUTPUT_DIR
        fields[flag.dest] = (_field_type(flag), Field(default, alias=flag.name.lstrip("-"),
                                                      description=flag.help))
    return create_model(
        "TrainerSection",
        __config__=_MODEL_CONFIG,
        **fields,
    )


TrainerSection = _trainer_model()


class WandbSection(BaseModel):
    """wandb settings. The API key is referenced, never held: a local file or an env var name."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    project: Optional[str] = Field(None, description=flags.BY_DEST["wandb_project"].help)
    run_name: Optional[str] = Field(None, alias="run-name", description=flags.BY_DEST["wandb_run_name"].help)
    mode: Literal[flags.BY_DEST["wandb_mode"].choices] = Field(  # type: ignore[valid-type]
        flags.BY_DEST["wandb_mode"].default, description=flags.BY_DEST["wandb_mode"].help)
    api_key_file: Optional[str] = Field(None, alias="api-key-file",
                                        description="local file holding the wandb API key (chmod 600)")
    api_key_env: Optional[str] = Field(None, alias="api-key-env",
                                       description="name of a local environment variable holding the key")

    @model_validator(mode="before")
    @classmethod
    def _no_literal_key(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("api-key", "api_key", "key"):
                if key in data:
                    raise ValueError(
                        f"{key}: an API key is never stored in a run config; put it in a file "
                        "(chmod 600) and set api-key-file, or name an environment variable in api-key-env")
        return data

    @model_validator(mode="after")
    def _one_source(self) -> "WandbSection":
        if self.api_key_file and self.api_key_env:
            raise ValueError("api-key-file and api-key-env are both set: keep one")
        return self

    def read_key(self, environ: Mapping[str, str] | None = None) -> Optional[str]:
        """The key, read on the operator's machine; None when none is configured."""
        environ = os.environ if environ is None else environ
        if self.api_key_env:
            value = environ.get(self.api_key_env, "").strip()
            if not value:
                raise RunConfigError(f"[wandb] api-key-env = {self.api_key_env!r}: that environment variable "
                                     "is unset or empty; export it, or use api-key-file")
            return value
        if self.api_key_file:
            path = Path(self.api_key_file).expanduser()
            try:
                value = path.read_text(encoding="utf-8").strip()
            except UnicodeDecodeError as exc:
                raise RunConfigError(f"[wandb] api-key-file = {self.api_key_file!r}: {not_utf8(exc)}") from None
            except OSError as exc:
                raise RunConfigError(f"[wandb] api-key-file = {self.api_key_file!r}: cannot read it "
                                     f"({exc.strerror}); create it holding only the key (chmod 600), "
                                     "or remove the setting") from None
            if not value:
                raise RunConfigError(f"[wandb] api-key-file = {self.api_key_file!r} is empty: put the key in it")
            return value
        return None


class BaselineSection(BaseModel):
    """When a run counts as known good: the median tokens/s of its last ``steady_steps``
    steps is within ``throughput_tolerance`` (relative) of the median of the steps before."""

    model_config = _MODEL_CONFIG

    steady_steps: Annotated[int, _exact("int")] = Field(20, alias="steady-steps", ge=1)
    throughput_tolerance: Annotated[float, _exact("float")] = Field(0.15, alias="throughput-tolerance", gt=0, le=1)
    # Data statistics that differ by more than these count as drift.
    length_tolerance: Annotated[float, _exact("float")] = Field(0.10, alias="length-tolerance", ge=0)
    loss_fraction_tolerance: Annotated[float, _exact("float")] = Field(0.02, alias="loss-fraction-tolerance", ge=0)
    samples_tolerance: Annotated[float, _exact("float")] = Field(0.10, alias="samples-tolerance", ge=0)
    # A run whose steady tokens/s falls more than this below the known-good run of its config
    # is stopped by the agent with a named reason (the story: 20 → 5.4 Ktok/s, nobody told).
    # 0 hands the agent no baseline (e.g. CPU runs on a shared machine, whose rate swings 3×).
    regression_fraction: Annotated[float, _exact("float")] = Field(AgentOptions.regression_fraction, alias="regression-fraction", ge=0, lt=1)


# Agent options the [baseline] table decides (controller/launch.py hands the agent the
# known-good rate with it): not settable twice.
_BASELINE_OPTIONS = ("baseline_tokens_per_s", "regression_fraction")


class _Supervision(BaseModel):
    model_config = _MODEL_CONFIG

    def agent_options(self) -> dict[str, Any]:
        """{option: value} for `agent start` (agent/options.py names)."""
        return self.model_dump()


# The agent's timings are seconds: a week is past any start-up, stall or grace anyone means.
MAX_SUPERVISION_S = 7 * 86400
MAX_RESTARTS = 1000


def _supervision_model() -> type[BaseModel]:
    """``[supervision]``: the agent's start options (agent/options.py), with its defaults and
    words, e.g. ``startup-timeout = 1800`` for a target that imports slowly."""
    from dataclasses import fields as dc_fields

    fields: dict[str, Any] = {}
    for f in dc_fields(AgentOptions):
        if f.name in _BASELINE_OPTIONS:
            continue
        kind = f.metadata["type"]
        fields[f.name] = (Annotated[kind, _exact(kind.__name__)],
                          Field(f.default, alias=f.name.replace("_", "-"), ge=0,
                                le=MAX_RESTARTS if kind is int else MAX_SUPERVISION_S, description=f.metadata["help"]))
    return create_model("SupervisionSection", __base__=_Supervision, **fields)


SupervisionSection = _supervision_model()


class JobContainer(BaseModel):
    """One container of a job across containers (controller/job.py) and its own GPU roles."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    container: str = Field(..., pattern=r"^([a-z][a-z0-9-]*:)?\d+$", description="NODE:CTID, e.g. sim2:300")
    target_gpus: Annotated[tuple[int, ...], BeforeValidator(_parser(flags.BY_DEST["target_gpus"]))] = Field(
        (), alias="target-gpus", description="this container's GPUs running the target")
    drafter_gpus: Annotated[tuple[int, ...], BeforeValidator(_parser(flags.BY_DEST["drafter_gpus"]))] = Field(
        (), alias="drafter-gpus", description="this container's GPUs training the drafter")


class JobSection(BaseModel):
    """``[[job.containers]]``: the containers of one job, any order (targets go first)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    containers: tuple[JobContainer, ...] = Field(..., min_length=2)


class RunConfig(BaseModel):
    """A validated run config: trainer flags (less the start decision), wandb, baseline, and
    optionally the containers of a job across containers."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    # run ids start with the name (agent/protocol.py: the run-id grammar)
    name: str = Field(..., pattern=f"^{RUN_NAME_PATTERN}$")
    # the job kind (trainer/kinds.py); the data kinds' configs are controller/jobconfig.py's
    kind: Literal["train"] = "train"
    trainer: TrainerSection  # type: ignore[valid-type]
    # The file it was read from (absolute), so a printed resume line names it exactly.
    _source_file: Optional[str] = PrivateAttr(default=None)
    # what the command line changed over the file, as --set KEY=VALUE, so a resume line
    # (controller/rollback.py) starts the run the way it was started
    _command_line_sets: list[str] = PrivateAttr(default_factory=list)
    wandb: WandbSection = Field(default_factory=WandbSection)
    baseline: BaselineSection = Field(default_factory=BaselineSection)
    supervision: SupervisionSection = Field(default_factory=SupervisionSection)  # type: ignore[valid-type]
    job: Optional[JobSection] = None
    # this run's own [notify], over the controller config's (controller/notifyconfig.py)
    notify: Optional[dict] = None

    @field_validator("notify")
    @classmethod
    def _notify(cls, value: Any) -> Any:
        if value is not None:
            from controller.notifyconfig import check_table

            check_table(value)
        return value

    @field_validator("trainer", mode="before")
    @classmethod
    def _not_in_config(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                dest = key.replace("-", "_")
                if dest in NOT_IN_CONFIG:
                    raise ValueError(f"{key}: not a run-config setting: {NOT_IN_CONFIG[dest]}")
                if dest in WANDB_FLAGS:
                    raise ValueError(f"{key}: wandb settings live in the [wandb] table as "
                                     f"{WANDB_FLAGS[dest].replace('_', '-')} = …")
        return data

    # -- what launch needs ------------------------------------------------------------------
    def values(self) -> dict[str, Any]:
        """Trainer flag values by dest, wandb included, start decision not."""
        out = dict(flags.defaults())
        out.update(self.trainer.model_dump())
        out.update({dest: getattr(self.wandb, attr) for dest, attr in WANDB_FLAGS.items()})
        for dest in NOT_IN_CONFIG:
            out[dest] = flags.BY_DEST[dest].default
        return out

    def resolve(self, start: Mapping[str, Any], *, run_id: str, run_dir: str, workspace: str) -> dict[str, Any]:
        """Values for ``flags.to_argv``: placeholders filled, the start decision added."""
        subst = {"run_id": run_id, "run_dir": run_dir, "workspace": workspace}
        values = self.values()
        values.update(start)
        for dest, value in values.items():
            if isinstance(value, str) and "{" in value:
                values[dest] = fill(value, subst, flags.BY_DEST[dest].name)
        return values


def fill(text: str, subst: Mapping[str, str], where: str) -> str:
    try:
        return text.format(**subst)
    except (KeyError, IndexError, ValueError) as exc:
        raise RunConfigError(f"{where} = {text!r}: unknown placeholder {exc}; "
                             f"use only {', '.join('{' + p + '}' for p in PLACEHOLDERS)}") from None


# --- loading and overrides -------------------------------------------------------------------

def _set_override(data: dict[str, Any], key: str, value: Any) -> None:
    """Put ``key`` (a trainer flag like ``lr``/``--lr``, or ``wandb.run-name``) into ``data``."""
    key = key.strip().lstrip("-")
    if "." in key:
        table, sub = key.split(".", 1)
        if table not in ("trainer", "wandb", "baseline", "supervision"):
            raise RunConfigError(f"--set {key}: unknown table {table!r}; use trainer.KEY, wandb.KEY, baseline.KEY "
                                 "or supervision.KEY")
        section = data.setdefault(table, {})
    else:
        table, sub = "trainer", key
        dest = key.replace("-", "_")
        if dest in WANDB_FLAGS:
            table, sub = "wandb", WANDB_FLAGS[dest].replace("_", "-")
        section = data.setdefault(table, {})
    if isinstance(value, str):
        model = {"trainer": TrainerSection, "wandb": WandbSection, "baseline": BaselineSection,
                 "supervision": SupervisionSection}.get(table)
        value = typed_set_value(model, sub, value)
    # One spelling per field: drop any other spelling already present, the override wins.
    norm = sub.replace("_", "-")
    for existing in list(section):
        if existing.replace("_", "-") == norm:
            del section[existing]
    section[norm] = value


def _scalar_types(annotation: Any) -> set:
    """The plain types a field's annotation admits (Optional, Union, Annotated and Literal
    unwrapped; a Literal admits its values' types)."""
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _scalar_types(typing.get_args(annotation)[0])
    if origin is Literal:
        return {type(v) for v in typing.get_args(annotation)}
    if origin is Union or type(annotation).__name__ == "UnionType":
        return set().union(*(_scalar_types(a) for a in typing.get_args(annotation)))
    return {origin or annotation}


def typed_set_value(model: Optional[type[BaseModel]], key: str, text: str) -> Any:
    """A `--set KEY=VALUE` value as the run-config file would hold it, so that one rule judges
    both (`--set max-steps=24.0` was taken, `max-steps = 24.0` in the file refused): for a
    field that holds a number or true/false, VALUE is read as the TOML value it
    spells (24.0 is a float, true a boolean, nan a float that is not finite); anything else,
    and a VALUE that is not a TOML value ("auto", "0,1"), stays text for the field to parse."""
    field = None
    if model is not None:
        norm = key.replace("-", "_")
        field = next((f for n, f in model.model_fields.items() if n == norm or (f.alias or "").replace("-", "_") == norm),
                     None)
    if field is None:
        return text
    kinds = _scalar_types(field.annotation) - {type(None)}
    if not kinds & {int, float, bool}:
        return text
    try:
        return tomllib.loads(f"v = {text.strip()}")["v"]
    except (tomllib.TOMLDecodeError, ValueError):
        return text


def parse_set(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        if "=" not in item:
            raise RunConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set lr=3e-4")
        key, value = item.split("=", 1)
        out.append((key.strip(), value))
    return out


def not_utf8(exc: UnicodeDecodeError) -> str:
    """One line for a file that is not UTF-8 text (TOML files must be)."""
    return (f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); save it as UTF-8")


def _set_text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def from_dict(data: dict[str, Any], *, source: str = "run config", default_name: str = "run",
              overrides: Mapping[str, Any] | None = None, sets: list[str] | None = None) -> RunConfig:
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    data.setdefault("name", default_name)
    data.setdefault("trainer", {})
    for key, value in parse_set(sets or []):
        _set_override(data, key, value)
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_override(data, key, value)
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise RunConfigError(format_errors(exc, source)) from None
    problems = [p for p in flags.check({**config.values(), "from_scratch": True}) if "start decision" not in p]
    if problems:
        raise RunConfigError(f"{source}: " + "\n  ".join(problems))
    return config


def _flag_for(loc: tuple) -> Optional[flags.Flag]:
    if len(loc) >= 2 and loc[0] == "trainer":
        return flags.BY_DEST.get(str(loc[1]).replace("-", "_"))
    return None


def format_errors(exc: ValidationError, source: str) -> str:
    """One line per problem: where ([table] key), the value, what is wrong and the fix."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        # Drop pydantic's union/type-branch suffixes (e.g. 'int', "literal['auto']").
        loc = tuple(p for p in loc if not (p in ("int", "str", "float", "bool") or p.startswith(("literal[", "tuple["))))
        where = f"[{loc[0]}] {loc[1]}" if len(loc) >= 2 else (loc[0] if loc else "(top level)")
        msg = err["msg"].removeprefix("Value error, ")
        if len(loc) == 1 and loc[0] in ("trainer", "wandb", "baseline") and ": " in msg:
            key, msg = msg.split(": ", 1)  # a table-level check that names its own key
            lines.append(f"[{loc[0]}] {key}: {msg}")
            continue
        flag = _flag_for(loc)
        if err["type"] == "missing":
            fix = f"set {loc[-1]} in the file" + (f" or pass {flag.name} to ctl launch" if flag else "")
            what = f"{flag.help}" if flag else "required"
            lines.append(f"{where}: missing ({what}); {fix}")
            continue
        if err["type"] == "extra_forbidden":
            known = _known_keys(loc[0]) if loc else []
            hint = _closest(loc[-1], known)
            lines.append(f"{where}: unknown setting" + (f"; did you mean {hint!r}?" if hint else
                                                         f"; known: {', '.join(known)}" if known else ""))
            continue
        got = err.get("input")
        value = f" = {_shown(got)}" if got is not None and not isinstance(got, dict) else ""
        fix = f" ({flag.help})" if flag else ""
        lines.append(f"{where}{value}: {msg}{fix}")
    return f"{source}: " + "\n  ".join(lines)


def _known_keys(table: str) -> list[str]:
    model = {"trainer": TrainerSection, "wandb": WandbSection, "baseline": BaselineSection,
             "supervision": SupervisionSection}.get(table)
    if model is None:
        return ["name", "kind", "trainer", "wandb", "baseline", "supervision", "job"]
    return [(f.alias or n) for n, f in model.model_fields.items()]


def _closest(word: str, options: list[str]) -> Optional[str]:
    import difflib

    match = difflib.get_close_matches(word.replace("_", "-"), options, n=1, cutoff=0.6)
    return match[0] if match else None


def start_decision(from_scratch: bool, resume_from: Optional[str], init_from: Optional[str]) -> dict[str, Any]:
    """The start flags from `ctl launch`'s options; exactly one, or RunConfigError with the help."""
    for option, value in (("--resume-from", resume_from), ("--init-from", init_from)):
        if value is None:
            continue
        if not value.strip():  # an unset $CKPT: not "no start decision"
            raise RunConfigError(f"{option} {value!r}: the checkpoint path is empty; name the checkpoint "
                                 "(`ctl status` shows a run's last one)")
        why = container_path_problem(value, "/workspace/runs/RUN/output/step_N/checkpoint.pt")
        if why:
            raise RunConfigError(f"{option} {value!r}: the checkpoint path {why}")
    chosen = {"from_scratch": bool(from_scratch), "resume_from": resume_from or None, "init_from": init_from or None}
    names = flags.start_decision(chosen)
    if not names:
        raise RunConfigError(f"no start decision: {flags.START_DECISION_HELP}")
    if len(names) > 1:
        raise RunConfigError(f"{' and '.join(names)} conflict: choose exactly one start decision "
                             f"({flags.START_DECISION_HELP})")
    return chosen
