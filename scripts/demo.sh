#!/usr/bin/env bash
# README command 1: the operators' story, replayed and recovered on a simulated Proxmox node
# on this machine (real sshd, real LXC containers 200 and 201, an emulated `pct`). Each step
# is one command a user would type, shown with `$`, after a one-line caption:
#   a good run becomes the container's known good → a package change lands in the venv as a
#   new env generation → the next launch reports the drift and is refused → launched anyway
#   with --accept-drift, then stopped → kill-and-rollback restores the known-good generation
#   and prints the resume line → the resumed run continues from its checkpoint to the end →
#   the drafter is exported out of the container.
#
# DFLASH_DEMO_NODE / DFLASH_DEMO_CTIDS pick another sim node (tests run the demo on a node of
# their own, e.g. on a freshly booted host: tests/test_fresh_host.py, tests/test_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"

NODE=${DFLASH_DEMO_NODE:-sim}
CTIDS=${DFLASH_DEMO_CTIDS:-200,201}
CT=${CTIDS%%,*}
CONFIG=examples/tiny.toml
WANDB=(--set wandb.project=dflash-demo)  # offline: files in the run directory, no network
LONG=(--set epochs=100 --set max-steps=400 --set save-interval=50)
OUT=${DFLASH_DEMO_OUT:-out/demo-drafter}
N=0
step() { N=$((N + 1)); printf '\n=== %d. %s\n' "$N" "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }

step "bring up the simulated Proxmox node: sshd on 127.0.0.1, LXC containers $CTIDS, an emulated pct"
run ctl sim up --name "$NODE" --ctids "$CTIDS"

step "the environment a process in container $CT gets: scrubbed, whatever the node's login exports"
run ctl env --container "$CT" --node "$NODE"

step "manage the container's venv as generations, so there is something to roll back to"
run ctl env adopt --container "$CT" --node "$NODE"

step "a good run, followed to the end: it becomes the container's known good (wandb logs offline)"
run ctl launch --container "$CT" --node "$NODE" --config "$CONFIG" --from-scratch "${WANDB[@]}" --follow

step "a package upgrade lands in the venv (numpy, from the container's offline wheelhouse): a new env generation"
run ctl env install --container "$CT" --node "$NODE" numpy==2.4.6 --wheelhouse /workspace/wheelhouse

step "the next launch reports the drift against the known good, package and both versions, and is refused"
rc=0; run ctl launch --container "$CT" --node "$NODE" --config "$CONFIG" --from-scratch "${WANDB[@]}" "${LONG[@]}" || rc=$?
echo "(exit $rc: refused, nothing was started)"
[ "$rc" -eq 3 ]

step "launched anyway with --accept-drift; tail it for a while (Ctrl-C only detaches)"
run ctl launch --container "$CT" --node "$NODE" --config "$CONFIG" --from-scratch --accept-drift "${WANDB[@]}" "${LONG[@]}"
# Until its first optimizer steps, not a fixed time: a run stopped while still starting up has
# nothing to checkpoint, and on a loaded machine start-up takes longer than any fixed wait.
until ctl status --container "$CT" --node "$NODE" --json 2>/dev/null | python3 -c '
import json, sys
st = json.load(sys.stdin).get("status") or {}
sys.exit(0 if (st.get("step") or 0) >= 2 or st.get("state") in ("completed", "failed", "stopped") else 1)'; do
  sleep 1
done
run timeout -s INT 8 ctl tail --container "$CT" --node "$NODE" --follow || true

step "kill it (SIGTERM: it checkpoints) and roll back to the known-good generation, verified"
report=$(mktemp)
run ctl kill-and-rollback --container "$CT" --node "$NODE" --grace 30 --yes | tee "$report"

step "resume from that checkpoint, as the rollback printed it, and follow it to the end"
resume=$(sed -n 's/^  \(ctl launch .*--resume-from .*\)$/\1/p' "$report" | tail -n 1)
rm -f "$report"
[ -n "$resume" ] || { echo "demo: the rollback printed no resume line" >&2; exit 1; }
eval "run $resume --follow"
run ctl status --container "$CT" --node "$NODE"

step "the trained drafter out of the container, as serving stacks load it"
rm -rf "$OUT"; mkdir -p "$(dirname "$OUT")"
run ctl export --container "$CT" --node "$NODE" --to "$OUT"
run ls -l "$OUT"
run ctl history --container "$CT" --node "$NODE"
