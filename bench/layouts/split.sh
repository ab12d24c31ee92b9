#!/usr/bin/env bash
# Target and drafter split over two GPUs of one host: split topology under the agent (8B and 27B-like), a real
# CUDA OOM during training reported by the agent, the memory probe (2 steps) and auto budget.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
W=$(mktemp -d); export OUT=${OUT:-$W/out}; mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi topo -m; nvidia-smi --query-gpu=index,name,memory.total,power.limit --format=csv
source bench/layouts/agent_run.sh
run_agent split8b 60 env MASTER_PORT=29601 python3 bench/layouts/train_loop.py --model qwen3-8b --target-gpu 0 --drafter-gpu 1 --steps 8 --log-interval 2
run_agent oom8b 40 env MASTER_PORT=29602 python3 bench/layouts/train_loop.py --model qwen3-8b --target-gpu 0 --drafter-gpu 1 --steps 6 --ballast-at-step 2 --ballast-short-mib 200
run_agent split27b 60 env MASTER_PORT=29603 python3 bench/layouts/train_loop.py --model qwen3-27b-like --target-gpu 0 --drafter-gpu 1 --steps 5 --log-interval 1
echo "=== probe: 27B-like drafter worst case, 2 steps, against 96 GB"
timeout 100 python3 -m trainer.gpu.probe --model qwen3-27b-like --token-budget 49152 --capacity-gib 89.4 --gpu 1 --run 2>&1 | tee "$OUT/probe.txt"
echo "=== probe: token budget auto, Qwen3-8B drafter on a 96 GB GPU"
timeout 30 python3 -m trainer.gpu.probe --model qwen3-8b --token-budget auto --capacity-gib 89.4 2>&1 | grep -v '^{' | tee -a "$OUT/probe.txt"
