"""What a process was doing, for its launcher to say when a runtime ends it.

Some runtimes end a process themselves, from native code, with nothing a
Python handler can report: JAX's coordination service aborts (SIGABRT) a
process whose peers never joined or stopped answering. Before entering such
a section, kd writes a one-line note in the directory the launcher gave
(`KERAS_DISTRIBUTE_NOTES_DIR`); when the process dies by a signal, the
launcher (`kd.launch`, `python -m keras_distribute.launch`) adds the note to
its error. No launcher, no directory: nothing is written.

Framework-free: the launcher imports it.
"""

import os
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


def write(text: str) -> None:
    """Records what this process does now (replacing the last note)."""
    directory, rank = os.environ.get(NOTES_VARIABLE), _own_rank()
    if not directory or rank is None or not os.path.isdir(directory):
        return
    path = _path(directory, rank)
    try:
        with open(path + ".tmp", "w") as note:
            note.write(text)
        os.replace(path + ".tmp", path)
    except OSError:  # a note must never fail the training
        pass


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
