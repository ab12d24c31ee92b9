#!/usr/bin/env bash
# One device call of the quality pipeline: `bash bench/quality/device.sh [gpu|gpu-short|gpu-fp8] [run.py options]`
# (e.g. `gpu-short --variants decay,fp8-taps`). Outputs come back packed in $OUT/quality.tgz:
# the device tool returns at most 8 files, and a full run once lost results.json, the plot and
# the events that way.
set -u
SCALE=${1:-gpu}
shift || true
# run.py budgets itself (the scale's deadline_s: 560 / 300 / 470); timeout is the safety net
case $SCALE in gpu) LIMIT=585 ;; gpu-short) LIMIT=330 ;; gpu-fp8) LIMIT=540 ;;
  *) echo "device.sh: scale gpu, gpu-short or gpu-fp8, not $SCALE" >&2; exit 2 ;; esac
T=$(mktemp -d); W=$T/quality-out
PYTHONUNBUFFERED=1 timeout -s TERM "$LIMIT" python3 bench/quality/run.py --scale "$SCALE" --out "$W" "$@"
rc=$?
tar czf "${OUT:-.}/quality.tgz" -C "$T" quality-out
exit $rc
