"""Every Python block of README.md and docs/ runs, as a reader would run it.

The blocks of one page run in order, as one script in a fresh interpreter
(as pasted into one script or notebook; forked from one that imported Keras
only, tests/program_runner.py), on each backend the page names, in a scratch
directory. A page states its context in its own blocks (no hidden `x, y`).
An HTML comment right before a block (invisible on the rendered page)
narrows it:

    <!-- test: backends=jax -->          only on these backends
    <!-- test: skip (why) -->            never here (e.g. it needs several
                                          processes: tested elsewhere)

A page-level `<!-- test: page backends=jax,tensorflow -->` anywhere in the
page narrows every block of it. JAX simulates 8 CPU devices, as the pages
say to; TensorFlow and torch run their one local replica.
"""

import os
import pathlib
import re

import pytest
from conftest import BACKEND
from program_runner import run_program

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
ALL_BACKENDS = ("jax", "tensorflow", "torch")
_BLOCK = re.compile(
    r"(?:<!--\s*test:(?P<directive>[^>]*)-->\s*\n)?```python\n(?P<code>.*?)"
    r"^```", re.DOTALL | re.MULTILINE)
_PAGE = re.compile(r"<!--\s*test:\s*page\s+backends=(?P<names>[\w,]+)\s*-->")


def _backends(names: str) -> tuple:
    found = tuple(n.strip() for n in names.split(",") if n.strip())
    unknown = set(found) - set(ALL_BACKENDS)
    assert not unknown, f"unknown backends {unknown} in a test directive"
    return found


def page_blocks(path: pathlib.Path, backend: str):
    """`[(line, code)]` of the blocks of `path` that run on `backend`."""
    text = path.read_text()
    page = _PAGE.search(text)
    if page and backend not in _backends(page.group("names")):
        return []
    blocks = []
    for match in _BLOCK.finditer(text):
        directive = (match.group("directive") or "").strip()
        if directive.startswith("skip"):
            continue
        if directive.startswith("backends="):
            if backend not in _backends(directive[len("backends="):]):
                continue
        elif directive:
            raise AssertionError(
                f"{path.name}: unknown test directive {directive!r}")
        line = text.count("\n", 0, match.start("code")) + 1
        blocks.append((line, match.group("code")))
    return blocks


def _script(path: pathlib.Path, blocks):
    """The page's blocks as one script, and which script lines come from
    which page lines (for the failure message)."""
    parts, where, start = [], [], 1
    for line, code in blocks:
        parts.append(code)
        size = code.count("\n")
        where.append(f"page.py {start}-{start + size - 1} = "
                     f"{path.name}:{line}-{line + size - 1}")
        start += size
    return "".join(parts), where


PAGES_WITH_CODE = [p for p in PAGES if "```python" in p.read_text()]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda p: p.name)
def test_every_python_block_of_the_page_runs(page, tmp_path):
    if os.environ.get("KD_DOCS_BLOCKS", "1") == "0":
        pytest.skip("KD_DOCS_BLOCKS=0 (scripts/test.sh: the next-Keras stack)")
    blocks = page_blocks(page, BACKEND)
    if not blocks:
        pytest.skip(f"{page.name} names no block for {BACKEND}")
    code, where = _script(page, blocks)
    (tmp_path / "page.py").write_text(code)
    env = dict(os.environ, KERAS_BACKEND=BACKEND, TF_CPP_MIN_LOG_LEVEL="2",
               XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join(
                   filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("KD_RECORD_BAD_INPUTS", None)
    result = run_program(["page.py"], cwd=tmp_path, env=env, timeout=600)
    assert result.returncode == 0, (
        f"{page.name} on {BACKEND}: a block failed (exit status "
        f"{result.returncode}).\n" + "\n".join(where)
        + f"\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")


def test_directives_are_read():
    # The parser itself: a narrowed block, a skipped one, a page directive.
    path = ROOT / "tests" / "_directive_probe.md"
    path.write_text(
        "<!-- test: backends=torch -->\n```python\na = 1\n```\n"
        "<!-- test: skip (two processes) -->\n```python\nb = 2\n```\n"
        "```python\nc = 3\n```\n")
    try:
        assert [c for _, c in page_blocks(path, "torch")] == [
            "a = 1\n", "c = 3\n"]
        assert [c for _, c in page_blocks(path, "jax")] == ["c = 3\n"]
        path.write_text(path.read_text() + "<!-- test: page backends=jax -->")
        assert page_blocks(path, "torch") == []
    finally:
        path.unlink()
