"""Torch's side of `keras_distribute.job.peer_board`: the heartbeat on the
group's c10d store, and gloo's errors for a lost peer turned into
`kd.WorkerLostError` naming it."""

import contextlib
import functools
from typing import Any
from typing import Optional

import torch

from keras_distribute.common.errors import WorkerLostError
from keras_distribute.job import peer_board
from keras_distribute.job import process_notes

# Text of the errors gloo (and the store) raise when a peer is gone.
_LOST_PEER_TEXT = ("timed out", "timeout", "connection closed",
                   "connection reset", "broken pipe", "connection refused",
                   "socket closed", "peer", "aborted")


class _StoreText:
    """A c10d store as the board's text store."""

    def __init__(self, store: Any):
        self._store = store

    def set(self, key: str, text: str) -> None:
        self._store.set(key, text)

    def get(self, key: str) -> Optional[str]:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()


def start(store: Any, rank: int, world_size: int, timeout_s: float,
          host: Optional[str] = None,
          store_address: Optional[str] = None) -> None:
    """Starts this process's heartbeat on the group's store (`host`,
    `store_address`: see `peer_board.PeerBoard`)."""
    peer_board.start(_StoreText(store), rank, world_size, timeout_s,
                     host=host, store_address=store_address,
                     watch_peers=True)


def looks_like_lost_peer(error: BaseException) -> bool:
    """Whether `error` is what gloo, nccl or the c10d store raise for a lost
    peer (a `TimeoutError` of the user's own code inside `fit` is not)."""
    import torch.distributed as dist

    if not isinstance(error, (RuntimeError, TimeoutError, ConnectionError)):
        return False
    text = str(error).lower()
    from_engine = isinstance(error, getattr(dist, "DistError", ())) or any(
        name in text for name in ("gloo", "nccl", "c10d", "tcpstore"))
    return from_engine and any(part in text for part in _LOST_PEER_TEXT)


@contextlib.contextmanager
def naming_a_lost_peer():
    """Turns the engine's error for a lost peer into `kd.WorkerLostError`
    naming it (the engine's error stays its cause). Nested uses explain
    once."""
    board = peer_board.board()
    try:
        with peer_board.busy():
            yield
    except WorkerLostError:
        raise
    except Exception as error:
        if board is None or not looks_like_lost_peer(error):
            raise
        rank, why = board.explain()
        message = (f"Process {board.rank} of {board.world_size} could not "
                   f"complete a collective: {why}. ")
        message += ("Check that process's own log; " if rank is not None else
                    "Check every process's log; ")
        message += ("a restart resumes from the last checkpoint "
                    "(BackupAndRestore). The engine said: "
                    f"{str(error).strip().splitlines()[0][:300]}")
        if rank is not None:
            process_notes.write_lost_peer(rank, why)
        raise WorkerLostError(message, rank) from error


def collective(method):
    """Marks an engine method that enters a collective: counted as a step
    of this process, and a lost peer raised as `kd.WorkerLostError`."""

    @functools.wraps(method)
    def counted(*args, **kwargs):
        if peer_board.board() is None:
            return method(*args, **kwargs)
        advance()
        with naming_a_lost_peer():
            return method(*args, **kwargs)

    return counted


# Counting a step is Python state the watchdog reads: it runs as Python
# even inside a step `torch.compile` traces (`jit_compile=True`), where a
# traced counter would be a guard that fails at every step (a recompile per
# step until dynamo gives up and runs the step eagerly).
advance = torch.compiler.disable(peer_board.advance)
stop = peer_board.stop
