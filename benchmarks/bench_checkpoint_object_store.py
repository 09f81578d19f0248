"""Save / restore throughput of kd checkpoints in object storage, against
s3fs's own transfer of the same bytes, in one run.

An S3-API server runs on 127.0.0.1 (moto's server mode, the one the tests
use; or `--endpoint` for another, e.g. MinIO). The same state
(`--megabytes` of float32 Keras variables, `_common.make_checkpoint_state`)
is saved to `s3://` by kd's `ShardedCheckpoint.write` (local shard file,
checksums, upload, index last) and restored by `read` (download, checks,
assignment); s3fs puts a file of the same bytes (`put_file`) and gets
the very shard object kd's restore downloaded (`get_file`): the store's
raw transfer.
orbax/tensorstore are not compared: orbax reaches S3 through etils' epath,
which needs a gcsfs/s3fs-backed `epath` set-up this run does not make.
Prints one JSON object with every run, the medians and kd's time over
s3fs's (goal: throughput ≥ 0.9× s3fs's, i.e. ratio ≤ 1.11).

    KERAS_BACKEND=jax python benchmarks/bench_checkpoint_object_store.py \
        --megabytes 256
"""

import os
import statistics
import sys
import tempfile
import time
import uuid

from _args import checkpoint_args
from _results import record

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                os.pardir, "tests"))


def main() -> None:
    parser = checkpoint_args(__doc__)
    parser.add_argument("--endpoint", default=None,
                        help="an S3-API server to use (default: start moto's)")
    parser.set_defaults(megabytes=256)
    args = parser.parse_args()
    import contextlib

    import s3_server

    server = (contextlib.nullcontext(args.endpoint) if args.endpoint
              else s3_server.s3_server())
    with server as endpoint:
        if not args.endpoint:
            os.environ.update(s3_server.environment(endpoint))
        s3_server.make_bucket(endpoint, "kd-bench")
        record("checkpoint_object_store", run(args))


def run(args) -> dict:
    import numpy as np
    from _common import make_checkpoint_state

    import keras_distribute as kd
    from keras_distribute.checkpoint.storage import object_store

    model = make_checkpoint_state(args.megabytes, seed=0)
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    checkpoint = kd.checkpoint.ShardedCheckpoint(model=model)
    fs = object_store.store_for("s3://kd-bench").fs
    scratch = tempfile.mkdtemp(prefix="kd-bench-")
    raw_file = os.path.join(scratch, "raw.bin")
    with open(raw_file, "wb") as f:
        for variable in model.weights:
            f.write(np.asarray(variable).tobytes())
    runs = []
    for _ in range(args.repeats):
        path = f"s3://kd-bench/{uuid.uuid4().hex}/ckpt"
        started = time.perf_counter()
        checkpoint.write(path)
        kd_save = time.perf_counter() - started
        started = time.perf_counter()
        checkpoint.read(path).assert_consumed()
        kd_restore = time.perf_counter() - started
        key = f"kd-bench/{uuid.uuid4().hex}/raw.bin"
        started = time.perf_counter()
        fs.put_file(raw_file, key)
        raw_put = time.perf_counter() - started
        # The anchor's download: the very object kd's restore downloaded.
        shard = next(name for name in object_store.store_for(path)
                     .files_under(path) if name.endswith(".h5"))
        got = os.path.join(scratch, "got.bin")
        started = time.perf_counter()
        fs.get_file(f"{path}/{shard}", got)
        raw_get = time.perf_counter() - started
        os.remove(got)
        runs.append({"kd_save_s": kd_save, "kd_restore_s": kd_restore,
                     "s3fs_put_s": raw_put, "s3fs_get_s": raw_get})
    os.remove(raw_file)
    os.rmdir(scratch)
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    mb = nbytes / 2**20
    return {
        "megabytes": round(mb, 1), "repeats": args.repeats,
        "server": "moto (server mode) on 127.0.0.1", "runs": runs,
        "median": median,
        "kd_save_mb_s": mb / median["kd_save_s"],
        "kd_restore_mb_s": mb / median["kd_restore_s"],
        "s3fs_put_mb_s": mb / median["s3fs_put_s"],
        "s3fs_get_mb_s": mb / median["s3fs_get_s"],
        "save_over_put": median["kd_save_s"] / median["s3fs_put_s"],
        "restore_over_get": median["kd_restore_s"] / median["s3fs_get_s"],
        "goal": "kd's throughput >= 0.9x s3fs's (ratio <= 1.11)",
    }


if __name__ == "__main__":
    main()
