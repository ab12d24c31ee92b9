#!/usr/bin/env bash
# One device call (nvidia-h200, one GPU), issue 17: DFlash2 against DFlash. NOT YET RUN.
#
#   run: {"kind": "nvidia-h200", "timeout_s": 600,
#         "command": "cd .carry-dflash2 && bash bench/gpu/dflash2.sh"}
#
# 1. the drafter step of both architectures at the operators' config, same batch
#    (bench/gpu/dflash2_step.py: drafted positions/s, MFU, allocated/reserved peaks beside the
#    memory model), about 2 minutes with the compiles;
# 2. the quality pipeline (bench/quality/run.py, gpu-short scale, shortened drafter training)
#    for the variants "decay" (DFlash, the reference objective) and "dflash2" (the same
#    objective, --drafter-arch dflash2): one target, one data set, the same steps and block
#    size, seed 0, then seed 1 on the same target and data (--reuse-target): τ block and tree
#    (budgets 16/32/64) per prompt, paired Δτ against "decay" with 95 % intervals over prompts
#    (report.delta_table, printed by the seed runs' tables and by reevaluate.py), lossless
#    checked on every prompt, and the τ-vs-steps plot of both variants.
# Each phase has its own time limit (the whole call stays under the tool's 600 s) and the
# outputs are packed into $OUT/results.tgz after every phase, so a cut-off call keeps what
# finished (the tool returns at most 8 files). Afterwards, here:
#   tar xzf results.tgz; python3 bench/quality/report.py out/q-seed0/results.json
# and the Δτ tables: python3 -c "import sys; sys.path[:0]=['bench/quality']; import json, report;
#   print(report.delta_table(json.load(open('out/q-seed1/results.json'))))"
set -u
export PYTHONUNBUFFERED=1
FINAL_OUT=${OUT:-/tmp/out}; W=/tmp/dflash2-ws; rm -rf "$W"; mkdir -p "$W/out" "$FINAL_OUT"
exec > >(tee "$FINAL_OUT/log.txt") 2>&1
T0=$(date +%s)
left() { echo $(( 585 - ($(date +%s) - T0) )); }
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar czf "$FINAL_OUT/results.tgz.part" -C "$W" out && mv "$FINAL_OUT/results.tgz.part" "$FINAL_OUT/results.tgz"; }
nvidia-smi --query-gpu=index,name,memory.total,power.limit,driver_version --format=csv > "$W/out/gpu.csv" || true
git log -1 --format='%H %s' > "$W/out/commit.txt" 2>/dev/null || true

el "drafter step: dflash vs dflash2 at the operators' config"
timeout -s TERM 170 python3 bench/gpu/dflash2_step.py --out "$W/out/step" --iters 3
el "step rc $?"; pack

Q=(--scale gpu-short --variants decay,dflash2 --work "$W/work"
   --set drafter.steps=150 --set drafter.save_interval=50 --set eval.prompts=8 --set eval.tree_prompts=4)
budget=$(( $(left) * 55 / 100 ))
el "quality seed 0 (${budget} s)"
timeout -s TERM $(( budget + 10 )) python3 bench/quality/run.py "${Q[@]}" --deadline-s "$budget" --out "$W/out/q-seed0"
el "seed 0 rc $?"; pack

budget=$(( $(left) - 20 ))
if [ "$budget" -gt 60 ]; then
  el "quality seed 1 on the same target and data (${budget} s)"
  timeout -s TERM $(( budget + 10 )) python3 bench/quality/run.py "${Q[@]}" --reuse-target --seed 1 \
    --deadline-s "$budget" --out "$W/out/q-seed1"
  el "seed 1 rc $?"
else
  el "seed 1 skipped: ${budget} s left"
fi
pack
el "done"
