#!/usr/bin/env bash
# One device call of the quality pipeline: `bash bench/quality/device.sh [gpu|gpu-short]`.
# Outputs come back packed in $OUT/quality.tgz: the device tool returns at most 8 files, and
# call 4 lost results.json, the plot and the events of a full run that way.
set -u
SCALE=${1:-gpu}
case $SCALE in gpu) LIMIT=585 ;; gpu-short) LIMIT=330 ;; *) echo "device.sh: scale gpu or gpu-short, not $SCALE" >&2; exit 2 ;; esac
W=/tmp/quality-out
rm -rf "$W"
PYTHONUNBUFFERED=1 timeout -s TERM "$LIMIT" python3 bench/quality/run.py --scale "$SCALE" --out "$W"
rc=$?
tar czf "${OUT:-/tmp}/quality.tgz" -C /tmp quality-out
exit $rc
