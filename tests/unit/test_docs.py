"""The documents' Python examples: each parses, each skip says why, and pytest runs them.

The examples themselves run through Sybil (the repository's ``conftest.py``:
README.md and docs/*.md are in pytest's ``testpaths``). A block marked
``<!-- skip: next "reason" -->`` does not run there, so this file at least
parses it: a typo in an example CI cannot run still fails here.
"""

from __future__ import annotations

import ast
import re
import tomllib

import pytest

from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.M | re.S)
SKIP = re.compile(r"<!--\s*skip:\s*(\w+)(.*?)-->", re.S)


def blocks() -> list[tuple[str, int, str]]:
    """(document, line of the fence, source) of every Python block."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            found.append((path.relative_to(REPO).as_posix(), text.count("\n", 0, match.start()) + 1, match.group(1)))
    return found


@pytest.mark.parametrize("doc, line, source", blocks(), ids=[f"{d}:{n}" for d, n, _ in blocks()])
def test_every_python_block_parses(doc, line, source):
    try:
        ast.parse(source)
    except SyntaxError as exc:
        pytest.fail(f"{doc}:{line + (exc.lineno or 0)}: {exc.msg}")


def test_every_skip_names_its_reason():
    """A reader (and CI's log) sees why a block does not run: ``skip: next "needs …"``, never a bare skip."""
    bare = []
    for path in DOCS:
        for action, rest in SKIP.findall(path.read_text(encoding="utf-8")):
            if action != "next" or not re.fullmatch(r'\s*"[^"]+"\s*', rest):
                bare.append(f"{path.name}: skip: {action}{rest}")
    assert not bare, bare


def test_pytest_collects_the_documents():
    testpaths = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"][
        "testpaths"]
    assert {"README.md", "docs"} <= set(testpaths)
    assert "Sybil(" in (REPO / "conftest.py").read_text(encoding="utf-8")
