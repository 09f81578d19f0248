"""A checkpoint is untrusted input: hostile or corrupt checkpoints are
refused with a `CheckpointError` before a byte outside the checkpoint
directory is read or a large allocation is made, and no save deletes what
is not a checkpoint. Backend-neutral (the format layer and its reader)."""

import copy
import json
import os
import random
import resource
import shutil
import sys
import tracemalloc

import h5py
import keras
import numpy as np
import pytest

import keras_distribute as kd
from keras_distribute.checkpoint.storage import format as fmt
from keras_distribute.checkpoint.storage import writing as ckpt_writing

ckpt = kd.checkpoint
CheckpointError = ckpt.CheckpointError


def original_arrays():
    rng = np.random.default_rng(7)
    import ml_dtypes

    return {
        "w": rng.normal(size=(6, 4)).astype("float32"),  # two pieces
        "b": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
        "step": np.array(41, "int64"),
        "mask": rng.integers(0, 2, size=(7,)).astype("bool"),
        "empty": np.zeros((0, 3), "float32"),
    }


def write_checkpoint(path):
    """A two-process checkpoint written through the format layer itself."""
    arrays = original_arrays()
    temporary = ckpt_writing.prepare(path)
    entries = [{}, {}]
    for key, array in arrays.items():
        dtype = array.dtype.name
        if key == "w":  # rows 0:4 by process 0, rows 4:6 by process 1
            for process, (lo, hi) in enumerate([(0, 4), (4, 6)]):
                entries[process][key] = (array.shape, dtype, [None, None], [
                    (((lo, hi), (0, 4)), array[lo:hi])], key)
        else:
            region = tuple((0, n) for n in array.shape)
            entries[0][key] = (array.shape, dtype, [None] * array.ndim,
                               [(region, array)], key)
    for process in (0, 1):
        ckpt_writing.write_process_shards(temporary, entries[process], process)
    ckpt_writing.commit(path, 2, {"backend": "none"})
    return arrays


@pytest.fixture
def written(tmp_path):
    path = str(tmp_path / "ckpt" / "c")
    os.makedirs(os.path.dirname(path))
    arrays = write_checkpoint(path)
    outside = tmp_path / "outside"
    outside.mkdir()
    return path, arrays, outside


def read_all(path):
    reader = ckpt.load_checkpoint(path)
    return {key: reader.get_tensor(key)
            for key in reader.get_variable_to_shape_map()}


def edit_index(path, edit):
    index_path = os.path.join(path, "index.json")
    index = json.load(open(index_path))
    edit(index)
    with open(index_path, "w") as f:
        json.dump(index, f)


def test_the_pristine_checkpoint_round_trips_bit_exactly(written):
    path, arrays, _ = written
    got = read_all(path)
    assert sorted(got) == sorted(arrays)
    for key, array in arrays.items():
        assert got[key].dtype == array.dtype and got[key].tobytes() == (
            array.tobytes()), key


def test_pieces_carry_xxh3_and_format_1_sha256_checkpoints_still_read(
        written):
    # #15: the checksum is XXH3-128 (at memory speed); a checkpoint of
    # format 1, whose pieces carry sha256, reads back bit-exactly and a
    # flipped byte in it is still caught and named.
    path, arrays, _ = written
    index = json.load(open(os.path.join(path, "index.json")))
    assert index["format_version"] == 2
    pieces = [p for v in index["variables"].values() for p in v["pieces"]]
    assert all(set(p) - {"offset"} == {"dataset", "file", "slice",
                                       "xxh3_128"} for p in pieces)

    def to_format_1(index):
        index["format_version"] = 1
        for variable in index["variables"].values():
            for piece in variable["pieces"]:
                with h5py.File(os.path.join(path, piece["file"])) as h5:
                    stored = h5[piece["dataset"]][()]
                piece.pop("xxh3_128")
                piece["sha256"] = fmt.checksum(stored, "sha256")

    edit_index(path, to_format_1)
    got = read_all(path)
    for key, array in arrays.items():
        assert got[key].tobytes() == array.tobytes(), key
    rewrite_dataset(path, dataset_of(path, "w"), lambda group, name: (
        group.create_dataset(name, data=arrays["w"][:4] + 1)))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_all(path)


@pytest.mark.parametrize("name", ["../outside/evil.h5", "/etc/passwd",
                                  "shards-00000.h5/../../x", "sub/x.h5"])
def test_index_file_names_outside_the_directory_are_refused(written, name):
    path, _, outside = written
    shutil.copy(os.path.join(path, "shards-00000.h5"), outside / "evil.h5")
    edit_index(path, lambda index: index["variables"]["step"]["pieces"][0]
               .__setitem__("file", name))
    with pytest.raises(CheckpointError, match="malformed at 'variables/step/"
                       "pieces/0/file'.*shards-NNNNN.h5"):
        read_all(path)


def test_a_shard_symlinked_outside_is_refused(written):
    path, _, outside = written
    shard = os.path.join(path, "shards-00000.h5")
    shutil.move(shard, outside / "real.h5")
    os.symlink(outside / "real.h5", shard)
    with pytest.raises(CheckpointError, match="not a symlink"):
        read_all(path)


def test_an_index_symlinked_outside_is_refused(written):
    path, _, outside = written
    index = os.path.join(path, "index.json")
    shutil.move(index, outside / "index.json")
    os.symlink(outside / "index.json", index)
    with pytest.raises(CheckpointError, match="not a symlink"):
        read_all(path)


def test_linking_a_checkpoint_with_a_symlink_inside_is_refused(written):
    # A manager's save_link copies a checkpoint by hard links: a symlink
    # planted in it is not followed, and nothing is made at the target.
    from keras_distribute.checkpoint.storage import writing as ckpt_writing

    path, _, outside = written
    (outside / "secret").write_text("not a shard")
    os.symlink(outside / "secret", os.path.join(path, "shards-00009.h5"))
    target = os.path.join(os.path.dirname(path), "copy")
    with pytest.raises(CheckpointError, match="not a plain file"):
        ckpt_writing.link_committed(path, target, owner="best")
    assert sorted(os.listdir(os.path.dirname(path))) == ["c"]
    assert (outside / "secret").read_text() == "not a shard"


def rewrite_dataset(path, dataset, make, drop_offsets=True):
    """Replaces `dataset` of shards-00000.h5 with what `make(h5, name)`
    creates there (keeping the index, checksums included, as they are).

    Unless `drop_offsets=False`, the index's byte offsets are dropped, as in
    a checkpoint written before kd recorded them: the reader then looks
    every piece up in the HDF5 file, which is what these tests attack.
    (With the offsets, it reads the recorded bytes and never asks HDF5: see
    the offset tests.)"""
    with h5py.File(os.path.join(path, "shards-00000.h5"), "r+") as h5:
        group, name = dataset.split("/")
        del h5[group][name]
        make(h5[group], name)
    if drop_offsets:
        edit_index(path, lambda index: [
            piece.pop("offset", None)
            for record in index["variables"].values()
            for piece in record["pieces"]])


def dataset_of(path, key):
    index = json.load(open(os.path.join(path, "index.json")))
    piece = index["variables"][key]["pieces"][0]
    return piece["dataset"]


def test_hdf5_external_links_are_refused(written):
    path, arrays, outside = written
    with h5py.File(outside / "secret.h5", "w") as h5:
        h5["p"] = arrays["step"]
    dataset = dataset_of(path, "step")
    rewrite_dataset(path, dataset, lambda group, name: group.__setitem__(
        name, h5py.ExternalLink(str(outside / "secret.h5"), "/p")))
    with pytest.raises(CheckpointError, match="ExternalLink.*only hard links"):
        read_all(path)


def test_external_raw_storage_is_refused(written):
    path, arrays, outside = written
    secret = outside / "secret.txt"
    secret.write_bytes(arrays["mask"].tobytes())  # what the index expects
    dataset = dataset_of(path, "mask")
    rewrite_dataset(path, dataset, lambda group, name: group.create_dataset(
        name, shape=(7,), dtype="bool", external=[(str(secret), 0, 7)]))
    with pytest.raises(CheckpointError, match="external raw storage"):
        read_all(path)


def test_virtual_datasets_are_refused(written):
    path, arrays, outside = written
    with h5py.File(outside / "other.h5", "w") as h5:
        h5["m"] = arrays["mask"]
    dataset = dataset_of(path, "mask")

    def virtual(group, name):
        layout = h5py.VirtualLayout(shape=(7,), dtype="bool")
        layout[:] = h5py.VirtualSource(str(outside / "other.h5"), "m",
                                       shape=(7,))
        group.create_virtual_dataset(name, layout)

    rewrite_dataset(path, dataset, virtual)
    with pytest.raises(CheckpointError, match="virtual, chunked or compact"):
        read_all(path)


@pytest.mark.parametrize("make, match", [
    (lambda g, n: g.create_dataset(n, data=np.array([b"x"] * 7, object),
                                   dtype=h5py.string_dtype()),
     "dtype object"),
    (lambda g, n: g.create_dataset(n, data=np.zeros(7, "int8"),
                                   compression="gzip"),
     "virtual, chunked or compact"),
    (lambda g, n: g.create_dataset(n, data=np.zeros(7, "int8")),
     "dtype int8 is not what the declared bool"),
    (lambda g, n: g.create_dataset(n, data=np.zeros(8, "bool")),
     "shape \\(8,\\) is not the index's \\(7,\\)"),
])
def test_non_numeric_or_unexpected_datasets_are_refused(written, make, match):
    path, _, _ = written
    rewrite_dataset(path, dataset_of(path, "mask"), make)
    with pytest.raises(CheckpointError, match=match):
        read_all(path)


def test_pieces_are_read_from_their_recorded_offsets_without_hdf5(
        written, monkeypatch):
    # #43 item 5: the index records where each piece's bytes lie; a restore
    # reads them from there (HDF5's metadata cost ~0.2 ms per piece) and
    # asks h5py only for scalars.
    path, arrays, _ = written
    index = json.load(open(os.path.join(path, "index.json")))
    for key, array in arrays.items():
        for piece in index["variables"][key]["pieces"]:
            assert ("offset" in piece) == (array.ndim > 0 and array.size > 0)
    (piece,) = index["variables"]["b"]["pieces"]
    raw = open(os.path.join(path, piece["file"]), "rb").read()
    at = piece["offset"]
    assert raw[at:at + arrays["b"].nbytes] == arrays["b"].tobytes()
    opened = []
    real_file = h5py.File
    monkeypatch.setattr(h5py, "File", lambda *a, **k: (
        opened.append(a[0]), real_file(*a, **k))[1])
    got = read_all(path)
    assert all(got[k].tobytes() == a.tobytes() for k, a in arrays.items())
    assert len(opened) == 1  # shards-00000.h5, for the scalar "step" only


def test_a_crafted_offset_reads_nothing_beyond_its_file(written):
    path, arrays, _ = written
    size = os.path.getsize(os.path.join(path, "shards-00000.h5"))

    def past_the_end(index):
        index["variables"]["b"]["pieces"][0]["offset"] = size - 4

    edit_index(path, past_the_end)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="Refusing piece 'v0/p0' .*"
                           "its 30 bytes at offset .* lie beyond the end of "
                           f"the file \\({size} bytes\\)"):
            read_all(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20

    def other_bytes(index):
        index["variables"]["b"]["pieces"][0]["offset"] = 0

    edit_index(path, other_bytes)
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        read_all(path)


def test_hdf5_tricks_do_not_reach_a_piece_read_at_its_offset(written):
    # With the offset recorded, a dataset relinked outside the directory is
    # never followed: the recorded bytes inside the file are read, and
    # checked.
    path, arrays, outside = written
    with h5py.File(outside / "secret.h5", "w") as h5:
        h5["p"] = arrays["mask"]
    rewrite_dataset(path, dataset_of(path, "mask"), lambda group, name: (
        group.__setitem__(name, h5py.ExternalLink(
            str(outside / "secret.h5"), "/p"))), drop_offsets=False)
    got = read_all(path)
    assert got["mask"].tobytes() == arrays["mask"].tobytes()


def test_a_huge_declared_dataset_in_a_small_file_allocates_nothing(written):
    path, _, _ = written
    huge = 1 << 28  # 1 GiB of float32 declared, no bytes stored
    dataset = dataset_of(path, "step")

    def edit(index):
        record = index["variables"]["step"]
        record.update(shape=[huge], dtype="float32")
        record["pieces"][0]["slice"] = [[0, huge]]

    edit_index(path, edit)
    rewrite_dataset(path, dataset, lambda group, name: group.create_dataset(
        name, shape=(huge,), dtype="float32"))  # HDF5 allocates lazily
    assert os.path.getsize(os.path.join(path, "shards-00000.h5")) < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="does not hold its "
                           "1073741824 bytes"):
            read_all(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize("edit, match", [
    (lambda i: (i["variables"]["step"].update(shape=[10**12, 3]),
                i["variables"]["step"]["pieces"][0].update(
                    slice=[[0, 10**12], [0, 3]])),
     "its shape \\(\\) is not the index's \\(1000000000000, 3\\)"),
    (lambda i: i["variables"]["step"].update(shape=[10**12, 3]),
     "2 \\[start, stop\\] pairs inside shape \\[1000000000000, 3\\]"),
    (lambda i: i["variables"]["step"].pop("shape"),
     "'variables/step/shape': expected a list of non-negative integers"),
    (lambda i: i["variables"]["step"].update(shape=[-1]),
     "expected a list of non-negative integers"),
    (lambda i: i["variables"]["step"].update(dtype="not_a_dtype"),
     "dtype 'not_a_dtype', which is not a numeric dtype"),
    (lambda i: i["variables"]["step"].update(dtype="object"),
     "dtype 'object', which is not a numeric dtype"),
    (lambda i: i["variables"]["step"].update(dtype="__class__"),
     "not a numeric dtype"),
    (lambda i: i["variables"]["w"]["pieces"][1].update(slice=[[4, 5], [0, 4]]),
     "pieces covering shape \\[6, 4\\] exactly"),
    (lambda i: i["variables"]["w"]["pieces"][1].update(slice=[[2, 4], [0, 4]]),
     "expected disjoint pieces"),
    (lambda i: i["variables"]["w"]["pieces"][1].update(slice=[[3, 6], [0, 4]]),
     "pieces covering shape"),
    (lambda i: i["variables"]["w"]["pieces"].append(
        dict(i["variables"]["w"]["pieces"][0], slice=[[0, 0], [0, 4]])),
     None),  # an empty extra piece: harmless, the read is exact
    (lambda i: i["variables"]["w"]["pieces"][0].update(sha256="00"),
     "sha256 hex digest"),
    (lambda i: i["variables"]["w"]["pieces"][0].update(xxh3_128="0" * 31),
     "xxh3_128 hex digest of 32 characters"),
    (lambda i: i["variables"]["w"]["pieces"][0].pop("xxh3_128"),
     "exactly one checksum field, 'xxh3_128' or 'sha256'"),
    (lambda i: i["variables"]["w"]["pieces"][0].update(sha256="a" * 64),
     "exactly one checksum field"),
    (lambda i: i["variables"]["w"]["pieces"][0].update(dataset="v0/../p0"),
     "dataset name"),
    (lambda i: i["variables"]["w"].update(pieces={}), "pieces"),
    (lambda i: i["variables"].update(w=[1, 2]), "'variables/w': expected an "
     "object"),
    (lambda i: i["variables"]["w"]["pieces"][0].update(offset=-1),
     "'variables/w/pieces/0/offset': expected a byte offset"),
    (lambda i: i["variables"]["w"]["pieces"][0].update(offset="2048"),
     "expected a byte offset"),
    (lambda i: i["variables"]["w"]["pieces"][0].update(offset=True),
     "expected a byte offset"),
    (lambda i: i["variables"]["w"]["pieces"][0].update(offset=1 << 62),
     "expected a byte offset from 0 to"),
    (lambda i: i.update(save_counter="3"), "save_counter"),
    (lambda i: i.update(metadata=[1]), "metadata"),
    (lambda i: i.update(format_version=99), "newer than this"),
    (lambda i: i.update(format="other"), "not a keras_distribute checkpoint "
     "index"),
])
def test_malformed_indexes_are_refused_with_the_entry(written, edit, match):
    path, arrays, _ = written
    edit_index(path, edit)
    if match is None:
        assert read_all(path)["w"].tobytes() == arrays["w"].tobytes()
        return
    with pytest.raises(CheckpointError, match=match):
        read_all(path)


def test_an_index_that_is_not_an_object_is_refused(written):
    path, _, _ = written
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump([1, 2, 3], f)
    with pytest.raises(CheckpointError, match="expected a JSON object, "
                       "received 'list'"):
        read_all(path)
    with open(os.path.join(path, "index.json"), "w") as f:
        f.write("[" * 100000)
    with pytest.raises(CheckpointError, match="dense with empty objects"):
        read_all(path)


def test_overlapping_pieces_are_refused(written):
    # Two pieces whose volumes add up but overlap would leave a gap
    # uninitialised (process memory in the model): refused.
    path, _, _ = written

    def edit(index):  # rows 0:3 and 1:3 of 5: 20 elements, rows 3:5 unset
        index["variables"]["w"]["shape"] = [5, 4]
        pieces = index["variables"]["w"]["pieces"]
        pieces[0]["slice"] = [[0, 3], [0, 4]]
        pieces[1]["slice"] = [[1, 3], [0, 4]]

    edit_index(path, edit)
    with pytest.raises(CheckpointError, match="disjoint pieces"):
        read_all(path)


def test_duplicate_grid_pieces_are_refused(written):
    path, _, _ = written

    def edit(index):  # rows 0:3 twice for a 6-row variable
        pieces = index["variables"]["w"]["pieces"]
        pieces[0]["slice"] = [[0, 3], [0, 4]]
        pieces[1]["slice"] = [[0, 3], [0, 4]]

    edit_index(path, edit)
    with pytest.raises(CheckpointError, match="disjoint pieces"):
        read_all(path)


def _many_pieces(index, count, grid=True):
    """`w` cut into `count` pieces along axis 1 (a grid), or into pieces
    of two widths staggered over two rows (not a grid)."""
    record = index["variables"]["w"]
    template = record["pieces"][0]
    if grid:
        record["shape"] = [1, count]
        slices = [[[0, 1], [i, i + 1]] for i in range(count)]
    else:  # row 0 in pieces of 2, row 1 offset by one: no common grid
        record["shape"] = [2, count]
        slices = ([[[0, 1], [i, i + 2]] for i in range(0, count, 2)]
                  + [[[1, 2], [0, 1]]]
                  + [[[1, 2], [i, i + 2]] for i in range(1, count - 1, 2)]
                  + [[[1, 2], [count - 1, count]]])
    record["pieces"] = [dict(template, slice=s) for s in slices]


@pytest.mark.timeout(120)  # the former pairwise check took ~90 minutes
def test_the_tiling_check_of_65536_pieces_is_linear(written):
    path, _, _ = written
    edit_index(path, lambda index: _many_pieces(index, 1 << 16))
    assert dict(ckpt.list_variables(path))["w"] == (1, 1 << 16)


def test_many_pieces_off_a_grid_are_refused(written):
    path, _, _ = written
    edit_index(path, lambda index: _many_pieces(index, 600, grid=False))
    with pytest.raises(CheckpointError, match="pieces on a grid"):
        ckpt.list_variables(path)
    edit_index(path, lambda index: _many_pieces(index, 40, grid=False))
    assert dict(ckpt.list_variables(path))["w"] == (2, 40)


@pytest.mark.parametrize("make", [
    lambda n: {"format": fmt.FORMAT, "variables": {
        f"k{i}": {} for i in range(n)}},
    lambda n: {"format": fmt.FORMAT, "variables": {}, "x": [{}] * n},
    lambda n: {"format": fmt.FORMAT, "variables": {}, "x": [[]] * n},
], ids=["empty-objects", "list-of-objects", "list-of-lists"])
def test_an_index_dense_with_tiny_values_is_refused_within_bounded_memory(
        written, make):
    import tracemalloc

    path, _, _ = written
    raw = json.dumps(make(1_000_000), separators=(",", ":")).encode()
    with open(os.path.join(path, "index.json"), "wb") as f:
        f.write(raw)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="dense with empty objects"):
            ckpt.list_variables(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(raw)  # the raw bytes and little more


def test_a_shape_numpy_cannot_address_is_refused_with_its_entry(written):
    path, _, _ = written

    def edit(index):
        index["variables"]["empty"]["shape"] = [0, 2 ** 62]
        index["variables"]["empty"]["pieces"][0]["slice"] = [[0, 0],
                                                             [0, 2 ** 62]]

    edit_index(path, edit)
    with pytest.raises(CheckpointError,
                       match="malformed at 'variables/empty/shape'"):
        read_all(path)


# --------------------------------------------------------------- writing
def test_write_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("print('mine')\n")
    checkpoint = ckpt.ShardedCheckpoint(v=keras.Variable(np.ones(3)))
    with pytest.raises(CheckpointError, match="is not a keras_distribute "
                       "checkpoint \\(it holds \\['src'\\]\\).*does not exist"):
        checkpoint.write(str(project))
    assert (project / "src" / "train.py").read_text() == "print('mine')\n"
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="holds a file"):
        checkpoint.write(str(tmp_path / "notes.txt"))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # Neighbours the commit uses are not ours either: refused, kept.
    (tmp_path / "c.tmp").mkdir()
    (tmp_path / "c.tmp" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="Not deleting .*c.tmp"):
        checkpoint.write(str(tmp_path / "c"))
    (tmp_path / "d.old").mkdir()
    (tmp_path / "d.old" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="d.old' exists and is not"):
        checkpoint.write(str(tmp_path / "d"))
    assert (tmp_path / "c.tmp" / "keep.txt").exists()
    assert (tmp_path / "d.old" / "keep.txt").exists()
    assert not ckpt.storage.writing.clean_unfinished(str(tmp_path))
    assert (tmp_path / "c.tmp" / "keep.txt").exists()


def test_write_overwrites_its_own_checkpoint_and_fills_an_empty_dir(tmp_path):
    variable = keras.Variable(np.ones(3))
    checkpoint = ckpt.ShardedCheckpoint(v=variable)
    (tmp_path / "empty").mkdir()
    path = checkpoint.write(str(tmp_path / "empty"))
    variable.assign(np.full(3, 2.0))
    checkpoint.write(path)  # a checkpoint: replaced atomically
    assert ckpt.load_variable(path, "v").tolist() == [2.0, 2.0, 2.0]
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_backup_cleanup_keeps_a_users_files(tmp_path):
    directory = tmp_path / "backup"
    directory.mkdir()
    (directory / "mine.txt").write_text("keep")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(np.ones((4, 2)), np.ones((4, 1)), epochs=1, verbose=0,
              callbacks=[kd.callbacks.BackupAndRestore(str(directory),
                                                      save_freq=1)])
    assert sorted(os.listdir(directory)) == ["mine.txt"]


# ------------------------------------------------------------------ fuzz
_POOL = [None, -1, 0, 1, 3, 2**63, 10**12, 1.5, True, "", "../x", "/etc/passwd",
         "shards-00001.h5", "shards-99999.h5", "v0/p1", "v9/p9", "object",
         "float64", "int32", "bfloat16", "|O", "V8", [], {}, [0], [[0, 10**9]],
         [[0, 2], [0, 4]], "0" * 64, [0, 2 ** 62], [2 ** 40, 2 ** 40],
         [[0, 0], [0, 2 ** 62]]]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for number, value in enumerate(node):
            yield from _paths(value, prefix + (number,))


def _mutate_index(index, rng):
    index = copy.deepcopy(index)
    paths = [p for p in _paths(index) if p]
    target = rng.choice(paths)
    parent = index
    for part in target[:-1]:
        parent = parent[part]
    action = rng.random()
    if action < 0.15 and isinstance(parent, dict):
        del parent[target[-1]]
    elif action < 0.3 and isinstance(parent[target[-1]], int) and not (
            isinstance(parent[target[-1]], bool)):
        parent[target[-1]] += rng.choice([-1, 1, 2**31, -(2**31)])
    else:
        parent[target[-1]] = copy.deepcopy(rng.choice(_POOL))
    return index


def _mutate_bytes(data, rng):
    data = bytearray(data)
    action = rng.random()
    if action < 0.6:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif action < 0.8:
        data = data[:rng.randrange(len(data))]
    else:
        at = rng.randrange(len(data))
        data[at:at + 8] = rng.randbytes(8)
    return bytes(data)


@pytest.fixture
def outside_reads():
    """Python-level opens outside the allowed directories (audit hook)."""
    seen, allowed = [], []

    def hook(event, args):
        if event == "open" and allowed and isinstance(args[0], str):
            target = os.path.realpath(args[0])
            if not any(target.startswith(a) for a in allowed):
                seen.append(target)

    sys.addaudithook(hook)  # cannot be removed: inert once `allowed` empties
    yield seen, allowed
    allowed.clear()


def test_fuzzed_checkpoints_restore_exactly_or_raise_checkpoint_error(
        tmp_path, outside_reads):
    seen, allowed = outside_reads
    pristine = str(tmp_path / "pristine")
    arrays = write_checkpoint(pristine)
    index = json.load(open(os.path.join(pristine, "index.json")))
    shard_names = sorted(n for n in os.listdir(pristine) if n.endswith(".h5"))
    shards = {n: open(os.path.join(pristine, n), "rb").read()
              for n in shard_names}
    rng = random.Random(20261130)
    outcomes = {"exact": 0, "refused": 0}
    work = str(tmp_path / "work")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reading_from = [os.path.realpath(work), sys.prefix, sys.base_prefix,
                    os.path.dirname(os.path.dirname(kd.__file__))]
    for case in range(1200):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        kind = case % 3
        if kind == 0:  # structured index mutations
            mutated = index
            for _ in range(rng.randint(1, 3)):
                mutated = _mutate_index(mutated, rng)
            with open(os.path.join(work, "index.json"), "w") as f:
                json.dump(mutated, f)
        elif kind == 1:  # shard bytes
            name = rng.choice(shard_names)
            with open(os.path.join(work, name), "wb") as f:
                f.write(_mutate_bytes(shards[name], rng))
        else:  # index bytes
            raw = open(os.path.join(pristine, "index.json"), "rb").read()
            with open(os.path.join(work, "index.json"), "wb") as f:
                f.write(_mutate_bytes(raw, rng))
        allowed.extend(reading_from)
        try:
            got = read_all(work)
        except CheckpointError:
            outcomes["refused"] += 1
            continue
        finally:
            allowed.clear()
        for key, value in got.items():
            if key in arrays:  # a renamed key holds its original bytes
                # (an index may declare an empty variable another empty
                # shape: a consistent index, and no byte to get wrong)
                assert value.dtype == arrays[key].dtype and (
                    value.shape == arrays[key].shape or value.size == 0 ==
                    arrays[key].size) and (
                    value.tobytes() == arrays[key].tobytes()), (case, key)
        outcomes["exact"] += 1
    assert not seen, seen[:5]
    assert outcomes["refused"] > 600 and outcomes["exact"] > 50, outcomes
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                - rss_before) / 1024
    assert grown_mb < 256, grown_mb


def test_an_interrupted_commit_is_read_where_it_lies_but_never_a_link(written):
    path, arrays, outside = written
    os.replace(path, path + ".old")  # a commit died between its renames
    assert set(read_all(path)) == set(arrays)
    assert os.path.isdir(path + ".old") and not os.path.exists(path)
    # A link put at `<path>.old` (to a checkpoint elsewhere) is not read.
    os.replace(path + ".old", str(outside / "c"))
    os.symlink(str(outside / "c"), path + ".old")
    with pytest.raises(CheckpointError, match="not a committed"):
        read_all(path)
    assert os.path.islink(path + ".old") and not os.path.exists(path)


@pytest.mark.parametrize("url", ["file:///tmp/run", "hdfs://nn/run",
                                 "az://container/run"])
def test_a_path_naming_storage_kd_cannot_use_is_refused_everywhere(
        tmp_path, monkeypatch, url):
    # os would take "hdfs://nn/run" for a directory "hdfs:" in the working
    # directory: a checkpoint that vanishes with the machine. Every entry
    # point refuses a scheme other than s3:// and gs:// (tested against a
    # server in test_object_store.py), and nothing is made anywhere.
    monkeypatch.chdir(tmp_path)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    from pathlib import PurePosixPath

    entry_points = {
        "write": lambda p: checkpoint.write(p),
        "save": lambda p: checkpoint.save(p),
        "read": lambda p: checkpoint.read(p),
        "restore": lambda p: checkpoint.restore(p),
        "CheckpointManager": lambda p: kd.checkpoint.CheckpointManager(
            checkpoint, p),
        "latest_checkpoint": kd.checkpoint.latest_checkpoint,
        "checkpoints_in": kd.checkpoint.checkpoints_in,
        "read_metadata": kd.checkpoint.read_metadata,
        "list_variables": kd.checkpoint.list_variables,
        "load_checkpoint": kd.checkpoint.load_checkpoint,
        "export_weights": lambda p: kd.checkpoint.export_weights(
            p, model, str(tmp_path / "w.weights.h5")),
        "callbacks.ShardedCheckpoint": kd.callbacks.ShardedCheckpoint,
        "BackupAndRestore": kd.callbacks.BackupAndRestore,
        "PreemptionCheckpoint": kd.callbacks.PreemptionCheckpoint,
        "PreemptionCheckpointHandler": lambda p: (
            kd.experimental.PreemptionCheckpointHandler(
                kd.get_strategy().cluster_resolver, checkpoint, p)),
        "pathlib": lambda p: checkpoint.write(PurePosixPath(p)),
    }
    scheme = url.split(":")[0]
    for name, call in entry_points.items():
        with pytest.raises(ValueError, match=f"names {scheme}:// storage, "
                           "which is not usable here.*s3:// or gs://.*"
                           "mounted"):
            call(url)
    assert os.listdir(tmp_path) == []
    with pytest.raises(TypeError, match="must be a path.*Received: path=3 "
                       "of type int"):
        checkpoint.write(3)
