#!/usr/bin/env bash
# One device call (nvidia-h200, one GPU), issue 17: DFlash2 against DFlash.
#
#   run: {"kind": "nvidia-h200", "timeout_s": 600, "command": "bash bench/gpu/dflash2.sh [PHASES]"}
#   PHASES: "step quality" (default) or one of them
#
# step: the drafter step of both architectures at the operators' config, same batch
#    (bench/gpu/dflash2_step.py: drafted positions/s, MFU, allocated/reserved peaks beside the
#    memory model), about 2.5 minutes with the compiles;
# quality: the quality pipeline (bench/quality/run.py, gpu-short scale, 150 drafter steps,
#    the served-path comparison left out) for the variants "decay" (DFlash, the reference
#    objective) and "dflash2" (the same objective, --drafter-arch dflash2): seed 0 trains the
#    target and writes the data; seed 1 starts on the same target and data (--reuse-target) as
#    soon as seed 0 has written them (work/stages.json, written atomically) and runs beside it
#    on the same GPU (the models are small: neither fills it). Each: τ block and tree (budgets
#    16/32/64) per prompt, paired Δτ against "decay" with 95 % intervals over prompts
#    (report.delta_table), lossless checked on every prompt, the τ-vs-steps plot.
# Each phase has its own time limit (the whole call stays under the tool's 600 s) and the
# outputs are packed into $OUT/results.tgz after every phase, so a cut-off call keeps what
# finished. Afterwards, here:
#   tar xzf results.tgz; python3 bench/quality/report.py out/q-seed0/results.json
# and the Δτ tables: python3 -c "import sys; sys.path[:0]=['bench/quality']; import json, report;
#   print(report.delta_table(json.load(open('out/q-seed1/results.json'))))"
set -u
export PYTHONUNBUFFERED=1
FINAL_OUT=${OUT:-/tmp/out}; W=/tmp/dflash2-ws; rm -rf "$W"; mkdir -p "$W/out" "$FINAL_OUT"
exec > >(tee "$FINAL_OUT/log.txt") 2>&1
T0=$(date +%s)
CALL_S=${CALL_S:-585}  # the whole call's seconds (the tool allows 600)
left() { echo $(( CALL_S - ($(date +%s) - T0) )); }
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar czf "$FINAL_OUT/results.tgz.part" -C "$W" out && mv "$FINAL_OUT/results.tgz.part" "$FINAL_OUT/results.tgz"; }
nvidia-smi --query-gpu=index,name,memory.total,power.limit,driver_version --format=csv > "$W/out/gpu.csv" || true
git log -1 --format='%H %s' > "$W/out/commit.txt" 2>/dev/null || true

PHASES=${1:-"step quality"}
if [[ " $PHASES " == *" step "* ]]; then
  el "drafter step: dflash vs dflash2 at the operators' config"
  timeout -s TERM 170 python3 bench/gpu/dflash2_step.py --out "$W/out/step" --iters 3
  el "step rc $?"; pack
fi

if [[ " $PHASES " == *" quality "* ]]; then
  # (QUALITY_ARGS: other scale settings, e.g. a CPU check of this script:
  #  QUALITY_ARGS="--scale cpu --set drafter.steps=20" bash bench/gpu/dflash2.sh quality)
  read -r -a Q <<< "${QUALITY_ARGS:---scale gpu-short --set drafter.steps=150 --set drafter.save_interval=50 --set eval.prompts=8 --set eval.tree_prompts=4}"
  Q+=(--variants decay,dflash2 --work "$W/work" --set eval.served=false)
  budget=$(( $(left) - 25 ))
  el "quality seed 0 (${budget} s)"
  timeout -s TERM $(( budget + 10 )) python3 bench/quality/run.py "${Q[@]}" --deadline-s "$budget" \
    --out "$W/out/q-seed0" > "$W/out/q-seed0.log" 2>&1 &
  seed0=$!
  while [ ! -f "$W/work/stages.json" ] && kill -0 "$seed0" 2>/dev/null; do sleep 2; done
  budget=$(( $(left) - 25 ))
  if [ -f "$W/work/stages.json" ] && [ "$budget" -gt 60 ]; then
    el "quality seed 1 on the same target and data, beside seed 0 (${budget} s)"
    timeout -s TERM $(( budget + 10 )) python3 bench/quality/run.py "${Q[@]}" --reuse-target --seed 1 \
      --deadline-s "$budget" --out "$W/out/q-seed1" > "$W/out/q-seed1.log" 2>&1
    el "seed 1 rc $?"
  else
    el "seed 1 not started: no target and data from seed 0, or ${budget} s left"
  fi
  wait "$seed0"; el "seed 0 rc $?"
  tail -n 25 "$W/out/q-seed0.log" "$W/out/q-seed1.log" 2>/dev/null
fi
pack
el "done"
