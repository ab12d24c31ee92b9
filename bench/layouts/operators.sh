#!/usr/bin/env bash
# The operators' layouts 3 + 1 and 2 + 2 on four GPUs of one host: the operators' exact flag set
# (their launch command without the wandb flags: no wandb on that image) on a synthetic
# Qwen3-27B-shaped target (random weights made on the GPUs), under the agent, in the two
# layouts four GPUs allow: 3 target + 1 drafter and 2 + 2. Then the 1 + 1
# Qwen3-8B split again with the target's next-step prefetch (train.py), and a config whose
# predicted need (margin left out) exceeds the free memory by ~200 MB, refused before training.
# Everything but log.txt comes back in results.tgz (the tool returns at most 8 files).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=$(mktemp -d); FINAL_OUT=${OUT:-$W/final}; mkdir -p $W/out "$FINAL_OUT"
export OUT=$W/out
exec > >(tee "$FINAL_OUT/log.txt") 2>&1
T0=$(date +%s)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
source bench/layouts/agent_run.sh
# packed after every phase: a call cut by its time limit never runs an EXIT trap (an archive
# written at exit was lost that way)
pack() { tar czf "$FINAL_OUT/results.tgz.part" -C $W out && mv "$FINAL_OUT/results.tgz.part" "$FINAL_OUT/results.tgz"; }
nvidia-smi --query-gpu=index,name,memory.total,power.limit,driver_version --format=csv > $OUT/gpus.csv
OPS=(--epochs 6 --lr 6e-4 --warmup-ratio 0.04 --weight-decay 0.01 --grad-accum 4 --grad-clip 1.0
     --token-budget 49152 --max-seq-len 8192 --max-batch-size 64 --block-size 32 --max-anchors 1024
     --num-draft-layers 5 --gamma 10.0 --noise-start 0.05 --noise-end 0.01 --noise-type uniform
     --use-soft-labels --kl-weight 0.15 --kl-temperature 2.0 --cap-lambda 0.1 --save-interval 2000)

el "synthetic targets"
python3 -m trainer synthetic --shape qwen3-27b-like --out $W/s27 --samples 96 --max-len 8192
python3 -m trainer synthetic --shape qwen3-8b --out $W/s8 --samples 96 --max-len 8192
T27=(--target-model $W/s27/target --data-dir $W/s27/data --device cuda)
T8=(--target-model $W/s8/target --data-dir $W/s8/data --device cuda)

el "layout 3+1"
run_agent l3p1 70 python3 -m trainer "${T27[@]}" "${OPS[@]}" --target-gpus 0,1,2 --drafter-gpus 3 --from-scratch \
  --max-steps 3 --log-interval 1 --output-dir $W/l3p1/output
pack
el "layout 2+2"
run_agent l2p2 70 python3 -m trainer "${T27[@]}" "${OPS[@]}" --target-gpus 0,1 --drafter-gpus 2,3 --from-scratch \
  --max-steps 3 --log-interval 1 --output-dir $W/l2p2/output

pack
el "split 1+1 with prefetch; ~200 MB over, refused"
run_agent split8b 45 python3 -m trainer "${T8[@]}" "${OPS[@]}" --target-gpus 1 --drafter-gpus 2 --from-scratch \
  --max-steps 4 --log-interval 1 --output-dir $W/split8b/output &
P=$!
SHORT=("${T8[@]}" "${OPS[@]}" --target-gpus 0 --drafter-gpus 0 --from-scratch --max-steps 2)
python3 bench/memory_model/ballast.py --gpu 0 --short-mib 200 --without-margin --ready $W/ballast.json -- "${SHORT[@]}" > $OUT/ballast.json &
BP=$!
for i in $(seq 1 120); do [ -f $W/ballast.json ] && break; sleep 0.5; done
cat $OUT/ballast.json
timeout 120 python3 -m trainer "${SHORT[@]}" --output-dir $W/short8b > $OUT/short8b.log 2>&1
el "short8b rc $?"; grep -v '^\s*$' $OUT/short8b.log | tail -3
cp $W/short8b/events.jsonl $OUT/short8b-events.jsonl 2>/dev/null
kill $BP; wait $BP 2>/dev/null
wait $P
pack
el "done"
