# Sourced by the device-call scripts: run_agent NAME MAX_POLLS ARGV... starts ARGV under the
# agent (python3 -m agent start), polls `agent status` every 3 s into $OUT/agent_status.jsonl
# until result.json appears, then prints the run's state, root cause, ranks, GPUs and step /
# error / probe events, and appends its events to $OUT/events.jsonl. Needs $W (work dir).
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
  if [ ! -f $D/result.json ]; then  # out of polls: stop it (SIGTERM, checkpoint) so the GPUs are free for the next run
    echo "[$name] still running after $polls polls: stopping"
    python3 -m agent stop --run-dir $D --grace 60 | tail -1
  fi
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
with open(os.path.join(os.environ["OUT"], "events.jsonl"), "a") as out:
    for line in open(os.path.join(d, "events.jsonl")):
        ev = json.loads(line); ev.pop("traceback", None); ev["run"] = name
        out.write(json.dumps(ev) + "\n")
        if ev.get("kind") in ("step", "error", "probe"):
            print(f"[{name}] {json.dumps(ev)[:420]}")
PY
}
