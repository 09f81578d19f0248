"""tf.distribute's names for how replicas exchange values, accepted so that
porting is an import change.

Each backend's engine chooses the all-reduce itself (XLA on JAX, NCCL or
gloo through `torch.distributed`, tf.distribute's own choice on
TensorFlow), so these objects select nothing: they are accepted where
tf.distribute accepts them (`MirroredStrategy(cross_device_ops=...)`,
`CommunicationOptions(implementation=...)`) and kept for inspection.
`CommunicationOptions` also carries what the engines do honour: the
timeout and the gradient compression.
"""

import dataclasses
import enum
import os
from types import MappingProxyType
from typing import Any
from typing import Optional

# The one communication timeout: joining a job and each collective, on
# every backend and strategy. `KERAS_DISTRIBUTE_TIMEOUT` (seconds) changes
# the default; `CommunicationOptions(timeout_seconds=...)` one strategy's.
DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_VARIABLE = "KERAS_DISTRIBUTE_TIMEOUT"
# Accepted names of each gradient compression, by the name kept.
_COMPRESSIONS = MappingProxyType({"fp16": ("fp16", "float16", "half"),
                 "bf16": ("bf16", "bfloat16")})


class CommunicationImplementation(enum.Enum):
    """Which collective implementation a multi-worker job should use, as
    `tf.distribute.experimental.CommunicationImplementation`. The engine
    decides (NCCL on GPUs with torch, XLA on JAX); kept for compatibility.

    Example:

    >>> CommunicationImplementation.from_value("nccl")
    <CommunicationImplementation.NCCL: 'NCCL'>
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @staticmethod
    def from_value(value: Any) -> "CommunicationImplementation":
        """The member `value` names (a member, or its name in any case).

        Raises:
            ValueError: for anything else.
        """
        if isinstance(value, CommunicationImplementation):
            return value
        name = getattr(value, "name", value)
        if isinstance(name, str) and name.upper() in (
                "AUTO", "RING", "NCCL"):
            return CommunicationImplementation[name.upper()]
        raise ValueError(
            "Expected a communication implementation: "
            "kd.CommunicationImplementation.AUTO / RING / NCCL, or one of "
            f"'auto', 'ring', 'nccl'. Received: implementation={value!r}.")


class CrossDeviceOps:
    """The base of the objects `MirroredStrategy(cross_device_ops=...)`
    accepts. The engine of the backend performs the all-reduce; this object
    only records the choice."""

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"<{type(self).__name__} {fields}>" if fields else (
            f"<{type(self).__name__}>")


class NcclAllReduce(CrossDeviceOps):
    """`tf.distribute.NcclAllReduce`: NCCL all-reduce (what the torch and
    TensorFlow engines use on GPUs anyway).

    Args:
        num_packs: Accepted for compatibility. Defaults to 1.
    """

    def __init__(self, num_packs: int = 1):
        self.num_packs = _positive_int(num_packs, "num_packs")


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """`tf.distribute.HierarchicalCopyAllReduce` (a DGX-1 topology
    algorithm); the engine picks its own.

    Args:
        num_packs: Accepted for compatibility. Defaults to 1.
    """

    def __init__(self, num_packs: int = 1):
        self.num_packs = _positive_int(num_packs, "num_packs")


class ReductionToOneDevice(CrossDeviceOps):
    """`tf.distribute.ReductionToOneDevice`: reduce on one device, then
    broadcast; the engine picks its own algorithm.

    Args:
        reduce_to_device: Accepted for compatibility. Defaults to `None`.
        accumulation_fn: Accepted for compatibility. Defaults to `None`.
    """

    def __init__(self, reduce_to_device: Optional[str] = None,
                 accumulation_fn: Any = None):
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Expected `{name}` to be a positive integer. "
                         f"Received: {name}={value!r}.")
    return int(value)


def communication_timeout_s(timeout_s: Optional[float] = None) -> float:
    """The communication timeout in seconds: `timeout_s` when given (a
    strategy's `CommunicationOptions`), else `$KERAS_DISTRIBUTE_TIMEOUT`,
    else 60.

    Raises:
        ValueError: if `KERAS_DISTRIBUTE_TIMEOUT` is not a positive number.
    """
    if timeout_s is not None:
        return float(timeout_s)
    value = os.environ.get(TIMEOUT_VARIABLE)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"Expected {TIMEOUT_VARIABLE} to be a positive number of seconds. "
            f"Received: {TIMEOUT_VARIABLE}={value!r}. Unset it for the "
            f"default ({DEFAULT_TIMEOUT_S:.0f} s).")
    return seconds


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How the replicas of a strategy talk.

    Args:
        timeout_seconds: How long start-up (every worker joining) and each
            collective may take before every process fails with an error
            instead of hanging. Defaults to `None`: the job's default,
            `$KERAS_DISTRIBUTE_TIMEOUT` or else 60 s.
        implementation: A `kd.CommunicationImplementation` (or its name),
            kept for `tf.distribute` compatibility; the backend's engine
            picks the algorithm. Defaults to `"AUTO"`.
        compression: `"fp16"` or `"bf16"` to all-reduce the gradients in
            that 16-bit type (half the bytes on the wire; Horovod's
            `Compression.fp16`, DDP's `fp16_compress_hook`), or `None` (the
            default) for their own dtype. Honoured on torch (a DDP
            communication hook), TensorFlow (the optimizer's all-reduce)
            and JAX (Keras' training step differentiated per replica in a
            `shard_map`, its gradients summed in 16 bits; see
            docs/strategies.md for the models that keep XLA's own).

    Raises:
        ValueError: if `timeout_seconds` is not positive, `implementation`
            names no implementation or `compression` no compression.

    Example:

    >>> CommunicationOptions(timeout_seconds=30).timeout_seconds
    30
    >>> CommunicationOptions(compression="bfloat16").compression
    'bf16'
    """

    timeout_seconds: Optional[float] = None
    implementation: str = "AUTO"
    compression: Optional[str] = None

    def __post_init__(self) -> None:
        CommunicationImplementation.from_value(self.implementation)  # checks
        timeout = self.timeout_seconds
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(
                timeout, (int, float)) or timeout <= 0):
            raise ValueError(
                "Expected `timeout_seconds` to be a positive number of "
                f"seconds. Received: timeout_seconds={timeout!r}.")
        if self.compression is not None:
            name = self.compression.lower() if isinstance(
                self.compression, str) else None
            kept = next((k for k, names in _COMPRESSIONS.items()
                         if name in names), None)
            if kept is None:
                raise ValueError(
                    "Expected `compression` to be None, 'fp16' or 'bf16'. "
                    f"Received: compression={self.compression!r}.")
            object.__setattr__(self, "compression", kept)


def checked_communication_options(options: Any) -> CommunicationOptions:
    """`options` if it is a `kd.CommunicationOptions`, the defaults for
    `None`; raises `ValueError` for anything else."""
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise ValueError(
            "Expected `communication_options` to be a "
            "`kd.CommunicationOptions`. Received: "
            f"{type(options).__name__}.")
    return options
