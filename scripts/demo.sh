#!/usr/bin/env bash
# README command 1: the main job on the embedded default, a simulated Proxmox node on this
# machine (real sshd, real LXC containers 200 and 201, an emulated `pct`): bring the node up
# (each container gets /workspace/tiny/{target,data}, as a real node holds its model and
# data), launch the tiny CPU training in container 200 and follow it to the end, then ask
# its status.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

ctl sim up
echo "--- what a process in container 200 gets, through ssh + pct exec (scrubbed):"
ctl env --container 200
echo "--- a command in container 200 through ctl:"
ctl exec --container 200 -- python3 -c 'import sys, torch; print(sys.executable, "torch", torch.__version__)'
echo "--- launch the tiny CPU training in container 200 (preflight, drift report, start) and follow it:"
ctl launch --container 200 --config examples/tiny.toml --from-scratch --follow
echo "--- its status:"
ctl status --container 200
