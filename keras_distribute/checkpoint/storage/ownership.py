"""What keras_distribute may delete: the ownership rules, in one place.

kd deletes or replaces only what it wrote itself and can prove it wrote:

- a committed checkpoint whose index names, in its `owner` field, the
  writer that now deletes it (a `CheckpointManager`'s owner, e.g.
  `"CheckpointManager/ckpt"`, or a callback's);
- a save's temporary directory (it holds `format.TEMPORARY_MARKER`);
- a directory kd created for its checkpoints, which holds
  `DIRECTORY_MARKER` naming its owner, once nothing else is in it.

Nothing is found by walking a directory tree: a clean-up looks only at the
direct children of the directory it was given, by the names its writer
uses (`<stem>-<number>`). Numbering never reuses a name: a new checkpoint
is numbered after the highest `<stem>-<number>` already in the directory,
whoever wrote it (`next_number`).
"""

import os
import re
from typing import List
from typing import Optional

from keras_distribute.checkpoint.storage import format as ckpt_format
from keras_distribute.checkpoint.storage import lease
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import paths as ckpt_paths
from keras_distribute.checkpoint.storage import remote_checkpoints
from keras_distribute.checkpoint.storage import writing as ckpt_writing

# Written into a directory kd created for checkpoints; names its owner.
DIRECTORY_MARKER = ".keras_distribute-directory"


def owner_of(path: str) -> Optional[str]:
    """The owner recorded in the committed checkpoint at `path`, or `None`
    (no checkpoint there, an unreadable index, or one written without an
    owner, e.g. by `ShardedCheckpoint.write` or an older keras_distribute).
    """
    if object_store.is_remote(path):
        return remote_checkpoints.owner_of(path)
    if not ckpt_format.is_checkpoint(path):
        return None
    try:
        index = ckpt_format.load_index_json(
            os.path.join(path, ckpt_format.INDEX))
    except ckpt_format.CheckpointError:
        return None
    owner = index.get("owner") if isinstance(index, dict) else None
    return owner if isinstance(owner, str) else None


def numbered_entries(directory: str, stem: str) -> List[tuple]:
    """`(number, path)` of every direct child of `directory` named
    `<stem>-<number>` (checkpoint or not), by number."""
    if object_store.is_remote(directory):
        return remote_checkpoints.numbered_entries(directory, stem)
    if not os.path.isdir(directory):
        return []
    pattern = re.compile(re.escape(stem) + "-(" + ckpt_paths.NUMBER + ")")
    found = []
    for name in os.listdir(directory):
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match.group(1)), os.path.join(directory, name)))
    return sorted(found)


def next_number(directory: str, stem: str, counter: int) -> int:
    """The number of the next `<stem>-<number>` in `directory`: after
    `counter` and after every such name already there (a previous run's
    checkpoints are never replaced by a new run's)."""
    entries = numbered_entries(directory, stem)
    highest = entries[-1][0] if entries else 0
    return max(int(counter), highest) + 1


def owned_checkpoints(directory: str, stem: str, owner: str,
                      moved_aside: str = "") -> List[str]:
    """The committed `<stem>-<number>` checkpoints directly in `directory`
    whose index names `owner`, oldest first; with `moved_aside` (a suffix
    such as `".corrupt"`), also the `<stem>-<number><suffix>[-<n>]` ones
    its writer moved aside."""
    paths = [path for _, path in numbered_entries(directory, stem)]
    if moved_aside and not object_store.is_remote(directory) and (
            os.path.isdir(directory)):
        number = ckpt_paths.NUMBER
        pattern = re.compile(re.escape(stem) + "-" + number
                             + re.escape(moved_aside) + f"(-{number})?")
        paths += sorted(os.path.join(directory, name)
                        for name in os.listdir(directory)
                        if pattern.fullmatch(name))
    return [path for path in paths if owner_of(path) == owner]


def remove_owned(path: str, owner: str) -> bool:
    """Deletes the checkpoint at `path` if its index names `owner`.

    Returns:
        Whether it was deleted (`False`: absent, or not `owner`'s).
    """
    if owner_of(path) != owner:
        return False
    if object_store.is_remote(path):
        remote_checkpoints.remove(path)
        return True
    ckpt_writing.remove(path)
    return True


def make_directory(directory: str, owner: str) -> None:
    """Creates `directory` for `owner`'s checkpoints; a directory created
    here holds `DIRECTORY_MARKER` (so `remove_directory` may remove it
    later), one that existed is left as it is; in object storage, where
    a directory is only a prefix, nothing is made."""
    if object_store.is_remote(directory) or os.path.isdir(directory):
        return
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, DIRECTORY_MARKER), "w") as f:
        f.write(owner)


def remove_directory(directory: str, owner: str) -> bool:
    """Removes `directory` if `owner` created it (`make_directory`) and
    nothing but the marker (and this job's own lease) is left in it.

    Returns:
        Whether it was removed.
    """
    if object_store.is_remote(directory):
        return False  # (no directory was made: `make_directory`)
    marker = os.path.join(directory, DIRECTORY_MARKER)
    if os.path.islink(directory) or not os.path.isfile(marker):
        return False
    try:
        with open(marker) as f:
            if f.read() != owner:
                return False
        if set(os.listdir(directory)) == {DIRECTORY_MARKER, lease.LEASE}:
            lease.drop(directory)  # this job's own lease goes with it
        if os.listdir(directory) != [DIRECTORY_MARKER]:
            return False
        os.remove(marker)
        os.rmdir(directory)
    except OSError:
        return False  # something appeared meanwhile: it stays
    return True
