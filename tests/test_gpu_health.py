"""GPUs checked before a launch: a GPU with a fault (uncorrectable ECC errors, a pending
row remap) is refused like a busy one, with its reason and the command that shows it; a
throttled one is a warning line; a healthy one says nothing. The GPUs answer through the
simulated node's nvidia-smi (sim/gpu.py), the one this machine has."""

from __future__ import annotations

import json

import pytest

from agent import gpuhealth, gpus, preflight
from sim import gpu as simgpu


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """The sim's nvidia-smi on PATH, two H200s; ``smi(index, condition)`` sets one's health."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(simgpu.SMI)
    exe.chmod(0o755)
    state = {"state": "ok", "gpus": 2, "free_mib": 143000, "driver": simgpu.NODE_DRIVER, "health": {}}

    def set_health(index: int, condition: str) -> None:
        state["health"][str(index)] = simgpu.HEALTH[condition]
        (bin_dir / "nvidia-smi.json").write_text(json.dumps(state))

    (bin_dir / "nvidia-smi.json").write_text(json.dumps(state))
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return set_health


def _check(ws):
    return preflight.check({"workspace": str(ws), "run_id": "new", "start": {"kind": "scratch"},
                            "flags": {"device": "auto", "target_gpus": [0], "drafter_gpus": [1]}})


def _gpu_lines(lines):
    return [l for l in lines if l.startswith("GPU ")]


def test_healthy_gpus_pass_the_preflight_without_a_word(smi, tmp_path):
    reply = _check(tmp_path)
    assert _gpu_lines(reply["errors"]) == [] and _gpu_lines(reply["warnings"]) == []
    h = reply["gpu_health"]["gpus"][1]
    assert h["pci_bus_id"] == "00000000:28:00.0" and h["ecc_uncorrected_volatile"] == 0
    assert h["retired_pages_pending"] is None and h["remapped_rows_pending"] is False  # Hopper: rows, not pages
    assert h["clocks_event_reasons"] == 0x1 and h["persistence_mode"] is True


def test_a_gpu_with_uncorrectable_ecc_errors_is_refused_with_its_reason_and_the_command_that_shows_it(smi, tmp_path):
    smi(1, "ecc")
    faults = _gpu_lines(_check(tmp_path)["errors"])
    assert faults == [
        "GPU 1 has 2 uncorrectable ECC errors since the driver loaded: its memory cannot be trusted until a reset; "
        "give the run other GPUs, or reset it (`nvidia-smi -r -i 00000000:28:00.0` on the node, nothing running on "
        "it); shows it: `nvidia-smi -q -d ECC -i 00000000:28:00.0`",
        "GPU 1 has a row remapping pending: a reset applies it, until then the bad row is in use; give the run other "
        "GPUs or reset it; shows it: `nvidia-smi -q -d ROW_REMAPPER -i 00000000:28:00.0`"]


def test_a_throttled_gpu_is_a_warning_line_not_a_refusal(smi, tmp_path):
    smi(0, "throttled")
    reply = _check(tmp_path)
    assert _gpu_lines(reply["errors"]) == []
    assert _gpu_lines(reply["warnings"]) == [
        "GPU 0 is throttled now (HW slowdown, SW thermal slowdown): it runs slower than its peers and the slowest rank "
        "sets every rank's pace; check its cooling and power limit; shows it: `nvidia-smi -q -d PERFORMANCE -i "
        "00000000:18:00.0`"]


def test_a_narrow_pcie_link_and_persistence_off_warn_and_an_idle_gpus_lower_link_generation_does_not():
    base = {"index": 0, "state": "ok", "pci_bus_id": "00000000:18:00.0", "pcie_gen_current": 1, "pcie_gen_max": 5,
            "pcie_width_current": 16, "pcie_width_max": 16, "clocks_event_reasons": 0x1}
    assert gpuhealth.judge(base).warnings == []  # links drop their generation at idle
    busy = gpuhealth.judge(dict(base, clocks_event_reasons=0x0, pcie_width_current=8, persistence_mode=False))
    assert "PCIe link runs x8 of x16, gen 1 of gen 5 while busy" in busy.warnings[0]
    assert "persistence mode off" in busy.warnings[1] and busy.faults == []


def test_a_gpu_that_does_not_answer_is_refused_and_lifetime_ecc_errors_alone_only_warn():
    lost = gpuhealth.judge({"index": 3, "state": "invalid", "error": "NVMLError_GpuIsLost: GPU is lost"})
    assert lost.faults and "fallen off the bus?" in lost.faults[0] and "journalctl -k" in lost.faults[0]
    old = gpuhealth.judge({"index": 2, "state": "ok", "ecc_uncorrected_volatile": 0, "ecc_uncorrected_aggregate": 3,
                           "remapped_rows_pending": False})
    assert old.faults == [] and "3 uncorrectable ECC errors over its life" in old.warnings[0]


def test_nvidia_smis_words_become_values():
    assert [gpus._smi_health_value(t) for t in ("[N/A]", "Yes", "Disabled", "0x0000000000000028", "16",
                                                "00000000:28:00.0")] == [None, True, False, 0x28, 16,
                                                                         "00000000:28:00.0"]
