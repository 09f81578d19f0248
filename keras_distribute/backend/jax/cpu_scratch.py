"""What XLA:CPU's kernels allocate outside XLA's own buffers.

`memory_analysis()` of a compiled program counts the buffers XLA assigns:
arguments, outputs and temporaries. On the CPU platform some kernels take
more memory of their own while they run, which no analysis sees but the
process's resident memory does (measured: `test_memory_estimate.py`,
`test_xla_cpu_kernels_take_the_scratch_the_estimate_counts`):

- a convolution XLA hands to YNNPACK (a `__ynn_fusion` fusion)
  materialises its im2col matrix — one row per output position, one column
  per kernel tap and input feature, over every group — or, when it is
  padded, its input with the padding; a depthwise one takes none. When a
  group's kernel is wider than one 64-column tile and its tiles are large
  (over 340 KiB, measured on x86 with the XLA of jax 0.10), YNNPACK packs
  that and the kernel again for its threads: twice as much, plus the
  kernel — in a process that may run on one CPU only (XLA's thread pool
  is as large as the CPUs the process may use), it does not;
- a convolution XLA runs itself (Eigen's: over volumes, or padded more than
  YNNPACK takes) holds one more output's bytes over a volume, nothing
  measurable over an image or a sequence;
- a dot XLA runs itself (Eigen's) on an operand whose contracting
  dimension is not the one its kernel reads along packs that operand in
  blocks the caches size: counted as one transposed copy of it (measured
  between half and twice that).

The scratch of one kernel lives only while it runs: the step's peak is at
most XLA's plus the largest of them (`largest_kernel_scratch`).
"""

from __future__ import annotations

import math
import os
import re
from types import MappingProxyType
from typing import Dict
from typing import List
from typing import Optional
from typing import Tuple

# Bytes per element of XLA's primitive types (the f8 and sub-byte kinds
# round up to one byte).
_ELEMENT_BYTES = MappingProxyType({
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
})
# YNNPACK's output tile width, and the tile size above which it packs the
# im2col matrix and the kernel (measured between 333 and 342 KiB on an x86
# CPU with 2 MiB of L2 cache a core: a CPU with other caches may choose
# otherwise, and the estimate then counts one im2col matrix too many or
# too few).
_YNN_TILE_COLUMNS = 64
_YNN_PACKED_ABOVE_BYTES = 340 * 1024

_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")


class _Instruction:
    """One HLO instruction: its name, result (element type and
    dimensions of the first array in it), opcode, operand names and the
    attribute text after them."""

    def __init__(self, name: str, result: str, opcode: str,
                 rest: str) -> None:
        self.name, self.opcode = name, opcode
        array = _ARRAY.search(result)
        self.dtype = array.group(1) if array else "f32"
        self.dims: Tuple[int, ...] = tuple(
            int(d) for d in array.group(2).split(",") if d) if array else ()
        depth, end = 1, len(rest)
        for i, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                end = i
                break
        self.operands = re.findall(r"%([\w.\-]+)", rest[:end])
        self.attributes = rest[end:]

    @property
    def nbytes(self) -> int:
        return math.prod(self.dims) * _ELEMENT_BYTES.get(self.dtype, 1)


def _computations(hlo_text: str) -> Tuple[Dict[str, List[_Instruction]],
                                          Optional[str]]:
    """Every computation of a module's text by name (its instructions in
    order), and the entry computation's name."""
    computations: Dict[str, List[_Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        found = _INSTRUCTION.match(line)
        if current is not None and found:
            computations[current].append(_Instruction(*found.groups()))
    return computations, entry


def _convolution_parts(convolution: _Instruction,
                       shapes: Dict[str, _Instruction]) -> Optional[tuple]:
    """(im2col bytes, kernel bytes, a group's columns, taps, rows, groups)
    of a convolution: rows are taps times a group's input features, columns a
    group's output features, and its im2col matrix holds every group's
    rows for each output position; None when its attributes do not read
    as expected."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)",
                       convolution.attributes)
    if labels is None or len(convolution.operands) < 2:
        return None
    kernel = shapes.get(convolution.operands[1])
    _, kernel_labels, out_labels = labels.groups()
    if kernel is None or len(kernel.dims) != len(kernel_labels) or len(
            convolution.dims) != len(out_labels):
        return None
    grouped = re.search(r"feature_group_count=(\d+)", convolution.attributes)
    groups = int(grouped.group(1)) if grouped else 1
    taps = math.prod(kernel.dims[i] for i, c in enumerate(kernel_labels)
                     if c.isdigit())
    rows = taps * kernel.dims[kernel_labels.index("i")]
    columns = kernel.dims[kernel_labels.index("o")] // groups
    positions = math.prod(convolution.dims[i] for i, c in
                          enumerate(out_labels) if c != "f")
    element = _ELEMENT_BYTES.get(convolution.dtype, 4)
    return (positions * rows * groups * element, kernel.nbytes, columns,
            taps, rows, groups)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the
    platform has one): the size of XLA:CPU's thread pool."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (no affinity masks: macOS)
        return os.cpu_count() or 1


def _ynn_convolution_scratch(convolution: _Instruction,
                             shapes: Dict[str, _Instruction],
                             threads: int) -> int:
    parts = _convolution_parts(convolution, shapes)
    if parts is None:
        return 0
    im2col, kernel_bytes, columns, taps, rows, groups = parts
    if groups > 1 and rows == taps:
        return 0  # (depthwise: one input feature a group, no im2col)
    # (a padded one works on its padded input instead of an im2col matrix)
    im2col = _padded_input_bytes(convolution, shapes) or im2col
    tiles = -(-columns // _YNN_TILE_COLUMNS) * _YNN_TILE_COLUMNS
    element = _ELEMENT_BYTES.get(convolution.dtype, 4)
    if threads > 1 and columns > _YNN_TILE_COLUMNS and (
            tiles * rows * element > _YNN_PACKED_ABOVE_BYTES):
        return 2 * im2col + kernel_bytes
    return im2col


def _padded_input_bytes(convolution: _Instruction,
                        shapes: Dict[str, _Instruction]) -> int:
    """A convolution's input with the padding added (none when
    unpadded)."""
    window = re.search(r"window=\{([^}]*)\}", convolution.attributes)
    labels = re.search(r"dim_labels=(\w+)_", convolution.attributes)
    pads = re.search(r"pad=([0-9_x\-]+)", window.group(1)) if window else None
    source = shapes.get(convolution.operands[0]) if (
        convolution.operands) else None
    if pads is None or labels is None or source is None:
        return 0
    spatial = [i for i, c in enumerate(labels.group(1)) if c.isdigit()]
    padded = list(source.dims)
    for axis, pad in zip(spatial, pads.group(1).split("x")):
        low, _, high = pad.partition("_")
        padded[axis] += max(int(low), 0) + max(int(high or 0), 0)
    return math.prod(padded) * _ELEMENT_BYTES.get(source.dtype, 4)


def _eigen_convolution_scratch(convolution: _Instruction) -> int:
    """A convolution XLA runs itself (Eigen's): one more output's bytes
    for a volume (three spatial dimensions), none for an image or a
    sequence (measured)."""
    labels = re.search(r"->(\w+)", convolution.attributes)
    spatial = sum(c.isdigit() for c in labels.group(1)) if labels else 0
    return convolution.nbytes if spatial >= 3 else 0


def _transposed_operand_bytes(dot: _Instruction,
                              shapes: Dict[str, _Instruction]) -> int:
    """A rank-2 dot XLA runs itself: the operands it reads across their
    layout (the left one contracted on its first dimension, the right one
    on its second) are copied."""
    copied = 0
    for side, across in (("lhs", "0"), ("rhs", "1")):
        found = re.search(side + r"_contracting_dims=\{([0-9,]*)\}",
                          dot.attributes)
        operand = shapes.get(dot.operands[0 if side == "lhs" else 1]) if (
            len(dot.operands) > 1) else None
        if found and operand is not None and len(operand.dims) == 2 and (
                found.group(1) == across):
            copied += operand.nbytes
    return copied


def _called(instruction: _Instruction) -> str:
    """The computation a fusion (or call) instruction runs; "" for one
    that names none."""
    called = re.search(r"calls=%([\w.\-]+)", instruction.attributes)
    return called.group(1) if called else ""


def largest_kernel_scratch(hlo_text: str,
                           threads: Optional[int] = None) -> Tuple[int, str]:
    """The most bytes one kernel of a compiled XLA:CPU program takes
    outside XLA's buffers while it runs (see the module's docstring).

    Args:
        hlo_text: the compiled program's text (`Compiled.as_text()`).
        threads: the threads of XLA:CPU's pool that run it; by default
            this process's (`usable_cpus()`).

    Returns:
        `(bytes, what)`: the most bytes, and what takes them in words;
        `(0, "")` when no kernel the program runs takes any (or the text
        is not an HLO module).

    Example:
    ```python
    compiled = jax.jit(step).lower(*abstract_args).compile()
    extra, what = largest_kernel_scratch(compiled.as_text())
    ```
    """
    computations, entry = _computations(hlo_text)
    if entry is None:
        return 0, ""
    threads = usable_cpus() if threads is None else threads
    shapes = {i.name: i for body in computations.values() for i in body}
    # A fusion's computation runs as one kernel, the fusion's.
    fused_names = {_called(i) for body in computations.values()
                   for i in body if i.opcode == "fusion"}
    largest: Tuple[int, str] = (0, "")
    # The entry computation's kernels and those of the computations it
    # runs (a while loop's body, a call's, a conditional's branches).
    running = [i for name, body in computations.items()
               if name not in fused_names for i in body]
    for instruction in running:
        scratch, what = 0, ""
        if instruction.opcode == "fusion" and (
                "__ynn_fusion" in instruction.attributes):
            scratch = sum(_ynn_convolution_scratch(i, shapes, threads)
                          for i in computations.get(_called(instruction), [])
                          if i.opcode == "convolution")
            what = "a convolution's im2col matrix"
        elif instruction.opcode == "convolution":
            scratch = _eigen_convolution_scratch(instruction)
            what = "a volume convolution's second output"
        elif instruction.opcode == "dot":
            scratch = _transposed_operand_bytes(instruction, shapes)
            what = "a dot's operand, transposed"
        if scratch > largest[0]:
            largest = (scratch, what)
    return largest
