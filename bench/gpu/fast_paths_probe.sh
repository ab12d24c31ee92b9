#!/usr/bin/env bash
# The fast paths and the memory probe on one H200 (first run as device call 2, 2026-11-29;
# raw results in bench/results/fast_paths_probe/): the fast paths after the static-shape fix, the core engineer's
# Drafter, the 27B-like shapes, the memory probe (measured vs model) and a refused launch.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
set -o pipefail
timeout 430 python3 bench/gpu/run_all.py --out "$OUT" --sections drafter,target,core,drafter27,target27 \
  --target-budgets 8192,49152 --drafter 49152:32:1024,24576:32:1024,49152:16:512 2>&1 | tee "$OUT/log.txt"
echo "=== probe: 27B-like drafter, memory target (96 GB = 89.4 GiB)"
timeout 90 python3 -m trainer.probe --model qwen3-27b-like --token-budget 49152 --capacity-gib 89.4 --run 2>&1 | tee "$OUT/probe27.txt"
echo "=== probe: Qwen3-8B drafter, GPU made 200 MiB short"
timeout 40 python3 -m trainer.probe --model qwen3-8b --token-budget 49152 --ballast-short-mib 200 2>&1 | tee "$OUT/probe_refuse.txt"
echo "probe rc=$?"
