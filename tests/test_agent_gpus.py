"""GPU sampling. This machine has no GPU, so the real path is the "no GPU" answer; the
per-call isolation (gpustat's safenvml habit) is checked against a stand-in NVML module
whose calls fail the way real drivers do (NotSupported on one field, a lost GPU), with
pynvml's own error hierarchy (every NVML error derives from ``NVMLError``)."""

from __future__ import annotations

import types

import pytest

from agent import gpus


def test_no_gpu_is_a_clear_answer_never_a_crash():
    s = gpus.sample()
    assert s["state"] == "no GPU" and s["gpus"] == [] and s["reason"]


class _NVMLError(Exception):
    pass


class _NotSupported(_NVMLError):
    pass


def _fake_nvml(lost_index: int):
    mib = 2**20

    def handle(i):
        if i == lost_index:
            raise _NotSupported("GPU is lost")
        return i

    def unsupported(h, *a):
        raise _NotSupported("Not Supported")

    nv = types.SimpleNamespace(
        NVMLError=_NVMLError, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 3, nvmlSystemGetDriverVersion=lambda: b"570.86",
        nvmlDeviceGetHandleByIndex=handle, nvmlDeviceGetUUID=lambda h: f"GPU-{h}", nvmlDeviceGetName=lambda h: b"H200",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=70000 * mib, total=143771 * mib),
        nvmlDeviceGetTemperature=lambda h, kind: 61, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetPowerUsage=unsupported,  # one field unsupported: None, the rest intact
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700000,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=4242, usedGpuMemory=69000 * mib)],
        nvmlDeviceGetGraphicsRunningProcesses=unsupported,
    )
    return nv


def test_each_nvml_call_fails_on_its_own(monkeypatch):
    monkeypatch.setattr(gpus, "_nv", _fake_nvml(lost_index=1))
    monkeypatch.setattr(gpus, "_initialised", False)
    s = gpus.sample()
    assert s["state"] == "ok" and s["driver"] == "570.86"
    g0, g1, g2 = s["gpus"]
    assert g0["name"] == "H200" and g0["utilization_gpu_pct"] == 97 and g0["memory_used_mib"] == 70000
    assert g0["power_draw_w"] is None and g0["power_limit_w"] == 700.0
    assert g0["processes"] == [{"pid": 4242, "used_memory_mib": 69000}]
    assert g1 == {"index": 1, "state": "invalid", "error": "handle unavailable (GPU lost?)"}
    assert g2["uuid"] == "GPU-2"


def test_an_unsupported_field_keeps_its_nvml_error_in_the_record(monkeypatch):
    monkeypatch.setattr(gpus, "_nv", _fake_nvml(lost_index=1))
    monkeypatch.setattr(gpus, "_initialised", False)
    g0 = gpus.sample()["gpus"][0]
    assert g0["errors"] == {"power_draw_w": "_NotSupported: Not Supported",
                            "graphics_processes": "_NotSupported: Not Supported"}


def test_a_bug_of_ours_is_raised_not_reported_as_unsupported(monkeypatch):
    # `_safe` once swallowed every exception, so a misspelt attribute looked like a field
    # the GPU does not support; only NVML's own errors mean that
    nv = _fake_nvml(lost_index=9)
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(usd=1, total=2)  # no .used
    monkeypatch.setattr(gpus, "_nv", nv)
    monkeypatch.setattr(gpus, "_initialised", False)
    with pytest.raises(AttributeError):
        gpus.sample()


def test_architectures_come_from_nvml_else_nvidia_smi_else_none(monkeypatch, tmp_path):
    """The compute capabilities a compile-cache import compares (agent/compilecache.py)."""
    import json
    import os

    from sim import gpu as simgpu

    monkeypatch.setattr(gpus, "_nv", None)
    monkeypatch.setattr(gpus, "_initialised", False)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + "/usr/bin:/bin")
    assert gpus.architectures() == []  # no NVML, no nvidia-smi
    smi = tmp_path / "nvidia-smi"  # the simulated node's nvidia-smi, which prints what the real one prints
    smi.write_text(simgpu.SMI)
    smi.chmod(0o755)
    (tmp_path / "nvidia-smi.json").write_text(json.dumps({"state": "ok", "gpus": 2, "free_mib": 1000,
                                                          "driver": simgpu.NODE_DRIVER}))
    assert gpus.architectures() == [{"name": "NVIDIA H200", "compute_cap": "9.0"}] * 2
    (tmp_path / "nvidia-smi.json").write_text(json.dumps({"state": "no-cgroup"}))
    assert gpus.architectures() == []  # "Failed to initialize NVML": no answer, not a crash

    nv = _fake_nvml(lost_index=1)
    nv.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    monkeypatch.setattr(gpus, "_nv", nv)
    assert gpus.architectures() == [{"name": "H200", "compute_cap": "9.0"}] * 2  # the lost GPU left out
