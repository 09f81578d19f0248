"""Checkpoints in object storage: the layout, the commit without rename,
the reads as untrusted input, and the removal of what kd wrote only.

An object store has no rename and no directories, so a checkpoint at
`s3://bucket/run/ckpt-3` is laid out as:

- `ckpt-3/g-<32 hex>/generation.json`: one save's *generation* marker,
  written first by the chief (process 0): the path, the writer's `owner`,
  its job token, host and process id, and a heartbeat the chief rewrites
  while the save runs;
- `ckpt-3/g-<32 hex>/shards-NNNNN.h5` and `part-NNNNN.json`: what each
  process wrote, uploaded by that process (its own files only), the part
  last;
- `ckpt-3/index.json`: written by the chief once every part arrived. **This
  one PUT is the commit**: an object is replaced atomically, a reader sees
  the old index (and the old generation it names) or the new one. The
  index names its generation and the size of every file in it.

A save interrupted anywhere (kill -9 during an upload, a multipart upload
left open, a chief that died) leaves at most a generation no index names:
never seen by a reader. The previous generation is deleted only after the
new index is in place. A generation no index names is removed by the next
save of the same path from the same job, or by a `CheckpointManager` whose
owner wrote it once its heartbeat stopped (`clean_unfinished`); a live one
of another job makes a save refuse (two jobs writing one path).

Reading downloads, into a private temporary directory, the index (at most
the bound every index has) and the files it names, each only if its size is
the one the index claims; the local reader then checks everything as for a
checkpoint on disk (`reading`, `validation`). Framework-free.
"""

import json
import re
import threading
import time
from typing import Callable
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

from keras_distribute.checkpoint.storage import format as ckpt_format
from keras_distribute.checkpoint.storage import lease
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import paths as ckpt_paths
from keras_distribute.checkpoint.storage import validation
from keras_distribute.checkpoint.storage.format import INDEX
from keras_distribute.checkpoint.storage.format import CheckpointError

GENERATION = re.compile(r"g-[0-9a-f]{32}")
MARKER = "generation.json"
MARKER_BYTES = 1 << 16
# The chief rewrites its generation's marker this often while a save runs;
# one whose beat is older than STALE_AFTER_S (by this host's clock: hosts'
# clocks may differ by seconds, not by this much) belongs to a dead writer.
HEARTBEAT_S = 5.0
STALE_AFTER_S = 60.0


def read_record(key: str) -> Optional[dict]:
    """The small JSON object at `key` (a marker, a lease), or `None` when
    it is absent, larger than `MARKER_BYTES` or not a JSON object."""
    try:
        raw = object_store.store_for(key).read_bytes(key, MARKER_BYTES)
        record = json.loads(raw) if len(raw) <= MARKER_BYTES else None
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def marker_of(path: str, generation: str) -> Optional[dict]:
    """The generation's marker, or `None` (absent or unreadable)."""
    return read_record(object_store.join(path, generation, MARKER))


def index_of(path: str) -> Optional[dict]:
    """The committed index at `path` (parsed within the bounds every index
    is read with), or `None` when there is none.

    Raises:
        CheckpointError: for an index too large, too dense or not JSON.
    """
    store = object_store.store_for(path)
    key = object_store.join(path, INDEX)
    try:
        raw = store.read_bytes(key, ckpt_format.MAX_INDEX_BYTES)
    except FileNotFoundError:
        return None
    index = ckpt_format.parse_index_bytes(raw, key)
    if not isinstance(index, dict) or index.get(
            "format") != ckpt_format.FORMAT:
        raise CheckpointError(
            f"{key!r} is not the index of a keras_distribute checkpoint.")
    return index


def read_index(path: str) -> dict:
    """The checked index of the committed checkpoint at `path` (nothing
    else is read: metadata and variable shapes without the shards).

    Raises:
        CheckpointError: if there is none, or it is malformed.
    """
    index = index_of(path)
    if index is None:
        raise CheckpointError(
            f"{path!r} is not a committed keras_distribute checkpoint (no "
            f"{INDEX}): it may not exist, or a save did not finish. Use "
            "kd.checkpoint.latest_checkpoint(directory) to find the last "
            "complete one.")
    validation.validate_index(index, object_store.join(path, INDEX))
    generation_of(index, path)
    return index


def generation_of(index: dict, path: str) -> str:
    """The generation a remote index names.

    Raises:
        CheckpointError: if it names none, or names it wrongly.
    """
    stored = index.get("object_store")
    generation = stored.get("generation") if isinstance(stored, dict) else None
    if not isinstance(generation, str) or not GENERATION.fullmatch(
            generation):
        raise CheckpointError(
            f"The index of {path!r} names no generation 'g-<32 hex>' of an "
            f"object-store checkpoint (it holds object_store={stored!r}): it "
            "was not written to object storage by keras_distribute.")
    return generation


def is_live(key: str, record: Optional[dict],
            stale_after_s: Optional[float] = None,
            probe_in: Optional[str] = None) -> bool:
    """Whether the heartbeat at `key` (a marker, a lease; read as `record`)
    was written less than `stale_after_s` (default `STALE_AFTER_S`) ago by
    the store's own clock: the time it stamped the object against the time
    it stamps a probe now. The writer's `"beat"` (its host's clock, which
    may run minutes ahead of this one's, or behind) is not compared: a dead
    job whose clock ran ahead kept its lease while its last beat lay "in
    the future". The probe is written in `probe_in` (default: beside
    `key`; a checkpoint's marker probes in the checkpoints' directory, never
    inside another job's generation)."""
    if not record:
        return False
    limit = STALE_AFTER_S if stale_after_s is None else stale_after_s
    store = object_store.store_for(key)
    try:
        written = store.modified(key)
    except FileNotFoundError:
        return False  # (gone meanwhile)
    return store.clock(probe_in or key.rpartition("/")[0]) - written < limit


class Heartbeat:
    """Writes the JSON object `key` (`record` with a fresh `"beat"`) now,
    then every `HEARTBEAT_S` until stopped: a generation's marker while its
    save runs, a lease while its job holds it. `before_beat`, if given, is
    called in the heartbeat's thread before each later beat (it may stop
    this heartbeat). `write`, if given, writes each beat's record instead
    of a plain write (a lease's conditional renewal); the beats end when it
    raises `lease.DirectoryInUseError` (the lease was lost)."""

    def __init__(self, key: str, record: dict,
                 before_beat: Optional[Callable[[], None]] = None,
                 write: Optional[Callable[[dict], None]] = None):
        self._key, self._record = key, dict(record)
        self._before_beat = before_beat
        self._store = object_store.store_for(key)
        self._write = write or (lambda beat: self._store.write_bytes(
            self._key, json.dumps(beat).encode()))
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kd-checkpoint-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        self._record["beat"] = time.time()
        self._write(dict(self._record))

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if self._before_beat is not None:
                    self._before_beat()
                if not self._stop.is_set():
                    self._beat()
            except lease.DirectoryInUseError:
                return  # lost: nothing more is written
            except Exception:  # noqa: BLE001 - the next beat tries again
                pass

    def stop(self) -> None:
        """Stops the beats; from another thread, waits for the last."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=HEARTBEAT_S + 30)


def refuse_foreign(path: str) -> Dict[str, bool]:
    """Raises unless `path` holds only kd's objects: `index.json` of this
    format and `g-<hex>/` generations. Returns its children.

    Raises:
        CheckpointError: naming what is there, if anything else is.
    """
    store = object_store.store_for(path)
    children = store.children(path)
    foreign = sorted(name for name, is_dir in children.items()
                     if not ((name == INDEX and not is_dir)
                             or (is_dir and GENERATION.fullmatch(name))))
    if not foreign and children.get(INDEX) is False:
        try:
            index_of(path)
        except CheckpointError:
            foreign = [INDEX]
    if not foreign and store.is_object(path):
        foreign = ["an object at that very key"]
    if foreign:
        raise CheckpointError(
            f"Not writing a checkpoint at {path!r}: it holds objects "
            f"keras_distribute did not write ({foreign[:5]}), and the save "
            "would replace them. Pass a "
            "prefix that holds nothing yet (or an earlier checkpoint to "
            "overwrite), or use save(prefix) / CheckpointManager, which "
            "number new checkpoints.")
    return children


def remove_generation(path: str, generation: str) -> None:
    """Deletes one generation of `path`: the uploads left open in it (by a
    process killed mid-upload), its files, its marker last."""
    store = object_store.store_for(path)
    prefix = object_store.join(path, generation)
    store.abort_uploads(prefix)
    keys = [object_store.join(prefix, name)
            for name in store.files_under(prefix) if name != MARKER]
    store.remove(keys)
    store.remove([object_store.join(prefix, MARKER)])


def discard_generation(path: str, generation: str) -> None:
    """`remove_generation` after a failed save, at best: a store that does
    not answer (`CheckpointStorageError`) leaves the generation, which no
    index names (never seen by a reader; removed by the next save of
    `path`), and the save's own error is the one raised."""
    try:
        remove_generation(path, generation)
    except ckpt_format.CheckpointStorageError:
        pass


def move_aside(path: str, suffix: str) -> str:
    """Moves the checkpoint at `path` to the first free
    `<path><suffix>[-N]` (an object store cannot rename: each object kd
    wrote there, its index and its generations with kd's marker, is copied
    by the store, then removed: the index first). Returns the new path.
    Objects kd did not write are left where they are.

    Raises:
        OSError: if the store fails (what was copied stays at both places).
    """
    store = object_store.store_for(path)
    target, number = f"{path}{suffix}", 0
    while store.children(target):
        number += 1
        target = f"{path}{suffix}-{number}"
    children = store.children(path)
    names = [INDEX] if children.get(INDEX) is False else []
    generations = [name for name, is_dir in children.items()
                   if is_dir and GENERATION.fullmatch(name)
                   and marker_of(path, name) is not None]
    for generation in generations:
        names += [object_store.join(generation, name) for name in
                  store.files_under(object_store.join(path, generation))]
    for name in names:
        store.call(f"Copying {name}", store.fs.copy,
                   object_store.join(path, name),
                   object_store.join(target, name))
    if INDEX in names:
        store.remove([object_store.join(path, INDEX)])
    for generation in generations:
        remove_generation(path, generation)
    return target


def remove(path: str) -> None:
    """Deletes the checkpoint at `path`: its index first (so it is no
    longer one), then each generation kd wrote there. Objects kd did not
    write are left."""
    store = object_store.store_for(path)
    children = store.children(path)
    if children.get(INDEX) is False:
        store.remove([object_store.join(path, INDEX)])
    for name, is_dir in children.items():
        if is_dir and GENERATION.fullmatch(name) and marker_of(
                path, name) is not None:
            remove_generation(path, name)


def owner_of(path: str) -> Optional[str]:
    """The owner recorded in the committed checkpoint at `path`, or
    `None`."""
    try:
        index = index_of(path)
    except CheckpointError:
        return None
    owner = index.get("owner") if index else None
    return owner if isinstance(owner, str) else None


def numbered_entries(directory: str, stem: str) -> List[Tuple[int, str]]:
    """`(number, path)` of every child `<stem>-<number>` of `directory`."""
    pattern = re.compile(re.escape(stem) + "-(" + ckpt_paths.NUMBER + ")")
    found = []
    for name in object_store.store_for(directory).children(directory):
        match = pattern.fullmatch(name)
        if match:
            found.append((int(match.group(1)),
                          object_store.join(directory, name)))
    return sorted(found)


def checkpoints_in(directory: str) -> List[str]:
    """The committed, numbered checkpoints in `directory`, oldest first."""
    store = object_store.store_for(directory)
    found = []
    for name, is_dir in store.children(directory).items():
        match = re.fullmatch(".*-(" + ckpt_paths.NUMBER + ")", name)
        if match and is_dir and store.exists(
                object_store.join(directory, name, INDEX)):
            found.append((int(match.group(1)),
                          object_store.join(directory, name)))
    return [path for _, path in sorted(found)]


def clean_unfinished(directory: str, owner: str) -> List[str]:
    """Removes, from the checkpoints directly in `directory`, the
    generations no index names whose marker names `owner` and whose
    writer is gone (its heartbeat stopped), or is this job.

    Returns:
        The generations removed (`<path>/<generation>`).
    """
    store = object_store.store_for(directory)
    removed = []
    for name, is_dir in store.children(directory).items():
        if not is_dir or not re.fullmatch(".*-" + ckpt_paths.NUMBER, name):
            continue
        path = object_store.join(directory, name)
        children = store.children(path)
        try:
            index = index_of(path) if children.get(INDEX) is False else None
            committed = generation_of(index, path) if index else None
        except CheckpointError:
            continue  # not kd's: nothing of it is touched
        for child, child_is_dir in children.items():
            if not child_is_dir or child == committed or (
                    not GENERATION.fullmatch(child)):
                continue
            marker = marker_of(path, child)
            if marker is None or marker.get("owner") != owner:
                continue
            if marker.get("job") == lease.job_token() or not is_live(
                    object_store.join(path, child, MARKER), marker,
                    probe_in=directory):
                remove_generation(path, child)
                removed.append(object_store.join(path, child))
    return removed
