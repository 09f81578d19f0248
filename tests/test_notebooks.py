"""Every notebook runs top to bottom (nbclient), on a fresh kernel."""

from pathlib import Path

import pytest

from conftest import BACKEND

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks")
                   .glob("*.ipynb"))

pytestmark = pytest.mark.skipif(
    BACKEND != "jax",
    reason="each notebook picks its own backend: they run once, with jax")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells
               if cell.cell_type == "code"), "commit notebooks without outputs"
    client = nbclient.NotebookClient(notebook, timeout=600,
                                     kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for cell in notebook.cells for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
