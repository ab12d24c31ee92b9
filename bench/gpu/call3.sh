#!/usr/bin/env bash
# Device call 3 (nvidia-h200-x2): split topology under the agent (8B and 27B-like), a real
# CUDA OOM during training reported by the agent, the memory probe (2 steps) and auto budget.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/ws; rm -rf $W; mkdir -p $W
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi topo -m; nvidia-smi --query-gpu=index,name,memory.total,power.limit --format=csv
run_agent() {  # name, max polls, argv...
  local name=$1 polls=$2; shift 2; local D=$W/$name
  echo "=== agent run $name: $*"
  python3 -m agent start --run-dir $D --gpu-interval 2 --stall-timeout 0 -- "$@" | sed -n 2p
  for i in $(seq 1 $polls); do
    sleep 3
    s=$(python3 -m agent status --run-dir $D | sed -n 2p)
    echo "{\"run\": \"$name\", \"poll\": $i, \"status\": $s}" >> "$OUT/agent_status.jsonl"
    [ -f $D/result.json ] && break
  done
  python3 - "$D" "$name" <<'PY'
import json, sys, os
d, name = sys.argv[1], sys.argv[2]
st = json.load(open(os.path.join(d, "status.json")))
res = json.load(open(os.path.join(d, "result.json"))) if os.path.exists(os.path.join(d, "result.json")) else {}
print(f"[{name}] state {st.get('state')} reason {res.get('reason') or st.get('reason')}")
print(f"[{name}] root cause {json.dumps(res.get('root_cause'))[:600]}")
print(f"[{name}] ranks {json.dumps(st.get('ranks'))}")
for g in st.get("gpus") or []:
    print(f"[{name}] gpu {json.dumps(g)[:400]}")
with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "events.jsonl"), "a") as out:
    for line in open(os.path.join(d, "events.jsonl")):
        ev = json.loads(line); ev.pop("traceback", None); ev["run"] = name
        out.write(json.dumps(ev) + "\n")
        if ev.get("kind") in ("step", "error"):
            print(f"[{name}] {json.dumps(ev)[:420]}")
PY
}
run_agent split8b 60 env MASTER_PORT=29601 python3 bench/gpu/train_loop.py --model qwen3-8b --target-gpu 0 --drafter-gpu 1 --steps 8 --log-interval 2
run_agent oom8b 40 env MASTER_PORT=29602 python3 bench/gpu/train_loop.py --model qwen3-8b --target-gpu 0 --drafter-gpu 1 --steps 6 --ballast-at-step 2 --ballast-short-mib 200
run_agent split27b 60 env MASTER_PORT=29603 python3 bench/gpu/train_loop.py --model qwen3-27b-like --target-gpu 0 --drafter-gpu 1 --steps 5 --log-interval 1
echo "=== probe: 27B-like drafter worst case, 2 steps, against 96 GB"
timeout 100 python3 -m trainer.probe --model qwen3-27b-like --token-budget 49152 --capacity-gib 89.4 --gpu 1 --run 2>&1 | tee "$OUT/probe.txt"
echo "=== probe: token budget auto, Qwen3-8B drafter on a 96 GB GPU"
timeout 30 python3 -m trainer.probe --model qwen3-8b --token-budget auto --capacity-gib 89.4 2>&1 | grep -v '^{' | tee -a "$OUT/probe.txt"
