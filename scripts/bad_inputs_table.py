"""docs/bad_inputs.md: every bad input the test suite tries, with the error
it gets — generated from the suite's own runs.

scripts/test.sh runs each backend's suite with KD_RECORD_BAD_INPUTS set, so
every `pytest.raises` that caught its exception is recorded (test, backend,
exception, message). This script merges those records:

    python scripts/bad_inputs_table.py --write RECORDS...   # rewrite the page
    python scripts/bad_inputs_table.py --check RECORDS...   # CI: page current?

`--check` compares the cases (test, exception type), not the messages (they
hold temporary paths and timings); it fails when the page lists a case the
suite no longer tries, misses one it tries, or has fewer than 60 cases.
"""

import argparse
import json
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "bad_inputs.md"
MINIMUM = 60
_ROW = re.compile(r"^\| `(?P<test>[^`]+)` \| (?P<backends>[^|]+) \| "
                  r"`(?P<type>[^`]+)` \|")


def _normalise(message: str) -> str:
    message = re.sub(r"/tmp/[^\s'\"),]+", "<tmp>", message)
    message = re.sub(r"0x[0-9a-f]+", "0x…", message)
    # Cut after the paths are shortened: the page does not change with the
    # length of a run's temporary directory.
    return message[:300].replace("|", "\\|").replace("`", "'")


def merge(paths):
    cases = {}
    for path in paths:
        for record in json.loads(Path(path).read_text()):
            if record["type"] in ("Interrupt",):  # a test's own stop signal
                continue
            # "|" and "`" would break the table: the same in every place.
            test = record["test"].replace("|", "/").replace("`", "'")
            key = (test, record["type"])
            case = cases.setdefault(key, {"backends": set(), "messages": []})
            case["backends"].add(record["backend"])
            message = _normalise(record["message"])
            if message not in case["messages"]:
                case["messages"].append(message)
    return cases


def render(cases) -> str:
    lines = [
        "# Bad input and the errors it gets",
        "",
        "Every bad input the test suite tries, with the exception and "
        "message it gets (the",
        "first message line, temporary paths shortened). Generated from "
        "the suite's own runs by",
        "`scripts/bad_inputs_table.py`; CI fails when this page and the "
        "suite disagree.",
        f"{len(cases)} cases.",
        "",
        "| test | backends | exception | message (first seen) |",
        "|---|---|---|---|",
    ]
    for (test, kind), case in sorted(cases.items()):
        backends = ", ".join(sorted(case["backends"]))
        lines.append(f"| `{test}` | {backends} | `{kind}` | "
                     f"{case['messages'][0]} |")
    return "\n".join(lines) + "\n"


def listed_cases(text: str):
    return {(m["test"], m["type"]) for m in map(_ROW.match,
                                                text.splitlines()) if m}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true",
                      help="rewrite docs/bad_inputs.md")
    mode.add_argument("--check", action="store_true",
                      help="fail unless docs/bad_inputs.md is current")
    parser.add_argument("records", nargs="+",
                        help="the KD_RECORD_BAD_INPUTS files of a suite run")
    args = parser.parse_args()
    cases = merge(args.records)
    if args.write:
        PAGE.write_text(render(cases))
        print(f"wrote {PAGE} ({len(cases)} cases)")
        return 0
    listed = listed_cases(PAGE.read_text()) if PAGE.exists() else set()
    tried = set(cases)
    problems = []
    if tried - listed:
        problems.append(f"tried but not on the page: {sorted(tried - listed)}")
    if listed - tried:
        problems.append(f"on the page but not tried: {sorted(listed - tried)}")
    if len(tried) < MINIMUM:
        problems.append(f"only {len(tried)} cases; at least {MINIMUM} expected")
    if problems:
        print("docs/bad_inputs.md is not current:\n  " + "\n  ".join(problems)
              + "\nRegenerate it: bash scripts/test.sh, then python "
              "scripts/bad_inputs_table.py --write .venv/bad-inputs-*.json*")
        return 1
    print(f"docs/bad_inputs.md lists the {len(tried)} cases the suite tries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
