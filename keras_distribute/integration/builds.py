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
from typing import Iterator

from keras_distribute.integration import registry

_NAME_SCOPE_STACK = "name_scope_stack"  # keras.src.backend.common.name_scope


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
