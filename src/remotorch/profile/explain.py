"""``remotorch.explain``: what dynamo makes of a function before anything runs remotely.

How many graphs a call produces, why each graph break happened (with the
user's source lines), and the operations in each graph. Many graphs mean many
round trips per call on a remote worker, so this is the first thing to look
at when a profile shows large local segments.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import IO

import torch

from .tables import is_terminal, table, to_text, write


@dataclass(frozen=True)
class GraphBreak:
    """One graph break: dynamo's reason and the user's frames where it happened."""

    reason: str
    user_stack: list[str]


@dataclass(frozen=True)
class Explanation:
    """Graphs, graph breaks and operations of one call of a function."""

    function: str
    graph_count: int
    graph_break_count: int
    breaks: list[GraphBreak]
    ops_per_graph: list[list[str]] = field(default_factory=list)

    def render(self, *, terminal: bool = False) -> str:
        """The summary line, a table of graphs and one of graph breaks (plain text unless ``terminal``)."""
        return to_text(*self._parts(terminal), terminal=terminal)

    def _parts(self, terminal: bool) -> list:
        parts: list = [f"{self.function}: {self.graph_count} graph(s), {self.graph_break_count} graph break(s)"]
        if self.ops_per_graph:
            rows = [[f"graph {i}", str(len(ops)), ", ".join(ops[:12]) + (" …" if len(ops) > 12 else "")]
                    for i, ops in enumerate(self.ops_per_graph, 1)]
            parts.append(table(("graph", "ops", "operations"), rows, terminal=terminal))
        if self.breaks:
            rows = []
            for i, brk in enumerate(self.breaks, 1):
                rows += [[f"break {i}", brk.reason], *([""] + [f"  {frame}"] for frame in brk.user_stack)]
            parts.append(table(("break", "reason, then where in your code"), rows, terminal=terminal))
        return parts

    def print(self, file: IO[str] | None = None, *, terminal: bool | None = None) -> None:
        """Print it: drawn by ``rich`` on a terminal, plain text elsewhere (or as ``terminal`` says)."""
        write(*self._parts(terminal if terminal is not None else is_terminal(file)), file=file, terminal=terminal)


def explain(fn, *args, **kwargs) -> Explanation:
    """Run ``fn(*args, **kwargs)`` once under dynamo and say how it splits into graphs.

    ``fn`` may be a function, a module or an ``@accelerate`` object. The
    function really runs (once), so its side effects happen.
    """
    from .accelerate import Accelerated

    target = fn.fn if isinstance(fn, Accelerated) else fn
    name = getattr(target, "__qualname__", None) or type(target).__name__
    out = torch._dynamo.explain(target)(*args, **kwargs)
    breaks = [GraphBreak(_reason(r.reason), [_frame(f) for f in (r.user_stack or [])]) for r in out.break_reasons]
    ops = [[_op_name(op) for op in graph_ops] for graph_ops in out.ops_per_graph]
    return Explanation(name, out.graph_count, out.graph_break_count, breaks, ops)


def _reason(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        return "(no reason given)"
    extra = next((ln for ln in lines[1:] if ln.startswith("Explanation:")), "")
    return lines[0] + (f" ({extra[:200]})" if extra else "")


def _frame(frame) -> str:
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"


def _op_name(op) -> str:
    if isinstance(op, str):
        return op
    name = getattr(op, "__name__", None) or str(op)
    if getattr(torch, name, None) is op:
        return f"torch.{name}"
    if getattr(operator, name, None) is op:
        return f"operator.{name}"
    return str(op) if name is None else name


class Explainer:
    """Collects explanations of ``@accelerate`` calls while ``remotorch explain`` runs a program.

    The first call of each accelerated function is explained (which runs it
    once under dynamo), then run eagerly for its result; later calls run
    eagerly.
    """

    def __init__(self) -> None:
        self.explanations: list[Explanation] = []
        self._seen: set[int] = set()

    def run_call(self, accelerated, args: tuple, kwargs: dict):
        if id(accelerated) not in self._seen:
            self._seen.add(id(accelerated))
            self.explanations.append(explain(accelerated, *args, **kwargs))
        return accelerated.fn(*args, **kwargs)


def run_explained(target: str, argv: list[str] | None = None) -> list[Explanation]:
    """Run a script (``path.py``) or call ``module:function`` and explain its accelerated calls."""
    import importlib
    import runpy
    import sys

    from .context import activate_explainer, deactivate_explainer

    explainer = Explainer()
    token = activate_explainer(explainer)
    try:
        if target.endswith(".py"):
            saved = sys.argv
            sys.argv = [target, *(argv or [])]
            try:
                runpy.run_path(target, run_name="__main__")
            finally:
                sys.argv = saved
        else:
            module_name, _, attr = target.partition(":")
            if not attr:
                raise ValueError(f"explain needs path/to/script.py or package.module:function, got {target!r}")
            fn = importlib.import_module(module_name)
            for part in attr.split("."):
                fn = getattr(fn, part)
            fn()
    finally:
        deactivate_explainer(token)
    return explainer.explanations
