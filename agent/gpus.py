"""GPU samples: NVML (nvidia-ml-py's ``pynvml``) when it is importable and a driver answers,
else ``nvidia-smi``; one record shape either way. The supervisor's periodic samples, the
`gpus` verbs and the launch preflight all take theirs from :func:`sample`.

Like gpustat's ``safenvml``, every NVML call is wrapped on its own, catching NVML's own
errors only: an unsupported field becomes None and its error is kept in the record's
``errors`` (field → "NVMLError_NotSupported: …"), a lost GPU becomes an ``{"index": i,
"state": "invalid", "error": …}`` record. Any other exception is a bug of ours and is raised
(docs/research/proxmox-and-supervision.md §5): a misspelt attribute must not pass for
"unsupported". Without a GPU the answer is ``{"gpus": [], "state": "no GPU", "reason": …}``.

A record: index, state, uuid, name, utilization_gpu_pct, utilization_memory_pct,
memory_used_mib, memory_total_mib, memory_free_mib, temperature_gpu_c, power_draw_w,
power_limit_w, processes [{pid, used_memory_mib}] (units in the names, nvidia-smi's query
names). PIDs that NVML reports are host PIDs inside an LXC container
(docs/research/proxmox-and-supervision.md §1.3, canonical/lxd#9755); they are reported as
NVML gives them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import Any, Callable, Optional

try:  # optional dependency; the agent runs with the standard library alone
    import pynvml as _nv
except Exception:  # noqa: BLE001 - any import failure means "no NVML"
    _nv = None

_initialised = False
_MIB = 2**20


def _nvml_error() -> type[BaseException] | tuple:
    return getattr(_nv, "NVMLError", ())


def _call(errors: dict, name: str, fn: Callable, *args) -> Any:
    """``fn(*args)``; on an NVML error None, with the error kept under ``name``."""
    try:
        value = fn(*args)
    except _nvml_error() as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _init() -> str | None:
    """None when NVML is ready, else the reason it is not."""
    global _initialised
    if _nv is None:
        return "nvidia-ml-py (pynvml) is not installed"
    if _initialised:
        return None
    try:
        _nv.nvmlInit()
    except _nvml_error() as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return f"NVML unavailable: {type(exc).__name__}: {exc}"
    _initialised = True
    return None


def _device(i: int) -> dict:
    nv = _nv
    errors: dict[str, str] = {}
    handle = _call(errors, "handle", nv.nvmlDeviceGetHandleByIndex, i)
    if handle is None:
        return {"index": i, "state": "invalid", "error": "handle unavailable (GPU lost?)"}
    rec: dict[str, Any] = {"index": i, "state": "ok"}
    rec["uuid"] = _call(errors, "uuid", nv.nvmlDeviceGetUUID, handle)
    rec["name"] = _call(errors, "name", nv.nvmlDeviceGetName, handle)
    util = _call(errors, "utilization", nv.nvmlDeviceGetUtilizationRates, handle)
    rec["utilization_gpu_pct"] = util.gpu if util is not None else None
    rec["utilization_memory_pct"] = util.memory if util is not None else None
    mem = _call(errors, "memory", nv.nvmlDeviceGetMemoryInfo, handle)
    rec["memory_used_mib"] = round(mem.used / _MIB) if mem is not None else None
    rec["memory_total_mib"] = round(mem.total / _MIB) if mem is not None else None
    rec["memory_free_mib"] = round((mem.total - mem.used) / _MIB) if mem is not None else None
    rec["temperature_gpu_c"] = _call(errors, "temperature_gpu_c", nv.nvmlDeviceGetTemperature, handle,
                                     nv.NVML_TEMPERATURE_GPU)
    power = _call(errors, "power_draw_w", nv.nvmlDeviceGetPowerUsage, handle)
    rec["power_draw_w"] = round(power / 1000, 1) if power is not None else None
    limit = _call(errors, "power_limit_w", nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    rec["power_limit_w"] = round(limit / 1000, 1) if limit is not None else None
    procs = []
    for name, fn in (("compute_processes", nv.nvmlDeviceGetComputeRunningProcesses),
                     ("graphics_processes", nv.nvmlDeviceGetGraphicsRunningProcesses)):
        for p in _call(errors, name, fn, handle) or []:
            used = p.usedGpuMemory
            procs.append({"pid": p.pid, "used_memory_mib": round(used / _MIB) if isinstance(used, int) else None})
    rec["processes"] = procs
    if errors:
        rec["errors"] = errors
    return rec


def _nvml_sample(ts: float) -> dict:
    errors: dict[str, str] = {}
    count = _call(errors, "count", _nv.nvmlDeviceGetCount)
    if not count:
        return {"ts": ts, "gpus": [], "state": "no GPU", "source": "nvml",
                "reason": errors.get("count") or "NVML reports 0 devices"}
    driver = _call(errors, "driver", _nv.nvmlSystemGetDriverVersion)
    return {"ts": ts, "state": "ok", "source": "nvml", "driver": driver, "gpus": [_device(i) for i in range(count)]}


_SMI_FIELDS = ("index", "uuid", "name", "utilization.gpu", "utilization.memory", "memory.used", "memory.total",
               "memory.free", "temperature.gpu", "power.draw", "power.limit", "driver_version")
_SMI_KEYS = ("index", "uuid", "name", "utilization_gpu_pct", "utilization_memory_pct", "memory_used_mib",
             "memory_total_mib", "memory_free_mib", "temperature_gpu_c", "power_draw_w", "power_limit_w", "driver")


def _smi_value(key: str, text: str) -> Any:
    if key in ("uuid", "name", "driver"):
        return text
    if not re.fullmatch(r"[0-9.]+", text):  # "[N/A]", "[Not Supported]"
        return None
    value = float(text)
    return value if key.startswith("power") else int(round(value))


def _smi_sample(ts: float, why_not_nvml: str) -> dict:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {"ts": ts, "gpus": [], "state": "no GPU", "source": None,
                "reason": f"{why_not_nvml}; no nvidia-smi either: no GPU is visible"}
    try:
        out = subprocess.run([exe, f"--query-gpu={','.join(_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"ts": ts, "gpus": [], "state": "no GPU", "source": "nvidia-smi", "reason": f"nvidia-smi failed: {exc}"}
    if out.returncode != 0:
        return {"ts": ts, "gpus": [], "state": "no GPU", "source": "nvidia-smi",
                "reason": f"nvidia-smi failed: {out.stderr.strip()[-300:]}"}
    rows, driver = [], None
    for line in out.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(_SMI_KEYS):
            continue
        rec = {k: _smi_value(k, v) for k, v in zip(_SMI_KEYS, parts)}
        driver = rec.pop("driver")
        rows.append({"state": "ok", **rec, "processes": []})
    if not rows:
        return {"ts": ts, "gpus": [], "state": "no GPU", "source": "nvidia-smi", "reason": "nvidia-smi lists no GPU"}
    return {"ts": ts, "state": "ok", "source": "nvidia-smi", "driver": driver, "gpus": rows}


def sample() -> dict:
    """One sample of every GPU: NVML's, else nvidia-smi's, else "no GPU" with the reason."""
    ts = time.time()
    reason = _init()
    if reason is None:
        got = _nvml_sample(ts)
        if got["gpus"]:
            return got
        reason = got["reason"]
    return _smi_sample(ts, reason)


def driver_version() -> str | None:
    return sample().get("driver")


def architectures() -> list[dict]:
    """``[{"name", "compute_cap"}]`` of every visible GPU (compute_cap "9.0" for Hopper; None
    where neither NVML nor nvidia-smi tells it); [] without a GPU. Compiled kernels are made
    for one compute capability: agent/compilecache.py compares these before it imports a
    cache built elsewhere."""
    if _init() is None:
        errors: dict[str, str] = {}
        out = []
        for i in range(_call(errors, "count", _nv.nvmlDeviceGetCount) or 0):
            handle = _call(errors, "handle", _nv.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                continue
            cap = _call(errors, "compute_cap", _nv.nvmlDeviceGetCudaComputeCapability, handle)
            out.append({"name": _call(errors, "name", _nv.nvmlDeviceGetName, handle),
                        "compute_cap": f"{cap[0]}.{cap[1]}" if cap else None})
        if out:
            return out
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        got = subprocess.run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if got.returncode != 0:
        return []
    out = []
    for line in got.stdout.strip().splitlines():
        name, _, cap = (part.strip() for part in line.rpartition(","))
        if name:
            out.append({"name": name, "compute_cap": cap if re.fullmatch(r"\d+\.\d+", cap) else None})
    return out


# --- health, read before a launch (agent/gpuhealth.py judges it) ------------------------------
#
# Fields (nvidia-smi's query names, units in ours): ecc_uncorrected_volatile (since the driver
# loaded), ecc_uncorrected_aggregate (the GPU's life), retired_pages_pending (pre-Ampere page
# retirement), remapped_rows_pending / remapped_rows_failure (Ampere and later), clocks_event_reasons
# (the bitmask NVML calls clocks throttle / event reasons), pcie_gen_current/max,
# pcie_width_current/max, persistence_mode, pci_bus_id. Each None where the GPU or driver does
# not support it (retired pages on Hopper: NVMLError_NotSupported; checked on an H200).

HEALTH_KEYS = ("ecc_uncorrected_volatile", "ecc_uncorrected_aggregate", "retired_pages_pending",
               "remapped_rows_pending", "remapped_rows_failure", "clocks_event_reasons", "pcie_gen_current",
               "pcie_gen_max", "pcie_width_current", "pcie_width_max", "persistence_mode", "pci_bus_id")


def _nvml_health(i: int) -> dict:
    nv = _nv
    errors: dict[str, str] = {}
    handle = _call(errors, "handle", nv.nvmlDeviceGetHandleByIndex, i)
    if handle is None:
        return {"index": i, "state": "invalid", "error": errors.get("handle") or "handle unavailable (GPU lost?)"}
    unc = getattr(nv, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
    rec: dict[str, Any] = {"index": i, "state": "ok"}
    rec["ecc_uncorrected_volatile"] = _call(errors, "ecc_uncorrected_volatile", nv.nvmlDeviceGetTotalEccErrors, handle,
                                            unc, getattr(nv, "NVML_VOLATILE_ECC", 0))
    rec["ecc_uncorrected_aggregate"] = _call(errors, "ecc_uncorrected_aggregate", nv.nvmlDeviceGetTotalEccErrors,
                                             handle, unc, getattr(nv, "NVML_AGGREGATE_ECC", 1))
    pending = _call(errors, "retired_pages_pending", nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    rec["retired_pages_pending"] = None if pending is None else bool(pending)
    remap = _call(errors, "remapped_rows", nv.nvmlDeviceGetRemappedRows, handle)  # (corr, unc, pending, failure)
    rec["remapped_rows_pending"] = bool(remap[2]) if remap is not None else None
    rec["remapped_rows_failure"] = bool(remap[3]) if remap is not None else None
    reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    rec["clocks_event_reasons"] = _call(errors, "clocks_event_reasons", reasons, handle)
    for key, fn in (("pcie_gen_current", nv.nvmlDeviceGetCurrPcieLinkGeneration),
                    ("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration),
                    ("pcie_width_current", nv.nvmlDeviceGetCurrPcieLinkWidth),
                    ("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth)):
        rec[key] = _call(errors, key, fn, handle)
    mode = _call(errors, "persistence_mode", nv.nvmlDeviceGetPersistenceMode, handle)
    rec["persistence_mode"] = None if mode is None else bool(mode)
    pci = _call(errors, "pci_bus_id", nv.nvmlDeviceGetPciInfo, handle)
    bus = getattr(pci, "busId", None) if pci is not None else None
    rec["pci_bus_id"] = bus.decode() if isinstance(bus, bytes) else bus
    if errors:
        rec["errors"] = errors
    return rec


_SMI_HEALTH = ("index", "pci.bus_id", "ecc.errors.uncorrected.volatile.total", "ecc.errors.uncorrected.aggregate.total",
               "retired_pages.pending", "clocks_throttle_reasons.active", "pcie.link.gen.current", "pcie.link.gen.max",
               "pcie.link.width.current", "pcie.link.width.max", "persistence_mode")
_SMI_HEALTH_KEYS = ("index", "pci_bus_id", "ecc_uncorrected_volatile", "ecc_uncorrected_aggregate",
                    "retired_pages_pending", "clocks_event_reasons", "pcie_gen_current", "pcie_gen_max",
                    "pcie_width_current", "pcie_width_max", "persistence_mode")


def _smi_health_value(text: str) -> Any:
    """nvidia-smi's words as values: "[N/A]"/"[Not Supported]" None, Yes/Enabled True, a hex
    mask or a count a number, a bus id as is."""
    if text.startswith("["):
        return None
    if text in ("Yes", "Enabled"):
        return True
    if text in ("No", "Disabled"):
        return False
    if re.fullmatch(r"0x[0-9A-Fa-f]+", text):
        return int(text, 16)
    if re.fullmatch(r"\d+", text):
        return int(text)
    return text


def _smi(exe: str, query: str, fields: tuple) -> Optional[list[list[str]]]:
    try:
        out = subprocess.run([exe, f"{query}={','.join(fields)}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [[p.strip() for p in line.split(",")] for line in out.stdout.strip().splitlines()]


def _smi_health() -> list[dict]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    rows = _smi(exe, "--query-gpu", _SMI_HEALTH) or []
    out = []
    for parts in rows:
        if len(parts) != len(_SMI_HEALTH_KEYS):
            continue
        rec = {k: _smi_health_value(v) for k, v in zip(_SMI_HEALTH_KEYS, parts)}
        rec["retired_pages_pending"] = rec["retired_pages_pending"] if isinstance(rec["retired_pages_pending"], bool) else None
        out.append(dict(rec, state="ok", remapped_rows_pending=None, remapped_rows_failure=None))
    remap = _smi(exe, "--query-remapped-rows", ("gpu_bus_id", "remapped_rows.pending", "remapped_rows.failure")) or []
    by_bus = {parts[0].lower(): parts for parts in remap if len(parts) == 3}
    for rec in out:
        parts = by_bus.get(str(rec.get("pci_bus_id")).lower())
        if parts:
            rec["remapped_rows_pending"] = _smi_health_value(parts[1]) if parts[1] in ("Yes", "No") else None
            rec["remapped_rows_failure"] = _smi_health_value(parts[2]) if parts[2] in ("Yes", "No") else None
    return out


def health() -> dict:
    """``{"source", "gpus": [record]}``: each GPU's health fields (HEALTH_KEYS), from NVML
    where it answers, else nvidia-smi; ``{"gpus": []}`` without either."""
    if _init() is None:
        errors: dict[str, str] = {}
        count = _call(errors, "count", _nv.nvmlDeviceGetCount)
        if count:
            return {"source": "nvml", "gpus": [_nvml_health(i) for i in range(count)]}
    return {"source": "nvidia-smi", "gpus": _smi_health()}
