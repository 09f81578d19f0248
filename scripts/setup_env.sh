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
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
extras="jax,tensorflow-cpu,torch,test,examples,docs,hub,ray"

# The installer: uv (installed into .venv by pip) unpacks the same pinned
# wheels in parallel and leaves compiling the bytecode to the first import
# of each module (the suite imports a fraction of what pip would compile);
# 15 s here where pip took 106 (2 cores, no download cache). Where pip is
# configured to find wheels on this machine (find-links: a CPU build of
# torch lies on disk here), uv is told the same. KD_INSTALLER=pip, or uv
# not installing, uses pip for the same steps.
install_with_uv() {
  .venv/bin/python -m pip install -q uv || return 1
  local links
  links=${PIP_FIND_LINKS:-$(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true)}
  local uv=(.venv/bin/uv pip install -q --python .venv/bin/python)
  local link
  for link in $links; do
    uv+=(--find-links "$link")
  done
  # A CPU build of torch first: an unpinned torch pulls a multi-GB CUDA build.
  "${uv[@]}" -c constraints.txt torch==2.13.0 &&
    "${uv[@]}" -c constraints.txt -e ".[$extras]" &&
    # keras-hub without its dependencies: tensorflow-text would pull the full
    # tensorflow wheel next to tensorflow-cpu (see pyproject.toml, extra "hub").
    "${uv[@]}" -c constraints.txt --no-deps keras-hub==0.32.0 &&
    # The next Keras (constraints-next.txt), beside the release one: the
    # second test stack puts .venv/keras-next first on PYTHONPATH.
    rm -rf .venv/keras-next &&
    "${uv[@]}" --no-deps --target .venv/keras-next -r constraints-next.txt
}

install_with_pip() {
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[$extras]"
  .venv/bin/python -m pip install -q -c constraints.txt --no-deps keras-hub==0.32.0
  rm -rf .venv/keras-next
  .venv/bin/python -m pip install -q --no-deps --target .venv/keras-next \
    -r constraints-next.txt
}

if [ "${KD_INSTALLER:-uv}" = "pip" ]; then
  install_with_pip
elif ! install_with_uv; then
  echo "setup_env.sh: uv did not install the environment; installing with pip" >&2
  install_with_pip
fi
echo "$want" > "$stamp"
