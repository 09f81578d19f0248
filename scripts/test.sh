#!/usr/bin/env bash
# Installs (or refreshes) .venv and runs the whole suite under every Keras
# backend, one after another (they would fight for 2 cores in parallel).
set -uo pipefail
cd "$(dirname "$0")/.."
# A stage's heading says when it began (minutes:seconds since this started).
stage() {
  current="$*"
  printf '=== %s (at %d:%02d) ===\n' "$*" $((SECONDS / 60)) $((SECONDS % 60))
}
# Each stage that fails is named again at the end (CI keeps only the tail).
failed_stages=()
fail() { status=1; failed_stages+=("$current"); }
# Each pytest run's output is also kept here, for its FAILED/ERROR lines.
logs=$(mktemp -d)
# One XLA compilation cache for the whole run, both Keras stacks (else
# tests/conftest.py makes one per pytest run): the next Keras traces the
# same small models to the same programs, so its JAX stage compiles few of
# its own (measured on six of its files: 67 s cold, 38 s after the release
# stage's). Keyed by the program, its devices and XLA's flags.
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d -t kd-test-xla-cache-XXXXXX)
  export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0  # (small programs too)
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
bash scripts/setup_env.sh || exit 1
export TF_CPP_MIN_LOG_LEVEL=2
# The suite starts hundreds of Python processes: let them keep the bytecode
# of kd's and the tests' modules (git ignores __pycache__) rather than
# compile them again in each one, where the environment says not to write it.
unset PYTHONDONTWRITEBYTECODE
status=0
backends=${KD_BACKENDS:-jax tensorflow torch}
# Two test files at a time (pytest-xdist; a file's tests stay together, so
# module fixtures such as a Ray cluster are made once): a third of the tests
# wait on processes they started, and CI has 2 cores. KD_TEST_WORKERS=0
# runs everything in one process.
workers=${KD_TEST_WORKERS:-2}
parallel=""
if [ "$workers" != "0" ]; then
  # In collection order (tests/conftest.py puts the longest files first).
  parallel="-n $workers --dist loadfile --no-loadscope-reorder"
fi
rm -f .venv/bad-inputs-*.json*
# The lint (config in pyproject.toml): sorted single-line imports, line
# length, blank lines, pyflakes.
stage "lint: ruff check"
.venv/bin/ruff check . || fail
# The type check (config in pyproject.toml): the whole package, strictly on
# the engine contract (backend/interface.py), the lowest layer (common/) and
# the checkpoint's save and restore protocol (checkpointer, restoring).
stage "type check: mypy -p keras_distribute"
.venv/bin/python -m mypy -p keras_distribute || fail
for backend in $backends; do
  stage "KERAS_BACKEND=$backend"
  # Every bad input a test tries is recorded for docs/bad_inputs.md.
  KD_RECORD_BAD_INPUTS=.venv/bad-inputs-$backend.json KERAS_BACKEND=$backend \
    .venv/bin/python -m pytest -q -p no:cacheprovider --durations=${KD_DURATIONS:-12} \
    $parallel tests "$@" 2>&1 | tee "$logs/release-$backend.log" || fail
done
if [ "$backends" = "jax tensorflow torch" ] && [ $# -eq 0 ]; then
  stage "docs/bad_inputs.md lists what the suite tries"
  .venv/bin/python scripts/bad_inputs_table.py --check .venv/bad-inputs-*.json* || fail
fi
stage "docs/benchmarks.md tables match benchmarks/results/"
.venv/bin/python benchmarks/make_tables.py --check || fail
# A short run of each fit benchmark (kd and its anchor interleaved), which
# fails only on a gross slow-down (over 1.25x the recorded ratio): on
# request (KD_BENCH_GUARD=1), before landing a change that adds work to every
# step. Speed is measured, never asserted by the suite (DEVELOPERS.md).
if [ $# -eq 0 ] && [ "${KD_BENCH_GUARD:-0}" = "1" ]; then
  stage "benchmarks: short-run regression guard"
  .venv/bin/python benchmarks/regression_guard.py || fail
fi
# The second stack: the pinned next Keras (constraints-next.txt) first on
# the path. It must really be the one imported (else this proves nothing).
next_version=$(sed -n 's/^keras-nightly==//p' constraints-next.txt)
for backend in ${KD_NEXT_BACKENDS:-jax tensorflow torch}; do
  stage "next Keras $next_version, KERAS_BACKEND=$backend"
  if ! PYTHONPATH=.venv/keras-next KERAS_BACKEND=$backend .venv/bin/python -c \
      "import keras, sys; sys.exit(keras.__version__ != '$next_version')"; then
    echo "the next Keras $next_version is not what .venv/keras-next imports"
    fail
    continue
  fi
  # The docs' blocks and recipes (test_docs_blocks.py, test_docs_recipes.py),
  # the examples and the notebooks run on the release stack only: programs
  # over the code paths the tests below run, kept off this stack for CI's
  # budget (30 min on 2 cores). The files that import no Keras (the
  # launcher's signals, the cluster resolvers, the package's import layers)
  # cannot change with it. Ray
  # Train (test_ray_train.py) runs BackupAndRestore's paths, which the next
  # stack runs in its own tests; under the budget it runs on the release one,
  # as the soak (test_soak.py) does, and the GPU tier's command on a CPU
  # (test_gpu_tier_script.py: it skips there). A lost, frozen, hung or never-joining worker
  # tests the engines' failure detection and the launchers, not Keras; so
  # does the several-hosts tier (test_several_hosts.py: network namespaces),
  # and so do a JAX worker started by hand, torchrun starting a JAX job and
  # the script launcher's fork server; and so do the rendezvous checks (a
  # one-host job listening on loopback, a taken port, workers given
  # different clusters). A checkpoint restored on another backend tests the
  # format between frameworks: the in-process restores on each backend run
  # here. Checkpoints in object storage (test_object_store.py) add an upload
  # and a download around the same gather and assignment the checkpoint
  # tests run here. The dry run (test_dry_run.py) adds verdicts over the
  # layout check and the memory estimate, whose own tests run here; the
  # scratch XLA:CPU's kernels take (test_xla_cpu_kernels_...) runs no Keras,
  # nor does gloo's staging of a collective (test_gloo_collectives_...).
  # The memory estimate's accuracy against what a real step holds, each a
  # fresh interpreter measuring its resident set or TensorFlow's allocator
  # (the JAX and torch steps' resident memory, the torch step's last
  # gradients, torch steps sharded across processes, TensorFlow's trace),
  # is measured on the release stack; the estimate's own tests (its parts,
  # every optimizer's slots, XLA's analysis of Keras' step) run here.
  # Of the files that start jobs of several processes, it runs the
  # comparisons of a whole job with one process (tests/conftest.py,
  # KD_KERAS_STACK=next). TensorFlow gets 2 logical devices instead of 4
  # (KD_TEST_TF_DEVICES): MirroredStrategy traces each step once per
  # replica (this stage: 3:07 in c40, 2:03-2:18 in c41 and c43), and the
  # replica count is the release stack's to vary; the tests of 4 named
  # devices skip here.
  KD_KERAS_STACK=next KD_DOCS_BLOCKS=0 KD_TEST_TF_DEVICES=2 \
    PYTHONPATH=.venv/keras-next KERAS_BACKEND=$backend \
    .venv/bin/python -m pytest -q -p no:cacheprovider --durations=${KD_DURATIONS:-12} \
    $parallel --ignore=tests/test_notebooks.py --ignore=tests/test_examples.py \
    --ignore=tests/test_launcher_signals.py \
    --ignore=tests/test_cluster_resolver.py --ignore=tests/test_ray_train.py \
    --ignore=tests/test_import_layers.py \
    --ignore=tests/test_soak.py --ignore=tests/test_gpu_tier_script.py \
    --ignore=tests/test_several_hosts.py --ignore=tests/test_object_store.py \
    --ignore=tests/test_dry_run.py \
    -k "not lost_worker and not never_joins and not frozen_rank and not hung and not started_by_hand and not torchrun_launches and not launch_module_runs and not listens_on_loopback and not taken_port and not different_clusters and not another_backend and not xla_cpu_kernels and not gloo_collectives and not resident_memory and not holds_the_last_gradients and not ten_percent_across_processes and not traces_the_step_within_30_percent" \
    tests "$@" 2>&1 | tee "$logs/next-$backend.log" || fail
done
stage "docs: mkdocs build --strict"
site=$(mktemp -d)
# No -q: strict mode then fails on every warning (griffe's included).
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$site" && echo "docs built" || fail
rm -rf "$site"
for name in "${failed_stages[@]}"; do
  echo "FAILED stage: $name"
done
grep -h -E '^(FAILED|ERROR) ' "$logs"/*.log 2>/dev/null | head -40
rm -rf "$logs"
stage "end: exit status $status"
exit $status
