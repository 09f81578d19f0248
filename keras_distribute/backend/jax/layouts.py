"""Layouts of a strategy's `keras.distribution`, with kd's own checks.

Keras lays variables out from a `LayoutMap` but lets mistakes pass silently
(a key that matches nothing replicates what was meant to be sharded). These
classes and checks make them errors, and lay out a short last batch
replicated so that it never fails to divide over the replicas.
"""

from typing import TYPE_CHECKING
from typing import Any
from typing import Dict
from typing import Optional

from keras.distribution import DataParallel
from keras.distribution import ModelParallel
from keras.distribution import TensorLayout

from keras_distribute.common.layouts import check_layout_fits

if TYPE_CHECKING:
    # To the type check, the `keras.distribution.Distribution` it is mixed
    # into (not a public name of Keras).
    _MixedIntoDistribution = Any
else:
    _MixedIntoDistribution = object


class StrategyLayouts(_MixedIntoDistribution):
    """What a strategy's `keras.distribution` adds to Keras' own.

    A batch that does not divide by the replica count (a short last batch)
    is laid out replicated: every device computes the whole short batch,
    which gives exactly the single-device result with no padding to mask.
    A `layout_map` entry whose rank differs from its variable's is an error.
    """

    _kd_strategy_distribution = True
    # A rule-based map (kd.layouts.fully_sharded), when the strategy has one.
    _kd_layout_map: Any = None
    # Several processes: whether the batch being laid out is given whole
    # (set by the engine for each batch it splits; None: decide by shape).
    batch_given_whole: Optional[bool]

    def _init_layout_cache(self, batch_shards: int):
        self._batch_shards = batch_shards
        self._data_layouts: Dict[Any, Any] = {}
        # Several processes: set by the engine for each batch it splits.
        self.batch_given_whole = None

    def get_data_layout(self, data_shape):
        rank = len(data_shape)
        if self.batch_given_whole is not None:
            divisible = rank > 0 and not self.batch_given_whole
        else:
            divisible = rank > 0 and data_shape[0] % self._batch_shards == 0
        key = (rank, divisible)
        if key not in self._data_layouts:
            axes = [None] * rank
            if divisible:
                axes[0] = self.batch_dim_name
            self._data_layouts[key] = TensorLayout(axes, self.device_mesh)
        return self._data_layouts[key]

    def get_variable_layout(self, variable):
        layout_map = self._kd_layout_map
        if (getattr(layout_map, "layout_for", None) is not None
                and getattr(variable, "_layout", None) is None):
            # A rule-based map (kd.layouts.fully_sharded) reads the shape.
            layout = layout_map.layout_for(variable.path, variable.shape)
            if layout is None:
                layout = TensorLayout([None] * len(variable.shape),
                                      self.device_mesh)
            check_layout_fits(layout, variable.path, variable.shape)
            return layout
        layout = super().get_variable_layout(variable)
        if layout is not None:
            check_layout_fits(layout, variable.path, variable.shape)
        return layout


class StrategyDataParallel(StrategyLayouts, DataParallel):
    def __init__(self, device_mesh):
        super().__init__(device_mesh=device_mesh)
        self._init_layout_cache(device_mesh.shape[0])


class StrategyModelParallel(StrategyLayouts, ModelParallel):
    def __init__(self, layout_map, batch_dim_name):
        super().__init__(layout_map=layout_map, batch_dim_name=batch_dim_name)
        self._kd_layout_map = layout_map
        axis = layout_map.device_mesh.axis_names.index(batch_dim_name)
        self._init_layout_cache(layout_map.device_mesh.shape[axis])


