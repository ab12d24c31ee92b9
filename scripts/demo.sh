#!/usr/bin/env bash
# README command 1: the main job on the embedded default, a simulated Proxmox node on this
# machine (real sshd, real LXC containers 200 and 201, an emulated `pct`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

ctl sim up
echo "--- what a process in container 200 gets, through ssh + pct exec (scrubbed):"
ctl env --container 200
echo "--- a command in container 200 through ctl:"
ctl exec --container 200 -- python3 -c 'import sys, torch; print(sys.executable, "torch", torch.__version__)'
