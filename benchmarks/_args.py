"""Command-line options shared by the fit benchmarks (imports no framework)."""

import argparse


def fit_benchmark_args(description: str, devices: int):
    """`--devices`, `--steps`, `--trials`, `--batch-size`, parsed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--devices", type=int, default=devices)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=256)
    return parser.parse_args()
