"""Every remotorch name the README and docs/*.md use still exists where they say it is.

STYLE.md: a public name that moves keeps a re-export at its old place, or the
docs move with it in the same commit. This test holds that rule: it collects
each ``from remotorch... import a, b``, ``import remotorch...`` and dotted
``remotorch.x.y`` the documents name (in code blocks and in the text) and
fails, naming the name and the files, when one no longer resolves.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from helpers import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FROM_IMPORT = re.compile(r"^\s*from\s+(remotorch(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
IMPORT = re.compile(r"^\s*import\s+([\w., ]+)", re.M)
# remotorch.x.y, but not a path or a file name such as /etc/systemd/system/remotorch.service
DOTTED = re.compile(r"(?<![\w./-])remotorch(?:\.[A-Za-z_]\w*)+")
NOT_NAMES = {"remotorch.service"}  # the systemd unit docs/deploy.md writes


def names_in(text: str) -> set[str]:
    """The dotted remotorch names one document uses."""
    found = set(DOTTED.findall(text))
    for module, imported in FROM_IMPORT.findall(text):
        for alias in imported.strip("()").split(","):
            name = alias.split(" as ")[0].strip()
            if name and name != "*":
                found.add(f"{module}.{name}")
    for line in IMPORT.findall(text):
        found.update(m.split(" as ")[0].strip() for m in line.split(",")
                     if m.strip().startswith("remotorch"))
    return found - NOT_NAMES


def documented() -> dict[str, list[str]]:
    """Each name the documents use, with the documents that use it."""
    uses: dict[str, list[str]] = {}
    for path in DOCS:
        for name in names_in(path.read_text(encoding="utf-8")):
            uses.setdefault(name, []).append(path.relative_to(REPO).as_posix())
    return uses


def resolve(name: str) -> object:
    """The object a dotted name names: its longest importable module prefix, then attributes."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        module = ".".join(parts[:k])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # not a module: an attribute of a shorter prefix
            if exc.name is not None and module.startswith(exc.name) and exc.name.startswith("remotorch"):
                continue
            raise  # a module that exists failed to import (a missing dependency): say so
        break
    for attr in parts[k:]:
        obj = getattr(obj, attr)
    return obj


USES = documented()


@pytest.mark.parametrize("name", sorted(USES))
def test_every_documented_name_resolves(name):
    try:
        resolve(name)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"{name} (used in {', '.join(USES[name])}) does not resolve: {exc}")


def test_the_collector_finds_imports_dotted_names_and_parenthesised_lists():
    text = ("from remotorch.pipeline.schedules import Action, build as make\n"
            "from remotorch.optim import (RemoteOptimizer,\n    other)\n"
            "import torch, remotorch.cluster\n"
            "see `remotorch.compile(model)` and /etc/systemd/system/remotorch.service\n")
    assert names_in(text) == {"remotorch.pipeline.schedules", "remotorch.pipeline.schedules.Action",
                              "remotorch.pipeline.schedules.build", "remotorch.optim", "remotorch.optim.RemoteOptimizer",
                              "remotorch.optim.other", "remotorch.cluster", "remotorch.compile"}
    assert {"remotorch.Session", "remotorch.pipeline.schedules.build", "remotorch.compile"} <= set(USES)


def test_a_name_that_moved_fails_to_resolve():
    assert resolve("remotorch.pipeline.schedules.build") is resolve("remotorch.pipeline.builders.build")
    with pytest.raises(AttributeError):
        resolve("remotorch.pipeline.schedules.no_such_name")
    with pytest.raises(AttributeError):
        resolve("remotorch.no_such_module.thing")
