"""Saving into object storage: a save's generation, each process's
upload, the commit by the index (the layout: `remote_checkpoints`).
Framework-free."""

import json
import os
import re
import secrets
import socket
import time
from typing import Any
from typing import Dict
from typing import Optional
from typing import Tuple

from keras_distribute.checkpoint.storage import format as ckpt_format
from keras_distribute.checkpoint.storage import lease
from keras_distribute.checkpoint.storage import object_store
from keras_distribute.checkpoint.storage import remote_lease
from keras_distribute.checkpoint.storage import streamed_upload
from keras_distribute.checkpoint.storage import validation
from keras_distribute.checkpoint.storage import writing
from keras_distribute.checkpoint.storage.format import INDEX
from keras_distribute.checkpoint.storage.format import CheckpointError
from keras_distribute.checkpoint.storage.remote_checkpoints import GENERATION
from keras_distribute.checkpoint.storage.remote_checkpoints import MARKER
from keras_distribute.checkpoint.storage.remote_checkpoints import Heartbeat
from keras_distribute.checkpoint.storage.remote_checkpoints import (
    discard_generation,
)
from keras_distribute.checkpoint.storage.remote_checkpoints import generation_of
from keras_distribute.checkpoint.storage.remote_checkpoints import index_of
from keras_distribute.checkpoint.storage.remote_checkpoints import is_live
from keras_distribute.checkpoint.storage.remote_checkpoints import marker_of
from keras_distribute.checkpoint.storage.remote_checkpoints import (
    refuse_foreign,
)
from keras_distribute.checkpoint.storage.remote_checkpoints import (
    remove_generation,
)

_PART = re.compile(r"part-(\d{5})\.json")
_FAILED = re.compile(r"failed-(\d{5})\.txt")


def prepare(path: str, owner: Optional[str]) -> Tuple[str, Heartbeat]:
    """Chief only: checks `path`, starts a new generation there.

    Removes this job's own unfinished generations at `path` (an earlier
    save that failed) and refuses while another job's save at `path` is
    alive.

    Returns:
        `(generation, heartbeat)`: stop the heartbeat when the save ends.

    Raises:
        CheckpointError: for foreign objects at `path`, or another job
            writing there now.
    """
    children = refuse_foreign(path)
    index = index_of(path) if children.get(INDEX) is False else None
    committed = generation_of(index, path) if index is not None else None
    for name, is_dir in children.items():
        if not is_dir or name == committed or not GENERATION.fullmatch(name):
            continue
        marker = marker_of(path, name)
        if marker is None:
            continue  # not provably ours: left alone
        if marker.get("job") == lease.job_token():
            remove_generation(path, name)
        elif is_live(object_store.join(path, name, MARKER), marker,
                     probe_in=object_store.split(path)[0]):
            raise CheckpointError(
                f"Not writing a checkpoint at {path!r}: another job is "
                f"writing there now (host {marker.get('host')!r}, process "
                f"{marker.get('pid')!r}, owner {marker.get('owner')!r}). Two "
                "jobs must not write one checkpoint path: give each job its "
                "own directory.")
    generation = "g-" + secrets.token_hex(16)
    heartbeat = Heartbeat(object_store.join(path, generation, MARKER), {
        "path": path, "owner": owner, "job": lease.job_token(),
        "host": socket.gethostname(), "pid": os.getpid(),
        "started": time.time()})
    return generation, heartbeat


def upload_process_shards(path: str, generation: str, staging: str,
                          entries: Dict[str, tuple], process_id: int) -> None:
    """Uploads this process's shard file, then its part of the index (with
    the file's size): the part's arrival tells the chief the shards are
    there.

    The file is laid out in the private directory `staging`
    (`writing.lay_out_shards`); its pieces' bytes go up from memory
    (`streamed_upload`).

    Args:
        path: The checkpoint (`s3://...` or `gs://...`).
        generation: The save's generation (`prepare`).
        staging: A private local directory, removed by the caller.
        entries: This process's pieces (`writing.write_process_shards`).
        process_id: This process's id; names its files.
    """
    store = object_store.store_for(path)
    shard_file, part, placed = writing.lay_out_shards(staging, entries,
                                                      process_id)
    shard_name = os.path.basename(shard_file)
    size = streamed_upload.upload(
        store, shard_file, placed,
        object_store.join(path, generation, shard_name))
    part["files"] = {shard_name: size}
    store.write_bytes(
        object_store.join(path, generation, f"part-{process_id:05d}.json"),
        json.dumps(part).encode())


def report_failure(path: str, generation: str, process_id: int,
                   error: BaseException) -> None:
    """Leaves a note for the chief that this process's save failed."""
    try:
        object_store.store_for(path).write_bytes(
            object_store.join(path, generation,
                              f"failed-{process_id:05d}.txt"),
            f"{type(error).__name__}: {error}"[:4000].encode())
    except Exception:  # noqa: BLE001 - the chief then times out instead
        pass


def commit(path: str, generation: str, process_count: int,
           metadata: Dict[str, Any], timeout_s: float) -> None:
    """Chief only: waits for every process's part, writes the index (the
    commit), then removes the parts and the generation the index replaced.
    On a failure before the index is written, the new generation is
    removed and `path` is as before.

    Raises:
        CheckpointError: if a process failed or did not upload in time.
    """
    store = object_store.store_for(path)
    prefix = object_store.join(path, generation)
    try:
        deadline, wait = time.monotonic() + timeout_s, 0.05
        while True:
            names = store.children(prefix)
            for name in sorted(names):
                failed = _FAILED.fullmatch(name)
                if failed:
                    reason = store.read_bytes(object_store.join(prefix, name),
                                              4096).decode(errors="replace")
                    raise CheckpointError(
                        f"Saving {path!r} failed in process "
                        f"{int(failed.group(1))}: {reason}. The previous "
                        "checkpoint is kept.")
            arrived = {int(m.group(1)) for m in map(_PART.fullmatch, names)
                       if m}
            if arrived >= set(range(process_count)):
                break
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"Saving {path!r}: processes "
                    f"{sorted(set(range(process_count)) - arrived)} did not "
                    f"upload their shards within {timeout_s:.0f} s. The "
                    "previous checkpoint is kept.")
            time.sleep(wait)
            wait = min(wait * 1.5, 1.0)
        variables: Dict[str, Any] = {}
        files: Dict[str, int] = {}
        for process_id in range(process_count):
            key = object_store.join(prefix, f"part-{process_id:05d}.json")
            part = json.loads(store.read_bytes(key,
                                               ckpt_format.MAX_INDEX_BYTES))
            files.update(part["files"])
            for key_name, record in part["variables"].items():
                if key_name in variables:
                    variables[key_name]["pieces"] += record["pieces"]
                else:
                    variables[key_name] = record
        old = index_of(path)
        index = dict(metadata, variables=variables,
                     format=ckpt_format.FORMAT,
                     format_version=ckpt_format.FORMAT_VERSION,
                     num_processes=process_count,
                     object_store={"generation": generation, "files": files})
        # Fencing: a job that lost its directory's lease commits nothing.
        remote_lease.confirm(path)
        store.write_bytes(object_store.join(path, INDEX),
                          json.dumps(index, indent=1, sort_keys=True).encode())
    except BaseException:
        discard_generation(path, generation)
        raise
    store.remove([object_store.join(prefix, f"part-{i:05d}.json")
                  for i in range(process_count)])
    if old is not None:
        try:
            replaced = generation_of(old, path)
        except CheckpointError:
            replaced = None
        if replaced is not None and replaced != generation:
            remove_generation(path, replaced)


def wait_committed(path: str, generation: str, timeout_s: float,
                   process_id: int) -> None:
    """Non-chief processes: waits until the index names `generation`; if
    the chief gave the save up, removes this process's own files of it.

    Raises:
        CheckpointError: if the chief failed (its generation is gone) or
            did not commit in time.
    """
    store = object_store.store_for(path)
    deadline, wait = time.monotonic() + timeout_s, 0.05
    while True:
        try:
            index = index_of(path)
        except CheckpointError:
            index = None
        if index is not None and index.get("object_store", {}).get(
                "generation") == generation:
            return
        if not store.exists(object_store.join(path, generation, MARKER)):
            store.remove([object_store.join(path, generation, name) for name
                          in (f"shards-{process_id:05d}.h5",
                              f"part-{process_id:05d}.json")])
            raise CheckpointError(
                f"Saving {path!r} failed on the chief (process 0); see its "
                "error. The previous checkpoint is kept.")
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"Saving {path!r}: the chief did not commit within "
                f"{timeout_s:.0f} s. The previous checkpoint is kept.")
        time.sleep(wait)
        wait = min(wait * 1.5, 1.0)


def copy_committed(source: str, target: str, owner: Optional[str]) -> None:
    """Puts a copy of the committed checkpoint `source` at `target` (the
    store copies the objects; `source` is not read here), committed by its
    own index, which records `owner`.

    Raises:
        CheckpointError: if `source` is no committed checkpoint, or
            `target` holds objects kd did not write.
    """
    index = index_of(source)
    if index is None:
        raise CheckpointError(
            f"Expected a committed checkpoint to copy. Received: {source!r} "
            f"(it has no {INDEX}).")
    old_generation = generation_of(index, source)
    generation, heartbeat = prepare(target, owner)
    store = object_store.store_for(target)
    try:
        try:
            previous = index_of(target)
            for name in index["object_store"].get("files", {}):
                if not validation.SHARD_FILE.fullmatch(str(name)):
                    raise CheckpointError(
                        f"The index of {source!r} lists {name!r}; not copied.")
                store.call(f"Copying {name}", store.fs.copy,
                           object_store.join(source, old_generation, name),
                           object_store.join(target, generation, name))
            if owner is None:
                index.pop("owner", None)
            else:
                index["owner"] = owner
            index["object_store"] = dict(index["object_store"],
                                         generation=generation)
            remote_lease.confirm(target)
            store.write_bytes(object_store.join(target, INDEX), json.dumps(
                index, indent=1, sort_keys=True).encode())
        except BaseException:
            discard_generation(target, generation)
            raise
    finally:
        heartbeat.stop()
    if previous is not None:
        replaced = previous.get("object_store", {}).get("generation")
        if isinstance(replaced, str) and GENERATION.fullmatch(
                replaced) and replaced != generation:
            remove_generation(target, replaced)
