"""The notebooks are committed executed, current, and still run.

`notebooks/make_notebooks.py` writes and executes them; here every committed
notebook must hold exactly the cells that script makes (so it is current),
carry the outputs of a full run (plots visible on GitHub), and run again top
to bottom on a fresh kernel with the same output in every cell the script
marks as deterministic.
"""

import copy
import sys
from pathlib import Path

import pytest
from conftest import BACKEND

HERE = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))

pytestmark = pytest.mark.skipif(
    BACKEND != "jax",
    reason="each notebook picks its own backend: they run once, with jax")


def _make_notebooks():
    sys.path.insert(0, str(HERE))
    try:
        import make_notebooks
    finally:
        sys.path.pop(0)
    return make_notebooks


def _text(outputs):
    """What a reader sees of `outputs` as text (streams, plain results)."""
    parts, stream = [], None
    for output in outputs:
        if output.get("output_type") == "stream":
            # The kernel splits a cell's prints into chunks by timing: the
            # chunks of one stream in a row read as one text.
            if output["name"] != stream:
                parts.append(f"{output['name']}: ")
            stream = output["name"]
            parts.append(output["text"])
        elif "data" in output:
            stream = None
            parts.append(output["data"].get("text/plain", ""))
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_current_and_reruns_with_the_same_outputs(path):
    import nbformat

    make = _make_notebooks()
    committed = nbformat.read(path, as_version=4)
    expected = make.build(path.stem)
    assert [(c.cell_type, c.source) for c in committed.cells] == [
        (c.cell_type, c.source) for c in expected.cells], (
        f"{path.name} is not what make_notebooks.py writes: run "
        "`.venv/bin/python notebooks/make_notebooks.py` and commit")
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), (
        f"{path.name} is committed without outputs: run make_notebooks.py")
    rerun = make.execute(copy.deepcopy(committed))
    errors = [o for cell in rerun.cells for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    checked = [(old, new) for old, new in zip(committed.cells, rerun.cells)
               if make.CHECKED in old.metadata.get("tags", [])]
    assert checked, "no cell marked deterministic"
    for old, new in checked:
        assert _text(new.outputs) == _text(old.outputs), (
            f"{path.name} cell {old.id}: the committed output is stale")
