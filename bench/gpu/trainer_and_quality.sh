#!/usr/bin/env bash
# `python -m trainer` on GPUs beside the quality pipeline (nvidia-h200-x4; first run as device
# call 4, raw results in bench/results/trainer_and_quality/). GPU 3: issue 10's quality pipeline (bench/quality/run.py
# --scale gpu). GPUs 0-2 meanwhile: issue 7 inside `python -m trainer` itself on a synthetic
# Qwen3-8B-shaped target (random weights made on the GPU, random full-length data):
#   phase 1  the transformers target + reference drafter step against the defaults on CUDA
#            (fast target + chunked step), colocated, one 8,192-token sequence per step
#            (all the reference step fits beside the target); and --probe-memory of the
#            operators' config split 1 + 1 (measured peak per GPU against the model)
#   phase 2  the operators' flag set split 1 + 1 under the agent (its status kept);
#            --token-budget auto colocated
#   phase 3  a config short by ~200 MB (a ballast process holds the rest) refused before training
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Outputs go to $W/out and come back packed in results.tgz after each phase: the device tool
# returns at most 8 files (the first run of this script lost its quality results that way).
FINAL_OUT=${OUT:-/tmp/out}; W=/tmp/ws; rm -rf $W; mkdir -p $W/out "$FINAL_OUT"
export OUT=$W/out
pack() { tar czf "$FINAL_OUT/results.tgz.part" -C $W out && mv "$FINAL_OUT/results.tgz.part" "$FINAL_OUT/results.tgz"; }
T0=$(date +%s)
nvidia-smi --query-gpu=index,name,memory.total,power.limit,driver_version --format=csv > "$OUT/gpus.csv"
(CUDA_VISIBLE_DEVICES=3 timeout -s TERM 560 python3 bench/quality/run.py --scale gpu --deadline-s 525 \
   --out "$OUT/quality" > "$OUT/quality.log" 2>&1; echo "quality rc $?" >> "$OUT/quality.log") &
QPID=$!
exec > >(tee "$FINAL_OUT/log.txt") 2>&1
source bench/gpu/agent_run.sh
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }

el "synthetic data"
python3 -m trainer synthetic --shape qwen3-8b --out $W/s8 --samples 96 --max-len 8192
T8=(--target-model $W/s8/target --data-dir $W/s8/data --device cuda)
OPS=(--epochs 6 --lr 6e-4 --warmup-ratio 0.04 --weight-decay 0.01 --grad-accum 4 --grad-clip 1.0
     --token-budget 49152 --max-seq-len 8192 --max-batch-size 64 --block-size 32 --max-anchors 1024
     --num-draft-layers 5 --gamma 10.0 --noise-start 0.05 --noise-end 0.01 --noise-type uniform
     --use-soft-labels --kl-weight 0.15 --kl-temperature 2.0 --cap-lambda 0.1 --save-interval 2000)
run_trainer() {  # name, timeout, flags...: python -m trainer, log in $OUT/NAME.log, events copied
  local name=$1 t=$2; shift 2
  timeout -s TERM "$t" python3 -m trainer "$@" --output-dir $W/$name > "$OUT/$name.log" 2>&1
  local rc=$?
  el "$name rc $rc"; grep -v '^\s*$' "$OUT/$name.log" | grep -v 'Loading\|Warning\|warn(' | tail -12
  cp $W/$name/events.jsonl "$OUT/$name-events.jsonl" 2>/dev/null
  return 0
}

el "phase 1"
SEQ1=(--token-budget 8192 --grad-accum 1 --max-steps 8 --log-interval 1)
run_trainer ref8b 240 "${T8[@]}" "${OPS[@]}" "${SEQ1[@]}" --target-gpus 0 --drafter-gpus 0 --from-scratch \
  --target-forward hf --drafter-step reference &
P1=$!
run_trainer fast8b 240 "${T8[@]}" "${OPS[@]}" "${SEQ1[@]}" --target-gpus 1 --drafter-gpus 1 --from-scratch &
P2=$!
wait $P1 $P2
run_trainer probe8b 200 "${T8[@]}" "${OPS[@]}" --target-gpus 0 --drafter-gpus 1 --from-scratch --probe-memory

pack
el "phase 2"
run_agent split8b 90 python3 -m trainer "${T8[@]}" "${OPS[@]}" --target-gpus 0 --drafter-gpus 1 --from-scratch \
  --max-steps 4 --log-interval 1 --output-dir $W/split8b/output &
P3=$!
run_trainer auto8b 240 "${T8[@]}" "${OPS[@]}" --token-budget auto --grad-accum 1 --max-steps 3 --log-interval 1 \
  --target-gpus 2 --drafter-gpus 2 --from-scratch &
P4=$!
wait $P3 $P4

pack
el "phase 3: ~200 MB short, refused before training"
SHORT=("${T8[@]}" "${OPS[@]}" --target-gpus 2 --drafter-gpus 2 --from-scratch --max-steps 2)
python3 bench/gpu/ballast.py --gpu 2 --short-mib 200 --ready $W/ballast.json -- "${SHORT[@]}" > "$OUT/ballast.json" &
BP=$!
for i in $(seq 1 120); do [ -f $W/ballast.json ] && break; sleep 0.5; done
cat "$OUT/ballast.json"
run_trainer short8b 120 "${SHORT[@]}"
ls $W/short8b 2>&1 | head
kill $BP; wait $BP 2>/dev/null

pack
el "waiting for the quality run"
wait $QPID
tail -40 "$OUT/quality.log"
pack
el "done"
