"""The training step and metric reads of the torch engine.

`TrainSteps.train_step` is Keras' torch train step with the forward pass
going through the `DistributedDataParallel` the engine holds (a `DDP(model)`
that Keras' `fit` bypasses would sync nothing);
`TrainSteps.global_metric_states` gives metric variables their all-process
values while Keras reads them.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING
from typing import Any
from typing import Sequence

import torch

if TYPE_CHECKING:
    from keras import Model

    from keras_distribute.backend.torch.engine import TorchEngine


class TrainSteps:
    """The torch engine's train step and its metric reads: a component
    each engine owns (`engine.train_steps`), holding the step's own state
    (whether Keras is computing a train step's metrics)."""

    def __init__(self, engine: TorchEngine):
        self._engine = engine
        self._in_train_step = False

    def train_step(self, model: Model, data: Any) -> Any:
        """Keras' torch train step, forwarding through the held DDP."""
        import keras

        engine = self._engine
        tree = keras.tree
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        wrapper = engine.step_begins(model)  # counted; the held DDP
        if model._call_has_training_arg:
            y_pred = wrapper(x, training=True)
        else:
            y_pred = wrapper(x)
        model.zero_grad()
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred,
                                   sample_weight=sample_weight, training=True)
        local = next(i for i in tree.flatten(x) if i is not None).shape[0]
        model._loss_tracker.update_state(loss, sample_weight=local)
        if model.optimizer is not None:
            loss = model.optimizer.scale_loss(loss)
        if not engine.even_batches:
            # DDP averages over processes; weigh each by its share of the
            # global batch so that an uneven split gives the global mean.
            total = engine.all_reduce_sum(
                torch.tensor(float(local), device=engine.device))
            loss = loss * (engine.num_replicas * local / total)
        if model.trainable_weights:
            loss.backward()
            weights = model.trainable_weights[:]
            engine.sync_gradients(weights)
            with torch.no_grad():
                model.optimizer.apply([v.value.grad for v in weights], weights)
        else:
            warnings.warn("The model does not have any trainable weights.")
        self._in_train_step = True
        try:
            return model.compute_metrics(x, y, y_pred,
                                         sample_weight=sample_weight)
        finally:
            self._in_train_step = False

    @contextlib.contextmanager
    def global_metric_states(self, variables: Sequence[Any]):
        """Temporarily gives metric variables their all-process values.

        Variables aggregated by `"sum"` are summed over processes, `"mean"`
        averaged, `"only_first_replica"` taken from rank 0; one flat
        all-reduce serves them all. Local values are restored on exit, so
        accumulation goes on locally.
        """
        engine = self._engine
        variables = [v for v in variables
                     if getattr(v, "aggregation", "none") != "none"]
        if not variables or (
            self._in_train_step and not engine.sync_metrics_each_step
        ):
            yield
            return
        local = [v.value.detach().clone() for v in variables]
        flat = torch.cat([
            (t.double() if v.aggregation != "only_first_replica" or
             engine.input_pipeline_id == 0
             else torch.zeros_like(t, dtype=torch.float64)).reshape(-1)
            for v, t in zip(variables, local)]).to(engine.device)
        engine.all_reduce_sum(flat)
        offset = 0
        with torch.no_grad():
            for variable, value in zip(variables, local):
                part = flat[offset:offset + value.numel()].reshape(value.shape)
                offset += value.numel()
                if variable.aggregation == "mean":
                    part = part / engine.num_replicas
                variable.value.copy_(part.to(value.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for variable, value in zip(variables, local):
                    variable.value.copy_(value)

    @contextlib.contextmanager
    def restoring_metric_states(self, variables: Sequence[Any]):
        """Around assigning all-process metric values (a restore).

        Pending rank-0 broadcasts of new variables (compiled metrics) land
        first, not on the restored values; afterwards only replica 0 keeps the
        summed (`"sum"`) values and the others hold zero, so that reading them
        sums to the restored values again.
        """
        engine = self._engine
        engine.broadcast_new_variables()
        yield
        if engine.input_pipeline_id != 0:
            with torch.no_grad():
                for variable in variables:
                    if getattr(variable, "aggregation", None) == "sum":
                        variable.value.zero_()


def compiled_ddp_mode(engine, model: Model):
    """How dynamo compiles a `jit_compile=True` step that forwards through
    the held DDP on CPU processes (a context around a trainer call).

    Dynamo's default for a DDP module ("ddp_optimizer") splits the forward
    graph at DDP's bucket boundaries, so that each bucket's all-reduce
    overlaps the backward of the rest. On CPU processes (gloo) the
    all-reduce runs on the same cores as the backward, and the split
    costs more than it gains: on 2 processes `bench_fit_torch.py`'s
    compiled step took 8.62 ms split, 7.31 ms whole (docs/benchmarks.md).
    There the step compiles
    whole and DDP's reducer all-reduces after the backward
    ("no_optimization"). Left as it is on accelerators, where the overlap
    pays, when the user chose a mode (anything but the default `True`,
    `"ddp_optimizer"` included), and under compiled autograd (which
    "no_optimization" cannot run with).

    Args:
        engine: the torch engine whose DDP the step forwards through.
        model: the Keras model the call trains.

    Returns:
        A context manager: dynamo's setting for the call, restored on exit.

    Example:

    ```python
    with compiled_ddp_mode(engine, model):
        model.fit(x, y)  # a jit_compile=True step compiles whole on CPU
    ```
    """
    import torch._dynamo

    config = torch._dynamo.config
    if (engine.device.type != "cpu"
            or getattr(model, "jit_compile", False) is not True
            or config.optimize_ddp is not True  # the user chose a mode
            or getattr(config, "compiled_autograd", False)):
        return contextlib.nullcontext()
    # `False` is "no_optimization" (a bool on every torch kd supports).
    return config.patch(optimize_ddp=False)


def value_and_gradients(model: Model, compute_loss, x: Any) -> tuple:
    """`(loss, gradients, y_pred)` by `loss.backward()` on this replica."""
    model.zero_grad()
    y_pred = model(x, training=True)
    loss = compute_loss(y_pred, model.losses)
    loss.backward()
    grads = [v.value.grad for v in model.trainable_variables]
    return loss.detach(), grads, y_pred.detach() if hasattr(
        y_pred, "detach") else y_pred
