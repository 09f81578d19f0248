"""Split one CPU into N devices, to develop distributed code on a laptop."""


def simulate_cpu_devices(num_devices: int) -> None:
    """Makes the active Keras backend see `num_devices` CPU devices.

    Call it at the start of the program, before the backend runs any
    operation: JAX gets `jax_num_cpu_devices`, TensorFlow splits the CPU into
    logical devices. A strategy created afterwards has `num_devices`
    replicas. Calling it again with the same count is harmless.

    Args:
        num_devices: How many CPU devices to simulate (>= 1).

    Raises:
        ValueError: if `num_devices` is not a positive int.
        RuntimeError: if the backend already initialised its devices with
            another count; the message says how to fix it.
        NotImplementedError: on a backend without simulated devices (torch
            runs one process per device instead: see `kd.launch`).

    Example:

    ```python
    import keras_distribute as kd
    kd.simulate_cpu_devices(4)
    kd.MirroredStrategy().num_replicas_in_sync   # 4
    ```
    """
    import keras

    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or (
        num_devices < 1
    ):
        raise ValueError(
            "Expected `num_devices` to be a positive int. Received: "
            f"num_devices={num_devices!r}."
        )
    backend = keras.backend.backend()
    if backend == "jax":
        _simulate_jax(num_devices)
    elif backend == "tensorflow":
        _simulate_tensorflow(num_devices)
    else:
        raise NotImplementedError(
            f"Simulated CPU devices are not available on the '{backend}' "
            "backend, which runs one process per device. Use the JAX or "
            "TensorFlow backend to simulate devices in one process."
        )


def _too_late(backend: str, have: int, want: int) -> RuntimeError:
    return RuntimeError(
        f"{backend} has already initialised {have} CPU device(s), so it "
        f"cannot be split into {want} any more. Received: "
        f"num_devices={want}. Call kd.simulate_cpu_devices({want}) at the "
        "very start of the program, before any tensor is created (in a "
        "notebook: restart the kernel and run it first)."
    )


def _simulate_jax(num_devices: int) -> None:
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", num_devices)
    except RuntimeError as error:
        have = jax.local_device_count("cpu")
        if have != num_devices:
            raise _too_late("JAX", have, num_devices) from error


def _simulate_tensorflow(num_devices: int) -> None:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_devices
        )
    except RuntimeError as error:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != num_devices:
            raise _too_late("TensorFlow", have, num_devices) from error
