"""GPU samples through NVML (nvidia-ml-py's ``pynvml``), when it is importable.

Like gpustat, every NVML call is wrapped on its own: an unsupported field becomes None, a
lost GPU becomes an ``{"index": i, "state": "invalid", "error": …}`` record, and the sample
as a whole never raises (research §5). Without NVML or a driver the answer is
``{"gpus": [], "state": "no GPU", "reason": …}``.

PIDs that NVML reports are host PIDs inside an LXC container (research §1.3, canonical/lxd#9755);
they are reported as NVML gives them, not matched to container processes.
"""

from __future__ import annotations

import time
from typing import Any, Callable

try:  # optional dependency; the agent runs with the standard library alone
    import pynvml as _nv
except Exception:  # noqa: BLE001 - any import failure means "no NVML"
    _nv = None

_initialised = False
_init_error: str | None = None


def _safe(fn: Callable, *args) -> Any:
    try:
        value = fn(*args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return value


def _init() -> str | None:
    """None when NVML is ready, else the reason it is not."""
    global _initialised, _init_error
    if _nv is None:
        return "nvidia-ml-py (pynvml) is not installed"
    if _initialised:
        return None
    try:
        _nv.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        _init_error = f"NVML unavailable: {type(exc).__name__}: {exc}"
        return _init_error
    _initialised = True
    return None


def _device(i: int) -> dict:
    nv = _nv
    handle = _safe(nv.nvmlDeviceGetHandleByIndex, i)
    if handle is None:
        return {"index": i, "state": "invalid", "error": "handle unavailable (GPU lost?)"}
    rec: dict[str, Any] = {"index": i, "state": "ok"}
    rec["uuid"] = _safe(nv.nvmlDeviceGetUUID, handle)
    rec["name"] = _safe(nv.nvmlDeviceGetName, handle)
    util = _safe(nv.nvmlDeviceGetUtilizationRates, handle)
    rec["utilization_gpu_pct"] = getattr(util, "gpu", None)
    rec["utilization_memory_pct"] = getattr(util, "memory", None)
    mem = _safe(nv.nvmlDeviceGetMemoryInfo, handle)
    rec["memory_used_mib"] = round(mem.used / 2**20) if mem is not None else None
    rec["memory_total_mib"] = round(mem.total / 2**20) if mem is not None else None
    rec["temperature_gpu_c"] = _safe(nv.nvmlDeviceGetTemperature, handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    power = _safe(nv.nvmlDeviceGetPowerUsage, handle)
    rec["power_draw_w"] = round(power / 1000, 1) if power is not None else None
    limit = _safe(nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    rec["power_limit_w"] = round(limit / 1000, 1) if limit is not None else None
    procs = []
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fn = getattr(nv, getter, None)
        for p in (_safe(fn, handle) if fn else None) or []:
            used = getattr(p, "usedGpuMemory", None)
            procs.append({"pid": getattr(p, "pid", None),
                          "used_memory_mib": round(used / 2**20) if isinstance(used, int) else None})
    rec["processes"] = procs
    return rec


def sample() -> dict:
    """One sample of every GPU; never raises."""
    ts = time.time()
    reason = _init()
    if reason is not None:
        return {"ts": ts, "gpus": [], "state": "no GPU", "reason": reason}
    count = _safe(_nv.nvmlDeviceGetCount)
    if not count:
        return {"ts": ts, "gpus": [], "state": "no GPU", "reason": "NVML reports 0 devices"}
    driver = _safe(_nv.nvmlSystemGetDriverVersion)
    return {"ts": ts, "state": "ok", "driver": driver, "gpus": [_device(i) for i in range(count)]}


def driver_version() -> str | None:
    if _init() is not None:
        return None
    return _safe(_nv.nvmlSystemGetDriverVersion)
