"""The fork server's extra imports (`KERAS_DISTRIBUTE_PRELOAD`), each bounded.

Python's fork server imports its preload list itself: it ignores an
`ImportError` (a dotted name whose submodule does not exist was dropped
without a word), dies on any other error or `SystemExit` (the launcher saw
only `EOFError: unexpected EOF`) and waits without end on an import that
blocks (the launch hung past its timeout). So the server is given this
module instead: importing it imports each module the variable names, in
its order, by the launch's deadline (a timer signal in the server's main
thread), and keeps what failed. A process forked from the server inherits
that record, and its launch fails at once naming the module and its error
(`raise_failure`), within the launch's timeout.

The deadline is the launch's (its timeout from its start), handed to the
server as it starts (`starting.PRELOAD_DEADLINE_VARIABLE`, in the
environment the server is started with only).

Importing this module outside a fork server imports those modules too:
only the fork server imports it (`starting.context_for_launch`).

Imports: the standard library, `launch.starting`.
"""

import os
import signal
import threading
import time
import traceback
from typing import Any
from typing import Optional
from typing import Tuple

from keras_distribute.launch import starting

# Where the server's environment gives no deadline: seconds from now.
DEFAULT_BOUND_S = 300.0
# The least an import is given, however late the server started it.
LEAST_BOUND_S = 1.0

# What this process's imports of the named modules left: `(name, what
# happened)` of the first that failed, or None. A fork server has one
# preload; a process forked from it inherits this.
failure: Optional[Tuple[str, str]] = None


class _ImportTookTooLong(BaseException):
    """Raised by the alarm into an import that passed its bound."""


def _bound_s() -> float:
    """The seconds left until the launch's deadline."""
    try:
        deadline = float(os.environ[starting.PRELOAD_DEADLINE_VARIABLE])
    except (KeyError, ValueError):
        return DEFAULT_BOUND_S
    return max(LEAST_BOUND_S, deadline - time.time())


def _on_alarm(signum: int, frame: Any) -> None:
    raise _ImportTookTooLong()


def _import_within(name: str, bound_s: float) -> Optional[str]:
    """Imports `name`; what went wrong, or None."""
    timed = threading.current_thread() is threading.main_thread()
    if timed:
        previous = signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, bound_s)
    try:
        __import__(name)
    except _ImportTookTooLong:
        return ("its import did not finish within the launch's timeout (it "
                f"had {bound_s:.0f} s left): it blocks, or waits for "
                "something that never comes")
    except BaseException as error:  # (kept: raised in each launch)
        lines = traceback.format_exception(error)
        return (f"its import raised {type(error).__name__}: {error}\n"
                + "".join(lines[-6:]))
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return None


def import_named_modules() -> None:
    """Imports each module `KERAS_DISTRIBUTE_PRELOAD` names, by the
    launch's deadline; the first failure is kept in `failure` and ends the
    preload."""
    global failure
    extra = starting.preloaded_modules()[len(starting.PRELOADED_MODULES):]
    for name in extra:
        problem = _import_within(name, _bound_s())
        if problem is not None:
            failure = (name, problem)
            return


def raise_failure() -> None:
    """In a launched process: raises if the server it was forked from could
    not import a module `KERAS_DISTRIBUTE_PRELOAD` names.

    Raises:
        ImportError: naming the module and what its import did.
    """
    if failure is None:
        return
    name, problem = failure
    raise ImportError(
        f"{starting.PRELOAD_VARIABLE} names {name!r}, which the launch's "
        f"fork server could not import: {problem}\nFix that module, or "
        f"remove it from {starting.PRELOAD_VARIABLE} (each process then "
        "imports what it needs itself); the next launch starts fresh "
        "processes once the variable changed.")


import_named_modules()
