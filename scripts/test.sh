#!/usr/bin/env bash
# README command 2: the whole test suite, set-up included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/pytest -q -ra "$@"
