"""Drift reports: this launch's environment and data against the container's known-good run.

The story this exists for: a torch upgrade (cu128 → cu130) ate ~200 MB per GPU and the run
OOMed hours later; hyperparameters tuned on 902K samples (mean length 2,068, 87.5 % loss
tokens) were reused on 1.1M samples (mean 2,826, 96 %). Both were visible before launch to
anyone who compared. Pure functions on plain dicts (the agent's fingerprint and the data
dir's meta.json), so every rule is unit-tested without a container.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from agent import envfp

ERROR = "error"  # refuse, whatever the operator accepts
DRIFT = "drift"  # refuse unless --accept-drift
INFO = "info"  # shown, never blocks


@dataclass(frozen=True)
class Finding:
    """One line of a drift report: what changed, the baseline's figure and this launch's."""

    level: str
    subject: str  # "torch", "package requests", "data mean length", …
    before: Optional[str]
    after: Optional[str]
    note: str = ""

    def line(self) -> str:
        if self.before is None:
            change = f"added {self.after}"
        elif self.after is None:
            change = f"removed (was {self.before})"
        elif self.before == self.after:
            change = f"{self.after} (unchanged)"
        else:
            change = f"{self.before} → {self.after}"
        text = f"{self.subject}: {change}"
        return f"{text} — {self.note}" if self.note else text


# --- environment ---------------------------------------------------------------------------

def normalize_fingerprint(fp: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields drift compares, from an environment fingerprint (agent/envfp.py: the launch
    preflight records one per run, the known-good record keeps its run's)."""
    fp = fp or {}
    torch = fp.get("torch") or {}
    packages = {envfp.canonical_name(k): str(v) for k, v in (fp.get("packages") or {}).items()}
    return {"python": _str(fp.get("python")), "torch": _str(torch.get("version") or packages.get("torch")),
            "cuda": _str(torch.get("cuda")), "driver": _str(fp.get("driver")), "packages": packages}


def _str(v: Any) -> Optional[str]:
    return None if v is None else str(v)


def env_drift(baseline: Mapping[str, Any] | None, current: Mapping[str, Any]) -> list[Finding]:
    """Every difference between the known-good fingerprint and this container's, by name and
    both versions. Empty list: no baseline yet, or no change."""
    if not baseline:
        return []
    old, new = normalize_fingerprint(baseline), normalize_fingerprint(current)
    findings: list[Finding] = []
    for key, subject, note in (
        ("python", "python", "a different interpreter runs the trainer"),
        ("torch", "torch", "a torch upgrade changes kernels and per-GPU memory use"),
        ("cuda", "torch CUDA build", "a different CUDA build changes per-GPU memory use"),
        ("driver", "NVIDIA driver", "the driver is tied to the node's kernel module"),
    ):
        if old[key] != new[key] and not (old[key] is None and new[key] is None):
            findings.append(Finding(DRIFT, subject, old[key], new[key], note))
    skip = {"torch"}  # reported above with its CUDA build
    a, b = old["packages"], new["packages"]
    for name in sorted((set(a) | set(b)) - skip):
        if a.get(name) != b.get(name):
            findings.append(Finding(DRIFT, f"package {name}", a.get(name), b.get(name)))
    return findings


# --- data ------------------------------------------------------------------------------------

# meta.json key spellings accepted for each statistic (trainer/data.py writes one of them).
DATA_KEYS = {
    "samples": ("samples", "num_samples", "n_samples", "count"),
    "tokens": ("tokens", "num_tokens", "total_tokens"),
    "mean_length": ("mean_length", "mean_len", "length_mean", "lengths.mean", "length.mean"),
    "loss_fraction": ("loss_token_fraction", "loss_fraction", "loss_tokens_fraction", "loss_mask_fraction"),
}


def _first(d: Mapping[str, Any], *paths: str) -> Any:
    """The first present value among dotted paths ('length.mean', 'mean_length', …)."""
    for path in paths:
        cur: Any = d
        for part in path.split("."):
            if isinstance(cur, Mapping) and part in cur:
                cur = cur[part]
            else:
                cur = None
                break
        if cur not in (None, ""):
            return cur
    return None


def normalize_data_stats(meta: Mapping[str, Any] | None) -> dict[str, Optional[float]]:
    meta = meta or {}
    stats = meta.get("stats") if isinstance(meta.get("stats"), Mapping) else meta
    out: dict[str, Optional[float]] = {}
    for key, names in DATA_KEYS.items():
        value = _first(stats, *names)
        if value is None and stats is not meta:
            value = _first(meta, *names)
        out[key] = float(value) if isinstance(value, (int, float)) else None
    if out["loss_fraction"] is None:
        loss_tokens = _first(stats, "loss_tokens", "num_loss_tokens")
        if isinstance(loss_tokens, (int, float)) and out["tokens"]:
            out["loss_fraction"] = float(loss_tokens) / out["tokens"]
    if out["mean_length"] is None and out["tokens"] and out["samples"]:
        out["mean_length"] = out["tokens"] / out["samples"]
    return out


def _fmt(key: str, v: Optional[float]) -> Optional[str]:
    if v is None:
        return None
    if key == "loss_fraction":
        return f"{v * 100:.1f} %"
    if key == "mean_length":
        return f"{v:,.1f}"
    return f"{int(v):,}"


DATA_SUBJECTS = {"samples": "data sample count", "mean_length": "data mean length",
                 "loss_fraction": "data loss-token fraction"}


def data_drift(baseline: Mapping[str, Any] | None, current: Mapping[str, Any], *,
               length_tolerance: float = 0.10, loss_fraction_tolerance: float = 0.02,
               samples_tolerance: float = 0.10) -> list[Finding]:
    """The three statistics the hyperparameters were tuned on, both sides' figures each.
    A statistic past its tolerance is DRIFT; within it, INFO (still shown: the operator sees
    both sides either way). Empty: no baseline for this config."""
    if not baseline:
        return []
    old, new = normalize_data_stats(baseline), normalize_data_stats(current)
    findings = []
    for key, subject in DATA_SUBJECTS.items():
        a, b = old[key], new[key]
        if a is None and b is None:
            continue
        if a is None or b is None:
            findings.append(Finding(INFO, subject, _fmt(key, a), _fmt(key, b), "not recorded on one side"))
            continue
        if key == "loss_fraction":
            delta, limit = abs(b - a), loss_fraction_tolerance
            moved = delta > limit
            note = f"{(b - a) * 100:+.1f} points"
        else:
            limit = length_tolerance if key == "mean_length" else samples_tolerance
            rel = abs(b - a) / a if a else (0.0 if b == a else float("inf"))
            moved = rel > limit
            note = f"{(b - a) / a * 100:+.1f} %" if a else ""
        findings.append(Finding(DRIFT if moved else INFO, subject, _fmt(key, a), _fmt(key, b), note))
    return findings


def blocking(findings: Iterable[Finding], accept_drift: bool) -> list[Finding]:
    """Findings that stop the launch: errors always, drift unless accepted."""
    return [f for f in findings if f.level == ERROR or (f.level == DRIFT and not accept_drift)]


def render(title: str, findings: list[Finding], baseline_label: str) -> list[str]:
    if not findings:
        return []
    lines = [f"{title} (against {baseline_label}):"]
    for f in findings:
        mark = {"error": "✗", "drift": "!", "info": " "}[f.level]
        lines.append(f"  {mark} {f.line()}")
    return lines
