"""The torch engine's training through `DistributedDataParallel`: the DDP
it holds per model (Keras 3.16's own, or one it makes), gradients
all-reduced in a compressed dtype with the bytes counted, the step
bookkeeping a watchdog reads, gradient sums and logs averaged over the
processes for a user's step, and Keras' train step through the held DDP
(`training.TrainSteps`).

`DdpTraining` is a base of `TorchEngine` (`engine.py`), which supplies the
attributes it declares.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING
from typing import Any
from typing import Callable
from typing import Sequence
from typing import cast

import torch

from keras_distribute.backend.torch import peers as torch_peers

if TYPE_CHECKING:
    from keras import Model

    from keras_distribute.backend.torch.engine import TorchEngine
    from keras_distribute.backend.torch.training import TrainSteps


class DdpTraining:
    """The DDP half of `TorchEngine` (see the module docstring); `self` is
    always a `TorchEngine`."""

    in_group: bool
    num_replicas: int
    device: Any
    gradient_compression: Any
    gradient_bytes_reduced: int
    _ddp: weakref.WeakKeyDictionary
    train_steps: TrainSteps
    broadcast_new_variables: Callable[[], None]
    all_reduce_sum: Callable[[Any], Any]

    def sync_gradients(self, variables: Sequence[Any]) -> None:
        """Nothing to do: the held DDP all-reduced the gradients."""

    # Keras 3.16 wraps a model in its own DistributedDataParallel; the
    # integration layer hands that one over (`hold_ddp`) instead of a second.
    uses_keras_ddp = True

    def set_gradient_compression(self, name: str) -> None:
        """All-reduces gradients in `name`'s dtype ("fp16" or "bf16")."""
        self.gradient_compression = {"fp16": torch.float16,
                                     "bf16": torch.bfloat16}[name]

    def compress_gradients(self, flat: Any) -> Any:
        """`flat` in the compression dtype (itself when there is none),
        counted as all-reduced bytes."""
        if self.gradient_compression is not None:
            flat = flat.to(self.gradient_compression)
        self.gradient_bytes_reduced += flat.numel() * flat.element_size()
        return flat

    def _register_compression(self, wrapper: Any) -> None:
        # torch's own DDP hooks (cast, divide, all-reduce, cast back), with
        # the bytes counted.
        if self.gradient_compression is None or getattr(
                wrapper, "_kd_compression", False):
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        torch_hook = (default_hooks.fp16_compress_hook
                      if self.gradient_compression == torch.float16
                      else default_hooks.bf16_compress_hook)
        itemsize = torch.empty((), dtype=self.gradient_compression
                               ).element_size()

        def counting_hook(state, bucket):
            self.gradient_bytes_reduced += bucket.buffer().numel() * itemsize
            return torch_hook(state, bucket)

        wrapper.register_comm_hook(None, counting_hook)
        wrapper._kd_compression = True

    def hold_ddp(self, model: Model, wrapper: Any) -> None:
        """Holds `wrapper` (a DDP of `model` made elsewhere) as its DDP."""
        if wrapper is not None:
            self._register_compression(wrapper)
            params = tuple(p for p in model.parameters() if p.requires_grad)
            self._ddp[model] = (wrapper, tuple(map(id, params)))

    def ddp(self, model: Model) -> Any:
        """The DistributedDataParallel that wraps `model`, made once."""
        params = tuple(p for p in model.parameters() if p.requires_grad)
        held = self._ddp.get(model)
        if held is None or held[1] != tuple(map(id, params)):
            self.broadcast_new_variables()
            wrapper = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=None if self.device.type == "cpu" else [
                    self.device.index])
            self._register_compression(wrapper)
            held = (wrapper, tuple(map(id, params)))
            self._ddp[model] = held
        return held[0]

    # ------------------------------------------------------------ training
    @torch.compiler.disable
    def step_begins(self, model: Model) -> Any:
        """Counts a training step (the watchdog reads the count) and returns
        the DDP that wraps `model` (made at its first step).

        Python state, kept out of a step `torch.compile` traces
        (`jit_compile=True`): one graph break where the step begins, where
        a traced counter or DDP lookup would be a guard failing at every
        step (a recompile per step, then eager).
        """
        torch_peers.advance()
        return self.ddp(model)

    @torch.compiler.disable
    def user_step_begins(self) -> None:
        """Counts a step of a user's `train_step`/`test_step` (the watchdog
        reads the count)."""
        torch_peers.advance()

    def wrap_step_function(self, model: Model, function: Callable,
                           is_train: bool) -> Callable:
        """Keras' `train_function`/`test_function` of a model whose step is
        the user's, made global (`user_steps`)."""
        from keras_distribute.backend.torch import user_steps

        return user_steps.wrap_step_function(cast("TorchEngine", self), model,
                                             function, is_train)

    @torch_peers.collective
    def sum_gradients(self, grads: Sequence[Any], scale: float) -> list:
        """This process's `grads` times `scale`, summed over the replicas
        (in place, as DDP leaves them): one flat all-reduce per dtype; a
        sharded gradient contributes its local part."""
        grads = list(grads)
        if not self.in_group or self.num_replicas == 1:
            return grads
        from torch.distributed.tensor import DTensor

        parts = [g.to_local() if isinstance(g, DTensor) else g
                 for g in grads if g is not None]
        with torch.no_grad():
            for dtype in dict.fromkeys(p.dtype for p in parts):
                group = [p for p in parts if p.dtype == dtype]
                flat = torch.cat([p.reshape(-1) for p in group]) * scale
                dtype_sent = flat.dtype
                flat = self.all_reduce_sum(self.compress_gradients(flat))
                flat = flat.to(dtype_sent)
                offset = 0
                for part in group:
                    part.copy_(flat[offset:offset + part.numel()].view_as(
                        part))
                    offset += part.numel()
        return grads

    def average_gradients(self, grads: Sequence[Any]) -> list:
        """This process's `grads` averaged over the replicas (in place, as
        DDP leaves them): an optimizer called in a loop of the user's own,
        each process's loss the mean over its own batch
        (`user_steps.apply_with_global_gradients`)."""
        return self.sum_gradients(grads, 1.0 / self.num_replicas)

    @torch_peers.collective
    def weighted_mean_logs(self, logs: dict, share: float) -> dict:
        """`logs` with each scalar value replaced by its mean over the
        processes, each weighted by `share` (its share of the batch)."""
        scalars = [key for key, value in logs.items()
                   if _is_scalar_log(value)]
        if not scalars or not self.in_group or self.num_replicas == 1:
            return logs
        flat = torch.tensor([float(_detached(logs[key])) * share
                             for key in scalars],
                            dtype=torch.float64, device=self.device)
        self.all_reduce_sum(flat)
        return {**logs, **{key: float(value)
                           for key, value in zip(scalars, flat.tolist())}}

    def train_step(self, model: Model, data: Any) -> Any:
        """Keras' torch train step, forwarding through the held DDP."""
        return self.train_steps.train_step(model, data)

    def global_metric_states(self, variables: Sequence[Any]):
        """Metric variables with their all-process values, for a read."""
        return self.train_steps.global_metric_states(variables)

    def restoring_metric_states(self, variables: Sequence[Any]):
        """Around a restore of all-process metric values (a context)."""
        return self.train_steps.restoring_metric_states(variables)


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _is_scalar_log(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, torch.Tensor) and value.numel() == 1 and (
        not value.dtype.is_complex)


def raised_in_ddp(error: BaseException) -> bool:
    """Whether `error` was raised inside torch's DistributedDataParallel."""
    ddp_file = os.path.join("torch", "nn", "parallel", "distributed.py")
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename.endswith(ddp_file):
            return True
        traceback = traceback.tb_next
    return False
