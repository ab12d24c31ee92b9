"""Package sets compared: which packages went up, down, in or out between two fingerprints,
with enough of PEP 440's ordering to say up or down (standard library only: it runs with the
container's system python3, agent/envgen.py).
"""

from __future__ import annotations

import re
from typing import Any

_PRE = {"dev": 0, "a": 1, "alpha": 1, "b": 2, "beta": 2, "rc": 3, "c": 3, "pre": 3, "preview": 3}


def version_key(v: str) -> tuple:
    """Sort key for a version string: release, then dev < a < b < rc < final < post, then
    the local label (``+cu128``). Unknown shapes compare as text after every known one."""
    main, _, local = v.strip().lower().partition("+")
    main = main.lstrip("v")
    m = re.match(r"^(?:(\d+)!)?(\d+(?:\.\d+)*)(.*)$", main)
    if not m:
        return (1, v)
    epoch = int(m.group(1) or 0)
    release = [int(x) for x in m.group(2).split(".")]
    while release and release[-1] == 0:
        release.pop()
    rest = m.group(3)
    phase = (4, 0)  # final
    post = -1
    dev = None
    for tag, num in re.findall(r"[._-]?(dev|alpha|beta|preview|pre|rc|post|a|b|c)[._-]?(\d*)", rest):
        n = int(num or 0)
        if tag == "post":
            post = n
        elif tag == "dev":
            dev = n
        else:
            phase = (_PRE[tag], n)
    if dev is not None and phase == (4, 0) and post < 0:
        phase = (0, dev)  # 1.0.dev1 sorts before 1.0a1
    return (0, epoch, tuple(release), phase, post, dev if dev is not None else 1 << 30, local)


def diff_packages(old: dict, new: dict) -> dict:
    """What changes when going from package set ``old`` to ``new`` ({name: version})."""
    out: dict[str, Any] = {"up": [], "down": [], "added": [], "removed": []}
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a is None:
            out["added"].append({"name": name, "to": b})
        elif b is None:
            out["removed"].append({"name": name, "from": a})
        else:
            key = "up" if version_key(b) > version_key(a) else "down"
            out[key].append({"name": name, "from": a, "to": b})
    return out


def diff_fingerprints(old: dict, new: dict) -> dict:
    d = diff_packages(old.get("packages", {}), new.get("packages", {}))
    tb_old = (old.get("torch") or {}).get("build")
    tb_new = (new.get("torch") or {}).get("build")
    d["torch_build"] = None if tb_old == tb_new else {"from": tb_old, "to": tb_new}
    d["python"] = None if old.get("python") == new.get("python") else {
        "from": old.get("python"), "to": new.get("python")}
    d["from"], d["to"] = old.get("id"), new.get("id")
    d["changed"] = any(d[k] for k in ("up", "down", "added", "removed", "torch_build", "python"))
    return d


