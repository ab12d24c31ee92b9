#!/usr/bin/env bash
# README command 2: the whole test suite, set-up included. Extra arguments go to pytest.
#
# Two pytest processes side by side, one per core: the tests of the simulated nodes (-m sim:
# one process, in order, so the nodes are brought up once and never driven by two sessions)
# with a few long ones that need no node (-m sim_side: the sim tests alone end minutes
# earlier), and all the others. The second's output follows the first's; the exit code is the worse.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
for arg in "$@"; do  # a selection by marker of one's own: one process, as asked
  case "$arg" in -m|-m*) exec .venv/bin/pytest -q -ra "$@" ;; esac
done
log=$(mktemp -t dflash-tests-XXXXXX.log)
trap 'rm -f "$log"' EXIT
.venv/bin/pytest -q -ra -m "not sim and not sim_side" "$@" >"$log" 2>&1 &
other=$!
sim_rc=0
.venv/bin/pytest -q -ra -m "sim or sim_side" "$@" || sim_rc=$?
other_rc=0
wait "$other" || other_rc=$?
echo "== the other tests (-m 'not sim and not sim_side')"
cat "$log"
# 5: nothing collected on one side (a selection that names only the other kind of test).
for rc in "$sim_rc" "$other_rc"; do
  [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ] || exit "$rc"
done
[ "$sim_rc" -eq 0 ] || [ "$other_rc" -eq 0 ] || exit 5
