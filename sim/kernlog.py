#!/usr/bin/python3
"""`journalctl` and `dmesg` of the simulated node, over the node's own kernel log.

Installed as ``<node state>/bin/journalctl`` and ``<node state>/bin/dmesg`` (sim/node.py
copies this file to both; it acts as the name it was called by), the first entries of the
node's login PATH as ``pct`` is. The log is ``<node state>/kernel.jsonl``, one record a line
(``{"ts": epoch seconds, "priority": 0-7, "message": …}``); tests append to it through
``SimNode.kernel_log()`` what a real kernel would have printed (an OOM kill, an ``NVRM: Xid``).
Standard library only, self-contained: it runs on the node, outside any venv.

What is reproduced (docs/sim.md names the source of each):

- ``journalctl [-k|--dmesg] [-b] [-S|--since T] [-U|--until T] [-o|--output short|short-iso|json|cat]
  [--no-pager] [-q|--quiet] [--utc]``: ``T`` as ``@<epoch>``, ``YYYY-MM-DD[ HH:MM[:SS]]``,
  ``now``, ``today``; an unparsable one is "Failed to parse timestamp: T", exit 1.
  ``-o json`` prints journalctl's export fields (``__REALTIME_TIMESTAMP`` µs, ``MESSAGE``…);
  ``short-iso`` ``2026-12-05T19:41:04+0000 host kernel: …`` (systemd before 254, Proxmox VE
  7/8) or ``+00:00`` (systemd 254 and later, Proxmox VE 9). Nothing found prints
  ``-- No entries --`` unless ``-q``. A user who is not root (nor in group adm or
  systemd-journal) sees no system messages, only journalctl's hint about it on stderr.
- ``dmesg [--time-format iso|ctime|notime|reltime|delta|raw] [-T]``: iso is
  ``2026-12-05T19:41:04,842881+00:00 …``, the default ``[ 1234.567890] …`` from boot.
  A user who is not root gets "dmesg: read kernel buffer failed: Operation not permitted"
  (Debian kernels set kernel.dmesg_restrict = 1).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

STATE = Path(__file__).resolve().parent.parent
LOG = STATE / "kernel.jsonl"
# Proxmox VE 9 is Debian 13, whose systemd (257) writes short-iso's offset as +00:00.
NEW_SYSTEMD_PVE = ("9.",)


def _node() -> dict:
    try:
        return json.loads((STATE / "node.json").read_text())
    except (OSError, ValueError):
        return {}


def _records() -> list[dict]:
    out = []
    try:
        text = LOG.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("ts"), (int, float)) and isinstance(rec.get("message"), str):
            out.append(rec)
    return sorted(out, key=lambda r: r["ts"])


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def _hostname() -> str:
    return _node().get("name") or os.uname().nodename


def _is_root() -> bool:
    return os.geteuid() == 0


# --- journalctl -------------------------------------------------------------------------------

def _parse_time(text: str) -> float:
    now = time.time()
    if text == "now":
        return now
    if text.startswith("@"):
        return float(text[1:])
    if text in ("today", "yesterday", "tomorrow"):
        day = datetime.now().replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
        return day + {"today": 0, "yesterday": -86400, "tomorrow": 86400}[text]
    for fmt in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y-%m-%d", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.strptime(text, fmt).timestamp()
        except ValueError:
            pass
    raise ValueError(text)


def _iso_offset(ts: float, utc: bool, colon: bool) -> str:
    dt = datetime.fromtimestamp(ts, timezone.utc) if utc else datetime.fromtimestamp(ts).astimezone()
    off = dt.strftime("%z")
    return dt.strftime("%Y-%m-%dT%H:%M:%S") + (f"{off[:3]}:{off[3:]}" if colon else off)


def journalctl(argv: list[str]) -> int:
    since = until = None
    output, quiet, utc = "short", False, False
    args = list(argv)
    while args:
        a = args.pop(0)
        key, eq, val = a.partition("=")
        if a in ("-k", "--dmesg", "--no-pager", "--no-hostname"):
            continue
        if a in ("-b", "--boot") or key == "--boot":
            if args and not args[0].startswith("-"):
                args.pop(0)  # a boot id or offset: the sim has one boot
            continue
        if a in ("-q", "--quiet"):
            quiet = True
            continue
        if a == "--utc":
            utc = True
            continue
        if a in ("-S", "--since", "-U", "--until", "-o", "--output") or key in ("--since", "--until", "--output"):
            if not eq:
                if not args:
                    print(f"journalctl: option '{a}' requires an argument", file=sys.stderr)
                    return 1
                val = args.pop(0)
            name = key if eq else a
            if name in ("-o", "--output"):
                if val not in ("short", "short-iso", "json", "cat"):
                    print(f'Unknown output format "{val}".', file=sys.stderr)
                    return 1
                output = val
                continue
            try:
                when = _parse_time(val)
            except ValueError:
                print(f"Failed to parse timestamp: {val}", file=sys.stderr)
                return 1
            if name in ("-S", "--since"):
                since = when
            else:
                until = when
            continue
        print(f"journalctl: unrecognized option '{a}'", file=sys.stderr)
        return 1
    if not _is_root():
        if not quiet:
            print("Hint: You are currently not seeing messages from other users and the system.\n"
                  "      Users in groups 'adm', 'systemd-journal' can see all messages.\n"
                  "      Pass -q to turn off this notice.", file=sys.stderr)
        records = []
    else:
        records = [r for r in _records() if (since is None or r["ts"] >= since) and (until is None or r["ts"] <= until)]
    host, boot = _hostname(), _boot_time()
    colon = str(_node().get("pve") or "9.1").startswith(NEW_SYSTEMD_PVE)
    for i, r in enumerate(records):
        ts = r["ts"]
        if output == "json":
            print(json.dumps({"__CURSOR": f"s=sim;i={i:x}", "__REALTIME_TIMESTAMP": str(int(ts * 1e6)),
                              "__MONOTONIC_TIMESTAMP": str(int(max(0.0, ts - boot) * 1e6)), "_BOOT_ID": "0" * 32,
                              "PRIORITY": str(r.get("priority", 6)), "SYSLOG_FACILITY": "0",
                              "SYSLOG_IDENTIFIER": "kernel", "_TRANSPORT": "kernel", "_HOSTNAME": host,
                              "MESSAGE": r["message"]}, separators=(",", ":")))
        elif output == "cat":
            print(r["message"])
        elif output == "short-iso":
            print(f"{_iso_offset(ts, utc, colon)} {host} kernel: {r['message']}")
        else:
            dt = datetime.fromtimestamp(ts, timezone.utc) if utc else datetime.fromtimestamp(ts)
            print(f"{dt.strftime('%b %d %H:%M:%S')} {host} kernel: {r['message']}")
    if not records and not quiet:
        print("-- No entries --")
    return 0


# --- dmesg ------------------------------------------------------------------------------------

def dmesg(argv: list[str]) -> int:
    fmt = "reltime-default"
    args = list(argv)
    while args:
        a = args.pop(0)
        key, eq, val = a.partition("=")
        if a in ("-T", "--ctime"):
            fmt = "ctime"
            continue
        if a in ("-k", "--kernel", "-x", "--decode", "-L", "--color", "--nopager", "-P"):
            continue
        if a == "--time-format" or key == "--time-format":
            if not eq:
                if not args:
                    print("dmesg: option '--time-format' requires an argument", file=sys.stderr)
                    return 1
                val = args.pop(0)
            if val not in ("iso", "ctime", "notime", "reltime", "delta", "raw"):
                print(f"dmesg: unknown time format: {val}", file=sys.stderr)
                return 1
            fmt = val
            continue
        print(f"dmesg: unrecognized option '{a}'\nTry 'dmesg --help' for more information.", file=sys.stderr)
        return 1
    if not _is_root():
        print("dmesg: read kernel buffer failed: Operation not permitted", file=sys.stderr)
        return 1
    boot = _boot_time()
    for r in _records():
        ts, msg = r["ts"], r["message"]
        if fmt == "iso":
            dt = datetime.fromtimestamp(ts).astimezone()
            off = dt.strftime("%z")
            print(f"{dt.strftime('%Y-%m-%dT%H:%M:%S')},{dt.microsecond:06d}{off[:3]}:{off[3:]} {msg}")
        elif fmt == "ctime":
            print(f"[{datetime.fromtimestamp(ts).strftime('%a %b %e %H:%M:%S %Y')}] {msg}")
        elif fmt == "notime":
            print(msg)
        else:
            print(f"[{max(0.0, ts - boot):12.6f}] {msg}")
    return 0


def main() -> int:
    name = os.path.basename(sys.argv[0])
    if name == "dmesg":
        return dmesg(sys.argv[1:])
    return journalctl(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
