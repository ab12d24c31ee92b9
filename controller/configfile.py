"""A run config file read, whatever its job kind: the TOML parsed once, then validated by the
kind's own model (controller/runconfig.py for training, controller/jobconfig.py for the data
kinds). Its own module because jobconfig builds on runconfig's sections: the dispatch in either
would make the two import each other."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping

from controller import jobconfig, runconfig
from controller.runconfig import RunConfigError


def load(path: str | Path, overrides: Mapping[str, Any] | None = None,
         sets: list[str] | None = None) -> Any:
    """Read, merge CLI overrides (None values ignored), validate. Raises RunConfigError.
    A training config gives a runconfig.RunConfig, a data kind jobconfig's model."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunConfigError(f"run config {path} does not exist: pass --config with an existing file "
                             "(examples/tiny.toml is one)") from None
    except OSError as exc:
        raise RunConfigError(f"run config {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise RunConfigError(f"run config {path}: {runconfig.not_utf8(exc)}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RunConfigError(f"run config {path} is not valid TOML: {exc}") from None
    if data.get("kind", "train") != "train":
        config = _data_job(data, path, overrides, sets)
    else:
        config = runconfig.from_dict(data, source=str(path), default_name=path.stem, overrides=overrides, sets=sets)
    config._source_file = str(path.resolve())
    config._command_line_sets = [
        *(f"{dest.replace('_', '-')}={runconfig._set_text(v)}" for dest, v in (overrides or {}).items() if v is not None),
        *(sets or [])]
    return config


def _data_job(data: dict[str, Any], path: Path, overrides: Mapping[str, Any] | None, sets: list[str] | None):
    from trainer import kinds

    try:
        kind = kinds.get(str(data["kind"]))
    except ValueError as exc:
        raise RunConfigError(f"run config {path}: {exc}") from None
    given = sorted(k for k, v in (overrides or {}).items() if v is not None)
    if given:
        raise RunConfigError(f"--{given[0].replace('_', '-')}: a training option, and {path} is a {kind.name} job; "
                             f"set its options in [{kind.table}] or with --set {kind.table}.KEY=VALUE")
    return jobconfig.from_dict(data, source=str(path), default_name=path.stem, sets=sets)
