#!/usr/bin/env bash
# Issue 19 on one H200 (nvidia-h200), one device call: the Qwen3.6-27B hybrid target forward
# (fast vs transformers), its drafter's step at the operators' flags, and a colocated
# `python -m trainer` run on the 64-layer synthetic target; outputs packed into one archive.
#   run from the repository root (a carried copy): bash bench/gpu/hybrid.sh "$OUT" [PHASES]
#   (PHASES: a subset of "model forward drafter colocated", default all)
# Needs the wheels of fla-core and flash-linear-attention 0.6.0 in .whl/ (not on the image;
# /work/.library/device/README.md, Notes, says how to fetch them).
set -u
OUT=${1:?output dir}
PHASES=${2:-"model forward drafter colocated"}
R=$OUT/hybrid
mkdir -p "$R"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$R/pip.log" 2>&1 || { echo "wheel install failed"; cat "$R/pip.log"; }
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, transformers, triton;
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)
import fla; print('fla', fla.__version__)"; } > "$R/env.txt" 2>&1
cat "$R/env.txt"
declare -A LIMIT=([model]=30 [forward]=300 [drafter]=140 [colocated]=230)
for phase in $PHASES; do
  timeout "${LIMIT[$phase]}" python3 bench/gpu/hybrid.py "$phase" "$R" > "$R/$phase.log" 2>&1; echo "$phase rc $?"
done
rm -rf "$R/syn" "$R/run/step_"* "$R/fwd-target"
tar -czf "$OUT/hybrid.tgz" -C "$OUT" hybrid
rm -rf "$R"
tar -xzOf "$OUT/hybrid.tgz" hybrid/results.jsonl | cut -c1-1500
