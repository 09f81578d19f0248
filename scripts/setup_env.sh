#!/usr/bin/env bash
# Creates (or refreshes) the local virtual environment .venv with every backend.
# Reinstalls only when pyproject.toml or constraints.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.kd-installed
want=$(cat pyproject.toml constraints.txt constraints-next.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # A CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
  .venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[jax,tensorflow-cpu,torch,test,examples,docs,hub,ray]"
  # keras-hub without its dependencies: tensorflow-text would pull the full
  # tensorflow wheel next to tensorflow-cpu (see pyproject.toml, extra "hub").
  .venv/bin/python -m pip install -q -c constraints.txt --no-deps keras-hub==0.32.0
  # The next Keras (constraints-next.txt), beside the release one: the
  # second test stack puts .venv/keras-next first on PYTHONPATH.
  rm -rf .venv/keras-next
  .venv/bin/python -m pip install -q --no-deps --target .venv/keras-next \
    -r constraints-next.txt
  echo "$want" > "$stamp"
fi
