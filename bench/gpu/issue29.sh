#!/usr/bin/env bash
# Issue 29's device calls (nvidia-h200, one GPU), from the repository root:
#
#   bash bench/gpu/issue29.sh step        # ceilings, flex options, top-k, the drafter step before/after (~8 min)
#   bash bench/gpu/issue29.sh colocated   # python -m trainer colocated: cold launch, relaunch, a profiled step
#   COLOCATED_S=300 ROOFLINE_ARGS="--phases ceilings,step --archs dflash2 --flex-options {}" \
#     bash bench/gpu/issue29.sh colocated step    # both in one call, in this order
#   ROOFLINE_ARGS="--phases ceilings,head" COLOCATED_ARGS="--scale gpu27" bash bench/gpu/issue29.sh step colocated
#                                         # session 2, call 1: the head kernels, then the Qwen3.6-27B shape
#   bash bench/gpu/issue29.sh kernels     # grad_accumulate's and silu_mul_kernel's sweeps and step before/after
#   COLOCATED_ARGS='--phases cold,shipped' bash bench/gpu/issue29.sh colocated
#                                         # a fresh machine given the cold launch's cache (ctl env cache)
#
# Wheels in .whl/ (flash-linear-attention for the 27B shape's hybrid target; flash-attn-4 and
# its small dependencies) are installed into /tmp/site first and put on PYTHONPATH (the
# trainer's subprocesses inherit it). A wheel over one call's carry (nvidia-cutlass-dsl's cu13
# libraries, 92 MB) travels in parts, one carried folder per call on the same warm machine:
#   python3 bench/gpu/wheel_parts.py split WHEEL --into .whl-part1 .whl-part2
# each call gathers what it brought in /tmp/wheel-parts; the call that completes a wheel
# installs it (bench/gpu/wheel_parts.py). "stage" as the only mode just gathers and installs.
# flash-attn-4's kernel cache (trainer/runtime_env.py) goes under the call's fresh cache too.
# The device tool sends the session's own checkout: from another worktree, unpack
# `git archive BRANCH` (plus .whl/ and a COMMIT file naming the commit) into a folder that
# checkout's .git/info/exclude ignores, carry that folder and cd into it (session 2's calls).
# Outputs go to $OUT (the device tool's folder): log.txt as it runs, results.json and
# results.tgz (everything, small files) after each phase. A fresh compile cache under /tmp, so
# the first step's compile is a cold one.
set -u
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
FINAL=${OUT:-/tmp/out}; W=/tmp/issue29; rm -rf "$W"; mkdir -p "$W/out" "$FINAL"
export TORCHINDUCTOR_CACHE_DIR=$W/cache/inductor TRITON_CACHE_DIR=$W/cache/triton
export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$W/cache/flash-attn-cute
exec > >(tee "$FINAL/log.txt") 2>&1
T0=$(date +%s)
CALL_S=${CALL_S:-570}
left() { echo $(( CALL_S - ($(date +%s) - T0) )); }
pack() { tar czf "$FINAL/results.tgz.part" -C "$W" out && mv "$FINAL/results.tgz.part" "$FINAL/results.tgz"; }
nvidia-smi --query-gpu=index,name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$W/out/gpu.csv" 2>&1 || true
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' > "$W/out/versions.txt" 2>&1
{ cat COMMIT 2>/dev/null || git log -1 --format='%H %s' 2>/dev/null; } > "$W/out/commit.txt"
if ls -d .whl-part* >/dev/null 2>&1; then
  python3 bench/gpu/wheel_parts.py gather --from .whl-part* --stage /tmp/wheel-parts --out /tmp/wheels-whole \
    > "$W/out/wheel_parts.txt" 2>&1; echo "wheel parts rc $?" >> "$W/out/wheel_parts.txt"
fi
wheels=$(ls .whl/*.whl /tmp/wheels-whole/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    > "$W/out/pip.txt" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # the cutlass DSL's .pth file is not read under --target: its packages by hand
  [ -d /tmp/site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  python3 -c 'import fla; print("fla", fla.__version__)' >> "$W/out/versions.txt" 2>&1
  python3 -c 'import flash_attn.cute, cutlass; print("flash_attn.cute", cutlass.__version__)' >> "$W/out/versions.txt" 2>&1
fi
for mode in ${@:-step}; do
  case "$mode" in
    step)  # ROOFLINE_ARGS: e.g. "--phases ceilings,step --archs dflash2 --flex-options {}"
      timeout -s TERM $(( $(left) - 20 )) python3 bench/gpu/roofline.py run --out "$W/out" ${ROOFLINE_ARGS:-}
      echo "roofline rc $?";;
    kernels)  # the elementwise kernels written without a device (session 2026-12-05b): their
      # sweeps, then the DFlash step before/after each (one process per --before; ~6 min)
      timeout -s TERM $(( $(left) - 20 )) python3 bench/gpu/roofline.py run --out "$W/out/kernels" \
        --phases ceilings,silu,accumulate; echo "kernels rc $?"
      for b in addkernel silukernel; do
        timeout -s TERM $(( $(left) - 20 )) python3 bench/gpu/roofline.py run --out "$W/out/$b" --phases step \
          --archs dflash --before $b --iters 3 ${ROOFLINE_ARGS:-}; echo "$b rc $?"
        pack
      done;;
    stage) ;;  # the wheels above, nothing measured
    colocated)
      timeout -s TERM $(( $(left) - 20 )) python3 bench/gpu/colocated.py run --out "$W/co" --work "$W/cowork" \
        --deadline-s ${COLOCATED_S:-$(( $(left) - 30 ))} ${COLOCATED_ARGS:-}
      echo "colocated rc $?"; rm -f "$W/co/results.tgz"; cp -r "$W/cowork/out" "$W/out/colocated" 2>/dev/null;;
  esac
  pack
done
cp "$W/out/results.json" "$FINAL/" 2>/dev/null
pack
echo "[t+$(( $(date +%s) - T0 ))s] done"
