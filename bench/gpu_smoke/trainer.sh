#!/usr/bin/env bash
# GPU smoke of the trainer on the tiny target: colocated (1 GPU), split 1 target + 1 drafter
# (NCCL point-to-point), a memory probe, and SIGTERM → exit 75. Logs under $OUT (a temporary folder if unset).
set -u
W=$(mktemp -d)
OUT=${OUT:-$W/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.device_count())' 2>&1 | tee "$OUT/env.log"
python3 -m trainer tiny --out "$W/tiny" > "$OUT/tiny.log" 2>&1 || { tail -20 "$OUT/tiny.log"; exit 1; }
COMMON=(--target-model "$W/tiny/target" --data-dir "$W/tiny/data" --device cuda --block-size 8 --max-anchors 64
        --num-draft-layers 2 --token-budget 4096 --max-seq-len 256 --max-batch-size 32 --grad-accum 2 --lr 3e-3
        --log-interval 10 --use-soft-labels --cap-lambda 0.1 --noise-start 0.05 --noise-end 0.01)
run() { name=$1; shift; echo "== $name"; timeout 300 python3 -m trainer "${COMMON[@]}" --output-dir "$W/$name" "$@" > "$OUT/$name.log" 2>&1; echo "rc $?"; grep -v "^\s*$" "$OUT/$name.log" | grep -v Loading | tail -8; }
run colocated --target-gpus 0 --drafter-gpus 0 --from-scratch --max-steps 60 --save-interval 30 --eval-prompts 2
run split --target-gpus 0 --drafter-gpus 1 --from-scratch --max-steps 30 --save-interval 30
run probe --target-gpus 0 --drafter-gpus 1 --from-scratch --probe-memory
echo "== sigterm"
python3 -m trainer "${COMMON[@]}" --output-dir "$W/stop" --target-gpus 0 --drafter-gpus 1 --from-scratch --epochs 50 > "$OUT/stop.log" 2>&1 &
pid=$!
for i in $(seq 1 600); do grep -q '"kind": "step"' "$W/stop/events.jsonl" 2>/dev/null && break; sleep 0.2; done
kill -TERM $pid; wait $pid; echo "rc $? (75 expected)"; ls "$W/stop"; cat "$W/stop/heartbeat/"*
cp "$W/colocated/events.jsonl" "$OUT/colocated-events.jsonl" 2>/dev/null
