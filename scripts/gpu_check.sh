#!/usr/bin/env bash
# The GPU tier (tests/gpu/, marker `gpu`) on a machine with a GPU, in well
# under 10 minutes. The machine's own CUDA builds of torch and JAX are used
# as they are; what it lacks (Keras and its pure-Python dependencies) is
# installed from wheels carried in .whl/ (see docs/gpu.md, "The GPU tier").
# Results: JUnit XML per backend, the tier's JSON (parity, async-save
# blocking, step times) and nvidia-smi's view, under $OUT (else
# ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
python=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  "$python" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/kd-gpu-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/kd-gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi" > "$out/nvidia-smi.txt"
KERAS_BACKEND=torch "$python" -c "
import sys, importlib, keras
print('keras', keras.__version__, 'python', sys.version.split()[0])
for name in ('torch', 'jax', 'jaxlib', 'numpy', 'h5py'):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:
        print(name, 'not importable:', error)" \
  | tee "$out/versions.txt" || exit 1
status=0
for backend in ${KD_GPU_BACKENDS:-torch jax}; do
  echo "=== GPU tier, KERAS_BACKEND=$backend ==="
  # -rs: the reason of every skip is printed (a CPU machine skips them all).
  KERAS_BACKEND=$backend KD_GPU_RESULTS="$out" \
    KD_GPU_TIER_DRY_RUN=${KD_GPU_TIER_DRY_RUN:-0} timeout 270 \
    "$python" -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu \
    --junitxml="$out/gpu-$backend.xml" || status=1
done
exit $status
