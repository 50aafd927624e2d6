"""What a graph will return, known before it runs: each output's dtype, sizes and strides, or its value.

A run that is sent without waiting for its reply hands Python placeholders
for its outputs at once, so their layouts must be known here. aot_autograd
traced the graph with fake tensors: every output's metadata is in the graph,
as numbers, or, with dynamic shapes, as expressions of the input sizes
(``s0``, ``s0 + 4``, ``64*s1``). :class:`Layouts` binds those symbols from a
call's arguments and evaluates the expressions, with a small evaluator built
once per graph (no code is generated). Where an output's size depends on the
data (an unbacked symbol, ``nonzero``) or an expression is of a kind it does
not know, it answers None and the caller waits for the worker's answer.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce

import torch

Env = dict
Expr = Callable[[Env], int]


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """A tensor output's metadata."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def _const(value):
    return lambda env: value


def _compile(expr) -> Expr | None:
    """``expr`` (an int or a sympy expression over size symbols) as a function of the symbols' values."""
    if isinstance(expr, (int, bool)):
        return _const(int(expr))
    import sympy
    from torch.utils._sympy import functions as F

    if isinstance(expr, sympy.Integer):
        return _const(int(expr))
    if isinstance(expr, sympy.Symbol):
        return lambda env, s=expr: env[s]
    parts = [_compile(a) for a in expr.args]
    if any(p is None for p in parts):
        return None
    if isinstance(expr, sympy.Add):
        return lambda env: sum(p(env) for p in parts)
    if isinstance(expr, sympy.Mul):
        return lambda env: reduce(operator.mul, (p(env) for p in parts), 1)
    binary = {F.FloorDiv: operator.floordiv, F.CleanDiv: operator.floordiv, F.PythonMod: operator.mod,
              F.Mod: operator.mod, sympy.Mod: operator.mod, F.CeilDiv: lambda a, b: -(-a // b)}
    for kind, op in binary.items():
        if isinstance(expr, kind) and len(parts) == 2:
            a, b = parts
            return lambda env: op(a(env), b(env))
    if isinstance(expr, sympy.Pow) and isinstance(expr.args[1], sympy.Integer) and int(expr.args[1]) >= 0:
        base, power = parts[0], int(expr.args[1])
        return lambda env: base(env) ** power
    if isinstance(expr, (sympy.Max, F.Max)):
        return lambda env: max(p(env) for p in parts)
    if isinstance(expr, (sympy.Min, F.Min)):
        return lambda env: min(p(env) for p in parts)
    return None


def _expr(value):
    """The sympy expression (or int) behind a size, stride or SymInt value."""
    node = getattr(value, "node", None)
    return node.expr if node is not None else int(value)


class Layouts:
    """The layouts of one aten graph's outputs, for given arguments (see the module docstring).

    ``truthful(i, name)`` says whether placeholder ``i`` (named ``name``) is
    given with its true local metadata: a backward graph's saved activations
    are not (they stand here as empty placeholders), its tangents and sizes are.
    """

    def __init__(self, gm: torch.fx.GraphModule, truthful: Callable[[int, str], bool] = lambda i, n: True) -> None:
        self._binds: list[tuple[object, int, int]] = []  # (symbol, argument index, dim; -1: the value itself)
        self._outs: list = []  # per output: (dtype, [size fns], [stride fns]), ("v", fn) or ("c", constant)
        self.known = True  # every output's layout can be computed from the arguments
        self._static: list | None = None
        self._init(gm, truthful)

    def _init(self, gm, truthful) -> None:
        import sympy
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        symint_first = sorted(range(len(placeholders)),
                              key=lambda i: not isinstance(placeholders[i].meta.get("val"), torch.SymInt))
        for i in symint_first:
            val = placeholders[i].meta.get("val")
            if isinstance(val, torch.SymInt) and isinstance(_expr(val), sympy.Symbol):
                self._binds.append((_expr(val), i, -1))
            elif isinstance(val, torch.Tensor) and truthful(i, placeholders[i].name):
                for d, size in enumerate(val.shape):
                    if isinstance(size, torch.SymInt) and isinstance(_expr(size), sympy.Symbol):
                        self._binds.append((_expr(size), i, d))
        out = next(n for n in gm.graph.nodes if n.op == "output")
        values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
        symbolic = False
        for v in values:
            val = v.meta.get("val") if isinstance(v, torch.fx.Node) else v
            if isinstance(val, torch.Tensor):
                sizes = [_compile(_expr(s)) for s in val.shape]
                strides = [_compile(_expr(s)) for s in val.stride()]
                self.known &= None not in sizes and None not in strides
                symbolic |= any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
                self._outs.append((val.dtype, sizes, strides))
            elif isinstance(val, torch.SymInt):
                fn = _compile(_expr(val))
                self.known &= fn is not None
                symbolic = True
                self._outs.append(("v", fn))
            elif val is None or isinstance(val, (int, float, bool)):
                self._outs.append(("c", val))
            else:  # SymFloat, SymBool, opaque objects: only the worker knows
                self.known = False
                self._outs.append(("c", None))
        if self.known and not symbolic:
            self._static = self._evaluate({})

    def __call__(self, args: Sequence) -> list | None:
        """Each output's :class:`TensorLayout` or value, for these arguments; None when not computable."""
        if self._static is not None:
            return self._static
        if not self.known:
            return None
        env: Env = {}
        for sym, i, d in self._binds:
            a = args[i]
            try:
                value = int(a) if d < 0 else int(a.shape[d])
            except (TypeError, IndexError, AttributeError):
                return None
            if env.setdefault(sym, value) != value:
                return None  # one symbol, two values: these arguments do not say
        try:
            return self._evaluate(env)
        except (KeyError, ZeroDivisionError):  # a symbol no argument binds
            return None

    def _evaluate(self, env: Env) -> list:
        out = []
        for spec in self._outs:
            if spec[0] == "v":
                out.append(spec[1](env))
            elif spec[0] == "c":
                out.append(spec[1])
            else:
                dtype, sizes, strides = spec
                out.append(TensorLayout(dtype, tuple(f(env) for f in sizes), tuple(f(env) for f in strides)))
        return out
