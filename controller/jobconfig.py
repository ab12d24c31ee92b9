"""Run configs of the data kinds (trainer/kinds.py: ``kind = "prepare"`` or
``"regenerate"``), validated before a connection is opened.

    name = "chat"
    kind = "prepare"
    [prepare]                     # the kind's own flags, named as on its command line without "--"
    input = ["/workspace/chat.jsonl"]
    out = "/workspace/data/chat"
    [supervision]                 # the agent's start options, as for training

The table's model is generated from the kind's own argument parser (its one source of truth,
named in trainer/kinds.py): one field per option, its type, choices, default and help. A
config is then checked the way the job will see it: the argv the start script carries is
parsed by that same parser, so the controller refuses exactly what the job would, with its
words, before anything starts. Path values may use ``{run_id}``, ``{run_dir}`` and
``{workspace}`` as in a training config.

A data job has no start decision: a relaunch of the same config after a stop resumes the way
its kind says (trainer/kinds.py ``resumes_by``).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, create_model
from typing_extensions import Annotated

from agent.protocol import RUN_NAME_PATTERN
from controller.runconfig import (PLACEHOLDERS, RunConfigError, SupervisionSection, _shown, exact, fill, parse_set,
                                  typed_set_value)
from trainer import kinds


def options_of(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's options that a run config may set (not --help)."""
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def option_name(action: argparse.Action) -> str:
    longs = [s for s in action.option_strings if s.startswith("--")]
    return (longs or action.option_strings)[0]


def _is_list(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*") or isinstance(action, (argparse._AppendAction, argparse._ExtendAction)) \
        or isinstance(action.nargs, int) and action.nargs > 1


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, (str, int, float)) and not isinstance(value, bool) else value


def value_kind(action: argparse.Action) -> Optional[str]:
    """"int", "float" or None (text, a choice, a switch) for an option's values: the parser's
    own type, or the ``kind`` a typed bound carries (trainer/flags.py bounded)."""
    return {int: "int", float: "float"}.get(action.type) or getattr(action.type, "kind", None)


def _field(action: argparse.Action) -> tuple[Any, Any]:
    # a number is held to its exact type first (true is not 1, 24.0 not 24, "8" not 8: the
    # rule of a training config's values, controller/runconfig.py exact), then the parser's
    # own converter judges its range
    kind = value_kind(action)
    scalar: Any = {"int": int, "float": float}.get(kind) or \
        {str: str, None: str}.get(action.type, Union[int, float, str])
    if kind:
        scalar = Annotated[scalar, BeforeValidator(lambda value, kind=kind: _exact_number(kind, value))]
    if action.choices:
        scalar = Literal[tuple(action.choices)]  # type: ignore[valid-type]
    if _is_switch(action):
        typ: Any = Annotated[bool, BeforeValidator(lambda value: exact("bool", value))]
    elif _is_list(action):
        typ = Annotated[list[scalar], BeforeValidator(_as_list)]
    else:
        typ = scalar
    required = bool(action.required)
    if not required:
        typ = Optional[typ]
    default = ... if required else action.default
    return typ, Field(default, alias=option_name(action).lstrip("-"), description=(action.help or "").replace("%%", "%"))


def _exact_number(kind: str, value: Any) -> Any:
    """A file's number of the exact type; text (never from a file for a number field: --set
    values are typed first, runconfig.typed_set_value) is refused the same way."""
    if isinstance(value, str):
        raise ValueError(f"must be a {'whole number' if kind == 'int' else 'number'}, not the text {value!r}")
    return exact(kind, value)


def section_model(kind: kinds.Kind) -> type[BaseModel]:
    parser = kind.build_parser()
    fields = {a.dest: _field(a) for a in options_of(parser) if a.dest not in dict(kind.not_in_config)}
    # finite numbers only, as in a training config: nan and inf compare false against every bound
    return create_model(f"{kind.name.title()}Section",
                        __config__=ConfigDict(extra="forbid", populate_by_name=True, frozen=True,
                                              allow_inf_nan=False), **fields)


class _DataJob(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    name: str = Field(..., pattern=f"^{RUN_NAME_PATTERN}$")  # run ids start with it
    supervision: SupervisionSection = Field(default_factory=SupervisionSection)  # type: ignore[valid-type]
    _source_file: Optional[str] = PrivateAttr(default=None)
    _command_line_sets: list[str] = PrivateAttr(default_factory=list)

    @property
    def job_kind(self) -> kinds.Kind:
        return kinds.get(self.kind)  # type: ignore[attr-defined]

    def values(self) -> dict[str, Any]:
        """The kind's option values by dest, as the config gives them."""
        return getattr(self, self.job_kind.table).model_dump()

    def resolve(self, *, run_id: str, run_dir: str, workspace: str) -> dict[str, Any]:
        subst = {"run_id": run_id, "run_dir": run_dir, "workspace": workspace}
        out = {}
        for dest, value in self.values().items():
            if isinstance(value, str) and "{" in value:
                value = fill(value, subst, dest.replace("_", "-"))
            elif isinstance(value, list):
                value = [fill(v, subst, dest.replace("_", "-")) if isinstance(v, str) and "{" in v else v for v in value]
            out[dest] = value
        return out

    def argv(self, values: Mapping[str, Any]) -> list[str]:
        """``python -m trainer`` arguments: the kind's subcommand, then its flags in parser order."""
        return [*self.job_kind.subcommand, *to_argv(self.job_kind.build_parser(), values)]

    def paths(self, values: Mapping[str, Any]) -> dict[str, list[str]]:
        """{"reads": [...], "writes": [...]}: what a launch must not share with a live run."""
        def flat(dests):
            out = []
            for d in dests:
                v = values.get(d)
                out += [str(x) for x in v] if isinstance(v, (list, tuple)) else ([str(v)] if v else [])
            return out
        return {"reads": flat(self.job_kind.reads), "writes": flat(self.job_kind.writes)}


def to_argv(parser: argparse.ArgumentParser, values: Mapping[str, Any]) -> list[str]:
    argv: list[str] = []
    for a in options_of(parser):
        v = values.get(a.dest, a.default)
        name = option_name(a)
        if v is None or (_is_switch(a) and bool(v) == bool(a.default)):
            continue
        if _is_switch(a):
            argv.append(name)
        elif isinstance(a, argparse._AppendAction):
            for item in v:
                argv += [name, str(item)]
        elif _is_list(a):
            if v == a.default or not v:
                continue
            argv += [name, *map(str, v)]
        elif v != a.default or a.required:
            argv += [name, str(v)]
    return argv


class _ParseError(Exception):
    pass


def parse_problems(parser: argparse.ArgumentParser, argv: list[str]) -> Optional[str]:
    """The kind's own parser's verdict on ``argv``: None, or its one-line error."""
    def error(message: str):
        raise _ParseError(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        parser.parse_args(argv)
    except _ParseError as exc:
        return str(exc)
    except SystemExit:  # a parser that exits by itself (a custom action)
        return f"{parser.prog} refused {' '.join(argv)}"
    return None


_MODELS: dict[str, type[BaseModel]] = {}
_SECTIONS: dict[str, type[BaseModel]] = {}


def section_model_of(kind: kinds.Kind) -> type[BaseModel]:
    if kind.name not in _SECTIONS:
        try:
            _SECTIONS[kind.name] = section_model(kind)
        except ImportError as exc:
            raise RunConfigError(f"kind = {kind.name!r}: its command ({kind.parser}) is not in this version of "
                                 f"dflash-ctl ({exc})") from None
    return _SECTIONS[kind.name]


def model_for(name: str) -> type[BaseModel]:
    kind = kinds.get(name)
    if name not in _MODELS:
        section = section_model_of(kind)
        _MODELS[name] = create_model(f"{name.title()}JobConfig", __base__=_DataJob,
                                     kind=(Literal[name], ...),  # type: ignore[valid-type]
                                     **{kind.table: (section, ...)})
    return _MODELS[name]


def from_dict(data: dict[str, Any], *, source: str, default_name: str, sets: list[str] | None = None) -> _DataJob:
    kind = kinds.get(str(data.get("kind")))
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    data.setdefault("name", default_name)
    if "trainer" in data:
        raise RunConfigError(f"{source}: [trainer]: a {kind.name} job has no trainer flags; its options go in "
                             f"[{kind.table}] (or set kind = \"train\")")
    for key, value in parse_set(sets or []):
        table, dot, sub = key.lstrip("-").partition(".")
        if not dot:
            table, sub = kind.table, table
        if table not in (kind.table, "supervision"):
            raise RunConfigError(f"--set {key}: a {kind.name} job has the tables [{kind.table}] and [supervision]")
        section = data.setdefault(table, {})
        for existing in [k for k in section if k.replace("_", "-") == sub.replace("_", "-")]:
            del section[existing]
        model = section_model_of(kind) if table == kind.table else SupervisionSection
        section[sub.replace("_", "-")] = typed_set_value(model, sub, value)  # the file's rule
    data.setdefault(kind.table, {})
    for key in data[kind.table] if isinstance(data[kind.table], dict) else ():
        why = dict(kind.not_in_config).get(key.replace("-", "_"))
        if why:
            raise RunConfigError(f"{source}: [{kind.table}] {key}: not a run-config setting: {why}")
    model = model_for(kind.name)
    try:
        config = model.model_validate(data)
    except ValidationError as exc:
        raise RunConfigError(format_errors(exc, source, model, kind)) from None
    parser = kind.build_parser()
    # placeholders filled with stand-ins: the parser judges values, not run ids
    values = config.resolve(run_id="RUN", run_dir="/RUN_DIR", workspace="/WORKSPACE")
    problem = parse_problems(parser, to_argv(parser, values))
    if problem:
        raise RunConfigError(f"{source}: [{kind.table}]: {problem}")
    return config


def format_errors(exc: ValidationError, source: str, model: type[BaseModel], kind: kinds.Kind) -> str:
    section = model.model_fields[kind.table].annotation
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not str(p).startswith(("literal[", "list[")) and str(p) not in
               ("int", "str", "float", "bool", "function-before[_as_list(), list[str]]")]
        loc = [p for p in loc if not p.startswith("function-")]
        where = f"[{loc[0]}] {loc[1]}" if len(loc) >= 2 else (loc[0] if loc else "(top level)")
        if err["type"] == "missing":
            field = section.model_fields.get(loc[-1].replace("-", "_")) if len(loc) >= 2 else None
            lines.append(f"{where}: missing ({field.description if field and field.description else 'required'}); "
                         "set it in the file or with --set")
        elif err["type"] == "extra_forbidden":
            known = ([f.alias or n for n, f in section.model_fields.items()] if len(loc) >= 2 and loc[0] == kind.table
                     else ["name", "kind", kind.table, "supervision"])
            lines.append(f"{where}: unknown setting for a {kind.name} job; known: {', '.join(known)}")
        else:
            got = err.get("input")
            value = f" = {_shown(got)}" if got is not None and not isinstance(got, dict) else ""
            lines.append(f"{where}{value}: {err['msg'].removeprefix('Value error, ')}")
    return f"{source}: " + "\n  ".join(lines)


__all__ = ["PLACEHOLDERS", "from_dict", "model_for", "to_argv", "parse_problems"]
