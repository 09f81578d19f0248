"""The record of every attribute keras_distribute replaced in Keras.

`patch` swaps one attribute and remembers what was there; `restore_all`
puts everything back in reverse order. `hooks` and `tf_hooks` patch only
through here, so `hooks.uninstall()` leaves Keras exactly as it was.
"""

from typing import Any
from typing import Callable
from typing import List
from typing import Tuple

# (owner, attribute name, original, whether it was in owner.__dict__)
originals: List[Tuple[Any, str, Any, bool]] = []


def wrapping(wrapper: Callable, original: Callable) -> Callable:
    """`wrapper`, marked as kd's wrapper of `original` (`_kd_original`:
    what tells a patched Keras function from Keras' own)."""
    setattr(wrapper, "_kd_original", original)
    return wrapper


def patch(owner, name: str, replacement) -> None:
    """Replaces `owner.name` by `replacement`, remembering the original."""
    had_own = name in owner.__dict__
    originals.append((owner, name, owner.__dict__.get(name), had_own))
    setattr(owner, name, replacement)


def restore_all() -> None:
    """Restores every recorded attribute, newest first."""
    while originals:
        owner, name, original, had_own = originals.pop()
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
