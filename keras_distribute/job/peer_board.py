"""Which process a job lost, said by the processes that waited for it.

When a peer dies, freezes or hangs, the engines fail (or block) the
processes waiting for it with text that names no process: gloo's "Timed out
waiting 20000ms for recv operation", "Connection closed by peer"; JAX waits
in native code without end for a peer that is alive but never reaches the
collective. Each process of a job kd joined therefore keeps a heartbeat on
the job's key-value store (torch's c10d store, JAX's coordination service):
a thread sets `keras_distribute/beat/<rank>` to "<beats> <steps>" every
tenth of the timeout, where `<steps>` counts the train steps, `run` calls
and kd collectives the process began. `PeerBoard.explain` reads the board
twice and tells apart

- a peer whose heartbeat stopped (frozen — SIGSTOP, a debugger —, killed,
  or on a machine that went away),
- a peer that left the job (it marks its heartbeat "ended" at exit),
- a peer that is alive but behind (stuck in work of its own between steps:
  a callback or a save only it runs, its input pipeline, a breakpoint).

Torch raises `kd.WorkerLostError` naming that rank when a collective
fails; on JAX, where nothing fails, a watchdog ends a process whose own
steps stalled for the timeout while a live peer lags (`on_stall`).

Framework-free: each backend hands in its store (`set`, `get`).
"""

import logging
import os
import socket
import sys
import threading
import time
from typing import Any
from typing import Callable
from typing import Optional

_ENDED = "ended"
_PREFIX = "keras_distribute/beat/"
_HOST = "keras_distribute/host/"


class PeerBoard:
    """The heartbeats of a job's processes on its key-value store.

    Args:
        store: an object with `set(key, text)` and `get(key)` (the text, or
            `None` when the key is not there); called from a thread of its
            own.
        rank: this process's rank.
        world_size: the number of processes.
        timeout_s: the job's communication timeout; a heartbeat goes out
            every tenth of it (between 0.2 and 2 s).
        on_stall: optional; called as `on_stall(rank, why)` from the
            heartbeat thread when this process's steps did not advance for
            `timeout_s` while it was `busy()` and a peer is named as the
            cause.
        host: where this process runs, as its peers' messages name it
            (its address in the cluster description; by default the host
            name). Published once; each process learns its peers' while
            the store answers, so that a partition still names them.
        store_address: `host:port` of the job's store, for the message
            of a process that cannot reach it.
        watch_peers: while this process is `busy()`, read the peers'
            heartbeats at each beat, so that `explain` names a peer that
            went silent at once, from what it saw while this process
            waited, instead of watching it for 2.5 beats more (torch:
            named within the collective's timeout).
        note_silent_peers: also watch the peers' heartbeats all along and
            leave a process note (`process_notes`) naming a peer that went
            silent, or the store when it stops answering: on JAX, whose
            runtime aborts the process in native code when a peer is lost,
            that note is what the process's last words name.
    """

    def __init__(self, store: Any, rank: int, world_size: int,
                 timeout_s: float,
                 on_stall: Optional[Callable[[int, str], None]] = None,
                 host: Optional[str] = None,
                 store_address: Optional[str] = None,
                 note_silent_peers: bool = False,
                 watch_peers: bool = False):
        self._store = store
        self._note_silent_peers = note_silent_peers
        self._watch_peers = watch_peers or note_silent_peers
        self._watched_at = 0.0  # when the peers' heartbeats were last read
        self._read_at: dict = {}  # rank -> when its heartbeat was last read
        self._last_write = time.monotonic()  # the last beat the store took
        self._seen: dict = {}  # rank -> (its beat text, when it changed)
        self._noted: Optional[str] = None
        self._note_before: Optional[str] = None
        self.host = host or socket.gethostname()
        self.store_address = store_address
        self._hosts: dict = {}  # rank -> host, learned from the store
        self.rank, self.world_size = rank, world_size
        self.steps = 0  # advanced by the engine; read by the beat thread
        self.busy_depth = 0  # > 0 while a fit/evaluate/predict/run runs
        self.timeout_s = timeout_s
        self.interval_s = min(2.0, max(0.2, timeout_s / 10.0))
        self._on_stall = on_stall
        self._beats = 0
        # What the last `explain` found: "ended", "silent" (a frozen or
        # dead peer), "behind" (a live peer that lags), "hangs", "store"
        # (the store's host does not answer) or "unknown".
        self.verdict = "unknown"
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, name="keras_distribute-heartbeat", daemon=True)
        self._thread.start()
        if on_stall is not None or note_silent_peers:
            threading.Thread(target=self._watch, daemon=True,
                             name="keras_distribute-peer-watchdog").start()

    def advance(self) -> None:
        """Counts one more step (or `run`, or collective) of this process."""
        self.steps += 1

    def _beat(self) -> None:
        try:
            self._store.set(f"{_HOST}{self.rank}", self.host)
        except Exception:  # the store's host is gone: nothing to tell
            return
        while not self._stopped.is_set():
            self._beats += 1
            try:
                self._store.set(f"{_PREFIX}{self.rank}",
                                f"{self._beats} {self.steps}")
                self._last_write = time.monotonic()
                if self._noted == "store":
                    self._unnote()  # it answers again
                if len(self._hosts) < self.world_size - 1:
                    self._learn_hosts()
                if self._note_silent_peers:
                    self._note_a_silent_peer()
                elif self._watch_peers and self.busy_depth:
                    self._read_peers()
            except Exception:  # the store's host is gone: nothing to tell
                self._note_store_lost()
                return
            self._stopped.wait(self.interval_s)

    # At most this many peers' heartbeats are read per beat (a window that
    # moves on), so a large job does not load its store.
    _WATCHED_PER_BEAT = 64

    def _read_peers(self) -> list:
        """Reads some peers' heartbeats (a window that moves on), keeping
        when each last changed (`_seen`); returns the ranks read."""
        now = time.monotonic()
        peers = [r for r in range(self.world_size) if r != self.rank]
        start = (self._beats * self._WATCHED_PER_BEAT) % len(peers)
        window = (peers[start:] + peers[:start])[:self._WATCHED_PER_BEAT]
        for rank in window:
            text = self._store.get(f"{_PREFIX}{rank}")
            if text is None:
                continue  # not started yet
            seen = self._seen.get(rank)
            if seen is None or seen[0] != text:
                self._seen[rank] = (text, now)
            self._read_at[rank] = now
        self._watched_at = now
        return window

    def _note_a_silent_peer(self) -> None:
        """Reads some peers' heartbeats; notes one that stood still for
        2.5 beats (the process note names it if the runtime aborts us)."""
        now = time.monotonic()
        before = dict(self._seen)
        for rank in self._read_peers():
            seen = self._seen.get(rank)
            if seen is None:
                continue  # not started yet
            if before.get(rank) != seen:
                if self._noted == f"process {rank} of {self.world_size}":
                    self._unnote()  # it answers again
            elif seen[0] != _ENDED and now - seen[1] > 2.5 * self.interval_s:
                self._note(rank, f"process {rank} of {self.world_size}", (
                    f"process {rank} of {self.world_size}{self._on(rank)} "
                    f"stopped answering: its heartbeat did not change for "
                    f"{now - seen[1]:.1f} s (it froze, was killed, or its "
                    "machine is unreachable: down, or the network between "
                    "them cut)"))
                return

    def _note_store_lost(self) -> None:
        if not self._note_silent_peers or self._stopped.is_set():
            return
        at = f" at {self.store_address}" if self.store_address else ""
        self._note(0, "store", (
            f"the job's store{at} (hosted by process 0{self._on(0)}) stopped "
            f"answering for {time.monotonic() - self._last_write:.1f} s "
            "(that process froze or ended, or its machine is unreachable: "
            "down, or the network between them cut)"))

    def _note(self, rank: int, what: str, why: str) -> None:
        """Leaves a note that peer `rank` (`what`: its short name) is lost,
        `why`; replaced again by `_unnote` if it answers again."""
        from keras_distribute.job import process_notes

        if what == self._noted or rank == self.rank:
            return
        if self._noted is None:
            self._note_before = process_notes.own()
        self._noted = what
        process_notes.write_lost_peer(rank, why)

    def _unnote(self) -> None:
        """Puts back the note from before `_note` (a pause, not a loss: the
        launcher must not blame that peer for this process's own end)."""
        from keras_distribute.job import process_notes

        if self._noted is not None and self._note_before is not None:
            process_notes.write(self._note_before)
        self._noted = None

    def _learn_hosts(self) -> None:
        for rank in range(self.world_size):
            if rank != self.rank and rank not in self._hosts:
                host = self._store.get(f"{_HOST}{rank}")
                if host:
                    self._hosts[rank] = host

    def _on(self, rank: int) -> str:
        """" on <host>" for a peer whose host is known, else ""."""
        host = self._hosts.get(rank)
        return f" on {host}" if host else ""

    def _watch(self) -> None:
        """The watchdog (a thread of its own: the heartbeat must go on
        while it explains, or two stalled processes call each other
        silent)."""
        on_stall = self._on_stall
        seen_steps, since = self.steps, time.monotonic()
        while not self._stopped.wait(self.interval_s):
            if (self._note_silent_peers and self.rank != 0 and
                    time.monotonic() - self._last_write
                    > 2.5 * self.interval_s + 1.0):
                self._note_store_lost()  # a write that hangs: unreachable
            if on_stall is None:
                continue
            if self.steps != seen_steps or not self.busy_depth:
                seen_steps, since = self.steps, time.monotonic()
            elif time.monotonic() - since > self.timeout_s:
                # Only a live peer that lags: JAX ends a process whose
                # peer died or froze itself, and a peer that ended may have
                # left a job this process still runs alone (its own work).
                rank, why = self.explain()
                if self.verdict == "behind" and not self._stopped.is_set() \
                        and self.steps == seen_steps:
                    on_stall(rank, why)
                since = time.monotonic()  # a long step of its own: look again

    def close(self) -> None:
        """Stops the heartbeat and marks this process as ended (normal
        exit: its peers then know it left rather than froze)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + 1.0)
        # Bounded: a store whose host is cut off (a network partition)
        # answers never, and an unbounded write kept the process from
        # ending after its error was raised. Its peers then see this
        # heartbeat stop, which names it as well.
        if not self._write_bounded(_ENDED, self.interval_s + 1.0):
            logging.getLogger("keras_distribute").debug(
                "could not mark process %d as ended within %.1f s",
                self.rank, self.interval_s + 1.0)

    def _write_bounded(self, text: str, wait_s: float) -> bool:
        """Sets this process's heartbeat to `text` in a thread; whether the
        store took it within `wait_s`."""
        done = threading.Event()

        def write():
            try:
                self._store.set(f"{_PREFIX}{self.rank}", text)
                done.set()
            except Exception:  # the store's host left first
                pass

        threading.Thread(target=write, daemon=True,
                         name="keras_distribute-heartbeat-end").start()
        return done.wait(wait_s)

    def _read_all(self) -> dict:
        """Every other process's heartbeat text (none yet: `None`)."""
        return {rank: self._store.get(f"{_PREFIX}{rank}")
                for rank in range(self.world_size) if rank != self.rank}

    def _read_bounded(self, wait_s: float) -> Optional[dict]:
        """`_read_all` in a thread; `None` when the store does not answer
        within `wait_s` (its host is itself frozen or gone)."""
        box = []
        reader = threading.Thread(target=lambda: box.append(self._read_all()),
                                  daemon=True)
        reader.start()
        reader.join(wait_s)
        return box[0] if box else None

    def _silent_as_recorded(self, watch_s: float) -> Optional[tuple]:
        """`explain`'s verdict from the heartbeats the beat thread read
        while this process waited (`watch_peers`), without watching them
        again: a peer that ended, or whose heartbeat stood still for more
        than `watch_s` up to a read less than two beats old; else None."""
        now = time.monotonic()
        if not self._watch_peers or now - self._watched_at > \
                2 * self.interval_s + 1.0:
            return None
        for rank, (text, since) in sorted(self._seen.items()):
            if self._watched_at - self._read_at.get(rank, 0.0) > 1e-9:
                continue  # not in the last read's window
            if text == _ENDED:
                return self._ended(rank)
            if self._watched_at - since > watch_s:
                return self._silent(rank, (
                    f"did not change for {self._watched_at - since:.1f} s "
                    "while this process waited"))
        return None

    def _ended(self, rank: int) -> tuple:
        self.verdict = "ended"
        return rank, (f"process {rank} of {self.world_size}{self._on(rank)} "
                      "has left the job (it ended) while this process still "
                      "needed it")

    def _silent(self, rank: int, how: str) -> tuple:
        """The verdict on a peer whose heartbeat `how` (stood still)."""
        self.verdict = "silent"
        return rank, (
            f"process {rank} of {self.world_size}{self._on(rank)} stopped "
            f"answering: its heartbeat {how} (it is frozen — stopped by "
            "SIGSTOP or a debugger —, was killed, or its machine is "
            "unreachable: down, or the network between them cut)")

    def explain(self) -> tuple:
        """Why this process waits in vain: `(rank, text)` naming the peer
        that froze, left or lags, or `(None, text)` when the board cannot
        tell (then `text` says what it saw)."""
        watch_s = 2.5 * self.interval_s
        self.verdict = "unknown"
        recorded = self._silent_as_recorded(watch_s)
        if recorded is not None:
            return recorded
        first = self._read_bounded(watch_s + 1.0)
        if first is None:
            self.verdict = "store"
            at = f" at {self.store_address}" if self.store_address else ""
            return (0 if self.rank != 0 else None), (
                f"the job's store{at} (hosted by process 0{self._on(0)}, or "
                f"by the launcher's agent) did not answer within "
                f"{watch_s + 1.0:.1f} s: that process is frozen, ended or "
                "unreachable (its machine down, or the network between "
                "them cut)")
        time.sleep(watch_s)
        second = self._read_bounded(watch_s + 1.0) or {}
        count = self.world_size
        for rank in sorted(first):
            before, after = first[rank], second.get(rank)
            if _ENDED in (before, after):
                return self._ended(rank)
            if before is None or after is None or before == after:
                return self._silent(rank, (
                    f"did not change in the {watch_s:.1f} s this process "
                    "watched it"))
        laggards = sorted((int(second[r].split()[1]), r) for r in second
                          if int(second[r].split()[1]) < self.steps)
        if laggards:
            steps, rank = laggards[0]
            self.verdict = "behind"
            return rank, (
                f"process {rank} of {count}{self._on(rank)} is alive but "
                f"behind: it "
                f"reached {steps} of the job's steps and collectives where "
                f"this process reached {self.steps}; it is stuck in work of "
                "its own between them (a callback or a save only it runs, its "
                "input pipeline, a breakpoint)")
        if count == 2:
            # This process waits in the exchange; the other is alive at the
            # same point, so it never reached it (the watchdog acts only on
            # "behind": a step merely long on both is not this).
            (rank,) = first
            self.verdict = "hangs"
            return rank, (
                f"process {rank} of 2{self._on(rank)} is alive and began "
                "the same step or "
                f"collective ({self.steps}) but never reached its exchange: "
                "it hangs inside it")
        return None, ("every process is alive and began the same step or "
                      f"collective ({self.steps})")


_board: Optional[PeerBoard] = None


def start(store: Any, rank: int, world_size: int, timeout_s: float,
          on_stall: Optional[Callable[[int, str], None]] = None,
          host: Optional[str] = None,
          store_address: Optional[str] = None,
          note_silent_peers: bool = False,
          watch_peers: bool = False) -> None:
    """Starts this process's heartbeat (once, for a job of several); see
    `PeerBoard` for the arguments."""
    global _board
    if _board is None and world_size > 1:
        _board = PeerBoard(store, rank, world_size, timeout_s, on_stall,
                           host=host, store_address=store_address,
                           note_silent_peers=note_silent_peers,
                           watch_peers=watch_peers)


def board() -> Optional[PeerBoard]:
    """This process's board, if kd joined its job."""
    return _board


def advance() -> None:
    """Counts a step (or `run`, or collective) this process begins."""
    if _board is not None:
        _board.advance()


class busy:
    """While a `fit`/`evaluate`/`predict`/`run` of the job runs (a context):
    only then does a stall of this process's steps mean a lost peer."""

    def __enter__(self):
        if _board is not None:
            _board.busy_depth += 1
        return self

    def __exit__(self, *exc):
        if _board is not None:
            _board.busy_depth = max(0, _board.busy_depth - 1)


def counting_epochs(callbacks: Any) -> Any:
    """`fit`'s `callbacks` with one more, last, that counts the ends and
    beginnings of epochs on the board: a process stuck in a callback of its
    own has not counted its epoch's end (its peers name it). Unchanged
    without a board, or for a `CallbackList` (not extended)."""
    if _board is None or not isinstance(callbacks, (list, tuple, type(None))):
        return callbacks
    import keras

    class CountEpochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            advance()

        def on_epoch_end(self, epoch, logs=None):
            advance()

    return [*(callbacks or []), CountEpochs()]


def stop() -> None:
    """Marks this process as ended and stops its heartbeat."""
    global _board
    if _board is not None:
        _board.close()
        _board = None


def ending_this_process(engine: str) -> Callable[[int, str], None]:
    """An `on_stall` for engines that wait in native code without end (JAX,
    TensorFlow): says which peer hangs (stderr, and the note the launcher
    reports), then ends this process with exit code 1 — no Python exception
    can reach a thread waiting in the engine."""

    def end(lost: int, why: str) -> None:
        from keras_distribute.job import process_notes

        board = _board
        if board is None:
            return  # the board stopped: the job is ending anyway
        process_notes.write_lost_peer(lost, why)
        print(f"keras_distribute: Process {board.rank} of {board.world_size} "
              f"waited {board.timeout_s:.0f} s for a collective that cannot "
              f"complete: {why}. {engine} waits in native code without end, "
              "so keras_distribute ends this process (exit code 1). Check "
              "that process's own log; a restart resumes from the last "
              "checkpoint (BackupAndRestore). Raise "
              "CommunicationOptions(timeout_seconds=...) for steps or saves "
              "that take longer.", file=sys.stderr, flush=True)
        os._exit(1)

    return end
