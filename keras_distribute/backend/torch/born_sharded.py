"""Variables born sharded on torch: a process draws only its shard.

torch's CPU generator cannot skip ahead, but drawing its stream in flat
chunks (each a multiple of 16 values, the last at least 16) gives exactly
the values of one whole draw, for `torch.rand` and `torch.normal` in every
float dtype. Keras' torch initializers draw from a fresh generator seeded
from the initializer's seed (`random.torch_seed_generator`). So a variable
can be made as one process's region of it: while its initializer runs for
the whole shape, Keras' torch `normal`, `uniform` and `truncated_normal`
are replaced, in the thread that makes it (other threads keep Keras' own),
by functions that draw the same stream chunk by chunk and
keep only the region — the rows and columns this process holds — never
holding more than a chunk, a row and the region. The region equals the
slice of the value an unsharded model gets from the same seed, bit for bit.

Only Keras' own initializers whose value is that one draw scaled element
by element (`ONE_DRAW_INITIALIZERS`) are cut so; those that draw nothing
(zeros, ones, a scalar constant: `constant_region`) are made at the
region's shape; any other (orthogonal, a custom one or a subclass) gives
None: the caller makes the whole value as Keras does. A first small draw checks
the chunked stream against a whole one (`chunked_draws_match`); if they
ever differed (another torch), nothing is born sharded.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import threading
from typing import Any
from typing import Callable
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

import torch

# A sharded variable at least this large (as float32, whole) is drawn shard
# by shard; smaller ones keep Keras' path (whole, then cut).
BORN_SHARDED_MIN_BYTES = 4 << 20
# Values per draw: a multiple of 16 (torch's normal fills 16 at a time).
CHUNK = 1 << 16

Region = Sequence[Tuple[int, int]]

# Keras' initializers whose value is one draw of Keras' `normal`, `uniform`
# or `truncated_normal` of the variable's shape, scaled elementwise.
ONE_DRAW_INITIALIZERS = (
    "RandomNormal", "RandomUniform", "TruncatedNormal", "VarianceScaling",
    "GlorotNormal", "GlorotUniform", "HeNormal", "HeUniform", "LecunNormal",
    "LecunUniform")

# Keras' initializers that draw nothing: every region of their value is
# the initializer's value of the region's shape (a Constant's value is a
# scalar).
DRAWING_NOTHING = ("Zeros", "Ones", "Constant")


class _NotChunkable(Exception):
    """The initializer drew in a way the region cannot be cut from."""


def _stream_region(draw: Callable[[int], torch.Tensor], shape: tuple,
                   region: Region, chunk: int = CHUNK) -> torch.Tensor:
    """`draw(m)` gives the next `m` values of a stream whose first
    `prod(shape)` values, in row-major order, are a `shape` tensor; returns
    that tensor's `region` (a `(start, stop)` per dimension)."""
    total = math.prod(shape)
    row = total // shape[0]
    first, last = region[0]
    inner = tuple(slice(a, b) for a, b in region[1:])
    kept: List[torch.Tensor] = []
    carry: Optional[torch.Tensor] = None
    drawn = 0
    while drawn < last * row:
        m = min(chunk, total - drawn)
        if 0 < total - drawn - m < 16:
            m = total - drawn  # (the last draw: at least 16 values)
        piece = draw(m)
        drawn += m
        if carry is not None and carry.numel():
            piece = torch.cat([carry, piece])
        start = (drawn - piece.numel()) // row
        rows = piece.numel() // row
        carry = piece[rows * row:]
        low, high = max(first - start, 0), min(last - start, rows)
        if low < high:
            block = piece[:rows * row].view((rows,) + tuple(shape[1:]))
            kept.append(block[(slice(low, high),) + inner].clone())
    return torch.cat(kept)


@functools.lru_cache(maxsize=None)
def chunked_draws_match(dtype: torch.dtype) -> bool:
    """Whether, on this torch, chunked draws give one whole draw's values
    (checked once per dtype on a small draw)."""
    shape, region = (37, 131), ((5, 30), (7, 99))
    for fill in (lambda m, g: torch.rand(m, generator=g, dtype=dtype),
                 lambda m, g: torch.normal(0.0, 1.0, size=(m,), generator=g,
                                           dtype=dtype)):
        generator = torch.Generator().manual_seed(1234)
        whole = fill(math.prod(shape), generator).view(shape)
        generator = torch.Generator().manual_seed(1234)
        part = _stream_region(lambda m: fill(m, generator), shape, region,
                              chunk=64)
        expected = whole[tuple(slice(a, b) for a, b in region)]
        if not torch.equal(part, expected):
            return False
    return True


# While a region is drawn, Keras' torch `normal`, `uniform` and
# `truncated_normal` are dispatchers: the thread drawing a region gets its
# region functions, every other thread Keras' own (`_installed` counts the
# threads drawing; the originals come back when the last one ends).
_NAMES = ("normal", "uniform", "truncated_normal")
_lock = threading.Lock()
_installed: dict = {"count": 0, "originals": {}}
_this_thread = threading.local()


def _dispatcher(name: str) -> Callable:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        own = getattr(_this_thread, "functions", None)
        if own is not None:
            return own[name](*args, **kwargs)
        return _installed["originals"][name](*args, **kwargs)

    dispatch.__name__ = name
    return dispatch


@contextlib.contextmanager
def _drawing_region(random_module: Any, whole: tuple, region: Region,
                    calls: list):
    """While entered, in this thread only, `random_module`'s (Keras' torch
    random) `normal`, `uniform` and `truncated_normal` of the `whole` shape
    return only `region` (their parameters keep Keras' names: it calls them
    by name); other threads get Keras' own functions."""

    def prepared(call_shape: Any, dtype: Any, seed: Any) -> tuple:
        if tuple(call_shape) != tuple(whole):
            raise _NotChunkable(f"a draw of shape {tuple(call_shape)}")
        calls.append(call_shape)
        from keras import config

        torch_dtype = random_module.to_torch_dtype(dtype or config.floatx())
        return random_module.torch_seed_generator(seed), torch_dtype

    def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None):
        generator, torch_dtype = prepared(shape, dtype, seed)
        return _stream_region(lambda m: torch.normal(
            mean, stddev, size=(m,), generator=generator, dtype=torch_dtype),
            whole, region)

    def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None):
        generator, torch_dtype = prepared(shape, dtype, seed)
        return _stream_region(lambda m: (maxval - minval) * torch.rand(
            m, generator=generator, dtype=torch_dtype) + minval,
            whole, region)

    def truncated_normal(shape, mean=0.0, stddev=1.0, dtype=None,
                         seed=None):
        # Keras draws 4 normals per value and keeps the first within 2.
        generator, torch_dtype = prepared(shape, dtype, seed)
        candidates = _stream_region(lambda m: torch.normal(
            0.0, 1.0, size=(m,), generator=generator, dtype=torch_dtype),
            tuple(whole) + (4,), tuple(region) + ((0, 4),))
        valid = (candidates > -2) & (candidates < 2)
        index = valid.max(-1, keepdim=True)[1]
        return candidates.gather(-1, index).squeeze(-1).mul_(stddev).add_(
            mean)

    if getattr(_this_thread, "functions", None) is not None:
        raise _NotChunkable("a region is already being drawn here")
    with _lock:
        if _installed["count"] == 0:
            _installed["originals"] = {
                name: getattr(random_module, name) for name in _NAMES}
            for name in _NAMES:
                setattr(random_module, name, _dispatcher(name))
        _installed["count"] += 1
    _this_thread.functions = {"normal": normal, "uniform": uniform,
                              "truncated_normal": truncated_normal}
    try:
        yield
    finally:
        _this_thread.functions = None
        with _lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                for name, function in _installed["originals"].items():
                    setattr(random_module, name, function)
                _installed["originals"] = {}


def draw_region(random_module: Any, initializer: Any, shape: tuple,
                dtype: Any, region: Region) -> Optional[torch.Tensor]:
    """`initializer(shape, dtype)`'s `region`, drawn without the rest; None
    unless the initializer is one of Keras' own `ONE_DRAW_INITIALIZERS`
    (not a subclass) and draws one Keras torch `normal` / `uniform` /
    `truncated_normal` of `shape`, and chunked draws match here.

    Args:
        random_module: Keras' torch random module (its `normal`, `uniform`,
            `truncated_normal`, `torch_seed_generator`, `to_torch_dtype`).
        initializer: A Keras initializer.
        shape: The variable's whole shape (2 dimensions or more).
        dtype: The variable's dtype.
        region: `(start, stop)` per dimension: the part to make.

    Returns:
        A tensor of the region's shape, or None.
    """
    kind = type(initializer)
    if len(shape) < 2 or kind.__name__ not in ONE_DRAW_INITIALIZERS or (
            not kind.__module__.startswith("keras.")):
        return None
    calls: list = []
    try:
        with _drawing_region(random_module, shape, region, calls):
            value = initializer(shape, dtype=dtype)
    except _NotChunkable:
        return None
    expected = tuple(b - a for a, b in region)
    if (len(calls) != 1 or not isinstance(value, torch.Tensor)
            or tuple(value.shape) != expected
            or not chunked_draws_match(value.dtype)):
        return None
    return value


def draws_nothing(initializer: Any) -> bool:
    """Whether `initializer` is one of Keras' own `DRAWING_NOTHING` (not a
    subclass; a Constant of a scalar only)."""
    kind = type(initializer)
    if kind.__name__ not in DRAWING_NOTHING or not kind.__module__.startswith(
            "keras."):
        return False
    return kind.__name__ != "Constant" or isinstance(
        getattr(initializer, "value", None), (int, float))


def constant_region(initializer: Any, dtype: Any,
                    region: Region) -> Optional[torch.Tensor]:
    """The `region` of a `draws_nothing` initializer's value, made at the
    region's shape only; None if it is not one.

    Args:
        initializer: A Keras initializer.
        dtype: The variable's dtype.
        region: `(start, stop)` per dimension: the part to make.

    Returns:
        A tensor of the region's shape, or None.
    """
    if not draws_nothing(initializer):
        return None
    expected = tuple(b - a for a, b in region)
    value = initializer(expected, dtype=dtype)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
        return None
    return value


def local_shard(variable: Any, initializer: Any, shape: tuple,
                placements: Sequence[Any], mesh: Any,
                random_module: Any) -> Optional[torch.Tensor]:
    """This process's shard of a new `variable` of `shape` laid out as
    `placements` on the torch `mesh`, made without the rest; None when it
    is to be made whole (Keras' path).

    Only for a variable of `BORN_SHARDED_MIN_BYTES` or more whose
    initializer is one of Keras' one-draw initializers with an int seed
    (process 0's seed is broadcast first: every process then draws the same
    values), or, for a trainable variable, one that draws nothing (zeros,
    ones, a scalar constant: no broadcast); each tensor dimension cut by at
    most one mesh axis. Every process decides alike (same layout, shape,
    trainability and initializer class) before the one broadcast.

    Args:
        variable: The Keras variable being made (its `trainable`, `dtype`).
        initializer: Its initializer.
        shape: Its whole shape.
        placements: Its DTensor placements on `mesh`.
        mesh: The torch `DeviceMesh` it lies on.
        random_module: Keras' torch random module (`draw_region`).

    Returns:
        A tensor of the shard's shape, or None.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    seed = getattr(initializer, "seed", None)
    # (Drawing nothing: only a trainable variable — a layer's —, not an
    # optimizer's zeros, which `shard_like` lays out as their variable.)
    constant = variable.trainable and draws_nothing(initializer)
    if math.prod(shape) * 4 < BORN_SHARDED_MIN_BYTES or not constant and (
            type(initializer).__name__ not in ONE_DRAW_INITIALIZERS
            or not isinstance(seed, int) or isinstance(seed, bool)
            or not -(1 << 63) <= seed < 1 << 63):
        return None
    cuts = [(p.dim, i) for i, p in enumerate(placements)
            if isinstance(p, Shard)]
    if len({dim for dim, _ in cuts}) != len(cuts):
        return None  # a dimension cut by two mesh axes: Keras' path
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    region = [(0, n) for n in shape]
    for dim, mesh_dim in cuts:
        size = shape[dim] // mesh.size(mesh_dim)
        region[dim] = (coordinate[mesh_dim] * size,
                       (coordinate[mesh_dim] + 1) * size)
    if constant:  # (its values are the same in every process)
        return constant_region(initializer, variable.dtype, region)
    agreed = torch.tensor([seed], dtype=torch.int64)
    dist.broadcast(agreed, src=0)  # process 0's seed, in every process
    chosen = copy.copy(initializer)
    chosen.seed = int(agreed.item())
    return draw_region(random_module, chosen, shape, variable.dtype, region)
