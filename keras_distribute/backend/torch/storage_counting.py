"""What a torch step holds, counted without its memory being measured.

`LiveStorageBytes` counts the storages the operators make as they are made
and freed (on fake tensors: the estimate's step; on real ones: the tests'
count of Keras' own step). Some kernels hold memory no dispatcher sees:
`kernel_copy_bytes` says how much, from rules measured as the resident
memory of the real kernels on CPU.
"""

from __future__ import annotations

import weakref
from typing import Any
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveStorageBytes(TorchDispatchMode):
    """Counts the bytes of the storages made while it is entered (`live`)
    and their highest count (`peak`); storages that existed before
    (`resident` tensors') are not counted. With `kernel_copies`, the
    copies an operator's kernel makes inside itself, unseen by the
    dispatcher (`kernel_copy_bytes`), count towards the peak while it
    runs."""

    def __init__(self, resident: Iterable[torch.Tensor],
                 kernel_copies: bool = False) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted = {id(t.untyped_storage()) for t in resident}
        self._kernel_copies = kernel_copies

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            tensor = self.storage_holder(tensor)
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            if key in self._counted:
                continue
            self._counted.add(key)
            nbytes = storage.nbytes()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, nbytes)
        if self._kernel_copies:
            self.peak = max(self.peak,
                            self.live + kernel_copy_bytes(func, args))
        return out

    def storage_holder(self, value: Any) -> Any:
        """The tensor whose storage an operator's output `value` holds:
        itself here (a subclass unwraps tensor subclasses, such as a
        DTensor's local tensor)."""
        return value

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._counted.discard(key)


def kernel_copy_bytes(func: Any, args: Any) -> int:
    """The bytes `func`'s kernel holds inside itself while it runs, unseen
    by the dispatcher: the copies it makes when its arguments are laid out
    in different memory formats (a Keras layer hands torch channels-last
    views; an operator between may return contiguous tensors) — a
    convolution's backward copies the output gradient into its input's
    format, a max pooling's backward copies its input and indices into the
    output gradient's —, and a gloo reduce-scatter's copy of its whole
    input (`gloo_stages_collectives`) (measured on CPU: the resident
    memory of the real kernels)."""
    if func is torch.ops._c10d_functional.reduce_scatter_tensor.default:
        return _nbytes(args[0]) if gloo_stages_collectives() else 0
    aten = torch.ops.aten
    if func is aten.convolution_backward.default:
        grad, given = args[0], args[1]
        return 0 if _same_format(grad, given) else _nbytes(grad)
    if func in (aten.max_pool2d_with_indices_backward.default,
                aten.max_pool3d_with_indices_backward.default):
        grad, given, indices = args[0], args[1], args[-1]
        return 0 if _same_format(grad, given) else (
            _nbytes(given) + _nbytes(indices))
    return 0


def _same_format(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _memory_format(a) == _memory_format(b)


def _memory_format(tensor: torch.Tensor) -> str:
    if tensor.is_contiguous():
        return "contiguous"
    if tensor.dim() == 4 and tensor.is_contiguous(
            memory_format=torch.channels_last):
        return "channels_last"
    if tensor.dim() == 5 and tensor.is_contiguous(
            memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "strided"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def gloo_stages_collectives() -> bool:
    """Whether the job's process group is gloo — kd's on a machine without
    CUDA (`groups.py`), as here —, whose all-gather (through DTensor) and
    reduce-scatter each hold a second buffer of the whole tensor while
    they run: the all-gather one torch makes (a storage the dispatcher
    sees, absent from `_Gathered`'s emulation), the reduce-scatter a copy
    of its input inside gloo (measured: a 2-process job's resident memory
    peaks at twice the whole tensor for an all-gather, one and a half for
    a reduce-scatter onto half)."""
    return not torch.cuda.is_available()
