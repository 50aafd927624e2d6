"""The tree tells the architecture: no import circles, dependencies one way, a small package root,
small modules.

Every import counts here, also those inside functions and under
``TYPE_CHECKING``: a circle held together by a lazy import is still a circle.
Python runs a package's ``__init__`` before any module in it, so importing
``remotorch.client.remote`` from outside ``client`` also imports the package
face ``remotorch.client`` and everything it imports: that implicit step
counts too. A package's own modules do not take that step (their package is
already being imported), so it is not counted for them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO

PACKAGE = REPO / "src" / "remotorch"

# part -> parts it must never import (directly or through a lazy or type-only import)
FORBIDDEN = {
    "codec": {"client", "capture", "training", "pipeline", "parallel", "cluster", "deploy", "profile", "worker",
              "transport", "weights"},
    "transport": {"client", "capture", "training", "pipeline", "parallel", "cluster", "deploy", "profile", "worker",
                  "codec", "weights"},
    "worker": {"client", "capture", "training", "pipeline", "parallel", "cluster", "deploy", "profile", "weights"},
    "client": {"capture", "training", "pipeline", "parallel", "cluster", "deploy", "profile", "worker", "weights"},
    "capture": {"training", "pipeline", "parallel", "cluster", "deploy", "profile", "worker", "transport",
                "client.session", "weights"},
    "training": {"capture", "pipeline", "parallel", "cluster", "deploy", "profile", "worker", "weights"},
    # weights on the worker: built on client, capture (a model compiled on its first call) and training
    "weights": {"pipeline", "parallel", "cluster", "deploy", "profile", "worker", "compat"},
    "pipeline": {"parallel", "cluster", "deploy", "profile", "worker"},
    "parallel": {"cluster", "deploy", "profile", "worker"},
    "deploy": {"capture", "training", "pipeline", "parallel", "cluster", "profile", "compat", "worker"},
    "compat": {"training", "pipeline", "parallel", "cluster", "deploy", "worker"},
}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = PACKAGE) -> set[str]:
    """Every module of the package a file imports, anywhere in it."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(root.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith(root.name):
                continue
            for alias in node.names:  # "from . import errors" imports the module errors
                sub = root.parent / Path(*f"{target}.{alias.name}".split("."))
                found.add(f"{target}.{alias.name}" if sub.with_suffix(".py").exists() or sub.is_dir()
                          else target)
    return found


def faces(target: str, importer: str, modules) -> list[str]:
    """The package faces (``__init__``) importing ``target`` runs first, less those ``importer`` is inside."""
    parts = target.split(".")
    found = []
    for k in range(1, len(parts)):
        face = ".".join(parts[:k])
        if face in modules and importer != face and not importer.startswith(face + "."):
            found.append(face)
    return found


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules it imports, each import with the package faces it runs on the way."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for t in imports_of(path, root):
            while t and t not in modules:  # "remotorch.x.y" names a module, or an attribute of one
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name:
                targets.add(t)
                targets.update(faces(t, name, modules))
        edges[name] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_among_modules():
    found = circles(graph())
    assert not found, f"import circles: {found}"


def test_the_circle_check_sees_lazy_and_type_only_imports(tmp_path):
    pkg = tmp_path / "demo_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\n")
    (pkg / "c.py").write_text("from . import a\n")
    assert circles(graph(pkg)) == [["demo_pkg.a", "demo_pkg.sub.b"]]


def reachable(edges: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` reaches through imports, each with the module that first imports it
    (a package face such as ``remotorch.client`` is a module: what its __init__ imports is reached too)."""
    via, todo = {}, [start]
    while todo:
        v = todo.pop()
        for w in edges.get(v, ()):
            if w not in via and w != start:
                via[w] = v
                todo.append(w)
    return via


def path_to(via: dict[str, str], start: str, end: str) -> str:
    hops = [end]
    while hops[-1] != start:
        hops.append(via[hops[-1]])
    return " -> ".join(reversed(hops))


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_dependencies_point_one_way(part):
    """Not only direct imports: nothing a part reaches, through any chain, may be forbidden to it."""
    edges, bad = graph(), []
    for name in edges:
        if not (name == f"remotorch.{part}" or name.startswith(f"remotorch.{part}.")):
            continue
        via = reachable(edges, name)
        for t in via:
            for other in FORBIDDEN[part]:
                if t == f"remotorch.{other}" or t.startswith(f"remotorch.{other}."):
                    bad.append(path_to(via, name, t))
    assert not bad, sorted(bad)[:20]


def test_reachability_follows_package_faces(tmp_path):
    pkg = tmp_path / "demo_pkg"
    (pkg / "client").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "client" / "__init__.py").write_text("from .session import Session\n")
    (pkg / "client" / "session.py").write_text("")
    (pkg / "capture.py").write_text("from .client import Session\n")
    via = reachable(graph(pkg), "demo_pkg.capture")
    assert path_to(via, "demo_pkg.capture", "demo_pkg.client.session") == \
        "demo_pkg.capture -> demo_pkg.client -> demo_pkg.client.session"


def test_reachability_counts_the_package_face_a_module_import_runs(tmp_path):
    """``from .client.remote import x`` runs ``client/__init__.py`` first: what that imports is reached."""
    pkg = tmp_path / "demo_pkg"
    (pkg / "client").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .client import remote\n")
    (pkg / "client" / "__init__.py").write_text("from .session import Session\n")
    (pkg / "client" / "session.py").write_text("from . import remote\n")
    (pkg / "client" / "remote.py").write_text("")
    (pkg / "capture.py").write_text("def f():\n    from .client.remote import fetch_all\n")
    edges = graph(pkg)
    via = reachable(edges, "demo_pkg.capture")
    assert path_to(via, "demo_pkg.capture", "demo_pkg.client.session") == \
        "demo_pkg.capture -> demo_pkg.client -> demo_pkg.client.session"
    # a package's own modules do not run its face (nor the root's), so this is no circle
    assert "demo_pkg.client" not in edges["demo_pkg.client.session"]
    assert circles(edges) == []


MAX_LINES = 450


def oversized(root: Path = PACKAGE) -> list[str]:
    """Every module of the package over ``MAX_LINES`` lines, with its count."""
    found = []
    for path in sorted(root.rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            found.append(f"{path.relative_to(root.parent)}: {n} lines")
    return found


def test_every_module_is_at_most_450_lines():
    """One job per module: a module past 450 lines is split by job (STYLE.md), not trimmed at the end."""
    assert not oversized(), oversized()


def test_the_size_check_finds_a_long_module(tmp_path):
    pkg = tmp_path / "demo_pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fits.py").write_text("x = 1\n" * MAX_LINES)
    (pkg / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert oversized(pkg) == [f"demo_pkg/sub/long.py: {MAX_LINES + 1} lines"]


def test_the_package_root_holds_at_most_six_modules():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 6, root
