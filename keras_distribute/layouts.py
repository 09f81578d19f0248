"""`kd.layouts`: layout maps kd writes for you.

`fully_sharded(mesh_or_layout_map, min_size=...)`: FSDP / ZeRO-3 in one
line, every large variable sharded over the batch axis (see
`keras_distribute.common.fully_sharded`).
"""

from keras_distribute.common.fully_sharded import DEFAULT_MIN_SIZE  # noqa: F401
from keras_distribute.common.fully_sharded import FullyShardedLayoutMap  # noqa: F401
from keras_distribute.common.fully_sharded import fully_sharded  # noqa: F401
