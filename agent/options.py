"""How the agent supervises a run: one field per `agent start` flag, with its default and
help, defined once. The start verb's parser (agent/cli.py), spec.json's "options", the
supervisor (agent/supervisor.py imports it as ``Options``) and the controller's run config
(controller/runconfig.py reads the defaults) all follow from this table.

Standard library only and free of side effects: the controller imports it too.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping


def _opt(default: Any, help: str, type: type = float):  # noqa: A002 - argparse's own words
    return field(default=default, metadata={"help": help, "type": type})


@dataclass(frozen=True)
class Options:
    """The supervision settings of one run; the flag of ``name`` is ``--name`` with dashes."""

    gpu_interval: float = _opt(10.0, "seconds between GPU samples")
    stall_timeout: float = _opt(300.0, "seconds without heartbeat progress before a rank counts as stalled "
                                       "(0: off)")
    # A rank's first heartbeat comes once it has joined the process group, before the model
    # loads (trainer/train.py), so this covers the interpreter, the imports and the rendezvous
    # of every rank; loading and compiling come after it. 15 minutes is several times what
    # 8 ranks importing torch from a cold network filesystem take.
    startup_timeout: float = _opt(900.0, "seconds within which every rank must send its first heartbeat; past "
                                         "it the run fails naming the ranks that never started (0: off)")
    revive: float = _opt(1.0, "seconds after the agent's death before the job's monitor starts a new agent, "
                              "which re-attaches (0: never)")
    baseline_tokens_per_s: float | None = _opt(None, "steady tokens/s of the known-good run; a run this far "
                                                     "below it (--regression-fraction) is stopped")
    regression_fraction: float = _opt(0.3, "allowed drop below --baseline-tokens-per-s, as a fraction")
    max_restarts: int = _opt(0, "restarts from the run's latest checkpoint after a failure", int)
    kill_grace: float = _opt(10.0, "seconds between SIGTERM and SIGKILL when the agent stops a failed run")
    settle: float = _opt(1.5, "seconds of evidence gathering after a first failure, before deciding")

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in fields(cls):
            default = f"default {f.default}" if f.default is not None else "default: none"
            parser.add_argument(cls.flag(f.name), dest=f.name, type=f.metadata["type"], default=f.default,
                                help=f"{f.metadata['help']} ({default})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Options":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "Options":
        """spec.json's "options"; keys this version does not know are left out."""
        given = spec.get("options") or {}
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name in given})

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def argv(cls, values: Mapping[str, Any]) -> list[str]:
        """`agent start` flags for ``values`` ({name: value}); None means the agent's default.
        An unknown name is a bug of the caller, never a flag the agent would refuse later."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"not an agent start option: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        out: list[str] = []
        for name, value in sorted(values.items()):
            if value is not None:
                out += [cls.flag(name), str(value)]
        return out
