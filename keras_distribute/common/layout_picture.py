"""Bytes in words and a layout drawn as HTML: the mesh with the bytes each
device holds, and the heaviest variables (a plan's `to_html`, a strategy's
`describe_layout`). Framework-free."""

import html
import math
from typing import Any
from typing import List
from typing import Optional
from typing import Sequence
from typing import Tuple

# (variable path, its layout: a mesh axis or None per dimension, bytes one
# device holds of it)
PictureRow = Tuple[str, Sequence[Optional[str]], int]


def nbytes_of(shape: Sequence[int], dtype: str) -> int:
    """The bytes of an array of `shape` and `dtype` (a dtype name numpy
    may not know, such as bfloat16, counted by its width)."""
    import numpy as np

    try:
        itemsize = int(np.dtype(dtype).itemsize)
    except TypeError:
        itemsize = 2 if "16" in dtype else 4  # bfloat16 and the like
    return int(math.prod(shape)) * itemsize


def human_bytes(nbytes: float) -> str:
    """`nbytes` in B, KiB, MiB or GiB (`"1.5 MiB"`)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return (f"{nbytes:.0f} {unit}" if unit == "B"
                    else f"{nbytes:.1f} {unit}")
        nbytes /= 1024
    return f"{nbytes:.1f} GiB"


def layout_html(title: str, axis_names: Sequence[str],
                mesh_shape: Sequence[int], rows: Sequence[PictureRow],
                replicated_bytes: int, top: int = 8) -> str:
    """A self-contained HTML fragment (names escaped): `title` on a mesh of
    `axis_names` x `mesh_shape`, one cell per device with the bytes it
    holds (the sum of `rows`), and the `top` heaviest rows as bars of their
    bytes per device with their layout."""
    names, shape = list(axis_names), [int(s) for s in mesh_shape] or [1]
    rows_count, columns = (shape[0], shape[1]) if len(shape) > 1 else (
        1, shape[0])
    per_device = human_bytes(sum(row[2] for row in rows))
    cell = ("<td style='border:1px solid #888;padding:6px 10px;"
            "text-align:center;background:#e8f0fe'>{}</td>")
    grid = "".join(
        "<tr>" + "".join(cell.format(
            f"device {r * columns + c}<br><b>{per_device}</b>")
            for c in range(columns)) + "</tr>"
        for r in range(rows_count))
    heaviest = sorted(rows, key=lambda row: -row[2])
    largest = max([row[2] for row in heaviest[:top]] + [1])
    bars = "".join(
        "<tr><td style='font-family:monospace;padding-right:8px'>"
        f"{html.escape(path)}</td><td>"
        f"<div style='background:#4285f4;height:10px;width:"
        f"{max(1, round(200 * nbytes / largest))}px'>"
        f"</div></td><td style='padding-left:8px'>"
        f"{human_bytes(nbytes)}</td>"
        f"<td style='font-family:monospace;padding-left:8px'>"
        f"{html.escape(str(tuple(axes)))}</td></tr>"
        for path, axes, nbytes in heaviest[:top])
    axes_text = " × ".join(f"{html.escape(str(n))} {s}"
                           for n, s in zip(names, shape))
    return (
        f"<div><p><b>{html.escape(title)}</b> on a mesh of {axes_text}: "
        f"{per_device} of variables per device (replicated: "
        f"{human_bytes(replicated_bytes)})</p>"
        f"<table style='border-collapse:collapse'>{grid}</table>"
        f"<p>The {min(top, len(heaviest))} heaviest variables, bytes "
        f"per device:</p><table>{bars}</table></div>")


class LayoutDescription(str):
    """What `Strategy.describe_layout` returns: its text table (a `str`),
    which also draws itself as HTML (`to_html`; Jupyter shows the picture
    for a description that ends a cell).

    Attributes:
        rows: `(path, layout, bytes per device)` per variable.
        axis_names: The mesh's axis names.
        mesh_shape: The mesh's shape.
        replicated_bytes: What one device would hold with every variable
            replicated.
    """

    rows: List[PictureRow]
    axis_names: List[str]
    mesh_shape: List[int]
    replicated_bytes: int

    def __new__(cls, text: str, rows: Sequence[PictureRow],
                axis_names: Sequence[str], mesh_shape: Sequence[int],
                replicated_bytes: int) -> "LayoutDescription":
        description = super().__new__(cls, text)
        description.rows = list(rows)
        description.axis_names = list(axis_names)
        description.mesh_shape = [int(s) for s in mesh_shape]
        description.replicated_bytes = int(replicated_bytes)
        return description

    def to_html(self, top: int = 8) -> str:
        """The layout drawn as HTML: the mesh, one cell per device with
        the bytes of variables it holds, and the `top` heaviest variables
        as bars of their bytes per device with their layout.

        Args:
            top: How many variables to draw.

        Returns:
            A self-contained HTML fragment (names escaped).

        Example:

        ```python
        description = strategy.describe_layout(model, print_fn=None)
        with open("layout.html", "w") as f:
            f.write(description.to_html())
        ```
        """
        return layout_html("Layout", self.axis_names, self.mesh_shape,
                           self.rows, self.replicated_bytes, top)

    def _repr_html_(self) -> str:
        return self.to_html()

    def __reduce__(self) -> Any:
        return (LayoutDescription, (str(self), self.rows, self.axis_names,
                                    self.mesh_shape, self.replicated_bytes))
