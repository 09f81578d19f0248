"""Where the benchmarks write their results (imports no framework).

Each script prints its JSON object and, through `record`, writes it to
`benchmarks/results/<name>.json` with the date, the commit and the versions
it ran with; `benchmarks/make_tables.py` turns those files into the tables of
docs/benchmarks.md.
"""

import datetime
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# KD_BENCH_RESULTS: write elsewhere (CI's short regression run, a trial
# run) and leave the recorded results alone.
RESULTS = os.environ.get("KD_BENCH_RESULTS") or os.path.join(HERE, "results")
_VERSIONED = ("keras", "jax", "tensorflow", "torch", "numpy", "h5py",
              "orbax.checkpoint")


def _commit() -> str:
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], cwd=HERE, capture_output=True, text=True,
            check=True).stdout.strip()
        commit = run("rev-parse", "--short=10", "HEAD")
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(name: str, result: dict) -> dict:
    """Prints `result` as JSON and writes it, with its provenance, to
    `benchmarks/results/<name>.json`. Returns what was written."""
    print(json.dumps(result))
    entry = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d"),
        "commit": _commit(),
        "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, "
                   f"Python {platform.python_version()}",
        "versions": {m: getattr(sys.modules[m], "__version__", "?")
                     for m in _VERSIONED if m in sys.modules},
        "command": " ".join(["python", *sys.argv]).replace(HERE + os.sep,
                                                          "benchmarks/"),
        "result": result,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as file:
        json.dump(entry, file, indent=1, sort_keys=True)
        file.write("\n")
    return entry
