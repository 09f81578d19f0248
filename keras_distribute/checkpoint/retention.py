"""Which checkpoints a `CheckpointManager` keeps: its retention policies.

- `KeepLatest`: the newest `max_to_keep` (the rule of
  `tf.train.CheckpointManager`);
- `KeepBest`: the `max_to_keep` with the best value of a metric each save
  records in its metadata (orbax's `best_fn`; the rule of
  `keras.callbacks.ModelCheckpoint(save_best_only=True)` with more than
  one kept).

A policy only chooses; the manager deletes, and only what its owner wrote
(`storage.ownership`). Framework-free.
"""

import abc
import math
from typing import Any
from typing import List
from typing import Mapping
from typing import Optional
from typing import Sequence


class Retention(abc.ABC):
    """Chooses which of a manager's checkpoints stay.

    Args:
        max_to_keep: How many to keep; `None` keeps all.
    """

    def __init__(self, max_to_keep: Optional[int]):
        self.max_to_keep = max_to_keep

    @abc.abstractmethod
    def kept(self, checkpoints: Sequence[str],
             values: Mapping[str, float]) -> List[str]:
        """Of `checkpoints` (oldest first), those kept, oldest first.

        Args:
            checkpoints: The managed checkpoint paths, oldest first.
            values: Each one's metric value (`KeepBest`; unused otherwise).
        """

    def value_of(self, metadata: Optional[Mapping[str, Any]]
                 ) -> Optional[float]:
        """The value this policy ranks a save by (`None`: it ranks none).

        Raises:
            ValueError: `metadata` lacks what the policy needs.
        """
        return None

    def would_keep(self, value: Optional[float],
                   checkpoints: Sequence[str],
                   values: Mapping[str, float]) -> bool:
        """Whether a new save with `value` would be among those kept."""
        return True


class KeepLatest(Retention):
    """Keeps the newest `max_to_keep` checkpoints.

    Example:

    >>> KeepLatest(2).kept(["ckpt-1", "ckpt-2", "ckpt-3"], {})
    ['ckpt-2', 'ckpt-3']
    """

    def kept(self, checkpoints: Sequence[str],
             values: Mapping[str, float]) -> List[str]:
        if self.max_to_keep is None:
            return list(checkpoints)
        return list(checkpoints)[-self.max_to_keep:]


class KeepBest(Retention):
    """Keeps the `max_to_keep` checkpoints with the best `metric`.

    `metric` names an entry of each save's metadata. Lower is better with
    `mode="min"`, higher with `"max"`; a save whose value is NaN is never
    kept (one already there ranks last); of equal values the older
    checkpoint ranks first (a new save must be strictly better than the
    worst kept to be kept, as `ModelCheckpoint` requires).

    Args:
        max_to_keep: How many to keep; `None` keeps all.
        metric: The metadata entry ranked (e.g. `"val_loss"`).
        mode: `"min"` or `"max"`.

    Raises:
        ValueError: for an empty `metric` or another `mode`.

    Example:

    >>> policy = KeepBest(1, "val_loss", "min")
    >>> policy.kept(["ckpt-1", "ckpt-2"], {"ckpt-1": 0.3, "ckpt-2": 0.5})
    ['ckpt-1']
    """

    def __init__(self, max_to_keep: Optional[int], metric: str,
                 mode: str = "min"):
        super().__init__(max_to_keep)
        if not isinstance(metric, str) or not metric:
            raise ValueError(
                "The metric ranked must be a non-empty name of a metadata "
                f"entry (e.g. 'val_loss'). Received: {metric!r}.")
        if mode not in ("min", "max"):
            raise ValueError(
                "The mode must be 'min' (lower is better) or 'max'. "
                f"Received: {mode!r}.")
        self.metric = metric
        self.mode = mode

    def value_of(self, metadata: Optional[Mapping[str, Any]]) -> float:
        value = (metadata or {}).get(self.metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            try:  # a NumPy or framework scalar
                value = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ValueError(
                    f"The checkpoints are ranked by metadata[{self.metric!r}]"
                    ", a number, so each save needs one. Received: "
                    f"metadata={dict(metadata or {})!r}. Pass metadata="
                    f"{{{self.metric!r}: <value>}} to save().") from None
        return float(value)

    def _sort_key(self, value: float) -> tuple:
        if math.isnan(value):
            return (1, 0.0)
        return (0, value if self.mode == "min" else -value)

    def ranked(self, checkpoints: Sequence[str],
               values: Mapping[str, float]) -> List[str]:
        """`checkpoints`, best first (of equal values, the older first)."""
        return sorted(checkpoints, key=lambda path: self._sort_key(
            values[path]))

    def kept(self, checkpoints: Sequence[str],
             values: Mapping[str, float]) -> List[str]:
        if self.max_to_keep is None:
            return list(checkpoints)
        best = set(self.ranked(checkpoints, values)[:self.max_to_keep])
        return [path for path in checkpoints if path in best]

    def would_keep(self, value: Optional[float],
                   checkpoints: Sequence[str],
                   values: Mapping[str, float]) -> bool:
        if value is None or math.isnan(value):
            return False
        if self.max_to_keep is None or len(checkpoints) < self.max_to_keep:
            return True
        worst = self.ranked(checkpoints, values)[self.max_to_keep - 1]
        return self._sort_key(value) < self._sort_key(values[worst])

