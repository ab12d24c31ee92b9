"""Command groups of `ctl`. Each module exposes ``register(app)``; add new ones to GROUPS."""

from __future__ import annotations

import importlib

import typer

GROUPS: list[str] = ["remote", "sim", "envs", "rollback", "run", "export"]


def register_all(app: typer.Typer) -> None:
    for name in GROUPS:
        importlib.import_module(f"controller.commands.{name}").register(app)
