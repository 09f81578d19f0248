"""The strategies: tf.distribute's programming model.

- `strategy`: `Strategy`, the base (`scope`, `run`, `reduce`, datasets).
- `extended`: `StrategyExtended` (`strategy.extended`).
- `mirrored`: `MirroredStrategy`, `OneDeviceStrategy`.
- `multi_worker`: `MultiWorkerMirroredStrategy`.
- `tpu`: `TPUStrategy`, `DeviceAssignment`.
- `default`: the default strategy outside any scope.

May import: every package but `callbacks` and `launch`.
"""
