"""A GPU's health before a launch: a fault refuses it like a busy GPU, a degradation is a
warning line; each names the command that shows it.

Judged from agent/gpus.py ``health()`` records (NVML, else nvidia-smi). What refuses, and why:

- uncorrectable ECC errors since the driver loaded (volatile): the memory that failed may
  still be mapped until a reset; a run there can die mid-step or compute on bad memory;
- pages pending retirement / rows pending remap: the fix waits for a reset, until then the
  bad memory is in use; a failed row remap: the GPU needs service;
- a GPU that does not answer NVML (fallen off the bus, lost): nothing will run on it.

What warns: uncorrectable ECC errors over the GPU's life with none now and nothing pending
(a repaired GPU: watch it, no reason to refuse it); clocks held down now by a thermal or
power reason (the slowest rank sets every rank's pace); a PCIe link narrower than its
maximum, or of a lower generation while the GPU is busy (links drop their generation at
idle to save power, so an idle GPU's lower generation means nothing); persistence mode off.

Standard library only: runs in the container inside the launch preflight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class ClockReason:
    """One bit of NVML's clocks event (throttle) reasons mask (nvml.h ``nvmlClocksEventReason*``)."""

    bit: int
    name: str
    degrades: bool  # a reason that holds the clocks below what the work asks for


CLOCK_REASONS = (
    ClockReason(0x1, "idle", False),
    ClockReason(0x2, "applications clocks setting", False),
    ClockReason(0x4, "SW power cap", True),
    ClockReason(0x8, "HW slowdown", True),
    ClockReason(0x10, "sync boost", False),
    ClockReason(0x20, "SW thermal slowdown", True),
    ClockReason(0x40, "HW thermal slowdown", True),
    ClockReason(0x80, "HW power brake slowdown", True),
    ClockReason(0x100, "display clock setting", False),
)
IDLE = 0x1


@dataclass
class Verdict:
    """One GPU's faults (refuse) and warnings, each one line."""

    faults: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _target(rec: dict) -> str:
    """What ``nvidia-smi -i`` takes for this GPU: its PCI bus id where known (the same on the
    node and in the container), else its index."""
    return str(rec.get("pci_bus_id") or rec.get("index"))


def judge(rec: dict) -> Verdict:
    v = Verdict()
    i, sel = rec.get("index"), _target(rec)
    if rec.get("state") == "invalid":
        v.faults.append(f"GPU {i} does not answer NVML ({rec.get('error') or 'lost'}): fallen off the bus? give the "
                        f"run other GPUs; shows it: `nvidia-smi -q -i {i}` and the node's kernel log "
                        "(`journalctl -k | grep -i xid` on the node)")
        return v
    vol, agg = rec.get("ecc_uncorrected_volatile"), rec.get("ecc_uncorrected_aggregate")
    if isinstance(vol, int) and vol > 0:
        v.faults.append(f"GPU {i} has {vol} uncorrectable ECC error{'s' if vol > 1 else ''} since the driver loaded: "
                        f"its memory cannot be trusted until a reset; give the run other GPUs, or reset it "
                        f"(`nvidia-smi -r -i {sel}` on the node, nothing running on it); shows it: "
                        f"`nvidia-smi -q -d ECC -i {sel}`")
    if rec.get("retired_pages_pending"):
        v.faults.append(f"GPU {i} has memory pages pending retirement: a reset retires them, until then they are in "
                        f"use; give the run other GPUs or reset it; shows it: `nvidia-smi -q -d PAGE_RETIREMENT -i {sel}`")
    if rec.get("remapped_rows_pending"):
        v.faults.append(f"GPU {i} has a row remapping pending: a reset applies it, until then the bad row is in use; "
                        f"give the run other GPUs or reset it; shows it: `nvidia-smi -q -d ROW_REMAPPER -i {sel}`")
    if rec.get("remapped_rows_failure"):
        v.faults.append(f"GPU {i} failed to remap a row: it needs service; give the run other GPUs; shows it: "
                        f"`nvidia-smi -q -d ROW_REMAPPER -i {sel}`")
    if isinstance(agg, int) and agg > 0 and not v.faults:
        v.warnings.append(f"GPU {i} has had {agg} uncorrectable ECC error{'s' if agg > 1 else ''} over its life (none "
                          f"since the driver loaded, nothing pending): watch it; `nvidia-smi -q -d ECC -i {sel}`")
    mask = rec.get("clocks_event_reasons")
    if isinstance(mask, int):
        held = [r.name for r in CLOCK_REASONS if r.degrades and mask & r.bit]
        if held:
            v.warnings.append(f"GPU {i} is throttled now ({', '.join(held)}): it runs slower than its peers and the "
                              f"slowest rank sets every rank's pace; check its cooling and power limit; shows it: "
                              f"`nvidia-smi -q -d PERFORMANCE -i {sel}`")
    link = _link(rec, mask)
    if link:
        v.warnings.append(f"GPU {i}'s PCIe link runs {link}: host-device copies are slower; reseat or check the "
                          f"slot; shows it: `nvidia-smi --query-gpu=pcie.link.gen.current,pcie.link.gen.max,"
                          f"pcie.link.width.current,pcie.link.width.max --format=csv -i {sel}`")
    if rec.get("persistence_mode") is False:
        v.warnings.append(f"GPU {i} has persistence mode off: the driver tears its state down when nothing holds it, "
                          f"and every start pays for bringing it up; run nvidia-persistenced on the node; shows it: "
                          f"`nvidia-smi --query-gpu=persistence_mode --format=csv -i {sel}`")
    return v


def _link(rec: dict, mask: Optional[int]) -> Optional[str]:
    parts = []
    w, wmax = rec.get("pcie_width_current"), rec.get("pcie_width_max")
    if isinstance(w, int) and isinstance(wmax, int) and 0 < w < wmax:
        parts.append(f"x{w} of x{wmax}")
    g, gmax = rec.get("pcie_gen_current"), rec.get("pcie_gen_max")
    busy = isinstance(mask, int) and not mask & IDLE
    if busy and isinstance(g, int) and isinstance(gmax, int) and 0 < g < gmax:
        parts.append(f"gen {g} of gen {gmax} while busy")
    return ", ".join(parts) or None


def check(health: dict, named: list[int]) -> Verdict:
    """The verdict over the GPUs a launch names (others are not its business)."""
    out = Verdict()
    for rec in health.get("gpus") or []:
        if rec.get("index") in named:
            v = judge(rec)
            out.faults += v.faults
            out.warnings += v.warnings
    return out
