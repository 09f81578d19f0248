"""tf.distribute's names for how replicas exchange values, accepted so that
porting is an import change.

Each backend's engine chooses the all-reduce itself (XLA on JAX, NCCL or
gloo through `torch.distributed`, tf.distribute's own choice on
TensorFlow), so these objects select nothing: they are accepted where
tf.distribute accepts them (`MirroredStrategy(cross_device_ops=...)`,
`CommunicationOptions(implementation=...)`) and kept for inspection.
"""

import enum
from typing import Any, Optional


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
    return value
