#!/usr/bin/env bash
# Installs (or refreshes) .venv and trains the digits demo under kd.MirroredStrategy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
KERAS_BACKEND=${KERAS_BACKEND:-jax} .venv/bin/python examples/demo_digits.py "$@"
