"""`kd.layouts`: layout maps kd writes for you.

`fully_sharded(mesh_or_layout_map, min_size=...)`: FSDP / ZeRO-3 in one
line, every large variable sharded over the batch axis (see
`keras_distribute.common.fully_sharded`). `plan_layout(model, mesh)`: a map
planned from the model's variable shapes (tensor parallel on the model
axis, FSDP on the batch axis), with a report (see
`keras_distribute.planning.layout_planner`). `check_layout(layout_map,
model)`: a map checked against a model before the launch, each finding
with its fix. `estimate_memory(model, layout_map, batch_size=...)`: the
bytes a device holds at the peak of a train step (see
`keras_distribute.planning.memory_estimate`). `dry_run(model, layout_map,
hosts=..., ...)`: the whole job checked before the launch, one verdict
table (`python -m keras_distribute.planning` on the command line).

Its names are loaded on first use: the layout maps subclass Keras'
`LayoutMap`, and `import keras_distribute` imports no Keras (the script
launcher, `python -m keras_distribute.launch`, never needs it).
"""

from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    from keras_distribute.common.fully_sharded import DEFAULT_MIN_SIZE
    from keras_distribute.common.fully_sharded import FullyShardedLayoutMap
    from keras_distribute.common.fully_sharded import fully_sharded
    from keras_distribute.planning.dry_run import DryRun
    from keras_distribute.planning.dry_run import dry_run
    from keras_distribute.planning.layout_check import Finding
    from keras_distribute.planning.layout_check import LayoutCheck
    from keras_distribute.planning.layout_check import check_layout
    from keras_distribute.planning.layout_planner import LayoutPlan
    from keras_distribute.planning.layout_planner import PlannedVariable
    from keras_distribute.planning.layout_planner import plan_layout
    from keras_distribute.planning.memory_estimate import MemoryEstimate
    from keras_distribute.planning.memory_estimate import estimate_memory

__all__ = ("DEFAULT_MIN_SIZE", "DryRun", "Finding", "FullyShardedLayoutMap",
           "LayoutCheck", "LayoutPlan", "MemoryEstimate", "PlannedVariable",
           "check_layout", "dry_run", "estimate_memory", "fully_sharded",
           "plan_layout")


def __getattr__(name: str) -> Any:
    if name in __all__:
        from keras_distribute.common.fully_sharded import DEFAULT_MIN_SIZE
        from keras_distribute.common.fully_sharded import FullyShardedLayoutMap
        from keras_distribute.common.fully_sharded import fully_sharded
        from keras_distribute.planning.dry_run import DryRun
        from keras_distribute.planning.dry_run import dry_run
        from keras_distribute.planning.layout_check import Finding
        from keras_distribute.planning.layout_check import LayoutCheck
        from keras_distribute.planning.layout_check import check_layout
        from keras_distribute.planning.layout_planner import LayoutPlan
        from keras_distribute.planning.layout_planner import PlannedVariable
        from keras_distribute.planning.layout_planner import plan_layout
        from keras_distribute.planning.memory_estimate import MemoryEstimate
        from keras_distribute.planning.memory_estimate import estimate_memory

        loaded = {"DEFAULT_MIN_SIZE": DEFAULT_MIN_SIZE,
                  "Finding": Finding,
                  "FullyShardedLayoutMap": FullyShardedLayoutMap,
                  "LayoutCheck": LayoutCheck,
                  "check_layout": check_layout,
                  "LayoutPlan": LayoutPlan,
                  "PlannedVariable": PlannedVariable,
                  "fully_sharded": fully_sharded,
                  "plan_layout": plan_layout,
                  "MemoryEstimate": MemoryEstimate,
                  "estimate_memory": estimate_memory,
                  "DryRun": DryRun,
                  "dry_run": dry_run}
        globals().update(loaded)  # later reads find them without this
        return loaded[name]
    raise AttributeError(
        f"module 'keras_distribute.layouts' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))
