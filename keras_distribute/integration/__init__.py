"""The Keras integration layer: every touch of a Keras-private name.

It sits above the neutral layer, the backends and the checkpoint (none of
them imports it): the strategies install it (`install()`) and hand the
engine they make what the lower layers need from it, as one typed
`KerasServices` (`services()`; `keras_distribute.common.keras_services`).
`registry` lists every private name with why it is used and on which Keras
versions; `hooks` patches Keras only after `registry.check()`
verified them. This module imports Keras only when something is installed.
"""

from keras_distribute.common import keras_services
from keras_distribute.integration.registry import SUPPORTED_KERAS
from keras_distribute.integration.registry import KerasVersionError


def install() -> None:
    """Installs the Keras hooks a strategy needs (once)."""
    from keras_distribute.integration import hooks

    hooks.install()


def uninstall() -> None:
    """Removes every hook, restoring Keras exactly as it was."""
    from keras_distribute.integration import hooks

    hooks.uninstall()


def _deferred_restores() -> None:
    from keras_distribute.integration import hooks

    hooks.install_checkpoint_hooks()


def _torch_sharding() -> None:
    from keras_distribute.integration import hooks

    hooks.install_torch_sharding_hooks()


def _seed_every_process() -> None:
    # One global seed in every JAX process once jax.distributed started, as
    # keras.distribution.initialize does (variables start identical).
    from keras_distribute.integration import registry

    registry.check("jax", ["jax_distribution_lib"])
    registry.resolve("jax_distribution_lib").initialize_rng()


def _chief_values() -> None:
    # A variable made while the processes' random states differ takes
    # process 0's value (integration/jax_processes.py).
    from keras_distribute.integration import hooks

    hooks.install_jax_process_hooks()


def _chief_only_writes(*args, **kwargs):
    from keras_distribute.integration import worker_callbacks

    return worker_callbacks.chief_only_writes(*args, **kwargs)


def _configs_read_without_tensorflow():
    from keras_distribute.integration import configs

    return configs.configs_read_without_tensorflow()


def _keras_distributes_torch() -> bool:
    # Keras 3.16's torch Trainer makes its own DDP (`_initialize_ddp`); its
    # torch backend then has a `distribution_lib`. Absent on 3.15.
    from keras_distribute.integration import registry

    registry.check("torch", ["TorchTrainer._initialize_ddp"])
    return registry.resolve("TorchTrainer._initialize_ddp") is not None


def _keras_torch_data_parallel(world_size):
    # Keras 3.16 distributes torch itself (its torch `distribution_lib`: DDP
    # on the mesh's process group, metrics reduced over it): a data-parallel
    # torch engine drives a `keras.distribution.DataParallel` over Keras'
    # own device list there, and none before (3.15's torch backend ignores
    # distributions).
    if not _keras_distributes_torch():
        return None
    import keras

    mesh = keras.distribution.DeviceMesh(
        shape=(world_size,), axis_names=["batch"],
        devices=keras.distribution.list_devices())
    # kd hands each process its slice of every batch: Keras' own sharding
    # of the input would split it a second time.
    return keras.distribution.DataParallel(device_mesh=mesh,
                                           auto_shard_dataset=False)


def _keras_torch_mesh(device_mesh):
    # Keras 3.16's torch `distribution_lib` turns a `keras.distribution`
    # mesh into a `torch.distributed.DeviceMesh` (its devices' indices are
    # the ranks) and a `TensorLayout` into DTensor placements on it: a
    # sharded torch engine takes both from Keras there (public
    # `DeviceMesh.backend_mesh`, `TensorLayout.backend_layout`), so a layout
    # map means on kd what it means to Keras' own `ModelParallel`. None on
    # Keras versions whose torch backend has no distribution.
    return device_mesh.backend_mesh if _keras_distributes_torch() else None


_SERVICES = keras_services.KerasServices(
    chief_only_writes=_chief_only_writes,
    keras_torch_data_parallel=_keras_torch_data_parallel,
    keras_torch_mesh=_keras_torch_mesh,
    install_deferred_restores=_deferred_restores,
    install_torch_sharding=_torch_sharding,
    seed_every_process=_seed_every_process,
    install_chief_values=_chief_values,
    configs_read_without_tensorflow=_configs_read_without_tensorflow,
)


def services() -> keras_services.KerasServices:
    """What the layers below need from the Keras integration, typed.

    A strategy hands it to the engine it makes (`make_engine(...,
    services=integration.services())`); the engine, the input pipeline and
    the checkpoint call its fields through `engine.keras_services`.

    Returns:
        The integration layer's `KerasServices` (one object, immutable).

    Example:

    >>> from keras_distribute import integration
    >>> engine = backend.make_engine(devices,
    ...                              services=integration.services())
    """
    return _SERVICES


__all__ = ("KerasVersionError", "SUPPORTED_KERAS", "install", "services",
           "uninstall")
