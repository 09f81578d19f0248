"""The specs of a training step's batch for `kd.layouts.estimate_memory`:
the inputs and targets as `keras.KerasTensor`s of the global batch, from
the model's `keras.Input`s or the `input_shape=` a user gives, checked
(a bad `input_shape` names what was expected). Imports no framework; Keras'
public API comes in as an argument.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    from keras import Layer


def input_specs(model: Layer, input_shape: Any, dtype: str,
                 batch_size: int, keras: Any) -> Any:
    """The global batch's inputs as `keras.KerasTensor`s: the model's
    `keras.Input`s (their dtypes; `input_shape` fills their unknown
    dimensions), else `input_shape` in `dtype`.

    Raises:
        ValueError: the model has no `keras.Input` (or one with unknown
            dimensions) and no `input_shape` was given, or `input_shape`
            is not one example's shape (positive ints; a list or dict of
            them)."""
    symbolic = symbolic_tensors(model, "input")
    if input_shape is None:
        if symbolic is None:
            raise ValueError(
                "The model's inputs are unknown (it has no keras.Input: a "
                "subclassed model). Pass input_shape=, one example's shape "
                "without the batch dimension, e.g. input_shape=(28, 28, 1).")
        for tensor in keras.tree.flatten(symbolic):
            if any(d is None for d in tensor.shape[1:]):
                raise ValueError(
                    f"The model's input {tensor.name!r} has unknown "
                    f"dimensions {tuple(tensor.shape)}: pass input_shape= "
                    "with one example's shape (e.g. a sequence length), as "
                    "the inputs are structured, e.g. input_shape={'token_ids':"
                    " (512,), 'padding_mask': (512,)}.")
        return keras.tree.map_structure(
            lambda t: keras.KerasTensor((batch_size,) + tuple(t.shape[1:]),
                                        dtype=t.dtype), symbolic)

    def spec(shape: Any, spec_dtype: str) -> Any:
        if not isinstance(shape, (tuple, list)) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0
                for d in shape):
            raise ValueError(
                "input_shape must be one example's shape, a tuple of "
                "positive ints without the batch dimension (or a list / dict "
                f"of them). Received: input_shape={input_shape!r}.")
        return keras.KerasTensor((batch_size,) + tuple(shape),
                                 dtype=spec_dtype)

    if isinstance(input_shape, dict):
        named = ({k: t.dtype for k, t in symbolic.items()}
                 if isinstance(symbolic, dict) else {})
        return {k: spec(v, named.get(k, dtype))
                for k, v in input_shape.items()}
    if isinstance(input_shape, list) and input_shape and all(
            isinstance(s, (tuple, list)) for s in input_shape):
        dtypes = ([t.dtype for t in symbolic] if isinstance(symbolic, list)
                  and len(symbolic) == len(input_shape) else
                  [dtype] * len(input_shape))
        return [spec(s, d) for s, d in zip(input_shape, dtypes)]
    single = (symbolic.dtype if symbolic is not None and not isinstance(
        symbolic, (dict, list)) else dtype)
    return spec(input_shape, single)


def target_specs(model: Layer, inputs: Any, sparse: bool, batch_size: int,
                  keras: Any) -> Any:
    """Targets shaped as the model's outputs (class indices for a sparse
    loss)."""
    outputs = symbolic_tensors(model, "output")
    if outputs is None:
        outputs = model.compute_output_spec(inputs)

    lengths = [t.shape for t in keras.tree.flatten(inputs)]

    def target(t: Any) -> Any:
        # An unknown dimension (a sequence) is the inputs' (same place).
        dims = [batch_size] + list(t.shape[1:])
        for i, d in enumerate(dims):
            if d is None:
                dims[i] = next((s[i] for s in lengths if len(s) > i
                                and s[i] is not None), 1)
        shape = tuple(dims)
        if sparse:
            return keras.KerasTensor(shape[:-1], dtype="int32")
        return keras.KerasTensor(shape, dtype=t.dtype)

    return keras.tree.map_structure(target, outputs)


def symbolic_tensors(model: Layer, which: str) -> Any:
    """The model's symbolic `input` or `output` (a structure of
    `KerasTensor`s; a Sequential's has only the lists `inputs` /
    `outputs`), None for a model without (a subclassed one)."""
    try:
        return getattr(model, which)
    except (AttributeError, ValueError):
        pass
    tensors = getattr(model, which + "s", None)
    if not tensors:
        return None
    return tensors[0] if len(tensors) == 1 else list(tensors)


def unknown_dimension(model: Layer, inputs: Any, keras: Any) -> int:
    """The size `input_shape` gave the unknown dimensions of the model's
    `keras.Input`s (a sequence length): the largest if they differ, 1 when
    there are none. Layer outputs have the same unknown dimensions."""
    symbolic = symbolic_tensors(model, "input")
    if symbolic is None:
        return 1
    tensors, specs = keras.tree.flatten(symbolic), keras.tree.flatten(inputs)
    if len(tensors) != len(specs):
        return 1
    sizes = [int(s) for tensor, spec in zip(tensors, specs)
             for d, s in zip(tensor.shape[1:], spec.shape[1:]) if d is None]
    return max(sizes, default=1)
