"""The one line that says why a container sees fewer GPUs than its run names, and the fix.

From the container's own facts (agent/gpuview.py: device nodes, whether one opens, the
user-space library versions) and the node's (its driver version and device nodes, read on
the node over the same connection, only when something is missing). The fixes are the lines
a Proxmox operator puts in /etc/pve/lxc/<ctid>.conf (docs/research/proxmox-and-supervision.md
§1.3), then `pct reboot <ctid>`.
"""

from __future__ import annotations

import re
from typing import Optional

from controller import pct
from controller.container import Container

# Fixed script, no interpolation: the node's driver version and its NVIDIA device nodes.
_NODE_FACTS = ('cat /proc/driver/nvidia/version 2>/dev/null; '
               'nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | sed "s/^/driver: /"; '
               'stat -c "dev: %n %t" /dev/nvidia* 2>/dev/null; true')
_MODULE = re.compile(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)")


def node_facts(ct: Container) -> dict:
    """{"driver": version or None, "majors": {device: major}} as the node shows them."""
    result = ct.runner.run(["sh", "-c", _NODE_FACTS])
    text = result.stdout
    m = _MODULE.search(text) or re.search(r"^driver: (\S+)", text, re.M)
    majors = {}
    for line in text.splitlines():
        if line.startswith("dev: "):
            _, name, major = line.split()
            majors[name] = int(major, 16)
    return {"driver": m.group(1) if m else None, "majors": majors}


def shortfall_line(ct: Container, shortfall: dict, node: Optional[dict] = None) -> str:
    """Refusal text for the preflight's ``gpu_shortfall``: what is missing, the cause seen, the fix."""
    node = node if node is not None else node_facts(ct)
    view = shortfall.get("view") or {}
    named, visible = shortfall["named"], shortfall["visible"]
    head = (f"the run names GPU {','.join(map(str, named))} but container {ct.ctid} sees "
            f"{'none' if not visible else 'only ' + ','.join(map(str, visible))}")
    conf = f"/etc/pve/lxc/{ct.ctid}.conf on node {ct.node_name}"
    reboot = f"`{pct.command_text(ct.node, 'reboot', ct.ctid)}`"
    cpu = 'or set device = "cpu" in the run config to train on CPU on purpose'
    libs = view.get("libraries") or []
    driver = node.get("driver") or view.get("kernel_module")
    if not view.get("device_nodes"):
        if not driver and not node.get("majors"):
            return (f"{head}: the node shows no NVIDIA driver either (no /proc/driver/nvidia, no nvidia-smi): is this "
                    f"a GPU node? {cpu}")
        majors = sorted(set(node.get("majors", {}).values()) or {195})
        devices = sorted(node.get("majors") or {"/dev/nvidia0": 195, "/dev/nvidiactl": 195})
        lines = [f"lxc.cgroup2.devices.allow: c {m}:* rwm" for m in majors]
        lines += [f"lxc.mount.entry: {d} {d[1:]} none bind,optional,create=file" for d in devices]
        return (f"{head}: the container has no /dev/nvidia* device nodes (node driver {driver or 'unknown'}); "
                f"pass them through: add to {conf}: " + "; ".join(lines) + f" (the nvidia-uvm major is the node's: "
                f"`ls -l /dev/nvidia-uvm`), then {reboot}; {cpu}")
    if view.get("open_error") == "EPERM":
        return (f"{head}: {view.get('opened')} is there but the container's cgroup refuses it (EPERM): the device "
                f"rule is missing: add `lxc.cgroup2.devices.allow: c 195:* rwm` (and the nvidia-uvm major, "
                f"`ls -l /dev/nvidia-uvm` on the node) to {conf}, then {reboot}; {cpu}")
    if driver and libs and driver not in libs:
        return (f"{head}: driver/library version mismatch: the node's kernel module is {driver}, the container's "
                f"libnvidia-ml is {', '.join(libs)} (the node's driver was updated, the container's user space was "
                f"not); install the {driver} user-space driver in the container (NVIDIA-Linux-x86_64-{driver}.run "
                f"--no-kernel-module, or the distribution's {driver.split('.')[0]} packages), then {reboot}; {cpu}")
    if not libs:
        return (f"{head}: the device nodes are there but the container has no NVIDIA user-space driver "
                f"(no libnvidia-ml.so); install the node's {driver or ''} driver libraries with --no-kernel-module; "
                f"{cpu}")
    return f"{head} ({shortfall.get('reason') or 'no reason given'}); check the container's GPU passthrough; {cpu}"


def kernel_log_lines(ct: Container, pf: dict) -> list[str]:
    """Warning lines for the Xid errors, fallen-off GPUs and resets the node's kernel log
    holds since it booted on a GPU this launch names (matched by PCI bus id, from the
    preflight's health records); a GPU's live faults refuse in the preflight itself
    (agent/gpuhealth.py), so these are its history: a GPU reset since would have cleared it."""
    from controller import kernellog

    health = (pf.get("gpu_health") or {}).get("gpus") or []
    named = set((pf.get("roles") or {}).get("target", [])) | set((pf.get("roles") or {}).get("drafter", []))
    by_pci = {kernellog.pci_key(h.get("pci_bus_id")): h.get("index") for h in health if h.get("index") in named}
    by_pci.pop(None, None)
    if pf.get("device") != "cuda" or not by_pci:
        return []
    reading = kernellog.read(ct.runner, ct.node, None)
    if reading.error:
        return [f"node     kernel log not read for Xid errors since boot ({reading.error})"]
    lines = []
    for f in reading.findings:
        index = by_pci.get(kernellog.pci_key(f.details.get("pci")))
        if index is None:
            continue
        sudo = "sudo " if ct.node.sudo else ""
        lines.append(f"warning: GPU {index} since node {ct.node_name} booted: {f.summary}; shows it: "
                     f"`{sudo}{ct.node.journalctl} -k -b | grep -i -e xid -e 'fallen off'` on node {ct.node_name}")
    return lines
