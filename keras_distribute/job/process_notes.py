"""What a process was doing, for its launcher to say when a runtime ends it.

Some runtimes end a process themselves, from native code, with nothing a
Python handler can report: JAX's coordination service aborts (SIGABRT) a
process whose peers never joined or stopped answering. Before entering such
a section, kd writes a one-line note in the directory the launcher gave
(`KERAS_DISTRIBUTE_NOTES_DIR`); when the process dies by a signal, the
launcher (`kd.launch`, `python -m keras_distribute.launch`) adds the note to
its error. A process started without kd's launcher (by hand with
`TF_CONFIG`, by `srun`, by Kubernetes) calls `watch_until_exit` where it
joins a job: a tiny watcher process then prints the last note on stderr if
this process ends without exiting (a signal, an abort in native code).

Framework-free: the launcher imports it.
"""

import os
from typing import Any
from typing import Dict
from typing import Optional

NOTES_VARIABLE = "KERAS_DISTRIBUTE_NOTES_DIR"


def _path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"process-{int(rank)}.txt")


def _own_rank() -> Optional[int]:
    for name in ("KERAS_DISTRIBUTION_PROCESS_ID", "RANK"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


# Without a launcher: the directory and rank `watch_until_exit` set up, and
# the pipe to its watcher (closed after "exit" when this process exits).
_own: Dict[str, Any] = {"directory": None, "rank": None, "watcher": None}

_WATCHER = """
import os, shutil, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)   # the terminal's Ctrl-C and a
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # group's SIGTERM: watch on
rank, directory = sys.argv[1], sys.argv[2]
said = sys.stdin.buffer.read()  # until this process's end closes the pipe
if said != b"exit":
    try:
        with open(os.path.join(directory, "process-" + rank + ".txt")) as f:
            note = f.read(2000).strip()
    except OSError:
        note = ""
    if note:
        sys.stderr.write("keras_distribute: process " + rank + " ended "
                         "without exiting (killed by a signal, or aborted in "
                         "native code: exit code 128 + the signal, e.g. 134 "
                         "for SIGABRT) while " + note + ".\\n")
        sys.stderr.flush()
shutil.rmtree(directory, ignore_errors=True)
"""


def watch_until_exit(rank: int) -> None:
    """Makes sure this process's last note reaches its stderr if it ends
    without exiting normally, when no launcher of kd reads the notes.

    Starts (once) a watcher process that waits for this process to end; if
    it did not exit through Python (`atexit`), the watcher prints the last
    note. With kd's launcher (`KERAS_DISTRIBUTE_NOTES_DIR` set) it does
    nothing: the launcher reports the note.

    Args:
        rank: This process's rank in its job (named in the message).
    """
    import atexit
    import subprocess
    import sys
    import tempfile

    if os.environ.get(NOTES_VARIABLE) or _own["watcher"] is not None:
        return
    directory = tempfile.mkdtemp(prefix="keras_distribute-notes-")
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(int(rank)), directory],
        stdin=subprocess.PIPE)
    _own.update(directory=directory, rank=int(rank), watcher=watcher)
    stdin = watcher.stdin
    assert stdin is not None  # made with stdin=PIPE

    def exiting() -> None:
        try:
            stdin.write(b"exit")
            stdin.close()
        except OSError:
            pass  # the watcher is gone: nothing to tell it
        watcher.wait()

    atexit.register(exiting)


def write(text: str) -> None:
    """Records what this process does now (replacing the last note)."""
    directory = os.environ.get(NOTES_VARIABLE) or _own["directory"]
    rank = _own_rank()
    if rank is None:
        rank = _own["rank"]
    if not directory or rank is None or not os.path.isdir(directory):
        return
    path = _path(directory, rank)
    try:
        with open(path + ".tmp", "w") as note:
            note.write(text)
        os.replace(path + ".tmp", path)
    except OSError:  # a note must never fail the training
        pass


def own() -> Optional[str]:
    """This process's last note, if it left one."""
    rank = _own_rank()
    return read(os.environ.get(NOTES_VARIABLE) or _own["directory"],
                _own["rank"] if rank is None else rank)


def read(directory: Optional[str], rank: int) -> Optional[str]:
    """The last note of process `rank`, if it left one."""
    if not directory:
        return None
    try:
        with open(_path(directory, rank)) as note:
            return note.read(2000).strip() or None
    except OSError:
        return None


_LOST = "lost process "


def write_lost_peer(rank: int, why: str) -> None:
    """Records that this process gave up on peer `rank`, and why (the
    launcher then blames `rank`, not this process)."""
    write(f"{_LOST}{int(rank)}: {why}")


def named_lost_peer(directory: Optional[str], rank: int,
                    count: int) -> Optional[int]:
    """The peer process `rank` named as lost in its last note, if any."""
    note = read(directory, rank) or ""
    number = note[len(_LOST):].split(":", 1)[0]
    if note.startswith(_LOST) and number.isdigit():
        lost = int(number)
        return lost if 0 <= lost < count and lost != rank else None
    return None


def reason(directory: Optional[str], rank: int) -> str:
    """Why process `rank` named a peer lost (its note after the rank)."""
    note = read(directory, rank) or ""
    return note.split(":", 1)[1].strip() if ":" in note else note
