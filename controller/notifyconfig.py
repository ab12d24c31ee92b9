"""The ``[notify]`` tables of the controller config (docs/alerts.md): where alerts go and when
they are raised, at four levels, each over the one before:

    [notify]                                   the file's: every node, every container
    [nodes.N.notify]                           one node
    [nodes.N.containers.C.notify]              one container
    [notify] in a run config                   one run

A table holds ``channels`` (by name; a later level's channel of the same name replaces it
whole, ``enabled = false`` switches it off) and ``thresholds`` (key by key). Channel secrets
are environment variable NAMES (``url_env = "ALERT_WEBHOOK_URL"``); their values are read
from the operator's environment when a run is configured and by `ctl watch`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from agent.alerts import Thresholds
from agent.notify import check_channel, secret_names

TABLE_KEYS = ("channels", "thresholds")


def check_table(table: Any, where: str = "notify") -> None:
    """One level's table; ValueError "where.key: what" naming the field."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: must be a table (got {table!r})")
    for key in table:
        if key not in TABLE_KEYS:
            raise ValueError(f"{where}.{key}: unknown key (known: {', '.join(TABLE_KEYS)})")
    channels = table.get("channels") or {}
    if not isinstance(channels, dict):
        raise ValueError(f"{where}.channels: must be a table of channels by name")
    for name, ch in channels.items():
        try:
            check_channel(name, ch)
        except ValueError as exc:
            raise ValueError(str(exc).replace("notify.", f"{where}.", 1)) from None
    Thresholds.from_json(table.get("thresholds"), f"{where}.thresholds")


def merge(*levels: Optional[Mapping]) -> dict:
    """The effective notify settings of the levels, first to last."""
    channels: dict[str, dict] = {}
    thresholds: dict[str, Any] = {}
    for level in levels:
        if not level:
            continue
        for name, ch in (level.get("channels") or {}).items():
            channels[name] = dict(ch)
        thresholds.update(level.get("thresholds") or {})
    return {"channels": {n: c for n, c in channels.items() if c.get("enabled", True) is not False},
            "thresholds": thresholds}


def for_container(node, ctid: Any, run_notify: Optional[Mapping] = None) -> dict:
    """The settings of one container of ``node`` (a NodeConfig), with a run config's on top."""
    container = (node.containers or {}).get(str(ctid))
    return merge(getattr(node, "notify_base", None), node.notify, container.notify if container else None, run_notify)


def secrets(channels: Mapping[str, dict], environ: Mapping[str, str] = os.environ) -> tuple[dict, list[str]]:
    """({NAME: value} of the channels' variables set here, [names not set here])."""
    names = secret_names(channels)
    return {n: environ[n] for n in names if environ.get(n)}, [n for n in names if not environ.get(n)]
