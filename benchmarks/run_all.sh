#!/usr/bin/env bash
# Runs every benchmark (one after another: they would share the cores) and
# rewrites the tables of docs/benchmarks.md from their results. About 25
# minutes on 2 cores. The checkpoint comparison needs orbax-checkpoint
# (pip install "keras_distribute[bench]"); without it orbax's row is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
export TF_CPP_MIN_LOG_LEVEL=2
for script in bench_fit_jax bench_fit_tf bench_fit_torch \
              bench_model_parallel_jax bench_model_parallel_torch \
              bench_compression_torch bench_compression_jax \
              bench_memory_torch bench_memory_jax; do
  echo "=== $script ==="
  "$python" "benchmarks/$script.py"
done
for script in bench_checkpoint_jax bench_checkpoint_torch bench_checkpoint_tf; do
  echo "=== $script (1 GiB, 3 trials) ==="
  "$python" "benchmarks/$script.py" --megabytes 1024
done
echo "=== bench_checkpoint_many (5,000 small variables, 3 trials) ==="
"$python" benchmarks/bench_checkpoint_many.py --variables 5000
for backend in jax tensorflow torch; do
  echo "=== soak on $backend (2 processes x 2,000 steps) ==="
  KERAS_BACKEND=$backend "$python" benchmarks/soak.py
done
echo "=== bench_plan_layout (a Gemma-7B-shaped layout, JAX) ==="
"$python" benchmarks/bench_plan_layout.py
"$python" benchmarks/make_tables.py
