#!/usr/bin/env bash
# README command 1: the main job on the embedded default, a simulated Proxmox node on this
# machine (real sshd, real LXC containers 200 and 201, an emulated `pct`):
#   bring the node up (each container gets /workspace/tiny/{target,data}, as a real node
#   holds its model and data) → launch the tiny CPU training in container 200 and follow it
#   to the end (it becomes the container's known-good baseline) → start a longer run, tail
#   it, show its status → kill it and roll the environment back to the known-good one.
#
# DFLASH_DEMO_NODE / DFLASH_DEMO_CTIDS pick another sim node (tests run the demo on a node of
# their own, e.g. on a freshly booted host: tests/test_fresh_host.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
say() { printf '\n=== %s\n' "$*"; }

NODE=${DFLASH_DEMO_NODE:-sim}
CTIDS=${DFLASH_DEMO_CTIDS:-200,201}
CT=${CTIDS%%,*}
on_node=(--node "$NODE")

say "bring up the simulated Proxmox node"
ctl sim up --name "$NODE" --ctids "$CTIDS"
say "the environment a process in container $CT gets through ssh + pct exec (scrubbed)"
ctl env --container "$CT" "${on_node[@]}"
say "manage container $CT's venv as generations, so there is something to roll back to"
ctl env adopt --container "$CT" "${on_node[@]}"
say "launch the tiny CPU training in container $CT and follow it to the end"
ctl launch --container "$CT" "${on_node[@]}" --config examples/tiny.toml --from-scratch --follow
ctl status --container "$CT" "${on_node[@]}"

say "start a longer run, tail it for a while (Ctrl-C only detaches), show its status"
ctl launch --container "$CT" "${on_node[@]}" --config examples/tiny.toml --from-scratch \
    --set epochs=1000 --set max-steps=100000
timeout -s INT 20 ctl tail --container "$CT" "${on_node[@]}" --follow || true
ctl status --container "$CT" "${on_node[@]}"

say "kill it (SIGTERM: the trainer checkpoints) and roll back to the known-good environment"
ctl kill-and-rollback --container "$CT" "${on_node[@]}" --grace 30 --yes
ctl history --container "$CT" "${on_node[@]}"
