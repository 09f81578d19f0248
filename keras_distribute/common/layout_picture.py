"""Bytes in words and a layout drawn as HTML: the mesh with the bytes each
device holds, and the heaviest variables (a plan's `to_html`, a strategy's
`describe_layout`). Framework-free."""

import html
from typing import Optional
from typing import Sequence
from typing import Tuple

# (variable path, its layout: a mesh axis or None per dimension, bytes one
# device holds of it)
PictureRow = Tuple[str, Sequence[Optional[str]], int]


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
