"""Attribute paths: the names `tf.train.Checkpoint` gives variables.

kd keys a saved object's variables by position (`"net/3"`), which is stable
between two builds of one model. `tf.train.Checkpoint` users also reach a
variable through the attributes that hold it (`"net/l1/bias"` for a
subclassed model's `self.l1 = Dense(...)`), and restore through a stand-in
object graph: `ShardedCheckpoint(net=ShardedCheckpoint(l1=
ShardedCheckpoint(bias=v)))`. A checkpoint records every saved variable's
attribute paths (`object_paths` in the index: path -> key); a restore
matches a variable by its key, else by one of its attribute paths.

An attribute path follows the object's public attributes (`self.l1`, a
list `self.blocks[2]` as `blocks/2`, a dict by its keys); a private
attribute counts under its public name where that name gives the same
object (Keras' `Dense._kernel` is `kernel`), else not at all.

This module imports no framework at module level.
"""

from typing import Any
from typing import Dict
from typing import Iterator
from typing import List
from typing import Tuple

# How deep a path may go, and how many one object may contribute: an
# attribute graph is the user's, and a cycle or a huge list must not stall
# a save.
_MAX_DEPTH = 32
_MAX_PATHS = 1 << 16


def _public_name(owner: Any, attribute: str, value: Any) -> Any:
    """The name `value` is reached by on `owner`, or None."""
    if not attribute.startswith("_"):
        return attribute
    public = attribute.lstrip("_")
    if not public or public.startswith("_"):
        return None
    try:
        return public if getattr(owner, public, None) is value else None
    except Exception:  # a property that cannot answer now
        return None


def _attributes(obj: Any) -> Iterator[Tuple[str, Any]]:
    try:
        items = list(vars(obj).items())
    except TypeError:
        return
    # torch.nn.Module (every Keras layer on torch) keeps sub-modules in
    # `_modules`, not in the instance dict.
    modules = vars(obj).get("_modules")
    if isinstance(modules, dict):
        items += [(name, module) for name, module in modules.items()
                  if isinstance(name, str) and not name.startswith("_")
                  and name not in vars(obj)]
    import keras

    for attribute, value in sorted(items, key=lambda item: item[0]):
        # What holds no variable is skipped before its public name is
        # looked up: a property (`losses`, `output`) may compute or fail.
        if not (isinstance(value, keras.Variable)
                or _holds_variables(value)):
            continue
        name = _public_name(obj, attribute, value)
        if name is not None and "/" not in name:
            yield name, value


def variable_paths(name: str, obj: Any) -> Dict[str, Any]:
    """`{attribute path: variable}` for the variables below `obj`.

    Args:
        name: The object's name in the checkpoint (the paths' first part).
        obj: A Keras model, layer, optimizer or metric.

    Returns:
        Every attribute path that reaches a Keras variable, at most one
        path per variable and path-first (the shortest, then the first in
        attribute order).

    Example:

    ```python
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.l1 = keras.layers.Dense(5)
    # after a build: {"net/l1/kernel": ..., "net/l1/bias": ...}
    variable_paths("net", net)
    ```
    """
    import keras

    found: Dict[str, Any] = {}
    seen_objects = {id(obj)}
    seen_variables = set()
    level: List[Tuple[str, Any]] = [(name, obj)]
    for _ in range(_MAX_DEPTH):  # breadth first: shortest paths win
        following = []
        for path, owner in level:
            for attribute, value in _children(owner):
                child = f"{path}/{attribute}"
                if isinstance(value, keras.Variable):
                    if id(value) not in seen_variables:
                        seen_variables.add(id(value))
                        found[child] = value
                        if len(found) >= _MAX_PATHS:
                            return found
                elif _holds_variables(value) and id(value) not in \
                        seen_objects:
                    seen_objects.add(id(value))
                    following.append((child, value))
        if not following:
            break
        level = following
    return found


def _children(owner: Any) -> Iterator[Tuple[str, Any]]:
    if isinstance(owner, (list, tuple)):
        yield from ((str(i), item) for i, item in enumerate(owner))
    elif isinstance(owner, dict):
        yield from ((str(key), item) for key, item in owner.items()
                    if isinstance(key, str) and "/" not in key)
    else:
        yield from _attributes(owner)


def _holds_variables(value: Any) -> bool:
    """Keras objects and the lists and dicts of them an attribute holds."""
    import keras

    if isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        return any(isinstance(item, keras.Variable) or _holds_variables(item)
                   for item in list(items)[:_MAX_PATHS])
    return isinstance(value, (keras.layers.Layer, keras.optimizers.Optimizer,
                              keras.metrics.Metric))


def saved_object_paths(objects: Dict[str, Any],
                       keys: Dict[int, str]) -> Dict[str, str]:
    """The `object_paths` of an index: `{attribute path: saved key}`.

    Args:
        objects: The checkpoint's leaf objects (`{name: object}`).
        keys: `id(variable) -> saved key`.

    Returns:
        The attribute paths that differ from a saved key.
    """
    paths = {}
    for name, obj in objects.items():
        if not _holds_variables(obj):
            continue
        for path, variable in variable_paths(name, obj).items():
            key = keys.get(id(variable))
            if key is not None and key != path:
                paths[path] = key
    return paths


def match(saved: Dict[str, Any], object_paths: Dict[str, str],
          variables: Dict[str, Any], objects: Dict[str, Any]
          ) -> Dict[str, Any]:
    """`variables` keyed by the saved key each restores from.

    A variable whose own key is saved keeps it; else the first of its
    attribute paths (or its key) that the checkpoint saved, directly or as
    an attribute path, gives the key. A variable with no match keeps its
    own key (reported missing).

    Args:
        saved: The index's variables.
        object_paths: The index's `object_paths`.
        variables: `{key: variable}` to restore.
        objects: The leaf objects the variables belong to.
    """
    lookup = {key: key for key in saved}
    for path, key in object_paths.items():
        lookup.setdefault(path, key)
    if all(key in saved for key in variables):
        return dict(variables)
    paths_of: Dict[int, List[str]] = {}
    for name, obj in objects.items():
        if _holds_variables(obj):
            for path, variable in variable_paths(name, obj).items():
                paths_of.setdefault(id(variable), []).append(path)
    matched = {}
    for key, variable in variables.items():
        target = key
        for candidate in [key] + paths_of.get(id(variable), []):
            if candidate in lookup:
                target = lookup[candidate]
                break
        matched[target] = variable
    return matched
