"""The torch engine's `run` and cross-replica operations: one replica per
process, `torch.distributed` collectives over the replicas' group.

`run` calls the function in this process's replica context and then
combines the "sum" / "mean" variables it changed (metric states, moving
statistics) over the processes; `reduce`, `gather`, `all_reduce_sum` and
`all_gather` are the collectives `strategy.reduce` / `gather` and the
replica context's use. `ProcessCollectives` is a base of `TorchEngine`
(`engine.py`), which supplies the attributes it declares.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import cast

import keras
import numpy as np
import torch
import torch.distributed as dist

from keras_distribute.backend.torch import peers as torch_peers
from keras_distribute.backend.torch.variables import whole_value
from keras_distribute.common.reduce_op import ReduceOp
from keras_distribute.common.values import PerReplica

if TYPE_CHECKING:
    from keras_distribute.backend.torch.engine import TorchEngine


class ProcessCollectives:
    """The `run` and collectives of `TorchEngine` (see the module
    docstring); `self` is always a `TorchEngine`."""

    in_group: bool
    num_replicas: int
    world_size: int
    device: Any
    replica_group: Any
    local_replica_ids: tuple
    _aggregated: List[Any]
    broadcast_new_variables: Callable[[], None]

    # ------------------------------------------------------------------ run
    def run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        if not self.in_group:
            return self._run(strategy, fn, args, kwargs)
        torch_peers.advance()
        with torch_peers.naming_a_lost_peer():
            self.broadcast_new_variables()
            return self._run(strategy, fn, args, kwargs)

    def _run(self, strategy, fn: Callable, args: tuple, kwargs: dict) -> Any:
        local = lambda v: v.values[0] if isinstance(v, PerReplica) else v  # noqa: E731
        call_args = keras.tree.map_structure(local, args)
        call_kwargs = keras.tree.map_structure(local, kwargs)
        aggregated = (self._agreed(self._live_aggregated())
                      if self.in_group and self.num_replicas > 1 else [])
        before = [v.value.detach().clone() for v in aggregated]
        from keras_distribute.backend.torch import user_steps

        with strategy.enter_replica(self.local_replica_ids[0],
                                    _TorchCollectives(self)), (
                user_steps.in_run(cast("TorchEngine", self))):
            result = fn(*call_args, **call_kwargs)
        if aggregated:
            self._combine_aggregated(aggregated, before)
        return keras.tree.map_structure(
            lambda out: out if out is None else PerReplica([out]), result)

    def _live_aggregated(self) -> list:
        """The "sum" / "mean" variables still alive, in creation order (the
        same on every process: they were made by the same program)."""
        alive = [(ref, ref()) for ref in self._aggregated]
        self._aggregated = [ref for ref, v in alive if v is not None]
        return [v for _, v in alive if v is not None and v._value is not None]

    @torch_peers.collective
    def _agreed(self, variables: list, group: Any = "replicas") -> list:
        """The `variables` that every process holds, in one order everywhere
        (a collective).

        Processes may hold different ones: a metric made by chief-only work
        (a callback, a save), or freed by the garbage collector at another
        time. Combining lists of different lengths aborted gloo ("Received
        data size doesn't match"). A variable is known by its path and shape
        (and which of that name it is); one small all-reduce finds the lists
        equal, else the processes exchange them and keep the common ones.
        `group`: the replicas' group (combining), or `None` for every
        process (broadcasting from process 0).
        """
        group = self.replica_group if group == "replicas" else group
        keys = _variable_keys(variables)
        digest = int.from_bytes(hashlib.blake2b(
            repr(keys).encode(), digest_size=7).digest(), "little")
        probe = torch.tensor([digest, -digest], dtype=torch.int64)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=group)
        if int(probe[0]) == digest == -int(probe[1]):
            return variables
        every: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, keys, group=group)
        common = set(every[0]).intersection(*every[1:])
        return [v for key, v in sorted(zip(keys, variables),
                                       key=lambda pair: pair[0])
                if key in common]

    def _combine_aggregated(self, variables: list, before: list) -> None:
        """As tf.distribute's sync-on-read variables read after `run`: a
        "sum" variable (a metric's total and count) holds every process's
        updates, a "mean" one their average — the same on every process.
        One flat all-reduce of the changes (sum) and values (mean)."""
        with torch.no_grad():
            flat = torch.cat([
                (v.value - old if v.aggregation == "sum" else v.value)
                .double().reshape(-1).to(self.device)
                for v, old in zip(variables, before)])
            self.all_reduce_sum(flat)
            offset = 0
            for variable, old in zip(variables, before):
                part = flat[offset:offset + old.numel()].reshape(old.shape)
                offset += old.numel()
                new = (old.double() + part if variable.aggregation == "sum"
                       else part / self.world_size)
                variable.value.copy_(new.to(old.dtype))

    # -------------------------------------------------- cross-replica ops
    def reduce(self, op: ReduceOp, values: Sequence[Any],
               axis: Optional[int]) -> Any:
        (value,) = values  # this process's one replica
        tensor = to_tensor(value).to(self.device)
        if axis is None:
            total = self.all_reduce_sum(tensor.clone())
            return total / self.num_replicas if op is ReduceOp.MEAN else total
        _check_axis(axis, tensor.dim())
        total = self.all_reduce_sum(tensor.sum(dim=axis))
        if op is ReduceOp.SUM:
            return total
        count = torch.tensor(float(tensor.shape[axis]), device=self.device)
        return total / self.all_reduce_sum(count)

    def gather(self, values: Sequence[Any], axis: int) -> Any:
        tensor = to_tensor(values[0]).to(self.device)
        if tensor.dim() == 0:
            raise ValueError(
                "`gather` needs per-replica values of rank >= 1 to "
                "concatenate. Received scalars. Use `reduce` for scalars, or "
                "give each replica's value a leading dimension.")
        _check_axis(axis, tensor.dim())
        return self.all_gather(tensor, axis)

    @torch_peers.collective
    def all_reduce_sum(self, tensor):
        """Sums `tensor` over the replicas, in place."""
        if self.in_group and self.num_replicas > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM,
                            group=self.replica_group)
        return tensor

    @torch_peers.collective
    def all_gather(self, tensor, axis: int):
        """Concatenates `tensor` of every replica along `axis` (sizes may
        differ), in replica order."""
        if not self.in_group or self.num_replicas == 1:
            return tensor
        group, count = self.replica_group, self.num_replicas
        axis = axis % tensor.dim()
        size = torch.tensor([tensor.shape[axis]], device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(count)]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        pad = ([0, 0] * (tensor.dim() - axis - 1)
               + [0, longest - tensor.shape[axis]])
        padded = torch.nn.functional.pad(tensor, pad)
        parts = [torch.empty_like(padded) for _ in range(count)]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([p.narrow(axis, 0, int(s.item()))
                          for p, s in zip(parts, sizes)], dim=axis)


def _variable_keys(variables: list) -> list:
    """`(path, shape, n)` of each variable: n counts earlier variables of the
    same path and shape (keys that name the same variable in every process
    of one program)."""
    seen: dict = {}
    keys = []
    for variable in variables:
        name = (str(getattr(variable, "path", variable.name)),
                tuple(variable.shape))
        seen[name] = seen.get(name, -1) + 1
        keys.append(name + (seen[name],))
    return keys


def _check_axis(axis: int, rank: int) -> None:
    if not -rank <= axis < rank:
        raise ValueError(
            f"`axis`={axis} is out of range for per-replica values of "
            f"rank {rank}. Use an axis in [{-rank}, {rank}).")


def to_tensor(value: Any) -> Any:
    """A torch tensor of `value`; a sharded one whole (a collective)."""
    if isinstance(value, keras.Variable):
        value = value.value
    if isinstance(value, torch.Tensor):
        return whole_value(value)
    if hasattr(value, "numpy") and not isinstance(value, np.generic):
        value = value.numpy()
    value = np.asarray(value)
    if not value.flags.writeable:  # e.g. tf.data's arrays: torch would warn
        value = value.copy()
    return torch.as_tensor(value)


class _TorchCollectives:
    """Collectives of one process-replica: `torch.distributed` all-reduce."""

    def __init__(self, engine: ProcessCollectives):
        self._engine = engine

    def all_reduce(self, op: ReduceOp, value: Any) -> Any:
        from keras_distribute.backend.torch import user_steps

        def reduce(leaf):
            tensor = to_tensor(leaf).to(self._engine.device).clone()
            if not torch.is_floating_point(tensor) and op is ReduceOp.MEAN:
                tensor = tensor.float()
            total = self._engine.all_reduce_sum(tensor)
            # Global now: an optimizer given it applies it as it is.
            return user_steps.mark_reduced(
                total / self._engine.num_replicas if op is ReduceOp.MEAN
                else total)

        return keras.tree.map_structure(reduce, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        return keras.tree.map_structure(
            lambda leaf: self._engine.all_gather(
                to_tensor(leaf).to(self._engine.device), axis), value)
