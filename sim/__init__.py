"""The simulated Proxmox node for tests and the demo: real sshd + real LXC + a `pct`
emulation (docs/sim.md). Standard library only; entry point: ``sim.node.SimNode``."""
