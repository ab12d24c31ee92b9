#!/usr/bin/env bash
# README command 1: the main job on the embedded default, a simulated Proxmox node on this
# machine (real sshd, real LXC containers 200 and 201, an emulated `pct`):
#   bring the node up (each container gets /workspace/tiny/{target,data}, as a real node
#   holds its model and data) → launch the tiny CPU training in container 200 and follow it
#   to the end (it becomes the container's known-good baseline) → start a longer run, tail
#   it, show its status → kill it and roll the environment back to the known-good one.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
say() { printf '\n=== %s\n' "$*"; }

say "bring up the simulated Proxmox node"
ctl sim up
say "the environment a process in container 200 gets through ssh + pct exec (scrubbed)"
ctl env --container 200
say "manage container 200's venv as generations, so there is something to roll back to"
ctl env adopt --container 200
say "launch the tiny CPU training in container 200 and follow it to the end"
ctl launch --container 200 --config examples/tiny.toml --from-scratch --follow
ctl status --container 200

say "start a longer run, tail it for a while (Ctrl-C only detaches), show its status"
ctl launch --container 200 --config examples/tiny.toml --from-scratch --set epochs=1000 --set max-steps=100000
timeout -s INT 20 ctl tail --container 200 --follow || true
ctl status --container 200

say "kill it (SIGTERM: the trainer checkpoints) and roll back to the known-good environment"
ctl kill-and-rollback --container 200 --grace 30 --yes
ctl history --container 200
