"""The tests are found from a package's name (#31, item 8).

`docs/testing.md` ("Where a package's tests are") maps each package to its
test files. Every package of `keras_distribute/` has a row, every test file
is in some row, and every file a row names exists: the table cannot go
stale without this failing.
"""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _table():
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("## Where a package's tests are", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or cells[0] in ("package", "---"):
            continue
        rows[cells[0].strip("`")] = set(
            re.findall(r"`([\w/]+\.py)`", cells[1]))
    return rows


def test_every_package_has_a_row():
    packages = {p.name + "/" for p in (ROOT / "keras_distribute").iterdir()
                if (p / "__init__.py").exists()}
    assert packages <= set(_table()), sorted(packages - set(_table()))


def test_every_test_file_is_in_the_table_and_every_named_file_exists():
    named = set().union(*_table().values())
    files = {str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")}
    assert files - named == set(), "test files the table does not name"
    assert named - files == set(), "the table names files that do not exist"


def test_the_longest_first_order_names_existing_files_and_stages():
    # conftest.STAGE_SECONDS sets the order xdist hands files out in
    # (scripts/test.sh); a renamed file would silently fall back to the end,
    # a misspelt stage would never be read.
    from conftest import STAGE_SECONDS

    missing = [name for name in STAGE_SECONDS if not (TESTS / name).exists()]
    assert missing == [], f"conftest.STAGE_SECONDS names {missing}"
    stages = {prefix + backend for prefix in ("", "next ")
              for backend in ("jax", "tensorflow", "torch")}
    unknown = {stage for seconds in STAGE_SECONDS.values()
               for stage in seconds} - stages
    assert unknown == set(), f"conftest.STAGE_SECONDS has stages {unknown}"
