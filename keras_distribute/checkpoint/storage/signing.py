"""Signatures of the checkpoint parts kd cannot validate itself.

An input iterator's state is tf.data's own serialisation, and TensorFlow's
deserializer does not withstand crafted bytes (one crashed the process with
SIGSEGV). kd cannot check those bytes, so it proves it wrote them: each
state is saved with an HMAC-SHA256 under a secret key, and restored only if
the signature matches (or the caller says the checkpoint is trusted).

The key, in this order:

1. `KERAS_DISTRIBUTE_CHECKPOINT_KEY` (64 hex digits): set the same value on
   every host of a cluster whose processes may restart on another host.
2. `<KERAS_HOME or ~/.keras>/keras_distribute/checkpoint.key`: 32 random
   bytes made on first use (mode 0600), shared by the processes of a host.

Framework-free.
"""

import hashlib
import hmac
import os
import secrets
from typing import Optional

KEY_VARIABLE = "KERAS_DISTRIBUTE_CHECKPOINT_KEY"
_KEY_BYTES = 32


def key_path() -> str:
    """Where this host's key is kept (Keras' configuration directory)."""
    home = os.environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    return os.path.join(home, "keras_distribute", "checkpoint.key")


def _key() -> bytes:
    text = os.environ.get(KEY_VARIABLE)
    if text is not None:
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != _KEY_BYTES:
            raise ValueError(
                f"{KEY_VARIABLE} must be {2 * _KEY_BYTES} hex digits (a "
                f"{_KEY_BYTES}-byte key). Received {len(text)} characters. "
                "Make one with: python -c \"import secrets; "
                "print(secrets.token_hex(32))\".")
        return key
    path = key_path()
    if not os.path.isfile(path):
        _create_key(path)
    with open(path, "rb") as f:
        key = f.read(_KEY_BYTES + 1)
    if len(key) != _KEY_BYTES:
        raise ValueError(
            f"The checkpoint key {path!r} holds {len(key)} bytes, not "
            f"{_KEY_BYTES}. Delete it (a new one is made; input iterator "
            "states signed with the old one then need "
            "CheckpointOptions(trusted=True)), or set "
            f"{KEY_VARIABLE}.")
    return key


def _create_key(path: str) -> None:
    """Writes a new key at `path` unless another process did first (the
    first one wins: written aside, then linked into place)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    aside = f"{path}.{os.getpid()}.new"
    descriptor = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as f:
            f.write(secrets.token_bytes(_KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(aside, path)
        except FileExistsError:
            pass  # another process made it: use that one
    finally:
        os.remove(aside)


def sign(data: bytes) -> bytes:
    """The signature (HMAC-SHA256, 32 bytes) of `data` under the key."""
    return hmac.new(_key(), data, hashlib.sha256).digest()


def verify(data: bytes, signature: Optional[bytes]) -> bool:
    """Whether `signature` is this key's signature of `data`."""
    return signature is not None and hmac.compare_digest(sign(data),
                                                         bytes(signature))
