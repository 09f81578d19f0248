"""Flattening a structure of tensors on torch without keeping it alive.

Keras 3.15's torch `keras.tree.flatten` flattens through an `is_leaf`
closure over the structure inside torch's recursive `tree_flatten` helper,
which refers to itself: each call on a nested structure leaves a reference
cycle holding the structure, and its tensors, until Python's cycle
collector runs (keras-team/keras#23110). Called on a layer's inputs every
step, that keeps a step's activations alive into the next one. torch's own
`tree_flatten` without `is_leaf` leaves its helper's cycle too, but the
cycle holds no leaf.
"""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import tree_flatten


def flat_leaves(structure: Any) -> list:
    """The leaves of `structure` (lists, tuples, dicts and the containers
    registered with torch's pytree), with no reference cycle left holding
    them.

    Unlike `keras.tree.flatten`, a dict's leaves come in its insertion
    order, not sorted by key: for a question about every leaf.

    Args:
        structure: A nested structure of tensors and other leaves.

    Returns:
        The list of its leaves.

    Example:

    >>> flat_leaves(((1, 2), {"b": 3, "a": None}))
    [1, 2, 3, None]
    """
    return tree_flatten(structure)[0]
