"""`InputContext`: which input pipeline a `dataset_fn` builds.

A value type the strategies hand to `dataset_fn` and the TensorFlow engine
makes from tf.distribute's own context; `kd.InputContext`.
"""


class InputContext:
    """Tells a `dataset_fn` which input pipeline it builds.

    Passed to the `dataset_fn` of `strategy.distribute_datasets_from_function`.

    Args:
        num_input_pipelines: Number of input pipelines (one per worker).
            Defaults to `1`.
        input_pipeline_id: This pipeline's id. Defaults to `0`.
        num_replicas_in_sync: Number of replicas in sync. Defaults to `1`.

    Example:

    >>> ctx = InputContext(num_input_pipelines=1, input_pipeline_id=0,
    ...                    num_replicas_in_sync=4)
    >>> ctx.get_per_replica_batch_size(64)
    16
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        self._num_input_pipelines = num_input_pipelines
        self._input_pipeline_id = input_pipeline_id
        self._num_replicas_in_sync = num_replicas_in_sync

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's id, in `[0, num_input_pipelines)`."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Returns `global_batch_size // num_replicas_in_sync`.

        Args:
            global_batch_size: The global batch size.

        Returns:
            The per-replica batch size.

        Raises:
            ValueError: if the global batch does not divide evenly.
        """
        if global_batch_size % self._num_replicas_in_sync:
            raise ValueError(
                "The global batch size must be divisible by the number of "
                f"replicas in sync ({self._num_replicas_in_sync}). Received: "
                f"global_batch_size={global_batch_size}. Use a multiple of "
                f"{self._num_replicas_in_sync}."
            )
        return global_batch_size // self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"<InputContext num_input_pipelines={self.num_input_pipelines}, "
            f"input_pipeline_id={self.input_pipeline_id}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync}>"
        )
