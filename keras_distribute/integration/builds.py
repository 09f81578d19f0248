"""Keras' global state around a model built without values (`kd.layouts`).

A backend builds a model without values by running its build where tensors
hold no memory (`jax.eval_shape`, torch's fake tensors, a TensorFlow graph:
`BackendModule.build_without_values`). Two pieces of Keras' global state
must come out of such a build as they went in:

- the global seed generator: an unseeded `keras.random` draw in the build
  would make it there, its state a value-less tensor that every later
  unseeded draw of the process would read;
- the name scope stack: Keras' TensorFlow name scope joins the stack before
  TensorFlow checks the name, so a name a graph refuses leaves it on the
  stack, and every variable made after would carry it in its path.
"""

import contextlib
from typing import Any
from typing import Dict
from typing import Iterator

from keras_distribute.integration import registry

_NAME_SCOPE_STACK = "name_scope_stack"  # keras.src.backend.common.name_scope
# The learning rate a config read without values gives (`optimizer_config`).
_PLACEHOLDER_LEARNING_RATE = 0.001


@contextlib.contextmanager
def keras_global_state_kept() -> Iterator[None]:
    """While entered, Keras has no global seed generator (an unseeded draw
    makes one); on exit the process's own, or none, is put back, and so is
    the name scope stack, as it was.

    Raises:
        KerasVersionError: if the running Keras keeps this state elsewhere.

    Example:

    ```python
    with keras_global_state_kept():
        model = backend.build_without_values(build)
    ```
    """
    global_state = registry.resolve("global_state")
    key = registry.resolve("seed_generator.GLOBAL_SEED_GENERATOR")
    own = global_state.get_global_attribute(key)
    stack = global_state.get_global_attribute(_NAME_SCOPE_STACK)
    scopes = list(stack) if isinstance(stack, list) else None
    global_state.set_global_attribute(key, None)
    try:
        yield
    finally:
        global_state.set_global_attribute(key, own)
        now = global_state.get_global_attribute(_NAME_SCOPE_STACK)
        if scopes is not None and now is stack:
            stack[:] = scopes
        elif scopes is None and isinstance(now, list):
            now.clear()


def optimizer_config(optimizer: Any) -> Dict[str, Any]:
    """`optimizer.get_config()`, also for an optimizer made without values.

    An optimizer compiled in a model built without values (a `make_model`
    that compiles, given to the planner) holds its learning rate in a
    variable that has no value, and Keras' `get_config` reads it. While it
    runs, a placeholder rate stands in for such a variable (of the
    optimizer and of a `LossScaleOptimizer`'s inner one); the variable is
    put back after. The config makes an optimizer of the same kind and
    slots, which is all the planner needs: the learning rate changes no
    shape and no byte of a step.

    Args:
        optimizer: A `keras.optimizers.Optimizer`.

    Returns:
        Its config, with the learning rate a placeholder where it was a
        variable.

    Raises:
        KerasVersionError: if the running Keras keeps the learning rate
            elsewhere.

    Example:

    ```python
    fresh = type(optimizer).from_config(optimizer_config(optimizer))
    ```
    """
    import keras

    attribute = registry.resolve("Optimizer._learning_rate")
    swapped = []
    for owner in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        rate = getattr(owner, attribute, None)
        if isinstance(rate, keras.Variable):
            swapped.append((owner, rate))
            # (object's own setattr: Keras' would track the float)
            object.__setattr__(owner, attribute, _PLACEHOLDER_LEARNING_RATE)
    try:
        return dict(optimizer.get_config())
    finally:
        for owner, rate in swapped:
            object.__setattr__(owner, attribute, rate)
