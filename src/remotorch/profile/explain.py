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

    def render(self) -> str:
        lines = [f"{self.function}: {self.graph_count} graph(s), {self.graph_break_count} graph break(s)"]
        for i, ops in enumerate(self.ops_per_graph, 1):
            lines.append(f"  graph {i}: {len(ops)} op(s): {', '.join(ops[:12])}{' …' if len(ops) > 12 else ''}")
        for i, brk in enumerate(self.breaks, 1):
            lines.append(f"  break {i}: {brk.reason}")
            lines += [f"    {frame}" for frame in brk.user_stack]
        return "\n".join(lines)

    def print(self, file: IO[str] | None = None) -> None:
        print(self.render(), file=file)


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
