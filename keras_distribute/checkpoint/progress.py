"""One line per large save or restore: bytes, seconds, MB/s, process.

Printed as Keras prints (`keras.config.is_interactive_logging_enabled()`:
to stdout, else to the `keras_distribute` logger), and only when
`CheckpointOptions.verbose` asks: `"auto"` for a process that moved at least
`AUTO_BYTES`, `1` always, `0` never.
"""

import logging
import sys
import time
from typing import Union

AUTO_BYTES = 1 << 30

Verbosity = Union[int, str]


def check_verbose(verbose: Verbosity) -> Verbosity:
    """`verbose` if it is 0, 1 or "auto".

    Raises:
        ValueError: for anything else.
    """
    if verbose == "auto" or (isinstance(verbose, int) and not isinstance(
            verbose, bool) and verbose in (0, 1)):
        return verbose
    raise ValueError(
        "Expected `verbose` to be 0 (silent), 1 (a line per save and "
        "restore) or 'auto' (a line when a process moves at least "
        f"{AUTO_BYTES >> 30} GiB). Received: verbose={verbose!r}.")


def _megabytes(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def line(action: str, path: str, nbytes: int, seconds: float,
         process_id: int, process_count: int) -> str:
    """The text of one progress line."""
    rate = nbytes / 1e6 / seconds if seconds > 0 else float("inf")
    who = f" (process {process_id} of {process_count})" if (
        process_count > 1) else ""
    return (f"keras_distribute: {action} {_megabytes(nbytes)} {path}{who} in "
            f"{seconds:.2f} s, {rate:,.0f} MB/s")


def report(verbose: Verbosity, action: str, path: str, nbytes: int,
           started: float, process_id: int, process_count: int) -> None:
    """Prints the line for a save or restore that began at `started`
    (`time.perf_counter()`), if `verbose` asks for it."""
    if verbose == 0 or (verbose == "auto" and nbytes < AUTO_BYTES):
        return
    text = line(action, path, nbytes, time.perf_counter() - started,
                process_id, process_count)
    import keras

    if keras.config.is_interactive_logging_enabled():
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    else:
        logging.getLogger("keras_distribute").info(text)
