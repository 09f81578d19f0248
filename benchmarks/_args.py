"""Command-line options shared by the benchmarks (imports no framework)."""

import argparse


def fit_benchmark_args(description: str, devices: int):
    """`--devices`, `--steps`, `--trials`, `--batch-size`, parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, default=devices)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    return parser.parse_args()


def model_parallel_args(description: str, width: int):
    """`--steps`, `--trials`, `--width` (of the sharded layer), parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--width", type=int, default=width)
    return parser.parse_args()


def checkpoint_args(doc: str, devices=None) -> argparse.ArgumentParser:
    """The checkpoint benchmarks' parser: `--megabytes`, `--repeats`,
    `--directory` and, given a default, `--devices` (not parsed yet: a
    script may add its own)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--directory", default=None,
                        help="where to write (default: a temporary one)")
    if devices is not None:
        parser.add_argument("--devices", type=int, default=devices)
    return parser
